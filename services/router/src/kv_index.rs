//! The router's exact index of the workers' prefix caches: block hash → the workers holding it.
//!
//! It is built only from what the workers say (`KvEvents/Subscribe`: snapshots, numbered
//! events, digests), never guessed from the router's own decisions, and it has no transport of
//! its own: [`KvIndex::apply`] takes one message and says when the feed must subscribe again.
//! - An event numbered past the next expected one is a **gap**: the feed resubscribes from the
//!   first missing event (a ranged replay from the worker's ring buffer; the worker sends a
//!   snapshot instead when its ring no longer holds it).
//! - A message of another **incarnation** (the worker restarted) without a snapshot: the
//!   worker's entries are dropped and a snapshot is asked for.
//! - A **digest** (block count + XOR of hashes as of an event) that differs from the index's:
//!   the index drifted; a snapshot is asked for. A digest past the last event received means
//!   events were lost: a gap.
//!
//! Workers are named by a [`WorkerSlot`]: the router's number for one worker incarnation as its
//! pools know it, so a restarted worker on the same address never inherits old entries.
//!
//! Beside the exact entries, and apart from them, the index keeps the placements the router just
//! made ([`KvIndex::record_pending`]): a prompt sent to a worker is counted as cached there at
//! once, so a follow-up or a burst sharing a fresh prompt finds it before the worker's events
//! arrive. A pending placement ends when the worker's events confirm every block of it, when its
//! time to live passes, or when a later request on the same prefix reports a miss
//! ([`KvIndex::missed`]).
//! Digests and snapshots compare only the exact entries.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, RwLock};
use std::time::Instant;

use duet_kv::{BlockHash, KvDigest};
use duet_proto::v1;

/// The router's number for one worker (one incarnation of it).
pub type WorkerSlot = u64;

/// Where a feed subscribes (again) from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resume {
    /// The incarnation the index holds events of; 0: none (a snapshot is wanted).
    pub incarnation: u64,
    /// The first event the index lacks.
    pub from_seq: u64,
}

/// What the feed does after a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// Taken; read on.
    Ok,
    /// Subscribe again from here.
    Resubscribe(Resume),
}

/// What one worker's entries are as of.
#[derive(Default)]
struct WorkerEntry {
    incarnation: u64,
    last_seq: u64,
    hashes: HashSet<BlockHash>,
    digest: KvDigest,
    /// Parts of a snapshot being received.
    pending_snapshot: Option<(u64, Vec<BlockHash>)>,
}

#[derive(Default)]
struct State {
    by_hash: HashMap<BlockHash, Vec<WorkerSlot>>,
    workers: HashMap<WorkerSlot, WorkerEntry>,
}

impl State {
    fn insert(&mut self, slot: WorkerSlot, hash: BlockHash) {
        let entry = self.workers.entry(slot).or_default();
        if entry.hashes.insert(hash) {
            entry.digest.toggle(hash, true);
            self.by_hash.entry(hash).or_default().push(slot);
        }
    }

    fn remove(&mut self, slot: WorkerSlot, hash: BlockHash) {
        let Some(entry) = self.workers.get_mut(&slot) else {
            return;
        };
        if entry.hashes.remove(&hash) {
            entry.digest.toggle(hash, false);
            if let Some(holders) = self.by_hash.get_mut(&hash) {
                holders.retain(|&s| s != slot);
                if holders.is_empty() {
                    self.by_hash.remove(&hash);
                }
            }
        }
    }

    fn clear(&mut self, slot: WorkerSlot) {
        let Some(entry) = self.workers.get_mut(&slot) else {
            return;
        };
        let hashes = std::mem::take(&mut entry.hashes);
        entry.digest = KvDigest::default();
        for h in hashes {
            if let Some(holders) = self.by_hash.get_mut(&h) {
                holders.retain(|&s| s != slot);
                if holders.is_empty() {
                    self.by_hash.remove(&h);
                }
            }
        }
    }
}

/// Counts of the index's repairs (shown by `Info`).
#[derive(Debug, Default)]
pub struct IndexCounters {
    pub gaps: AtomicU64,
    pub snapshots: AtomicU64,
    pub digest_mismatches: AtomicU64,
    pub new_incarnations: AtomicU64,
}

/// A placement the router made: the prompt's blocks, counted as held by `slots` until `until`.
#[derive(Debug)]
struct PendingPrefix {
    id: u64,
    slots: Vec<WorkerSlot>,
    hashes: Vec<BlockHash>,
    until: Instant,
}

/// Block hash → workers, per worker as of its last event; and the router's pending placements.
#[derive(Default)]
pub struct KvIndex {
    state: RwLock<State>,
    pending: Mutex<Vec<PendingPrefix>>,
    next_pending: AtomicU64,
    pub counters: IndexCounters,
    /// Test hook: events still to discard as if lost in transit.
    drop_events: AtomicUsize,
}

impl std::fmt::Debug for KvIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvIndex")
            .field("counters", &self.counters)
            .finish_non_exhaustive()
    }
}

impl KvIndex {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Test hook: the next `n` events received are discarded, as if lost in transit.
    pub fn drop_next_events(&self, n: usize) {
        self.drop_events.store(n, Ordering::SeqCst);
    }

    /// Where `slot`'s feed subscribes from.
    pub fn resume(&self, slot: WorkerSlot) -> Resume {
        match self.read().workers.get(&slot) {
            Some(e) if e.incarnation != 0 => Resume {
                incarnation: e.incarnation,
                from_seq: e.last_seq + 1,
            },
            _ => Resume {
                incarnation: 0,
                from_seq: 0,
            },
        }
    }

    /// Takes one message of `slot`'s feed.
    pub fn apply(&self, slot: WorkerSlot, msg: &v1::KvEventsMessage) -> Applied {
        let applied = self.apply_exact(slot, msg);
        self.confirm_pending(slot);
        applied
    }

    fn apply_exact(&self, slot: WorkerSlot, msg: &v1::KvEventsMessage) -> Applied {
        let mut state = self.write();
        let entry = state.workers.entry(slot).or_default();
        if let Some(snapshot) = &msg.snapshot {
            let (seq, mut hashes) = entry
                .pending_snapshot
                .take()
                .filter(|(seq, _)| *seq == snapshot.seq)
                .unwrap_or((snapshot.seq, Vec::new()));
            hashes.extend_from_slice(&snapshot.block_hashes);
            if !snapshot.last {
                entry.pending_snapshot = Some((seq, hashes));
                return Applied::Ok;
            }
            state.clear(slot);
            for h in hashes {
                state.insert(slot, h);
            }
            let entry = state.workers.get_mut(&slot).expect("cleared entry exists");
            entry.incarnation = msg.incarnation;
            entry.last_seq = seq;
            self.counters.snapshots.fetch_add(1, Ordering::Relaxed);
            return Applied::Ok;
        }
        if entry.incarnation != msg.incarnation {
            if entry.incarnation != 0 {
                self.counters
                    .new_incarnations
                    .fetch_add(1, Ordering::Relaxed);
            }
            state.clear(slot);
            let entry = state.workers.get_mut(&slot).expect("entry exists");
            entry.incarnation = 0;
            entry.last_seq = 0;
            return Applied::Resubscribe(Resume {
                incarnation: 0,
                from_seq: 0,
            });
        }
        for e in &msg.events {
            if self
                .drop_events
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                continue;
            }
            let last_seq = state.workers[&slot].last_seq;
            if e.seq <= last_seq {
                continue; // already applied (a replay overlapping what arrived)
            }
            if e.seq != last_seq + 1 {
                self.counters.gaps.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    slot,
                    expected = last_seq + 1,
                    got = e.seq,
                    "KV event gap; replaying"
                );
                return Applied::Resubscribe(Resume {
                    incarnation: msg.incarnation,
                    from_seq: last_seq + 1,
                });
            }
            match v1::KvEventKind::try_from(e.kind) {
                Ok(v1::KvEventKind::BlockStored) => state.insert(slot, e.block_hash),
                Ok(v1::KvEventKind::BlockRemoved) => state.remove(slot, e.block_hash),
                Ok(v1::KvEventKind::Cleared) => state.clear(slot),
                // An event this router does not know: its effect is unknown, so start over.
                _ => {
                    return Applied::Resubscribe(Resume {
                        incarnation: 0,
                        from_seq: 0,
                    });
                }
            }
            state.workers.get_mut(&slot).expect("entry exists").last_seq = e.seq;
        }
        if let Some(d) = &msg.digest {
            let entry = &state.workers[&slot];
            // The worker sends a digest only after every event up to it: some were lost.
            if d.seq > entry.last_seq {
                self.counters.gaps.fetch_add(1, Ordering::Relaxed);
                return Applied::Resubscribe(Resume {
                    incarnation: msg.incarnation,
                    from_seq: entry.last_seq + 1,
                });
            }
            let theirs = KvDigest {
                block_count: d.block_count,
                hash_xor: d.hash_xor,
            };
            if d.seq == entry.last_seq && theirs != entry.digest {
                self.counters
                    .digest_mismatches
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    slot,
                    seq = d.seq,
                    ours = entry.hashes.len(),
                    theirs = d.block_count,
                    "KV index drifted from the worker's digest; asking for a snapshot"
                );
                return Applied::Resubscribe(Resume {
                    incarnation: 0,
                    from_seq: 0,
                });
            }
        }
        Applied::Ok
    }

    /// Forgets a worker (it left the pools).
    pub fn remove_worker(&self, slot: WorkerSlot) {
        let mut state = self.write();
        state.clear(slot);
        state.workers.remove(&slot);
        drop(state);
        self.pending_mut().retain_mut(|p| {
            p.slots.retain(|&s| s != slot);
            !p.slots.is_empty()
        });
    }

    fn pending_mut(&self) -> std::sync::MutexGuard<'_, Vec<PendingPrefix>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts `hashes` (a prompt's leading blocks) as held by each of `slots` until `until`,
    /// or until confirmed or missed; returns the placement's id (for [`Self::missed`]).
    pub fn record_pending(
        &self,
        slots: &[WorkerSlot],
        hashes: Vec<BlockHash>,
        until: Instant,
    ) -> u64 {
        let id = self.next_pending.fetch_add(1, Ordering::Relaxed);
        if !hashes.is_empty() && !slots.is_empty() {
            self.pending_mut().push(PendingPrefix {
                id,
                slots: slots.to_vec(),
                hashes,
                until,
            });
        }
        id
    }

    /// A request placed on `slot` (its own placement `id`) found fewer of its blocks cached
    /// there than predicted: every other pending placement on `slot` of a prompt starting with
    /// `first_block` was wrong (its request failed, or the worker evicted the blocks) and ends.
    /// The request's own placement stays: the worker has just computed those blocks.
    pub fn missed(&self, slot: WorkerSlot, first_block: BlockHash, id: u64) {
        self.pending_mut().retain_mut(|p| {
            if p.id != id && p.hashes.first() == Some(&first_block) {
                p.slots.retain(|&s| s != slot);
            }
            !p.slots.is_empty()
        });
    }

    /// Pending placements now.
    pub fn pending_count(&self) -> usize {
        self.pending_mut().len()
    }

    /// Ends `slot`'s part of every pending placement whose blocks its events now all show.
    fn confirm_pending(&self, slot: WorkerSlot) {
        let state = self.read();
        let Some(entry) = state.workers.get(&slot) else {
            return;
        };
        self.pending_mut().retain_mut(|p| {
            if p.slots.contains(&slot) && p.hashes.iter().all(|h| entry.hashes.contains(h)) {
                p.slots.retain(|&s| s != slot);
            }
            !p.slots.is_empty()
        });
    }

    /// For each worker holding at least the first block: how many leading blocks of `hashes`
    /// (a prompt's chained hashes) it holds, by its events or by a placement pending at `now`
    /// (expired placements are dropped here).
    pub fn prefix_matches(&self, hashes: &[BlockHash], now: Instant) -> HashMap<WorkerSlot, usize> {
        let mut matches = self.exact_matches(hashes);
        let mut pending = self.pending_mut();
        pending.retain(|p| p.until > now);
        for p in pending.iter() {
            let common = p
                .hashes
                .iter()
                .zip(hashes)
                .take_while(|(a, b)| a == b)
                .count();
            if common == 0 {
                continue;
            }
            for &slot in &p.slots {
                let n = matches.entry(slot).or_default();
                *n = (*n).max(common);
            }
        }
        matches
    }

    /// [`Self::prefix_matches`] by the workers' events alone.
    fn exact_matches(&self, hashes: &[BlockHash]) -> HashMap<WorkerSlot, usize> {
        let state = self.read();
        let mut matches: HashMap<WorkerSlot, usize> = HashMap::new();
        for (i, h) in hashes.iter().enumerate() {
            let Some(holders) = state.by_hash.get(h) else {
                break;
            };
            let mut any = false;
            for &slot in holders {
                // A chain: a worker counts only while it held every block before this one.
                if let Some(n) = matches.get_mut(&slot) {
                    if *n == i {
                        *n += 1;
                        any = true;
                    }
                } else if i == 0 {
                    matches.insert(slot, 1);
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
        matches
    }

    /// Blocks indexed over all workers.
    pub fn total_blocks(&self) -> usize {
        self.read().workers.values().map(|e| e.hashes.len()).sum()
    }

    /// Blocks indexed for `slot`.
    pub fn blocks_of(&self, slot: WorkerSlot) -> usize {
        self.read().workers.get(&slot).map_or(0, |e| e.hashes.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INC: u64 = 7;

    fn stored(seq: u64, hash: u64) -> v1::KvEvent {
        v1::KvEvent {
            seq,
            kind: v1::KvEventKind::BlockStored as i32,
            block_hash: hash,
        }
    }

    fn removed(seq: u64, hash: u64) -> v1::KvEvent {
        v1::KvEvent {
            seq,
            kind: v1::KvEventKind::BlockRemoved as i32,
            block_hash: hash,
        }
    }

    fn events(incarnation: u64, events: Vec<v1::KvEvent>) -> v1::KvEventsMessage {
        v1::KvEventsMessage {
            incarnation,
            events,
            ..Default::default()
        }
    }

    fn snapshot(incarnation: u64, seq: u64, hashes: &[u64], last: bool) -> v1::KvEventsMessage {
        v1::KvEventsMessage {
            incarnation,
            snapshot: Some(v1::KvSnapshot {
                seq,
                block_hashes: hashes.to_vec(),
                last,
            }),
            ..Default::default()
        }
    }

    fn digest(incarnation: u64, seq: u64, hashes: &[u64]) -> v1::KvEventsMessage {
        v1::KvEventsMessage {
            incarnation,
            digest: Some(v1::KvDigest {
                seq,
                block_count: hashes.len() as u64,
                hash_xor: hashes.iter().fold(0, |x, h| x ^ h),
            }),
            ..Default::default()
        }
    }

    fn resubscribe(incarnation: u64, from_seq: u64) -> Applied {
        Applied::Resubscribe(Resume {
            incarnation,
            from_seq,
        })
    }

    fn matches(index: &KvIndex, hashes: &[u64]) -> Vec<(WorkerSlot, usize)> {
        let mut m: Vec<_> = index
            .prefix_matches(hashes, Instant::now())
            .into_iter()
            .collect();
        m.sort();
        m
    }

    #[test]
    fn prefix_matches_follow_the_chain_per_worker() {
        let index = KvIndex::default();
        assert_eq!(
            index.apply(1, &snapshot(INC, 0, &[10, 20, 30], true)),
            Applied::Ok
        );
        assert_eq!(
            index.apply(2, &snapshot(INC, 0, &[10, 30], true)),
            Applied::Ok
        );
        // Worker 2 holds 30 but not 20: its match stops at the first block.
        assert_eq!(matches(&index, &[10, 20, 30]), [(1, 3), (2, 1)]);
        assert_eq!(matches(&index, &[99, 10]), []);
        assert_eq!(
            index.resume(1),
            Resume {
                incarnation: INC,
                from_seq: 1
            }
        );
        index.remove_worker(1);
        assert_eq!(matches(&index, &[10, 20, 30]), [(2, 1)]);
        assert_eq!(
            index.resume(1),
            Resume {
                incarnation: 0,
                from_seq: 0
            }
        );
    }

    #[test]
    fn events_store_remove_and_clear() {
        let index = KvIndex::default();
        // Snapshot parts add up.
        assert_eq!(index.apply(1, &snapshot(INC, 4, &[1], false)), Applied::Ok);
        assert_eq!(index.blocks_of(1), 0, "not until the last part");
        assert_eq!(index.apply(1, &snapshot(INC, 4, &[2], true)), Applied::Ok);
        assert_eq!(matches(&index, &[1, 2]), [(1, 2)]);
        let m = events(INC, vec![stored(5, 3), removed(6, 1), stored(6, 9)]);
        // Event 6 twice is a duplicate: skipped.
        assert_eq!(index.apply(1, &m), Applied::Ok);
        assert_eq!(matches(&index, &[1]), []);
        assert_eq!(index.blocks_of(1), 2);
        assert_eq!(index.apply(1, &digest(INC, 6, &[2, 3])), Applied::Ok);
        let cleared = v1::KvEvent {
            seq: 7,
            kind: v1::KvEventKind::Cleared as i32,
            block_hash: 0,
        };
        assert_eq!(index.apply(1, &events(INC, vec![cleared])), Applied::Ok);
        assert_eq!(index.blocks_of(1), 0, "cleared is not a no-op");
        assert_eq!(index.resume(1).from_seq, 8);
    }

    #[test]
    fn a_gap_asks_for_a_replay_from_the_first_missing_event() {
        let index = KvIndex::default();
        index.apply(1, &snapshot(INC, 0, &[], true));
        assert_eq!(
            index.apply(1, &events(INC, vec![stored(1, 11), stored(2, 12)])),
            Applied::Ok
        );
        // Event 3 was lost.
        assert_eq!(
            index.apply(1, &events(INC, vec![stored(4, 14)])),
            resubscribe(INC, 3)
        );
        assert_eq!(index.counters.gaps.load(Ordering::Relaxed), 1);
        // The replay fills it in; nothing was lost.
        assert_eq!(
            index.apply(1, &events(INC, vec![stored(3, 13), stored(4, 14)])),
            Applied::Ok
        );
        assert_eq!(matches(&index, &[11, 12, 13, 14]), [(1, 4)]);
        // The test hook loses the next event in transit: detected the same way.
        index.drop_next_events(1);
        assert_eq!(
            index.apply(1, &events(INC, vec![stored(5, 15), stored(6, 16)])),
            resubscribe(INC, 5)
        );
    }

    #[test]
    fn a_new_incarnation_drops_the_old_entries_and_asks_for_a_snapshot() {
        let index = KvIndex::default();
        index.apply(1, &snapshot(INC, 3, &[1, 2], true));
        assert_eq!(
            index.apply(1, &events(INC + 1, vec![stored(1, 5)])),
            resubscribe(0, 0)
        );
        assert_eq!(
            index.blocks_of(1),
            0,
            "the restarted worker's cache is empty"
        );
        assert_eq!(index.counters.new_incarnations.load(Ordering::Relaxed), 1);
        assert_eq!(
            index.apply(1, &snapshot(INC + 1, 1, &[5], true)),
            Applied::Ok
        );
        assert_eq!(matches(&index, &[5]), [(1, 1)]);
    }

    #[test]
    fn the_digest_catches_a_corrupted_index() {
        let index = KvIndex::default();
        index.apply(1, &snapshot(INC, 2, &[1, 2], true));
        assert_eq!(index.apply(1, &digest(INC, 2, &[1, 2])), Applied::Ok);
        // Corrupt the index behind the events' back.
        index.write().remove(1, 2);
        assert_eq!(index.apply(1, &digest(INC, 2, &[1, 2])), resubscribe(0, 0));
        assert_eq!(index.counters.digest_mismatches.load(Ordering::Relaxed), 1);
        // A digest past the last event received: events were lost.
        assert_eq!(index.apply(1, &digest(INC, 9, &[7])), resubscribe(INC, 3));
        assert_eq!(
            index.apply(1, &snapshot(INC, 2, &[1, 2], true)),
            Applied::Ok
        );
        assert_eq!(index.apply(1, &digest(INC, 2, &[1, 2])), Applied::Ok);
    }

    #[test]
    fn pending_placements_count_until_confirmed_missed_or_expired() {
        let index = KvIndex::default();
        let now = Instant::now();
        let later = now + std::time::Duration::from_secs(10);
        index.record_pending(&[1], vec![10, 20, 30], later);
        // Matched as far as the prompt agrees with the placement, on top of the exact index.
        assert_eq!(index.prefix_matches(&[10, 20, 99], now)[&1], 2);
        // Worker 1's snapshot shows two of the three blocks: still pending; then its event.
        index.apply(1, &snapshot(INC, 2, &[10, 20], true));
        assert_eq!(index.pending_count(), 1);
        index.apply(1, &events(INC, vec![stored(3, 30)]));
        assert_eq!(index.pending_count(), 0, "confirmed");
        // A later request on the prefix reports a miss on worker 2: older placements of that
        // prefix there end, its own stays.
        index.record_pending(&[2], vec![10, 20], later);
        let own = index.record_pending(&[2], vec![10, 20, 40], later);
        index.missed(2, 10, own);
        assert_eq!(index.pending_count(), 1);
        assert_eq!(index.prefix_matches(&[10, 20, 40], now)[&2], 3);
        // Expired placements match nothing and are dropped; a worker leaving drops its own.
        assert!(!index.prefix_matches(&[10, 20, 40], later).contains_key(&2));
        assert_eq!(index.pending_count(), 0);
        index.record_pending(&[3], vec![10], later);
        index.remove_worker(3);
        assert_eq!(index.pending_count(), 0);
    }
}
