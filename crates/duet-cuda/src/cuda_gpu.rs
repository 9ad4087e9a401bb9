//! [`Gpu`] over the CUDA driver (cudarc): a stream of the backend's own (never the legacy NULL
//! stream, where capture is illegal), our kernels compiled by NVRTC for the device, cuBLAS on
//! that stream with a workspace of its own (so its products can be captured), pinned host
//! memory, a second stream for reading KV off the engine's stream, and a third for copying in
//! blocks brought up from a tier below.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};

use duet_engine::backend::PrefillAttention;

use crate::CudaError;
use crate::backend::{CudaKvStore, GpuBackend, GpuOptions};
use crate::fp8_gemm::Fp8Blas;
use crate::fp8_weights;
use crate::gpu::{Arg, DevicePtr, Gemm, Gpu, Launch};
use crate::kernels;
use crate::probe::{self, DeviceInfo};

/// The backend on a CUDA GPU.
pub type CudaBackend = GpuBackend<CudaGpu>;

/// cuBLAS's workspace: what a captured product may use (its own allocations are not capturable).
const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

pub struct CudaGpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Where reads of the KV cache for transfers run, off the engine's stream.
    copy_stream: Arc<CudaStream>,
    /// Where blocks brought up from a tier below are copied in, beside the engine's stream.
    load_stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// cuBLASLt for FP8 products, made when the first FP8 matrix loads (a model without one
    /// never opens the library), or why it could not be (declared before the workspace it shares
    /// with cuBLAS, so dropped first).
    fp8_blas: OnceLock<Result<Fp8Blas, String>>,
    blas_workspace: CudaSlice<u8>,
    functions: HashMap<&'static str, CudaFunction>,
    /// Kernels whose dynamic shared memory this GPU cannot raise to what they launch with, and
    /// why (the FlashAttention-tiled prefill kernels take ~100 KiB a block).
    shared_refused: HashMap<&'static str, String>,
    info: DeviceInfo,
    gather: Mutex<GatherStaging>,
}

/// The buffers of [`Gpu::gather_download`], grown to the largest layer read.
#[derive(Default)]
struct GatherStaging {
    ids: Option<PinnedBytes>,
    ids_device: Option<CudaSlice<u8>>,
    packed: Option<CudaSlice<u8>>,
    host: Option<PinnedBytes>,
}

/// Page-locked host memory.
pub struct PinnedBytes {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: plain host memory, owned; the context handle is Send + Sync.
unsafe impl Send for PinnedBytes {}

impl AsRef<[u8]> for PinnedBytes {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `len` bytes allocated by cuMemHostAlloc, owned by this value.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl AsMut<[u8]> for PinnedBytes {
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, borrowed mutably once.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBytes {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by cuMemHostAlloc, freed once.
        unsafe {
            let _ = cudarc::driver::result::free_host(self.ptr.cast());
        }
    }
}

/// A captured graph (cudarc's is not `Send`; it is used from the engine's thread only, one at a
/// time, under the backend's lock).
pub struct Graph(CudaGraph);

// SAFETY: see above: never used from two threads at once.
unsafe impl Send for Graph {}

impl CudaGpu {
    /// Opens GPU `ordinal`, compiles our kernels for it, and makes the streams and cuBLAS.
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        let (ctx, info) = probe::open_device(ordinal)?;
        // Our streams are used in order and synchronized explicitly.
        // SAFETY: every buffer's users are ordered on the backend's stream, or joined to it.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let copy_stream = ctx.new_stream()?;
        let load_stream = ctx.new_stream()?;
        let blas = CudaBlas::new(stream.clone())?;
        let workspace = stream.alloc_zeros::<u8>(BLAS_WORKSPACE_BYTES)?;
        {
            use cudarc::driver::DevicePtr;
            let (ptr, _) = workspace.device_ptr(&stream);
            // SAFETY: the workspace outlives the handle (both owned here; dropped together).
            unsafe {
                cudarc::cublas::sys::cublasSetWorkspace_v2(
                    *blas.handle(),
                    ptr as *mut _,
                    BLAS_WORKSPACE_BYTES,
                )
            }
            .result()?;
        }
        let (major, minor) = info.compute_capability;
        let mut functions = HashMap::new();
        for compiled in compiled_kernels(&format!("sm_{major}{minor}"))?.iter() {
            let module = ctx.load_module(compiled.ptx.clone())?;
            for &name in compiled.file.kernels {
                functions.insert(name, module.load_function(name)?);
            }
        }
        let shared_refused = raise_shared_limits(&functions);
        Ok(Self {
            ctx,
            stream,
            copy_stream,
            load_stream,
            blas,
            fp8_blas: OnceLock::new(),
            blas_workspace: workspace,
            functions,
            shared_refused,
            info,
            gather: Mutex::new(GatherStaging::default()),
        })
    }

    pub fn device_info(&self) -> &DeviceInfo {
        &self.info
    }

    /// cuBLASLt for FP8 products, opened on first use; an error naming `what` needs it when
    /// the GPU has no FP8 or the library is missing.
    fn fp8_blas(&self, what: &str) -> Result<&Fp8Blas, CudaError> {
        fp8_weights::require_fp8(self.info.compute_capability, what)?;
        let opened = self.fp8_blas.get_or_init(|| {
            if !probe::cublaslt_present() {
                return Err(
                    "libcublasLt.so.13 (cuBLASLt) was not found: install the CUDA 13 \
                     toolkit, or `pip install nvidia-cublas` and put its lib folder on \
                     LD_LIBRARY_PATH"
                        .into(),
                );
            }
            use cudarc::driver::DevicePtr;
            let (ptr, _) = self.blas_workspace.device_ptr(&self.stream);
            Fp8Blas::new(ptr, BLAS_WORKSPACE_BYTES).map_err(|e| e.to_string())
        });
        opened
            .as_ref()
            .map_err(|why| CudaError::Unsupported(format!("FP8 products ({what}): {why}")))
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Whether every kernel of `--prefill-attention fa` can launch here (an error naming the flag
    /// where the GPU cannot give one its shared memory).
    pub fn check_fa_prefill(&self) -> Result<(), CudaError> {
        match kernels::FA_ENTRIES
            .iter()
            .find_map(|e| self.shared_refused.get(e.kernel))
        {
            Some(why) => Err(CudaError::Unsupported(format!(
                "--prefill-attention fa: {why}; use --prefill-attention legacy on GPU {}",
                self.info.ordinal
            ))),
            None => Ok(()),
        }
    }

    fn function(&self, name: &str) -> Result<&CudaFunction, CudaError> {
        self.functions
            .get(name)
            .ok_or_else(|| CudaError::Unsupported(format!("no kernel named {name}")))
    }

    fn pinned(&self, bytes: usize) -> Result<PinnedBytes, CudaError> {
        self.ctx.bind_to_thread()?;
        // SAFETY: a fresh allocation of `bytes`, freed on drop.
        let ptr = unsafe { cudarc::driver::result::malloc_host(bytes, 0) }?;
        Ok(PinnedBytes {
            ptr: ptr.cast(),
            len: bytes,
            ctx: self.ctx.clone(),
        })
    }
}

/// Raises the dynamic shared memory limit of the kernels that launch with more than the default
/// 48 KiB a block to what they use; returns those the GPU refuses, each with the reason.
fn raise_shared_limits(
    functions: &HashMap<&'static str, CudaFunction>,
) -> HashMap<&'static str, String> {
    use cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
    let mut refused = HashMap::new();
    for e in &kernels::FA_ENTRIES {
        for kernel in [e.kernel, e.kernel_fp8] {
            let Some(f) = functions.get(kernel) else {
                continue;
            };
            if let Err(err) = f.set_attribute(
                CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                e.smem_bytes as i32,
            ) {
                refused.insert(
                    kernel,
                    format!(
                        "{kernel} needs {} KiB of shared memory a block, which this GPU does not \
                         give ({err})",
                        e.smem_bytes / 1024
                    ),
                );
            }
        }
    }
    refused
}

/// Our kernels compiled for `arch`, once per process: a process opening several backends (the
/// checks of `duet bench gpu`) compiles them once.
fn compiled_kernels(arch: &str) -> Result<Arc<Vec<kernels::CompiledFile>>, CudaError> {
    static COMPILED: Mutex<Vec<(String, Arc<Vec<kernels::CompiledFile>>)>> = Mutex::new(Vec::new());
    let mut compiled = COMPILED.lock().expect("compiled kernels lock");
    if let Some((_, files)) = compiled.iter().find(|(a, _)| a == arch) {
        return Ok(files.clone());
    }
    let files = Arc::new(kernels::compile_all(arch)?);
    compiled.push((arch.to_string(), files.clone()));
    Ok(files)
}

impl Gpu for CudaGpu {
    type Graph = Graph;
    type Pinned = PinnedBytes;

    fn alloc(&self, bytes: usize) -> Result<DevicePtr, CudaError> {
        self.ctx.bind_to_thread()?;
        // SAFETY: a fresh plain allocation (cuMemAlloc: exportable over CUDA IPC).
        Ok(unsafe { cudarc::driver::result::malloc_sync(bytes) }?)
    }

    fn free(&self, ptr: DevicePtr) {
        // Work still queued may use it: wait first (frees happen between steps, at most).
        let _ = self.stream.synchronize();
        let _ = self.ctx.bind_to_thread();
        // SAFETY: from `alloc`, freed once (DeviceBuffer's drop).
        unsafe {
            let _ = cudarc::driver::result::free_sync(ptr);
        }
    }

    fn alloc_pinned(&self, bytes: usize) -> Result<PinnedBytes, CudaError> {
        self.pinned(bytes)
    }

    fn free_memory(&self) -> Result<usize, CudaError> {
        Ok(self.ctx.mem_get_info()?.0)
    }

    fn compute_capability(&self) -> (i32, i32) {
        self.info.compute_capability
    }

    fn upload(&self, dst: DevicePtr, src: &[u8]) -> Result<(), CudaError> {
        self.ctx.bind_to_thread()?;
        // SAFETY: `dst` covers `src.len()` bytes (the backend sizes its buffers); `src` stays
        // unchanged until the stream has run the copy (pinned staging is rewritten only after a
        // synchronization; pageable memory is copied before this returns).
        Ok(
            unsafe {
                cudarc::driver::result::memcpy_htod_async(dst, src, self.stream.cu_stream())
            }?,
        )
    }

    fn download(&self, dst: &mut [u8], src: DevicePtr) -> Result<(), CudaError> {
        self.ctx.bind_to_thread()?;
        // SAFETY: `src` covers `dst.len()` bytes; the caller synchronizes before reading `dst`.
        Ok(
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(dst, src, self.stream.cu_stream())
            }?,
        )
    }

    fn zero(&self, dst: DevicePtr, bytes: usize) -> Result<(), CudaError> {
        self.ctx.bind_to_thread()?;
        // SAFETY: `dst` covers `bytes`.
        Ok(unsafe {
            cudarc::driver::result::memset_d8_async(dst, 0, bytes, self.stream.cu_stream())
        }?)
    }

    fn launch(&self, launch: &Launch<'_>) -> Result<(), CudaError> {
        if let Some(why) = self.shared_refused.get(launch.kernel) {
            return Err(CudaError::Unsupported(why.clone()));
        }
        let f = self.function(launch.kernel)?;
        let mut builder = self.stream.launch_builder(f);
        for a in launch.args {
            match a {
                Arg::Ptr(p) => builder.arg(p),
                Arg::I32(v) => builder.arg(v),
                Arg::U32(v) => builder.arg(v),
                Arg::U64(v) => builder.arg(v),
                Arg::F32(v) => builder.arg(v),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: launch.grid,
            block_dim: (launch.block, 1, 1),
            shared_mem_bytes: launch.shared_bytes,
        };
        // SAFETY: the argument lists match the kernels' signatures in kernels/*.cu (the backend
        // builds each from the kernel file's comment), and every grid guards its indices.
        unsafe { builder.launch(cfg) }?;
        Ok(())
    }

    fn gemm(&self, g: &Gemm) -> Result<(), CudaError> {
        let (alpha, beta) = (1f32, 0f32);
        // Row-major out[rows][n] is column-major n × rows: C = op(W)·X with W read transposed.
        // SAFETY: the pointers cover n×k, rows×k and rows×n elements of the stated types.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                g.n as i32,
                g.rows as i32,
                g.k as i32,
                (&alpha as *const f32).cast(),
                g.w as *const _,
                cudaDataType::CUDA_R_16BF,
                g.k as i32,
                g.x as *const _,
                cudaDataType::CUDA_R_16BF,
                g.k as i32,
                (&beta as *const f32).cast(),
                g.out as *mut _,
                cudaDataType::CUDA_R_32F,
                g.ld_out as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        Ok(())
    }

    fn fp8_gemm(&self, g: &Gemm) -> Result<(), CudaError> {
        self.fp8_blas("an FP8 product")?
            .gemm(g, self.stream.cu_stream() as _)
    }

    fn fp8_products(&self, what: &str) -> Result<(), CudaError> {
        self.fp8_blas(what).map(|_| ())
    }

    fn gather_download(
        &self,
        base: DevicePtr,
        chunks: &[u32],
        chunk_bytes: usize,
        dst: &mut [u8],
    ) -> Result<(), CudaError> {
        use cudarc::driver::{DevicePtr as _, DevicePtrMut as _};
        let bytes = chunks.len() * chunk_bytes;
        assert_eq!(dst.len(), bytes, "gather_download: wrong length");
        if chunks.is_empty() {
            return Ok(());
        }
        let mut staging = self.gather.lock().expect("gather staging lock");
        let GatherStaging {
            ids,
            ids_device,
            packed,
            host,
        } = &mut *staging;
        let too_small = |b: &Option<PinnedBytes>, n: usize| b.as_ref().is_none_or(|b| b.len < n);
        if too_small(ids, chunks.len() * 4) {
            *ids = Some(self.pinned(chunks.len() * 4)?);
        }
        if too_small(host, bytes) {
            *host = Some(self.pinned(bytes)?);
        }
        if ids_device
            .as_ref()
            .is_none_or(|b| b.len() < chunks.len() * 4)
        {
            *ids_device = Some(self.copy_stream.alloc_zeros::<u8>(chunks.len() * 4)?);
        }
        if packed.as_ref().is_none_or(|b| b.len() < bytes) {
            *packed = Some(self.copy_stream.alloc_zeros::<u8>(bytes)?);
        }
        let (ids, ids_device, packed, host) = (
            ids.as_mut().expect("grown"),
            ids_device.as_mut().expect("grown"),
            packed.as_mut().expect("grown"),
            host.as_mut().expect("grown"),
        );
        for (w, c) in ids.as_mut().chunks_exact_mut(4).zip(chunks) {
            w.copy_from_slice(&c.to_le_bytes());
        }
        // The layer's KV is queued on the engine's stream: the copies wait for it there.
        self.copy_stream.join(&self.stream)?;
        let (ids_ptr, _) = ids_device.device_ptr_mut(&self.copy_stream);
        let (packed_ptr, _) = packed.device_ptr(&self.copy_stream);
        // SAFETY: pinned source and destination of the stated sizes, synchronized below before
        // either is touched again; the pack kernel's arguments follow kv_cache.cu.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                ids_ptr,
                &ids.as_ref()[..chunks.len() * 4],
                self.copy_stream.cu_stream(),
            )?;
            let elems = (chunk_bytes / 2) as u64;
            let f = self.function("pack_kv_chunks")?;
            let mut builder = self.copy_stream.launch_builder(f);
            builder
                .arg(&base)
                .arg(&ids_ptr)
                .arg(&elems)
                .arg(&packed_ptr);
            builder.launch(LaunchConfig {
                grid_dim: (
                    (elems / 8).div_ceil(256).clamp(1, 1024) as u32,
                    chunks.len() as u32,
                    1,
                ),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })?;
            cudarc::driver::result::memcpy_dtoh_async(
                &mut host.as_mut()[..bytes],
                packed_ptr,
                self.copy_stream.cu_stream(),
            )?;
        }
        self.copy_stream.synchronize()?;
        dst.copy_from_slice(&host.as_ref()[..bytes]);
        Ok(())
    }

    fn upload_on_load_stream(&self, dst: DevicePtr, src: &[u8]) -> Result<(), CudaError> {
        self.ctx.bind_to_thread()?;
        // SAFETY: `dst` is a block of the KV store, `src.len()` bytes long; `src` is pinned and
        // stays unchanged until the load stream has run the copy (the backend keeps it until
        // `loads_done` or `synchronize_loads`).
        Ok(unsafe {
            cudarc::driver::result::memcpy_htod_async(dst, src, self.load_stream.cu_stream())
        }?)
    }

    fn loads_done(&self) -> Result<bool, CudaError> {
        Ok(self.load_stream.record_event(None)?.try_is_complete()?)
    }

    fn synchronize_loads(&self) -> Result<(), CudaError> {
        Ok(self.load_stream.synchronize()?)
    }

    fn synchronize(&self) -> Result<(), CudaError> {
        Ok(self.stream.synchronize()?)
    }

    fn begin_capture(&self) -> Result<(), CudaError> {
        Ok(self
            .stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?)
    }

    fn end_capture(&self) -> Result<Graph, CudaError> {
        let graph = self.stream.end_capture(CUgraphInstantiate_flags(0))?;
        graph
            .map(Graph)
            .ok_or_else(|| CudaError::Driver("the CUDA graph capture recorded nothing".into()))
    }

    fn replay(&self, graph: &Graph) -> Result<(), CudaError> {
        Ok(graph.0.launch()?)
    }
}

impl GpuBackend<CudaGpu> {
    /// Opens GPU `ordinal` and compiles our kernels for it. `memory_fraction` of the memory left
    /// after the weights goes to the KV cache.
    pub fn new(
        ordinal: usize,
        memory_fraction: f64,
        options: GpuOptions,
    ) -> Result<Self, CudaError> {
        let gpu = CudaGpu::open(ordinal)?;
        if options.prefill_attention == PrefillAttention::Fa {
            gpu.check_fa_prefill()?;
        }
        Ok(Self::with_gpu(Arc::new(gpu), options, memory_fraction))
    }

    pub fn device_info(&self) -> &DeviceInfo {
        self.gpu().device_info()
    }

    /// The backend's stream (transports order their copies after it).
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.gpu().stream()
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        self.gpu().context()
    }

    /// Packs chunks (indices [`CudaKvStore::chunk_index`]) into one buffer of the store's bytes,
    /// in order: what the NCCL transport sends.
    pub fn pack_chunks(
        &self,
        store: &CudaKvStore,
        chunks: &[u32],
    ) -> Result<CudaSlice<u8>, CudaError> {
        let packed = self
            .stream()
            .alloc_zeros::<u8>(chunks.len() * store.chunk_bytes())?;
        self.move_chunks("pack_kv_chunks", store, chunks, &packed)?;
        Ok(packed)
    }

    /// The inverse of [`CudaBackend::pack_chunks`].
    pub fn unpack_chunks(
        &self,
        store: &mut CudaKvStore,
        chunks: &[u32],
        packed: &CudaSlice<u8>,
    ) -> Result<(), CudaError> {
        self.move_chunks("unpack_kv_chunks", store, chunks, packed)
    }

    /// `kernel` (pack or unpack) over the chunks, between the store and `packed`; waits for it.
    fn move_chunks(
        &self,
        kernel: &str,
        store: &CudaKvStore,
        chunks: &[u32],
        packed: &CudaSlice<u8>,
    ) -> Result<(), CudaError> {
        use cudarc::driver::DevicePtr as _;
        let stream = self.stream();
        // The kernels move bf16 elements; an FP8 chunk's bytes are half as many of them.
        let elems = (store.chunk_bytes() / 2) as u64;
        let ids = stream.clone_htod(chunks)?;
        let (packed_ptr, _) = packed.device_ptr(stream);
        let base = store.base_ptr();
        let f = self.gpu().function(kernel)?;
        let mut builder = stream.launch_builder(f);
        builder.arg(&base).arg(&ids).arg(&elems).arg(&packed_ptr);
        // SAFETY: pack/unpack_kv_chunks(store, chunks, chunk_elems, data) as in kv_cache.cu.
        unsafe {
            builder.launch(LaunchConfig {
                grid_dim: ((elems / 8).div_ceil(256) as u32, chunks.len() as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }?;
        Ok(stream.synchronize()?)
    }
}
