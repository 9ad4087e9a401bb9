//! The repacked layout of Q4_0 / Q4_1 / Q8_0 matrices, activation quantization, and the portable
//! (scalar) integer kernels.
//!
//! Rows are taken in groups of [`GROUP`] (16); the last group is padded with zero rows. A group
//! stores, for each block column `k`, one *group-block*: the 16 rows' quants interleaved in 4-byte
//! words — chunk `c` (64 bytes) holds, in lane `r`, bytes `4c..4c+4` of row `r`'s original `qs` —
//! followed by the 16 `d` scales (f16) and, for Q4_1, the 16 `m` offsets (f16). One SIMD register
//! per chunk then yields 16 per-row partial dot products at once, with no horizontal reductions,
//! and the bytes are exactly those of the file (a Q4_1 group-block is 16 × 20 bytes).
//!
//! Activations are quantized once per call to 32-element blocks of i8 (`d = amax / 127`), with the
//! block sums kept for the Q4_0 offset (−8) and the Q4_1 minimum.

// Kernels index several parallel arrays with one counter.
#![allow(clippy::needless_range_loop)]

use super::QuantType;
use super::dequant::f16_at;

pub(crate) const GROUP: usize = 16;

/// 64-byte aligned storage unit.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct A64(pub [u8; 64]);

pub(crate) struct Packed {
    storage: Vec<A64>,
    len: usize,
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
            self.n_groups, self.nb, self.len
        )
    }
}

pub(crate) fn packable(ty: QuantType) -> bool {
    matches!(ty, QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q8_0)
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
    GROUP * ty.block_bytes()
}

impl Packed {
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: A64 is plain bytes; `len <= storage.len() * 64`.
        unsafe { std::slice::from_raw_parts(self.storage.as_ptr() as *const u8, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts_mut(self.storage.as_mut_ptr() as *mut u8, self.len) }
    }

    /// Packs `rows` rows of `cols` values stored in GGML layout (`raw.len() == rows * row_bytes`).
    pub fn pack(ty: QuantType, rows: usize, cols: usize, raw: &[u8]) -> Packed {
        let nb = cols / 32;
        let gb = group_block_bytes(ty);
        let n_groups = rows.div_ceil(GROUP);
        let len = n_groups * nb * gb;
        let mut p = Packed {
            storage: vec![A64([0; 64]); len.div_ceil(64)],
            len,
            nb,
            gb,
            n_groups,
        };
        let rb = nb * ty.block_bytes();
        let bytes = p.bytes_mut();
        for r in 0..rows {
            let row = &raw[r * rb..(r + 1) * rb];
            for k in 0..nb {
                let blk = &row[k * ty.block_bytes()..(k + 1) * ty.block_bytes()];
                let dst = &mut bytes[((r / GROUP) * nb + k) * gb..][..gb];
                put_block(ty, blk, r % GROUP, dst);
            }
        }
        p
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

/// Activations quantized to 32-element i8 blocks, token-major.
#[derive(Default)]
pub(crate) struct QActs {
    pub qs: Vec<i8>,
    /// Scale per (token, block).
    pub d: Vec<f32>,
    /// `d * sum(q)` per (token, block).
    pub sd: Vec<f32>,
    /// `sum(q)` per (token, block).
    pub isum: Vec<i32>,
    /// Blocks per token.
    pub nb: usize,
}

impl QActs {
    pub fn resize(&mut self, n_tokens: usize, cols: usize) {
        let nb = cols / 32;
        self.nb = nb;
        self.qs.resize(n_tokens * cols, 0);
        self.d.resize(n_tokens * nb, 0.0);
        self.sd.resize(n_tokens * nb, 0.0);
        self.isum.resize(n_tokens * nb, 0);
    }
}

/// Rounds to nearest, ties to even, for |v| < 2^22 (exactly what `cvtps2dq` does under the
/// default rounding mode, so every path quantizes identically).
#[inline(always)]
pub(crate) fn round_even(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    (v + MAGIC) - MAGIC
}

/// Quantizes `x` (whole tokens) into the given output slices (same token range).
pub(crate) fn quantize_acts(
    path: super::KernelPath,
    x: &[f32],
    qs: &mut [i8],
    d: &mut [f32],
    sd: &mut [f32],
    isum: &mut [i32],
) {
    assert!(
        qs.len() == x.len()
            && d.len() * 32 == x.len()
            && sd.len() == d.len()
            && isum.len() == d.len()
    );
    match path {
        // SAFETY: the path is supported (checked by the caller) and the lengths agree (above).
        #[cfg(target_arch = "x86_64")]
        super::KernelPath::Avx512 => unsafe {
            super::x86::quantize_acts_avx512(x, qs, d, sd, isum)
        },
        _ => quantize_acts_scalar(x, qs, d, sd, isum),
    }
}

pub(crate) fn quantize_acts_scalar(
    x: &[f32],
    qs: &mut [i8],
    d: &mut [f32],
    sd: &mut [f32],
    isum: &mut [i32],
) {
    for (b, xb) in x.chunks_exact(32).enumerate() {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let db = amax / 127.0;
        let id = if db != 0.0 { 1.0 / db } else { 0.0 };
        let q = &mut qs[b * 32..b * 32 + 32];
        let mut s = 0i32;
        for (qv, &xv) in q.iter_mut().zip(xb) {
            let v = (round_even(xv * id) as i32).clamp(-127, 127);
            *qv = v as i8;
            s += v;
        }
        d[b] = db;
        isum[b] = s;
        sd[b] = db * s as f32;
    }
}

/// Pointers and strides one kernel call needs. `out` points at `out[t0 * rows + g * 16]`.
#[derive(Clone, Copy)]
pub(crate) struct Tile {
    /// Start of the group's first group-block.
    pub w: *const u8,
    pub nb: usize,
    pub gb: usize,
    /// Quantized activations of token t0.
    pub xq: *const i8,
    /// Per-block activation data of token t0.
    pub xd: *const f32,
    pub xsd: *const f32,
    pub xi: *const i32,
    /// Activation bytes per token (`cols`).
    pub xs: usize,
    pub out: *mut f32,
    /// Output stride per token (`rows`).
    pub os: usize,
    /// Valid rows in this group (1..=16).
    pub nvalid: usize,
}

/// Portable kernel for `nt` tokens of one group. Same arithmetic (and same f32 operation order
/// per output) as the SIMD kernels, so results are bit-identical. Written lane-wise over the 16
/// rows of the group so that compilers can vectorize it (e.g. NEON on aarch64).
pub(crate) unsafe fn tile_scalar(ty: QuantType, t: &Tile, nt: usize) {
    unsafe {
        let (nq, _, _, _) = geometry(ty);
        let qbase = GROUP * nq;
        for ti in 0..nt {
            let xq = t.xq.add(ti * t.xs);
            let mut acc = [0.0f32; GROUP];
            for k in 0..t.nb {
                let blk = std::slice::from_raw_parts(t.w.add(k * t.gb), t.gb);
                let x = std::slice::from_raw_parts(xq.add(k * 32), 32);
                let ai = ti * t.nb + k;
                let mut s = [0i32; GROUP];
                if ty == QuantType::Q8_0 {
                    for c in 0..8 {
                        let ch = &blk[c * 64..c * 64 + 64];
                        for r in 0..GROUP {
                            for i in 0..4 {
                                s[r] += (ch[r * 4 + i] as i8) as i32 * x[4 * c + i] as i32;
                            }
                        }
                    }
                } else {
                    for c in 0..4 {
                        let ch = &blk[c * 64..c * 64 + 64];
                        for r in 0..GROUP {
                            for i in 0..4 {
                                let w = ch[r * 4 + i];
                                s[r] += (w & 0x0F) as i32 * x[4 * c + i] as i32
                                    + (w >> 4) as i32 * x[16 + 4 * c + i] as i32;
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
