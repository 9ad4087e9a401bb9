//! duet's GPU side: loading an engine on the device the options name ([`device`]), our CUDA
//! kernels compiled by NVRTC ([`kernels`]), the CUDA backend over cuBLAS and those kernels, and the
//! KV transports between GPU workers ([`transport`]).
//!
//! Everything that touches CUDA sits behind the `cuda` feature and opens the CUDA libraries at run
//! time, so the workspace builds and tests on machines without CUDA; asking for a GPU there gives a
//! clear error naming what is missing.

pub mod device;
pub mod error;
pub mod kernels;
pub mod transport;

#[cfg(feature = "cuda")]
pub mod backend;
#[cfg(feature = "cuda")]
pub mod bench;
#[cfg(feature = "cuda")]
pub mod ipc;
#[cfg(feature = "cuda")]
pub mod nccl;
#[cfg(feature = "cuda")]
pub mod probe;

pub use device::{LoadedEngine, WithEngine};
pub use error::CudaError;
