//! Row-wise f32 kernels that are cheap next to the matrix products: RMSNorm, SiLU·mul, exp.

use crate::quant::KernelPath;

pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let mut acc = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
    for c in chunks {
        for j in 0..8 {
            acc[j] += c[j] * c[j];
        }
    }
    let mean_sq = (acc.iter().sum::<f32>() + tail) / x.len() as f32;
    let scale = 1.0 / (mean_sq + eps).sqrt();
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = xi * scale * wi;
    }
}

/// `out[i] = silu(gate[i]) * up[i]` on the kernel `path`: the same loop compiled a second and a
/// third time for AVX-512 (16 lanes) and AVX2 (8 lanes), bit-identical (no contraction into FMA).
pub fn silu_mul_slices(path: KernelPath, gate: &[f32], up: &[f32], out: &mut [f32]) {
    match path {
        // SAFETY (both): `path` is only ever a path this CPU supports.
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512 => unsafe { silu_mul_avx512(gate, up, out) },
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx2 | KernelPath::Avx2Vnni => unsafe { silu_mul_avx2(gate, up, out) },
        _ => silu_mul_loop(gate, up, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn silu_mul_avx512(gate: &[f32], up: &[f32], out: &mut [f32]) {
    silu_mul_loop(gate, up, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) {
    silu_mul_loop(gate, up, out)
}

#[inline(always)]
fn silu_mul_loop(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = silu_mul(g, u);
    }
}

/// `silu(g) * u = g / (1 + e^-g) * u`.
#[inline(always)]
pub fn silu_mul(g: f32, u: f32) -> f32 {
    g / (1.0 + exp_approx(-g)) * u
}

/// `e^x`: a Cody-Waite range reduction and a degree-6 polynomial (relative error below 2e-7),
/// written branch-free so loops over it vectorise.
#[inline(always)]
pub fn exp_approx(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Below -87 the result is ~0 and above 88 ~f32::MAX (2^n would leave the exponent field).
    let x = x.clamp(-87.0, 88.0);
    // Round to nearest via the 1.5·2^23 trick (vectorises, unlike f32::round): `shifted` holds
    // `n` in its low mantissa bits, so its bits minus those of 1.5·2^23 are `n` as an integer —
    // the same value as `n as i32`, whose saturating conversion LLVM does lane by lane.
    const SHIFT: f32 = 12_582_912.0;
    let shifted = x * LOG2E + SHIFT;
    let n = shifted - SHIFT;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (0.166_666_67
                    + r * (0.041_666_668 + r * (0.008_333_334 + r * 0.001_388_889)))));
    let n_int = shifted.to_bits().wrapping_sub(SHIFT.to_bits());
    let scale = f32::from_bits(n_int.wrapping_add(127) << 23);
    p * scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_approx_is_accurate() {
        let mut worst = 0f64;
        // The whole clamped range, so every exponent `n` from -126 to 127 is built.
        let mut x = -87.0f32;
        while x <= 88.0 {
            let want = (x as f64).exp();
            let got = exp_approx(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 1e-6, "relative error {worst}");
        assert!(exp_approx(-1000.0) < 1e-37);
        assert!(exp_approx(1000.0) > 1e38);
    }

    #[test]
    fn silu_mul_matches_definition_over_the_whole_range() {
        let mut g = -120.0f32;
        while g <= 120.0 {
            let want = g as f64 / (1.0 + (-g as f64).exp()) * 0.75;
            let got = silu_mul(g, 0.75) as f64;
            assert!(
                (got - want).abs() <= 1e-6 * want.abs().max(1e-30),
                "silu({g}) = {got}, want {want}"
            );
            g += 0.0731;
        }
    }

    #[test]
    fn rms_norm_matches_definition() {
        let x: Vec<f32> = (0..67).map(|i| (i as f32 * 0.37).sin()).collect();
        let w: Vec<f32> = (0..67).map(|i| 1.0 + i as f32 * 0.01).collect();
        let mut out = vec![0f32; 67];
        rms_norm(&x, &w, 1e-5, &mut out);
        let ms: f64 = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / 67.0;
        for i in 0..67 {
            let want = x[i] as f64 / (ms + 1e-5).sqrt() * w[i] as f64;
            assert!((out[i] as f64 - want).abs() < 1e-6);
        }
    }
}
