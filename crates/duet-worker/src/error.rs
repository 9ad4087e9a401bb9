//! The workers' errors, mapped once to gRPC statuses.

use duet_engine::EngineError;
use duet_model::params::PromptError;
use duet_transfer::{ModelMismatch, TransferError};
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A malformed request the caller can fix.
    #[error("{0}")]
    InvalidArgument(String),
    /// The request was made for another model or KV geometry.
    #[error("{0}")]
    FailedPrecondition(String),
    /// The caller may not ask this (a prefill plan naming a worker outside the cluster).
    #[error("{0}")]
    PermissionDenied(String),
    /// A reservation that is gone (cancelled or expired).
    #[error("{0}")]
    NotFound(String),
    /// The queue is full, or the KV cache cannot hold the prompt.
    #[error("{0}")]
    ResourceExhausted(String),
    /// The call's deadline passed.
    #[error("{0}")]
    DeadlineExceeded(String),
    #[error("{0}")]
    Internal(String),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Transfer(#[from] TransferError),
    /// The engine thread is gone (the worker is shutting down, or its model failed to load).
    #[error("the engine thread has stopped")]
    EngineStopped,
}

impl From<ModelMismatch> for WorkerError {
    fn from(e: ModelMismatch) -> Self {
        WorkerError::FailedPrecondition(e.to_string())
    }
}

impl From<PromptError> for WorkerError {
    fn from(e: PromptError) -> Self {
        WorkerError::InvalidArgument(e.to_string())
    }
}

impl From<WorkerError> for Status {
    fn from(e: WorkerError) -> Self {
        let code = match &e {
            WorkerError::InvalidArgument(_) => Code::InvalidArgument,
            WorkerError::FailedPrecondition(_) => Code::FailedPrecondition,
            WorkerError::NotFound(_) => Code::NotFound,
            WorkerError::PermissionDenied(_) => Code::PermissionDenied,
            WorkerError::ResourceExhausted(_) => Code::ResourceExhausted,
            WorkerError::DeadlineExceeded(_) => Code::DeadlineExceeded,
            WorkerError::Internal(_) => Code::Internal,
            WorkerError::Engine(EngineError::InvalidRequest(_) | EngineError::Prompt(_)) => {
                Code::InvalidArgument
            }
            WorkerError::Engine(EngineError::Kv(duet_kv::KvError::Exhausted { .. })) => {
                Code::ResourceExhausted
            }
            WorkerError::Engine(_) => Code::Internal,
            WorkerError::Transfer(t) => t.code(),
            WorkerError::EngineStopped => Code::Unavailable,
        };
        Status::new(code, e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes() {
        let s = Status::from(WorkerError::InvalidArgument("empty".into()));
        assert_eq!((s.code(), s.message()), (Code::InvalidArgument, "empty"));
        let s = Status::from(WorkerError::Engine(EngineError::InvalidRequest(
            "top_p".into(),
        )));
        assert_eq!(s.code(), Code::InvalidArgument);
        let full = duet_kv::KvError::Exhausted {
            requested: 2,
            available: 1,
        };
        let s = Status::from(WorkerError::Engine(full.into()));
        assert_eq!(s.code(), Code::ResourceExhausted);
        let s = Status::from(WorkerError::Transfer(TransferError::Corrupt("xxh3".into())));
        assert_eq!(s.code(), Code::DataLoss);
        assert_eq!(
            Status::from(WorkerError::EngineStopped).code(),
            Code::Unavailable
        );
    }
}
