//! Worker pools and routing decisions.
//!
//! The router knows its workers from flags (static) and from the cluster's worker cards
//! ([`Pools::sync`] diffs each new membership against the pools). Each one is polled every
//! stats interval (`grpc.health.v1` check of the service "" and `WorkerControl/Stats`); a worker
//! is routable only when both answered, the health check said SERVING, its model fingerprint
//! equals the cluster's (the most common fingerprint among the answering workers), and — for a
//! worker known from a card — its card is present and `ready`. A decode worker whose call fails
//! is taken out of rotation until its next good poll.
//!
//! Decisions are pure functions over snapshots ([`pick_decode`], [`rank_prefill`],
//! [`consensus_fingerprint`]) so they are unit-tested without a network.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use duet_cluster::{CardState, Membership, Role, WorkerCard};
use duet_proto::v1;
use duet_proto::v1::worker_control_client::WorkerControlClient;
use duet_proto::{ClusterToken, PeerChannel};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// Blocks of KV headroom one running sequence (or one request the router sent since the last
/// stats) is worth when comparing decode workers.
pub const RUNNING_PENALTY_BLOCKS: i64 = 4;

/// Prefill rate (tokens per unit time) assumed for a worker until it is measured.
pub const DEFAULT_PREFILL_RATE: f64 = 1.0;

/// The last poll of a worker.
#[derive(Clone, Debug, Default)]
pub struct WorkerStatus {
    /// The health check said SERVING and the stats answered (cleared when a call fails).
    pub healthy: bool,
    /// The last stats received.
    pub stats: Option<v1::StatsResponse>,
    /// Why the worker is not healthy, when it is not.
    pub last_error: Option<String>,
}

/// One worker the router routes to.
#[derive(Debug)]
pub struct Worker {
    pub address: String,
    pub role: Role,
    channel: PeerChannel,
    status: Mutex<WorkerStatus>,
    /// Requests the router has on this worker right now.
    in_flight: AtomicU32,
    /// Estimated prefill rate (prefill workers).
    pub prefill_rate: f64,
    /// The card it is known from, and the card's key (`None`: named by a flag).
    card: Mutex<Option<(String, WorkerCard)>>,
}

/// Counts a request on a worker while alive.
pub struct InFlight(Arc<Worker>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Worker {
    /// A worker at `address` (host:port, or a URI) whose calls carry `token`; connects lazily.
    pub fn new(address: &str, role: Role, token: Option<ClusterToken>) -> anyhow::Result<Self> {
        let channel = duet_proto::channel(address, token)?;
        Ok(Self {
            address: address.to_string(),
            role,
            channel,
            status: Mutex::new(WorkerStatus::default()),
            in_flight: AtomicU32::new(0),
            prefill_rate: DEFAULT_PREFILL_RATE,
            card: Mutex::new(None),
        })
    }

    /// The worker a card describes.
    pub fn from_card(
        key: &str,
        card: &WorkerCard,
        token: Option<ClusterToken>,
    ) -> anyhow::Result<Self> {
        let w = Self::new(&card.grpc_address, card.role, token)?;
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

    /// Polls health and stats once, each bounded by `timeout`.
    pub async fn poll(&self, timeout: Duration) {
        let health = async {
            let mut req = tonic::Request::new(HealthCheckRequest {
                service: String::new(),
            });
            req.set_timeout(timeout);
            let r = tokio::time::timeout(timeout, HealthClient::new(self.channel()).check(req))
                .await
                .map_err(|_| "health check timed out".to_string())?
                .map_err(|s| format!("health check failed: {}", s.message()))?;
            match r.into_inner().status() {
                ServingStatus::Serving => Ok(()),
                other => Err(format!("health check says {}", other.as_str_name())),
            }
        };
        let stats = async {
            let mut req = tonic::Request::new(v1::StatsRequest {});
            req.set_timeout(timeout);
            tokio::time::timeout(timeout, WorkerControlClient::new(self.channel()).stats(req))
                .await
                .map_err(|_| "stats timed out".to_string())?
                .map(|r| r.into_inner())
                .map_err(|s| format!("stats failed: {}", s.message()))
        };
        let (health, stats) = tokio::join!(health, stats);
        self.set_status(|s| match (health, stats) {
            (Ok(()), Ok(st)) => {
                s.healthy = true;
                s.stats = Some(st);
                s.last_error = None;
            }
            (h, st) => {
                let mut why = h.err();
                match st {
                    Ok(st) => s.stats = Some(st),
                    Err(e) => why = Some(why.map_or(e.clone(), |w| format!("{w}; {e}"))),
                }
                s.healthy = false;
                s.last_error = why;
            }
        });
    }
}

/// A decode worker's load, as routing sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeLoad {
    /// Blocks available for new work (free plus evictable cached).
    pub free_blocks: u32,
    /// Sequences in its running batch.
    pub running: u32,
    /// Requests the router has on it.
    pub in_flight: u32,
}

/// Score of a decode worker: more is better.
pub fn decode_score(l: DecodeLoad) -> i64 {
    l.free_blocks as i64 - RUNNING_PENALTY_BLOCKS * (l.running as i64 + l.in_flight as i64)
}

/// The candidate (by its key) with the best score; ties go to the first.
pub fn pick_decode<K: Copy>(candidates: &[(K, DecodeLoad)]) -> Option<K> {
    let mut best: Option<(K, i64)> = None;
    for &(k, load) in candidates {
        let s = decode_score(load);
        if best.is_none_or(|(_, b)| s > b) {
            best = Some((k, s));
        }
    }
    best.map(|(k, _)| k)
}

/// A prefill worker's load, as routing sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillLoad {
    pub queued_tokens: u64,
    /// Tokens per unit time (> 0).
    pub rate: f64,
}

/// Candidates (by key) ordered by estimated time to first token,
/// `(queued + prompt_tokens) / rate`, best first; ties keep their order.
pub fn rank_prefill<K: Copy>(prompt_tokens: usize, candidates: &[(K, PrefillLoad)]) -> Vec<K> {
    let mut scored: Vec<(K, f64)> = candidates
        .iter()
        .map(|&(k, l)| {
            let rate = if l.rate > 0.0 {
                l.rate
            } else {
                DEFAULT_PREFILL_RATE
            };
            (k, (l.queued_tokens as f64 + prompt_tokens as f64) / rate)
        })
        .collect();
    scored.sort_by(|a, b| a.1.total_cmp(&b.1));
    scored.into_iter().map(|(k, _)| k).collect()
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
#[derive(Clone, Debug)]
pub struct Route {
    pub decode: Arc<Worker>,
    pub plan: v1::PrefillPlan,
    /// The cluster's model fingerprint (empty when unknown).
    pub fingerprint: String,
}

/// The prefill and decode pools: the workers named by flags, and those known from cards.
#[derive(Debug, Default)]
pub struct Pools {
    decode: RwLock<Vec<Arc<Worker>>>,
    prefill: RwLock<Vec<Arc<Worker>>>,
    /// Set once polling started: workers added later are polled from then on.
    poll_interval: Mutex<Option<Duration>>,
    /// What every call to a worker carries, those known from cards included.
    token: Option<ClusterToken>,
}

impl Pools {
    /// The pools of workers at these addresses; every call to them carries `token`.
    pub fn new(
        decode: &[String],
        prefill: &[String],
        token: Option<ClusterToken>,
    ) -> anyhow::Result<Self> {
        let make = |list: &[String], role| -> anyhow::Result<Vec<Arc<Worker>>> {
            list.iter()
                .map(|a| a.trim())
                .filter(|a| !a.is_empty())
                .map(|a| Worker::new(a, role, token.clone()).map(Arc::new))
                .collect()
        };
        Ok(Self {
            decode: RwLock::new(make(decode, Role::Decode)?),
            prefill: RwLock::new(make(prefill, Role::Prefill)?),
            poll_interval: Mutex::new(None),
            token,
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
            spawn_poller(&w, interval);
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
                match Worker::from_card(key, card, self.token.clone()) {
                    Ok(w) => {
                        let w = Arc::new(w);
                        if let Some(interval) = interval {
                            spawn_poller(&w, interval);
                        }
                        tracing::info!(key, address = %card.grpc_address, incarnation = card.incarnation, "worker joined");
                        pool.push(w);
                    }
                    Err(e) => tracing::warn!(key, error = %e, "skipping a worker card"),
                }
            }
        }
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

    /// Chooses a decode worker (whose address is not among `exclude`) and builds the prefill
    /// plan for a prompt of `prompt_tokens`. `None`: no routable decode worker is left.
    pub fn route(
        &self,
        prompt_tokens: usize,
        local_threshold: u32,
        exclude: &[String],
    ) -> Option<Route> {
        let fingerprint = self.fingerprint();
        let decode = self.decode();
        let prefill_pool = self.prefill();
        let candidates: Vec<(usize, DecodeLoad)> = decode
            .iter()
            .enumerate()
            .filter(|(_, w)| !exclude.contains(&w.address))
            .filter_map(|(i, w)| {
                let st = Self::routable(w, &fingerprint)?;
                Some((
                    i,
                    DecodeLoad {
                        free_blocks: st.kv_blocks_free.saturating_add(st.kv_blocks_cached),
                        running: st.running_sequences,
                        in_flight: w.in_flight(),
                    },
                ))
            })
            .collect();
        let decode_index = pick_decode(&candidates)?;
        let prefill: Vec<(usize, PrefillLoad)> = prefill_pool
            .iter()
            .enumerate()
            .filter_map(|(i, w)| {
                let st = Self::routable(w, &fingerprint)?;
                Some((
                    i,
                    PrefillLoad {
                        queued_tokens: st.queued_prefill_tokens,
                        rate: w.prefill_rate,
                    },
                ))
            })
            .collect();
        let plan = if prompt_tokens <= local_threshold as usize || prefill.is_empty() {
            v1::PrefillPlan {
                local: true,
                prefill_workers: vec![],
            }
        } else {
            v1::PrefillPlan {
                local: false,
                prefill_workers: rank_prefill(prompt_tokens, &prefill)
                    .into_iter()
                    .map(|i| v1::PrefillTarget {
                        worker_id: prefill_pool[i].id(),
                        address: prefill_pool[i].address.clone(),
                    })
                    .collect(),
            }
        };
        Some(Route {
            decode: decode[decode_index].clone(),
            plan,
            fingerprint: fingerprint.unwrap_or_default(),
        })
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

/// Polls `worker` every `interval` while it exists.
fn spawn_poller(worker: &Arc<Worker>, interval: Duration) {
    let timeout = interval.max(Duration::from_millis(200));
    let weak: Weak<Worker> = Arc::downgrade(worker);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(w) = weak.upgrade() else { return };
            w.poll(timeout).await;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(free_blocks: u32, running: u32, in_flight: u32) -> DecodeLoad {
        DecodeLoad {
            free_blocks,
            running,
            in_flight,
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
    }

    #[test]
    fn prefill_ranked_by_estimated_ttft() {
        let l = |q, rate| PrefillLoad {
            queued_tokens: q,
            rate,
        };
        assert_eq!(
            rank_prefill(100, &[(0, l(500, 1.0)), (1, l(0, 1.0)), (2, l(100, 1.0))]),
            [1, 2, 0]
        );
        // A faster worker wins despite a longer queue; rate 0 is treated as the default.
        assert_eq!(
            rank_prefill(100, &[(0, l(0, 1.0)), (1, l(300, 10.0))]),
            [1, 0]
        );
        assert_eq!(rank_prefill(10, &[(0, l(5, 0.0)), (1, l(1, 1.0))]), [1, 0]);
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
            None,
        )
        .unwrap();
        assert!(pools.route(10, 32, &[]).is_none());
        set(&pools.decode()[0], true, stats("fp", 10, 0));
        set(&pools.decode()[1], true, stats("fp", 50, 0));
        // Most free blocks, but another model: not routable.
        set(&pools.decode()[2], true, stats("other", 90, 0));
        let r = pools.route(10, 32, &[]).unwrap();
        assert_eq!(r.decode.address, "127.0.0.1:2");
        assert_eq!(r.fingerprint, "fp");
        assert!(r.plan.local, "short prompt: local");
        // Long prompt but no healthy prefill worker: local.
        assert!(pools.route(100, 32, &[]).unwrap().plan.local);
        set(&pools.prefill()[0], true, stats("fp", 1, 500));
        set(&pools.prefill()[1], true, stats("fp", 2, 10));
        let r = pools.route(100, 32, &[]).unwrap();
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
            pools.route(10, 32, &tried).unwrap().decode.address,
            "127.0.0.1:1"
        );
        pools.decode()[0].mark_failed("boom");
        assert!(pools.route(10, 32, &tried).is_none());
        // In-flight requests count against a worker.
        let _g: Vec<InFlight> = (0..11).map(|_| pools.decode()[1].begin()).collect();
        set(&pools.decode()[0], true, stats("fp", 10, 0));
        assert_eq!(
            pools.route(10, 32, &[]).unwrap().decode.address,
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
        let pools = Pools::new(&["127.0.0.1:9".into()], &[], None).unwrap();
        let a = card("a", 1, 1, CardState::Ready, "fp");
        let b = card("b", 2, 1, CardState::Joining, "fp");
        let other = card("c", 3, 1, CardState::Ready, "other-model");
        pools.sync(&membership(&[a.clone(), b.clone(), other]));
        answer(&pools);
        let routable = |pools: &Pools| -> Vec<String> {
            let mut tried = Vec::new();
            while let Some(r) = pools.route(10, 32, &tried) {
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
}
