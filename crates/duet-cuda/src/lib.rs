//! The CUDA backend, a peer of `duet-cpu`: our CUDA kernels (`kernels/*.cu` at the repository
//! root) compiled by NVRTC ([`kernels`]), the backend over cuBLAS and those kernels
//! ([`backend`], written over the [`gpu::Gpu`] trait), a step's shape and inputs as host logic
//! ([`step`]), device sampling's host side ([`sampling`]), the driver under it (`cuda_gpu`), and
//! the probe that turns missing libraries and devices into clear errors.
//!
//! Everything that touches CUDA sits behind the `cuda` feature and opens the CUDA libraries at run
//! time, so the workspace builds and tests on machines without CUDA; asking for a GPU there gives a
//! clear error naming what is missing. The backend's host logic builds and is tested without the
//! feature, over a GPU that records what it is asked.

pub mod backend;
#[cfg(feature = "cuda")]
pub mod cuda_gpu;
pub mod error;
#[cfg(feature = "cuda")]
mod fp8_gemm;
pub mod fp8_weights;
pub mod gpu;
pub mod kernels;
pub mod packed_weights;
#[cfg(feature = "cuda")]
pub mod probe;
#[cfg(test)]
mod recording_gpu;
pub mod sampling;
pub mod step;

pub use error::CudaError;
