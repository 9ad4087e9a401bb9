//! The repacked layout of block-quantized matrices, activation quantization, and the portable
//! (scalar) integer kernels.
//!
//! Rows are taken in groups of [`GROUP`] (16); the last group is padded with zero rows. A group
//! stores, for each block column `k`, one *group-block*: the 16 rows' quants interleaved in 4-byte
//! words — chunk `c` (64 bytes) holds, in lane `r`, bytes `4c..4c+4` of row `r`'s original `qs` —
//! followed by the 16 `d` scales (f16) and, for Q4_1, the 16 `m` offsets (f16). One SIMD register
//! per chunk then yields 16 per-row partial dot products at once, with no horizontal reductions,
//! and the bytes are exactly those of the file (a Q4_1 group-block is 16 × 20 bytes). Q4_K and
//! Q6_K (256-value super-blocks) follow the same idea, see their layout constants below.
//!
//! Activations are quantized once per call to 32-element blocks of i16 (`d = amax / 32767`,
//! round half to even; relative rounding error ~1e-5 instead of ~4e-3 for 8 bits), stored with
//! each group of 4 in [`PAIR_POS`] order, with the block sums kept for the Q4_0 offset (−8), the
//! Q4_1 / Q4_K minimum and the Q6_K offset (−32, per 16-value half-block). The integer dots are
//! i16 × (4-, 6- or 8-bit quant) products summed in i32 per 32-value block (per 16-value
//! half-block for Q6_K), then scaled in f32; see the bounds above [`tile_scalar`].

// Kernels index several parallel arrays with one counter.
#![allow(clippy::needless_range_loop)]

use super::QuantType;
use crate::huge_pages::HugeBuffer;
use duet_model::dequant::f16_at;

pub(crate) const GROUP: usize = 16;

pub(crate) struct Packed {
    /// On huge pages, page aligned (see `huge_pages.rs`).
    storage: HugeBuffer<u8>,
    /// Block columns per row.
    pub nb: usize,
    /// Bytes per group-block.
    pub gb: usize,
    pub n_groups: usize,
}

impl std::fmt::Debug for Packed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Packed({} groups x {} blocks, {} bytes)",
            self.n_groups,
            self.nb,
            self.storage.len()
        )
    }
}

pub(crate) fn packable(ty: QuantType) -> bool {
    matches!(
        ty,
        QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q8_0 | QuantType::Q4_K | QuantType::Q6_K
    )
}

/// (bytes of quants, offset of d in the original block, offset of m (Q4_1), offset of qs)
fn geometry(ty: QuantType) -> (usize, usize, Option<usize>, usize) {
    match ty {
        QuantType::Q4_0 => (16, 0, None, 2),
        QuantType::Q4_1 => (16, 0, Some(2), 4),
        QuantType::Q8_0 => (32, 0, None, 2),
        _ => unreachable!("not a packable type"),
    }
}

pub(crate) fn group_block_bytes(ty: QuantType) -> usize {
    match ty {
        QuantType::Q4_K => Q4K_GB,
        QuantType::Q6_K => Q6K_GB,
        _ => GROUP * ty.block_bytes(),
    }
}

// Q4_K group-block (16 rows x 256 values): quants as 32 chunks (chunk `8 * jj + c`, lane r =
// bytes `32 jj + 4c .. +4` of row r's `qs`), then the 6-bit scales and mins unpacked to one byte
// each (`[j * 16 + r]`, sub-block j), then d and dmin (f16 x 16 each).
pub(crate) const Q4K_SC: usize = 2048;
pub(crate) const Q4K_MN: usize = Q4K_SC + 128;
pub(crate) const Q4K_D: usize = Q4K_MN + 128;
pub(crate) const Q4K_DMIN: usize = Q4K_D + 32;
const Q4K_GB: usize = Q4K_DMIN + 32;

// Q6_K group-block (16 rows x 256 values, exactly 16 x 210 bytes): `ql` as 32 chunks (lane r =
// bytes `4w..4w+4` of row r's `ql`), `qh` as 16 chunks, the 16 i8 scales (`[s * 16 + r]`), d.
pub(crate) const Q6K_QH: usize = 2048;
pub(crate) const Q6K_SC: usize = Q6K_QH + 1024;
pub(crate) const Q6K_D: usize = Q6K_SC + 256;
const Q6K_GB: usize = Q6K_D + 32;

impl Packed {
    pub fn bytes(&self) -> &[u8] {
        &self.storage
    }

    /// Packs `rows` rows of `cols` values stored in GGML layout (`raw.len() == rows * row_bytes`).
    /// Fails only when the memory for them cannot be mapped.
    pub fn pack(ty: QuantType, rows: usize, cols: usize, raw: &[u8]) -> std::io::Result<Packed> {
        let nb = cols / ty.block_len();
        let gb = group_block_bytes(ty);
        let n_groups = rows.div_ceil(GROUP);
        let mut p = Packed {
            storage: HugeBuffer::zeroed(n_groups * nb * gb)?,
            nb,
            gb,
            n_groups,
        };
        let rb = nb * ty.block_bytes();
        let bytes = &mut p.storage[..];
        for r in 0..rows {
            let row = &raw[r * rb..(r + 1) * rb];
            for k in 0..nb {
                let blk = &row[k * ty.block_bytes()..(k + 1) * ty.block_bytes()];
                let dst = &mut bytes[((r / GROUP) * nb + k) * gb..][..gb];
                put_block(ty, blk, r % GROUP, dst);
            }
        }
        Ok(p)
    }

    /// Row `r` in the original GGML block layout.
    pub fn unpack_row(&self, ty: QuantType, r: usize, out: &mut [u8]) {
        let bb = ty.block_bytes();
        let bytes = self.bytes();
        for k in 0..self.nb {
            let src = &bytes[((r / GROUP) * self.nb + k) * self.gb..][..self.gb];
            get_block(ty, src, r % GROUP, &mut out[k * bb..(k + 1) * bb]);
        }
    }
}

fn put_block(ty: QuantType, blk: &[u8], lane: usize, dst: &mut [u8]) {
    if ty == QuantType::Q6_K {
        for w in 0..32 {
            dst[w * 64 + lane * 4..w * 64 + lane * 4 + 4].copy_from_slice(&blk[4 * w..4 * w + 4]);
        }
        for w in 0..16 {
            let o = Q6K_QH + w * 64 + lane * 4;
            dst[o..o + 4].copy_from_slice(&blk[128 + 4 * w..128 + 4 * w + 4]);
        }
        for sb in 0..16 {
            dst[Q6K_SC + sb * 16 + lane] = blk[192 + sb];
        }
        dst[Q6K_D + 2 * lane..Q6K_D + 2 * lane + 2].copy_from_slice(&blk[208..210]);
        return;
    }
    if ty == QuantType::Q4_K {
        for q in 0..32 {
            dst[q * 64 + lane * 4..q * 64 + lane * 4 + 4]
                .copy_from_slice(&blk[16 + 4 * q..16 + 4 * q + 4]);
        }
        for j in 0..8 {
            let (sc, m) = duet_model::dequant::scale_min_k4(j, &blk[4..16]);
            dst[Q4K_SC + j * 16 + lane] = sc;
            dst[Q4K_MN + j * 16 + lane] = m;
        }
        dst[Q4K_D + 2 * lane..Q4K_D + 2 * lane + 2].copy_from_slice(&blk[0..2]);
        dst[Q4K_DMIN + 2 * lane..Q4K_DMIN + 2 * lane + 2].copy_from_slice(&blk[2..4]);
        return;
    }
    let (nq, d_off, m_off, qs_off) = geometry(ty);
    let qbase = GROUP * nq; // scales follow the quants
    for c in 0..nq / 4 {
        dst[c * 64 + lane * 4..c * 64 + lane * 4 + 4]
            .copy_from_slice(&blk[qs_off + 4 * c..qs_off + 4 * c + 4]);
    }
    dst[qbase + 2 * lane..qbase + 2 * lane + 2].copy_from_slice(&blk[d_off..d_off + 2]);
    if let Some(m) = m_off {
        dst[qbase + 32 + 2 * lane..qbase + 32 + 2 * lane + 2].copy_from_slice(&blk[m..m + 2]);
    }
}

fn get_block(ty: QuantType, src: &[u8], lane: usize, blk: &mut [u8]) {
    if ty == QuantType::Q6_K {
        for w in 0..32 {
            blk[4 * w..4 * w + 4].copy_from_slice(&src[w * 64 + lane * 4..w * 64 + lane * 4 + 4]);
        }
        for w in 0..16 {
            let o = Q6K_QH + w * 64 + lane * 4;
            blk[128 + 4 * w..128 + 4 * w + 4].copy_from_slice(&src[o..o + 4]);
        }
        for sb in 0..16 {
            blk[192 + sb] = src[Q6K_SC + sb * 16 + lane];
        }
        blk[208..210].copy_from_slice(&src[Q6K_D + 2 * lane..Q6K_D + 2 * lane + 2]);
        return;
    }
    if ty == QuantType::Q4_K {
        for q in 0..32 {
            blk[16 + 4 * q..16 + 4 * q + 4]
                .copy_from_slice(&src[q * 64 + lane * 4..q * 64 + lane * 4 + 4]);
        }
        // Inverse of get_scale_min_k4: all 96 bits of the 12 bytes are used, so this is exact.
        let sc: [u8; 8] = std::array::from_fn(|j| src[Q4K_SC + j * 16 + lane]);
        let m: [u8; 8] = std::array::from_fn(|j| src[Q4K_MN + j * 16 + lane]);
        let q = &mut blk[4..16];
        for j in 0..4 {
            q[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
            q[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
            q[j + 8] = (sc[j + 4] & 15) | ((m[j + 4] & 15) << 4);
        }
        blk[0..2].copy_from_slice(&src[Q4K_D + 2 * lane..Q4K_D + 2 * lane + 2]);
        blk[2..4].copy_from_slice(&src[Q4K_DMIN + 2 * lane..Q4K_DMIN + 2 * lane + 2]);
        return;
    }
    let (nq, d_off, m_off, qs_off) = geometry(ty);
    let qbase = GROUP * nq;
    for c in 0..nq / 4 {
        blk[qs_off + 4 * c..qs_off + 4 * c + 4]
            .copy_from_slice(&src[c * 64 + lane * 4..c * 64 + lane * 4 + 4]);
    }
    blk[d_off..d_off + 2].copy_from_slice(&src[qbase + 2 * lane..qbase + 2 * lane + 2]);
    if let Some(m) = m_off {
        blk[m..m + 2].copy_from_slice(&src[qbase + 32 + 2 * lane..qbase + 32 + 2 * lane + 2]);
    }
}

/// Position of element `i` (0..4) of each 4-element group in the quantized activation storage.
///
/// Activations are stored as `[x0, x2, x1, x3]` per group of 4, so that the i16 pair (32-bit
/// word) `2g` holds elements `(4g, 4g+2)` and word `2g+1` holds `(4g+1, 4g+3)`. These pair with
/// the even / odd bytes of a row's 4-byte word in the packed weights, which the SIMD kernels
/// widen to i16 pairs with one shift and one mask (no shuffles).
pub(crate) const PAIR_POS: [usize; 4] = [0, 2, 1, 3];

/// Largest quantized activation magnitude.
pub(crate) const QMAX: f32 = 32767.0;

/// Activations quantized to 32-element i16 blocks (`d = amax / 32767`), token-major, each group
/// of 4 stored in [`PAIR_POS`] order.
#[derive(Default)]
pub(crate) struct QActs {
    pub qs: Vec<i16>,
    /// Scale per (token, block).
    pub d: Vec<f32>,
    /// `d * sum(q)` per (token, block).
    pub sd: Vec<f32>,
    /// `sum(q)` per (token, block) (|sum| <= 32 * 32767).
    pub isum: Vec<i32>,
    /// Sum of the first 16 `q` of each (token, block).
    pub isum_lo: Vec<i32>,
    /// Blocks per token.
    pub nb: usize,
    /// `qs` in the layout of the AVX-512 kernels (`x86::interleave_tiles`), on that path only.
    pub tiled: Vec<i32>,
    /// One token's `qs` split into high and low bytes, and `32768 * sum(high)` per block, for
    /// the split-byte kernels (`x86::split_bytes`), on their paths only.
    pub hi: Vec<i8>,
    pub lo: Vec<u8>,
    pub hi_corr: Vec<i32>,
}

impl QActs {
    pub fn resize(&mut self, n_tokens: usize, cols: usize) {
        let nb = cols / 32;
        self.nb = nb;
        self.qs.resize(n_tokens * cols, 0);
        self.d.resize(n_tokens * nb, 0.0);
        self.sd.resize(n_tokens * nb, 0.0);
        self.isum.resize(n_tokens * nb, 0);
        self.isum_lo.resize(n_tokens * nb, 0);
    }
}

/// Rounds to nearest, ties to even, for |v| < 2^22 (exactly what `cvtps2dq` does under the
/// default rounding mode, so every path quantizes identically).
#[inline(always)]
pub(crate) fn round_even(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    (v + MAGIC) - MAGIC
}

/// Where quantized activations of some tokens go: all of a [`QActs`] ([`QActs::blocks`]) or one
/// thread's token range of it.
pub(crate) struct ActBlocks<'a> {
    pub qs: &'a mut [i16],
    pub d: &'a mut [f32],
    pub sd: &'a mut [f32],
    pub isum: &'a mut [i32],
    pub isum_lo: &'a mut [i32],
}

/// Quantizes `x` (whole tokens) into the given output slices (same token range).
pub(crate) fn quantize_acts(path: super::KernelPath, x: &[f32], out: ActBlocks<'_>) {
    let nb = out.d.len();
    assert!(
        out.qs.len() == x.len()
            && nb * 32 == x.len()
            && out.sd.len() == nb
            && out.isum.len() == nb
            && out.isum_lo.len() == nb
    );
    match path {
        // SAFETY: the path is supported (checked by the caller) and the lengths agree (above).
        #[cfg(target_arch = "x86_64")]
        super::KernelPath::Avx512 => unsafe { super::x86::quantize_acts_avx512(x, out) },
        #[cfg(target_arch = "x86_64")]
        super::KernelPath::Avx2 | super::KernelPath::Avx2Vnni => unsafe {
            super::x86::quantize_acts_avx2(x, out)
        },
        _ => quantize_acts_scalar(x, out),
    }
}

pub(crate) fn quantize_acts_scalar(x: &[f32], out: ActBlocks<'_>) {
    for (b, xb) in x.chunks_exact(32).enumerate() {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let db = amax / QMAX;
        let id = if db != 0.0 { 1.0 / db } else { 0.0 };
        let q = &mut out.qs[b * 32..b * 32 + 32];
        let mut s = 0i32;
        for (i, &xv) in xb.iter().enumerate() {
            let v = (round_even(xv * id) as i32).clamp(-32767, 32767);
            q[(i & !3) + PAIR_POS[i & 3]] = v as i16;
            s += v;
            if i == 15 {
                out.isum_lo[b] = s;
            }
        }
        out.d[b] = db;
        out.isum[b] = s;
        out.sd[b] = db * s as f32;
    }
}

/// Pointers and strides one kernel call needs. `out` points at `out[t0 * rows + g * 16]`.
#[derive(Clone, Copy)]
pub(crate) struct Tile {
    /// Start of the group's first group-block.
    pub w: *const u8,
    pub nb: usize,
    pub gb: usize,
    /// Quantized activations of token t0 ([`PAIR_POS`] order); on the AVX-512 path those of
    /// the tile, interleaved by token (`x86::interleave_tiles`).
    pub xq: *const i16,
    /// Activation blocks (of 32) per token.
    pub anb: usize,
    /// Per-block activation data of token t0.
    pub xd: *const f32,
    pub xsd: *const f32,
    pub xi: *const i32,
    /// Sums of the first 16 quantized activations of each block.
    pub xilo: *const i32,
    /// Token t0's activations split into bytes (`x86::split_bytes`): read by the split-byte
    /// kernels only, and written only for their calls.
    pub xhi: *const i8,
    pub xlo: *const u8,
    pub xhc: *const i32,
    /// Activation values per token (`cols`), between tokens' rows of `xq` (not on the AVX-512
    /// path).
    pub xs: usize,
    pub out: *mut f32,
    /// Output stride per token (`rows`).
    pub os: usize,
    /// Valid rows from `w` on: 1..=16 for a row group; up to 32 for a unit of the AVX2 kernels
    /// (`x86::unit_avx2`: two groups, the second one's group-blocks after the first one's).
    pub nvalid: usize,
}

/// Activation `e` (0..32) of a block stored in [`PAIR_POS`] order, widened.
#[inline(always)]
fn act(x: &[i16], e: usize) -> i32 {
    x[(e & !3) + PAIR_POS[e & 3]] as i32
}

// Integer bounds (per block or sub-block, before any scaling): |q_x| <= 32767 and
//   Q4_0 / Q4_1 / Q4_K: 32 products of a 4-bit quant (0..15): |sum| <= 15.7e6, minus 8 * isum;
//   Q8_0: 32 products with |q_w| <= 128: |sum| <= 134.2e6;
//   Q6_K: 16 products of a 6-bit quant (0..63) per half-block: <= 33.0e6, minus 32 * isum_half.
// All far inside i32; every scale (including the Q6_K sub-block scales) is applied in f32.

/// Portable kernel for `nt` tokens of one group. Same arithmetic (and same f32 operation order
/// per output) as the SIMD kernels, so results are bit-identical. Written lane-wise over the 16
/// rows of the group so that compilers can vectorize it (e.g. NEON on aarch64).
pub(crate) unsafe fn tile_scalar(ty: QuantType, t: &Tile, nt: usize) {
    if ty == QuantType::Q4_K {
        return unsafe { tile_q4k_scalar(t, nt) };
    }
    if ty == QuantType::Q6_K {
        return unsafe { tile_q6k_scalar(t, nt) };
    }
    unsafe {
        let (nq, _, _, _) = geometry(ty);
        let qbase = GROUP * nq;
        for ti in 0..nt {
            let xq = t.xq.add(ti * t.xs);
            let mut acc = [0.0f32; GROUP];
            for k in 0..t.nb {
                let blk = std::slice::from_raw_parts(t.w.add(k * t.gb), t.gb);
                let x = std::slice::from_raw_parts(xq.add(k * 32), 32);
                let ai = ti * t.anb + k;
                let mut s = [0i32; GROUP];
                if ty == QuantType::Q8_0 {
                    for c in 0..8 {
                        let ch = &blk[c * 64..c * 64 + 64];
                        for r in 0..GROUP {
                            for i in 0..4 {
                                s[r] += (ch[r * 4 + i] as i8) as i32 * act(x, 4 * c + i);
                            }
                        }
                    }
                } else {
                    for c in 0..4 {
                        let ch = &blk[c * 64..c * 64 + 64];
                        for r in 0..GROUP {
                            for i in 0..4 {
                                let w = ch[r * 4 + i];
                                s[r] += (w & 0x0F) as i32 * act(x, 4 * c + i)
                                    + (w >> 4) as i32 * act(x, 16 + 4 * c + i);
                            }
                        }
                    }
                    if ty == QuantType::Q4_0 {
                        let off = 8 * *t.xi.add(ai);
                        s.iter_mut().for_each(|v| *v -= off);
                    }
                }
                let dx = *t.xd.add(ai);
                let sc = &blk[qbase..];
                for r in 0..GROUP {
                    acc[r] = (s[r] as f32).mul_add(f16_at(sc, 2 * r) * dx, acc[r]);
                }
                if ty == QuantType::Q4_1 {
                    let sdx = *t.xsd.add(ai);
                    for r in 0..GROUP {
                        acc[r] = f16_at(sc, 32 + 2 * r).mul_add(sdx, acc[r]);
                    }
                }
            }
            std::ptr::copy_nonoverlapping(acc.as_ptr(), t.out.add(ti * t.os), t.nvalid);
        }
    }
}

/// Portable Q4_K kernel; the operation order per output matches `x86::q4k_avx512` and
/// `x86::q4k_avx2`.
unsafe fn tile_q4k_scalar(t: &Tile, nt: usize) {
    unsafe {
        for ti in 0..nt {
            let xq = t.xq.add(ti * t.xs);
            let mut acc = [0.0f32; GROUP];
            for k in 0..t.nb {
                let blk = std::slice::from_raw_parts(t.w.add(k * t.gb), t.gb);
                let d: [f32; GROUP] = std::array::from_fn(|r| f16_at(blk, Q4K_D + 2 * r));
                let dmin: [f32; GROUP] = std::array::from_fn(|r| f16_at(blk, Q4K_DMIN + 2 * r));
                for jj in 0..4 {
                    let x0 = std::slice::from_raw_parts(xq.add(k * 256 + 64 * jj), 32);
                    let x1 = std::slice::from_raw_parts(xq.add(k * 256 + 64 * jj + 32), 32);
                    let mut s0 = [0i32; GROUP];
                    let mut s1 = [0i32; GROUP];
                    for c in 0..8 {
                        let ch = &blk[(8 * jj + c) * 64..(8 * jj + c) * 64 + 64];
                        for r in 0..GROUP {
                            for i in 0..4 {
                                let w = ch[r * 4 + i];
                                s0[r] += (w & 0x0F) as i32 * act(x0, 4 * c + i);
                                s1[r] += (w >> 4) as i32 * act(x1, 4 * c + i);
                            }
                        }
                    }
                    for (h, s) in [s0, s1].iter().enumerate() {
                        let j = 2 * jj + h;
                        let ai = ti * t.anb + 8 * k + j;
                        let (dx, sdx) = (*t.xd.add(ai), *t.xsd.add(ai));
                        for r in 0..GROUP {
                            let dsc = d[r] * blk[Q4K_SC + 16 * j + r] as f32;
                            let dm = dmin[r] * blk[Q4K_MN + 16 * j + r] as f32;
                            acc[r] = (s[r] as f32).mul_add(dsc * dx, acc[r]);
                            acc[r] = (-dm).mul_add(sdx, acc[r]);
                        }
                    }
                }
            }
            std::ptr::copy_nonoverlapping(acc.as_ptr(), t.out.add(ti * t.os), t.nvalid);
        }
    }
}

/// Portable Q6_K kernel; the operation order per output matches `x86::q6k_avx512` and
/// `x86::q6k_avx2`.
unsafe fn tile_q6k_scalar(t: &Tile, nt: usize) {
    unsafe {
        for ti in 0..nt {
            let xq = t.xq.add(ti * t.xs);
            let mut acc = [0.0f32; GROUP];
            for k in 0..t.nb {
                let blk = std::slice::from_raw_parts(t.w.add(k * t.gb), t.gb);
                let d: [f32; GROUP] = std::array::from_fn(|r| f16_at(blk, Q6K_D + 2 * r));
                for n in 0..2 {
                    for quarter in 0..4 {
                        // quarter 0: low nibbles of ql[0..32] + qh bits 0-1; 1: low nibbles of
                        // ql[32..64] + bits 2-3; 2: high nibbles of ql[0..32] + bits 4-5; 3: ...
                        let lw = 16 * n + 8 * (quarter % 2);
                        let nshift = 4 * (quarter / 2);
                        let hshift = 2 * quarter;
                        let x = std::slice::from_raw_parts(
                            xq.add(k * 256 + 128 * n + 32 * quarter),
                            32,
                        );
                        let mut s_lo = [0i32; GROUP];
                        let mut s_hi = [0i32; GROUP];
                        for c in 0..8 {
                            let ql = &blk[(lw + c) * 64..(lw + c) * 64 + 64];
                            let qh =
                                &blk[Q6K_QH + (8 * n + c) * 64..Q6K_QH + (8 * n + c) * 64 + 64];
                            for r in 0..GROUP {
                                for i in 0..4 {
                                    let q = ((ql[4 * r + i] >> nshift) & 15)
                                        | (((qh[4 * r + i] >> hshift) & 3) << 4);
                                    let p = q as i32 * act(x, 4 * c + i);
                                    if c < 4 {
                                        s_lo[r] += p;
                                    } else {
                                        s_hi[r] += p;
                                    }
                                }
                            }
                        }
                        let ai = ti * t.anb + 8 * k + 4 * n + quarter;
                        let xlo = *t.xilo.add(ai);
                        let xhi = *t.xi.add(ai) - xlo;
                        let dx = *t.xd.add(ai);
                        let sb = 8 * n + 2 * quarter;
                        for r in 0..GROUP {
                            let sc_lo = blk[Q6K_SC + sb * 16 + r] as i8 as f32;
                            let sc_hi = blk[Q6K_SC + (sb + 1) * 16 + r] as i8 as f32;
                            acc[r] =
                                ((s_lo[r] - 32 * xlo) as f32).mul_add(d[r] * sc_lo * dx, acc[r]);
                            acc[r] =
                                ((s_hi[r] - 32 * xhi) as f32).mul_add(d[r] * sc_hi * dx, acc[r]);
                        }
                    }
                }
            }
            std::ptr::copy_nonoverlapping(acc.as_ptr(), t.out.add(ti * t.os), t.nvalid);
        }
    }
}
