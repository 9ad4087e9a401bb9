//! The simulated router's prefix index: which worker holds which cached block, fed by the
//! simulated workers' own KV events (their real block pools record them), plus the placements
//! the router just made, counted as held until they expire (the router's pending placements).
//!
//! The router's `KvIndex` does the same over gRPC streams, with gaps, resyncs and worker
//! incarnations; here events arrive in order and at once, so the index is the workers' caches.

use std::collections::VecDeque;

use duet_kv::{BlockHash, KvEvent, Tier};
use smallvec::SmallVec;

/// A worker holding a block: in its pool, or placed there by the router until `pending_until`.
#[derive(Clone, Copy, Debug)]
struct Holder {
    worker: u32,
    stored: bool,
    /// The latest placement's expiry (placements only lengthen it: the router's clock runs
    /// forward); none left when not past now.
    pending_until: f64,
}

impl Holder {
    fn holds(&self, now: f64) -> bool {
        self.stored || self.pending_until > now
    }
}

/// The workers holding one block. Most blocks have one or two (the prefill worker that
/// computed it and the decode worker it was pushed to): they live inline, allocating nothing,
/// since the index is updated on every block of every request.
type Holders = SmallVec<[Holder; 2]>;

#[derive(Default)]
pub struct PrefixIndex {
    blocks: foldhash::HashMap<BlockHash, Holders>,
    /// Pending placements by expiry, oldest first.
    expiring: VecDeque<(f64, BlockHash, u32)>,
}

impl PrefixIndex {
    /// Applies a worker's KV events.
    pub fn apply(&mut self, worker: u32, events: &[KvEvent]) {
        for e in events {
            // The simulated router scores what the device pools hold (simulated workers have no
            // tiers below them, and a block moved down is no longer in the pool).
            match *e {
                KvEvent::Stored(h) | KvEvent::BroughtUp { hash: h, .. } => {
                    let holders = self.blocks.entry(h).or_default();
                    match holders.iter_mut().find(|x| x.worker == worker) {
                        Some(x) => x.stored = true,
                        None => holders.push(Holder {
                            worker,
                            stored: true,
                            pending_until: f64::NEG_INFINITY,
                        }),
                    }
                }
                KvEvent::Removed {
                    hash: h,
                    tier: Tier::Device,
                }
                | KvEvent::MovedDown {
                    hash: h,
                    from: Tier::Device,
                    ..
                } => self.forget(h, worker, |x| x.stored = false),
                KvEvent::Removed { .. } | KvEvent::MovedDown { .. } => {}
                KvEvent::Cleared => {
                    self.blocks.retain(|_, holders| {
                        for x in holders.iter_mut().filter(|x| x.worker == worker) {
                            x.stored = false;
                        }
                        holders.retain(|x| x.stored || x.pending_until != f64::NEG_INFINITY);
                        !holders.is_empty()
                    });
                }
            }
        }
    }

    /// Applies `change` to `worker`'s hold on block `h`, dropping the hold (and the block's
    /// entry) once nothing is left of it.
    fn forget(&mut self, h: BlockHash, worker: u32, change: impl FnOnce(&mut Holder)) {
        let Some(holders) = self.blocks.get_mut(&h) else {
            return;
        };
        let Some(i) = holders.iter().position(|x| x.worker == worker) else {
            return;
        };
        change(&mut holders[i]);
        let x = holders[i];
        if !x.stored && x.pending_until == f64::NEG_INFINITY {
            holders.remove(i);
            if holders.is_empty() {
                self.blocks.remove(&h);
            }
        }
    }

    /// Counts `hashes` as held by `worker` until `until`.
    pub fn record_pending(&mut self, worker: u32, hashes: &[BlockHash], until: f64) {
        for &h in hashes {
            let holders = self.blocks.entry(h).or_default();
            match holders.iter_mut().find(|x| x.worker == worker) {
                Some(x) => x.pending_until = x.pending_until.max(until),
                None => holders.push(Holder {
                    worker,
                    stored: false,
                    pending_until: until,
                }),
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
            self.forget(h, worker, |x| {
                if x.pending_until <= now {
                    x.pending_until = f64::NEG_INFINITY;
                }
            });
        }
    }

    /// For each worker holding the first block: how many leading `hashes` it holds. Workers not
    /// listed hold none.
    pub fn prefix_matches(&self, hashes: &[BlockHash], now: f64, out: &mut Vec<(u32, usize)>) {
        out.clear();
        let Some(first) = hashes.first().and_then(|h| self.blocks.get(h)) else {
            return;
        };
        out.extend(first.iter().filter(|x| x.holds(now)).map(|x| (x.worker, 1)));
        for (i, h) in hashes.iter().enumerate().skip(1) {
            let Some(holders) = self.blocks.get(h) else {
                break;
            };
            let mut any = false;
            for (w, n) in out.iter_mut() {
                if *n == i && holders.iter().any(|x| x.worker == *w && x.holds(now)) {
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
        index.apply(
            0,
            &[KvEvent::Removed {
                hash: 2,
                tier: Tier::Device,
            }],
        );
        index.prefix_matches(&[1, 2, 3, 4], 6.0, &mut out);
        out.sort();
        assert_eq!(out, [(0, 1), (1, 1)]);
        // A block moved down from a pool is no longer in it; one below that leaves is no news.
        index.apply(
            0,
            &[
                KvEvent::Removed {
                    hash: 1,
                    tier: Tier::Host,
                },
                KvEvent::MovedDown {
                    hash: 3,
                    from: Tier::Device,
                    to: Tier::Host,
                },
            ],
        );
        index.prefix_matches(&[1, 2, 3, 4], 6.0, &mut out);
        out.sort();
        assert_eq!(out, [(0, 1), (1, 1)]);
        index.apply(
            0,
            &[KvEvent::BroughtUp {
                hash: 3,
                from: Tier::Host,
            }],
        );
        assert!(index.blocks[&3].iter().any(|x| x.worker == 0 && x.stored));
        index.apply(1, &[KvEvent::Cleared]);
        index.prefix_matches(&[1], 6.0, &mut out);
        assert_eq!(out, [(0, 1)]);
    }
}
