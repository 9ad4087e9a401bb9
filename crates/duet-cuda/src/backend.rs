//! The CUDA backend: bf16 weights and KV cache in GPU memory, f32 activations, cuBLAS for the
//! matrix products (bf16 in, f32 accumulate and out) and our NVRTC kernels for everything else,
//! written once over [`Gpu`] (the driver in production, a recording GPU in the tests).
//!
//! All work goes to one stream of the backend's own, in order. A step allocates nothing: its
//! inputs (tokens, positions, slots, block tables, ...) are packed on the host and reach the GPU
//! in one upload into a buffer of fixed capacity ([`crate::step`]); its activations come from
//! one workspace, planned at start-up ([`Backend::reserve_step_memory`]) and handed out in order;
//! the decode attention's partitions, the bf16 operands of the matrix products and the sampling
//! scratch are buffers that only grow, between steps. A decode step is padded to its batch
//! bucket (padded rows write the KV cache's scratch block), so that with `--cuda-graphs on` the
//! same shapes are captured once as a CUDA graph and replayed. Ops cannot return errors (see
//! [`Backend::sync`]): the first failure is kept, later work is skipped, and `sync` reports it.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use duet_engine::EngineError;
use duet_engine::backend::{
    AttentionShape, Backend, HostMemory, KvDtype, KvDtypeChoice, KvLayout, PrefillAttention,
    StepMemoryPlan, StepRows,
};
use duet_engine::batch::ForwardBatch;
use duet_engine::sampling_steps::RowSampling;
use duet_model::config::ModelConfig;
use duet_model::dequant::dequantize_row;
use duet_model::fp8::Fp8Matrix;
use duet_model::model_files::RawTensor;
use duet_model::params::Sampled;
use duet_model::quant_type::QuantType;
use duet_model::storage::WeightBytes;

use crate::CudaError;
use crate::fp8_weights::{self, Fp8Layout};
use crate::gpu::{Arg, DeviceBuffer, DevicePtr, Gemm, Gpu, Launch};
use crate::kernels;
use crate::packed_weights::{self, PackedLayout};
use crate::sampling::{self, PackedRows};
use crate::step::{self, Arena, GraphKey, InputLayout};

/// Choices of the GPU path that have not run on a GPU yet, each off (or the kernel that has) by
/// default (`--cuda-graphs`, `--device-sampling`, `--fused-kernels`, `--gpu-weights`,
/// `--prefill-attention`, `--kv-load-stream`, `--kv-host-pinned`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuOptions {
    /// Decode steps captured once per batch bucket as a CUDA graph, then replayed.
    pub cuda_graphs: bool,
    /// Tokens drawn on the GPU (`kernels/sampling.cu`), bit for bit as the CPU sampler.
    pub device_sampling: bool,
    /// QKV → RoPE → KV write as one kernel, and norms and attention writing the next matrix
    /// product's bf16 operand themselves.
    pub fused_kernels: bool,
    /// GGUF block formats kept packed on the GPU (`--gpu-weights packed`), read by the kernels
    /// of `kernels/quant_matvec.cu`; otherwise dequantized to bf16. Read when a matrix is
    /// loaded: switching it later changes no loaded weights.
    pub packed_weights: bool,
    /// The kernel of prefill attention: prefill_attention.cu (legacy) or the FlashAttention-tiled
    /// prefill_attention_fa.cu (fa).
    pub prefill_attention: PrefillAttention,
    /// Blocks brought up from a tier below copied on the load stream, beside the step in flight
    /// (`--kv-load-stream`), not on the backend's stream, waited for.
    pub load_stream: bool,
    /// The host tier below the KV pool in page-locked memory (`--kv-host-pinned`): the copy
    /// engine reads a block brought up straight from its slot and writes a block moving down
    /// straight into one. Read when the tiers are made.
    pub host_pinned: bool,
}

/// [`GpuOptions`] as the backend holds them: switchable between steps (`duet bench gpu` times
/// each on one loaded model).
#[derive(Default)]
struct Switches {
    cuda_graphs: AtomicBool,
    device_sampling: AtomicBool,
    fused_kernels: AtomicBool,
    packed_weights: AtomicBool,
    /// Whether prefill attention is `fa` (else `legacy`).
    fa_prefill: AtomicBool,
    load_stream: AtomicBool,
    host_pinned: AtomicBool,
}

impl Switches {
    fn get(&self) -> GpuOptions {
        GpuOptions {
            cuda_graphs: self.cuda_graphs.load(Ordering::Relaxed),
            device_sampling: self.device_sampling.load(Ordering::Relaxed),
            fused_kernels: self.fused_kernels.load(Ordering::Relaxed),
            packed_weights: self.packed_weights.load(Ordering::Relaxed),
            prefill_attention: match self.fa_prefill.load(Ordering::Relaxed) {
                true => PrefillAttention::Fa,
                false => PrefillAttention::Legacy,
            },
            load_stream: self.load_stream.load(Ordering::Relaxed),
            host_pinned: self.host_pinned.load(Ordering::Relaxed),
        }
    }

    fn set(&self, o: GpuOptions) {
        self.cuda_graphs.store(o.cuda_graphs, Ordering::Relaxed);
        self.device_sampling
            .store(o.device_sampling, Ordering::Relaxed);
        self.fused_kernels.store(o.fused_kernels, Ordering::Relaxed);
        self.packed_weights
            .store(o.packed_weights, Ordering::Relaxed);
        self.fa_prefill.store(
            o.prefill_attention == PrefillAttention::Fa,
            Ordering::Relaxed,
        );
        self.load_stream.store(o.load_stream, Ordering::Relaxed);
        self.host_pinned.store(o.host_pinned, Ordering::Relaxed);
    }
}

/// Largest decode bucket before [`Backend::reserve_step_memory`] names the real one.
const DEFAULT_MAX_BUCKET: usize = 256;

pub struct GpuBackend<G: Gpu> {
    gpu: Arc<G>,
    options: Switches,
    memory_fraction: f64,
    /// The largest dequantized tile of a packed matrix loaded so far (bytes): the scratch
    /// buffer prefill's products over packed weights need, reserved with the step memory.
    packed_tile_bytes: AtomicUsize,
    /// The widest input of an FP8 matrix loaded so far (values): the scratch its products'
    /// quantized inputs need, reserved with the step memory.
    fp8_widest_cols: AtomicUsize,
    /// Device memory the weights loaded so far take (matrices and vectors), bytes.
    weight_bytes: AtomicUsize,
    /// The first failure; once set, ops do nothing and `sync` reports it.
    failure: Mutex<Option<String>>,
    state: Mutex<State<G>>,
}

/// Everything a step changes.
struct State<G: Gpu> {
    buckets: Vec<usize>,
    /// The last KV store's scratch block, which padded rows read and write.
    scratch_block: u32,
    /// The step's inputs as packed on the host, their pinned copy and their device buffer.
    words: Vec<u32>,
    staging: Option<G::Pinned>,
    inputs: Option<DeviceBuffer>,
    arena: Arena,
    workspace: Option<DeviceBuffer>,
    /// Activations past the workspace in this step (the workspace grows before the next).
    overflow: Vec<DeviceBuffer>,
    /// bf16 copy of a matrix product's input.
    cast: Option<DeviceBuffer>,
    /// A tile of a packed matrix dequantized to bf16 (prefill's products over packed weights).
    tile: Option<DeviceBuffer>,
    /// An FP8 product's input quantized to E4M3, then its row scales.
    fp8_input: Option<DeviceBuffer>,
    /// The activations whose bf16 copy `cast` holds (0: none). Set by the kernels that write the
    /// copy beside their output, cleared by every other launch, so a product skips its cast only
    /// when nothing can have changed its input since.
    cast_holds: DevicePtr,
    /// Decode attention's per (row, head, partition) output, max and sum.
    partitions: Option<DeviceBuffer>,
    packed: PackedRows,
    sampling_staging: Option<G::Pinned>,
    sampling_inputs: Option<DeviceBuffer>,
    sampling_work: Option<DeviceBuffer>,
    sampling_out: Option<DeviceBuffer>,
    /// Pinned landing place of downloads (logits, sampled tokens).
    download: Option<G::Pinned>,
    /// Captured graphs and the workspace bytes their step used.
    graphs: HashMap<GraphKey, (G::Graph, usize)>,
    /// Shapes run eagerly once: the next step of the shape is captured.
    seen: HashSet<GraphKey>,
    mode: Mode,
    /// Work queued since the last synchronization.
    pending: bool,
    /// Between `prepare_batch` and `sync`: activations come from the workspace.
    in_step: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Eager,
    /// The step's work is being captured into the graph of this key.
    Capture(GraphKey),
    /// The graph of this key has been queued: ops only take their activations.
    Replay(GraphKey),
}

/// A weight matrix `[rows][cols]` in bf16, as the GGUF file's blocks (`--gpu-weights packed`),
/// or in FP8 with its row scales (an FP8 checkpoint, `--quantization fp8`).
pub struct CudaMatrix {
    buf: DeviceBuffer,
    rows: usize,
    cols: usize,
    packed: Option<PackedLayout>,
    fp8: Option<Fp8Layout>,
}

impl CudaMatrix {
    /// Bytes of device memory the weights take.
    pub fn bytes(&self) -> usize {
        self.buf.bytes()
    }

    /// The packed layout, when the matrix is kept in its file's blocks.
    pub fn packed(&self) -> Option<&PackedLayout> {
        self.packed.as_ref()
    }

    /// The FP8 layout, when the matrix is kept in FP8.
    pub fn fp8(&self) -> Option<&Fp8Layout> {
        self.fp8.as_ref()
    }
}

/// A weight vector in f32.
pub struct CudaVector {
    buf: DeviceBuffer,
}

/// Activations `[rows][cols]` in f32: a view of the step's workspace, or memory of their own.
pub struct CudaActivations {
    ptr: DevicePtr,
    rows: usize,
    cols: usize,
    _owned: Option<DeviceBuffer>,
}

impl CudaActivations {
    pub fn rows(&self) -> usize {
        self.rows
    }
}

/// The paged KV store in bf16 or FP8 E4M3 (`--kv-dtype fp8`), laid out
/// `[layer][block][K|V][kv_head][slot][head_dim]`, with one block more per layer than the engine
/// has (the scratch block padded rows write): one (layer, block) is contiguous and is the transfer
/// layout as it stands. A plain allocation, so that it can be exported through CUDA IPC.
pub struct CudaKvStore {
    buf: DeviceBuffer,
    layout: KvLayout,
}

/// The scale of every layer's K and V in an FP8 cache (stored E4M3 = value / scale): 1, vLLM's
/// default without calibrated scales. E4M3 keeps 3 mantissa bits at any magnitude from 2^-6 to
/// 448, which holds a Llama's keys and values (|x| ≲ 20; 2.2 on the tiny fixture model), so the
/// scale guards only the range: per-token scales give the tiny model's logits 1.0e-2 from float64
/// against 1.5e-2 with this one, at the cost of scales in every block. Kernels take the scales as
/// arguments; a checkpoint's calibrated `k_scale`/`v_scale` are not read yet.
pub const FP8_KV_SCALE: f32 = 1.0;

/// The lowest compute capability with FP8 (E4M3) conversions: Ada (8.9), then Hopper (9.0).
pub const FP8_MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 9);

impl CudaKvStore {
    /// Bytes of one (layer, block): half a bf16 cache's in an FP8 one.
    pub fn chunk_bytes(&self) -> usize {
        self.layout.layer_block_bytes()
    }

    /// Device address of (layer, block).
    pub fn chunk_ptr(&self, layer: usize, block: usize) -> DevicePtr {
        self.buf.ptr() + (self.chunk_index(layer, block) * self.chunk_bytes()) as u64
    }

    /// Whether values are stored as FP8 E4M3 (else bf16).
    pub fn fp8(&self) -> bool {
        self.layout.dtype == KvDtype::Fp8E4m3
    }

    /// Index of (layer, block) among the store's chunks.
    pub fn chunk_index(&self, layer: usize, block: usize) -> usize {
        layer * self.physical_blocks() + block
    }

    /// The engine's geometry (its blocks, without the scratch block).
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// The geometry as stored: one block more per layer.
    pub fn physical_layout(&self) -> KvLayout {
        KvLayout {
            num_blocks: self.physical_blocks(),
            ..self.layout
        }
    }

    fn physical_blocks(&self) -> usize {
        self.layout.num_blocks + 1
    }

    /// The block padded rows read and write.
    pub fn scratch_block(&self) -> usize {
        self.layout.num_blocks
    }

    /// The start of the allocation (for CUDA IPC export).
    pub fn base_ptr(&self) -> DevicePtr {
        self.buf.ptr()
    }

    pub fn bytes(&self) -> usize {
        self.buf.bytes()
    }
}

/// A step's metadata: where its inputs are on the device.
pub struct CudaBatch<'a> {
    forward: &'a ForwardBatch,
    layout: InputLayout,
    base: DevicePtr,
}

impl CudaBatch<'_> {
    /// Address of the array starting at `word`.
    fn at(&self, word: usize) -> Arg {
        Arg::Ptr(self.base + 4 * word as u64)
    }
}

fn i32_of(v: usize) -> Arg {
    Arg::I32(v as i32)
}

fn grid1(n: usize, block: u32) -> ((u32, u32, u32), u32) {
    (
        ((n as u32).div_ceil(block).clamp(1, 65_535 * 16), 1, 1),
        block,
    )
}

fn per_row(rows: usize, block: u32) -> ((u32, u32, u32), u32) {
    ((rows as u32, 1, 1), block)
}

/// Grows `slot` to at least `bytes`; true when it was reallocated.
fn grow<G: Gpu>(
    gpu: &Arc<G>,
    slot: &mut Option<DeviceBuffer>,
    bytes: usize,
) -> Result<bool, CudaError> {
    if slot.as_ref().is_some_and(|b| b.bytes() >= bytes) {
        return Ok(false);
    }
    *slot = None; // free first: the old and the new need not fit together
    *slot = Some(DeviceBuffer::new(gpu, bytes)?);
    Ok(true)
}

fn grow_pinned<G: Gpu>(
    gpu: &G,
    slot: &mut Option<G::Pinned>,
    bytes: usize,
) -> Result<(), CudaError> {
    if slot.as_ref().is_none_or(|p| p.as_ref().len() < bytes) {
        *slot = None;
        *slot = Some(gpu.alloc_pinned(bytes.max(4096))?);
    }
    Ok(())
}

/// The host tier's memory with `--kv-host-pinned on`: page-locked, so the copy engine reads a
/// block brought up straight from its slot (the tier keeps a slot a queued copy reads until the
/// engine saw the copies complete). Freed only after the load stream's copies complete: one may
/// still read it when the engine stops.
struct PinnedTierMemory<G: Gpu> {
    gpu: Arc<G>,
    bytes: G::Pinned,
}

impl<G: Gpu> HostMemory for PinnedTierMemory<G> {
    fn bytes(&self) -> &[u8] {
        self.bytes.as_ref()
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        self.bytes.as_mut()
    }

    fn page_locked(&self) -> bool {
        true
    }
}

impl<G: Gpu> Drop for PinnedTierMemory<G> {
    fn drop(&mut self) {
        let _ = self.gpu.synchronize_loads();
    }
}

fn words_to_bytes(words: &[u32], out: &mut [u8]) {
    for (o, w) in out.chunks_exact_mut(4).zip(words) {
        o.copy_from_slice(&w.to_le_bytes());
    }
}

impl<G: Gpu> GpuBackend<G> {
    /// The backend over `gpu`; `memory_fraction` of the memory left after the weights goes to
    /// the KV cache.
    pub fn with_gpu(gpu: Arc<G>, options: GpuOptions, memory_fraction: f64) -> Self {
        let switches = Switches::default();
        switches.set(options);
        Self {
            gpu,
            options: switches,
            memory_fraction,
            packed_tile_bytes: AtomicUsize::new(0),
            fp8_widest_cols: AtomicUsize::new(0),
            weight_bytes: AtomicUsize::new(0),
            failure: Mutex::new(None),
            state: Mutex::new(State {
                buckets: step::buckets(DEFAULT_MAX_BUCKET),
                scratch_block: 0,
                words: Vec::new(),
                staging: None,
                inputs: None,
                arena: Arena::default(),
                workspace: None,
                overflow: Vec::new(),
                cast: None,
                tile: None,
                fp8_input: None,
                cast_holds: 0,
                partitions: None,
                packed: PackedRows::default(),
                sampling_staging: None,
                sampling_inputs: None,
                sampling_work: None,
                sampling_out: None,
                download: None,
                graphs: HashMap::new(),
                seen: HashSet::new(),
                mode: Mode::Eager,
                pending: false,
                in_step: false,
            }),
        }
    }

    pub fn gpu(&self) -> &Arc<G> {
        &self.gpu
    }

    /// An error unless this GPU converts FP8 (`--kv-dtype fp8`).
    fn check_fp8_kv(&self) -> Result<(), EngineError> {
        let (major, minor) = self.gpu.compute_capability();
        if (major, minor) >= FP8_MIN_COMPUTE_CAPABILITY {
            return Ok(());
        }
        let (need_major, need_minor) = FP8_MIN_COMPUTE_CAPABILITY;
        Err(EngineError::Config(format!(
            "--kv-dtype fp8 needs a GPU of compute capability {need_major}.{need_minor} or later \
             (Ada, Hopper); this GPU's is {major}.{minor}: use --kv-dtype bf16"
        )))
    }

    pub fn options(&self) -> GpuOptions {
        self.options.get()
    }

    /// Device memory the weights loaded so far take, in bytes (weights are never freed while
    /// the backend lives).
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes.load(Ordering::Relaxed)
    }

    /// Switches the GPU path between steps: graphs captured so far are dropped, and each shape
    /// runs eagerly once again before it is captured.
    pub fn set_options(&self, options: GpuOptions) {
        let mut s = self.state();
        self.options.set(options);
        s.graphs.clear();
        s.seen.clear();
    }

    fn state(&self) -> MutexGuard<'_, State<G>> {
        self.state.lock().expect("backend state lock")
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

    /// Whether ops must not queue work: a failure, or a replayed graph already doing it.
    fn idle(&self, s: &State<G>) -> bool {
        self.failed() || matches!(s.mode, Mode::Replay(_))
    }

    /// Launches `kernel` unless the backend is idle.
    fn launch(
        &self,
        s: &mut State<G>,
        kernel: &'static str,
        grid: ((u32, u32, u32), u32),
        args: &[Arg],
    ) {
        self.launch_shared(s, kernel, grid, 0, args);
    }

    /// [`Self::launch`] with `shared_bytes` of dynamic shared memory a block.
    fn launch_shared(
        &self,
        s: &mut State<G>,
        kernel: &'static str,
        (grid, block): ((u32, u32, u32), u32),
        shared_bytes: u32,
        args: &[Arg],
    ) {
        if self.idle(s) {
            return;
        }
        s.cast_holds = 0;
        s.pending = true;
        let r = self.gpu.launch(&Launch {
            kernel,
            grid,
            block,
            shared_bytes,
            args,
        });
        self.check(kernel, r);
    }

    /// A persistent scratch buffer of at least `bytes`; growing it drops every captured graph
    /// (they hold its old address). Never called under capture with a size the shape's eager
    /// run did not already reach.
    fn scratch(
        &self,
        what: &str,
        pick: fn(&mut State<G>) -> &mut Option<DeviceBuffer>,
        s: &mut State<G>,
        bytes: usize,
    ) -> Option<DevicePtr> {
        let grew = self.check(what, grow(&self.gpu, pick(s), bytes))?;
        if grew {
            s.graphs.clear();
        }
        Some(pick(s).as_ref().expect("grown").ptr())
    }

    /// The bf16 copy of `rows × cols` activations (the cast buffer), grown to fit (a new buffer
    /// holds no one's copy).
    fn cast_buffer(&self, s: &mut State<G>, elems: usize) -> Option<DevicePtr> {
        let before = s.cast.as_ref().map(DeviceBuffer::bytes);
        let ptr = self.scratch(
            "allocating the matmul cast buffer",
            |s| &mut s.cast,
            s,
            elems * 2,
        )?;
        if s.cast.as_ref().map(DeviceBuffer::bytes) != before {
            s.cast_holds = 0;
        }
        Some(ptr)
    }

    /// The cast buffer as the kernels writing a bf16 copy take it: null unless fused.
    fn bf16_copy(&self, s: &mut State<G>, elems: usize) -> Arg {
        match self.options().fused_kernels {
            true => Arg::Ptr(self.cast_buffer(s, elems).unwrap_or(0)),
            false => Arg::Ptr(0),
        }
    }

    /// After a kernel wrote `out`'s bf16 copy: the next product of `out` needs no cast.
    fn cast_written(&self, s: &mut State<G>, out: &CudaActivations) {
        if self.options().fused_kernels {
            s.cast_holds = out.ptr;
        }
    }

    /// `out = x · wᵀ`: over packed weights and a few rows, one kernel reading the blocks and
    /// `x` in f32; otherwise through cuBLAS, `x` cast to bf16 unless the cast buffer holds it
    /// already (packed weights dequantized to bf16 a tile at a time).
    fn gemm(&self, s: &mut State<G>, w: &CudaMatrix, x: &CudaActivations, out: &CudaActivations) {
        if self.idle(s) || x.rows == 0 {
            return;
        }
        if let Some(layout) = &w.fp8 {
            return self.gemm_fp8(s, w, layout, x, out);
        }
        if let Some(p) = &w.packed
            && x.rows <= packed_weights::MATVEC_MAX_ROWS
        {
            let args = [
                Arg::Ptr(w.buf.ptr()),
                Arg::Ptr(x.ptr),
                Arg::Ptr(out.ptr),
                i32_of(x.rows),
                i32_of(p.rows),
                i32_of(p.cols),
            ];
            return self.launch(s, p.kernels().matvec, p.matvec_grid(x.rows), &args);
        }
        let n = x.rows * x.cols;
        let Some(xb) = self.cast_buffer(s, n) else {
            return;
        };
        if s.cast_holds != x.ptr {
            self.launch(
                s,
                "f32_to_bf16_n",
                grid1(n, 256),
                &[Arg::Ptr(x.ptr), Arg::Ptr(xb), Arg::U64(n as u64)],
            );
            // Several products of one input (unstacked projections) share the cast.
            s.cast_holds = x.ptr;
        }
        match &w.packed {
            None => {
                let shape = (w.rows, w.cols);
                self.gemm_bf16(s, w.buf.ptr(), shape, xb, x.rows, out.ptr, w.rows)
            }
            Some(p) => self.gemm_packed_tiles(s, w, p, xb, x.rows, out),
        }
        if s.cast_holds == out.ptr {
            s.cast_holds = 0;
        }
    }

    /// `out = x · wᵀ` over packed `w` for many rows of `x` (prefill; `xb` its bf16 copy): each
    /// tile of `w`'s rows dequantized to bf16 into the tile buffer, then its band of `out`'s
    /// columns through cuBLAS.
    fn gemm_packed_tiles(
        &self,
        s: &mut State<G>,
        w: &CudaMatrix,
        p: &PackedLayout,
        xb: DevicePtr,
        rows: usize,
        out: &CudaActivations,
    ) {
        let Some(tile) = self.scratch(
            "allocating the dequantized tile",
            |s| &mut s.tile,
            s,
            p.tile_bytes(),
        ) else {
            return;
        };
        let cast_holds = s.cast_holds;
        for (first, tile_rows) in p.tiles() {
            self.launch(
                s,
                p.kernels().to_bf16,
                grid1(tile_rows * p.cols / 32, 256),
                &[
                    Arg::Ptr(w.buf.ptr() + (first * p.row_bytes) as u64),
                    Arg::Ptr(tile),
                    i32_of(tile_rows),
                    i32_of(p.cols),
                ],
            );
            let band = out.ptr + (first * 4) as u64;
            self.gemm_bf16(s, tile, (tile_rows, p.cols), xb, rows, band, p.rows);
        }
        // The tiles left the cast buffer alone.
        s.cast_holds = cast_holds;
    }

    /// `out[rows][..n] = x · wᵀ` through cuBLAS, `w` `[n][k]` and `x` in bf16, `out`'s rows
    /// `ld_out` values apart.
    #[allow(clippy::too_many_arguments)]
    fn gemm_bf16(
        &self,
        s: &mut State<G>,
        w: DevicePtr,
        (n, k): (usize, usize),
        x: DevicePtr,
        rows: usize,
        out: DevicePtr,
        ld_out: usize,
    ) {
        if self.idle(s) {
            return;
        }
        s.pending = true;
        let r = self.gpu.gemm(&Gemm {
            w,
            x,
            out,
            rows,
            n,
            k,
            ld_out,
        });
        self.check("cublasGemmEx", r);
    }

    /// `out = x · wᵀ` with `x` a bf16 matrix of its own (the matrix-rate benchmark).
    pub fn gemm_matrices(&self, w: &CudaMatrix, x: &CudaMatrix, out: &CudaActivations) {
        let mut s = self.state();
        let (n, k) = (w.rows, w.cols);
        self.gemm_bf16(&mut s, w.buf.ptr(), (n, k), x.buf.ptr(), x.rows, out.ptr, n);
    }

    /// Activations made from host values (benchmarks and checks), in memory of their own.
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
        let buf = DeviceBuffer::new(&self.gpu, values.len() * 4)?;
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.gpu.upload(buf.ptr(), &bytes)?;
        self.gpu.synchronize()?;
        Ok(CudaActivations {
            ptr: buf.ptr(),
            rows,
            cols,
            _owned: Some(buf),
        })
    }

    fn upload_matrix(
        &self,
        values: &[u16],
        rows: usize,
        cols: usize,
    ) -> Result<CudaMatrix, CudaError> {
        let buf = DeviceBuffer::new(&self.gpu, values.len() * 2)?;
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.gpu.upload(buf.ptr(), &bytes)?;
        self.gpu.synchronize()?;
        self.weight_bytes.fetch_add(buf.bytes(), Ordering::Relaxed);
        Ok(CudaMatrix {
            buf,
            rows,
            cols,
            packed: None,
            fp8: None,
        })
    }

    /// A packed matrix: its blocks uploaded as they are.
    fn upload_packed(&self, layout: PackedLayout, bytes: &[u8]) -> Result<CudaMatrix, CudaError> {
        let buf = DeviceBuffer::new(&self.gpu, bytes.len())?;
        self.gpu.upload(buf.ptr(), bytes)?;
        self.gpu.synchronize()?;
        self.packed_tile_bytes
            .fetch_max(layout.tile_bytes(), Ordering::Relaxed);
        self.weight_bytes.fetch_add(buf.bytes(), Ordering::Relaxed);
        Ok(CudaMatrix {
            buf,
            rows: layout.rows,
            cols: layout.cols,
            packed: Some(layout),
            fp8: None,
        })
    }

    /// An FP8 matrix: its E4M3 bytes and row scales uploaded in one allocation.
    fn upload_fp8(&self, layout: Fp8Layout, m: &Fp8Matrix) -> Result<CudaMatrix, CudaError> {
        let buf = DeviceBuffer::new(&self.gpu, layout.bytes())?;
        self.gpu.upload(buf.ptr(), &layout.image(m))?;
        self.gpu.synchronize()?;
        self.fp8_widest_cols
            .fetch_max(layout.cols, Ordering::Relaxed);
        self.weight_bytes.fetch_add(buf.bytes(), Ordering::Relaxed);
        Ok(CudaMatrix {
            buf,
            rows: layout.rows,
            cols: layout.cols,
            packed: None,
            fp8: Some(layout),
        })
    }

    /// `out = x · wᵀ` over FP8 `w`: `x` quantized to E4M3 a row at a time (or with `w`'s static
    /// input scale), the E4M3 product through cuBLASLt in f32, then each output value times its
    /// row's input scale and its column's weight scale.
    fn gemm_fp8(
        &self,
        s: &mut State<G>,
        w: &CudaMatrix,
        layout: &Fp8Layout,
        x: &CudaActivations,
        out: &CudaActivations,
    ) {
        let (rows, k, n) = (x.rows, layout.cols, layout.rows);
        let Some(input) = self.scratch(
            "allocating the FP8 input",
            |s| &mut s.fp8_input,
            s,
            fp8_weights::input_bytes(rows, k),
        ) else {
            return;
        };
        let input_scales = input + fp8_weights::input_scales_offset(rows, k) as u64;
        self.launch(
            s,
            "quantize_rows_e4m3",
            ((rows as u32, 1, 1), fp8_weights::QUANTIZE_THREADS),
            &[
                Arg::Ptr(x.ptr),
                Arg::Ptr(input),
                Arg::Ptr(input_scales),
                i32_of(rows),
                i32_of(k),
                Arg::F32(layout.static_input_scale()),
            ],
        );
        if self.idle(s) {
            return;
        }
        s.pending = true;
        let r = self.gpu.fp8_gemm(&Gemm {
            w: w.buf.ptr(),
            x: input,
            out: out.ptr,
            rows,
            n,
            k,
            ld_out: n,
        });
        self.check("cublasLtMatmul (FP8)", r);
        self.launch(
            s,
            "fp8_scale_output",
            grid1(rows * n, 256),
            &[
                Arg::Ptr(out.ptr),
                Arg::Ptr(input_scales),
                Arg::Ptr(w.buf.ptr() + layout.scales_offset() as u64),
                i32_of(rows),
                i32_of(n),
            ],
        );
    }

    /// Ends a capture under way: the graph is kept and queued, so the step's work runs.
    fn finish_capture(&self, s: &mut State<G>) {
        let Mode::Capture(key) = s.mode else {
            return;
        };
        s.mode = Mode::Replay(key);
        let Some(graph) = self.check("ending the CUDA graph capture", self.gpu.end_capture())
        else {
            return;
        };
        if self
            .check("replaying the CUDA graph", self.gpu.replay(&graph))
            .is_some()
        {
            s.graphs.insert(key, (graph, s.arena.used));
        }
    }

    /// At the end of a replayed step's ops: the forward pass asked for the same activations as
    /// when the graph was captured, or the graph computed into other addresses.
    fn check_replay(&self, s: &State<G>) {
        if let Mode::Replay(key) = s.mode
            && let Some((_, used)) = s.graphs.get(&key)
            && *used != s.arena.used
        {
            self.check::<(), _>(
                "replaying a CUDA graph",
                Err(format!(
                    "the step's workspace differs from the captured one ({} bytes, captured {used})",
                    s.arena.used
                )),
            );
        }
    }

    /// Downloads `bytes` from `src` into the pinned landing buffer and waits for it: a step's
    /// one synchronization.
    fn download_and_wait(&self, s: &mut State<G>, src: DevicePtr, bytes: usize) -> Option<()> {
        self.finish_capture(s);
        self.check_replay(s);
        if self.failed() {
            return None;
        }
        self.check(
            "allocating pinned memory",
            grow_pinned(&*self.gpu, &mut s.download, bytes),
        )?;
        let landing = &mut s.download.as_mut().expect("grown").as_mut()[..bytes];
        self.check("copying to the host", self.gpu.download(landing, src))?;
        self.check("stream synchronize", self.gpu.synchronize())?;
        s.pending = false;
        Some(())
    }

    /// Starts a step: the workspace grown to what the last step asked for, the inputs packed and
    /// uploaded, and the mode chosen (eager, capture, or a graph replayed at once).
    fn start_step(
        &self,
        s: &mut State<G>,
        batch: &ForwardBatch,
    ) -> Option<(InputLayout, DevicePtr)> {
        if matches!(s.mode, Mode::Capture(_)) {
            // A step abandoned under capture (no download, no sync): end it.
            self.finish_capture(s);
        }
        s.mode = Mode::Eager;
        s.overflow.clear();
        if let Some(bytes) = s.arena.wanted() {
            let grown = grow(&self.gpu, &mut s.workspace, bytes);
            self.check("allocating the activation workspace", grown)?;
            s.arena.capacity = bytes;
            s.graphs.clear();
        }
        s.arena.reset();
        s.in_step = true;
        s.cast_holds = 0;
        let mut words = std::mem::take(&mut s.words);
        let layout = step::pack_inputs(batch, &s.buckets, s.scratch_block, &mut words);
        s.words = words;
        let bytes = layout.used * 4;
        let base = self.scratch("allocating the step inputs", |s| &mut s.inputs, s, bytes)?;
        self.check(
            "allocating pinned memory",
            grow_pinned(&*self.gpu, &mut s.staging, bytes),
        )?;
        let staging = s.staging.as_mut().expect("grown").as_mut();
        words_to_bytes(&s.words, &mut staging[..bytes]);
        self.check(
            "uploading the step",
            self.gpu.upload(base, &staging[..bytes]),
        )?;
        s.pending = true;
        if let (true, Some(key)) = (self.options().cuda_graphs, layout.graph) {
            if let Some((graph, _)) = s.graphs.get(&key) {
                self.check("replaying a CUDA graph", self.gpu.replay(graph))?;
                s.mode = Mode::Replay(key);
            } else if !s.seen.insert(key) {
                // Run once eagerly (buffers grown, cuBLAS warm), captured the second time.
                self.check("beginning a CUDA graph capture", self.gpu.begin_capture())?;
                s.mode = Mode::Capture(key);
            }
        }
        Some((layout, base))
    }

    /// The decode buckets up to `max` rows (from `reserve_step_memory`).
    #[cfg(test)]
    fn buckets(&self) -> Vec<usize> {
        self.state().buckets.clone()
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

/// The kernel of a KV cache's type: `bf16`, or `fp8` with the K and V scales appended to `args`
/// (every FP8 kernel takes them last).
fn kv_kernel(
    kv: &CudaKvStore,
    bf16: &'static str,
    fp8: &'static str,
    args: &mut Vec<Arg>,
) -> &'static str {
    if !kv.fp8() {
        return bf16;
    }
    args.extend([Arg::F32(FP8_KV_SCALE), Arg::F32(FP8_KV_SCALE)]);
    fp8
}

/// The geometry arguments both attention kernels take, in their order.
fn attention_geometry(layer: usize, kv: &CudaKvStore, shape: AttentionShape) -> [Arg; 7] {
    [
        i32_of(layer),
        i32_of(kv.physical_blocks()),
        i32_of(shape.num_heads),
        i32_of(shape.num_kv_heads),
        i32_of(kv.layout.block_size),
        i32_of(shape.head_dim),
        Arg::F32(1.0 / (shape.head_dim as f32).sqrt()),
    ]
}

impl<G: Gpu> Backend for GpuBackend<G> {
    type Matrix = CudaMatrix;
    type Vector = CudaVector;
    type Activations = CudaActivations;
    type KvStore = CudaKvStore;
    type Batch<'a> = CudaBatch<'a>;

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
            Some(KvDtype::Fp8E4m3) => {
                self.check_fp8_kv()?;
                Ok(KvDtype::Fp8E4m3)
            }
            Some(other) => Err(EngineError::Config(format!(
                "the CUDA KV cache stores bf16 or fp8, not {other} (--kv-dtype)"
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
        let packed = match self.options().packed_weights {
            true => PackedLayout::of(name, ty, rows, cols, bytes.len())?,
            false => None,
        };
        let uploaded = match packed {
            Some(layout) => self.upload_packed(layout, &bytes),
            None => self.upload_matrix(&bf16_matrix(ty, &bytes, rows * cols), rows, cols),
        };
        uploaded.map_err(|e| CudaError::Driver(format!("uploading {name}: {e}")).into())
    }

    fn load_stacked_matrix(&self, parts: &[RawTensor]) -> Result<Option<CudaMatrix>, EngineError> {
        let Some(first) = parts.first() else {
            return Ok(None);
        };
        if parts.iter().any(|t| t.cols != first.cols) {
            return Ok(None);
        }
        let packed = |t: &RawTensor| {
            self.options().packed_weights && packed_weights::kernels(t.ty).is_some()
        };
        if parts.iter().any(packed) {
            // Rows of whole blocks stack as bytes; parts of other formats load apart.
            if parts.iter().any(|t| t.ty != first.ty) {
                return Ok(None);
            }
            let mut bytes = Vec::new();
            for t in parts {
                PackedLayout::of(&t.name, t.ty, t.rows, t.cols, t.bytes.len())?;
                bytes.extend_from_slice(&t.bytes);
            }
            let rows = parts.iter().map(|t| t.rows).sum();
            let layout = PackedLayout::of(&first.name, first.ty, rows, first.cols, bytes.len())?
                .expect("a block format");
            return Ok(Some(self.upload_packed(layout, &bytes).map_err(|e| {
                CudaError::Driver(format!("uploading stacked matrices: {e}"))
            })?));
        }
        // Every part becomes bf16, whatever its stored type, so mixed types stack too.
        let mut values = Vec::new();
        for t in parts {
            values.extend(bf16_matrix(t.ty, &t.bytes, t.rows * t.cols));
        }
        let rows = parts.iter().map(|t| t.rows).sum();
        Ok(Some(
            self.upload_matrix(&values, rows, first.cols)
                .map_err(|e| CudaError::Driver(format!("uploading stacked matrices: {e}")))?,
        ))
    }

    /// Kept FP8 on a GPU of compute capability 8.9 or later; an error naming the matrix and the
    /// compute capability elsewhere.
    fn load_fp8_matrix(&self, m: Fp8Matrix) -> Result<CudaMatrix, EngineError> {
        self.gpu.fp8_products(&m.name)?;
        let layout = Fp8Layout::of(&m)?;
        Ok(self
            .upload_fp8(layout, &m)
            .map_err(|e| CudaError::Driver(format!("uploading {}: {e}", m.name)))?)
    }

    fn matrix_rows(&self, m: &CudaMatrix) -> usize {
        m.rows
    }

    fn load_vector(&self, values: Vec<f32>) -> Result<CudaVector, EngineError> {
        let upload = || -> Result<CudaVector, CudaError> {
            let buf = DeviceBuffer::new(&self.gpu, values.len() * 4)?;
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            self.gpu.upload(buf.ptr(), &bytes)?;
            self.gpu.synchronize()?;
            self.weight_bytes.fetch_add(buf.bytes(), Ordering::Relaxed);
            Ok(CudaVector { buf })
        };
        Ok(upload().map_err(|e| CudaError::Driver(format!("uploading a vector: {e}")))?)
    }

    fn kv_capacity_blocks(&self, block_bytes: usize) -> Option<usize> {
        let free = self.gpu.free_memory().ok()?;
        let bytes = (free as f64 * self.memory_fraction) as usize;
        // One block per layer more is the scratch block.
        Some((bytes / block_bytes.max(1)).saturating_sub(1))
    }

    fn alloc_kv(&self, layout: KvLayout) -> Result<CudaKvStore, EngineError> {
        match layout.dtype {
            KvDtype::Bf16 => {}
            KvDtype::Fp8E4m3 => self.check_fp8_kv()?,
            other => {
                return Err(EngineError::Config(format!(
                    "the CUDA KV cache stores bf16 or fp8, not {other}"
                )));
            }
        }
        let physical = KvLayout {
            num_blocks: layout.num_blocks + 1,
            ..layout
        };
        let bytes = physical.bytes();
        let fail = |e: CudaError| {
            CudaError::Driver(format!(
                "allocating the KV cache ({} MiB): {e}",
                bytes >> 20
            ))
        };
        let buf = DeviceBuffer::new(&self.gpu, bytes).map_err(fail)?;
        self.gpu
            .zero(buf.ptr(), bytes)
            .and_then(|()| self.gpu.synchronize())
            .map_err(fail)?;
        self.state().scratch_block = layout.num_blocks as u32;
        Ok(CudaKvStore { buf, layout })
    }

    fn kv_block_bytes(&self, kv: &CudaKvStore) -> usize {
        kv.chunk_bytes()
    }

    fn read_kv_block(&self, kv: &CudaKvStore, layer: usize, block: usize, out: &mut [u8]) {
        if self.failed() {
            return;
        }
        let r = self
            .gpu
            .download(out, kv.chunk_ptr(layer, block))
            .and_then(|()| self.gpu.synchronize());
        self.check("reading a KV block", r);
    }

    fn read_kv_blocks(&self, kv: &CudaKvStore, layer: usize, blocks: &[u32], out: &mut [u8]) {
        if self.failed() {
            return;
        }
        let chunks: Vec<u32> = blocks
            .iter()
            .map(|&b| kv.chunk_index(layer, b as usize) as u32)
            .collect();
        let r = self
            .gpu
            .gather_download(kv.base_ptr(), &chunks, kv.chunk_bytes(), out);
        self.check("reading a layer's KV blocks", r);
    }

    fn write_kv_block(&self, kv: &mut CudaKvStore, layer: usize, block: usize, data: &[u8]) {
        if self.failed() {
            return;
        }
        let r = self
            .gpu
            .upload(kv.chunk_ptr(layer, block), data)
            .and_then(|()| self.gpu.synchronize());
        self.check("writing a KV block", r);
    }

    /// With `--kv-load-stream on`, on the load stream: the engine holds the block's sequence
    /// out of the steps until [`Self::stored_writes_done`]. The source may be pageable memory,
    /// which the driver stages before the call returns, or a slot of the pinned host tier
    /// ([`Self::host_tier_memory`]), which the copy engine reads until the copy completes.
    fn write_stored_block(&self, kv: &mut CudaKvStore, block: usize, data: &[u8]) {
        let layer_bytes = self.kv_block_bytes(kv);
        if !self.options().load_stream {
            for (layer, part) in data.chunks_exact(layer_bytes).enumerate() {
                self.write_kv_block(kv, layer, block, part);
            }
            return;
        }
        for (layer, part) in data.chunks_exact(layer_bytes).enumerate() {
            if self.failed() {
                return;
            }
            let r = self
                .gpu
                .upload_on_load_stream(kv.chunk_ptr(layer, block), part);
            self.check("copying a KV block brought up from a tier below", r);
        }
    }

    fn host_tier_memory(&self, bytes: usize) -> Result<Box<dyn HostMemory>, EngineError> {
        if !self.options().host_pinned {
            return Ok(Box::new(vec![0u8; bytes]));
        }
        let pinned = self.gpu.alloc_pinned(bytes).map_err(|e| {
            EngineError::Device(format!(
                "--kv-host-pinned: page-locking {bytes} bytes for the host tier: {e}"
            ))
        })?;
        Ok(Box::new(PinnedTierMemory {
            gpu: self.gpu.clone(),
            bytes: pinned,
        }))
    }

    fn stored_writes_done(&self) -> bool {
        if self.failed() {
            return true; // nothing more runs; the step reports the failure
        }
        self.check("querying the KV block loads", self.gpu.loads_done())
            .unwrap_or(true)
    }

    fn finish_stored_writes(&self) -> Result<(), EngineError> {
        if !self.failed() {
            let r = self.gpu.synchronize_loads();
            self.check("waiting for the KV block loads", r);
        }
        self.status()
    }

    fn reserve_step_memory(&self, plan: &StepMemoryPlan<'_>) {
        let c = plan.config;
        let (rows, logit_rows) = (plan.max_rows.max(1), plan.max_logit_rows.max(1));
        let mut s = self.state();
        s.buckets = step::buckets(rows);
        let widest = [c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size]
            .into_iter()
            .max()
            .unwrap_or(0);
        let blocks_per_seq = c.max_position_embeddings.div_ceil(plan.block_size.max(1));
        // Every array of `step::pack_inputs`, each sequence with a whole context's table.
        let input_bytes = 4 * rows * (12 + blocks_per_seq);
        let logits_bytes = logit_rows * c.vocab_size * 4;
        let sampling_words = logit_rows * (sampling::PARAM_WORDS + c.vocab_size.div_ceil(32) + 64);
        let activation_bytes = step::arena_bytes(plan.activations);
        let reserved = (|| -> Result<(), CudaError> {
            grow(&self.gpu, &mut s.workspace, activation_bytes)?;
            grow(&self.gpu, &mut s.cast, rows * widest * 2)?;
            let tile = self.packed_tile_bytes.load(Ordering::Relaxed);
            if tile > 0 {
                grow(&self.gpu, &mut s.tile, tile)?;
            }
            let fp8_cols = self.fp8_widest_cols.load(Ordering::Relaxed);
            if fp8_cols > 0 {
                grow(
                    &self.gpu,
                    &mut s.fp8_input,
                    fp8_weights::input_bytes(rows, fp8_cols),
                )?;
            }
            // Decode attention of every row within one partition; longer contexts grow it.
            grow(
                &self.gpu,
                &mut s.partitions,
                rows * c.num_heads * (c.head_dim + 2) * 4,
            )?;
            grow(&self.gpu, &mut s.inputs, input_bytes)?;
            grow_pinned(&*self.gpu, &mut s.staging, input_bytes)?;
            grow_pinned(&*self.gpu, &mut s.download, logits_bytes)?;
            if self.options().device_sampling {
                grow(&self.gpu, &mut s.sampling_inputs, sampling_words * 4)?;
                grow_pinned(&*self.gpu, &mut s.sampling_staging, sampling_words * 4)?;
                grow(&self.gpu, &mut s.sampling_work, logits_bytes)?;
                grow(
                    &self.gpu,
                    &mut s.sampling_out,
                    logit_rows * sampling::OUT_WORDS * 4,
                )?;
            }
            Ok(())
        })();
        if self.check("reserving the step memory", reserved).is_some() {
            s.arena.capacity = activation_bytes;
        }
    }

    fn alloc(&self, rows: usize, cols: usize) -> CudaActivations {
        let bytes = rows * cols * 4;
        let mut guard = self.state();
        let s = &mut *guard;
        if s.in_step {
            if let (Some(offset), Some(ws)) = (s.arena.take(bytes), s.workspace.as_ref()) {
                return CudaActivations {
                    ptr: ws.ptr() + offset as u64,
                    rows,
                    cols,
                    _owned: None,
                };
            }
            if matches!(s.mode, Mode::Replay(_)) {
                // The captured step fitted; a replay that does not would compute elsewhere.
                self.check::<(), _>("a replayed step", Err("outgrew its workspace"));
            }
        }
        // Outside a step (benchmarks, checks) or past the workspace: memory of its own, zeroed.
        let owned = self.check(
            "allocating activations",
            DeviceBuffer::new(&self.gpu, bytes)
                .and_then(|b| self.gpu.zero(b.ptr(), bytes).map(|()| b)),
        );
        let ptr = owned.as_ref().map(DeviceBuffer::ptr).unwrap_or(0);
        CudaActivations {
            ptr,
            rows,
            cols,
            _owned: owned,
        }
    }

    fn alloc_zeroed(&self, rows: usize, cols: usize) -> CudaActivations {
        let x = self.alloc(rows, cols);
        let mut s = self.state();
        if !self.idle(&s) {
            s.pending = true;
            self.check("zeroing activations", self.gpu.zero(x.ptr, rows * cols * 4));
        }
        x
    }

    fn prepare_batch<'a>(&self, batch: &'a ForwardBatch) -> CudaBatch<'a> {
        let mut s = self.state();
        let (layout, base) = self
            .start_step(&mut s, batch)
            .unwrap_or((InputLayout::default(), 0));
        CudaBatch {
            forward: batch,
            layout,
            base,
        }
    }

    fn step_rows(&self, batch: &CudaBatch<'_>) -> StepRows {
        if self.failed() {
            // Nothing runs; the batch's own shape keeps the caller's arithmetic right.
            return StepRows {
                rows: batch.forward.num_rows(),
                logit_rows: batch.forward.logit_rows.len(),
            };
        }
        StepRows {
            rows: batch.layout.rows,
            logit_rows: batch.layout.logit_rows,
        }
    }

    fn embed(&self, table: &CudaMatrix, batch: &CudaBatch<'_>, out: &mut CudaActivations) {
        let mut s = self.state();
        let kernel = match &table.packed {
            Some(p) => p.kernels().embed_rows,
            None => "embed_rows",
        };
        self.launch(
            &mut s,
            kernel,
            per_row(batch.layout.rows, 256),
            &[
                Arg::Ptr(table.buf.ptr()),
                batch.at(batch.layout.tokens),
                Arg::Ptr(out.ptr),
                i32_of(table.cols),
            ],
        );
    }

    fn rms_norm(&self, x: &CudaActivations, w: &CudaVector, eps: f32, out: &mut CudaActivations) {
        self.norm(x, None, w, eps, out);
    }

    fn head_rms_norm(&self, x: &mut CudaActivations, w: &CudaVector, head_dim: usize, eps: f32) {
        // The row kernel over `rows × heads` rows of `head_dim`, into a buffer taken in x's place.
        let heads = x.cols / head_dim;
        let mut normed = self.alloc(x.rows, x.cols);
        let mut s = self.state();
        self.launch(
            &mut s,
            "rms_norm",
            per_row(x.rows * heads, 256),
            &[
                Arg::Ptr(x.ptr),
                Arg::Ptr(w.buf.ptr()),
                Arg::Ptr(normed.ptr),
                Arg::Ptr(0),
                i32_of(head_dim),
                Arg::F32(eps),
            ],
        );
        std::mem::swap(x, &mut normed);
    }

    fn add_rms_norm(
        &self,
        x: &mut CudaActivations,
        delta: &CudaActivations,
        w: &CudaVector,
        eps: f32,
        out: &mut CudaActivations,
    ) {
        self.norm(x, Some(delta), w, eps, out);
    }

    fn matmul(&self, w: &CudaMatrix, x: &CudaActivations, out: &mut CudaActivations) {
        let mut s = self.state();
        self.gemm(&mut s, w, x, out);
    }

    fn split_cols(&self, x: &CudaActivations, parts: &mut [&mut CudaActivations]) {
        let mut s = self.state();
        let mut start = 0;
        for p in parts.iter_mut() {
            self.launch(
                &mut s,
                "copy_cols",
                grid1(x.rows * p.cols, 256),
                &[
                    Arg::Ptr(x.ptr),
                    i32_of(x.rows),
                    i32_of(x.cols),
                    i32_of(start),
                    i32_of(p.cols),
                    Arg::Ptr(p.ptr),
                ],
            );
            start += p.cols;
        }
    }

    fn add_bias(&self, x: &mut CudaActivations, bias: &CudaVector) {
        let mut s = self.state();
        self.launch(
            &mut s,
            "add_bias_rows",
            grid1(x.rows * x.cols, 256),
            &[
                Arg::Ptr(x.ptr),
                Arg::Ptr(bias.buf.ptr()),
                i32_of(x.rows),
                i32_of(x.cols),
            ],
        );
    }

    fn rope(
        &self,
        x: &mut CudaActivations,
        head_dim: usize,
        inv_freq: &CudaVector,
        attention_factor: f32,
        batch: &CudaBatch<'_>,
    ) {
        let heads = x.cols / head_dim;
        let mut s = self.state();
        self.launch(
            &mut s,
            "rope_rotate_half",
            ((x.rows as u32, heads as u32, 1), (head_dim / 2) as u32),
            &[
                Arg::Ptr(x.ptr),
                batch.at(batch.layout.positions),
                Arg::Ptr(inv_freq.buf.ptr()),
                i32_of(heads),
                i32_of(head_dim),
                Arg::F32(attention_factor),
            ],
        );
    }

    fn write_kv(
        &self,
        kv: &mut CudaKvStore,
        layer: usize,
        k: &CudaActivations,
        v: &CudaActivations,
        batch: &CudaBatch<'_>,
    ) {
        let l = kv.layout;
        let mut s = self.state();
        let mut args = vec![
            Arg::Ptr(kv.base_ptr()),
            Arg::Ptr(k.ptr),
            Arg::Ptr(v.ptr),
            batch.at(batch.layout.slots),
            i32_of(layer),
            i32_of(kv.physical_blocks()),
            i32_of(l.num_kv_heads),
            i32_of(l.block_size),
            i32_of(l.head_dim),
        ];
        let kernel = kv_kernel(kv, "write_kv", "write_kv_fp8", &mut args);
        self.launch(&mut s, kernel, per_row(k.rows, 128), &args);
    }

    #[allow(clippy::too_many_arguments)]
    fn qkv_rope_write_kv(
        &self,
        qkv: &CudaActivations,
        q: &mut CudaActivations,
        k: &mut CudaActivations,
        v: &mut CudaActivations,
        kv: &mut CudaKvStore,
        layer: usize,
        shape: AttentionShape,
        inv_freq: &CudaVector,
        attention_factor: f32,
        batch: &CudaBatch<'_>,
    ) {
        if !self.options().fused_kernels {
            self.split_cols(qkv, &mut [&mut *q, &mut *k, &mut *v]);
            self.rope(q, shape.head_dim, inv_freq, attention_factor, batch);
            self.rope(k, shape.head_dim, inv_freq, attention_factor, batch);
            return self.write_kv(kv, layer, k, v, batch);
        }
        let l = kv.layout;
        let mut s = self.state();
        let mut args = vec![
            Arg::Ptr(qkv.ptr),
            Arg::Ptr(q.ptr),
            Arg::Ptr(kv.base_ptr()),
            batch.at(batch.layout.positions),
            batch.at(batch.layout.slots),
            Arg::Ptr(inv_freq.buf.ptr()),
            i32_of(layer),
            i32_of(kv.physical_blocks()),
            i32_of(shape.num_heads),
            i32_of(shape.num_kv_heads),
            i32_of(l.block_size),
            i32_of(shape.head_dim),
            Arg::F32(attention_factor),
        ];
        let kernel = kv_kernel(kv, "qkv_rope_write_kv", "qkv_rope_write_kv_fp8", &mut args);
        self.launch(
            &mut s,
            kernel,
            (
                (
                    qkv.rows as u32,
                    (shape.num_heads + 2 * shape.num_kv_heads) as u32,
                    1,
                ),
                (shape.head_dim / 2) as u32,
            ),
            &args,
        );
    }

    fn attention(
        &self,
        q: &CudaActivations,
        kv: &CudaKvStore,
        layer: usize,
        shape: AttentionShape,
        batch: &CudaBatch<'_>,
        out: &mut CudaActivations,
    ) {
        let l = &batch.layout;
        let geometry = attention_geometry(layer, kv, shape);
        let mut s = self.state();
        if l.decode_rows > 0 {
            let parts = l.partitions;
            let stats = l.decode_rows * shape.num_heads * parts;
            // Every entry a launch reads is written first (empty partitions too), so the
            // buffer is reused as it is: [out: stats × head_dim][max: stats][sum: stats].
            let bytes = stats * (shape.head_dim + 2) * 4;
            let Some(part) =
                self.scratch("attention scratch", |s| &mut s.partitions, &mut s, bytes)
            else {
                return;
            };
            let part_out = part;
            let part_max = part + (stats * shape.head_dim * 4) as u64;
            let part_sum = part_max + (stats * 4) as u64;
            let mut args = vec![
                Arg::Ptr(q.ptr),
                Arg::Ptr(kv.base_ptr()),
                batch.at(l.decode_row_ids),
                batch.at(l.row_seq),
                batch.at(l.positions),
                Arg::Ptr(batch.base),
                batch.at(l.table_offsets),
            ];
            args.extend(geometry);
            args.extend([
                i32_of(parts),
                Arg::Ptr(part_out),
                Arg::Ptr(part_max),
                Arg::Ptr(part_sum),
            ]);
            let kernel = kv_kernel(
                kv,
                "paged_attention_partial",
                "paged_attention_partial_fp8",
                &mut args,
            );
            self.launch(
                &mut s,
                kernel,
                (
                    (
                        l.decode_rows as u32,
                        shape.num_kv_heads as u32,
                        parts as u32,
                    ),
                    128,
                ),
                &args,
            );
            // The bf16 copy only when every row is a decode row (all of `out` written).
            let copy = match l.prefill_seqs {
                0 => self.bf16_copy(&mut s, out.rows * out.cols),
                _ => Arg::Ptr(0),
            };
            self.launch(
                &mut s,
                "paged_attention_reduce",
                (
                    (l.decode_rows as u32, shape.num_heads as u32, 1),
                    shape.head_dim as u32,
                ),
                &[
                    Arg::Ptr(part_out),
                    Arg::Ptr(part_max),
                    Arg::Ptr(part_sum),
                    batch.at(l.decode_row_ids),
                    batch.at(l.positions),
                    i32_of(shape.num_heads),
                    i32_of(shape.head_dim),
                    i32_of(parts),
                    Arg::Ptr(out.ptr),
                    copy,
                ],
            );
            if l.prefill_seqs == 0 {
                self.cast_written(&mut s, out);
            }
        }
        if l.prefill_seqs > 0 {
            let max_len = batch
                .forward
                .seqs
                .iter()
                .map(|seq| seq.len)
                .filter(|&n| n > 1)
                .max()
                .unwrap_or(0);
            let mut args = vec![
                Arg::Ptr(q.ptr),
                Arg::Ptr(kv.base_ptr()),
                batch.at(l.prefill_row_start),
                batch.at(l.prefill_len),
                batch.at(l.prefill_start_pos),
                Arg::Ptr(batch.base),
                batch.at(l.prefill_table_offsets),
            ];
            args.extend(geometry);
            args.push(Arg::Ptr(out.ptr));
            let seqs = l.prefill_seqs as u32;
            let heads = shape.num_heads as u32;
            // One entry point per padded head size (each with its own registers).
            match self.options().prefill_attention {
                PrefillAttention::Legacy => {
                    let (kernel, kernel_fp8) = if shape.head_dim <= 64 {
                        ("prefill_attention_hd64", "prefill_attention_fp8_hd64")
                    } else if shape.head_dim <= 128 {
                        ("prefill_attention_hd128", "prefill_attention_fp8_hd128")
                    } else {
                        ("prefill_attention_hd256", "prefill_attention_fp8_hd256")
                    };
                    let kernel = kv_kernel(kv, kernel, kernel_fp8, &mut args);
                    let tiles = max_len.div_ceil(kernels::PREFILL_BLOCK_M) as u32;
                    let grid = ((tiles, heads, seqs), kernels::PREFILL_THREADS);
                    self.launch(&mut s, kernel, grid, &args);
                }
                // The heads first in the grid: every head of a query tile runs at once.
                PrefillAttention::Fa => {
                    let e = kernels::fa_entry(shape.head_dim);
                    let kernel = kv_kernel(kv, e.kernel, e.kernel_fp8, &mut args);
                    let tiles = max_len.div_ceil(e.block_m) as u32;
                    let grid = ((heads, tiles, seqs), kernels::FA_THREADS);
                    self.launch_shared(&mut s, kernel, grid, e.smem_bytes, &args);
                }
            }
        }
    }

    fn silu_mul(&self, gate: &mut CudaActivations, up: &CudaActivations) {
        let n = gate.rows * gate.cols;
        let mut s = self.state();
        self.launch(
            &mut s,
            "silu_mul",
            grid1(n, 256),
            &[Arg::Ptr(gate.ptr), Arg::Ptr(up.ptr), Arg::U64(n as u64)],
        );
    }

    fn silu_mul_stacked(&self, gate_up: &CudaActivations, out: &mut CudaActivations) {
        let (rows, inter) = (gate_up.rows, gate_up.cols / 2);
        let n = rows * inter;
        let mut s = self.state();
        let Some(xb) = self.cast_buffer(&mut s, n) else {
            return;
        };
        self.launch(
            &mut s,
            "silu_mul_stacked",
            grid1(n, 256),
            &[
                Arg::Ptr(gate_up.ptr),
                Arg::Ptr(out.ptr),
                Arg::Ptr(xb),
                i32_of(rows),
                i32_of(inter),
            ],
        );
        // `out` goes to the down projection next, which now needs no cast.
        s.cast_holds = out.ptr;
    }

    fn add(&self, x: &mut CudaActivations, y: &CudaActivations) {
        let n = x.rows * x.cols;
        let mut s = self.state();
        self.launch(
            &mut s,
            "add_inplace",
            grid1(n, 256),
            &[Arg::Ptr(x.ptr), Arg::Ptr(y.ptr), Arg::U64(n as u64)],
        );
    }

    fn gather_logit_rows(
        &self,
        x: &CudaActivations,
        batch: &CudaBatch<'_>,
        out: &mut CudaActivations,
    ) {
        let mut s = self.state();
        self.launch(
            &mut s,
            "gather_rows",
            per_row(batch.layout.logit_rows, 256),
            &[
                Arg::Ptr(x.ptr),
                batch.at(batch.layout.logit_row_ids),
                Arg::Ptr(out.ptr),
                i32_of(x.cols),
            ],
        );
    }

    fn gather_rows(&self, x: &CudaActivations, rows: &[usize], out: &mut CudaActivations) {
        // Rows chosen on the host mid-step (a mixture's experts; refused on this backend until it
        // has run on a GPU, see `check_model`): uploaded here, in memory of their own.
        let ids: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let Some(ids) = self.upload_words("uploading rows", &ids) else {
            return;
        };
        let mut s = self.state();
        self.launch(
            &mut s,
            "gather_rows",
            per_row(rows.len(), 256),
            &[
                Arg::Ptr(x.ptr),
                Arg::Ptr(ids.ptr()),
                Arg::Ptr(out.ptr),
                i32_of(x.cols),
            ],
        );
        s.overflow.push(ids);
    }

    fn scatter_add_rows(
        &self,
        out: &mut CudaActivations,
        y: &CudaActivations,
        rows: &[usize],
        weights: &[f32],
    ) {
        let ids: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let bits: Vec<u32> = weights.iter().map(|w| w.to_bits()).collect();
        let (Some(ids), Some(weights)) = (
            self.upload_words("uploading rows", &ids),
            self.upload_words("uploading weights", &bits),
        ) else {
            return;
        };
        let mut s = self.state();
        self.launch(
            &mut s,
            "scatter_add_rows",
            per_row(rows.len(), 256),
            &[
                Arg::Ptr(out.ptr),
                Arg::Ptr(y.ptr),
                Arg::Ptr(ids.ptr()),
                Arg::Ptr(weights.ptr()),
                i32_of(out.cols),
            ],
        );
        s.overflow.extend([ids, weights]);
    }

    fn to_host(&self, x: CudaActivations) -> Vec<f32> {
        let n = x.rows * x.cols;
        let mut host = vec![0f32; n];
        let mut s = self.state();
        if self.download_and_wait(&mut s, x.ptr, n * 4).is_some() {
            let landing = &s.download.as_ref().expect("grown").as_ref()[..n * 4];
            for (h, b) in host.iter_mut().zip(landing.chunks_exact(4)) {
                *h = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        host
    }

    fn samples_on_device(&self) -> bool {
        self.options().device_sampling
    }

    fn sample(
        &self,
        logits: CudaActivations,
        vocab: usize,
        rows: &[RowSampling<'_>],
    ) -> Vec<Sampled> {
        let mut s = self.state();
        self.finish_capture(&mut s);
        self.check_replay(&s);
        // The sampling kernel runs after the step's graph, eagerly: its inputs (penalties,
        // grammar bitmaps) vary in length from step to step.
        s.mode = Mode::Eager;
        let m = rows.len();
        let mut packed = std::mem::take(&mut s.packed);
        packed.pack(rows);
        let (params, pen, allowed) = (
            packed.params.len(),
            packed.penalized.len(),
            packed.allowed.len(),
        );
        let words = params + pen + allowed;
        let out_bytes = m * sampling::OUT_WORDS * 4;
        let ready = (|| {
            let at = self.scratch(
                "allocating sampling inputs",
                |s| &mut s.sampling_inputs,
                &mut s,
                words * 4,
            )?;
            let work = self.scratch(
                "allocating sampling scratch",
                |s| &mut s.sampling_work,
                &mut s,
                m * vocab * 4,
            )?;
            let out = self.scratch(
                "allocating sampling output",
                |s| &mut s.sampling_out,
                &mut s,
                out_bytes,
            )?;
            self.check(
                "allocating pinned memory",
                grow_pinned(&*self.gpu, &mut s.sampling_staging, words * 4),
            )?;
            let staging = s.sampling_staging.as_mut().expect("grown").as_mut();
            words_to_bytes(&packed.params, &mut staging[..params * 4]);
            words_to_bytes(
                &packed.penalized,
                &mut staging[params * 4..(params + pen) * 4],
            );
            words_to_bytes(&packed.allowed, &mut staging[(params + pen) * 4..words * 4]);
            if !self.failed() {
                self.check(
                    "uploading sampling inputs",
                    self.gpu.upload(at, &staging[..words * 4]),
                )?;
            }
            Some((at, work, out))
        })();
        s.packed = packed;
        let Some((at, work, out)) = ready else {
            return vec![
                Sampled {
                    token: 0,
                    logprobs: None
                };
                m
            ];
        };
        self.launch(
            &mut s,
            "sample_rows",
            ((m as u32, 1, 1), sampling::THREADS),
            &[
                Arg::Ptr(logits.ptr),
                Arg::Ptr(work),
                i32_of(vocab),
                Arg::Ptr(at),
                Arg::Ptr(at + (params * 4) as u64),
                Arg::Ptr(at + ((params + pen) * 4) as u64),
                Arg::Ptr(out),
            ],
        );
        if self.download_and_wait(&mut s, out, out_bytes).is_none() {
            return vec![
                Sampled {
                    token: 0,
                    logprobs: None
                };
                m
            ];
        }
        let landing = &s.download.as_ref().expect("grown").as_ref()[..out_bytes];
        let words: Vec<u32> = landing
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        sampling::unpack(&words, rows)
    }

    fn status(&self) -> Result<(), EngineError> {
        match self.failure.lock().expect("failure lock").as_ref() {
            None => Ok(()),
            Some(f) => Err(EngineError::Device(format!("CUDA device: {f}"))),
        }
    }

    fn sync(&self) -> Result<(), EngineError> {
        let mut s = self.state();
        self.finish_capture(&mut s);
        self.check_replay(&s);
        if s.pending && !self.failed() {
            self.check("stream synchronize", self.gpu.synchronize());
        }
        s.pending = false;
        s.in_step = false;
        s.mode = Mode::Eager;
        s.overflow.clear();
        drop(s);
        self.status()
    }
}

impl<G: Gpu> GpuBackend<G> {
    /// RMSNorm of `x`'s rows into `out`, `x += delta` first (written back) when given; with
    /// fused kernels `out`'s bf16 copy beside it.
    fn norm(
        &self,
        x: &CudaActivations,
        delta: Option<&CudaActivations>,
        w: &CudaVector,
        eps: f32,
        out: &CudaActivations,
    ) {
        let mut s = self.state();
        let copy = self.bf16_copy(&mut s, out.rows * out.cols);
        let mut args = vec![Arg::Ptr(x.ptr)];
        let kernel = match delta {
            Some(d) => {
                args.push(Arg::Ptr(d.ptr));
                "add_rms_norm"
            }
            None => "rms_norm",
        };
        args.extend([
            Arg::Ptr(w.buf.ptr()),
            Arg::Ptr(out.ptr),
            copy,
            i32_of(x.cols),
            Arg::F32(eps),
        ]);
        self.launch(&mut s, kernel, per_row(x.rows, 256), &args);
        self.cast_written(&mut s, out);
    }

    /// Words in memory of their own, uploaded and waited for (outside the step's inputs).
    fn upload_words(&self, what: &str, words: &[u32]) -> Option<DeviceBuffer> {
        let buf = self.check(what, DeviceBuffer::new(&self.gpu, words.len() * 4))?;
        let mut bytes = vec![0u8; words.len() * 4];
        words_to_bytes(words, &mut bytes);
        self.check(
            what,
            self.gpu
                .upload(buf.ptr(), &bytes)
                .and_then(|()| self.gpu.synchronize()),
        )?;
        Some(buf)
    }
}

#[cfg(feature = "cuda")]
pub use crate::cuda_gpu::CudaBackend;

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::recording_gpu::{Event, RecordingGpu};
    use duet_engine::batch::{LogitsWanted, SeqInput};
    use duet_engine::llama::Llama;
    use duet_model::fp8::Quantization;
    use duet_model::params::SamplingParams;

    fn fixtures() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
    }

    fn fixture(name: &str) -> ModelConfig {
        ModelConfig::from_hf_config_file(&fixtures().join(name).join("config.json")).unwrap()
    }

    /// The FP8 products of a step's events, with the arguments of the kernels around them.
    fn fp8_products(gpu: &RecordingGpu, events: &[Event]) -> Vec<(Gemm, Vec<Arg>, Vec<Arg>)> {
        let gemms: Vec<Gemm> = events
            .iter()
            .filter_map(|e| match e {
                Event::Fp8Gemm(g) => Some(*g),
                _ => None,
            })
            .collect();
        let quantized = gpu.take_args("quantize_rows_e4m3");
        let scaled = gpu.take_args("fp8_scale_output");
        assert_eq!((quantized.len(), scaled.len()), (gemms.len(), gemms.len()));
        gemms
            .into_iter()
            .zip(quantized)
            .zip(scaled)
            .map(|((g, q), s)| (g, q, s))
            .collect()
    }

    /// An FP8 checkpoint (and `--quantization fp8`) stays FP8 on the device: a byte a weight and
    /// four a row, so the layers' projections take half of bf16's memory. Each product of a
    /// decode step is its input quantized a row at a time into the scratch the FP8 GEMM reads,
    /// cuBLASLt's FP8 GEMM of the projection's shape, and the output scaled by the input's row
    /// scales and the weight's (stored after its E4M3 bytes); the output projection stays a bf16
    /// product, and the step still allocates nothing and waits once.
    #[test]
    fn fp8_weights_stay_fp8_and_multiply_through_cublaslt() {
        let bf16 = Rig::new(GpuOptions::default());
        let quantized = Rig::synthetic(GpuOptions::default(), QuantType::BF16, Quantization::Fp8);
        let c = bf16.model.config().clone();
        let (h, q, kv, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let shapes = [(q + 2 * kv, h), (h, q), (2 * f, h), (h, f)];
        let weights: usize = c.num_layers * shapes.iter().map(|(r, c)| r * c).sum::<usize>();
        let rows: usize = c.num_layers * shapes.iter().map(|(r, _)| r).sum::<usize>();
        assert_eq!(
            quantized.model.backend().weight_bytes(),
            bf16.model.backend().weight_bytes() - 2 * weights + weights + 4 * rows
        );
        for mut rig in [
            quantized,
            Rig::from_file(GpuOptions::default(), "tiny-llama-fp8"),
        ] {
            for _ in 0..2 {
                let events = rig.decode(3, 20);
                assert_eq!(count(&events, |e| matches!(e, Event::Alloc(_))), 0);
                assert_eq!(count(&events, |e| *e == Event::Synchronize), 1);
                assert_eq!(count(&events, |e| matches!(e, Event::Gemm(_))), 1);
                let products = fp8_products(&rig.gpu, &events);
                assert_eq!(products.len(), 4 * c.num_layers);
                for (i, (g, quantize, scale)) in products.iter().enumerate() {
                    assert_eq!((g.n, g.k), shapes[i % 4], "product {i}");
                    assert_eq!(g.rows, products[0].0.rows);
                    let scales_at = g.x + fp8_weights::input_scales_offset(g.rows, g.k) as u64;
                    let weight_scales = g.w + (g.n * g.k).next_multiple_of(16) as u64;
                    assert_eq!(
                        quantize[1..],
                        [
                            Arg::Ptr(g.x),
                            Arg::Ptr(scales_at),
                            i32_of(g.rows),
                            i32_of(g.k),
                            Arg::F32(0.0)
                        ]
                    );
                    assert_eq!(
                        scale[..],
                        [
                            Arg::Ptr(g.out),
                            Arg::Ptr(scales_at),
                            Arg::Ptr(weight_scales),
                            i32_of(g.rows),
                            i32_of(g.n)
                        ]
                    );
                }
            }
        }
    }

    /// A checkpoint's static input scale quantizes every input row with it (the largest of the
    /// stacked parts'), for any number of rows.
    #[test]
    fn a_static_input_scale_reaches_the_quantizing_kernel() {
        let gpu = Arc::new(RecordingGpu::default());
        let b = GpuBackend::with_gpu(gpu.clone(), GpuOptions::default(), 0.5);
        let part = |name: &str, input_scale| {
            Fp8Matrix::new(
                name,
                16,
                48,
                WeightBytes::from_vec(vec![0x38; 16 * 48]),
                vec![0.5; 16],
                input_scale,
            )
            .unwrap()
        };
        let stacked = Fp8Matrix::stack(&[part("q", Some(0.25)), part("k", Some(2.0))]).unwrap();
        let m = b.load_fp8_matrix(stacked).unwrap();
        assert_eq!(m.fp8().map(|l| (l.rows, l.cols)), Some((32, 48)));
        for rows in [1, 40] {
            let x = b
                .upload_activations(rows, 48, &vec![1.0; rows * 48])
                .unwrap();
            let mut out = b.alloc(rows, 32);
            b.matmul(&m, &x, &mut out);
            let events = gpu.take();
            let products = fp8_products(&gpu, &events);
            assert_eq!(products.len(), 1);
            let (g, quantize, _) = &products[0];
            assert_eq!((g.rows, g.n, g.k, g.w), (rows, 32, 48, m.buf.ptr()));
            assert_eq!(quantize[5], Arg::F32(2.0));
            b.sync().unwrap();
        }
    }

    /// FP8 weights on a GPU without FP8 products (below compute capability 8.9) are an error
    /// naming the matrix and the compute capability, at load; bf16 weights load there.
    #[test]
    fn fp8_weights_on_a_gpu_without_fp8_are_named() {
        let load = |quantization| {
            let gpu = Arc::new(RecordingGpu::with_compute_capability((8, 6)));
            let backend = GpuBackend::with_gpu(gpu, GpuOptions::default(), 0.5);
            Llama::synthetic(
                backend,
                fixture("tiny-llama"),
                QuantType::BF16,
                quantization,
                3,
            )
        };
        let Err(e) = load(Quantization::Fp8) else {
            panic!("FP8 weights loaded on a GPU of compute capability 8.6");
        };
        let e = e.to_string();
        assert!(
            e.contains("blk.0.attn_q.weight") && e.contains("8.9") && e.contains("is 8.6"),
            "{e}"
        );
        assert!(load(Quantization::None).is_ok());
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

    /// The tiny fixture's shapes (and a longer context), random weights, on a recording GPU; a KV
    /// store of 256 blocks and the step memory reserved for 16 rows, as `ModelRunner::load` does.
    struct Rig {
        gpu: Arc<RecordingGpu>,
        model: Llama<GpuBackend<RecordingGpu>>,
        kv: CudaKvStore,
    }

    const BLOCK: usize = 16;
    const BLOCKS: usize = 256;

    impl Rig {
        fn new(options: GpuOptions) -> Self {
            Self::synthetic(options, QuantType::BF16, Quantization::None)
        }

        /// The tiny fixture's shapes with random weights stored as `ty`, the layers'
        /// projections quantized as `quantization` asks.
        fn synthetic(options: GpuOptions, ty: QuantType, quantization: Quantization) -> Self {
            let gpu = Arc::new(RecordingGpu::default());
            let backend = GpuBackend::with_gpu(gpu.clone(), options, 0.5);
            // Contexts past one 512-token attention partition.
            let config = ModelConfig {
                max_position_embeddings: 4096,
                ..fixture("tiny-llama")
            };
            let model = Llama::synthetic(backend, config, ty, quantization, 3).unwrap();
            Self::ready(gpu, model)
        }

        /// The model of a fixture's file (`tests/fixtures/<name>`).
        fn from_file(options: GpuOptions, name: &str) -> Self {
            let gpu = Arc::new(RecordingGpu::default());
            let backend = GpuBackend::with_gpu(gpu.clone(), options, 0.5);
            let files = duet_model::model_files::open_model(&fixtures().join(name)).unwrap();
            Self::ready(gpu, Llama::load(backend, &files).unwrap())
        }

        /// A KV store and the step memory reserved for 16 rows, as `ModelRunner::load` does.
        fn ready(gpu: Arc<RecordingGpu>, model: Llama<GpuBackend<RecordingGpu>>) -> Self {
            Self::ready_with(gpu, model, KvDtype::Bf16)
        }

        /// The tiny fixture's shapes, bf16 weights, an FP8 KV cache.
        fn fp8_kv(options: GpuOptions) -> Self {
            let rig = Self::new(options);
            Self::ready_with(rig.gpu, rig.model, KvDtype::Fp8E4m3)
        }

        fn ready_with(
            gpu: Arc<RecordingGpu>,
            model: Llama<GpuBackend<RecordingGpu>>,
            dtype: KvDtype,
        ) -> Self {
            let kv = model
                .backend()
                .alloc_kv(model.kv_layout(BLOCK, BLOCKS, dtype))
                .unwrap();
            model.reserve_step_memory(16, BLOCK);
            gpu.take();
            Self { gpu, model, kv }
        }

        /// One decode step of `n` sequences at `context` tokens; the events it caused.
        fn decode(&mut self, n: usize, context: usize) -> Vec<Event> {
            let per_seq = (context + 1).div_ceil(BLOCK);
            let tables: Vec<Vec<u32>> = (0..n)
                .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
                .collect();
            let tokens: Vec<[u32; 1]> = (0..n as u32).map(|t| [t + 1]).collect();
            let inputs: Vec<SeqInput<'_>> = tables
                .iter()
                .zip(&tokens)
                .map(|(table, t)| SeqInput {
                    tokens: t,
                    start_pos: context,
                    block_table: table,
                    logits: LogitsWanted::Last,
                })
                .collect();
            let (logit_rows, events) = self.step(&inputs);
            assert_eq!(logit_rows, n, "padded rows are not returned");
            events
        }

        /// One step of `inputs`: the logit rows it returned and the events it caused.
        fn step(&mut self, inputs: &[SeqInput<'_>]) -> (usize, Vec<Event>) {
            let c = self.model.config();
            let batch = ForwardBatch::new(
                inputs,
                BLOCK,
                BLOCKS,
                c.vocab_size,
                c.max_position_embeddings,
            )
            .unwrap();
            let logits = self
                .model
                .forward(&batch, &mut self.kv, &mut |_, _| {})
                .unwrap();
            (logits.num_rows(), self.gpu.take())
        }
    }

    fn count(events: &[Event], f: impl Fn(&Event) -> bool) -> usize {
        events.iter().filter(|e| f(e)).count()
    }

    fn launches(events: &[Event]) -> usize {
        count(events, |e| matches!(e, Event::Launch(_) | Event::Gemm(_)))
    }

    /// After start-up, a decode step allocates nothing, uploads its inputs once, downloads its
    /// logits once and waits once; padded to its bucket.
    #[test]
    fn a_decode_step_allocates_nothing_and_synchronizes_once() {
        let mut rig = Rig::new(GpuOptions::default());
        for _ in 0..3 {
            let events = rig.decode(3, 20);
            assert_eq!(
                count(&events, |e| matches!(
                    e,
                    Event::Alloc(_) | Event::AllocPinned(_)
                )),
                0,
                "{events:?}"
            );
            assert_eq!(
                count(&events, |e| matches!(e, Event::Upload(_))),
                1,
                "{events:?}"
            );
            assert_eq!(count(&events, |e| matches!(e, Event::Download(_))), 1);
            assert_eq!(
                count(&events, |e| *e == Event::Synchronize),
                1,
                "{events:?}"
            );
            // The products run on the bucket's 4 rows.
            assert!(
                events
                    .iter()
                    .all(|e| !matches!(e, Event::Gemm(g) if g.rows != 4))
            );
        }
    }

    /// With graphs on: the first step of a shape runs eagerly, the second is captured (and its
    /// graph replayed), later ones only replay; all with one upload and one wait.
    #[test]
    fn graphs_are_captured_once_per_bucket_and_replayed() {
        let mut rig = Rig::new(GpuOptions {
            cuda_graphs: true,
            ..Default::default()
        });
        let eager = rig.decode(3, 20);
        assert!(launches(&eager) > 0 && !eager.contains(&Event::BeginCapture));
        let captured = rig.decode(4, 30); // the same bucket (4) and partitions (1)
        let brackets: Vec<Event> = captured
            .iter()
            .filter(|e| {
                matches!(
                    e,
                    Event::BeginCapture | Event::EndCapture(_) | Event::Replay
                )
            })
            .cloned()
            .collect();
        // The graph holds the eager step's launches, all of them.
        assert_eq!(
            brackets,
            vec![
                Event::BeginCapture,
                Event::EndCapture(launches(&eager)),
                Event::Replay
            ]
        );
        for _ in 0..2 {
            let replayed = rig.decode(3, 40);
            assert_eq!(launches(&replayed), 0, "{replayed:?}");
            assert_eq!(count(&replayed, |e| *e == Event::Replay), 1);
            assert_eq!(count(&replayed, |e| matches!(e, Event::Upload(_))), 1);
            assert_eq!(count(&replayed, |e| *e == Event::Synchronize), 1);
            assert_eq!(
                count(&replayed, |e| matches!(
                    e,
                    Event::Alloc(_) | Event::AllocPinned(_)
                )),
                0
            );
        }
        // Another bucket starts over: eager first.
        assert!(launches(&rig.decode(7, 20)) > 0);
        // A longer context is another partition class: eager first too.
        assert!(launches(&rig.decode(3, 600)) > 0);
    }

    /// Launches of one decode step, per layer and in all, fused kernels off and on (the counts
    /// the issue asks for, from the code path itself). Tiny fixture: stacked QKV and gate/up, no
    /// biases.
    #[test]
    fn fused_kernels_cut_a_decode_step_s_launches() {
        let per_step = |fused: bool| {
            let mut rig = Rig::new(GpuOptions {
                fused_kernels: fused,
                ..Default::default()
            });
            rig.decode(2, 20);
            let events = rig.decode(2, 20);
            (launches(&events), rig.model.config().num_layers)
        };
        let (unfused, layers) = per_step(false);
        let (fused, _) = per_step(true);
        println!(
            "decode step launches (kernels + cuBLAS calls), {layers} layers: unfused {unfused}, fused {fused}"
        );
        // Per layer unfused: cast, QKV, 3 copies, 2 RoPE, KV write, attention ×2, cast, O,
        // add+norm, cast, gate/up, SiLU, down, add+norm = 18; fused: QKV, QKV→RoPE→KV,
        // attention ×2, O, add+norm, gate/up, SiLU, down, add+norm = 10. Per step: embedding,
        // first norm, gather, final norm, (cast,) LM head.
        assert_eq!(unfused, 18 * layers + 6);
        assert_eq!(fused, 10 * layers + 5);
    }

    /// A prefill step (a prompt with a cached prefix) sampled on the device: the prefill
    /// attention kernel `--prefill-attention` picks and the sampling kernel get the arguments
    /// their signatures take (as every launch of these tests, checked by the recording GPU), and
    /// the step still waits once.
    #[test]
    fn prefill_and_device_sampling_launch_what_the_kernels_take() {
        let choices = [false, true].into_iter().flat_map(|fused| {
            [PrefillAttention::Legacy, PrefillAttention::Fa].map(move |kernel| (fused, kernel))
        });
        for (fused_kernels, prefill_attention) in choices {
            let mut rig = Rig::new(GpuOptions {
                device_sampling: true,
                fused_kernels,
                prefill_attention,
                ..Default::default()
            });
            let table: Vec<u32> = (0..4).collect();
            let tokens: Vec<u32> = (1..=48).collect();
            let inputs = [SeqInput::span(&tokens, 8, 48, &table, LogitsWanted::Last)];
            let c = rig.model.config();
            let batch = ForwardBatch::new(
                &inputs,
                BLOCK,
                BLOCKS,
                c.vocab_size,
                c.max_position_embeddings,
            )
            .unwrap();
            let params = SamplingParams {
                temperature: 0.7,
                top_k: 5,
                logprobs: 2,
                ..Default::default()
            };
            let row = RowSampling {
                params: &params,
                seed: 1,
                position: 48,
                penalized: &[(3, 1)],
                allowed: None,
            };
            let sampled = rig
                .model
                .forward_sampled(&batch, &mut rig.kv, &mut |_, _| {}, &[row])
                .unwrap();
            assert_eq!(sampled.len(), 1);
            let events = rig.gpu.take();
            let launched = |prefix: &str| {
                events
                    .iter()
                    .any(|e| matches!(e, Event::Launch(k) if k.starts_with(prefix)))
            };
            let (chosen, other) = match prefill_attention {
                PrefillAttention::Legacy => ("prefill_attention_hd", "prefill_attention_fa_hd"),
                PrefillAttention::Fa => ("prefill_attention_fa_hd", "prefill_attention_hd"),
            };
            assert!(launched(chosen) && !launched(other), "{events:?}");
            assert!(launched("sample_rows"));
            assert_eq!(
                count(&events, |e| *e == Event::Synchronize),
                1,
                "{events:?}"
            );
        }
    }

    #[test]
    fn fp8_kv_needs_compute_capability_8_9_and_bf16_stays_the_default() {
        let layout = |dtype| KvLayout {
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 16,
            block_size: BLOCK,
            num_blocks: 8,
            dtype,
        };
        for (cc, fp8) in [
            ((8, 0), false),
            ((8, 6), false),
            ((8, 9), true),
            ((9, 0), true),
        ] {
            let gpu = Arc::new(RecordingGpu::with_compute_capability(cc));
            let backend = GpuBackend::with_gpu(gpu, GpuOptions::default(), 0.5);
            assert_eq!(
                backend.kv_dtype(KvDtypeChoice::Auto, false).unwrap(),
                KvDtype::Bf16
            );
            let chosen = backend.kv_dtype(KvDtypeChoice::Fp8, false);
            let allocated = backend.alloc_kv(layout(KvDtype::Fp8E4m3));
            if fp8 {
                assert_eq!(chosen.unwrap(), KvDtype::Fp8E4m3);
                assert!(allocated.unwrap().fp8());
            } else {
                let named = format!("this GPU's is {}.{}", cc.0, cc.1);
                for e in [chosen.unwrap_err(), allocated.err().unwrap()] {
                    let e = e.to_string();
                    assert!(e.contains(&named) && e.contains("8.9"), "{e}");
                }
            }
        }
        let backend = GpuBackend::with_gpu(
            Arc::new(RecordingGpu::default()),
            GpuOptions::default(),
            0.5,
        );
        for other in [KvDtypeChoice::F16, KvDtypeChoice::Int8] {
            let e = backend.kv_dtype(other, false).unwrap_err().to_string();
            assert!(e.contains("bf16 or fp8") && e.contains("--kv-dtype"), "{e}");
        }
    }

    #[test]
    fn an_fp8_kv_cache_takes_half_the_bytes_of_a_bf16_one() {
        let bf16 = Rig::new(GpuOptions::default());
        let fp8 = Rig::fp8_kv(GpuOptions::default());
        let b = bf16.model.backend();
        let f = fp8.model.backend();
        assert_eq!(b.kv_block_bytes(&bf16.kv), 2 * f.kv_block_bytes(&fp8.kv));
        assert_eq!(bf16.kv.bytes(), 2 * fp8.kv.bytes());
        // K and V of 2 heads × 16 slots × 16 dims, one byte each, the scratch block included.
        assert_eq!(f.kv_block_bytes(&fp8.kv), 2 * 2 * BLOCK * 16);
        assert_eq!(fp8.kv.bytes(), 2 * (BLOCKS + 1) * 2 * 2 * BLOCK * 16);
        assert_eq!(
            fp8.kv.chunk_ptr(1, 3) - fp8.kv.base_ptr(),
            ((BLOCKS + 1 + 3) * 2 * 2 * BLOCK * 16) as u64
        );
        // Sized from free memory, the FP8 cache holds twice the blocks.
        let blocks = |dtype| {
            b.kv_capacity_blocks(bf16.model.kv_layout(BLOCK, 1, dtype).block_bytes())
                .unwrap()
        };
        assert_eq!(
            blocks(KvDtype::Fp8E4m3) + 1,
            2 * (blocks(KvDtype::Bf16) + 1)
        );
    }

    #[test]
    fn an_fp8_kv_cache_is_written_and_read_by_the_fp8_kernels() {
        let choices = [false, true].into_iter().flat_map(|fused| {
            [PrefillAttention::Legacy, PrefillAttention::Fa].map(move |kernel| (fused, kernel))
        });
        for (fused_kernels, prefill_attention) in choices {
            let mut rig = Rig::fp8_kv(GpuOptions {
                fused_kernels,
                prefill_attention,
                ..Default::default()
            });
            // A prefill of 48 tokens after 8 cached ones, then a decode step of 3 rows.
            let table: Vec<u32> = (0..4).collect();
            let tokens: Vec<u32> = (1..=48).collect();
            let (_, mut events) =
                rig.step(&[SeqInput::span(&tokens, 8, 48, &table, LogitsWanted::Last)]);
            events.extend(rig.decode(3, 600));
            let kv_kernels: Vec<&str> = events
                .iter()
                .filter_map(|e| match e {
                    Event::Launch(k) if k.contains("write_kv") || k.contains("attention") => {
                        Some(*k)
                    }
                    _ => None,
                })
                .collect();
            let writer = match fused_kernels {
                true => "qkv_rope_write_kv_fp8",
                false => "write_kv_fp8",
            };
            let prefill = match prefill_attention {
                PrefillAttention::Legacy => "prefill_attention_fp8_hd64",
                PrefillAttention::Fa => "prefill_attention_fa_fp8_hd64",
            };
            for k in [writer, prefill, "paged_attention_partial_fp8"] {
                assert!(kv_kernels.contains(&k), "{k} not in {kv_kernels:?}");
            }
            // Every other reader or writer of the cache is an FP8 one (the reduce reads none).
            for k in &kv_kernels {
                assert!(
                    k.contains("fp8") || *k == "paged_attention_reduce",
                    "{k} in {kv_kernels:?}"
                );
            }
        }
    }

    fn packed() -> GpuOptions {
        GpuOptions {
            packed_weights: true,
            ..Default::default()
        }
    }

    /// Bytes allocated on the device.
    fn allocated(events: &[Event]) -> usize {
        events
            .iter()
            .map(|e| match e {
                Event::Alloc(b) => *b,
                _ => 0,
            })
            .sum()
    }

    /// The Q8_0 fixture loaded with `--gpu-weights packed` takes its file's tensor bytes on the
    /// device (to within a few percent: the RoPE frequencies, and norms as f32 as stored);
    /// dequantized to bf16 it takes 64/34 of its matrices.
    #[test]
    fn packed_weights_take_the_file_s_bytes() {
        let name = "tiny-llama-q8_0.gguf";
        let files = duet_model::model_files::open_model(&fixtures().join(name)).unwrap();
        let file: usize = files
            .tensors
            .names()
            .map(|n| files.tensors.get(n).unwrap().bytes.len())
            .sum();
        let measure = |options: GpuOptions| {
            let gpu = Arc::new(RecordingGpu::default());
            let backend = GpuBackend::with_gpu(gpu.clone(), options, 0.5);
            let model = Llama::load(backend, &files).unwrap();
            let allocated = allocated(&gpu.take());
            // What `duet bench gpu` reports as the weights' memory: all the load allocated.
            assert_eq!(model.backend().weight_bytes(), allocated);
            allocated
        };
        let (packed_bytes, bf16_bytes) = (measure(packed()), measure(GpuOptions::default()));
        let ratio = packed_bytes as f64 / file as f64;
        assert!(
            (0.97..1.03).contains(&ratio),
            "packed {packed_bytes} bytes, file {file}"
        );
        assert!(
            bf16_bytes as f64 > 1.7 * packed_bytes as f64,
            "bf16 {bf16_bytes}, packed {packed_bytes}"
        );
    }

    /// `duet bench gpu --gpu-weights packed`'s synthetic models load as a file of their format
    /// would: kept packed, a fraction of bf16's memory (as `weight_bytes` reports it), a decode
    /// step's products the format's kernel. (The tiny shape's 64 columns are not K-quant blocks.)
    #[test]
    fn a_synthetic_model_in_a_block_format_is_kept_packed() {
        for (ty, bf16_over_packed) in [
            (QuantType::Q4_0, 3.0),
            (QuantType::Q4_1, 2.8),
            (QuantType::Q8_0, 1.7),
        ] {
            let bf16 = Rig::synthetic(GpuOptions::default(), ty, Quantization::None);
            let mut rig = Rig::synthetic(packed(), ty, Quantization::None);
            let (b, p) = (
                bf16.model.backend().weight_bytes(),
                rig.model.backend().weight_bytes(),
            );
            assert!(
                b as f64 > bf16_over_packed * p as f64,
                "{ty}: bf16 {b}, packed {p}"
            );
            let c = rig.model.config().clone();
            let events = rig.decode(3, 20);
            let matvec = packed_weights::kernels(ty).unwrap().matvec;
            assert_eq!(
                count(&events, |e| *e == Event::Launch(matvec)),
                4 * c.num_layers + 1,
                "{ty}"
            );
            assert_eq!(count(&events, |e| matches!(e, Event::Gemm(_))), 0);
        }
    }

    /// With packed weights a decode step's products read the blocks (one kernel each, no cuBLAS
    /// call, no cast), the embedding gathers packed rows, and the step still allocates nothing
    /// and waits once; a prefill of more rows dequantizes tiles for cuBLAS, each product's
    /// bands written into the whole output.
    #[test]
    fn packed_weights_decode_in_one_kernel_and_prefill_through_tiles() {
        let mut rig = Rig::from_file(packed(), "tiny-llama-q8_0.gguf");
        let c = rig.model.config().clone();
        for _ in 0..2 {
            let events = rig.decode(3, 20);
            assert_eq!(count(&events, |e| matches!(e, Event::Gemm(_))), 0);
            assert_eq!(count(&events, |e| *e == Event::Launch("f32_to_bf16_n")), 0);
            // Per layer QKV, output, gate/up, down; and the LM head.
            assert_eq!(
                count(&events, |e| *e == Event::Launch("quant_matvec_q8_0")),
                4 * c.num_layers + 1
            );
            assert_eq!(
                count(&events, |e| *e == Event::Launch("quant_embed_rows_q8_0")),
                1
            );
            assert_eq!(count(&events, |e| matches!(e, Event::Alloc(_))), 0);
            assert_eq!(count(&events, |e| *e == Event::Synchronize), 1);
        }
        let table: Vec<u32> = (0..4).collect();
        let tokens: Vec<u32> = (1..=40).collect();
        let inputs = [SeqInput::span(&tokens, 0, 40, &table, LogitsWanted::Last)];
        let (_, events) = rig.step(&inputs);
        let gemms: Vec<Gemm> = events
            .iter()
            .filter_map(|e| match e {
                Event::Gemm(g) => Some(*g),
                _ => None,
            })
            .collect();
        // The tiny matrices are one tile each: a tile launch per product of the 40 rows.
        let tiles = count(&events, |e| *e == Event::Launch("quant_to_bf16_q8_0"));
        assert_eq!(tiles, gemms.iter().filter(|g| g.rows == 40).count());
        assert_eq!(tiles, 4 * c.num_layers);
        assert!(gemms.iter().all(|g| g.ld_out == g.n), "{gemms:?}");
    }

    /// Products over tiles: each band of rows written at its columns of the whole output.
    #[test]
    fn a_product_of_several_tiles_writes_each_band() {
        let gpu = Arc::new(RecordingGpu::default());
        let backend = GpuBackend::with_gpu(gpu.clone(), packed(), 0.5);
        // 9000 rows of 4096 values: 4096 rows a tile, so three tiles.
        let (rows, cols) = (9000, 4096);
        let ty = QuantType::Q4_0;
        let bytes = WeightBytes::from_vec(vec![0u8; rows * ty.row_bytes(cols).unwrap()]);
        let w = backend.load_matrix("w", ty, rows, cols, bytes).unwrap();
        let x = backend
            .upload_activations(20, cols, &vec![0.0; 20 * cols])
            .unwrap();
        let mut out = backend.alloc(20, rows);
        gpu.take();
        backend.matmul(&w, &x, &mut out);
        let gemms: Vec<Gemm> = gpu
            .take()
            .into_iter()
            .filter_map(|e| match e {
                Event::Gemm(g) => Some(g),
                _ => None,
            })
            .collect();
        let bands: Vec<(u64, usize)> = gemms.iter().map(|g| (g.out - out.ptr, g.n)).collect();
        assert_eq!(bands, vec![(0, 4096), (4096 * 4, 4096), (8192 * 4, 808)]);
        assert!(
            gemms
                .iter()
                .all(|g| g.ld_out == rows && g.k == cols && g.rows == 20)
        );
    }

    /// A packed tensor that is not whole blocks is refused at load, naming the tensor.
    #[test]
    fn a_packed_tensor_of_the_wrong_size_is_named() {
        let backend = GpuBackend::with_gpu(Arc::new(RecordingGpu::default()), packed(), 0.5);
        let bytes = WeightBytes::from_vec(vec![0u8; 100]);
        let Err(e) = backend.load_matrix("blk.0.attn_v.weight", QuantType::Q4_1, 2, 48, bytes)
        else {
            panic!("a Q4_1 row of 48 values loaded");
        };
        let e = e.to_string();
        assert!(
            e.contains("blk.0.attn_v.weight") && e.contains("Q4_1"),
            "{e}"
        );
    }

    type RecordedEngine = duet_engine::engine::Engine<GpuBackend<RecordingGpu>>;

    /// An engine over the tiny fixture on `gpu` with `options`: a pool of 6 blocks and the
    /// scratch block, a host tier of `host_tokens` below it.
    fn tiered_engine(
        gpu: &Arc<RecordingGpu>,
        options: GpuOptions,
        host_tokens: usize,
    ) -> RecordedEngine {
        use duet_engine::device::Device;
        use duet_engine::engine::{Engine, EngineOptions};
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama");
        let files = duet_model::model_files::open_model(&dir).unwrap();
        let mut engine_options = EngineOptions {
            device: Device::Cuda(0),
            kv_cache_tokens: 256,
            block_size: BLOCK,
            ..Default::default()
        };
        engine_options.kv_tiers.kv_offload_tokens = host_tokens;
        let fraction = (7 * TIER_BLOCK_BYTES + 100) as f64 / (1u64 << 30) as f64;
        let backend = GpuBackend::with_gpu(gpu.clone(), options, fraction);
        let engine = Engine::with_backend(backend, files, engine_options).unwrap();
        assert_eq!(engine.kv_layout().num_blocks, 6);
        engine
    }

    /// 2 layers × K and V × 2 heads × 16 dims × 16 slots in bf16: a block of the tiny fixture.
    const TIER_BLOCK_BYTES: usize = 2 * 2 * 2 * 16 * BLOCK * 2;

    fn stop(max_tokens: usize) -> duet_model::params::StopCriteria {
        duet_model::params::StopCriteria {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        }
    }

    /// Two whole blocks and a token.
    fn prompt(first: u32) -> Vec<u32> {
        (first..first + 2 * BLOCK as u32 + 1).collect()
    }

    fn run_alone(engine: &mut RecordedEngine, prompt: Vec<u32>) {
        let id = engine
            .add_sequence(prompt, Default::default(), stop(1))
            .unwrap();
        while engine.has_work() {
            engine.step().unwrap();
        }
        engine.remove_sequence(id).unwrap();
    }

    /// Prompts that push every cached block out of the pool.
    fn evict(engine: &mut RecordedEngine) {
        for first in [100, 150, 200] {
            run_alone(engine, prompt(first));
        }
    }

    /// `prompt(first)` reused once, then pushed out of the pool: its two blocks move down to
    /// the host tier.
    fn moved_down(engine: &mut RecordedEngine, first: u32) {
        run_alone(engine, prompt(first));
        run_alone(engine, prompt(first));
        evict(engine);
        let host = engine.kv_tier_stats()[0];
        assert!(host.blocks >= 2, "{host:?}");
    }

    fn seqs(out: Vec<duet_engine::engine::StepOutput>) -> Vec<u64> {
        out.iter().map(|o| o.seq).collect()
    }

    /// A sequence decoding, then `prompt(first)` again, whose two blocks are below: they load
    /// beside the next step. The two sequences, the log taken before the second came.
    fn brought_up_beside_a_decode(
        engine: &mut RecordedEngine,
        gpu: &RecordingGpu,
        first: u32,
    ) -> (u64, u64) {
        let decoding = engine
            .add_sequence(vec![300, 301], Default::default(), stop(20))
            .unwrap();
        engine.step().unwrap();
        gpu.take();
        let again = engine
            .add_sequence(prompt(first), Default::default(), stop(1))
            .unwrap();
        assert_eq!(engine.cached_prompt_tokens(again), Some(2 * BLOCK));
        (decoding, again)
    }

    /// With `--kv-load-stream on`, a prefix brought up from the host tier is copied on the load
    /// stream and its sequence is in no step until the copies complete, while the sequences
    /// already running go on; with nothing else to run, the engine waits for the copies before
    /// the step that reads them.
    #[test]
    fn a_sequence_joins_the_steps_only_once_its_blocks_have_loaded() {
        let gpu = Arc::new(RecordingGpu::default());
        let load_stream = GpuOptions {
            load_stream: true,
            ..Default::default()
        };
        let mut engine = tiered_engine(&gpu, load_stream, 256);
        moved_down(&mut engine, 3);
        assert_eq!(engine.kv_tier_stats()[0].hits, 0);
        let (decoding, again) = brought_up_beside_a_decode(&mut engine, &gpu, 3);
        let events = gpu.take();
        let loads = count(&events, |e| *e == Event::LoadUpload(TIER_BLOCK_BYTES / 2));
        assert_eq!(loads, 2 * 2, "two blocks, a copy per layer: {events:?}");
        assert_eq!(seqs(engine.step().unwrap()), [decoding], "still loading");
        assert_eq!(seqs(engine.step().unwrap()), [decoding], "still loading");
        gpu.complete_loads();
        assert_eq!(seqs(engine.step().unwrap()), [decoding, again]);
        assert!(!gpu.take().contains(&Event::SynchronizeLoads));
        engine.remove_sequence(again).unwrap();
        while engine.has_work() {
            engine.step().unwrap();
        }
        engine.remove_sequence(decoding).unwrap();
        // Alone, it waits for its copies before the step that reads its blocks.
        evict(&mut engine);
        gpu.take();
        let alone = engine
            .add_sequence(prompt(3), Default::default(), stop(1))
            .unwrap();
        assert_eq!(engine.cached_prompt_tokens(alone), Some(2 * BLOCK));
        assert_eq!(seqs(engine.step().unwrap()), [alone]);
        let events = gpu.take();
        let waited = events.iter().position(|e| *e == Event::SynchronizeLoads);
        let first_launch = events
            .iter()
            .position(|e| matches!(e, Event::Launch(_) | Event::Gemm(_)));
        assert!(waited.is_some() && waited < first_launch, "{events:?}");
    }

    /// With `--kv-host-pinned on` the host tier is page-locked memory: a prefix brought up is
    /// copied on the load stream straight from its slots (no copy out of the tier), and a block
    /// moving down while those copies are in flight, into a tier whose every free slot is one
    /// of theirs, waits for them before its download writes the slot (the recording GPU panics
    /// at a download into memory a queued copy still reads).
    #[test]
    fn a_pinned_tier_slot_is_rewritten_only_after_its_copy_completes() {
        let gpu = Arc::new(RecordingGpu::default());
        let pinned = GpuOptions {
            load_stream: true,
            host_pinned: true,
            ..Default::default()
        };
        // A host tier of two blocks, in page-locked memory.
        let mut engine = tiered_engine(&gpu, pinned, 2 * BLOCK);
        let host = engine.kv_tier_stats()[0];
        assert!(host.page_locked, "{host:?}");
        moved_down(&mut engine, 3);
        // Another prompt reused in the pool: its blocks move down when evicted.
        run_alone(&mut engine, prompt(50));
        run_alone(&mut engine, prompt(50));
        let (decoding, again) = brought_up_beside_a_decode(&mut engine, &gpu, 3);
        let host = engine.kv_tier_stats()[0];
        assert_eq!(host.lent, 2, "brought up straight from its slots: {host:?}");
        // A new prompt evicts the reused blocks while the copies are in flight: they move into
        // the slots the copies read, after the copies.
        let new = engine
            .add_sequence(prompt(330), Default::default(), stop(1))
            .unwrap();
        let out = seqs(engine.step().unwrap());
        assert!(out.contains(&decoding) && !out.contains(&again), "{out:?}");
        let host = engine.kv_tier_stats()[0];
        assert!(host.copy_waits >= 1, "{host:?}");
        let events = gpu.take();
        let waited = events.iter().position(|e| *e == Event::SynchronizeLoads);
        assert!(waited.is_some(), "{events:?}");
        for id in [again, new, decoding] {
            while engine.has_work() {
                engine.step().unwrap();
            }
            engine.remove_sequence(id).unwrap();
        }
        assert_eq!(engine.kv_tier_stats()[0].blocks, 2);
    }

    #[test]
    fn buckets_follow_the_reserved_maximum() {
        let rig = Rig::new(GpuOptions::default());
        assert_eq!(rig.model.backend().buckets(), vec![1, 2, 4, 8, 16]);
    }

    /// A runner loaded for `--device cuda` without `--max-step-tokens` plans its step memory, and
    /// its decode buckets, for the GPU's step budget.
    #[test]
    fn a_gpu_runner_reserves_the_gpu_step_budget_by_default() {
        use duet_engine::device::Device;
        use duet_engine::engine::EngineOptions;
        use duet_engine::model_runner::ModelRunner;
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama");
        let files = duet_model::model_files::open_model(&dir).unwrap();
        let options = EngineOptions {
            device: Device::Cuda(0),
            kv_cache_tokens: 256,
            ..Default::default()
        };
        let backend = GpuBackend::with_gpu(
            Arc::new(RecordingGpu::default()),
            GpuOptions::default(),
            0.5,
        );
        let runner = ModelRunner::load(backend, &files, &options).unwrap();
        let buckets = runner.model().backend().buckets();
        assert_eq!(
            buckets.last(),
            Some(&duet_engine::device::GPU_STEP_TOKENS),
            "{buckets:?}"
        );
    }
}
