//! Paged KV cache bookkeeping, independent of where the KV bytes live (CPU memory, a GPU).
//!
//! - [`BlockPool`]: fixed-size blocks with reference counts, a free list, and a prefix cache of
//!   freed-but-still-valid blocks keyed by their chained content hash, evicted LRU.
//! - [`BlockTable`]: the blocks of one sequence, in position order.
//! - [`block_hashes`]: the chained 64-bit hashes of a token sequence's full blocks.

mod block_pool;
mod block_table;
mod hashing;

pub use block_pool::{BlockId, BlockPool, KvError, PoolStats};
pub use block_table::BlockTable;
pub use hashing::{BlockHash, block_hashes, hash_seed, next_block_hash};
