//! A pool of fixed-size KV blocks with reference counts and a prefix cache.
//!
//! A block is in exactly one of three states:
//! - **in use**: `ref_count > 0`, held by one or more sequences (shared prefix blocks);
//! - **cached**: `ref_count == 0` but its content hash is registered, so a later prompt with the
//!   same prefix can take it back; it sits in the LRU order and is evicted when space is needed;
//! - **free**: `ref_count == 0` and no hash.
//!
//! Allocation takes free blocks first and then evicts the least recently used cached block.
//!
//! While [recording](BlockPool::record_events), every change to the set of findable hashes is
//! appended to a list of [`KvEvent`]s (one per block, never per token) that the owner drains
//! between steps, and the pool keeps a [`KvDigest`] of that set.
//!
//! With tiers below it, the pool also [tracks evictions](BlockPool::track_evictions): each cached
//! block it evicts is listed ([`Eviction`]) with whether it was *admitted* (reused, or marked so
//! by its owner), so the owner can copy an admitted block's KV down before its slot is written
//! again. An admitted block's eviction is not reported as removed: the owner reports where it
//! went.

use std::collections::hash_map::Entry;

use crate::{BlockHash, SeqId, Tier};

/// Index of a block in the pool (and in the KV storage that mirrors it).
pub type BlockId = u32;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KvError {
    #[error("KV cache exhausted: {requested} blocks requested, {available} available")]
    Exhausted { requested: usize, available: usize },
    #[error("block {0} is not in use (double free or foreign block id)")]
    NotInUse(BlockId),
    #[error("block {block} out of range for a pool of {num_blocks} blocks")]
    OutOfRange { block: BlockId, num_blocks: usize },
    #[error("no sequence {0} holds KV blocks here")]
    UnknownSequence(SeqId),
    #[error("sequence {0} already holds KV blocks")]
    DuplicateSequence(SeqId),
}

/// A change to the set of (block hash, tier) pairs a worker holds (what a router indexes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// A full block's KV was computed (or received) into the device pool.
    Stored(BlockHash),
    /// The block left tier `from` and is now held in `to`, below it.
    MovedDown {
        hash: BlockHash,
        from: Tier,
        to: Tier,
    },
    /// The block was loaded into the device pool from `from`, which keeps its copy.
    BroughtUp { hash: BlockHash, from: Tier },
    /// The block left `tier`.
    Removed { hash: BlockHash, tier: Tier },
    /// Every block of every tier was forgotten.
    Cleared,
}

/// A cached block the pool evicted to reuse its slot (see [`BlockPool::track_evictions`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Eviction {
    pub block: BlockId,
    pub hash: BlockHash,
    /// Reused (or marked admitted): its KV should move down before the slot is written.
    pub admitted: bool,
}

/// The set of held blocks in brief: how many, and the XOR of their keys (a block's hash in the
/// device pool, see [`Tier::digest_key`] below it). Two copies of a set that differ almost surely
/// differ here.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvDigest {
    pub block_count: u64,
    pub hash_xor: u64,
}

impl KvDigest {
    /// The digest with `hash` added to or removed from the set (XOR is its own inverse).
    pub fn toggle(&mut self, hash: BlockHash, added: bool) {
        self.hash_xor ^= hash;
        if added {
            self.block_count += 1;
        } else {
            self.block_count -= 1;
        }
    }
}

#[derive(Clone, Debug, Default)]
struct BlockMeta {
    ref_count: u32,
    hash: Option<BlockHash>,
    /// Worth moving down when evicted (see [`Eviction::admitted`]).
    admitted: bool,
}

/// The cached blocks in the order they were last released, oldest first: a doubly linked list
/// threaded through per-block links, so that releasing, reusing (from anywhere in the order) and
/// evicting a block cost O(1) and allocate nothing, on every block of every request.
#[derive(Clone, Debug)]
struct LruOrder {
    /// `(previous, next)` of each block; [`NOT_LISTED`] as previous: not in the order.
    links: Vec<(BlockId, BlockId)>,
    head: BlockId,
    tail: BlockId,
    len: usize,
}

/// No block: the end of the order.
const NONE: BlockId = BlockId::MAX;
/// The previous link of a block not in the order.
const NOT_LISTED: BlockId = BlockId::MAX - 1;

impl LruOrder {
    fn new(num_blocks: usize) -> Self {
        Self {
            links: vec![(NOT_LISTED, NONE); num_blocks],
            head: NONE,
            tail: NONE,
            len: 0,
        }
    }

    fn len(&self) -> usize {
        self.len
    }

    /// Appends `b` as the most recently used.
    fn push_newest(&mut self, b: BlockId) {
        debug_assert_eq!(self.links[b as usize].0, NOT_LISTED);
        self.links[b as usize] = (self.tail, NONE);
        match self.tail {
            NONE => self.head = b,
            tail => self.links[tail as usize].1 = b,
        }
        self.tail = b;
        self.len += 1;
    }

    /// Takes `b` out of the order (if it is in it).
    fn remove(&mut self, b: BlockId) {
        let (prev, next) = self.links[b as usize];
        if prev == NOT_LISTED {
            return;
        }
        match prev {
            NONE => self.head = next,
            p => self.links[p as usize].1 = next,
        }
        match next {
            NONE => self.tail = prev,
            n => self.links[n as usize].0 = prev,
        }
        self.links[b as usize] = (NOT_LISTED, NONE);
        self.len -= 1;
    }

    fn pop_oldest(&mut self) -> Option<BlockId> {
        let b = self.head;
        (b != NONE).then(|| {
            self.remove(b);
            b
        })
    }
}

/// Counts for metrics and admission decisions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolStats {
    pub num_blocks: usize,
    pub in_use: usize,
    pub cached: usize,
    pub free: usize,
}

pub struct BlockPool {
    block_size: usize,
    blocks: Vec<BlockMeta>,
    free: Vec<BlockId>,
    /// Cached blocks by last use.
    lru: LruOrder,
    by_hash: foldhash::HashMap<BlockHash, BlockId>,
    in_use: usize,
    /// Events not drained yet; `None` while not recording.
    events: Option<Vec<KvEvent>>,
    digest: KvDigest,
    /// Evictions not drained yet; `None` while not tracking.
    evictions: Option<Vec<Eviction>>,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "block size must be positive");
        assert!(num_blocks <= BlockId::MAX as usize, "too many blocks");
        Self {
            block_size,
            blocks: vec![BlockMeta::default(); num_blocks],
            // Pop from the end: hand out low ids first.
            free: (0..num_blocks as BlockId).rev().collect(),
            lru: LruOrder::new(num_blocks),
            by_hash: foldhash::HashMap::default(),
            in_use: 0,
            events: None,
            digest: KvDigest::default(),
            evictions: None,
        }
    }

    /// Starts listing evicted cached blocks (for [`take_evictions`](Self::take_evictions)).
    pub fn track_evictions(&mut self) {
        self.evictions.get_or_insert_with(Vec::new);
    }

    /// The evictions since the last call (none when not tracking).
    pub fn take_evictions(&mut self) -> Vec<Eviction> {
        self.evictions
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Marks a block holding a registered hash as worth moving down when evicted.
    pub fn mark_admitted(&mut self, block: BlockId) {
        if let Some(meta) = self.blocks.get_mut(block as usize)
            && meta.hash.is_some()
        {
            meta.admitted = true;
        }
    }

    /// Starts recording [`KvEvent`]s (for [`take_events`](Self::take_events)).
    pub fn record_events(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }

    /// The events since the last call (none when not recording).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The digest of the findable hashes now.
    pub fn digest(&self) -> KvDigest {
        self.digest
    }

    /// Records a change of the device pool's hashes.
    fn changed(&mut self, event: KvEvent) {
        match event {
            KvEvent::Stored(h) | KvEvent::BroughtUp { hash: h, .. } => self.digest.toggle(h, true),
            KvEvent::Removed { hash, .. } => self.digest.toggle(hash, false),
            KvEvent::MovedDown { .. } => {}
            KvEvent::Cleared => self.digest = KvDigest::default(),
        }
        if let Some(events) = &mut self.events {
            events.push(event);
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that an allocation could obtain now (free plus evictable cached).
    pub fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    pub fn stats(&self) -> PoolStats {
        PoolStats {
            num_blocks: self.blocks.len(),
            in_use: self.in_use,
            cached: self.lru.len(),
            free: self.free.len(),
        }
    }

    /// Takes `n` blocks (reference count 1 each), free ones first, then evicting the least
    /// recently used cached ones; or none at all if fewer are available.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>, KvError> {
        self.take(n, self.available())
    }

    /// Takes `n` free blocks, never evicting a cached one (what speculative drafts get: a cached
    /// prefix is worth more than a guess); or none at all if fewer are free.
    pub fn allocate_free(&mut self, n: usize) -> Result<Vec<BlockId>, KvError> {
        self.take(n, self.free.len())
    }

    /// Takes `n` blocks out of the `available` an allocation may have.
    fn take(&mut self, n: usize, available: usize) -> Result<Vec<BlockId>, KvError> {
        if n > available {
            return Err(KvError::Exhausted {
                requested: n,
                available,
            });
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = match self.free.pop() {
                Some(id) => id,
                None => self.evict_oldest(),
            };
            let meta = &mut self.blocks[id as usize];
            debug_assert_eq!(meta.ref_count, 0);
            meta.ref_count = 1;
            self.in_use += 1;
            out.push(id);
        }
        Ok(out)
    }

    fn evict_oldest(&mut self) -> BlockId {
        let id = self
            .lru
            .pop_oldest()
            .expect("available() counted a cached block");
        let meta = &mut self.blocks[id as usize];
        let admitted = std::mem::take(&mut meta.admitted);
        if let Some(hash) = meta.hash.take() {
            self.by_hash.remove(&hash);
            match &mut self.evictions {
                Some(evictions) => {
                    evictions.push(Eviction {
                        block: id,
                        hash,
                        admitted,
                    });
                    if admitted {
                        // Where it goes is the owner's event to report.
                        self.digest.toggle(hash, false);
                    } else {
                        self.changed(KvEvent::Removed {
                            hash,
                            tier: Tier::Device,
                        });
                    }
                }
                None => self.changed(KvEvent::Removed {
                    hash,
                    tier: Tier::Device,
                }),
            }
        }
        id
    }

    /// Takes one more reference to each block, all in use: they stay out of the free list and
    /// the cache until [`release`](Self::release)d as often. Validates every id before changing
    /// anything.
    pub fn share(&mut self, blocks: &[BlockId]) -> Result<(), KvError> {
        self.check_in_use(blocks)?;
        for &b in blocks {
            self.blocks[b as usize].ref_count += 1;
        }
        Ok(())
    }

    /// Drops one reference to each block. Blocks that reach zero become cached (if hashed) or
    /// free. Validates every id before changing anything.
    pub fn release(&mut self, blocks: &[BlockId]) -> Result<(), KvError> {
        self.check_in_use(blocks)?;
        for &b in blocks {
            let meta = &mut self.blocks[b as usize];
            // The same id twice in one call must not underflow.
            if meta.ref_count == 0 {
                return Err(KvError::NotInUse(b));
            }
            meta.ref_count -= 1;
            if meta.ref_count == 0 {
                self.in_use -= 1;
                if meta.hash.is_some() {
                    self.lru.push_newest(b);
                } else {
                    meta.admitted = false;
                    self.free.push(b);
                }
            }
        }
        Ok(())
    }

    /// Every one of `blocks` exists and is in use.
    fn check_in_use(&self, blocks: &[BlockId]) -> Result<(), KvError> {
        for &b in blocks {
            self.check(b)?;
            if self.blocks[b as usize].ref_count == 0 {
                return Err(KvError::NotInUse(b));
            }
        }
        Ok(())
    }

    /// Registers the content hash of a block whose KV is now fully written, making it findable
    /// by [`lookup_prefix`](Self::lookup_prefix). If another block already holds this content,
    /// this one stays anonymous (it is freed normally later). Returns whether it was registered.
    pub fn register_hash(&mut self, block: BlockId, hash: BlockHash) -> Result<bool, KvError> {
        self.register(block, hash, KvEvent::Stored(hash))
    }

    /// Registers a block whose KV was loaded from tier `from` below the pool (see
    /// [`register_hash`](Self::register_hash)); it is admitted (it came from below).
    pub fn register_loaded(
        &mut self,
        block: BlockId,
        hash: BlockHash,
        from: Tier,
    ) -> Result<bool, KvError> {
        let registered = self.register(block, hash, KvEvent::BroughtUp { hash, from })?;
        if registered {
            self.blocks[block as usize].admitted = true;
        }
        Ok(registered)
    }

    fn register(
        &mut self,
        block: BlockId,
        hash: BlockHash,
        event: KvEvent,
    ) -> Result<bool, KvError> {
        self.check(block)?;
        if self.blocks[block as usize].ref_count == 0 {
            return Err(KvError::NotInUse(block));
        }
        if self.blocks[block as usize].hash.is_some() {
            return Ok(false);
        }
        // One lookup (the map is large and each lookup a cache miss): taken, or taken now.
        match self.by_hash.entry(hash) {
            Entry::Occupied(_) => return Ok(false),
            Entry::Vacant(v) => v.insert(block),
        };
        self.blocks[block as usize].hash = Some(hash);
        self.changed(event);
        Ok(true)
    }

    /// Number of leading `hashes` whose blocks are present (in use or cached), without taking them.
    pub fn cached_prefix_len(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.by_hash.contains_key(h))
            .count()
    }

    /// Takes a reference to the blocks of the longest present prefix of `hashes` and returns them
    /// in order (possibly none).
    pub fn lookup_prefix(&mut self, hashes: &[BlockHash]) -> Vec<BlockId> {
        let mut out = Vec::new();
        for h in hashes {
            let Some(&id) = self.by_hash.get(h) else {
                break;
            };
            let meta = &mut self.blocks[id as usize];
            if meta.ref_count == 0 {
                self.lru.remove(id);
                self.in_use += 1;
            }
            meta.ref_count += 1;
            // Found again: reused, so worth keeping below when evicted.
            meta.admitted = true;
            out.push(id);
        }
        out
    }

    /// The content hash registered for a block, if any.
    pub fn hash_of(&self, block: BlockId) -> Option<BlockHash> {
        self.blocks.get(block as usize).and_then(|m| m.hash)
    }

    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.blocks.get(block as usize).map_or(0, |m| m.ref_count)
    }

    /// Forgets every hash: cached blocks become free (their KV may be overwritten), in-use blocks
    /// anonymous (freed normally later). One [`KvEvent::Cleared`] says so.
    pub fn clear_cache(&mut self) {
        while let Some(id) = self.lru.pop_oldest() {
            self.free.push(id);
        }
        for (_, id) in self.by_hash.drain() {
            let meta = &mut self.blocks[id as usize];
            meta.hash = None;
            meta.admitted = false;
        }
        self.changed(KvEvent::Cleared);
    }

    fn check(&self, block: BlockId) -> Result<(), KvError> {
        if (block as usize) < self.blocks.len() {
            Ok(())
        } else {
            Err(KvError::OutOfRange {
                block,
                num_blocks: self.blocks.len(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_until_exhausted_and_all_or_nothing() {
        let mut pool = BlockPool::new(4, 16);
        let a = pool.allocate(3).unwrap();
        assert_eq!(a.len(), 3);
        assert_eq!(
            pool.allocate(2),
            Err(KvError::Exhausted {
                requested: 2,
                available: 1
            })
        );
        assert_eq!(pool.stats().in_use, 3, "a failed allocation takes nothing");
        let b = pool.allocate(1).unwrap();
        assert!(!a.contains(&b[0]));
        assert_eq!(pool.available(), 0);
    }

    #[test]
    fn freeing_returns_blocks_and_rejects_double_free() {
        let mut pool = BlockPool::new(2, 16);
        let a = pool.allocate(2).unwrap();
        pool.release(&a).unwrap();
        assert_eq!(pool.available(), 2);
        assert_eq!(pool.release(&a[..1]), Err(KvError::NotInUse(a[0])));
        assert_eq!(
            pool.release(&[9]),
            Err(KvError::OutOfRange {
                block: 9,
                num_blocks: 2
            })
        );
        let b = pool.allocate(1).unwrap();
        assert_eq!(pool.release(&[b[0], b[0]]), Err(KvError::NotInUse(b[0])));
    }

    #[test]
    fn prefix_hits_share_blocks_and_survive_release() {
        let mut pool = BlockPool::new(4, 16);
        let a = pool.allocate(2).unwrap();
        assert!(pool.register_hash(a[0], 100).unwrap());
        assert!(pool.register_hash(a[1], 200).unwrap());
        // A second sequence shares the prefix while the first still runs.
        let shared = pool.lookup_prefix(&[100, 200, 300]);
        assert_eq!(shared, a);
        assert_eq!(pool.ref_count(a[0]), 2);
        pool.release(&a).unwrap();
        pool.release(&shared).unwrap();
        // Released hashed blocks stay findable as cache.
        assert_eq!(
            pool.stats(),
            PoolStats {
                num_blocks: 4,
                in_use: 0,
                cached: 2,
                free: 2
            }
        );
        assert_eq!(pool.cached_prefix_len(&[100, 200]), 2);
        assert_eq!(
            pool.cached_prefix_len(&[100, 999, 200]),
            1,
            "a prefix stops at the first miss"
        );
        let again = pool.lookup_prefix(&[100]);
        assert_eq!(again, vec![a[0]]);
        assert_eq!(pool.stats().cached, 1);
    }

    #[test]
    fn duplicate_content_stays_anonymous() {
        let mut pool = BlockPool::new(2, 16);
        let a = pool.allocate(2).unwrap();
        assert!(pool.register_hash(a[0], 7).unwrap());
        assert!(!pool.register_hash(a[1], 7).unwrap());
        pool.release(&a).unwrap();
        assert_eq!(pool.stats().cached, 1);
        assert_eq!(pool.stats().free, 1);
    }

    #[test]
    fn evicts_least_recently_used_cached_block_first() {
        let mut pool = BlockPool::new(3, 16);
        let blocks = pool.allocate(3).unwrap();
        for (i, &b) in blocks.iter().enumerate() {
            pool.register_hash(b, 10 + i as u64).unwrap();
        }
        // Release in order 1, 0, 2: block 1 is the oldest cached.
        pool.release(&[blocks[1]]).unwrap();
        pool.release(&[blocks[0]]).unwrap();
        pool.release(&[blocks[2]]).unwrap();
        // A hit on block 0 followed by its release makes it the newest.
        let hit = pool.lookup_prefix(&[10]);
        assert_eq!(hit, vec![blocks[0]]);
        pool.release(&hit).unwrap();
        let taken = pool.allocate(1).unwrap();
        assert_eq!(
            taken,
            vec![blocks[1]],
            "oldest cached block is evicted first"
        );
        assert_eq!(pool.hash_of(blocks[1]), None, "eviction forgets the hash");
        assert_eq!(pool.cached_prefix_len(&[11]), 0);
        assert_eq!(pool.allocate(1).unwrap(), vec![blocks[2]]);
        assert_eq!(pool.allocate(1).unwrap(), vec![blocks[0]]);
        assert!(matches!(pool.allocate(1), Err(KvError::Exhausted { .. })));
    }

    #[test]
    fn allocating_free_blocks_never_evicts() {
        let mut pool = BlockPool::new(3, 16);
        pool.record_events();
        let a = pool.allocate(2).unwrap();
        pool.register_hash(a[0], 1).unwrap();
        pool.release(&a[..1]).unwrap();
        pool.take_events();
        // One block free, one cached: only the free one can be had this way.
        assert_eq!(
            pool.allocate_free(2),
            Err(KvError::Exhausted {
                requested: 2,
                available: 1
            })
        );
        let b = pool.allocate_free(1).unwrap();
        assert!(!a.contains(&b[0]));
        assert_eq!(pool.stats().cached, 1);
        assert!(pool.take_events().is_empty(), "nothing evicted");
        assert_eq!(pool.cached_prefix_len(&[1]), 1);
        assert!(pool.allocate_free(1).is_err(), "the cached block stays");
        assert_eq!(pool.cached_prefix_len(&[1]), 1);
    }

    #[test]
    fn clear_cache_frees_cached_blocks_only() {
        let mut pool = BlockPool::new(3, 16);
        let a = pool.allocate(2).unwrap();
        pool.register_hash(a[0], 1).unwrap();
        pool.register_hash(a[1], 2).unwrap();
        pool.release(&a[..1]).unwrap();
        pool.clear_cache();
        assert_eq!(
            pool.stats(),
            PoolStats {
                num_blocks: 3,
                in_use: 1,
                cached: 0,
                free: 2
            }
        );
        assert_eq!(pool.cached_prefix_len(&[1, 2]), 0);
        assert_eq!(pool.hash_of(a[1]), None, "in-use blocks become anonymous");
        pool.release(&a[1..]).unwrap();
        assert_eq!(
            pool.stats().free,
            3,
            "an anonymous block is freed, not cached"
        );
    }

    #[test]
    fn events_follow_the_findable_hashes() {
        let mut pool = BlockPool::new(2, 16);
        let a = pool.allocate(2).unwrap();
        pool.register_hash(a[0], 1).unwrap();
        assert!(pool.take_events().is_empty(), "not recording yet");
        pool.record_events();
        pool.register_hash(a[1], 2).unwrap();
        // Duplicate content is not findable: no event.
        assert!(!pool.register_hash(a[1], 1).unwrap());
        pool.release(&a).unwrap();
        let digest = pool.digest();
        assert_eq!((digest.block_count, digest.hash_xor), (2, 1 ^ 2));
        // Eviction by allocation removes the least recently used.
        let b = pool.allocate(1).unwrap();
        assert_eq!(
            pool.take_events(),
            [
                KvEvent::Stored(2),
                KvEvent::Removed {
                    hash: 1,
                    tier: Tier::Device
                }
            ]
        );
        assert_eq!(pool.digest().block_count, 1);
        pool.release(&b).unwrap();
        pool.clear_cache();
        assert_eq!(pool.take_events(), [KvEvent::Cleared]);
        assert_eq!(pool.digest(), KvDigest::default());
        assert!(pool.take_events().is_empty(), "drained");
    }

    #[test]
    fn evictions_list_admitted_blocks_for_their_owner_to_move_down() {
        let mut pool = BlockPool::new(4, 16);
        pool.record_events();
        pool.track_evictions();
        let a = pool.allocate(4).unwrap();
        for (i, &b) in a.iter().take(3).enumerate() {
            pool.register_hash(b, 10 + i as u64).unwrap();
        }
        pool.mark_admitted(a[1]);
        pool.mark_admitted(a[3]); // anonymous: nothing to admit
        pool.release(&a).unwrap();
        // Found again: reused.
        let hit = pool.lookup_prefix(&[12]);
        pool.release(&hit).unwrap();
        pool.take_events();
        pool.allocate(4).unwrap();
        let evicted = |block, hash, admitted| Eviction {
            block,
            hash,
            admitted,
        };
        assert_eq!(
            pool.take_evictions(),
            [
                evicted(a[0], 10, false),
                evicted(a[1], 11, true),
                evicted(a[2], 12, true)
            ]
        );
        assert_eq!(
            pool.take_events(),
            [KvEvent::Removed {
                hash: 10,
                tier: Tier::Device
            }],
            "where an admitted block went is its owner's to report"
        );
        assert_eq!(pool.digest(), KvDigest::default());
        assert!(pool.take_evictions().is_empty(), "drained");
    }

    #[test]
    fn a_loaded_block_is_brought_up_and_admitted() {
        let mut pool = BlockPool::new(1, 16);
        pool.record_events();
        pool.track_evictions();
        let b = pool.allocate(1).unwrap();
        assert!(pool.register_loaded(b[0], 5, Tier::Disk).unwrap());
        assert_eq!(
            pool.take_events(),
            [KvEvent::BroughtUp {
                hash: 5,
                from: Tier::Disk
            }]
        );
        assert_eq!(pool.digest().hash_xor, 5);
        pool.release(&b).unwrap();
        pool.allocate(1).unwrap();
        assert!(pool.take_evictions()[0].admitted);
    }
}
