//! The CUDA backend: bf16 weights and KV cache in GPU memory, f32 activations, cuBLAS for the
//! matrix products (bf16 in, f32 accumulate and out) and our NVRTC kernels for everything else.
//!
//! All work goes to one stream in order. Ops cannot return errors (see [`Backend::sync`]): the
//! first failure is kept, later work is skipped, and `sync` reports it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
    PushKernelArg,
};
use duet_engine::EngineError;
use duet_engine::backend::{
    AttentionShape, Backend, KvDtype, KvDtypeChoice, KvLayout, PrefillAttention,
};
use duet_engine::batch::ForwardBatch;
use duet_model::config::ModelConfig;
use duet_model::dequant::dequantize_row;
use duet_model::model_files::RawTensor;
use duet_model::quant_type::QuantType;
use duet_model::storage::WeightBytes;

use crate::CudaError;
use crate::kernels::{self, PARTITION_TOKENS};
use crate::probe::{self, DeviceInfo};

/// Rows of queries per prefill-attention block (`PREFILL_BLOCK_M` in prefill_attention.cu).
const PREFILL_BLOCK_M: usize = kernels::PREFILL_BLOCK_M;

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    functions: HashMap<&'static str, CudaFunction>,
    info: DeviceInfo,
    memory_fraction: f64,
    /// The first failure; once set, ops do nothing and `sync` reports it.
    failure: Mutex<Option<String>>,
    /// bf16 copy of a matmul input (cuBLAS takes both operands in bf16).
    cast_scratch: Mutex<Option<CudaSlice<u16>>>,
    /// The f32 activations whose bf16 copy `cast_scratch` holds (device address; 0: none). Set by
    /// the kernels that write the copy beside their output, cleared by every other launch and
    /// allocation, so a matmul skips its cast only when nothing can have changed its input since.
    cast_holds: AtomicU64,
    /// Decode attention's per-partition results, kept across layers and steps: allocating and
    /// zeroing them in every layer of every step was three allocations, memsets and frees each.
    partition_scratch: Mutex<PartitionScratch>,
    /// The prefill attention kernel (`--prefill-attention`); switchable between steps, so that
    /// `duet bench gpu` compares both on one loaded model.
    prefill_attention: Mutex<PrefillAttention>,
}

/// Per (row, head, partition): the partial output, its running max and its sum of weights.
#[derive(Default)]
struct PartitionScratch {
    out: Option<CudaSlice<f32>>,
    max: Option<CudaSlice<f32>>,
    sum: Option<CudaSlice<f32>>,
}

/// A weight matrix `[rows][cols]` in bf16.
pub struct CudaMatrix {
    data: CudaSlice<u16>,
    rows: usize,
    cols: usize,
}

/// Activations `[rows][cols]` in f32.
pub struct CudaActivations {
    data: CudaSlice<f32>,
    rows: usize,
    cols: usize,
}

/// The paged KV store in bf16, laid out `[layer][block][K|V][kv_head][slot][head_dim]`: one
/// (layer, block) is contiguous and is the transfer layout as it stands. A plain `cuMemAlloc`
/// allocation (not the stream-ordered pool), so that it can be exported through CUDA IPC.
pub struct CudaKvStore {
    ptr: CUdeviceptr,
    elems: usize,
    layout: KvLayout,
    ctx: Arc<CudaContext>,
}

impl CudaKvStore {
    /// Elements of one (layer, block).
    pub fn chunk_elems(&self) -> usize {
        2 * self.layout.num_kv_heads * self.layout.block_size * self.layout.head_dim
    }

    /// Device address of (layer, block).
    pub fn chunk_ptr(&self, layer: usize, block: usize) -> CUdeviceptr {
        self.ptr + ((layer * self.layout.num_blocks + block) * self.chunk_elems() * 2) as u64
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// The start of the allocation (for CUDA IPC export).
    pub fn base_ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.elems * 2
    }
}

impl Drop for CudaKvStore {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `malloc_sync` in this context and is freed once.
        let _ = self.ctx.bind_to_thread();
        unsafe {
            let _ = cudarc::driver::result::free_sync(self.ptr);
        }
    }
}

/// The geometry arguments both attention kernels take, in their order.
struct AttentionArgs {
    layer: i32,
    num_blocks: i32,
    num_heads: i32,
    num_kv_heads: i32,
    block_size: i32,
    head_dim: i32,
    scale: f32,
}

impl AttentionArgs {
    fn push<'a>(&'a self, a: &mut cudarc::driver::LaunchArgs<'a>) {
        a.arg(&self.layer)
            .arg(&self.num_blocks)
            .arg(&self.num_heads)
            .arg(&self.num_kv_heads)
            .arg(&self.block_size)
            .arg(&self.head_dim)
            .arg(&self.scale);
    }
}

/// A step's metadata in GPU memory.
pub struct CudaBatch {
    positions: CudaSlice<u32>,
    slots: CudaSlice<u32>,
    row_seq: CudaSlice<u32>,
    block_tables: CudaSlice<u32>,
    table_offsets: CudaSlice<u32>,
    /// Rows of single-token sequences (decode), attended by the split-context kernel.
    decode: Option<DecodeRows>,
    /// Sequences of several new tokens, attended by the tiled prefill kernel.
    prefill: Option<PrefillSeqs>,
}

struct DecodeRows {
    rows: CudaSlice<u32>,
    count: usize,
    max_partitions: usize,
}

struct PrefillSeqs {
    row_start: CudaSlice<u32>,
    len: CudaSlice<u32>,
    start_pos: CudaSlice<u32>,
    table_offsets: CudaSlice<u32>,
    count: usize,
    max_len: usize,
}

fn grid1(n: usize, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(block).clamp(1, 65_535 * 16), 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn per_row(rows: usize, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaBackend {
    /// Opens GPU `ordinal` and compiles our kernels for it. `memory_fraction` of the memory left
    /// after the weights goes to the KV cache.
    pub fn new(ordinal: usize, memory_fraction: f64) -> Result<Self, CudaError> {
        let (ctx, info) = probe::open_device(ordinal)?;
        // One stream, used in order: the per-allocation event tracking is not needed.
        // SAFETY: every use of our allocations goes through `stream`.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone())?;
        let (major, minor) = info.compute_capability;
        let arch = format!("sm_{major}{minor}");
        let mut functions = HashMap::new();
        for compiled in kernels::compile_all(&arch)? {
            let module = ctx.load_module(compiled.ptx)?;
            for &name in compiled.file.kernels {
                functions.insert(name, module.load_function(name)?);
            }
        }
        Ok(Self {
            ctx,
            stream,
            blas,
            functions,
            info,
            memory_fraction,
            failure: Mutex::new(None),
            cast_scratch: Mutex::new(None),
            cast_holds: AtomicU64::new(0),
            partition_scratch: Mutex::new(PartitionScratch::default()),
            prefill_attention: Mutex::new(PrefillAttention::default()),
        })
    }

    /// Computes prefill attention with `kernel` from the next step on. The fa kernels take more
    /// than the default 48 KiB of shared memory a block: their limit is raised here, and a GPU
    /// that cannot give it is an error naming the flag.
    pub fn set_prefill_attention(&self, kernel: PrefillAttention) -> Result<(), CudaError> {
        if kernel == PrefillAttention::Fa {
            use cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            for e in &kernels::FA_ENTRIES {
                self.function(e.kernel)
                    .set_attribute(
                        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        e.smem_bytes as i32,
                    )
                    .map_err(|err| {
                        CudaError::Unsupported(format!(
                            "--prefill-attention fa needs {} KiB of shared memory a block for head \
                             size {}, which GPU {} does not give ({err}): use --prefill-attention legacy",
                            e.smem_bytes / 1024,
                            e.head_dim,
                            self.info.ordinal
                        ))
                    })?;
            }
        }
        *self
            .prefill_attention
            .lock()
            .expect("prefill attention lock") = kernel;
        Ok(())
    }

    /// Activations made from host values (benchmarks and checks).
    pub fn upload_activations(
        &self,
        rows: usize,
        cols: usize,
        values: &[f32],
    ) -> Result<CudaActivations, EngineError> {
        assert_eq!(
            values.len(),
            rows * cols,
            "upload_activations: wrong length"
        );
        self.cast_holds.store(0, Ordering::Relaxed);
        let data = self
            .stream
            .clone_htod(values)
            .map_err(|e| CudaError::Driver(format!("uploading activations: {e}")))?;
        Ok(CudaActivations { data, rows, cols })
    }

    pub fn device_info(&self) -> &DeviceInfo {
        &self.info
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn failed(&self) -> bool {
        self.failure.lock().expect("failure lock").is_some()
    }

    /// Keeps the first failure; returns the value on success.
    fn check<T, E: std::fmt::Display>(&self, what: &str, r: Result<T, E>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                let mut failure = self.failure.lock().expect("failure lock");
                failure.get_or_insert_with(|| format!("{what}: {e}"));
                None
            }
        }
    }

    fn function(&self, name: &str) -> &CudaFunction {
        &self.functions[name]
    }

    fn upload<T>(&self, what: &str, host: &[T]) -> Option<CudaSlice<T>>
    where
        T: cudarc::driver::DeviceRepr + Copy + Default,
    {
        self.cast_holds.store(0, Ordering::Relaxed);
        // A zero-length allocation is an error in CUDA; keep one element.
        if host.is_empty() {
            return self.check(what, self.stream.clone_htod(&[T::default()]));
        }
        self.check(what, self.stream.clone_htod(host))
    }

    fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        what: &str,
        len: usize,
    ) -> Option<CudaSlice<T>> {
        self.cast_holds.store(0, Ordering::Relaxed);
        self.check(what, self.stream.alloc_zeros(len.max(1)))
    }

    /// A scratch buffer of at least `len` elements, reallocated only when it must grow.
    fn grown<'s, T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        slot: &'s mut Option<CudaSlice<T>>,
        what: &str,
        len: usize,
    ) -> Option<&'s mut CudaSlice<T>> {
        if slot.as_ref().is_none_or(|s| s.len() < len) {
            *slot = self.zeros(what, len);
        }
        slot.as_mut()
    }

    /// Launches `name` with the arguments `push` adds.
    fn launch<'a>(
        &'a self,
        name: &str,
        cfg: LaunchConfig,
        push: impl FnOnce(&mut cudarc::driver::LaunchArgs<'a>),
    ) {
        if self.failed() {
            return;
        }
        self.cast_holds.store(0, Ordering::Relaxed);
        let mut args = self.stream.launch_builder(self.function(name));
        push(&mut args);
        // SAFETY: the argument lists match the kernels' signatures in kernels/*.cu, and every
        // grid guards its indices against the sizes passed.
        let r = unsafe { args.launch(cfg) };
        self.check(name, r);
    }

    /// `out[n][w.rows] = x[n][w.cols] · wᵀ` through cuBLAS, bf16 operands, f32 accumulate.
    fn gemm(&self, w: &CudaMatrix, x: &CudaActivations, out: &mut CudaActivations) {
        if self.failed() || x.rows == 0 {
            return;
        }
        let n = x.rows * x.cols;
        let mut scratch = self.cast_scratch.lock().expect("scratch lock");
        let Some(xb) = self.grown(&mut scratch, "allocating the matmul cast buffer", n) else {
            return;
        };
        let source = self.address(&x.data);
        if self.cast_holds.load(Ordering::Relaxed) != source {
            let n64 = n as u64;
            self.launch("f32_to_bf16_n", grid1(n, 256), |a| {
                a.arg(&x.data).arg(&mut *xb).arg(&n64);
            });
            // Several matmuls of one input (unstacked projections) share the cast.
            self.cast_holds.store(source, Ordering::Relaxed);
        }
        self.gemm_bf16(w, xb, x.rows, out);
        // cuBLAS wrote `out` without a launch of ours.
        let _ = self.cast_holds.compare_exchange(
            self.address(&out.data),
            0,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }

    fn address(&self, data: &CudaSlice<f32>) -> u64 {
        data.device_ptr(&self.stream).0
    }

    /// `out[rows][w.rows] = x[rows][w.cols] · wᵀ` with `x` already in bf16: the cuBLAS call.
    pub fn gemm_bf16(
        &self,
        w: &CudaMatrix,
        x: &CudaSlice<u16>,
        rows: usize,
        out: &mut CudaActivations,
    ) {
        if self.failed() {
            return;
        }
        let (alpha, beta) = (1f32, 0f32);
        let (wp, _w) = w.data.device_ptr(&self.stream);
        let (xp, _x) = x.device_ptr(&self.stream);
        let (op, _o) = out.data.device_ptr_mut(&self.stream);
        // Row-major out[rows][w.rows] is column-major w.rows × rows: C = op(W)·X with W read
        // transposed.
        // SAFETY: the pointers cover w.rows×w.cols, rows×w.cols and rows×w.rows elements of the
        // stated types.
        let r = unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                w.rows as i32,
                rows as i32,
                w.cols as i32,
                (&alpha as *const f32).cast(),
                wp as *const _,
                cudaDataType::CUDA_R_16BF,
                w.cols as i32,
                xp as *const _,
                cudaDataType::CUDA_R_16BF,
                w.cols as i32,
                (&beta as *const f32).cast(),
                op as *mut _,
                cudaDataType::CUDA_R_32F,
                w.rows as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        self.check("cublasGemmEx", r);
    }

    fn upload_matrix(
        &self,
        name: &str,
        values: &[u16],
        rows: usize,
        cols: usize,
    ) -> Result<CudaMatrix, EngineError> {
        let data = self
            .stream
            .clone_htod(values)
            .map_err(|e| CudaError::Driver(format!("uploading {name}: {e}")))?;
        Ok(CudaMatrix { data, rows, cols })
    }
}

/// The bf16 bits of `len` values stored as `ty`: GGUF quantized (and f16/f32) weights are
/// dequantized at load, since the GPU path is bf16.
fn bf16_matrix(ty: QuantType, bytes: &[u8], len: usize) -> Vec<u16> {
    if ty == QuantType::BF16 {
        return bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
    }
    let mut f = vec![0f32; len];
    dequantize_row(ty, bytes, &mut f);
    bf16_bits(&f)
}

/// bf16 bits of `values`, rounded to nearest even (as the kernels' `f32_to_bf16`).
pub fn bf16_bits(values: &[f32]) -> Vec<u16> {
    values
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect()
}

/// The part of `config`'s family whose kernels have been checked in the CPU emulator only (per-head
/// q/k norms, mixtures of experts): refused on this backend until they have run on a GPU.
fn not_run_on_a_gpu(config: &ModelConfig) -> Option<&'static str> {
    if config.moe.is_some() {
        Some("mixture-of-experts FFNs")
    } else if config.qk_norm {
        Some("per-head q/k RMSNorm")
    } else {
        None
    }
}

impl Backend for CudaBackend {
    type Matrix = CudaMatrix;
    type Vector = CudaSlice<f32>;
    type Activations = CudaActivations;
    type KvStore = CudaKvStore;
    type Batch<'a> = Option<CudaBatch>;

    /// One engine per GPU context: steps never interleave with another engine's.
    type StepTurn<'a> = ();

    fn step_turn(&self) {}

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn check_model(&self, config: &ModelConfig) -> Result<(), EngineError> {
        match not_run_on_a_gpu(config) {
            None => Ok(()),
            Some(part) => Err(EngineError::Config(format!(
                "{} models need {part}, which the CUDA backend has not run on a GPU yet: \
                 serve this model with --device cpu",
                config.architecture
            ))),
        }
    }

    fn kv_dtype(&self, choice: KvDtypeChoice, _f32_weights: bool) -> Result<KvDtype, EngineError> {
        match choice.fixed() {
            None | Some(KvDtype::Bf16) => Ok(KvDtype::Bf16),
            Some(other) => Err(EngineError::Config(format!(
                "the CUDA KV cache stores bf16, not {other} (--kv-dtype)"
            ))),
        }
    }

    fn load_matrix(
        &self,
        name: &str,
        ty: QuantType,
        rows: usize,
        cols: usize,
        bytes: WeightBytes,
    ) -> Result<CudaMatrix, EngineError> {
        self.upload_matrix(name, &bf16_matrix(ty, &bytes, rows * cols), rows, cols)
    }

    fn load_stacked_matrix(&self, parts: &[RawTensor]) -> Result<Option<CudaMatrix>, EngineError> {
        let Some(first) = parts.first() else {
            return Ok(None);
        };
        if parts.iter().any(|t| t.cols != first.cols) {
            return Ok(None);
        }
        // Every part becomes bf16, whatever its stored type, so mixed types stack too.
        let mut values = Vec::new();
        for t in parts {
            values.extend(bf16_matrix(t.ty, &t.bytes, t.rows * t.cols));
        }
        let rows = parts.iter().map(|t| t.rows).sum();
        self.upload_matrix("stacked matrices", &values, rows, first.cols)
            .map(Some)
    }

    fn matrix_rows(&self, m: &CudaMatrix) -> usize {
        m.rows
    }

    fn load_vector(&self, values: Vec<f32>) -> Result<CudaSlice<f32>, EngineError> {
        Ok(self
            .stream
            .clone_htod(&values)
            .map_err(|e| CudaError::Driver(format!("uploading a vector: {e}")))?)
    }

    fn kv_capacity_blocks(&self, values_per_block: usize) -> Option<usize> {
        let (free, _) = self.ctx.mem_get_info().ok()?;
        let bytes = (free as f64 * self.memory_fraction) as usize;
        Some(bytes / (values_per_block * 2).max(1))
    }

    fn alloc_kv(&self, layout: KvLayout) -> Result<CudaKvStore, EngineError> {
        if layout.dtype != KvDtype::Bf16 {
            return Err(EngineError::Config(format!(
                "the CUDA KV cache stores bf16, not {}",
                layout.dtype
            )));
        }
        let elems = layout.num_blocks * layout.block_size * layout.values_per_token();
        let bytes = (elems * 2).max(2);
        let fail = |e: cudarc::driver::DriverError| {
            CudaError::Driver(format!(
                "allocating the KV cache ({} MiB): {e}",
                bytes >> 20
            ))
        };
        self.ctx.bind_to_thread().map_err(fail)?;
        // SAFETY: a fresh allocation, zeroed before use.
        let ptr = unsafe {
            let ptr = cudarc::driver::result::malloc_sync(bytes).map_err(fail)?;
            cudarc::driver::result::memset_d8_sync(ptr, 0, bytes).map_err(fail)?;
            ptr
        };
        Ok(CudaKvStore {
            ptr,
            elems,
            layout,
            ctx: self.ctx.clone(),
        })
    }

    fn kv_block_bytes(&self, kv: &CudaKvStore) -> usize {
        kv.chunk_elems() * 2
    }

    fn read_kv_block(&self, kv: &CudaKvStore, layer: usize, block: usize, out: &mut [u8]) {
        if self.failed() {
            return;
        }
        let mut host = vec![0u16; kv.chunk_elems()];
        // SAFETY: the chunk lies inside the store (the engine checks layer and block).
        let r = unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                &mut host,
                kv.chunk_ptr(layer, block),
                self.stream.cu_stream(),
            )
        }
        .and_then(|()| self.stream.synchronize());
        if self.check("reading a KV block", r).is_some() {
            for (o, v) in out.chunks_exact_mut(2).zip(&host) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
    }

    fn write_kv_block(&self, kv: &mut CudaKvStore, layer: usize, block: usize, data: &[u8]) {
        if self.failed() {
            return;
        }
        let host: Vec<u16> = data
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        // SAFETY: as above; the copy completes before `host` is dropped (synchronize).
        let r = unsafe {
            cudarc::driver::result::memcpy_htod_async(
                kv.chunk_ptr(layer, block),
                &host,
                self.stream.cu_stream(),
            )
        }
        .and_then(|()| self.stream.synchronize());
        self.check("writing a KV block", r);
    }

    fn alloc(&self, rows: usize, cols: usize) -> CudaActivations {
        // On failure a 1-element buffer stands in; the failure is reported by `sync`.
        let data = self
            .zeros::<f32>("allocating activations", rows * cols)
            .or_else(|| self.stream.alloc_zeros::<f32>(1).ok())
            .expect("a one-element allocation");
        CudaActivations { data, rows, cols }
    }

    fn prepare_batch(&self, batch: &ForwardBatch) -> Option<CudaBatch> {
        let mut block_tables = Vec::new();
        let mut table_offsets = Vec::with_capacity(batch.seqs.len());
        for s in &batch.seqs {
            table_offsets.push(block_tables.len() as u32);
            block_tables.extend_from_slice(&s.block_table);
        }
        let mut decode_rows = Vec::new();
        let mut max_context = 0;
        let (mut p_start, mut p_len, mut p_pos, mut p_table) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, s) in batch.seqs.iter().enumerate() {
            if s.len == 1 {
                decode_rows.push(s.row_start as u32);
                max_context = max_context.max(s.context_len());
            } else if s.len > 1 {
                p_start.push(s.row_start as u32);
                p_len.push(s.len as u32);
                p_pos.push(s.start_pos as u32);
                p_table.push(table_offsets[i]);
            }
        }
        let decode = if decode_rows.is_empty() {
            None
        } else {
            Some(DecodeRows {
                count: decode_rows.len(),
                rows: self.upload("uploading decode rows", &decode_rows)?,
                max_partitions: max_context.div_ceil(PARTITION_TOKENS),
            })
        };
        let prefill = if p_start.is_empty() {
            None
        } else {
            Some(PrefillSeqs {
                count: p_start.len(),
                max_len: p_len.iter().copied().max().unwrap_or(0) as usize,
                row_start: self.upload("uploading the batch", &p_start)?,
                len: self.upload("uploading the batch", &p_len)?,
                start_pos: self.upload("uploading the batch", &p_pos)?,
                table_offsets: self.upload("uploading the batch", &p_table)?,
            })
        };
        Some(CudaBatch {
            positions: self.upload("uploading the batch", &batch.positions)?,
            slots: self.upload("uploading the batch", &batch.slots)?,
            row_seq: self.upload("uploading the batch", &batch.row_seq)?,
            block_tables: self.upload("uploading the batch", &block_tables)?,
            table_offsets: self.upload("uploading the batch", &table_offsets)?,
            decode,
            prefill,
        })
    }

    fn embed(&self, table: &CudaMatrix, tokens: &[u32], out: &mut CudaActivations) {
        let Some(ids) = self.upload("uploading tokens", tokens) else {
            return;
        };
        let hidden = table.cols as i32;
        self.launch("embed_rows", per_row(tokens.len(), 256), |a| {
            a.arg(&table.data).arg(&ids).arg(&mut out.data).arg(&hidden);
        });
    }

    fn rms_norm(
        &self,
        x: &CudaActivations,
        w: &CudaSlice<f32>,
        eps: f32,
        out: &mut CudaActivations,
    ) {
        let cols = x.cols as i32;
        self.launch("rms_norm", per_row(x.rows, 256), |a| {
            a.arg(&x.data)
                .arg(w)
                .arg(&mut out.data)
                .arg(&cols)
                .arg(&eps);
        });
    }

    fn head_rms_norm(
        &self,
        x: &mut CudaActivations,
        w: &CudaSlice<f32>,
        head_dim: usize,
        eps: f32,
    ) {
        // The row kernel over `rows × heads` rows of `head_dim`, into a buffer taken in x's place.
        let heads = x.cols / head_dim;
        let mut normed = self.alloc(x.rows, x.cols);
        let cols = head_dim as i32;
        self.launch("rms_norm", per_row(x.rows * heads, 256), |a| {
            a.arg(&x.data)
                .arg(w)
                .arg(&mut normed.data)
                .arg(&cols)
                .arg(&eps);
        });
        std::mem::swap(x, &mut normed);
    }

    fn add_rms_norm(
        &self,
        x: &mut CudaActivations,
        delta: &CudaActivations,
        w: &CudaSlice<f32>,
        eps: f32,
        out: &mut CudaActivations,
    ) {
        let cols = x.cols as i32;
        self.launch("add_rms_norm", per_row(x.rows, 256), |a| {
            a.arg(&mut x.data)
                .arg(&delta.data)
                .arg(w)
                .arg(&mut out.data)
                .arg(&cols)
                .arg(&eps);
        });
    }

    fn matmul(&self, w: &CudaMatrix, x: &CudaActivations, out: &mut CudaActivations) {
        self.gemm(w, x, out);
    }

    fn split_cols(&self, x: &CudaActivations, parts: &mut [&mut CudaActivations]) {
        let (rows, cols) = (x.rows as i32, x.cols as i32);
        let mut start = 0i32;
        for p in parts.iter_mut() {
            let width = p.cols as i32;
            self.launch("copy_cols", grid1(x.rows * p.cols, 256), |a| {
                a.arg(&x.data)
                    .arg(&rows)
                    .arg(&cols)
                    .arg(&start)
                    .arg(&width)
                    .arg(&mut p.data);
            });
            start += width;
        }
    }

    fn add_bias(&self, x: &mut CudaActivations, bias: &CudaSlice<f32>) {
        let (rows, cols) = (x.rows as i32, x.cols as i32);
        self.launch("add_bias_rows", grid1(x.rows * x.cols, 256), |a| {
            a.arg(&mut x.data).arg(bias).arg(&rows).arg(&cols);
        });
    }

    fn rope(
        &self,
        x: &mut CudaActivations,
        head_dim: usize,
        inv_freq: &CudaSlice<f32>,
        attention_factor: f32,
        batch: &Option<CudaBatch>,
    ) {
        let Some(b) = batch else {
            return self.report_missing_batch();
        };
        let heads = (x.cols / head_dim) as i32;
        let hd = head_dim as i32;
        let cfg = LaunchConfig {
            grid_dim: (x.rows as u32, heads as u32, 1),
            block_dim: ((head_dim / 2) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch("rope_rotate_half", cfg, |a| {
            a.arg(&mut x.data)
                .arg(&b.positions)
                .arg(inv_freq)
                .arg(&heads)
                .arg(&hd)
                .arg(&attention_factor);
        });
    }

    fn write_kv(
        &self,
        kv: &mut CudaKvStore,
        layer: usize,
        k: &CudaActivations,
        v: &CudaActivations,
        batch: &Option<CudaBatch>,
    ) {
        let Some(b) = batch else {
            return self.report_missing_batch();
        };
        let l = kv.layout;
        let (layer, nb, kvh, bs, hd) = (
            layer as i32,
            l.num_blocks as i32,
            l.num_kv_heads as i32,
            l.block_size as i32,
            l.head_dim as i32,
        );
        self.launch("write_kv", per_row(k.rows, 128), |a| {
            a.arg(&kv.ptr)
                .arg(&k.data)
                .arg(&v.data)
                .arg(&b.slots)
                .arg(&layer)
                .arg(&nb)
                .arg(&kvh)
                .arg(&bs)
                .arg(&hd);
        });
    }

    fn attention(
        &self,
        q: &CudaActivations,
        kv: &CudaKvStore,
        layer: usize,
        shape: AttentionShape,
        batch: &Option<CudaBatch>,
        out: &mut CudaActivations,
    ) {
        let Some(b) = batch else {
            return self.report_missing_batch();
        };
        let l = kv.layout;
        let g = AttentionArgs {
            layer: layer as i32,
            num_blocks: l.num_blocks as i32,
            num_heads: shape.num_heads as i32,
            num_kv_heads: shape.num_kv_heads as i32,
            block_size: l.block_size as i32,
            head_dim: shape.head_dim as i32,
            scale: 1.0 / (shape.head_dim as f32).sqrt(),
        };
        let (nh, kvh, hd) = (g.num_heads, g.num_kv_heads, g.head_dim);
        if let Some(d) = &b.decode {
            let parts = d.max_partitions as i32;
            let stats = d.count * shape.num_heads * d.max_partitions;
            // Every entry a launch reads is written first (empty partitions too), so the buffers
            // are reused as they are.
            let mut scratch = self.partition_scratch.lock().expect("scratch lock");
            let PartitionScratch { out: o, max, sum } = &mut *scratch;
            let (Some(part_out), Some(part_max), Some(part_sum)) = (
                self.grown(o, "attention scratch", stats * shape.head_dim),
                self.grown(max, "attention scratch", stats),
                self.grown(sum, "attention scratch", stats),
            ) else {
                return;
            };
            let cfg = LaunchConfig {
                grid_dim: (d.count as u32, kvh as u32, parts as u32),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            self.launch("paged_attention_partial", cfg, |a| {
                a.arg(&q.data)
                    .arg(&kv.ptr)
                    .arg(&d.rows)
                    .arg(&b.row_seq)
                    .arg(&b.positions)
                    .arg(&b.block_tables)
                    .arg(&b.table_offsets);
                g.push(a);
                a.arg(&parts)
                    .arg(&mut *part_out)
                    .arg(&mut *part_max)
                    .arg(&mut *part_sum);
            });
            let cfg = LaunchConfig {
                grid_dim: (d.count as u32, nh as u32, 1),
                block_dim: (hd as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            self.launch("paged_attention_reduce", cfg, |a| {
                a.arg(&*part_out)
                    .arg(&*part_max)
                    .arg(&*part_sum)
                    .arg(&d.rows)
                    .arg(&b.positions)
                    .arg(&nh)
                    .arg(&hd)
                    .arg(&parts)
                    .arg(&mut out.data);
            });
        }
        if let Some(p) = &b.prefill {
            self.launch_prefill_attention(q, kv, p, b, &g, out);
        }
    }

    fn silu_mul(&self, gate: &mut CudaActivations, up: &CudaActivations) {
        let n = (gate.rows * gate.cols) as u64;
        self.launch("silu_mul", grid1(n as usize, 256), |a| {
            a.arg(&mut gate.data).arg(&up.data).arg(&n);
        });
    }

    fn silu_mul_stacked(&self, gate_up: &CudaActivations, out: &mut CudaActivations) {
        let (rows, inter) = (gate_up.rows as i32, (gate_up.cols / 2) as i32);
        let n = gate_up.rows * gate_up.cols / 2;
        let mut scratch = self.cast_scratch.lock().expect("scratch lock");
        let Some(xb) = self.grown(&mut scratch, "allocating the matmul cast buffer", n) else {
            return;
        };
        self.launch("silu_mul_stacked", grid1(n, 256), |a| {
            a.arg(&gate_up.data)
                .arg(&mut out.data)
                .arg(&mut *xb)
                .arg(&rows)
                .arg(&inter);
        });
        // `out` goes to the down projection next, which now needs no cast.
        let source = self.address(&out.data);
        self.cast_holds.store(source, Ordering::Relaxed);
    }

    fn add(&self, x: &mut CudaActivations, y: &CudaActivations) {
        let n = (x.rows * x.cols) as u64;
        self.launch("add_inplace", grid1(n as usize, 256), |a| {
            a.arg(&mut x.data).arg(&y.data).arg(&n);
        });
    }

    fn gather_rows(&self, x: &CudaActivations, rows: &[usize], out: &mut CudaActivations) {
        let ids: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let Some(ids) = self.upload("uploading rows", &ids) else {
            return;
        };
        let cols = x.cols as i32;
        self.launch("gather_rows", per_row(rows.len(), 256), |a| {
            a.arg(&x.data).arg(&ids).arg(&mut out.data).arg(&cols);
        });
    }

    fn scatter_add_rows(
        &self,
        out: &mut CudaActivations,
        y: &CudaActivations,
        rows: &[usize],
        weights: &[f32],
    ) {
        let ids: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let (Some(ids), Some(weights)) = (
            self.upload("uploading rows", &ids),
            self.upload("uploading weights", weights),
        ) else {
            return;
        };
        let cols = out.cols as i32;
        self.launch("scatter_add_rows", per_row(rows.len(), 256), |a| {
            a.arg(&mut out.data)
                .arg(&y.data)
                .arg(&ids)
                .arg(&weights)
                .arg(&cols);
        });
    }

    fn to_host(&self, x: CudaActivations) -> Vec<f32> {
        let n = x.rows * x.cols;
        let mut host = vec![0f32; n];
        if !self.failed() {
            let r = self.stream.memcpy_dtoh(&x.data.slice(0..n), &mut host);
            self.check("copying logits to the host", r);
        }
        host
    }

    fn sync(&self) -> Result<(), EngineError> {
        if !self.failed() {
            let r = self.stream.synchronize();
            self.check("stream synchronize", r);
        }
        match self.failure.lock().expect("failure lock").as_ref() {
            None => Ok(()),
            Some(f) => Err(EngineError::Device(format!(
                "CUDA device {}: {f}",
                self.info.ordinal
            ))),
        }
    }
}

impl CudaBackend {
    /// Causal attention of the step's prefill sequences (several new tokens each) with the kernel
    /// `--prefill-attention` chose, one entry point per padded head size (each with its own
    /// registers). The fa grid puts the heads first: every head of a query tile runs at once.
    fn launch_prefill_attention(
        &self,
        q: &CudaActivations,
        kv: &CudaKvStore,
        p: &PrefillSeqs,
        b: &CudaBatch,
        g: &AttentionArgs,
        out: &mut CudaActivations,
    ) {
        let (heads, seqs) = (g.num_heads as u32, p.count as u32);
        let head_dim = g.head_dim as usize;
        let kernel = *self
            .prefill_attention
            .lock()
            .expect("prefill attention lock");
        let (name, cfg) = match kernel {
            PrefillAttention::Legacy => {
                let name = if head_dim <= 64 {
                    "prefill_attention_hd64"
                } else if head_dim <= 128 {
                    "prefill_attention_hd128"
                } else {
                    "prefill_attention_hd256"
                };
                let tiles = p.max_len.div_ceil(PREFILL_BLOCK_M) as u32;
                let cfg = LaunchConfig {
                    grid_dim: (tiles, heads, seqs),
                    block_dim: (kernels::PREFILL_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                (name, cfg)
            }
            PrefillAttention::Fa => {
                let e = kernels::fa_entry(head_dim);
                let cfg = LaunchConfig {
                    grid_dim: (heads, p.max_len.div_ceil(e.block_m) as u32, seqs),
                    block_dim: (kernels::FA_THREADS, 1, 1),
                    shared_mem_bytes: e.smem_bytes,
                };
                (e.kernel, cfg)
            }
        };
        self.launch(name, cfg, |a| {
            a.arg(&q.data)
                .arg(&kv.ptr)
                .arg(&p.row_start)
                .arg(&p.len)
                .arg(&p.start_pos)
                .arg(&b.block_tables)
                .arg(&p.table_offsets);
            g.push(a);
            a.arg(&mut out.data);
        });
    }

    /// Packs (layer, block) chunks (indices `layer * num_blocks + block`) into one buffer of
    /// bf16 bytes, in order: what the NCCL transport sends.
    pub fn pack_chunks(
        &self,
        store: &CudaKvStore,
        chunks: &[u32],
    ) -> Result<CudaSlice<u8>, CudaError> {
        let elems = store.chunk_elems() as u64;
        let ids = self.stream.clone_htod(chunks)?;
        let mut out = self
            .stream
            .alloc_zeros::<u8>(chunks.len() * store.chunk_elems() * 2)?;
        self.launch(
            "pack_kv_chunks",
            self.chunk_grid(store, chunks.len()),
            |a| {
                a.arg(&store.ptr).arg(&ids).arg(&elems).arg(&mut out);
            },
        );
        self.sync().map_err(|e| CudaError::Driver(e.to_string()))?;
        Ok(out)
    }

    /// The inverse of [`CudaBackend::pack_chunks`].
    pub fn unpack_chunks(
        &self,
        store: &mut CudaKvStore,
        chunks: &[u32],
        packed: &CudaSlice<u8>,
    ) -> Result<(), CudaError> {
        let elems = store.chunk_elems() as u64;
        let ids = self.stream.clone_htod(chunks)?;
        self.launch(
            "unpack_kv_chunks",
            self.chunk_grid(store, chunks.len()),
            |a| {
                a.arg(&store.ptr).arg(&ids).arg(&elems).arg(packed);
            },
        );
        self.sync().map_err(|e| CudaError::Driver(e.to_string()))
    }

    fn chunk_grid(&self, store: &CudaKvStore, num_chunks: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (
                (store.chunk_elems() / 8).div_ceil(256) as u32,
                num_chunks as u32,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn report_missing_batch(&self) {
        self.check::<(), _>("batch", Err("the step's metadata could not be uploaded"));
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn fixture(name: &str) -> ModelConfig {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
        ModelConfig::from_hf_config_file(&dir.join(name).join("config.json")).unwrap()
    }

    #[test]
    fn families_not_run_on_a_gpu_are_named() {
        assert_eq!(not_run_on_a_gpu(&fixture("tiny-llama")), None);
        assert_eq!(not_run_on_a_gpu(&fixture("tiny-rope-llama3")), None);
        assert_eq!(
            not_run_on_a_gpu(&fixture("tiny-qwen3")),
            Some("per-head q/k RMSNorm")
        );
        for moe in ["tiny-mixtral", "tiny-qwen3-moe"] {
            assert_eq!(
                not_run_on_a_gpu(&fixture(moe)),
                Some("mixture-of-experts FFNs")
            );
        }
    }
}
