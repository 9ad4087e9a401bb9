//! Least-squares fits of DistServe's latency forms: a step's time as a non-negative linear
//! combination of a few features of the step (a constant, token counts, token products).
//!
//! The fit minimises the squared *relative* error (each sample weighted by 1/t²): the steps span
//! two orders of magnitude (one decode row to thousands of prompt tokens), and an absolute fit
//! would tune the large ones and leave the small ones, which a decode batch is made of, tens of
//! percent off. Coefficients are kept non-negative (a negative cost per token would predict
//! negative times past the measured range): every subset of the features is fitted and the best
//! fit whose coefficients are all non-negative wins, which for three features is the exact
//! non-negative least-squares solution.

use serde::{Deserialize, Serialize};

/// How well a fit reproduces the samples it was fitted to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FitError {
    /// Mean of |predicted − measured| ÷ measured over the samples, in percent.
    pub mean_abs_pct: f64,
    /// The largest of them, in percent.
    pub max_abs_pct: f64,
    pub samples: usize,
}

/// Fits `y ≈ Σ coef_j · x_j` over `(x, y)` samples with non-negative coefficients, minimising the
/// squared relative error. Returns the coefficients (0 for a feature left out) and the error.
/// `None` without a sample with a positive `y`.
pub fn fit_non_negative<const N: usize>(
    samples: &[([f64; N], f64)],
) -> Option<([f64; N], FitError)> {
    let usable: Vec<&([f64; N], f64)> = samples.iter().filter(|(_, y)| *y > 0.0).collect();
    if usable.is_empty() {
        return None;
    }
    let mut best: Option<([f64; N], f64)> = None;
    // Every non-empty subset of the features, as a bit mask.
    for mask in 1u32..(1 << N) {
        let Some(coef) = solve_subset(&usable, mask) else {
            continue;
        };
        if coef.iter().any(|&c| c < 0.0) {
            continue;
        }
        let loss: f64 = usable
            .iter()
            .map(|(x, y)| ((predict(&coef, x) - y) / y).powi(2))
            .sum();
        if best.is_none_or(|(_, b)| loss < b) {
            best = Some((coef, loss));
        }
    }
    let (coef, _) = best?;
    Some((coef, error_of(samples, |x| predict(&coef, x))))
}

/// `Σ coef_j · x_j`.
pub fn predict<const N: usize>(coef: &[f64; N], x: &[f64; N]) -> f64 {
    coef.iter().zip(x).map(|(c, v)| c * v).sum()
}

/// The relative error of `model` over `samples`.
pub fn error_of<const N: usize>(
    samples: &[([f64; N], f64)],
    model: impl Fn(&[f64; N]) -> f64,
) -> FitError {
    let errors: Vec<f64> = samples
        .iter()
        .filter(|(_, y)| *y > 0.0)
        .map(|(x, y)| ((model(x) - y) / y).abs() * 100.0)
        .collect();
    FitError {
        mean_abs_pct: errors.iter().sum::<f64>() / errors.len().max(1) as f64,
        max_abs_pct: errors.iter().copied().fold(0.0, f64::max),
        samples: errors.len(),
    }
}

/// Weighted least squares over the features in `mask` (the others fixed at 0), by the normal
/// equations; `None` when they are singular (a feature constant at 0 over the samples, say).
fn solve_subset<const N: usize>(samples: &[&([f64; N], f64)], mask: u32) -> Option<[f64; N]> {
    let cols: Vec<usize> = (0..N).filter(|j| mask & (1 << j) != 0).collect();
    let k = cols.len();
    // [A | b] of the normal equations, each sample weighted by 1/y².
    let mut m = vec![vec![0.0; k + 1]; k];
    for (x, y) in samples {
        let w = 1.0 / (y * y);
        for (r, &i) in cols.iter().enumerate() {
            for (c, &j) in cols.iter().enumerate() {
                m[r][c] += w * x[i] * x[j];
            }
            m[r][k] += w * x[i] * y;
        }
    }
    let solution = gauss(m)?;
    let mut coef = [0.0; N];
    for (r, &j) in cols.iter().enumerate() {
        coef[j] = solution[r];
    }
    Some(coef)
}

/// Solves `[A | b]` by Gaussian elimination with partial pivoting.
fn gauss(mut m: Vec<Vec<f64>>) -> Option<Vec<f64>> {
    let k = m.len();
    for col in 0..k {
        let pivot = (col..k).max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs()))?;
        // Relative to the row's own scale: features differ by orders of magnitude.
        let scale = m[pivot].iter().map(|v| v.abs()).fold(0.0, f64::max);
        if m[pivot][col].abs() <= scale * 1e-12 {
            return None;
        }
        m.swap(col, pivot);
        let pivot_row = m[col].clone();
        for (r, row) in m.iter_mut().enumerate() {
            if r != col {
                let f = row[col] / pivot_row[col];
                for (v, p) in row.iter_mut().zip(&pivot_row).skip(col) {
                    *v -= f * p;
                }
            }
        }
    }
    Some((0..k).map(|r| m[r][k] / m[r][r]).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exact_form_is_recovered() {
        // t = 2 + 0.5·n + 0.001·n², DistServe's prefill form.
        let samples: Vec<([f64; 3], f64)> = [16.0, 64.0, 128.0, 512.0, 1024.0]
            .iter()
            .map(|&n| ([1.0, n, n * n], 2.0 + 0.5 * n + 0.001 * n * n))
            .collect();
        let (coef, err) = fit_non_negative(&samples).unwrap();
        for (got, want) in coef.iter().zip([2.0, 0.5, 0.001]) {
            assert!((got - want).abs() < 1e-9 * want.max(1.0), "{coef:?}");
        }
        assert!(err.max_abs_pct < 1e-6 && err.samples == 5, "{err:?}");
    }

    #[test]
    fn a_negative_term_is_dropped_rather_than_kept() {
        // Linear data with a little downward curvature: a free fit would take c < 0.
        let samples: Vec<([f64; 3], f64)> = [10.0, 100.0, 1000.0, 2000.0]
            .iter()
            .map(|&n| ([1.0, n, n * n], 1.0 + 0.01 * n - 1e-7 * n * n))
            .collect();
        let (coef, err) = fit_non_negative(&samples).unwrap();
        assert!(coef.iter().all(|&c| c >= 0.0), "{coef:?}");
        assert_eq!(coef[2], 0.0);
        assert!(err.max_abs_pct < 5.0, "{err:?}");
    }

    #[test]
    fn the_relative_error_is_reported() {
        let samples = [([1.0], 10.0), ([1.0], 12.0)];
        let err = error_of(&samples, |_| 11.0);
        assert!((err.mean_abs_pct - (10.0 + 100.0 / 12.0) / 2.0).abs() < 1e-9);
        assert!((err.max_abs_pct - 10.0).abs() < 1e-9);
        assert_eq!(fit_non_negative::<1>(&[]), None);
    }
}
