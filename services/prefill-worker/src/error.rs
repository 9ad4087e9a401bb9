//! The prefill worker's error type, one variant per kind of failure, mapped once to a gRPC
//! status (see `proto/duet/v1/worker.proto` for the codes the decode worker acts on).

use duet_engine::EngineError;
use tonic::{Code, Status};

/// Why a `Prefill` call failed.
#[derive(Debug, thiserror::Error)]
pub enum PrefillError {
    /// A malformed request (empty prompt, token outside the vocabulary, wrong block count, ...).
    #[error("{0}")]
    InvalidArgument(String),
    /// The request was made for another model or KV geometry.
    #[error("{0}")]
    FailedPrecondition(String),
    /// The queue is full, or the KV cache cannot hold the prompt.
    #[error("{0}")]
    ResourceExhausted(String),
    /// The call's deadline passed.
    #[error("{0}")]
    DeadlineExceeded(String),
    /// The decode worker did not accept the KV (its reservation was released meanwhile).
    #[error("the decode worker at {address} did not accept the KV: {message}")]
    NotAccepted { address: String, message: String },
    /// The `KvTransfer/Push` call failed; its status code is passed on.
    #[error("KV push to {address} failed: {}", .status.message())]
    Push { address: String, status: Status },
    /// The engine failed on this request.
    #[error("prefill engine: {0}")]
    Engine(#[from] EngineError),
    /// The engine thread is gone (the worker is shutting down or crashed).
    #[error("the prefill engine is not running")]
    EngineGone,
}

impl From<PrefillError> for Status {
    fn from(e: PrefillError) -> Self {
        let code = match &e {
            PrefillError::InvalidArgument(_) => Code::InvalidArgument,
            PrefillError::FailedPrecondition(_) => Code::FailedPrecondition,
            PrefillError::ResourceExhausted(_) => Code::ResourceExhausted,
            PrefillError::DeadlineExceeded(_) => Code::DeadlineExceeded,
            PrefillError::NotAccepted { .. } => Code::Unavailable,
            PrefillError::Push { status, .. } => match status.code() {
                // A local failure of the call itself (connection refused, reset): the peer is
                // unreachable, the decode worker may retry elsewhere.
                Code::Unknown | Code::Internal | Code::Ok => Code::Unavailable,
                code => code,
            },
            PrefillError::Engine(EngineError::InvalidRequest(_)) => Code::InvalidArgument,
            PrefillError::Engine(EngineError::Kv(duet_kv::KvError::Exhausted { .. })) => {
                Code::ResourceExhausted
            }
            PrefillError::Engine(_) => Code::Internal,
            PrefillError::EngineGone => Code::Unavailable,
        };
        Status::new(code, e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes() {
        let s: Status = PrefillError::InvalidArgument("empty".into()).into();
        assert_eq!(s.code(), Code::InvalidArgument);
        assert_eq!(s.message(), "empty");
        let s: Status = PrefillError::Push {
            address: "a:1".into(),
            status: Status::data_loss("bad checksum"),
        }
        .into();
        assert_eq!(s.code(), Code::DataLoss);
        assert!(s.message().contains("bad checksum"), "{}", s.message());
        let s: Status = PrefillError::Push {
            address: "a:1".into(),
            status: Status::unknown("connection reset"),
        }
        .into();
        assert_eq!(s.code(), Code::Unavailable);
        let s: Status = PrefillError::NotAccepted {
            address: "a:1".into(),
            message: "lease expired".into(),
        }
        .into();
        assert_eq!(s.code(), Code::Unavailable);
        let s: Status = PrefillError::Engine(EngineError::InvalidRequest("top_p".into())).into();
        assert_eq!(s.code(), Code::InvalidArgument);
    }
}
