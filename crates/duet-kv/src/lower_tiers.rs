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
//! - **Lent slots**: a block brought up from page-locked host memory is copied by the device
//!   straight from its slot ([`BlockBytes::Lent`]); the slot keeps its bytes until the engine
//!   reports the copies complete ([`LowerTiers::copies_done`]), and a block moving in that
//!   needs such a slot waits for them first.
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
    /// The tier's memory is page-locked: the device copies blocks straight from their slots.
    pub page_locked: bool,
    /// Blocks brought up straight from their slot (lent to the device's copy, not copied out).
    pub lent: u64,
    /// Blocks moving in that waited for the device's copies in flight to free a slot.
    pub copy_waits: u64,
    /// The fitted load bandwidth, bytes per second.
    pub load_bytes_per_s: f64,
}

/// The bytes of a block brought up from a tier.
#[derive(Debug)]
pub enum BlockBytes {
    /// Read out of the tier.
    Copied(Vec<u8>),
    /// Left in slot `slot` of `tier`'s page-locked memory, lent to the device's copy
    /// ([`LowerTiers::start_copy`] gives the bytes as it is queued) until
    /// [`LowerTiers::copies_done`].
    Lent { tier: Tier, slot: usize },
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
            s.page_locked = t.page_locked();
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
    /// victims down). `fill` writes its bytes, straight into the tier's slot where it has one
    /// (`false`: the device could not read them, and the block is gone);
    /// `wait_for_copies` waits for the device's copies reading lent slots (`true` once they
    /// completed), called only when a block moving in needs a slot one of them still reads.
    /// Events say where the block went.
    pub fn store(
        &mut self,
        hash: BlockHash,
        fill: &mut dyn FnMut(&mut [u8]) -> bool,
        wait_for_copies: &mut dyn FnMut() -> bool,
        events: &mut Vec<KvEvent>,
    ) {
        if self.tiers.is_empty() || !self.store_at(0, hash, fill, wait_for_copies, events) {
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
        fill: &mut dyn FnMut(&mut [u8]) -> bool,
        wait_for_copies: &mut dyn FnMut() -> bool,
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
            self.evict(level, victim, wait_for_copies, events);
        }
        if self.tiers[level].waits_for_copies() {
            self.stats[tier.index()].copy_waits += 1;
            if !wait_for_copies() {
                return false; // the device failed: nothing is read or written any more
            }
            self.copies_done();
        }
        let started = Instant::now();
        let put = self.tiers[level].put_with(hash, fill);
        let s = &mut self.stats[tier.index()];
        match put {
            Ok(false) => false,
            Ok(true) => {
                s.stored += 1;
                s.bytes_stored += self.block_bytes as u64;
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
    fn evict(
        &mut self,
        level: usize,
        victim: BlockHash,
        wait_for_copies: &mut dyn FnMut() -> bool,
        events: &mut Vec<KvEvent>,
    ) {
        let tier = self.tiers[level].tier();
        let below = level + 1 < self.tiers.len();
        let mut moved = false;
        if below {
            let mut bytes = vec![0; self.block_bytes];
            if self.read_counting(level, victim, &mut bytes, events) {
                let mut copy = |out: &mut [u8]| {
                    out.copy_from_slice(&bytes);
                    true
                };
                moved = self.store_at(level + 1, victim, &mut copy, wait_for_copies, events);
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

    /// The bytes of `hash` from the fastest tier that holds a good copy, marking it used
    /// there: lent in place from page-locked memory, else read out. The tier it came from,
    /// `None` when no tier had a good copy (bad copies are dropped on the way). The caller
    /// reports the whole load's time ([`loaded`](Self::loaded)).
    pub fn load(
        &mut self,
        hash: BlockHash,
        events: &mut Vec<KvEvent>,
    ) -> Option<(Tier, BlockBytes)> {
        for level in 0..self.tiers.len() {
            if !self.tiers[level].contains(hash) {
                continue;
            }
            let tier = self.tiers[level].tier();
            if let Some(slot) = self.tiers[level].lend(hash) {
                self.tiers[level].touch(hash);
                self.stats[tier.index()].lent += 1;
                return Some((tier, BlockBytes::Lent { tier, slot }));
            }
            let mut out = vec![0; self.block_bytes];
            if self.read_counting(level, hash, &mut out, events) {
                self.tiers[level].touch(hash);
                return Some((tier, BlockBytes::Copied(out)));
            }
        }
        None
    }

    /// The bytes of a block [`load`](Self::load) brought up, as its copy to the device is
    /// queued: a lent slot is read by that copy until [`copies_done`](Self::copies_done).
    pub fn start_copy<'a>(&'a mut self, bytes: &'a BlockBytes) -> &'a [u8] {
        match bytes {
            BlockBytes::Copied(b) => b,
            &BlockBytes::Lent { tier, slot } => self
                .tiers
                .iter_mut()
                .find(|t| t.tier() == tier)
                .and_then(|t| t.start_copy(slot))
                .expect("a slot stays lent until its copy is queued"),
        }
    }

    /// Every device copy queued so far has completed: the slots they read are the tiers' again.
    pub fn copies_done(&mut self) {
        for t in &mut self.tiers {
            t.copies_done();
        }
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

    /// Block `h` leaving the device; never waits for copies (none is lent here).
    fn store(t: &mut LowerTiers, h: BlockHash, events: &mut Vec<KvEvent>) {
        let mut fill = |out: &mut [u8]| {
            out.copy_from_slice(&block(h));
            true
        };
        t.store(
            h,
            &mut fill,
            &mut || unreachable!("no copy in flight"),
            events,
        );
    }

    fn copied(t: &mut LowerTiers, h: BlockHash, events: &mut Vec<KvEvent>) -> Option<Tier> {
        let (tier, bytes) = t.load(h, events)?;
        let BlockBytes::Copied(bytes) = bytes else {
            panic!("lent from pageable memory");
        };
        assert_eq!(bytes, block(h));
        Some(tier)
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
            store(&mut t, h, &mut events);
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
        store(&mut t, 1, &mut events);
        store(&mut t, 2, &mut events); // 1 moves to disk
        assert_eq!(copied(&mut t, 1, &mut events), Some(Tier::Disk));
        assert_eq!(t.find(1), Some(Tier::Disk), "inclusive: the copy stays");
        // Evicted from the device again, it enters the host tier; the disk copy stays.
        events.clear();
        store(&mut t, 1, &mut events);
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
        assert!(t.load(9, &mut events).is_none());
    }

    #[test]
    fn a_corrupt_file_falls_through_to_a_miss_and_is_counted() {
        let dir = tempfile::tempdir().unwrap();
        let disk = DiskTier::new(dir.path(), 1 << 20, BYTES, 1).unwrap();
        let path = disk.path_of(7);
        let mut t = LowerTiers::new(vec![Box::new(disk)], 16, BYTES, 10);
        let mut events = Vec::new();
        store(&mut t, 7, &mut events);
        std::fs::write(&path, b"garbage").unwrap();
        events.clear();
        assert!(t.load(7, &mut events).is_none());
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
        store(&mut t, 3, &mut events);
        assert_eq!(
            events,
            [KvEvent::Removed {
                hash: 3,
                tier: Tier::Device
            }]
        );
        assert!(t.seen_before(3));
    }

    /// Host memory a device copies straight from.
    struct PageLocked(Vec<u8>);

    impl crate::HostMemory for PageLocked {
        fn bytes(&self) -> &[u8] {
            &self.0
        }
        fn bytes_mut(&mut self) -> &mut [u8] {
            &mut self.0
        }
        fn page_locked(&self) -> bool {
            true
        }
    }

    fn page_locked_host(blocks: usize) -> LowerTiers {
        let memory = Box::new(PageLocked(vec![0; blocks * BYTES]));
        let host = HostTier::in_memory(blocks, BYTES, memory);
        LowerTiers::new(vec![Box::new(host)], 16, BYTES, 10)
    }

    /// A block brought up from page-locked memory is lent, not copied; while its copy is in
    /// flight, a block moving in that needs its slot waits for the copy first, and only then
    /// writes the slot.
    #[test]
    fn a_slot_read_by_a_copy_in_flight_is_written_only_after_the_copy() {
        let mut t = page_locked_host(1);
        let mut events = Vec::new();
        store(&mut t, 1, &mut events);
        let (tier, bytes) = t.load(1, &mut events).unwrap();
        assert_eq!(tier, Tier::Host);
        assert!(matches!(bytes, BlockBytes::Lent { .. }), "{bytes:?}");
        let copying = t.start_copy(&bytes);
        assert_eq!(copying, block(1));
        let copied_slot = copying.as_ptr() as usize;
        let (waited, mut written_before_wait) = (std::cell::Cell::new(0), false);
        let mut fill = |out: &mut [u8]| {
            written_before_wait |= out.as_ptr() as usize == copied_slot && waited.get() == 0;
            out.copy_from_slice(&block(2));
            true
        };
        let mut wait = || {
            waited.set(waited.get() + 1);
            true
        };
        events.clear();
        t.store(2, &mut fill, &mut wait, &mut events);
        assert!(
            !written_before_wait,
            "the slot was rewritten under the copy"
        );
        assert_eq!(waited.get(), 1, "the block waited for the copy");
        assert_eq!(t.find(2), Some(Tier::Host), "{events:?}");
        let host = t.stats()[0];
        assert!(host.page_locked);
        assert_eq!((host.lent, host.copy_waits), (1, 1));
        // Nothing in flight now: the next block takes a slot without waiting.
        let mut never = || -> bool { panic!("no copy in flight") };
        let mut fill = |out: &mut [u8]| {
            out.copy_from_slice(&block(3));
            true
        };
        t.store(3, &mut fill, &mut never, &mut events);
        assert_eq!(t.find(3), Some(Tier::Host));
    }

    /// A slot lent to a copy not queued yet survives the completion of the copies queued before
    /// it: a block moving in does not take it, and the copy later reads the block lent.
    #[test]
    fn a_lent_slot_whose_copy_is_not_queued_is_kept_through_copies_done() {
        let mut t = page_locked_host(1);
        let mut events = Vec::new();
        store(&mut t, 1, &mut events);
        let (_, bytes) = t.load(1, &mut events).unwrap();
        events.clear();
        // Waiting would not free the slot (its copy is not even queued): the block leaves.
        let mut fill = |_: &mut [u8]| -> bool { panic!("written into a lent slot") };
        t.store(
            2,
            &mut fill,
            &mut || panic!("waited for nothing"),
            &mut events,
        );
        assert_eq!(t.find(2), None);
        assert!(events.contains(&KvEvent::Removed {
            hash: 2,
            tier: Tier::Device
        }));
        t.copies_done();
        assert_eq!(
            t.start_copy(&bytes),
            block(1),
            "the lent slot kept its bytes"
        );
        t.copies_done();
        store(&mut t, 3, &mut events);
        assert_eq!(t.find(3), Some(Tier::Host), "the slot is free again");
    }

    #[test]
    fn pageable_memory_is_read_out_never_lent() {
        let mut t = LowerTiers::new(vec![Box::new(HostTier::new(2, BYTES))], 16, BYTES, 10);
        let mut events = Vec::new();
        store(&mut t, 4, &mut events);
        assert_eq!(copied(&mut t, 4, &mut events), Some(Tier::Host));
        assert!(!t.stats()[0].page_locked);
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
