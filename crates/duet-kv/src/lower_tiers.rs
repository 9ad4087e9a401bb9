//! The tiers below a device pool, fastest first, as one store: what a block evicted from the
//! device becomes, where a tier's victims go, which blocks are worth bringing back up, what was
//! seen before (the admission rule's memory), and the counts behind the metrics.
//!
//! - **Moving down**: a block leaving the device enters the first tier; to make room, a tier's
//!   victim moves to the tier below it, or leaves the worker from the last one.
//! - **Blocks in the device store's own layout** (whatever the engine reads from it for a tier:
//!   the CPU's keys stay transposed), so bringing one back up is a copy; the tiers never look
//!   inside a block, and a block leaving the worker (a peer's pull) is read from the device in
//!   the transfer layout.
//! - **Inclusive**: a block brought up keeps its copy below, so when the device evicts it again
//!   nothing is written (a churn of the same hot blocks between a small host tier and the
//!   device costs one copy, not one per round trip).
//! - **Ghosts**: hashes of blocks that left the worker (evicted from the device unadmitted, or
//!   from the last tier), in a bounded first-in-first-out memory. A prompt whose blocks include
//!   a ghost repeats KV computed here before: it counts as reused (see
//!   [`KvCacheManager`](crate::KvCacheManager) for the admission rule).

use std::collections::{HashSet, VecDeque};
use std::time::Instant;

use crate::{BlockHash, CostModel, Elapsed, KvDigest, KvEvent, LoadDecision, Tier, TierStore};

/// What one tier did since the worker started.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TierStats {
    pub tier: Option<Tier>,
    pub capacity_blocks: usize,
    pub blocks: usize,
    /// Blocks brought up from this tier (instead of recomputed).
    pub hits: u64,
    pub bytes_loaded: u64,
    /// Seconds spent bringing blocks up (tier read and device write), and the CPU time of the
    /// threads that did it (apart from their waits for a core).
    pub load_seconds: f64,
    pub load_cpu_seconds: f64,
    /// Blocks written into this tier.
    pub stored: u64,
    pub bytes_stored: u64,
    pub store_seconds: f64,
    /// Blocks found here but recomputed because the cost model said recomputing was faster.
    pub cost_model_misses: u64,
    /// Blocks found unreadable (corrupt or truncated files): misses, never served.
    pub corrupt: u64,
    /// Blocks that could not be written (I/O errors): dropped.
    pub write_errors: u64,
    /// The fitted load bandwidth, bytes per second.
    pub load_bytes_per_s: f64,
}

/// A bounded first-in-first-out set of hashes.
struct Ghosts {
    order: VecDeque<BlockHash>,
    set: HashSet<BlockHash>,
    capacity: usize,
}

impl Ghosts {
    fn remember(&mut self, hash: BlockHash) {
        if self.capacity == 0 || !self.set.insert(hash) {
            return;
        }
        self.order.push_back(hash);
        if self.order.len() > self.capacity {
            let old = self.order.pop_front().expect("over capacity");
            self.set.remove(&old);
        }
    }
}

pub struct LowerTiers {
    tiers: Vec<Box<dyn TierStore>>,
    block_bytes: usize,
    ghosts: Ghosts,
    cost: CostModel,
    stats: [TierStats; 3],
    /// Over every (hash, tier) pair held below (see [`Tier::digest_key`]).
    digest: KvDigest,
}

impl LowerTiers {
    /// `tiers`, fastest first (none of them the device), holding blocks of `block_bytes`
    /// bytes and `block_tokens` tokens; hashes of up to `ghosts` blocks that left are
    /// remembered.
    pub fn new(
        tiers: Vec<Box<dyn TierStore>>,
        block_tokens: usize,
        block_bytes: usize,
        ghosts: usize,
    ) -> Self {
        assert!(
            tiers.iter().all(|t| t.tier() != Tier::Device),
            "the device is not a lower tier"
        );
        let mut stats = [TierStats::default(); 3];
        for t in &tiers {
            let s = &mut stats[t.tier().index()];
            s.tier = Some(t.tier());
            s.capacity_blocks = t.capacity_blocks();
        }
        Self {
            tiers,
            block_bytes,
            ghosts: Ghosts {
                order: VecDeque::new(),
                set: HashSet::new(),
                capacity: ghosts,
            },
            cost: CostModel::new(block_tokens, block_bytes),
            stats,
            digest: KvDigest::default(),
        }
    }

    /// Bytes of one block (every layer, K and V).
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    pub fn cost_model(&self) -> &CostModel {
        &self.cost
    }

    pub fn cost_model_mut(&mut self) -> &mut CostModel {
        &mut self.cost
    }

    /// The digest of every (hash, tier) pair held below.
    pub fn digest(&self) -> KvDigest {
        self.digest
    }

    /// Whether `hash` left this worker before (and is remembered).
    pub fn seen_before(&self, hash: BlockHash) -> bool {
        self.ghosts.set.contains(&hash)
    }

    /// Remembers a block that left the worker.
    pub fn remember(&mut self, hash: BlockHash) {
        self.ghosts.remember(hash);
    }

    /// The fastest tier holding `hash`.
    pub fn find(&self, hash: BlockHash) -> Option<Tier> {
        self.tiers
            .iter()
            .find(|t| t.contains(hash))
            .map(|t| t.tier())
    }

    /// Whether a block found in `tier` is loaded (counting a refusal as a cost-model miss).
    pub fn decide(&mut self, tier: Tier) -> bool {
        let decision = self.cost.decide(tier);
        if decision == LoadDecision::Recompute {
            self.stats[tier.index()].cost_model_misses += 1;
        }
        decision.loads()
    }

    fn changed(&mut self, hash: BlockHash, tier: Tier, added: bool) {
        self.digest.toggle(tier.digest_key(hash), added);
    }

    /// A block leaving the device: it enters the first tier (making room there by moving
    /// victims down). Events say where it went.
    pub fn store(&mut self, hash: BlockHash, block: &[u8], events: &mut Vec<KvEvent>) {
        if self.tiers.is_empty() || !self.store_at(0, hash, block, events) {
            events.push(KvEvent::Removed {
                hash,
                tier: Tier::Device,
            });
            self.remember(hash);
            return;
        }
        events.push(KvEvent::MovedDown {
            hash,
            from: Tier::Device,
            to: self.tiers[0].tier(),
        });
    }

    /// Puts a block into tier `level`; whether it is held there afterwards.
    fn store_at(
        &mut self,
        level: usize,
        hash: BlockHash,
        block: &[u8],
        events: &mut Vec<KvEvent>,
    ) -> bool {
        let tier = self.tiers[level].tier();
        if self.tiers[level].contains(hash) {
            self.tiers[level].touch(hash);
            return true;
        }
        if self.tiers[level].capacity_blocks() == 0 {
            return false;
        }
        while self.tiers[level].is_full() {
            let victim = self.tiers[level]
                .victim()
                .expect("a full tier has a victim");
            self.evict(level, victim, events);
        }
        let started = Instant::now();
        let put = self.tiers[level].put(hash, block);
        let s = &mut self.stats[tier.index()];
        match put {
            Ok(()) => {
                s.stored += 1;
                s.bytes_stored += block.len() as u64;
                s.store_seconds += started.elapsed().as_secs_f64();
                self.changed(hash, tier, true);
                true
            }
            Err(e) => {
                s.write_errors += 1;
                if s.write_errors == 1 {
                    tracing::warn!("KV {tier} tier: {e}; the block is dropped (logged once)");
                }
                false
            }
        }
    }

    /// Moves `victim` out of tier `level`: into the tier below, or out of the worker.
    fn evict(&mut self, level: usize, victim: BlockHash, events: &mut Vec<KvEvent>) {
        let tier = self.tiers[level].tier();
        let below = level + 1 < self.tiers.len();
        let mut moved = false;
        if below {
            let mut bytes = vec![0; self.block_bytes];
            if self.read_counting(level, victim, &mut bytes, events) {
                moved = self.store_at(level + 1, victim, &bytes, events);
            }
        }
        if self.tiers[level].remove(victim) {
            self.changed(victim, tier, false);
        }
        if moved {
            events.push(KvEvent::MovedDown {
                hash: victim,
                from: tier,
                to: self.tiers[level + 1].tier(),
            });
        } else {
            events.push(KvEvent::Removed { hash: victim, tier });
            if self.find(victim).is_none() {
                self.remember(victim);
            }
        }
    }

    /// Reads a block from tier `level`; a block found unreadable is dropped, counted and
    /// reported removed.
    fn read_counting(
        &mut self,
        level: usize,
        hash: BlockHash,
        out: &mut [u8],
        events: &mut Vec<KvEvent>,
    ) -> bool {
        let t = &mut self.tiers[level];
        let tier = t.tier();
        let (held, corrupt_before) = (t.contains(hash), t.corrupt_blocks());
        let read = t.read(hash, out);
        let corrupt = t.corrupt_blocks() - corrupt_before;
        let gone = held && !t.contains(hash);
        self.stats[tier.index()].corrupt += corrupt;
        if corrupt > 0 || gone {
            self.changed(hash, tier, false);
            events.push(KvEvent::Removed { hash, tier });
        }
        match read {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!("KV {tier} tier: {e}");
                false
            }
        }
    }

    /// Reads `hash` into `out` from the fastest tier that holds a good copy, marking it used
    /// there; the tier it came from, `None` when no tier had a good copy (bad copies are
    /// dropped on the way). The caller reports the whole load's time
    /// ([`loaded`](Self::loaded)).
    pub fn load(
        &mut self,
        hash: BlockHash,
        out: &mut [u8],
        events: &mut Vec<KvEvent>,
    ) -> Option<Tier> {
        for level in 0..self.tiers.len() {
            if !self.tiers[level].contains(hash) {
                continue;
            }
            if self.read_counting(level, hash, out, events) {
                self.tiers[level].touch(hash);
                return Some(self.tiers[level].tier());
            }
        }
        None
    }

    /// `blocks` blocks were brought up from `tier` in `took` (tier reads and device writes):
    /// counted, and the wall time fitted into the cost model.
    pub fn loaded(&mut self, tier: Tier, blocks: usize, took: Elapsed) {
        let s = &mut self.stats[tier.index()];
        s.hits += blocks as u64;
        s.bytes_loaded += (blocks * self.block_bytes) as u64;
        s.load_seconds += took.wall_seconds;
        s.load_cpu_seconds += took.cpu_seconds;
        self.cost.observe_load(tier, blocks, took.wall_seconds);
    }

    /// Forgets every block of every tier.
    pub fn clear(&mut self) {
        for t in &mut self.tiers {
            for h in t.hashes() {
                t.remove(h);
            }
        }
        self.digest = KvDigest::default();
    }

    /// Every (hash, tier) pair held below.
    pub fn held(&self) -> Vec<(BlockHash, Tier)> {
        self.tiers
            .iter()
            .flat_map(|t| t.hashes().into_iter().map(|h| (h, t.tier())))
            .collect()
    }

    /// The counts of each configured tier, fastest first.
    pub fn stats(&self) -> Vec<TierStats> {
        self.tiers
            .iter()
            .map(|t| {
                let tier = t.tier();
                TierStats {
                    blocks: t.len(),
                    load_bytes_per_s: self.cost.load_bytes_per_s(tier),
                    ..self.stats[tier.index()]
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DiskTier, HostTier};

    const BYTES: usize = 8;

    fn block(h: BlockHash) -> Vec<u8> {
        vec![h as u8; BYTES]
    }

    fn host_and_disk(host: usize, disk: u64, dir: &std::path::Path) -> LowerTiers {
        let disk_bytes = disk * (crate::disk_tier::HEADER_BYTES + BYTES) as u64;
        LowerTiers::new(
            vec![
                Box::new(HostTier::new(host, BYTES)),
                Box::new(DiskTier::new(dir, disk_bytes, BYTES, 1).unwrap()),
            ],
            16,
            BYTES,
            100,
        )
    }

    #[test]
    fn victims_move_down_then_leave_and_are_remembered() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = host_and_disk(2, 2, dir.path());
        let mut events = Vec::new();
        for h in 1..=5 {
            t.store(h, &block(h), &mut events);
        }
        use KvEvent::*;
        use Tier::*;
        let moved = |hash, from, to| MovedDown { hash, from, to };
        assert_eq!(
            events,
            [
                moved(1, Device, Host),
                moved(2, Device, Host),
                moved(1, Host, Disk),
                moved(3, Device, Host),
                moved(2, Host, Disk),
                moved(4, Device, Host),
                Removed {
                    hash: 1,
                    tier: Disk
                },
                moved(3, Host, Disk),
                moved(5, Device, Host),
            ]
        );
        assert_eq!(t.find(1), None);
        assert!(t.seen_before(1), "a block that left is remembered");
        assert_eq!((t.find(3), t.find(5)), (Some(Disk), Some(Host)));
        let mut held = t.held();
        held.sort();
        assert_eq!(held, [(2, Disk), (3, Disk), (4, Host), (5, Host)]);
        let mut want = KvDigest::default();
        for (h, tier) in held {
            want.toggle(tier.digest_key(h), true);
        }
        assert_eq!(t.digest(), want);
    }

    #[test]
    fn a_block_is_loaded_from_the_fastest_good_copy_and_kept_below() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = host_and_disk(1, 4, dir.path());
        let mut events = Vec::new();
        t.store(1, &block(1), &mut events);
        t.store(2, &block(2), &mut events); // 1 moves to disk
        let mut out = vec![0; BYTES];
        assert_eq!(t.load(1, &mut out, &mut events), Some(Tier::Disk));
        assert_eq!(out, block(1));
        assert_eq!(t.find(1), Some(Tier::Disk), "inclusive: the copy stays");
        // Evicted from the device again, it enters the host tier; the disk copy stays.
        events.clear();
        t.store(1, &block(1), &mut events);
        assert_eq!(t.find(1), Some(Tier::Host));
        t.loaded(
            Tier::Host,
            1,
            Elapsed {
                wall_seconds: 2e-6,
                cpu_seconds: 1e-6,
            },
        );
        let host = t.stats()[0];
        assert_eq!((host.hits, host.bytes_loaded), (1, BYTES as u64));
        assert_eq!((host.load_seconds, host.load_cpu_seconds), (2e-6, 1e-6));
        assert!(t.load(9, &mut out, &mut events).is_none());
    }

    #[test]
    fn a_corrupt_file_falls_through_to_a_miss_and_is_counted() {
        let dir = tempfile::tempdir().unwrap();
        let disk = DiskTier::new(dir.path(), 1 << 20, BYTES, 1).unwrap();
        let path = disk.path_of(7);
        let mut t = LowerTiers::new(vec![Box::new(disk)], 16, BYTES, 10);
        let mut events = Vec::new();
        t.store(7, &block(7), &mut events);
        std::fs::write(&path, b"garbage").unwrap();
        events.clear();
        let mut out = vec![0; BYTES];
        assert_eq!(t.load(7, &mut out, &mut events), None);
        assert_eq!(
            events,
            [KvEvent::Removed {
                hash: 7,
                tier: Tier::Disk
            }]
        );
        assert_eq!(t.stats()[0].corrupt, 1);
        assert_eq!(t.digest(), KvDigest::default());
    }

    #[test]
    fn without_room_below_a_block_leaves_the_worker() {
        let mut t = LowerTiers::new(vec![Box::new(HostTier::new(0, BYTES))], 16, BYTES, 10);
        let mut events = Vec::new();
        t.store(3, &block(3), &mut events);
        assert_eq!(
            events,
            [KvEvent::Removed {
                hash: 3,
                tier: Tier::Device
            }]
        );
        assert!(t.seen_before(3));
    }

    #[test]
    fn ghosts_are_bounded() {
        let mut t = LowerTiers::new(Vec::new(), 16, BYTES, 2);
        for h in 1..=3 {
            t.remember(h);
        }
        assert!(!t.seen_before(1));
        assert!(t.seen_before(2) && t.seen_before(3));
    }
}
