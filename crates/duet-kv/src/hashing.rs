//! Chained block hashes: `h_i = xxh3(h_{i-1} ‖ tokens_i, seed)`.
//!
//! Chaining makes a block's hash identify its whole prefix, so equal hashes mean equal KV (for the
//! same model: the seed is derived from the model fingerprint and an optional tenant salt, so two
//! models or tenants never share entries).

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// The content hash of one full block together with everything before it.
pub type BlockHash = u64;

/// The hashing seed for a model fingerprint and an optional per-tenant cache salt.
pub fn hash_seed(model_fingerprint: &[u8], cache_salt: Option<&str>) -> u64 {
    let mut bytes = model_fingerprint.to_vec();
    if let Some(salt) = cache_salt {
        bytes.push(0xff);
        bytes.extend_from_slice(salt.as_bytes());
    }
    xxh3_64(&bytes)
}

/// The seed of a request's prefix hashes: its model's fingerprint string and its cache salt
/// (empty: the shared namespace). The engine and the router both seed with this, so the
/// router's index names the same blocks the engines cache.
pub fn request_hash_seed(model_fingerprint: &str, cache_salt: &str) -> u64 {
    hash_seed(
        model_fingerprint.as_bytes(),
        (!cache_salt.is_empty()).then_some(cache_salt),
    )
}

/// Hashes of the full blocks of `tokens` (a trailing partial block gets none).
pub fn block_hashes(seed: u64, tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    assert!(block_size > 0, "block size must be positive");
    let mut prev = 0;
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            prev = next_block_hash(seed, prev, block);
            prev
        })
        .collect()
}

/// The hash of `block` following a block whose hash is `prev` (0 for the first block).
pub fn next_block_hash(seed: u64, prev: BlockHash, block: &[u32]) -> BlockHash {
    // The bytes of blocks of up to 64 tokens are laid out on the stack: hashing is on every
    // block of every prompt, and an allocation would cost more than the hash.
    const ON_STACK: usize = 8 + 4 * 64;
    let len = 8 + 4 * block.len();
    let mut stack = [0u8; ON_STACK];
    let mut heap = Vec::new();
    let buf = match len <= ON_STACK {
        true => &mut stack[..len],
        false => {
            heap.resize(len, 0);
            &mut heap[..]
        }
    };
    buf[..8].copy_from_slice(&prev.to_le_bytes());
    for (bytes, t) in buf[8..].chunks_exact_mut(4).zip(block) {
        bytes.copy_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(buf, seed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_identify_the_whole_prefix() {
        let seed = hash_seed(b"model", None);
        let a = block_hashes(seed, &[1, 2, 3, 4, 5, 6, 7, 8, 9], 4);
        assert_eq!(a.len(), 2, "partial trailing block has no hash");
        let b = block_hashes(seed, &[1, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_eq!(a, b);
        // Same second block after a different first block: different hash.
        let c = block_hashes(seed, &[0, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_ne!(a[0], c[0]);
        assert_ne!(a[1], c[1]);
    }

    /// A block's hash is xxh3 of the previous hash and the tokens, little-endian, whatever the
    /// block's size (routers and engines of other builds must agree).
    #[test]
    fn a_block_hash_is_xxh3_of_its_bytes() {
        for n in [1, 16, 64, 65, 200] {
            let block: Vec<u32> = (0..n).map(|i| i * 7919 + 3).collect();
            let mut bytes = 42u64.to_le_bytes().to_vec();
            bytes.extend(block.iter().flat_map(|t| t.to_le_bytes()));
            assert_eq!(
                next_block_hash(9, 42, &block),
                xxh3_64_with_seed(&bytes, 9),
                "{n} tokens"
            );
        }
    }

    #[test]
    fn seed_separates_models_and_tenants() {
        let t = [7u32; 16];
        let base = block_hashes(hash_seed(b"m1", None), &t, 16);
        assert_ne!(base, block_hashes(hash_seed(b"m2", None), &t, 16));
        assert_ne!(base, block_hashes(hash_seed(b"m1", Some("tenant")), &t, 16));
    }
}
