//! The disk tier: one file per block in a directory of this tier's own, made inside the
//! directory the operator names (`--kv-disk-dir`) and removed when the tier is dropped, so two
//! workers sharing a directory never read each other's files and a restart starts empty.
//!
//! A file is a 40-byte header (magic, block hash, namespace, payload length, xxh3 of the
//! payload) and the block. Every read checks all five: a file corrupt, cut short, grown or gone
//! is a miss, dropped and counted ([`TierStore::corrupt_blocks`]), never KV.

use std::collections::HashSet;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use xxhash_rust::xxh3::xxh3_64;

use crate::{BlockHash, FrequencyLru, Tier, TierError, TierStore};

const MAGIC: [u8; 8] = *b"DUETKV01";
/// Bytes of a file's header.
pub const HEADER_BYTES: usize = 40;

pub struct DiskTier {
    dir: PathBuf,
    block_bytes: usize,
    capacity: usize,
    /// Seeds nothing; checked on read, so a file of another model or layout is never taken.
    namespace: u64,
    held: HashSet<BlockHash>,
    order: FrequencyLru,
    corrupt: u64,
}

impl DiskTier {
    /// A tier of at most `max_bytes` of files in a new directory inside `parent` (created if
    /// missing), for blocks of `block_bytes`. `namespace` identifies the model and layout.
    pub fn new(
        parent: &Path,
        max_bytes: u64,
        block_bytes: usize,
        namespace: u64,
    ) -> Result<Self, TierError> {
        let file_bytes = (HEADER_BYTES + block_bytes) as u64;
        let capacity = (max_bytes / file_bytes) as usize;
        if capacity == 0 {
            return Err(TierError::DiskDir(format!(
                "--kv-disk-bytes {max_bytes} holds no block: each takes {file_bytes} bytes"
            )));
        }
        std::fs::create_dir_all(parent)
            .map_err(|e| TierError::DiskDir(format!("cannot create {}: {e}", parent.display())))?;
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = parent.join(format!(
            "duet-kv-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir(&dir)
            .map_err(|e| TierError::DiskDir(format!("cannot create {}: {e}", dir.display())))?;
        Ok(Self {
            dir,
            block_bytes,
            capacity,
            namespace,
            held: HashSet::new(),
            order: FrequencyLru::new(capacity),
            corrupt: 0,
        })
    }

    /// The directory this tier's files are in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of a block.
    pub fn path_of(&self, hash: BlockHash) -> PathBuf {
        self.dir.join(format!("{hash:016x}.kvb"))
    }

    fn header(&self, hash: BlockHash, block: &[u8]) -> [u8; HEADER_BYTES] {
        let mut h = [0; HEADER_BYTES];
        h[..8].copy_from_slice(&MAGIC);
        h[8..16].copy_from_slice(&hash.to_le_bytes());
        h[16..24].copy_from_slice(&self.namespace.to_le_bytes());
        h[24..32].copy_from_slice(&(block.len() as u64).to_le_bytes());
        h[32..40].copy_from_slice(&xxh3_64(block).to_le_bytes());
        h
    }

    /// Reads and checks a block's file into `out`; whether it is whole and the block's.
    fn read_checked(&self, hash: BlockHash, out: &mut [u8]) -> bool {
        let Ok(mut file) = File::open(self.path_of(hash)) else {
            return false;
        };
        let mut header = [0; HEADER_BYTES];
        if file.read_exact(&mut header).is_err() || file.read_exact(out).is_err() {
            return false;
        }
        // Nothing may follow the block.
        if !matches!(file.read(&mut [0; 1]), Ok(0)) {
            return false;
        }
        header == self.header(hash, out)
    }

    fn io(context: String, source: std::io::Error) -> TierError {
        TierError::Io {
            tier: Tier::Disk,
            context,
            source,
        }
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        // Only this tier's own directory, which holds only its block files.
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl TierStore for DiskTier {
    fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    fn tier(&self) -> Tier {
        Tier::Disk
    }

    fn capacity_blocks(&self) -> usize {
        self.capacity
    }

    fn len(&self) -> usize {
        self.held.len()
    }

    fn contains(&self, hash: BlockHash) -> bool {
        self.held.contains(&hash)
    }

    fn victim(&self) -> Option<BlockHash> {
        self.order.victim()
    }

    fn put(&mut self, hash: BlockHash, block: &[u8]) -> Result<(), TierError> {
        if block.len() != self.block_bytes {
            return Err(TierError::BlockSize {
                tier: Tier::Disk,
                got: block.len(),
                want: self.block_bytes,
            });
        }
        if self.contains(hash) {
            self.touch(hash);
            return Ok(());
        }
        if self.is_full() {
            return Ok(()); // the caller makes room first
        }
        let path = self.path_of(hash);
        let written = File::create(&path).and_then(|mut f| {
            f.write_all(&self.header(hash, block))?;
            f.write_all(block)
        });
        if let Err(e) = written {
            let _ = std::fs::remove_file(&path);
            return Err(Self::io(format!("writing {}", path.display()), e));
        }
        self.held.insert(hash);
        self.order.insert(hash);
        Ok(())
    }

    fn read(&mut self, hash: BlockHash, out: &mut [u8]) -> Result<bool, TierError> {
        if out.len() != self.block_bytes {
            return Err(TierError::BlockSize {
                tier: Tier::Disk,
                got: out.len(),
                want: self.block_bytes,
            });
        }
        if !self.contains(hash) {
            return Ok(false);
        }
        if self.read_checked(hash, out) {
            return Ok(true);
        }
        self.corrupt += 1;
        self.remove(hash);
        Ok(false)
    }

    fn touch(&mut self, hash: BlockHash) {
        self.order.touch(hash);
    }

    fn remove(&mut self, hash: BlockHash) -> bool {
        if !self.held.remove(&hash) {
            return false;
        }
        self.order.remove(hash);
        let _ = std::fs::remove_file(self.path_of(hash));
        true
    }

    fn hashes(&self) -> Vec<BlockHash> {
        self.held.iter().copied().collect()
    }

    fn corrupt_blocks(&self) -> u64 {
        self.corrupt
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tier(dir: &Path, blocks: u64) -> DiskTier {
        DiskTier::new(dir, blocks * (HEADER_BYTES as u64 + 8), 8, 77).unwrap()
    }

    #[test]
    fn blocks_round_trip_through_files_within_the_byte_limit() {
        let parent = tempfile::tempdir().unwrap();
        let mut t = tier(parent.path(), 2);
        assert_eq!(t.capacity_blocks(), 2);
        t.put(1, &[1; 8]).unwrap();
        t.put(2, &[2; 8]).unwrap();
        assert!(t.is_full());
        t.put(3, &[3; 8]).unwrap();
        assert!(!t.contains(3), "nothing is written past the limit");
        let mut out = [0; 8];
        assert!(t.read(1, &mut out).unwrap());
        assert_eq!(out, [1; 8]);
        assert_eq!(t.victim(), Some(1), "a read alone is not a use");
        t.touch(1);
        assert_eq!(t.victim(), Some(2), "block 1 was used since it entered");
        assert!(t.remove(2));
        assert!(!t.path_of(2).exists(), "a removed block's file is deleted");
        let dir = t.dir().to_path_buf();
        drop(t);
        assert!(!dir.exists(), "the tier's directory goes with it");
        assert!(parent.path().exists(), "the operator's directory stays");
    }

    #[test]
    fn corrupt_truncated_or_missing_files_are_misses_and_counted() {
        let parent = tempfile::tempdir().unwrap();
        let mut t = tier(parent.path(), 4);
        for h in 1..=4 {
            t.put(h, &[h as u8; 8]).unwrap();
        }
        // One bit of the payload flipped.
        let mut bytes = std::fs::read(t.path_of(1)).unwrap();
        bytes[HEADER_BYTES + 3] ^= 1;
        std::fs::write(t.path_of(1), bytes).unwrap();
        // Cut short, grown, gone.
        let bytes = std::fs::read(t.path_of(2)).unwrap();
        std::fs::write(t.path_of(2), &bytes[..bytes.len() - 1]).unwrap();
        std::fs::write(t.path_of(3), [bytes.as_slice(), &[0]].concat()).unwrap();
        std::fs::remove_file(t.path_of(4)).unwrap();
        let mut out = [0xaa; 8];
        for h in 1..=4 {
            assert!(
                !t.read(h, &mut out).unwrap(),
                "block {h} read from a bad file"
            );
            assert!(!t.contains(h), "a bad block is dropped");
        }
        assert_eq!(t.corrupt_blocks(), 4);
        assert!(t.is_empty());
    }

    #[test]
    fn a_file_of_another_block_is_not_taken() {
        let parent = tempfile::tempdir().unwrap();
        let mut t = tier(parent.path(), 2);
        t.put(1, &[1; 8]).unwrap();
        t.put(2, &[2; 8]).unwrap();
        std::fs::copy(t.path_of(2), t.path_of(1)).unwrap();
        let mut out = [0; 8];
        assert!(!t.read(1, &mut out).unwrap());
        assert_eq!(t.corrupt_blocks(), 1);
    }

    #[test]
    fn a_limit_below_one_block_is_a_clear_error() {
        let parent = tempfile::tempdir().unwrap();
        let err = DiskTier::new(parent.path(), 10, 8, 0).err().unwrap();
        assert!(err.to_string().contains("--kv-disk-bytes 10"), "{err}");
    }
}
