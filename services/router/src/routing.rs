//! Worker pools and routing decisions.
//!
//! The router knows its workers from flags (static) and from the cluster's worker cards
//! ([`Pools::sync`] diffs each new membership against the pools). Each one is polled every
//! stats interval (`grpc.health.v1` check of the service "" and `WorkerControl/Stats`), on a
//! connection of its own so that polls never queue behind (or reset) request streams. A worker is
//! routable once it answered stats, its health check says SERVING, its model fingerprint equals
//! the cluster's (the most common fingerprint among the answering workers), and — for a worker
//! known from a card — its card is present and `ready`. Health comes from the connection, not
//! from a slow stats reply: a stats call that fails keeps the last stats, and a worker leaves
//! rotation only after [`HealthPolicy::unhealthy_after`] consecutive failed health checks, a
//! refused connection, or a NOT_SERVING answer. A decode worker whose call fails is taken out of
//! rotation until its next good poll.
//!
//! Each worker is also followed on `KvEvents` ([`crate::kv_feed`]) into the exact prefix index
//! ([`KvIndex`]). A route ([`Pools::route`]) hashes the prompt with duet-kv's chained function
//! (seed: the cluster's fingerprint and the request's cache salt) and, under the cache-aware
//! policy:
//! - picks the decode worker with the most KV headroom, less its running batch and the time to
//!   move the prompt's KV it does not hold ([`decode_score`]);
//! - ranks prefill workers by estimated time to first token: (queued prefill tokens + tokens
//!   the router planned there since their last stats + this prompt's tokens not cached there) ÷
//!   the worker's measured prefill rate ([`estimated_ttft_s`]);
//! - prefills on the decode worker itself when the prompt's uncached part there is short, or
//!   when the prefill pool is saturated (its best estimate is worse than
//!   `--prefill-saturation-factor` times the decode worker's own);
//! - refuses at once (RESOURCE_EXHAUSTED) when the best estimate passes the request's deadline.
//!
//! Every decision is counted by reason with the cached tokens it predicted ([`Decisions`]).
//! Decisions are pure functions over snapshots ([`pick_decode`], [`rank_prefill`],
//! [`consensus_fingerprint`]) so they are unit-tested without a network.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use duet_cluster::{CardState, Membership, Role, WorkerCard};
use duet_proto::v1;
use duet_proto::v1::worker_control_client::WorkerControlClient;
use duet_proto::{PeerAuth, PeerChannel};
use tokio::sync::Notify;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::kv_index::{KvIndex, WorkerSlot};

/// Blocks of KV headroom one running sequence (or one request the router sent since the last
/// stats) is worth when comparing decode workers.
pub const RUNNING_PENALTY_BLOCKS: i64 = 4;

/// Prefill rate (prompt tokens per second) assumed while no worker has reported a measured one:
/// the order of a small model on a few CPU cores.
pub const DEFAULT_PREFILL_RATE: f64 = 1000.0;

/// Tokens the router planned on a worker stay counted this long after a poll started: the
/// time for the decode worker to ask the prefill worker, so that the stats then include them.
pub const PLAN_REPORT_GRACE: Duration = Duration::from_millis(250);

/// Blocks of headroom one millisecond of KV movement is worth when comparing decode workers.
pub const MOVE_PENALTY_BLOCKS_PER_MS: f64 = 1.0;

/// Where workers get their numbers ([`WorkerSlot`]) from.
static NEXT_SLOT: AtomicU64 = AtomicU64::new(1);

/// Where plans get their numbers from.
static NEXT_PLAN: AtomicU64 = AtomicU64::new(1);

/// How requests are spread over the workers (`--routing`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum RoutingPolicy {
    /// Any routable worker, uniformly at random (a baseline).
    Random,
    /// Least loaded: KV headroom and running batch for decode, estimated prefill time of the
    /// whole prompt for prefill; caches ignored.
    Load,
    /// Least estimated time to first token, counting the tokens each worker holds in its
    /// prefix cache (the exact index), and the cost of moving KV.
    #[default]
    CacheAware,
}

impl RoutingPolicy {
    pub fn name(self) -> &'static str {
        match self {
            RoutingPolicy::Random => "random",
            RoutingPolicy::Load => "load",
            RoutingPolicy::CacheAware => "cache-aware",
        }
    }
}

impl std::fmt::Display for RoutingPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// When a worker's failed health checks take it out of rotation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HealthPolicy {
    /// Consecutive failed (timed-out or erroring) health checks that take a worker out of
    /// rotation; a refused connection or a NOT_SERVING answer takes it out at once.
    pub unhealthy_after: u32,
}

/// How one health check ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HealthCheck {
    /// SERVING.
    Serving,
    /// An answer other than SERVING (draining, unknown service), or a refused connection.
    Refused(String),
    /// No answer in time, or a failed call.
    Failed(String),
}

/// The last poll of a worker.
#[derive(Clone, Debug, Default)]
pub struct WorkerStatus {
    /// In rotation as far as health goes (see [`HealthPolicy`]; cleared when a call fails).
    pub healthy: bool,
    /// The last stats received (kept when a later stats call fails).
    pub stats: Option<v1::StatsResponse>,
    /// Health checks failed in a row.
    pub failed_checks: u32,
    /// What went wrong last (a failed check, or stats that did not answer), when anything did.
    pub last_error: Option<String>,
}

impl WorkerStatus {
    /// Takes in one poll: its health check, and its stats call's answer.
    pub fn record(
        &mut self,
        policy: HealthPolicy,
        check: HealthCheck,
        stats: Result<v1::StatsResponse, String>,
    ) {
        let mut errors = Vec::new();
        match check {
            HealthCheck::Serving => {
                self.failed_checks = 0;
                self.healthy = true;
            }
            HealthCheck::Refused(why) => {
                self.failed_checks = self.failed_checks.saturating_add(1);
                self.healthy = false;
                errors.push(why);
            }
            HealthCheck::Failed(why) => {
                self.failed_checks = self.failed_checks.saturating_add(1);
                if self.failed_checks >= policy.unhealthy_after.max(1) {
                    self.healthy = false;
                }
                errors.push(why);
            }
        }
        match stats {
            Ok(st) => self.stats = Some(st),
            Err(why) => errors.push(why),
        }
        self.last_error = (!errors.is_empty()).then(|| errors.join("; "));
    }

    /// Out of rotation because its health checks failed (not because one call did).
    pub fn unresponsive(&self) -> bool {
        !self.healthy && self.failed_checks > 0
    }
}

/// One worker the router routes to.
#[derive(Debug)]
pub struct Worker {
    pub address: String,
    pub role: Role,
    /// Request streams.
    channel: PeerChannel,
    /// Health checks and stats: a connection of their own.
    poll_channel: PeerChannel,
    status: Mutex<WorkerStatus>,
    /// Requests the router has on this worker right now.
    in_flight: AtomicU32,
    /// Prompt tokens the router planned for prefill here (plan number, when, tokens); each is
    /// dropped when its request's first token arrives, or once a poll that started after it
    /// (plus [`PLAN_REPORT_GRACE`]) reported the worker's queue, whichever comes first.
    planned: Mutex<VecDeque<(u64, Instant, u64)>>,
    /// The card it is known from, and the card's key (`None`: named by a flag).
    card: Mutex<Option<(String, WorkerCard)>>,
    /// The router's number for this worker in the KV index.
    slot: WorkerSlot,
}

/// Counts a request on a worker while alive.
pub struct InFlight(Arc<Worker>);

/// Counts prefill tokens the router planned on a worker while alive (until the request's first
/// token, or the worker's stats reporting them).
#[derive(Debug)]
pub struct Planned {
    worker: Arc<Worker>,
    id: u64,
}

impl Drop for Planned {
    fn drop(&mut self) {
        let mut planned = self
            .worker
            .planned
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        planned.retain(|&(id, _, _)| id != self.id);
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Worker {
    /// A worker at `address` (host:port, or a URI) whose calls are authenticated by `auth`;
    /// connects lazily.
    pub fn new(address: &str, role: Role, auth: &PeerAuth) -> anyhow::Result<Self> {
        // Each call makes a channel (and so a connection) of its own.
        let channel = duet_proto::channel(address, auth)?;
        let poll_channel = duet_proto::channel(address, auth)?;
        Ok(Self {
            address: address.to_string(),
            role,
            channel,
            poll_channel,
            status: Mutex::new(WorkerStatus::default()),
            in_flight: AtomicU32::new(0),
            planned: Mutex::new(VecDeque::new()),
            card: Mutex::new(None),
            slot: NEXT_SLOT.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// The router's number for this worker in the KV index.
    pub fn slot(&self) -> WorkerSlot {
        self.slot
    }

    /// Counts `tokens` of prefill the router just planned here, until the guard drops.
    pub fn plan(self: &Arc<Self>, tokens: u64) -> Planned {
        let id = NEXT_PLAN.fetch_add(1, Ordering::Relaxed);
        self.planned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back((id, Instant::now(), tokens));
        Planned {
            worker: self.clone(),
            id,
        }
    }

    /// Prefill tokens planned here that the worker's stats do not show yet.
    pub fn planned_tokens(&self) -> u64 {
        let planned = self.planned.lock().unwrap_or_else(|e| e.into_inner());
        planned.iter().map(|&(_, _, t)| t).sum()
    }

    /// The prefill rate measured in the last stats; `None` until the worker has prefilled a
    /// prompt long enough to measure.
    pub fn prefill_rate(&self) -> Option<f64> {
        self.status()
            .stats
            .map(|s| s.prefill_tokens_per_s)
            .filter(|&r| r > 0.0)
    }

    /// The worker a card describes.
    pub fn from_card(key: &str, card: &WorkerCard, auth: &PeerAuth) -> anyhow::Result<Self> {
        let w = Self::new(&card.grpc_address, card.role, auth)?;
        *w.card.lock().unwrap_or_else(|e| e.into_inner()) = Some((key.to_string(), card.clone()));
        Ok(w)
    }

    /// Its card and the card's key, when it is known from one.
    pub fn card(&self) -> Option<(String, WorkerCard)> {
        self.card.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The worker's id (from its card or stats; its address until it answered).
    pub fn id(&self) -> String {
        if let Some((_, card)) = self.card() {
            return card.worker_id;
        }
        match &self.status().stats {
            Some(s) if !s.worker_id.is_empty() => s.worker_id.clone(),
            _ => self.address.clone(),
        }
    }

    pub fn channel(&self) -> PeerChannel {
        self.channel.clone()
    }

    pub fn status(&self) -> WorkerStatus {
        self.status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn set_status(&self, f: impl FnOnce(&mut WorkerStatus)) {
        f(&mut self.status.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// Takes the worker out of rotation until its next good poll.
    pub fn mark_failed(&self, why: &str) {
        self.set_status(|s| {
            s.healthy = false;
            s.last_error = Some(why.to_string());
        });
    }

    /// Counts a request on this worker until the guard drops.
    pub fn begin(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(self.clone())
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Polls health and stats once on the poll connection, each bounded by `timeout`.
    pub async fn poll(&self, timeout: Duration, policy: HealthPolicy) {
        let started = Instant::now();
        let health = async {
            let mut req = tonic::Request::new(HealthCheckRequest {
                service: String::new(),
            });
            req.set_timeout(timeout);
            let answer = tokio::time::timeout(
                timeout,
                HealthClient::new(self.poll_channel.clone()).check(req),
            )
            .await;
            match answer {
                Err(_) => HealthCheck::Failed("health check timed out".into()),
                Ok(Err(s)) if duet_proto::is_connection_refused(&s) => {
                    HealthCheck::Refused(format!("connection refused: {}", s.message()))
                }
                Ok(Err(s)) => HealthCheck::Failed(format!("health check failed: {}", s.message())),
                Ok(Ok(r)) => match r.into_inner().status() {
                    ServingStatus::Serving => HealthCheck::Serving,
                    other => {
                        HealthCheck::Refused(format!("health check says {}", other.as_str_name()))
                    }
                },
            }
        };
        let stats = async {
            let mut req = tonic::Request::new(v1::StatsRequest {});
            req.set_timeout(timeout);
            tokio::time::timeout(
                timeout,
                WorkerControlClient::new(self.poll_channel.clone()).stats(req),
            )
            .await
            .map_err(|_| "stats timed out".to_string())?
            .map(|r| r.into_inner())
            .map_err(|s| format!("stats failed: {}", s.message()))
        };
        let (health, stats) = tokio::join!(health, stats);
        let reported = stats.is_ok();
        self.set_status(|s| s.record(policy, health, stats));
        if reported {
            // What was planned before this poll started is counted in the stats now.
            let reported = started.checked_sub(PLAN_REPORT_GRACE).unwrap_or(started);
            let mut planned = self.planned.lock().unwrap_or_else(|e| e.into_inner());
            while planned.front().is_some_and(|&(_, at, _)| at < reported) {
                planned.pop_front();
            }
        }
    }
}

/// A decode worker's load, as routing sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeLoad {
    /// Blocks available for new work (free plus evictable cached).
    pub free_blocks: u32,
    /// Sequences in its running batch.
    pub running: u32,
    /// Requests the router has on it.
    pub in_flight: u32,
    /// Milliseconds to move the prompt's KV it does not hold there (bytes ÷ link bandwidth).
    pub move_ms: f64,
}

/// Score of a decode worker: more is better.
pub fn decode_score(l: DecodeLoad) -> f64 {
    l.free_blocks as f64
        - (RUNNING_PENALTY_BLOCKS * (l.running as i64 + l.in_flight as i64)) as f64
        - MOVE_PENALTY_BLOCKS_PER_MS * l.move_ms
}

/// The candidate (by its key) with the best score; ties go to the first.
pub fn pick_decode<K: Copy>(candidates: &[(K, DecodeLoad)]) -> Option<K> {
    let mut best: Option<(K, f64)> = None;
    for &(k, load) in candidates {
        let s = decode_score(load);
        if best.is_none_or(|(_, b)| s > b) {
            best = Some((k, s));
        }
    }
    best.map(|(k, _)| k)
}

/// A worker's prefill load for one prompt, as routing sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillLoad {
    /// Prompt tokens queued there: reported, plus planned by the router since.
    pub queued_tokens: u64,
    /// Tokens of this prompt it would compute (not in its prefix cache).
    pub uncached_tokens: u64,
    /// Measured prompt tokens per second (> 0; else [`DEFAULT_PREFILL_RATE`]).
    pub rate: f64,
}

/// Estimated time to first token on a worker, in seconds:
/// `(queued + uncached tokens of this prompt) / prefill rate`.
pub fn estimated_ttft_s(l: PrefillLoad) -> f64 {
    let rate = if l.rate > 0.0 {
        l.rate
    } else {
        DEFAULT_PREFILL_RATE
    };
    (l.queued_tokens + l.uncached_tokens) as f64 / rate
}

/// Candidates (by key) with their estimated time to first token, best first; ties keep their
/// order.
pub fn rank_prefill<K: Copy>(candidates: &[(K, PrefillLoad)]) -> Vec<(K, f64)> {
    let mut scored: Vec<(K, f64)> = candidates
        .iter()
        .map(|&(k, l)| (k, estimated_ttft_s(l)))
        .collect();
    scored.sort_by(|a, b| a.1.total_cmp(&b.1));
    scored
}

/// Why a request was routed as it was (the label of its count).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Prefilled on a prefill worker, KV moved to the decode worker.
    Remote,
    /// Prefilled on the decode worker: the prompt's part not cached there is short.
    LocalShortSuffix,
    /// Prefilled on the decode worker: no prefill worker is routable.
    LocalNoPrefillWorker,
    /// Prefilled on the decode worker: the prefill pool is saturated.
    LocalPrefillSaturated,
    /// Refused: the estimated time to first token passes the deadline.
    RejectedTtft,
}

impl Decision {
    pub const ALL: [Decision; 5] = [
        Decision::Remote,
        Decision::LocalShortSuffix,
        Decision::LocalNoPrefillWorker,
        Decision::LocalPrefillSaturated,
        Decision::RejectedTtft,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Decision::Remote => "remote",
            Decision::LocalShortSuffix => "local_short_suffix",
            Decision::LocalNoPrefillWorker => "local_no_prefill_worker",
            Decision::LocalPrefillSaturated => "local_prefill_saturated",
            Decision::RejectedTtft => "rejected_ttft",
        }
    }
}

/// The router's own routing counts since it started.
#[derive(Debug, Default)]
pub struct Decisions {
    by_reason: [AtomicU64; 5],
    /// Over finished requests: prompt tokens, cached tokens the route predicted, and cached
    /// tokens the workers reported.
    pub prompt_tokens: AtomicU64,
    pub predicted_cached_tokens: AtomicU64,
    pub actual_cached_tokens: AtomicU64,
}

impl Decisions {
    pub fn count(&self, d: Decision) {
        let i = Decision::ALL.iter().position(|&x| x == d).expect("listed");
        self.by_reason[i].fetch_add(1, Ordering::Relaxed);
    }

    /// How many decisions had this reason.
    pub fn of(&self, d: Decision) -> u64 {
        let i = Decision::ALL.iter().position(|&x| x == d).expect("listed");
        self.by_reason[i].load(Ordering::Relaxed)
    }

    /// A finished request: what its route predicted against what the worker found.
    pub fn finished(&self, prompt_tokens: u32, predicted_cached: u32, actual_cached: u32) {
        self.prompt_tokens
            .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        self.predicted_cached_tokens
            .fetch_add(predicted_cached as u64, Ordering::Relaxed);
        self.actual_cached_tokens
            .fetch_add(actual_cached as u64, Ordering::Relaxed);
    }
}

/// The most common fingerprint; ties go to the one seen first.
pub fn consensus_fingerprint<'a>(
    fingerprints: impl IntoIterator<Item = &'a str>,
) -> Option<String> {
    let mut counts: Vec<(&str, usize)> = Vec::new();
    for f in fingerprints {
        match counts.iter_mut().find(|(g, _)| *g == f) {
            Some((_, n)) => *n += 1,
            None => counts.push((f, 1)),
        }
    }
    let mut best: Option<(&str, usize)> = None;
    for (f, n) in counts {
        if best.is_none_or(|(_, b)| n > b) {
            best = Some((f, n));
        }
    }
    best.map(|(f, _)| f.to_string())
}

/// The decision for one attempt: where to decode, and the prefill plan to send with it.
#[derive(Debug)]
pub struct Route {
    pub decode: Arc<Worker>,
    pub plan: v1::PrefillPlan,
    /// The cluster's model fingerprint (empty when unknown).
    pub fingerprint: String,
    pub decision: Decision,
    /// Prompt tokens the index says the chosen prefilling worker holds.
    pub predicted_cached_tokens: u32,
    /// The estimated time to first token of the chosen plan.
    pub estimated_ttft: Duration,
    /// The prefill tokens planned on the prefilling worker; drop at the first token.
    pub planned: Planned,
}

/// What one attempt asks of routing.
#[derive(Clone, Copy, Debug)]
pub struct RouteRequest<'a> {
    /// The tokens to prefill (the prompt, plus tokens streamed before a failover).
    pub tokens: &'a [u32],
    pub cache_salt: &'a str,
    /// Decode workers (addresses) not to use: tried already.
    pub exclude: &'a [String],
    /// What is left of the request's deadline.
    pub deadline_left: Duration,
}

/// Why no route was given.
#[derive(Clone, Debug, PartialEq)]
pub enum NoRoute {
    /// No routable decode worker is left.
    NoDecodeWorker,
    /// The best plan's estimated time to first token passes the deadline because of the work
    /// queued before it.
    PastDeadline { estimated: Duration, left: Duration },
    /// The deadline left is shorter than the prompt's own prefill on an idle worker: the
    /// request's deadline cannot be met, however idle the cluster.
    DeadlineTooShort { alone: Duration, left: Duration },
}

/// How routing is tuned (router flags).
#[derive(Clone, Copy, Debug)]
pub struct RoutingParams {
    pub policy: RoutingPolicy,
    /// Uncached prompt parts of at most this many tokens are prefilled on the decode worker.
    pub local_prefill_threshold: u32,
    /// Bytes per second the KV transport moves between a prefill and a decode worker.
    pub kv_link_bytes_per_s: f64,
    /// The prefill pool is saturated when its best estimated TTFT is worse than this many
    /// times the decode worker's own; 0: never.
    pub prefill_saturation_factor: f64,
    /// When failed health checks take a worker out of rotation.
    pub health: HealthPolicy,
}

/// The prefill and decode pools: the workers named by flags, and those known from cards.
#[derive(Debug)]
pub struct Pools {
    decode: RwLock<Vec<Arc<Worker>>>,
    prefill: RwLock<Vec<Arc<Worker>>>,
    /// Set once polling started: workers added later are polled (and their KV events
    /// followed) from then on.
    poll_interval: Mutex<Option<Duration>>,
    /// Woken after every poll and membership change (what a waiting request waits on).
    changed: Arc<Notify>,
    /// How every call to a worker authenticates, those known from cards included.
    auth: PeerAuth,
    /// Which worker holds which prefix block.
    pub index: Arc<KvIndex>,
    pub params: RoutingParams,
    pub decisions: Arc<Decisions>,
}

impl Pools {
    /// The pools of workers at these addresses, routed by `params`; every call to them is
    /// authenticated by `auth`.
    pub fn new(
        decode: &[String],
        prefill: &[String],
        auth: PeerAuth,
        params: RoutingParams,
    ) -> anyhow::Result<Self> {
        let make = |list: &[String], role| -> anyhow::Result<Vec<Arc<Worker>>> {
            list.iter()
                .map(|a| a.trim())
                .filter(|a| !a.is_empty())
                .map(|a| Worker::new(a, role, &auth).map(Arc::new))
                .collect()
        };
        Ok(Self {
            decode: RwLock::new(make(decode, Role::Decode)?),
            prefill: RwLock::new(make(prefill, Role::Prefill)?),
            poll_interval: Mutex::new(None),
            changed: Arc::default(),
            auth,
            index: Arc::default(),
            params,
            decisions: Arc::default(),
        })
    }

    fn pool(&self, role: Role) -> &RwLock<Vec<Arc<Worker>>> {
        match role {
            Role::Decode => &self.decode,
            Role::Prefill => &self.prefill,
        }
    }

    /// The decode workers now.
    pub fn decode(&self) -> Vec<Arc<Worker>> {
        self.decode
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The prefill workers now.
    pub fn prefill(&self) -> Vec<Arc<Worker>> {
        self.prefill
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn all(&self) -> Vec<Arc<Worker>> {
        let mut all = self.decode();
        all.extend(self.prefill());
        all
    }

    /// Polls every worker now, then every `interval`; so are workers added later. A worker's
    /// poller ends once the worker is gone from the pools and its last request ended.
    pub fn start_polling(&self, interval: Duration) {
        *self.poll_interval.lock().unwrap_or_else(|e| e.into_inner()) = Some(interval);
        for w in self.all() {
            self.follow(&w, interval);
        }
    }

    /// Brings the pools in line with `membership`: workers of new cards (or of a new
    /// incarnation) are added, those whose card is gone are dropped, and changed states are
    /// taken. Workers named by flags are left as they are.
    pub fn sync(&self, membership: &Membership) {
        let interval = *self.poll_interval.lock().unwrap_or_else(|e| e.into_inner());
        for role in [Role::Decode, Role::Prefill] {
            let mut pool = self.pool(role).write().unwrap_or_else(|e| e.into_inner());
            pool.retain(|w| match w.card() {
                None => true,
                Some((key, old)) => match membership.cards.get(&key) {
                    Some(new)
                        if new.incarnation == old.incarnation
                            && new.grpc_address == old.grpc_address =>
                    {
                        if new.state != old.state {
                            tracing::info!(key, state = ?new.state, "worker state changed");
                        }
                        *w.card.lock().unwrap_or_else(|e| e.into_inner()) =
                            Some((key, new.clone()));
                        true
                    }
                    Some(_) => {
                        tracing::info!(key, "worker has a new incarnation; its old one is dropped");
                        false
                    }
                    None => {
                        tracing::info!(key, address = %w.address, "worker left");
                        false
                    }
                },
            });
            let known: Vec<String> = pool
                .iter()
                .filter_map(|w| w.card())
                .map(|(k, _)| k)
                .collect();
            for (key, card) in &membership.cards {
                if card.role != role || known.contains(key) {
                    continue;
                }
                match Worker::from_card(key, card, &self.auth) {
                    Ok(w) => {
                        let w = Arc::new(w);
                        if let Some(interval) = interval {
                            self.follow(&w, interval);
                        }
                        tracing::info!(key, address = %card.grpc_address, incarnation = card.incarnation, "worker joined");
                        pool.push(w);
                    }
                    Err(e) => tracing::warn!(key, error = %e, "skipping a worker card"),
                }
            }
        }
        self.changed.notify_waiters();
        if let Some(fingerprint) = consensus_fingerprint(
            membership
                .cards
                .values()
                .map(|c| c.model_fingerprint.as_str()),
        ) {
            for (key, card) in &membership.cards {
                if card.model_fingerprint != fingerprint {
                    tracing::warn!(
                        key,
                        fingerprint = card.model_fingerprint,
                        cluster = fingerprint,
                        "a worker serves another model; it is never routed to"
                    );
                }
            }
        }
    }

    /// Polls `w` and follows its KV events.
    fn follow(&self, w: &Arc<Worker>, interval: Duration) {
        self.spawn_poller(w, interval);
        crate::kv_feed::spawn(w, self.index.clone());
    }

    /// Polls `worker` every `interval` while it exists.
    fn spawn_poller(&self, worker: &Arc<Worker>, interval: Duration) {
        let timeout = interval.max(Duration::from_millis(200));
        let weak: Weak<Worker> = Arc::downgrade(worker);
        let (policy, changed) = (self.params.health, self.changed.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(w) = weak.upgrade() else { return };
                w.poll(timeout, policy).await;
                changed.notify_waiters();
            }
        });
    }

    /// The fingerprint shared by most healthy workers.
    pub fn fingerprint(&self) -> Option<String> {
        let statuses: Vec<WorkerStatus> = self.all().iter().map(|w| w.status()).collect();
        consensus_fingerprint(
            statuses
                .iter()
                .filter(|s| s.healthy)
                .filter_map(|s| s.stats.as_ref())
                .map(|s| s.model_fingerprint.as_str()),
        )
    }

    /// Tokens per KV block as the workers report it.
    pub fn block_size(&self) -> Option<u32> {
        self.all()
            .iter()
            .filter_map(|w| w.status().stats)
            .map(|s| s.block_size)
            .find(|&b| b > 0)
    }

    fn routable(w: &Worker, fingerprint: &Option<String>) -> Option<v1::StatsResponse> {
        if w.card().is_some_and(|(_, c)| c.state != CardState::Ready) {
            return None;
        }
        let s = w.status();
        let stats = s.stats.filter(|_| s.healthy)?;
        match fingerprint {
            Some(f) if *f != stats.model_fingerprint => None,
            _ => Some(stats),
        }
    }

    /// The prefill rate assumed for a worker that has not measured its own: the mean of the
    /// measured ones, else [`DEFAULT_PREFILL_RATE`]. A decode worker that has only prefilled
    /// short suffixes has no measurement, and comparing it at a constant prior with the prefill
    /// workers' measured rates would prefer it (or them) for no reason: the workers run the same
    /// model.
    pub fn unmeasured_prefill_rate(&self) -> f64 {
        let measured: Vec<f64> = self.all().iter().filter_map(|w| w.prefill_rate()).collect();
        if measured.is_empty() {
            DEFAULT_PREFILL_RATE
        } else {
            measured.iter().sum::<f64>() / measured.len() as f64
        }
    }

    /// Chooses a decode worker and builds the prefill plan for one attempt (see the module).
    pub fn route(&self, req: RouteRequest<'_>) -> Result<Route, NoRoute> {
        let fingerprint = self.fingerprint();
        let decode = self.decode();
        let prefill_pool = self.prefill();
        let policy = self.params.policy;
        let n = req.tokens.len();
        let block_size = self.block_size().unwrap_or(0) as usize;
        // Cached tokens per worker slot, as the engine would find them: whole blocks, leaving
        // at least one token to compute.
        let cached: HashMap<WorkerSlot, usize> = match (&fingerprint, policy) {
            (Some(fp), RoutingPolicy::CacheAware) if block_size > 0 => {
                let seed = duet_kv::request_hash_seed(fp, req.cache_salt);
                let hashes = duet_kv::block_hashes(seed, req.tokens, block_size);
                let usable = n.saturating_sub(1) / block_size;
                self.index
                    .prefix_matches(&hashes[..hashes.len().min(usable)])
                    .into_iter()
                    .map(|(slot, blocks)| (slot, blocks * block_size))
                    .collect()
            }
            _ => HashMap::new(),
        };
        let cached_on = |w: &Worker| cached.get(&w.slot()).copied().unwrap_or(0);
        let unmeasured_rate = self.unmeasured_prefill_rate();
        let load_of = |w: &Worker, st: &v1::StatsResponse| PrefillLoad {
            queued_tokens: st.queued_prefill_tokens + w.planned_tokens(),
            uncached_tokens: (n - cached_on(w)) as u64,
            rate: w.prefill_rate().unwrap_or(unmeasured_rate),
        };
        let mut candidates: Vec<(usize, DecodeLoad)> = Vec::new();
        for (i, w) in decode.iter().enumerate() {
            if req.exclude.contains(&w.address) {
                continue;
            }
            let Some(st) = Self::routable(w, &fingerprint) else {
                continue;
            };
            let moved_blocks = n.div_ceil(block_size.max(1)) - cached_on(w) / block_size.max(1);
            let move_ms = match policy {
                RoutingPolicy::CacheAware => {
                    (moved_blocks as f64 * st.kv_block_bytes as f64)
                        / self.params.kv_link_bytes_per_s.max(1.0)
                        * 1e3
                }
                _ => 0.0,
            };
            candidates.push((
                i,
                DecodeLoad {
                    free_blocks: st.kv_blocks_free.saturating_add(st.kv_blocks_cached),
                    running: st.running_sequences,
                    in_flight: w.in_flight(),
                    move_ms,
                },
            ));
        }
        let decode_index = match policy {
            RoutingPolicy::Random => candidates
                .get(random_index(candidates.len()))
                .map(|&(i, _)| i),
            _ => pick_decode(&candidates),
        }
        .ok_or(NoRoute::NoDecodeWorker)?;
        let d = &decode[decode_index];
        let d_stats = Self::routable(d, &fingerprint).unwrap_or_default();
        let local_load = load_of(d, &d_stats);
        let local_ttft = estimated_ttft_s(local_load);
        let prefill: Vec<(usize, PrefillLoad)> = prefill_pool
            .iter()
            .enumerate()
            .filter_map(|(i, w)| {
                let st = Self::routable(w, &fingerprint)?;
                Some((i, load_of(w, &st)))
            })
            .collect();
        let mut ranked = rank_prefill(&prefill);
        if policy == RoutingPolicy::Random {
            let k = random_index(ranked.len());
            ranked.rotate_left(k);
        }
        let decision = match ranked.first() {
            _ if local_load.uncached_tokens <= self.params.local_prefill_threshold as u64 => {
                Decision::LocalShortSuffix
            }
            None => Decision::LocalNoPrefillWorker,
            Some(&(_, best))
                if policy != RoutingPolicy::Random
                    && self.params.prefill_saturation_factor > 0.0
                    && best > self.params.prefill_saturation_factor * local_ttft =>
            {
                Decision::LocalPrefillSaturated
            }
            Some(_) => Decision::Remote,
        };
        let (plan, estimate, predicted, prefilling, load) = if decision == Decision::Remote {
            let (first, estimate) = ranked[0];
            let load = prefill
                .iter()
                .find(|&&(i, _)| i == first)
                .map(|&(_, l)| l)
                .expect("ranked from these");
            let plan = v1::PrefillPlan {
                local: false,
                prefill_workers: ranked
                    .iter()
                    .map(|&(i, _)| v1::PrefillTarget {
                        worker_id: prefill_pool[i].id(),
                        address: prefill_pool[i].address.clone(),
                    })
                    .collect(),
            };
            let w = &prefill_pool[first];
            (plan, estimate, cached_on(w), w, load)
        } else {
            let plan = v1::PrefillPlan {
                local: true,
                prefill_workers: vec![],
            };
            (plan, local_ttft, cached_on(d), d, local_load)
        };
        let estimated_ttft = Duration::from_secs_f64(estimate.max(0.0));
        if estimated_ttft > req.deadline_left {
            self.decisions.count(Decision::RejectedTtft);
            let alone = estimated_ttft_s(PrefillLoad {
                queued_tokens: 0,
                ..load
            });
            let (alone, left) = (Duration::from_secs_f64(alone.max(0.0)), req.deadline_left);
            return Err(if alone >= left {
                NoRoute::DeadlineTooShort { alone, left }
            } else {
                NoRoute::PastDeadline {
                    estimated: estimated_ttft,
                    left,
                }
            });
        }
        self.decisions.count(decision);
        let planned = prefilling.plan((n - predicted) as u64);
        Ok(Route {
            decode: d.clone(),
            plan,
            fingerprint: fingerprint.unwrap_or_default(),
            decision,
            predicted_cached_tokens: predicted as u32,
            estimated_ttft,
            planned,
        })
    }

    /// The routing counts and the index's, as `Info` shows them.
    pub fn routing_stats(&self) -> v1::RoutingStats {
        let d = &self.decisions;
        let c = &self.index.counters;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        v1::RoutingStats {
            policy: self.params.policy.name().into(),
            decisions: Decision::ALL
                .iter()
                .map(|&r| (r.name().to_string(), d.of(r)))
                .collect(),
            prompt_tokens: load(&d.prompt_tokens),
            predicted_cached_tokens: load(&d.predicted_cached_tokens),
            actual_cached_tokens: load(&d.actual_cached_tokens),
            indexed_blocks: self.index.total_blocks() as u64,
            kv_event_gaps: load(&c.gaps),
            kv_snapshots: load(&c.snapshots),
            kv_digest_mismatches: load(&c.digest_mismatches),
            kv_new_incarnations: load(&c.new_incarnations),
        }
    }

    /// The first thing `pick` finds in the pools, trying again after every poll and membership
    /// change until `until`; `None` when it found nothing by then.
    pub async fn wait_for<T>(
        &self,
        until: tokio::time::Instant,
        pick: impl Fn(&Self) -> Option<T>,
    ) -> Option<T> {
        loop {
            // Registered before looking, so a change in between is not missed.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(found) = pick(self) {
                return Some(found);
            }
            tokio::time::timeout_at(until, changed).await.ok()?;
        }
    }

    /// Whether any decode worker is routable now.
    pub fn any_decode_routable(&self) -> bool {
        let fingerprint = self.fingerprint();
        self.decode()
            .iter()
            .any(|w| Self::routable(w, &fingerprint).is_some())
    }

    /// How many (prefill, decode) workers are routable now.
    pub fn routable_counts(&self) -> (usize, usize) {
        let fingerprint = self.fingerprint();
        let count = |pool: &[Arc<Worker>]| {
            pool.iter()
                .filter(|w| Self::routable(w, &fingerprint).is_some())
                .count()
        };
        (count(&self.prefill()), count(&self.decode()))
    }

    /// The workers as `Info` describes them.
    pub fn infos(&self) -> (Vec<v1::WorkerInfo>, Vec<v1::WorkerInfo>) {
        let fingerprint = self.fingerprint();
        let info = |w: &Arc<Worker>| {
            let st = w.status().stats.unwrap_or_default();
            v1::WorkerInfo {
                id: w.id(),
                address: w.address.clone(),
                healthy: Self::routable(w, &fingerprint).is_some(),
                kv_blocks_total: st.kv_blocks_total,
                kv_blocks_free: st.kv_blocks_free.saturating_add(st.kv_blocks_cached),
                running_sequences: st.running_sequences,
                queued_tokens: st.queued_prefill_tokens,
            }
        };
        (
            self.prefill().iter().map(info).collect(),
            self.decode().iter().map(info).collect(),
        )
    }

    /// Addresses of workers whose fingerprint differs from the cluster's (for logs).
    pub fn mismatched(&self) -> HashMap<String, String> {
        let fingerprint = self.fingerprint();
        self.all()
            .iter()
            .filter_map(|w| {
                let st = w.status().stats?;
                match &fingerprint {
                    Some(f) if *f != st.model_fingerprint => {
                        Some((w.address.clone(), st.model_fingerprint))
                    }
                    _ => None,
                }
            })
            .collect()
    }
}

/// A uniformly random index below `n` (0 when `n` is 0).
fn random_index(n: usize) -> usize {
    if n == 0 {
        0
    } else {
        (crate::validate::random_u64() % n as u64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: HealthPolicy = HealthPolicy { unhealthy_after: 3 };

    #[test]
    fn health_leaves_rotation_after_consecutive_failures_or_a_refusal() {
        let mut s = WorkerStatus::default();
        let stats = || Ok(v1::StatsResponse::default());
        s.record(POLICY, HealthCheck::Serving, stats());
        assert!(s.healthy && s.stats.is_some() && s.last_error.is_none());
        // Slow stats are not ill health: the last stats stay.
        s.record(POLICY, HealthCheck::Serving, Err("stats timed out".into()));
        assert!(s.healthy && s.stats.is_some());
        assert_eq!(s.last_error.as_deref(), Some("stats timed out"));
        // Two failed checks in a row, then a good one: never out.
        for _ in 0..2 {
            s.record(POLICY, HealthCheck::Failed("timed out".into()), stats());
            assert!(s.healthy && !s.unresponsive());
        }
        s.record(POLICY, HealthCheck::Serving, stats());
        assert_eq!((s.healthy, s.failed_checks), (true, 0));
        // Three in a row: out, until the next good check.
        for _ in 0..3 {
            s.record(POLICY, HealthCheck::Failed("timed out".into()), stats());
        }
        assert!(!s.healthy && s.unresponsive());
        s.record(POLICY, HealthCheck::Serving, stats());
        assert!(s.healthy);
        // A refusal takes it out at once.
        s.record(POLICY, HealthCheck::Refused("NOT_SERVING".into()), stats());
        assert!(!s.healthy && s.unresponsive());
    }

    #[tokio::test]
    async fn waiting_for_a_worker_ends_when_one_is_routable_or_at_the_bound() {
        let pools = Arc::new(
            Pools::new(
                &["127.0.0.1:1".into()],
                &[],
                PeerAuth::default(),
                params(RoutingPolicy::CacheAware),
            )
            .unwrap(),
        );
        let started = tokio::time::Instant::now();
        let none = pools
            .wait_for(started + Duration::from_millis(100), |p| route(p, 10, &[]))
            .await;
        assert!(none.is_none() && started.elapsed() >= Duration::from_millis(100));
        let waiting = {
            let pools = pools.clone();
            tokio::spawn(async move {
                pools
                    .wait_for(tokio::time::Instant::now() + Duration::from_secs(10), |p| {
                        route(p, 10, &[]).map(|r| r.decode.address.clone())
                    })
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        set(&pools.decode()[0], true, stats("fp", 10, 0));
        pools.changed.notify_waiters();
        let found = tokio::time::timeout(Duration::from_secs(1), waiting).await;
        assert_eq!(found.unwrap().unwrap().as_deref(), Some("127.0.0.1:1"));
    }

    fn load(free_blocks: u32, running: u32, in_flight: u32) -> DecodeLoad {
        DecodeLoad {
            free_blocks,
            running,
            in_flight,
            move_ms: 0.0,
        }
    }

    #[test]
    fn decode_prefers_headroom_minus_running() {
        assert_eq!(pick_decode::<usize>(&[]), None);
        assert_eq!(
            pick_decode(&[(0, load(10, 0, 0)), (1, load(20, 0, 0))]),
            Some(1)
        );
        // 20 - 4*3 = 8 < 10.
        assert_eq!(
            pick_decode(&[(0, load(10, 0, 0)), (1, load(20, 2, 1))]),
            Some(0)
        );
        // Ties go to the first.
        assert_eq!(
            pick_decode(&[(3, load(10, 1, 0)), (5, load(14, 2, 0))]),
            Some(3)
        );
        // Moving the KV costs: 20 - 15 ms of movement < 10.
        let far = DecodeLoad {
            move_ms: 15.0,
            ..load(20, 0, 0)
        };
        assert_eq!(pick_decode(&[(0, load(10, 0, 0)), (1, far)]), Some(0));
    }

    #[test]
    fn prefill_ranked_by_estimated_ttft() {
        let l = |q, uncached, rate| PrefillLoad {
            queued_tokens: q,
            uncached_tokens: uncached,
            rate,
        };
        let keys = |r: Vec<(usize, f64)>| r.into_iter().map(|(k, _)| k).collect::<Vec<_>>();
        assert_eq!(
            keys(rank_prefill(&[
                (0, l(500, 100, 1.0)),
                (1, l(0, 100, 1.0)),
                (2, l(100, 100, 1.0))
            ])),
            [1, 2, 0]
        );
        // A faster worker wins despite a longer queue; rate 0 is treated as the default.
        assert_eq!(
            keys(rank_prefill(&[(0, l(0, 100, 1.0)), (1, l(300, 100, 10.0))])),
            [1, 0]
        );
        assert_eq!(
            keys(rank_prefill(&[(0, l(5, 10, 0.0)), (1, l(1, 10, 1.0))])),
            [0, 1]
        );
        // The tokens a worker holds cached are not computed again.
        assert_eq!(
            keys(rank_prefill(&[(0, l(0, 100, 1.0)), (1, l(50, 10, 1.0))])),
            [1, 0]
        );
        assert_eq!(estimated_ttft_s(l(100, 100, 100.0)), 2.0);
    }

    #[test]
    fn fingerprint_consensus() {
        assert_eq!(consensus_fingerprint([]), None);
        assert_eq!(consensus_fingerprint(["a", "b", "b"]).as_deref(), Some("b"));
        assert_eq!(consensus_fingerprint(["a", "b"]).as_deref(), Some("a"));
    }

    fn stats(fp: &str, free: u32, queued: u64) -> v1::StatsResponse {
        v1::StatsResponse {
            worker_id: format!("w-{free}"),
            model_fingerprint: fp.into(),
            kv_blocks_free: free,
            kv_blocks_total: 100,
            queued_prefill_tokens: queued,
            block_size: 16,
            ..Default::default()
        }
    }

    fn params(policy: RoutingPolicy) -> RoutingParams {
        RoutingParams {
            policy,
            local_prefill_threshold: 32,
            kv_link_bytes_per_s: 1e9,
            prefill_saturation_factor: 2.0,
            health: POLICY,
        }
    }

    /// Routes a prompt of tokens 0..n with plenty of deadline left.
    fn route(pools: &Pools, n: usize, exclude: &[String]) -> Option<Route> {
        let tokens: Vec<u32> = (0..n as u32).collect();
        pools
            .route(RouteRequest {
                tokens: &tokens,
                cache_salt: "",
                exclude,
                deadline_left: Duration::from_secs(600),
            })
            .ok()
    }

    fn set(w: &Worker, healthy: bool, st: v1::StatsResponse) {
        w.set_status(|s| {
            s.healthy = healthy;
            s.stats = Some(st);
        });
    }

    #[tokio::test]
    async fn route_builds_plan() {
        let pools = Pools::new(
            &[
                "127.0.0.1:1".into(),
                "127.0.0.1:2".into(),
                "127.0.0.1:3".into(),
            ],
            &["127.0.0.1:4".into(), "127.0.0.1:5".into()],
            PeerAuth::default(),
            params(RoutingPolicy::CacheAware),
        )
        .unwrap();
        assert!(route(&pools, 10, &[]).is_none());
        set(&pools.decode()[0], true, stats("fp", 10, 0));
        set(&pools.decode()[1], true, stats("fp", 50, 0));
        // Most free blocks, but another model: not routable.
        set(&pools.decode()[2], true, stats("other", 90, 0));
        let r = route(&pools, 10, &[]).unwrap();
        assert_eq!(r.decode.address, "127.0.0.1:2");
        assert_eq!(r.fingerprint, "fp");
        assert!(r.plan.local, "short prompt: local");
        // Long prompt but no healthy prefill worker: local.
        assert!(route(&pools, 100, &[]).unwrap().plan.local);
        set(&pools.prefill()[0], true, stats("fp", 1, 500));
        set(&pools.prefill()[1], true, stats("fp", 2, 10));
        let r = route(&pools, 100, &[]).unwrap();
        assert!(!r.plan.local);
        let ids: Vec<&str> = r
            .plan
            .prefill_workers
            .iter()
            .map(|t| t.address.as_str())
            .collect();
        assert_eq!(ids, ["127.0.0.1:5", "127.0.0.1:4"]);
        assert_eq!(r.plan.prefill_workers[0].worker_id, "w-2");
        // Excluded and failed workers are skipped.
        let tried = ["127.0.0.1:2".to_string()];
        assert_eq!(
            route(&pools, 10, &tried).unwrap().decode.address,
            "127.0.0.1:1"
        );
        pools.decode()[0].mark_failed("boom");
        assert!(route(&pools, 10, &tried).is_none());
        // In-flight requests count against a worker.
        let _g: Vec<InFlight> = (0..11).map(|_| pools.decode()[1].begin()).collect();
        set(&pools.decode()[0], true, stats("fp", 10, 0));
        assert_eq!(
            route(&pools, 10, &[]).unwrap().decode.address,
            "127.0.0.1:1"
        );
        let (prefill, decode) = pools.infos();
        assert_eq!((prefill.len(), decode.len()), (2, 3));
        assert!(!decode[2].healthy && decode[1].healthy);
        assert_eq!(pools.mismatched().len(), 1);
        assert_eq!(pools.block_size(), Some(16));
    }

    fn card(id: &str, port: u16, incarnation: u64, state: CardState, fp: &str) -> WorkerCard {
        WorkerCard {
            worker_id: id.into(),
            role: Role::Decode,
            grpc_address: format!("127.0.0.1:{port}"),
            kv_address: format!("127.0.0.1:{port}"),
            node: "host".into(),
            device: "cpu".into(),
            model_fingerprint: fp.into(),
            block_size: 16,
            kv_capacity_blocks: 100,
            incarnation,
            state,
        }
    }

    fn membership(cards: &[WorkerCard]) -> Membership {
        Membership {
            cards: cards.iter().map(|c| (c.key("test"), c.clone())).collect(),
            ..Default::default()
        }
    }

    /// Marks every decode worker healthy with stats of its card's fingerprint.
    fn answer(pools: &Pools) {
        for w in pools.decode() {
            let fp = w.card().map_or("fp".into(), |(_, c)| c.model_fingerprint);
            set(&w, true, stats(&fp, 50, 0));
        }
    }

    #[tokio::test]
    async fn cards_join_leave_drain_and_reincarnate() {
        let pools = Pools::new(
            &["127.0.0.1:9".into()],
            &[],
            PeerAuth::default(),
            params(RoutingPolicy::CacheAware),
        )
        .unwrap();
        let a = card("a", 1, 1, CardState::Ready, "fp");
        let b = card("b", 2, 1, CardState::Joining, "fp");
        let other = card("c", 3, 1, CardState::Ready, "other-model");
        pools.sync(&membership(&[a.clone(), b.clone(), other]));
        answer(&pools);
        let routable = |pools: &Pools| -> Vec<String> {
            let mut tried = Vec::new();
            while let Some(r) = route(pools, 10, &tried) {
                tried.push(r.decode.address.clone());
            }
            tried.sort();
            tried
        };
        // The static worker stays; b is not ready yet; c serves another model.
        assert_eq!(routable(&pools), ["127.0.0.1:1", "127.0.0.1:9"]);
        let b_ready = WorkerCard {
            state: CardState::Ready,
            ..b.clone()
        };
        let a_draining = WorkerCard {
            state: CardState::Draining,
            ..a.clone()
        };
        pools.sync(&membership(&[a_draining, b_ready.clone()]));
        assert_eq!(routable(&pools), ["127.0.0.1:2", "127.0.0.1:9"]);
        assert_eq!(pools.decode().len(), 3, "c left");
        // b restarts (same address, new incarnation): its old worker and status are dropped.
        let b_again = WorkerCard {
            incarnation: 2,
            ..b_ready
        };
        pools.sync(&membership(&[b_again]));
        let b_worker = pools
            .decode()
            .into_iter()
            .find(|w| w.address == "127.0.0.1:2")
            .unwrap();
        assert_eq!(b_worker.card().unwrap().1.incarnation, 2);
        assert!(
            b_worker.status().stats.is_none(),
            "a new incarnation starts unpolled"
        );
        assert_eq!(routable(&pools), ["127.0.0.1:9"]);
        answer(&pools);
        assert_eq!(routable(&pools), ["127.0.0.1:2", "127.0.0.1:9"]);
        pools.sync(&Membership::default());
        assert_eq!(routable(&pools), ["127.0.0.1:9"]);
    }

    /// Two idle prefill workers and one decode worker, all answering for model "fp".
    fn cluster(policy: RoutingPolicy) -> Pools {
        let pools = Pools::new(
            &["127.0.0.1:1".into()],
            &["127.0.0.1:4".into(), "127.0.0.1:5".into()],
            PeerAuth::default(),
            params(policy),
        )
        .unwrap();
        set(&pools.decode()[0], true, stats("fp", 1000, 0));
        for w in pools.prefill() {
            set(&w, true, stats("fp", 1000, 0));
        }
        pools
    }

    fn first_prefill(r: &Route) -> &str {
        &r.plan.prefill_workers[0].address
    }

    #[tokio::test]
    async fn a_burst_spreads_over_idle_prefill_workers() {
        let pools = cluster(RoutingPolicy::CacheAware);
        // Routes held (their prefills not answered yet), as a burst's are.
        let burst: Vec<Route> = (0..4).map(|_| route(&pools, 900, &[]).unwrap()).collect();
        let firsts: Vec<&str> = burst.iter().map(first_prefill).collect();
        assert_eq!(
            firsts,
            ["127.0.0.1:4", "127.0.0.1:5", "127.0.0.1:4", "127.0.0.1:5"]
        );
        assert_eq!(pools.prefill()[0].planned_tokens(), 1800);
        assert_eq!(pools.decisions.of(Decision::Remote), 4);
        // Once the first tokens arrive, nothing planned is left.
        drop(burst);
        assert_eq!(pools.prefill()[0].planned_tokens(), 0);
    }

    #[tokio::test]
    async fn a_prompt_goes_where_its_prefix_is_cached() {
        let pools = cluster(RoutingPolicy::CacheAware);
        let tokens: Vec<u32> = (0..200).collect();
        let hashes = duet_kv::block_hashes(duet_kv::request_hash_seed("fp", ""), &tokens, 16);
        // The second prefill worker holds the first 10 blocks.
        let holder = &pools.prefill()[1];
        let snapshot = v1::KvEventsMessage {
            incarnation: 1,
            snapshot: Some(v1::KvSnapshot {
                seq: 0,
                block_hashes: hashes[..10].to_vec(),
                last: true,
            }),
            ..Default::default()
        };
        pools.index.apply(holder.slot(), &snapshot);
        let r = route(&pools, 200, &[]).unwrap();
        assert_eq!(first_prefill(&r), "127.0.0.1:5");
        assert_eq!(r.predicted_cached_tokens, 160);
        assert_eq!(
            holder.planned_tokens(),
            40,
            "only the uncached part is planned"
        );
        // Another tenant's salt: nothing cached for it.
        let other = pools
            .route(RouteRequest {
                tokens: &tokens,
                cache_salt: "tenant-b",
                exclude: &[],
                deadline_left: Duration::from_secs(600),
            })
            .unwrap();
        assert_eq!(other.predicted_cached_tokens, 0);
        assert_eq!(first_prefill(&other), "127.0.0.1:4");
        // The load policy ignores caches.
        let load = cluster(RoutingPolicy::Load);
        load.index.apply(load.prefill()[1].slot(), &snapshot);
        let r = route(&load, 200, &[]).unwrap();
        assert_eq!(
            (first_prefill(&r), r.predicted_cached_tokens),
            ("127.0.0.1:4", 0)
        );
    }

    #[tokio::test]
    async fn a_saturated_prefill_pool_prefills_on_the_decode_worker() {
        let pools = cluster(RoutingPolicy::CacheAware);
        for w in pools.prefill() {
            set(&w, true, stats("fp", 1000, 5000));
        }
        let r = route(&pools, 200, &[]).unwrap();
        assert!(r.plan.local);
        assert_eq!(r.decision, Decision::LocalPrefillSaturated);
        assert_eq!(pools.decode()[0].planned_tokens(), 200);
        // Short prompts stay local whatever the pools.
        let r = route(&pools, 20, &[]).unwrap();
        assert_eq!(r.decision, Decision::LocalShortSuffix);
    }

    #[tokio::test]
    async fn a_request_whose_estimated_ttft_passes_its_deadline_is_refused() {
        let pools = cluster(RoutingPolicy::CacheAware);
        // 900 tokens at the prior of 1000 tokens/s: 0.9 s.
        let tokens: Vec<u32> = (0..900).collect();
        let ask = |left| {
            pools.route(RouteRequest {
                tokens: &tokens,
                cache_salt: "",
                exclude: &[],
                deadline_left: left,
            })
        };
        let refused = ask(Duration::from_millis(500)).unwrap_err();
        assert!(
            matches!(refused, NoRoute::DeadlineTooShort { .. }),
            "shorter than the prompt's own prefill: {refused:?}"
        );
        assert_eq!(pools.decisions.of(Decision::RejectedTtft), 1);
        // Queued work (everywhere) makes a deadline the prompt alone would meet too short:
        // overload.
        for w in pools.all() {
            set(&w, true, stats("fp", 1000, 2000));
        }
        let refused = ask(Duration::from_secs(2)).unwrap_err();
        assert!(
            matches!(refused, NoRoute::PastDeadline { .. }),
            "{refused:?}"
        );
        for w in pools.all() {
            set(&w, true, stats("fp", 1000, 0));
        }
        assert_eq!(
            pools.prefill()[0].planned_tokens(),
            0,
            "a refusal plans nothing"
        );
        let ok = ask(Duration::from_secs(2)).unwrap();
        assert!((ok.estimated_ttft.as_secs_f64() - 0.9).abs() < 1e-6);
        // A measured rate replaces the prior.
        let mut fast = stats("fp", 1000, 0);
        fast.prefill_tokens_per_s = 9000.0;
        for w in pools.prefill() {
            set(&w, true, fast.clone());
        }
        drop(ok);
        assert!(ask(Duration::from_millis(500)).is_ok());
    }

    #[tokio::test]
    async fn an_unmeasured_worker_prefills_at_the_pools_measured_rate() {
        let pools = Pools::new(
            &["127.0.0.1:1".into()],
            &["127.0.0.1:2".into(), "127.0.0.1:3".into()],
            PeerAuth::default(),
            params(RoutingPolicy::CacheAware),
        )
        .unwrap();
        assert_eq!(pools.unmeasured_prefill_rate(), DEFAULT_PREFILL_RATE);
        set(&pools.decode()[0], true, stats("fp", 100, 0));
        let mut slow = stats("fp", 100, 0);
        slow.prefill_tokens_per_s = 100.0;
        for w in pools.prefill() {
            set(&w, true, slow.clone());
        }
        // A slow pool: the decode worker, never measured, is as slow, so a long prompt still
        // goes to an idle prefill worker rather than to a decode worker thought 10x faster.
        slow.prefill_tokens_per_s = 300.0;
        set(&pools.prefill()[1], true, slow);
        assert_eq!(pools.unmeasured_prefill_rate(), 200.0);
        let r = route(&pools, 400, &[]).unwrap();
        assert_eq!(r.decision, Decision::Remote);
        assert_eq!(r.plan.prefill_workers[0].address, "127.0.0.1:3");
        assert!((r.estimated_ttft.as_secs_f64() - 400.0 / 300.0).abs() < 1e-6);
    }
}
