//! Scalar dequantization of GGML blocks (the reference reading of every format).

use crate::quant_type::QuantType;

#[inline(always)]
pub fn f16_at(b: &[u8], i: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Dequantize one contiguous run of blocks: `bytes.len() == ty.row_bytes(out.len())`.
///
/// Panics if the lengths do not agree.
pub fn dequantize_row(ty: QuantType, bytes: &[u8], out: &mut [f32]) {
    dequantize_row_inline(ty, bytes, out)
}

/// [`dequantize_row`], inlined into callers compiled with wider SIMD (which autovectorize it).
#[inline(always)]
pub fn dequantize_row_inline(ty: QuantType, bytes: &[u8], out: &mut [f32]) {
    let expected = ty.row_bytes(out.len());
    assert_eq!(
        Some(bytes.len()),
        expected,
        "dequantize_row: {} bytes for {} {} values",
        bytes.len(),
        out.len(),
        ty.name()
    );
    let bb = ty.block_bytes();
    let bl = ty.block_len();
    match ty {
        QuantType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        QuantType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        QuantType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        _ => {
            for (blk, o) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(bl)) {
                dequantize_block(ty, blk, o);
            }
        }
    }
}

/// One block of a block-quantized type.
#[inline(always)]
pub fn dequantize_block(ty: QuantType, b: &[u8], y: &mut [f32]) {
    match ty {
        QuantType::Q4_0 => {
            let d = f16_at(b, 0);
            let qs = &b[2..18];
            for j in 0..16 {
                y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
                y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
            }
        }
        QuantType::Q4_1 => {
            let d = f16_at(b, 0);
            let m = f16_at(b, 2);
            let qs = &b[4..20];
            for j in 0..16 {
                y[j] = (qs[j] & 0x0F) as f32 * d + m;
                y[j + 16] = (qs[j] >> 4) as f32 * d + m;
            }
        }
        QuantType::Q8_0 => {
            let d = f16_at(b, 0);
            for j in 0..32 {
                y[j] = (b[2 + j] as i8) as f32 * d;
            }
        }
        QuantType::Q4_K => {
            // d: f16, dmin: f16, scales[12] (6-bit scale/min pairs), qs[128]
            let d = f16_at(b, 0);
            let dmin = f16_at(b, 2);
            let scales = &b[4..16];
            let qs = &b[16..144];
            for j in 0..4 {
                let (sc1, m1) = scale_min_k4(2 * j, scales);
                let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
                let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
                let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
                let q = &qs[32 * j..32 * j + 32];
                let o = &mut y[64 * j..64 * j + 64];
                for l in 0..32 {
                    o[l] = d1 * (q[l] & 0x0F) as f32 - m1;
                    o[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
                }
            }
        }
        QuantType::Q6_K => {
            // ql[128], qh[64], scales[16] (i8), d: f16
            let ql = &b[0..128];
            let qh = &b[128..192];
            let sc = &b[192..208];
            let d = f16_at(b, 208);
            for n in 0..2 {
                let ql = &ql[64 * n..];
                let qh = &qh[32 * n..];
                let sc = &sc[8 * n..];
                let o = &mut y[128 * n..128 * n + 128];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    o[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                    o[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                    o[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                    o[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                }
            }
        }
        QuantType::F32 | QuantType::F16 | QuantType::BF16 => {
            unreachable!("float types have no blocks")
        }
    }
}

/// GGML's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` (0..8) of a Q4_K block.
#[inline(always)]
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}
