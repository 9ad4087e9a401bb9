//! The paged KV store in host memory and causal attention over it.
//!
//! Layout: `[layer][block][K|V][kv_head][slot][head_dim]`, so one layer's blocks are contiguous
//! (a transfer can ship a layer as soon as it is computed) and one head's keys in a block are
//! contiguous (attention streams through them). Values are f32 or f16 ([`KvElement`]); the
//! kernels widen them to f32 as they read.

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::threadpool::ThreadPool;
use duet_engine::EngineError;
use duet_engine::backend::{AttentionShape, KvDtype, KvLayout};
use duet_engine::batch::ForwardBatch;

use super::vector::exp_approx;
use super::{CpuTensor, SendPtr};

pub struct CpuKvStore {
    layout: KvLayout,
    data: KvData,
}

/// The cache's values, in the element type of its layout.
enum KvData {
    F32(Vec<f32>),
    F16(Vec<f16>),
}

/// An element type the CPU cache stores: values are rounded to it when written and widened to
/// f32 when read.
pub(super) trait KvElement: Copy + Send + Sync + 'static {
    /// The element is an IEEE half (the AVX-512 kernels widen it with `vcvtph2ps`).
    const IS_F16: bool;
    fn to_f32(self) -> f32;
    /// `dst[i] = src[i]`, rounded to nearest even.
    fn store(dst: &mut [Self], src: &[f32]);
    fn write_le(src: &[Self], out: &mut [u8]);
    fn read_le(dst: &mut [Self], data: &[u8]);
}

impl KvElement for f32 {
    const IS_F16: bool = false;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    fn store(dst: &mut [f32], src: &[f32]) {
        dst.copy_from_slice(src);
    }

    fn write_le(src: &[f32], out: &mut [u8]) {
        for (o, v) in out.chunks_exact_mut(4).zip(src) {
            o.copy_from_slice(&v.to_le_bytes());
        }
    }

    fn read_le(dst: &mut [f32], data: &[u8]) {
        for (v, b) in dst.iter_mut().zip(data.chunks_exact(4)) {
            *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
    }
}

impl KvElement for f16 {
    const IS_F16: bool = true;

    /// Branch-free so that the portable kernels vectorise: the magnitude bits shifted into f32
    /// position and scaled by 2^112 rebias the exponent (subnormals included); infinities and
    /// NaNs get the f32 all-ones exponent.
    #[inline(always)]
    fn to_f32(self) -> f32 {
        let h = self.to_bits() as u32;
        let mag = (h & 0x7fff) << 13;
        let scaled = (f32::from_bits(mag) * f32::from_bits(0x7780_0000)).to_bits();
        let bits = if h & 0x7c00 == 0x7c00 {
            mag | 0x7f80_0000
        } else {
            scaled
        };
        f32::from_bits(bits | ((h & 0x8000) << 16))
    }

    fn store(dst: &mut [f16], src: &[f32]) {
        dst.convert_from_f32_slice(src);
    }

    fn write_le(src: &[f16], out: &mut [u8]) {
        for (o, v) in out.chunks_exact_mut(2).zip(src) {
            o.copy_from_slice(&v.to_bits().to_le_bytes());
        }
    }

    fn read_le(dst: &mut [f16], data: &[u8]) {
        for (v, b) in dst.iter_mut().zip(data.chunks_exact(2)) {
            *v = f16::from_bits(u16::from_le_bytes([b[0], b[1]]));
        }
    }
}

/// `len` zeroed values straight from the allocator (calloc/mmap): memory becomes resident only
/// as blocks are first written, so an idle pool costs nothing. `None` if the allocation fails.
fn zeroed_vec<T: KvElement>(len: usize) -> Option<Vec<T>> {
    if len == 0 {
        return Some(Vec::new());
    }
    let bytes = std::alloc::Layout::array::<T>(len).ok()?;
    // SAFETY: the layout is non-zero-sized; a non-null result is `len` zeroed values (all-zero
    // bits are 0.0 for both element types) allocated by the global allocator with exactly the
    // layout a Vec<T> uses.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(bytes) as *mut T;
        (!ptr.is_null()).then(|| Vec::from_raw_parts(ptr, len, len))
    }
}

impl CpuKvStore {
    pub fn new(layout: KvLayout) -> Result<Self, EngineError> {
        let len = layout
            .num_blocks
            .checked_mul(layout.block_size)
            .and_then(|n| n.checked_mul(layout.values_per_token()))
            .ok_or_else(|| EngineError::Config("KV cache size overflows".into()))?;
        let data = match layout.dtype {
            KvDtype::F32 => zeroed_vec(len).map(KvData::F32),
            KvDtype::F16 => zeroed_vec(len).map(KvData::F16),
            KvDtype::Bf16 => {
                return Err(EngineError::Config(
                    "the CPU KV cache stores f32 or f16, not bf16".into(),
                ));
            }
        };
        let data = data.ok_or_else(|| {
            EngineError::Config(format!(
                "cannot allocate a KV cache of {} MiB ({} blocks)",
                layout.bytes() >> 20,
                layout.num_blocks
            ))
        })?;
        Ok(Self { layout, data })
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Bytes of one (layer, block) pair as stored and transferred.
    pub fn layer_block_bytes(&self) -> usize {
        block_len(&self.layout) * self.layout.dtype.bytes()
    }

    /// The KV of one layer of one block, little-endian, as stored: K then V, each
    /// `[kv_head][slot][head_dim]`.
    pub fn read_layer_block(&self, layer: usize, block: usize, out: &mut [u8]) {
        let range = layer_block_range(&self.layout, layer, block);
        match &self.data {
            KvData::F32(d) => f32::write_le(&d[range], out),
            KvData::F16(d) => f16::write_le(&d[range], out),
        }
    }

    pub fn write_layer_block(&mut self, layer: usize, block: usize, data: &[u8]) {
        let range = layer_block_range(&self.layout, layer, block);
        match &mut self.data {
            KvData::F32(d) => f32::read_le(&mut d[range], data),
            KvData::F16(d) => f16::read_le(&mut d[range], data),
        }
    }

    /// Writes rows of K and V (`[row][kv_head * head_dim]`) into their slots.
    pub fn write(&mut self, layer: usize, k: &[f32], v: &[f32], slots: &[u32]) {
        match &mut self.data {
            KvData::F32(d) => write_rows(&self.layout, d, layer, k, v, slots),
            KvData::F16(d) => write_rows(&self.layout, d, layer, k, v, slots),
        }
    }
}

fn write_rows<E: KvElement>(
    l: &KvLayout,
    data: &mut [E],
    layer: usize,
    k: &[f32],
    v: &[f32],
    slots: &[u32],
) {
    let width = l.num_kv_heads * l.head_dim;
    for (row, &slot) in slots.iter().enumerate() {
        let (block, offset) = (slot as usize / l.block_size, slot as usize % l.block_size);
        let base = layer_block_range(l, layer, block).start;
        for (kv, src) in [(0, k), (1, v)] {
            for h in 0..l.num_kv_heads {
                let dst = base + ((kv * l.num_kv_heads + h) * l.block_size + offset) * l.head_dim;
                let s = row * width + h * l.head_dim;
                E::store(&mut data[dst..dst + l.head_dim], &src[s..s + l.head_dim]);
            }
        }
    }
}

/// Values of one (layer, block) pair: K then V, each `[kv_head][slot][head_dim]`.
fn block_len(l: &KvLayout) -> usize {
    2 * l.num_kv_heads * l.block_size * l.head_dim
}

fn layer_block_range(l: &KvLayout, layer: usize, block: usize) -> std::ops::Range<usize> {
    let start = (layer * l.num_blocks + block) * block_len(l);
    start..start + block_len(l)
}

/// The cache's values seen as one element type.
#[derive(Clone, Copy)]
struct KvView<'a, E> {
    layout: KvLayout,
    data: &'a [E],
}

impl<'a, E> KvView<'a, E> {
    /// K (`kv = 0`) or V (`kv = 1`) of one head in one block: `[slot][head_dim]`.
    fn head_block(&self, layer: usize, block: usize, kv: usize, head: usize) -> &'a [E] {
        let l = self.layout;
        let start = layer_block_range(&l, layer, block).start
            + (kv * l.num_kv_heads + head) * l.block_size * l.head_dim;
        &self.data[start..start + l.block_size * l.head_dim]
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
    let layout = kv.layout;
    match &kv.data {
        KvData::F32(data) => {
            attention_over(pool, q, KvView { layout, data }, layer, shape, batch, out)
        }
        KvData::F16(data) => {
            attention_over(pool, q, KvView { layout, data }, layer, shape, batch, out)
        }
    }
}

fn attention_over<E: KvElement>(
    pool: &ThreadPool,
    q: &CpuTensor,
    kv: KvView<'_, E>,
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
    let kernel = unit_kernel::<E>(shape.head_dim);
    pool.run(|tid, n| {
        let mut scratch = Scratch::new(group, max_ctx, shape.head_dim);
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
            kernel(&unit_args, &mut scratch, o);
            unit += n;
        }
    });
}

/// One (row, KV head) attention problem.
struct Unit<'a, E> {
    kv: KvView<'a, E>,
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

impl<E> Unit<'_, E> {
    /// `(first position, block id)` of every cache block holding attended positions.
    fn blocks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let bs = self.kv.layout.block_size;
        self.block_table
            .iter()
            .enumerate()
            .map(move |(bi, &block)| (bi * bs, block as usize))
            .take_while(|&(first, _)| first < self.ctx)
    }
}

/// Slots the AVX-512 kernel scores at once: one per lane of a 16-float vector.
const SLOT_CHUNK: usize = 16;

/// A kernel thread's working memory, reused across the units it runs.
struct Scratch {
    /// `[group][ctx]`: the scores, then the normalised softmax weights.
    scores: Vec<f32>,
    /// Up to [`SLOT_CHUNK`] slots of one block's keys or values widened to f32,
    /// `[slot][head_dim]`, zero past the slots in use.
    slots: Vec<f32>,
}

impl Scratch {
    fn new(group: usize, max_ctx: usize, head_dim: usize) -> Self {
        Self {
            scores: vec![0.0; group * max_ctx],
            slots: vec![0.0; SLOT_CHUNK * head_dim],
        }
    }
}

type UnitKernel<E> = fn(&Unit<'_, E>, &mut Scratch, &mut [f32]);

/// The attention kernel for this CPU and head size, chosen per call from features detected once:
/// AVX-512 for head sizes that are a multiple of 16, otherwise the portable code, compiled a
/// second time with AVX2 and FMA enabled so its fixed-width loops become vector instructions.
fn unit_kernel<E: KvElement>(head_dim: usize) -> UnitKernel<E> {
    #[cfg(target_arch = "x86_64")]
    {
        static FEATURES: std::sync::OnceLock<(bool, bool)> = std::sync::OnceLock::new();
        let (avx512, avx2) = *FEATURES.get_or_init(|| {
            (
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c"),
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            )
        });
        if avx512 && head_dim.is_multiple_of(16) {
            return |u, s, o| unsafe { avx512::attend(u, s, o) };
        }
        if avx2 {
            return |u, s, o| unsafe { attend_avx2(u, s, o) };
        }
    }
    let _ = head_dim;
    attend_portable::<E>
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_avx2<E: KvElement>(u: &Unit<'_, E>, scratch: &mut Scratch, out: &mut [f32]) {
    attend(u, scratch, out)
}

fn attend_portable<E: KvElement>(u: &Unit<'_, E>, scratch: &mut Scratch, out: &mut [f32]) {
    attend(u, scratch, out)
}

#[inline(always)]
fn attend<E: KvElement>(u: &Unit<'_, E>, scratch: &mut Scratch, out: &mut [f32]) {
    let (hd, ctx, g) = (u.head_dim, u.ctx, u.group);
    let bs = u.kv.layout.block_size;
    let scale = 1.0 / (hd as f32).sqrt();
    let scores = &mut scratch.scores[..g * ctx];
    // Scores: every key read once for all query heads of the group.
    for (first, block) in u.blocks() {
        let keys = u.kv.head_block(u.layer, block, 0, u.kvh);
        for s in 0..bs.min(ctx - first) {
            let k = &keys[s * hd..(s + 1) * hd];
            for h in 0..g {
                scores[h * ctx + first + s] = dot(&u.q[h * hd..(h + 1) * hd], k) * scale;
            }
        }
    }
    for row in scores.chunks_exact_mut(ctx) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        softmax_from(row, max);
    }
    out.fill(0.0);
    for (first, block) in u.blocks() {
        let values = u.kv.head_block(u.layer, block, 1, u.kvh);
        for s in 0..bs.min(ctx - first) {
            let v = &values[s * hd..(s + 1) * hd];
            for h in 0..g {
                axpy(
                    scores[h * ctx + first + s],
                    v,
                    &mut out[h * hd..(h + 1) * hd],
                );
            }
        }
    }
}

/// Attention with AVX-512 for head sizes that are a multiple of 16. Keys and values are taken
/// [`SLOT_CHUNK`] slots at a time and widened to f32 once for all query heads of the group. A
/// query head's scores for the 16 slots are 16 independent dot products whose lanes are summed
/// by one transposing reduction (45 instructions instead of 16 horizontal sums); its weighted
/// sum of values keeps the output chunk (up to 64 values) in registers over the chunk's slots.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{KvElement, SLOT_CHUNK, Scratch, Unit, softmax_from};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,fma,f16c")]
    pub(super) unsafe fn attend<E: KvElement>(
        u: &Unit<'_, E>,
        scratch: &mut Scratch,
        out: &mut [f32],
    ) {
        let (hd, ctx, g) = (u.head_dim, u.ctx, u.group);
        debug_assert!(hd.is_multiple_of(16));
        let scale = _mm512_set1_ps(1.0 / (hd as f32).sqrt());
        let Scratch { scores, slots } = scratch;
        let scores = &mut scores[..g * ctx];
        let slots = &mut slots[..SLOT_CHUNK * hd];
        for_each_chunk(u, 0, slots, |first, n, keys| {
            let mask = lanes(n);
            for h in 0..g {
                let d = _mm512_mul_ps(dots16(&u.q[h * hd..(h + 1) * hd], keys), scale);
                let row = &mut scores[h * ctx + first..h * ctx + first + n];
                // SAFETY: the mask stores the first `n` lanes, the length of `row`.
                unsafe { _mm512_mask_storeu_ps(row.as_mut_ptr(), mask, d) };
            }
        });
        for row in scores.chunks_exact_mut(ctx) {
            softmax_from(row, row_max(row));
        }
        out.fill(0.0);
        for_each_chunk(u, 1, slots, |first, n, values| {
            for h in 0..g {
                let weights = &scores[h * ctx + first..h * ctx + first + n];
                for d0 in (0..hd).step_by(64) {
                    let o = &mut out[h * hd + d0..(h + 1) * hd];
                    let v = &values[d0..];
                    match (hd - d0) / 16 {
                        1 => weighted_sum::<1>(weights, v, hd, o),
                        2 => weighted_sum::<2>(weights, v, hd, o),
                        3 => weighted_sum::<3>(weights, v, hd, o),
                        _ => weighted_sum::<4>(weights, v, hd, o),
                    }
                }
            }
        });
    }

    /// Calls `f(first position, slots in use, widened slots)` for every chunk of up to
    /// [`SLOT_CHUNK`] attended slots of keys (`kv = 0`) or values (`kv = 1`). Blocks are
    /// scattered, so the hardware prefetcher stops at each one: the next block is fetched while
    /// this one is used, and the keys' pass also fetches each block's values for the next pass.
    #[inline]
    #[target_feature(enable = "avx512f,fma,f16c")]
    fn for_each_chunk<E: KvElement>(
        u: &Unit<'_, E>,
        kv: usize,
        slots: &mut [f32],
        mut f: impl FnMut(usize, usize, &[f32]),
    ) {
        let (hd, bs) = (u.head_dim, u.kv.layout.block_size);
        let fetch = |first: usize, block: usize, kv: usize| {
            let data = u.kv.head_block(u.layer, block, kv, u.kvh);
            for line in (0..bs.min(u.ctx - first) * hd).step_by(64 / size_of::<E>()) {
                _mm_prefetch::<_MM_HINT_T0>(data[line..].as_ptr() as *const i8);
            }
        };
        let mut blocks = u.blocks().peekable();
        while let Some((first, block)) = blocks.next() {
            if let Some(&(next_first, next)) = blocks.peek() {
                fetch(next_first, next, kv);
            }
            if kv == 0 {
                fetch(first, block, 1);
            }
            let data = u.kv.head_block(u.layer, block, kv, u.kvh);
            let in_block = bs.min(u.ctx - first);
            for c in (0..in_block).step_by(SLOT_CHUNK) {
                let n = SLOT_CHUNK.min(in_block - c);
                widen(&data[c * hd..(c + n) * hd], slots);
                f(first + c, n, slots);
            }
        }
    }

    /// `dst[..src.len()]` = `src` as f32, the rest of `dst` zero.
    #[inline]
    #[target_feature(enable = "avx512f,f16c")]
    fn widen<E: KvElement>(src: &[E], dst: &mut [f32]) {
        debug_assert!(src.len().is_multiple_of(16) && src.len() <= dst.len());
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        for i in (0..src.len()).step_by(16) {
            // SAFETY: `i + 16 <= src.len() <= dst.len()`.
            unsafe {
                let v = if E::IS_F16 {
                    _mm512_cvtph_ps(_mm256_loadu_si256(s.add(i) as *const __m256i))
                } else {
                    _mm512_loadu_ps(s.add(i) as *const f32)
                };
                _mm512_storeu_ps(d.add(i), v);
            }
        }
        dst[src.len()..].fill(0.0);
    }

    /// A mask of the first `n <= 16` lanes.
    fn lanes(n: usize) -> __mmask16 {
        ((1u32 << n) - 1) as __mmask16
    }

    /// Lane `s` = `q · keys[s]` for the 16 slots of `keys` (`[16][q.len()]`).
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    fn dots16(q: &[f32], keys: &[f32]) -> __m512 {
        let hd = q.len();
        assert!(hd.is_multiple_of(16) && keys.len() >= SLOT_CHUNK * hd);
        let mut acc = [_mm512_setzero_ps(); SLOT_CHUNK];
        for c in (0..hd).step_by(16) {
            // SAFETY: `c + 16 <= hd`, and slot `s < 16` holds `hd` values.
            unsafe {
                let qv = _mm512_loadu_ps(q.as_ptr().add(c));
                for (s, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(qv, _mm512_loadu_ps(keys.as_ptr().add(s * hd + c)), *a);
                }
            }
        }
        sum_lanes16(acc)
    }

    /// Lane `i` of the result = the sum of the 16 lanes of `a[i]`: four rounds, each adding two
    /// halves of pairs of vectors (8 + 4 + 2 + 1 additions).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn sum_lanes16(a: [__m512; 16]) -> __m512 {
        // The rounds leave lane 4k + p holding input 4p + k, so inputs are taken transposed.
        let x = |i: usize| a[(i % 4) * 4 + i / 4];
        // Round 1: 256-bit halves. b[i] = [x(2i) folded to 8 lanes | x(2i+1) folded].
        let b: [__m512; 8] = std::array::from_fn(|i| {
            let (u, v) = (x(2 * i), x(2 * i + 1));
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x44>(u, v),
                _mm512_shuffle_f32x4::<0xEE>(u, v),
            )
        });
        // Round 2: 128-bit quarters. c[j] quarter k = x(4j + k) folded to 4 lanes.
        let c: [__m512; 4] = std::array::from_fn(|j| {
            let (u, v) = (b[2 * j], b[2 * j + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(u, v),
                _mm512_shuffle_f32x4::<0xDD>(u, v),
            )
        });
        // Round 3: pairs within quarters.
        let d: [__m512; 2] = std::array::from_fn(|m| {
            let (u, v) = (c[2 * m], c[2 * m + 1]);
            _mm512_add_ps(
                _mm512_shuffle_ps::<0x44>(u, v),
                _mm512_shuffle_ps::<0xEE>(u, v),
            )
        });
        // Round 4: single lanes.
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x88>(d[0], d[1]),
            _mm512_shuffle_ps::<0xDD>(d[0], d[1]),
        )
    }

    /// The largest value of `row`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn row_max(row: &[f32]) -> f32 {
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        for c in row.chunks(16) {
            // SAFETY: the mask covers only the chunk's values.
            let v = unsafe { _mm512_mask_loadu_ps(m, lanes(c.len()), c.as_ptr()) };
            m = _mm512_max_ps(m, v);
        }
        _mm512_reduce_max_ps(m)
    }

    /// `o[..W * 16] += sum_s weights[s] * values[s * hd .. s * hd + W * 16]`.
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    fn weighted_sum<const W: usize>(weights: &[f32], values: &[f32], hd: usize, o: &mut [f32]) {
        let n = weights.len();
        assert!(o.len() >= W * 16 && (n == 0 || values.len() >= (n - 1) * hd + W * 16));
        let (v, op) = (values.as_ptr(), o.as_mut_ptr());
        // SAFETY (loads and stores): inside `values` and `o` (asserted above).
        let mut even: [__m512; W] =
            std::array::from_fn(|j| unsafe { _mm512_loadu_ps(op.add(16 * j)) });
        let mut odd = [_mm512_setzero_ps(); W];
        let add = |acc: &mut [__m512; W], s: usize| {
            let w = _mm512_set1_ps(weights[s]);
            for (j, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(w, unsafe { _mm512_loadu_ps(v.add(s * hd + 16 * j)) }, *a);
            }
        };
        let mut s = 0;
        while s + 2 <= n {
            add(&mut even, s);
            add(&mut odd, s + 1);
            s += 2;
        }
        if s < n {
            add(&mut even, s);
        }
        for j in 0..W {
            unsafe { _mm512_storeu_ps(op.add(16 * j), _mm512_add_ps(even[j], odd[j])) };
        }
    }
}

#[inline(always)]
fn dot<E: KvElement>(a: &[f32], b: &[E]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..8 {
            acc[j] += x[j] * y[j].to_f32();
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y.to_f32();
    }
    s
}

#[inline(always)]
fn axpy<E: KvElement>(alpha: f32, x: &[E], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi.to_f32();
    }
}

/// `row` becomes the softmax of `row` (whose largest value is `max`): `exp(x - max)` by a
/// Cody-Waite range reduction and a degree-6 polynomial (relative error below 2e-7), written
/// branch-free so it vectorises, then divided by the sum.
#[inline(always)]
fn softmax_from(row: &mut [f32], max: f32) {
    let mut acc = [0f32; 8];
    let mut chunks = row.chunks_exact_mut(8);
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
    let inv = 1.0 / sum;
    for v in row.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel this CPU can run agrees with a float64 reference (over the values as stored),
    /// for both element types, over head sizes that take each AVX-512 chunk width, GQA groups,
    /// and contexts ending inside and on block boundaries through a scattered block table.
    #[test]
    fn kernels_match_a_float64_reference() {
        let mut rng = duet_model::synthetic::Uniform::new(7);
        for (hd, group, bs) in [
            (16, 1, 16),
            (64, 3, 16),
            (80, 4, 7),
            (128, 2, 16),
            (24, 3, 4),
        ] {
            let layout = |dtype| KvLayout {
                num_layers: 2,
                num_kv_heads: 2,
                head_dim: hd,
                block_size: bs,
                num_blocks: 12,
                dtype,
            };
            let values = rng.values(layout(KvDtype::F32).bytes() / 4);
            let q: Vec<f32> = rng.values(group * hd).iter().map(|x| 2.0 * x).collect();
            let f32_data = values.clone();
            let mut f16_data = vec![f16::ZERO; values.len()];
            f16::store(&mut f16_data, &values);
            check_kernels(layout(KvDtype::F32), &f32_data, &q, group);
            check_kernels(layout(KvDtype::F16), &f16_data, &q, group);
        }
    }

    fn check_kernels<E: KvElement>(layout: KvLayout, data: &[E], q: &[f32], group: usize) {
        let (hd, bs) = (layout.head_dim, layout.block_size);
        let block_table = [5u32, 0, 11, 3, 8, 1, 9];
        for ctx in [1, bs - 1, bs, bs + 1, 3 * bs + 2, 7 * bs] {
            let unit = Unit {
                kv: KvView { layout, data },
                layer: 1,
                kvh: 1,
                block_table: &block_table,
                ctx,
                q,
                group,
                head_dim: hd,
            };
            let want = reference(&unit);
            let mut kernels: Vec<(&str, UnitKernel<E>)> = vec![("portable", attend_portable)];
            if hd.is_multiple_of(16) {
                kernels.push(("selected", unit_kernel(hd)));
            }
            for (name, kernel) in kernels {
                let mut scratch = Scratch::new(group, ctx, hd);
                let mut out = vec![f32::NAN; group * hd];
                kernel(&unit, &mut scratch, &mut out);
                for (i, (&got, &w)) in out.iter().zip(&want).enumerate() {
                    assert!(
                        (got as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()),
                        "{name} {}: head_dim {hd} group {group} ctx {ctx} out[{i}] = {got}, want {w}",
                        layout.dtype
                    );
                }
            }
        }
    }

    fn reference<E: KvElement>(u: &Unit<'_, E>) -> Vec<f64> {
        let (hd, bs) = (u.head_dim, u.kv.layout.block_size);
        let slot = |pos: usize, kv: usize| {
            let block = u.block_table[pos / bs] as usize;
            let s = pos % bs;
            u.kv.head_block(u.layer, block, kv, u.kvh)[s * hd..(s + 1) * hd]
                .iter()
                .map(|x| x.to_f32() as f64)
                .collect::<Vec<f64>>()
        };
        let mut out = vec![0f64; u.group * hd];
        for h in 0..u.group {
            let q = &u.q[h * hd..(h + 1) * hd];
            let logits: Vec<f64> = (0..u.ctx)
                .map(|p| {
                    let d: f64 = q.iter().zip(slot(p, 0)).map(|(&a, b)| a as f64 * b).sum();
                    d / (hd as f64).sqrt()
                })
                .collect();
            let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            for (p, w) in e.iter().enumerate() {
                for (o, v) in out[h * hd..(h + 1) * hd].iter_mut().zip(slot(p, 1)) {
                    *o += w / sum * v;
                }
            }
        }
        out
    }

    /// The branch-free widening agrees with `half` on every f16 bit pattern (NaNs stay NaN).
    #[test]
    fn f16_widening_is_exact() {
        for bits in 0..=u16::MAX {
            let h = f16::from_bits(bits);
            let (got, want) = (KvElement::to_f32(h), h.to_f32());
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{bits:#06x}: {got} != {want}"
            );
        }
    }

    /// A layer block read as bytes and written back is unchanged, in both element types.
    #[test]
    fn layer_blocks_round_trip_through_bytes() {
        for dtype in [KvDtype::F32, KvDtype::F16] {
            let layout = KvLayout {
                num_layers: 2,
                num_kv_heads: 2,
                head_dim: 8,
                block_size: 4,
                num_blocks: 3,
                dtype,
            };
            let mut kv = CpuKvStore::new(layout).unwrap();
            let k: Vec<f32> = (0..16).map(|i| i as f32 * 0.25 - 1.0).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            kv.write(1, &k, &v, &[9]);
            let mut bytes = vec![0u8; kv.layer_block_bytes()];
            assert_eq!(bytes.len(), 2 * 2 * 4 * 8 * dtype.bytes());
            kv.read_layer_block(1, 2, &mut bytes);
            let mut copy = CpuKvStore::new(layout).unwrap();
            copy.write_layer_block(1, 2, &bytes);
            let mut again = vec![0u8; bytes.len()];
            copy.read_layer_block(1, 2, &mut again);
            assert_eq!(bytes, again, "{dtype}");
            // slot 9 = block 2, offset 1; K of head 1 holds k[8..16], exactly representable
            let view = |s: &CpuKvStore| match &s.data {
                KvData::F32(d) => d.iter().map(|x| x.to_f32()).collect::<Vec<f32>>(),
                KvData::F16(d) => d.iter().map(|x| KvElement::to_f32(*x)).collect(),
            };
            let all = view(&copy);
            let head = KvView {
                layout,
                data: &all[..],
            }
            .head_block(1, 2, 0, 1);
            assert_eq!(&head[8..16], &k[8..16], "{dtype}");
        }
    }
}
