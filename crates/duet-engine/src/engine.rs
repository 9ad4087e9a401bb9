//! A model with its KV cache: sequences are added, and each [`Engine::step`] runs one batched
//! forward over every sequence that has work (prompt chunks and decode tokens mixed), samples,
//! and reports the new tokens. This is the unit the services schedule; `duet generate` and
//! `duet bench engine` drive it directly.

use std::collections::BTreeMap;

use duet_kv::{BlockHash, BlockPool, BlockTable, block_hashes, hash_seed, next_block_hash};

use crate::EngineError;
use crate::backend::{Backend, KvDtype, KvDtypeChoice, KvLayout};
use crate::batch::{ForwardBatch, LogitsWanted, SeqInput};
use crate::device::Device;
use crate::generation::TextStream;
use crate::llama::Llama;
use crate::sampling::Sampler;
use duet_model::chat::{ChatMessage, ChatTemplate};
use duet_model::config::ModelConfig;
use duet_model::model_files::ModelFiles;
use duet_model::params::{FinishReason, Sampled, SamplingParams, StopCriteria};
use duet_model::tokenizer::Tokenizer;

/// Sizes of the engine's resources (also the engine flags of every command that loads a model).
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct EngineOptions {
    /// Kernel threads (0: one per core).
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "DUET_THREADS", default_value_t = EngineOptions::default().threads)
    )]
    pub threads: usize,
    /// Tokens per KV cache block.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "DUET_BLOCK_SIZE", default_value_t = EngineOptions::default().block_size)
    )]
    pub block_size: usize,
    /// KV cache capacity in tokens, over all sequences.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "DUET_KV_CACHE_TOKENS", default_value_t = EngineOptions::default().kv_cache_tokens)
    )]
    pub kv_cache_tokens: usize,
    /// Most tokens one forward step computes; longer prompts are prefilled in chunks. On a CPU,
    /// 128 costs no prefill speed and keeps a step's activations small; a GPU wants ~2048.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "DUET_MAX_STEP_TOKENS", default_value_t = EngineOptions::default().max_step_tokens)
    )]
    pub max_step_tokens: usize,
    /// Device the model runs on: cpu, cuda or cuda:N (CUDA needs a build with `--features cuda`).
    #[cfg_attr(feature = "cli", arg(long, env = "DUET_DEVICE", default_value_t = EngineOptions::default().device))]
    pub device: Device,
    /// On a GPU: share of the memory left free after loading the weights that the KV cache takes
    /// (sizes the cache instead of --kv-cache-tokens).
    #[cfg_attr(feature = "cli", arg(long, env = "DUET_GPU_MEMORY_FRACTION", default_value_t = EngineOptions::default().gpu_memory_fraction,
          value_parser = parse_fraction))]
    pub gpu_memory_fraction: f64,
    /// Element type of the KV cache: auto, f32, f16 or bf16. `auto` is f16 on a CPU for
    /// quantized or 16-bit weights (half the cache memory, attention reads and KV transfer
    /// bytes; greedy outputs of the default model unchanged) and f32 for f32 weights; bf16 on a
    /// GPU. Workers exchanging KV must use the same type.
    #[cfg_attr(feature = "cli", arg(long, env = "DUET_KV_DTYPE", value_enum, default_value_t = EngineOptions::default().kv_dtype))]
    pub kv_dtype: KvDtypeChoice,
}

#[cfg(feature = "cli")]
fn parse_fraction(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
        _ => Err(format!("{s:?} is not a fraction in (0, 1]")),
    }
}

/// The flags' defaults (the flags above take theirs from here).
impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            threads: 0,
            block_size: 16,
            kv_cache_tokens: 16384,
            max_step_tokens: 128,
            device: Device::Cpu,
            gpu_memory_fraction: 0.9,
            kv_dtype: KvDtypeChoice::Auto,
        }
    }
}

#[cfg(feature = "cli")]
impl EngineOptions {
    /// These options as the flags above: parsed back, they give `self`.
    pub fn to_args(&self) -> Vec<std::ffi::OsString> {
        let Self {
            threads,
            block_size,
            kv_cache_tokens,
            max_step_tokens,
            device,
            gpu_memory_fraction,
            kv_dtype,
        } = self;
        let kv_dtype =
            clap::ValueEnum::to_possible_value(kv_dtype).expect("every KV dtype is a flag value");
        [
            format!("--threads={threads}"),
            format!("--block-size={block_size}"),
            format!("--kv-cache-tokens={kv_cache_tokens}"),
            format!("--max-step-tokens={max_step_tokens}"),
            format!("--device={device}"),
            format!("--gpu-memory-fraction={gpu_memory_fraction}"),
            format!("--kv-dtype={}", kv_dtype.get_name()),
        ]
        .into_iter()
        .map(Into::into)
        .collect()
    }
}

/// Identifies a sequence inside one engine.
pub type SeqId = u64;

struct Sequence {
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens whose KV is in the cache.
    num_computed: usize,
    /// Prompt tokens found in the prefix cache at admission.
    num_cached_prompt: usize,
    table: BlockTable,
    /// Hashes of the full blocks registered so far.
    hashes: Vec<BlockHash>,
    /// Seed of those hashes: the model's, with the request's cache salt.
    hash_seed: u64,
    sampler: Sampler,
    stop: StopCriteria,
    text: TextStream,
    finish: Option<FinishReason>,
}

impl Sequence {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

/// What one step produced for one sequence.
#[derive(Clone, Debug)]
pub struct StepOutput {
    pub seq: SeqId,
    /// The sampled token (a final stop token included; its text is not).
    pub token: Sampled,
    /// Newly final text.
    pub text: String,
    pub finish: Option<FinishReason>,
}

pub struct Engine<B: Backend> {
    model: Llama<B>,
    kv: B::KvStore,
    kv_layout: KvLayout,
    blocks: BlockPool,
    tokenizer: Tokenizer,
    chat: Option<ChatTemplate>,
    options: EngineOptions,
    fingerprint: String,
    seqs: BTreeMap<SeqId, Sequence>,
    next_id: SeqId,
    preemptions: u64,
    /// Steps since freed heap was last given back (see [`Engine::release_step_heap`]).
    steps_since_trim: usize,
}

/// Loading builds and drops large temporaries (tokenizer tables, repacked-weight staging); glibc
/// keeps freed heap pages resident unless asked to give them back.
fn release_freed_heap() {
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

impl<B: Backend> Engine<B> {
    pub fn with_backend(
        backend: B,
        files: ModelFiles,
        options: EngineOptions,
    ) -> Result<Self, EngineError> {
        if options.block_size == 0
            || options.kv_cache_tokens < options.block_size
            || options.max_step_tokens == 0
        {
            return Err(EngineError::Config(format!(
                "block size {}, KV cache of {} tokens and step budget {} must all be positive, and the cache at least one block",
                options.block_size, options.kv_cache_tokens, options.max_step_tokens
            )));
        }
        let model = Llama::load(backend, &files)?;
        let kv_dtype = model
            .backend()
            .kv_dtype(options.kv_dtype, files.tensors.matrices_all_f32())?;
        let values_per_block = model
            .kv_layout(options.block_size, 1, kv_dtype)
            .values_per_token()
            * options.block_size;
        let num_blocks = model
            .backend()
            .kv_capacity_blocks(values_per_block)
            .unwrap_or(options.kv_cache_tokens / options.block_size);
        if num_blocks == 0 {
            return Err(EngineError::Config(format!(
                "no room for a KV cache block ({} values) on {}",
                values_per_block,
                model.backend().name()
            )));
        }
        let kv_layout = model.kv_layout(options.block_size, num_blocks, kv_dtype);
        let kv = model.backend().alloc_kv(kv_layout)?;
        let fingerprint = model_fingerprint(
            &files.config,
            &files.weights_digest,
            kv_dtype,
            options.block_size,
        );
        let engine = Self {
            fingerprint,
            model,
            kv,
            kv_layout,
            blocks: BlockPool::new(num_blocks, options.block_size),
            tokenizer: files.tokenizer,
            chat: files.chat_template,
            options,
            seqs: BTreeMap::new(),
            next_id: 0,
            preemptions: 0,
            steps_since_trim: 0,
        };
        release_freed_heap();
        Ok(engine)
    }

    pub fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    pub fn options(&self) -> &EngineOptions {
        &self.options
    }

    /// Identifies the model and KV geometry; KV is only exchanged between equal fingerprints.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    pub fn model(&self) -> &Llama<B> {
        &self.model
    }

    pub fn kv_store(&self) -> &B::KvStore {
        &self.kv
    }

    pub fn block_pool(&self) -> &BlockPool {
        &self.blocks
    }

    /// Geometry and element type of the KV cache.
    pub fn kv_layout(&self) -> KvLayout {
        self.kv_layout
    }

    /// Forgets every cached prefix block (blocks held by sequences are untouched).
    pub fn clear_prefix_cache(&mut self) {
        self.blocks.clear_cache();
    }

    /// Formats a conversation with the model's chat template (ChatML when it has none).
    pub fn apply_chat_template(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        let fallback;
        let template = match &self.chat {
            Some(t) => t,
            None => {
                fallback = ChatTemplate::chatml();
                &fallback
            }
        };
        Ok(template.apply(messages, true)?)
    }

    /// Token ids of a prompt (special tokens such as `<|im_start|>` are recognised).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        Ok(self.tokenizer.encode(text)?)
    }

    /// Validates a request against the model and admits it, reusing cached prefix blocks of the
    /// shared namespace (no cache salt).
    pub fn add_sequence(
        &mut self,
        prompt: Vec<u32>,
        params: SamplingParams,
        stop: StopCriteria,
    ) -> Result<SeqId, EngineError> {
        self.resume_sequence(prompt, Resumed::default(), "", params, stop)
    }

    /// The seed of the prefix hashes of requests with this cache salt: requests share cached
    /// blocks only when their salts are equal (empty: the shared namespace).
    pub fn hash_seed(&self, cache_salt: &str) -> u64 {
        hash_seed(
            self.fingerprint.as_bytes(),
            (!cache_salt.is_empty()).then_some(cache_salt),
        )
    }

    /// Admits a request that another worker started: the last `resumed.generated` of `tokens`
    /// were already generated (they count towards `max_tokens` and the penalties, and are not
    /// reported again) and `resumed.sent_text_bytes` of their text already reached the client.
    pub fn resume_sequence(
        &mut self,
        tokens: Vec<u32>,
        resumed: Resumed,
        cache_salt: &str,
        params: SamplingParams,
        stop: StopCriteria,
    ) -> Result<SeqId, EngineError> {
        params.validate()?;
        stop.validate()?;
        if resumed.generated >= stop.max_tokens || resumed.generated >= tokens.len() {
            return Err(EngineError::InvalidRequest(format!(
                "{} tokens already generated leave nothing to do (max_tokens {}, {} tokens in all)",
                resumed.generated,
                stop.max_tokens,
                tokens.len()
            )));
        }
        self.check_prompt(&tokens, stop.max_tokens - resumed.generated)?;
        let prompt_len = tokens.len() - resumed.generated;
        let bs = self.options.block_size;
        let seed = self.hash_seed(cache_salt);
        let hashes = block_hashes(seed, &tokens, bs);
        // Leave at least one token to compute: its logits give the next output token.
        let usable = hashes.len().min((tokens.len() - 1) / bs);
        let cached = self.blocks.lookup_prefix(&hashes[..usable]);
        let num_cached = cached.len() * bs;
        let id = self.next_id;
        self.next_id += 1;
        let mut sampler = Sampler::new(params, &tokens[..prompt_len]);
        sampler.record(&tokens[prompt_len..]);
        let text = TextStream::resumed(
            &self.tokenizer,
            stop.stop_strings.clone(),
            &tokens[prompt_len..],
            resumed.sent_text_bytes,
        )?;
        self.seqs.insert(
            id,
            Sequence {
                prompt_len,
                tokens,
                num_computed: num_cached,
                num_cached_prompt: num_cached.min(prompt_len),
                hashes: hashes[..cached.len()].to_vec(),
                hash_seed: seed,
                table: BlockTable::from_blocks(cached),
                sampler,
                stop,
                text,
                finish: None,
            },
        );
        Ok(id)
    }

    /// A prompt the model can take, with room for `max_tokens` more.
    fn check_prompt(&self, prompt: &[u32], max_tokens: usize) -> Result<(), EngineError> {
        let ctx = self.config().max_position_embeddings;
        let vocab = self.config().vocab_size;
        if prompt.is_empty() {
            return Err(EngineError::InvalidRequest("the prompt is empty".into()));
        }
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary (0..{vocab})"
            )));
        }
        if prompt.len() >= ctx {
            return Err(EngineError::InvalidRequest(format!(
                "the prompt has {} tokens; the model's context is {ctx}, leaving no room to generate",
                prompt.len()
            )));
        }
        if prompt.len() + max_tokens > ctx {
            return Err(EngineError::InvalidRequest(format!(
                "prompt ({} tokens) + max_tokens ({max_tokens}) exceeds the model's context of {ctx}",
                prompt.len()
            )));
        }
        Ok(())
    }

    /// Decode side of a transfer: holds blocks for `tokens`' KV, reusing locally cached full
    /// prefix blocks (their KV need not be sent). The blocks stay held until
    /// [`add_prefilled`](Self::add_prefilled) takes them or [`release`](Self::release) frees them.
    pub fn reserve(
        &mut self,
        tokens: &[u32],
        cache_salt: &str,
    ) -> Result<KvReservation, EngineError> {
        self.check_prompt(tokens, 1)?;
        let bs = self.options.block_size;
        let hash_seed = self.hash_seed(cache_salt);
        let hashes = block_hashes(hash_seed, tokens, bs);
        let cached = self.blocks.lookup_prefix(&hashes);
        let needed = tokens.len().div_ceil(bs) - cached.len();
        let fresh = match self.blocks.allocate(needed) {
            Ok(b) => b,
            Err(e) => {
                self.blocks.release(&cached)?;
                return Err(e.into());
            }
        };
        let cached_blocks = cached.len();
        let mut blocks = cached;
        blocks.extend(fresh);
        Ok(KvReservation {
            blocks,
            cached_blocks,
            num_tokens: tokens.len(),
            hash_seed,
        })
    }

    /// Frees a reservation that will not be used (cancelled request, expired lease, failed
    /// transfer).
    pub fn release(&mut self, reservation: KvReservation) -> Result<(), EngineError> {
        Ok(self.blocks.release(&reservation.blocks)?)
    }

    /// Starts generating for a prompt whose KV was written into `reservation` by a prefill
    /// worker, which also sampled `first`. Returns the sequence and the output for `first`
    /// (which may already finish it).
    pub fn add_prefilled(
        &mut self,
        prompt: Vec<u32>,
        reservation: KvReservation,
        first: Sampled,
        params: SamplingParams,
        stop: StopCriteria,
    ) -> Result<(SeqId, StepOutput), EngineError> {
        let checked = params
            .validate()
            .and_then(|_| stop.validate())
            .map_err(EngineError::from)
            .and_then(|_| self.check_prompt(&prompt, stop.max_tokens));
        if let Err(e) = checked {
            self.release(reservation)?;
            return Err(e);
        }
        if reservation.num_tokens != prompt.len() {
            self.release(reservation)?;
            return Err(EngineError::InvalidRequest(
                "the reservation was made for another prompt".into(),
            ));
        }
        let bs = self.options.block_size;
        let id = self.next_id;
        self.next_id += 1;
        let mut sampler = Sampler::new(params, &prompt);
        sampler.record(&[first.token]);
        let mut seq = Sequence {
            prompt_len: prompt.len(),
            num_computed: prompt.len(),
            num_cached_prompt: reservation.cached_blocks * bs,
            tokens: prompt,
            table: BlockTable::from_blocks(reservation.blocks),
            hashes: Vec::new(),
            hash_seed: reservation.hash_seed,
            sampler,
            text: TextStream::new(stop.stop_strings.clone()),
            stop,
            finish: None,
        };
        register_full_blocks(&mut seq, &mut self.blocks, bs)?;
        let out = advance(
            &mut seq,
            first,
            &self.tokenizer,
            self.config().max_position_embeddings,
            id,
        )?;
        if out.finish.is_some() {
            self.blocks.release(&seq.table.take())?;
        }
        self.seqs.insert(id, seq);
        Ok((id, out))
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

    fn check_block(&self, layer: usize, block: u32, len: usize) -> Result<(), EngineError> {
        if layer >= self.config().num_layers
            || block as usize >= self.blocks.num_blocks()
            || len != self.kv_block_bytes()
        {
            return Err(EngineError::InvalidBatch(format!(
                "KV block (layer {layer}, block {block}, {len} bytes) does not fit a cache of {} layers, {} blocks of {} bytes",
                self.config().num_layers,
                self.blocks.num_blocks(),
                self.kv_block_bytes()
            )));
        }
        Ok(())
    }

    /// Prompt tokens of a sequence that were found in the prefix cache.
    pub fn cached_prompt_tokens(&self, id: SeqId) -> Option<usize> {
        self.seqs.get(&id).map(|s| s.num_cached_prompt)
    }

    /// The blocks holding a sequence's KV, in position order.
    pub fn block_table(&self, id: SeqId) -> Option<&[u32]> {
        self.seqs.get(&id).map(|s| s.table.blocks())
    }

    /// All tokens (prompt and generated) of a sequence.
    pub fn tokens(&self, id: SeqId) -> Option<&[u32]> {
        self.seqs.get(&id).map(|s| s.tokens.as_slice())
    }

    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// Whether any sequence still has work.
    pub fn has_work(&self) -> bool {
        self.seqs.values().any(|s| s.finish.is_none())
    }

    /// Removes a sequence (finished or not) and releases its blocks; full blocks stay in the
    /// prefix cache.
    pub fn remove_sequence(&mut self, id: SeqId) -> Result<(), EngineError> {
        let mut seq = self
            .seqs
            .remove(&id)
            .ok_or(EngineError::UnknownSequence(id))?;
        self.blocks.release(&seq.table.take())?;
        Ok(())
    }

    /// Runs one forward step over every unfinished sequence (see [`Engine::step_with`]).
    pub fn step(&mut self) -> Result<Vec<StepOutput>, EngineError> {
        self.step_with(&mut |_| {})
    }

    /// Runs one forward step over every unfinished sequence: decode tokens first (oldest
    /// sequence first), then prompt chunks, within the step token budget. When the cache cannot
    /// hold a decoding sequence's next token, the newest sequences are preempted: their blocks are
    /// released (full ones stay in the prefix cache) and they are recomputed later. `on_layer` is
    /// called after each layer's K/V are written, with the step's plan, so a caller can ship KV
    /// while later layers still compute.
    pub fn step_with(
        &mut self,
        on_layer: &mut dyn FnMut(&LayerDone<'_, B>),
    ) -> Result<Vec<StepOutput>, EngineError> {
        let bs = self.options.block_size;
        let plan = self.plan_step()?;
        if plan.is_empty() {
            return Ok(Vec::new());
        }
        let inputs: Vec<SeqInput<'_>> = plan
            .iter()
            .map(|p| {
                let s = &self.seqs[&p.seq];
                SeqInput {
                    tokens: &s.tokens[p.start_pos..p.start_pos + p.len],
                    start_pos: p.start_pos,
                    block_table: s.table.blocks(),
                    logits: if p.start_pos + p.len == s.tokens.len() {
                        LogitsWanted::Last
                    } else {
                        LogitsWanted::None
                    },
                }
            })
            .collect();
        let cfg = self.model.config();
        let batch = ForwardBatch::new(
            &inputs,
            bs,
            self.blocks.num_blocks(),
            cfg.vocab_size,
            cfg.max_position_embeddings,
        )?;
        let batch_rows = batch.num_rows();
        let backend = self.model.backend();
        let mut logits = self.model.forward(&batch, &mut self.kv, &mut |layer, kv| {
            on_layer(&LayerDone {
                layer,
                kv,
                backend,
                plan: &plan,
            })
        })?;

        let mut outputs = Vec::new();
        let mut logit_row = 0;
        for p in &plan {
            let seq = self.seqs.get_mut(&p.seq).expect("planned sequences exist");
            seq.num_computed += p.len;
            register_full_blocks(seq, &mut self.blocks, bs)?;
            if seq.num_computed < seq.tokens.len() {
                continue; // a prompt chunk; no token yet
            }
            let sampled = seq.sampler.sample(logits.row_mut(logit_row));
            logit_row += 1;
            let out = advance(
                seq,
                sampled,
                &self.tokenizer,
                cfg.max_position_embeddings,
                p.seq,
            )?;
            if out.finish.is_some() {
                // Finished sequences give their blocks back at once (full ones stay cached);
                // the record stays until the caller removes it.
                self.blocks.release(&seq.table.take())?;
            }
            outputs.push(out);
        }
        drop((logits, batch));
        self.release_step_heap(batch_rows);
        Ok(outputs)
    }

    /// Gives freed heap back to the kernel after large steps, and now and then after small ones.
    /// A step's activations and logits are freed when it ends, but glibc keeps freed heap pages
    /// resident: over a run that is tens of MiB held for nothing (the resident-memory budget is
    /// 1.3 × the weights file plus the KV pool). Trimming costs well under a millisecond, against
    /// tens of milliseconds for a step with that many rows.
    fn release_step_heap(&mut self, rows: usize) {
        const LARGE_STEP_ROWS: usize = 64;
        const SMALL_STEPS_BETWEEN_TRIMS: usize = 8;
        self.steps_since_trim += 1;
        if rows >= LARGE_STEP_ROWS || self.steps_since_trim >= SMALL_STEPS_BETWEEN_TRIMS {
            release_freed_heap();
            self.steps_since_trim = 0;
        }
    }

    /// Chooses the sequences and token counts of the next step and gives them their blocks.
    fn plan_step(&mut self) -> Result<Vec<PlannedSeq>, EngineError> {
        let bs = self.options.block_size;
        let mut budget = self.options.max_step_tokens;
        let mut order: Vec<SeqId> = self
            .seqs
            .iter()
            .filter(|(_, s)| s.finish.is_none())
            .map(|(&id, _)| id)
            .collect();
        // Decoding sequences first (oldest first), then prompts (oldest first).
        order.sort_by_key(|id| {
            (
                self.seqs[id].tokens.len() - self.seqs[id].num_computed > 1,
                *id,
            )
        });
        let mut plan: Vec<PlannedSeq> = Vec::new();
        let mut preempted = Vec::new();
        for (i, &id) in order.iter().enumerate() {
            if budget == 0 {
                break;
            }
            if preempted.contains(&id) {
                continue; // recomputed in a later step
            }
            let seq = &self.seqs[&id];
            let n = (seq.tokens.len() - seq.num_computed).min(budget);
            let missing = seq.table.blocks_missing(seq.num_computed + n, bs);
            if missing > self.blocks.available() {
                let decoding = seq.tokens.len() - seq.num_computed == 1;
                if !decoding {
                    continue; // a prompt waits for room
                }
                // Make room by preempting the newest sequences not already in this step.
                for &victim in order[i + 1..].iter().rev() {
                    if missing <= self.blocks.available() {
                        break;
                    }
                    if !preempted.contains(&victim) {
                        self.preempt(victim)?;
                        preempted.push(victim);
                    }
                }
                if missing > self.blocks.available() {
                    continue;
                }
            }
            let new_blocks = self.blocks.allocate(missing)?;
            let seq = self.seqs.get_mut(&id).expect("listed above");
            seq.table.extend(new_blocks);
            plan.push(PlannedSeq {
                seq: id,
                start_pos: seq.num_computed,
                len: n,
                block_table: seq.table.blocks().to_vec(),
            });
            budget -= n;
        }
        if plan.is_empty() && self.has_work() {
            return Err(EngineError::Kv(duet_kv::KvError::Exhausted {
                requested: 1,
                available: self.blocks.available(),
            }));
        }
        Ok(plan)
    }

    /// Releases a sequence's blocks so it is recomputed from its tokens later.
    fn preempt(&mut self, id: SeqId) -> Result<(), EngineError> {
        let seq = self.seqs.get_mut(&id).expect("preempting a known sequence");
        self.blocks.release(&seq.table.take())?;
        seq.num_computed = 0;
        seq.hashes.clear();
        self.preemptions += 1;
        Ok(())
    }

    /// Sequences preempted (and recomputed) since the engine started.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }
}

/// Where a resumed request stands (see [`Engine::resume_sequence`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resumed {
    /// Trailing tokens of the prompt that were generated before.
    pub generated: usize,
    /// Bytes of their text already delivered.
    pub sent_text_bytes: usize,
}

/// KV blocks held on the decode side for a prompt whose KV is being transferred.
#[derive(Debug, PartialEq, Eq)]
pub struct KvReservation {
    /// One block per `block_size` tokens of the prompt, in order.
    pub blocks: Vec<u32>,
    /// Leading blocks already holding the prompt's KV from the local prefix cache.
    pub cached_blocks: usize,
    pub num_tokens: usize,
    /// Seed of the prompt's prefix hashes (the request's cache salt).
    pub hash_seed: u64,
}

/// One sequence's share of a step.
#[derive(Clone, Debug)]
pub struct PlannedSeq {
    pub seq: SeqId,
    /// Position of the first token computed.
    pub start_pos: usize,
    /// Tokens computed.
    pub len: usize,
    /// The sequence's blocks (covering at least `start_pos + len` positions).
    pub block_table: Vec<u32>,
}

/// Passed to a step's layer callback once a layer's K/V are in the cache.
pub struct LayerDone<'a, B: Backend> {
    pub layer: usize,
    pub kv: &'a B::KvStore,
    pub backend: &'a B,
    pub plan: &'a [PlannedSeq],
}

impl<B: Backend> LayerDone<'_, B> {
    /// Appends this layer's KV of `block` in transfer layout (see [`Engine::read_kv_block`]).
    pub fn append_kv_block(&self, block: u32, out: &mut Vec<u8>) -> Result<(), EngineError> {
        let start = out.len();
        out.resize(start + self.backend.kv_block_bytes(self.kv), 0);
        self.backend
            .read_kv_block(self.kv, self.layer, block as usize, &mut out[start..]);
        self.backend.sync()
    }
}

/// Appends a sampled token to a sequence and decides whether it finished.
fn advance(
    seq: &mut Sequence,
    sampled: Sampled,
    tokenizer: &Tokenizer,
    max_positions: usize,
    id: SeqId,
) -> Result<StepOutput, EngineError> {
    let is_stop_token = seq.stop.stop_token_ids.contains(&sampled.token)
        || (!seq.stop.ignore_eos && tokenizer.eos_token_ids().contains(&sampled.token));
    if is_stop_token {
        // Reported (it counts as generated) but not part of the text or the context.
        seq.finish = Some(FinishReason::Stop);
        let text = seq.text.finish(tokenizer)?;
        return Ok(StepOutput {
            seq: id,
            token: sampled,
            text,
            finish: seq.finish,
        });
    }
    seq.tokens.push(sampled.token);
    let (mut text, hit_stop_string) = seq.text.push(tokenizer, sampled.token)?;
    if hit_stop_string {
        seq.finish = Some(FinishReason::Stop);
    } else if seq.generated() >= seq.stop.max_tokens || seq.tokens.len() >= max_positions {
        seq.finish = Some(FinishReason::Length);
        text.push_str(&seq.text.finish(tokenizer)?);
    }
    Ok(StepOutput {
        seq: id,
        token: sampled,
        text,
        finish: seq.finish,
    })
}

/// Registers the content hash of every block that became full with computed KV.
fn register_full_blocks(
    seq: &mut Sequence,
    pool: &mut BlockPool,
    bs: usize,
) -> Result<(), EngineError> {
    let full = seq.num_computed / bs;
    if full <= seq.hashes.len() {
        return Ok(());
    }
    let mut prev = seq.hashes.last().copied();
    for b in seq.hashes.len()..full {
        let h = next_block_hash(
            seq.hash_seed,
            prev.unwrap_or(0),
            &seq.tokens[b * bs..(b + 1) * bs],
        );
        pool.register_hash(seq.table.blocks()[b], h)?;
        seq.hashes.push(h);
        prev = Some(h);
    }
    Ok(())
}

/// Architecture, geometry, dtype, block size and weights digest in one printable string.
fn model_fingerprint(
    c: &ModelConfig,
    digest: &[u8; 32],
    kv_dtype: KvDtype,
    block_size: usize,
) -> String {
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{:?}/L{}/H{}/KV{}/D{}/V{}/kv-{}/bs{}/{}",
        c.architecture,
        c.num_layers,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.vocab_size,
        kv_dtype,
        block_size,
        hex
    )
}
