//! The eviction order of a tier below the device: a segmented LRU (LRU with frequency).
//!
//! A block enters on *probation*; used again while held (brought up, or stored again after it
//! was), it becomes *protected*. Victims come from probation first, oldest first, so a stream of
//! blocks used once (a long prompt nobody sends again) cycles through probation without pushing
//! out what was reused. Protected blocks take at most [`PROTECTED_SHARE`] of the capacity; past
//! it the oldest protected block goes back to probation (as the newest there), so the protected
//! set follows the workload instead of holding on to blocks that were hot long ago. This is
//! SLRU, the frequency half of ARC without its adaptive split (vLLM's offloading offers LRU and
//! ARC; SGLang's HiCache uses LRU over a hit-count gate).

use std::collections::{BTreeMap, HashMap};

use crate::BlockHash;

/// Share of the capacity protected blocks may take.
pub const PROTECTED_SHARE: f64 = 0.8;

#[derive(Debug)]
pub struct FrequencyLru {
    /// Blocks not used since they entered, by last use (oldest first).
    probation: BTreeMap<u64, BlockHash>,
    /// Blocks used while held, by last use (oldest first).
    protected: BTreeMap<u64, BlockHash>,
    /// Each block's tick and whether it is protected.
    entries: HashMap<BlockHash, (u64, bool)>,
    next_tick: u64,
    protected_cap: usize,
}

impl FrequencyLru {
    /// An order for a tier of `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        Self {
            probation: BTreeMap::new(),
            protected: BTreeMap::new(),
            entries: HashMap::new(),
            next_tick: 0,
            protected_cap: ((capacity as f64 * PROTECTED_SHARE) as usize).max(1),
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        self.entries.contains_key(&hash)
    }

    fn tick(&mut self) -> u64 {
        self.next_tick += 1;
        self.next_tick
    }

    /// A block entering the tier (on probation); a block already held is [touched](Self::touch).
    pub fn insert(&mut self, hash: BlockHash) {
        if self.contains(hash) {
            return self.touch(hash);
        }
        let tick = self.tick();
        self.probation.insert(tick, hash);
        self.entries.insert(hash, (tick, false));
    }

    /// A use of a held block: it becomes (or stays) protected, as the newest.
    pub fn touch(&mut self, hash: BlockHash) {
        let Some(&(old, protected)) = self.entries.get(&hash) else {
            return;
        };
        match protected {
            true => self.protected.remove(&old),
            false => self.probation.remove(&old),
        };
        let tick = self.tick();
        self.protected.insert(tick, hash);
        self.entries.insert(hash, (tick, true));
        while self.protected.len() > self.protected_cap {
            let (_, demoted) = self.protected.pop_first().expect("over the cap");
            let tick = self.tick();
            self.probation.insert(tick, demoted);
            self.entries.insert(demoted, (tick, false));
        }
    }

    /// The block to evict next: the oldest on probation, else the oldest protected.
    pub fn victim(&self) -> Option<BlockHash> {
        self.probation
            .first_key_value()
            .or_else(|| self.protected.first_key_value())
            .map(|(_, &h)| h)
    }

    /// Forgets a block; whether it was held.
    pub fn remove(&mut self, hash: BlockHash) -> bool {
        let Some((tick, protected)) = self.entries.remove(&hash) else {
            return false;
        };
        match protected {
            true => self.protected.remove(&tick),
            false => self.probation.remove(&tick),
        };
        true
    }

    /// Every block held.
    pub fn hashes(&self) -> Vec<BlockHash> {
        self.entries.keys().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inserts like a tier of `capacity` would: evicting the victim when full.
    fn admit(lru: &mut FrequencyLru, capacity: usize, hash: BlockHash) -> Option<BlockHash> {
        let evicted = (lru.len() >= capacity && !lru.contains(hash)).then(|| {
            let v = lru.victim().unwrap();
            lru.remove(v);
            v
        });
        lru.insert(hash);
        evicted
    }

    #[test]
    fn evicts_the_oldest_block_used_once_first() {
        let mut lru = FrequencyLru::new(3);
        for h in [1, 2, 3] {
            lru.insert(h);
        }
        assert_eq!(lru.victim(), Some(1));
        lru.touch(1);
        assert_eq!(lru.victim(), Some(2), "a reused block is protected");
        lru.remove(2);
        lru.remove(3);
        assert_eq!(
            lru.victim(),
            Some(1),
            "protected blocks go when nothing else is left"
        );
        assert!(lru.remove(1));
        assert!(!lru.remove(1));
        assert_eq!(lru.victim(), None);
    }

    #[test]
    fn a_scan_of_one_shot_blocks_keeps_the_reused_ones() {
        let capacity = 10;
        let mut lru = FrequencyLru::new(capacity);
        for h in 0..4 {
            lru.insert(h);
            lru.touch(h);
        }
        // A long prompt's blocks pass through once each.
        for h in 100..200 {
            let evicted = admit(&mut lru, capacity, h);
            assert!(
                !matches!(evicted, Some(0..4)),
                "a reused block was evicted for one used once"
            );
        }
        assert!((0..4).all(|h| lru.contains(h)));
        assert_eq!(lru.len(), capacity);
    }

    #[test]
    fn the_protected_share_is_capped_and_follows_the_workload() {
        let capacity = 5; // at most 4 protected
        let mut lru = FrequencyLru::new(capacity);
        for h in 0..5 {
            lru.insert(h);
        }
        for h in 0..5 {
            lru.touch(h);
        }
        // Block 0 was used longest ago: it went back on probation, and goes first.
        assert_eq!(lru.victim(), Some(0));
        assert_eq!(lru.protected.len(), 4);
        // Touching it again protects it and demotes the next oldest.
        lru.touch(0);
        assert_eq!(lru.victim(), Some(1));
    }
}
