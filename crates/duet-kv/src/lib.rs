//! Paged KV cache bookkeeping, independent of where the KV bytes live (CPU memory, a GPU).
//!
//! - [`BlockPool`]: fixed-size blocks with reference counts, a free list, and a prefix cache of
//!   freed-but-still-valid blocks keyed by their chained content hash, evicted LRU; the
//!   [`KvEvent`]s that tell a router which hashes it holds.
//! - [`BlockTable`]: the blocks of one sequence, in position order.
//! - [`block_hashes`]: the chained 64-bit hashes of a token sequence's full blocks.
//! - [`KvCacheManager`]: owns the pool; gives sequences blocks (prefix hits first), registers and
//!   frees them, and holds blocks for transferred KV. Schedulers see only [`KvBlocks`].
//! - Tiers below the pool ([`Tier`], [`TierStore`]): [`HostTier`] (memory) and [`DiskTier`]
//!   (files), chained as [`LowerTiers`] with their eviction order ([`FrequencyLru`]) and the
//!   [`CostModel`] that decides whether a block found below is loaded or recomputed;
//!   [`HeldBlocks`], what a stream of events says a worker holds in which tier; [`Stopwatch`],
//!   the wall and CPU time of loading blocks.

mod block_pool;
mod block_table;
mod cost_model;
pub mod disk_tier;
mod frequency_lru;
mod hashing;
mod held_blocks;
mod host_tier;
mod kv_cache_manager;
mod lower_tiers;
mod stopwatch;
mod tier;

pub use block_pool::{BlockId, BlockPool, Eviction, KvDigest, KvError, KvEvent, PoolStats};
pub use block_table::BlockTable;
pub use cost_model::{CostModel, LoadDecision, PRIOR_PREFILL_TOKENS_PER_S};
pub use disk_tier::DiskTier;
pub use frequency_lru::FrequencyLru;
pub use hashing::{BlockHash, block_hashes, hash_seed, next_block_hash, request_hash_seed};
pub use held_blocks::{HeldBlocks, Presence};
pub use host_tier::{HostMemory, HostTier};
pub use kv_cache_manager::{
    BlockLoad, KvBlocks, KvCacheManager, KvFence, KvMoves, KvReservation, SeqId,
};
pub use lower_tiers::{BlockBytes, LowerTiers, TierStats};
pub use stopwatch::{Elapsed, Stopwatch};
pub use tier::{Tier, TierError, TierStore};
