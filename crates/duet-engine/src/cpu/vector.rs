//! Small f32 vector kernels (dot, axpy, RMSNorm), with AVX2/FMA versions chosen at run time.

use std::sync::OnceLock;

type DotFn = fn(&[f32], &[f32]) -> f32;
type AxpyFn = fn(f32, &[f32], &mut [f32]);

struct Kernels {
    dot: DotFn,
    axpy: AxpyFn,
}

fn kernels() -> &'static Kernels {
    static K: OnceLock<Kernels> = OnceLock::new();
    K.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return Kernels {
                dot: avx2::dot,
                axpy: avx2::axpy,
            };
        }
        Kernels {
            dot: dot_portable,
            axpy: axpy_portable,
        }
    })
}

/// `Σ a[i]·b[i]`.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    (kernels().dot)(a, b)
}

/// `y += alpha·x`.
#[inline]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    (kernels().axpy)(alpha, x, y)
}

pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let mean_sq = dot(x, x) / x.len() as f32;
    let scale = 1.0 / (mean_sq + eps).sqrt();
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = xi * scale * wi;
    }
}

fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8 * 8;
    for (ca, cb) in a[..chunks].chunks_exact(8).zip(b[..chunks].chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += ca[i] * cb[i];
        }
    }
    let tail: f32 = a[chunks..]
        .iter()
        .zip(&b[chunks..])
        .map(|(x, y)| x * y)
        .sum();
    acc.iter().sum::<f32>() + tail
}

fn axpy_portable(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    pub fn dot(a: &[f32], b: &[f32]) -> f32 {
        // SAFETY: chosen only when AVX2 and FMA are present.
        unsafe { dot_impl(a, b) }
    }

    pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
        // SAFETY: chosen only when AVX2 and FMA are present.
        unsafe { axpy_impl(alpha, x, y) }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_impl(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut i = 0;
        unsafe {
            while i + 16 <= n {
                acc0 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(a.as_ptr().add(i)),
                    _mm256_loadu_ps(b.as_ptr().add(i)),
                    acc0,
                );
                acc1 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(a.as_ptr().add(i + 8)),
                    _mm256_loadu_ps(b.as_ptr().add(i + 8)),
                    acc1,
                );
                i += 16;
            }
            while i + 8 <= n {
                acc0 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(a.as_ptr().add(i)),
                    _mm256_loadu_ps(b.as_ptr().add(i)),
                    acc0,
                );
                i += 8;
            }
        }
        let acc = _mm256_add_ps(acc0, acc1);
        let hi = _mm256_extractf128_ps(acc, 1);
        let lo = _mm256_castps256_ps128(acc);
        let s = _mm_add_ps(hi, lo);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        let mut total = _mm_cvtss_f32(s);
        while i < n {
            total += a[i] * b[i];
            i += 1;
        }
        total
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn axpy_impl(alpha: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len().min(y.len());
        let va = _mm256_set1_ps(alpha);
        let mut i = 0;
        unsafe {
            while i + 8 <= n {
                let yv = _mm256_loadu_ps(y.as_ptr().add(i));
                _mm256_storeu_ps(
                    y.as_mut_ptr().add(i),
                    _mm256_fmadd_ps(va, _mm256_loadu_ps(x.as_ptr().add(i)), yv),
                );
                i += 8;
            }
        }
        while i < n {
            y[i] += alpha * x[i];
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simd_and_portable_agree() {
        let a: Vec<f32> = (0..67).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..67).map(|i| (i as f32 * 0.11).cos()).collect();
        let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        assert!((dot(&a, &b) as f64 - exact).abs() < 1e-5);
        assert!((dot_portable(&a, &b) as f64 - exact).abs() < 1e-5);
        let mut y1 = b.clone();
        let mut y2 = b.clone();
        axpy(0.5, &a, &mut y1);
        axpy_portable(0.5, &a, &mut y2);
        for (p, q) in y1.iter().zip(&y2) {
            assert!((p - q).abs() < 1e-6);
        }
    }
}
