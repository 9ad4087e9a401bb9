//! `duet simulate`: a duet cluster simulated from a profile (see `duet_planner::simulator`),
//! with the flags of `duet bench serve`, so that one command line can be run and simulated, and
//! the same JSON report (`--json-out`), so that the two compare key by key.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use duet_engine::device::Device;
use duet_model::model_path::model_name;
use duet_planner::arrivals::{ArrivalClock, Arrivals};
use duet_planner::profile::{Profile, Target};
use duet_planner::report::Slo;
use duet_planner::sim_worker::Sharing;
use duet_planner::simulator::{Design, RouterShape, SimConfig, SimResult, simulate};
use duet_planner::trace::TraceWriter;
use duet_planner::workload::Prompt;
use duet_prefill_worker::PrefillConfig;
use serde::Serialize;

use crate::progress::{Progress, Unit};
use crate::serve_args::{RequestsOut, ShapeArgs, WorkloadArgs, WorkloadReport};
use crate::serve_report::{self, TableRow};

/// What times a simulated cluster: the flags `duet simulate` and `duet plan` share.
#[derive(Args, Debug)]
pub struct TimingArgs {
    /// The profile that times the cluster (`duet profile --out`).
    #[arg(long, env = "DUET_PROFILE")]
    pub profile: PathBuf,
    /// The model the cluster would serve, checked against the profile's (`model.name`). Unset:
    /// the profile's.
    #[arg(long, env = "DUET_MODEL")]
    pub model: Option<PathBuf>,
    /// Cores of the machine the workers share with --processes (0: this machine's).
    #[arg(long, env = "DUET_MACHINE_CORES", default_value_t = 0)]
    pub machine_cores: usize,
    /// Every compute step takes this many times the profile's time; KV transfers keep theirs.
    /// For a machine whose speed moved since it was profiled (the ratio of one short `duet
    /// bench engine` run then and now), or a what-if for a slower or faster device.
    #[arg(long, env = "DUET_COMPUTE_SCALE", default_value_t = 1.0)]
    pub compute_scale: f64,
}

impl TimingArgs {
    /// The profile, refused if it was measured for another device, model, thread count or
    /// block size than `shape` gives.
    pub fn load(&self, shape: &ShapeArgs) -> Result<Profile> {
        let profile = Profile::load(&self.profile)?;
        check_profile(&profile, shape, self.model.as_deref())?;
        profile
            .scale_compute(self.compute_scale)
            .context("--compute-scale")
    }
}

#[derive(Args, Debug)]
pub struct SimulateArgs {
    #[command(flatten)]
    pub timing: TimingArgs,
    /// Write the JSON report here (the keys of `duet bench serve --json-out`, and the
    /// simulation's own: routing decisions, fallbacks, preemptions, attainment over time).
    #[arg(long)]
    pub json_out: Option<PathBuf>,
    /// Write an SVG chart of the latency percentiles here (FILE.svg).
    #[arg(long)]
    pub plot_out: Option<PathBuf>,
    /// Write the workload (open loop or trace) as a Mooncake trace here, to run the same
    /// requests at the same times with `duet bench serve --trace`.
    #[arg(long)]
    pub trace_out: Option<PathBuf>,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// The simulated clusters (the flags `duet bench serve` launches them with).
    // Last: its router heading applies to every flag after it.
    #[command(flatten, next_help_heading = "Cluster")]
    pub shape: ShapeArgs,
}

/// A simulated run, as the report lists it.
#[derive(Serialize)]
struct SimulateReport<'a> {
    workload: WorkloadReport<'a>,
    profile: String,
    runs: Vec<SimResult>,
}

pub fn run(args: SimulateArgs) -> Result<()> {
    let profile = args.timing.load(&args.shape)?;
    let arrivals = args.workload.arrivals()?;
    let requests_out = RequestsOut::create(args.workload.requests_out.as_deref())?;
    let slo = args.workload.slo()?;
    if let Some(out) = &args.trace_out {
        write_trace(&args.workload, arrivals, out)?;
    }
    let total = planned_requests(&args.workload)?;
    let mut runs = Vec::new();
    for &design in &args.shape.launch {
        let config = SimConfig {
            keep_outcomes: args.workload.requests_out.is_some(),
            ..sim_config(
                &args.shape,
                design,
                &profile,
                slo,
                args.timing.machine_cores,
                args.workload.timeline_window_s,
            )
        };
        let progress = Progress::new(
            format!("[{design:?} simulated]").to_lowercase(),
            total,
            Unit::Requests,
        );
        let started = Instant::now();
        let mut jobs = args.workload.jobs()?;
        let result = simulate(
            &profile,
            &config,
            &mut jobs,
            arrivals,
            args.workload.seed,
            &mut |n| progress.inc(n),
        )?;
        progress.finish();
        let took = started.elapsed().as_secs_f64();
        eprintln!(
            "[{}] simulated {} requests ({} events) in {took:.2} s: {:.0} requests/s",
            result.summary.design,
            result.summary.requests,
            result.events,
            result.summary.requests as f64 / took.max(1e-9)
        );
        runs.push(result);
    }
    let rows: Vec<TableRow> = runs
        .iter()
        .map(|r| TableRow {
            summary: &r.summary,
            full_tokens_per_s: None,
            hit: r.prefix_hit_rate,
            ideal: None,
        })
        .collect();
    serve_report::print_table(&rows, &args.workload, arrivals);
    serve_report::print_ttft_split(runs.iter().map(|r| &r.summary));
    for r in &runs {
        let decisions: Vec<String> = r
            .decisions
            .iter()
            .filter(|(_, n)| *n > 0)
            .map(|(d, n)| format!("{d} {n}"))
            .collect();
        println!(
            "{:<27} routed: {}; local prefill fallbacks {}, preemptions {}",
            r.summary.design,
            decisions.join(", "),
            r.local_prefill_fallbacks,
            r.preemptions
        );
    }
    if let Some(p) = &args.plot_out {
        let summaries: Vec<_> = runs.iter().map(|r| r.summary.clone()).collect();
        crate::plot::latency_percentiles(&summaries, p)?;
        eprintln!("plot written to {}", p.display());
    }
    if let Some(out) = requests_out {
        out.write(
            runs.iter()
                .map(|r| (r.summary.design.as_str(), &r.outcomes[..])),
        )?;
    }
    let report = SimulateReport {
        workload: args
            .workload
            .report(runs.first().map_or(0, |r| r.summary.requests), arrivals),
        profile: match args.timing.compute_scale {
            1.0 => args.timing.profile.display().to_string(),
            scale => format!("{} (compute ×{scale})", args.timing.profile.display()),
        },
        runs,
    };
    crate::bench_engine::print_json(&report, args.json_out.as_deref())
}

/// Refuses a profile measured for another device, model, thread count or block size than the
/// simulated cluster's flags give.
fn check_profile(profile: &Profile, shape: &ShapeArgs, model: Option<&Path>) -> Result<()> {
    let engine = &shape.engine;
    let on_gpu = matches!(engine.device, Device::Cuda(_));
    let target = Target {
        device_kind: Some(if on_gpu { "cuda" } else { "cpu" }.into()),
        model_name: model.map(model_name),
        // Kernel threads shape a CPU step; a GPU's do not.
        threads: (!on_gpu).then(|| resolved_threads(engine.threads)),
        block_size: Some(engine.block_size),
    };
    Ok(profile.check_matches(&target)?)
}

/// `--threads` as the engine takes it: 0 is one per core.
pub(crate) fn resolved_threads(threads: usize) -> usize {
    match threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    }
}

/// The simulated cluster of `design` that `shape` launches.
pub(crate) fn sim_config(
    shape: &ShapeArgs,
    design: Design,
    profile: &Profile,
    slo: Slo,
    machine_cores: usize,
    timeline_window_s: f64,
) -> SimConfig {
    let routing = shape.routing_of(design);
    let engine = &shape.engine;
    let sharing = match engine.device {
        Device::Cuda(_) => Sharing::Dedicated,
        Device::Cpu if shape.processes => Sharing::Cores {
            cores: match machine_cores {
                0 => resolved_threads(0),
                n => n,
            },
            threads: resolved_threads(engine.threads),
        },
        Device::Cpu => Sharing::TakeTurns,
    };
    // On a GPU the KV cache takes its share of the memory the weights leave.
    let kv_cache_tokens = match (engine.device, profile.kv.memory_bytes) {
        (Device::Cuda(_), Some(bytes)) => {
            let blocks =
                (bytes as f64 * engine.gpu_memory_fraction) as u64 / profile.kv.block_bytes;
            blocks as usize * profile.kv.block_size
        }
        _ => engine.kv_cache_tokens,
    };
    SimConfig {
        design,
        prefill_workers: shape.prefill_workers_of(design),
        decode_workers: shape.decode_workers,
        max_step_tokens: engine.step_tokens(),
        kv_cache_tokens,
        routing: RouterShape {
            policy: routing.params().policy,
            stats_interval_s: routing.stats_interval_ms as f64 / 1e3,
            pending_prefix_ttl_s: routing.pending_prefix_ttl_ms as f64 / 1e3,
            max_queued_requests: routing.max_queued_requests,
            request_timeout_s: routing.request_timeout_ms as f64 / 1e3,
        },
        prefill_max_queued_tokens: PrefillConfig::default().max_queued_tokens,
        sharing,
        transport: shape.transport_name().into(),
        slo,
        timeline_window_s,
        keep_outcomes: false,
    }
}

/// How many requests the workload sends (a trace's lines, counted first), for the progress bar.
fn planned_requests(workload: &WorkloadArgs) -> Result<u64> {
    if let Some(path) = &workload.trace {
        let file =
            std::fs::File::open(path).with_context(|| format!("--trace {}", path.display()))?;
        let lines = std::io::BufReader::new(file).lines();
        return Ok(lines
            .map_while(Result::ok)
            .filter(|l| !l.trim().is_empty())
            .count() as u64);
    }
    let turns = match workload.workload {
        crate::serve_args::WorkloadShape::SharedPrefix => {
            let p = &workload.shared_prefix;
            p.groups * p.users * p.turns.max(1)
        }
        crate::serve_args::WorkloadShape::Random => workload.requests,
    };
    Ok(turns as u64)
}

/// Writes the workload's requests at their arrival times as a Mooncake trace.
fn write_trace(workload: &WorkloadArgs, arrivals: Arrivals, out: &Path) -> Result<()> {
    if matches!(arrivals, Arrivals::Closed { .. }) {
        bail!(
            "--trace-out needs arrival times: an open loop (--rate) or a trace (--trace); a closed \
             loop sends each request when the last one ends"
        );
    }
    let file =
        std::fs::File::create(out).with_context(|| format!("--trace-out {}", out.display()))?;
    let mut writer = TraceWriter::new(std::io::BufWriter::new(file));
    let mut clock = ArrivalClock::new(arrivals, workload.seed);
    for job in workload.jobs()? {
        let job = job?;
        let Prompt::Tokens(prompt) = &job.prompt else {
            bail!("--trace-out: a text prompt has no tokens to write; use token prompts");
        };
        if !job.follow_ups.is_empty() {
            bail!(
                "--trace-out: a conversation's later turns depend on its answers; a trace holds single requests"
            );
        }
        let at = clock
            .next(job.at.map(|d| d.as_secs_f64()))
            .expect("an open loop's clock gives times");
        writer.write(
            std::time::Duration::from_secs_f64(at),
            prompt,
            job.max_tokens,
        )?;
    }
    writer.finish()?;
    eprintln!("trace written to {}", out.display());
    Ok(())
}
