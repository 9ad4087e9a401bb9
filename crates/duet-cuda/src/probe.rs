//! Finding the CUDA libraries and the device before anything calls into them: cudarc opens the
//! libraries on first use and panics when one is missing, so every entry point probes first and
//! turns absence into a [`CudaError`] that says what to install.

use cudarc::driver::CudaContext;

use crate::CudaError;

const NVRTC_HINT: &str = "install the CUDA 13 toolkit, or `pip install nvidia-cuda-nvrtc==13.0.88` \
     and put its nvidia/cu13/lib on LD_LIBRARY_PATH";

pub fn driver_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

pub fn nvrtc_present() -> bool {
    // SAFETY: as above.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

pub fn cublas_present() -> bool {
    // SAFETY: as above.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

pub fn cublaslt_present() -> bool {
    // SAFETY: as above.
    unsafe { cudarc::cublaslt::sys::is_culib_present() }
}

pub fn nccl_present() -> bool {
    // SAFETY: as above.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// NVRTC, which compiles our kernels (needed with or without a GPU to check them).
pub fn require_nvrtc() -> Result<(), CudaError> {
    if nvrtc_present() {
        Ok(())
    } else {
        Err(CudaError::LibraryMissing {
            library: "libnvrtc.so.13 (NVRTC)",
            hint: NVRTC_HINT,
        })
    }
}

pub fn require_nccl() -> Result<(), CudaError> {
    if nccl_present() {
        Ok(())
    } else {
        Err(CudaError::LibraryMissing {
            library: "libnccl.so (NCCL)",
            hint: "install NCCL 2.x for CUDA 13 (e.g. `pip install nvidia-nccl-cu13`) and put it on LD_LIBRARY_PATH, or use --kv-transport grpc|cuda-ipc",
        })
    }
}

/// What the backend learns about its GPU.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_memory: usize,
}

/// Checks the driver, the device, NVRTC and cuBLAS, in that order, and opens the device.
pub fn open_device(ordinal: usize) -> Result<(std::sync::Arc<CudaContext>, DeviceInfo), CudaError> {
    if !driver_present() {
        return Err(CudaError::LibraryMissing {
            library: "libcuda.so (the NVIDIA driver)",
            hint: "this machine has no NVIDIA driver; run with --device cpu",
        });
    }
    let count = CudaContext::device_count()? as usize;
    if ordinal >= count {
        return Err(CudaError::NoDevice { ordinal, count });
    }
    require_nvrtc()?;
    if !cublas_present() {
        return Err(CudaError::LibraryMissing {
            library: "libcublas.so.13 (cuBLAS)",
            hint: "install the CUDA 13 toolkit, or `pip install nvidia-cublas` and put its lib folder on LD_LIBRARY_PATH",
        });
    }
    let ctx = CudaContext::new(ordinal)?;
    let info = DeviceInfo {
        ordinal,
        name: ctx.name()?,
        compute_capability: ctx.compute_capability()?,
        total_memory: ctx.total_mem()?,
    };
    Ok((ctx, info))
}
