//! The CUDA backend, a peer of `duet-cpu`: our CUDA kernels (`kernels/*.cu` at the repository
//! root) compiled by NVRTC ([`kernels`]), the backend over cuBLAS and those kernels
//! ([`backend`]), and the probe that turns missing libraries and devices into clear errors.
//!
//! Everything that touches CUDA sits behind the `cuda` feature and opens the CUDA libraries at run
//! time, so the workspace builds and tests on machines without CUDA; asking for a GPU there gives a
//! clear error naming what is missing.

pub mod error;
pub mod kernels;

#[cfg(feature = "cuda")]
pub mod backend;
#[cfg(feature = "cuda")]
pub mod probe;

pub use error::CudaError;
