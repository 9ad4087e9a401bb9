//! The decode worker's errors, mapped once to gRPC statuses.

use duet_engine::EngineError;

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    DataLoss(String),
    #[error("{0}")]
    ResourceExhausted(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Internal(String),
}

impl From<EngineError> for DecodeError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::InvalidRequest(m) => DecodeError::InvalidArgument(m),
            EngineError::Kv(k) => DecodeError::ResourceExhausted(k.to_string()),
            other => DecodeError::Internal(other.to_string()),
        }
    }
}

impl From<DecodeError> for tonic::Status {
    fn from(e: DecodeError) -> Self {
        use tonic::Status;
        match e {
            DecodeError::InvalidArgument(m) => Status::invalid_argument(m),
            DecodeError::FailedPrecondition(m) => Status::failed_precondition(m),
            DecodeError::NotFound(m) => Status::not_found(m),
            DecodeError::DataLoss(m) => Status::data_loss(m),
            DecodeError::ResourceExhausted(m) => Status::resource_exhausted(m),
            DecodeError::Unavailable(m) => Status::unavailable(m),
            DecodeError::Internal(m) => Status::internal(m),
        }
    }
}
