//! `duet bench serve --chaos`: faults injected into a launched cluster's worker processes while
//! the load runs (SIGKILL, SIGSTOP then SIGCONT, restart on the same port, every block file of a
//! worker's disk tier damaged), and what a user must never see afterwards: failed requests,
//! streams whose tokens differ from the same prompt's solo greedy run (repeats or gaps at a
//! failover, KV read from a damaged file), and KV blocks still held once the load is over.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use duet_proto::{ClusterToken, v1};
use serde::Serialize;

use crate::cluster::Cluster;

#[derive(Args, Debug, Clone)]
pub struct ChaosArgs {
    /// Inject faults into the launched cluster's workers while the load runs, and fail (exit
    /// non-zero) when a request failed, a stream's tokens differ from its prompt's solo greedy
    /// run, or a worker still holds KV blocks after the run. Needs --processes. SPEC: faults
    /// `ACTION:WORKER@TIME[+DURATION]` separated by commas, e.g.
    /// `kill:decode0@5s,stop:prefill1@8s+3s,restart:decode0@12s` (kill = SIGKILL, started
    /// again after +DURATION, default --chaos-restart-after-ms, or `+never`; stop = SIGSTOP,
    /// SIGCONT after +DURATION; restart = SIGTERM, then started again on the same port), or
    /// `random:N` (N faults at seeded random times and workers over the expected run). Faults
    /// run one at a time: one whose time comes while the previous one recovers waits for it.
    /// `corrupt:WORKER@TIME` flips a byte in every block file of the worker's disk tier
    /// (--kv-disk-dir): each must be found bad when read, counted, and recomputed.
    #[arg(
        long,
        value_name = "SPEC",
        env = "DUET_BENCH_CHAOS",
        requires = "processes",
        conflicts_with = "server"
    )]
    pub chaos: Option<String>,
    /// Seed of `--chaos random:N`.
    #[arg(long, env = "DUET_BENCH_CHAOS_SEED", default_value_t = 1)]
    pub chaos_seed: u64,
    /// How long a killed worker stays down before it is started again (unless its fault says
    /// `+DURATION` or `+never`).
    #[arg(
        long,
        env = "DUET_BENCH_CHAOS_RESTART_AFTER_MS",
        default_value_t = 2000
    )]
    pub chaos_restart_after_ms: u64,
}

/// What `--chaos` asks for.
#[derive(Clone, Debug, PartialEq)]
pub enum ChaosSpec {
    Faults(Vec<Fault>),
    Random(usize),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
}

/// A worker of the launched cluster: `prefill0`, `decode1`…
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Worker {
    pub role: Role,
    pub index: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// SIGKILL; started again after `back_after` (never when `None`).
    Kill { back_after: Option<Duration> },
    /// SIGSTOP, then SIGCONT after `resume_after`.
    Stop { resume_after: Duration },
    /// SIGTERM (SIGKILL if it has not exited within [`TERM_GRACE`]), then started again.
    Restart,
    /// A byte flipped in every block file of the worker's disk tier.
    CorruptKv,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// From the start of the load.
    pub at: Duration,
    pub worker: Worker,
    pub action: Action,
}

/// How long a restarted worker may drain after SIGTERM: past it, it is killed, and the fault
/// counts as broken (a rolling update relies on the drain ending once the requests in flight
/// are done, which for the bench's requests is well within this).
const TERM_GRACE: Duration = Duration::from_secs(10);
/// How long a started-again worker may take to answer `Stats`.
const START_LIMIT: Duration = Duration::from_secs(120);
/// How long the workers may take to free the blocks of the last requests' cleanups.
const SETTLE_LIMIT: Duration = Duration::from_secs(30);

impl fmt::Display for Worker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let role = match self.role {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        };
        write!(f, "{role}{}", self.index)
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Whole milliseconds as a user writes them: `5s`, `3478ms` (not `3.4779999999999998s`).
        let s = |d: Duration| match d.as_millis() {
            ms if ms % 1000 == 0 => format!("{}s", ms / 1000),
            ms => format!("{ms}ms"),
        };
        let (name, tail) = match self.action {
            Action::Kill { back_after: None } => ("kill", "+never".to_string()),
            Action::Kill {
                back_after: Some(d),
            } => ("kill", format!("+{}", s(d))),
            Action::Stop { resume_after } => ("stop", format!("+{}", s(resume_after))),
            Action::Restart => ("restart", String::new()),
            Action::CorruptKv => ("corrupt", String::new()),
        };
        write!(f, "{name}:{}@{}{tail}", self.worker, s(self.at))
    }
}

/// `500ms`, `5s`, `1.5s`.
fn duration(s: &str) -> Result<Duration, String> {
    let (number, unit) = if let Some(n) = s.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else {
        return Err(format!(
            "`{s}`: a duration needs a unit, `ms` or `s` (e.g. 5s)"
        ));
    };
    match number.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(Duration::from_secs_f64(v * unit)),
        _ => Err(format!("`{s}` is not a duration such as 500ms or 5s")),
    }
}

fn worker(s: &str) -> Result<Worker, String> {
    let (role, index) = if let Some(i) = s.strip_prefix("prefill") {
        (Role::Prefill, i)
    } else if let Some(i) = s.strip_prefix("decode") {
        (Role::Decode, i)
    } else {
        return Err(format!("`{s}`: a worker is prefillN or decodeN"));
    };
    let index = index
        .parse()
        .map_err(|_| format!("`{s}`: a worker is prefillN or decodeN (N from 0)"))?;
    Ok(Worker { role, index })
}

impl ChaosSpec {
    /// Parses `--chaos`; a kill without `+DURATION` brings its worker back after `restart_after`.
    pub fn parse(spec: &str, restart_after: Duration) -> Result<ChaosSpec, String> {
        let spec = spec.trim();
        if let Some(n) = spec.strip_prefix("random:") {
            return match n.parse::<usize>() {
                Ok(n) if n > 0 => Ok(ChaosSpec::Random(n)),
                _ => Err(format!("`{spec}`: random:N needs a positive count")),
            };
        }
        let faults = spec
            .split(',')
            .map(|event| {
                let event = event.trim();
                let bad = |why: String| format!("`{event}`: {why}");
                let (action, rest) = event
                    .split_once(':')
                    .ok_or_else(|| bad("a fault is ACTION:WORKER@TIME[+DURATION]".into()))?;
                let (target, when) = rest
                    .split_once('@')
                    .ok_or_else(|| bad("no @TIME after the worker".into()))?;
                let worker = worker(target).map_err(bad)?;
                let (at, after) = match when.split_once('+') {
                    Some((at, after)) => (at, Some(after)),
                    None => (when, None),
                };
                let at = duration(at).map_err(bad)?;
                let action = match (action, after) {
                    ("kill", None) => Action::Kill {
                        back_after: Some(restart_after),
                    },
                    ("kill", Some("never")) => Action::Kill { back_after: None },
                    ("kill", Some(d)) => Action::Kill {
                        back_after: Some(duration(d).map_err(bad)?),
                    },
                    ("stop", Some(d)) => Action::Stop {
                        resume_after: duration(d).map_err(bad)?,
                    },
                    ("stop", None) => {
                        return Err(bad("stop needs +DURATION, how long it stays stopped".into()));
                    }
                    ("restart", None) => Action::Restart,
                    ("restart", Some(_)) => {
                        return Err(bad("restart takes no +DURATION".into()));
                    }
                    ("corrupt", None) => Action::CorruptKv,
                    ("corrupt", Some(_)) => {
                        return Err(bad("corrupt takes no +DURATION".into()));
                    }
                    (other, _) => {
                        return Err(bad(format!(
                            "unknown action `{other}` (kill, stop, restart or corrupt)"
                        )));
                    }
                };
                Ok(Fault { at, worker, action })
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(ChaosSpec::Faults(faults))
    }
}

/// The cluster's process index of `worker` (prefill workers first, then decode workers), or why
/// the cluster has no such worker.
fn process_index(worker: Worker, prefill: usize, decode: usize) -> Result<usize, String> {
    let (count, base) = match worker.role {
        Role::Prefill => (prefill, 0),
        Role::Decode => (decode, prefill),
    };
    if worker.index >= count {
        return Err(format!(
            "--chaos names {worker}, but the cluster has {prefill} prefill and {decode} decode workers"
        ));
    }
    Ok(base + worker.index)
}

/// `n` faults over `window` (in its 10–70 %, so that the load still runs when they recover), at
/// workers and of kinds drawn from `seed`.
pub fn random_faults(
    n: usize,
    seed: u64,
    window: Duration,
    prefill: usize,
    decode: usize,
    restart_after: Duration,
) -> Vec<Fault> {
    let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut unit = move || ((next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    // Whole milliseconds, so that the faults print as briefly as a user writes them.
    let ms = |d: Duration| Duration::from_millis(d.as_millis() as u64);
    let workers = prefill + decode;
    let mut faults: Vec<Fault> = (0..n)
        .map(|_| {
            let i = ((unit() * workers as f64) as usize).min(workers - 1);
            let worker = if i < prefill {
                Worker {
                    role: Role::Prefill,
                    index: i,
                }
            } else {
                Worker {
                    role: Role::Decode,
                    index: i - prefill,
                }
            };
            let at = ms(window.mul_f64(0.1 + 0.6 * unit()));
            let action = match (unit() * 3.0) as usize {
                0 => Action::Kill {
                    back_after: Some(restart_after),
                },
                1 => Action::Stop {
                    resume_after: ms(Duration::from_secs_f64(1.0 + 2.0 * unit())),
                },
                _ => Action::Restart,
            };
            Fault { at, worker, action }
        })
        .collect();
    faults.sort_by_key(|f| f.at);
    faults
}

/// The faults `spec` asks for on a cluster of `prefill` + `decode` workers whose load is expected
/// to take `window`.
pub fn plan(
    spec: &ChaosSpec,
    args: &ChaosArgs,
    window: Duration,
    prefill: usize,
    decode: usize,
) -> Result<Vec<Fault>> {
    let mut faults = match spec {
        ChaosSpec::Faults(f) => f.clone(),
        ChaosSpec::Random(n) => random_faults(
            *n,
            args.chaos_seed,
            window,
            prefill,
            decode,
            Duration::from_millis(args.chaos_restart_after_ms),
        ),
    };
    for f in &faults {
        process_index(f.worker, prefill, decode).map_err(anyhow::Error::msg)?;
    }
    faults.sort_by_key(|f| f.at);
    Ok(faults)
}

/// A fault as it happened.
#[derive(Clone, Debug, Serialize)]
pub struct Injected {
    pub fault: String,
    /// From the start of the load.
    pub at_s: f64,
    /// Until the worker served again (or resumed).
    pub recovered_s: f64,
    /// Why injecting or recovering went wrong, if it did.
    pub error: Option<String>,
}

/// Runs `faults` against `cluster` one at a time, from `start`, until `load_done`; a fault already
/// begun is finished (the worker started again or resumed), so the cluster is whole afterwards
/// except for kills with `+never`.
pub fn inject(
    cluster: &mut Cluster,
    faults: &[Fault],
    start: Instant,
    load_done: &AtomicBool,
    kv_disk_dir: Option<&Path>,
) -> Vec<Injected> {
    let (prefill, decode) = (cluster.prefill.len(), cluster.decode.len());
    let mut injected = Vec::new();
    for fault in faults {
        while start.elapsed() < fault.at && !load_done.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(20));
        }
        if load_done.load(Ordering::Relaxed) {
            break;
        }
        let at = start.elapsed();
        let result = process_index(fault.worker, prefill, decode)
            .map_err(anyhow::Error::msg)
            .and_then(|i| apply(cluster, i, fault.action, kv_disk_dir));
        eprintln!(
            "chaos: {fault} at {:.1}s{}",
            at.as_secs_f64(),
            match &result {
                Ok(()) => String::new(),
                Err(e) => format!(" failed: {e:#}"),
            }
        );
        injected.push(Injected {
            fault: fault.to_string(),
            at_s: at.as_secs_f64(),
            recovered_s: start.elapsed().as_secs_f64(),
            error: result.err().map(|e| format!("{e:#}")),
        });
    }
    injected
}

fn apply(
    cluster: &mut Cluster,
    index: usize,
    action: Action,
    kv_disk_dir: Option<&Path>,
) -> Result<()> {
    match action {
        Action::CorruptKv => {
            let dir = kv_disk_dir.context("corrupt needs a disk tier (--kv-disk-dir)")?;
            let pid = cluster.process_id(index)?;
            let files = corrupt_tier_files(dir, pid)?;
            eprintln!("chaos: {files} block files of process {pid} damaged");
        }
        Action::Kill { back_after } => {
            cluster.kill_process(index)?;
            if let Some(d) = back_after {
                std::thread::sleep(d);
                start_again(cluster, index)?;
            }
        }
        Action::Stop { resume_after } => {
            cluster.signal_process(index, "STOP")?;
            std::thread::sleep(resume_after);
            cluster.signal_process(index, "CONT")?;
        }
        Action::Restart => {
            cluster.signal_process(index, "TERM")?;
            let drained = cluster.wait_process(index, TERM_GRACE)?;
            if !drained {
                cluster.kill_process(index)?;
            }
            start_again(cluster, index)?;
            if !drained {
                anyhow::bail!("still draining {TERM_GRACE:?} after SIGTERM; killed");
            }
        }
    }
    Ok(())
}

/// Flips a byte in the middle of every block file of process `pid`'s disk tier (its directory
/// `duet-kv-<pid>-<n>` inside `dir`); how many files.
fn corrupt_tier_files(dir: &Path, pid: u32) -> Result<usize> {
    let mut files = 0;
    let prefix = format!("duet-kv-{pid}-");
    for tier in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let tier = tier?.path();
        let ours = tier
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(&prefix));
        if !ours {
            continue;
        }
        for file in std::fs::read_dir(&tier)? {
            let file = file?.path();
            // A file the worker removes meanwhile is simply not damaged.
            let Ok(mut bytes) = std::fs::read(&file) else {
                continue;
            };
            let mid = bytes.len() / 2;
            if let Some(b) = bytes.get_mut(mid) {
                *b ^= 0x40;
                if std::fs::write(&file, &bytes).is_ok() {
                    files += 1;
                }
            }
        }
    }
    Ok(files)
}

/// Starts an exited worker again and waits until it answers `Stats`.
fn start_again(cluster: &mut Cluster, index: usize) -> Result<()> {
    cluster.respawn_process(index)?;
    let addr = cluster.workers()[index];
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let deadline = Instant::now() + START_LIMIT;
    runtime.block_on(async {
        loop {
            match stats(addr, &cluster.token).await {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() >= deadline => {
                    return Err(e.context(format!("{addr} did not start again in {START_LIMIT:?}")));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    })
}

pub async fn stats(worker: SocketAddr, token: &ClusterToken) -> Result<v1::StatsResponse> {
    // Launched clusters serve plaintext (the bench launches no TLS cluster).
    let auth = duet_proto::PeerAuth {
        token: Some(token.clone()),
        tls: None,
    };
    let channel = duet_proto::channel(&worker.to_string(), &auth)?;
    Ok(v1::worker_control_client::WorkerControlClient::new(channel)
        .stats(v1::StatsRequest {})
        .await
        .with_context(|| format!("Stats of {worker}"))?
        .into_inner())
}

/// What one worker holds once the load is over. Cached blocks (an evictable prefix cache) are
/// not held: `kv_blocks_used` counts only blocks of running sequences and reservations.
#[derive(Clone, Debug, Serialize)]
pub struct WorkerBlocks {
    pub worker: String,
    pub kv_blocks_used: u32,
    pub kv_blocks_cached: u32,
    pub reservations_outstanding: u32,
    pub running_sequences: u32,
    /// The worker did not answer (killed with `+never`, or broken).
    pub error: Option<String>,
}

impl WorkerBlocks {
    fn held(&self) -> bool {
        self.kv_blocks_used > 0 || self.reservations_outstanding > 0 || self.running_sequences > 0
    }
}

/// Every worker's blocks once they are all idle, or as they are after [`SETTLE_LIMIT`] (the
/// last requests' cleanups run after their streams end).
pub async fn held_blocks(cluster: &Cluster) -> Vec<WorkerBlocks> {
    let names: Vec<String> = (0..cluster.prefill.len())
        .map(|index| {
            Worker {
                role: Role::Prefill,
                index,
            }
            .to_string()
        })
        .chain((0..cluster.decode.len()).map(|index| {
            Worker {
                role: Role::Decode,
                index,
            }
            .to_string()
        }))
        .collect();
    let deadline = Instant::now() + SETTLE_LIMIT;
    loop {
        let mut all = Vec::new();
        for (name, &addr) in names.iter().zip(cluster.workers().iter()) {
            all.push(match stats(addr, &cluster.token).await {
                Ok(s) => WorkerBlocks {
                    worker: name.clone(),
                    kv_blocks_used: s.kv_blocks_used,
                    kv_blocks_cached: s.kv_blocks_cached,
                    reservations_outstanding: s.reservations_outstanding,
                    running_sequences: s.running_sequences,
                    error: None,
                },
                Err(e) => WorkerBlocks {
                    worker: name.clone(),
                    kv_blocks_used: 0,
                    kv_blocks_cached: 0,
                    reservations_outstanding: 0,
                    running_sequences: 0,
                    error: Some(format!("{e:#}")),
                },
            });
        }
        if !all.iter().any(WorkerBlocks::held) || Instant::now() >= deadline {
            return all;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// How a stream's tokens compare with its prompt's solo greedy run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum StreamCheck {
    Same,
    /// From `at` on, the stream repeats `tokens` tokens it had already sent.
    Repeated {
        at: usize,
        tokens: usize,
    },
    /// From `at` on, the stream skips `tokens` tokens.
    Gap {
        at: usize,
        tokens: usize,
    },
    /// From `at` on, something else.
    Differs {
        at: usize,
    },
}

/// Compares a stream with the reference: the first difference, and whether the rest is the
/// reference shifted back (a repeat) or forward (a gap).
pub fn check_stream(reference: &[u32], got: &[u32]) -> StreamCheck {
    let at = reference
        .iter()
        .zip(got)
        .take_while(|(a, b)| a == b)
        .count();
    if at == reference.len() && at == got.len() {
        return StreamCheck::Same;
    }
    let rest = &got[at..];
    if rest.is_empty() {
        return StreamCheck::Gap {
            at,
            tokens: reference.len() - at,
        };
    }
    let follows = |from: &[u32]| !from.is_empty() && rest.iter().zip(from).all(|(a, b)| a == b);
    if let Some(tokens) = (1..=at).find(|&j| follows(&reference[at - j..])) {
        return StreamCheck::Repeated { at, tokens };
    }
    if let Some(tokens) = (1..reference.len() - at).find(|&j| follows(&reference[at + j..])) {
        return StreamCheck::Gap { at, tokens };
    }
    StreamCheck::Differs { at }
}

/// A stream that differs from its solo run.
#[derive(Clone, Debug, Serialize)]
pub struct DifferingStream {
    /// The request's index in the workload, and its turn in a conversation.
    pub request: usize,
    pub turn: usize,
    pub check: StreamCheck,
}

#[derive(Clone, Debug, Serialize)]
pub struct ChaosReport {
    pub faults_planned: Vec<String>,
    pub faults: Vec<Injected>,
    pub completed: usize,
    /// Failed requests by gRPC status code.
    pub failed: BTreeMap<String, usize>,
    pub differing: Vec<DifferingStream>,
    pub workers: Vec<WorkerBlocks>,
}

impl ChaosReport {
    /// What went wrong, if anything did: the reason the bench exits non-zero.
    pub fn problems(&self) -> Option<String> {
        let failed: usize = self.failed.values().sum();
        let held: Vec<&WorkerBlocks> = self.workers.iter().filter(|w| w.held()).collect();
        let broken = self.faults.iter().filter(|f| f.error.is_some()).count();
        // A run that ended before its faults proved nothing.
        let missed = self.faults_planned.len() - self.faults.len();
        if failed == 0 && self.differing.is_empty() && held.is_empty() && broken + missed == 0 {
            return None;
        }
        Some(format!(
            "{failed} requests failed, {} streams differ from their solo run, {} workers hold KV blocks, {broken} faults could not be injected or recovered, {missed} faults came after the load ended (give it more requests)",
            self.differing.len(),
            held.len()
        ))
    }

    pub fn print(&self, design: &str) {
        println!(
            "{design} chaos: {} of {} faults injected",
            self.faults.len(),
            self.faults_planned.len()
        );
        for f in &self.faults {
            println!(
                "  {:<28} at {:>6.1}s, recovered at {:>6.1}s{}",
                f.fault,
                f.at_s,
                f.recovered_s,
                f.error
                    .as_ref()
                    .map_or(String::new(), |e| format!(" ERROR: {e}"))
            );
        }
        let failed: usize = self.failed.values().sum();
        let by_status = self
            .failed
            .iter()
            .map(|(code, n)| format!("{code} {n}"))
            .collect::<Vec<_>>()
            .join(", ");
        println!(
            "  completed {}, failed {failed}{}, differing streams {}",
            self.completed,
            if by_status.is_empty() {
                String::new()
            } else {
                format!(" ({by_status})")
            },
            self.differing.len()
        );
        for d in &self.differing {
            println!("    request {} turn {}: {:?}", d.request, d.turn, d.check);
        }
        println!(
            "  {:<10} {:>11} {:>12} {:>8} {:>7}",
            "worker", "blocks held", "reservations", "running", "cached"
        );
        for w in &self.workers {
            match &w.error {
                None => println!(
                    "  {:<10} {:>11} {:>12} {:>8} {:>7}",
                    w.worker,
                    w.kv_blocks_used,
                    w.reservations_outstanding,
                    w.running_sequences,
                    w.kv_blocks_cached
                ),
                Some(e) => println!("  {:<10} not answering: {e}", w.worker),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BACK: Duration = Duration::from_secs(2);

    fn decode(index: usize) -> Worker {
        Worker {
            role: Role::Decode,
            index,
        }
    }

    #[test]
    fn parses_a_schedule() {
        let spec = ChaosSpec::parse(
            "kill:decode0@5s, stop:prefill1@8s+3s,restart:decode0@12s,kill:decode1@500ms+never,kill:decode1@1.5s+1s",
            BACK,
        )
        .unwrap();
        let s = Duration::from_secs_f64;
        assert_eq!(
            spec,
            ChaosSpec::Faults(vec![
                Fault {
                    at: s(5.0),
                    worker: decode(0),
                    action: Action::Kill {
                        back_after: Some(BACK)
                    }
                },
                Fault {
                    at: s(8.0),
                    worker: Worker {
                        role: Role::Prefill,
                        index: 1
                    },
                    action: Action::Stop {
                        resume_after: s(3.0)
                    }
                },
                Fault {
                    at: s(12.0),
                    worker: decode(0),
                    action: Action::Restart
                },
                Fault {
                    at: s(0.5),
                    worker: decode(1),
                    action: Action::Kill { back_after: None }
                },
                Fault {
                    at: s(1.5),
                    worker: decode(1),
                    action: Action::Kill {
                        back_after: Some(s(1.0))
                    }
                },
            ])
        );
        assert_eq!(
            ChaosSpec::parse("random:4", BACK).unwrap(),
            ChaosSpec::Random(4)
        );
    }

    #[test]
    fn refuses_bad_specs_saying_why() {
        for (spec, why) in [
            ("explode:decode0@5s", "unknown action `explode`"),
            ("kill:decode0", "no @TIME"),
            ("kill:decoder@5s", "prefillN or decodeN"),
            ("kill:gpu0@5s", "prefillN or decodeN"),
            ("kill:decode0@5", "needs a unit"),
            ("kill:decode0@-1s", "not a duration"),
            ("stop:decode0@5s", "stop needs +DURATION"),
            ("restart:decode0@5s+2s", "restart takes no +DURATION"),
            ("corrupt:decode0@5s+1s", "corrupt takes no +DURATION"),
            ("kill decode0", "ACTION:WORKER@TIME"),
            ("random:0", "positive count"),
            ("random:x", "positive count"),
            ("", "ACTION:WORKER@TIME"),
        ] {
            let e = ChaosSpec::parse(spec, BACK).unwrap_err();
            assert!(e.contains(why), "{spec:?} gave {e:?}, expected {why:?}");
        }
    }

    #[test]
    fn a_fault_prints_as_it_parses() {
        let text = "kill:decode0@5s+2s,stop:prefill1@8s+3s,restart:decode1@12s,kill:decode0@1s+never,stop:decode1@3478ms+2127ms,corrupt:decode1@14s";
        let ChaosSpec::Faults(faults) = ChaosSpec::parse(text, BACK).unwrap() else {
            panic!("faults expected")
        };
        let printed: Vec<String> = faults.iter().map(Fault::to_string).collect();
        assert_eq!(printed.join(","), text);
        // Drawn faults print as a schedule that parses back to them.
        let drawn = random_faults(8, 7, Duration::from_secs(100), 2, 2, BACK);
        let printed: Vec<String> = drawn.iter().map(Fault::to_string).collect();
        assert_eq!(
            ChaosSpec::parse(&printed.join(","), BACK).unwrap(),
            ChaosSpec::Faults(drawn),
            "{printed:?}"
        );
    }

    #[test]
    fn a_worker_the_cluster_lacks_is_refused() {
        let args = ChaosArgs {
            chaos: None,
            chaos_seed: 1,
            chaos_restart_after_ms: 2000,
        };
        let spec = ChaosSpec::parse("kill:prefill2@1s", BACK).unwrap();
        let e = plan(&spec, &args, Duration::from_secs(10), 2, 2).unwrap_err();
        assert!(e.to_string().contains("has 2 prefill and 2 decode"), "{e}");
        assert!(plan(&spec, &args, Duration::from_secs(10), 3, 2).is_ok());
    }

    #[test]
    fn random_faults_follow_the_seed_and_stay_in_the_window() {
        let window = Duration::from_secs(100);
        let a = random_faults(8, 7, window, 2, 2, BACK);
        assert_eq!(a, random_faults(8, 7, window, 2, 2, BACK));
        assert_ne!(a, random_faults(8, 8, window, 2, 2, BACK));
        assert_eq!(a.len(), 8);
        assert!(a.windows(2).all(|w| w[0].at <= w[1].at));
        for f in &a {
            assert!(f.at >= Duration::from_secs(10) && f.at <= Duration::from_secs(70));
            assert_eq!(f.at.subsec_nanos() % 1_000_000, 0, "{f}");
            process_index(f.worker, 2, 2).unwrap();
        }
        // Only decode workers exist in a cluster with no prefill pool.
        assert!(
            random_faults(8, 7, window, 0, 2, BACK)
                .iter()
                .all(|f| f.worker.role == Role::Decode)
        );
    }

    #[test]
    fn the_stream_check_catches_repeats_and_gaps() {
        let reference = [10, 11, 12, 13, 14, 15, 16, 17];
        assert_eq!(check_stream(&reference, &reference), StreamCheck::Same);
        // A failover that re-sent the last two tokens.
        assert_eq!(
            check_stream(&reference, &[10, 11, 12, 13, 12, 13, 14, 15]),
            StreamCheck::Repeated { at: 4, tokens: 2 }
        );
        // One that lost a token.
        assert_eq!(
            check_stream(&reference, &[10, 11, 12, 14, 15, 16, 17, 90]),
            StreamCheck::Gap { at: 3, tokens: 1 }
        );
        // One that ended early.
        assert_eq!(
            check_stream(&reference, &[10, 11, 12]),
            StreamCheck::Gap { at: 3, tokens: 5 }
        );
        assert_eq!(
            check_stream(&reference, &[10, 11, 99, 98, 97, 96, 95, 94]),
            StreamCheck::Differs { at: 2 }
        );
        assert_eq!(
            check_stream(&reference, &[10, 11, 12, 13, 14, 15, 16, 17, 18]),
            StreamCheck::Differs { at: 8 }
        );
    }

    #[test]
    fn corrupting_a_worker_damages_only_its_own_tier_files() {
        let dir = tempfile::tempdir().unwrap();
        let (ours, theirs) = (
            dir.path().join("duet-kv-7-0"),
            dir.path().join("duet-kv-77-0"),
        );
        for d in [&ours, &theirs] {
            std::fs::create_dir(d).unwrap();
            for name in ["a.kvb", "b.kvb"] {
                std::fs::write(d.join(name), [0u8; 8]).unwrap();
            }
        }
        assert_eq!(corrupt_tier_files(dir.path(), 7).unwrap(), 2);
        assert_eq!(std::fs::read(ours.join("a.kvb")).unwrap()[4], 0x40);
        assert_eq!(std::fs::read(theirs.join("a.kvb")).unwrap(), [0u8; 8]);
    }
}
