//! What `WorkerControl/Stats` reports, read without the engine thread: a snapshot the actor
//! publishes after every turn, and counters either side adds to.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use duet_kv::PoolStats;
use duet_proto::v1;

use crate::EngineHandle;

/// The engine thread's state after its last turn.
#[derive(Clone, Copy, Debug)]
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
}

/// Counters and gauges shared by the services and the engine thread.
#[derive(Debug, Default)]
pub struct Counters {
    /// Prompt tokens admitted but not computed yet (the handle adds, the engine thread
    /// subtracts).
    pub queued_tokens: AtomicU64,
    pub requests_served: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub prefix_hit_tokens: AtomicU64,
    pub transfer_bytes_in: AtomicU64,
    pub transfer_bytes_out: AtomicU64,
}

impl Counters {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn unqueue(&self, tokens: usize) {
        self.queued_tokens
            .fetch_sub(tokens as u64, Ordering::Relaxed);
    }
}

/// Steps computing fewer prompt tokens than this are not measured: their time is mostly the
/// decode tokens and the fixed cost of a step.
const MIN_MEASURED_PROMPT_TOKENS: usize = 16;

/// Weight of the newest step in the prefill rate's moving average.
const PREFILL_RATE_WEIGHT: f64 = 0.3;

/// The measured prefill speed: an exponential moving average of prompt tokens per second over
/// the steps that computed prompt tokens.
#[derive(Clone, Copy, Debug, Default)]
pub struct PrefillRate(Option<f64>);

impl PrefillRate {
    /// Takes in one step that computed `prompt_tokens` in `took`.
    pub fn measured(&mut self, prompt_tokens: usize, took: std::time::Duration) {
        if prompt_tokens < MIN_MEASURED_PROMPT_TOKENS || took.is_zero() {
            return;
        }
        let sample = prompt_tokens as f64 / took.as_secs_f64();
        self.0 = Some(match self.0 {
            Some(avg) => avg + PREFILL_RATE_WEIGHT * (sample - avg),
            None => sample,
        });
    }

    /// Tokens per second; 0 until measured.
    pub fn tokens_per_s(&self) -> f64 {
        self.0.unwrap_or(0.0)
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
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
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
            transfer_bytes_in: load(&c.transfer_bytes_in),
            transfer_bytes_out: load(&c.transfer_bytes_out),
            prefill_tokens_per_s: snap.prefill_tokens_per_s,
            kv_block_bytes: engine.info().wire.layout.block_bytes() as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn prefill_rate_averages_prompt_heavy_steps() {
        let mut r = PrefillRate::default();
        assert_eq!(r.tokens_per_s(), 0.0, "unmeasured");
        r.measured(4, Duration::from_millis(1));
        assert_eq!(
            r.tokens_per_s(),
            0.0,
            "a decode step is not a prefill measurement"
        );
        r.measured(1000, Duration::from_secs(1));
        assert_eq!(r.tokens_per_s(), 1000.0);
        r.measured(2000, Duration::from_secs(1));
        assert!((r.tokens_per_s() - 1300.0).abs() < 1e-9);
    }
}
