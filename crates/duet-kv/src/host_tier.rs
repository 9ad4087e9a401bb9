//! The host-memory tier: a second pool of whole blocks in the worker's memory, below the device
//! pool. One allocation of `capacity × block_bytes` made at start (zeroed lazily by the kernel,
//! so untouched capacity costs no resident memory); blocks go into free slots, and the tier's
//! [`FrequencyLru`] picks victims.

use std::collections::HashMap;

use crate::{BlockHash, FrequencyLru, Tier, TierError, TierStore};

pub struct HostTier {
    block_bytes: usize,
    capacity: usize,
    slab: Vec<u8>,
    slots: HashMap<BlockHash, usize>,
    free: Vec<usize>,
    order: FrequencyLru,
}

impl HostTier {
    /// A tier of `capacity` blocks of `block_bytes` each.
    pub fn new(capacity: usize, block_bytes: usize) -> Self {
        Self {
            block_bytes,
            capacity,
            slab: vec![0; capacity.saturating_mul(block_bytes)],
            slots: HashMap::new(),
            free: (0..capacity).rev().collect(),
            order: FrequencyLru::new(capacity),
        }
    }

    fn slot_bytes(&mut self, slot: usize) -> &mut [u8] {
        &mut self.slab[slot * self.block_bytes..(slot + 1) * self.block_bytes]
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

    fn put(&mut self, hash: BlockHash, block: &[u8]) -> Result<(), TierError> {
        self.check_len(block.len())?;
        if self.contains(hash) {
            self.touch(hash);
            return Ok(());
        }
        let Some(slot) = self.free.pop() else {
            // The caller makes room first; a tier of no capacity keeps nothing.
            return Ok(());
        };
        self.slot_bytes(slot).copy_from_slice(block);
        self.slots.insert(hash, slot);
        self.order.insert(hash);
        Ok(())
    }

    fn read(&mut self, hash: BlockHash, out: &mut [u8]) -> Result<bool, TierError> {
        self.check_len(out.len())?;
        let Some(&slot) = self.slots.get(&hash) else {
            return Ok(false);
        };
        out.copy_from_slice(self.slot_bytes(slot));
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
        self.free.push(slot);
        true
    }

    fn hashes(&self) -> Vec<BlockHash> {
        self.slots.keys().copied().collect()
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
