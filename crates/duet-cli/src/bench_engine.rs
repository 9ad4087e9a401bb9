//! `duet bench engine`: the engine alone as its users see it, swept over decode context × batch
//! and prompt length, next to llama.cpp on the same file in the same run, and against two
//! ceilings measured in the same run: the memory bandwidth (single-stream decode) and the
//! integer dot rate (batched decode, prefill).
//!
//! A decode batch is made the way a decode worker admits remotely prefilled prompts: ONE prompt
//! of `context` tokens is prefilled per context and its KV kept in a reservation, and every
//! sequence of every batch at that context gets its own physical copy of those blocks
//! (`reserve`, `read_kv_block` / `write_kv_block`, `add_prefilled`), so the 32 × 2048 point
//! costs one 2048-token prefill, not 32. Sharing the prompt's blocks through the prefix cache
//! would be cheaper still, but then every sequence would read the same blocks and a batch's KV
//! traffic would be one sequence's: each copy gets its own cache salt in a cleared prefix cache,
//! and the bench fails unless the batch's block tables are disjoint.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Args;
use duet_cpu::quant::KernelPath;
use duet_device::{LoadedEngine, WithEngine};
use duet_engine::backend::Backend;
use duet_engine::device::Device;
use duet_engine::engine::{Engine, EngineOptions, KvReservation, SeqId};
use duet_model::config::ModelConfig;
use duet_model::model_files::{ModelFiles, expert_tensor_name, open_model};
use duet_model::model_path::ModelArgs;
use duet_model::params::{Sampled, SamplingParams, StopCriteria};
use serde::{Deserialize, Serialize};

use crate::bandwidth::{self, Bandwidth};

#[derive(Args, Debug)]
pub struct EngineBenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineOptions,
    /// Decode contexts: tokens of KV every sequence holds when the timed steps start. Each
    /// context is measured at every --batch size. The KV cache is sized for the largest point
    /// unless --kv-cache-tokens is given.
    #[arg(long, value_delimiter = ',', default_value = "64,512,2048")]
    pub contexts: Vec<usize>,
    /// Decode batch sizes: sequences decoding together, each with its own copy of the context's
    /// KV.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub batch: Vec<usize>,
    /// Prompt lengths of the prefill measurement: one fresh prompt at a time, timed until its
    /// first token.
    #[arg(long, value_delimiter = ',', default_value = "200,2000")]
    pub prefill_tokens: Vec<usize>,
    /// Decode steps timed at each (batch, context) point, after one untimed step.
    #[arg(long, default_value_t = 64)]
    pub decode_steps: usize,
    /// Timed runs of each point; the best is reported.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// MiB the memory-bandwidth measurement streams through; it must be far larger than the
    /// CPU's last-level cache for the rate to be memory's.
    #[arg(long, default_value_t = 1024)]
    pub bandwidth_mib: usize,
    /// Also run llama.cpp (Python package llama-cpp-python) on the same model file, at every
    /// point of the sweep, with as many threads as the engine. The report names the instruction
    /// set llama.cpp was built for and warns when it is not the kernel path duet ran.
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

impl EngineBenchArgs {
    fn check(&self) -> Result<()> {
        for (flag, values) in [
            ("--contexts", &self.contexts),
            ("--batch", &self.batch),
            ("--prefill-tokens", &self.prefill_tokens),
        ] {
            ensure!(
                !values.is_empty() && !values.contains(&0),
                "{flag} takes positive numbers"
            );
        }
        ensure!(
            self.decode_steps > 0 && self.repeats > 0 && self.bandwidth_mib > 0,
            "--decode-steps, --repeats and --bandwidth-mib must be positive"
        );
        Ok(())
    }

    /// Every decode point, `(batch, context)`, in the order they are measured.
    fn decode_points(&self) -> Vec<(usize, usize)> {
        let contexts = self.contexts.iter();
        contexts
            .flat_map(|&c| self.batch.iter().map(move |&b| (b, c)))
            .collect()
    }
}

/// One prefill length.
#[derive(Serialize)]
struct PrefillPoint {
    tokens: usize,
    tokens_per_s: f64,
    llamacpp_tokens_per_s: Option<f64>,
    /// duet ÷ llama.cpp.
    ratio: Option<f64>,
    /// Share of [`ComputeCeiling::prefill_tokens_per_s`].
    compute_fraction: Option<f64>,
}

/// One (batch, context) decode point.
#[derive(Serialize)]
struct DecodePoint {
    batch: usize,
    context: usize,
    tokens_per_s: f64,
    llamacpp_tokens_per_s: Option<f64>,
    /// duet ÷ llama.cpp.
    ratio: Option<f64>,
    /// Batch 1 on a CPU: the streaming-read bandwidth just before and just after the point.
    bandwidth: Option<BandwidthAround>,
    /// Batch 1: the memory-bandwidth roofline at this context ([`MemoryRoofline::tokens_per_s`]
    /// at the higher of the two bandwidths).
    roofline_tokens_per_s: Option<f64>,
    roofline_fraction: Option<f64>,
    /// Batched: share of [`ComputeCeiling::decode_tokens_per_s`].
    compute_fraction: Option<f64>,
    /// Blocks in the batch's block tables after the timed steps, and how many of them are
    /// distinct: equal, or the bench fails (every sequence reads its own KV).
    kv_blocks: usize,
    kv_blocks_distinct: usize,
}

#[derive(Serialize)]
pub(crate) struct Cpu {
    /// `model name` in /proc/cpuinfo.
    pub(crate) model: String,
    /// `cpu family` in /proc/cpuinfo.
    pub(crate) family: String,
    /// `model` in /proc/cpuinfo: with the family, tells apart CPUs of one name (AMD EPYC Zen 3
    /// is family 25 model 1, Zen 4 family 25 model 17).
    pub(crate) model_number: String,
}

#[derive(Serialize)]
struct Report {
    model: String,
    device: String,
    cpu: Cpu,
    /// The CPU matrix kernels' path (AVX-512 / AVX2 / portable).
    kernel_path: String,
    threads: usize,
    decode_steps: usize,
    repeats: usize,
    prefill: Vec<PrefillPoint>,
    decode: Vec<DecodePoint>,
    /// On a CPU: what single-stream decode can reach, bandwidth-bound.
    memory_roofline: Option<MemoryRoofline>,
    /// On a CPU: what the matrix kernels' dot instruction allows batched decode and prefill.
    compute_ceiling: Option<ComputeCeiling>,
    llamacpp: Option<LlamaCppBuild>,
    /// Set when llama.cpp's build and duet's CPU kernels use different instruction sets, so the
    /// ratios compare more than the two engines (a pip wheel cached from a native build, say).
    llamacpp_other_instructions: Option<String>,
    model_file_bytes: u64,
    kv_dtype: String,
    kv_cache_tokens: usize,
    kv_pool_bytes: u64,
    peak_rss_bytes: u64,
    rss_after_load_bytes: u64,
}

/// Single-stream decode reads every weight once per token and the sequence's whole KV, so it
/// cannot beat the memory bandwidth divided by those bytes.
#[derive(Serialize)]
struct MemoryRoofline {
    /// Measured after the whole sweep; each single-stream point is judged by its own
    /// [`BandwidthAround`].
    bandwidth: Bandwidth,
    /// Weights read per decode token: see [`weight_bytes_per_token`].
    weight_bytes_per_token: u64,
    /// KV bytes of one context token: layers × (K and V) × KV heads × head dim × element bytes.
    kv_bytes_per_context_token: u64,
}

impl MemoryRoofline {
    /// Decode tokens per second at `context` when only memory traffic costs time. The KV read is
    /// the mean over the timed steps: step `k` (from 0) attends `context + 2 + k` positions (the
    /// prompt, the untimed step's token, the tokens of the timed steps so far and its own).
    fn tokens_per_s(&self, context: usize, steps: usize, bandwidth: f64) -> f64 {
        let mean_context = context as f64 + (steps as f64 + 3.0) / 2.0;
        let bytes = self.weight_bytes_per_token as f64
            + mean_context * self.kv_bytes_per_context_token as f64;
        bandwidth / bytes
    }
}

/// The streaming-read bandwidth right before and right after one single-stream decode point. A
/// host's bandwidth can move by tens of percent within minutes (other tenants of its memory), so
/// one measurement for the whole run may come from another phase than the point it judges. The
/// roofline takes the higher of the two: a slow phase never flatters the engine.
#[derive(Serialize)]
struct BandwidthAround {
    before: Bandwidth,
    after: Bandwidth,
}

impl BandwidthAround {
    fn bytes_per_s(&self) -> f64 {
        self.before.bytes_per_s.max(self.after.bytes_per_s)
    }
}

/// Measures the streaming-read bandwidth between engine runs while keeping the engine's peak RSS
/// apart from the measurement's buffer: the kernel's high-water mark is read before each
/// measurement and reset after it (`/proc/self/clear_refs`); if it cannot be reset, later marks
/// would count the buffer and are not read.
struct BandwidthProbe {
    threads: usize,
    buffer_bytes: usize,
    engine_peak_rss: u64,
    high_water_mark_is_engines: bool,
}

impl BandwidthProbe {
    fn new(threads: usize, buffer_bytes: usize) -> Self {
        Self {
            threads,
            buffer_bytes,
            engine_peak_rss: 0,
            high_water_mark_is_engines: true,
        }
    }

    fn measure(&mut self) -> Bandwidth {
        self.engine_peak_rss();
        let bandwidth = bandwidth::streaming_read(self.threads, self.buffer_bytes, 5);
        self.high_water_mark_is_engines &= std::fs::write("/proc/self/clear_refs", "5").is_ok();
        bandwidth
    }

    fn engine_peak_rss(&mut self) -> u64 {
        if self.high_water_mark_is_engines {
            self.engine_peak_rss = self.engine_peak_rss.max(rss_bytes("VmHWM"));
        }
        self.engine_peak_rss
    }
}

/// Batched decode cannot beat the rate at which the cores execute the integer dot instruction
/// of the quantized matmuls divided by the matrix multiply-accumulates a token needs.
#[derive(Serialize, Clone)]
struct ComputeCeiling {
    kernel_path: String,
    /// All kernel threads together, registers only: the higher of the two measures below.
    integer_macs_per_s: f64,
    integer_macs_per_s_before_sweep: f64,
    integer_macs_per_s_after_sweep: f64,
    matmul_macs_per_token: usize,
    /// `integer_macs_per_s / matmul_macs_per_token`: attention and everything else taken as free.
    decode_tokens_per_s: f64,
    /// The same for a prompt token, which skips the output head (only the last prompt row's
    /// logits are computed).
    prefill_tokens_per_s: f64,
}

impl ComputeCeiling {
    /// The ceiling from the higher of the rates measured before and after the sweep: a host that
    /// starves one core for minutes would otherwise halve the ceiling for the whole run.
    fn new(
        path: KernelPath,
        before: Option<f64>,
        after: Option<f64>,
        config: &ModelConfig,
    ) -> Option<ComputeCeiling> {
        let (before, after) = (before?, after?);
        let integer_macs_per_s = before.max(after);
        let matmul_macs_per_token = config.matmul_params();
        let head_macs = config.vocab_size * config.hidden_size;
        Some(ComputeCeiling {
            kernel_path: format!("{path:?}"),
            integer_macs_per_s,
            integer_macs_per_s_before_sweep: before,
            integer_macs_per_s_after_sweep: after,
            matmul_macs_per_token,
            decode_tokens_per_s: integer_macs_per_s / matmul_macs_per_token as f64,
            prefill_tokens_per_s: integer_macs_per_s / (matmul_macs_per_token - head_macs) as f64,
        })
    }
}

/// Bytes of weights one decode token reads: every matrix a forward step multiplies (each
/// layer's q, k, v, o, gate, up and down projections, and the output head: `output.weight`, or
/// the embedding when tied) plus the one embedding row the lookup reads. With a mixture of
/// experts, the router and the experts one token goes to (all experts of a layer are the same
/// size). The sizes are the file's (GGML layout), which is what the CPU backend streams: it
/// keeps that size when it repacks (`QMatrix::size_bytes`). Norm weights (a few KiB per layer)
/// are left out.
fn weight_bytes_per_token(files: &ModelFiles) -> Result<u64> {
    let bytes = |name: &str| -> Result<u64> { Ok(files.tensors.get(name)?.bytes.len() as u64) };
    let mut total = 0;
    for i in 0..files.config.num_layers {
        for m in ["attn_q", "attn_k", "attn_v", "attn_output"] {
            total += bytes(&format!("blk.{i}.{m}.weight"))?;
        }
        for part in ["gate", "up", "down"] {
            total += match &files.config.moe {
                None => bytes(&format!("blk.{i}.ffn_{part}.weight"))?,
                Some(moe) => bytes(&expert_tensor_name(i, part, 0))? * moe.experts_per_token as u64,
            };
        }
        if files.config.moe.is_some() {
            total += bytes(&format!("blk.{i}.ffn_gate_inp.weight"))?;
        }
    }
    let embedding = files.tensors.get("token_embd.weight")?;
    total += embedding.bytes.len() as u64 / embedding.rows as u64;
    total += if files.tensors.contains("output.weight") {
        bytes("output.weight")?
    } else {
        embedding.bytes.len() as u64
    };
    Ok(total)
}

/// `kv_cache_tokens_given`: whether --kv-cache-tokens (or its environment variable) was set;
/// if not, the cache is sized for the sweep.
pub fn run(args: EngineBenchArgs, kv_cache_tokens_given: bool) -> Result<()> {
    args.check()?;
    let path = args.model.resolve()?;
    let mut options = args.engine.clone();
    let needed = sweep_kv_tokens(
        &args.decode_points(),
        &args.prefill_tokens,
        args.decode_steps,
        options.block_size,
    );
    fit_kv_cache(&mut options, needed, kv_cache_tokens_given)?;
    let weight_bytes = weight_bytes_per_token(&open_model(&path)?)?;
    eprintln!("loading {} on {}", path.display(), options.device);
    let engine = LoadedEngine::load(&path, options)?;
    engine.run(EngineBench {
        args,
        path,
        weight_bytes,
    })
}

struct EngineBench {
    args: EngineBenchArgs,
    path: PathBuf,
    weight_bytes: u64,
}

impl WithEngine for EngineBench {
    type Output = Result<()>;

    fn run<B: Backend + 'static>(self, engine: Engine<B>) -> Result<()> {
        bench(self, engine)
    }
}

fn bench<B: Backend>(run: EngineBench, mut engine: Engine<B>) -> Result<()> {
    let EngineBench {
        args,
        path,
        weight_bytes,
    } = run;
    let options = engine.options().clone();
    let rss_after_load = rss_bytes("VmRSS");
    let threads = kernel_threads(&options);
    let cpu = cpu_info();
    let kernels = KernelPath::choose(options.cpu_kernels)?;
    let kernel_path = format!("{kernels:?}");
    eprintln!(
        "cpu: {} (family {} model {}), kernel path {kernel_path}, {threads} threads",
        cpu.model, cpu.family, cpu.model_number
    );
    let on_cpu = options.device == Device::Cpu;
    let macs_before = on_cpu
        .then(|| kernels.integer_macs_per_s_on(threads))
        .flatten();
    let mut prompt = prompt_source(engine.config().vocab_size);
    let total = args.prefill_tokens.len() + args.decode_points().len();
    let mut done = 0;

    let mut prefill = Vec::new();
    for &tokens in &args.prefill_tokens {
        let mut best = 0f64;
        for _ in 0..args.repeats {
            best = best.max(prefill_rate(&mut engine, prompt(tokens))?);
        }
        done += 1;
        eprintln!("[{done}/{total}] prefill {tokens} tokens: {best:.1} tok/s");
        prefill.push((tokens, best));
    }
    let mut probe = BandwidthProbe::new(threads, args.bandwidth_mib << 20);
    let mut decode = Vec::new();
    for &context in &args.contexts {
        let source = PrefilledPrompt::new(&mut engine, prompt(context))
            .with_context(|| format!("prefilling the {context}-token decode context"))?;
        for &batch in &args.batch {
            let around = on_cpu && batch == 1;
            let before = around.then(|| probe.measure());
            let m = decode_point(&mut engine, &source, batch, args.decode_steps, args.repeats)
                .with_context(|| format!("decode at batch {batch}, context {context}"))?;
            let bandwidth = before.map(|before| BandwidthAround {
                before,
                after: probe.measure(),
            });
            done += 1;
            eprintln!(
                "[{done}/{total}] decode batch {batch} at context {context}: {:.1} tok/s",
                m.tokens_per_s
            );
            decode.push((batch, context, m, bandwidth));
        }
        source.release(&mut engine)?;
    }
    let peak_rss = probe.engine_peak_rss();

    let layout = engine.kv_layout();
    let (memory_roofline, compute_ceiling) = match options.device {
        Device::Cpu => {
            eprintln!(
                "measuring the memory bandwidth ({} MiB streamed)",
                args.bandwidth_mib
            );
            let roofline = MemoryRoofline {
                bandwidth: probe.measure(),
                weight_bytes_per_token: weight_bytes,
                kv_bytes_per_context_token: layout.bytes_per_token() as u64,
            };
            (
                Some(roofline),
                ComputeCeiling::new(
                    kernels,
                    macs_before,
                    kernels.integer_macs_per_s_on(threads),
                    engine.config(),
                ),
            )
        }
        Device::Cuda(_) => (None, None),
    };
    let llamacpp = if args.compare_llamacpp {
        Some(run_llamacpp(&args, &path, threads)?)
    } else {
        None
    };

    let prefill = prefill
        .into_iter()
        .map(|(tokens, rate)| {
            let peer = llamacpp
                .as_ref()
                .map(|l| l.prefill_rate(tokens))
                .transpose()?;
            Ok(PrefillPoint {
                tokens,
                tokens_per_s: rate,
                llamacpp_tokens_per_s: peer,
                ratio: peer.map(|p| rate / p),
                compute_fraction: compute_ceiling
                    .as_ref()
                    .map(|c| rate / c.prefill_tokens_per_s),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let decode = decode
        .into_iter()
        .map(|(batch, context, m, bandwidth)| {
            let peer = llamacpp
                .as_ref()
                .map(|l| l.decode_rate(batch, context))
                .transpose()?;
            let roofline = memory_roofline
                .as_ref()
                .zip(bandwidth.as_ref())
                .map(|(r, b)| r.tokens_per_s(context, args.decode_steps, b.bytes_per_s()));
            let rate = m.tokens_per_s;
            Ok(DecodePoint {
                batch,
                context,
                tokens_per_s: rate,
                llamacpp_tokens_per_s: peer,
                ratio: peer.map(|p| rate / p),
                bandwidth,
                roofline_tokens_per_s: roofline,
                roofline_fraction: roofline.map(|r| rate / r),
                compute_fraction: compute_ceiling
                    .as_ref()
                    .filter(|_| batch > 1)
                    .map(|c| rate / c.decode_tokens_per_s),
                kv_blocks: m.kv_blocks,
                kv_blocks_distinct: m.kv_blocks_distinct,
            })
        })
        .collect::<Result<Vec<_>>>()?;

    let report = Report {
        model: path.display().to_string(),
        device: options.device.to_string(),
        cpu,
        kernel_path,
        threads,
        decode_steps: args.decode_steps,
        repeats: args.repeats,
        prefill,
        decode,
        memory_roofline,
        compute_ceiling,
        llamacpp_other_instructions: llamacpp
            .as_ref()
            .filter(|_| on_cpu)
            .and_then(|l| other_instructions(kernels, &l.build.system_info)),
        llamacpp: llamacpp.map(|l| l.build),
        model_file_bytes: std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0),
        kv_dtype: layout.dtype.name().into(),
        kv_cache_tokens: layout.num_blocks * layout.block_size,
        kv_pool_bytes: layout.bytes() as u64,
        peak_rss_bytes: peak_rss,
        rss_after_load_bytes: rss_after_load,
    };
    print_report(&report);
    print_json(&report, args.json_out.as_deref())
}

/// A benchmark's report as JSON on standard output, and into `out` when given.
pub(crate) fn print_json(report: &impl Serialize, out: Option<&Path>) -> Result<()> {
    let json = serde_json::to_string_pretty(report)?;
    println!("{json}");
    if let Some(out) = out {
        std::fs::write(out, &json).with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

/// The kernel threads an engine of `options` runs (0: one per core).
pub(crate) fn kernel_threads(options: &EngineOptions) -> usize {
    match options.threads {
        0 => duet_cpu::threadpool::default_threads(),
        n => n,
    }
}

fn print_report(r: &Report) {
    println!(
        "engine benchmark: {} on {}, {} threads",
        r.model, r.device, r.threads
    );
    println!(
        "cpu: {} (family {} model {}); kernel path {}",
        r.cpu.model, r.cpu.family, r.cpu.model_number, r.kernel_path
    );
    if let Some(m) = &r.memory_roofline {
        println!(
            "memory bandwidth: {:.1} GB/s streaming read after the sweep ({} threads, {} MiB, best of {}; each single-stream point is judged by the higher of the reads just before and after it); a token reads {:.1} MB of weights + {:.1} KB of KV per context token",
            m.bandwidth.bytes_per_s / 1e9,
            m.bandwidth.threads,
            m.bandwidth.buffer_bytes >> 20,
            m.bandwidth.passes,
            m.weight_bytes_per_token as f64 / 1e6,
            m.kv_bytes_per_context_token as f64 / 1e3
        );
    }
    if let Some(c) = &r.compute_ceiling {
        println!(
            "compute ceiling: {} integer dots {:.1} GMAC/s (the higher of {:.1} before and {:.1} after the sweep) / {:.1} M MACs per token = {:.0} tok/s decode, {:.0} tok/s prefill at most",
            c.kernel_path,
            c.integer_macs_per_s / 1e9,
            c.integer_macs_per_s_before_sweep / 1e9,
            c.integer_macs_per_s_after_sweep / 1e9,
            c.matmul_macs_per_token as f64 / 1e6,
            c.decode_tokens_per_s,
            c.prefill_tokens_per_s
        );
    }
    if let Some(l) = &r.llamacpp {
        println!(
            "llama.cpp: llama-cpp-python {}, built for {}",
            l.version,
            llamacpp_instructions(&l.system_info)
        );
    }
    if let Some(warning) = &r.llamacpp_other_instructions {
        println!("WARNING: {warning}");
    }
    let opt = |x: Option<f64>, f: &dyn Fn(f64) -> String| x.map_or("-".to_string(), f);
    let rate = |x: f64| format!("{x:.1}");
    let ratio = |x: f64| format!("{x:.2}×");
    let pct = |x: f64| format!("{:.0}%", 100.0 * x);
    println!();
    println!(
        "{:>8} {:>8} {:>12} {:>16} {:>8} {:>16}",
        "prefill", "tokens", "duet tok/s", "llama.cpp tok/s", "ratio", "compute ceiling"
    );
    for p in &r.prefill {
        println!(
            "{:>8} {:>8} {:>12.1} {:>16} {:>8} {:>16}",
            "",
            p.tokens,
            p.tokens_per_s,
            opt(p.llamacpp_tokens_per_s, &rate),
            opt(p.ratio, &ratio),
            opt(p.compute_fraction, &pct)
        );
    }
    println!();
    println!(
        "{:>8} {:>8} {:>12} {:>16} {:>8} {:>16}",
        "batch", "context", "duet tok/s", "llama.cpp tok/s", "ratio", "roofline"
    );
    for d in &r.decode {
        let ceiling = match (d.roofline_fraction, &d.bandwidth, d.compute_fraction) {
            (Some(f), Some(b), _) => format!("{} of {:.1} GB/s", pct(f), b.bytes_per_s() / 1e9),
            (_, _, Some(f)) => format!("{} compute", pct(f)),
            _ => "-".into(),
        };
        println!(
            "{:>8} {:>8} {:>12.1} {:>16} {:>8} {:>16}",
            d.batch,
            d.context,
            d.tokens_per_s,
            opt(d.llamacpp_tokens_per_s, &rate),
            opt(d.ratio, &ratio),
            ceiling
        );
    }
    println!();
    let budget = 1.3 * r.model_file_bytes as f64 + r.kv_pool_bytes as f64;
    println!(
        "memory: peak RSS {:.0} MiB; model file {:.0} MiB, KV pool {:.0} MiB ({}, {} tokens) → RSS / (1.3×file + KV) = {:.2}",
        mib(r.peak_rss_bytes),
        mib(r.model_file_bytes),
        mib(r.kv_pool_bytes),
        r.kv_dtype,
        r.kv_cache_tokens,
        r.peak_rss_bytes as f64 / budget
    );
}

/// `model name`, `cpu family` and `model` of the first processor in /proc/cpuinfo ("unknown"
/// where there is none).
pub(crate) fn cpu_info() -> Cpu {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |key: &str| {
        info.lines()
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim() == key)
            .map_or_else(|| "unknown".into(), |(_, v)| v.trim().to_string())
    };
    Cpu {
        model: field("model name"),
        family: field("cpu family"),
        model_number: field("model"),
    }
}

/// KV tokens the sweep holds at its fullest, in whole blocks: a decode point holds the prompt its
/// sequences copy and `batch` sequences grown to `context + 1 + steps` tokens (the prompt, the
/// untimed step's token, the timed steps' tokens); a prefill point holds its one prompt.
fn sweep_kv_tokens(
    decode_points: &[(usize, usize)],
    prefill_tokens: &[usize],
    steps: usize,
    block_size: usize,
) -> usize {
    let blocks = |tokens: usize| tokens.div_ceil(block_size);
    let decode = decode_points
        .iter()
        .map(|&(batch, context)| blocks(context) + batch * blocks(context + 1 + steps));
    let prefill = prefill_tokens.iter().map(|&p| blocks(p));
    decode.chain(prefill).max().unwrap_or(0) * block_size
}

/// Makes a CPU KV cache hold the `needed` tokens of a run: one sized by the user (`given`) must
/// already; otherwise it is grown to fit.
fn fit_kv_cache(options: &mut EngineOptions, needed: usize, given: bool) -> Result<()> {
    if options.device != Device::Cpu || options.kv_cache_tokens >= needed {
        return Ok(());
    }
    if given {
        bail!(
            "--kv-cache-tokens {} is too small for this run: it needs {needed}",
            options.kv_cache_tokens
        );
    }
    eprintln!("KV cache: {needed} tokens, what this run needs (--kv-cache-tokens)");
    options.kv_cache_tokens = needed;
    Ok(())
}

/// Fresh random prompts (never cached), skipping the low ids where special tokens live.
pub(crate) fn prompt_source(vocab: usize) -> impl FnMut(usize) -> Vec<u32> {
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

/// Adds `prompt` as a sequence that stops at its first token and steps until it has it. Returns
/// the sequence (still holding its KV), the token and the time taken.
fn prefill(
    engine: &mut Engine<impl Backend>,
    prompt: Vec<u32>,
) -> Result<(SeqId, Sampled, Duration)> {
    let stop = StopCriteria {
        max_tokens: 1,
        ignore_eos: true,
        ..Default::default()
    };
    let t = Instant::now();
    let id = engine.add_sequence(prompt, SamplingParams::greedy(), stop)?;
    loop {
        if let Some(out) = engine.step()?.into_iter().find(|o| o.seq == id) {
            return Ok((id, out.token, t.elapsed()));
        }
    }
}

/// Prompt tokens per second prefilling one fresh prompt (never cached) until its first token.
fn prefill_rate(engine: &mut Engine<impl Backend>, prompt: Vec<u32>) -> Result<f64> {
    let len = prompt.len();
    let (id, _, took) = prefill(engine, prompt)?;
    engine.remove_sequence(id)?;
    Ok(len as f64 / took.as_secs_f64())
}

/// A prompt's KV, prefilled once and kept in a reservation (not a sequence, so no step touches
/// it), with the token its prefill sampled: what decode batches at its context are copied from.
pub(crate) struct PrefilledPrompt {
    prompt: Vec<u32>,
    kv: KvReservation,
    first: Sampled,
}

impl PrefilledPrompt {
    pub(crate) fn new(engine: &mut Engine<impl Backend>, prompt: Vec<u32>) -> Result<Self> {
        let (id, first, _) = prefill(engine, prompt.clone())?;
        let kv = engine.reserve(&prompt, "duet-bench-source")?;
        let blocks = engine
            .block_table(id)
            .context("the prefilled sequence")?
            .to_vec();
        copy_kv(engine, &blocks, &kv.blocks)?;
        engine.remove_sequence(id)?;
        Ok(Self { prompt, kv, first })
    }

    pub(crate) fn release(self, engine: &mut Engine<impl Backend>) -> Result<()> {
        Ok(engine.release(self.kv)?)
    }

    /// `batch` sequences, each admitted as a remotely prefilled prompt into its own copy of this
    /// KV, with room for `max_tokens` (the first included) before any stops.
    fn copies(
        &self,
        engine: &mut Engine<impl Backend>,
        batch: usize,
        max_tokens: usize,
    ) -> Result<Vec<SeqId>> {
        // Blocks cached by an earlier batch (same salts) would be found instead of copied into.
        engine.clear_prefix_cache();
        let stop = StopCriteria {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        };
        (0..batch)
            .map(|i| {
                let kv = engine.reserve(&self.prompt, &format!("duet-bench-copy-{i}"))?;
                ensure!(
                    kv.cached_blocks == 0,
                    "a decode copy found cached KV blocks"
                );
                copy_kv(engine, &self.kv.blocks, &kv.blocks)?;
                let (id, out) = engine.add_prefilled(
                    self.prompt.clone(),
                    kv,
                    self.first.clone(),
                    SamplingParams::greedy(),
                    None,
                    stop.clone(),
                )?;
                ensure!(out.finish.is_none(), "a decode copy finished at once");
                Ok(id)
            })
            .collect()
    }
}

/// Copies every layer's KV of blocks `from` into blocks `to`, pairwise.
fn copy_kv(engine: &mut Engine<impl Backend>, from: &[u32], to: &[u32]) -> Result<()> {
    let mut buf = vec![0u8; engine.kv_block_bytes()];
    for layer in 0..engine.config().num_layers {
        for (&src, &dst) in from.iter().zip(to) {
            engine.read_kv_block(layer, src, &mut buf)?;
            engine.write_kv_block(layer, dst, &buf)?;
        }
    }
    Ok(())
}

pub(crate) struct DecodeMeasured {
    /// The best of the repeats.
    pub(crate) tokens_per_s: f64,
    kv_blocks: usize,
    kv_blocks_distinct: usize,
}

/// Decode tokens per second of `batch` sequences holding copies of `source`: each repeat admits
/// a fresh batch (so every repeat starts at the same context), runs one untimed step, then
/// times `steps` steps and counts the tokens they produced. No sequence may finish inside the
/// timed window (a shrinking batch would be timed as a full one), so the count must be
/// `batch × steps`.
pub(crate) fn decode_point(
    engine: &mut Engine<impl Backend>,
    source: &PrefilledPrompt,
    batch: usize,
    steps: usize,
    repeats: usize,
) -> Result<DecodeMeasured> {
    let mut best = DecodeMeasured {
        tokens_per_s: 0.0,
        kv_blocks: 0,
        kv_blocks_distinct: 0,
    };
    for _ in 0..repeats {
        // The first token, the untimed step's, the timed steps' and one spare.
        let ids = source.copies(engine, batch, steps + 3)?;
        let warm = engine.step()?.len();
        let t = Instant::now();
        let mut produced = 0;
        for _ in 0..steps {
            produced += engine.step()?.len();
        }
        let rate = produced as f64 / t.elapsed().as_secs_f64();
        let mut tables = Vec::new();
        for &id in &ids {
            tables.extend_from_slice(engine.block_table(id).context("a decoding sequence")?);
            engine.remove_sequence(id)?;
        }
        if warm != batch || produced != batch * steps {
            bail!(
                "the decode measurement ran {produced} of {} sequence-steps: the KV cache is too small",
                batch * steps
            );
        }
        let distinct = tables.iter().collect::<HashSet<_>>().len();
        ensure!(
            distinct == tables.len(),
            "the batch's sequences share KV blocks ({distinct} distinct of {})",
            tables.len()
        );
        if rate > best.tokens_per_s {
            best = DecodeMeasured {
                tokens_per_s: rate,
                kv_blocks: tables.len(),
                kv_blocks_distinct: distinct,
            };
        }
    }
    Ok(best)
}

/// What a cluster benchmark compares a run with: the engine alone on the run's mean shape.
pub struct EngineAloneRates {
    /// Time to first token of one prompt of `context` tokens, prefilled alone.
    pub prefill_ms: f64,
    /// Decode tokens per second of `batch` sequences from `context`-token prompts.
    pub decode_tokens_per_s: f64,
}

/// The engine alone, loaded afresh in this process: the best of `repeats` measurements of each
/// rate (`shape = (batch, context, steps)`), for benchmarks that compare a cluster with it. The
/// KV cache is the cluster's (`options`), so it must hold the measurement as given.
pub fn engine_alone_rates(
    model: &Path,
    mut options: EngineOptions,
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
            let (batch, context, steps) = self.shape;
            let repeats = self.repeats.max(1);
            let mut prefill = 0f64;
            for _ in 0..repeats {
                prefill = prefill.max(prefill_rate(&mut engine, prompt(context))?);
            }
            let source = PrefilledPrompt::new(&mut engine, prompt(context))?;
            let decode = decode_point(&mut engine, &source, batch, steps, repeats)?;
            source.release(&mut engine)?;
            Ok(EngineAloneRates {
                prefill_ms: 1e3 * context as f64 / prefill,
                decode_tokens_per_s: decode.tokens_per_s,
            })
        }
    }
    let (batch, context, steps) = shape;
    let needed = sweep_kv_tokens(&[(batch, context)], &[context], steps, options.block_size);
    fit_kv_cache(&mut options, needed, true)?;
    LoadedEngine::load(model, options)?.run(Rates { shape, repeats })
}

/// What `bench/llamacpp_engine.py` prints: llama.cpp's rate at every point it was given.
#[derive(Deserialize)]
struct LlamaCpp {
    #[serde(flatten)]
    build: LlamaCppBuild,
    prefill: Vec<LlamaCppPrefill>,
    decode: Vec<LlamaCppDecode>,
}

#[derive(Serialize, Deserialize)]
struct LlamaCppBuild {
    /// llama-cpp-python's version.
    version: String,
    /// llama.cpp's `llama_print_system_info()`: the CPU features its kernels use.
    system_info: String,
}

#[derive(Deserialize)]
struct LlamaCppPrefill {
    tokens: usize,
    tokens_per_s: f64,
}

#[derive(Deserialize)]
struct LlamaCppDecode {
    batch: usize,
    context: usize,
    tokens_per_s: f64,
}

impl LlamaCpp {
    fn prefill_rate(&self, tokens: usize) -> Result<f64> {
        self.prefill
            .iter()
            .find(|p| p.tokens == tokens)
            .map(|p| p.tokens_per_s)
            .with_context(|| format!("llama.cpp reported no prefill of {tokens} tokens"))
    }

    fn decode_rate(&self, batch: usize, context: usize) -> Result<f64> {
        self.decode
            .iter()
            .find(|d| (d.batch, d.context) == (batch, context))
            .map(|d| d.tokens_per_s)
            .with_context(|| {
                format!("llama.cpp reported no decode at batch {batch}, context {context}")
            })
    }
}

/// The instruction set a build's kernels use, named as for duet's kernel paths, from
/// `llama_print_system_info()` ("CPU : SSE3 = 1 | AVX2 = 1 | ...").
fn llamacpp_instructions(system_info: &str) -> &'static str {
    let has = |feature: &str| {
        system_info
            .split('|')
            .any(|f| f.trim().trim_start_matches("CPU :").trim() == format!("{feature} = 1"))
    };
    if has("AVX512") {
        KernelPath::Avx512.name()
    } else if has("AVX2") && has("AVX_VNNI") {
        KernelPath::Avx2Vnni.name()
    } else if has("AVX2") {
        KernelPath::Avx2.name()
    } else {
        KernelPath::Scalar.name()
    }
}

/// Why llama.cpp's numbers are not those of the same instruction set as duet's `path`, if so.
fn other_instructions(path: KernelPath, system_info: &str) -> Option<String> {
    let llamacpp = llamacpp_instructions(system_info);
    (llamacpp != path.name()).then(|| {
        format!(
            "llama.cpp was built for {llamacpp} and duet ran its {} kernels: the ratios compare \
             instruction sets as well as engines (build llama-cpp-python for the same set with \
             `pip install --no-cache-dir`, see the README)",
            path.name()
        )
    })
}

/// Runs the llama.cpp script on the same points; its progress goes to our stderr as it runs.
fn run_llamacpp(args: &EngineBenchArgs, model: &Path, threads: usize) -> Result<LlamaCpp> {
    eprintln!(
        "running llama.cpp through {}",
        args.llamacpp_script.display()
    );
    let list = |v: &[usize]| v.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    let out = Command::new(&args.python)
        .arg(&args.llamacpp_script)
        .arg("--model")
        .arg(model)
        .args(["--threads", &threads.to_string()])
        .args(["--contexts", &list(&args.contexts)])
        .args(["--batch", &list(&args.batch)])
        .args(["--prefill-tokens", &list(&args.prefill_tokens)])
        .args(["--decode-steps", &args.decode_steps.to_string()])
        .args(["--repeats", &args.repeats.to_string()])
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", args.python))?;
    if !out.status.success() {
        bail!(
            "the llama.cpp benchmark failed (its error is above; is llama-cpp-python installed? `pip install llama-cpp-python`)"
        );
    }
    serde_json::from_slice(&out.stdout).context("reading the llama.cpp script's JSON")
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A token of the tiny Mixtral (f32; 2 layers, 4 experts, top 2) reads each layer's
    /// attention (49,152 bytes), two of the four experts' gate, up and down (8,192 bytes each),
    /// the router (1,024), one embedding row (256) and the output head (98,304): sizes read from
    /// the file with the `gguf` package.
    #[test]
    fn a_mixture_reads_the_router_and_the_experts_a_token_goes_to() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/tiny-mixtral.gguf");
        let files = open_model(&path).unwrap();
        let layer = 49_152 + 2 * 3 * 8_192 + 1_024;
        assert_eq!(
            weight_bytes_per_token(&files).unwrap(),
            2 * layer + 256 + 98_304
        );
    }

    #[test]
    fn a_llamacpp_build_for_another_instruction_set_is_named() {
        let native = "CPU : SSE3 = 1 | AVX = 1 | AVX_VNNI = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | \
                      AVX512 = 1 | AVX512_VNNI = 1 | OPENMP = 1 |";
        let avx2 = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | OPENMP = 1 |";
        let vnni = "CPU : SSE3 = 1 | AVX = 1 | AVX_VNNI = 1 | AVX2 = 1 | FMA = 1 |";
        assert_eq!(other_instructions(KernelPath::Avx512, native), None);
        assert_eq!(other_instructions(KernelPath::Avx2, avx2), None);
        assert_eq!(other_instructions(KernelPath::Avx2Vnni, vnni), None);
        assert_eq!(
            other_instructions(KernelPath::Scalar, "CPU : SSE3 = 1 |"),
            None
        );
        let warning = other_instructions(KernelPath::Avx2, native).unwrap();
        assert!(
            warning.starts_with("llama.cpp was built for avx512 and duet ran its avx2 kernels"),
            "{warning}"
        );
        assert!(other_instructions(KernelPath::Avx2Vnni, avx2).is_some());
        assert!(other_instructions(KernelPath::Avx512, vnni).is_some());
        // AVX512_VNNI alone is not AVX-512 (a name that only contains the feature's).
        assert_eq!(
            llamacpp_instructions("CPU : AVX2 = 1 | AVX512_VNNI = 1 |"),
            "avx2"
        );
    }

    #[test]
    fn the_kv_cache_is_sized_for_the_largest_point_in_whole_blocks() {
        // Batch 4 at context 20, 5 steps, blocks of 16: the 2-block source + 4 × 2 blocks
        // (26 tokens) beats a 40-token prefill (3 blocks).
        assert_eq!(sweep_kv_tokens(&[(4, 20)], &[40], 5, 16), 16 * 10);
        // Batch 1 at context 100 (7 + 7 blocks) beats both.
        assert_eq!(sweep_kv_tokens(&[(1, 100), (4, 20)], &[40], 5, 16), 16 * 14);
        assert_eq!(sweep_kv_tokens(&[], &[40], 5, 16), 16 * 3);
    }

    #[test]
    fn a_cache_the_user_sized_is_never_grown() {
        let mut options = EngineOptions {
            kv_cache_tokens: 64,
            ..EngineOptions::default()
        };
        let err = fit_kv_cache(&mut options, 100, true).unwrap_err();
        assert!(err.to_string().contains("--kv-cache-tokens 64"), "{err}");
        assert!(err.to_string().contains("needs 100"), "{err}");
        fit_kv_cache(&mut options, 100, false).unwrap();
        assert_eq!(options.kv_cache_tokens, 100);
    }
}
