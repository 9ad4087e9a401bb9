//! The vector attention kernels: AVX-512 (head sizes a multiple of 16) and AVX2 (multiples of
//! 8), over the cache's layout (per block and head, keys `[head_dim][slot]` and values
//! `[slot][head_dim]`, see `kv_store.rs`).
//!
//! Scores: the slots of a chunk are the vector lanes (16 or 8), so a query head's scores are one
//! multiply-add per dimension — that dimension's run of keys, widened once for every query head
//! of the group, times the query's value broadcast — with no sums across lanes and no copies. A
//! block of two chunks or more takes them in pairs, so each broadcast serves both (on AMD Zen 3,
//! whose broadcasts take a vector pipe as the multiply-adds do, a single stream's attention at
//! context 512 with the cache hot went from 0.59-0.78 to 0.51-0.74 ms a step).
//! Values: each slot's values are widened once and added, weighted by the slot's softmax weight,
//! into the outputs of the group's query heads, held in registers over the block; on AVX2 in
//! two sets of accumulators (even and odd slots), whose twelve chains cover the multiply-add
//! latency where six did not (0.49-0.67 ms at context 512 with the pairs).

use std::arch::x86_64::*;

use super::{KernelScratch, Span, TILE_SLOTS, row_max, slot_scale, softmax_from};
use crate::kv_store::{KvElement, Widening};

/// Query heads whose accumulators a kernel call keeps in registers; larger GQA groups are taken
/// in batches of this many.
const HEADS_AT_ONCE: usize = 4;

/// Calls `$f::<E, G $(, W)?>(args)` for `$g` (1..=4) query heads known only at run time.
macro_rules! dispatch_heads {
    ($f:ident, $e:ty, $g:expr $(, $w:tt)?; $($args:expr),*) => {
        match $g {
            1 => $f::<$e, 1 $(, $w)?>($($args),*),
            2 => $f::<$e, 2 $(, $w)?>($($args),*),
            3 => $f::<$e, 3 $(, $w)?>($($args),*),
            4 => $f::<$e, 4 $(, $w)?>($($args),*),
            _ => unreachable!("more than {HEADS_AT_ONCE} query heads at once"),
        }
    };
}

/// Calls `f(KV head of the span, offset in the span, slots in use, that head's block, its slots'
/// scales)` for every block of the span's keys (`kv = 0`) or values (`kv = 1`), block by block
/// and, within a block,
/// head by head: the span's heads of one block are one contiguous run of the cache, read in
/// order. Blocks are scattered, so the hardware prefetcher stops at each one: the next block is
/// fetched while this one is used, and the keys' pass also fetches each block's values for the
/// next pass, into L2 (`T1`: on AMD Zen 4, 15-25% faster attention than into L1, whose few miss
/// buffers the loads being waited for need). Each head's share is fetched just before that head's
/// work rather than the whole block's at once: a burst of 192 lines (three KV heads) held up the
/// kernel's own loads behind it (per head, 8-13% faster attention on the AVX2 path and 5-22% on
/// AVX-512, on an Intel Xeon model 207).
#[inline(always)]
fn for_each_block<E: KvElement>(
    u: &Span<'_, E>,
    kv: usize,
    mut f: impl FnMut(usize, usize, usize, &[E], &[f32]),
) {
    let bs = u.kv.layout.block_size;
    let fetch = |block: usize, kv: usize, head: usize| {
        let run = u.kv.head_block(u.layer, block, kv, u.kvh + head);
        for line in (0..run.len()).step_by(64 / size_of::<E>()) {
            // SAFETY: SSE is part of x86-64; a prefetch never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(run[line..].as_ptr() as *const i8) };
        }
    };
    let mut blocks = u.blocks().peekable();
    while let Some((first, block)) = blocks.next() {
        let next = blocks.peek().map(|&(_, next)| next);
        let in_block = bs.min(u.end - first);
        for head in 0..u.heads {
            if let Some(next) = next {
                fetch(next, kv, head);
            }
            if kv == 0 {
                fetch(block, 1, head);
            }
            let data = u.kv.head_block(u.layer, block, kv, u.kvh + head);
            let scales = u.kv.head_block_scales(u.layer, block, kv, u.kvh + head);
            f(head, first - u.start, in_block, data, scales);
        }
    }
}

/// Independent accumulators per query head and chunk in a scores kernel of `lanes`-wide vectors:
/// enough chains, over all heads and chunks of a call, to cover the multiply-add latency within
/// the registers (the sums are split by dimension, in a fixed order: a slot's score is the same
/// bits whether its chunk is taken alone or in a pair). AVX2 takes a block's chunks in pairs,
/// so its chains fit `2 * heads` accumulators, a broadcast and two keys in 16 registers.
const fn score_chains(heads: usize, lanes: usize) -> usize {
    match (lanes, heads) {
        (16, 1 | 2) => 4,
        (16, _) => 2,
        (_, 1) => 4,
        (_, 2 | 3) => 2,
        _ => 1,
    }
}

/// The f32 vector of a kernel path, with the few operations the kernels use. Every method is
/// inlined into a caller that enables the path's target features.
trait Vector: Copy {
    const LANES: usize;
    /// Loads of fewer than `LANES` values (AVX-512 masks); without them a short chunk of keys is
    /// widened into a tile first.
    const PARTIAL_LOADS: bool;
    /// Vectors of values a values kernel keeps per query head: one pass over a run of
    /// `LANES * VALUE_VECTORS` dimensions.
    const VALUE_VECTORS: usize;
    /// Sets of accumulators a values kernel keeps, slot `s` going to set `s % VALUE_SETS`:
    /// independent chains enough to cover the multiply-add latency.
    const VALUE_SETS: usize;
    unsafe fn zero() -> Self;
    unsafe fn splat(x: f32) -> Self;
    /// `a * b + c`.
    unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self;
    unsafe fn add(a: Self, b: Self) -> Self;
    unsafe fn mul(a: Self, b: Self) -> Self;
    /// The first `n` values at `p` widened to f32, the other lanes zero (`n == LANES` unless
    /// `PARTIAL_LOADS`).
    unsafe fn load<E: KvElement>(p: *const E, n: usize) -> Self;
    unsafe fn load_f32(p: *const f32) -> Self;
    unsafe fn store_f32(p: *mut f32, v: Self);
    /// Stores the first `n` lanes.
    unsafe fn store_first(p: *mut f32, v: Self, n: usize);
}

/// The `Vector` methods that are one intrinsic each, for vector type `$v` under `$features`.
macro_rules! one_intrinsic_ops {
    ($v:ident, $features:literal, $zero:ident, $splat:ident, $fmadd:ident, $add:ident, $mul:ident,
     $load:ident, $store:ident) => {
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn zero() -> Self {
            $v($zero())
        }
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn splat(x: f32) -> Self {
            $v($splat(x))
        }
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
            $v($fmadd(a.0, b.0, c.0))
        }
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn add(a: Self, b: Self) -> Self {
            $v($add(a.0, b.0))
        }
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn mul(a: Self, b: Self) -> Self {
            $v($mul(a.0, b.0))
        }
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn load_f32(p: *const f32) -> Self {
            // SAFETY: the caller passes `LANES` readable values.
            $v(unsafe { $load(p) })
        }
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn store_f32(p: *mut f32, v: Self) {
            // SAFETY: the caller passes room for `LANES` values.
            unsafe { $store(p, v.0) }
        }
    };
}

#[derive(Clone, Copy)]
struct V512(__m512);

impl Vector for V512 {
    const LANES: usize = 16;
    const PARTIAL_LOADS: bool = true;
    const VALUE_VECTORS: usize = 4;
    const VALUE_SETS: usize = 1;
    one_intrinsic_ops!(
        V512,
        "avx512f,avx512bw,avx512vl,fma,f16c",
        _mm512_setzero_ps,
        _mm512_set1_ps,
        _mm512_fmadd_ps,
        _mm512_add_ps,
        _mm512_mul_ps,
        _mm512_loadu_ps,
        _mm512_storeu_ps
    );
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    unsafe fn load<E: KvElement>(p: *const E, n: usize) -> Self {
        // SAFETY: the caller passes `n` readable values; masked-off lanes are never accessed.
        unsafe {
            let mask = lanes16(n);
            V512(match E::WIDENING {
                Widening::F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p as *const i16)),
                Widening::I8 => _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(
                    mask,
                    p as *const i8,
                ))),
                Widening::None => _mm512_maskz_loadu_ps(mask, p as *const f32),
            })
        }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    unsafe fn store_first(p: *mut f32, v: Self, n: usize) {
        unsafe { _mm512_mask_storeu_ps(p, lanes16(n), v.0) }
    }
}

/// The first `n <= 16` lanes.
#[inline(always)]
fn lanes16(n: usize) -> __mmask16 {
    ((1u32 << n) - 1) as __mmask16
}

#[derive(Clone, Copy)]
struct V256(__m256);

impl Vector for V256 {
    const LANES: usize = 8;
    const PARTIAL_LOADS: bool = false;
    const VALUE_VECTORS: usize = 2;
    const VALUE_SETS: usize = 2;
    one_intrinsic_ops!(
        V256,
        "avx2,fma,f16c",
        _mm256_setzero_ps,
        _mm256_set1_ps,
        _mm256_fmadd_ps,
        _mm256_add_ps,
        _mm256_mul_ps,
        _mm256_loadu_ps,
        _mm256_storeu_ps
    );
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load<E: KvElement>(p: *const E, _n: usize) -> Self {
        // SAFETY: the caller passes 8 readable values.
        unsafe {
            V256(match E::WIDENING {
                Widening::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
                Widening::I8 => {
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)))
                }
                Widening::None => _mm256_loadu_ps(p as *const f32),
            })
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn store_first(p: *mut f32, v: Self, n: usize) {
        if n == Self::LANES {
            // SAFETY: the caller passes room for `n` values.
            return unsafe { Self::store_f32(p, v) };
        }
        let mut lanes = [0f32; 8];
        unsafe {
            _mm256_storeu_ps(lanes.as_mut_ptr(), v.0);
            std::ptr::copy_nonoverlapping(lanes.as_ptr(), p, n);
        }
    }
}

/// `slots` slots of a block's keys from slot 0 of `keys` on: dimension `d` is
/// `keys[d * stride..][..slots]`. When `E` is scaled, dimensions come in groups of `group`, and
/// slot `s`'s scale for group `g` is `scales[g * stride + s]`.
struct KeyChunk<'a, E> {
    keys: &'a [E],
    stride: usize,
    slots: usize,
    group: usize,
    scales: &'a [f32],
}

/// `slots` slots of a block's values from dimension 0 of `values` on: slot `s` is
/// `values[s * head_dim..]`, its scale `scales[s]` when `E` is scaled.
struct ValueChunk<'a, E> {
    values: &'a [E],
    head_dim: usize,
    slots: usize,
    scales: &'a [f32],
}

/// The attention kernel of one vector type: `$attend` with its scores and values kernels, each
/// compiled with `$features` so that the vector's operations inline into them.
macro_rules! vector_attention {
    ($v:ident, $features:literal, $attend:ident, $scores:ident, $values:ident) => {
        /// Attention over one span in chunks of `$v::LANES` slots.
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $attend<E: KvElement>(
            u: &Span<'_, E>,
            work: &mut KernelScratch,
            out: &mut [f32],
            lse: &mut [f32],
        ) {
            let (hd, n, g, bs) = (u.head_dim, u.len(), u.group, u.kv.layout.block_size);
            let (qh, key_group) = (u.q_heads(), u.kv.layout.key_scale_group());
            debug_assert!(hd.is_multiple_of($v::LANES));
            let scale = 1.0 / (hd as f32).sqrt();
            let KernelScratch { scores, tile: buf } = work;
            let scores = &mut scores[..u.rows * qh * n];
            for_each_block(u, 0, |head, at, in_block, keys, key_scales| {
                let mut c = 0;
                while c < in_block {
                    let cnt = $v::LANES.min(in_block - c);
                    // Two whole chunks at once: each query value broadcast serves both.
                    let pair = in_block - c >= 2 * $v::LANES;
                    // Without partial loads, a short chunk is first widened (and scaled) into a
                    // tile of `LANES` slots (zero past its own), so that no load reads past the
                    // block.
                    let tile = (cnt < $v::LANES && !$v::PARTIAL_LOADS).then(|| {
                        let tile = &mut buf[..TILE_SLOTS * hd];
                        tile.fill(0.0);
                        for (d, t) in tile.chunks_exact_mut(TILE_SLOTS).enumerate() {
                            let group_scales = key_scales.get(d / key_group * bs..).unwrap_or_default();
                            for (s, (x, k)) in
                                t.iter_mut().zip(&keys[d * bs + c..][..cnt]).enumerate()
                            {
                                *x = slot_scale::<E>(k.to_f32(), group_scales, c + s);
                            }
                        }
                        &*tile
                    });
                    // Each row's query heads in the same batches as alone: a row's scores are
                    // the same bits in any tile.
                    for r in 0..u.rows {
                        let q_row = u.q_row(r);
                        let row_scores = &mut scores[r * qh * n..];
                        for h0 in (head * g..(head + 1) * g).step_by(HEADS_AT_ONCE) {
                            let heads = HEADS_AT_ONCE.min((head + 1) * g - h0);
                            let q = &q_row[h0 * hd..(h0 + heads) * hd];
                            let rows = &mut row_scores[h0 * n + at + c..];
                            // SAFETY (all): the chunks hold `hd` dimensions of their slots,
                            // readable as `load` reads them (a whole tile, or a masked or whole
                            // run of a block).
                            match tile {
                                Some(t) => {
                                    let chunk = KeyChunk {
                                        keys: t,
                                        stride: TILE_SLOTS,
                                        slots: cnt,
                                        group: hd,
                                        scales: &[],
                                    };
                                    unsafe {
                                        dispatch_heads!($scores, f32, heads, 1; &chunk, q, scale, rows, n)
                                    }
                                }
                                None => {
                                    let chunk = KeyChunk {
                                        keys: &keys[c..],
                                        stride: bs,
                                        slots: if pair { 2 * $v::LANES } else { cnt },
                                        group: key_group,
                                        scales: key_scales.get(c..).unwrap_or_default(),
                                    };
                                    unsafe {
                                        if pair {
                                            dispatch_heads!($scores, E, heads, 2; &chunk, q, scale, rows, n)
                                        } else {
                                            dispatch_heads!($scores, E, heads, 1; &chunk, q, scale, rows, n)
                                        }
                                    }
                                }
                            }
                        }
                    }
                    c += if pair { 2 * $v::LANES } else { $v::LANES };
                }
            });
            for (row, l) in scores.chunks_exact_mut(n).zip(lse.iter_mut()) {
                *l = softmax_from(row, row_max(row));
            }
            out.fill(0.0);
            let pass = $v::LANES * $v::VALUE_VECTORS;
            for_each_block(u, 1, |head, at, in_block, values, value_scales| {
                for r in 0..u.rows {
                    for h0 in (head * g..(head + 1) * g).step_by(HEADS_AT_ONCE) {
                        let heads = HEADS_AT_ONCE.min((head + 1) * g - h0);
                        let weights = &scores[(r * qh + h0) * n + at..];
                        for d0 in (0..hd).step_by(pass) {
                            let chunk = ValueChunk {
                                values: &values[d0..],
                                head_dim: hd,
                                slots: in_block,
                                scales: value_scales,
                            };
                            let o = &mut out[(r * qh + h0) * hd + d0..];
                            // SAFETY (all): `V`'s features are enabled by the caller.
                            unsafe {
                                match ((hd - d0) / $v::LANES).min($v::VALUE_VECTORS) {
                                    1 => {
                                        dispatch_heads!($values, E, heads, 1; &chunk, weights, n, o)
                                    }
                                    2 => {
                                        dispatch_heads!($values, E, heads, 2; &chunk, weights, n, o)
                                    }
                                    3 => {
                                        dispatch_heads!($values, E, heads, 3; &chunk, weights, n, o)
                                    }
                                    _ => {
                                        dispatch_heads!($values, E, heads, 4; &chunk, weights, n, o)
                                    }
                                }
                            }
                        }
                    }
                }
            });
        }

        /// `rows[i * n + s]` = `scale * q_i · key_s` for the chunk's slots `s` (`C` chunks of
        /// `$v::LANES`, the last one possibly partial) and the `G` query heads
        /// `q_i = q[i * head_dim..]`. For a scaled `E`, each key group's part of the dot product
        /// is multiplied by the slot's scale of that group.
        ///
        /// # Safety
        /// the chunk's keys are readable as `$v::load` reads them.
        #[inline]
                #[target_feature(enable = $features)]
                unsafe fn $scores<E: KvElement, const G: usize, const C: usize>(
            chunk: &KeyChunk<'_, E>,
            q: &[f32],
            scale: f32,
            rows: &mut [f32],
            n: usize,
        ) {
            let hd = q.len() / G;
            let (stride, cnt) = (chunk.stride, chunk.slots);
            // Slots of chunk `c`.
            let slots = |c: usize| $v::LANES.min(cnt - c * $v::LANES);
            let loaded = if $v::PARTIAL_LOADS { slots(C - 1) } else { $v::LANES };
            assert!(cnt > (C - 1) * $v::LANES && cnt <= C * $v::LANES);
            assert!(chunk.keys.len() >= (hd - 1) * stride + (C - 1) * $v::LANES + loaded);
            assert!(rows.len() >= (G - 1) * n + cnt);
            let group = if E::SCALED { chunk.group } else { hd };
            assert!(hd.is_multiple_of(group) && group.is_multiple_of(4));
            let last_group = (hd / group - 1) * stride;
            assert!(!E::SCALED || chunk.scales.len() >= last_group + (C - 1) * $v::LANES + loaded);
            let chains = score_chains(G, $v::LANES);
            let (kp, qp) = (chunk.keys.as_ptr(), q.as_ptr());
            // SAFETY (all): loads within the chunk (asserted above), `q` holds `G * hd` values,
            // row `i` holds `cnt` values at `i * n`.
            unsafe {
                // The dot products of a group, then added up weighted by the group's scales (one
                // group, unweighted, for the float types).
                let mut dots = [[$v::zero(); C]; G];
                for g0 in (0..hd).step_by(group) {
                    let mut acc = [[[$v::zero(); 8]; C]; G];
                    for d in (g0..g0 + group).step_by(chains) {
                        for j in 0..chains {
                            let k: [$v; C] = std::array::from_fn(|c| {
                                $v::load(kp.add((d + j) * stride + c * $v::LANES), slots(c))
                            });
                            for (i, a) in acc.iter_mut().enumerate() {
                                let qd = $v::splat(*qp.add(i * hd + d + j));
                                for (ac, &kc) in a.iter_mut().zip(&k) {
                                    ac[j] = $v::fmadd(qd, kc, ac[j]);
                                }
                            }
                        }
                    }
                    let at = g0 / group * stride;
                    for (i, a) in acc.iter().enumerate() {
                        for (c, ac) in a.iter().enumerate() {
                            let s = ac[1..chains].iter().fold(ac[0], |s, &x| $v::add(s, x));
                            dots[i][c] = if E::SCALED {
                                let own = chunk.scales.as_ptr().add(at + c * $v::LANES);
                                $v::fmadd(s, $v::load(own, slots(c)), dots[i][c])
                            } else {
                                s
                            };
                        }
                    }
                }
                for (i, d) in dots.iter().enumerate() {
                    for (c, &s) in d.iter().enumerate() {
                        let p = rows.as_mut_ptr().add(i * n + c * $v::LANES);
                        $v::store_first(p, $v::mul(s, $v::splat(scale)), slots(c));
                    }
                }
            }
        }

        /// `out[i * head_dim..][..W * LANES] += sum_s weights[i * n + s] * value_s[..W * LANES]`
        /// for the chunk's slots and the `G` query heads.
        ///
        #[inline]
                #[target_feature(enable = $features)]
                unsafe fn $values<E: KvElement, const G: usize, const W: usize>(
            chunk: &ValueChunk<'_, E>,
            weights: &[f32],
            n: usize,
            out: &mut [f32],
        ) {
            let (hd, cnt, width) = (chunk.head_dim, chunk.slots, W * $v::LANES);
            assert!(cnt == 0 || chunk.values.len() >= (cnt - 1) * hd + width);
            assert!(cnt == 0 || weights.len() >= (G - 1) * n + cnt);
            assert!(out.len() >= (G - 1) * hd + width);
            assert!(!E::SCALED || chunk.scales.len() >= cnt);
            let (vp, wp, op) = (chunk.values.as_ptr(), weights.as_ptr(), out.as_mut_ptr());
            let sp = chunk.scales.as_ptr();
            let at = |i: usize, j: usize| i * hd + j * $v::LANES;
            // SAFETY (all): loads and stores inside `values`, `weights` and `out` (asserted above).
            unsafe {
                const SETS: usize = $v::VALUE_SETS;
                // Set 0 continues `out`; the others start at zero and are added in at the end.
                let mut acc: [[[$v; W]; G]; SETS] = std::array::from_fn(|k| {
                    std::array::from_fn(|i| {
                        std::array::from_fn(|j| {
                            if k == 0 { $v::load_f32(op.add(at(i, j))) } else { $v::zero() }
                        })
                    })
                });
                let add_slot = |acc: &mut [[$v; W]; G], s: usize| {
                    let slot = vp.add(s * hd);
                    let v: [$v; W] =
                        std::array::from_fn(|j| $v::load(slot.add(j * $v::LANES), $v::LANES));
                    for (i, a) in acc.iter_mut().enumerate() {
                        let w = *wp.add(i * n + s);
                        let w = $v::splat(if E::SCALED { w * *sp.add(s) } else { w });
                        for (aj, &vj) in a.iter_mut().zip(&v) {
                            *aj = $v::fmadd(w, vj, *aj);
                        }
                    }
                };
                let whole = cnt / SETS * SETS;
                for s in (0..whole).step_by(SETS) {
                    for (k, a) in acc.iter_mut().enumerate() {
                        add_slot(a, s + k);
                    }
                }
                for s in whole..cnt {
                    add_slot(&mut acc[0], s);
                }
                for i in 0..G {
                    for j in 0..W {
                        let sum = (1..SETS).fold(acc[0][i][j], |x, k| $v::add(x, acc[k][i][j]));
                        $v::store_f32(op.add(at(i, j)), sum);
                    }
                }
            }
        }
    };
}

vector_attention!(
    V512,
    "avx512f,avx512bw,avx512vl,fma,f16c",
    attend_avx512,
    key_scores_avx512,
    weighted_values_avx512
);
vector_attention!(
    V256,
    "avx2,fma,f16c",
    attend_avx2,
    key_scores_avx2,
    weighted_values_avx2
);
