//! A model with its KV cache: sequences are added, and each [`Engine::step`] runs one batched
//! forward over every sequence that has work (prompt chunks and decode tokens mixed), samples,
//! and reports the new tokens. This is the unit the services schedule; `duet generate` and
//! `duet bench engine` drive it directly.
//!
//! The engine composes three parts, as vLLM v1 does: the [`Scheduler`] decides what each step
//! computes, through the [`KvCacheManager`] it owns (the only owner of the block pool); the
//! [`ModelRunner`] runs the plan on the model; the engine samples and applies stop criteria.

use std::collections::BTreeMap;

use duet_kv::{BlockPool, KvCacheManager};

use crate::EngineError;
use crate::backend::{Backend, CpuKernels, KvDtype, KvDtypeChoice, KvLayout, PrefillAttention};
use crate::device::{Device, GpuWeights, Switch};
use crate::draft_model::DraftModel;
use crate::generation::TextStream;
use crate::grammars::Grammars;
use crate::kv_tiers::{KvTierOptions, finish_stored_writes, settle_kv_moves, stored_writes_done};
use crate::llama::Llama;
use crate::model_runner::{ModelRunner, release_freed_heap};
use crate::sampling::Sampler;
use crate::sampling_steps::RowSampling;
use crate::scheduler::Scheduler;
use crate::speculator::{DraftLength, NgramSpeculator, SpeculativeMode};
use duet_model::chat::{ChatMessage, ChatTemplate};
use duet_model::config::ModelConfig;
use duet_model::fp8::Quantization;
use duet_model::grammar::Grammar;
use duet_model::model_files::ModelFiles;
use duet_model::params::{FinishReason, PromptLimits, Sampled, SamplingParams, StopCriteria};
use duet_model::tokenizer::Tokenizer;

/// Sizes of the engine's resources (also the engine flags of every command that loads a model).
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct EngineOptions {
    /// Kernel threads (0: one per core). Fewer than the cores leaves a core for the grammar
    /// masks of constrained requests, computed while the forward pass runs.
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
    /// Most tokens one forward step computes; longer prompts are prefilled in chunks. 0: the
    /// device's budget, 128 on a CPU (costs no prefill speed, keeps a step's activations small)
    /// and 2048 on a GPU (a chunk that fills the tensor cores).
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
    /// Element type of the KV cache: auto, f32, f16, bf16, int8 or fp8. `auto` is f16 on a CPU
    /// for quantized or 16-bit weights (half the cache memory, attention reads and KV transfer
    /// bytes; greedy outputs of the default model unchanged) and f32 for f32 weights; bf16 on a
    /// GPU. int8 (CPU) keeps one scale per token and KV head: about half of f16's memory, reads
    /// and transfer bytes again. fp8 (GPU, compute capability 8.9+): E4M3 with a scale of 1 per
    /// layer, half bf16's bytes; not yet run on a GPU. Workers exchanging KV must use the same
    /// type.
    #[cfg_attr(feature = "cli", arg(long, env = "DUET_KV_DTYPE", value_enum, default_value_t = EngineOptions::default().kv_dtype))]
    pub kv_dtype: KvDtypeChoice,
    /// CPU kernels: auto (the best this CPU supports), portable, avx2, avx2-vnni (AVX2 with
    /// AVX-VNNI, Intel cores from Alder Lake on) or avx512. Forcing a path the CPU lacks is an
    /// error at load.
    #[cfg_attr(feature = "cli", arg(long, env = "DUET_CPU_KERNELS", value_enum, default_value_t = EngineOptions::default().cpu_kernels))]
    pub cpu_kernels: CpuKernels,
    /// Prefill attention on a GPU: legacy (Q and P in two bf16 terms each, f32-grade, run on
    /// H100 and H200) or fa (FlashAttention's numerics and tiles, ~1e-3 from float64; checked in
    /// the CPU emulator, not yet run on a GPU). Ignored on a CPU.
    #[cfg_attr(feature = "cli", arg(long, env = "DUET_PREFILL_ATTENTION", value_enum, default_value_t = EngineOptions::default().prefill_attention))]
    pub prefill_attention: PrefillAttention,
    /// Speculative decoding: off; ngram (prompt lookup: a decoding sequence's next tokens are
    /// drafted from what followed the last earlier occurrence of its last 2-4 tokens, in its
    /// prompt or output); or draft:<model> (the greedy continuation of a smaller model of the
    /// same tokenizer, a GGUF file or HF directory, loaded beside the target with a KV cache of
    /// as many tokens). A step computes the drafts with the next token and keeps the drafted
    /// tokens the model itself samples, so outputs, greedy or seeded, are those of decoding one
    /// token per step; a step yields up to --num-speculative-tokens + 1 tokens. ngram wins where
    /// the output copies spans of the context (code edits, summaries, RAG answers); drafting
    /// backs off for sequences whose drafts are rejected. Requests may opt out. CPU only for now.
    #[cfg_attr(feature = "cli", arg(long, env = "DUET_SPECULATIVE", default_value_t = EngineOptions::default().speculative))]
    pub speculative: SpeculativeMode,
    /// Most tokens drafted per sequence and step when speculating (>= 1).
    #[cfg_attr(feature = "cli", arg(long, env = "DUET_NUM_SPECULATIVE_TOKENS", default_value_t = EngineOptions::default().num_speculative_tokens))]
    pub num_speculative_tokens: usize,
    /// Drafts fill a step only up to this many rows (decoding tokens and drafts together): a
    /// large batch's step is already compute-bound, so drafting there costs about as much as it
    /// saves. With as many sequences decoding, nobody drafts.
    #[cfg_attr(feature = "cli", arg(long, env = "DUET_SPECULATIVE_MAX_STEP_ROWS", default_value_t = EngineOptions::default().speculative_max_step_rows))]
    pub speculative_max_step_rows: usize,
    /// On a GPU: each decode step's batch bucket (1, 2, 4, 8, 16, 24, 32, 48, 64, ... up to
    /// --max-step-tokens) is captured once as a CUDA graph and replayed, on or off. Off until
    /// it has run on a GPU (docs/gpu.md).
    #[cfg_attr(feature = "cli", arg(long, env = "DUET_CUDA_GRAPHS", value_enum, default_value_t = EngineOptions::default().cuda_graphs))]
    pub cuda_graphs: Switch,
    /// On a GPU: tokens drawn on the device, the same bits as the CPU sampler (so only tokens,
    /// not logits, come to the host), on or off. Off until it has run on a GPU.
    #[cfg_attr(feature = "cli", arg(long, env = "DUET_DEVICE_SAMPLING", value_enum, default_value_t = EngineOptions::default().device_sampling))]
    pub device_sampling: Switch,
    /// On a GPU: fused kernels (the QKV projection's output through RoPE into the KV cache in
    /// one launch; norms and attention writing the next product's bf16 operand), on or off.
    /// Off until they have run on a GPU.
    #[cfg_attr(feature = "cli", arg(long, env = "DUET_FUSED_KERNELS", value_enum, default_value_t = EngineOptions::default().fused_kernels))]
    pub fused_kernels: Switch,
    /// On a GPU: GGUF weights of a block format (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) dequantized to
    /// bf16 at load, or kept packed (the file's bytes: about a quarter of bf16's memory and
    /// reads for 4-bit formats) and dequantized in registers by the matrix kernels. bf16 until
    /// packed has run on a GPU.
    #[cfg_attr(feature = "cli", arg(long, env = "DUET_GPU_WEIGHTS", value_enum, default_value_t = EngineOptions::default().gpu_weights))]
    pub gpu_weights: GpuWeights,
    /// Weight quantization at load: none (matrices as the file stores them; an FP8 checkpoint
    /// stays FP8) or fp8 (the layers' projections of a F32/F16/BF16 model quantized to E4M3, a
    /// scale per output channel: half of bf16's weight memory and reads). A CPU serves FP8
    /// weights dequantized to bf16 (the accuracy reference); a GPU of compute capability 8.9 or
    /// more keeps them FP8 and multiplies through cuBLASLt's FP8 GEMM, each product's input
    /// quantized per token (not yet run on a GPU; older GPUs refuse FP8).
    #[cfg_attr(feature = "cli", arg(long, env = "DUET_QUANTIZATION", value_enum, default_value_t = EngineOptions::default().quantization))]
    pub quantization: Quantization,
    /// The tiers below the KV pool (host memory, disk).
    #[cfg_attr(feature = "cli", command(flatten))]
    pub kv_tiers: KvTierOptions,
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
            max_step_tokens: 0,
            device: Device::Cpu,
            gpu_memory_fraction: 0.9,
            kv_dtype: KvDtypeChoice::Auto,
            cpu_kernels: CpuKernels::Auto,
            prefill_attention: PrefillAttention::Legacy,
            speculative: SpeculativeMode::Off,
            num_speculative_tokens: 8,
            speculative_max_step_rows: 8,
            cuda_graphs: Switch::Off,
            device_sampling: Switch::Off,
            fused_kernels: Switch::Off,
            gpu_weights: GpuWeights::Bf16,
            quantization: Quantization::None,
            kv_tiers: KvTierOptions::default(),
        }
    }
}

impl EngineOptions {
    /// The step token budget: `max_step_tokens`, or the device's when that is 0.
    pub fn step_tokens(&self) -> usize {
        match self.max_step_tokens {
            0 => self.device.step_tokens(),
            n => n,
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
            cpu_kernels,
            prefill_attention,
            speculative,
            num_speculative_tokens,
            speculative_max_step_rows,
            cuda_graphs,
            device_sampling,
            fused_kernels,
            gpu_weights,
            quantization,
            kv_tiers,
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
            format!("--cpu-kernels={cpu_kernels}"),
            format!("--prefill-attention={prefill_attention}"),
            format!("--speculative={speculative}"),
            format!("--num-speculative-tokens={num_speculative_tokens}"),
            format!("--speculative-max-step-rows={speculative_max_step_rows}"),
            format!("--cuda-graphs={cuda_graphs}"),
            format!("--device-sampling={device_sampling}"),
            format!("--fused-kernels={fused_kernels}"),
            format!("--gpu-weights={gpu_weights}"),
            format!("--quantization={quantization}"),
        ]
        .into_iter()
        .chain(kv_tiers.to_args())
        .map(Into::into)
        .collect()
    }
}

// The engine's API names these; they are defined by the part that makes them.
pub use crate::model_runner::LayerDone;
pub use crate::scheduler::PlannedSeq;
pub use duet_kv::{KvFence, KvReservation, SeqId};

/// What turns a sequence's logits into output: sampling, stop criteria and text. Its tokens and
/// blocks are the scheduler's.
struct OutputState {
    prompt_len: usize,
    /// Prompt tokens found in the prefix cache at admission.
    num_cached_prompt: usize,
    sampler: Sampler,
    stop: StopCriteria,
    text: TextStream,
    /// How many tokens to draft next; `None`: this sequence is not speculated.
    draft_length: Option<DraftLength>,
    speculation: Speculation,
}

/// What speculative decoding did for one sequence on this engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Speculation {
    /// Forward steps that sampled tokens for the sequence.
    pub steps: u64,
    /// Speculated tokens computed and verified.
    pub draft_tokens: u64,
    /// Those the model sampled too (kept as output).
    pub accepted_draft_tokens: u64,
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
    /// What failed, when `finish` is [`FinishReason::Error`].
    pub error: Option<String>,
    /// The sequence's speculation so far on this engine (its steps, drafted and accepted
    /// tokens), up to and including the step of this output.
    pub speculation: Speculation,
}

pub struct Engine<B: Backend> {
    runner: ModelRunner<B>,
    scheduler: Scheduler,
    seqs: BTreeMap<SeqId, OutputState>,
    tokenizer: Tokenizer,
    chat: Option<ChatTemplate>,
    options: EngineOptions,
    fingerprint: String,
    next_id: SeqId,
    /// Compiles the constraints of requests admitted without their grammar.
    grammars: Grammars,
    /// The draft proposer when speculating.
    speculator: Option<Proposer<B>>,
    /// Over every sequence since the engine started.
    speculation_totals: Speculation,
    /// Grammar masks are computed on a thread of their own while the forward pass runs (where
    /// the backend leaves a host core free), not after it.
    overlap_grammar_masks: bool,
}

/// Where drafts come from when speculating.
enum Proposer<B: Backend> {
    Ngram(NgramSpeculator),
    Draft(Box<DraftModel<B>>),
}

impl<B: Backend> Engine<B> {
    pub fn with_backend(
        backend: B,
        files: ModelFiles,
        options: EngineOptions,
    ) -> Result<Self, EngineError> {
        if options.block_size == 0 || options.kv_cache_tokens < options.block_size {
            return Err(EngineError::Config(format!(
                "block size {} and KV cache of {} tokens must be positive, and the cache at least one block",
                options.block_size, options.kv_cache_tokens
            )));
        }
        let speculator = match &options.speculative {
            SpeculativeMode::Off => None,
            _ if options.num_speculative_tokens == 0 => {
                return Err(EngineError::Config(
                    "--num-speculative-tokens must be at least 1 when speculating".into(),
                ));
            }
            // Verification keeps the drafted tokens the model samples; that equals decoding one
            // token per step only where a row's logits do not depend on the rows beside it.
            _ if !backend.batch_invariant() => {
                return Err(EngineError::Config(format!(
                    "speculative decoding has not run on the {} backend yet; use --speculative off",
                    backend.name()
                )));
            }
            SpeculativeMode::Ngram => Some(Proposer::Ngram(NgramSpeculator::default())),
            SpeculativeMode::Draft(path) => {
                let Some(draft_backend) = backend.sibling() else {
                    return Err(EngineError::Config(format!(
                        "the {} backend cannot run a draft model beside the target",
                        backend.name()
                    )));
                };
                let draft_files = duet_model::model_files::open_model(path)?;
                let draft = DraftModel::load(draft_backend, &draft_files, &files, &options)?;
                Some(Proposer::Draft(Box::new(draft)))
            }
        };
        let overlap_grammar_masks = backend.host_core_free_during_forward();
        let runner = ModelRunner::load(backend, &files, &options)?;
        let kv_layout = runner.kv_layout();
        let (kv_dtype, num_blocks) = (kv_layout.dtype, kv_layout.num_blocks);
        let fingerprint = model_fingerprint(
            &files.config,
            &files.weights_digest,
            options.quantization,
            kv_dtype,
            options.block_size,
        );
        let mut kv_cache = KvCacheManager::new(num_blocks, options.block_size, &fingerprint);
        let block_bytes = runner.kv_block_bytes() * kv_layout.num_layers;
        if let Some(lower) = options.kv_tiers.build(
            runner.model().backend(),
            &kv_layout,
            block_bytes,
            &fingerprint,
        )? {
            kv_cache = kv_cache.with_lower_tiers(lower);
        }
        let (tokenizer, vocab_size) = (files.tokenizer, files.config.vocab_size);
        let grammars = Grammars::new(tokenizer.clone(), vocab_size);
        let engine = Self {
            runner,
            scheduler: Scheduler::new(
                kv_cache,
                options.step_tokens(),
                options.speculative_max_step_rows,
                vocab_size,
            ),
            seqs: BTreeMap::new(),
            tokenizer,
            chat: files.chat_template,
            options,
            fingerprint,
            next_id: 0,
            grammars,
            speculator,
            speculation_totals: Speculation::default(),
            overlap_grammar_masks,
        };
        // Loading builds and drops large temporaries (tokenizer tables, repacked-weight staging).
        release_freed_heap();
        Ok(engine)
    }

    pub fn config(&self) -> &ModelConfig {
        self.runner.model().config()
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
        self.runner.model()
    }

    pub fn kv_store(&self) -> &B::KvStore {
        self.runner.kv_store()
    }

    pub fn block_pool(&self) -> &BlockPool {
        self.scheduler.kv_cache().pool()
    }

    /// Geometry and element type of the KV cache.
    pub fn kv_layout(&self) -> KvLayout {
        self.runner.kv_layout()
    }

    /// Forgets every cached prefix block (blocks held by sequences keep their KV but are no
    /// longer shared).
    pub fn clear_prefix_cache(&mut self) {
        self.scheduler.kv_cache_mut().clear_prefix_cache();
    }

    /// The counts of each tier below the KV pool, fastest first (none without tiers).
    pub fn kv_tier_stats(&self) -> Vec<duet_kv::TierStats> {
        self.scheduler.kv_cache().tier_stats()
    }

    /// The prefill speed measured now (prompt tokens per second), for the cost model that
    /// weighs loading a block from a tier against computing it again.
    pub fn set_prefill_rate(&mut self, tokens_per_s: f64) {
        self.scheduler.kv_cache_mut().set_prefill_rate(tokens_per_s);
    }

    /// Moves KV the cache manager owes between the device store and the tiers below; blocks
    /// brought up are written when it returns.
    fn settle_kv_moves(&mut self) -> Result<(), EngineError> {
        if settle_kv_moves(&mut self.runner, self.scheduler.kv_cache_mut())? {
            finish_stored_writes(&self.runner, self.scheduler.kv_cache_mut())?;
        }
        Ok(())
    }

    /// Sequences held while their blocks load from a tier below join the steps once the loads
    /// have completed; the engine waits for them only when no other sequence could run.
    fn admit_loaded(&mut self) -> Result<(), EngineError> {
        if !self.scheduler.is_loading() {
            return Ok(());
        }
        if !stored_writes_done(&self.runner, self.scheduler.kv_cache_mut()) {
            if self.scheduler.has_runnable() {
                return Ok(());
            }
            finish_stored_writes(&self.runner, self.scheduler.kv_cache_mut())?;
        }
        self.scheduler.end_loading();
        Ok(())
    }

    /// Starts recording prefix-cache events (see [`take_kv_events`](Self::take_kv_events)).
    pub fn record_kv_events(&mut self) {
        self.scheduler.kv_cache_mut().record_events();
    }

    /// The prefix-cache events since the last call, and the digest of the cache after them.
    pub fn take_kv_events(&mut self) -> (Vec<duet_kv::KvEvent>, duet_kv::KvDigest) {
        self.scheduler.kv_cache_mut().take_events()
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
        Ok(template.apply(messages, true, &self.tokenizer().special_tokens())?)
    }

    /// Token ids of a prompt (special tokens such as `<|im_start|>` are recognised).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        Ok(self.tokenizer.encode(text)?)
    }

    /// Validates a request against the model and admits it, reusing cached prefix blocks of the
    /// shared namespace (no cache salt); its constraint, if any, is compiled here.
    pub fn add_sequence(
        &mut self,
        prompt: Vec<u32>,
        params: SamplingParams,
        stop: StopCriteria,
    ) -> Result<SeqId, EngineError> {
        self.resume_sequence(prompt, Resumed::default(), "", params, None, stop)
    }

    /// The compiler of requests' constraints, to compile them off the engine's thread (see
    /// [`resume_sequence`](Self::resume_sequence)).
    pub fn grammars(&self) -> &Grammars {
        &self.grammars
    }

    /// The seed of the prefix hashes of requests with this cache salt: requests share cached
    /// blocks only when their salts are equal (empty: the shared namespace).
    pub fn hash_seed(&self, cache_salt: &str) -> u64 {
        self.scheduler.kv_cache().hash_seed(cache_salt)
    }

    /// Admits a request that another worker started: the last `resumed.generated` of `tokens`
    /// were already generated (they count towards `max_tokens` and the penalties, and are not
    /// reported again) and `resumed.sent_text_bytes` of their text already reached the client.
    /// `grammar` is `params.constraint` compiled ahead by [`grammars`](Self::grammars) (a worker
    /// compiles on other threads: a compile here would stall every running sequence); `None`
    /// compiles it here.
    pub fn resume_sequence(
        &mut self,
        tokens: Vec<u32>,
        resumed: Resumed,
        cache_salt: &str,
        params: SamplingParams,
        grammar: Option<Grammar>,
        stop: StopCriteria,
    ) -> Result<SeqId, EngineError> {
        params.validate()?;
        stop.validate()?;
        if resumed.generated >= stop.max_tokens {
            return Err(EngineError::InvalidRequest(format!(
                "{} tokens already generated reach max_tokens {}: nothing is left to generate",
                resumed.generated, stop.max_tokens
            )));
        }
        // An empty request is left to `check_prompt`, which calls it what it is.
        if !tokens.is_empty() && resumed.generated >= tokens.len() {
            return Err(EngineError::InvalidRequest(format!(
                "all {} tokens are already generated ones: no prompt is left",
                tokens.len()
            )));
        }
        self.check_prompt(&tokens, stop.max_tokens - resumed.generated)?;
        let prompt_len = tokens.len() - resumed.generated;
        let id = self.next_id;
        self.next_id += 1;
        let mut sampler = self.sampler(params, grammar, &tokens[..prompt_len])?;
        sampler.record(&tokens[prompt_len..]);
        let text = TextStream::resumed(
            &self.tokenizer,
            stop.stop_strings.clone(),
            &tokens[prompt_len..],
            resumed.sent_text_bytes,
        )?;
        let added = self.scheduler.add_sequence(id, tokens, cache_salt);
        // Blocks brought up for its prefix may still be loading (a GPU copies them beside the
        // step in flight): the sequence joins a step once they are written.
        let loaded = settle_kv_moves(&mut self.runner, self.scheduler.kv_cache_mut())?;
        let num_cached = added?;
        if loaded && !stored_writes_done(&self.runner, self.scheduler.kv_cache_mut()) {
            self.scheduler.hold_loading(id);
        }
        self.seqs.insert(
            id,
            OutputState {
                prompt_len,
                num_cached_prompt: num_cached.min(prompt_len),
                draft_length: self.draft_length(sampler.params()),
                sampler,
                stop,
                text,
                speculation: Speculation::default(),
            },
        );
        Ok(id)
    }

    /// A request's sampler; a constrained one starts at the beginning of its grammar (`grammar`,
    /// or `params.constraint` compiled here).
    fn sampler(
        &self,
        params: SamplingParams,
        grammar: Option<Grammar>,
        prompt: &[u32],
    ) -> Result<Sampler, EngineError> {
        let grammar = match (grammar, &params.constraint) {
            (Some(grammar), _) => Some(grammar),
            (None, Some(constraint)) => Some(self.grammars.compile(constraint)?),
            (None, None) => None,
        };
        let sampler = Sampler::new(params, prompt);
        Ok(match grammar {
            Some(grammar) => sampler.with_grammar(grammar),
            None => sampler,
        })
    }

    /// A new sequence's draft length: none unless the engine speculates and the request allows.
    fn draft_length(&self, params: &SamplingParams) -> Option<DraftLength> {
        (self.speculator.is_some() && params.speculative)
            .then(|| DraftLength::new(self.options.num_speculative_tokens))
    }

    /// A prompt the model can take, with room for `max_tokens` more.
    fn check_prompt(&self, prompt: &[u32], max_tokens: usize) -> Result<(), EngineError> {
        let limits = PromptLimits {
            context_length: self.config().max_position_embeddings,
            vocab_size: self.config().vocab_size,
        };
        limits.check(prompt)?;
        Ok(limits.check_max_tokens(prompt.len(), max_tokens)?)
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
        let reserved = self.scheduler.kv_cache_mut().reserve(tokens, cache_salt);
        self.settle_kv_moves()?;
        Ok(reserved?)
    }

    /// Frees a reservation that will not be used (cancelled request, expired lease, failed
    /// transfer).
    pub fn release(&mut self, reservation: KvReservation) -> Result<(), EngineError> {
        Ok(self.scheduler.kv_cache_mut().release(reservation)?)
    }

    /// Holds the blocks a transfer writes into `reservation` until the fence is lifted,
    /// whatever becomes of the reservation (see [`KvCacheManager::fence`]).
    pub fn fence(&mut self, reservation: &KvReservation) -> Result<KvFence, EngineError> {
        Ok(self.scheduler.kv_cache_mut().fence(reservation)?)
    }

    pub fn lift_fence(&mut self, fence: KvFence) -> Result<(), EngineError> {
        Ok(self.scheduler.kv_cache_mut().lift_fence(fence)?)
    }

    /// Makes a reservation of `tokens` (whole blocks) whose KV was pulled from a peer a cached
    /// prefix here, and frees it.
    pub fn cache_reservation(
        &mut self,
        tokens: &[u32],
        reservation: KvReservation,
    ) -> Result<(), EngineError> {
        Ok(self
            .scheduler
            .kv_cache_mut()
            .cache_reservation(tokens, reservation)?)
    }

    /// Holds blocks `..blocks_end` of the prefix of `tokens` (whole blocks) held here, in the
    /// pool or brought up from below, and shows `on_layer` each layer's KV of them, with the
    /// physical block of each prefix block; then lets them go. `false` (nothing shown) unless
    /// every block is held. What a peer's pull is sent from, over any transport.
    pub fn send_prefix(
        &mut self,
        tokens: &[u32],
        cache_salt: &str,
        blocks_end: usize,
        on_layer: &mut dyn FnMut(&[u32], &LayerDone<'_, B>),
    ) -> Result<bool, EngineError> {
        let end = (blocks_end * self.options.block_size).min(tokens.len());
        let pinned = self
            .scheduler
            .kv_cache_mut()
            .pin_prefix(&tokens[..end], cache_salt);
        let sent = self.settle_kv_moves().map(|()| {
            if pinned.len() < blocks_end {
                return false;
            }
            for layer in 0..self.runner.kv_layout().num_layers {
                let done = LayerDone {
                    layer,
                    kv: self.runner.kv_store(),
                    backend: self.runner.model().backend(),
                    plan: &[],
                };
                on_layer(&pinned[..blocks_end], &done);
            }
            true
        });
        self.scheduler.kv_cache_mut().unpin(&pinned)?;
        sent
    }

    /// Starts generating for a prompt whose KV was written into `reservation` by a prefill
    /// worker, which also sampled `first`. Returns the sequence and the output for `first`
    /// (which may already finish it). `grammar` is as for
    /// [`resume_sequence`](Self::resume_sequence).
    pub fn add_prefilled(
        &mut self,
        prompt: Vec<u32>,
        reservation: KvReservation,
        first: Sampled,
        params: SamplingParams,
        grammar: Option<Grammar>,
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
        let mut sampler = match self.sampler(params, grammar, &prompt) {
            Ok(s) => s,
            Err(e) => {
                self.release(reservation)?;
                return Err(e);
            }
        };
        let id = self.next_id;
        self.next_id += 1;
        sampler.record(&[first.token]);
        let mut generation = OutputState {
            prompt_len: prompt.len(),
            num_cached_prompt: reservation.cached_blocks * self.options.block_size,
            draft_length: self.draft_length(sampler.params()),
            sampler,
            text: TextStream::new(stop.stop_strings.clone()),
            stop,
            speculation: Speculation::default(),
        };
        self.scheduler.add_prefilled(id, prompt, reservation)?;
        let max_positions = self.config().max_position_embeddings;
        let advanced = advance(
            &mut generation,
            id,
            first,
            &mut self.scheduler,
            &self.tokenizer,
            max_positions,
        );
        let out = match advanced {
            Ok(out) => out,
            Err(e) => {
                self.scheduler.remove(id)?;
                return Err(e);
            }
        };
        self.seqs.insert(id, generation);
        Ok((id, out))
    }

    /// Bytes of one (layer, block) of KV in transfer layout.
    pub fn kv_block_bytes(&self) -> usize {
        self.runner.kv_block_bytes()
    }

    /// Copies one (layer, block) of KV out, in transfer layout.
    pub fn read_kv_block(
        &self,
        layer: usize,
        block: u32,
        out: &mut [u8],
    ) -> Result<(), EngineError> {
        self.runner.read_kv_block(layer, block, out)
    }

    /// Writes one (layer, block) of KV received from a transfer.
    pub fn write_kv_block(
        &mut self,
        layer: usize,
        block: u32,
        data: &[u8],
    ) -> Result<(), EngineError> {
        self.runner.write_kv_block(layer, block, data)
    }

    /// Prompt tokens of a sequence that were found in the prefix cache.
    pub fn cached_prompt_tokens(&self, id: SeqId) -> Option<usize> {
        self.seqs.get(&id).map(|s| s.num_cached_prompt)
    }

    /// The blocks holding a sequence's KV, in position order.
    pub fn block_table(&self, id: SeqId) -> Option<&[u32]> {
        self.scheduler.kv_cache().blocks(id).map(|b| b.ids())
    }

    /// All tokens (prompt and generated) of a sequence.
    pub fn tokens(&self, id: SeqId) -> Option<&[u32]> {
        self.scheduler.tokens(id)
    }

    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// Whether any sequence still has work.
    pub fn has_work(&self) -> bool {
        self.scheduler.has_work()
    }

    /// Removes a sequence (finished or not) and releases its blocks; full blocks stay in the
    /// prefix cache.
    pub fn remove_sequence(&mut self, id: SeqId) -> Result<(), EngineError> {
        self.seqs
            .remove(&id)
            .ok_or(EngineError::UnknownSequence(id))?;
        if self.scheduler.is_loading() {
            // Its blocks go back to the pool: no load may still be writing them.
            finish_stored_writes(&self.runner, self.scheduler.kv_cache_mut())?;
        }
        if let Some(Proposer::Draft(draft)) = &mut self.speculator {
            draft.release(id)?;
        }
        Ok(self.scheduler.remove(id)?)
    }

    /// Runs one forward step over every unfinished sequence (see [`Engine::step_with`]).
    pub fn step(&mut self) -> Result<Vec<StepOutput>, EngineError> {
        self.step_with(&mut |_| {})
    }

    /// Runs one forward step over every unfinished sequence, as [`Scheduler::plan_step`] plans
    /// it: decode tokens first, then prompt chunks, within the step token budget, preempting the
    /// newest sequences when the cache cannot hold a decoding sequence's next token. `on_layer`
    /// is called after each layer's K/V are written, with the step's plan, so a caller can ship
    /// KV while later layers still compute.
    pub fn step_with(
        &mut self,
        on_layer: &mut dyn FnMut(&LayerDone<'_, B>),
    ) -> Result<Vec<StepOutput>, EngineError> {
        self.admit_loaded()?;
        let max_positions = self.config().max_position_embeddings;
        let (seqs, speculator) = (&mut self.seqs, &mut self.speculator);
        // A draft model's failure ends the step once planning is done.
        let mut draft_failure = None;
        let plan = self.scheduler.plan_step(&mut |id, tokens| {
            let (Some(speculator), Some(g)) = (speculator.as_mut(), seqs.get_mut(&id)) else {
                return Vec::new();
            };
            let Some(draft_length) = g.draft_length.as_mut() else {
                return Vec::new();
            };
            // Nothing past max_tokens (counting the token to compute) or the context.
            let generated = tokens.len() - g.prompt_len;
            let room = (g.stop.max_tokens.saturating_sub(generated + 1))
                .min(max_positions.saturating_sub(tokens.len()));
            let max_len = draft_length.for_step().min(room);
            match speculator {
                Proposer::Ngram(ngram) => ngram.propose(tokens, max_len),
                Proposer::Draft(_) if max_len == 0 || draft_failure.is_some() => Vec::new(),
                Proposer::Draft(draft) => draft.propose(id, tokens, max_len).unwrap_or_else(|e| {
                    draft_failure = Some(e);
                    Vec::new()
                }),
            }
        });
        // Blocks the plan took may have been evicted: their KV moves down before it is
        // overwritten.
        self.settle_kv_moves()?;
        let plan = plan?;
        if let Some(e) = draft_failure {
            return Err(e);
        }
        if plan.is_empty() {
            return Ok(Vec::new());
        }
        if self.runner.model().backend().samples_on_device()
            && plan.iter().all(|p| p.draft.is_empty())
        {
            return self.step_sampled_on_device(&plan, on_layer);
        }
        let constrained: Vec<&mut Sampler> = match self.overlap_grammar_masks {
            true => self
                .seqs
                .iter_mut()
                .filter(|(id, g)| g.sampler.constrained() && plan.iter().any(|p| p.seq == **id))
                .map(|(_, g)| &mut g.sampler)
                .collect(),
            false => Vec::new(),
        };
        let (runner, scheduler) = (&mut self.runner, &self.scheduler);
        let mut logits = std::thread::scope(|s| {
            // A mask needs only the tokens so far, not this step's logits.
            if !constrained.is_empty() {
                s.spawn(move || constrained.into_iter().for_each(Sampler::prepare_mask));
            }
            runner.forward(
                &plan,
                |seq| scheduler.tokens(seq).expect("planned sequences exist"),
                on_layer,
            )
        })?;
        let mut outputs = Vec::new();
        let mut logit_row = 0;
        for p in &plan {
            if !self.scheduler.record_computed(p)? {
                continue; // a prompt chunk; no token yet
            }
            let vocab = logits.vocab_size;
            let rows = &mut logits.data[logit_row * vocab..(logit_row + 1 + p.draft.len()) * vocab];
            logit_row += 1 + p.draft.len();
            let first_output = outputs.len();
            let generation = self.seqs.get_mut(&p.seq).expect("planned sequences exist");
            let accepted = verify(
                generation,
                p,
                rows,
                &mut self.scheduler,
                &self.tokenizer,
                max_positions,
                &mut outputs,
            )?;
            let s = &mut generation.speculation;
            s.steps += 1;
            if !p.draft.is_empty() {
                self.scheduler.end_draft(p.seq)?;
                s.draft_tokens += p.draft.len() as u64;
                s.accepted_draft_tokens += accepted as u64;
                if let Some(d) = &mut generation.draft_length {
                    d.verified(p.draft.len(), accepted);
                }
                let totals = &mut self.speculation_totals;
                totals.draft_tokens += p.draft.len() as u64;
                totals.accepted_draft_tokens += accepted as u64;
            }
            self.speculation_totals.steps += 1;
            for out in &mut outputs[first_output..] {
                out.speculation = generation.speculation;
            }
        }
        drop(logits);
        self.runner.end_step(&plan);
        Ok(outputs)
    }

    /// A step of `plan` (no drafts) whose tokens the backend draws on the device: each sequence
    /// the step completes hands its sampler's state over ([`Sampler::row`]) and accepts the token
    /// drawn, which equals what [`Sampler::sample`] draws from the same logits.
    fn step_sampled_on_device(
        &mut self,
        plan: &[PlannedSeq],
        on_layer: &mut dyn FnMut(&LayerDone<'_, B>),
    ) -> Result<Vec<StepOutput>, EngineError> {
        let max_positions = self.config().max_position_embeddings;
        // The sequences the step completes: the rows whose logits the model runner asks for.
        let completes: Vec<bool> = plan
            .iter()
            .map(|p| {
                let tokens = self
                    .scheduler
                    .tokens(p.seq)
                    .expect("planned sequences exist");
                p.start_pos + p.len == tokens.len()
            })
            .collect();
        for (p, _) in plan.iter().zip(&completes).filter(|(_, c)| **c) {
            let g = self.seqs.get_mut(&p.seq).expect("planned sequences exist");
            g.sampler.prepare_mask();
        }
        let (runner, scheduler, seqs) = (&mut self.runner, &self.scheduler, &self.seqs);
        let rows: Vec<RowSampling<'_>> = plan
            .iter()
            .zip(&completes)
            .filter(|(_, c)| **c)
            .map(|(p, _)| seqs[&p.seq].sampler.row())
            .collect();
        let sampled = runner.forward_sampled(
            plan,
            |seq| scheduler.tokens(seq).expect("planned sequences exist"),
            on_layer,
            &rows,
        )?;
        let mut sampled = sampled.into_iter();
        let mut outputs = Vec::new();
        for p in plan {
            if !self.scheduler.record_computed(p)? {
                continue; // a prompt chunk; no token yet
            }
            let token = sampled.next().ok_or_else(|| {
                EngineError::Device("the device drew fewer tokens than the step completed".into())
            })?;
            let generation = self.seqs.get_mut(&p.seq).expect("planned sequences exist");
            generation.sampler.accept(token.token);
            generation.speculation.steps += 1;
            self.speculation_totals.steps += 1;
            outputs.push(advance(
                generation,
                p.seq,
                token,
                &mut self.scheduler,
                &self.tokenizer,
                max_positions,
            )?);
        }
        self.runner.end_step(plan);
        Ok(outputs)
    }

    /// Speculative decoding over every sequence since the engine started: sampling steps (one
    /// per sequence per step), drafted and accepted tokens.
    pub fn speculation_totals(&self) -> Speculation {
        self.speculation_totals
    }

    /// Whether grammar masks are computed while the forward pass runs (see
    /// [`Backend::host_core_free_during_forward`]).
    pub fn overlaps_grammar_masks(&self) -> bool {
        self.overlap_grammar_masks
    }

    /// Sequences preempted (and recomputed) since the engine started.
    pub fn preemptions(&self) -> u64 {
        self.scheduler.preemptions()
    }

    /// Drafts cut before a token outside the model's vocabulary since the engine started (see
    /// [`Scheduler::plan_step`]).
    pub fn out_of_vocab_drafts(&self) -> u64 {
        self.scheduler.out_of_vocab_drafts()
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

/// Samples a planned sequence's tokens from its step's logits `rows` (the row of its last token,
/// then one per drafted token) and appends them to `outputs`: one token per row while the sampled
/// token is the drafted one, ending with the first that differs (the model's own pick), the
/// token after the whole draft, or the sequence's finish. Each row is sampled exactly as decoding
/// one token per step would have sampled it, so the output, and the random stream of a seeded
/// sampler, are unchanged. For a drafted token this is the rejection-sampling rule of
/// speculative decoding with a draft distribution that puts all its mass on that token: it is
/// accepted with the target probability `p(d)`, and on rejection the token drawn follows `p`
/// without `d`, renormalised. Returns the number of drafted tokens accepted.
fn verify(
    generation: &mut OutputState,
    planned: &PlannedSeq,
    rows: &mut [f32],
    scheduler: &mut Scheduler,
    tokenizer: &Tokenizer,
    max_positions: usize,
    outputs: &mut Vec<StepOutput>,
) -> Result<usize, EngineError> {
    let mut accepted = 0;
    let vocab = rows.len() / (1 + planned.draft.len());
    for (i, row) in rows.chunks_exact_mut(vocab).enumerate() {
        let sampled = generation.sampler.sample(row);
        let token = sampled.token;
        let out = advance(
            generation,
            planned.seq,
            sampled,
            scheduler,
            tokenizer,
            max_positions,
        )?;
        let finished = out.finish.is_some();
        outputs.push(out);
        if planned.draft.get(i) != Some(&token) {
            break; // the token after the whole draft, or the model's own pick
        }
        accepted += 1;
        if finished {
            break;
        }
        // Its KV was computed in this step, from the row of the drafted token.
        scheduler.record_draft_accepted(planned.seq)?;
    }
    Ok(accepted)
}

/// Appends a sampled token to a sequence and decides whether it finished; a finished sequence
/// gives its blocks back at once (full ones stay cached), its record stays until removed.
fn advance(
    generation: &mut OutputState,
    id: SeqId,
    sampled: Sampled,
    scheduler: &mut Scheduler,
    tokenizer: &Tokenizer,
    max_positions: usize,
) -> Result<StepOutput, EngineError> {
    let stop = &generation.stop;
    // A grammar that failed (an llguidance error) ends the sequence with the failure, and the
    // token drawn is not part of the answer: the grammar could not vouch for it.
    let error = generation.sampler.grammar_failure();
    let is_stop_token = stop.stop_token_ids.contains(&sampled.token)
        || (!stop.ignore_eos && tokenizer.eos_token_ids().contains(&sampled.token));
    let (text, finish) = if error.is_some() || is_stop_token {
        // Reported (it counts as generated) but not part of the text or the context.
        let reason = match error {
            Some(_) => FinishReason::Error,
            None => FinishReason::Stop,
        };
        (generation.text.finish(tokenizer)?, Some(reason))
    } else {
        let num_tokens = scheduler.append_token(id, sampled.token)?;
        let (mut text, hit_stop_string) = generation.text.push(tokenizer, sampled.token)?;
        let finish = if hit_stop_string {
            Some(FinishReason::Stop)
        } else if generation.sampler.grammar_complete() {
            // The text is a whole sentence of the request's grammar: nothing may follow.
            text.push_str(&generation.text.finish(tokenizer)?);
            Some(FinishReason::Stop)
        } else if num_tokens - generation.prompt_len >= stop.max_tokens
            || num_tokens >= max_positions
        {
            text.push_str(&generation.text.finish(tokenizer)?);
            Some(FinishReason::Length)
        } else {
            None
        };
        (text, finish)
    };
    if finish.is_some() {
        scheduler.finish(id)?;
    }
    Ok(StepOutput {
        seq: id,
        token: sampled,
        text,
        finish,
        error,
        speculation: generation.speculation,
    })
}

/// Architecture, geometry, dtype, block size and weights digest in one printable string.
fn model_fingerprint(
    c: &ModelConfig,
    digest: &[u8; 32],
    quantization: Quantization,
    kv_dtype: KvDtype,
    block_size: usize,
) -> String {
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    // The same file quantized at load computes other KV.
    let quantized = match quantization {
        Quantization::None => String::new(),
        q => format!("/q-{q}"),
    };
    // The same weights with another RoPE scaling (a config edited) compute other KV.
    let rope = match &c.rope_scaling {
        duet_model::rope::RopeScaling::None => String::new(),
        scaling => format!("/rope-{}", scaling.tag()),
    };
    format!(
        "{:?}/L{}/H{}/KV{}/D{}/V{}/kv-{}/bs{}/{}{rope}{quantized}",
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
