//! The tiers a KV block can live in, and the one trait every tier below the device pool
//! implements ([`TierStore`]): host memory ([`HostTier`](crate::HostTier)) and local disk
//! ([`DiskTier`](crate::DiskTier)).
//!
//! A tier below the device holds whole blocks (every layer, K and V, in the device store's own
//! layout, so that bringing one back is a copy; it never leaves the worker) under their chained
//! hash; the hash's seed carries the model fingerprint and the request's
//! cache salt, so a tier keyed by it keeps tenants apart exactly as the device pool does. It
//! keeps its own order of what to evict ([`FrequencyLru`](crate::FrequencyLru)); the chain of
//! tiers ([`LowerTiers`](crate::LowerTiers)) decides what enters and where victims go.

use crate::BlockHash;

/// Where a block's KV is held, fastest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// The device pool the model reads (GPU memory, or the CPU worker's KV pool).
    Device,
    /// Host memory below the device pool.
    Host,
    /// Files in a local directory.
    Disk,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];

    pub fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }

    /// Position in [`Tier::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// This tier's bit in a set of tiers (a `u8` mask).
    pub fn bit(self) -> u8 {
        1 << self.index()
    }

    /// The key a block in this tier adds to a [`KvDigest`](crate::KvDigest): the hash itself in
    /// the device pool (the digest of a worker without tiers is unchanged), a mix of hash and
    /// tier below it, so that the same block in two tiers counts twice.
    pub fn digest_key(self, hash: BlockHash) -> u64 {
        match self {
            Tier::Device => hash,
            Tier::Host => hash.rotate_left(21) ^ 0x9e37_79b9_7f4a_7c15,
            Tier::Disk => hash.rotate_left(42) ^ 0xc2b2_ae3d_27d4_eb4f,
        }
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TierError {
    #[error("{tier} tier: {context}: {source}")]
    Io {
        tier: Tier,
        context: String,
        source: std::io::Error,
    },
    #[error("{tier} tier: a block of {got} bytes where blocks are {want} bytes")]
    BlockSize { tier: Tier, got: usize, want: usize },
    /// The disk tier's directory cannot be used.
    #[error("--kv-disk-dir: {0}")]
    DiskDir(String),
}

/// A store of whole KV blocks below the device pool, keyed by chained block hash. Every block
/// has the same size (fixed when the store is made). The store keeps the order in which its
/// blocks should go ([`victim`](Self::victim)); the caller makes room before a
/// [`put`](Self::put).
pub trait TierStore: Send {
    fn tier(&self) -> Tier;
    /// Blocks it can hold.
    fn capacity_blocks(&self) -> usize;
    /// Blocks it holds.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn is_full(&self) -> bool {
        self.len() >= self.capacity_blocks()
    }
    fn contains(&self, hash: BlockHash) -> bool;
    /// The block to evict next: the least valuable by use and recency.
    fn victim(&self) -> Option<BlockHash>;
    /// Bytes of each block.
    fn block_bytes(&self) -> usize;
    /// Stores a block (not held yet; the caller made room).
    fn put(&mut self, hash: BlockHash, block: &[u8]) -> Result<(), TierError>;
    /// Stores a block (not held yet; the caller made room) whose bytes `fill` writes (one
    /// block; `false`: it could not, and nothing is stored): straight into the tier's own memory
    /// where it has a place for them (a host slot), else through a buffer. Whether the block is
    /// held afterwards.
    fn put_with(
        &mut self,
        hash: BlockHash,
        fill: &mut dyn FnMut(&mut [u8]) -> bool,
    ) -> Result<bool, TierError> {
        let mut block = vec![0; self.block_bytes()];
        if !fill(&mut block) {
            return Ok(false);
        }
        self.put(hash, &block)?;
        Ok(self.contains(hash))
    }
    /// Copies a block into `out` (exactly one block long). `Ok(false)` when it is not held, or
    /// was held but is unreadable (a file corrupt or cut short): such a block is dropped and
    /// counted, never returned.
    fn read(&mut self, hash: BlockHash, out: &mut [u8]) -> Result<bool, TierError>;
    /// Records a use of a held block (it was brought up, or stored again).
    fn touch(&mut self, hash: BlockHash);
    /// Drops a block; whether it was held.
    fn remove(&mut self, hash: BlockHash) -> bool;
    /// Every block held.
    fn hashes(&self) -> Vec<BlockHash>;
    /// Blocks found unreadable since the store was made.
    fn corrupt_blocks(&self) -> u64 {
        0
    }
    /// Whether the device copies straight from this tier's memory (page-locked host memory).
    fn page_locked(&self) -> bool {
        false
    }
    /// Lends a held block's slot to a device copy that will read it in place, after the call
    /// that queues it returned: `Some(slot)` where the tier's memory is page-locked (else the
    /// block is [read](Self::read) out). The slot keeps its bytes, neither rewritten nor given
    /// to another block, until [`start_copy`](Self::start_copy) and then
    /// [`copies_done`](Self::copies_done).
    fn lend(&mut self, hash: BlockHash) -> Option<usize> {
        let _ = hash;
        None
    }
    /// A copy of lent slot `slot` is being queued: its bytes (`None` if it is not lent).
    fn start_copy(&mut self, slot: usize) -> Option<&[u8]> {
        let _ = slot;
        None
    }
    /// Every copy queued so far ([`start_copy`](Self::start_copy)) has completed: their slots
    /// are the tier's again (slots lent to copies not queued yet stay lent).
    fn copies_done(&mut self) {}
    /// Whether a block moving in now needs a slot a copy in flight still reads (every free slot
    /// is held back): the caller waits for the copies, then calls
    /// [`copies_done`](Self::copies_done), before the [`put`](Self::put).
    fn waits_for_copies(&self) -> bool {
        false
    }
}
