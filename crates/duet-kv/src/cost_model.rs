//! Whether a block found below the device is worth loading: the time to load it from its tier,
//! fitted to the loads this worker measured, against the time to compute its tokens again at
//! the prefill speed it measured. SGLang's tiered cache reported a file-tier hit slower than
//! recomputing (2,450 against 1,725 ms); here a tier is read only where that is faster.
//!
//! Loading time per block is an exponentially weighted mean of measured loads (seconds per
//! block, the tier read and the device write together), starting from a prior until the first
//! load. A tier the model refuses is still read once every [`PROBE_EVERY`] refusals, so a tier
//! that became faster (a warm page cache, a quiet disk) is noticed.

use crate::Tier;

/// A refused tier is read anyway once per this many refusals, to measure it again.
pub const PROBE_EVERY: u32 = 64;

/// Prefill speed assumed until one is measured (what the router assumes for a worker that has
/// measured none).
pub const PRIOR_PREFILL_TOKENS_PER_S: f64 = 1000.0;

/// Weight of the newest measurement in the fitted load time.
const EWMA_WEIGHT: f64 = 0.2;

/// What to do with a block found in a tier below.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadDecision {
    /// Loading is faster than recomputing.
    Load,
    /// Recomputing is faster, but the tier is read this once to measure it again.
    Probe,
    /// Recomputing is faster.
    Recompute,
}

impl LoadDecision {
    pub fn loads(self) -> bool {
        !matches!(self, LoadDecision::Recompute)
    }
}

#[derive(Clone, Debug)]
pub struct CostModel {
    block_tokens: usize,
    block_bytes: usize,
    prefill_tokens_per_s: f64,
    /// Per tier: fitted seconds to load one block; `None` until measured.
    load_seconds: [Option<f64>; 3],
    /// Per tier: the bandwidth assumed before the first measurement.
    prior_bytes_per_s: [f64; 3],
    refusals: [u32; 3],
}

impl CostModel {
    /// A model for blocks of `block_tokens` tokens and `block_bytes` bytes.
    pub fn new(block_tokens: usize, block_bytes: usize) -> Self {
        Self {
            block_tokens,
            block_bytes,
            prefill_tokens_per_s: PRIOR_PREFILL_TOKENS_PER_S,
            load_seconds: [None; 3],
            // Optimistic, so that the first hits are taken and measured.
            prior_bytes_per_s: [f64::INFINITY, 8e9, 1e9],
            refusals: [0; 3],
        }
    }

    /// The prefill speed measured now (ignored unless positive).
    pub fn set_prefill_rate(&mut self, tokens_per_s: f64) {
        if tokens_per_s > 0.0 && tokens_per_s.is_finite() {
            self.prefill_tokens_per_s = tokens_per_s;
        }
    }

    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prefill_tokens_per_s
    }

    /// A measured load of `blocks` blocks from `tier` that took `seconds` in all.
    pub fn observe_load(&mut self, tier: Tier, blocks: usize, seconds: f64) {
        if blocks == 0 || !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        let per_block = seconds / blocks as f64;
        let fitted = &mut self.load_seconds[tier.index()];
        *fitted = Some(match *fitted {
            Some(old) => old + EWMA_WEIGHT * (per_block - old),
            None => per_block,
        });
    }

    /// Seconds to load one block from `tier` (fitted, else from the prior).
    pub fn load_seconds_per_block(&self, tier: Tier) -> f64 {
        self.load_seconds[tier.index()]
            .unwrap_or(self.block_bytes as f64 / self.prior_bytes_per_s[tier.index()])
    }

    /// Loading bandwidth of `tier` in bytes per second (fitted, else the prior).
    pub fn load_bytes_per_s(&self, tier: Tier) -> f64 {
        self.block_bytes as f64 / self.load_seconds_per_block(tier)
    }

    /// Seconds to compute one block's tokens again.
    pub fn recompute_seconds_per_block(&self) -> f64 {
        self.block_tokens as f64 / self.prefill_tokens_per_s
    }

    /// Whether a block found in `tier` is loaded rather than recomputed.
    pub fn decide(&mut self, tier: Tier) -> LoadDecision {
        if self.load_seconds_per_block(tier) < self.recompute_seconds_per_block() {
            return LoadDecision::Load;
        }
        let refusals = &mut self.refusals[tier.index()];
        *refusals += 1;
        if *refusals >= PROBE_EVERY {
            *refusals = 0;
            return LoadDecision::Probe;
        }
        LoadDecision::Recompute
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tier_is_read_only_while_loading_beats_recomputing() {
        // 16 tokens at 1,600 tokens/s: 10 ms to recompute a block.
        let mut m = CostModel::new(16, 1 << 20);
        m.set_prefill_rate(1600.0);
        assert!((m.recompute_seconds_per_block() - 0.01).abs() < 1e-12);
        // Before any measurement the prior (1 GB/s: ~1 ms a block) says load.
        assert_eq!(m.decide(Tier::Disk), LoadDecision::Load);
        // Measured: 40 ms for two blocks.
        m.observe_load(Tier::Disk, 2, 0.04);
        assert!((m.load_seconds_per_block(Tier::Disk) - 0.02).abs() < 1e-12);
        assert_eq!(m.decide(Tier::Disk), LoadDecision::Recompute);
        // The host tier is measured apart.
        m.observe_load(Tier::Host, 1, 0.0001);
        assert_eq!(m.decide(Tier::Host), LoadDecision::Load);
        // A slower prefill (a busier worker) makes the same disk worth reading.
        m.set_prefill_rate(400.0);
        assert_eq!(m.decide(Tier::Disk), LoadDecision::Load);
    }

    #[test]
    fn the_fit_follows_new_measurements() {
        let mut m = CostModel::new(16, 1000);
        m.observe_load(Tier::Disk, 1, 1.0);
        for _ in 0..40 {
            m.observe_load(Tier::Disk, 1, 0.001);
        }
        assert!(m.load_seconds_per_block(Tier::Disk) < 0.002);
        assert!((m.load_bytes_per_s(Tier::Disk) - 1e6).abs() / 1e6 < 0.6);
        // Nonsense is ignored.
        m.observe_load(Tier::Disk, 0, 5.0);
        m.observe_load(Tier::Disk, 1, f64::NAN);
        m.set_prefill_rate(0.0);
        assert!(m.load_seconds_per_block(Tier::Disk) < 0.002);
        assert_eq!(m.prefill_tokens_per_s(), PRIOR_PREFILL_TOKENS_PER_S);
    }

    #[test]
    fn a_refused_tier_is_probed_now_and_then() {
        let mut m = CostModel::new(16, 1000);
        m.set_prefill_rate(1e9);
        m.observe_load(Tier::Disk, 1, 1.0);
        let decisions: Vec<_> = (0..2 * PROBE_EVERY).map(|_| m.decide(Tier::Disk)).collect();
        let probes = decisions
            .iter()
            .filter(|d| **d == LoadDecision::Probe)
            .count();
        assert_eq!(probes, 2);
        assert!(decisions.iter().all(|d| *d != LoadDecision::Load));
    }
}
