//! The routing decision: for one attempt of one request, which decode worker serves it and where
//! its prompt is prefilled, or why it is refused.
//!
//! [`select`] is a pure function over plain data, as Dynamo's `WorkerSelector` is: the request's
//! size, what is left of its deadline and the decode workers it already tried
//! ([`PolicyRequest`]), and one [`WorkerSnapshot`] per worker (health, card state, model, KV
//! headroom, running batch, queued prompt tokens, measured prefill rate, prefix overlap with this
//! prompt, bytes per KV block). No channels, clocks or tasks: the router's `Pools` takes the
//! snapshots from its live workers, calls it, and carries the decision out; the planner's
//! simulator (`duet-planner`) takes them from simulated workers, so what it predicts is decided
//! by this same code.
//!
//! Under the cache-aware policy it:
//! - picks the decode worker with the most KV headroom, less its running batch and the time to
//!   move the prompt's KV it does not hold ([`decode_score`]);
//! - ranks the prefill workers that decode worker accepts (those its card or `--prefill` names)
//!   by estimated time to first token: (queued prompt tokens + this
//!   prompt's tokens not cached there) ÷ the worker's measured prefill rate
//!   ([`estimated_ttft_s`]), where a measured rate counts as at least a share of the
//!   pool's median ([`prefill_rates`]); the workers are ranked by that estimate plus a share of
//!   the prompt's own compute there ([`prefill_score`]), so a worker holding the prompt's prefix
//!   wins unless it is clearly slower to answer;
//! - prefills on the decode worker itself when the prompt's uncached part there is short, or
//!   when the prefill pool is saturated (its best estimate is worse than
//!   `--prefill-saturation-factor` times the decode worker's own);
//! - refuses when the chosen plan's estimate passes the request's deadline.
//!
//! The load policy is the same with every prefix cache taken as empty; the random policy picks
//! the decode worker and the first prefill worker at random.

use std::sync::Arc;
use std::time::Duration;

use duet_cluster::CardState;

/// Blocks of KV headroom one running sequence (or one request the router sent since the last
/// stats) is worth when comparing decode workers.
pub const RUNNING_PENALTY_BLOCKS: i64 = 4;

/// Prefill rate (prompt tokens per second) assumed while no worker has reported a measured one:
/// the order of a small model on a few CPU cores.
pub const DEFAULT_PREFILL_RATE: f64 = 1000.0;

/// Blocks of headroom one millisecond of KV movement is worth when comparing decode workers.
pub const MOVE_PENALTY_BLOCKS_PER_MS: f64 = 1.0;

/// Prefill workers are ranked by estimated time to first token plus this share of the time the
/// prompt's own uncached tokens take there: a placement's compute delays every later prompt on
/// that worker, so a worker holding (or about to hold) the prompt's prefix is preferred unless
/// it is clearly slower to answer. A burst sharing a fresh prompt then lands on the worker
/// computing it, though that worker's queue holds the first of them, while unrelated prompts
/// still spread by their estimates.
pub const COMPUTE_WEIGHT: f64 = 0.5;

/// A measured prefill rate counts as at least this share of the median of the workers'
/// measured rates. One pathological sample (a worker stopped in the middle of a prefill) would
/// otherwise pin a worker's rate so low that it is never sent the work that would measure it
/// again; a worker this slow on a real measurement still ranks last.
pub const RATE_FLOOR_OF_MEDIAN: f64 = 0.25;

/// A measured prefill rate that has not changed for this long counts half-way toward the median
/// of the measured rates (a quarter after twice as long, ...). A worker the router sends nothing
/// measures nothing new, so a low measurement (its worst moment) would otherwise keep it unused
/// for good; decayed, it is sent work again now and then, and that work measures it afresh.
pub const RATE_HALF_LIFE: Duration = Duration::from_secs(10);

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

/// How the decision is tuned (router flags).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PolicyParams {
    pub policy: RoutingPolicy,
    /// Uncached prompt parts of at most this many tokens are prefilled on the decode worker.
    pub local_prefill_threshold: u32,
    /// Bytes per second the KV transport moves between a prefill and a decode worker.
    pub kv_link_bytes_per_s: f64,
    /// The prefill pool is saturated when its best estimated TTFT is worse than this many
    /// times the decode worker's own; 0: never.
    pub prefill_saturation_factor: f64,
}

/// One worker as the decision sees it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkerSnapshot {
    /// Its worker id (from its card or stats), as a prefill plan names it.
    pub id: String,
    /// Where it is called.
    pub address: String,
    /// Its health checks pass and it has answered stats.
    pub healthy: bool,
    /// Its card's state; `None` for a worker named by a flag.
    pub card: Option<CardState>,
    /// The model fingerprint its stats report.
    pub fingerprint: String,
    /// KV blocks available for new work (free plus evictable cached).
    pub free_blocks: u32,
    /// Sequences in its running batch.
    pub running: u32,
    /// Requests the router has on it.
    pub in_flight: u32,
    /// Prompt tokens queued there: reported, plus planned by the router since.
    pub queued_tokens: u64,
    /// Prompt tokens per second it measured; `None` until it has prefilled enough to measure.
    pub prefill_rate: Option<f64>,
    /// How long its measured rate has stayed the same (no prompt measured since).
    pub prefill_rate_age: Duration,
    /// Bytes one KV block takes (every layer, K and V).
    pub kv_block_bytes: u64,
    /// Tokens of this request's prompt in its prefix cache, as its engine would find them.
    pub cached_tokens: usize,
    /// A decode worker's: the addresses of the prefill workers it accepts in a plan; `None`:
    /// not known (every one is planned, and one it refuses is prefilled on it instead).
    pub accepted_prefill: Option<Arc<[String]>>,
}

impl WorkerSnapshot {
    /// Whether this decode worker accepts `prefill` in a plan.
    pub fn accepts(&self, prefill: &WorkerSnapshot) -> bool {
        self.accepted_prefill
            .as_ref()
            .is_none_or(|a| a.contains(&prefill.address))
    }
}

/// What one attempt asks of the decision.
#[derive(Clone, Copy, Debug)]
pub struct PolicyRequest<'a> {
    /// Tokens to prefill (the prompt, plus tokens streamed before a failover).
    pub tokens: usize,
    /// Tokens per KV block (0 while no worker has reported it).
    pub block_size: usize,
    /// The cluster's model fingerprint (`None` while no worker has answered).
    pub fingerprint: Option<&'a str>,
    /// Decode workers (addresses) not to use: tried already.
    pub exclude: &'a [String],
    /// What is left of the request's deadline.
    pub deadline_left: Duration,
    /// A uniformly random number: the random policy's only source of choice.
    pub random: u64,
}

/// Why a request was routed as it was (the label of its count).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Prefilled on a prefill worker, KV moved to the decode worker.
    Remote,
    /// Prefilled on the decode worker: the prompt's part not cached there is short.
    LocalShortSuffix,
    /// Prefilled on the decode worker: no prefill worker it accepts is routable.
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

/// The decision for one attempt.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    /// The decode worker (an index into the decode snapshots).
    pub decode: usize,
    /// The prefill plan: prefill workers (indices into the prefill snapshots), best first;
    /// empty when the decode worker prefills the prompt itself.
    pub prefill: Vec<usize>,
    pub decision: Decision,
    /// Prompt tokens the prefilling worker holds in its prefix cache.
    pub predicted_cached_tokens: usize,
    /// The estimated time to first token of the plan.
    pub estimated_ttft: Duration,
}

/// Why no placement was given.
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

/// Whether a worker may be given work: healthy, its card (if any) ready, and serving the
/// cluster's model.
pub fn routable(w: &WorkerSnapshot, fingerprint: Option<&str>) -> bool {
    w.healthy
        && w.card.is_none_or(|c| c == CardState::Ready)
        && fingerprint.is_none_or(|f| f == w.fingerprint)
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

/// A decode worker's load, as the decision compares them.
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

/// A worker's prefill load for one prompt, as the decision compares them.
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

/// What a prefill worker is ranked by, in seconds (less is better): its estimated time to
/// first token plus [`COMPUTE_WEIGHT`] of the prompt's own compute there.
pub fn prefill_score(l: PrefillLoad) -> f64 {
    estimated_ttft_s(l)
        + COMPUTE_WEIGHT
            * estimated_ttft_s(PrefillLoad {
                queued_tokens: 0,
                ..l
            })
}

/// Candidates (by key) with their estimated time to first token, best [`prefill_score`] first;
/// ties keep their order.
pub fn rank_prefill<K: Copy>(candidates: &[(K, PrefillLoad)]) -> Vec<(K, f64)> {
    let mut scored: Vec<(K, f64, f64)> = candidates
        .iter()
        .map(|&(k, l)| (k, estimated_ttft_s(l), prefill_score(l)))
        .collect();
    scored.sort_by(|a, b| a.2.total_cmp(&b.2));
    scored.into_iter().map(|(k, t, _)| (k, t)).collect()
}

/// The prefill rate each worker is estimated at: its measured one, raised to at least
/// [`RATE_FLOOR_OF_MEDIAN`] of the median measured rate and decayed toward that median as the
/// measurement ages ([`RATE_HALF_LIFE`]); the mean of the (raised) measured rates for a worker
/// that has measured none (comparing it with the others at a constant prior would prefer it, or
/// them, for no reason: the workers run the same model).
pub fn prefill_rates<'a>(workers: impl IntoIterator<Item = &'a WorkerSnapshot>) -> RateEstimates {
    let mut measured: Vec<f64> = workers
        .into_iter()
        .filter_map(|w| w.prefill_rate)
        .filter(|&r| r > 0.0)
        .collect();
    measured.sort_by(f64::total_cmp);
    let median = match measured.len() {
        0 => DEFAULT_PREFILL_RATE,
        n if n % 2 == 1 => measured[n / 2],
        n => (measured[n / 2 - 1] + measured[n / 2]) / 2.0,
    };
    let floor = median * RATE_FLOOR_OF_MEDIAN;
    let unmeasured = if measured.is_empty() {
        DEFAULT_PREFILL_RATE
    } else {
        measured.iter().map(|r| r.max(floor)).sum::<f64>() / measured.len() as f64
    };
    RateEstimates {
        median,
        floor,
        unmeasured,
    }
}

/// See [`prefill_rates`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RateEstimates {
    /// The median measured rate, what old measurements decay toward.
    pub median: f64,
    /// No measured rate counts as lower than this.
    pub floor: f64,
    /// The rate of a worker that has measured none.
    pub unmeasured: f64,
}

impl RateEstimates {
    /// The rate `w` is estimated at.
    pub fn of(&self, w: &WorkerSnapshot) -> f64 {
        match w.prefill_rate {
            Some(r) if r > 0.0 => {
                let kept =
                    0.5f64.powf(w.prefill_rate_age.as_secs_f64() / RATE_HALF_LIFE.as_secs_f64());
                self.median + (r.max(self.floor) - self.median) * kept
            }
            _ => self.unmeasured,
        }
    }
}

/// Chooses the decode worker and the prefill plan for one attempt (see the module).
pub fn select(
    params: &PolicyParams,
    req: &PolicyRequest<'_>,
    decode: &[WorkerSnapshot],
    prefill: &[WorkerSnapshot],
) -> Result<Placement, NoRoute> {
    let policy = params.policy;
    let n = req.tokens;
    let block_size = req.block_size.max(1);
    let cached = |w: &WorkerSnapshot| match policy {
        RoutingPolicy::CacheAware => w.cached_tokens.min(n),
        _ => 0,
    };
    let rates = prefill_rates(decode.iter().chain(prefill));
    let load_of = |w: &WorkerSnapshot| PrefillLoad {
        queued_tokens: w.queued_tokens,
        uncached_tokens: (n - cached(w)) as u64,
        rate: rates.of(w),
    };
    let candidates: Vec<(usize, DecodeLoad)> = decode
        .iter()
        .enumerate()
        .filter(|(_, w)| !req.exclude.contains(&w.address) && routable(w, req.fingerprint))
        .map(|(i, w)| {
            let move_ms = match policy {
                RoutingPolicy::CacheAware => {
                    let moved_blocks = n.div_ceil(block_size) - cached(w) / block_size;
                    (moved_blocks as f64 * w.kv_block_bytes as f64)
                        / params.kv_link_bytes_per_s.max(1.0)
                        * 1e3
                }
                _ => 0.0,
            };
            let load = DecodeLoad {
                free_blocks: w.free_blocks,
                running: w.running,
                in_flight: w.in_flight,
                move_ms,
            };
            (i, load)
        })
        .collect();
    let d = match policy {
        RoutingPolicy::Random if !candidates.is_empty() => {
            Some(candidates[(req.random % candidates.len() as u64) as usize].0)
        }
        _ => pick_decode(&candidates),
    }
    .ok_or(NoRoute::NoDecodeWorker)?;
    let local_load = load_of(&decode[d]);
    let local_ttft = estimated_ttft_s(local_load);
    let loads: Vec<(usize, PrefillLoad)> = prefill
        .iter()
        .enumerate()
        .filter(|(_, w)| routable(w, req.fingerprint) && decode[d].accepts(w))
        .map(|(i, w)| (i, load_of(w)))
        .collect();
    let mut ranked = rank_prefill(&loads);
    if policy == RoutingPolicy::Random && !ranked.is_empty() {
        let k = ((req.random >> 32) % ranked.len() as u64) as usize;
        ranked.rotate_left(k);
    }
    let decision = match ranked.first() {
        _ if local_load.uncached_tokens <= params.local_prefill_threshold as u64 => {
            Decision::LocalShortSuffix
        }
        None => Decision::LocalNoPrefillWorker,
        Some(&(_, best))
            if policy != RoutingPolicy::Random
                && params.prefill_saturation_factor > 0.0
                && best > params.prefill_saturation_factor * local_ttft =>
        {
            Decision::LocalPrefillSaturated
        }
        Some(_) => Decision::Remote,
    };
    let (prefill_plan, estimate, load, prefilling) = if decision == Decision::Remote {
        let (first, estimate) = ranked[0];
        let plan = ranked.iter().map(|&(i, _)| i).collect();
        (plan, estimate, load_of(&prefill[first]), &prefill[first])
    } else {
        (Vec::new(), local_ttft, local_load, &decode[d])
    };
    let estimated_ttft = Duration::from_secs_f64(estimate.max(0.0));
    let left = req.deadline_left;
    if estimated_ttft > left {
        let alone = estimated_ttft_s(PrefillLoad {
            queued_tokens: 0,
            ..load
        });
        let alone = Duration::from_secs_f64(alone.max(0.0));
        return Err(if alone >= left {
            NoRoute::DeadlineTooShort { alone, left }
        } else {
            NoRoute::PastDeadline {
                estimated: estimated_ttft,
                left,
            }
        });
    }
    Ok(Placement {
        decode: d,
        prefill: prefill_plan,
        decision,
        predicted_cached_tokens: cached(prefilling),
        estimated_ttft,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARAMS: PolicyParams = PolicyParams {
        policy: RoutingPolicy::CacheAware,
        local_prefill_threshold: 32,
        kv_link_bytes_per_s: 1e9,
        prefill_saturation_factor: 2.0,
    };

    /// A healthy, ready worker of model "fp" with `free` blocks, `queued` prompt tokens and
    /// `cached` tokens of the prompt.
    fn w(address: &str, free: u32, queued: u64, cached: usize) -> WorkerSnapshot {
        WorkerSnapshot {
            id: format!("id-{address}"),
            address: address.into(),
            healthy: true,
            card: None,
            fingerprint: "fp".into(),
            free_blocks: free,
            queued_tokens: queued,
            cached_tokens: cached,
            kv_block_bytes: 1 << 20,
            ..Default::default()
        }
    }

    fn ask(tokens: usize, deadline_left: Duration) -> PolicyRequest<'static> {
        PolicyRequest {
            tokens,
            block_size: 16,
            fingerprint: Some("fp"),
            exclude: &[],
            deadline_left,
            random: 0,
        }
    }

    const PLENTY: Duration = Duration::from_secs(600);

    /// One row of the table: its name, the request, the decode and the prefill workers, and the
    /// outcome.
    type Case = (
        &'static str,
        PolicyRequest<'static>,
        Vec<WorkerSnapshot>,
        Vec<WorkerSnapshot>,
        Outcome,
    );

    /// What a decision is reduced to in the table: the decode worker's address, the plan's
    /// addresses (empty: local) and the reason; or the refusal.
    type Outcome = Result<(String, Vec<String>, Decision), NoRoute>;

    fn outcome(
        params: &PolicyParams,
        req: &PolicyRequest<'_>,
        decode: &[WorkerSnapshot],
        prefill: &[WorkerSnapshot],
    ) -> Outcome {
        select(params, req, decode, prefill).map(|p| {
            let plan = p.prefill.iter().map(|&i| prefill[i].address.clone());
            (decode[p.decode].address.clone(), plan.collect(), p.decision)
        })
    }

    fn ok(decode: &str, plan: &[&str], decision: Decision) -> Outcome {
        let plan = plan.iter().map(|s| s.to_string()).collect();
        Ok((decode.into(), plan, decision))
    }

    #[test]
    fn decisions_as_a_table() {
        let draining = WorkerSnapshot {
            card: Some(CardState::Draining),
            ..w("d-draining", 1000, 0, 0)
        };
        let joining = WorkerSnapshot {
            card: Some(CardState::Joining),
            ..w("p-joining", 100, 0, 0)
        };
        let unhealthy = WorkerSnapshot {
            healthy: false,
            ..w("p-down", 100, 0, 0)
        };
        let other_model = WorkerSnapshot {
            fingerprint: "other".into(),
            ..w("d-other", 5000, 0, 0)
        };
        let measured = |address: &str, rate: f64| WorkerSnapshot {
            prefill_rate: Some(rate),
            ..w(address, 100, 0, 0)
        };
        let busy = |address: &str| w(address, 100, 5000, 0);
        let holder = |address: &str| w(address, 100, 300, 320);
        let short_deadline = Duration::from_millis(500);
        let table: Vec<Case> = vec![
            (
                "a short prompt prefills on the decode worker",
                ask(20, PLENTY),
                vec![w("d1", 100, 0, 0)],
                vec![w("p1", 100, 0, 0)],
                ok("d1", &[], Decision::LocalShortSuffix),
            ),
            (
                "a long prompt goes to the prefill pool, ranked by estimated TTFT",
                ask(400, PLENTY),
                vec![w("d1", 100, 0, 0)],
                vec![w("p1", 100, 500, 0), w("p2", 100, 10, 0)],
                ok("d1", &["p2", "p1"], Decision::Remote),
            ),
            (
                "a long prompt with no routable prefill worker prefills locally",
                ask(400, PLENTY),
                vec![w("d1", 100, 0, 0)],
                vec![unhealthy.clone(), joining.clone()],
                ok("d1", &[], Decision::LocalNoPrefillWorker),
            ),
            (
                "a saturated prefill pool prefills on the decode worker",
                ask(200, PLENTY),
                vec![w("d1", 100, 0, 0)],
                vec![busy("p1"), busy("p2")],
                ok("d1", &[], Decision::LocalPrefillSaturated),
            ),
            (
                "the decode worker with the most headroom, less its running batch",
                ask(20, PLENTY),
                vec![
                    w("d1", 10, 0, 0),
                    WorkerSnapshot {
                        running: 2,
                        in_flight: 1,
                        ..w("d2", 20, 0, 0)
                    },
                    w("d3", 15, 0, 0),
                ],
                vec![],
                ok("d3", &[], Decision::LocalShortSuffix),
            ),
            (
                "a draining decode worker and one of another model are passed over",
                ask(20, PLENTY),
                vec![draining.clone(), other_model.clone(), w("d1", 10, 0, 0)],
                vec![],
                ok("d1", &[], Decision::LocalShortSuffix),
            ),
            (
                "cache overlap beats load: the holder of the prefix, though busier",
                ask(400, PLENTY),
                vec![w("d1", 100, 0, 0)],
                vec![w("p-idle", 100, 0, 0), holder("p-holder")],
                ok("d1", &["p-holder", "p-idle"], Decision::Remote),
            ),
            (
                "a faster measured worker beats a shorter queue",
                ask(400, PLENTY),
                vec![w("d1", 100, 0, 0)],
                vec![
                    measured("p-slow", 100.0),
                    WorkerSnapshot {
                        queued_tokens: 300,
                        ..measured("p-fast", 10_000.0)
                    },
                ],
                ok("d1", &["p-fast", "p-slow"], Decision::Remote),
            ),
            (
                "only the prefill workers the decode worker accepts are planned",
                ask(400, PLENTY),
                vec![WorkerSnapshot {
                    accepted_prefill: Some(["p2".to_string()].into()),
                    ..w("d1", 100, 0, 0)
                }],
                // p1, idle, would rank first.
                vec![w("p1", 100, 0, 0), w("p2", 100, 10, 0)],
                ok("d1", &["p2"], Decision::Remote),
            ),
            (
                "a decode worker that accepts no prefill worker prefills locally",
                ask(400, PLENTY),
                vec![WorkerSnapshot {
                    accepted_prefill: Some([].into()),
                    ..w("d1", 100, 0, 0)
                }],
                vec![w("p1", 100, 0, 0)],
                ok("d1", &[], Decision::LocalNoPrefillWorker),
            ),
            (
                "no routable decode worker",
                ask(20, PLENTY),
                vec![draining, other_model],
                vec![w("p1", 100, 0, 0)],
                Err(NoRoute::NoDecodeWorker),
            ),
            (
                // 900 tokens at the prior 1000 tokens/s: 0.9 s alone.
                "a deadline shorter than the prompt's own prefill",
                ask(900, short_deadline),
                vec![w("d1", 100, 0, 0)],
                vec![w("p1", 100, 0, 0)],
                Err(NoRoute::DeadlineTooShort {
                    alone: Duration::from_millis(900),
                    left: short_deadline,
                }),
            ),
            (
                "a deadline the prompt alone meets, missed for the queues",
                ask(900, Duration::from_secs(2)),
                vec![w("d1", 100, 2000, 0)],
                vec![w("p1", 100, 2000, 0)],
                Err(NoRoute::PastDeadline {
                    estimated: Duration::from_millis(2900),
                    left: Duration::from_secs(2),
                }),
            ),
        ];
        for (case, req, decode, prefill, expected) in table {
            assert_eq!(
                outcome(&PARAMS, &req, &decode, &prefill),
                expected,
                "{case}"
            );
        }
    }

    #[test]
    fn the_load_policy_ignores_caches_and_the_random_one_uses_its_number() {
        let load = PolicyParams {
            policy: RoutingPolicy::Load,
            ..PARAMS
        };
        let decode = [w("d1", 100, 0, 0)];
        let prefill = [w("p-idle", 100, 0, 0), w("p-holder", 100, 300, 320)];
        let placed = select(&load, &ask(400, PLENTY), &decode, &prefill).unwrap();
        assert_eq!(
            (placed.prefill.clone(), placed.predicted_cached_tokens),
            (vec![0, 1], 0)
        );
        // The same prompt under the cache-aware policy predicts the holder's 320 tokens.
        let placed = select(&PARAMS, &ask(400, PLENTY), &decode, &prefill).unwrap();
        assert_eq!(
            (placed.prefill[0], placed.predicted_cached_tokens),
            (1, 320)
        );
        let random = PolicyParams {
            policy: RoutingPolicy::Random,
            ..PARAMS
        };
        let decode = [w("d1", 100, 0, 0), w("d2", 100, 0, 0), w("d3", 1000, 0, 0)];
        let picks: Vec<(usize, usize)> = [0u64, 1, 2, 1 << 32]
            .iter()
            .map(|&number| {
                let req = PolicyRequest {
                    random: number,
                    ..ask(400, PLENTY)
                };
                let p = select(&random, &req, &decode, &prefill).unwrap();
                (p.decode, p.prefill[0])
            })
            .collect();
        // The low half picks the decode worker (2^32 mod 3 = 1), the high half rotates the plan.
        assert_eq!(picks, [(0, 0), (1, 0), (2, 0), (1, 1)]);
    }

    #[test]
    fn the_move_of_kv_counts_against_a_decode_worker() {
        // 400 tokens = 25 blocks of 4 MB at 1 GB/s: 105 ms against 60 blocks more headroom.
        let decode = [
            WorkerSnapshot {
                kv_block_bytes: 4_000_000,
                ..w("d-far", 160, 0, 0)
            },
            WorkerSnapshot {
                kv_block_bytes: 4_000_000,
                ..w("d-holder", 100, 0, 384)
            },
        ];
        let placed = select(&PARAMS, &ask(400, PLENTY), &decode, &[]).unwrap();
        assert_eq!(placed.decode, 1);
        assert_eq!(placed.decision, Decision::LocalShortSuffix);
    }

    fn measured(address: &str, rate: f64) -> WorkerSnapshot {
        WorkerSnapshot {
            prefill_rate: Some(rate),
            ..w(address, 100, 0, 0)
        }
    }

    #[test]
    fn an_unmeasured_worker_prefills_at_the_pools_measured_rate() {
        assert_eq!(prefill_rates([]).unmeasured, DEFAULT_PREFILL_RATE);
        let decode = [w("d1", 100, 0, 0)];
        let prefill = [measured("p1", 100.0), measured("p2", 300.0)];
        let rates = prefill_rates(decode.iter().chain(&prefill));
        assert_eq!(rates.unmeasured, 200.0);
        assert_eq!(rates.of(&decode[0]), 200.0);
        // The decode worker, never measured, is taken as slow as the pool, so a long prompt
        // still goes to an idle prefill worker rather than to a decode worker thought faster.
        let placed = select(&PARAMS, &ask(400, PLENTY), &decode, &prefill).unwrap();
        assert_eq!((placed.decision, placed.prefill[0]), (Decision::Remote, 1));
        assert!((placed.estimated_ttft.as_secs_f64() - 400.0 / 300.0).abs() < 1e-6);
    }

    /// A worker whose one measurement caught it stopped mid-prefill (4 tokens/s against its
    /// peer's 1,300) is estimated at a quarter of the median, so it is sent work again once its
    /// peer's queue is long enough; that work measures it afresh.
    #[test]
    fn a_pathological_rate_is_clamped_against_the_pool() {
        let decode = [w("d1", 100, 0, 0)];
        let stalled = measured("p-stalled", 4.0);
        let busy_peer = |queued| WorkerSnapshot {
            queued_tokens: queued,
            ..measured("p-peer", 1300.0)
        };
        let rates = prefill_rates(decode.iter().chain([&stalled, &busy_peer(0)]));
        // The median of (4, 1300) is 652; a quarter of it is 163.
        assert_eq!(rates.of(&stalled), 163.0);
        assert_eq!(rates.of(&busy_peer(0)), 1300.0);
        let no_saturation = PolicyParams {
            prefill_saturation_factor: 0.0,
            ..PARAMS
        };
        let first = |queued| {
            let prefill = [stalled.clone(), busy_peer(queued)];
            let p = select(&no_saturation, &ask(600, PLENTY), &decode, &prefill).unwrap();
            prefill[p.prefill[0]].address.clone()
        };
        // 600 tokens at 163 tokens/s score 5.5 s (3.7 s to answer, half of that again for the
        // compute); the peer scores better up to a 6,276-token queue.
        assert_eq!(first(6000), "p-peer");
        assert_eq!(first(7000), "p-stalled");
    }

    /// A measurement that nothing renews (the worker was sent no prompt since) decays toward the
    /// median: half-way after the half-life, and the worker is sent work again.
    #[test]
    fn an_old_measurement_decays_toward_the_median() {
        let aged = |rate: f64, secs: u64| WorkerSnapshot {
            prefill_rate_age: Duration::from_secs(secs),
            ..measured("p", rate)
        };
        // Median of (200, 1000, 1000) = 1000.
        let pool = [aged(200.0, 0), measured("b", 1000.0), measured("c", 1000.0)];
        let rates = prefill_rates(&pool);
        assert_eq!(rates.median, 1000.0);
        assert_eq!(rates.of(&aged(200.0, 0)), 250.0, "raised to the floor");
        assert_eq!(
            rates.of(&aged(600.0, 10)),
            800.0,
            "half-way after the half-life"
        );
        assert_eq!(rates.of(&aged(600.0, 20)), 900.0);
        assert_eq!(rates.of(&aged(1400.0, 10)), 1200.0, "fast ones decay too");
    }

    #[test]
    fn the_worker_holding_the_prompt_wins_unless_clearly_slower() {
        let l = |q, uncached| PrefillLoad {
            queued_tokens: q,
            uncached_tokens: uncached,
            rate: 1000.0,
        };
        let keys = |r: Vec<(usize, f64)>| r.into_iter().map(|(k, _)| k).collect::<Vec<_>>();
        // The holder of a fresh 1,000-token prompt (queued there by the burst's first call)
        // answers a little later than an idle worker that would compute all of it: 1.2 s + 0.1
        // against 1.0 + 0.5, so the holder, with the estimates unchanged.
        let ranked = rank_prefill(&[(0, l(0, 1000)), (1, l(1000, 200)), (2, l(3000, 1000))]);
        assert_eq!(ranked, [(1, 1.2), (0, 1.0), (2, 4.0)]);
        // Clearly slower to answer (a queue of 1,400): the idle worker.
        assert_eq!(
            keys(rank_prefill(&[(0, l(0, 1000)), (1, l(1400, 200))])),
            [0, 1]
        );
        // Unrelated prompts: the idle worker.
        assert_eq!(
            keys(rank_prefill(&[(0, l(1000, 1000)), (1, l(0, 1000))])),
            [1, 0]
        );
    }

    #[test]
    fn decode_prefers_headroom_minus_running() {
        let load = |free_blocks, running, in_flight| DecodeLoad {
            free_blocks,
            running,
            in_flight,
            move_ms: 0.0,
        };
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
        let l = |q, uncached, rate| PrefillLoad {
            queued_tokens: q,
            uncached_tokens: uncached,
            rate,
        };
        let keys = |r: Vec<(usize, f64)>| r.into_iter().map(|(k, _)| k).collect::<Vec<_>>();
        let three = [
            (0, l(500, 100, 1.0)),
            (1, l(0, 100, 1.0)),
            (2, l(100, 100, 1.0)),
        ];
        assert_eq!(keys(rank_prefill(&three)), [1, 2, 0]);
        // Rate 0 is taken as the default.
        assert_eq!(
            keys(rank_prefill(&[(0, l(5, 10, 0.0)), (1, l(1, 10, 1.0))])),
            [0, 1]
        );
        assert_eq!(estimated_ttft_s(l(100, 100, 100.0)), 2.0);
    }

    #[test]
    fn fingerprint_consensus() {
        assert_eq!(consensus_fingerprint([]), None);
        assert_eq!(consensus_fingerprint(["a", "b", "b"]).as_deref(), Some("b"));
        assert_eq!(consensus_fingerprint(["a", "b"]).as_deref(), Some("a"));
    }
}
