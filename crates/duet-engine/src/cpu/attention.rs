//! The paged KV store in host memory and causal attention over it.
//!
//! Layout: `[layer][block][K|V][kv_head][slot][head_dim]`, so one layer's blocks are contiguous
//! (a transfer can ship a layer as soon as it is computed) and one head's keys in a block are
//! contiguous (attention streams through them).

use crate::EngineError;
use crate::backend::{AttentionShape, KvLayout};
use crate::batch::ForwardBatch;
use crate::threadpool::ThreadPool;

use super::vector::{axpy, dot};
use super::{CpuTensor, SendPtr};

pub struct CpuKvStore {
    layout: KvLayout,
    data: Vec<f32>,
}

impl CpuKvStore {
    pub fn new(layout: KvLayout) -> Result<Self, EngineError> {
        let len = layout
            .num_blocks
            .checked_mul(layout.block_size)
            .and_then(|n| n.checked_mul(layout.values_per_token()))
            .ok_or_else(|| EngineError::Config("KV cache size overflows".into()))?;
        let mut data = Vec::new();
        data.try_reserve_exact(len).map_err(|_| {
            EngineError::Config(format!(
                "cannot allocate a KV cache of {} MiB ({} blocks)",
                len * 4 >> 20,
                layout.num_blocks
            ))
        })?;
        data.resize(len, 0.0);
        Ok(Self { layout, data })
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Values of one (layer, block) pair: K then V, each `[kv_head][slot][head_dim]`.
    fn block_len(&self) -> usize {
        2 * self.layout.num_kv_heads * self.layout.block_size * self.layout.head_dim
    }

    fn block_offset(&self, layer: usize, block: usize) -> usize {
        (layer * self.layout.num_blocks + block) * self.block_len()
    }

    /// K (`kv = 0`) or V (`kv = 1`) of one head in one block: `[slot][head_dim]`.
    fn head_block(&self, layer: usize, block: usize, kv: usize, head: usize) -> &[f32] {
        let l = self.layout;
        let start = self.block_offset(layer, block)
            + (kv * l.num_kv_heads + head) * l.block_size * l.head_dim;
        &self.data[start..start + l.block_size * l.head_dim]
    }

    /// The KV of one layer of one block, as stored (for transfer).
    pub fn layer_block(&self, layer: usize, block: usize) -> &[f32] {
        let start = self.block_offset(layer, block);
        &self.data[start..start + self.block_len()]
    }

    pub fn layer_block_mut(&mut self, layer: usize, block: usize) -> &mut [f32] {
        let start = self.block_offset(layer, block);
        let len = self.block_len();
        &mut self.data[start..start + len]
    }

    /// Writes rows of K and V (`[row][kv_head * head_dim]`) into their slots.
    pub fn write(&mut self, layer: usize, k: &[f32], v: &[f32], slots: &[u32]) {
        let l = self.layout;
        let width = l.num_kv_heads * l.head_dim;
        for (row, &slot) in slots.iter().enumerate() {
            let (block, offset) = (slot as usize / l.block_size, slot as usize % l.block_size);
            let base = self.block_offset(layer, block);
            for (kv, src) in [(0, k), (1, v)] {
                for h in 0..l.num_kv_heads {
                    let dst =
                        base + ((kv * l.num_kv_heads + h) * l.block_size + offset) * l.head_dim;
                    let s = row * width + h * l.head_dim;
                    self.data[dst..dst + l.head_dim].copy_from_slice(&src[s..s + l.head_dim]);
                }
            }
        }
    }
}

/// One (row, query head) attention problem per unit of work, dealt round-robin to threads so that
/// the long rows of a causal prompt are spread evenly.
pub(super) fn paged_attention(
    pool: &ThreadPool,
    q: &CpuTensor,
    kv: &CpuKvStore,
    layer: usize,
    shape: AttentionShape,
    batch: &ForwardBatch,
    out: &mut CpuTensor,
) {
    let hd = shape.head_dim;
    let group = shape.num_heads / shape.num_kv_heads;
    let bs = kv.layout.block_size;
    let scale = 1.0 / (hd as f32).sqrt();
    let units = q.rows * shape.num_heads;
    let out_cols = out.cols;
    let out_ptr = SendPtr(out.data.as_mut_ptr());
    let max_ctx = batch
        .seqs
        .iter()
        .map(|s| s.context_len())
        .max()
        .unwrap_or(0);
    pool.run(|tid, n| {
        let mut scores = vec![0f32; max_ctx];
        let mut unit = tid;
        while unit < units {
            let (row, head) = (unit / shape.num_heads, unit % shape.num_heads);
            let seq = &batch.seqs[batch.row_seq[row] as usize];
            let ctx = batch.positions[row] as usize + 1;
            let kvh = head / group;
            let qv = &q.data[row * q.cols + head * hd..row * q.cols + (head + 1) * hd];
            let mut max = f32::NEG_INFINITY;
            for (bi, &block) in seq.block_table.iter().enumerate() {
                let first = bi * bs;
                if first >= ctx {
                    break;
                }
                let keys = kv.head_block(layer, block as usize, 0, kvh);
                for s in 0..bs.min(ctx - first) {
                    let sc = dot(qv, &keys[s * hd..(s + 1) * hd]) * scale;
                    scores[first + s] = sc;
                    max = max.max(sc);
                }
            }
            let mut sum = 0f32;
            for s in &mut scores[..ctx] {
                *s = (*s - max).exp();
                sum += *s;
            }
            // SAFETY: each (row, head) unit owns its own `hd` outputs.
            let o = unsafe { out_ptr.slice(row * out_cols + head * hd, hd) };
            o.fill(0.0);
            let inv = 1.0 / sum;
            for (bi, &block) in seq.block_table.iter().enumerate() {
                let first = bi * bs;
                if first >= ctx {
                    break;
                }
                let values = kv.head_block(layer, block as usize, 1, kvh);
                for s in 0..bs.min(ctx - first) {
                    axpy(scores[first + s] * inv, &values[s * hd..(s + 1) * hd], o);
                }
            }
            unit += n;
        }
    });
}
