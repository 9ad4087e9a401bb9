//! `duet bench kv-dtype`: a KV cache type (int8) against a reference type (f16) on the same
//! model in one run, on the CPU.
//!
//! Accuracy, at the model's forward pass: for each prompt, the reference cache decodes greedily
//! and the compared cache is fed the same tokens (teacher forcing), so every position's logits
//! are compared on the same input: ‖Δ‖/‖ref‖, and whether the top token agrees (and where not,
//! how close the reference's top two logits were). Then the compared cache decodes greedily on
//! its own, and its tokens are compared with the reference's.
//!
//! Speed, through the engine: decode at one long context at each batch size, the two caches'
//! engines loaded side by side and measured in turn, repeat after repeat, so that a slow phase
//! of the host does not land on one type only.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, ensure};
use clap::Args;
use duet_cpu::CpuBackend;
use duet_cpu::quant::KernelPath;
use duet_engine::backend::{Backend, KvDtype, KvDtypeChoice};
use duet_engine::batch::{ForwardBatch, LogitsWanted, SeqInput};
use duet_engine::engine::{Engine, EngineOptions};
use duet_engine::llama::Llama;
use duet_engine::sampling::argmax;
use duet_model::chat::ChatMessage;
use duet_model::model_files::open_model;
use duet_model::model_path::ModelArgs;
use serde::Serialize;

use crate::bench_engine::{
    Cpu, PrefilledPrompt, cpu_info, decode_point, kernel_threads, print_json, prompt_source,
};

#[derive(Args, Debug)]
pub struct KvDtypeBenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Engine options; `--kv-dtype` is the cache compared (int8 when `auto`).
    #[command(flatten)]
    pub engine: EngineOptions,
    /// The cache type the compared one is measured against.
    #[arg(long, value_enum, default_value_t = KvDtypeChoice::F16)]
    pub reference_kv_dtype: KvDtypeChoice,
    /// Greedy tokens decoded per prompt for the accuracy comparison.
    #[arg(long, default_value_t = 256)]
    pub tokens: usize,
    /// Decode context of the speed points: tokens of KV every sequence holds when the timed
    /// steps start.
    #[arg(long, default_value_t = 2048)]
    pub context: usize,
    /// Decode batch sizes of the speed points.
    #[arg(long, value_delimiter = ',', default_value = "1,32")]
    pub batch: Vec<usize>,
    /// Decode steps timed at each point, after one untimed step.
    #[arg(long, default_value_t = 32)]
    pub decode_steps: usize,
    /// Timed runs of each point and type, taken in turn; the best is reported.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Write the JSON report here too.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
}

/// The accuracy prompts: chat turns of the kinds users send (facts, code, lists, prose).
const PROMPTS: [&str; 8] = [
    "What is the capital of France, and what is it known for?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List five tips for staying productive when working from home.",
    "Explain how a rainbow forms, in simple terms.",
    "Write a short story about a robot who learns to paint.",
    "What are the differences between TCP and UDP?",
    "Summarize the plot of Romeo and Juliet in a paragraph.",
    "Give me a recipe for a simple tomato soup.",
];

#[derive(Serialize)]
struct Report {
    model: String,
    cpu: Cpu,
    kernel_path: String,
    threads: usize,
    reference: CacheType,
    compared: CacheType,
    accuracy: Accuracy,
    speed: Vec<SpeedPoint>,
}

#[derive(Serialize)]
struct CacheType {
    dtype: String,
    /// Cache bytes per token, every layer, K and V, scales included.
    kv_bytes_per_token: usize,
    /// Bytes of one (layer, block) in a KV push.
    push_bytes_per_layer_block: usize,
}

#[derive(Serialize)]
struct Accuracy {
    tokens_per_prompt: usize,
    prompts: Vec<PromptAccuracy>,
    /// Over every position of every prompt.
    mean_relative_logit_error: f64,
    max_relative_logit_error: f64,
    /// Teacher-forced positions whose top token is the reference's.
    top_token_agreement: f64,
    /// Prompts whose free-running greedy tokens equal the reference's, all of them.
    prompts_identical: usize,
    /// Free-running greedy tokens equal to the reference's before the first difference, over
    /// all prompts' tokens.
    tokens_before_first_difference: f64,
}

#[derive(Serialize)]
struct PromptAccuracy {
    prompt_tokens: usize,
    mean_relative_logit_error: f64,
    max_relative_logit_error: f64,
    top_token_agreement: f64,
    /// Teacher-forced positions whose top tokens differ, with the reference's top two logits.
    disagreements: Vec<Disagreement>,
    /// The first generated token where free-running greedy decoding differs, if any.
    first_difference: Option<usize>,
}

#[derive(Serialize)]
struct Disagreement {
    position: usize,
    reference_token: u32,
    compared_token: u32,
    /// The reference's logits of its own top token and of the compared cache's.
    reference_logits: (f32, f32),
}

#[derive(Serialize)]
struct SpeedPoint {
    batch: usize,
    context: usize,
    reference_tokens_per_s: f64,
    compared_tokens_per_s: f64,
    /// compared ÷ reference.
    ratio: f64,
}

pub fn run(args: KvDtypeBenchArgs) -> Result<()> {
    ensure!(
        args.tokens > 0 && args.context > 0 && args.decode_steps > 0 && args.repeats > 0,
        "--tokens, --context, --decode-steps and --repeats must be positive"
    );
    ensure!(
        !args.batch.is_empty() && !args.batch.contains(&0),
        "--batch takes positive numbers"
    );
    ensure!(
        args.engine.device == duet_engine::device::Device::Cpu,
        "duet bench kv-dtype runs on the CPU (--device cpu)"
    );
    let path = args.model.resolve()?;
    let compared_choice = match args.engine.kv_dtype {
        KvDtypeChoice::Auto => KvDtypeChoice::Int8,
        d => d,
    };
    let options = |kv_dtype| {
        let blocks = |tokens: usize| tokens.div_ceil(args.engine.block_size);
        let batch = args.batch.iter().max().copied().unwrap_or(1);
        EngineOptions {
            kv_dtype,
            kv_cache_tokens: (blocks(args.context)
                + batch * blocks(args.context + args.decode_steps + 3))
                * args.engine.block_size,
            ..args.engine.clone()
        }
    };
    eprintln!(
        "loading {} twice: {} and {} KV caches",
        path.display(),
        args.reference_kv_dtype,
        compared_choice
    );
    let mut reference = duet_cpu::load_engine(&path, options(args.reference_kv_dtype))?;
    let mut compared = duet_cpu::load_engine(&path, options(compared_choice))?;
    let kernels = KernelPath::choose(args.engine.cpu_kernels)?;
    let threads = kernel_threads(&args.engine);
    let cpu = cpu_info();
    eprintln!(
        "cpu: {} (family {} model {}), kernel path {kernels:?}, {threads} threads",
        cpu.model, cpu.family, cpu.model_number
    );

    let prompts = PROMPTS
        .iter()
        .map(|text| {
            let chat = reference.apply_chat_template(&[ChatMessage::new("user", *text)])?;
            Ok(reference.encode(&chat)?)
        })
        .collect::<Result<Vec<_>>>()?;
    let (ref_dtype, cmp_dtype) = (reference.kv_layout().dtype, compared.kv_layout().dtype);
    let accuracy = accuracy(
        &path,
        CpuBackend::with_kernels(threads, kernels),
        (ref_dtype, cmp_dtype),
        &prompts,
        args.tokens,
    )?;
    let speed = speed(&args, &mut reference, &mut compared)?;
    let cache_type = |e: &Engine<CpuBackend>| {
        let l = e.kv_layout();
        CacheType {
            dtype: l.dtype.name().into(),
            kv_bytes_per_token: l.bytes_per_token(),
            push_bytes_per_layer_block: l.layer_block_bytes(),
        }
    };
    let report = Report {
        model: path.display().to_string(),
        cpu,
        kernel_path: format!("{kernels:?}"),
        threads,
        reference: cache_type(&reference),
        compared: cache_type(&compared),
        accuracy,
        speed,
    };
    print_report(&report);
    print_json(&report, args.json_out.as_deref())
}

/// A model with one cache of each type to compare, one prompt at a time (blocks `0..`).
struct TwoCaches {
    model: Llama<CpuBackend>,
    reference: duet_cpu::CpuKvStore,
    compared: duet_cpu::CpuKvStore,
    block_table: Vec<u32>,
}

const BLOCK_SIZE: usize = 16;

impl TwoCaches {
    /// The logits of the last of `tokens`, which start at `start_pos`, through `kv`.
    fn last_logits(
        model: &Llama<CpuBackend>,
        kv: &mut duet_cpu::CpuKvStore,
        block_table: &[u32],
        tokens: &[u32],
        start_pos: usize,
    ) -> Result<Vec<f32>> {
        let c = model.config();
        let batch = ForwardBatch::new(
            &[SeqInput {
                tokens,
                start_pos,
                block_table,
                logits: LogitsWanted::Last,
            }],
            BLOCK_SIZE,
            block_table.len(),
            c.vocab_size,
            c.max_position_embeddings,
        )?;
        Ok(model.forward(&batch, kv, &mut |_, _| {})?.row(0).to_vec())
    }

    /// Greedy decoding of `n` tokens after `prompt` through the compared cache alone.
    fn greedy_compared(&mut self, prompt: &[u32], n: usize) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(n);
        let mut logits = Self::last_logits(
            &self.model,
            &mut self.compared,
            &self.block_table,
            prompt,
            0,
        )?;
        for i in 0..n {
            let token = argmax(&logits);
            out.push(token);
            if i + 1 < n {
                let pos = prompt.len() + i;
                logits = Self::last_logits(
                    &self.model,
                    &mut self.compared,
                    &self.block_table,
                    &[token],
                    pos,
                )?;
            }
        }
        Ok(out)
    }

    /// The reference's greedy decoding of `n` tokens after `prompt`, with the compared cache fed
    /// the same tokens: the comparison of every position, and the reference's tokens.
    fn teacher_forced(&mut self, prompt: &[u32], n: usize) -> Result<(PromptAccuracy, Vec<u32>)> {
        let (mut errors, mut agree, mut disagreements, mut tokens) =
            (Vec::new(), 0, Vec::new(), Vec::with_capacity(n));
        let (mut input, mut start) = (prompt.to_vec(), 0);
        for i in 0..n {
            let table = &self.block_table;
            let r = Self::last_logits(&self.model, &mut self.reference, table, &input, start)?;
            let c = Self::last_logits(&self.model, &mut self.compared, table, &input, start)?;
            errors.push(relative_error(&c, &r));
            let (rt, ct) = (argmax(&r), argmax(&c));
            if rt == ct {
                agree += 1;
            } else {
                disagreements.push(Disagreement {
                    position: i,
                    reference_token: rt,
                    compared_token: ct,
                    reference_logits: (r[rt as usize], r[ct as usize]),
                });
            }
            tokens.push(rt);
            start += input.len();
            input = vec![rt];
        }
        let accuracy = PromptAccuracy {
            prompt_tokens: prompt.len(),
            mean_relative_logit_error: errors.iter().sum::<f64>() / n as f64,
            max_relative_logit_error: errors.iter().copied().fold(0.0, f64::max),
            top_token_agreement: agree as f64 / n as f64,
            disagreements,
            first_difference: None,
        };
        Ok((accuracy, tokens))
    }
}

/// ‖got − want‖ / ‖want‖, in f64.
fn relative_error(got: &[f32], want: &[f32]) -> f64 {
    let (mut diff, mut norm) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        diff += (g as f64 - w as f64).powi(2);
        norm += (w as f64).powi(2);
    }
    (diff / norm).sqrt()
}

fn accuracy(
    path: &Path,
    backend: CpuBackend,
    (reference, compared): (KvDtype, KvDtype),
    prompts: &[Vec<u32>],
    tokens: usize,
) -> Result<Accuracy> {
    let files = open_model(path)?;
    let model = Llama::load(backend, &files)?;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let blocks = (longest + tokens).div_ceil(BLOCK_SIZE);
    let cache = |dtype| {
        let layout = model.kv_layout(BLOCK_SIZE, blocks, dtype);
        model.backend().alloc_kv(layout)
    };
    let (reference, compared) = (cache(reference)?, cache(compared)?);
    let mut caches = TwoCaches {
        model,
        reference,
        compared,
        block_table: (0..blocks as u32).collect(),
    };
    let mut results = Vec::new();
    for (i, prompt) in prompts.iter().enumerate() {
        let (mut result, want) = caches.teacher_forced(prompt, tokens)?;
        let got = caches.greedy_compared(prompt, tokens)?;
        result.first_difference = got.iter().zip(&want).position(|(g, w)| g != w);
        eprintln!(
            "[{}/{}] prompt of {} tokens: ‖Δ‖/‖ref‖ mean {:.2e} max {:.2e}, top token agrees at {:.1}%, greedy tokens {}",
            i + 1,
            prompts.len(),
            prompt.len(),
            result.mean_relative_logit_error,
            result.max_relative_logit_error,
            100.0 * result.top_token_agreement,
            result
                .first_difference
                .map_or(format!("identical over {tokens}"), |p| format!(
                    "differ from token {p}"
                ))
        );
        results.push(result);
    }
    let n = results.len() as f64;
    Ok(Accuracy {
        tokens_per_prompt: tokens,
        mean_relative_logit_error: results
            .iter()
            .map(|r| r.mean_relative_logit_error)
            .sum::<f64>()
            / n,
        max_relative_logit_error: results
            .iter()
            .map(|r| r.max_relative_logit_error)
            .fold(0.0, f64::max),
        top_token_agreement: results.iter().map(|r| r.top_token_agreement).sum::<f64>() / n,
        prompts_identical: results
            .iter()
            .filter(|r| r.first_difference.is_none())
            .count(),
        tokens_before_first_difference: results
            .iter()
            .map(|r| r.first_difference.unwrap_or(tokens) as f64)
            .sum::<f64>()
            / (n * tokens as f64),
        prompts: results,
    })
}

fn speed(
    args: &KvDtypeBenchArgs,
    reference: &mut Engine<CpuBackend>,
    compared: &mut Engine<CpuBackend>,
) -> Result<Vec<SpeedPoint>> {
    let context = args.context;
    let mut prompt = prompt_source(reference.config().vocab_size);
    let text = prompt(context);
    let what = |dtype: KvDtype| format!("prefilling the {context}-token context ({dtype})");
    let ref_source = PrefilledPrompt::new(reference, text.clone())
        .with_context(|| what(reference.kv_layout().dtype))?;
    let cmp_source =
        PrefilledPrompt::new(compared, text).with_context(|| what(compared.kv_layout().dtype))?;
    let mut points = Vec::new();
    for &batch in &args.batch {
        let (mut best_ref, mut best_cmp) = (0f64, 0f64);
        for r in 0..args.repeats {
            let steps = args.decode_steps;
            let m = decode_point(reference, &ref_source, batch, steps, 1)?;
            best_ref = best_ref.max(m.tokens_per_s);
            let m = decode_point(compared, &cmp_source, batch, steps, 1)?;
            best_cmp = best_cmp.max(m.tokens_per_s);
            eprintln!(
                "batch {batch} at context {context}, round {}/{}: best so far {best_ref:.1} vs {best_cmp:.1} tok/s",
                r + 1,
                args.repeats
            );
        }
        points.push(SpeedPoint {
            batch,
            context,
            reference_tokens_per_s: best_ref,
            compared_tokens_per_s: best_cmp,
            ratio: best_cmp / best_ref,
        });
    }
    ref_source.release(reference)?;
    cmp_source.release(compared)?;
    Ok(points)
}

fn print_report(r: &Report) {
    println!(
        "KV cache {} against {}: {} on {}, {} threads ({}, family {} model {})",
        r.compared.dtype,
        r.reference.dtype,
        r.model,
        r.kernel_path,
        r.threads,
        r.cpu.model,
        r.cpu.family,
        r.cpu.model_number
    );
    for c in [&r.reference, &r.compared] {
        println!(
            "  {}: {} bytes per token of cache, {} bytes per (layer, block) pushed",
            c.dtype, c.kv_bytes_per_token, c.push_bytes_per_layer_block
        );
    }
    let a = &r.accuracy;
    println!(
        "accuracy over {} prompts × {} tokens: logits ‖Δ‖/‖ref‖ mean {:.2e}, max {:.2e}; top token agrees at {:.2}% of teacher-forced positions; greedy tokens identical on {}/{} prompts, {:.1}% of tokens before the first difference",
        a.prompts.len(),
        a.tokens_per_prompt,
        a.mean_relative_logit_error,
        a.max_relative_logit_error,
        100.0 * a.top_token_agreement,
        a.prompts_identical,
        a.prompts.len(),
        100.0 * a.tokens_before_first_difference
    );
    for p in &a.prompts {
        for d in &p.disagreements {
            println!(
                "  near tie at generated token {} of a {}-token prompt: reference logits {:.4} ({}) vs {:.4} ({})",
                d.position,
                p.prompt_tokens,
                d.reference_logits.0,
                d.reference_token,
                d.reference_logits.1,
                d.compared_token
            );
        }
    }
    println!(
        "{:>6} {:>8} {:>14} {:>14} {:>7}",
        "batch", "context", r.reference.dtype, r.compared.dtype, "ratio"
    );
    for s in &r.speed {
        println!(
            "{:>6} {:>8} {:>10.1} tok/s {:>10.1} tok/s {:>6.2}×",
            s.batch, s.context, s.reference_tokens_per_s, s.compared_tokens_per_s, s.ratio
        );
    }
}
