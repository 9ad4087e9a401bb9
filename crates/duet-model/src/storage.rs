//! Weight bytes that are either memory-mapped from a model file or owned.
//!
//! Quantized weights are used in place from the mapping (no copy, no extra resident memory);
//! the few tensors that must be rewritten at load (row permutations, dtype conversions) own theirs.

use std::ops::{Deref, Range};
use std::sync::Arc;

/// An immutable, cheaply clonable byte slice of a weight tensor.
#[derive(Clone)]
pub struct WeightBytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    range: Range<usize>,
}

impl WeightBytes {
    /// Bytes `range` of a shared mapping (or any shared buffer).
    pub fn shared(owner: Arc<dyn AsRef<[u8]> + Send + Sync>, range: Range<usize>) -> Self {
        assert!(
            range.end <= (*owner).as_ref().len(),
            "weight range past the end of its buffer"
        );
        Self { owner, range }
    }

    /// Bytes `range` of these bytes, sharing their buffer.
    pub fn slice(&self, range: Range<usize>) -> Self {
        assert!(
            range.end <= self.range.len(),
            "slice past the end of the weight bytes"
        );
        Self {
            owner: self.owner.clone(),
            range: self.range.start + range.start..self.range.start + range.end,
        }
    }

    pub fn from_vec(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        Self {
            owner: Arc::new(bytes),
            range: 0..len,
        }
    }
}

impl Deref for WeightBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.range.clone()]
    }
}

impl std::fmt::Debug for WeightBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WeightBytes({} bytes)", self.range.len())
    }
}
