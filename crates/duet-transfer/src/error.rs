//! Why a KV push failed, on either side; mapped once to a gRPC status.

use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The two sides run different models or KV geometries.
    #[error("{0}")]
    Mismatch(String),
    /// A push that breaks the protocol (no header, chunk out of range, block sent twice, ...).
    #[error("{0}")]
    Malformed(String),
    /// Bytes lost or damaged on the way (checksum mismatch, missing blocks).
    #[error("{0}")]
    Corrupt(String),
    /// A push the reservation does not allow: from another prefill worker than the one it was
    /// handed to, or into its cached blocks.
    #[error("{0}")]
    Forbidden(String),
    /// The reservation being filled was released (cancelled or expired).
    #[error("{0}")]
    ReservationGone(String),
    /// The receiver answered the push with `accepted = false`.
    #[error("the decode worker at {address} did not accept the KV: {message}")]
    Rejected { address: String, message: String },
    /// The push call itself failed; its status code is passed on.
    #[error("KV push to {address} failed: {}", .status.message())]
    Call { address: String, status: Status },
    /// The push's own stream failed on the receiving side (the sender went away, reset).
    #[error("the KV push stream failed: {}", .0.message())]
    Stream(Status),
    /// The KV could not be read from or written to the local cache.
    #[error("{0}")]
    Cache(String),
    /// The local engine has stopped.
    #[error("{0}")]
    Unavailable(String),
}

impl TransferError {
    /// What went wrong, in one word (the `reason` label of failed transfers).
    pub fn reason(&self) -> &'static str {
        match self {
            TransferError::Mismatch(_) => "mismatch",
            TransferError::Malformed(_) => "malformed",
            TransferError::Corrupt(_) => "corrupt",
            TransferError::Forbidden(_) => "forbidden",
            TransferError::ReservationGone(_) => "reservation_gone",
            TransferError::Rejected { .. } => "rejected",
            TransferError::Call { .. } => "call_failed",
            TransferError::Stream(_) => "stream_failed",
            TransferError::Cache(_) => "cache",
            TransferError::Unavailable(_) => "unavailable",
        }
    }

    /// The gRPC status code this failure is reported with.
    pub fn code(&self) -> Code {
        match self {
            TransferError::Mismatch(_) => Code::FailedPrecondition,
            TransferError::Malformed(_) => Code::InvalidArgument,
            TransferError::Corrupt(_) => Code::DataLoss,
            TransferError::Forbidden(_) => Code::PermissionDenied,
            TransferError::ReservationGone(_) => Code::NotFound,
            TransferError::Rejected { .. } | TransferError::Unavailable(_) => Code::Unavailable,
            TransferError::Call { status, .. } => match status.code() {
                // A local failure of the call itself (connection refused, reset): the peer is
                // unreachable, and the caller may try elsewhere.
                Code::Unknown | Code::Internal | Code::Ok => Code::Unavailable,
                code => code,
            },
            TransferError::Stream(status) => status.code(),
            TransferError::Cache(_) => Code::Internal,
        }
    }
}

impl From<TransferError> for Status {
    fn from(e: TransferError) -> Self {
        Status::new(e.code(), e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes() {
        let call = |status| TransferError::Call {
            address: "a:1".into(),
            status,
        };
        let s = Status::from(call(Status::data_loss("bad checksum")));
        assert_eq!(s.code(), Code::DataLoss);
        assert!(s.message().contains("bad checksum"), "{}", s.message());
        assert_eq!(
            Status::from(call(Status::unknown("connection reset"))).code(),
            Code::Unavailable
        );
        let rejected = TransferError::Rejected {
            address: "a:1".into(),
            message: "lease expired".into(),
        };
        assert_eq!(Status::from(rejected).code(), Code::Unavailable);
        assert_eq!(
            Status::from(TransferError::Mismatch("fp".into())).code(),
            Code::FailedPrecondition
        );
    }
}
