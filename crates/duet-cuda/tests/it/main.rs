//! duet-cuda's integration tests, one binary: every kernel compiled for the GPUs we target, and
//! the device sampler run in the CPU emulator against the CPU sampler, and the packed-weight
//! kernels there against duet's CPU dequantization. None needs a GPU.

mod emulated;
mod kernels_compile;
mod quant_emulated;
mod sampling_emulated;
