//! The blocks holding one sequence's KV, in position order.

use crate::BlockId;

/// Maps a sequence's token positions to blocks: position `p` lives in `blocks[p / block_size]`
/// at offset `p % block_size`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<BlockId>,
}

impl BlockTable {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn from_blocks(blocks: Vec<BlockId>) -> Self {
        Self { blocks }
    }

    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Token capacity of the blocks held.
    pub fn capacity(&self, block_size: usize) -> usize {
        self.blocks.len() * block_size
    }

    /// Blocks still needed to hold `num_tokens` tokens in total.
    pub fn blocks_missing(&self, num_tokens: usize, block_size: usize) -> usize {
        num_tokens
            .div_ceil(block_size)
            .saturating_sub(self.blocks.len())
    }

    pub fn extend(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        self.blocks.extend(blocks);
    }

    /// Removes and returns the blocks past the first `keep` (to hand back to the pool).
    pub fn truncate(&mut self, keep: usize) -> Vec<BlockId> {
        self.blocks.split_off(keep.min(self.blocks.len()))
    }

    /// Removes and returns every block (to hand back to the pool).
    pub fn take(&mut self) -> Vec<BlockId> {
        std::mem::take(&mut self.blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_missing_blocks() {
        let mut t = BlockTable::new();
        assert_eq!(t.blocks_missing(0, 16), 0);
        assert_eq!(t.blocks_missing(1, 16), 1);
        assert_eq!(t.blocks_missing(33, 16), 3);
        t.extend([4, 9]);
        assert_eq!(t.blocks_missing(32, 16), 0);
        assert_eq!(t.blocks_missing(33, 16), 1);
        assert_eq!(t.capacity(16), 32);
        assert_eq!(t.take(), vec![4, 9]);
        assert!(t.is_empty());
    }
}
