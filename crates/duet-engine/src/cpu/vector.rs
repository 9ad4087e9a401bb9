//! Row-wise f32 kernels that are cheap next to the matrix products: RMSNorm, SiLU·mul.

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

#[cfg(test)]
mod tests {
    use super::*;

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
