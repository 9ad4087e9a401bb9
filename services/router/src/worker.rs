//! One worker the router routes to: its connections (one for request streams, one for polls,
//! so polls never queue behind or reset a stream), its last poll, the requests and prompt tokens
//! the router has on it, and its card. [`Worker::poll`] checks health (`grpc.health.v1`, the
//! service "") and asks `WorkerControl/Stats`; health comes from the connection, not from a slow
//! stats reply: a stats call that fails keeps the last stats, and a worker leaves rotation only
//! after [`HealthPolicy::unhealthy_after`] consecutive failed health checks, a refused
//! connection, or a NOT_SERVING answer. [`Worker::snapshot`] is what the routing policy sees of
//! it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use duet_cluster::{Role, WorkerCard};
use duet_proto::v1;
use duet_proto::v1::worker_control_client::WorkerControlClient;
use duet_proto::{PeerAuth, PeerChannel};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::kv_index::WorkerSlot;
use duet_routing::WorkerSnapshot;

/// Tokens the router planned on a worker stay counted this long after a poll started: the
/// time for the decode worker to ask the prefill worker, so that the stats then include them.
pub const PLAN_REPORT_GRACE: Duration = Duration::from_millis(250);

/// Blocks of headroom one millisecond of KV movement is worth when comparing decode workers.
pub const MOVE_PENALTY_BLOCKS_PER_MS: f64 = 1.0;

/// Where workers get their numbers ([`WorkerSlot`]) from.
static NEXT_SLOT: AtomicU64 = AtomicU64::new(1);

/// Where plans get their numbers from.
static NEXT_PLAN: AtomicU64 = AtomicU64::new(1);

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
    /// The prefill rate its stats report, and since when it has been that.
    rate_seen: Mutex<(f64, Instant)>,
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
            rate_seen: Mutex::new((0.0, Instant::now())),
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

    /// The worker a card describes.
    pub fn from_card(key: &str, card: &WorkerCard, auth: &PeerAuth) -> anyhow::Result<Self> {
        let w = Self::new(&card.grpc_address, card.role, auth)?;
        *w.card.lock().unwrap_or_else(|e| e.into_inner()) = Some((key.to_string(), card.clone()));
        Ok(w)
    }

    /// Takes a newer version of its card (same incarnation and address: a state change).
    pub fn set_card(&self, key: &str, card: &WorkerCard) {
        *self.card.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((key.to_string(), card.clone()));
    }

    /// What the routing policy sees of it now, holding `cached_tokens` of the prompt at hand.
    pub fn snapshot(&self, cached_tokens: usize) -> WorkerSnapshot {
        let status = self.status();
        let stats = status.stats.clone().unwrap_or_default();
        WorkerSnapshot {
            id: self.id(),
            address: self.address.clone(),
            healthy: status.healthy && status.stats.is_some(),
            card: self.card().map(|(_, c)| c.state),
            fingerprint: stats.model_fingerprint,
            free_blocks: stats.kv_blocks_free.saturating_add(stats.kv_blocks_cached),
            running: stats.running_sequences,
            in_flight: self.in_flight(),
            queued_tokens: stats.queued_prefill_tokens + self.planned_tokens(),
            prefill_rate: Some(stats.prefill_tokens_per_s).filter(|&r| r > 0.0),
            prefill_rate_age: self.rate_seen().1.elapsed(),
            kv_block_bytes: stats.kv_block_bytes,
            cached_tokens,
            accepted_prefill: stats.accepted_prefill_workers.map(|a| a.addresses.into()),
        }
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

    pub(crate) fn set_status(&self, f: impl FnOnce(&mut WorkerStatus)) {
        f(&mut self.status.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// Takes the worker out of rotation until its next good poll.
    pub fn mark_failed(&self, why: &str) {
        self.set_status(|s| {
            s.healthy = false;
            s.last_error = Some(why.to_string());
        });
    }

    /// The prefill rate its stats last reported, and when that rate was first reported.
    fn rate_seen(&self) -> (f64, Instant) {
        *self.rate_seen.lock().unwrap_or_else(|e| e.into_inner())
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
        if let Ok(st) = &stats {
            let mut seen = self.rate_seen.lock().unwrap_or_else(|e| e.into_inner());
            if seen.0 != st.prefill_tokens_per_s {
                *seen = (st.prefill_tokens_per_s, Instant::now());
            }
        }
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
}
