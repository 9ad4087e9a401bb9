//! Paged KV cache bookkeeping, independent of where the KV bytes live (CPU memory, a GPU).
//!
//! - [`BlockPool`]: fixed-size blocks with reference counts, a free list, and a prefix cache of
//!   freed-but-still-valid blocks keyed by their chained content hash, evicted LRU; the
//!   [`KvEvent`]s that tell a router which hashes it holds.
//! - [`BlockTable`]: the blocks of one sequence, in position order.
//! - [`block_hashes`]: the chained 64-bit hashes of a token sequence's full blocks.
//! - [`KvCacheManager`]: owns the pool; gives sequences blocks (prefix hits first), registers and
//!   frees them, and holds blocks for transferred KV. Schedulers see only [`KvBlocks`].

mod block_pool;
mod block_table;
mod hashing;
mod kv_cache_manager;

pub use block_pool::{BlockId, BlockPool, KvDigest, KvError, KvEvent, PoolStats};
pub use block_table::BlockTable;
pub use hashing::{BlockHash, block_hashes, hash_seed, next_block_hash, request_hash_seed};
pub use kv_cache_manager::{KvBlocks, KvCacheManager, KvReservation, SeqId};
