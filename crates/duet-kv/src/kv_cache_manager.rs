//! The KV cache manager: the only owner of the [`BlockPool`]. It gives sequences blocks (reusing
//! cached prefix blocks), registers the content hashes of blocks as they fill, frees them, and
//! holds blocks for KV arriving from another worker ([`KvReservation`]). A scheduler sees a
//! sequence's blocks only as [`KvBlocks`].

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use crate::{
    BlockHash, BlockId, BlockPool, BlockTable, KvDigest, KvError, KvEvent, block_hashes,
    next_block_hash, request_hash_seed,
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
}

struct SeqKv {
    blocks: KvBlocks,
    /// Hashes of the leading blocks registered so far.
    hashes: Vec<BlockHash>,
    /// Seed of those hashes: the model's, with the request's cache salt. Kept when the blocks are
    /// freed: a preempted sequence fills new blocks with the same content.
    hash_seed: u64,
}

pub struct KvCacheManager {
    pool: BlockPool,
    /// Seeds every prefix hash, so that only KV of the same model and geometry is shared.
    model_fingerprint: String,
    seqs: HashMap<SeqId, SeqKv>,
}

impl KvCacheManager {
    pub fn new(num_blocks: usize, block_size: usize, model_fingerprint: &str) -> Self {
        Self {
            pool: BlockPool::new(num_blocks, block_size),
            model_fingerprint: model_fingerprint.to_string(),
            seqs: HashMap::new(),
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

    /// The prefix-cache events since the last call, and the digest after them.
    pub fn take_events(&mut self) -> (Vec<KvEvent>, KvDigest) {
        (self.pool.take_events(), self.pool.digest())
    }

    /// Forgets every cached prefix block (blocks held by sequences keep their KV but are no
    /// longer shared).
    pub fn clear_prefix_cache(&mut self) {
        self.pool.clear_cache();
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
        let Entry::Vacant(entry) = self.seqs.entry(seq) else {
            return Err(KvError::DuplicateSequence(seq));
        };
        let mut hashes = block_hashes(hash_seed, tokens, bs);
        // Leave at least one token to compute: its logits give the next output token.
        let usable = hashes.len().min(tokens.len().saturating_sub(1) / bs);
        let cached = self.pool.lookup_prefix(&hashes[..usable]);
        hashes.truncate(cached.len());
        let seq_kv = entry.insert(SeqKv {
            blocks: KvBlocks {
                num_cached: cached.len(),
                table: BlockTable::from_blocks(cached),
            },
            hashes,
            hash_seed,
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
        self.seqs.insert(
            seq,
            SeqKv {
                blocks: KvBlocks {
                    table: BlockTable::from_blocks(reservation.blocks),
                    num_cached: reservation.cached_blocks,
                },
                hashes: Vec::new(),
                hash_seed: reservation.hash_seed,
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
            s.hashes.len() <= keep,
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
        let mut prev = s.hashes.last().copied();
        for b in s.hashes.len()..full {
            let h = next_block_hash(
                s.hash_seed,
                prev.unwrap_or(0),
                &tokens[b * bs..(b + 1) * bs],
            );
            self.pool.register_hash(s.blocks.table.blocks()[b], h)?;
            s.hashes.push(h);
            prev = Some(h);
        }
        Ok(())
    }

    /// Gives a sequence's blocks back (full ones stay in the prefix cache); it stays tracked, with
    /// none, and may be given blocks again (a preempted sequence recomputing its KV).
    pub fn free(&mut self, seq: SeqId) -> Result<(), KvError> {
        let s = tracked(&mut self.seqs, seq)?;
        let blocks = std::mem::take(&mut s.blocks);
        s.hashes.clear();
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
        let mut blocks = self.pool.lookup_prefix(&hashes);
        let cached_blocks = blocks.len();
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
        })
    }

    /// Frees a reservation that will not be used.
    pub fn release(&mut self, reservation: KvReservation) -> Result<(), KvError> {
        self.pool.release(&reservation.blocks)
    }
}

fn tracked(seqs: &mut HashMap<SeqId, SeqKv>, seq: SeqId) -> Result<&mut SeqKv, KvError> {
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
            !events.iter().any(|e| matches!(e, KvEvent::Removed(_))),
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
}
