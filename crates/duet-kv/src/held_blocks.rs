//! What a stream of [`KvEvent`]s says a worker holds: each block hash with the set of tiers
//! holding it, and the digest of that set. The worker's event log mirrors its own events with
//! it (for snapshots), and the router's index keeps one per worker: one reading of the events in
//! one place.

use std::collections::HashMap;

use crate::{BlockHash, KvDigest, KvEvent, Tier};

/// How an event changed whether a block is held at all (in any tier).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Presence {
    /// Still held somewhere, or still not held.
    Unchanged,
    /// Held now, and not before.
    Added(BlockHash),
    /// Held nowhere now.
    Removed(BlockHash),
    /// Every block was forgotten: these were held.
    Cleared(Vec<BlockHash>),
}

#[derive(Clone, Debug, Default)]
pub struct HeldBlocks {
    /// Each held block's tiers, as a mask of [`Tier::bit`]s (never 0).
    tiers: HashMap<BlockHash, u8>,
    /// Over every (hash, tier) pair (see [`Tier::digest_key`]).
    digest: KvDigest,
    pairs: usize,
}

impl HeldBlocks {
    /// Blocks held in at least one tier.
    pub fn len(&self) -> usize {
        self.tiers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tiers.is_empty()
    }

    /// (block, tier) pairs held.
    pub fn pairs(&self) -> usize {
        self.pairs
    }

    pub fn digest(&self) -> KvDigest {
        self.digest
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        self.tiers.contains_key(&hash)
    }

    /// The fastest tier holding `hash`.
    pub fn best_tier(&self, hash: BlockHash) -> Option<Tier> {
        let mask = *self.tiers.get(&hash)?;
        Tier::ALL.into_iter().find(|t| mask & t.bit() != 0)
    }

    /// Every (block, tier) pair held.
    pub fn iter(&self) -> impl Iterator<Item = (BlockHash, Tier)> + '_ {
        self.tiers.iter().flat_map(|(&h, &mask)| {
            Tier::ALL
                .into_iter()
                .filter(move |t| mask & t.bit() != 0)
                .map(move |t| (h, t))
        })
    }

    /// Adds `hash` to `tier`; whether it was held nowhere before.
    pub fn insert(&mut self, hash: BlockHash, tier: Tier) -> bool {
        let mask = self.tiers.entry(hash).or_insert(0);
        let was = *mask;
        if was & tier.bit() == 0 {
            *mask |= tier.bit();
            self.digest.toggle(tier.digest_key(hash), true);
            self.pairs += 1;
        }
        was == 0
    }

    /// Removes `hash` from `tier`; whether it is held nowhere now (and was before).
    pub fn remove(&mut self, hash: BlockHash, tier: Tier) -> bool {
        let Some(mask) = self.tiers.get_mut(&hash) else {
            return false;
        };
        if *mask & tier.bit() != 0 {
            *mask &= !tier.bit();
            self.digest.toggle(tier.digest_key(hash), false);
            self.pairs -= 1;
        }
        if *mask != 0 {
            return false;
        }
        self.tiers.remove(&hash);
        true
    }

    /// Forgets everything; the blocks that were held.
    pub fn clear(&mut self) -> Vec<BlockHash> {
        self.digest = KvDigest::default();
        self.pairs = 0;
        self.tiers.drain().map(|(h, _)| h).collect()
    }

    /// Applies one event.
    pub fn apply(&mut self, event: KvEvent) -> Presence {
        let added = |newly: bool, hash| match newly {
            true => Presence::Added(hash),
            false => Presence::Unchanged,
        };
        match event {
            KvEvent::Stored(hash) | KvEvent::BroughtUp { hash, .. } => {
                added(self.insert(hash, Tier::Device), hash)
            }
            KvEvent::MovedDown { hash, from, to } => {
                let before = self.contains(hash);
                self.remove(hash, from);
                self.insert(hash, to);
                added(!before, hash)
            }
            KvEvent::Removed { hash, tier } => match self.remove(hash, tier) {
                true => Presence::Removed(hash),
                false => Presence::Unchanged,
            },
            KvEvent::Cleared => Presence::Cleared(self.clear()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_move_blocks_between_tiers() {
        let mut held = HeldBlocks::default();
        assert_eq!(held.apply(KvEvent::Stored(1)), Presence::Added(1));
        assert_eq!(held.best_tier(1), Some(Tier::Device));
        let down = KvEvent::MovedDown {
            hash: 1,
            from: Tier::Device,
            to: Tier::Host,
        };
        assert_eq!(held.apply(down), Presence::Unchanged);
        assert_eq!(held.best_tier(1), Some(Tier::Host));
        let up = KvEvent::BroughtUp {
            hash: 1,
            from: Tier::Host,
        };
        assert_eq!(held.apply(up), Presence::Unchanged);
        assert_eq!((held.best_tier(1), held.pairs()), (Some(Tier::Device), 2));
        let gone = |tier| KvEvent::Removed { hash: 1, tier };
        assert_eq!(held.apply(gone(Tier::Device)), Presence::Unchanged);
        assert_eq!(held.apply(gone(Tier::Host)), Presence::Removed(1));
        assert!(held.is_empty());
        assert_eq!(held.digest(), KvDigest::default());
    }

    #[test]
    fn the_digest_counts_each_block_in_each_tier() {
        let mut held = HeldBlocks::default();
        held.insert(5, Tier::Device);
        held.insert(5, Tier::Disk);
        held.insert(5, Tier::Disk);
        held.insert(6, Tier::Host);
        let mut want = KvDigest::default();
        for (h, t) in [(5, Tier::Device), (5, Tier::Disk), (6, Tier::Host)] {
            want.toggle(t.digest_key(h), true);
        }
        assert_eq!(held.digest(), want);
        assert_eq!(held.digest().block_count, 3);
        let mut pairs: Vec<_> = held.iter().collect();
        pairs.sort();
        assert_eq!(pairs, [(5, Tier::Device), (5, Tier::Disk), (6, Tier::Host)]);
        let mut cleared = match held.apply(KvEvent::Cleared) {
            Presence::Cleared(hashes) => hashes,
            other => panic!("{other:?}"),
        };
        cleared.sort();
        assert_eq!(cleared, [5, 6]);
        assert_eq!(held.digest(), KvDigest::default());
    }
}
