//! What `WorkerControl/Stats` reports, read without the engine thread: a snapshot the actor
//! publishes after every turn, and counters either side adds to.

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use duet_engine::engine::Speculation;
use duet_kv::{PoolStats, TierStats};
use duet_proto::v1;
use duet_telemetry::metrics;
use duet_transfer::choice::transport_name;
use prometheus::core::Collector;
use prometheus::{Histogram, HistogramOpts, HistogramVec, IntCounterVec, Opts};

use crate::EngineHandle;

/// The engine thread's state after its last turn.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// Measured prefill speed (0 until a step computed prompt tokens).
    pub prefill_tokens_per_s: f64,
    pub pool: PoolStats,
    /// Admitted requests not in any step yet.
    pub waiting: usize,
    /// Requests with at least one step computed.
    pub running: usize,
    /// KV reservations waiting for their transfer.
    pub reservations: usize,
    /// Sequences preempted (their KV given up, recomputed later) since the engine started.
    pub preemptions: u64,
    /// Drafts cut before a token outside the model's vocabulary since the engine started.
    pub out_of_vocab_drafts: u64,
    /// Speculative decoding since the engine started: sequence-steps, drafted and accepted
    /// tokens.
    pub speculation: Speculation,
    /// The tiers below the KV pool, fastest first (none unless configured).
    pub kv_tiers: Vec<TierStats>,
}

/// Counters and gauges shared by the services and the engine thread. The histograms and
/// per-transport families carry no labels here: [`crate::metrics::WorkerMetrics`] adds the
/// worker's when it exports them.
#[derive(Debug)]
pub struct Counters {
    /// Prompt tokens admitted but not computed yet (the handle adds, the engine thread
    /// subtracts).
    pub queued_tokens: AtomicU64,
    pub requests_served: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub prefix_hit_tokens: AtomicU64,
    /// Requests whose grammar failed part way (ended with finish_reason error).
    pub grammar_failures: AtomicU64,
    /// Tokens computed by each engine step.
    pub step_tokens: Histogram,
    /// Wall time of each engine step.
    pub step_seconds: Histogram,
    /// KV bytes moved, by `transport` and `direction` (`in`: received, `out`: sent).
    pub kv_transfer_bytes: IntCounterVec,
    /// Each request's KV transfer time, by `transport` and `direction`.
    pub kv_transfer_seconds: HistogramVec,
    /// KV transfers that failed, by `transport`, `direction` and `reason` (the status code's
    /// name).
    pub kv_transfer_failures: IntCounterVec,
    /// Prompts a decode worker prefilled itself although its plan named prefill workers, by
    /// `reason` ([`LocalFallback`]).
    pub local_prefill_fallbacks: IntCounterVec,
    /// The fallback reasons logged so far (each is logged once, then only counted).
    fallbacks_logged: Mutex<HashSet<LocalFallback>>,
    /// Prefix pulls from peers, by `outcome` ([`PullOutcome`]) and `transport` (`grpc`,
    /// `cuda-ipc`: each attempt counts once, a CUDA-IPC pull asked again over gRPC twice).
    pub kv_peer_pulls: IntCounterVec,
}

/// The transports a pull takes.
const PULL_TRANSPORTS: [v1::TransportKind; 2] =
    [v1::TransportKind::Grpc, v1::TransportKind::CudaIpc];

/// How a decode worker's pull of a prefix from a peer ended; every outcome but `pulled` falls
/// back to computing the prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PullOutcome {
    /// The prefix arrived, checked, and is cached here.
    Pulled,
    /// The peer no longer held the whole prefix.
    Missing,
    /// The pull took longer than computing the prefix would have.
    Slow,
    /// The call or a check failed (the peer died mid-stream, a checksum, the reservation).
    Failed,
    /// The router named a peer that is not a decode worker of this cluster.
    Refused,
}

impl PullOutcome {
    pub const ALL: [PullOutcome; 5] = [
        PullOutcome::Pulled,
        PullOutcome::Missing,
        PullOutcome::Slow,
        PullOutcome::Failed,
        PullOutcome::Refused,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PullOutcome::Pulled => "pulled",
            PullOutcome::Missing => "missing",
            PullOutcome::Slow => "slow",
            PullOutcome::Failed => "failed",
            PullOutcome::Refused => "refused",
        }
    }
}

/// Why a decode worker prefilled a prompt itself instead of on the prefill workers its plan
/// named.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LocalFallback {
    /// A prefill worker refused to push to this worker (PERMISSION_DENIED, UNAUTHENTICATED: a
    /// prefill worker that does not know this decode worker, or another cluster token).
    RefusedPush,
    /// No prefill worker of the plan could be reached, or none answered in time.
    Unreachable,
    /// The prefill workers were saturated (RESOURCE_EXHAUSTED).
    Saturated,
    /// Another failure of the prefill call.
    Failed,
    /// This worker had no room to reserve the prompt's KV for a transfer.
    NoReservation,
    /// The plan named only prefill workers this worker does not accept (neither its --prefill
    /// nor a prefill card of its cluster): asking them would send the prompt, and the cluster
    /// token, to an address of the caller's choosing.
    RefusedPlan,
}

impl LocalFallback {
    pub const ALL: [LocalFallback; 6] = [
        LocalFallback::RefusedPush,
        LocalFallback::Unreachable,
        LocalFallback::Saturated,
        LocalFallback::Failed,
        LocalFallback::NoReservation,
        LocalFallback::RefusedPlan,
    ];

    /// Why a failed prefill call failed.
    pub fn of(code: tonic::Code) -> Self {
        use tonic::Code::*;
        match code {
            PermissionDenied | Unauthenticated => LocalFallback::RefusedPush,
            Unavailable | DeadlineExceeded | Cancelled => LocalFallback::Unreachable,
            ResourceExhausted => LocalFallback::Saturated,
            _ => LocalFallback::Failed,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            LocalFallback::RefusedPush => "refused_push",
            LocalFallback::Unreachable => "unreachable",
            LocalFallback::Saturated => "saturated",
            LocalFallback::Failed => "failed",
            LocalFallback::NoReservation => "no_reservation",
            LocalFallback::RefusedPlan => "refused_plan",
        }
    }

    /// What an operator should look at.
    fn advice(self) -> &'static str {
        match self {
            LocalFallback::RefusedPush => {
                "a prefill worker refused to push KV here: give it this worker's --advertise \
                 address with --decode, or run both in one cluster (--etcd), with one cluster token"
            }
            LocalFallback::Unreachable => {
                "no prefill worker of the plan answered in time: check that they run and are \
                 reachable from this worker, and --prefill-timeout-ms"
            }
            LocalFallback::Saturated => "the prefill workers are saturated: add prefill workers",
            LocalFallback::Failed => "the prefill call failed (its error is logged above)",
            LocalFallback::NoReservation => {
                "this worker's KV cache had no room to reserve the prompt for a transfer"
            }
            LocalFallback::RefusedPlan => {
                "the router planned prefill workers this worker does not accept: name them with \
                 --prefill ADDR (DUET_PREFILL_WORKERS), or run every service in one cluster \
                 (--etcd)"
            }
        }
    }
}

impl Default for Counters {
    fn default() -> Self {
        let histogram = |name: &str, help: &str, buckets: &[f64]| {
            Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
                .expect("valid histogram")
        };
        let transfer = ["transport", "direction"];
        Self {
            queued_tokens: AtomicU64::default(),
            requests_served: AtomicU64::default(),
            prompt_tokens: AtomicU64::default(),
            prefix_hit_tokens: AtomicU64::default(),
            grammar_failures: AtomicU64::default(),
            step_tokens: histogram(
                "duet_iteration_tokens_total",
                "Tokens computed by one engine step (prompt and decode tokens).",
                metrics::STEP_TOKENS_BUCKETS,
            ),
            step_seconds: histogram(
                "duet_step_duration_seconds",
                "Wall time of one engine step (a batched forward pass), in seconds.",
                metrics::TOKEN_LATENCY_BUCKETS,
            ),
            kv_transfer_bytes: IntCounterVec::new(
                Opts::new(
                    "duet_kv_transfer_bytes_total",
                    "KV cache bytes transferred between workers, by transport and direction (in, out).",
                ),
                &transfer,
            )
            .expect("valid counter"),
            kv_transfer_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "duet_kv_transfer_seconds",
                    "Time of one request's KV transfer (first chunk to acknowledgement), by transport and direction.",
                )
                .buckets(metrics::KV_TRANSFER_BUCKETS.to_vec()),
                &transfer,
            )
            .expect("valid histogram"),
            kv_transfer_failures: IntCounterVec::new(
                Opts::new(
                    "duet_kv_transfer_failures_total",
                    "KV transfers that failed, by transport, direction and reason.",
                ),
                &["transport", "direction", "reason"],
            )
            .expect("valid counter"),
            local_prefill_fallbacks: {
                let family = IntCounterVec::new(
                    Opts::new(
                        "duet_local_prefill_fallbacks_total",
                        "Prompts a decode worker prefilled itself although its plan named prefill \
                         workers, by reason (refused_push, unreachable, saturated, failed, \
                         no_reservation, refused_plan).",
                    ),
                    &["reason"],
                )
                .expect("valid counter");
                // Every reason from the start, at 0, so a rate over it is defined.
                for r in LocalFallback::ALL {
                    family.with_label_values(&[r.as_str()]);
                }
                family
            },
            fallbacks_logged: Mutex::default(),
            kv_peer_pulls: {
                let family = IntCounterVec::new(
                    Opts::new(
                        "duet_kv_peer_pulls_total",
                        "Prefixes a decode worker pulled from a peer instead of computing them, by \
                         outcome (pulled; missing, slow, failed, refused: computed instead) and \
                         transport (grpc, cuda-ipc; a failed cuda-ipc pull is asked again over grpc).",
                    ),
                    &["outcome", "transport"],
                )
                .expect("valid counter");
                for o in PullOutcome::ALL {
                    for t in PULL_TRANSPORTS {
                        family.with_label_values(&[o.as_str(), transport_name(t)]);
                    }
                }
                family
            },
        }
    }
}

/// Which way KV moved, as this worker sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    In,
    Out,
}

impl Direction {
    fn as_str(self) -> &'static str {
        match self {
            Direction::In => "in",
            Direction::Out => "out",
        }
    }
}

impl Counters {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Prefix pulls over `transport` that ended with `outcome`.
    pub fn pulls(&self, outcome: PullOutcome, transport: v1::TransportKind) -> u64 {
        self.kv_peer_pulls
            .with_label_values(&[outcome.as_str(), transport_name(transport)])
            .get()
    }

    /// Counts a prefix pull over `transport` that ended with `outcome`.
    pub fn pulled(&self, outcome: PullOutcome, transport: v1::TransportKind) {
        self.kv_peer_pulls
            .with_label_values(&[outcome.as_str(), transport_name(transport)])
            .inc();
    }

    /// One request's KV moved: `bytes` over `transport` in `seconds`.
    pub fn transferred(&self, transport: &str, direction: Direction, bytes: u64, seconds: f64) {
        let labels = [transport, direction.as_str()];
        self.kv_transfer_bytes
            .with_label_values(&labels)
            .inc_by(bytes);
        self.kv_transfer_seconds
            .with_label_values(&labels)
            .observe(seconds);
    }

    /// A prompt prefilled here instead of on the plan's prefill workers: counted, and logged
    /// the first time for each reason.
    pub fn fell_back_to_local_prefill(&self, reason: LocalFallback, detail: &str) {
        self.local_prefill_fallbacks
            .with_label_values(&[reason.as_str()])
            .inc();
        let first = self
            .fallbacks_logged
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(reason);
        if first {
            tracing::warn!(
                reason = reason.as_str(),
                detail,
                "prefilling here instead of on a prefill worker: {} (logged once per reason; \
                 counted in duet_local_prefill_fallbacks_total)",
                reason.advice()
            );
        }
    }

    /// Prompts prefilled here for `reason` since start.
    pub fn local_prefill_fallbacks(&self, reason: LocalFallback) -> u64 {
        self.local_prefill_fallbacks
            .with_label_values(&[reason.as_str()])
            .get()
    }

    /// One request's KV transfer failed.
    pub fn transfer_failed(&self, transport: &str, direction: Direction, reason: &str) {
        self.kv_transfer_failures
            .with_label_values(&[transport, direction.as_str(), reason])
            .inc();
    }

    /// KV bytes moved in `direction` over every transport.
    pub fn transfer_bytes(&self, direction: Direction) -> u64 {
        let family = self.kv_transfer_bytes.collect();
        family
            .iter()
            .flat_map(|f| f.get_metric())
            .filter(|m| {
                m.get_label()
                    .iter()
                    .any(|l| l.name() == "direction" && l.value() == direction.as_str())
            })
            .map(|m| m.get_counter().get_value() as u64)
            .sum()
    }

    pub(crate) fn unqueue(&self, tokens: usize) {
        self.queued_tokens
            .fetch_sub(tokens as u64, Ordering::Relaxed);
    }
}

/// Steps computing fewer prompt tokens than this are not measured: their time is mostly the
/// decode tokens and the fixed cost of a step.
const MIN_MEASURED_PROMPT_TOKENS: usize = 16;

/// How many of the latest prompt-heavy steps the prefill rate is the median of.
const PREFILL_RATE_SAMPLES: usize = 5;

/// The measured prefill speed: the median prompt tokens per second of the latest
/// [`PREFILL_RATE_SAMPLES`] steps that computed prompt tokens. A median, not a moving average:
/// one step that stalled (the process stopped, the machine swapping) is outvoted by the next
/// two, where an average would keep the worker looking slow, and so unused, for many prompts.
#[derive(Clone, Copy, Debug, Default)]
pub struct PrefillRate {
    samples: [f64; PREFILL_RATE_SAMPLES],
    /// Steps measured so far (the ring holds the latest of them).
    measured: usize,
}

impl PrefillRate {
    /// Takes in one step that computed `prompt_tokens` in `took`.
    pub fn measured(&mut self, prompt_tokens: usize, took: std::time::Duration) {
        if prompt_tokens < MIN_MEASURED_PROMPT_TOKENS || took.is_zero() {
            return;
        }
        self.samples[self.measured % PREFILL_RATE_SAMPLES] =
            prompt_tokens as f64 / took.as_secs_f64();
        self.measured += 1;
    }

    /// Tokens per second; 0 until measured.
    pub fn tokens_per_s(&self) -> f64 {
        let mut latest = self.samples;
        let latest = &mut latest[..self.measured.min(PREFILL_RATE_SAMPLES)];
        latest.sort_by(f64::total_cmp);
        match latest.len() {
            0 => 0.0,
            n if n % 2 == 1 => latest[n / 2],
            n => (latest[n / 2 - 1] + latest[n / 2]) / 2.0,
        }
    }
}

/// Where the snapshot lives between turns.
#[derive(Debug)]
pub(crate) struct Published(Mutex<Snapshot>);

impl Published {
    pub(crate) fn new(snapshot: Snapshot) -> Self {
        Self(Mutex::new(snapshot))
    }

    pub(crate) fn set(&self, snapshot: Snapshot) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = snapshot;
    }

    pub(crate) fn get(&self) -> Snapshot {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Who a worker is: its id, and an incarnation that changes with every start.
#[derive(Clone, Debug)]
pub struct Identity {
    pub worker_id: String,
    pub incarnation: u64,
}

impl Identity {
    pub fn new(worker_id: String) -> Self {
        let incarnation = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        Self {
            worker_id,
            incarnation,
        }
    }

    /// The `Stats` answer for a worker of `role` running `engine`.
    pub fn stats(&self, role: v1::WorkerRole, engine: &EngineHandle) -> v1::StatsResponse {
        let snap = engine.snapshot();
        let c = engine.counters();
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        v1::StatsResponse {
            role: role as i32,
            worker_id: self.worker_id.clone(),
            incarnation: self.incarnation,
            kv_blocks_total: snap.pool.num_blocks as u32,
            kv_blocks_used: snap.pool.in_use as u32,
            kv_blocks_cached: snap.pool.cached as u32,
            kv_blocks_free: snap.pool.free as u32,
            block_size: engine.info().wire.layout.block_size as u32,
            running_sequences: snap.running as u32,
            waiting_requests: snap.waiting as u32,
            queued_prefill_tokens: load(&c.queued_tokens),
            reservations_outstanding: snap.reservations as u32,
            model_fingerprint: engine.info().wire.fingerprint.clone(),
            requests_served: load(&c.requests_served),
            prompt_tokens: load(&c.prompt_tokens),
            prefix_hit_tokens: load(&c.prefix_hit_tokens),
            transfer_bytes_in: c.transfer_bytes(Direction::In),
            transfer_bytes_out: c.transfer_bytes(Direction::Out),
            prefill_tokens_per_s: snap.prefill_tokens_per_s,
            kv_block_bytes: engine.info().wire.layout.block_bytes() as u64,
            // What a decode worker accepts in a plan is its service's to say.
            accepted_prefill_workers: None,
            refused_prefill_plans: c.local_prefill_fallbacks(LocalFallback::RefusedPlan),
            kv_tiers: snap
                .kv_tiers
                .iter()
                .filter_map(tier_stats_to_wire)
                .collect(),
            // Whether it pulls is a decode worker's flag; its service sets it.
            kv_peer_pull: false,
            kv_peer_pulls: PullOutcome::ALL
                .iter()
                .map(|&o| {
                    let all = PULL_TRANSPORTS.iter().map(|&t| c.pulls(o, t)).sum();
                    (o.as_str().into(), all)
                })
                .collect(),
            kv_peer_pulls_cuda_ipc: PullOutcome::ALL
                .iter()
                .map(|&o| (o.as_str().into(), c.pulls(o, v1::TransportKind::CudaIpc)))
                .collect(),
            // Only a decode worker's role can switch; its service says whether it does.
            role_switch: false,
        }
    }
}

/// A tier's counts as `Stats` reports them.
fn tier_stats_to_wire(t: &TierStats) -> Option<v1::KvTierStats> {
    Some(v1::KvTierStats {
        tier: v1::KvTier::from(t.tier?) as i32,
        capacity_blocks: t.capacity_blocks as u64,
        blocks: t.blocks as u64,
        hits: t.hits,
        bytes_loaded: t.bytes_loaded,
        load_seconds: t.load_seconds,
        load_cpu_seconds: t.load_cpu_seconds,
        stored: t.stored,
        bytes_stored: t.bytes_stored,
        cost_model_misses: t.cost_model_misses,
        corrupt: t.corrupt,
        load_bytes_per_s: t.load_bytes_per_s,
        page_locked: t.page_locked,
        lent_blocks: t.lent,
        copy_waits: t.copy_waits,
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn prefill_rate_is_the_median_of_the_latest_prompt_heavy_steps() {
        let mut r = PrefillRate::default();
        assert_eq!(r.tokens_per_s(), 0.0, "unmeasured");
        r.measured(4, Duration::from_millis(1));
        assert_eq!(
            r.tokens_per_s(),
            0.0,
            "a decode step is not a prefill measurement"
        );
        // A first prefill stalled for 8 s.
        r.measured(1000, Duration::from_secs(8));
        assert_eq!(r.tokens_per_s(), 125.0);
        r.measured(1000, Duration::from_secs(1));
        assert_eq!(r.tokens_per_s(), 562.5, "two samples: their mean");
        r.measured(2000, Duration::from_secs(2));
        assert_eq!(r.tokens_per_s(), 1000.0, "the stall is outvoted");
        for _ in 0..3 {
            r.measured(1000, Duration::from_secs(1));
        }
        // The worker really slows down: the rate follows once most of the window says so.
        for _ in 0..2 {
            r.measured(500, Duration::from_secs(1));
            assert_eq!(r.tokens_per_s(), 1000.0);
        }
        r.measured(500, Duration::from_secs(1));
        assert_eq!(r.tokens_per_s(), 500.0);
    }
}
