//! Errors of the CUDA side, each saying what is missing or what failed and what to do about it.

use duet_engine::EngineError;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error(
        "this build has no CUDA support; rebuild with `cargo build --release --features cuda` to use --device cuda"
    )]
    NotBuilt,
    #[error("the CUDA library {library} was not found ({hint})")]
    LibraryMissing {
        library: &'static str,
        hint: &'static str,
    },
    #[error("no CUDA device {ordinal}: this machine has {count}")]
    NoDevice { ordinal: usize, count: usize },
    #[error("CUDA driver: {0}")]
    Driver(String),
    #[error("compiling kernel file {file} for {arch} with NVRTC failed:\n{log}")]
    Compile {
        file: &'static str,
        arch: String,
        log: String,
    },
    #[error("cuBLAS: {0}")]
    Blas(String),
    #[error("NCCL: {0}")]
    Nccl(String),
    #[error("{0}")]
    Unsupported(String),
}

impl From<CudaError> for EngineError {
    fn from(e: CudaError) -> Self {
        EngineError::Device(e.to_string())
    }
}

#[cfg(feature = "cuda")]
impl From<cudarc::driver::DriverError> for CudaError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        CudaError::Driver(e.to_string())
    }
}

#[cfg(feature = "cuda")]
impl From<cudarc::cublas::result::CublasError> for CudaError {
    fn from(e: cudarc::cublas::result::CublasError) -> Self {
        CudaError::Blas(format!("{e:?}"))
    }
}
