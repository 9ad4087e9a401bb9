//! AVX-512 (VNNI) and AVX2 kernels over the packed group layout (see `packed.rs`), and f32 dots.
//!
//! The block kernels widen the weight quants of a 64-byte chunk (16 rows x 4 bytes) to two
//! registers of i16 pairs — bytes (0, 2) and (1, 3) of every row word, by a shift and a mask — and
//! multiply them with broadcast i16 activation pairs (stored in the matching order, see
//! `packed::PAIR_POS`): `vpdpwssd` on AVX-512 VNNI, `vpmaddwd` + `vpaddd` on AVX2, and the VEX
//! `vpdpwssd` of AVX-VNNI on AVX2 machines that have it. The AVX-512 kernels read their token
//! tile's activations interleaved by token ([`interleave_tiles`]), the others token by token.
//! Calls of many tokens on the 256-bit paths run weight-stationary units instead
//! ([`unit_avx2`], [`unit_avx2_vnni`]): each block of two row groups widened once, then every
//! token's dots with it. One token on the VNNI paths takes the split-byte kernels
//! ([`bytes_avx512`], [`bytes_avx2_vnni`]): `vpdpbusd` on the activations' high and low bytes.

// Kernels index several parallel arrays with one counter.
#![allow(clippy::needless_range_loop)]

use super::QuantType;
use super::packed::{ActBlocks, Q4K_D, Q4K_DMIN, Q4K_MN, Q4K_SC, Q6K_D, Q6K_QH, Q6K_SC, Tile};
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// Token tile of the AVX-512 kernels: every unpacked weight register feeds 16 tokens' dots, so
/// unpacking costs less per dot and 16 independent accumulator chains hide the `vpdpwssd`
/// latency. The f32 accumulators then live on the stack, read and written once per block by the
/// load and store ports. 16 rather than 8 measured 6-13% faster per matrix at 32 tokens on an
/// Intel Xeon (family 6 model 207), for every block type.
pub(crate) const NT_512: usize = 16;
/// Token tile of the AVX2 kernels (16 ymm registers: accumulators and weights of 8 tokens).
pub(crate) const NT_256: usize = 8;

/// Calls `$f::<nt, $generics...>($args...)` for a token count known only at run time:
/// `dispatch_nt!(@512 f, nt, (args), generics...)` for 1..=[`NT_512`] tokens, `@256` for
/// 1..=[`NT_256`].
macro_rules! dispatch_nt {
    (@512 $f:ident, $nt:expr, $args:tt $(, $g:tt)*) => {
        dispatch_nt!(@match [1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16] $f, $nt, $args, [$($g)*])
    };
    (@256 $f:ident, $nt:expr, $args:tt $(, $g:tt)*) => {
        dispatch_nt!(@match [1 2 3 4 5 6 7 8] $f, $nt, $args, [$($g)*])
    };
    (@match [$($n:literal)*] $f:ident, $nt:expr, $args:tt, $gs:tt) => {
        match $nt {
            $($n => dispatch_nt!(@call $f, $n, $gs, $args),)*
            _ => unreachable!("token tile too large"),
        }
    };
    (@call $f:ident, $n:literal, [$($g:tt)*], ($($args:expr),*)) => {
        $f::<$n $(, $g)*>($($args),*)
    };
}

/// The i16 pair (32-bit word) `m` of the activations at `x`, broadcast.
#[inline(always)]
unsafe fn bcast(x: *const i16, m: usize) -> i32 {
    unsafe { (x as *const i32).add(m).read_unaligned() }
}

/// Independent i32 accumulators per token: enough chains to hide the `vpdpwssd` latency when
/// few tokens share the weights (integer sums are exact, so the split does not change results).
const fn n_chains(nt: usize) -> usize {
    if nt == 1 {
        4
    } else if nt <= 9 {
        2
    } else {
        1
    }
}

/// Adds the products of 16 i16 weight pairs (`$w[m]`: 16 rows, pair `m` of a 32-value block)
/// with the matching activation pairs of each of `$nt` tokens into `$s[ti]`: the pairs
/// `$p0 + m` of the tile's activations `$xq`, laid out by [`interleave_tiles`].
///
/// Pair by pair, every token in turn, so a chain's next `vpdpwssd` comes `$nt` instructions
/// later. Token by token (eight into one accumulator in a row) left it to the out-of-order
/// window to find independent work, which it did not whenever the host kept the core's sibling
/// thread busy: a loop of nothing but these instructions then fell to ~3.4 G a second from
/// ~5.5 on an Intel Xeon (family 6 model 207), where pair by pair held 4.5-5.3. With the
/// activations interleaved, each instruction reads its pair at a constant offset from one
/// register, fused with the broadcast (a separate broadcast load fell like token by token).
/// Written as the instruction because LLVM's generic x86 tuning splits the intrinsic into
/// `vpmaddwd` + `vpaddd`; a macro, to expand inside the kernels' `target_feature` context.
macro_rules! dp_tokens {
    ($nt:ident, $s:expr, $w:expr, $xq:expr, $p0:expr) => {{
        let x = ($xq as *const i32).add(($p0) * $nt);
        dp_tokens!(@pairs $nt, $s, $w, x, [0 1 2 3 4 5 6 7]);
    }};
    (@pairs $nt:ident, $s:expr, $w:expr, $x:ident, [$($m:literal)*]) => {
        $(dp_tokens!(@tokens $nt, $s, $w, $x, $m, [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15]);)*
    };
    (@tokens $nt:ident, $s:expr, $w:expr, $x:ident, $m:literal, [$($ti:literal)*]) => {
        $(
            if $ti < $nt {
                let c = $m % n_chains($nt);
                // SAFETY: the kernel enables AVX-512 VNNI, and its tile's activations hold pairs
                // $p0..$p0 + 8 of each of its $nt tokens.
                std::arch::asm!(
                    "vpdpwssd {a}, {w}, dword ptr [{x} + {o}]{{1to16}}",
                    a = inout(zmm_reg) $s[$ti][c],
                    w = in(zmm_reg) $w[$m],
                    x = in(reg) $x,
                    o = const ($m * $nt + $ti) * 4,
                    options(pure, readonly, nostack, preserves_flags),
                )
            }
        )*
    };
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn sum_chains<const NT: usize>(s: &[[__m512i; 4]; NT], ti: usize) -> __m512i {
    let na = n_chains(NT);
    let mut v = s[ti][0];
    for a in 1..na {
        v = _mm512_add_epi32(v, s[ti][a]);
    }
    v
}

/// Widens 4-bit quants (the low nibbles of a 64-byte chunk, 16 rows x 4 bytes) to i16 pairs:
/// `(even, odd)` = bytes (0, 2) and (1, 3) of every row word.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn nibble_pairs(v: __m512i) -> (__m512i, __m512i) {
    let m4 = _mm512_set1_epi32(0x000F_000F);
    (
        _mm512_and_si512(v, m4),
        _mm512_and_si512(_mm512_srli_epi32::<8>(v), m4),
    )
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn store_rows<const NT: usize>(t: &Tile, acc: &[__m512; NT]) {
    unsafe {
        let mask: __mmask16 = if t.nvalid >= 16 {
            0xFFFF
        } else {
            (1u16 << t.nvalid) - 1
        };
        for (ti, a) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(t.out.add(ti * t.os), mask, *a);
        }
    }
}

/// Prefetches the group-block [`PREFETCH_BYTES`] past `b` (`gb` bytes long). A group's weights
/// stream from memory on its first token tile, and the hardware prefetcher alone leaves the
/// kernel waiting on them (batch-32 decode ~9% faster with this on AVX-512; on the AVX2 path
/// batch-32 decode +5% and single-stream decode +20-30%).
#[inline(always)]
unsafe fn prefetch_ahead(b: *const u8, gb: usize) {
    unsafe {
        let p = b.wrapping_add(PREFETCH_BYTES);
        let mut o = 0;
        while o < gb {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(o) as *const i8);
            o += 64;
        }
    }
}

/// How far ahead of the block being multiplied the weights are prefetched.
const PREFETCH_BYTES: usize = 4096;

/// Copies the quantized activations of `tokens` (`qs`: their rows of `cols` values, token-major)
/// into `tiled`, the layout of the AVX-512 kernels for a matrix product of `n_tokens` tokens:
/// tiles of [`NT_512`] tokens (the last one shorter), and within a tile of `nt` tokens every
/// i16 pair in turn, for each token of the tile: pair `p` of the tile's token `ti` is the i32
/// at `p * nt + ti` from the tile's start, `t0 * cols / 2` for a tile starting at token `t0`.
/// (A single token's row is its own tile.)
///
/// # Safety
/// `tiled` holds `n_tokens * cols / 2` values, `tokens` lies within `0..n_tokens`, and no one
/// else writes the values of these tokens meanwhile.
pub(crate) unsafe fn interleave_tiles(
    qs: &[i16],
    cols: usize,
    n_tokens: usize,
    tokens: std::ops::Range<usize>,
    tiled: *mut i32,
) {
    let npairs = cols / 2;
    for (t, row) in tokens.zip(qs.chunks_exact(cols)) {
        let t0 = t / NT_512 * NT_512;
        let nt = NT_512.min(n_tokens - t0);
        // SAFETY: pair p of token t lands at t0 * npairs + p * nt + (t - t0) < (t0 + nt) * npairs.
        unsafe {
            let dst = tiled.add(t0 * npairs + (t - t0));
            let src = row.as_ptr() as *const i32;
            for p in 0..npairs {
                *dst.add(p * nt) = src.add(p).read_unaligned();
            }
        }
    }
}

/// `nt <= NT_512` tokens of one group; `t.xq` holds the tile's activations as
/// [`interleave_tiles`] lays them out.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
pub(crate) unsafe fn tile_avx512(ty: QuantType, t: &Tile, nt: usize) {
    unsafe {
        match ty {
            QuantType::Q4_0 => dispatch_nt!(@512 q4_avx512_false, nt, (t)),
            QuantType::Q4_1 => dispatch_nt!(@512 q4_avx512_true, nt, (t)),
            QuantType::Q8_0 => dispatch_nt!(@512 q8_avx512, nt, (t)),
            QuantType::Q4_K => dispatch_nt!(@512 q4k_avx512, nt, (t)),
            QuantType::Q6_K => dispatch_nt!(@512 q6k_avx512, nt, (t)),
            _ => unreachable!(),
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn q4_avx512_false<const NT: usize>(t: &Tile) {
    unsafe { q4_avx512::<NT, false>(t) }
}
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn q4_avx512_true<const NT: usize>(t: &Tile) {
    unsafe { q4_avx512::<NT, true>(t) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn q4_avx512<const NT: usize, const Q41: bool>(t: &Tile) {
    unsafe {
        let mut acc = [_mm512_setzero_ps(); NT];
        for k in 0..t.nb {
            let b = t.w.add(k * t.gb);
            prefetch_ahead(b, t.gb);
            let mut s = [[_mm512_setzero_si512(); 4]; NT];
            // Low nibbles (values 0..16 of the block), then high nibbles (16..32).
            for h in 0..2 {
                let mut w = [_mm512_setzero_si512(); 8];
                for c in 0..4 {
                    let mut v = _mm512_loadu_si512(b.add(64 * c) as *const _);
                    if h == 1 {
                        v = _mm512_srli_epi32::<4>(v);
                    }
                    (w[2 * c], w[2 * c + 1]) = nibble_pairs(v);
                    if !Q41 {
                        // Q4_0 quants are offset by 8: signed weights need no per-token correction
                        // (which, at 16 tokens, spilled and made Q4_0 20% slower than at 8).
                        let eight = _mm512_set1_epi16(8);
                        w[2 * c] = _mm512_sub_epi16(w[2 * c], eight);
                        w[2 * c + 1] = _mm512_sub_epi16(w[2 * c + 1], eight);
                    }
                }
                dp_tokens!(NT, s, w, t.xq, 16 * k + 8 * h);
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(b.add(256) as *const __m256i));
            for ti in 0..NT {
                acc[ti] = q4_scale_512::<Q41>(t, k, b, ti, dw, sum_chains(&s, ti), acc[ti]);
            }
        }
        store_rows(t, &acc);
    }
}

/// `acc` plus token `ti`'s integer sums `s` of block `k` (group-block at `b`, weight scales
/// `dw`) scaled, and for Q4_1 the block minimum's share; Q4_0's offset is in `s`.
#[inline(always)]
unsafe fn q4_scale_512<const Q41: bool>(
    t: &Tile,
    k: usize,
    b: *const u8,
    ti: usize,
    dw: __m512,
    s: __m512i,
    acc: __m512,
) -> __m512 {
    unsafe {
        let ai = ti * t.anb + k;
        let dx = _mm512_set1_ps(*t.xd.add(ai));
        let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dx), acc);
        if Q41 {
            let mw = _mm512_cvtph_ps(_mm256_loadu_si256(b.add(288) as *const __m256i));
            _mm512_fmadd_ps(mw, _mm512_set1_ps(*t.xsd.add(ai)), acc)
        } else {
            acc
        }
    }
}

/// `acc` plus token `ti`'s integer sums `s` of Q8_0 block `k` (weight scales `dw`) scaled.
#[inline(always)]
unsafe fn q8_scale_512(
    t: &Tile,
    k: usize,
    ti: usize,
    dw: __m512,
    s: __m512i,
    acc: __m512,
) -> __m512 {
    unsafe {
        let dx = _mm512_set1_ps(*t.xd.add(ti * t.anb + k));
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dx), acc)
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn q4k_avx512<const NT: usize>(t: &Tile) {
    unsafe {
        let mut acc = [_mm512_setzero_ps(); NT];
        for k in 0..t.nb {
            let b = t.w.add(k * t.gb);
            prefetch_ahead(b, t.gb);
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(b.add(Q4K_D) as *const __m256i));
            let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(b.add(Q4K_DMIN) as *const __m256i));
            // Sub-block j: nibble h of chunks 8 jj .. 8 jj + 8 (j = 2 jj + h).
            for j in 0..8 {
                let (jj, h) = (j / 2, j % 2);
                let mut s = [[_mm512_setzero_si512(); 4]; NT];
                for half in 0..2 {
                    let mut w = [_mm512_setzero_si512(); 8];
                    for c in 0..4 {
                        let mut v =
                            _mm512_loadu_si512(b.add(64 * (8 * jj + 4 * half + c)) as *const _);
                        if h == 1 {
                            v = _mm512_srli_epi32::<4>(v);
                        }
                        (w[2 * c], w[2 * c + 1]) = nibble_pairs(v);
                    }
                    dp_tokens!(NT, s, w, t.xq, 128 * k + 16 * j + 8 * half);
                }
                let sc =
                    _mm512_cvtepu8_epi32(_mm_loadu_si128(b.add(Q4K_SC + 16 * j) as *const __m128i));
                let mn =
                    _mm512_cvtepu8_epi32(_mm_loadu_si128(b.add(Q4K_MN + 16 * j) as *const __m128i));
                let dsc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
                let dm = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn));
                for ti in 0..NT {
                    let ai = ti * t.anb + 8 * k + j;
                    let dx = _mm512_set1_ps(*t.xd.add(ai));
                    acc[ti] = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(sum_chains(&s, ti)),
                        _mm512_mul_ps(dsc, dx),
                        acc[ti],
                    );
                    acc[ti] = _mm512_fnmadd_ps(dm, _mm512_set1_ps(*t.xsd.add(ai)), acc[ti]);
                }
            }
        }
        store_rows(t, &acc);
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn q6k_avx512<const NT: usize>(t: &Tile) {
    unsafe {
        let m4 = _mm512_set1_epi32(0x000F_000F);
        let m30 = _mm512_set1_epi32(0x0030_0030);
        let mut acc = [_mm512_setzero_ps(); NT];
        for k in 0..t.nb {
            let b = t.w.add(k * t.gb);
            prefetch_ahead(b, t.gb);
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(b.add(Q6K_D) as *const __m256i));
            for n in 0..2 {
                for quarter in 0..4 {
                    let lw = 16 * n + 8 * (quarter % 2);
                    // s[..][half]: values 0..16 (scale sb) and 16..32 (scale sb + 1).
                    let mut s_half = [[[_mm512_setzero_si512(); 4]; NT]; 2];
                    for half in 0..2 {
                        let mut w = [_mm512_setzero_si512(); 8];
                        for c in 0..4 {
                            let cc = 4 * half + c;
                            let ql = _mm512_loadu_si512(b.add(64 * (lw + cc)) as *const _);
                            let qh =
                                _mm512_loadu_si512(b.add(Q6K_QH + 64 * (8 * n + cc)) as *const _);
                            let lo = if quarter < 2 {
                                ql
                            } else {
                                _mm512_srli_epi32::<4>(ql)
                            };
                            // bits 2 quarter .. 2 quarter + 2 of each qh byte to bits 4..6
                            let hi = match quarter {
                                0 => _mm512_slli_epi32::<4>(qh),
                                1 => _mm512_slli_epi32::<2>(qh),
                                2 => qh,
                                _ => _mm512_srli_epi32::<2>(qh),
                            };
                            let q = _mm512_or_si512(
                                _mm512_and_si512(lo, m4),
                                _mm512_and_si512(hi, m30),
                            );
                            let q_odd = _mm512_or_si512(
                                _mm512_and_si512(_mm512_srli_epi32::<8>(lo), m4),
                                _mm512_and_si512(_mm512_srli_epi32::<8>(hi), m30),
                            );
                            (w[2 * c], w[2 * c + 1]) = (q, q_odd);
                        }
                        dp_tokens!(
                            NT,
                            s_half[half],
                            w,
                            t.xq,
                            128 * k + 64 * n + 16 * quarter + 8 * half
                        );
                    }
                    let sb = 8 * n + 2 * quarter;
                    let sc_lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(
                        b.add(Q6K_SC + 16 * sb) as *const __m128i
                    ));
                    let sc_hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(
                        b.add(Q6K_SC + 16 * (sb + 1)) as *const __m128i,
                    ));
                    let dsc_lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc_lo));
                    let dsc_hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc_hi));
                    for ti in 0..NT {
                        let ai = ti * t.anb + 8 * k + 4 * n + quarter;
                        let xlo = *t.xilo.add(ai);
                        let xhi = *t.xi.add(ai) - xlo;
                        let s_lo = _mm512_sub_epi32(
                            sum_chains(&s_half[0], ti),
                            _mm512_set1_epi32(32 * xlo),
                        );
                        let s_hi = _mm512_sub_epi32(
                            sum_chains(&s_half[1], ti),
                            _mm512_set1_epi32(32 * xhi),
                        );
                        let dx = _mm512_set1_ps(*t.xd.add(ai));
                        acc[ti] = _mm512_fmadd_ps(
                            _mm512_cvtepi32_ps(s_lo),
                            _mm512_mul_ps(dsc_lo, dx),
                            acc[ti],
                        );
                        acc[ti] = _mm512_fmadd_ps(
                            _mm512_cvtepi32_ps(s_hi),
                            _mm512_mul_ps(dsc_hi, dx),
                            acc[ti],
                        );
                    }
                }
            }
        }
        store_rows(t, &acc);
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn q8_avx512<const NT: usize>(t: &Tile) {
    unsafe {
        let mut acc = [_mm512_setzero_ps(); NT];
        for k in 0..t.nb {
            let b = t.w.add(k * t.gb);
            prefetch_ahead(b, t.gb);
            let mut s = [[_mm512_setzero_si512(); 4]; NT];
            for h in 0..2 {
                let mut w = [_mm512_setzero_si512(); 8];
                for c in 0..4 {
                    let v = _mm512_loadu_si512(b.add(64 * (4 * h + c)) as *const _);
                    // bytes (0, 2) and (1, 3) of every row word, sign-extended to i16
                    w[2 * c] = _mm512_srai_epi16::<8>(_mm512_slli_epi16::<8>(v));
                    w[2 * c + 1] = _mm512_srai_epi16::<8>(v);
                }
                dp_tokens!(NT, s, w, t.xq, 16 * k + 8 * h);
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(b.add(512) as *const __m256i));
            for ti in 0..NT {
                acc[ti] = q8_scale_512(t, k, ti, dw, sum_chains(&s, ti), acc[ti]);
            }
        }
        store_rows(t, &acc);
    }
}

/// `nt <= NT_256` tokens of one group.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn tile_avx2(ty: QuantType, t: &Tile, nt: usize) {
    unsafe { tile_256::<false>(ty, t, nt) }
}

/// [`tile_avx2`] with AVX-VNNI `vpdpwssd` for its multiply-accumulates.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub(crate) unsafe fn tile_avx2_vnni(ty: QuantType, t: &Tile, nt: usize) {
    unsafe { tile_256::<true>(ty, t, nt) }
}

/// The 256-bit kernels, inlined into the two entry points above, which enable the features.
#[inline(always)]
unsafe fn tile_256<const VNNI: bool>(ty: QuantType, t: &Tile, nt: usize) {
    unsafe {
        match ty {
            QuantType::Q4_0 => dispatch_nt!(@256 q4_avx2, nt, (t), false, VNNI),
            QuantType::Q4_1 => dispatch_nt!(@256 q4_avx2, nt, (t), true, VNNI),
            QuantType::Q8_0 => dispatch_nt!(@256 q8_avx2, nt, (t), VNNI),
            QuantType::Q4_K => dispatch_nt!(@256 q4k_avx2, nt, (t), VNNI),
            QuantType::Q6_K => dispatch_nt!(@256 q6k_avx2, nt, (t), VNNI),
            _ => unreachable!(),
        }
    }
}

/// `s` plus the products of the i16 pairs of `w[i]` and `x[i]`, summed per 32-bit lane (exact
/// integer sums, so both ways give the same bits). With `vnni` (a constant in every caller), a
/// `vpmaddwd` and then a `vpdpwssd` per further pair, where AVX2 needs `vpmaddwd` and `vpaddd`.
#[inline(always)]
unsafe fn add_pair_dots<const N: usize>(
    vnni: bool,
    s: __m256i,
    w: [__m256i; N],
    x: [__m256i; N],
) -> __m256i {
    unsafe {
        if vnni {
            // The call's pairs form a chain of their own, added to `s` at the end: the chains
            // of a block's calls overlap, where one chain through `s` waited on the latency of
            // every `vpdpwssd` (the model's matrices at 32 tokens 2-18% faster, Xeon model 207).
            // Short chains also let tiles of fewer tokens use it, which one chain a token made
            // slower than AVX2: the model's matrices at one token are now 5-7% faster with it.
            let t = (1..N).fold(_mm256_madd_epi16(w[0], x[0]), |t, i| {
                dpwssd_vex(t, w[i], x[i])
            });
            _mm256_add_epi32(s, t)
        } else {
            let mut p: [__m256i; N] = std::array::from_fn(|i| _mm256_madd_epi16(w[i], x[i]));
            let mut n = N;
            while n > 1 {
                for i in 0..n / 2 {
                    p[i] = _mm256_add_epi32(p[2 * i], p[2 * i + 1]);
                }
                n /= 2;
            }
            _mm256_add_epi32(s, p[0])
        }
    }
}

/// `vpdpwssd` ymm (AVX-VNNI) written as the instruction: LLVM splits the intrinsic back into
/// `vpmaddwd` + `vpaddd` for generic x86-64 targets, which measured no faster than AVX2.
#[inline]
#[target_feature(enable = "avx2,avxvnni")]
unsafe fn dpwssd_vex(mut s: __m256i, w: __m256i, x: __m256i) -> __m256i {
    // SAFETY: register operands only.
    unsafe {
        std::arch::asm!(
            "{{vex}} vpdpwssd {s}, {w}, {x}",
            s = inout(ymm_reg) s,
            w = in(ymm_reg) w,
            x = in(ymm_reg) x,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    s
}

/// Stores the first `n` lanes of `v` (n <= 8).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_partial(p: *mut f32, v: __m256, n: usize) {
    unsafe {
        if n >= 8 {
            _mm256_storeu_ps(p, v);
        } else {
            let mut tmp = [0.0f32; 8];
            _mm256_storeu_ps(tmp.as_mut_ptr(), v);
            std::ptr::copy_nonoverlapping(tmp.as_ptr(), p, n);
        }
    }
}

/// The frame of the 256-bit token-tile kernels: `block(h, k, b, acc)` adds block column `k`
/// (its group-block at `b`) of rows `8 h .. 8 h + 8` (the second 32 bytes of every chunk for
/// `h = 1`) to the f32 accumulators `acc` of the tile's tokens, for each half of the group's
/// rows in turn, and the accumulators are stored. The first half prefetches the weights ahead.
#[inline(always)]
unsafe fn by_row_halves<const NT: usize>(
    t: &Tile,
    mut block: impl FnMut(usize, usize, *const u8, &mut [__m256; NT]),
) {
    unsafe {
        for h in 0..2 {
            if 8 * h >= t.nvalid {
                break;
            }
            let mut acc = [_mm256_setzero_ps(); NT];
            for k in 0..t.nb {
                let b = t.w.add(k * t.gb);
                if h == 0 {
                    prefetch_ahead(b, t.gb);
                }
                block(h, k, b, &mut acc);
            }
            for (ti, a) in acc.iter().enumerate() {
                store_partial(t.out.add(ti * t.os + 8 * h), *a, t.nvalid - 8 * h);
            }
        }
    }
}

#[inline(always)]
unsafe fn q4_avx2<const NT: usize, const Q41: bool, const VNNI: bool>(t: &Tile) {
    unsafe {
        let m4 = _mm256_set1_epi32(0x000F_000F);
        by_row_halves::<NT>(t, |h, k, b, acc| {
            let mut s = [_mm256_setzero_si256(); NT];
            for c in 0..4 {
                let v = _mm256_loadu_si256(b.add(64 * c + 32 * h) as *const __m256i);
                let vh = _mm256_srli_epi32::<4>(v);
                let w = [
                    _mm256_and_si256(v, m4),
                    _mm256_and_si256(_mm256_srli_epi32::<8>(v), m4),
                    _mm256_and_si256(vh, m4),
                    _mm256_and_si256(_mm256_srli_epi32::<8>(vh), m4),
                ];
                for ti in 0..NT {
                    let x = t.xq.add(ti * t.xs + k * 32);
                    let xs = [2 * c, 2 * c + 1, 8 + 2 * c, 9 + 2 * c]
                        .map(|m| _mm256_set1_epi32(bcast(x, m)));
                    s[ti] = add_pair_dots(VNNI, s[ti], w, xs);
                }
            }
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(b.add(256 + 16 * h) as *const __m128i));
            for ti in 0..NT {
                acc[ti] = q4_scale_256::<Q41>(t, h, k, b, ti, dw, s[ti], acc[ti]);
            }
        });
    }
}

/// `acc` plus token `ti`'s integer sums `s` of block `k` (rows of half `h`, group-block at
/// `b`, weight scales `dw`) scaled: for Q4_0 less the offset of its unsigned quants (8 times
/// the activations' sum), for Q4_1 plus the block minimum's share.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q4_scale_256<const Q41: bool>(
    t: &Tile,
    h: usize,
    k: usize,
    b: *const u8,
    ti: usize,
    dw: __m256,
    s: __m256i,
    acc: __m256,
) -> __m256 {
    unsafe {
        let ai = ti * t.anb + k;
        let mut s = s;
        if !Q41 {
            s = _mm256_sub_epi32(s, _mm256_set1_epi32(8 * *t.xi.add(ai)));
        }
        let dx = _mm256_set1_ps(*t.xd.add(ai));
        let acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dx), acc);
        if Q41 {
            let mw = _mm256_cvtph_ps(_mm_loadu_si128(b.add(288 + 16 * h) as *const __m128i));
            _mm256_fmadd_ps(mw, _mm256_set1_ps(*t.xsd.add(ai)), acc)
        } else {
            acc
        }
    }
}

/// `acc` plus token `ti`'s integer sums `s` of Q8_0 block `k` (weight scales `dw`) scaled.
#[inline(always)]
unsafe fn q8_scale_256(
    t: &Tile,
    k: usize,
    ti: usize,
    dw: __m256,
    s: __m256i,
    acc: __m256,
) -> __m256 {
    unsafe {
        let dx = _mm256_set1_ps(*t.xd.add(ti * t.anb + k));
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dx), acc)
    }
}

#[inline(always)]
unsafe fn q8_avx2<const NT: usize, const VNNI: bool>(t: &Tile) {
    unsafe {
        by_row_halves::<NT>(t, |h, k, b, acc| {
            let mut s = [_mm256_setzero_si256(); NT];
            for c in 0..8 {
                let v = _mm256_loadu_si256(b.add(64 * c + 32 * h) as *const __m256i);
                // bytes (0, 2) and (1, 3) of every row word, sign-extended to i16
                let we = _mm256_srai_epi16::<8>(_mm256_slli_epi16::<8>(v));
                let wo = _mm256_srai_epi16::<8>(v);
                for ti in 0..NT {
                    let x = t.xq.add(ti * t.xs + k * 32);
                    let xs = [2 * c, 2 * c + 1].map(|m| _mm256_set1_epi32(bcast(x, m)));
                    s[ti] = add_pair_dots(VNNI, s[ti], [we, wo], xs);
                }
            }
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(b.add(512 + 16 * h) as *const __m128i));
            for ti in 0..NT {
                acc[ti] = q8_scale_256(t, k, ti, dw, s[ti], acc[ti]);
            }
        });
    }
}

/// The f32 values of 8 bytes at `p` (the unpacked 6-bit scales and mins of Q4_K, the signed
/// sub-block scales of Q6_K), widened as unsigned or signed.
#[inline(always)]
unsafe fn bytes_ps<const SIGNED: bool>(p: *const u8) -> __m256 {
    unsafe {
        let v = _mm_loadl_epi64(p as *const __m128i);
        _mm256_cvtepi32_ps(if SIGNED {
            _mm256_cvtepi8_epi32(v)
        } else {
            _mm256_cvtepu8_epi32(v)
        })
    }
}

/// The 32 bytes at `p`, shifted down to their high nibbles if `high`.
#[inline(always)]
unsafe fn nibbles_of(p: *const u8, high: bool) -> __m256i {
    unsafe {
        let v = _mm256_loadu_si256(p as *const __m256i);
        if high { _mm256_srli_epi32::<4>(v) } else { v }
    }
}

/// Quarter `quarter` of the Q6_K quants of 32 bytes of `ql` and `qh` as i16 pairs (bytes (0, 2)
/// and (1, 3) of every row word): a nibble of `ql` (the low one in quarters 0 and 1) and bits
/// `2 quarter .. 2 quarter + 2` of `qh` above it.
#[inline(always)]
unsafe fn q6k_quants(ql: *const u8, qh: *const u8, quarter: usize) -> (__m256i, __m256i) {
    unsafe {
        let m4 = _mm256_set1_epi32(0x000F_000F);
        let m30 = _mm256_set1_epi32(0x0030_0030);
        let lo = nibbles_of(ql, quarter >= 2);
        let qh = _mm256_loadu_si256(qh as *const __m256i);
        let hi = match quarter {
            0 => _mm256_slli_epi32::<4>(qh),
            1 => _mm256_slli_epi32::<2>(qh),
            2 => qh,
            _ => _mm256_srli_epi32::<2>(qh),
        };
        (
            _mm256_or_si256(_mm256_and_si256(lo, m4), _mm256_and_si256(hi, m30)),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi32::<8>(lo), m4),
                _mm256_and_si256(_mm256_srli_epi32::<8>(hi), m30),
            ),
        )
    }
}

/// Q4_K in the frame of [`by_row_halves`]; the operation order per output
/// is that of `packed::tile_q4k_scalar`.
#[inline(always)]
unsafe fn q4k_avx2<const NT: usize, const VNNI: bool>(t: &Tile) {
    unsafe {
        let m4 = _mm256_set1_epi32(0x000F_000F);
        by_row_halves::<NT>(t, |h, k, b, acc| {
            let d = _mm256_cvtph_ps(_mm_loadu_si128(b.add(Q4K_D + 16 * h) as *const __m128i));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(b.add(Q4K_DMIN + 16 * h) as *const __m128i));
            // Sub-block j: nibble `j % 2` of chunks 8 (j / 2) .. 8 (j / 2) + 8.
            for j in 0..8 {
                let mut s = [_mm256_setzero_si256(); NT];
                for c in (0..8).step_by(2) {
                    let chunk = |c: usize| b.add(64 * (8 * (j / 2) + c) + 32 * h);
                    let (v0, v1) = (
                        nibbles_of(chunk(c), j % 2 == 1),
                        nibbles_of(chunk(c + 1), j % 2 == 1),
                    );
                    let w = [
                        _mm256_and_si256(v0, m4),
                        _mm256_and_si256(_mm256_srli_epi32::<8>(v0), m4),
                        _mm256_and_si256(v1, m4),
                        _mm256_and_si256(_mm256_srli_epi32::<8>(v1), m4),
                    ];
                    for ti in 0..NT {
                        let x = t.xq.add(ti * t.xs + k * 256 + 32 * j);
                        let xs = [2 * c, 2 * c + 1, 2 * c + 2, 2 * c + 3]
                            .map(|m| _mm256_set1_epi32(bcast(x, m)));
                        s[ti] = add_pair_dots(VNNI, s[ti], w, xs);
                    }
                }
                let dsc = _mm256_mul_ps(d, bytes_ps::<false>(b.add(Q4K_SC + 16 * j + 8 * h)));
                let dm = _mm256_mul_ps(dmin, bytes_ps::<false>(b.add(Q4K_MN + 16 * j + 8 * h)));
                for ti in 0..NT {
                    let ai = ti * t.anb + 8 * k + j;
                    let dx = _mm256_set1_ps(*t.xd.add(ai));
                    acc[ti] =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[ti]), _mm256_mul_ps(dsc, dx), acc[ti]);
                    acc[ti] = _mm256_fnmadd_ps(dm, _mm256_set1_ps(*t.xsd.add(ai)), acc[ti]);
                }
            }
        });
    }
}

/// Q6_K in the frame of [`by_row_halves`]; the operation order per output
/// is that of `packed::tile_q6k_scalar`.
#[inline(always)]
unsafe fn q6k_avx2<const NT: usize, const VNNI: bool>(t: &Tile) {
    unsafe {
        by_row_halves::<NT>(t, |h, k, b, acc| {
            let d = _mm256_cvtph_ps(_mm_loadu_si128(b.add(Q6K_D + 16 * h) as *const __m128i));
            for n in 0..2 {
                for quarter in 0..4 {
                    let lw = 16 * n + 8 * (quarter % 2);
                    let quants = |cc: usize| {
                        let ql = b.add(64 * (lw + cc) + 32 * h);
                        q6k_quants(ql, b.add(Q6K_QH + 64 * (8 * n + cc) + 32 * h), quarter)
                    };
                    // s[half]: values 0..16 (scale sb) and 16..32 (scale sb + 1).
                    let mut s = [[_mm256_setzero_si256(); NT]; 2];
                    for cc in (0..8).step_by(2) {
                        let ((w0, w1), (w2, w3)) = (quants(cc), quants(cc + 1));
                        for ti in 0..NT {
                            let x = t.xq.add(ti * t.xs + k * 256 + 128 * n + 32 * quarter);
                            let xs = [2 * cc, 2 * cc + 1, 2 * cc + 2, 2 * cc + 3]
                                .map(|m| _mm256_set1_epi32(bcast(x, m)));
                            s[cc / 4][ti] =
                                add_pair_dots(VNNI, s[cc / 4][ti], [w0, w1, w2, w3], xs);
                        }
                    }
                    let sb = 8 * n + 2 * quarter;
                    let dsc_lo =
                        _mm256_mul_ps(d, bytes_ps::<true>(b.add(Q6K_SC + 16 * sb + 8 * h)));
                    let dsc_hi =
                        _mm256_mul_ps(d, bytes_ps::<true>(b.add(Q6K_SC + 16 * (sb + 1) + 8 * h)));
                    for ti in 0..NT {
                        let ai = ti * t.anb + 8 * k + 4 * n + quarter;
                        let xlo = *t.xilo.add(ai);
                        let xhi = *t.xi.add(ai) - xlo;
                        let s_lo = _mm256_sub_epi32(s[0][ti], _mm256_set1_epi32(32 * xlo));
                        let s_hi = _mm256_sub_epi32(s[1][ti], _mm256_set1_epi32(32 * xhi));
                        let dx = _mm256_set1_ps(*t.xd.add(ai));
                        acc[ti] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(s_lo),
                            _mm256_mul_ps(dsc_lo, dx),
                            acc[ti],
                        );
                        acc[ti] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(s_hi),
                            _mm256_mul_ps(dsc_hi, dx),
                            acc[ti],
                        );
                    }
                }
            }
        });
    }
}

/// Dots of `nr` (1..=4) rows of `w` (row stride `cols`) with `x`.
#[target_feature(enable = "avx512f,fma")]
pub(crate) unsafe fn dot4_avx512(w: &[f32], nr: usize, cols: usize, x: &[f32]) -> [f32; 4] {
    unsafe {
        let mut acc = [_mm512_setzero_ps(); 4];
        let n16 = cols / 16 * 16;
        let xp = x.as_ptr();
        let wp = w.as_ptr();
        let mut c = 0;
        while c < n16 {
            let xv = _mm512_loadu_ps(xp.add(c));
            for (r, a) in acc.iter_mut().enumerate().take(nr) {
                *a = _mm512_fmadd_ps(_mm512_loadu_ps(wp.add(r * cols + c)), xv, *a);
            }
            c += 16;
        }
        let mut res = [0.0f32; 4];
        for r in 0..nr {
            let mut s = _mm512_reduce_add_ps(acc[r]);
            for cc in n16..cols {
                s = w[r * cols + cc].mul_add(x[cc], s);
            }
            res[r] = s;
        }
        res
    }
}

/// Dots of `nr` (1..=4) rows of `w` (row stride `cols`) with `x`.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn dot4_avx2(w: &[f32], nr: usize, cols: usize, x: &[f32]) -> [f32; 4] {
    unsafe {
        let mut acc = [_mm256_setzero_ps(); 4];
        let n8 = cols / 8 * 8;
        let xp = x.as_ptr();
        let wp = w.as_ptr();
        let mut c = 0;
        while c < n8 {
            let xv = _mm256_loadu_ps(xp.add(c));
            for (r, a) in acc.iter_mut().enumerate().take(nr) {
                *a = _mm256_fmadd_ps(_mm256_loadu_ps(wp.add(r * cols + c)), xv, *a);
            }
            c += 8;
        }
        let mut res = [0.0f32; 4];
        for r in 0..nr {
            let mut lanes = [0.0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r]);
            let mut s = lanes.iter().sum::<f32>();
            for cc in n8..cols {
                s = w[r * cols + cc].mul_add(x[cc], s);
            }
            res[r] = s;
        }
        res
    }
}

/// AVX-512 version of `packed::quantize_acts_scalar` (bit-identical results).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
pub(crate) unsafe fn quantize_acts_avx512(x: &[f32], out: ActBlocks<'_>) {
    unsafe {
        let absmask = _mm512_set1_epi32(0x7FFF_FFFF);
        let lo = _mm512_set1_epi32(-32767);
        let hi = _mm512_set1_epi32(32767);
        // `packed::PAIR_POS` within every group of 4.
        let perm = _mm512_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
        for b in 0..out.d.len() {
            let p = x.as_ptr().add(32 * b);
            let v0 = _mm512_loadu_ps(p);
            let v1 = _mm512_loadu_ps(p.add(16));
            let a0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v0), absmask));
            let a1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v1), absmask));
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
            let db = amax / super::packed::QMAX;
            let id = _mm512_set1_ps(if db != 0.0 { 1.0 / db } else { 0.0 });
            let q0 = _mm512_min_epi32(
                _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, id)), lo),
                hi,
            );
            let q1 = _mm512_min_epi32(
                _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, id)), lo),
                hi,
            );
            let o = out.qs.as_mut_ptr().add(32 * b);
            _mm256_storeu_si256(
                o as *mut __m256i,
                _mm512_cvtepi32_epi16(_mm512_permutexvar_epi32(perm, q0)),
            );
            _mm256_storeu_si256(
                o.add(16) as *mut __m256i,
                _mm512_cvtepi32_epi16(_mm512_permutexvar_epi32(perm, q1)),
            );
            let s = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            out.d[b] = db;
            out.isum[b] = s;
            out.isum_lo[b] = _mm512_reduce_add_epi32(q0);
            out.sd[b] = db * s as f32;
        }
    }
}

/// AVX2 version of `packed::quantize_acts_scalar` (bit-identical results).
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn quantize_acts_avx2(x: &[f32], out: ActBlocks<'_>) {
    unsafe {
        let absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        let lo = _mm256_set1_epi32(-32767);
        let hi = _mm256_set1_epi32(32767);
        let hsum = |v: __m256i| {
            let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
            _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s)))
        };
        for b in 0..out.d.len() {
            let p = x.as_ptr().add(32 * b);
            let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(p.add(8 * i)));
            let a = v.map(|v| _mm256_and_ps(v, absmask));
            let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
            let db = amax / super::packed::QMAX;
            let id = _mm256_set1_ps(if db != 0.0 { 1.0 / db } else { 0.0 });
            // Rounded to nearest even (the default rounding), clamped, then each group of 4
            // in `packed::PAIR_POS` order (0, 2, 1, 3).
            let q = v.map(|v| {
                let q = _mm256_cvtps_epi32(_mm256_mul_ps(v, id));
                _mm256_shuffle_epi32::<0b11_01_10_00>(_mm256_min_epi32(_mm256_max_epi32(q, lo), hi))
            });
            // packs interleaves 128-bit lanes (q0 0-3, q1 0-3, q0 4-7, q1 4-7); the permute
            // restores token order. The values are clamped, so packing never saturates.
            let o = out.qs.as_mut_ptr().add(32 * b);
            for (half, (q0, q1)) in [(q[0], q[1]), (q[2], q[3])].into_iter().enumerate() {
                let packed = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(q0, q1));
                _mm256_storeu_si256(o.add(16 * half) as *mut __m256i, packed);
            }
            let first = hsum(_mm256_add_epi32(q[0], q[1]));
            let s = first + hsum(_mm256_add_epi32(q[2], q[3]));
            out.d[b] = db;
            out.isum[b] = s;
            out.isum_lo[b] = first;
            out.sd[b] = db * s as f32;
        }
    }
}

/// Row dequantization compiled for AVX-512 (the same scalar code, autovectorized; F16 via
/// `vcvtph2ps`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub(crate) unsafe fn dequantize_row_avx512(ty: QuantType, bytes: &[u8], out: &mut [f32]) {
    if ty == QuantType::F16 && bytes.len() == 2 * out.len() {
        let n16 = out.len() / 16 * 16;
        unsafe {
            for i in (0..n16).step_by(16) {
                let h = _mm256_loadu_si256(bytes.as_ptr().add(2 * i) as *const __m256i);
                _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
            }
        }
        duet_model::dequant::dequantize_row_inline(ty, &bytes[2 * n16..], &mut out[n16..]);
        return;
    }
    duet_model::dequant::dequantize_row_inline(ty, bytes, out)
}

/// Row dequantization compiled for AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dequantize_row_avx2(ty: QuantType, bytes: &[u8], out: &mut [f32]) {
    if ty == QuantType::F16 && bytes.len() == 2 * out.len() {
        let n8 = out.len() / 8 * 8;
        unsafe {
            for i in (0..n8).step_by(8) {
                let h = _mm_loadu_si128(bytes.as_ptr().add(2 * i) as *const __m128i);
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
        }
        duet_model::dequant::dequantize_row_inline(ty, &bytes[2 * n8..], &mut out[n8..]);
        return;
    }
    duet_model::dequant::dequantize_row_inline(ty, bytes, out)
}

/// Dots of `nr` (1..=4) rows of `w` (row stride `cols`) with 4 tokens of `x` (`4 * cols` values):
/// `out[token][row]`, each bit-identical to [`dot4_avx512`] of that token.
#[target_feature(enable = "avx512f,fma")]
pub(crate) unsafe fn dot4x4_avx512(w: &[f32], nr: usize, cols: usize, x: &[f32]) -> [[f32; 4]; 4] {
    assert!(nr <= 4 && w.len() >= nr * cols && x.len() == 4 * cols);
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); 4]; 4];
        let n16 = cols / 16 * 16;
        let xp = x.as_ptr();
        let wp = w.as_ptr();
        let mut c = 0;
        while c < n16 {
            let xv = [
                _mm512_loadu_ps(xp.add(c)),
                _mm512_loadu_ps(xp.add(cols + c)),
                _mm512_loadu_ps(xp.add(2 * cols + c)),
                _mm512_loadu_ps(xp.add(3 * cols + c)),
            ];
            for r in 0..nr {
                let wv = _mm512_loadu_ps(wp.add(r * cols + c));
                for t in 0..4 {
                    acc[t][r] = _mm512_fmadd_ps(wv, xv[t], acc[t][r]);
                }
            }
            c += 16;
        }
        let mut res = [[0.0f32; 4]; 4];
        for t in 0..4 {
            for r in 0..nr {
                let mut s = _mm512_reduce_add_ps(acc[t][r]);
                for cc in n16..cols {
                    s = w[r * cols + cc].mul_add(x[t * cols + cc], s);
                }
                res[t][r] = s;
            }
        }
        res
    }
}

/// Runs `iterations` rounds of 16 independent `vpdpwssd` (written as the instruction, so the
/// compiler cannot split it) and returns the multiply-accumulates done.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
pub(crate) unsafe fn dot_throughput_avx512(iterations: usize) -> usize {
    let mut acc = [_mm512_setzero_si512(); 16];
    let w = _mm512_set1_epi32(0x0001_0001);
    for _ in 0..iterations {
        for a in acc.iter_mut() {
            // SAFETY: register operands only.
            unsafe {
                std::arch::asm!(
                    "vpdpwssd {a}, {w}, {w}",
                    a = inout(zmm_reg) *a,
                    w = in(zmm_reg) w,
                    options(pure, nomem, nostack, preserves_flags),
                );
            }
        }
    }
    std::hint::black_box(acc);
    iterations * 16 * 32
}

/// As [`dot_throughput_avx512`] for the AVX2 kernels' `vpmaddwd` + `vpaddd` on ymm registers.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_throughput_avx2(iterations: usize) -> usize {
    unsafe { dot_throughput_256::<false>(iterations) }
}

/// As [`dot_throughput_avx2`] for AVX-VNNI `vpdpwssd` on ymm registers.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub(crate) unsafe fn dot_throughput_avx2_vnni(iterations: usize) -> usize {
    unsafe { dot_throughput_256::<true>(iterations) }
}

/// `s` + `vpmaddwd(w, x)` written as the two instructions, so the ceiling loop measures them.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn madd_add_asm(mut s: __m256i, w: __m256i, x: __m256i) -> __m256i {
    // SAFETY: register operands only.
    unsafe {
        std::arch::asm!(
            "vpmaddwd {p}, {w}, {x}",
            "vpaddd {s}, {s}, {p}",
            s = inout(ymm_reg) s,
            w = in(ymm_reg) w,
            x = in(ymm_reg) x,
            p = out(ymm_reg) _,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    s
}

/// `iterations` rounds of 12 independent dot instructions, inlined into the entry points above.
#[inline(always)]
unsafe fn dot_throughput_256<const VNNI: bool>(iterations: usize) -> usize {
    let mut acc = [unsafe { _mm256_setzero_si256() }; 12];
    let w = unsafe { _mm256_set1_epi32(0x0001_0001) };
    for _ in 0..iterations {
        for a in acc.iter_mut() {
            // SAFETY: register operands only.
            unsafe {
                *a = if VNNI {
                    dpwssd_vex(*a, w, w)
                } else {
                    madd_add_asm(*a, w, w)
                };
            }
        }
    }
    std::hint::black_box(acc);
    iterations * 12 * 16
}

/// Row groups of a weight-stationary unit of the 256-bit kernels ([`unit_avx2`]).
pub(crate) const UNIT_GROUPS: usize = 2;
/// 8-row weight vectors of a unit.
const UNIT_VECS: usize = 2 * UNIT_GROUPS;
/// Tokens one pass over a unit's widened block takes: `UNIT_VECS * UNIT_TOKENS` = 12 i32
/// accumulators, with a broadcast and a product, fill the 16 ymm registers.
const UNIT_TOKENS: usize = 3;
/// Most tokens of one unit call: their f32 accumulators (6 KiB) stay on the stack.
pub(crate) const UNIT_MAX_TOKENS: usize = 48;
/// Fewest tokens for which units beat token tiles ([`tile_avx2`]): a unit stores each widened
/// block (2 KiB) once, which fewer tokens do not repay (on AMD Zen 3, one matrix at 8 tokens
/// 12% slower in units, at 12 and more 5-15% faster).
pub(crate) const UNIT_MIN_TOKENS: usize = 12;

/// A block's weights of one unit widened to i16 pairs: pair `m` (of 16) of vector `r` at
/// `w[m * UNIT_VECS + r]`, and the vectors' f32 scales (`d`, and `m` of Q4_1).
#[repr(C, align(64))]
struct UnitBlock {
    w: [__m256i; 16 * UNIT_VECS],
    d: [__m256; UNIT_VECS],
    m: [__m256; UNIT_VECS],
}

/// Widens block `k` of the unit's `ng` groups into `u`, as the token-tile kernels widen them.
#[inline(always)]
unsafe fn widen_unit_block(ty: QuantType, t: &Tile, ng: usize, k: usize, u: &mut UnitBlock) {
    unsafe {
        let m4 = _mm256_set1_epi32(0x000F_000F);
        for gi in 0..ng {
            let b = t.w.add((gi * t.nb + k) * t.gb);
            prefetch_ahead(b, t.gb);
            for h in 0..2 {
                let r = 2 * gi + h;
                let pair = |m: usize| m * UNIT_VECS + r;
                let scales = |at: usize| {
                    _mm256_cvtph_ps(_mm_loadu_si128(b.add(at + 16 * h) as *const __m128i))
                };
                match ty {
                    QuantType::Q4_0 | QuantType::Q4_1 => {
                        for c in 0..4 {
                            let v = _mm256_loadu_si256(b.add(64 * c + 32 * h) as *const __m256i);
                            let vh = _mm256_srli_epi32::<4>(v);
                            u.w[pair(2 * c)] = _mm256_and_si256(v, m4);
                            u.w[pair(2 * c + 1)] = _mm256_and_si256(_mm256_srli_epi32::<8>(v), m4);
                            u.w[pair(8 + 2 * c)] = _mm256_and_si256(vh, m4);
                            u.w[pair(9 + 2 * c)] = _mm256_and_si256(_mm256_srli_epi32::<8>(vh), m4);
                        }
                        u.d[r] = scales(256);
                        if ty == QuantType::Q4_1 {
                            u.m[r] = scales(288);
                        }
                    }
                    QuantType::Q8_0 => {
                        for c in 0..8 {
                            let v = _mm256_loadu_si256(b.add(64 * c + 32 * h) as *const __m256i);
                            // bytes (0, 2) and (1, 3) of every row word, sign-extended to i16
                            u.w[pair(2 * c)] = _mm256_srai_epi16::<8>(_mm256_slli_epi16::<8>(v));
                            u.w[pair(2 * c + 1)] = _mm256_srai_epi16::<8>(v);
                        }
                        u.d[r] = scales(512);
                    }
                    _ => unreachable!("no unit kernel for {ty:?}"),
                }
            }
        }
    }
}

/// `vpmaddwd` of `x` and the vector `O` bytes past `w`, the weights as a memory operand.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn madd_mem<const O: usize>(x: __m256i, w: *const __m256i) -> __m256i {
    let p;
    // SAFETY: the caller passes a readable vector at `w + O`.
    unsafe {
        std::arch::asm!(
            "vpmaddwd {p}, {x}, ymmword ptr [{w} + {o}]",
            p = out(ymm_reg) p,
            x = in(ymm_reg) x,
            w = in(reg) w,
            o = const O,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    p
}

/// `s` + [`madd_mem`]: one AVX-VNNI `vpdpwssd` with `VNNI`, else `vpmaddwd` + `vpaddd`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn madd_add_mem<const O: usize, const VNNI: bool>(
    mut s: __m256i,
    x: __m256i,
    w: *const __m256i,
) -> __m256i {
    // SAFETY: as for `madd_mem`; the caller of the VNNI form runs on a machine with AVX-VNNI.
    unsafe {
        if VNNI {
            std::arch::asm!(
                "{{vex}} vpdpwssd {s}, {x}, ymmword ptr [{w} + {o}]",
                s = inout(ymm_reg) s,
                x = in(ymm_reg) x,
                w = in(reg) w,
                o = const O,
                options(pure, readonly, nostack, preserves_flags),
            );
        } else {
            std::arch::asm!(
                "vpmaddwd {p}, {x}, ymmword ptr [{w} + {o}]",
                "vpaddd {s}, {s}, {p}",
                s = inout(ymm_reg) s,
                x = in(ymm_reg) x,
                w = in(reg) w,
                o = const O,
                p = out(ymm_reg) _,
                options(pure, readonly, nostack, preserves_flags),
            );
        }
    }
    s
}

/// Adds the products of pair `$m` of the first `$nr` widened weight vectors (`$w`, a
/// [`UnitBlock::w`]) with token `$t`'s broadcast pair `$xb` into `$s[$t]`; pair 0 starts the
/// sums. The weights are memory operands, so the 12 accumulators, the broadcast and a product
/// are all the registers the dots need (with intrinsics, LLVM kept weights in registers and
/// spilled accumulators); a macro, for the constant offsets.
macro_rules! unit_pair {
    ($vnni:ident, $nr:expr, $s:ident, $t:literal, $xb:ident, $w:ident, $m:literal, [$($r:literal)*]) => {
        $(
            if $r < $nr {
                const O: usize = ($m * UNIT_VECS + $r) * 32;
                $s[$t][$r] = if $m == 0 {
                    madd_mem::<O>($xb, $w)
                } else {
                    madd_add_mem::<O, $vnni>($s[$t][$r], $xb, $w)
                };
            }
        )*
    };
}

/// [`unit_pair`] for every pair `$m` and each of `$nt` tokens (`$x[t]`: the token's 16 pairs).
macro_rules! unit_pairs {
    ($vnni:ident, $nr:expr, $nt:expr, $s:ident, $x:ident, $w:ident, [$($m:literal)*]) => {
        $(unit_pairs!(@tokens $vnni, $nr, $nt, $s, $x, $w, $m, [0 1 2]);)*
    };
    (@tokens $vnni:ident, $nr:expr, $nt:expr, $s:ident, $x:ident, $w:ident, $m:literal, [$($t:literal)*]) => {
        $(
            if $t < $nt {
                let xb = _mm256_set1_epi32(*$x[$t].add($m));
                unit_pair!($vnni, $nr, $s, $t, xb, $w, $m, [0 1 2 3]);
            }
        )*
    };
}

/// The i32 dots of `R` widened weight vectors with `T` tokens' activations of one block
/// (`x[t]`: the token's 16 i16 pairs): for each pair, each token's broadcast feeds all `R`
/// vectors.
#[inline(always)]
unsafe fn unit_dots<const R: usize, const T: usize, const VNNI: bool>(
    w: &[__m256i; 16 * UNIT_VECS],
    x: [*const i32; T],
) -> [[__m256i; R]; T] {
    unsafe {
        let mut s = [[_mm256_setzero_si256(); R]; T];
        let w = w.as_ptr();
        unit_pairs!(VNNI, R, T, s, x, w, [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15]);
        s
    }
}

/// Scales `T` tokens' block dots (tokens `t0..`) into their f32 accumulators, in the order of
/// every other kernel (so the same bits).
#[inline(always)]
unsafe fn unit_scale<const R: usize, const T: usize>(
    ty: QuantType,
    t: &Tile,
    k: usize,
    t0: usize,
    u: &UnitBlock,
    s: [[__m256i; R]; T],
    acc: &mut [[__m256; UNIT_VECS]],
) {
    unsafe {
        for ti in 0..T {
            let ai = (t0 + ti) * t.anb + k;
            let dx = _mm256_set1_ps(*t.xd.add(ai));
            let a = &mut acc[t0 + ti];
            for r in 0..R {
                let mut si = s[ti][r];
                if ty == QuantType::Q4_0 {
                    si = _mm256_sub_epi32(si, _mm256_set1_epi32(8 * *t.xi.add(ai)));
                }
                a[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_mul_ps(u.d[r], dx), a[r]);
                if ty == QuantType::Q4_1 {
                    a[r] = _mm256_fmadd_ps(u.m[r], _mm256_set1_ps(*t.xsd.add(ai)), a[r]);
                }
            }
        }
    }
}

/// Block `k` of the unit (its `R` vectors) for all `nt` tokens, [`UNIT_TOKENS`] at a time.
#[inline(always)]
unsafe fn unit_block<const R: usize, const VNNI: bool>(
    ty: QuantType,
    t: &Tile,
    nt: usize,
    k: usize,
    u: &UnitBlock,
    acc: &mut [[__m256; UNIT_VECS]],
) {
    unsafe {
        let x = |ti: usize| t.xq.add(ti * t.xs + k * 32) as *const i32;
        let mut t0 = 0;
        while t0 + UNIT_TOKENS <= nt {
            let s = unit_dots::<R, UNIT_TOKENS, VNNI>(&u.w, std::array::from_fn(|i| x(t0 + i)));
            unit_scale(ty, t, k, t0, u, s, acc);
            t0 += UNIT_TOKENS;
        }
        match nt - t0 {
            0 => {}
            1 => unit_scale(ty, t, k, t0, u, unit_dots::<R, 1, VNNI>(&u.w, [x(t0)]), acc),
            _ => {
                let s = unit_dots::<R, 2, VNNI>(&u.w, [x(t0), x(t0 + 1)]);
                unit_scale(ty, t, k, t0, u, s, acc);
            }
        }
    }
}

/// `nt` (`UNIT_MIN_TOKENS..=UNIT_MAX_TOKENS`) tokens of a unit: up to [`UNIT_GROUPS`] row
/// groups (`t.nvalid` rows from `t.w` on, the second group's blocks after the first's),
/// weight-stationary: each block's weights are widened once into a [`UnitBlock`], and every
/// token's dots with it are done before the next block. On AMD Zen 3 a broadcast takes a vector
/// pipe as `vpmaddwd` and `vpaddd` do, and the token-tile kernels ([`tile_avx2`]) pay one per
/// `vpmaddwd` (plus the widening of each chunk for every 8 tokens); here each broadcast feeds
/// four `vpmaddwd`s, whose weights are memory operands. Same integer sums and f32 order per
/// output as every kernel, so the same bits.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn unit_avx2(ty: QuantType, t: &Tile, nt: usize) {
    unsafe { unit_256::<false>(ty, t, nt) }
}

/// [`unit_avx2`] with AVX-VNNI `vpdpwssd` for its multiply-accumulates, each one instruction
/// on a memory operand. An Intel Xeon (family 6 model 207) broadcasts from memory on its load
/// ports, so the tiles ([`tile_avx2_vnni`]) lose nothing there; sharing each block's widening
/// among all the call's tokens still made the model's matrices 3-6% faster than tiles at 12-32
/// tokens and 15-22% at 48-128 (one process alternating the two, median of 16-40 rounds).
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub(crate) unsafe fn unit_avx2_vnni(ty: QuantType, t: &Tile, nt: usize) {
    unsafe { unit_256::<true>(ty, t, nt) }
}

/// The unit kernels, inlined into the two entry points above, which enable the features.
#[inline(always)]
unsafe fn unit_256<const VNNI: bool>(ty: QuantType, t: &Tile, nt: usize) {
    unsafe {
        debug_assert!(nt <= UNIT_MAX_TOKENS && t.nvalid <= UNIT_GROUPS * 16);
        let ng = t.nvalid.div_ceil(16);
        // Only the call's tokens' accumulators are zeroed (a whole 6 KiB array per unit call was
        // ~1% of a batch-32 decode step in `memset`).
        let mut acc_store =
            [const { MaybeUninit::<[__m256; UNIT_VECS]>::uninit() }; UNIT_MAX_TOKENS];
        for a in &mut acc_store[..nt] {
            a.write([_mm256_setzero_ps(); UNIT_VECS]);
        }
        // SAFETY: the first `nt` are initialized (above).
        let acc =
            std::slice::from_raw_parts_mut(acc_store.as_mut_ptr() as *mut [__m256; UNIT_VECS], nt);
        let mut u = UnitBlock {
            w: [_mm256_setzero_si256(); 16 * UNIT_VECS],
            d: [_mm256_setzero_ps(); UNIT_VECS],
            m: [_mm256_setzero_ps(); UNIT_VECS],
        };
        for k in 0..t.nb {
            widen_unit_block(ty, t, ng, k, &mut u);
            // Each arm names its type, so the scale step's type tests fold away.
            use QuantType::{Q4_0, Q4_1, Q8_0};
            match (ty, ng) {
                (Q4_0, 2) => unit_block::<UNIT_VECS, VNNI>(Q4_0, t, nt, k, &u, acc),
                (Q4_1, 2) => unit_block::<UNIT_VECS, VNNI>(Q4_1, t, nt, k, &u, acc),
                (Q8_0, 2) => unit_block::<UNIT_VECS, VNNI>(Q8_0, t, nt, k, &u, acc),
                (Q4_0, _) => unit_block::<2, VNNI>(Q4_0, t, nt, k, &u, acc),
                (Q4_1, _) => unit_block::<2, VNNI>(Q4_1, t, nt, k, &u, acc),
                (Q8_0, _) => unit_block::<2, VNNI>(Q8_0, t, nt, k, &u, acc),
                _ => unreachable!("no unit kernel for {ty:?}"),
            }
        }
        for (ti, a) in acc.iter().enumerate() {
            for (r, v) in a.iter().enumerate().take(2 * ng) {
                let rows = t.nvalid.saturating_sub(8 * r);
                if rows > 0 {
                    store_partial(t.out.add(ti * t.os + 8 * r), *v, rows);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// One token: the split-byte kernels.
//
// At one token nothing shares a widened weight register, and widening 4-bit quants to i16
// pairs took more vector ops than the dots themselves (7 per 64-byte chunk against 4
// `vpdpwssd`). Split into its high byte `h` (signed) and low byte `l` (unsigned), each i16
// activation is `256 h + l` exactly, so `sum(q x) = 256 sum(q h) + sum(q l)` with the byte dots
// of `vpdpbusd` (unsigned x signed bytes, four products per 32-bit lane): a quant byte is then
// widened by one mask (low nibbles) or a shift and a mask (high ones), and four `vpdpbusd` do
// what four `vpdpwssd` did. Q8_0's signed quants take the unsigned side of the high-byte dots as
// `q + 128`, less `128 sum(h)` per block. The integer sums are the same, so are the bits.

/// Splits one token's quantized activations `qs` (its `nb` blocks, [`PAIR_POS`] order) into
/// their high bytes `hi` and low bytes `lo` in element order, and `hi_corr[b]` = `32768 *
/// sum(hi)` over block `b` (Q8_0's correction, already shifted by the 8 bits its sums are).
///
/// [`PAIR_POS`]: super::packed::PAIR_POS
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn split_bytes(qs: &[i16], hi: &mut [i8], lo: &mut [u8], hi_corr: &mut [i32]) {
    assert!(qs.len() == hi.len() && qs.len() == lo.len() && qs.len() == hi_corr.len() * 32);
    // Within each 128-bit lane (two groups of four, stored as elements 0, 2, 1, 3): the low
    // bytes of elements 0..8 in order, then their high bytes.
    let order = _mm256_setr_epi8(
        0, 4, 2, 6, 8, 12, 10, 14, 1, 5, 3, 7, 9, 13, 11, 15, 0, 4, 2, 6, 8, 12, 10, 14, 1, 5, 3,
        7, 9, 13, 11, 15,
    );
    let flip = _mm_set1_epi8(-128);
    // SAFETY: every block's 32 values are in bounds (asserted above).
    unsafe {
        for (b, corr) in hi_corr.iter_mut().enumerate() {
            let mut biased = _mm_setzero_si128();
            for half in 0..2 {
                let at = 32 * b + 16 * half;
                let v = _mm256_loadu_si256(qs.as_ptr().add(at) as *const __m256i);
                // qwords: low bytes of elements 0..8, high 0..8, low 8..16, high 8..16
                let s = _mm256_shuffle_epi8(v, order);
                let s = _mm256_permute4x64_epi64::<0b11_01_10_00>(s);
                let h = _mm256_extracti128_si256::<1>(s);
                _mm_storeu_si128(
                    lo.as_mut_ptr().add(at) as *mut __m128i,
                    _mm256_castsi256_si128(s),
                );
                _mm_storeu_si128(hi.as_mut_ptr().add(at) as *mut __m128i, h);
                // The high bytes biased to unsigned, summed by `vpsadbw`.
                let sums = _mm_sad_epu8(_mm_xor_si128(h, flip), _mm_setzero_si128());
                biased = _mm_add_epi64(biased, sums);
            }
            let sum = _mm_cvtsi128_si64(biased) + _mm_extract_epi64::<1>(biased);
            *corr = 32768 * (sum as i32 - 128 * 32);
        }
    }
}

/// `vpdpbusd` ymm (AVX-VNNI): `s` plus the products of the unsigned bytes of `u` with the signed
/// bytes of `i`, four per 32-bit lane.
#[inline]
#[target_feature(enable = "avx2,avxvnni")]
unsafe fn dpbusd_vex(mut s: __m256i, u: __m256i, i: __m256i) -> __m256i {
    // SAFETY: register operands only.
    unsafe {
        std::arch::asm!(
            "{{vex}} vpdpbusd {s}, {u}, {i}",
            s = inout(ymm_reg) s,
            u = in(ymm_reg) u,
            i = in(ymm_reg) i,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    s
}

/// `vpdpbusd` zmm with the signed bytes a 32-bit word at `p`, broadcast by the instruction.
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn dpbusd_bcast(mut s: __m512i, u: __m512i, p: *const i8) -> __m512i {
    // SAFETY: the caller passes 4 readable bytes.
    unsafe {
        std::arch::asm!(
            "vpdpbusd {s}, {u}, dword ptr [{p}]{{1to16}}",
            s = inout(zmm_reg) s,
            u = in(zmm_reg) u,
            p = in(reg) p,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    s
}

/// `vpdpbusd` zmm on registers.
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn dpbusd_512(mut s: __m512i, u: __m512i, i: __m512i) -> __m512i {
    // SAFETY: register operands only.
    unsafe {
        std::arch::asm!(
            "vpdpbusd {s}, {u}, {i}",
            s = inout(zmm_reg) s,
            u = in(zmm_reg) u,
            i = in(zmm_reg) i,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    s
}

/// The 32-bit word of bytes `e..e + 4` at `p`.
#[inline(always)]
unsafe fn word_at<T>(p: *const T, e: usize) -> i32 {
    unsafe { (p as *const u8).add(e).cast::<i32>().read_unaligned() }
}

/// Element (of its block) of the first of the 4 values in each row word of the Q4 split-byte
/// kernels' weight vector `i`: `[low nibbles of chunk 0, high nibbles of chunk 0, low of chunk
/// 1, ...]` (Q8_0's vector `c` is chunk `c`, elements `4 c..`).
const fn q4_element(i: usize) -> usize {
    4 * (i / 2) + 16 * (i % 2)
}

/// One token of one group on the AVX2 + AVX-VNNI path, by byte dots (see [`split_bytes`]); `t`
/// carries the token's split activations.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub(crate) unsafe fn bytes_avx2_vnni(ty: QuantType, t: &Tile) {
    unsafe {
        match ty {
            QuantType::Q4_0 => q4_bytes_avx2::<false>(t),
            QuantType::Q4_1 => q4_bytes_avx2::<true>(t),
            QuantType::Q8_0 => q8_bytes_avx2(t),
            _ => unreachable!("no split-byte kernel for {ty:?}"),
        }
    }
}

/// The integer sums of 8 weight vectors `w` (element `elem(i)` first in `w[i]`) with the
/// token's split activations of block `k`: high-byte dots, shifted by 8 bits, then the low-byte
/// dots, in four chains (two left the model's matrices at one token 1-7% slower on an Intel Xeon,
/// family 6 model 207: each chain waits on eight `vpdpbusd`s in a row); `flip` gives the
/// high-byte dots' unsigned side (Q8_0: `q + 128`).
#[inline(always)]
unsafe fn byte_dots_256(
    t: &Tile,
    k: usize,
    w: &[__m256i; 8],
    elem: impl Fn(usize) -> usize,
    flip: impl Fn(__m256i) -> __m256i,
) -> __m256i {
    unsafe {
        let (xh, xl) = (t.xhi.add(32 * k), t.xlo.add(32 * k));
        let mut a = [_mm256_setzero_si256(); 4];
        for i in 0..8 {
            let x = _mm256_set1_epi32(word_at(xh, elem(i)));
            a[i / 2] = dpbusd_vex(a[i / 2], flip(w[i]), x);
        }
        for v in &mut a {
            *v = _mm256_slli_epi32::<8>(*v);
        }
        for i in 0..8 {
            let x = _mm256_set1_epi32(word_at(xl, elem(i)));
            a[i / 2] = dpbusd_vex(a[i / 2], x, w[i]);
        }
        _mm256_add_epi32(_mm256_add_epi32(a[0], a[1]), _mm256_add_epi32(a[2], a[3]))
    }
}

#[inline(always)]
unsafe fn q4_bytes_avx2<const Q41: bool>(t: &Tile) {
    unsafe {
        let m4 = _mm256_set1_epi8(0x0F);
        by_row_halves::<1>(t, |h, k, b, acc| {
            let mut w = [_mm256_setzero_si256(); 8];
            for c in 0..4 {
                let v = _mm256_loadu_si256(b.add(64 * c + 32 * h) as *const __m256i);
                w[2 * c] = _mm256_and_si256(v, m4);
                w[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
            }
            let s = byte_dots_256(t, k, &w, q4_element, |w| w);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(b.add(256 + 16 * h) as *const __m128i));
            acc[0] = q4_scale_256::<Q41>(t, h, k, b, 0, dw, s, acc[0]);
        });
    }
}

#[inline(always)]
unsafe fn q8_bytes_avx2(t: &Tile) {
    unsafe {
        let flip = _mm256_set1_epi8(-128);
        by_row_halves::<1>(t, |h, k, b, acc| {
            let w: [__m256i; 8] = std::array::from_fn(|c| {
                _mm256_loadu_si256(b.add(64 * c + 32 * h) as *const __m256i)
            });
            let s = byte_dots_256(t, k, &w, |c| 4 * c, |w| _mm256_xor_si256(w, flip));
            let s = _mm256_sub_epi32(s, _mm256_set1_epi32(*t.xhc.add(k)));
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(b.add(512 + 16 * h) as *const __m128i));
            acc[0] = q8_scale_256(t, k, 0, dw, s, acc[0]);
        });
    }
}

/// One token of one group on the AVX-512 path, by byte dots (see [`split_bytes`]); `t` carries
/// the token's split activations.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
pub(crate) unsafe fn bytes_avx512(ty: QuantType, t: &Tile) {
    unsafe {
        match ty {
            QuantType::Q4_0 => q4_bytes_avx512::<false>(t),
            QuantType::Q4_1 => q4_bytes_avx512::<true>(t),
            QuantType::Q8_0 => q8_bytes_avx512(t),
            _ => unreachable!("no split-byte kernel for {ty:?}"),
        }
    }
}

/// [`byte_dots_256`] for 16-row vectors; the high bytes are broadcast by the instruction.
#[inline(always)]
unsafe fn byte_dots_512(
    t: &Tile,
    k: usize,
    w: &[__m512i; 8],
    elem: impl Fn(usize) -> usize,
    flip: impl Fn(__m512i) -> __m512i,
) -> __m512i {
    unsafe {
        let (xh, xl) = (t.xhi.add(32 * k), t.xlo.add(32 * k));
        let mut a = [_mm512_setzero_si512(); 4];
        for i in 0..8 {
            a[i / 2] = dpbusd_bcast(a[i / 2], flip(w[i]), xh.add(elem(i)));
        }
        for v in &mut a {
            *v = _mm512_slli_epi32::<8>(*v);
        }
        for i in 0..8 {
            let x = _mm512_set1_epi32(word_at(xl, elem(i)));
            a[i / 2] = dpbusd_512(a[i / 2], x, w[i]);
        }
        _mm512_add_epi32(_mm512_add_epi32(a[0], a[1]), _mm512_add_epi32(a[2], a[3]))
    }
}

#[inline(always)]
unsafe fn q4_bytes_avx512<const Q41: bool>(t: &Tile) {
    unsafe {
        let m4 = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps()];
        for k in 0..t.nb {
            let b = t.w.add(k * t.gb);
            prefetch_ahead(b, t.gb);
            let mut w = [_mm512_setzero_si512(); 8];
            for c in 0..4 {
                let v = _mm512_loadu_si512(b.add(64 * c) as *const _);
                w[2 * c] = _mm512_and_si512(v, m4);
                w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
            }
            let mut s = byte_dots_512(t, k, &w, q4_element, |w| w);
            if !Q41 {
                // The quants are unsigned here (the token tiles subtract 8 from each).
                s = _mm512_sub_epi32(s, _mm512_set1_epi32(8 * *t.xi.add(k)));
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(b.add(256) as *const __m256i));
            acc[0] = q4_scale_512::<Q41>(t, k, b, 0, dw, s, acc[0]);
        }
        store_rows(t, &acc);
    }
}

#[inline(always)]
unsafe fn q8_bytes_avx512(t: &Tile) {
    unsafe {
        let flip = _mm512_set1_epi8(-128);
        let mut acc = [_mm512_setzero_ps()];
        for k in 0..t.nb {
            let b = t.w.add(k * t.gb);
            prefetch_ahead(b, t.gb);
            let w: [__m512i; 8] =
                std::array::from_fn(|c| _mm512_loadu_si512(b.add(64 * c) as *const _));
            let s = byte_dots_512(t, k, &w, |c| 4 * c, |w| _mm512_xor_si512(w, flip));
            let s = _mm512_sub_epi32(s, _mm512_set1_epi32(*t.xhc.add(k)));
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(b.add(512) as *const __m256i));
            acc[0] = q8_scale_512(t, k, 0, dw, s, acc[0]);
        }
        store_rows(t, &acc);
    }
}
