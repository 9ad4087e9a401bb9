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

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, RwLock};
use std::time::Instant;

use duet_kv::{BlockHash, HeldBlocks, KvDigest, KvEvent, Presence, Tier};
use duet_proto::convert::{kv_event_from_wire, tier_from_wire};
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
    held: HeldBlocks,
    /// Parts of a snapshot being received.
    pending_snapshot: Option<(u64, Vec<(BlockHash, Tier)>)>,
}

#[derive(Default)]
struct State {
    /// The workers holding each block, in any tier.
    by_hash: HashMap<BlockHash, Vec<WorkerSlot>>,
    workers: HashMap<WorkerSlot, WorkerEntry>,
}

impl State {
    /// Applies one of `slot`'s events, keeping `by_hash` in step.
    fn apply(&mut self, slot: WorkerSlot, event: KvEvent) {
        let entry = self.workers.entry(slot).or_default();
        match entry.held.apply(event) {
            Presence::Unchanged => {}
            Presence::Added(hash) => self.by_hash.entry(hash).or_default().push(slot),
            Presence::Removed(hash) => self.unlink(slot, hash),
            Presence::Cleared(hashes) => hashes.into_iter().for_each(|h| self.unlink(slot, h)),
        }
    }

    /// `slot` holds `hash` in `tier` (a snapshot's entry).
    fn insert(&mut self, slot: WorkerSlot, hash: BlockHash, tier: Tier) {
        if self
            .workers
            .entry(slot)
            .or_default()
            .held
            .insert(hash, tier)
        {
            self.by_hash.entry(hash).or_default().push(slot);
        }
    }

    fn unlink(&mut self, slot: WorkerSlot, hash: BlockHash) {
        if let Some(holders) = self.by_hash.get_mut(&hash) {
            holders.retain(|&s| s != slot);
            if holders.is_empty() {
                self.by_hash.remove(&hash);
            }
        }
    }

    fn clear(&mut self, slot: WorkerSlot) {
        if self.workers.contains_key(&slot) {
            self.apply(slot, KvEvent::Cleared);
        }
    }
}

/// A worker's share of a prompt's leading blocks, each counted in the fastest tier holding it
/// there ([`Tier::index`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    pub by_tier: [usize; 3],
}

impl PrefixMatch {
    /// `blocks` leading blocks in the device pool.
    pub fn device(blocks: usize) -> Self {
        Self {
            by_tier: [blocks, 0, 0],
        }
    }

    /// Leading blocks held, in any tier.
    pub fn blocks(&self) -> usize {
        self.by_tier.iter().sum()
    }

    /// Prompt tokens whose prefill this match saves on its worker, net of reading them from
    /// their tiers: each block counts its tokens times the share of its compute time that
    /// loading it from its tier leaves saved ([`TierWorth`]).
    pub fn saved_tokens(&self, block_size: usize, worth: &TierWorth) -> usize {
        let saved: f64 = Tier::ALL
            .iter()
            .map(|t| (self.by_tier[t.index()] * block_size) as f64 * worth.saved_share[t.index()])
            .sum();
        saved as usize
    }
}

/// What a block in each of a worker's tiers saves of computing it again: 1 in the device pool;
/// below it, 1 less the time to load a block (its bytes at the load bandwidth the worker
/// measured) over the time to compute one (its tokens at the worker's prefill rate), and 0
/// where loading is no faster (the worker recomputes those).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TierWorth {
    pub saved_share: [f64; 3],
}

impl Default for TierWorth {
    /// A worker without tiers below its pool.
    fn default() -> Self {
        Self {
            saved_share: [1.0, 0.0, 0.0],
        }
    }
}

impl TierWorth {
    /// From a worker's stats, computing at `prefill_rate` tokens per second.
    pub fn of(stats: &v1::StatsResponse, prefill_rate: f64) -> Self {
        let mut worth = Self::default();
        let compute_s = stats.block_size as f64 / prefill_rate;
        for t in &stats.kv_tiers {
            let Some(tier) = tier_from_wire(t.tier) else {
                continue;
            };
            if t.load_bytes_per_s > 0.0 && compute_s > 0.0 {
                let load_s = stats.kv_block_bytes as f64 / t.load_bytes_per_s;
                worth.saved_share[tier.index()] = (1.0 - load_s / compute_s).max(0.0);
            }
        }
        worth
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
            let (seq, mut blocks) = entry
                .pending_snapshot
                .take()
                .filter(|(seq, _)| *seq == snapshot.seq)
                .unwrap_or((snapshot.seq, Vec::new()));
            for (hashes, tier) in [
                (&snapshot.block_hashes, Tier::Device),
                (&snapshot.host_block_hashes, Tier::Host),
                (&snapshot.disk_block_hashes, Tier::Disk),
            ] {
                blocks.extend(hashes.iter().map(|&h| (h, tier)));
            }
            if !snapshot.last {
                entry.pending_snapshot = Some((seq, blocks));
                return Applied::Ok;
            }
            state.clear(slot);
            for (hash, tier) in blocks {
                state.insert(slot, hash, tier);
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
            match kv_event_from_wire(e) {
                Some(event) => state.apply(slot, event),
                // An event this router does not know: its effect is unknown, so start over.
                None => {
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
            if d.seq == entry.last_seq && theirs != entry.held.digest() {
                self.counters
                    .digest_mismatches
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    slot,
                    seq = d.seq,
                    ours = entry.held.pairs(),
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
            if p.slots.contains(&slot) && p.hashes.iter().all(|&h| entry.held.contains(h)) {
                p.slots.retain(|&s| s != slot);
            }
            !p.slots.is_empty()
        });
    }

    /// For each worker holding at least the first block: the leading blocks of `hashes` (a
    /// prompt's chained hashes) it holds, by tier, by its events or by a placement pending at
    /// `now` (in its device pool; expired placements are dropped here).
    pub fn prefix_matches(
        &self,
        hashes: &[BlockHash],
        now: Instant,
    ) -> HashMap<WorkerSlot, PrefixMatch> {
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
                let m = matches.entry(slot).or_default();
                if common > m.blocks() {
                    *m = PrefixMatch::device(common);
                }
            }
        }
        matches
    }

    /// [`Self::prefix_matches`] by the workers' events alone.
    fn exact_matches(&self, hashes: &[BlockHash]) -> HashMap<WorkerSlot, PrefixMatch> {
        let state = self.read();
        let mut matches: HashMap<WorkerSlot, PrefixMatch> = HashMap::new();
        for (i, &h) in hashes.iter().enumerate() {
            let Some(holders) = state.by_hash.get(&h) else {
                break;
            };
            let mut any = false;
            for &slot in holders {
                // A chain: a worker counts only while it held every block before this one.
                if matches.get(&slot).map_or(0, PrefixMatch::blocks) != i {
                    continue;
                }
                let m = matches.entry(slot).or_default();
                let tier = state.workers[&slot]
                    .held
                    .best_tier(h)
                    .expect("by_hash lists holders");
                m.by_tier[tier.index()] += 1;
                any = true;
            }
            if !any {
                break;
            }
        }
        matches
    }

    /// Blocks indexed over all workers.
    pub fn total_blocks(&self) -> usize {
        self.read().workers.values().map(|e| e.held.len()).sum()
    }

    /// Blocks indexed for `slot`, in any tier.
    pub fn blocks_of(&self, slot: WorkerSlot) -> usize {
        self.read().workers.get(&slot).map_or(0, |e| e.held.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INC: u64 = 7;

    fn stored(seq: u64, hash: u64) -> v1::KvEvent {
        duet_proto::convert::kv_event_to_wire(seq, KvEvent::Stored(hash))
    }

    fn removed(seq: u64, hash: u64) -> v1::KvEvent {
        let tier = Tier::Device;
        duet_proto::convert::kv_event_to_wire(seq, KvEvent::Removed { hash, tier })
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
                ..Default::default()
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
            .map(|(slot, m)| (slot, m.blocks()))
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
        let cleared = duet_proto::convert::kv_event_to_wire(7, KvEvent::Cleared);
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
        index.write().apply(
            1,
            KvEvent::Removed {
                hash: 2,
                tier: Tier::Device,
            },
        );
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
        assert_eq!(
            index.prefix_matches(&[10, 20, 99], now)[&1],
            PrefixMatch::device(2)
        );
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
        assert_eq!(index.prefix_matches(&[10, 20, 40], now)[&2].blocks(), 3);
        // Expired placements match nothing and are dropped; a worker leaving drops its own.
        assert!(!index.prefix_matches(&[10, 20, 40], later).contains_key(&2));
        assert_eq!(index.pending_count(), 0);
        index.record_pending(&[3], vec![10], later);
        index.remove_worker(3);
        assert_eq!(index.pending_count(), 0);
    }

    fn tiers_snapshot(device: &[u64], host: &[u64], disk: &[u64]) -> v1::KvEventsMessage {
        v1::KvEventsMessage {
            incarnation: INC,
            snapshot: Some(v1::KvSnapshot {
                seq: 0,
                block_hashes: device.to_vec(),
                host_block_hashes: host.to_vec(),
                disk_block_hashes: disk.to_vec(),
                last: true,
            }),
            ..Default::default()
        }
    }

    #[test]
    fn matches_count_each_block_in_its_fastest_tier() {
        let index = KvIndex::default();
        index.apply(1, &tiers_snapshot(&[10], &[20, 10], &[30]));
        let at = |index: &KvIndex| index.prefix_matches(&[10, 20, 30, 40], Instant::now())[&1];
        assert_eq!(at(&index).by_tier, [1, 1, 1]);
        let wire = duet_proto::convert::kv_event_to_wire;
        let m = events(
            INC,
            vec![
                // Block 10 leaves the device (a copy stays in host memory), 30 comes up.
                wire(
                    1,
                    KvEvent::MovedDown {
                        hash: 10,
                        from: Tier::Device,
                        to: Tier::Host,
                    },
                ),
                wire(
                    2,
                    KvEvent::BroughtUp {
                        hash: 30,
                        from: Tier::Disk,
                    },
                ),
                wire(3, KvEvent::Stored(40)),
            ],
        );
        assert_eq!(index.apply(1, &m), Applied::Ok);
        assert_eq!(at(&index).by_tier, [2, 2, 0]);
        // The digest counts each (block, tier) pair: 10 host, 20 host, 30 device and disk, 40.
        let mut digest = KvDigest::default();
        for (h, t) in [
            (10, Tier::Host),
            (20, Tier::Host),
            (30, Tier::Device),
            (30, Tier::Disk),
            (40, Tier::Device),
        ] {
            digest.toggle(t.digest_key(h), true);
        }
        let check = v1::KvEventsMessage {
            incarnation: INC,
            digest: Some(v1::KvDigest {
                seq: 3,
                block_count: digest.block_count,
                hash_xor: digest.hash_xor,
            }),
            ..Default::default()
        };
        assert_eq!(index.apply(1, &check), Applied::Ok);
        // Removed from the last tier holding it, a block is gone from the chain.
        let gone = events(
            INC,
            vec![wire(
                4,
                KvEvent::Removed {
                    hash: 20,
                    tier: Tier::Host,
                },
            )],
        );
        index.apply(1, &gone);
        assert_eq!(at(&index).by_tier, [0, 1, 0]);
        assert_eq!(index.blocks_of(1), 3);
    }

    #[test]
    fn a_block_below_is_worth_what_loading_it_saves_of_computing_it() {
        let tier = |tier: Tier, load_bytes_per_s: f64| v1::KvTierStats {
            tier: v1::KvTier::from(tier) as i32,
            load_bytes_per_s,
            ..Default::default()
        };
        // 16 tokens at 1,000 tokens/s: 16 ms a block; a block of 16 MB.
        let stats = v1::StatsResponse {
            block_size: 16,
            kv_block_bytes: 16_000_000,
            kv_tiers: vec![tier(Tier::Host, 4e9), tier(Tier::Disk, 0.5e9)],
            ..Default::default()
        };
        let worth = TierWorth::of(&stats, 1000.0);
        // Host: 4 ms to load 16 ms of compute saves 3/4; disk: 32 ms, slower than computing.
        assert!((worth.saved_share[Tier::Host.index()] - 0.75).abs() < 1e-9);
        assert_eq!(worth.saved_share[Tier::Disk.index()], 0.0);
        let m = PrefixMatch { by_tier: [2, 4, 8] };
        assert_eq!(m.saved_tokens(16, &worth), 2 * 16 + 48);
        assert_eq!(m.saved_tokens(16, &TierWorth::default()), 32);
    }
}
