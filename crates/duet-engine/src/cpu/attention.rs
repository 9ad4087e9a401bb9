//! The paged KV store in host memory and causal attention over it.
//!
//! Layout: `[layer][block][K|V][kv_head][slot][head_dim]`, so one layer's blocks are contiguous
//! (a transfer can ship a layer as soon as it is computed) and one head's keys in a block are
//! contiguous (attention streams through them).

use crate::EngineError;
use crate::backend::{AttentionShape, KvLayout};
use crate::batch::ForwardBatch;
use crate::threadpool::ThreadPool;

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
        // Zeroed pages straight from the allocator (calloc/mmap): memory becomes resident only
        // as blocks are first written, so an idle pool costs nothing.
        let alloc_error = || {
            EngineError::Config(format!(
                "cannot allocate a KV cache of {} MiB ({} blocks)",
                (len * 4) >> 20,
                layout.num_blocks
            ))
        };
        let data = if len == 0 {
            Vec::new()
        } else {
            let bytes = std::alloc::Layout::array::<f32>(len).map_err(|_| alloc_error())?;
            // SAFETY: the layout is non-zero-sized; a non-null result is `len` zeroed f32s
            // allocated by the global allocator with exactly the layout a Vec<f32> uses.
            unsafe {
                let ptr = std::alloc::alloc_zeroed(bytes) as *mut f32;
                if ptr.is_null() {
                    return Err(alloc_error());
                }
                Vec::from_raw_parts(ptr, len, len)
            }
        };
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

/// Causal attention over the paged cache. One unit of work is a (row, KV head) pair: the query
/// heads sharing that KV head are processed together so each key and value is read once. Units
/// are dealt round-robin so the long rows of a causal prompt spread evenly over threads.
pub(super) fn paged_attention(
    pool: &ThreadPool,
    q: &CpuTensor,
    kv: &CpuKvStore,
    layer: usize,
    shape: AttentionShape,
    batch: &ForwardBatch,
    out: &mut CpuTensor,
) {
    let group = shape.num_heads / shape.num_kv_heads;
    let units = q.rows * shape.num_kv_heads;
    let out_cols = out.cols;
    let out_ptr = SendPtr(out.data.as_mut_ptr());
    let max_ctx = batch
        .seqs
        .iter()
        .map(|s| s.context_len())
        .max()
        .unwrap_or(0);
    let kernel = unit_kernel();
    pool.run(|tid, n| {
        let mut scores = vec![0f32; group * max_ctx];
        let mut inv_sums = vec![0f32; group];
        let mut unit = tid;
        while unit < units {
            let (row, kvh) = (unit / shape.num_kv_heads, unit % shape.num_kv_heads);
            let seq = &batch.seqs[batch.row_seq[row] as usize];
            let hd = shape.head_dim;
            let first_head = kvh * group;
            let q_heads =
                &q.data[row * q.cols + first_head * hd..row * q.cols + (first_head + group) * hd];
            // SAFETY: each (row, KV head) unit owns the outputs of its own query heads.
            let o = unsafe { out_ptr.slice(row * out_cols + first_head * hd, group * hd) };
            let unit_args = Unit {
                kv,
                layer,
                kvh,
                block_table: &seq.block_table,
                ctx: batch.positions[row] as usize + 1,
                q: q_heads,
                group,
                head_dim: hd,
            };
            kernel(&unit_args, &mut scores, &mut inv_sums, o);
            unit += n;
        }
    });
}

/// One (row, KV head) attention problem.
struct Unit<'a> {
    kv: &'a CpuKvStore,
    layer: usize,
    kvh: usize,
    block_table: &'a [u32],
    /// Positions attended: `0..ctx`.
    ctx: usize,
    /// The `group` query heads, `[group][head_dim]`.
    q: &'a [f32],
    group: usize,
    head_dim: usize,
}

type UnitKernel = fn(&Unit<'_>, &mut [f32], &mut [f32], &mut [f32]);

/// The attention kernel for this CPU, chosen once: the same portable code, compiled a second
/// time with AVX2 and FMA enabled so its fixed-width loops become vector instructions.
fn unit_kernel() -> UnitKernel {
    static K: std::sync::OnceLock<UnitKernel> = std::sync::OnceLock::new();
    *K.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return |u, s, i, o| unsafe { attend_avx2(u, s, i, o) };
        }
        attend_portable
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_avx2(u: &Unit<'_>, scores: &mut [f32], inv_sums: &mut [f32], out: &mut [f32]) {
    attend(u, scores, inv_sums, out)
}

fn attend_portable(u: &Unit<'_>, scores: &mut [f32], inv_sums: &mut [f32], out: &mut [f32]) {
    attend(u, scores, inv_sums, out)
}

#[inline(always)]
fn attend(u: &Unit<'_>, scores: &mut [f32], inv_sums: &mut [f32], out: &mut [f32]) {
    let (hd, ctx, g) = (u.head_dim, u.ctx, u.group);
    let bs = u.kv.layout.block_size;
    let scale = 1.0 / (hd as f32).sqrt();
    let scores = &mut scores[..g * ctx];
    // Scores: every key read once for all query heads of the group.
    for (bi, &block) in u.block_table.iter().enumerate() {
        let first = bi * bs;
        if first >= ctx {
            break;
        }
        let keys = u.kv.head_block(u.layer, block as usize, 0, u.kvh);
        for s in 0..bs.min(ctx - first) {
            let k = &keys[s * hd..(s + 1) * hd];
            for h in 0..g {
                scores[h * ctx + first + s] = dot(&u.q[h * hd..(h + 1) * hd], k) * scale;
            }
        }
    }
    // Softmax per head, normalisation folded into the output.
    for h in 0..g {
        let row = &mut scores[h * ctx..(h + 1) * ctx];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        inv_sums[h] = 1.0 / exp_sub_in_place(row, max);
    }
    out.fill(0.0);
    for (bi, &block) in u.block_table.iter().enumerate() {
        let first = bi * bs;
        if first >= ctx {
            break;
        }
        let values = u.kv.head_block(u.layer, block as usize, 1, u.kvh);
        for s in 0..bs.min(ctx - first) {
            let v = &values[s * hd..(s + 1) * hd];
            for h in 0..g {
                let w = scores[h * ctx + first + s] * inv_sums[h];
                axpy(w, v, &mut out[h * hd..(h + 1) * hd]);
            }
        }
    }
}

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[inline(always)]
fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
}

/// `x[i] = exp(x[i] - max)` for every element; returns the sum. A Cody-Waite range reduction and
/// a degree-6 polynomial (relative error below 2e-7), written branch-free so it vectorises.
#[inline(always)]
fn exp_sub_in_place(x: &mut [f32], max: f32) -> f32 {
    let mut acc = [0f32; 8];
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        for j in 0..8 {
            c[j] = exp_approx(c[j] - max);
            acc[j] += c[j];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for v in chunks.into_remainder() {
        *v = exp_approx(*v - max);
        sum += *v;
    }
    sum
}

#[inline(always)]
fn exp_approx(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Below -87 the result is ~0 (and 2^n would underflow the exponent field).
    let x = x.max(-87.0);
    // Round to nearest via the 1.5·2^23 trick (vectorises, unlike f32::round).
    let n = (x * LOG2E + 12_582_912.0) - 12_582_912.0;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (0.166_666_67
                    + r * (0.041_666_668 + r * (0.008_333_334 + r * 0.001_388_889)))));
    let scale = f32::from_bits(((n as i32 + 127) << 23) as u32);
    p * scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_approx_is_accurate() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let want = (x as f64).exp();
            let got = exp_approx(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 1e-6, "relative error {worst}");
        assert!(exp_approx(-1000.0) < 1e-37);
    }
}
