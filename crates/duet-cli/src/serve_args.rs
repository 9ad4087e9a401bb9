//! The flags `duet bench serve` and `duet simulate` share, so that one command line runs a
//! cluster and simulates it: the cluster's shape ([`ShapeArgs`]) and the workload
//! ([`WorkloadArgs`]: the jobs, when they arrive, and the SLOs they are held to).

use std::io::BufReader;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use duet_engine::device::Device;
use duet_engine::engine::EngineOptions;
use duet_planner::PlannerError;
use duet_planner::arrivals::Arrivals;
use duet_planner::report::{Outcome, Slo, write_outcomes};
use duet_planner::simulator::Design;
use duet_planner::trace::TraceReader;
use duet_planner::workload::{Job, Prompt, Range, TokenSource, random_jobs};
use duet_router::RoutingOptions;
use duet_transfer::choice::TransportChoice;
use serde::{Deserialize, Serialize};

use crate::shared_prefix::SharedPrefixArgs;

/// The cluster: its designs, pools, engine settings and router.
#[derive(Args, Clone, Debug)]
pub struct ShapeArgs {
    /// Designs to launch (or simulate) and compare when no --server is given.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Design::Disaggregated, Design::Colocated])]
    pub launch: Vec<Design>,
    /// Prefill workers of a disaggregated cluster.
    #[arg(long, default_value_t = 1)]
    pub prefill_workers: usize,
    /// Decode workers of a cluster (a colocated cluster's workers).
    #[arg(long, default_value_t = 1)]
    pub decode_workers: usize,
    /// Run each launched cluster's services as separate processes (the `duet-router`,
    /// `duet-prefill` and `duet-decode` binaries next to this one) instead of in this process.
    /// In one process the workers take turns on one kernel thread pool; as processes they share
    /// the machine's cores (what `duet simulate` models for each).
    #[arg(long, env = "DUET_BENCH_PROCESSES")]
    pub processes: bool,
    /// The KV transport between prefill and decode workers (the workers' --kv-transport).
    #[arg(long, env = "DUET_KV_TRANSPORT", default_value_t = TransportChoice::Auto)]
    pub kv_transport: TransportChoice,
    #[command(flatten)]
    pub engine: EngineOptions,
    /// The routers' routing and limits (the `duet-router` flags of the same names; a colocated
    /// cluster prefills every prompt locally whatever --local-prefill-threshold says).
    // Last: the heading applies to every flag after it.
    #[command(flatten, next_help_heading = "Router")]
    pub routing: RoutingOptions,
}

impl ShapeArgs {
    /// The prefill workers of a cluster of `design` (a colocated one has none).
    pub fn prefill_workers_of(&self, design: Design) -> usize {
        match design {
            Design::Disaggregated => self.prefill_workers,
            Design::Colocated => 0,
        }
    }

    /// The router's options for a cluster of `design`: a colocated one prefills every prompt
    /// on its decode worker.
    pub fn routing_of(&self, design: Design) -> RoutingOptions {
        RoutingOptions {
            local_prefill_threshold: match design {
                Design::Disaggregated => self.routing.local_prefill_threshold,
                Design::Colocated => u32::MAX,
            },
            ..self.routing.clone()
        }
    }

    /// The transport's name as profiles record it: `auto` is cuda-ipc between GPU workers and
    /// gRPC between CPU ones.
    pub fn transport_name(&self) -> &'static str {
        match self.kv_transport {
            TransportChoice::Auto if matches!(self.engine.device, Device::Cuda(_)) => {
                TransportChoice::CudaIpc.as_str()
            }
            TransportChoice::Auto => TransportChoice::Grpc.as_str(),
            other => other.as_str(),
        }
    }
}

/// What the prompts are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadShape {
    /// Distinct random prompts of --prompt-tokens (no prefix cache can help), or --dataset.
    Random,
    /// Groups × users of multi-turn conversations sharing each group's long system prompt (the
    /// "Shared-prefix workload" flags); --requests and --prompt-tokens do not apply.
    SharedPrefix,
}

/// How an open loop (--rate) spaces its requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ArrivalProcess {
    /// Exponential gaps.
    Poisson,
    /// Gamma-distributed gaps with coefficient of variation --arrival-cv (bursty above 1).
    Gamma,
    /// A Poisson process whose rate swings by --rate-amplitude around --rate over
    /// --rate-period-s.
    Sinusoidal,
}

/// The workload: its jobs, when they arrive, and the SLOs they are held to.
#[derive(Args, Clone, Debug)]
pub struct WorkloadArgs {
    /// Closed loop: this many requests in flight at all times.
    #[arg(long, default_value_t = 1, conflicts_with_all = ["rate", "trace"])]
    pub concurrency: usize,
    /// Open loop: requests per second, arriving as --arrival says.
    #[arg(long)]
    pub rate: Option<f64>,
    /// How open-loop requests arrive.
    #[arg(long, value_enum, default_value_t = ArrivalProcess::Poisson, requires = "rate")]
    pub arrival: ArrivalProcess,
    /// Coefficient of variation of the gaps of --arrival gamma.
    #[arg(long, default_value_t = 2.0)]
    pub arrival_cv: f64,
    /// How far --arrival sinusoidal swings the rate: rate · (1 ± amplitude), within [0, 1].
    #[arg(long, default_value_t = 0.5)]
    pub rate_amplitude: f64,
    /// The period of --arrival sinusoidal, in seconds.
    #[arg(long, default_value_t = 60.0)]
    pub rate_period_s: f64,
    /// Requests per run.
    #[arg(long, default_value_t = 32)]
    pub requests: usize,
    /// Prompt length in tokens: `N` or a uniform range `A..B`.
    #[arg(long, default_value = "128")]
    pub prompt_tokens: Range,
    /// Output length in tokens: `N` or `A..B` (EOS is ignored, so every request makes exactly this).
    #[arg(long, default_value = "64")]
    pub output_tokens: Range,
    /// Workload from a JSONL file instead: `{"prompt": "...", "max_tokens": N}` or
    /// `{"prompt_tokens": N, "output_tokens": M}` per line.
    #[arg(long, conflicts_with = "trace")]
    pub dataset: Option<PathBuf>,
    /// Replay a trace in the Mooncake format (JSONL: `timestamp` in ms, `input_length`,
    /// `output_length`, `hash_ids` per 512-token block) at its timestamps; prompts sharing
    /// leading hash ids share those tokens. --requests, --prompt-tokens and --output-tokens do
    /// not apply.
    #[arg(long, env = "DUET_TRACE")]
    pub trace: Option<PathBuf>,
    /// Replays --trace this many times faster than recorded.
    #[arg(long, default_value_t = 1.0, requires = "trace")]
    pub trace_speedup: f64,
    /// What the prompts are.
    #[arg(long, value_enum, default_value_t = WorkloadShape::Random)]
    pub workload: WorkloadShape,
    /// Time-to-first-token SLO in milliseconds.
    #[arg(long, default_value_t = 1000.0)]
    pub ttft_slo_ms: f64,
    /// Time-per-output-token SLO in milliseconds.
    #[arg(long, default_value_t = 100.0)]
    pub tpot_slo_ms: f64,
    /// Seed of the synthetic prompts and arrival times.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Width of the windows of the report's attainment over time (`timeline`: requests by the
    /// window they arrived in), in seconds.
    #[arg(long, default_value_t = 10.0, value_parser = positive_seconds)]
    pub timeline_window_s: f64,
    /// Write every served request here, one JSON line each in the order they arrived: arrival,
    /// prompt and cached tokens, TTFT, TPOT, end-to-end latency, output tokens and the servers'
    /// split of the TTFT (`server_queue_ms`, ...). `duet bench serve` and `duet simulate` write
    /// the same fields, so a run and its simulation compare request by request.
    #[arg(long)]
    pub requests_out: Option<PathBuf>,
    #[command(flatten, next_help_heading = "Shared-prefix workload")]
    pub shared_prefix: SharedPrefixArgs,
}

fn positive_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("{s:?} is not a positive number of seconds")),
    }
}

#[derive(Deserialize)]
struct DatasetLine {
    prompt: Option<String>,
    max_tokens: Option<u32>,
    prompt_tokens: Option<usize>,
    output_tokens: Option<u32>,
}

impl WorkloadArgs {
    /// When requests arrive (checked).
    pub fn arrivals(&self) -> Result<Arrivals, PlannerError> {
        let arrivals = match (self.trace.is_some(), self.rate) {
            (true, _) => Arrivals::Trace {
                speedup: self.trace_speedup,
            },
            (false, None) => Arrivals::Closed {
                concurrency: self.concurrency,
            },
            (false, Some(rate)) => match self.arrival {
                ArrivalProcess::Poisson => Arrivals::Poisson { rate },
                ArrivalProcess::Gamma => Arrivals::Gamma {
                    rate,
                    cv: self.arrival_cv,
                },
                ArrivalProcess::Sinusoidal => Arrivals::Sinusoidal {
                    rate,
                    amplitude: self.rate_amplitude,
                    period_s: self.rate_period_s,
                },
            },
        };
        arrivals.check()?;
        Ok(arrivals)
    }

    /// The SLOs (checked).
    pub fn slo(&self) -> Result<Slo, PlannerError> {
        let slo = Slo {
            ttft_ms: self.ttft_slo_ms,
            tpot_ms: self.tpot_slo_ms,
        };
        slo.check()?;
        Ok(slo)
    }

    /// The jobs in the order they are sent: a trace is read as it is consumed, random prompts
    /// drawn as they are; a dataset or conversations are built first.
    pub fn jobs(&self) -> Result<Box<dyn Iterator<Item = Result<Job, PlannerError>>>> {
        if let Some(path) = &self.trace {
            let file = std::fs::File::open(path)
                .with_context(|| format!("--trace {}: cannot open it", path.display()))?;
            let reader = TraceReader::new(BufReader::new(file), path.display().to_string());
            return Ok(Box::new(reader));
        }
        let mut source = TokenSource::new(self.seed);
        if self.workload == WorkloadShape::SharedPrefix {
            let max_tokens = self.output_tokens.max as u32;
            let mut token = || duet_planner::workload::synthetic_token(source.next_u64());
            let jobs: Vec<Job> = self
                .shared_prefix
                .conversations(&mut token)
                .into_iter()
                .map(|c| Job {
                    prompt: Prompt::Tokens(c.first),
                    max_tokens,
                    follow_ups: c.follow_ups,
                    at: None,
                })
                .collect();
            return Ok(Box::new(jobs.into_iter().map(Ok)));
        }
        if let Some(path) = &self.dataset {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let mut jobs = Vec::new();
            for (i, line) in text
                .lines()
                .enumerate()
                .filter(|(_, l)| !l.trim().is_empty())
            {
                let l: DatasetLine = serde_json::from_str(line)
                    .with_context(|| format!("{}:{}: not a dataset line", path.display(), i + 1))?;
                let prompt = match (l.prompt, l.prompt_tokens) {
                    (Some(p), _) => Prompt::Text(p),
                    (None, Some(n)) => Prompt::Tokens(source.tokens(n)),
                    (None, None) => bail!(
                        "{}:{}: needs `prompt` or `prompt_tokens`",
                        path.display(),
                        i + 1
                    ),
                };
                let max_tokens = l
                    .max_tokens
                    .or(l.output_tokens)
                    .unwrap_or(self.output_tokens.max as u32);
                jobs.push(Job {
                    prompt,
                    max_tokens,
                    follow_ups: Vec::new(),
                    at: None,
                });
            }
            if jobs.is_empty() {
                bail!("{} holds no requests", path.display());
            }
            let jobs: Vec<Job> = jobs
                .into_iter()
                .cycle()
                .take(self.requests.max(1))
                .collect();
            return Ok(Box::new(jobs.into_iter().map(Ok)));
        }
        let jobs = random_jobs(
            self.seed,
            self.requests,
            self.prompt_tokens,
            self.output_tokens,
        );
        Ok(Box::new(jobs.map(Ok)))
    }
}

/// The workload as a report states it.
#[derive(Serialize)]
pub struct WorkloadReport<'a> {
    pub requests: usize,
    pub concurrency: Option<usize>,
    pub rate: Option<f64>,
    pub arrivals: Arrivals,
    pub shape: WorkloadShape,
    pub shared_prefix: Option<&'a SharedPrefixArgs>,
    pub prompt_tokens: &'a Range,
    pub output_tokens: &'a Range,
    pub dataset: Option<String>,
    pub trace: Option<String>,
    pub ttft_slo_ms: f64,
    pub tpot_slo_ms: f64,
}

impl WorkloadArgs {
    /// What a report says of this workload, of which `requests` were sent.
    pub fn report(&self, requests: usize, arrivals: Arrivals) -> WorkloadReport<'_> {
        WorkloadReport {
            requests,
            shape: self.workload,
            shared_prefix: (self.workload == WorkloadShape::SharedPrefix)
                .then_some(&self.shared_prefix),
            concurrency: matches!(arrivals, Arrivals::Closed { .. }).then_some(self.concurrency),
            rate: self.rate,
            arrivals,
            prompt_tokens: &self.prompt_tokens,
            output_tokens: &self.output_tokens,
            dataset: self.dataset.as_ref().map(|p| p.display().to_string()),
            trace: self.trace.as_ref().map(|p| p.display().to_string()),
            ttft_slo_ms: self.ttft_slo_ms,
            tpot_slo_ms: self.tpot_slo_ms,
        }
    }
}

/// `--requests-out`, created before the run: a path that cannot be written is refused before
/// anything runs, not after a long run.
pub struct RequestsOut {
    path: PathBuf,
    file: std::fs::File,
}

impl RequestsOut {
    pub fn create(path: Option<&Path>) -> Result<Option<Self>> {
        let Some(path) = path else {
            return Ok(None);
        };
        let file = std::fs::File::create(path)
            .with_context(|| format!("--requests-out {}", path.display()))?;
        Ok(Some(Self {
            path: path.to_path_buf(),
            file,
        }))
    }

    /// Writes every run's served requests (see [`write_outcomes`]).
    pub fn write<'a>(self, runs: impl IntoIterator<Item = (&'a str, &'a [Outcome])>) -> Result<()> {
        write_outcomes(self.file, runs)
            .with_context(|| format!("--requests-out {}", self.path.display()))?;
        eprintln!("requests written to {}", self.path.display());
        Ok(())
    }
}
