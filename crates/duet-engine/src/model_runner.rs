//! The model runner: the model with the KV store its forward passes write. It turns a step's plan
//! into a [`ForwardBatch`], runs it, and hands back the logits to sample from.

use crate::EngineError;
use crate::backend::{Backend, KvLayout};
use crate::batch::{ForwardBatch, LogitsWanted, SeqInput};
use crate::engine::EngineOptions;
use crate::llama::{Llama, Logits};
use crate::sampling_steps::RowSampling;
use crate::scheduler::PlannedSeq;
use duet_kv::SeqId;
use duet_model::model_files::ModelFiles;
use duet_model::params::Sampled;

pub struct ModelRunner<B: Backend> {
    model: Llama<B>,
    kv: B::KvStore,
    kv_layout: KvLayout,
    /// Steps since freed heap was last given back (see [`ModelRunner::end_step`]).
    steps_since_trim: usize,
}

impl<B: Backend> ModelRunner<B> {
    /// Loads the model of `files` on `backend` with a KV store of `options`' element type and
    /// size (or, on a backend that sizes its cache itself, of the blocks it has room for).
    pub fn load(
        backend: B,
        files: &ModelFiles,
        options: &EngineOptions,
    ) -> Result<Self, EngineError> {
        let model = Llama::load_quantized(backend, files, options.quantization)?;
        // Step memory before the KV cache, which a GPU sizes from the memory left.
        model.reserve_step_memory(options.step_tokens(), options.block_size);
        let kv_dtype = model
            .backend()
            .kv_dtype(options.kv_dtype, files.tensors.matrices_all_f32())?;
        let block_bytes = model
            .kv_layout(options.block_size, 1, kv_dtype)
            .block_bytes();
        let num_blocks = model
            .backend()
            .kv_capacity_blocks(block_bytes)
            .unwrap_or(options.kv_cache_tokens / options.block_size);
        if num_blocks == 0 {
            return Err(EngineError::Config(format!(
                "no room for a KV cache block ({block_bytes} bytes) on {}",
                model.backend().name()
            )));
        }
        let kv_layout = model.kv_layout(options.block_size, num_blocks, kv_dtype);
        Self::new(model, kv_layout)
    }

    /// Allocates the KV store of `kv_layout` for `model`.
    pub fn new(model: Llama<B>, kv_layout: KvLayout) -> Result<Self, EngineError> {
        let kv = model.backend().alloc_kv(kv_layout)?;
        Ok(Self {
            model,
            kv,
            kv_layout,
            steps_since_trim: 0,
        })
    }

    pub fn model(&self) -> &Llama<B> {
        &self.model
    }

    pub fn kv_store(&self) -> &B::KvStore {
        &self.kv
    }

    pub fn kv_layout(&self) -> KvLayout {
        self.kv_layout
    }

    /// Bytes of one (layer, block) of KV in transfer layout.
    pub fn kv_block_bytes(&self) -> usize {
        self.model.backend().kv_block_bytes(&self.kv)
    }

    /// Copies one (layer, block) of KV out, in transfer layout.
    pub fn read_kv_block(
        &self,
        layer: usize,
        block: u32,
        out: &mut [u8],
    ) -> Result<(), EngineError> {
        self.check_block(layer, block, out.len())?;
        self.model
            .backend()
            .read_kv_block(&self.kv, layer, block as usize, out);
        self.model.backend().sync()
    }

    /// Writes one (layer, block) of KV received from a transfer.
    pub fn write_kv_block(
        &mut self,
        layer: usize,
        block: u32,
        data: &[u8],
    ) -> Result<(), EngineError> {
        self.check_block(layer, block, data.len())?;
        self.model
            .backend()
            .write_kv_block(&mut self.kv, layer, block as usize, data);
        self.model.backend().sync()
    }

    /// Copies every layer of one block out, in transfer layout, layer after layer (`out` is
    /// [`KvLayout::block_bytes`] long): what a peer's pull is sent.
    pub fn read_block(&self, block: u32, out: &mut [u8]) -> Result<(), EngineError> {
        let layer_bytes = self.whole_block_bytes(out.len())?;
        for (layer, part) in out.chunks_exact_mut(layer_bytes).enumerate() {
            self.read_kv_block(layer, block, part)?;
        }
        Ok(())
    }

    /// Copies every layer of one block out in the store's own layout
    /// ([`Backend::read_stored_block`]): what a tier below the pool keeps.
    pub fn read_stored_block(&self, block: u32, out: &mut [u8]) -> Result<(), EngineError> {
        self.check_whole_block(block, out.len())?;
        let backend = self.model.backend();
        backend.read_stored_block(&self.kv, block as usize, out);
        backend.sync()
    }

    /// Writes every layer of one block from what [`read_stored_block`](Self::read_stored_block)
    /// gave.
    pub fn write_stored_block(&mut self, block: u32, data: &[u8]) -> Result<(), EngineError> {
        self.check_whole_block(block, data.len())?;
        let backend = self.model.backend();
        backend.write_stored_block(&mut self.kv, block as usize, data);
        backend.sync()
    }

    fn check_whole_block(&self, block: u32, len: usize) -> Result<(), EngineError> {
        self.whole_block_bytes(len)?;
        self.check_block(0, block, self.kv_block_bytes())
    }

    /// Bytes of one layer of a block, checking that `len` is a whole block.
    fn whole_block_bytes(&self, len: usize) -> Result<usize, EngineError> {
        let layer_bytes = self.kv_block_bytes();
        if len != layer_bytes * self.kv_layout.num_layers {
            return Err(EngineError::InvalidBatch(format!(
                "a whole KV block is {} layers of {layer_bytes} bytes, not {len} bytes",
                self.kv_layout.num_layers
            )));
        }
        Ok(layer_bytes)
    }

    fn check_block(&self, layer: usize, block: u32, len: usize) -> Result<(), EngineError> {
        let l = self.kv_layout;
        if layer >= l.num_layers || block as usize >= l.num_blocks || len != self.kv_block_bytes() {
            return Err(EngineError::InvalidBatch(format!(
                "KV block (layer {layer}, block {block}, {len} bytes) does not fit a cache of {} layers, {} blocks of {} bytes",
                l.num_layers,
                l.num_blocks,
                self.kv_block_bytes()
            )));
        }
        Ok(())
    }

    /// Runs one forward pass over `plan` (`seq_tokens` gives each planned sequence's tokens):
    /// writes their K/V into the cache and returns, in plan order, the logits of the sequences
    /// whose every token is then computed (one row each, and one more per drafted token).
    /// `on_layer` is called after each layer's K/V are written. Pass the logits to
    /// [`end_step`](Self::end_step) once sampled.
    pub fn forward<'t>(
        &mut self,
        plan: &[PlannedSeq],
        seq_tokens: impl Fn(SeqId) -> &'t [u32],
        on_layer: &mut dyn FnMut(&LayerDone<'_, B>),
    ) -> Result<Logits, EngineError> {
        let drafted = drafted(plan, &seq_tokens);
        let batch = self.batch(plan, &seq_tokens, &drafted)?;
        let backend = self.model.backend();
        self.model.forward(&batch, &mut self.kv, &mut |layer, kv| {
            on_layer(&LayerDone {
                layer,
                kv,
                backend,
                plan,
            })
        })
    }

    /// Runs one forward pass over `plan`, a plan without drafts, as [`Self::forward`] does, and
    /// draws the token of each sequence it completes, `rows` saying how, in plan order (see
    /// [`Llama::forward_sampled`]).
    pub fn forward_sampled<'t>(
        &mut self,
        plan: &[PlannedSeq],
        seq_tokens: impl Fn(SeqId) -> &'t [u32],
        on_layer: &mut dyn FnMut(&LayerDone<'_, B>),
        rows: &[RowSampling<'_>],
    ) -> Result<Vec<Sampled>, EngineError> {
        let batch = self.batch(plan, &seq_tokens, &vec![Vec::new(); plan.len()])?;
        let backend = self.model.backend();
        self.model.forward_sampled(
            &batch,
            &mut self.kv,
            &mut |layer, kv| {
                on_layer(&LayerDone {
                    layer,
                    kv,
                    backend,
                    plan,
                })
            },
            rows,
        )
    }

    /// The step of `plan` as the model takes it: each sequence's new tokens (its drafted ones
    /// after them), and which rows want logits.
    fn batch<'t>(
        &self,
        plan: &[PlannedSeq],
        seq_tokens: &impl Fn(SeqId) -> &'t [u32],
        drafted: &[Vec<u32>],
    ) -> Result<ForwardBatch, EngineError> {
        let inputs: Vec<SeqInput<'_>> = plan
            .iter()
            .zip(drafted)
            .map(|(p, drafted)| {
                let tokens = seq_tokens(p.seq);
                let complete = p.start_pos + p.len == tokens.len();
                let (tokens, logits) = match (drafted.is_empty(), complete) {
                    (false, _) => (drafted.as_slice(), LogitsWanted::All),
                    (true, true) => (&tokens[p.start_pos..], LogitsWanted::Last),
                    (true, false) => (
                        &tokens[p.start_pos..p.start_pos + p.len],
                        LogitsWanted::None,
                    ),
                };
                SeqInput {
                    tokens,
                    start_pos: p.start_pos,
                    block_table: &p.block_table,
                    logits,
                }
            })
            .collect();
        let cfg = self.model.config();
        ForwardBatch::new(
            &inputs,
            self.kv_layout.block_size,
            self.kv_layout.num_blocks,
            cfg.vocab_size,
            cfg.max_position_embeddings,
        )
    }

    /// Ends the step of `plan` (its logits dropped already): gives freed heap back to the kernel
    /// after large steps, and now and then after small ones. A step's activations and logits are
    /// freed when it ends, but glibc keeps freed heap pages resident: over a run that is tens of
    /// MiB held for nothing (the resident-memory budget is 1.3 × the weights file plus the KV
    /// pool). Trimming costs well under a millisecond, against tens of milliseconds for a step
    /// with that many rows.
    pub fn end_step(&mut self, plan: &[PlannedSeq]) {
        const LARGE_STEP_ROWS: usize = 64;
        const SMALL_STEPS_BETWEEN_TRIMS: usize = 8;
        let rows: usize = plan.iter().map(PlannedSeq::rows).sum();
        self.steps_since_trim += 1;
        if rows >= LARGE_STEP_ROWS || self.steps_since_trim >= SMALL_STEPS_BETWEEN_TRIMS {
            release_freed_heap();
            self.steps_since_trim = 0;
        }
    }
}

/// A drafting sequence computes its last token and the draft after it, and needs the logits of
/// every one of them to verify the draft: each planned sequence's tokens so (empty: no draft).
fn drafted<'t>(plan: &[PlannedSeq], seq_tokens: &impl Fn(SeqId) -> &'t [u32]) -> Vec<Vec<u32>> {
    plan.iter()
        .map(|p| match p.draft.is_empty() {
            true => Vec::new(),
            false => [seq_tokens(p.seq)[p.start_pos..].as_ref(), &p.draft].concat(),
        })
        .collect()
}

/// Passed to a step's layer callback once a layer's K/V are in the cache.
pub struct LayerDone<'a, B: Backend> {
    pub layer: usize,
    pub kv: &'a B::KvStore,
    pub backend: &'a B,
    pub plan: &'a [PlannedSeq],
}

impl<B: Backend> LayerDone<'_, B> {
    /// Appends this layer's KV of `blocks`, one after another, in transfer layout (see
    /// [`ModelRunner::read_kv_block`]); a GPU reads them in one copy.
    pub fn append_kv_blocks(&self, blocks: &[u32], out: &mut Vec<u8>) -> Result<(), EngineError> {
        let start = out.len();
        out.resize(
            start + blocks.len() * self.backend.kv_block_bytes(self.kv),
            0,
        );
        self.backend
            .read_kv_blocks(self.kv, self.layer, blocks, &mut out[start..]);
        // Mid-step: the read waited for itself; the step's own work goes on.
        self.backend.status()
    }
}

/// Gives freed heap back to the kernel: glibc keeps freed heap pages resident unless asked.
pub(crate) fn release_freed_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn malloc_trim(pad: usize) -> i32;
        }
        // SAFETY: malloc_trim only returns free heap memory to the kernel.
        unsafe {
            malloc_trim(0);
        }
    }
}
