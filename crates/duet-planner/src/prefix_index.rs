//! The simulated router's prefix index: which worker holds which cached block, fed by the
//! simulated workers' own KV events (their real block pools record them), plus the placements
//! the router just made, counted as held until they expire (the router's pending placements).
//!
//! The router's `KvIndex` does the same over gRPC streams, with gaps, resyncs and worker
//! incarnations; here events arrive in order and at once, so the index is the workers' caches.

use std::collections::{HashMap, VecDeque};

use duet_kv::{BlockHash, KvEvent};

#[derive(Default)]
struct Holders {
    /// Workers whose pools hold the block.
    stored: Vec<u32>,
    /// Workers the router placed it on, until when.
    pending: Vec<(u32, f64)>,
}

impl Holders {
    fn holds(&self, worker: u32, now: f64) -> bool {
        self.stored.contains(&worker)
            || self
                .pending
                .iter()
                .any(|&(w, until)| w == worker && until > now)
    }

    fn is_empty(&self) -> bool {
        self.stored.is_empty() && self.pending.is_empty()
    }
}

#[derive(Default)]
pub struct PrefixIndex {
    blocks: HashMap<BlockHash, Holders>,
    /// Pending placements by expiry, oldest first.
    expiring: VecDeque<(f64, BlockHash, u32)>,
}

impl PrefixIndex {
    /// Applies a worker's KV events.
    pub fn apply(&mut self, worker: u32, events: &[KvEvent]) {
        for e in events {
            match *e {
                KvEvent::Stored(h) => {
                    let holders = self.blocks.entry(h).or_default();
                    if !holders.stored.contains(&worker) {
                        holders.stored.push(worker);
                    }
                }
                KvEvent::Removed(h) => {
                    if let Some(holders) = self.blocks.get_mut(&h) {
                        holders.stored.retain(|&w| w != worker);
                        if holders.is_empty() {
                            self.blocks.remove(&h);
                        }
                    }
                }
                KvEvent::Cleared => {
                    self.blocks.retain(|_, holders| {
                        holders.stored.retain(|&w| w != worker);
                        !holders.is_empty()
                    });
                }
            }
        }
    }

    /// Counts `hashes` as held by `worker` until `until`.
    pub fn record_pending(&mut self, worker: u32, hashes: &[BlockHash], until: f64) {
        for &h in hashes {
            self.blocks
                .entry(h)
                .or_default()
                .pending
                .push((worker, until));
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
            if let Some(holders) = self.blocks.get_mut(&h) {
                holders.pending.retain(|&(w, u)| !(w == worker && u <= now));
                if holders.is_empty() {
                    self.blocks.remove(&h);
                }
            }
        }
    }

    /// For each worker holding the first block: how many leading `hashes` it holds. Workers not
    /// listed hold none.
    pub fn prefix_matches(&self, hashes: &[BlockHash], now: f64, out: &mut Vec<(u32, usize)>) {
        out.clear();
        let Some(first) = hashes.first().and_then(|h| self.blocks.get(h)) else {
            return;
        };
        out.extend(first.stored.iter().map(|&w| (w, 1)));
        for &(w, until) in &first.pending {
            if until > now && !out.iter().any(|&(x, _)| x == w) {
                out.push((w, 1));
            }
        }
        for (i, h) in hashes.iter().enumerate().skip(1) {
            let Some(holders) = self.blocks.get(h) else {
                break;
            };
            let mut any = false;
            for (w, n) in out.iter_mut() {
                if *n == i && holders.holds(*w, now) {
                    *n = i + 1;
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_and_pending_blocks_make_prefixes_until_removed_or_expired() {
        let mut index = PrefixIndex::default();
        let mut out = Vec::new();
        index.apply(
            0,
            &[KvEvent::Stored(1), KvEvent::Stored(2), KvEvent::Stored(3)],
        );
        index.apply(1, &[KvEvent::Stored(1)]);
        index.prefix_matches(&[1, 2, 3, 4], 0.0, &mut out);
        out.sort();
        assert_eq!(out, [(0, 3), (1, 1)]);
        index.record_pending(1, &[1, 2, 3, 4], 5.0);
        index.prefix_matches(&[1, 2, 3, 4], 1.0, &mut out);
        out.sort();
        assert_eq!(out, [(0, 3), (1, 4)]);
        index.expire(6.0);
        index.apply(0, &[KvEvent::Removed(2)]);
        index.prefix_matches(&[1, 2, 3, 4], 6.0, &mut out);
        out.sort();
        assert_eq!(out, [(0, 1), (1, 1)]);
        index.apply(1, &[KvEvent::Cleared]);
        index.prefix_matches(&[1], 6.0, &mut out);
        assert_eq!(out, [(0, 1)]);
    }
}
