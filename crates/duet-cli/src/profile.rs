//! `duet profile`: measures the engine on the device at hand with the settings its workers will
//! run (`--threads` above all: workers sharing a machine's cores each get theirs), fits
//! DistServe's latency forms to the measurements, and writes the profile `duet simulate` and
//! `duet plan` time clusters by (`duet_planner::profile`).
//!
//! - Prefill: one step computing `seqs` prompts of `new` tokens each after `cached` tokens of
//!   each already in the prefix cache (a prefix prefilled before, untimed), over a grid of token
//!   counts and cached fractions.
//! - Decode: one step of `batch` sequences at `context` tokens, each holding its own copy of a
//!   prefilled prompt's KV (`duet bench engine`'s method), over batch × context.
//! - KV transfer: a prompt's KV pushed over gRPC on loopback into a real decode worker by a
//!   stand-in prefill worker (`duet bench transfer`'s rig), over prompt lengths.
//! - Serving: decode steps through a real decode worker, beside the decode fit, and prompts
//!   computed by it and by a real prefill worker pushing their KV, alone and beside a decoding
//!   stream (`profile_served`, the workers as processes): what serving adds to the bare
//!   engine's steps, and what two served workers computing at once cost each other.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use clap::Args;
use duet_device::{LoadedEngine, WithEngine};
use duet_engine::backend::Backend;
use duet_engine::device::Device;
use duet_engine::engine::{Engine, EngineOptions};
use duet_model::model_path::{ModelArgs, model_name};
use duet_model::params::{SamplingParams, StopCriteria};
use duet_planner::fit::{FitError, fit_non_negative};
use duet_planner::profile::{
    DecodeFit, DecodeProfile, DecodeSample, DeviceInfo, KvInfo, ModelInfo, PROFILE_FORMAT,
    PrefillFit, PrefillProfile, PrefillSample, Profile, SpeedFlags, TransferFit, TransferProfile,
    TransferSample,
};

use crate::bench_engine::{PrefilledPrompt, cpu_info, decode_point, kernel_threads, prompt_source};
use crate::bench_transfer::TransferRig;
use crate::cluster::Cluster;
use crate::profile_served::{ServedPlan, measure_served, served_cluster};
use crate::progress::{Progress, Unit};

#[derive(Args, Debug)]
pub struct ProfileArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The engine settings the workers will run with: --threads is each worker's kernel
    /// threads (on a CPU, give each worker of a machine its share of the cores).
    #[command(flatten)]
    pub engine: EngineOptions,
    /// Prompt tokens computed by each measured prefill step.
    #[arg(long, value_delimiter = ',', default_values_t = [32, 64, 128, 256, 512])]
    pub prefill_tokens: Vec<usize>,
    /// Shares of each measured prompt already in the prefix cache, each in [0, 1).
    #[arg(long, value_delimiter = ',', default_values_t = [0.0, 0.5, 0.75])]
    pub cached_fractions: Vec<f64>,
    /// Prompts per measured prefill step, besides one: the step's tokens are split among them.
    #[arg(long, default_value_t = 4)]
    pub prefill_batch: usize,
    /// Decode batch sizes measured.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 4, 16, 32])]
    pub decode_batches: Vec<usize>,
    /// Decode contexts (tokens per sequence) measured.
    #[arg(long, value_delimiter = ',', default_values_t = [128, 512, 2048])]
    pub decode_contexts: Vec<usize>,
    /// Decode steps timed per point (after one untimed).
    #[arg(long, default_value_t = 4)]
    pub decode_steps: usize,
    /// Prompt lengths whose KV push over gRPC is measured (none: no transfer measured).
    #[arg(long, value_delimiter = ',', default_values_t = [64, 512, 2048])]
    pub transfer_tokens: Vec<usize>,
    /// Concurrent streams whose decode steps are timed through a served worker.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2, 4, 8, 16])]
    pub served_batches: Vec<usize>,
    /// Prompt lengths computed through served workers, in turn by the decode worker itself, by
    /// a prefill worker pushing the KV (what pushing adds to a prompt), and by it again while the
    /// decode worker decodes a stream (what two served workers computing at once cost each
    /// other).
    #[arg(long, value_delimiter = ',', default_values_t = [64, 128, 256])]
    pub served_prompt_tokens: Vec<usize>,
    /// Each served decode stream's prompt tokens.
    #[arg(long, default_value_t = 128)]
    pub served_decode_prompt: usize,
    /// Each served decode stream's generated tokens.
    #[arg(long, default_value_t = 64)]
    pub served_decode_tokens: u32,
    /// Measure no served worker: the profile's decode steps are the fit's (`serving` absent).
    #[arg(long)]
    pub skip_served: bool,
    /// Measurements per point: the median prefill and served decode step, the best decode and
    /// transfer.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Write the profile here (JSON).
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
}

impl ProfileArgs {
    fn check(&self) -> Result<()> {
        ensure!(
            !self.prefill_tokens.is_empty() && self.prefill_tokens.iter().all(|&t| t > 0),
            "--prefill-tokens: give positive token counts"
        );
        for &f in &self.cached_fractions {
            ensure!(
                (0.0..1.0).contains(&f),
                "--cached-fractions: {f} is not in [0, 1)"
            );
        }
        ensure!(
            !self.decode_batches.is_empty() && self.decode_batches.iter().all(|&b| b > 0),
            "--decode-batches: give positive batch sizes"
        );
        ensure!(
            !self.decode_contexts.is_empty() && self.decode_contexts.iter().all(|&c| c > 0),
            "--decode-contexts: give positive contexts"
        );
        ensure!(self.decode_steps > 0, "--decode-steps must be at least 1");
        if !self.skip_served {
            ensure!(
                !self.served_batches.is_empty()
                    && self.served_batches.iter().all(|&b| b > 0)
                    && self.served_batches.is_sorted_by(|a, b| a < b),
                "--served-batches: give positive stream counts, increasing (or --skip-served)"
            );
            ensure!(
                self.served_prompt_tokens.iter().all(|&t| t > 0),
                "--served-prompt-tokens: give positive token counts"
            );
            ensure!(
                self.served_decode_prompt > 0 && self.served_decode_tokens >= 4,
                "--served-decode-prompt must be at least 1 and --served-decode-tokens at least 4"
            );
        }
        ensure!(self.repeats > 0, "--repeats must be at least 1");
        Ok(())
    }

    /// Every prefill point: (prompts, new tokens each, cached tokens each), cached counts in
    /// whole blocks.
    fn prefill_points(&self, block_size: usize) -> Vec<(usize, usize, usize)> {
        let mut points = Vec::new();
        for &tokens in &self.prefill_tokens {
            for &f in &self.cached_fractions {
                let cached = (tokens as f64 * f / (1.0 - f)) as usize / block_size * block_size;
                points.push((1, tokens, cached));
            }
            if self.prefill_batch > 1 && tokens >= self.prefill_batch * 8 {
                points.push((self.prefill_batch, tokens / self.prefill_batch, 0));
            }
        }
        points
    }

    /// Every decode point: (batch, context).
    fn decode_points(&self) -> Vec<(usize, usize)> {
        let mut points = Vec::new();
        for &context in &self.decode_contexts {
            for &batch in &self.decode_batches {
                points.push((batch, context));
            }
        }
        points
    }

    /// The served measurement, unless skipped.
    fn served_plan(&self) -> Option<ServedPlan<'_>> {
        (!self.skip_served).then(|| ServedPlan {
            batches: &self.served_batches,
            prompt_tokens: &self.served_prompt_tokens,
            decode_prompt: self.served_decode_prompt,
            decode_tokens: self.served_decode_tokens,
            repeats: self.repeats,
        })
    }

    /// KV tokens the measurements hold at their fullest (the prefix cache is cleared between
    /// points).
    fn kv_tokens(&self, block_size: usize) -> usize {
        let blocks = |t: usize| t.div_ceil(block_size);
        let prefill = self
            .prefill_points(block_size)
            .into_iter()
            .map(|(seqs, new, cached)| seqs * (2 * blocks(cached) + blocks(cached + new) + 1));
        let decode = self.decode_points().into_iter().map(|(batch, context)| {
            blocks(context) + batch * blocks(context + self.decode_steps + 3)
        });
        prefill.chain(decode).max().unwrap_or(0) * block_size
    }
}

pub fn run(args: ProfileArgs) -> Result<()> {
    args.check()?;
    let path = args.model.resolve()?;
    let mut options = args.engine.clone();
    let block_size = options.block_size;
    // One step computes a whole measured prefill point.
    let largest_step = args
        .prefill_points(block_size)
        .iter()
        .map(|&(seqs, new, _)| seqs * new)
        .max()
        .unwrap_or(0)
        .max(*args.decode_batches.iter().max().unwrap_or(&1));
    options.max_step_tokens = largest_step;
    if options.device == Device::Cpu {
        options.kv_cache_tokens = options.kv_cache_tokens.max(args.kv_tokens(block_size));
    }
    let served = args.served_plan();
    let points = args.prefill_points(block_size).len()
        + args.decode_points().len()
        + args.transfer_tokens.len()
        + served.as_ref().map_or(0, |p| p.points());
    let progress = Progress::new("profile", points as u64, Unit::Measurements);
    let started = Instant::now();
    eprintln!(
        "profiling {} on {} with {} kernel threads",
        path.display(),
        options.device,
        kernel_threads(&options)
    );
    let measured = LoadedEngine::load(&path, options.clone())?.run(Measure {
        args: &args,
        progress: &progress,
    })?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let transfers = match args.transfer_tokens.is_empty() {
        true => Vec::new(),
        false => vec![runtime.block_on(measure_transfer(&path, &args, &progress))?],
    };
    let mut profile = Profile {
        format: PROFILE_FORMAT,
        device: DeviceInfo {
            kind: match options.device {
                Device::Cpu => "cpu".into(),
                Device::Cuda(_) => "cuda".into(),
            },
            name: match options.device {
                Device::Cpu => {
                    let cpu = cpu_info();
                    format!(
                        "{} (family {} model {})",
                        cpu.model, cpu.family, cpu.model_number
                    )
                }
                gpu => gpu.to_string(),
            },
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        },
        model: ModelInfo {
            name: model_name(&path),
            fingerprint: measured.fingerprint,
            num_layers: measured.num_layers,
        },
        commit: commit(),
        source: std::env::args().collect::<Vec<_>>().join(" "),
        flags: SpeedFlags {
            threads: kernel_threads(&options),
            cpu_kernels: match options.device {
                Device::Cpu => format!("{:?}", options.cpu_kernels).to_lowercase(),
                Device::Cuda(_) => "-".into(),
            },
            kv_dtype: measured.kv_dtype,
            max_step_tokens: largest_step,
        },
        kv: KvInfo {
            block_size,
            block_bytes: measured.block_bytes,
            memory_bytes: measured.kv_memory_bytes,
        },
        prefill: fit_prefill(measured.prefill)?,
        decode: fit_decode(measured.decode)?,
        transfer: transfers,
        serving: None,
    };
    if let Some(plan) = &served {
        // The engine options as given: the worker's own step budget and KV cache.
        let cluster = Cluster::start(&served_cluster(
            &path,
            args.engine.clone(),
            plan,
            measured.context_limit,
        )?)?;
        let serving = runtime.block_on(measure_served(
            &cluster,
            (measured.vocab_size, measured.context_limit),
            &profile,
            plan,
            &progress,
        ))?;
        profile.serving = Some(serving);
    }
    progress.finish();
    profile
        .check()
        .map_err(|e| anyhow::anyhow!("the measured profile is unusable: {e}"))?;
    print_profile(&profile, started.elapsed().as_secs_f64());
    let json = serde_json::to_string_pretty(&profile)?;
    std::fs::write(&args.out, json).with_context(|| format!("writing {}", args.out.display()))?;
    eprintln!("profile written to {}", args.out.display());
    Ok(())
}

/// The commit of the working tree this runs from, if it is one.
fn commit() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

/// What the engine measurements gave.
struct Measured {
    prefill: Vec<PrefillSample>,
    decode: Vec<DecodeSample>,
    fingerprint: String,
    num_layers: usize,
    kv_dtype: String,
    block_bytes: u64,
    kv_memory_bytes: Option<u64>,
    vocab_size: usize,
    context_limit: usize,
}

struct Measure<'a> {
    args: &'a ProfileArgs,
    progress: &'a Progress,
}

impl WithEngine for Measure<'_> {
    type Output = Result<Measured>;

    fn run<B: Backend + 'static>(self, mut engine: Engine<B>) -> Result<Measured> {
        let args = self.args;
        let block_size = engine.options().block_size;
        let mut prompt = prompt_source(engine.config().vocab_size);
        let context_limit = engine.config().max_position_embeddings;
        // Checked before measuring anything: the served measurement comes last.
        if let Some(plan) = args.served_plan() {
            let longest = plan.prompt_tokens.iter().max().map_or(0, |t| t + 1);
            ensure!(
                longest < context_limit,
                "--served-prompt-tokens {} passes the model's context of {context_limit}",
                longest - 1
            );
            ensure!(
                plan.decode_prompt + (plan.decode_tokens as usize) < context_limit,
                "--served-decode-prompt {} and --served-decode-tokens {} pass the model's \
                 context of {context_limit}",
                plan.decode_prompt,
                plan.decode_tokens
            );
        }
        // One untimed step first: the first forward pass allocates its buffers.
        let warm = prompt(engine.options().step_tokens().min(64));
        let (id, _) = prefill_one(&mut engine, warm)?;
        engine.remove_sequence(id)?;
        let mut prefill = Vec::new();
        for (seqs, new, cached) in args.prefill_points(block_size) {
            if cached + new >= context_limit {
                bail!(
                    "a prefill point of {} tokens passes the model's context of {context_limit}: \
                     lower --prefill-tokens or --cached-fractions",
                    cached + new
                );
            }
            engine.clear_prefix_cache();
            prefill.push(prefill_point(
                &mut engine,
                &mut prompt,
                seqs,
                new,
                cached,
                args.repeats,
            )?);
            self.progress.inc(1);
        }
        let mut decode = Vec::new();
        for &context in &args.decode_contexts {
            ensure!(
                context + args.decode_steps + 3 < context_limit,
                "--decode-contexts {context} passes the model's context of {context_limit}"
            );
            engine.clear_prefix_cache();
            let source = PrefilledPrompt::new(&mut engine, prompt(context))?;
            for &batch in &args.decode_batches {
                let m = decode_point(&mut engine, &source, batch, args.decode_steps, args.repeats)?;
                decode.push(DecodeSample {
                    batch,
                    // The timed steps run from context + 1 on: their middle.
                    context: context + 1 + args.decode_steps / 2,
                    ms: 1e3 * batch as f64 / m.tokens_per_s,
                });
                self.progress.inc(1);
            }
            source.release(&mut engine)?;
        }
        let layout = engine.kv_layout();
        let block_bytes = engine.kv_block_bytes() as u64;
        let kv_memory_bytes = match engine.options().device {
            Device::Cpu => None,
            Device::Cuda(_) => Some(
                (layout.num_blocks as f64 * block_bytes as f64
                    / engine.options().gpu_memory_fraction) as u64,
            ),
        };
        Ok(Measured {
            prefill,
            decode,
            fingerprint: engine.fingerprint().to_string(),
            num_layers: layout.num_layers,
            kv_dtype: format!("{:?}", layout.dtype).to_lowercase(),
            block_bytes,
            kv_memory_bytes,
            vocab_size: engine.config().vocab_size,
            context_limit,
        })
    }
}

/// Adds `prompt` as a sequence stopping at its first token and runs ONE step, which must compute
/// it whole. Returns the sequence and the step's time in milliseconds.
fn prefill_one(engine: &mut Engine<impl Backend>, prompt: Vec<u32>) -> Result<(u64, f64)> {
    let id = engine.add_sequence(prompt, SamplingParams::greedy(), first_token_only())?;
    let t = Instant::now();
    let out = engine.step()?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    ensure!(
        out.iter().any(|o| o.seq == id),
        "a measured prompt did not finish in one step"
    );
    Ok((id, ms))
}

fn first_token_only() -> StopCriteria {
    StopCriteria {
        max_tokens: 1,
        ignore_eos: true,
        ..Default::default()
    }
}

/// The median of `repeats` steps computing `seqs` prompts of `new` fresh tokens after `cached`
/// tokens each found in the prefix cache.
fn prefill_point(
    engine: &mut Engine<impl Backend>,
    prompt: &mut impl FnMut(usize) -> Vec<u32>,
    seqs: usize,
    new: usize,
    cached: usize,
    repeats: usize,
) -> Result<PrefillSample> {
    // The prefixes, prefilled once untimed: their blocks stay in the prefix cache.
    let prefixes: Vec<Vec<u32>> = (0..seqs).map(|_| prompt(cached)).collect();
    if cached > 0 {
        for p in &prefixes {
            let id =
                engine.add_sequence(p.clone(), SamplingParams::greedy(), first_token_only())?;
            while engine.has_work() {
                engine.step()?;
            }
            engine.remove_sequence(id)?;
        }
    }
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let mut ids = Vec::with_capacity(seqs);
        for p in &prefixes {
            let mut tokens = p.clone();
            tokens.extend(prompt(new));
            let id = engine.add_sequence(tokens, SamplingParams::greedy(), first_token_only())?;
            ensure!(
                engine.cached_prompt_tokens(id) == Some(cached),
                "a measured prompt found {:?} of its {cached} prefix tokens cached",
                engine.cached_prompt_tokens(id)
            );
            ids.push(id);
        }
        let t = Instant::now();
        let out = engine.step()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        ensure!(
            out.len() == seqs,
            "a measured prefill step computed {} of its {seqs} prompts",
            out.len()
        );
        for id in ids {
            engine.remove_sequence(id)?;
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(PrefillSample {
        seqs,
        new_tokens: seqs * new,
        cached_tokens: seqs * cached,
        attention: (seqs * new) as f64 * (cached + new) as f64,
        ms: times[times.len() / 2],
    })
}

/// The gRPC push of each of `--transfer-tokens`' prompts' KV, the best of `--repeats`.
async fn measure_transfer(
    path: &std::path::Path,
    args: &ProfileArgs,
    progress: &Progress,
) -> Result<TransferProfile> {
    let largest = *args.transfer_tokens.iter().max().unwrap_or(&0);
    let mut rig = TransferRig::start(path, largest).await?;
    let mut samples = Vec::new();
    for &tokens in &args.transfer_tokens {
        let mut best = f64::INFINITY;
        let mut bytes = 0;
        for _ in 0..args.repeats {
            let m = rig.push(tokens).await?;
            best = best.min(m.seconds * 1e3);
            bytes = m.bytes;
        }
        samples.push(TransferSample { bytes, ms: best });
        progress.inc(1);
    }
    let points: Vec<([f64; 2], f64)> = samples
        .iter()
        .map(|s| ([1.0, s.bytes as f64 / (1u64 << 20) as f64], s.ms))
        .collect();
    let (coef, error) = fit_non_negative(&points).context("no KV transfer was measured")?;
    Ok(TransferProfile {
        transport: "grpc".into(),
        samples,
        fit: TransferFit {
            a_ms: coef[0],
            ms_per_mib: coef[1],
        },
        error,
    })
}

/// DistServe's prefill form fitted to the samples.
pub(crate) fn fit_prefill(samples: Vec<PrefillSample>) -> Result<PrefillProfile> {
    let points: Vec<([f64; 3], f64)> = samples
        .iter()
        .map(|s| ([1.0, s.new_tokens as f64, s.attention], s.ms))
        .collect();
    let (c, error) = fit_non_negative(&points).context("no prefill step was measured")?;
    Ok(PrefillProfile {
        samples,
        fit: PrefillFit {
            a_ms: c[0],
            b_ms_per_token: c[1],
            c_ms_per_attended_token: c[2],
        },
        error,
    })
}

/// DistServe's decode form fitted to the samples.
pub(crate) fn fit_decode(samples: Vec<DecodeSample>) -> Result<DecodeProfile> {
    let points: Vec<([f64; 3], f64)> = samples
        .iter()
        .map(|s| ([1.0, (s.batch * s.context) as f64, s.batch as f64], s.ms))
        .collect();
    let (c, error) = fit_non_negative(&points).context("no decode step was measured")?;
    Ok(DecodeProfile {
        samples,
        fit: DecodeFit {
            a_ms: c[0],
            b_ms_per_context_token: c[1],
            c_ms_per_sequence: c[2],
        },
        error,
    })
}

fn print_profile(p: &Profile, took_s: f64) {
    let err = |e: &FitError| {
        format!(
            "mean error {:.1}%, worst {:.1}% over {} points",
            e.mean_abs_pct, e.max_abs_pct, e.samples
        )
    };
    println!(
        "profile of {} on {} ({} threads, {} KV), commit {}, measured in {took_s:.0} s",
        p.model.name, p.device.name, p.flags.threads, p.flags.kv_dtype, p.commit
    );
    let f = &p.prefill.fit;
    println!(
        "prefill step: {:.3} ms + {:.5} ms/token + {:.3e} ms/(token × attended token); {}",
        f.a_ms,
        f.b_ms_per_token,
        f.c_ms_per_attended_token,
        err(&p.prefill.error)
    );
    let d = &p.decode.fit;
    println!(
        "decode step:  {:.3} ms + {:.3e} ms/context token + {:.4} ms/sequence; {}",
        d.a_ms,
        d.b_ms_per_context_token,
        d.c_ms_per_sequence,
        err(&p.decode.error)
    );
    for t in &p.transfer {
        println!(
            "KV transfer over {}: {:.3} ms + {:.3} ms/MiB; {}",
            t.transport,
            t.fit.a_ms,
            t.fit.ms_per_mib,
            err(&t.error)
        );
    }
    if let Some(s) = &p.serving {
        let steps: Vec<String> = s
            .decode
            .iter()
            .map(|s| format!("{} rows {:.2}/{:.2} ms", s.batch, s.served_ms, s.engine_ms))
            .collect();
        println!(
            "served decode step (served/fit, context {}): {}",
            s.decode.first().map_or(0, |s| s.context),
            steps.join(", ")
        );
        let prompts: Vec<String> = s
            .prefill
            .iter()
            .map(|s| {
                format!(
                    "{} tokens {:.1}/{:.1} ms",
                    s.tokens, s.pushed_ms, s.local_ms
                )
            })
            .collect();
        println!(
            "served prompt pushing its KV: ×{:.3} ({}, prefill worker/decode worker)",
            s.prefill_push_factor,
            prompts.join(", ")
        );
        match &s.contention {
            Some(c) => println!(
                "two served workers computing at once: prompts ×{:.3}, decode steps ×{:.3}",
                c.prefill_factor, c.decode_factor
            ),
            None => println!(
                "two served workers computing at once: not measured (no decode step fell inside \
                 a prompt)"
            ),
        }
    }
}
