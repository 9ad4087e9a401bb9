//! AVX-512 (VNNI) and AVX2 kernels over the packed group layout (see `packed.rs`), and f32 dots.

// Kernels index several parallel arrays with one counter.
#![allow(clippy::needless_range_loop)]

use super::QuantType;
use super::packed::Tile;
use std::arch::x86_64::*;

/// Token tile of the AVX-512 kernels (accumulators held in registers).
pub(crate) const NT_512: usize = 8;
/// Token tile of the AVX2 kernels.
pub(crate) const NT_256: usize = 4;

macro_rules! dispatch_nt {
    ($f:ident, $nt:expr, $max:expr, ($($args:expr),*)) => {
        match $nt {
            1 => $f::<1>($($args),*),
            2 => $f::<2>($($args),*),
            3 => $f::<3>($($args),*),
            4 => $f::<4>($($args),*),
            5 if $max >= 5 => $f::<5>($($args),*),
            6 if $max >= 6 => $f::<6>($($args),*),
            7 if $max >= 7 => $f::<7>($($args),*),
            8 if $max >= 8 => $f::<8>($($args),*),
            _ => unreachable!("token tile too large"),
        }
    };
}

#[inline(always)]
unsafe fn bcast(p: *const i8, i: usize) -> i32 {
    unsafe { (p as *const i32).add(i).read_unaligned() }
}

/// `nt <= NT_512` tokens of one group.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
pub(crate) unsafe fn tile_avx512(ty: QuantType, t: &Tile, nt: usize) {
    unsafe {
        match ty {
            QuantType::Q4_0 => dispatch_nt!(q4_avx512_false, nt, NT_512, (t)),
            QuantType::Q4_1 => dispatch_nt!(q4_avx512_true, nt, NT_512, (t)),
            QuantType::Q8_0 => dispatch_nt!(q8_avx512, nt, NT_512, (t)),
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
        let m4 = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); NT];
        for k in 0..t.nb {
            let b = t.w.add(k * t.gb);
            let mut lo = [_mm512_setzero_si512(); 4];
            let mut hi = [_mm512_setzero_si512(); 4];
            for c in 0..4 {
                let v = _mm512_loadu_si512(b.add(64 * c) as *const _);
                lo[c] = _mm512_and_si512(v, m4);
                hi[c] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(b.add(256) as *const __m256i));
            let mw = if Q41 {
                _mm512_cvtph_ps(_mm256_loadu_si256(b.add(288) as *const __m256i))
            } else {
                _mm512_setzero_ps()
            };
            for ti in 0..NT {
                let x = t.xq.add(ti * t.xs + k * 32);
                let mut s0 = _mm512_setzero_si512();
                let mut s1 = _mm512_setzero_si512();
                for c in 0..4 {
                    s0 = _mm512_dpbusd_epi32(s0, lo[c], _mm512_set1_epi32(bcast(x, c)));
                    s1 = _mm512_dpbusd_epi32(s1, hi[c], _mm512_set1_epi32(bcast(x, 4 + c)));
                }
                let ai = ti * t.nb + k;
                let mut s = _mm512_add_epi32(s0, s1);
                if !Q41 {
                    s = _mm512_sub_epi32(s, _mm512_set1_epi32(8 * *t.xi.add(ai)));
                }
                let dx = _mm512_set1_ps(*t.xd.add(ai));
                acc[ti] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dx), acc[ti]);
                if Q41 {
                    acc[ti] = _mm512_fmadd_ps(mw, _mm512_set1_ps(*t.xsd.add(ai)), acc[ti]);
                }
            }
        }
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

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn q8_avx512<const NT: usize>(t: &Tile) {
    unsafe {
        let ones = _mm512_set1_epi8(1);
        let mut acc = [_mm512_setzero_ps(); NT];
        for k in 0..t.nb {
            let b = t.w.add(k * t.gb);
            let mut w = [_mm512_setzero_si512(); 8];
            let mut ws0 = _mm512_setzero_si512();
            let mut ws1 = _mm512_setzero_si512();
            for c in 0..8 {
                w[c] = _mm512_loadu_si512(b.add(64 * c) as *const _);
            }
            for c in 0..4 {
                ws0 = _mm512_dpbusd_epi32(ws0, ones, w[c]);
                ws1 = _mm512_dpbusd_epi32(ws1, ones, w[4 + c]);
            }
            // x is fed as unsigned (x + 128); subtract 128 * sum(w) per row.
            let corr = _mm512_slli_epi32::<7>(_mm512_add_epi32(ws0, ws1));
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(b.add(512) as *const __m256i));
            for ti in 0..NT {
                let x = t.xq.add(ti * t.xs + k * 32);
                let mut s0 = _mm512_setzero_si512();
                let mut s1 = _mm512_setzero_si512();
                for c in 0..4 {
                    let x0 = bcast(x, c) ^ 0x8080_8080u32 as i32;
                    let x1 = bcast(x, 4 + c) ^ 0x8080_8080u32 as i32;
                    s0 = _mm512_dpbusd_epi32(s0, _mm512_set1_epi32(x0), w[c]);
                    s1 = _mm512_dpbusd_epi32(s1, _mm512_set1_epi32(x1), w[4 + c]);
                }
                let ai = ti * t.nb + k;
                let s = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), corr);
                let dx = _mm512_set1_ps(*t.xd.add(ai));
                acc[ti] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dx), acc[ti]);
            }
        }
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

/// `nt <= NT_256` tokens of one group.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn tile_avx2(ty: QuantType, t: &Tile, nt: usize) {
    unsafe {
        match ty {
            QuantType::Q4_0 => dispatch_nt!(q4_avx2_false, nt, NT_256, (t)),
            QuantType::Q4_1 => dispatch_nt!(q4_avx2_true, nt, NT_256, (t)),
            QuantType::Q8_0 => dispatch_nt!(q8_avx2, nt, NT_256, (t)),
            _ => unreachable!(),
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_avx2_false<const NT: usize>(t: &Tile) {
    unsafe { q4_avx2::<NT, false>(t) }
}
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_avx2_true<const NT: usize>(t: &Tile) {
    unsafe { q4_avx2::<NT, true>(t) }
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

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_avx2<const NT: usize, const Q41: bool>(t: &Tile) {
    unsafe {
        let m4 = _mm256_set1_epi8(0x0F);
        let ones16 = _mm256_set1_epi16(1);
        // Rows 0..8 then 8..16 (the two 32-byte halves of every chunk).
        for h in 0..2 {
            if 8 * h >= t.nvalid {
                break;
            }
            let mut acc = [_mm256_setzero_ps(); NT];
            for k in 0..t.nb {
                let b = t.w.add(k * t.gb);
                let mut lo = [_mm256_setzero_si256(); 4];
                let mut hi = [_mm256_setzero_si256(); 4];
                for c in 0..4 {
                    let v = _mm256_loadu_si256(b.add(64 * c + 32 * h) as *const __m256i);
                    lo[c] = _mm256_and_si256(v, m4);
                    hi[c] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                }
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(b.add(256 + 16 * h) as *const __m128i));
                let mw = if Q41 {
                    _mm256_cvtph_ps(_mm_loadu_si128(b.add(288 + 16 * h) as *const __m128i))
                } else {
                    _mm256_setzero_ps()
                };
                for ti in 0..NT {
                    let x = t.xq.add(ti * t.xs + k * 32);
                    // |pair| <= 2 * 15 * 127, eight of them fit in i16.
                    let mut s16 = _mm256_setzero_si256();
                    for c in 0..4 {
                        s16 = _mm256_add_epi16(
                            s16,
                            _mm256_maddubs_epi16(lo[c], _mm256_set1_epi32(bcast(x, c))),
                        );
                        s16 = _mm256_add_epi16(
                            s16,
                            _mm256_maddubs_epi16(hi[c], _mm256_set1_epi32(bcast(x, 4 + c))),
                        );
                    }
                    let mut s = _mm256_madd_epi16(s16, ones16);
                    let ai = ti * t.nb + k;
                    if !Q41 {
                        s = _mm256_sub_epi32(s, _mm256_set1_epi32(8 * *t.xi.add(ai)));
                    }
                    let dx = _mm256_set1_ps(*t.xd.add(ai));
                    acc[ti] =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dx), acc[ti]);
                    if Q41 {
                        acc[ti] = _mm256_fmadd_ps(mw, _mm256_set1_ps(*t.xsd.add(ai)), acc[ti]);
                    }
                }
            }
            for (ti, a) in acc.iter().enumerate() {
                store_partial(t.out.add(ti * t.os + 8 * h), *a, t.nvalid - 8 * h);
            }
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_avx2<const NT: usize>(t: &Tile) {
    unsafe {
        let ones16 = _mm256_set1_epi16(1);
        for h in 0..2 {
            if 8 * h >= t.nvalid {
                break;
            }
            let mut acc = [_mm256_setzero_ps(); NT];
            for k in 0..t.nb {
                let b = t.w.add(k * t.gb);
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(b.add(512 + 16 * h) as *const __m128i));
                for ti in 0..NT {
                    let x = t.xq.add(ti * t.xs + k * 32);
                    let mut s = _mm256_setzero_si256();
                    for c in 0..8 {
                        let w = _mm256_loadu_si256(b.add(64 * c + 32 * h) as *const __m256i);
                        let xb = _mm256_set1_epi32(bcast(x, c));
                        // |w| * sign(x, w) == w * x; a pair is at most 2 * 128 * 127.
                        let p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xb, w));
                        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones16));
                    }
                    let ai = ti * t.nb + k;
                    let dx = _mm256_set1_ps(*t.xd.add(ai));
                    acc[ti] =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dx), acc[ti]);
                }
            }
            for (ti, a) in acc.iter().enumerate() {
                store_partial(t.out.add(ti * t.os + 8 * h), *a, t.nvalid - 8 * h);
            }
        }
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
pub(crate) unsafe fn quantize_acts_avx512(
    x: &[f32],
    qs: &mut [i8],
    d: &mut [f32],
    sd: &mut [f32],
    isum: &mut [i32],
) {
    unsafe {
        let absmask = _mm512_set1_epi32(0x7FFF_FFFF);
        let lo = _mm512_set1_epi32(-127);
        let hi = _mm512_set1_epi32(127);
        for b in 0..d.len() {
            let p = x.as_ptr().add(32 * b);
            let v0 = _mm512_loadu_ps(p);
            let v1 = _mm512_loadu_ps(p.add(16));
            let a0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v0), absmask));
            let a1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v1), absmask));
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
            let db = amax / 127.0;
            let id = _mm512_set1_ps(if db != 0.0 { 1.0 / db } else { 0.0 });
            let q0 = _mm512_min_epi32(
                _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, id)), lo),
                hi,
            );
            let q1 = _mm512_min_epi32(
                _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, id)), lo),
                hi,
            );
            let o = qs.as_mut_ptr().add(32 * b);
            _mm_storeu_si128(o as *mut __m128i, _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128(o.add(16) as *mut __m128i, _mm512_cvtepi32_epi8(q1));
            let s = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            d[b] = db;
            isum[b] = s;
            sd[b] = db * s as f32;
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
        super::dequant::dequantize_row_inline(ty, &bytes[2 * n16..], &mut out[n16..]);
        return;
    }
    super::dequant::dequantize_row_inline(ty, bytes, out)
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
        super::dequant::dequantize_row_inline(ty, &bytes[2 * n8..], &mut out[n8..]);
        return;
    }
    super::dequant::dequantize_row_inline(ty, bytes, out)
}
