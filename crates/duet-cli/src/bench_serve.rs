//! `duet bench serve`: a load generator against a router — what ghz cannot see: time to first
//! token, time per output token, inter-token latency, end-to-end latency, throughput, and SLO
//! attainment and goodput as DistServe defines them (a request attains only if TTFT ≤ its SLO and
//! TPOT ≤ its SLO). It drives a running cluster (`--server`) or launches its own, disaggregated
//! and/or colocated (one worker doing both phases), so the two designs meet the same workload on
//! the same machine in one run.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use duet_cluster::ClusterArgs;
use duet_decode_worker::{DecodeConfig, PeerPullArgs};
use duet_engine::engine::EngineOptions;
use duet_model::model_path::ModelArgs;
use duet_planner::arrivals::{ArrivalClock, Arrivals};
use duet_planner::report::{
    Outcome, Percentiles, ServeSummary, Slo, SummaryBuilder, TtftSplit, percentiles,
};
use duet_planner::simulator::Design;
use duet_planner::workload::{Job, Prompt};
use duet_prefill_worker::PrefillConfig;
use duet_proto::v1;
use duet_router::{RouterConfig, RoutingOptions};
use duet_routing::RoutingPolicy;
use duet_worker::WorkerArgs;
use futures::StreamExt;
use serde::Serialize;

use crate::chaos::{self, ChaosArgs, ChaosReport, ChaosSpec, DifferingStream, StreamCheck};
use crate::cluster::{Cluster, ClusterSpec};
use crate::plot;
use crate::progress::{Progress, Unit};
use crate::serve_args::{RequestsOut, ShapeArgs, WorkloadArgs, WorkloadReport, WorkloadShape};
use crate::serve_report::{self, TableRow};
use crate::shared_prefix::{self, Seen};

#[derive(Args, Debug)]
pub struct ServeBenchArgs {
    /// Router to load (a running cluster). Without it, clusters are launched (see --launch).
    #[arg(long)]
    pub server: Option<String>,
    /// PEM certificate of the CA that signed the --server router's certificate: called over TLS.
    #[arg(long, env = "DUET_TLS_CA", requires = "server")]
    pub tls_ca: Option<PathBuf>,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Peer pulls on the launched clusters' decode workers.
    #[command(flatten)]
    pub peer_pull: PeerPullArgs,
    /// Also measure the engine alone (in this process, before the first cluster and after each)
    /// decoding a batch of --concurrency sequences from the mean --prompt-tokens for the mean
    /// --output-tokens steps, and prefilling one prompt of that length; report each run's output
    /// tokens/s, TPOT and TTFT against the mean of the measurements just before and after it.
    #[arg(long, conflicts_with_all = ["rate", "dataset", "server", "trace"])]
    pub compare_engine: bool,
    /// Write the JSON report here.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
    /// Write an SVG chart of the latency percentiles here (FILE.svg).
    #[arg(long)]
    pub plot_out: Option<PathBuf>,
    /// Launch every cluster twice, with the tiers below the KV pool as the engine flags set
    /// them (--kv-offload-tokens, --kv-disk-dir) and with none, and compare the two: TTFT of
    /// turns 2 and later, and output throughput.
    #[arg(long, conflicts_with = "server")]
    pub compare_kv_tiers: bool,
    /// Launch one disaggregated cluster per routing policy listed (instead of the router's
    /// --routing), to compare them on the same workload.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub compare_routing: Vec<RoutingPolicy>,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten, next_help_heading = "Chaos")]
    pub chaos: ChaosArgs,
    /// Membership of the launched clusters: with --etcd, every service joins through etcd, each
    /// cluster under its own name (--cluster, then the design and the routing policy).
    #[command(flatten, next_help_heading = "Membership")]
    pub membership: ClusterArgs,
    /// The launched clusters (the flags `duet simulate` takes too).
    // Last: its router heading applies to every flag after it.
    #[command(flatten, next_help_heading = "Cluster")]
    pub shape: ShapeArgs,
}

/// What was measured for one request.
#[derive(Clone, Debug, Default)]
struct Sample {
    ok: bool,
    ttft_ms: f64,
    tpot_ms: f64,
    e2e_ms: f64,
    output_tokens: usize,
    /// When each message with tokens arrived, and how many tokens it carried.
    arrivals: Vec<(Instant, usize)>,
    /// The servers' own account of the request (`Timings` on its last message).
    server: Option<v1::Timings>,
    /// When it was sent.
    sent: Option<Instant>,
    /// The prompt's tokens (empty for a text prompt) and the tokens generated.
    prompt: Vec<u32>,
    token_ids: Vec<u32>,
    /// The final message's usage: prompt tokens, and those found in a prefix cache.
    prompt_tokens: u32,
    cached_tokens: u32,
    /// The final message's usage: what speculative decoding did.
    decode_steps: u32,
    draft_tokens: u32,
    accepted_draft_tokens: u32,
    code: Option<tonic::Code>,
    error: Option<String>,
}

impl Sample {
    /// Milliseconds between consecutive messages with tokens.
    fn itl_ms(&self) -> impl Iterator<Item = f64> + '_ {
        self.arrivals
            .windows(2)
            .map(|w| (w[1].0 - w[0].0).as_secs_f64() * 1e3)
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    /// What a simulated run reports too (`duet simulate --json-out`: the same keys).
    #[serde(flatten)]
    pub summary: ServeSummary,
    /// Closed loop only: output tokens/s from the start until the first client found no request
    /// left to send, the window in which every client had a request in flight (the run's
    /// throughput also counts the drain at its end, where fewer and fewer streams run).
    pub full_concurrency: Option<FullConcurrency>,
    /// Prompt tokens found in a prefix cache ÷ prompt tokens, over successful requests.
    pub prefix_hit_rate: f64,
    /// The same, had one worker held every prefix computed before (token prompts only).
    pub ideal_prefix_hit_rate: f64,
    /// TTFT of the cold requests: those even that ideal cache holds nothing of (a prompt whose
    /// first block no earlier request had), which no routing can help. `None` without token
    /// prompts.
    pub cold_ttft_ms: Option<ColdTtft>,
    pub first_error: Option<String>,
    /// With --chaos: the faults, failures by status, differing streams and held blocks.
    pub chaos: Option<ChaosReport>,
    /// Speculative decoding over successful requests, from their usage.
    pub speculation: SpeculationReport,
    /// Multi-turn workloads: each turn's TTFT, and that of every turn after the first.
    pub turns: Vec<TurnReport>,
    pub later_turns_ttft_ms: Option<Percentiles>,
    /// Launched clusters: the tiers below the workers' KV pools over the run, and the prefix
    /// pulls between decode workers.
    pub kv_tiers: Vec<TierReport>,
    pub peer_pulls: BTreeMap<String, u64>,
    /// Every served request's outcome (`--requests-out`), not in the JSON report.
    #[serde(skip)]
    pub outcomes: Vec<Outcome>,
}

/// One turn of the conversations.
#[derive(Clone, Debug, Serialize)]
pub struct TurnReport {
    /// 1 for the first.
    pub turn: usize,
    pub requests: usize,
    pub ttft_ms: Percentiles,
}

/// One tier below the KV pool, over every worker of a launched cluster.
#[derive(Clone, Debug, Default, Serialize)]
pub struct TierReport {
    pub tier: String,
    /// Blocks brought up instead of computed, their bytes and the time that took.
    pub hits: u64,
    pub bytes_loaded: u64,
    pub load_seconds: f64,
    /// bytes_loaded ÷ load_seconds, in GB/s.
    pub restore_gb_per_s: f64,
    /// The CPU time of those loads (their wall time less waits for a core), and bytes_loaded
    /// over it in GB/s: the copy's own speed on a shared machine.
    pub load_cpu_seconds: f64,
    pub restore_gb_per_cpu_s: f64,
    pub bytes_stored: u64,
    pub cost_model_misses: u64,
    pub corrupt: u64,
    /// Page-locked memory on some worker (`--kv-host-pinned on`): blocks brought up straight
    /// from their slots, and blocks moving in that waited for those copies.
    pub page_locked: bool,
    pub lent_blocks: u64,
    pub copy_waits: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct SpeculationReport {
    pub decode_steps: u64,
    pub draft_tokens: u64,
    pub accepted_draft_tokens: u64,
    /// Accepted ÷ drafted.
    pub acceptance_rate: f64,
    /// Tokens generated on the decode workers ÷ their steps (1 without speculation).
    pub tokens_per_step: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct ColdTtft {
    pub requests: usize,
    pub ttft_ms: Percentiles,
}

#[derive(Clone, Debug, Serialize)]
pub struct FullConcurrency {
    pub window_s: f64,
    pub output_tokens_per_s: f64,
}

#[derive(Serialize)]
struct Report<'a> {
    workload: WorkloadReport<'a>,
    runs: Vec<RunReport>,
    engine_alone: Option<EngineAlone>,
}

/// The engine's own batched decode on the workload's mean shape (`--compare-engine`), measured
/// before the first cluster run and after each one, so that every run is compared with the mean
/// of the measurements on either side of it (this machine's speed drifts over minutes).
#[derive(Serialize, Clone)]
struct EngineAlone {
    batch: usize,
    context: usize,
    steps: usize,
    /// In order: before the first run, then after each run.
    decode_tokens_per_s: Vec<f64>,
    /// Time to first token of one `context`-token prompt prefilled alone, measured with each
    /// decode rate.
    prefill_ms: Vec<f64>,
}

impl EngineAlone {
    /// The mean of the measurements just before and after run `i`.
    fn around(series: &[f64], i: usize) -> f64 {
        (series[i] + series[(i + 1).min(series.len() - 1)]) / 2.0
    }
}

pub fn run(args: ServeBenchArgs) -> Result<()> {
    let restart_after = Duration::from_millis(args.chaos.chaos_restart_after_ms);
    let chaos_spec = match &args.chaos.chaos {
        Some(spec) => Some(
            ChaosSpec::parse(spec, restart_after).map_err(|e| anyhow::anyhow!("--chaos {e}"))?,
        ),
        None => None,
    };
    let arrivals = args.workload.arrivals()?;
    args.workload.slo()?;
    let requests_out = RequestsOut::create(args.workload.requests_out.as_deref())?;
    let jobs: Vec<Job> = args.workload.jobs()?.collect::<Result<_, _>>()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut engine_alone = args.compare_engine.then(|| EngineAlone {
        batch: args.workload.concurrency,
        context: args.workload.prompt_tokens.mean() as usize,
        steps: args.workload.output_tokens.mean() as usize,
        decode_tokens_per_s: Vec::new(),
        prefill_ms: Vec::new(),
    });
    let measure_engine = |e: &mut Option<EngineAlone>| -> Result<()> {
        if let Some(e) = e {
            eprintln!(
                "the engine alone: batch {}, {}-token prompts, {} steps",
                e.batch, e.context, e.steps
            );
            let rates = crate::bench_engine::engine_alone_rates(
                &args.model.resolve()?,
                args.shape.engine.clone(),
                (e.batch, e.context, e.steps),
                2,
            )?;
            e.decode_tokens_per_s.push(rates.decode_tokens_per_s);
            e.prefill_ms.push(rates.prefill_ms);
        }
        Ok(())
    };
    // Workers a fault names must exist in every cluster, before any is launched.
    if let Some(spec) = &chaos_spec {
        for (design, _, _) in arms(&args) {
            let prefill = args.shape.prefill_workers_of(design);
            chaos::plan(
                spec,
                &args.chaos,
                Duration::ZERO,
                prefill,
                args.shape.decode_workers,
            )?;
        }
    }
    let mut runs = Vec::new();
    if let Some(server) = &args.server {
        let addr: SocketAddr = server
            .parse()
            .with_context(|| format!("--server {server}: not host:port"))?;
        runs.push(
            runtime
                .block_on(drive(&args, arrivals, addr, &jobs, "server"))?
                .0,
        );
    } else {
        measure_engine(&mut engine_alone)?;
        for (design, policy, tiers) in arms(&args) {
            let prefill = args.shape.prefill_workers_of(design);
            let routing = args.shape.routing_of(design);
            let mut name = format!("{design:?}").to_lowercase();
            if let Some(policy) = policy {
                name = format!("{name}/{policy}");
            }
            let engine = match tiers {
                Some(true) | None => args.shape.engine.clone(),
                Some(false) => EngineOptions {
                    kv_tiers: Default::default(),
                    ..args.shape.engine.clone()
                },
            };
            if let Some(on) = tiers {
                name = format!("{name}/{}", if on { "tiers" } else { "no-tiers" });
            }
            let membership = ClusterArgs {
                cluster: format!("{}-{}", args.membership.cluster, name.replace('/', "-")),
                ..args.membership.clone()
            };
            let spec = ClusterSpec {
                router: RouterConfig {
                    listen: crate::cluster::free_port(std::net::Ipv4Addr::LOCALHOST.into())?,
                    routing: RoutingOptions {
                        routing: policy.unwrap_or(routing.routing),
                        ..routing
                    },
                    cluster: membership,
                    ..RouterConfig::default()
                },
                prefill: PrefillConfig {
                    worker: WorkerArgs {
                        engine: engine.clone(),
                        kv_transport: args.shape.kv_transport,
                        ..WorkerArgs::default()
                    },
                    ..PrefillConfig::default()
                },
                decode: DecodeConfig {
                    worker: WorkerArgs {
                        engine,
                        kv_transport: args.shape.kv_transport,
                        ..WorkerArgs::default()
                    },
                    peer_pull: args.peer_pull.clone(),
                    ..DecodeConfig::default()
                },
                prefill_workers: prefill,
                decode_workers: args.shape.decode_workers,
                model: args.model.resolve()?,
                processes: args.shape.processes,
                bin_dir: None,
                telemetry: Default::default(),
                auth: Default::default(),
            };
            eprintln!(
                "launching a {name} cluster ({prefill} prefill + {} decode)",
                args.shape.decode_workers
            );
            let mut cluster = Cluster::start(&spec)?;
            let mut run = match &chaos_spec {
                None => {
                    runtime
                        .block_on(drive(&args, arrivals, cluster.router, &jobs, &name))?
                        .0
                }
                Some(spec) => {
                    chaos_run(&args, arrivals, &runtime, &mut cluster, spec, &jobs, &name)?
                }
            };
            (run.kv_tiers, run.peer_pulls) = runtime.block_on(tier_reports(&cluster));
            runs.push(run);
            drop(cluster);
            measure_engine(&mut engine_alone)?;
        }
    }
    print_table(&runs, &args.workload, arrivals);
    for r in &runs {
        if let Some(c) = &r.chaos {
            c.print(&r.summary.design);
        }
    }
    serve_report::print_ttft_split(runs.iter().map(|r| &r.summary));
    print_turns_and_tiers(&runs);
    if let Some(e) = &engine_alone {
        let list = |v: &[f64]| {
            v.iter()
                .map(|r| format!("{r:.1}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!(
            "engine alone before and after each run: batch {} from {}-token prompts over {} steps {} tok/s; one {}-token prompt's first token {} ms",
            e.batch,
            e.context,
            e.steps,
            list(&e.decode_tokens_per_s),
            e.context,
            list(&e.prefill_ms)
        );
        for (i, r) in runs.iter().enumerate() {
            let engine = EngineAlone::around(&e.decode_tokens_per_s, i);
            let prefill_ms = EngineAlone::around(&e.prefill_ms, i);
            let full = r.full_concurrency.as_ref().map_or(String::new(), |f| {
                format!(
                    "; {:.2}× while all {} streams ran (first {:.1} s)",
                    f.output_tokens_per_s / engine,
                    args.workload.concurrency,
                    f.window_s
                )
            });
            println!(
                "{:<27} output tok/s = {:.2}× the engine alone around it ({engine:.1} tok/s) over the run{full}",
                r.summary.design,
                r.summary.output_tokens_per_s / engine
            );
            // A sequence of the engine's batch gets one token per step.
            let step_ms = 1e3 * e.batch as f64 / engine;
            println!(
                "{:<27} TPOT p50 = {:.2}× the engine's step ({step_ms:.2} ms); TTFT p50 = {:.2}× the engine's prefill ({prefill_ms:.1} ms)",
                r.summary.design,
                r.summary.tpot_ms.p50 / step_ms,
                r.summary.ttft_ms.p50 / prefill_ms
            );
        }
    }
    let report = Report {
        workload: args
            .workload
            .report(runs.first().map_or(0, |r| r.summary.requests), arrivals),
        runs: runs.clone(),
        engine_alone,
    };
    crate::bench_engine::print_json(&report, args.json_out.as_deref())?;
    if let Some(out) = requests_out {
        out.write(
            runs.iter()
                .map(|r| (r.summary.design.as_str(), &r.outcomes[..])),
        )?;
    }
    if let Some(p) = &args.plot_out {
        let summaries: Vec<ServeSummary> = runs.iter().map(|r| r.summary.clone()).collect();
        plot::latency_percentiles(&summaries, p)?;
        eprintln!("plot written to {}", p.display());
    }
    let problems: Vec<String> = runs
        .iter()
        .filter_map(|r| {
            let p = r.chaos.as_ref()?.problems()?;
            Some(format!("{}: {p}", r.summary.design))
        })
        .collect();
    if !problems.is_empty() {
        bail!("chaos: {}", problems.join("; "));
    }
    Ok(())
}

/// One launched cluster under --chaos: every distinct request once alone (the reference), then
/// the load with the faults injected alongside, then the workers' blocks once it is over.
fn chaos_run(
    args: &ServeBenchArgs,
    arrivals: Arrivals,
    runtime: &tokio::runtime::Runtime,
    cluster: &mut Cluster,
    spec: &ChaosSpec,
    jobs: &[Job],
    design: &str,
) -> Result<RunReport> {
    eprintln!("[{design}] solo greedy runs of every distinct request (the reference)");
    let solo = runtime.block_on(solo_runs(cluster.router, jobs, design))?;
    // The load's expected length: the solo runs' time spread over the concurrency, or the
    // arrivals' span.
    let solo_s: f64 = solo.iter().flatten().map(|s| s.e2e_ms / 1e3).sum();
    let solo_mean_s = solo_s / jobs.len().max(1) as f64;
    let window = match arrivals {
        Arrivals::Closed { concurrency } => solo_s / concurrency.max(1) as f64,
        Arrivals::Trace { speedup } => {
            let last = jobs.last().and_then(|j| j.at).unwrap_or_default();
            (last.as_secs_f64() / speedup).max(solo_mean_s)
        }
        open => {
            let rate = open.mean_rate().expect("an open loop has a rate");
            (jobs.len() as f64 / rate).max(solo_mean_s)
        }
    };
    let faults = chaos::plan(
        spec,
        &args.chaos,
        Duration::from_secs_f64(window),
        cluster.prefill.len(),
        cluster.decode.len(),
    )?;
    let load_done = AtomicBool::new(false);
    let router = cluster.router;
    let start = Instant::now();
    let disk = args.shape.engine.kv_tiers.kv_disk_dir.as_deref();
    let (load, injected) = std::thread::scope(|scope| {
        let injector = scope.spawn(|| chaos::inject(cluster, &faults, start, &load_done, disk));
        let load = runtime.block_on(drive(args, arrivals, router, jobs, design));
        load_done.store(true, Ordering::Relaxed);
        (load, injector.join())
    });
    let injected = injected.map_err(|_| anyhow::anyhow!("the fault injector panicked"))?;
    let (mut report, by_job) = load?;
    let mut failed = BTreeMap::new();
    let mut differing = Vec::new();
    for (request, (turns, reference)) in by_job.iter().zip(&solo).enumerate() {
        for (turn, s) in turns.iter().enumerate() {
            if !s.ok {
                let code = s.code.map_or("transport".into(), |c| format!("{c:?}"));
                *failed.entry(code).or_insert(0) += 1;
                continue;
            }
            let check = match reference.get(turn) {
                Some(r) => chaos::check_stream(&r.token_ids, &s.token_ids),
                // A turn past the reference's: an earlier answer already differed.
                None => StreamCheck::Differs { at: 0 },
            };
            if check != StreamCheck::Same {
                differing.push(DifferingStream {
                    request,
                    turn,
                    check,
                });
            }
        }
    }
    let workers = runtime.block_on(chaos::held_blocks(cluster));
    report.chaos = Some(ChaosReport {
        faults_planned: faults.iter().map(ToString::to_string).collect(),
        faults: injected,
        completed: by_job.iter().flatten().filter(|s| s.ok).count(),
        failed,
        differing,
        workers,
    });
    Ok(report)
}

/// Every distinct request of `jobs` run alone, greedy, in order: each job's samples, turn by turn.
async fn solo_runs(router: SocketAddr, jobs: &[Job], design: &str) -> Result<Vec<Vec<Sample>>> {
    // Only launched clusters run chaos, and they serve plaintext.
    let (channel, _, folded) = connect(router, jobs, None).await?;
    let done = Progress::new(
        format!("[{design} solo]"),
        jobs.len() as u64,
        Unit::Requests,
    );
    let mut seen: HashMap<&Job, Vec<Sample>> = HashMap::new();
    let mut out = Vec::with_capacity(jobs.len());
    for (i, job) in folded.iter().enumerate() {
        let samples = match seen.get(job) {
            Some(s) => s.clone(),
            None => {
                let s = conversation(channel.clone(), job, &done).await;
                if let Some(e) = s.iter().find_map(|s| s.error.as_ref()) {
                    bail!("the solo run of request {i} failed before any fault: {e}");
                }
                seen.insert(job, s.clone());
                s
            }
        };
        out.push(samples);
    }
    done.finish();
    Ok(out)
}

/// The clusters to launch, in order: each design, for a disaggregated one each policy of
/// --compare-routing (or the router's own --routing), and with --compare-kv-tiers each without
/// and then with the tiers below the KV pool (`Some(false)`, `Some(true)`; `None`: as
/// configured, not compared).
fn arms(args: &ServeBenchArgs) -> Vec<(Design, Option<RoutingPolicy>, Option<bool>)> {
    let tiers: &[Option<bool>] = match args.compare_kv_tiers {
        true => &[Some(false), Some(true)],
        false => &[None],
    };
    args.shape
        .launch
        .iter()
        .flat_map(|&design| match design {
            Design::Disaggregated if !args.compare_routing.is_empty() => args
                .compare_routing
                .iter()
                .map(|&p| (design, Some(p)))
                .collect(),
            _ => vec![(design, None)],
        })
        .flat_map(|(design, policy)| tiers.iter().map(move |&t| (design, policy, t)))
        .collect()
}

/// A channel to the router (TLS when `tls_ca` is given), its `Info`, and `jobs` with their
/// synthetic tokens folded into the model's vocabulary.
async fn connect(
    router: SocketAddr,
    jobs: &[Job],
    tls_ca: Option<&std::path::Path>,
) -> Result<(tonic::transport::Channel, v1::InfoResponse, Vec<Job>)> {
    let channel = crate::generate::router_channel(&router.to_string(), tls_ca).await?;
    let info = v1::generation_client::GenerationClient::new(channel.clone())
        .info(v1::InfoRequest {})
        .await?
        .into_inner();
    // Synthetic prompts are drawn for a large vocabulary; fold them into this model's.
    let vocab = info.vocab_size.max(4);
    let fold = |t: &[u32]| -> Vec<u32> {
        t.iter()
            .map(|&x| if x < vocab { x } else { 3 + x % (vocab - 3) })
            .collect()
    };
    let jobs: Vec<Job> = jobs
        .iter()
        .map(|j| Job {
            prompt: match &j.prompt {
                Prompt::Tokens(t) => Prompt::Tokens(fold(t)),
                Prompt::Text(_) => j.prompt.clone(),
            },
            max_tokens: j.max_tokens,
            follow_ups: j.follow_ups.iter().map(|q| fold(q)).collect(),
            at: j.at,
        })
        .collect();
    Ok((channel, info, jobs))
}

/// Runs the workload against `router`: the report, and each job's samples turn by turn.
async fn drive(
    args: &ServeBenchArgs,
    arrivals: Arrivals,
    router: SocketAddr,
    jobs: &[Job],
    design: &str,
) -> Result<(RunReport, Vec<Vec<Sample>>)> {
    let (channel, info, jobs) = connect(router, jobs, args.tls_ca.as_deref()).await?;
    let jobs = &jobs[..];
    let total = jobs.iter().map(|j| 1 + j.follow_ups.len()).sum::<usize>();
    let done = Arc::new(Progress::new(
        format!("[{design}]"),
        total as u64,
        Unit::Requests,
    ));
    let start = Instant::now();
    // Closed loop: when the first client found the queue empty (the drain begins).
    let drain_start = std::sync::OnceLock::new();
    let by_job: Vec<Vec<Sample>> = match arrivals {
        Arrivals::Closed { concurrency }
            if args.workload.workload == WorkloadShape::SharedPrefix
                && args.workload.shared_prefix.interleave =>
        {
            interleaved(jobs, concurrency.max(1), &channel, &done, &drain_start).await
        }
        Arrivals::Closed { concurrency } => {
            let next = Arc::new(AtomicUsize::new(0));
            let drain_start = &drain_start;
            let workers = (0..concurrency.max(1)).map(|_| {
                let (next, done, channel) = (next.clone(), done.clone(), channel.clone());
                async move {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(job) = jobs.get(i) else {
                            let _ = drain_start.set(Instant::now());
                            break;
                        };
                        out.push((i, conversation(channel.clone(), job, &done).await));
                    }
                    out
                }
            });
            let mut all: Vec<(usize, Vec<Sample>)> = futures::future::join_all(workers)
                .await
                .into_iter()
                .flatten()
                .collect();
            all.sort_by_key(|(i, _)| *i);
            all.into_iter().map(|(_, s)| s).collect()
        }
        open => {
            let mut clock = ArrivalClock::new(open, args.workload.seed);
            let mut handles = Vec::new();
            for job in jobs {
                let at = clock
                    .next(job.at.map(|d| d.as_secs_f64()))
                    .expect("an open loop's clock gives times");
                tokio::time::sleep_until((start + Duration::from_secs_f64(at)).into()).await;
                let (channel, done, job) = (channel.clone(), done.clone(), job.clone());
                handles.push(tokio::spawn(async move {
                    conversation(channel, &job, &done).await
                }));
            }
            let mut out = Vec::new();
            for h in handles {
                out.push(h.await?);
            }
            out
        }
    };
    let duration = start.elapsed().as_secs_f64();
    done.finish();
    let samples: Vec<Sample> = by_job.iter().flatten().cloned().collect();
    eprintln!("[{design}] {total} requests done in {duration:.1}s");
    let full_concurrency = drain_start.get().map(|&end| {
        let window_s = (end - start).as_secs_f64();
        let tokens: usize = samples
            .iter()
            .flat_map(|s| &s.arrivals)
            .filter(|(at, _)| *at <= end)
            .map(|(_, n)| n)
            .sum();
        FullConcurrency {
            window_s,
            output_tokens_per_s: tokens as f64 / window_s,
        }
    });
    let report = summarize(
        design,
        &samples,
        start,
        duration,
        full_concurrency,
        info.block_size as usize,
        args,
    );
    let mut report = report;
    (report.turns, report.later_turns_ttft_ms) = turn_reports(&by_job);
    Ok((report, by_job))
}

/// Each turn's TTFT over the successful requests of that turn, and that of every turn after the
/// first; none for a workload of single requests.
fn turn_reports(by_job: &[Vec<Sample>]) -> (Vec<TurnReport>, Option<Percentiles>) {
    let turns = by_job.iter().map(Vec::len).max().unwrap_or(0);
    if turns < 2 {
        return (Vec::new(), None);
    }
    let of_turn = |t: usize| by_job.iter().filter_map(move |j| j.get(t)).filter(|s| s.ok);
    let reports = (0..turns)
        .map(|t| TurnReport {
            turn: t + 1,
            requests: of_turn(t).count(),
            ttft_ms: percentiles(of_turn(t).map(|s| s.ttft_ms)),
        })
        .collect();
    let later = percentiles((1..turns).flat_map(of_turn).map(|s| s.ttft_ms));
    (reports, Some(later))
}

/// The tiers below the KV pools of `cluster`'s workers, summed per tier, and the decode
/// workers' prefix pulls by outcome.
async fn tier_reports(cluster: &Cluster) -> (Vec<TierReport>, BTreeMap<String, u64>) {
    let mut tiers: BTreeMap<i32, TierReport> = BTreeMap::new();
    let mut pulls = BTreeMap::new();
    for &addr in &cluster.workers() {
        let Ok(s) = chaos::stats(addr, &cluster.token).await else {
            continue;
        };
        for t in &s.kv_tiers {
            let name = v1::KvTier::try_from(t.tier).map_or("unknown", |k| k.as_str_name());
            let r = tiers.entry(t.tier).or_insert_with(|| TierReport {
                tier: name.trim_start_matches("KV_TIER_").to_lowercase(),
                ..TierReport::default()
            });
            r.hits += t.hits;
            r.bytes_loaded += t.bytes_loaded;
            r.load_seconds += t.load_seconds;
            r.load_cpu_seconds += t.load_cpu_seconds;
            r.bytes_stored += t.bytes_stored;
            r.cost_model_misses += t.cost_model_misses;
            r.corrupt += t.corrupt;
            r.page_locked |= t.page_locked;
            r.lent_blocks += t.lent_blocks;
            r.copy_waits += t.copy_waits;
        }
        for (outcome, n) in &s.kv_peer_pulls {
            *pulls.entry(outcome.clone()).or_insert(0) += n;
        }
    }
    let tiers = tiers
        .into_values()
        .map(|mut r| {
            let bytes = r.bytes_loaded as f64;
            let gb_per_s = |seconds: f64| match seconds > 0.0 {
                true => bytes / seconds / 1e9,
                false => 0.0,
            };
            r.restore_gb_per_s = gb_per_s(r.load_seconds);
            r.restore_gb_per_cpu_s = gb_per_s(r.load_cpu_seconds);
            r
        })
        .collect();
    (tiers, pulls)
}

/// Users taking turns (`--interleave`): `clients` clients take turns from the front of a queue
/// holding every conversation's first turn, and a conversation's next turn (its prompt, answer and
/// next question) joins the back once its answer arrives; a failed turn ends the conversation.
/// Each job's samples, turn by turn.
async fn interleaved(
    jobs: &[Job],
    clients: usize,
    channel: &tonic::transport::Channel,
    done: &Progress,
    drain_start: &std::sync::OnceLock<Instant>,
) -> Vec<Vec<Sample>> {
    struct Turn {
        job: usize,
        turn: usize,
        prompt: Prompt,
    }
    let queue = std::sync::Mutex::new(
        jobs.iter()
            .enumerate()
            .map(|(job, j)| Turn {
                job,
                turn: 0,
                prompt: j.prompt.clone(),
            })
            .collect::<std::collections::VecDeque<_>>(),
    );
    let samples = std::sync::Mutex::new(vec![Vec::new(); jobs.len()]);
    // Turns taken and not yet answered: while any is, the queue may still grow.
    let in_flight = AtomicUsize::new(0);
    let client = || async {
        loop {
            let next = {
                let mut q = queue.lock().unwrap_or_else(|e| e.into_inner());
                let next = q.pop_front();
                if next.is_some() {
                    in_flight.fetch_add(1, Ordering::SeqCst);
                }
                next
            };
            let Some(Turn { job, turn, prompt }) = next else {
                if in_flight.load(Ordering::SeqCst) == 0 {
                    let _ = drain_start.set(Instant::now());
                    return;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
                continue;
            };
            let s = one_request(channel.clone(), &prompt, jobs[job].max_tokens).await;
            done.inc(1);
            let question = jobs[job].follow_ups.get(turn).filter(|_| s.ok);
            if let (Some(question), Prompt::Tokens(mut tokens)) = (question, prompt) {
                tokens.extend_from_slice(&s.token_ids);
                tokens.extend_from_slice(question);
                let next = Turn {
                    job,
                    turn: turn + 1,
                    prompt: Prompt::Tokens(tokens),
                };
                queue
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push_back(next);
            }
            samples.lock().unwrap_or_else(|e| e.into_inner())[job].push(s);
            // After the next turn is queued: a client finding the queue empty with nothing in
            // flight is done.
            in_flight.fetch_sub(1, Ordering::SeqCst);
        }
    };
    futures::future::join_all((0..clients).map(|_| client())).await;
    samples.into_inner().unwrap_or_else(|e| e.into_inner())
}

/// A job's turns, one after another (each turn's prompt is the previous turn's prompt, its
/// answer and the next question); a failed turn ends the conversation.
async fn conversation(
    channel: tonic::transport::Channel,
    job: &Job,
    done: &Progress,
) -> Vec<Sample> {
    let mut samples: Vec<Sample> = Vec::with_capacity(1 + job.follow_ups.len());
    let mut prompt = job.prompt.clone();
    for turn in 0..=job.follow_ups.len() {
        if let (Some(last), Prompt::Tokens(t)) = (samples.last(), &mut prompt) {
            if !last.ok {
                break;
            }
            t.extend_from_slice(&last.token_ids);
            t.extend_from_slice(&job.follow_ups[turn - 1]);
        }
        samples.push(one_request(channel.clone(), &prompt, job.max_tokens).await);
        done.inc(1);
    }
    samples
}

async fn one_request(
    channel: tonic::transport::Channel,
    prompt: &Prompt,
    max_tokens: u32,
) -> Sample {
    let mut client = v1::generation_client::GenerationClient::new(channel);
    let mut req = v1::GenerateRequest {
        max_tokens: Some(max_tokens),
        temperature: Some(0.0),
        ignore_eos: true,
        ..Default::default()
    };
    let mut s = Sample::default();
    match prompt {
        Prompt::Text(t) => req.prompt = t.clone(),
        Prompt::Tokens(t) => {
            req.token_ids = t.clone();
            s.prompt = t.clone();
        }
    }
    let start = Instant::now();
    s.sent = Some(start);
    let result: Result<(), tonic::Status> = async {
        let mut stream = client.generate(req).await?.into_inner();
        while let Some(msg) = stream.next().await {
            let msg = msg?;
            if msg.timings.is_some() {
                s.server = msg.timings.clone();
            }
            if let Some(u) = msg.usage {
                (s.prompt_tokens, s.cached_tokens) = (u.prompt_tokens, u.cached_prompt_tokens);
                (s.decode_steps, s.draft_tokens, s.accepted_draft_tokens) =
                    (u.decode_steps, u.draft_tokens, u.accepted_draft_tokens);
            }
            s.token_ids.extend_from_slice(&msg.token_ids);
            if msg.token_ids.is_empty() {
                continue;
            }
            let now = Instant::now();
            if s.arrivals.is_empty() {
                s.ttft_ms = (now - start).as_secs_f64() * 1e3;
            }
            s.output_tokens += msg.token_ids.len();
            s.arrivals.push((now, msg.token_ids.len()));
        }
        Ok(())
    }
    .await;
    s.e2e_ms = start.elapsed().as_secs_f64() * 1e3;
    match result {
        Ok(()) => {
            s.ok = true;
            s.tpot_ms = if s.output_tokens > 1 {
                (s.e2e_ms - s.ttft_ms) / (s.output_tokens - 1) as f64
            } else {
                0.0
            };
        }
        Err(e) => {
            s.code = Some(e.code());
            s.error = Some(format!("{}: {}", e.code(), e.message()));
        }
    }
    s
}

fn summarize(
    design: &str,
    samples: &[Sample],
    start: Instant,
    duration: f64,
    full_concurrency: Option<FullConcurrency>,
    block_size: usize,
    args: &ServeBenchArgs,
) -> RunReport {
    let slo = Slo {
        ttft_ms: args.workload.ttft_slo_ms,
        tpot_ms: args.workload.tpot_slo_ms,
    };
    let mut summary = SummaryBuilder::new(args.workload.timeline_window_s);
    if args.workload.requests_out.is_some() {
        summary.keep_outcomes();
    }
    for s in samples {
        let arrival_s = s.sent.map_or(0.0, |t| (t - start).as_secs_f64());
        if !s.ok {
            summary.failed(s.code == Some(tonic::Code::ResourceExhausted), arrival_s);
            continue;
        }
        for itl in s.itl_ms() {
            summary.inter_token(itl);
        }
        let outcome = Outcome {
            arrival_s,
            prompt_tokens: s.prompt_tokens as usize,
            cached_tokens: s.cached_tokens as usize,
            ttft_ms: s.ttft_ms,
            tpot_ms: s.tpot_ms,
            e2e_ms: s.e2e_ms,
            output_tokens: s.output_tokens,
            split: s.server.as_ref().map(|t| TtftSplit {
                queue_ms: t.queue_ms,
                prefill_ms: t.prefill_ms,
                transfer_ms: t.transfer_ms,
                ttft_ms: t.ttft_ms,
                prefill_local: t.prefill_local,
            }),
        };
        summary.served(&outcome, &slo);
    }
    let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
    let prompt_tokens: u64 = ok.iter().map(|s| s.prompt_tokens as u64).sum();
    let cached_tokens: u64 = ok.iter().map(|s| s.cached_tokens as u64).sum();
    let mut in_order: Vec<&Sample> = ok
        .iter()
        .copied()
        .filter(|s| !s.prompt.is_empty())
        .collect();
    in_order.sort_by_key(|s| s.sent);
    let seen: Vec<Seen> = in_order
        .iter()
        .map(|s| Seen {
            prompt: &s.prompt,
            output: &s.token_ids,
        })
        .collect();
    let ideal_each = shared_prefix::ideal_cached_tokens(&seen, block_size);
    let ideal: usize = ideal_each.iter().sum();
    let cold: Vec<f64> = in_order
        .iter()
        .zip(&ideal_each)
        .filter(|&(_, &cached)| cached == 0)
        .map(|(s, _)| s.ttft_ms)
        .collect();
    let token_prompts: usize = in_order.iter().map(|s| s.prompt.len()).sum();
    let rate = |part: f64, whole: f64| if whole > 0.0 { part / whole } else { 0.0 };
    RunReport {
        summary: summary.build(design, duration),
        outcomes: summary.take_outcomes(),
        full_concurrency,
        prefix_hit_rate: rate(cached_tokens as f64, prompt_tokens as f64),
        ideal_prefix_hit_rate: rate(ideal as f64, token_prompts as f64),
        cold_ttft_ms: (!cold.is_empty()).then(|| ColdTtft {
            requests: cold.len(),
            ttft_ms: percentiles(cold.iter().copied()),
        }),
        first_error: samples.iter().find_map(|s| s.error.clone()),
        chaos: None,
        turns: Vec::new(),
        later_turns_ttft_ms: None,
        kv_tiers: Vec::new(),
        peer_pulls: BTreeMap::new(),
        speculation: {
            let sum = |f: fn(&Sample) -> u32| ok.iter().map(|s| f(s) as u64).sum::<u64>();
            let steps = sum(|s| s.decode_steps);
            let accepted = sum(|s| s.accepted_draft_tokens);
            let drafted = sum(|s| s.draft_tokens);
            SpeculationReport {
                decode_steps: steps,
                draft_tokens: drafted,
                accepted_draft_tokens: accepted,
                acceptance_rate: rate(accepted as f64, drafted as f64),
                // Each step yields one token and one per accepted draft token.
                tokens_per_step: rate((steps + accepted) as f64, steps as f64),
            }
        },
    }
}

/// Each run's TTFT by turn and its tiers; with --compare-kv-tiers, each pair's ratios.
fn print_turns_and_tiers(runs: &[RunReport]) {
    for r in runs {
        if let Some(later) = &r.later_turns_ttft_ms {
            let by_turn: Vec<String> = r
                .turns
                .iter()
                .map(|t| format!("{}: {:.1}", t.turn, t.ttft_ms.p50))
                .collect();
            let flat = match (r.turns.get(1), r.turns.last()) {
                (Some(second), Some(last)) if second.ttft_ms.p50 > 0.0 => format!(
                    "; turn {}/turn 2 = {:.2}×",
                    last.turn,
                    last.ttft_ms.p50 / second.ttft_ms.p50
                ),
                _ => String::new(),
            };
            println!(
                "{:<27} TTFT p50 by turn (ms) {}; turns 2+: p50 {:.1}, p90 {:.1}{flat}",
                r.summary.design,
                by_turn.join(", "),
                later.p50,
                later.p90
            );
        }
        for t in &r.kv_tiers {
            let page_locked = match t.page_locked {
                true => format!(
                    " (page-locked: {} straight from their slots, {} waits for copies)",
                    t.lent_blocks, t.copy_waits
                ),
                false => String::new(),
            };
            println!(
                "{:<27} {} tier{page_locked}: {} blocks brought up, {:.1} MB in {:.3} s ({:.2} GB/s; CPU time {:.3} s, {:.2} GB/s); {:.1} MB moved down; {} cost-model misses; {} corrupt",
                r.summary.design,
                t.tier,
                t.hits,
                t.bytes_loaded as f64 / 1e6,
                t.load_seconds,
                t.restore_gb_per_s,
                t.load_cpu_seconds,
                t.restore_gb_per_cpu_s,
                t.bytes_stored as f64 / 1e6,
                t.cost_model_misses,
                t.corrupt
            );
        }
        let pulls: Vec<String> = r
            .peer_pulls
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(o, n)| format!("{o} {n}"))
            .collect();
        if !pulls.is_empty() {
            println!(
                "{:<27} prefix pulls: {}",
                r.summary.design,
                pulls.join(", ")
            );
        }
    }
    for pair in runs.windows(2) {
        let (off, on) = (&pair[0], &pair[1]);
        let Some(base) = off.summary.design.strip_suffix("/no-tiers") else {
            continue;
        };
        if on.summary.design != format!("{base}/tiers") {
            continue;
        }
        let later = match (&off.later_turns_ttft_ms, &on.later_turns_ttft_ms) {
            (Some(a), Some(b)) if a.p50 > 0.0 => format!(
                "turns 2+ TTFT p50 = {:.2}× without them ({:.1} against {:.1} ms); ",
                b.p50 / a.p50,
                b.p50,
                a.p50
            ),
            _ => String::new(),
        };
        println!(
            "{base:<27} with tiers: {later}output tok/s = {:.3}× without them",
            on.summary.output_tokens_per_s / off.summary.output_tokens_per_s.max(f64::MIN_POSITIVE)
        );
    }
}

fn print_table(runs: &[RunReport], workload: &WorkloadArgs, arrivals: Arrivals) {
    let rows: Vec<TableRow> = runs
        .iter()
        .map(|r| TableRow {
            summary: &r.summary,
            full_tokens_per_s: r.full_concurrency.as_ref().map(|f| f.output_tokens_per_s),
            hit: r.prefix_hit_rate,
            ideal: Some(r.ideal_prefix_hit_rate),
        })
        .collect();
    serve_report::print_table(&rows, workload, arrivals);
    for r in runs {
        if let (Some(c), WorkloadShape::SharedPrefix) = (&r.cold_ttft_ms, &workload.workload) {
            println!(
                "{:<27} TTFT of the {} cold requests (no earlier request had their first block): p50 {:.1}, p90 {:.1} ms",
                r.summary.design, c.requests, c.ttft_ms.p50, c.ttft_ms.p90
            );
        }
        let s = &r.speculation;
        if s.draft_tokens > 0 {
            println!(
                "{:<27} speculation: {} of {} drafted tokens accepted ({:.0}%), {:.2} tokens per decode step",
                r.summary.design,
                s.accepted_draft_tokens,
                s.draft_tokens,
                s.acceptance_rate * 100.0,
                s.tokens_per_step
            );
        }
        if let Some(e) = &r.first_error {
            println!("  first error: {e}");
        }
    }
}
