//! `duet bench engine`: prefill and decode throughput of the engine alone, single stream and
//! batched, resident memory, and (optionally) llama.cpp on the same file in the same run.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use duet_device::{LoadedEngine, WithEngine};
use duet_engine::backend::Backend;
use duet_engine::device::Device;
use duet_engine::engine::{Engine, EngineOptions, SeqId};
use duet_model::params::SamplingParams;
use duet_model::params::StopCriteria;
use serde::Serialize;

use duet_model::model_path::ModelArgs;

#[derive(Args, Debug)]
pub struct EngineBenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineOptions,
    /// Batch sizes to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub batch: Vec<usize>,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 200)]
    pub prompt_tokens: usize,
    /// Prompt length of each sequence in the decode measurement.
    #[arg(long, default_value_t = 64)]
    pub decode_context: usize,
    /// Decode steps timed per batch size.
    #[arg(long, default_value_t = 64)]
    pub decode_steps: usize,
    /// Repetitions of each measurement (the best is reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Also run llama.cpp (Python package llama-cpp-python) on the same model file.
    #[arg(long)]
    pub compare_llamacpp: bool,
    /// Script that measures llama.cpp.
    #[arg(long, default_value = "bench/llamacpp_engine.py")]
    pub llamacpp_script: PathBuf,
    /// Python interpreter for the llama.cpp script.
    #[arg(long, env = "DUET_PYTHON", default_value = "python3")]
    pub python: String,
    /// Write the JSON report here too.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
}

#[derive(Serialize, Clone)]
struct Row {
    batch: usize,
    prefill_tokens_per_s: f64,
    decode_tokens_per_s: f64,
}

#[derive(Serialize, serde::Deserialize, Clone)]
struct PeerResult {
    prefill_tokens_per_s: f64,
    decode_tokens_per_s: f64,
    #[serde(default)]
    version: String,
}

#[derive(Serialize)]
struct Report {
    model: String,
    threads: usize,
    prompt_tokens: usize,
    decode_context: usize,
    decode_steps: usize,
    rows: Vec<Row>,
    batched_decode_speedup_max: f64,
    model_file_bytes: u64,
    kv_dtype: String,
    kv_pool_bytes: u64,
    peak_rss_bytes: u64,
    rss_after_load_bytes: u64,
    /// On a CPU: what the matrix kernels' dot instruction allows batched decode at most.
    compute_ceiling: Option<ComputeCeiling>,
    llamacpp: Option<PeerResult>,
}

/// Batched decode cannot beat the rate at which the cores execute the integer dot instruction
/// of the quantized matmuls divided by the matrix multiply-accumulates a token needs.
#[derive(Serialize, Clone)]
struct ComputeCeiling {
    kernel_path: String,
    /// All kernel threads together, registers only.
    integer_macs_per_s: f64,
    matmul_macs_per_token: usize,
    /// `integer_macs_per_s / matmul_macs_per_token`: attention and everything else taken as free.
    decode_tokens_per_s: f64,
}

fn compute_ceiling(
    threads: usize,
    config: &duet_model::config::ModelConfig,
) -> Option<ComputeCeiling> {
    let path = duet_cpu::quant::KernelPath::detect();
    let per_thread: Vec<Option<f64>> = std::thread::scope(|s| {
        let runs: Vec<_> = (0..threads)
            .map(|_| s.spawn(move || path.integer_macs_per_s()))
            .collect();
        runs.into_iter().map(|r| r.join().ok().flatten()).collect()
    });
    let integer_macs_per_s = per_thread.into_iter().sum::<Option<f64>>()?;
    let matmul_macs_per_token = config.matmul_params();
    Some(ComputeCeiling {
        kernel_path: format!("{path:?}"),
        integer_macs_per_s,
        matmul_macs_per_token,
        decode_tokens_per_s: integer_macs_per_s / matmul_macs_per_token as f64,
    })
}

pub fn run(args: EngineBenchArgs) -> Result<()> {
    let path = args.model.resolve()?;
    let options = args.engine.clone();
    let batch = args.batch.iter().max().copied().unwrap_or(1);
    let needed = (batch * (args.prompt_tokens + 1)).max(decode_kv_tokens(
        (batch, args.decode_context, args.decode_steps),
        options.max_step_tokens,
    ));
    check_kv_capacity(&options, needed)?;
    eprintln!("loading {} on {}", path.display(), options.device);
    let engine = LoadedEngine::load(&path, options)?;
    engine.run(EngineBench { args, path })
}

struct EngineBench {
    args: EngineBenchArgs,
    path: PathBuf,
}

impl WithEngine for EngineBench {
    type Output = Result<()>;

    fn run<B: Backend + 'static>(self, engine: Engine<B>) -> Result<()> {
        bench(self.args, &self.path, engine)
    }
}

fn bench<B: Backend>(args: EngineBenchArgs, path: &Path, mut engine: Engine<B>) -> Result<()> {
    let options = engine.options().clone();
    let rss_after_load = rss_bytes("VmRSS");
    let threads = if options.threads == 0 {
        duet_cpu::threadpool::default_threads()
    } else {
        options.threads
    };
    let mut prompt = prompt_source(engine.config().vocab_size);

    let mut rows = Vec::new();
    for &batch in &args.batch {
        // Prefill: `batch` fresh prompts (never cached) until each has its first token.
        let mut best_prefill = 0f64;
        for _ in 0..args.repeats {
            let rate = prefill_rate(&mut engine, batch, args.prompt_tokens, &mut prompt)?;
            best_prefill = best_prefill.max(rate);
        }
        // Decode: `batch` sequences past their prompt, then `decode_steps` timed steps.
        let mut best_decode = 0f64;
        for _ in 0..args.repeats {
            let shape = (batch, args.decode_context, args.decode_steps);
            best_decode = best_decode.max(decode_rate(&mut engine, shape, &mut prompt)?);
        }
        eprintln!(
            "batch {batch:>3}: prefill {best_prefill:8.1} tok/s, decode {best_decode:8.1} tok/s"
        );
        rows.push(Row {
            batch,
            prefill_tokens_per_s: best_prefill,
            decode_tokens_per_s: best_decode,
        });
    }

    let llamacpp = if args.compare_llamacpp {
        Some(run_llamacpp(&args, path, threads)?)
    } else {
        None
    };
    let single = rows
        .iter()
        .find(|r| r.batch == 1)
        .map(|r| r.decode_tokens_per_s);
    let speedup = match single {
        Some(s) if s > 0.0 => rows
            .iter()
            .map(|r| r.decode_tokens_per_s / s)
            .fold(0.0, f64::max),
        _ => 0.0,
    };
    let layout = engine.kv_layout();
    let report = Report {
        model: path.display().to_string(),
        threads,
        prompt_tokens: args.prompt_tokens,
        decode_context: args.decode_context,
        decode_steps: args.decode_steps,
        rows: rows.clone(),
        batched_decode_speedup_max: speedup,
        model_file_bytes: std::fs::metadata(path).map(|m| m.len()).unwrap_or(0),
        kv_dtype: layout.dtype.name().into(),
        kv_pool_bytes: layout.bytes() as u64,
        peak_rss_bytes: rss_bytes("VmHWM"),
        rss_after_load_bytes: rss_after_load,
        compute_ceiling: match options.device {
            duet_engine::device::Device::Cpu => compute_ceiling(threads, engine.config()),
            duet_engine::device::Device::Cuda(_) => None,
        },
        llamacpp: llamacpp.clone(),
    };

    println!("engine benchmark: {} ({} threads)", report.model, threads);
    println!(
        "{:>6} {:>16} {:>16} {:>12}",
        "batch", "prefill tok/s", "decode tok/s", "decode ×b1"
    );
    for r in &rows {
        let x = single.map(|s| r.decode_tokens_per_s / s).unwrap_or(0.0);
        println!(
            "{:>6} {:>16.1} {:>16.1} {:>12.2}",
            r.batch, r.prefill_tokens_per_s, r.decode_tokens_per_s, x
        );
    }
    if let (Some(peer), Some(b1)) = (&llamacpp, rows.iter().find(|r| r.batch == 1)) {
        println!(
            "llama.cpp {}: prefill {:.1} tok/s, decode {:.1} tok/s → duet/llama.cpp: prefill {:.2}×, decode {:.2}×",
            peer.version,
            peer.prefill_tokens_per_s,
            peer.decode_tokens_per_s,
            b1.prefill_tokens_per_s / peer.prefill_tokens_per_s,
            b1.decode_tokens_per_s / peer.decode_tokens_per_s
        );
    }
    if let (Some(c), Some(b1)) = (&report.compute_ceiling, single) {
        println!(
            "compute ceiling: {} integer dots {:.1} GMAC/s on {threads} threads / {:.1} M MACs per token = {:.0} tok/s batched decode at most ({:.2}× single stream)",
            c.kernel_path,
            c.integer_macs_per_s / 1e9,
            c.matmul_macs_per_token as f64 / 1e6,
            c.decode_tokens_per_s,
            c.decode_tokens_per_s / b1
        );
    }
    let budget = 1.3 * report.model_file_bytes as f64 + report.kv_pool_bytes as f64;
    println!(
        "memory: peak RSS {:.0} MiB; model file {:.0} MiB, KV pool {:.0} MiB ({}) → RSS / (1.3×file + KV) = {:.2}",
        mib(report.peak_rss_bytes),
        mib(report.model_file_bytes),
        mib(report.kv_pool_bytes),
        report.kv_dtype,
        report.peak_rss_bytes as f64 / budget
    );
    let json = serde_json::to_string_pretty(&report)?;
    println!("{json}");
    if let Some(out) = &args.json_out {
        std::fs::write(out, &json).with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

/// A CPU KV cache sized by --kv-cache-tokens must hold the `needed` tokens of a run at once.
fn check_kv_capacity(options: &EngineOptions, needed: usize) -> Result<()> {
    if options.device == Device::Cpu && options.kv_cache_tokens < needed {
        bail!(
            "--kv-cache-tokens {} is too small for this run: it needs {needed}",
            options.kv_cache_tokens
        );
    }
    Ok(())
}

/// Fresh random prompts (never cached), skipping the low ids where special tokens live.
fn prompt_source(vocab: usize) -> impl FnMut(usize) -> Vec<u32> {
    let mut seed = 1u64;
    move |len| {
        seed += 1;
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                300 + (x % (vocab as u64 - 300)) as u32
            })
            .collect()
    }
}

/// Decode tokens per second of `batch` sequences past `context`-token prompts over `steps`
/// steps: `shape = (batch, context, steps)`.
/// Steps that prefilling `batch` prompts of `context` tokens may take before every sequence has
/// its first token; the sequences that finish their prompts first decode meanwhile.
fn warmup_steps(batch: usize, context: usize, max_step_tokens: usize) -> usize {
    (batch * context).div_ceil(max_step_tokens.max(1)) + batch
}

/// KV tokens a decode measurement of this shape may hold.
fn decode_kv_tokens(
    (batch, context, steps): (usize, usize, usize),
    max_step_tokens: usize,
) -> usize {
    batch * (context + warmup_steps(batch, context, max_step_tokens) + steps + 1)
}

/// Decode tokens per second with `batch` sequences of `context` tokens: every sequence is past
/// its prompt before the clock starts and none finishes before it stops (the first prompts
/// finished decode while later ones still prefill, so a `max_tokens` of `steps` would let them
/// end inside the timed steps and leave a smaller batch running); the tokens counted are the
/// ones the timed steps produced.
fn decode_rate(
    engine: &mut Engine<impl Backend>,
    (batch, context, steps): (usize, usize, usize),
    prompt: &mut impl FnMut(usize) -> Vec<u32>,
) -> Result<f64> {
    let max_tokens = warmup_steps(batch, context, engine.options().max_step_tokens) + steps + 1;
    let ids = add(engine, batch, context, max_tokens, prompt)?;
    run_until_tokens(engine, &ids, 1)?;
    let t = Instant::now();
    let mut produced = 0;
    for _ in 0..steps {
        produced += engine.step()?.len();
    }
    let rate = produced as f64 / t.elapsed().as_secs_f64();
    remove(engine, &ids)?;
    if produced != batch * steps {
        bail!(
            "the decode measurement ran {produced} of {} sequence-steps: the KV cache is too small for batch {batch} at context {context}",
            batch * steps
        );
    }
    Ok(rate)
}

/// Prompt tokens per second prefilling `batch` fresh prompts (never cached) of `len` tokens
/// until each has its first token.
fn prefill_rate(
    engine: &mut Engine<impl Backend>,
    batch: usize,
    len: usize,
    prompt: &mut impl FnMut(usize) -> Vec<u32>,
) -> Result<f64> {
    let ids = add(engine, batch, len, 1, prompt)?;
    let t = Instant::now();
    run_until_tokens(engine, &ids, 1)?;
    let rate = (batch * len) as f64 / t.elapsed().as_secs_f64();
    remove(engine, &ids)?;
    Ok(rate)
}

/// What a cluster benchmark compares a run with: the engine alone on the run's mean shape.
pub struct EngineAloneRates {
    /// Time to first token of one prompt of `context` tokens, prefilled alone.
    pub prefill_ms: f64,
    /// Decode tokens per second of `batch` sequences from `context`-token prompts.
    pub decode_tokens_per_s: f64,
}

/// The engine alone, loaded afresh in this process: the best of `repeats` measurements of each
/// rate (`shape = (batch, context, steps)`), for benchmarks that compare a cluster with it.
pub fn engine_alone_rates(
    model: &Path,
    options: EngineOptions,
    shape: (usize, usize, usize),
    repeats: usize,
) -> Result<EngineAloneRates> {
    struct Rates {
        shape: (usize, usize, usize),
        repeats: usize,
    }
    impl WithEngine for Rates {
        type Output = Result<EngineAloneRates>;
        fn run<B: Backend + 'static>(self, mut engine: Engine<B>) -> Result<EngineAloneRates> {
            let mut prompt = prompt_source(engine.config().vocab_size);
            let context = self.shape.1;
            let (mut prefill, mut decode) = (0f64, 0f64);
            for _ in 0..self.repeats.max(1) {
                prefill = prefill.max(prefill_rate(&mut engine, 1, context, &mut prompt)?);
                decode = decode.max(decode_rate(&mut engine, self.shape, &mut prompt)?);
            }
            Ok(EngineAloneRates {
                prefill_ms: 1e3 * context as f64 / prefill,
                decode_tokens_per_s: decode,
            })
        }
    }
    check_kv_capacity(&options, decode_kv_tokens(shape, options.max_step_tokens))?;
    LoadedEngine::load(model, options)?.run(Rates { shape, repeats })
}

fn add(
    engine: &mut Engine<impl Backend>,
    n: usize,
    len: usize,
    max_tokens: usize,
    prompt: &mut impl FnMut(usize) -> Vec<u32>,
) -> Result<Vec<SeqId>> {
    let stop = StopCriteria {
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    };
    (0..n)
        .map(|_| Ok(engine.add_sequence(prompt(len), SamplingParams::greedy(), stop.clone())?))
        .collect()
}

/// Steps until every sequence in `ids` has generated at least `n` tokens.
fn run_until_tokens(engine: &mut Engine<impl Backend>, ids: &[SeqId], n: usize) -> Result<()> {
    let mut counts = vec![0usize; ids.len()];
    while counts.iter().any(|&c| c < n) {
        for out in engine.step()? {
            if let Some(i) = ids.iter().position(|&id| id == out.seq) {
                counts[i] += 1;
            }
        }
    }
    Ok(())
}

fn remove(engine: &mut Engine<impl Backend>, ids: &[SeqId]) -> Result<()> {
    for &id in ids {
        engine.remove_sequence(id)?;
    }
    Ok(())
}

fn run_llamacpp(args: &EngineBenchArgs, model: &Path, threads: usize) -> Result<PeerResult> {
    eprintln!(
        "running llama.cpp through {}",
        args.llamacpp_script.display()
    );
    let out = Command::new(&args.python)
        .arg(&args.llamacpp_script)
        .arg("--model")
        .arg(model)
        .args(["--threads", &threads.to_string()])
        .args(["--prompt-tokens", &args.prompt_tokens.to_string()])
        .args(["--decode-steps", &args.decode_steps.to_string()])
        .args(["--repeats", &args.repeats.to_string()])
        .output()
        .with_context(|| format!("running {}", args.python))?;
    if !out.status.success() {
        bail!(
            "the llama.cpp benchmark failed (is llama-cpp-python installed? `pip install llama-cpp-python`):\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .context("llama.cpp script printed no JSON")?;
    Ok(serde_json::from_str(line)?)
}

fn rss_bytes(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}
