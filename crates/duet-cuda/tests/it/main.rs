//! duet-cuda's integration tests, one binary: every kernel compiled for the GPUs we target, and
//! the device sampler run in the CPU emulator against the CPU sampler. Neither needs a GPU.

mod kernels_compile;
mod sampling_emulated;
