//! The vector attention kernels: AVX-512 (head sizes a multiple of 16) and AVX2 (multiples of
//! 8). Both take a span's keys and values a chunk of slots at a time, widened to f32 once for all
//! query heads of the group (f16 with `vcvtph2ps`). A query head's scores for the chunk are
//! independent dot products, one per slot, whose lanes are summed by one transposing reduction
//! instead of a horizontal sum each; its weighted sum of values keeps a run of output values in
//! registers over the chunk's slots.

use std::arch::x86_64::*;

use super::{KernelScratch, SLOT_CHUNK, Span, row_max, softmax_from};
use crate::kv_store::KvElement;

/// Calls `f(offset in the span, slots in use, widened slots)` for every chunk of up to `CHUNK`
/// attended slots of keys (`kv = 0`) or values (`kv = 1`), widened by `widen`. Blocks are
/// scattered, so the hardware prefetcher stops at each one: the next block is fetched while this
/// one is used, and the keys' pass also fetches each block's values for the next pass.
#[inline(always)]
fn for_each_chunk<E: KvElement, const CHUNK: usize>(
    u: &Span<'_, E>,
    kv: usize,
    slots: &mut [f32],
    widen: impl Fn(&[E], &mut [f32]),
    mut f: impl FnMut(usize, usize, &[f32]),
) {
    let (hd, bs) = (u.head_dim, u.kv.layout.block_size);
    let slots = &mut slots[..CHUNK * hd];
    let fetch = |first: usize, block: usize, kv: usize| {
        let data = u.kv.head_block(u.layer, block, kv, u.kvh);
        for line in (0..bs.min(u.end - first) * hd).step_by(64 / size_of::<E>()) {
            // SAFETY: SSE is part of x86-64; a prefetch never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(data[line..].as_ptr() as *const i8) };
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
        let in_block = bs.min(u.end - first);
        for c in (0..in_block).step_by(CHUNK) {
            let n = CHUNK.min(in_block - c);
            widen(&data[c * hd..(c + n) * hd], slots);
            f(first - u.start + c, n, slots);
        }
    }
}

/// Attention with AVX-512 over 16-slot chunks.
#[target_feature(enable = "avx512f,fma,f16c")]
pub(super) unsafe fn attend_avx512<E: KvElement>(
    u: &Span<'_, E>,
    work: &mut KernelScratch,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let (hd, n, g) = (u.head_dim, u.len(), u.group);
    debug_assert!(hd.is_multiple_of(16));
    let scale = _mm512_set1_ps(1.0 / (hd as f32).sqrt());
    let KernelScratch { scores, slots } = work;
    let scores = &mut scores[..g * n];
    for_each_chunk::<E, 16>(
        u,
        0,
        slots,
        |s, d| widen16(s, d),
        |at, cnt, keys| {
            let mask = lanes16(cnt);
            for h in 0..g {
                let d = _mm512_mul_ps(dots16(&u.q[h * hd..(h + 1) * hd], keys), scale);
                let row = &mut scores[h * n + at..h * n + at + cnt];
                // SAFETY: the mask stores the first `cnt` lanes, the length of `row`.
                unsafe { _mm512_mask_storeu_ps(row.as_mut_ptr(), mask, d) };
            }
        },
    );
    for (row, l) in scores.chunks_exact_mut(n).zip(lse.iter_mut()) {
        *l = softmax_from(row, row_max(row));
    }
    out.fill(0.0);
    for_each_chunk::<E, 16>(
        u,
        1,
        slots,
        |s, d| widen16(s, d),
        |at, cnt, values| {
            for h in 0..g {
                let weights = &scores[h * n + at..h * n + at + cnt];
                for d0 in (0..hd).step_by(64) {
                    let o = &mut out[h * hd + d0..(h + 1) * hd];
                    let v = &values[d0..];
                    match (hd - d0) / 16 {
                        1 => weighted_sum16::<1>(weights, v, hd, o),
                        2 => weighted_sum16::<2>(weights, v, hd, o),
                        3 => weighted_sum16::<3>(weights, v, hd, o),
                        _ => weighted_sum16::<4>(weights, v, hd, o),
                    }
                }
            }
        },
    );
}

/// `dst[..src.len()]` = `src` as f32, the rest of `dst` zero.
#[inline]
#[target_feature(enable = "avx512f,f16c")]
fn widen16<E: KvElement>(src: &[E], dst: &mut [f32]) {
    assert!(src.len().is_multiple_of(16) && src.len() <= dst.len());
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
fn lanes16(n: usize) -> __mmask16 {
    ((1u32 << n) - 1) as __mmask16
}

/// Lane `s` = `q · keys[s]` for the 16 slots of `keys` (`[16][q.len()]`).
#[inline]
#[target_feature(enable = "avx512f,fma")]
fn dots16(q: &[f32], keys: &[f32]) -> __m512 {
    let hd = q.len();
    assert!(hd.is_multiple_of(16) && keys.len() >= SLOT_CHUNK * hd);
    let mut acc = [_mm512_setzero_ps(); 16];
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
/// halves of pairs of vectors (8 + 4 + 2 + 1 additions, 45 instructions instead of 16
/// horizontal sums).
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

/// `o[..W * 16] += sum_s weights[s] * values[s * hd .. s * hd + W * 16]`.
#[inline]
#[target_feature(enable = "avx512f,fma")]
fn weighted_sum16<const W: usize>(weights: &[f32], values: &[f32], hd: usize, o: &mut [f32]) {
    let n = weights.len();
    assert!(o.len() >= W * 16 && (n == 0 || values.len() >= (n - 1) * hd + W * 16));
    let (v, op) = (values.as_ptr(), o.as_mut_ptr());
    // SAFETY (loads and stores): inside `values` and `o` (asserted above).
    let mut even: [__m512; W] = std::array::from_fn(|j| unsafe { _mm512_loadu_ps(op.add(16 * j)) });
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

/// Attention with AVX2 over 8-slot chunks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn attend_avx2<E: KvElement>(
    u: &Span<'_, E>,
    work: &mut KernelScratch,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let (hd, n, g) = (u.head_dim, u.len(), u.group);
    debug_assert!(hd.is_multiple_of(8));
    let scale = _mm256_set1_ps(1.0 / (hd as f32).sqrt());
    let KernelScratch { scores, slots } = work;
    let scores = &mut scores[..g * n];
    for_each_chunk::<E, 8>(
        u,
        0,
        slots,
        |s, d| widen8(s, d),
        |at, cnt, keys| {
            for h in 0..g {
                let d = _mm256_mul_ps(dots8(&u.q[h * hd..(h + 1) * hd], keys), scale);
                let row = &mut scores[h * n + at..h * n + at + cnt];
                if cnt == 8 {
                    // SAFETY: `row` holds 8 values.
                    unsafe { _mm256_storeu_ps(row.as_mut_ptr(), d) };
                } else {
                    let mut all = [0f32; 8];
                    // SAFETY: `all` holds 8 values.
                    unsafe { _mm256_storeu_ps(all.as_mut_ptr(), d) };
                    row.copy_from_slice(&all[..cnt]);
                }
            }
        },
    );
    for (row, l) in scores.chunks_exact_mut(n).zip(lse.iter_mut()) {
        *l = softmax_from(row, row_max(row));
    }
    out.fill(0.0);
    for_each_chunk::<E, 8>(
        u,
        1,
        slots,
        |s, d| widen8(s, d),
        |at, cnt, values| {
            for h in 0..g {
                let weights = &scores[h * n + at..h * n + at + cnt];
                for d0 in (0..hd).step_by(64) {
                    let o = &mut out[h * hd + d0..(h + 1) * hd];
                    let v = &values[d0..];
                    match (hd - d0) / 8 {
                        1 => weighted_sum8::<1>(weights, v, hd, o),
                        2 => weighted_sum8::<2>(weights, v, hd, o),
                        3 => weighted_sum8::<3>(weights, v, hd, o),
                        4 => weighted_sum8::<4>(weights, v, hd, o),
                        5 => weighted_sum8::<5>(weights, v, hd, o),
                        6 => weighted_sum8::<6>(weights, v, hd, o),
                        7 => weighted_sum8::<7>(weights, v, hd, o),
                        _ => weighted_sum8::<8>(weights, v, hd, o),
                    }
                }
            }
        },
    );
}

/// `dst[..src.len()]` = `src` as f32, the rest of `dst` zero.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn widen8<E: KvElement>(src: &[E], dst: &mut [f32]) {
    assert!(src.len().is_multiple_of(8) && src.len() <= dst.len());
    let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
    for i in (0..src.len()).step_by(8) {
        // SAFETY: `i + 8 <= src.len() <= dst.len()`.
        unsafe {
            let v = if E::IS_F16 {
                _mm256_cvtph_ps(_mm_loadu_si128(s.add(i) as *const __m128i))
            } else {
                _mm256_loadu_ps(s.add(i) as *const f32)
            };
            _mm256_storeu_ps(d.add(i), v);
        }
    }
    dst[src.len()..].fill(0.0);
}

/// Lane `s` = `q · keys[s]` for the 8 slots of `keys` (`[8][q.len()]`): eight independent FMA
/// chains, enough to cover the FMA latency at two per cycle.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn dots8(q: &[f32], keys: &[f32]) -> __m256 {
    let hd = q.len();
    assert!(hd.is_multiple_of(8) && keys.len() >= 8 * hd);
    let mut acc = [_mm256_setzero_ps(); 8];
    for c in (0..hd).step_by(8) {
        // SAFETY: `c + 8 <= hd`, and slot `s < 8` holds `hd` values.
        unsafe {
            let qv = _mm256_loadu_ps(q.as_ptr().add(c));
            for (s, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys.as_ptr().add(s * hd + c)), *a);
            }
        }
    }
    sum_lanes8(acc)
}

/// Lane `i` of the result = the sum of the 8 lanes of `a[i]`: two rounds of pairwise horizontal
/// adds leave each input folded to 4 lanes per 128-bit half; adding the halves finishes.
#[inline]
#[target_feature(enable = "avx2")]
fn sum_lanes8(a: [__m256; 8]) -> __m256 {
    let t: [__m256; 4] = std::array::from_fn(|i| _mm256_hadd_ps(a[2 * i], a[2 * i + 1]));
    // u[0] = [a0..a3 summed over lanes 0-3 | the same over lanes 4-7]; u[1] likewise for a4..a7.
    let u = [_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3])];
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(u[0], u[1]),
        _mm256_permute2f128_ps::<0x31>(u[0], u[1]),
    )
}

/// `o[..W * 8] += sum_s weights[s] * values[s * hd .. s * hd + W * 8]`: `W` accumulators, enough
/// independent chains at `W = 8` (a head size of 64 in one pass).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn weighted_sum8<const W: usize>(weights: &[f32], values: &[f32], hd: usize, o: &mut [f32]) {
    let n = weights.len();
    assert!(o.len() >= W * 8 && (n == 0 || values.len() >= (n - 1) * hd + W * 8));
    let (v, op) = (values.as_ptr(), o.as_mut_ptr());
    // SAFETY (loads and stores): inside `values` and `o` (asserted above).
    let mut acc: [__m256; W] = std::array::from_fn(|j| unsafe { _mm256_loadu_ps(op.add(8 * j)) });
    for (s, &w) in weights.iter().enumerate() {
        let w = _mm256_set1_ps(w);
        for (j, a) in acc.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(w, unsafe { _mm256_loadu_ps(v.add(s * hd + 8 * j)) }, *a);
        }
    }
    for (j, a) in acc.iter().enumerate() {
        unsafe { _mm256_storeu_ps(op.add(8 * j), *a) };
    }
}
