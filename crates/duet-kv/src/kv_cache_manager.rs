//! The KV cache manager: the only owner of the [`BlockPool`]. It gives sequences blocks (reusing
//! cached prefix blocks), registers the content hashes of blocks as they fill, frees them, and
//! holds blocks for KV arriving from another worker ([`KvReservation`]). A scheduler sees a
//! sequence's blocks only as [`KvBlocks`].
//!
//! With [tiers below the pool](KvCacheManager::with_lower_tiers), a prefix is looked up in the
//! device pool and then below it: a block found below is brought up (read from its tier into a
//! fresh device block) where the cost model says loading beats recomputing. The bytes themselves
//! move through the engine, which owns the device store: after every call that may evict or
//! load it takes the [`KvMoves`] owed (copies down of evicted blocks first, then the loaded
//! blocks to write) before any step or transfer writes a block.
//!
//! **Admission.** An evicted block moves down only if it is *admitted*: it was found again in
//! the pool (reused), came from below, or belongs to a sequence whose prompt reused KV (a
//! prefix found in any tier, or a block this worker computed before and let go, remembered as a
//! ghost). The unit of reuse in chats and agent loops is the growing prefix: each turn's new
//! blocks extend a prefix that was just reused and are the next turn's prefix. Gating each
//! block on its own second use (vLLM's "seen twice") would keep a turn's blocks below only from
//! their third use on, after they were evicted and recomputed once; gating on the prefix keeps
//! them from the first turn that showed reuse, while a workload without any reuse (every prompt
//! new) writes nothing below and pays nothing.

use crate::{
    BlockBytes, BlockHash, BlockId, BlockPool, BlockTable, Elapsed, KvDigest, KvError, KvEvent,
    LowerTiers, Stopwatch, Tier, TierStats, block_hashes, next_block_hash, request_hash_seed,
};

/// Identifies a sequence (one request) among those whose blocks a manager tracks.
pub type SeqId = u64;

/// The blocks a sequence holds, in position order: what a scheduler sees of the cache.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KvBlocks {
    table: BlockTable,
    num_cached: usize,
}

impl KvBlocks {
    pub fn ids(&self) -> &[BlockId] {
        self.table.blocks()
    }

    /// Leading blocks that came from the prefix cache when the sequence was admitted.
    pub fn num_cached(&self) -> usize {
        self.num_cached
    }
}

/// Blocks held against late writes ([`KvCacheManager::fence`]).
#[derive(Debug)]
#[must_use = "a fence's blocks stay held until it is lifted"]
pub struct KvFence {
    blocks: Vec<BlockId>,
}

/// KV blocks held on the decode side for a prompt whose KV is being transferred.
#[derive(Debug, PartialEq, Eq)]
pub struct KvReservation {
    /// One block per `block_size` tokens of the prompt, in order.
    pub blocks: Vec<u32>,
    /// Leading blocks already holding the prompt's KV from the local prefix cache.
    pub cached_blocks: usize,
    pub num_tokens: usize,
    /// Seed of the prompt's prefix hashes (the request's cache salt).
    pub hash_seed: u64,
    /// The hashes of the prompt's full blocks (computed to find its cached prefix: kept, so that
    /// filling the blocks does not hash the prompt again).
    pub hashes: Vec<BlockHash>,
    /// The prompt reused KV held here (its blocks are admitted below when evicted).
    pub reused: bool,
}

impl KvReservation {
    /// Whether `hashes` are those of `tokens`: the caller gives back the tokens it reserved; a
    /// prompt of another length is another prompt, hashed itself.
    fn hashes_hold_for(&self, tokens: &[u32]) -> bool {
        tokens.len() == self.num_tokens
    }
}

/// KV the engine owes the tiers (see [`KvCacheManager::take_moves`]).
#[derive(Debug, Default)]
pub struct KvMoves {
    /// Evicted blocks whose KV moves down: read each, through
    /// [`KvCacheManager::store_below`], before its slot is written.
    pub spills: Vec<(BlockId, BlockHash)>,
    /// Blocks brought up: write each into the device store before a step reads it.
    pub loads: Vec<BlockLoad>,
}

/// A block's KV read from a tier below, to write into device block `block`.
#[derive(Debug)]
pub struct BlockLoad {
    pub block: BlockId,
    pub tier: Tier,
    /// Every layer's K and V, in the device store's own layout (see
    /// [`KvCacheManager::start_copy`]).
    pub bytes: BlockBytes,
    /// The time the tier read took.
    pub read: Elapsed,
}

struct SeqKv {
    blocks: KvBlocks,
    /// Hashes of its leading full blocks known so far: the prompt's, computed when it was added
    /// (to find its cached prefix), then those of the blocks filled since. Kept when the blocks
    /// are freed, as the seed is.
    hashes: Vec<BlockHash>,
    /// Leading blocks whose hashes are registered in the pool (none once its blocks are freed).
    registered: usize,
    /// Seed of those hashes: the model's, with the request's cache salt. Kept when the blocks are
    /// freed: a preempted sequence fills new blocks with the same content.
    hash_seed: u64,
    /// Its prompt reused KV: the blocks it fills are admitted below.
    reused: bool,
}

pub struct KvCacheManager {
    pool: BlockPool,
    /// Seeds every prefix hash, so that only KV of the same model and geometry is shared.
    model_fingerprint: String,
    seqs: foldhash::HashMap<SeqId, SeqKv>,
    lower: Option<LowerTiers>,
    /// Events in order: the pool's, moved here before each event of the tiers below.
    events: Vec<KvEvent>,
    spills: Vec<(BlockId, BlockHash)>,
    loads: Vec<BlockLoad>,
}

impl KvCacheManager {
    pub fn new(num_blocks: usize, block_size: usize, model_fingerprint: &str) -> Self {
        Self {
            pool: BlockPool::new(num_blocks, block_size),
            model_fingerprint: model_fingerprint.to_string(),
            seqs: foldhash::HashMap::default(),
            lower: None,
            events: Vec::new(),
            spills: Vec::new(),
            loads: Vec::new(),
        }
    }

    /// Puts `lower` below the pool: admitted blocks move there when evicted and prefixes are
    /// brought back up from there.
    pub fn with_lower_tiers(mut self, lower: LowerTiers) -> Self {
        self.pool.track_evictions();
        self.lower = Some(lower);
        self
    }

    /// The counts of each tier below the pool, fastest first (none without tiers).
    pub fn tier_stats(&self) -> Vec<TierStats> {
        self.lower
            .as_ref()
            .map(LowerTiers::stats)
            .unwrap_or_default()
    }

    /// The prefill speed measured now, for the cost model.
    pub fn set_prefill_rate(&mut self, tokens_per_s: f64) {
        if let Some(lower) = &mut self.lower {
            lower.cost_model_mut().set_prefill_rate(tokens_per_s);
        }
    }

    /// Moves the pool's events so far behind those already taken, keeping their order with the
    /// events of the tiers below.
    fn flush_pool_events(&mut self) {
        self.events.extend(self.pool.take_events());
    }

    /// The copies the engine owes: evicted admitted blocks to read and [store
    /// below](Self::store_below) (before their slots are written), then loaded blocks to write.
    /// Call after every call that may allocate ([`add_sequence`](Self::add_sequence),
    /// [`reserve`](Self::reserve), [`allocate_slots`](Self::allocate_slots)), whatever it
    /// returned.
    pub fn take_moves(&mut self) -> KvMoves {
        for e in self.pool.take_evictions() {
            match (e.admitted, &mut self.lower) {
                (true, Some(_)) => self.spills.push((e.block, e.hash)),
                (false, Some(lower)) => lower.remember(e.hash),
                (_, None) => {}
            }
        }
        KvMoves {
            spills: std::mem::take(&mut self.spills),
            loads: std::mem::take(&mut self.loads),
        }
    }

    /// An evicted block moves down: `fill` reads its KV (every layer, in the device store's own
    /// layout) from the device before its slot is written, straight into the tier's memory
    /// where it can (`false`: the device could not, and the block is gone);
    /// `wait_for_copies` waits for the device's copies of blocks brought up (`true` once they
    /// completed), called only when the block needs a slot one of them still reads.
    pub fn store_below(
        &mut self,
        hash: BlockHash,
        fill: &mut dyn FnMut(&mut [u8]) -> bool,
        wait_for_copies: &mut dyn FnMut() -> bool,
    ) {
        self.flush_pool_events();
        if let Some(lower) = &mut self.lower {
            lower.store(hash, fill, wait_for_copies, &mut self.events);
        }
    }

    /// The bytes of a block brought up, as the engine queues its copy to the device: a slot of
    /// page-locked memory is read in place until [`copies_done`](Self::copies_done).
    pub fn start_copy<'a>(&'a mut self, bytes: &'a BlockBytes) -> &'a [u8] {
        match (bytes, &mut self.lower) {
            (BlockBytes::Copied(b), _) => b,
            (lent, Some(lower)) => lower.start_copy(lent),
            (BlockBytes::Lent { .. }, None) => unreachable!("lent by a tier below"),
        }
    }

    /// Every copy to the device queued so far has completed: the tier slots they read are free
    /// to reuse.
    pub fn copies_done(&mut self) {
        if let Some(lower) = &mut self.lower {
            lower.copies_done();
        }
    }

    /// An evicted block whose KV could not be read from the device: it is gone.
    pub fn spill_failed(&mut self, hash: BlockHash) {
        self.flush_pool_events();
        self.events.push(KvEvent::Removed {
            hash,
            tier: Tier::Device,
        });
        if let Some(lower) = &mut self.lower {
            lower.remember(hash);
        }
    }

    /// `blocks` blocks were brought up from `tier` in `took` (tier reads and device writes):
    /// for the metrics and the cost model.
    pub fn loaded(&mut self, tier: Tier, blocks: usize, took: Elapsed) {
        if let Some(lower) = &mut self.lower {
            lower.loaded(tier, blocks, took);
        }
    }

    /// The pool, for its counts (blocks change hands only through the manager).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    /// The seed of the prefix hashes of requests with this cache salt: requests share cached
    /// blocks only when their salts are equal (empty: the shared namespace).
    pub fn hash_seed(&self, cache_salt: &str) -> u64 {
        request_hash_seed(&self.model_fingerprint, cache_salt)
    }

    /// Starts recording prefix-cache events (see [`BlockPool::take_events`]).
    pub fn record_events(&mut self) {
        self.pool.record_events();
    }

    /// The prefix-cache events since the last call (every tier), and the digest after them.
    pub fn take_events(&mut self) -> (Vec<KvEvent>, KvDigest) {
        self.flush_pool_events();
        let mut digest = self.pool.digest();
        if let Some(lower) = &self.lower {
            let below = lower.digest();
            digest.block_count += below.block_count;
            digest.hash_xor ^= below.hash_xor;
        }
        (std::mem::take(&mut self.events), digest)
    }

    /// Forgets every cached prefix block, in every tier (blocks held by sequences keep their KV
    /// but are no longer shared).
    pub fn clear_prefix_cache(&mut self) {
        // Blocks evicted before are forgotten too: none moves down.
        let loads = std::mem::take(&mut self.loads);
        self.take_moves();
        self.loads = loads;
        if let Some(lower) = &mut self.lower {
            lower.clear();
        }
        self.pool.clear_cache();
    }

    /// Takes the longest prefix of `hashes` held here: blocks in the pool are shared; blocks
    /// below it are brought up into fresh blocks where the cost model says loading beats
    /// recomputing (their bytes wait in [`take_moves`](Self::take_moves)). Stops at the first
    /// block held nowhere, not worth loading, unreadable, or without a free block.
    fn take_prefix(&mut self, hashes: &[BlockHash]) -> Vec<BlockId> {
        let mut blocks = self.pool.lookup_prefix(hashes);
        if self.lower.is_none() {
            return blocks;
        }
        while let Some(&hash) = hashes.get(blocks.len()) {
            // A block evicted from the pool may be followed by one still in it.
            if let Some(&block) = self.pool.lookup_prefix(&[hash]).first() {
                blocks.push(block);
                continue;
            }
            let lower = self.lower.as_mut().expect("checked above");
            let Some(tier) = lower.find(hash) else {
                break;
            };
            if !lower.decide(tier) {
                break;
            }
            let Ok(fresh) = self.pool.allocate(1) else {
                break;
            };
            self.flush_pool_events();
            let lower = self.lower.as_mut().expect("checked above");
            let watch = Stopwatch::start();
            let found = lower.load(hash, &mut self.events);
            let read = watch.elapsed();
            let Some((tier, bytes)) = found else {
                // Unreadable below (dropped there): recomputed. The fresh block goes back.
                let _ = self.pool.release(&fresh);
                break;
            };
            if !matches!(self.pool.register_loaded(fresh[0], hash, tier), Ok(true)) {
                let _ = self.pool.release(&fresh);
                break;
            }
            self.loads.push(BlockLoad {
                block: fresh[0],
                tier,
                bytes,
                read,
            });
            blocks.push(fresh[0]);
        }
        blocks
    }

    /// Whether a prompt of these block hashes reuses KV held here: a prefix found (`cached`
    /// blocks), or a block this worker computed before and let go.
    fn reuses(&self, hashes: &[BlockHash], cached: usize) -> bool {
        cached > 0
            || self
                .lower
                .as_ref()
                .is_some_and(|l| hashes.iter().any(|&h| l.seen_before(h)))
    }

    /// Starts tracking a sequence of `tokens`, taking the cached blocks of its longest cached
    /// prefix; their KV need not be computed again.
    pub fn add_sequence(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        cache_salt: &str,
    ) -> Result<&KvBlocks, KvError> {
        let bs = self.pool.block_size();
        let hash_seed = self.hash_seed(cache_salt);
        if self.seqs.contains_key(&seq) {
            return Err(KvError::DuplicateSequence(seq));
        }
        let hashes = block_hashes(hash_seed, tokens, bs);
        // Leave at least one token to compute: its logits give the next output token.
        let usable = hashes.len().min(tokens.len().saturating_sub(1) / bs);
        let cached = self.take_prefix(&hashes[..usable]);
        let reused = self.reuses(&hashes, cached.len());
        let seq_kv = self.seqs.entry(seq).or_insert(SeqKv {
            registered: cached.len(),
            blocks: KvBlocks {
                num_cached: cached.len(),
                table: BlockTable::from_blocks(cached),
            },
            hashes,
            hash_seed,
            reused,
        });
        Ok(&seq_kv.blocks)
    }

    /// Starts tracking a sequence whose first `tokens.len()` tokens' KV was written into
    /// `reservation`.
    pub fn add_reserved(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        reservation: KvReservation,
    ) -> Result<&KvBlocks, KvError> {
        if self.seqs.contains_key(&seq) {
            self.release(reservation)?;
            return Err(KvError::DuplicateSequence(seq));
        }
        let hashes = match reservation.hashes_hold_for(tokens) {
            true => reservation.hashes,
            false => Vec::new(),
        };
        self.seqs.insert(
            seq,
            SeqKv {
                blocks: KvBlocks {
                    table: BlockTable::from_blocks(reservation.blocks),
                    num_cached: reservation.cached_blocks,
                },
                hashes,
                registered: 0,
                hash_seed: reservation.hash_seed,
                reused: reservation.reused,
            },
        );
        if let Err(e) = self.cache_full_blocks(seq, tokens, tokens.len()) {
            self.remove(seq)?;
            return Err(e);
        }
        Ok(&self.seqs[&seq].blocks)
    }

    /// The blocks a sequence holds.
    pub fn blocks(&self, seq: SeqId) -> Option<&KvBlocks> {
        self.seqs.get(&seq).map(|s| &s.blocks)
    }

    /// Gives a sequence blocks for `num_tokens` tokens in all. [`KvError::Exhausted`] (nothing
    /// taken) when too few blocks are available.
    pub fn allocate_slots(&mut self, seq: SeqId, num_tokens: usize) -> Result<&KvBlocks, KvError> {
        let bs = self.pool.block_size();
        let s = tracked(&mut self.seqs, seq)?;
        let missing = s.blocks.table.blocks_missing(num_tokens, bs);
        s.blocks.table.extend(self.pool.allocate(missing)?);
        Ok(&s.blocks)
    }

    /// Gives a sequence free blocks toward `num_tokens` tokens in all, as many as are free,
    /// never evicting a cached prefix block (the slots of speculated tokens, which are worth
    /// less than a prefix another request may reuse). Returns the tokens its blocks now hold.
    pub fn allocate_free_slots(&mut self, seq: SeqId, num_tokens: usize) -> Result<usize, KvError> {
        let bs = self.pool.block_size();
        let s = tracked(&mut self.seqs, seq)?;
        let missing = s.blocks.table.blocks_missing(num_tokens, bs);
        let free = self.pool.stats().free;
        s.blocks
            .table
            .extend(self.pool.allocate_free(missing.min(free))?);
        Ok(s.blocks.table.capacity(bs))
    }

    /// Gives back a sequence's blocks past those holding `num_tokens` tokens: the slots of
    /// speculated tokens that were rejected. Blocks past `num_tokens` were never full of computed
    /// KV, so none is in the prefix cache.
    pub fn shrink(&mut self, seq: SeqId, num_tokens: usize) -> Result<(), KvError> {
        let bs = self.pool.block_size();
        let s = tracked(&mut self.seqs, seq)?;
        let keep = num_tokens.div_ceil(bs);
        debug_assert!(
            s.registered <= keep,
            "a registered block is never shrunk away"
        );
        let past = s.blocks.table.truncate(keep);
        self.pool.release(&past)
    }

    /// Registers the content hash of every block of `tokens` that became full with computed KV
    /// (`num_computed` tokens), so later prompts with this prefix can reuse it.
    pub fn cache_full_blocks(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        num_computed: usize,
    ) -> Result<(), KvError> {
        let bs = self.pool.block_size();
        let s = tracked(&mut self.seqs, seq)?;
        let full = num_computed / bs;
        for b in s.registered..full {
            // Known (the prompt's), or hashed now from the block before.
            if b == s.hashes.len() {
                let prev = s.hashes.last().copied().unwrap_or(0);
                let h = next_block_hash(s.hash_seed, prev, &tokens[b * bs..(b + 1) * bs]);
                s.hashes.push(h);
            }
            let block = s.blocks.table.blocks()[b];
            self.pool.register_hash(block, s.hashes[b])?;
            if s.reused {
                self.pool.mark_admitted(block);
            }
            s.registered = b + 1;
        }
        Ok(())
    }

    /// Gives a sequence's blocks back (full ones stay in the prefix cache); it stays tracked, with
    /// none, and may be given blocks again (a preempted sequence recomputing its KV).
    pub fn free(&mut self, seq: SeqId) -> Result<(), KvError> {
        let s = tracked(&mut self.seqs, seq)?;
        let blocks = std::mem::take(&mut s.blocks);
        s.registered = 0;
        self.pool.release(blocks.ids())
    }

    /// Frees a sequence's blocks and stops tracking it.
    pub fn remove(&mut self, seq: SeqId) -> Result<(), KvError> {
        self.free(seq)?;
        self.seqs.remove(&seq);
        Ok(())
    }

    /// Holds blocks for `tokens`' KV, reusing locally cached full prefix blocks (their KV need
    /// not be sent). The blocks stay held until [`add_reserved`](Self::add_reserved) takes them
    /// or [`release`](Self::release) frees them.
    pub fn reserve(&mut self, tokens: &[u32], cache_salt: &str) -> Result<KvReservation, KvError> {
        let bs = self.block_size();
        let hash_seed = self.hash_seed(cache_salt);
        let hashes = block_hashes(hash_seed, tokens, bs);
        let mut blocks = self.take_prefix(&hashes);
        let cached_blocks = blocks.len();
        let reused = self.reuses(&hashes, cached_blocks);
        match self
            .pool
            .allocate(tokens.len().div_ceil(bs) - cached_blocks)
        {
            Ok(fresh) => blocks.extend(fresh),
            Err(e) => {
                self.pool.release(&blocks)?;
                return Err(e);
            }
        }
        Ok(KvReservation {
            blocks,
            cached_blocks,
            num_tokens: tokens.len(),
            hash_seed,
            hashes,
            reused,
        })
    }

    /// Frees a reservation that will not be used.
    pub fn release(&mut self, reservation: KvReservation) -> Result<(), KvError> {
        self.pool.release(&reservation.blocks)
    }

    /// Fences the blocks of `reservation` that a transfer writes (those past its cached prefix):
    /// they stay out of every other sequence's reach, whatever becomes of the reservation,
    /// until the fence is lifted. For a transport whose sender writes the blocks in place (CUDA
    /// IPC): its copies may still land after the receiver has given the transfer up.
    pub fn fence(&mut self, reservation: &KvReservation) -> Result<KvFence, KvError> {
        let blocks = reservation.blocks[reservation.cached_blocks..].to_vec();
        self.pool.share(&blocks)?;
        Ok(KvFence { blocks })
    }

    /// Lets the blocks of `fence` go (to the cache or the free list, if nothing else holds them).
    pub fn lift_fence(&mut self, fence: KvFence) -> Result<(), KvError> {
        self.pool.release(&fence.blocks)
    }

    /// Makes a filled reservation of `tokens` (whole blocks, pulled from a peer) a cached
    /// prefix: registers its blocks' hashes and frees it. The blocks are admitted below (a peer
    /// held them: they were reused).
    pub fn cache_reservation(
        &mut self,
        tokens: &[u32],
        reservation: KvReservation,
    ) -> Result<(), KvError> {
        let hashes = match reservation.hashes_hold_for(tokens) {
            true => &reservation.hashes,
            false => &block_hashes(reservation.hash_seed, tokens, self.block_size()),
        };
        let filled = reservation.blocks.iter().zip(hashes);
        for (&block, &hash) in filled.skip(reservation.cached_blocks) {
            if self.pool.register_hash(block, hash)? {
                self.pool.mark_admitted(block);
            }
        }
        self.pool.release(&reservation.blocks)
    }

    /// Takes references to the blocks of the longest held prefix of `tokens`' full blocks,
    /// bringing blocks up from below as a prompt would (their bytes wait in
    /// [`take_moves`](Self::take_moves)): what a peer's pull reads. Give them back with
    /// [`unpin`](Self::unpin).
    pub fn pin_prefix(&mut self, tokens: &[u32], cache_salt: &str) -> Vec<BlockId> {
        let hashes = block_hashes(self.hash_seed(cache_salt), tokens, self.block_size());
        self.take_prefix(&hashes)
    }

    /// Gives back blocks [pinned](Self::pin_prefix).
    pub fn unpin(&mut self, blocks: &[BlockId]) -> Result<(), KvError> {
        self.pool.release(blocks)
    }
}

fn tracked(seqs: &mut foldhash::HashMap<SeqId, SeqKv>, seq: SeqId) -> Result<&mut SeqKv, KvError> {
    seqs.get_mut(&seq).ok_or(KvError::UnknownSequence(seq))
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: usize = 4;

    fn manager(num_blocks: usize) -> KvCacheManager {
        KvCacheManager::new(num_blocks, BS, "model")
    }

    fn tokens(n: u32) -> Vec<u32> {
        (0..n).collect()
    }

    /// Runs a sequence's `tokens` through the cache as if computed, then removes it.
    fn compute_and_remove(kv: &mut KvCacheManager, seq: SeqId, t: &[u32], salt: &str) {
        kv.add_sequence(seq, t, salt).unwrap();
        kv.allocate_slots(seq, t.len()).unwrap();
        kv.cache_full_blocks(seq, t, t.len()).unwrap();
        kv.remove(seq).unwrap();
    }

    #[test]
    fn allocates_blocks_as_tokens_grow_and_frees_them() {
        let mut kv = manager(4);
        assert_eq!(kv.add_sequence(0, &tokens(9), "").unwrap().ids(), &[]);
        assert_eq!(kv.allocate_slots(0, 5).unwrap().ids().len(), 2);
        assert_eq!(kv.allocate_slots(0, 8).unwrap().ids().len(), 2);
        assert_eq!(kv.allocate_slots(0, 9).unwrap().ids().len(), 3);
        assert_eq!(
            kv.allocate_slots(0, 17),
            Err(KvError::Exhausted {
                requested: 2,
                available: 1
            })
        );
        assert_eq!(kv.blocks(0).unwrap().ids().len(), 3, "nothing taken");
        kv.free(0).unwrap();
        assert_eq!(
            kv.blocks(0).unwrap().ids(),
            &[],
            "still tracked, without blocks"
        );
        assert_eq!(kv.pool().available(), 4);
        kv.remove(0).unwrap();
        assert_eq!(kv.blocks(0), None);
        assert_eq!(kv.free(0), Err(KvError::UnknownSequence(0)));
    }

    #[test]
    fn free_slots_come_only_from_free_blocks() {
        let mut kv = manager(4);
        kv.record_events();
        // Two blocks cached (a finished prompt), two free.
        compute_and_remove(&mut kv, 0, &tokens(8), "");
        kv.add_sequence(1, &tokens(3), "x").unwrap();
        // 20 tokens would need 5 blocks: the two free ones are taken, the cached ones stay.
        assert_eq!(kv.allocate_free_slots(1, 20).unwrap(), 8);
        assert_eq!(kv.pool().stats().cached, 2);
        assert_eq!(kv.allocate_free_slots(1, 20).unwrap(), 8, "none free now");
        assert_eq!(kv.allocate_free_slots(1, 6).unwrap(), 8, "already held");
        let (events, _) = kv.take_events();
        assert!(
            !events.iter().any(|e| matches!(e, KvEvent::Removed { .. })),
            "{events:?}"
        );
    }

    #[test]
    fn shrinking_gives_back_the_blocks_of_rejected_slots_only() {
        let mut kv = manager(8);
        let t = tokens(14);
        kv.add_sequence(0, &t, "").unwrap();
        // 6 tokens computed, 5 speculated past them: 3 blocks.
        kv.allocate_slots(0, 11).unwrap();
        kv.cache_full_blocks(0, &t, 6).unwrap();
        let held = kv.blocks(0).unwrap().ids().to_vec();
        assert_eq!(held.len(), 3);
        // Two speculated tokens kept: 8 tokens fill exactly 2 blocks.
        kv.shrink(0, 8).unwrap();
        assert_eq!(kv.blocks(0).unwrap().ids(), &held[..2]);
        assert_eq!(kv.pool().available(), 6);
        // Nothing past what is held: nothing changes.
        kv.shrink(0, 8).unwrap();
        kv.shrink(0, 100).unwrap();
        assert_eq!(kv.blocks(0).unwrap().ids(), &held[..2]);
        assert_eq!(kv.shrink(7, 1), Err(KvError::UnknownSequence(7)));
    }

    #[test]
    fn prefix_hits_leave_the_last_token_to_compute() {
        let mut kv = manager(8);
        compute_and_remove(&mut kv, 0, &tokens(12), "");
        let hit = kv.add_sequence(1, &tokens(12), "").unwrap();
        assert_eq!(
            hit.num_cached(),
            2,
            "3 full blocks, the last one recomputed"
        );
        assert_eq!(kv.add_sequence(2, &tokens(13), "").unwrap().num_cached(), 3);
        assert_eq!(kv.add_sequence(3, &tokens(9), "").unwrap().num_cached(), 2);
        let mut other = tokens(13);
        other[5] = 99;
        assert_eq!(kv.add_sequence(4, &other, "").unwrap().num_cached(), 1);
        assert_eq!(
            kv.add_sequence(4, &other, ""),
            Err(KvError::DuplicateSequence(4))
        );
    }

    #[test]
    fn salts_separate_prefix_caches() {
        let mut kv = manager(8);
        compute_and_remove(&mut kv, 0, &tokens(13), "a");
        assert_eq!(
            kv.add_sequence(1, &tokens(13), "b").unwrap().num_cached(),
            0
        );
        assert_eq!(kv.add_sequence(2, &tokens(13), "").unwrap().num_cached(), 0);
        assert_eq!(
            kv.add_sequence(3, &tokens(13), "a").unwrap().num_cached(),
            3
        );
        assert_ne!(kv.hash_seed("a"), kv.hash_seed(""));
    }

    #[test]
    fn a_fence_keeps_a_reservations_written_blocks_from_every_other_sequence_until_lifted() {
        let mut kv = manager(5);
        compute_and_remove(&mut kv, 0, &tokens(12), "");
        // Three blocks from the cache, one to be written by a transfer.
        let r = kv.reserve(&tokens(14), "").unwrap();
        let written = r.blocks[3];
        let fence = kv.fence(&r).unwrap();
        kv.release(r).unwrap();
        assert_eq!(kv.pool().stats().in_use, 1);
        assert_eq!(kv.pool().ref_count(written), 1);
        // The other four blocks (the cached prefix evicted) go to another prompt, never the
        // fenced one; nothing is left for a third.
        let other = kv.reserve(&(100..116).collect::<Vec<u32>>(), "x").unwrap();
        assert_eq!(other.blocks.len(), 4);
        assert!(!other.blocks.contains(&written));
        assert!(matches!(
            kv.reserve(&(200..204).collect::<Vec<u32>>(), "x"),
            Err(KvError::Exhausted { available: 0, .. })
        ));
        kv.release(other).unwrap();
        kv.lift_fence(fence).unwrap();
        assert_eq!(kv.pool().stats().in_use, 0);
        assert_eq!(kv.pool().available(), 5);
    }

    #[test]
    fn reservations_reuse_the_prefix_cache_and_are_all_or_nothing() {
        let mut kv = manager(5);
        compute_and_remove(&mut kv, 0, &tokens(12), "");
        let r = kv.reserve(&tokens(14), "").unwrap();
        assert_eq!((r.blocks.len(), r.cached_blocks, r.num_tokens), (4, 3, 14));
        assert_eq!(
            kv.reserve(&tokens(12), "x"),
            Err(KvError::Exhausted {
                requested: 3,
                available: 1
            })
        );
        assert_eq!(
            kv.pool().stats().in_use,
            4,
            "a failed reservation holds nothing"
        );
        kv.release(r).unwrap();
        assert_eq!(kv.pool().stats().in_use, 0);

        // A reservation becomes a sequence's blocks, its full blocks registered.
        let r = kv.reserve(&tokens(14), "").unwrap();
        let blocks = r.blocks.clone();
        let seq = kv.add_reserved(7, &tokens(14), r).unwrap();
        assert_eq!((seq.ids(), seq.num_cached()), (&blocks[..], 3));
        kv.remove(7).unwrap();
        assert_eq!(
            kv.pool()
                .cached_prefix_len(&block_hashes(kv.hash_seed(""), &tokens(14), BS)),
            3
        );
        // Tokens other than those reserved are registered by their own hashes, never by the
        // reservation's (which are the reserved prompt's).
        let other: Vec<u32> = (100..113).collect();
        let r = kv.reserve(&(200..214).collect::<Vec<u32>>(), "").unwrap();
        kv.add_reserved(8, &other, r).unwrap();
        kv.remove(8).unwrap();
        let seed = kv.hash_seed("");
        assert_eq!(
            kv.pool().cached_prefix_len(&block_hashes(seed, &other, BS)),
            3
        );
        let reserved: Vec<u32> = (200..214).collect();
        assert_eq!(
            kv.pool()
                .cached_prefix_len(&block_hashes(seed, &reserved, BS)),
            0
        );
    }

    #[test]
    fn a_freed_sequence_registers_its_recomputed_blocks_again() {
        let mut kv = manager(4);
        let t = tokens(8);
        kv.add_sequence(0, &t, "").unwrap();
        kv.allocate_slots(0, 8).unwrap();
        kv.cache_full_blocks(0, &t, 4).unwrap();
        kv.free(0).unwrap();
        kv.clear_prefix_cache();
        kv.allocate_slots(0, 8).unwrap();
        kv.cache_full_blocks(0, &t, 8).unwrap();
        let hashes = block_hashes(kv.hash_seed(""), &t, BS);
        assert_eq!(kv.pool().cached_prefix_len(&hashes), 2);
    }

    mod tiers {
        use std::collections::HashMap;

        use super::*;
        use crate::HostTier;

        const BYTES: usize = 8;

        fn tiered(num_blocks: usize, host_blocks: usize) -> KvCacheManager {
            let lower = LowerTiers::new(
                vec![Box::new(HostTier::new(host_blocks, BYTES))],
                BS,
                BYTES,
                64,
            );
            manager(num_blocks).with_lower_tiers(lower)
        }

        /// Block `i`'s KV of `tokens` as a device would hold it.
        fn kv_of(tokens: &[u32], i: usize) -> Vec<u8> {
            let sum: u32 = tokens[..(i + 1) * BS].iter().sum();
            sum.to_le_bytes().repeat(BYTES / 4)
        }

        /// The device store beside a manager, and the engine's part.
        #[derive(Default)]
        struct Device {
            blocks: HashMap<BlockId, Vec<u8>>,
            spilled: usize,
        }

        impl Device {
            /// What the engine does after each call that may allocate.
            fn settle(&mut self, kv: &mut KvCacheManager) {
                let moves = kv.take_moves();
                for (block, hash) in moves.spills {
                    let mut fill = |out: &mut [u8]| {
                        out.copy_from_slice(&self.blocks[&block]);
                        true
                    };
                    kv.store_below(hash, &mut fill, &mut || unreachable!("nothing lent"));
                    self.spilled += 1;
                }
                for load in moves.loads {
                    let bytes = kv.start_copy(&load.bytes).to_vec();
                    kv.loaded(load.tier, 1, load.read);
                    self.blocks.insert(load.block, bytes);
                }
            }

            /// Runs a prompt through, computing what was not cached; its cached tokens.
            fn run(&mut self, kv: &mut KvCacheManager, seq: SeqId, t: &[u32], salt: &str) -> usize {
                let cached = kv.add_sequence(seq, t, salt).map(|b| b.num_cached());
                self.settle(kv);
                let cached = cached.unwrap();
                for (i, &b) in kv.blocks(seq).unwrap().ids().iter().enumerate() {
                    assert_eq!(
                        self.blocks[&b],
                        kv_of(t, i),
                        "block {i} came up with other KV"
                    );
                }
                let allocated = kv.allocate_slots(seq, t.len()).map(|b| b.ids().to_vec());
                self.settle(kv);
                for (i, &b) in allocated.unwrap().iter().enumerate().skip(cached) {
                    if (i + 1) * BS <= t.len() {
                        self.blocks.insert(b, kv_of(t, i));
                    }
                }
                kv.cache_full_blocks(seq, t, t.len()).unwrap();
                kv.remove(seq).unwrap();
                cached * BS
            }
        }

        fn tokens_from(start: u32, n: u32) -> Vec<u32> {
            (start..start + n).collect()
        }

        /// A manager of `num_blocks` over a host tier of 4 blocks, where `prompt` (2 full
        /// blocks) was computed, reused from the pool under `salt`, then evicted by a prompt of
        /// `num_blocks` blocks: its blocks moved down.
        fn reused_then_evicted(
            num_blocks: usize,
            prompt: &[u32],
            salt: &str,
        ) -> (KvCacheManager, Device) {
            let mut kv = tiered(num_blocks, 4);
            kv.record_events();
            let mut dev = Device::default();
            dev.run(&mut kv, 0, prompt, salt);
            assert_eq!(dev.run(&mut kv, 1, prompt, salt), 8, "reused from the pool");
            let other = tokens_from(100, 4 * num_blocks as u32);
            dev.run(&mut kv, 2, &other, "");
            assert_eq!(dev.spilled, 2, "the reused blocks moved down");
            (kv, dev)
        }

        #[test]
        fn a_reused_prefix_moves_down_when_evicted_and_comes_back_up() {
            let chat = tokens(9);
            let (mut kv, mut dev) = reused_then_evicted(3, &chat, "");
            let hashes = block_hashes(kv.hash_seed(""), &chat, BS);
            let (events, _) = kv.take_events();
            for &h in &hashes {
                assert!(events.contains(&KvEvent::MovedDown {
                    hash: h,
                    from: Tier::Device,
                    to: Tier::Host
                }));
            }
            // Its next turn finds them below and brings them up (checked by `run`).
            let next_turn = tokens(12);
            assert_eq!(dev.run(&mut kv, 3, &next_turn, ""), 8);
            let (events, digest) = kv.take_events();
            for &h in &hashes {
                assert!(events.contains(&KvEvent::BroughtUp {
                    hash: h,
                    from: Tier::Host
                }));
            }
            let host = kv.tier_stats()[0];
            assert_eq!((host.hits, host.stored), (2, 2));
            // Brought up, the blocks keep their copy below: both tiers count in the digest.
            assert_eq!(digest.block_count as usize, kv.pool().stats().cached + 2);
        }

        #[test]
        fn prompts_without_reuse_write_nothing_below() {
            let mut kv = tiered(3, 4);
            let mut dev = Device::default();
            for seq in 0..20 {
                dev.run(&mut kv, seq, &tokens_from(1000 * seq as u32, 12), "");
            }
            assert_eq!(dev.spilled, 0);
            assert_eq!(kv.tier_stats()[0].stored, 0);
        }

        #[test]
        fn a_prompt_computed_before_and_let_go_counts_as_reused() {
            let mut kv = tiered(3, 4);
            let mut dev = Device::default();
            let prompt = tokens(9);
            dev.run(&mut kv, 0, &prompt, "");
            // Evicted unadmitted: gone, but remembered.
            dev.run(&mut kv, 1, &tokens_from(100, 12), "");
            assert_eq!(dev.spilled, 0);
            // Computed again: now its blocks are admitted, and move down when evicted.
            assert_eq!(dev.run(&mut kv, 2, &prompt, ""), 0);
            dev.run(&mut kv, 3, &tokens_from(200, 12), "");
            assert_eq!(dev.spilled, 2);
            assert_eq!(dev.run(&mut kv, 4, &prompt, ""), 8);
        }

        #[test]
        fn salts_separate_the_tiers_below() {
            let prompt = tokens(9);
            let (mut kv, mut dev) = reused_then_evicted(3, &prompt, "tenant-a");
            assert_eq!(dev.run(&mut kv, 3, &prompt, "tenant-b"), 0);
            assert_eq!(dev.run(&mut kv, 4, &prompt, ""), 0);
            assert_eq!(dev.run(&mut kv, 5, &prompt, "tenant-a"), 8);
        }

        #[test]
        fn blocks_below_are_recomputed_where_that_is_faster() {
            let prompt = tokens(9);
            let (mut kv, mut dev) = reused_then_evicted(3, &prompt, "");
            // A worker computing 16 tokens in well under the measured load time.
            let one_second = Elapsed {
                wall_seconds: 1.0,
                cpu_seconds: 1.0,
            };
            kv.loaded(Tier::Host, 1, one_second);
            kv.set_prefill_rate(1e6);
            assert_eq!(dev.run(&mut kv, 3, &prompt, ""), 0);
            assert_eq!(kv.tier_stats()[0].cost_model_misses, 1);
        }

        #[test]
        fn reservations_bring_prefixes_up_too() {
            let prompt = tokens(9);
            let (mut kv, mut dev) = reused_then_evicted(4, &prompt, "");
            let r = kv.reserve(&prompt, "").unwrap();
            dev.settle(&mut kv);
            assert_eq!((r.cached_blocks, r.reused), (2, true));
            for i in 0..2 {
                assert_eq!(dev.blocks[&r.blocks[i]], kv_of(&prompt, i));
            }
            kv.release(r).unwrap();
        }

        #[test]
        fn a_pulled_reservation_becomes_a_cached_prefix_and_pins_hold_blocks() {
            let mut kv = tiered(4, 4);
            let prefix = tokens(8);
            let r = kv.reserve(&prefix, "").unwrap();
            assert_eq!((r.blocks.len(), r.cached_blocks), (2, 0));
            kv.cache_reservation(&prefix, r).unwrap();
            let hashes = block_hashes(kv.hash_seed(""), &prefix, BS);
            assert_eq!(kv.pool().cached_prefix_len(&hashes), 2);
            // A pin holds the blocks in use until unpinned, and only for the right salt.
            assert!(kv.pin_prefix(&prefix, "other").is_empty());
            let pinned = kv.pin_prefix(&tokens(12), "");
            assert_eq!(pinned.len(), 2, "the prefix held, not the prompt asked");
            assert_eq!(kv.pool().stats().in_use, 2);
            kv.unpin(&pinned).unwrap();
            assert_eq!(kv.pool().stats().in_use, 0);
        }
    }
}
