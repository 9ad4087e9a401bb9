//! The operations a Llama-family forward pass needs from a device.
//!
//! The model (`llama.rs`) is written once over this trait; a backend owns its memory (weights,
//! activations, the paged KV store) and implements each op for its device. Batch metadata
//! ([`ForwardBatch`]) is plain host data; [`Backend::prepare_batch`] turns it into what the device
//! reads, once per step.

use crate::EngineError;
use crate::batch::ForwardBatch;
use crate::sampling_steps::{RowSampling, sample_row};
pub use duet_kv::HostMemory;
use duet_model::config::ModelConfig;
use duet_model::fp8::Fp8Matrix;
use duet_model::model_files::RawTensor;
use duet_model::params::Sampled;
use duet_model::quant_type::QuantType;
use duet_model::storage::WeightBytes;

/// Element type of a KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    F16,
    Bf16,
    /// 8-bit integers with f32 scales: each token's key, per KV head, one per group of
    /// [`KvLayout::key_scale_group`] dimensions; its value one per KV head.
    Int8,
    /// FP8 E4M3 (`float8_e4m3fn`) bytes of value / scale, one scale per layer for K and one for V
    /// held by the backend, not the blocks (as vLLM's `--kv-cache-dtype fp8`): a block is half a
    /// bf16 block's bytes. The CUDA backend's, on devices of compute capability 8.9 and later.
    Fp8E4m3,
}

impl KvDtype {
    pub const ALL: [KvDtype; 5] = [
        KvDtype::F32,
        KvDtype::F16,
        KvDtype::Bf16,
        KvDtype::Int8,
        KvDtype::Fp8E4m3,
    ];

    /// The type of [`Self::name`] `name` (what a peer's message names).
    pub fn from_name(name: &str) -> Option<KvDtype> {
        Self::ALL.into_iter().find(|d| d.name() == name)
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
            KvDtype::Int8 => "int8",
            KvDtype::Fp8E4m3 => "fp8",
        }
    }

    /// Bytes of one value.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
            KvDtype::Int8 | KvDtype::Fp8E4m3 => 1,
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The KV element type asked for on the command line; `auto` lets the backend choose from the
/// weights (see [`Backend::kv_dtype`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum KvDtypeChoice {
    #[default]
    Auto,
    F32,
    F16,
    Bf16,
    Int8,
    /// FP8 E4M3 with a scale per layer (CUDA, compute capability 8.9 and later).
    Fp8,
}

impl KvDtypeChoice {
    /// The fixed type asked for, `None` for `auto`.
    pub fn fixed(self) -> Option<KvDtype> {
        match self {
            KvDtypeChoice::Auto => None,
            KvDtypeChoice::F32 => Some(KvDtype::F32),
            KvDtypeChoice::F16 => Some(KvDtype::F16),
            KvDtypeChoice::Bf16 => Some(KvDtype::Bf16),
            KvDtypeChoice::Int8 => Some(KvDtype::Int8),
            KvDtypeChoice::Fp8 => Some(KvDtype::Fp8E4m3),
        }
    }
}

impl std::fmt::Display for KvDtypeChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.fixed() {
            Some(d) => f.write_str(d.name()),
            None => f.write_str("auto"),
        }
    }
}

/// Which kernels run a model on the CPU: the best this CPU supports, or one path forced — to
/// compare paths, or to run the portable code on any machine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum CpuKernels {
    #[default]
    Auto,
    /// Plain Rust, any CPU.
    Portable,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// x86-64 AVX2 + FMA + F16C + AVX-VNNI (Intel cores from Alder Lake on without AVX-512).
    Avx2Vnni,
    /// x86-64 AVX-512 F/BW/VL + VNNI.
    Avx512,
}

impl std::fmt::Display for CpuKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CpuKernels::Auto => "auto",
            CpuKernels::Portable => "portable",
            CpuKernels::Avx2 => "avx2",
            CpuKernels::Avx2Vnni => "avx2-vnni",
            CpuKernels::Avx512 => "avx512",
        })
    }
}

/// Which kernel computes prefill attention on a GPU (sequences of several new tokens; decode rows
/// have their own). Both read cached prefixes through the block table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum PrefillAttention {
    /// Q and P each in two bf16 terms: f32-grade results (2e-6 from float64), at two to four
    /// times the tensor-core work; no cp.async or ldmatrix. Run on H100 and H200.
    #[default]
    Legacy,
    /// FlashAttention's numerics (Q and P one bf16 term, f32 accumulation and softmax
    /// statistics; ~1e-3 from float64) and FlashAttention-2's tiles (ldmatrix, cp.async
    /// double-buffered K/V, causal-block skipping). Checked in the CPU emulator only so far.
    Fa,
}

impl std::fmt::Display for PrefillAttention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PrefillAttention::Legacy => "legacy",
            PrefillAttention::Fa => "fa",
        })
    }
}

/// Geometry of the paged KV store: `num_blocks` blocks of `block_size` token slots, for every
/// layer, K and V, `num_kv_heads × head_dim` values of `dtype` per slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    pub dtype: KvDtype,
}

impl KvLayout {
    /// Values (K and V, all layers) stored per token slot.
    pub fn values_per_token(&self) -> usize {
        2 * self.num_layers * self.num_kv_heads * self.head_dim
    }

    /// Bytes of the whole store (saturating: an absurd size is reported, not wrapped).
    pub fn bytes(&self) -> usize {
        self.num_blocks.saturating_mul(self.block_bytes())
    }

    /// Bytes of one block, every layer, K and V (what moving it costs).
    pub fn block_bytes(&self) -> usize {
        self.num_layers.saturating_mul(self.layer_block_bytes())
    }

    /// Bytes of one layer of one block, K and V, scales included: the unit a KV transfer moves.
    pub fn layer_block_bytes(&self) -> usize {
        let values = 2 * self.num_kv_heads * self.block_size * self.head_dim;
        values
            .saturating_mul(self.dtype.bytes())
            .saturating_add(4 * self.layer_block_scales())
    }

    /// Dimensions of a key that share a scale in an int8 cache: 32, as in llama.cpp's q8_0 (the
    /// keys' few large channels then cost precision only to their own group), or the largest
    /// power of two dividing a head size that 32 does not divide.
    pub fn key_scale_group(&self) -> usize {
        1 << self.head_dim.trailing_zeros().min(5)
    }

    /// f32 scales one layer of one block holds: in an int8 cache, per KV head and slot, one per
    /// key group and one for the value; none in the float types (an FP8 cache's are per layer).
    pub fn layer_block_scales(&self) -> usize {
        match self.dtype {
            KvDtype::Int8 => {
                let per_slot = self.head_dim / self.key_scale_group() + 1;
                self.num_kv_heads * self.block_size * per_slot
            }
            KvDtype::F32 | KvDtype::F16 | KvDtype::Bf16 | KvDtype::Fp8E4m3 => 0,
        }
    }

    /// Bytes one token takes in the cache, every layer, K and V, scales included.
    pub fn bytes_per_token(&self) -> usize {
        self.block_bytes() / self.block_size.max(1)
    }
}

/// Attention geometry of one layer.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// Rows of a step's activations as a backend runs it (see [`Backend::step_rows`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepRows {
    /// Rows of the step: the batch's, or more where the backend pads it.
    pub rows: usize,
    /// Rows whose logits are computed: the batch's logit rows, then any padded ones.
    pub logit_rows: usize,
}

/// What a backend keeps for steps, sized once at start-up (see
/// [`Backend::reserve_step_memory`]).
#[derive(Clone, Copy, Debug)]
pub struct StepMemoryPlan<'a> {
    pub config: &'a ModelConfig,
    /// Most rows one step computes.
    pub max_rows: usize,
    /// Most rows one step computes logits for (more grow the memory when they come).
    pub max_logit_rows: usize,
    /// The activations `[rows][cols]` such a step allocates.
    pub activations: &'a [(usize, usize)],
    /// Tokens per KV block (the length of block tables).
    pub block_size: usize,
}

pub trait Backend: Send + Sync {
    /// A weight matrix `[rows (out), cols (in)]`.
    type Matrix: Send + Sync;
    /// A weight vector (norm weights, biases).
    type Vector: Send + Sync;
    /// Activations `[rows, cols]`.
    type Activations;
    /// The paged KV store.
    type KvStore: Send + 'static;
    /// A step's batch metadata as the device reads it (positions, slots, block tables), made once
    /// per forward pass by [`Backend::prepare_batch`].
    type Batch<'a>;

    fn name(&self) -> &'static str;
    /// Whether a row's logits are the same bits whatever rows share its step (checked for this
    /// backend's kernels). Speculative decoding keeps output unchanged only where they are, so it
    /// is refused elsewhere.
    fn batch_invariant(&self) -> bool {
        false
    }
    /// Whether a forward pass leaves a host core free, so host work of the step (grammar masks)
    /// can run beside it instead of after it.
    fn host_core_free_during_forward(&self) -> bool {
        false
    }
    /// Another handle on this backend's device and threads, for a second model beside the first
    /// (a speculative draft model); `None` where that is not built.
    fn sibling(&self) -> Option<Self>
    where
        Self: Sized,
    {
        None
    }
    /// An error when this backend cannot run a model of `config`'s family (one whose path on it
    /// is not built, or has not run on its hardware yet).
    fn check_model(&self, config: &duet_model::config::ModelConfig) -> Result<(), EngineError> {
        let _ = config;
        Ok(())
    }
    /// The KV element type for `choice`, given whether every weight matrix is stored in f32
    /// (part of the model fingerprint: KV only moves between equal types). An error when this
    /// backend cannot store the type asked for.
    fn kv_dtype(&self, choice: KvDtypeChoice, f32_weights: bool) -> Result<KvDtype, EngineError>;

    fn load_matrix(
        &self,
        name: &str,
        ty: QuantType,
        rows: usize,
        cols: usize,
        bytes: WeightBytes,
    ) -> Result<Self::Matrix, EngineError>;
    /// One matrix of `parts` stacked (rows concatenated, equal `cols`), so that projections of
    /// the same input run as one product; `Ok(None)` when the backend cannot (e.g. mixed types),
    /// and the parts are loaded one by one. Stacking the stored tensors, not loaded matrices,
    /// keeps the parts from ever taking memory of their own.
    fn load_stacked_matrix(&self, parts: &[RawTensor])
    -> Result<Option<Self::Matrix>, EngineError>;
    /// An FP8 matrix (E4M3 values, a scale per row): by default dequantized to bf16 at load, so
    /// every backend serves FP8 checkpoints (the CPU's is the accuracy reference); a backend
    /// with FP8 products keeps it FP8.
    fn load_fp8_matrix(&self, m: Fp8Matrix) -> Result<Self::Matrix, EngineError> {
        let t = m.dequantize_bf16();
        self.load_matrix(&t.name, t.ty, t.rows, t.cols, t.bytes)
    }
    fn matrix_rows(&self, m: &Self::Matrix) -> usize;
    fn load_vector(&self, values: Vec<f32>) -> Result<Self::Vector, EngineError>;

    /// How many KV blocks of `block_bytes` bytes (every layer, K and V) this backend should hold, when it sizes
    /// the cache itself (a GPU: a share of its free memory); `None` keeps the configured size.
    fn kv_capacity_blocks(&self, block_bytes: usize) -> Option<usize> {
        let _ = block_bytes;
        None
    }
    fn alloc_kv(&self, layout: KvLayout) -> Result<Self::KvStore, EngineError>;
    /// Bytes of one (layer, block) of KV in transfer layout: K then V, each
    /// `[kv_head][slot][head_dim]`, little-endian.
    fn kv_block_bytes(&self, kv: &Self::KvStore) -> usize;
    fn read_kv_block(&self, kv: &Self::KvStore, layer: usize, block: usize, out: &mut [u8]);
    fn write_kv_block(&self, kv: &mut Self::KvStore, layer: usize, block: usize, data: &[u8]);
    /// Copies every layer of one block out (`num_layers` × [`Self::kv_block_bytes`] bytes) in
    /// the store's own layout, which may differ from the transfer layout wherever converting
    /// costs more than a copy: what a tier below the pool keeps (it never leaves the worker).
    /// By default the transfer layout, layer after layer.
    fn read_stored_block(&self, kv: &Self::KvStore, block: usize, out: &mut [u8]) {
        let layer_bytes = self.kv_block_bytes(kv);
        for (layer, out) in out.chunks_exact_mut(layer_bytes).enumerate() {
            self.read_kv_block(kv, layer, block, out);
        }
    }
    /// Stores every layer of one block from what [`Self::read_stored_block`] gave (a block
    /// brought up from a tier below). A backend may queue the write to overlap a step in flight
    /// (a GPU's copy engine, off the compute stream); no step may read the block until
    /// [`Self::stored_writes_done`] says so, or [`Self::finish_stored_writes`] returned. `data`
    /// in memory from [`Self::host_tier_memory`] may be read after this returns: it stays
    /// unchanged until then (the tier lends its slot to the copy).
    fn write_stored_block(&self, kv: &mut Self::KvStore, block: usize, data: &[u8]) {
        let layer_bytes = self.kv_block_bytes(kv);
        for (layer, data) in data.chunks_exact(layer_bytes).enumerate() {
            self.write_kv_block(kv, layer, block, data);
        }
    }
    /// The memory of a host tier of `bytes` below the pool: by default a `Vec` (pageable, zeroed
    /// lazily by the kernel). A GPU backend may give page-locked memory its copy engine reads
    /// and writes directly (`--kv-host-pinned on`).
    fn host_tier_memory(&self, bytes: usize) -> Result<Box<dyn HostMemory>, EngineError> {
        Ok(Box::new(vec![0u8; bytes]))
    }
    /// Whether every [`Self::write_stored_block`] so far has completed, without waiting. The
    /// CPU's writes are copies done before they return: loading cannot overlap a step there,
    /// since the copy needs the cores and the memory bandwidth the step is using.
    fn stored_writes_done(&self) -> bool {
        true
    }
    /// Waits until every [`Self::write_stored_block`] so far has completed.
    fn finish_stored_writes(&self) -> Result<(), EngineError> {
        Ok(())
    }
    /// Copies one layer's KV of `blocks` out in transfer layout, one block after another, and
    /// waits for it (a GPU reads them in one copy, off its compute stream, without ending the
    /// step); see [`Backend::status`] for its failure.
    fn read_kv_blocks(&self, kv: &Self::KvStore, layer: usize, blocks: &[u32], out: &mut [u8]) {
        let block_bytes = self.kv_block_bytes(kv);
        for (&b, chunk) in blocks.iter().zip(out.chunks_exact_mut(block_bytes)) {
            self.read_kv_block(kv, layer, b as usize, chunk);
        }
    }
    /// Sizes what the backend keeps for steps (a GPU's activation workspace and input buffers)
    /// once at start-up, so that steps allocate nothing; nothing by default.
    fn reserve_step_memory(&self, plan: &StepMemoryPlan<'_>) {
        let _ = plan;
    }
    /// Activations `[rows][cols]`, their contents unspecified (a GPU hands a step's out of one
    /// reused workspace).
    fn alloc(&self, rows: usize, cols: usize) -> Self::Activations;
    /// Activations `[rows][cols]` of zeros.
    fn alloc_zeroed(&self, rows: usize, cols: usize) -> Self::Activations {
        self.alloc(rows, cols)
    }
    fn prepare_batch<'a>(&self, batch: &'a ForwardBatch) -> Self::Batch<'a>;
    /// Rows of the step's activations: the batch's rows and logit rows, or more where the
    /// backend pads a step to a fixed shape (a GPU's batch buckets). Padded rows compute what
    /// nothing reads.
    fn step_rows(&self, batch: &Self::Batch<'_>) -> StepRows;

    /// Held for a whole forward step: engines sharing a device's compute (several workers in one
    /// process share the CPU's kernel threads) take turns step by step instead of interleaving
    /// kernel by kernel, which would stretch every step by the other engine's work.
    type StepTurn<'a>
    where
        Self: 'a;
    fn step_turn(&self) -> Self::StepTurn<'_>;

    /// `out[i] = table[token of row i]`.
    fn embed(&self, table: &Self::Matrix, batch: &Self::Batch<'_>, out: &mut Self::Activations);
    /// `out = x / rms(x) * w`, row-wise.
    fn rms_norm(
        &self,
        x: &Self::Activations,
        w: &Self::Vector,
        eps: f32,
        out: &mut Self::Activations,
    );
    /// `out = x · wᵀ`.
    fn matmul(&self, w: &Self::Matrix, x: &Self::Activations, out: &mut Self::Activations);
    /// Splits the columns of `x` into consecutive parts of the given widths.
    fn split_cols(&self, x: &Self::Activations, parts: &mut [&mut Self::Activations]);
    /// `x += bias`, row-wise.
    fn add_bias(&self, x: &mut Self::Activations, bias: &Self::Vector);
    /// `x = rms_norm(head) * w` for each `head_dim`-wide head of each row, in place (Qwen3's
    /// q/k norm).
    fn head_rms_norm(&self, x: &mut Self::Activations, w: &Self::Vector, head_dim: usize, eps: f32);
    /// Rotary embedding (rotate-half convention) of each head of each row at its position:
    /// pair `i` turns by `position × inv_freq[i]` (`head_dim / 2` frequencies, the model's
    /// scaling applied), cos and sin scaled by `attention_factor`.
    fn rope(
        &self,
        x: &mut Self::Activations,
        head_dim: usize,
        inv_freq: &Self::Vector,
        attention_factor: f32,
        batch: &Self::Batch<'_>,
    );
    /// Stores each row's K and V into its cache slot for `layer`.
    fn write_kv(
        &self,
        kv: &mut Self::KvStore,
        layer: usize,
        k: &Self::Activations,
        v: &Self::Activations,
        batch: &Self::Batch<'_>,
    );
    /// Causal attention of each row over its sequence's cached positions `0..=position`.
    fn attention(
        &self,
        q: &Self::Activations,
        kv: &Self::KvStore,
        layer: usize,
        shape: AttentionShape,
        batch: &Self::Batch<'_>,
        out: &mut Self::Activations,
    );
    /// The QKV projection's output `qkv` (rows of `[q | k | v]`) split into `q`, `k`, `v`, `q`
    /// and `k` turned by RoPE, and K and V stored into the cache for `layer`: what
    /// [`Backend::split_cols`], [`Backend::rope`] and [`Backend::write_kv`] do, which a device
    /// backend fuses into one pass (`k` and `v` are then left unwritten).
    #[allow(clippy::too_many_arguments)]
    fn qkv_rope_write_kv(
        &self,
        qkv: &Self::Activations,
        q: &mut Self::Activations,
        k: &mut Self::Activations,
        v: &mut Self::Activations,
        kv: &mut Self::KvStore,
        layer: usize,
        shape: AttentionShape,
        inv_freq: &Self::Vector,
        attention_factor: f32,
        batch: &Self::Batch<'_>,
    ) {
        self.split_cols(qkv, &mut [&mut *q, &mut *k, &mut *v]);
        self.rope(q, shape.head_dim, inv_freq, attention_factor, batch);
        self.rope(k, shape.head_dim, inv_freq, attention_factor, batch);
        self.write_kv(kv, layer, k, v, batch);
    }
    /// `gate = silu(gate) * up`.
    fn silu_mul(&self, gate: &mut Self::Activations, up: &Self::Activations);
    /// `out = silu(gate) * up` where each row of `gate_up` is `[gate | up]` (the stacked
    /// projection's output), without splitting it first.
    fn silu_mul_stacked(&self, gate_up: &Self::Activations, out: &mut Self::Activations);
    /// `x += y`.
    fn add(&self, x: &mut Self::Activations, y: &Self::Activations);
    /// `x += delta; out = rms_norm(x, w)`: the residual add and the next norm, which a device
    /// backend fuses into one pass.
    fn add_rms_norm(
        &self,
        x: &mut Self::Activations,
        delta: &Self::Activations,
        w: &Self::Vector,
        eps: f32,
        out: &mut Self::Activations,
    ) {
        self.add(x, delta);
        self.rms_norm(x, w, eps, out);
    }
    /// `out[i] = x[rows[i]]`.
    fn gather_rows(&self, x: &Self::Activations, rows: &[usize], out: &mut Self::Activations);
    /// `out[i] = x[i-th row whose logits the step wants]` (and any padded rows after them).
    fn gather_logit_rows(
        &self,
        x: &Self::Activations,
        batch: &Self::Batch<'_>,
        out: &mut Self::Activations,
    );
    /// `out[rows[i]] += weights[i] · y[i]` (`rows` distinct): an expert's outputs added back to
    /// the tokens it was picked for.
    fn scatter_add_rows(
        &self,
        out: &mut Self::Activations,
        y: &Self::Activations,
        rows: &[usize],
        weights: &[f32],
    );
    fn to_host(&self, x: Self::Activations) -> Vec<f32>;
    /// Whether [`Backend::sample`] draws on the device (else the logits come to the host).
    fn samples_on_device(&self) -> bool {
        false
    }
    /// The token each of `rows` draws from its row of `logits` (`[rows][vocab]`, padded rows
    /// after them ignored), as [`crate::sampling_steps::sample_row`] defines it: on the host by
    /// default, on the device where a backend does it there.
    fn sample(
        &self,
        logits: Self::Activations,
        vocab: usize,
        rows: &[RowSampling<'_>],
    ) -> Vec<Sampled> {
        let mut data = self.to_host(logits);
        rows.iter()
            .zip(data.chunks_exact_mut(vocab))
            .map(|(row, l)| sample_row(l, row))
            .collect()
    }
    /// Waits for queued work and reports a device failure. Ops do not return errors themselves:
    /// as in a CUDA context, a failure is sticky (the backend is unusable afterwards) and every
    /// later `sync` reports it.
    fn sync(&self) -> Result<(), EngineError>;
    /// The failure of the ops so far, without waiting for queued work: after an op that waits for
    /// its own result ([`Backend::read_kv_blocks`]), mid-step.
    fn status(&self) -> Result<(), EngineError> {
        Ok(())
    }
}
