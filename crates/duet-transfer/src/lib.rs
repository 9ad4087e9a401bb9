//! The KV transport seam: how the KV of a prefilled prompt moves from a prefill worker into a
//! decode worker's reservation.
//!
//! [`transport`] is the seam itself: the sending side ([`KvTransport`] opens a push, its
//! [`KvSender`] is fed layer by layer by the prefill worker's engine thread) and the receiving
//! side ([`KvSink`], the decode worker's reservations). [`grpc`] is the gRPC implementation of
//! both sides (header, fingerprint and layout checks, chunking, checksums, acknowledgement);
//! [`choice`] resolves which transport a (prefill, decode) pair uses; the CUDA-IPC and NCCL
//! links sit beside them behind the `cuda` feature.

pub mod choice;
#[cfg(feature = "cuda")]
pub mod cuda_ipc;
mod error;
pub mod grpc;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod transport;

pub use error::TransferError;
pub use transport::{
    KvSender, KvSink, KvTransport, KvWire, LayerSource, ModelMismatch, OpenPush, PushSpec, Pushed,
    ReservationKey,
};
