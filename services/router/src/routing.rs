//! The worker pools: who the router can route to, kept in line with the cluster, and routing
//! carried out over them.
//!
//! The router knows its workers from flags (static) and from the cluster's worker cards
//! ([`Pools::sync`] diffs each new membership against the pools). Each one ([`Worker`]) is polled
//! every stats interval on a connection of its own, and followed on `KvEvents`
//! ([`crate::kv_feed`]) into the exact prefix index ([`KvIndex`]).
//!
//! A route ([`Pools::route`]) hashes the prompt with duet-kv's chained function (seed: the
//! cluster's fingerprint, the most common one among healthy workers, and the request's cache
//! salt), looks up each worker's prefix overlap in the index, takes a [`WorkerSnapshot`] of every
//! worker, and asks the policy ([`duet_routing::select`]); it then counts the decision by reason
//! ([`Decisions`]), counts the prompt tokens it planned on the prefilling worker until that
//! worker reports them, and returns the plan to send.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use duet_cluster::{Membership, Role, WorkerCard};
use duet_proto::PeerAuth;
use duet_proto::v1;
use tokio::sync::Notify;

use crate::kv_index::{KvIndex, PrefixMatch, WorkerSlot};
use crate::worker::{HealthPolicy, Planned, Worker};
use duet_kv::BlockHash;
use duet_routing::{
    Decision, NoRoute, PolicyParams, PolicyRequest, RoutingPolicy, WorkerSnapshot,
    consensus_fingerprint,
};

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
    /// The prompt's blocks, recorded as held by the prefilling worker.
    pub pending: Option<PendingPlacement>,
    /// A peer of the decode worker holding more of the prompt, to pull from (local prefill
    /// only: a prefill worker computes the whole prompt anyway).
    pub pull: Option<v1::KvPullSource>,
}

/// A prefix a decode worker would pull from a peer instead of computing it.
#[derive(Debug)]
struct PeerPull {
    source: v1::KvPullSource,
    /// What pulling saves of computing it, in prompt tokens.
    saved_tokens: usize,
}

impl PeerPull {
    /// What `w`, holding `own` of the prompt, would pull from `holder` (the decode worker
    /// holding the most of it): the blocks it lacks, where it pulls from peers
    /// (`--kv-peer-pull`) and moving a block over the link (`link_bytes_per_s`) beats computing
    /// its tokens at `w`'s prefill rate. Each block counts its tokens times the share of that
    /// time moving it leaves saved.
    fn plan(
        w: &Worker,
        own: PrefixMatch,
        holder: Option<(&Arc<Worker>, PrefixMatch)>,
        block_size: usize,
        link_bytes_per_s: f64,
    ) -> Option<Self> {
        let (holder, held) = holder?;
        let stats = w.status().stats?;
        if !stats.kv_peer_pull || holder.slot() == w.slot() || held.blocks() <= own.blocks() {
            return None;
        }
        let rate = Some(stats.prefill_tokens_per_s)
            .filter(|&r| r > 0.0)
            .unwrap_or(duet_kv::PRIOR_PREFILL_TOKENS_PER_S);
        let compute_s = block_size as f64 / rate;
        let move_s = stats.kv_block_bytes as f64 / link_bytes_per_s.max(1.0);
        let share = 1.0 - move_s / compute_s;
        if share <= 0.0 {
            return None;
        }
        let extra = held.blocks() - own.blocks();
        Some(Self {
            source: v1::KvPullSource {
                worker_id: holder.id(),
                address: holder.address.clone(),
                blocks: held.blocks() as u32,
            },
            saved_tokens: ((extra * block_size) as f64 * share) as usize,
        })
    }
}

/// A prefill worker of the pools that a decode worker does not accept in a prefill plan.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct RefusedPrefill {
    /// The decode worker's address.
    pub decode: String,
    /// The prefill worker's address.
    pub prefill: String,
}

/// A placement recorded in the index as pending (see [`KvIndex::record_pending`]).
#[derive(Clone, Copy, Debug)]
pub struct PendingPlacement {
    pub slot: WorkerSlot,
    /// The prompt's first block.
    pub first_block: BlockHash,
    pub id: u64,
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

/// How routing is tuned (router flags).
#[derive(Clone, Copy, Debug)]
pub struct RoutingParams {
    /// What the policy decides by.
    pub policy: PolicyParams,
    /// When failed health checks take a worker out of rotation.
    pub health: HealthPolicy,
    /// How long a placement counts as cached on its worker before the worker's KV events
    /// confirm it.
    pub pending_prefix_ttl: Duration,
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
    /// The one decode worker (by worker id) taken from the cluster's cards, when set.
    only_decode_worker: Option<String>,
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
            only_decode_worker: None,
        })
    }

    /// Takes only the decode worker registered as `worker_id` from the cluster's cards (the
    /// router beside one decode worker: `--only-decode-worker`); prefill workers as before.
    pub fn only_decode_worker(mut self, worker_id: Option<String>) -> Self {
        self.only_decode_worker = worker_id;
        self
    }

    /// Whether a card's worker belongs in the pools.
    fn takes(&self, card: &WorkerCard) -> bool {
        match (&self.only_decode_worker, card.role) {
            (Some(id), Role::Decode) => card.worker_id == *id,
            _ => true,
        }
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
                        w.set_card(&key, new);
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
                if card.role != role || known.contains(key) || !self.takes(card) {
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

    /// Every worker as the policy sees it now, with no prefix overlap.
    fn snapshots(&self) -> (Vec<WorkerSnapshot>, Vec<WorkerSnapshot>) {
        let take = |pool: Vec<Arc<Worker>>| pool.iter().map(|w| w.snapshot(0)).collect();
        (take(self.prefill()), take(self.decode()))
    }

    /// The fingerprint shared by most healthy workers.
    pub fn fingerprint(&self) -> Option<String> {
        let (prefill, decode) = self.snapshots();
        fingerprint_of(decode.iter().chain(&prefill))
    }

    /// Tokens per KV block as the workers report it.
    pub fn block_size(&self) -> Option<u32> {
        self.all()
            .iter()
            .filter_map(|w| w.status().stats)
            .map(|s| s.block_size)
            .find(|&b| b > 0)
    }

    /// Chooses a decode worker and builds the prefill plan for one attempt (see the module and
    /// [`crate::policy`]).
    pub fn route(&self, req: RouteRequest<'_>) -> Result<Route, NoRoute> {
        let (decode, prefill) = (self.decode(), self.prefill());
        let (prefill_now, decode_now) = self.snapshots();
        let fingerprint = fingerprint_of(decode_now.iter().chain(&prefill_now));
        let block_size = self.block_size().unwrap_or(0) as usize;
        let n = req.tokens.len();
        let now = Instant::now();
        // The prompt's full blocks, as the workers hash them.
        let hashes = match &fingerprint {
            Some(fp) if block_size > 0 => {
                let seed = duet_kv::request_hash_seed(fp, req.cache_salt);
                duet_kv::block_hashes(seed, req.tokens, block_size)
            }
            _ => Vec::new(),
        };
        // Cached tokens per worker, as the engine would find them: whole blocks, leaving at
        // least one token to compute.
        let usable = n.saturating_sub(1) / block_size.max(1);
        let overlap = self
            .index
            .prefix_matches(&hashes[..hashes.len().min(usable)], now);
        // A prefix held below a worker's pool counts for what loading it saves there.
        let saved = |w: &Arc<Worker>| {
            overlap
                .get(&w.slot())
                .map_or(0, |m| m.saved_tokens(block_size, &w.tier_worth()))
        };
        // A decode worker that pulls from peers also counts what pulling the longest prefix
        // another decode worker holds would save.
        let holder = decode
            .iter()
            .filter_map(|w| Some((w, *overlap.get(&w.slot())?)))
            .max_by_key(|(_, m)| m.blocks());
        let link = self.params.policy.kv_link_bytes_per_s;
        let mut pulls: Vec<Option<PeerPull>> = decode
            .iter()
            .map(|w| {
                let own = overlap.get(&w.slot()).copied().unwrap_or_default();
                PeerPull::plan(w, own, holder, block_size, link)
            })
            .collect();
        let decode_now: Vec<WorkerSnapshot> = decode
            .iter()
            .zip(&pulls)
            .map(|(w, pull)| w.snapshot(saved(w) + pull.as_ref().map_or(0, |p| p.saved_tokens)))
            .collect();
        let prefill_now: Vec<WorkerSnapshot> =
            prefill.iter().map(|w| w.snapshot(saved(w))).collect();
        let ask = PolicyRequest {
            tokens: n,
            block_size,
            fingerprint: fingerprint.as_deref(),
            exclude: req.exclude,
            deadline_left: req.deadline_left,
            random: crate::ids::random_u64(),
        };
        let placed = duet_routing::select(&self.params.policy, &ask, &decode_now, &prefill_now)
            .inspect_err(|e| {
                if !matches!(e, NoRoute::NoDecodeWorker) {
                    self.decisions.count(Decision::RejectedTtft);
                }
            })?;
        self.decisions.count(placed.decision);
        let prefilling = match placed.prefill.first() {
            Some(&first) => &prefill[first],
            None => &decode[placed.decode],
        };
        let planned = prefilling.plan((n - placed.predicted_cached_tokens) as u64);
        // The prefilling worker holds the prompt's blocks from now on, as far as routing goes.
        let pending = (self.params.policy.policy == RoutingPolicy::CacheAware
            && !hashes.is_empty())
        .then(|| PendingPlacement {
            slot: prefilling.slot(),
            first_block: hashes[0],
            id: self.index.record_pending(
                &[prefilling.slot()],
                hashes,
                now + self.params.pending_prefix_ttl,
            ),
        });
        let plan = v1::PrefillPlan {
            local: placed.prefill.is_empty(),
            prefill_workers: placed
                .prefill
                .iter()
                .map(|&i| v1::PrefillTarget {
                    worker_id: prefill_now[i].id.clone(),
                    address: prefill_now[i].address.clone(),
                })
                .collect(),
        };
        let pull = match plan.local {
            true => pulls[placed.decode].take().map(|p| p.source),
            false => None,
        };
        Ok(Route {
            decode: decode[placed.decode].clone(),
            pull,
            plan,
            fingerprint: fingerprint.unwrap_or_default(),
            decision: placed.decision,
            predicted_cached_tokens: placed.predicted_cached_tokens as u32,
            estimated_ttft: placed.estimated_ttft,
            planned,
            pending,
        })
    }

    /// The routing counts and the index's, as `Info` shows them.
    pub fn routing_stats(&self) -> v1::RoutingStats {
        let d = &self.decisions;
        let c = &self.index.counters;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        v1::RoutingStats {
            policy: self.params.policy.policy.name().into(),
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
        self.routable_counts().1 > 0
    }

    /// Every (decode, prefill) pair of the pools whose decode worker says it does not accept
    /// that prefill worker in a plan: the router plans it for other decode workers only.
    pub fn refused_prefill(&self) -> Vec<RefusedPrefill> {
        let prefill: Vec<WorkerSnapshot> = self.prefill().iter().map(|w| w.snapshot(0)).collect();
        let mut refused = Vec::new();
        for d in self.decode() {
            let decode = d.snapshot(0);
            for p in prefill.iter().filter(|p| !decode.accepts(p)) {
                refused.push(RefusedPrefill {
                    decode: decode.address.clone(),
                    prefill: p.address.clone(),
                });
            }
        }
        refused
    }

    /// Plans the decode workers prefilled themselves since they started because it named only
    /// prefill workers they do not accept (their stats' count, summed).
    pub fn refused_prefill_plans(&self) -> u64 {
        self.decode()
            .iter()
            .filter_map(|w| w.status().stats)
            .map(|s| s.refused_prefill_plans)
            .sum()
    }

    /// Logs each pair of [`Pools::refused_prefill`] once it appears: at start-up, as the first
    /// stats come in, and whenever membership or a decode worker's flags change it. Runs until
    /// aborted.
    pub async fn warn_of_refused_prefill(&self) {
        let mut said: Vec<RefusedPrefill> = Vec::new();
        loop {
            // Registered before looking, so a change in between is not missed.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let refused = self.refused_prefill();
            for r in refused.iter().filter(|r| !said.contains(r)) {
                tracing::warn!(
                    decode = r.decode,
                    prefill = r.prefill,
                    "this decode worker does not accept this prefill worker in a prefill plan, so \
                     its requests are never planned there (other prefill workers, or its own \
                     prefill, take them): give the decode worker --prefill with the prefill \
                     worker's address, or run both in one cluster (--etcd)"
                );
            }
            said = refused;
            changed.await;
        }
    }

    /// How many (prefill, decode) workers are routable now.
    pub fn routable_counts(&self) -> (usize, usize) {
        let (prefill, decode) = self.snapshots();
        let fingerprint = fingerprint_of(decode.iter().chain(&prefill));
        let count = |pool: &[WorkerSnapshot]| {
            pool.iter()
                .filter(|w| duet_routing::routable(w, fingerprint.as_deref()))
                .count()
        };
        (count(&prefill), count(&decode))
    }

    /// The workers as `Info` describes them.
    pub fn infos(&self) -> (Vec<v1::WorkerInfo>, Vec<v1::WorkerInfo>) {
        let fingerprint = self.fingerprint();
        let refused = self.refused_prefill();
        let info = |w: &Arc<Worker>| {
            let st = w.status().stats.unwrap_or_default();
            v1::WorkerInfo {
                refused_prefill_workers: refused
                    .iter()
                    .filter(|r| r.decode == w.address)
                    .map(|r| r.prefill.clone())
                    .collect(),
                id: w.id(),
                address: w.address.clone(),
                healthy: duet_routing::routable(&w.snapshot(0), fingerprint.as_deref()),
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

/// The fingerprint shared by most healthy workers among `workers`.
fn fingerprint_of<'a>(workers: impl Iterator<Item = &'a WorkerSnapshot>) -> Option<String> {
    consensus_fingerprint(
        workers
            .filter(|w| w.healthy)
            .map(|w| w.fingerprint.as_str()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::InFlight;
    use duet_cluster::{CardState, WorkerCard};
    use duet_routing::RoutingPolicy;

    const POLICY: HealthPolicy = HealthPolicy { unhealthy_after: 3 };

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
            policy: PolicyParams {
                policy,
                local_prefill_threshold: 32,
                kv_link_bytes_per_s: 1e9,
                prefill_saturation_factor: 2.0,
            },
            health: POLICY,
            pending_prefix_ttl: Duration::from_secs(10),
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

    fn route_tokens(pools: &Pools, tokens: &[u32]) -> Option<Route> {
        pools
            .route(RouteRequest {
                tokens,
                cache_salt: "",
                exclude: &[],
                deadline_left: Duration::from_secs(600),
            })
            .ok()
    }

    /// `n` tokens of a prompt of its own for each `seed`.
    fn unrelated(seed: u32, n: usize) -> Vec<u32> {
        (0..n as u32).map(|j| seed * 100_000 + j).collect()
    }

    /// A worker's whole snapshot: it holds `hashes` in its device pool.
    fn snapshot_of(hashes: &[u64]) -> v1::KvEventsMessage {
        v1::KvEventsMessage {
            incarnation: 1,
            snapshot: Some(v1::KvSnapshot {
                seq: 0,
                block_hashes: hashes.to_vec(),
                last: true,
                ..Default::default()
            }),
            ..Default::default()
        }
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
        // The same prompt again: the decode worker that just prefilled it holds it.
        let again = route(&pools, 100, &[]).unwrap();
        assert_eq!(
            (again.decision, again.decode.address.as_str()),
            (Decision::LocalShortSuffix, "127.0.0.1:2")
        );
        let r = route_tokens(&pools, &unrelated(3, 100)).unwrap();
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

    #[tokio::test]
    async fn a_decode_worker_that_pulls_is_told_the_peer_holding_the_prompt() {
        for pulls in [true, false] {
            let pools = Pools::new(
                &["127.0.0.1:1".into(), "127.0.0.1:2".into()],
                &[],
                PeerAuth::default(),
                params(RoutingPolicy::CacheAware),
            )
            .unwrap();
            // 16 tokens at 1,000 tokens/s (16 ms) against 1 MB over 1 GB/s (1 ms): pulling
            // pays.
            let stats = |free, pull| v1::StatsResponse {
                kv_peer_pull: pull,
                prefill_tokens_per_s: 1000.0,
                kv_block_bytes: 1_000_000,
                ..stats("fp", free, 0)
            };
            let (holder, other) = (&pools.decode()[0], &pools.decode()[1]);
            set(holder, true, stats(2, true));
            set(other, true, stats(500, pulls));
            let tokens: Vec<u32> = (0..200).collect();
            let seed = duet_kv::request_hash_seed("fp", "");
            let hashes = duet_kv::block_hashes(seed, &tokens, 16);
            let snapshot = snapshot_of(&hashes[..10]);
            pools.index.apply(holder.slot(), &snapshot);
            let r = route(&pools, 200, &[]).unwrap();
            if !pulls {
                assert!(
                    r.pull.is_none(),
                    "a worker that does not pull is told nothing"
                );
                continue;
            }
            assert_eq!(r.decode.address, "127.0.0.1:2");
            assert!(r.plan.local);
            let pull = r.pull.expect("told to pull");
            assert_eq!(
                (pull.worker_id, pull.address.as_str(), pull.blocks),
                (holder.id(), "127.0.0.1:1", 10)
            );
        }
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

    /// `--only-decode-worker`: of the cluster's decode workers only the named one is routed
    /// to, and prefill workers still come from the cards.
    #[tokio::test]
    async fn a_router_pinned_to_one_decode_worker_routes_only_to_it() {
        let pools = Pools::new(&[], &[], PeerAuth::default(), params(RoutingPolicy::Load))
            .unwrap()
            .only_decode_worker(Some("b".into()));
        let prefill = WorkerCard {
            role: Role::Prefill,
            ..card("p", 4, 1, CardState::Ready, "fp")
        };
        let (a, b) = (
            card("a", 1, 1, CardState::Ready, "fp"),
            card("b", 2, 1, CardState::Ready, "fp"),
        );
        pools.sync(&membership(&[a.clone(), b.clone(), prefill.clone()]));
        answer(&pools);
        for w in pools.prefill() {
            set(&w, true, stats("fp", 50, 0));
        }
        let decode: Vec<String> = pools.decode().iter().map(|w| w.id()).collect();
        assert_eq!(decode, ["b"]);
        assert_eq!(pools.prefill().len(), 1, "prefill workers still join");
        for _ in 0..8 {
            let r = route(&pools, 10, &[]).expect("routable");
            assert_eq!(r.decode.address, "127.0.0.1:2");
        }
        // Its worker gone, the router has no decode worker, never another one.
        pools.sync(&membership(&[a, prefill]));
        assert!(pools.decode().is_empty());
        assert!(route(&pools, 10, &[]).is_none());
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
    async fn a_burst_of_unrelated_prompts_spreads_over_idle_prefill_workers() {
        let pools = cluster(RoutingPolicy::CacheAware);
        // Routes held (their prefills not answered yet), as a burst's are.
        let burst: Vec<Route> = (0..4)
            .map(|i| route_tokens(&pools, &unrelated(i, 900)).unwrap())
            .collect();
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
        let snapshot = snapshot_of(&hashes[..10]);
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
    async fn a_refusal_is_counted_and_plans_nothing() {
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
            "{refused:?}"
        );
        assert_eq!(pools.decisions.of(Decision::RejectedTtft), 1);
        assert_eq!(pools.prefill()[0].planned_tokens(), 0);
        // A measured rate replaces the prior.
        let mut fast = stats("fp", 1000, 0);
        fast.prefill_tokens_per_s = 9000.0;
        for w in pools.prefill() {
            set(&w, true, fast.clone());
        }
        let ok = ask(Duration::from_millis(500)).unwrap();
        assert!((ok.estimated_ttft.as_secs_f64() - 0.1).abs() < 1e-6);
        assert_eq!(pools.prefill()[0].planned_tokens(), 900);
    }

    #[tokio::test]
    async fn a_burst_sharing_a_fresh_prompt_lands_on_the_worker_computing_it() {
        let pools = cluster(RoutingPolicy::CacheAware);
        let shared = unrelated(1, 1000);
        let burst: Vec<Route> = (0..8)
            .map(|i| {
                let mut p = shared.clone();
                p.extend(unrelated(10 + i, 12));
                route_tokens(&pools, &p).unwrap()
            })
            .collect();
        let firsts: Vec<&str> = burst.iter().map(first_prefill).collect();
        assert!(firsts.iter().all(|&f| f == firsts[0]), "{firsts:?}");
        // The first computes the prompt; the others are predicted to find its 62 full blocks
        // (the 63rd holds each call's own tokens).
        let predicted: Vec<u32> = burst.iter().map(|r| r.predicted_cached_tokens).collect();
        assert_eq!(predicted, [0, 992, 992, 992, 992, 992, 992, 992]);
        assert_eq!(pools.index.pending_count(), 8);
    }

    #[tokio::test]
    async fn a_follow_up_finds_the_placement_until_it_expires() {
        let pools = cluster(RoutingPolicy::CacheAware);
        let prompt = unrelated(2, 600);
        let first = route_tokens(&pools, &prompt).unwrap();
        let holder = first_prefill(&first).to_string();
        // The first request is done: nothing planned is left, the placement stays.
        drop(first);
        let second = route_tokens(&pools, &prompt).unwrap();
        assert_eq!(
            (first_prefill(&second), second.predicted_cached_tokens),
            (holder.as_str(), 592)
        );
        // Its events confirm the blocks: the placement ends, the index holds them.
        let w = pools
            .prefill()
            .into_iter()
            .find(|w| w.address == holder)
            .unwrap();
        let hashes = duet_kv::block_hashes(duet_kv::request_hash_seed("fp", ""), &prompt, 16);
        let snapshot = snapshot_of(&hashes);
        pools.index.apply(w.slot(), &snapshot);
        assert_eq!(pools.index.pending_count(), 0);
        // Without events, a placement lasts its time to live.
        let mut short = cluster(RoutingPolicy::CacheAware);
        short.params.pending_prefix_ttl = Duration::ZERO;
        drop(route_tokens(&short, &prompt).unwrap());
        assert_eq!(
            route_tokens(&short, &prompt)
                .unwrap()
                .predicted_cached_tokens,
            0
        );
    }
}
