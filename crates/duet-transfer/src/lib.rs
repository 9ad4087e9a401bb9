//! The KV transport seam: how the KV of a prefilled prompt moves from a prefill worker into a
//! decode worker's reservation. [`choice`] resolves which transport a (prefill, decode) pair
//! uses; the CUDA-IPC and NCCL links sit behind the `cuda` feature.

pub mod choice;
#[cfg(feature = "cuda")]
pub mod cuda_ipc;
#[cfg(feature = "cuda")]
pub mod nccl;
