//! The host-memory tier: a second pool of whole blocks in the worker's memory, below the device
//! pool. One allocation of `capacity × block_bytes` made at start; blocks go into free slots,
//! and the tier's [`FrequencyLru`] picks victims.
//!
//! The memory is a `Vec` (zeroed lazily by the kernel, so untouched capacity costs no resident
//! memory) unless the backend supplies its own ([`HostMemory`]): a GPU backend's page-locked
//! memory (`--kv-host-pinned on`), which its copy engine reads and writes directly. A block
//! brought up from page-locked memory is not copied out first: its slot is *lent*
//! ([`TierStore::lend`]) when the block is found, and the device copies straight from it once
//! the engine queues the copy ([`TierStore::start_copy`]). The slot keeps its bytes, neither
//! rewritten nor given to another block, until the engine reports the copies queued so far
//! complete ([`TierStore::copies_done`]). A slot freed while lent (its block evicted or
//! dropped) is held back until then; a block moving in when every free slot is held back waits
//! for the copies ([`TierStore::waits_for_copies`]).

use std::collections::{HashMap, HashSet};

use crate::{BlockHash, FrequencyLru, Tier, TierError, TierStore};

/// The memory the host tier keeps its blocks in: a `Vec` by default; a backend may supply
/// memory its device copies to and from directly.
pub trait HostMemory: Send {
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> &mut [u8];
    /// Whether the device's copy engine reads this memory directly, after the call that queued
    /// the copy returned (page-locked memory): a block brought up from it is lent to the copy
    /// rather than copied out first.
    fn page_locked(&self) -> bool {
        false
    }
}

impl HostMemory for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

pub struct HostTier {
    block_bytes: usize,
    capacity: usize,
    memory: Box<dyn HostMemory>,
    slots: HashMap<BlockHash, usize>,
    free: Vec<usize>,
    /// Slots lent to copies not queued yet, with how many (page-locked memory only).
    lent: HashMap<usize, usize>,
    /// Slots copies queued on the device read.
    copying: HashSet<usize>,
    /// Lent or copied slots whose block left: free once nothing reads them.
    held_back: Vec<usize>,
    order: FrequencyLru,
}

impl HostTier {
    /// A tier of `capacity` blocks of `block_bytes` each, in a `Vec`.
    pub fn new(capacity: usize, block_bytes: usize) -> Self {
        let bytes = capacity.saturating_mul(block_bytes);
        Self::in_memory(capacity, block_bytes, Box::new(vec![0u8; bytes]))
    }

    /// A tier of `capacity` blocks of `block_bytes` each, in `memory` (at least
    /// `capacity × block_bytes` long).
    pub fn in_memory(capacity: usize, block_bytes: usize, memory: Box<dyn HostMemory>) -> Self {
        assert!(
            memory.bytes().len() >= capacity.saturating_mul(block_bytes),
            "the host tier's memory holds its capacity"
        );
        Self {
            block_bytes,
            capacity,
            memory,
            slots: HashMap::new(),
            free: (0..capacity).rev().collect(),
            lent: HashMap::new(),
            copying: HashSet::new(),
            held_back: Vec::new(),
            order: FrequencyLru::new(capacity),
        }
    }

    fn range(&self, slot: usize) -> std::ops::Range<usize> {
        slot * self.block_bytes..(slot + 1) * self.block_bytes
    }

    /// Whether a copy, queued or not yet, reads `slot`.
    fn read_by_copy(&self, slot: usize) -> bool {
        self.lent.contains_key(&slot) || self.copying.contains(&slot)
    }

    fn check_len(&self, len: usize) -> Result<(), TierError> {
        if len == self.block_bytes {
            return Ok(());
        }
        Err(TierError::BlockSize {
            tier: Tier::Host,
            got: len,
            want: self.block_bytes,
        })
    }
}

impl TierStore for HostTier {
    fn tier(&self) -> Tier {
        Tier::Host
    }

    fn capacity_blocks(&self) -> usize {
        self.capacity
    }

    fn len(&self) -> usize {
        self.slots.len()
    }

    fn contains(&self, hash: BlockHash) -> bool {
        self.slots.contains_key(&hash)
    }

    fn victim(&self) -> Option<BlockHash> {
        self.order.victim()
    }

    fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    fn put(&mut self, hash: BlockHash, block: &[u8]) -> Result<(), TierError> {
        self.check_len(block.len())?;
        self.put_with(hash, &mut |slot| {
            slot.copy_from_slice(block);
            true
        })
        .map(drop)
    }

    fn put_with(
        &mut self,
        hash: BlockHash,
        fill: &mut dyn FnMut(&mut [u8]) -> bool,
    ) -> Result<bool, TierError> {
        if self.contains(hash) {
            self.touch(hash);
            return Ok(true);
        }
        // The caller makes room first (waiting for copies where `waits_for_copies` said so); a
        // tier of no capacity keeps nothing.
        let Some(slot) = self.free.pop() else {
            return Ok(false);
        };
        let range = self.range(slot);
        if !fill(&mut self.memory.bytes_mut()[range]) {
            self.free.push(slot);
            return Ok(false);
        }
        self.slots.insert(hash, slot);
        self.order.insert(hash);
        Ok(true)
    }

    fn read(&mut self, hash: BlockHash, out: &mut [u8]) -> Result<bool, TierError> {
        self.check_len(out.len())?;
        let Some(&slot) = self.slots.get(&hash) else {
            return Ok(false);
        };
        out.copy_from_slice(&self.memory.bytes()[self.range(slot)]);
        Ok(true)
    }

    fn touch(&mut self, hash: BlockHash) {
        self.order.touch(hash);
    }

    fn remove(&mut self, hash: BlockHash) -> bool {
        let Some(slot) = self.slots.remove(&hash) else {
            return false;
        };
        self.order.remove(hash);
        match self.read_by_copy(slot) {
            true => self.held_back.push(slot),
            false => self.free.push(slot),
        }
        true
    }

    fn hashes(&self) -> Vec<BlockHash> {
        self.slots.keys().copied().collect()
    }

    fn lend(&mut self, hash: BlockHash) -> Option<usize> {
        if !self.memory.page_locked() {
            return None;
        }
        let slot = *self.slots.get(&hash)?;
        *self.lent.entry(slot).or_default() += 1;
        Some(slot)
    }

    fn start_copy(&mut self, slot: usize) -> Option<&[u8]> {
        let count = self.lent.get_mut(&slot)?;
        *count -= 1;
        if *count == 0 {
            self.lent.remove(&slot);
        }
        self.copying.insert(slot);
        Some(&self.memory.bytes()[self.range(slot)])
    }

    fn copies_done(&mut self) {
        self.copying.clear();
        let held_back = std::mem::take(&mut self.held_back);
        let (still_lent, free): (Vec<usize>, Vec<usize>) = held_back
            .into_iter()
            .partition(|s| self.lent.contains_key(s));
        self.held_back = still_lent;
        self.free.extend(free);
    }

    fn waits_for_copies(&self) -> bool {
        self.free.is_empty()
            && self
                .held_back
                .iter()
                .any(|s| self.copying.contains(s) && !self.lent.contains_key(s))
    }

    fn page_locked(&self) -> bool {
        self.memory.page_locked()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_round_trip_and_slots_are_reused() {
        let mut t = HostTier::new(2, 4);
        t.put(1, &[1, 2, 3, 4]).unwrap();
        t.put(2, &[5, 6, 7, 8]).unwrap();
        assert!(t.is_full());
        let mut out = [0; 4];
        assert!(t.read(2, &mut out).unwrap());
        assert_eq!(out, [5, 6, 7, 8]);
        assert!(!t.read(3, &mut out).unwrap(), "a miss");
        assert_eq!(t.victim(), Some(1));
        assert!(t.remove(1));
        t.put(3, &[9; 4]).unwrap();
        assert!(t.read(3, &mut out).unwrap());
        assert_eq!(out, [9; 4]);
        assert!(t.read(2, &mut out).unwrap());
        assert_eq!(out, [5, 6, 7, 8], "another block's slot is untouched");
        let mut hashes = t.hashes();
        hashes.sort();
        assert_eq!(hashes, [2, 3]);
    }

    #[test]
    fn a_block_of_the_wrong_size_is_refused() {
        let mut t = HostTier::new(1, 4);
        assert!(matches!(
            t.put(1, &[0; 3]),
            Err(TierError::BlockSize {
                got: 3,
                want: 4,
                ..
            })
        ));
        assert!(t.is_empty());
    }
}
