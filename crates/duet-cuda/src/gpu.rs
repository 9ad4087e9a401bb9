//! What the backend asks of a GPU, as one trait: memory, copies, kernel launches, the cuBLAS
//! product, synchronization and graph capture on the backend's stream (and copies of KV blocks
//! brought up from a tier below on a load stream beside it). The CUDA driver
//! implements it (`cuda_gpu.rs`); a recording GPU does in the tests, so the backend's host logic
//! (what a step allocates, uploads, launches and waits for) is tested without a GPU.

use std::sync::Arc;

use crate::CudaError;

/// A device address.
pub type DevicePtr = u64;

/// One kernel argument.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    Ptr(DevicePtr),
    I32(i32),
    U32(u32),
    U64(u64),
    F32(f32),
}

/// A kernel launch: `kernel` (its `extern "C"` name) over `grid` blocks of `block` threads, each
/// block with `shared_bytes` of dynamic shared memory.
#[derive(Clone, Copy, Debug)]
pub struct Launch<'a> {
    pub kernel: &'static str,
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub shared_bytes: u32,
    pub args: &'a [Arg],
}

/// `out[rows][n] = x[rows][k] · wᵀ` with `w` `[n][k]` and `x` in bf16 ([`Gpu::gemm`]) or E4M3
/// ([`Gpu::fp8_gemm`], unscaled: `fp8_scale_output` applies the scales), `out` in f32, its rows
/// `ld_out` values apart (`n`, or more when the product fills a band of a wider output's columns).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gemm {
    pub w: DevicePtr,
    pub x: DevicePtr,
    pub out: DevicePtr,
    pub rows: usize,
    pub n: usize,
    pub k: usize,
    pub ld_out: usize,
}

pub trait Gpu: Send + Sync + 'static {
    /// A captured graph, replayed by [`Gpu::replay`].
    type Graph: Send;
    /// Page-locked host memory: copies from it are asynchronous.
    type Pinned: AsRef<[u8]> + AsMut<[u8]> + Send + 'static;

    /// Device memory (a plain allocation: exportable over CUDA IPC).
    fn alloc(&self, bytes: usize) -> Result<DevicePtr, CudaError>;
    fn free(&self, ptr: DevicePtr);
    fn alloc_pinned(&self, bytes: usize) -> Result<Self::Pinned, CudaError>;
    /// Bytes of device memory free.
    fn free_memory(&self) -> Result<usize, CudaError>;
    /// The device's compute capability (major, minor): 9.0 on Hopper.
    fn compute_capability(&self) -> (i32, i32);
    /// Queues `dst[..src.len()] = src` (`src` must stay unchanged until the stream has run it).
    fn upload(&self, dst: DevicePtr, src: &[u8]) -> Result<(), CudaError>;
    /// Queues `dst = src[..dst.len()]`; `dst` holds it once the stream is synchronized.
    fn download(&self, dst: &mut [u8], src: DevicePtr) -> Result<(), CudaError>;
    /// Queues `bytes` zero bytes at `dst`.
    fn zero(&self, dst: DevicePtr, bytes: usize) -> Result<(), CudaError>;
    fn launch(&self, launch: &Launch<'_>) -> Result<(), CudaError>;
    fn gemm(&self, gemm: &Gemm) -> Result<(), CudaError>;
    /// An FP8 product, through cuBLASLt (where [`Gpu::fp8_products`] says yes; `ld_out` is `n`).
    fn fp8_gemm(&self, gemm: &Gemm) -> Result<(), CudaError>;
    /// Whether this GPU runs FP8 products (compute capability 8.9 or later, cuBLASLt present);
    /// the error says why not, naming `what` needs them.
    fn fp8_products(&self, what: &str) -> Result<(), CudaError>;
    /// Copies the chunks `chunks` (indices of `chunk_bytes`-byte pieces from `base`) into `dst`,
    /// in order, through pinned memory in one copy, on a stream of its own once the work queued
    /// so far on the backend's stream is done; waits for that stream only.
    fn gather_download(
        &self,
        base: DevicePtr,
        chunks: &[u32],
        chunk_bytes: usize,
        dst: &mut [u8],
    ) -> Result<(), CudaError>;
    /// Queues `dst[..src.len()] = src` on the load stream, a stream of its own: a block brought
    /// up from a tier below, copied by the copy engine while the backend's stream runs a step.
    /// Pinned `src` must stay unchanged until [`Gpu::loads_done`] says the copy completed or
    /// [`Gpu::synchronize_loads`] returned; pageable `src` is staged by the driver before this
    /// returns.
    fn upload_on_load_stream(&self, dst: DevicePtr, src: &[u8]) -> Result<(), CudaError>;
    /// Whether every copy queued on the load stream has completed, without waiting.
    fn loads_done(&self) -> Result<bool, CudaError>;
    /// Waits for the copies queued on the load stream.
    fn synchronize_loads(&self) -> Result<(), CudaError>;
    /// Waits for everything queued.
    fn synchronize(&self) -> Result<(), CudaError>;
    /// From now on the stream's work is recorded, not run.
    fn begin_capture(&self) -> Result<(), CudaError>;
    fn end_capture(&self) -> Result<Self::Graph, CudaError>;
    /// Queues a captured graph.
    fn replay(&self, graph: &Self::Graph) -> Result<(), CudaError>;
}

/// Frees device memory; what [`DeviceBuffer`] keeps of its GPU.
pub trait Free: Send + Sync {
    fn free(&self, ptr: DevicePtr);
}

impl<G: Gpu> Free for G {
    fn free(&self, ptr: DevicePtr) {
        Gpu::free(self, ptr)
    }
}

/// Device memory freed on drop.
pub struct DeviceBuffer {
    ptr: DevicePtr,
    bytes: usize,
    owner: Arc<dyn Free>,
}

impl DeviceBuffer {
    pub fn new<G: Gpu>(gpu: &Arc<G>, bytes: usize) -> Result<Self, CudaError> {
        // A zero-length allocation is an error in CUDA; keep one word.
        let ptr = gpu.alloc(bytes.max(4))?;
        Ok(Self {
            ptr,
            bytes,
            owner: gpu.clone(),
        })
    }

    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        self.owner.free(self.ptr);
    }
}
