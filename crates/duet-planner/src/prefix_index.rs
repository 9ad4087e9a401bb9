//! The simulated router's prefix index: which workers hold a prompt's leading blocks.
//!
//! The router's `KvIndex` is fed by the workers' KV events over gRPC streams, with gaps, resyncs
//! and worker incarnations. In the simulation those events would arrive at once and in order, so
//! that index would be exactly what the workers' pools hold: the pools are read instead (one
//! lookup of the first block per worker and request, where mirroring every pool's every stored
//! and removed block cost a lookup each, into a map of every block of the cluster). What the
//! router adds of its own lives here: the blocks it just placed on a worker, counted as held
//! there until they expire (its pending placements).

use std::collections::VecDeque;

use duet_kv::BlockHash;
use smallvec::SmallVec;

/// The workers a block was placed on, each with the latest placement's expiry (placements only
/// lengthen it: the router's clock runs forward). Most blocks have one.
type Placements = SmallVec<[(u32, f64); 2]>;

#[derive(Default)]
pub struct PrefixIndex {
    pending: foldhash::HashMap<BlockHash, Placements>,
    /// Pending placements by expiry, oldest first.
    expiring: VecDeque<(f64, BlockHash, u32)>,
}

impl PrefixIndex {
    /// Counts `hashes` as held by `worker` until `until`.
    pub fn record_pending(&mut self, worker: u32, hashes: &[BlockHash], until: f64) {
        for &h in hashes {
            let placed = self.pending.entry(h).or_default();
            match placed.iter_mut().find(|(w, _)| *w == worker) {
                Some((_, u)) => *u = u.max(until),
                None => placed.push((worker, until)),
            }
            self.expiring.push_back((until, h, worker));
        }
    }

    /// Forgets the pending placements past their time.
    pub fn expire(&mut self, now: f64) {
        while let Some(&(until, h, worker)) = self.expiring.front() {
            if until > now {
                break;
            }
            self.expiring.pop_front();
            let Some(placed) = self.pending.get_mut(&h) else {
                continue;
            };
            // A later placement of the same block on the same worker keeps it.
            placed.retain(|&mut (w, until)| w != worker || until > now);
            if placed.is_empty() {
                self.pending.remove(&h);
            }
        }
    }

    fn pending_on(&self, worker: u32, h: &BlockHash, now: f64) -> bool {
        self.pending
            .get(h)
            .is_some_and(|p| placed_on(p, worker, now))
    }

    /// For each of `workers` holding the first block: how many leading `hashes` it holds, in its
    /// pool (`stored(worker, hashes)`: how many leading ones the pool has) or placed there and
    /// not expired. Workers not listed hold none.
    pub fn prefix_matches(
        &self,
        hashes: &[BlockHash],
        now: f64,
        workers: u32,
        stored: impl Fn(u32, &[BlockHash]) -> usize,
        out: &mut Vec<(u32, usize)>,
    ) {
        out.clear();
        let Some(first) = hashes.first() else {
            return;
        };
        let first_placed = self.pending.get(first);
        for w in 0..workers {
            let mut held = stored(w, hashes);
            if held == 0 && !first_placed.is_some_and(|p| placed_on(p, w, now)) {
                continue;
            }
            // Runs of pending and of stored blocks, alternating, until neither goes on.
            loop {
                let before = held;
                while held < hashes.len() && self.pending_on(w, &hashes[held], now) {
                    held += 1;
                }
                if held == before || held == hashes.len() {
                    break;
                }
                held += stored(w, &hashes[held..]);
            }
            out.push((w, held));
        }
    }
}

fn placed_on(placed: &Placements, worker: u32, now: f64) -> bool {
    placed.iter().any(|&(w, until)| w == worker && until > now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_and_pending_blocks_make_prefixes_until_removed_or_expired() {
        let mut index = PrefixIndex::default();
        let mut out = Vec::new();
        // Worker 0's pool holds blocks 1, 2, 3 (then 1 and 3); worker 1's holds block 1.
        let mut pools: Vec<Vec<BlockHash>> = vec![vec![1, 2, 3], vec![1]];
        let matches = |index: &PrefixIndex, pools: &[Vec<BlockHash>], now, out: &mut Vec<_>| {
            let stored = |w: u32, hashes: &[BlockHash]| {
                let pool = &pools[w as usize];
                hashes.iter().take_while(|h| pool.contains(h)).count()
            };
            index.prefix_matches(&[1, 2, 3, 4], now, 2, stored, out);
        };
        matches(&index, &pools, 0.0, &mut out);
        assert_eq!(out, [(0, 3), (1, 1)]);
        // Placed on worker 1 until 5: held there, stored and pending runs together.
        index.record_pending(1, &[2, 3, 4], 5.0);
        matches(&index, &pools, 1.0, &mut out);
        assert_eq!(out, [(0, 3), (1, 4)]);
        // A gap in worker 0's pool ends its prefix; the placement on worker 1 expires.
        pools[0] = vec![1, 3];
        index.expire(6.0);
        matches(&index, &pools, 6.0, &mut out);
        assert_eq!(out, [(0, 1), (1, 1)]);
        assert!(index.pending.is_empty() && index.expiring.is_empty());
        // Pending blocks fill a pool's gap; a later placement outlives an earlier one's expiry.
        index.record_pending(0, &[2], 7.0);
        index.record_pending(0, &[2], 9.0);
        index.expire(7.0);
        matches(&index, &pools, 7.0, &mut out);
        assert_eq!(out, [(0, 3), (1, 1)]);
        // A worker holding nothing of the first block is not listed, whatever it holds after.
        pools[1] = vec![2, 3];
        matches(&index, &pools, 7.0, &mut out);
        assert_eq!(out, [(0, 3)]);
    }
}
