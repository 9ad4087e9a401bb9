//! The router's errors and their gRPC status codes (the one place that maps them; the HTTP
//! front maps these codes once more, to HTTP statuses, in `openai/server.rs`).

use std::time::Duration;

use tonic::{Code, Status};

use crate::validate::ValidationError;

#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    /// Bad input: INVALID_ARGUMENT.
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    /// No decode worker is healthy (or all were tried): UNAVAILABLE.
    #[error("no healthy decode worker{}", detail(.0))]
    NoDecodeWorker(Option<String>),
    /// Every decode worker tried failed: UNAVAILABLE (or RESOURCE_EXHAUSTED when the last one
    /// said it was full).
    #[error("all {attempts} decode worker(s) tried failed; last error: {last}")]
    AllDecodeWorkersFailed {
        attempts: usize,
        last: String,
        last_code: Code,
    },
    /// The estimated time to first token passes the request's deadline: RESOURCE_EXHAUSTED at
    /// once, rather than queueing work that cannot finish in time.
    #[error(
        "the estimated time to first token ({:.1} s) exceeds what is left of the deadline ({:.1} s)",
        estimated.as_secs_f64(),
        left.as_secs_f64()
    )]
    TtftPastDeadline { estimated: Duration, left: Duration },
    /// What is left of the deadline is shorter than the prompt's own prefill on an idle worker:
    /// DEADLINE_EXCEEDED at once (no cluster could answer in time).
    #[error(
        "what is left of the deadline ({:.3} s) is shorter than this prompt's prefill alone (an estimated {:.3} s)",
        left.as_secs_f64(),
        alone.as_secs_f64()
    )]
    DeadlineTooShort { alone: Duration, left: Duration },
    /// The router already has its limit of requests in flight: RESOURCE_EXHAUSTED.
    #[error(transparent)]
    Overloaded(#[from] duet_proto::Overloaded),
    /// The request's deadline passed: DEADLINE_EXCEEDED.
    #[error("deadline exceeded after {0:?}")]
    DeadlineExceeded(Duration),
    /// A decode worker's error that is not retried (passed on as is).
    #[error("decode worker {worker}: {}", .status.message())]
    Worker { worker: String, status: Status },
    /// A public call without a valid API key: UNAUTHENTICATED.
    #[error(transparent)]
    Unauthenticated(#[from] Unauthenticated),
    /// A bug or an impossible state: INTERNAL.
    #[error("internal error: {0}")]
    Internal(String),
}

/// A public call without a valid API key (see [`crate::api_keys`]).
#[derive(Debug, thiserror::Error)]
#[error("missing or invalid API key: send `Authorization: Bearer <key>`")]
pub struct Unauthenticated;

fn detail(d: &Option<String>) -> String {
    d.as_ref().map(|d| format!(" ({d})")).unwrap_or_default()
}

impl RouterError {
    pub fn code(&self) -> Code {
        match self {
            RouterError::Invalid(_) => Code::InvalidArgument,
            RouterError::NoDecodeWorker(_) => Code::Unavailable,
            RouterError::Overloaded(_) | RouterError::TtftPastDeadline { .. } => {
                Code::ResourceExhausted
            }
            RouterError::AllDecodeWorkersFailed { last_code, .. } => match last_code {
                Code::ResourceExhausted => Code::ResourceExhausted,
                _ => Code::Unavailable,
            },
            RouterError::DeadlineExceeded(_) | RouterError::DeadlineTooShort { .. } => {
                Code::DeadlineExceeded
            }
            RouterError::Worker { status, .. } => status.code(),
            RouterError::Unauthenticated(_) => Code::Unauthenticated,
            RouterError::Internal(_) => Code::Internal,
        }
    }
}

impl From<RouterError> for Status {
    fn from(e: RouterError) -> Self {
        let code = e.code();
        let message = match &e {
            // The client should see exactly what was wrong with its input.
            RouterError::Invalid(v) => v.to_string(),
            other => other.to_string(),
        };
        Status::new(code, message)
    }
}

/// Whether a decode call that failed this way should be tried on another decode worker: the
/// worker (or the way to it) failed, not the request.
pub fn is_retryable(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable
            | Code::Unknown
            | Code::Internal
            | Code::Aborted
            | Code::Cancelled
            | Code::DataLoss
            | Code::ResourceExhausted
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes() {
        let s: Status = RouterError::Invalid(ValidationError::EmptyPrompt).into();
        assert_eq!(s.code(), Code::InvalidArgument);
        assert!(s.message().starts_with("empty prompt"), "{}", s.message());
        let s: Status = RouterError::NoDecodeWorker(None).into();
        assert_eq!(
            (s.code(), s.message()),
            (Code::Unavailable, "no healthy decode worker")
        );
        let e = RouterError::AllDecodeWorkersFailed {
            attempts: 2,
            last: "full".into(),
            last_code: Code::ResourceExhausted,
        };
        assert_eq!(Status::from(e).code(), Code::ResourceExhausted);
        let e = RouterError::Worker {
            worker: "d1".into(),
            status: Status::failed_precondition("fingerprint"),
        };
        let s = Status::from(e);
        assert_eq!(s.code(), Code::FailedPrecondition);
        assert!(s.message().contains("d1") && s.message().contains("fingerprint"));
        let e = RouterError::TtftPastDeadline {
            estimated: Duration::from_secs(12),
            left: Duration::from_secs(2),
        };
        let s = Status::from(e);
        assert_eq!(s.code(), Code::ResourceExhausted);
        assert!(s.message().contains("12.0 s"), "{}", s.message());
        assert!(is_retryable(&Status::unavailable("x")));
        assert!(!is_retryable(&Status::invalid_argument("x")));
        assert!(!is_retryable(&Status::deadline_exceeded("x")));
    }
}
