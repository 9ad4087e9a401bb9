//! The steps that turn one row of logits into a token, defined once. The CPU sampler
//! ([`crate::sampling::Sampler`]) runs them; the CUDA kernel `sample_rows` (`kernels/sampling.cu`)
//! reproduces them bit for bit, which the emulator test `crates/duet-cuda/tests/it/sampling_emulated.rs`
//! checks on the same logits. Every step is written so that a GPU block can do it in parallel and
//! get the same bits:
//!
//! 1. The grammar's mask: a token whose bit is clear (or past the bitmap) gets −∞.
//! 2. Penalties, once per distinct token: repetition (prompt and output tokens) divides a
//!    positive logit and multiplies a negative one; presence and frequency subtract
//!    `presence + frequency × count` from each generated token's logit.
//! 3. Log-probabilities (if asked for) of the penalised logits: `lse = max + ln Σ exp(l − max)`,
//!    the sum in the fixed order of [`canonical_sum`]; the top `n` tokens by logit (ties: lower
//!    id), masked ones (−∞) never listed.
//! 4. Temperature 0: [`argmax`] (lowest id among equals).
//! 5. Otherwise `s = l × (1/T)`; top-k keeps the `k` largest `s` (ties: lower id); `e = exp(s −
//!    max s)` over the kept tokens; min-p keeps `e ≥ min_p` (the same as `p ≥ min_p × p_max`,
//!    without a sum); top-p keeps the tokens with `e ≥ θ` for the largest `θ` whose kept mass
//!    (a [`canonical_sum`]) reaches `top_p` of the whole: tokens tied at the cut are all kept.
//! 6. The draw is an exponential race: each kept token gets `E = −ln(1 − u)`, `u` uniform from
//!    [`philox4x32_10`] keyed by the request's seed and counted by (position, token), and the token
//!    with the largest `e / E` wins (ties: lower id). That picks token `i` with probability
//!    `e_i / Σ e` and needs no sorted prefix sums, so a GPU reduces it like an argmax; and since
//!    the noise depends on (seed, position, token) only, a seeded request draws the same tokens
//!    whatever shares its step, on either backend, and after a failover.
//!
//! `exp` and `ln` are our own ([`exp`], [`ln`]), in plain f32 additions, multiplications and
//! divisions without fused multiply-adds, so the host's libm and CUDA's give no different bits.

use duet_model::grammar::mask_logits;
use duet_model::params::{Logprobs, Sampled, SamplingParams};

/// Lanes of [`canonical_sum`]: a sampling block's threads on the GPU.
pub const LANES: usize = 256;

/// What sampling one row needs besides its logits: the request's parameters and its state.
#[derive(Clone, Copy, Debug)]
pub struct RowSampling<'a> {
    pub params: &'a SamplingParams,
    /// The request's seed (drawn at random when it gave none).
    pub seed: u64,
    /// Position in the sequence of the token drawn (prompt and generated tokens before it).
    pub position: u64,
    /// Distinct tokens the penalties apply to, each with how often it was generated (0 for a
    /// prompt token that was not): repetition applies to every entry, presence and frequency
    /// to those generated.
    pub penalized: &'a [(u32, u32)],
    /// The grammar's allowed tokens, bit `t % 32` of word `t / 32`; `None`: unconstrained.
    pub allowed: Option<&'a [u32]>,
}

/// Samples one row: the steps of the module doc, in order. `logits` is left masked and
/// penalised.
pub fn sample_row(logits: &mut [f32], row: &RowSampling<'_>) -> Sampled {
    let p = row.params;
    if let Some(allowed) = row.allowed {
        mask_logits(allowed, logits);
    }
    penalize(logits, p, row.penalized);
    let token = if p.temperature == 0.0 {
        argmax(logits)
    } else {
        draw(logits, p, row.seed, row.position).unwrap_or_else(|| argmax(logits))
    };
    let logprobs = (p.logprobs > 0).then(|| {
        let lse = log_sum_exp(logits);
        Logprobs {
            logprob: logits[token as usize] - lse,
            top: top_n(logits, p.logprobs as usize)
                .into_iter()
                .map(|(t, l)| (t, l - lse))
                .collect(),
        }
    });
    Sampled { token, logprobs }
}

/// Step 2: the penalties, once per distinct token of `penalized`.
pub fn penalize(logits: &mut [f32], p: &SamplingParams, penalized: &[(u32, u32)]) {
    let repetition = p.repetition_penalty != 1.0;
    let additive = p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
    if !repetition && !additive {
        return;
    }
    for &(t, count) in penalized {
        let Some(l) = logits.get_mut(t as usize) else {
            continue;
        };
        if repetition {
            *l = if *l > 0.0 {
                *l / p.repetition_penalty
            } else {
                *l * p.repetition_penalty
            };
        }
        if additive && count > 0 {
            *l -= p.presence_penalty + p.frequency_penalty * count as f32;
        }
    }
}

/// Index of the largest logit, the lowest index among equals (NaNs never win, except a NaN first
/// logit, which is returned as if it were the largest).
///
/// Two passes that vectorize — the maximum over 16 lanes, then the first block holding it —
/// instead of one loop carrying the best index: a decode step samples every row of the batch on
/// one thread, 49k logits each for the default model.
pub fn argmax(logits: &[f32]) -> u32 {
    const LANES: usize = 16;
    if logits.first().is_none_or(|l| l.is_nan()) {
        return 0;
    }
    // `a > b ? a : b` keeps the earlier of equal values and skips NaNs, as a scan would.
    let larger = |m: f32, l: f32| if l > m { l } else { m };
    let blocks = logits.chunks_exact(LANES);
    let tail = blocks.remainder();
    let mut lanes = [f32::NEG_INFINITY; LANES];
    for block in blocks {
        for (m, &l) in lanes.iter_mut().zip(block) {
            *m = larger(*m, l);
        }
    }
    let max = lanes.iter().chain(tail).copied().fold(logits[0], larger);
    let first_block = logits
        .chunks(LANES)
        .position(|b| b.iter().fold(false, |hit, &l| hit | (l == max)))
        .unwrap_or(0);
    let within = logits[first_block * LANES..]
        .iter()
        .position(|&l| l == max)
        .unwrap_or(0);
    (first_block * LANES + within) as u32
}

/// The sum of `values` (in id order) in a fixed order that a GPU block of [`LANES`] threads
/// reproduces: lane `i` adds the values at `i, i + LANES, i + 2·LANES, …` in turn
/// ([`add_to_lane`]), then [`lane_tree`] adds the lanes pairwise.
pub fn canonical_sum(values: impl IntoIterator<Item = f32>) -> f32 {
    let mut lanes = [0f32; LANES];
    for (i, v) in values.into_iter().enumerate() {
        add_to_lane(&mut lanes, i as u32, v);
    }
    lane_tree(lanes)
}

/// Adds the value of token `id` to its lane. Adding zeros changes no lane, so a sum over some
/// tokens only (the others zero) adds just those, in id order.
fn add_to_lane(lanes: &mut [f32; LANES], id: u32, v: f32) {
    lanes[id as usize % LANES] += v;
}

/// `lane[i] += lane[i + s]` for `s = LANES/2, …, 1`; the sum is `lane[0]`.
fn lane_tree(mut lanes: [f32; LANES]) -> f32 {
    let mut stride = LANES / 2;
    while stride > 0 {
        let (low, high) = lanes.split_at_mut(stride);
        for (a, b) in low.iter_mut().zip(&high[..stride]) {
            *a += b;
        }
        stride /= 2;
    }
    lanes[0]
}

/// `max + ln Σ exp(l − max)` over the row (step 3), −∞ for a row of −∞.
pub fn log_sum_exp(logits: &[f32]) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    max + ln(canonical_sum(logits.iter().map(|&l| exp(l - max))))
}

/// Order-preserving 32-bit key of an f32 (`f32::total_cmp`'s order): larger float, larger key.
pub fn total_key(f: f32) -> u32 {
    let u = f.to_bits();
    if u & 0x8000_0000 != 0 {
        !u
    } else {
        u | 0x8000_0000
    }
}

/// A token's rank key among logits: larger value first, then lower id.
fn rank_key(value: f32, id: u32) -> u64 {
    (u64::from(total_key(value)) << 32) | u64::from(!id)
}

/// The `n` largest logits, largest first (ties: lower id), leaving out tokens masked to −∞.
pub fn top_n(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut v: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| **l != f32::NEG_INFINITY)
        .map(|(i, &l)| (i as u32, l))
        .collect();
    let by_rank = |a: &(u32, f32), b: &(u32, f32)| rank_key(b.1, b.0).cmp(&rank_key(a.1, a.0));
    let n = n.min(v.len());
    if n < v.len() {
        v.select_nth_unstable_by(n, by_rank);
        v.truncate(n);
    }
    v.sort_by(by_rank);
    v
}

/// Steps 5 and 6: the token drawn at temperature `p.temperature`, or `None` when no kept token
/// has a score (every logit NaN or −∞), where the caller falls back to [`argmax`].
fn draw(logits: &[f32], p: &SamplingParams, seed: u64, position: u64) -> Option<u32> {
    let inv_t = 1.0 / p.temperature;
    // Candidates (id, scaled logit), then (id, e) once exponentiated.
    let mut cand: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, l * inv_t))
        .collect();
    let k = p.top_k as usize;
    if k > 0 && k < cand.len() {
        let by_rank = |a: &(u32, f32), b: &(u32, f32)| rank_key(b.1, b.0).cmp(&rank_key(a.1, a.0));
        cand.select_nth_unstable_by(k - 1, by_rank);
        cand.truncate(k);
        // Id order again: the sums below run over ids in order.
        cand.sort_unstable_by_key(|c| c.0);
    }
    let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    for c in cand.iter_mut() {
        c.1 = exp(c.1 - max);
    }
    if p.min_p > 0.0 {
        cand.retain(|c| c.1 >= p.min_p);
    }
    if p.top_p < 1.0 {
        let theta = top_p_threshold(&cand, p.top_p);
        cand.retain(|c| c.1 >= theta);
    }
    let mut best: Option<(f32, u32)> = None;
    for &(id, e) in &cand {
        let score = e / exponential(uniform(seed, position, id));
        // Strictly larger: the lower id keeps a tie; NaN never wins.
        if best.is_none_or(|(b, _)| score > b) && !score.is_nan() {
            best = Some((score, id));
        }
    }
    best.map(|(_, id)| id)
}

/// The top-p cut: the largest `θ` (an f32 in `[0, 1]`) such that the kept tokens with `e ≥ θ`
/// hold at least `top_p` of the kept mass, masses summed in [`canonical_sum`]'s order over the
/// whole vocabulary (tokens not kept count as zero). The mass only grows as `θ` falls (a rounded
/// addition of a non-negative term never decreases), so bisection over θ's bits finds it.
fn top_p_threshold(cand: &[(u32, f32)], top_p: f32) -> f32 {
    let mass = |theta: f32| {
        let mut lanes = [0f32; LANES];
        for &(id, e) in cand {
            if e >= theta {
                add_to_lane(&mut lanes, id, e);
            }
        }
        lane_tree(lanes)
    };
    let target = top_p * mass(0.0);
    let (mut lo, mut hi) = (0u32, 1f32.to_bits());
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if mass(f32::from_bits(mid)) >= target {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    f32::from_bits(lo)
}

/// Uniform in `(0, 1)` for `token` at `position` of a request seeded with `seed`: the first
/// word of Philox4x32-10 with counter (token, position) and key `seed`, as `(x + ½)·2⁻³²`.
pub fn uniform(seed: u64, position: u64, token: u32) -> f32 {
    let x = philox4x32_10(
        [token, position as u32, (position >> 32) as u32, 0],
        [seed as u32, (seed >> 32) as u32],
    )[0];
    (x as f32 + 0.5) * TWO_POW_MINUS_32
}

const TWO_POW_MINUS_32: f32 = 1.0 / 4_294_967_296.0;

/// `−ln(1 − u)`: exponentially distributed for uniform `u`, accurate near 0 where a race is won.
pub fn exponential(u: f32) -> f32 {
    if u < 1.0 / 256.0 {
        // The series of −ln(1 − u); the next term is below 2⁻³² of the sum.
        u * (1.0 + u * (0.5 + u * (1.0 / 3.0)))
    } else {
        0.0 - ln(1.0 - u)
    }
}

/// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011), the
/// counter-based generator of Random123, cuRAND and PyTorch.
pub fn philox4x32_10(mut ctr: [u32; 4], mut key: [u32; 2]) -> [u32; 4] {
    const M0: u32 = 0xD251_1F53;
    const M1: u32 = 0xCD9E_8D57;
    for round in 0..10 {
        if round > 0 {
            key[0] = key[0].wrapping_add(0x9E37_79B9);
            key[1] = key[1].wrapping_add(0xBB67_AE85);
        }
        let p0 = u64::from(M0) * u64::from(ctr[0]);
        let p1 = u64::from(M1) * u64::from(ctr[2]);
        ctr = [
            (p1 >> 32) as u32 ^ ctr[1] ^ key[0],
            p1 as u32,
            (p0 >> 32) as u32 ^ ctr[3] ^ key[1],
            p0 as u32,
        ];
    }
    ctr
}

// The constants as bits, written the same way in kernels/sampling.cu.
/// ln 2 in two parts: the high one has 12 significant bits, so `n · LN2_HI` is exact.
const LN2_HI: f32 = f32::from_bits(0x3f31_7200);
const LN2_LO: f32 = f32::from_bits(0x35bf_be8e);
const LOG2_E: f32 = f32::from_bits(0x3fb8_aa3b);
const SQRT_2: f32 = f32::from_bits(0x3fb5_04f3);

/// `eˣ` in plain f32 arithmetic (about 1 ulp for `x ≤ 0`); 0 below −87 and for NaN.
pub fn exp(x: f32) -> f32 {
    // Written out as on the GPU: no fused multiply-adds, round-to-nearest-even for `n`.
    if x.is_nan() || x < -87.0 {
        return 0.0;
    }
    if x > 88.0 {
        return f32::INFINITY;
    }
    let n = (x * LOG2_E).round_ties_even();
    let r = (x - n * LN2_HI) - n * LN2_LO;
    // Taylor series of e^r to r⁷/7! on |r| ≤ 0.35 (next term below 2⁻²⁸).
    let mut q = 1.0 / 5040.0;
    q = q * r + 1.0 / 720.0;
    q = q * r + 1.0 / 120.0;
    q = q * r + 1.0 / 24.0;
    q = q * r + 1.0 / 6.0;
    q = q * r + 0.5;
    q = q * r + 1.0;
    q = q * r + 1.0;
    q * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `ln x` in plain f32 arithmetic (about 1 ulp); −∞ for `x ≤ 0`, NaN for NaN, ∞ for ∞.
pub fn ln(x: f32) -> f32 {
    if x.is_nan() || x == f32::INFINITY {
        return x;
    }
    if x <= 0.0 {
        return f32::NEG_INFINITY;
    }
    let mut bits = x.to_bits();
    let mut e = 0i32;
    if bits < 0x0080_0000 {
        // Subnormal: scale into the normal range first.
        bits = (x * 16_777_216.0).to_bits();
        e = -24;
    }
    e += (bits >> 23) as i32 - 127;
    let mut m = f32::from_bits((bits & 0x007f_ffff) | 0x3f80_0000);
    if m > SQRT_2 {
        m *= 0.5;
        e += 1;
    }
    // ln m = 2·atanh(s), s = (m − 1)/(m + 1), |s| ≤ 0.172.
    let f = m - 1.0;
    let s = f / (2.0 + f);
    let z = s * s;
    let mut q = 1.0 / 11.0;
    q = q * z + 1.0 / 9.0;
    q = q * z + 1.0 / 7.0;
    q = q * z + 1.0 / 5.0;
    q = q * z + 1.0 / 3.0;
    q = q * z + 1.0;
    let ef = e as f32;
    ef * LN2_HI + (ef * LN2_LO + 2.0 * s * q)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's known-answer vectors (`kat_vectors`, the three `philox4x32 10` lines).
    #[test]
    fn philox_matches_the_published_known_answers() {
        let cases = [
            (
                [0; 4],
                [0; 2],
                [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8],
            ),
            (
                [u32::MAX; 4],
                [u32::MAX; 2],
                [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd],
            ),
            (
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0],
                [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1],
            ),
        ];
        for (ctr, key, want) in cases {
            assert_eq!(philox4x32_10(ctr, key), want, "ctr {ctr:x?} key {key:x?}");
        }
    }

    /// Within 2 ulp of libm's f64 results over the ranges sampling uses.
    #[test]
    fn exp_and_ln_are_accurate() {
        let ulps = |got: f32, want: f64| (got as f64 - want) / (want.abs() * f32::EPSILON as f64);
        for i in 0..=200_000 {
            let x = -87.0 + 87.0 * i as f32 / 200_000.0;
            let want = (x as f64).exp();
            assert!(
                ulps(exp(x), want).abs() <= 2.0,
                "exp({x}) = {} vs {want}",
                exp(x)
            );
        }
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(f32::NAN), 0.0);
        for i in 1..=200_000 {
            for x in [i as f32 / 200_000.0, 1.0 + i as f32, 1e-30 * i as f32] {
                let want = (x as f64).ln();
                let err = (ln(x) as f64 - want).abs();
                // Relative to ln x, or absolute near x = 1 where ln x is near 0.
                assert!(
                    err <= 2.0 * f32::EPSILON as f64 * want.abs().max(1.0),
                    "ln({x}) = {} vs {want}",
                    ln(x)
                );
            }
        }
        assert_eq!(ln(1.0), 0.0);
        assert_eq!(ln(0.0), f32::NEG_INFINITY);
    }

    #[test]
    fn the_canonical_sum_is_the_lane_tree_and_ignores_zeros() {
        let values: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin()).collect();
        let exact: f64 = values.iter().map(|&v| v as f64).sum();
        let sum = canonical_sum(values.iter().copied());
        assert!((sum as f64 - exact).abs() < 1e-4, "{sum} vs {exact}");
        // A sparse sum (the others zero) is the same bits as the dense one.
        let sparse: Vec<f32> = values
            .iter()
            .enumerate()
            .map(|(i, &v)| if i % 3 == 0 { v } else { 0.0 })
            .collect();
        let mut lanes = [0f32; LANES];
        for (i, &v) in values.iter().enumerate().filter(|(i, _)| i % 3 == 0) {
            add_to_lane(&mut lanes, i as u32, v);
        }
        assert_eq!(lane_tree(lanes).to_bits(), canonical_sum(sparse).to_bits());
    }

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            ..Default::default()
        }
    }

    fn draws(logits: &[f32], p: &SamplingParams, seed: u64, n: u64) -> Vec<usize> {
        let mut counts = vec![0; logits.len()];
        for position in 0..n {
            let row = RowSampling {
                params: p,
                seed,
                position,
                penalized: &[],
                allowed: None,
            };
            counts[sample_row(&mut logits.to_vec(), &row).token as usize] += 1;
        }
        counts
    }

    /// The race draws each token with its softmax probability: frequencies over 40,000 positions
    /// within 4.5 standard deviations of the probabilities numpy-style softmax gives.
    #[test]
    fn the_exponential_race_draws_the_softmax() {
        let logits = [1.0, 3.0, 2.0, 3.0, -1.0, 0.5, -3.0];
        for t in [1.0f32, 0.5, 2.0] {
            let n = 40_000;
            let counts = draws(&logits, &params(t), 7, n);
            let w: Vec<f64> = logits
                .iter()
                .map(|&l| (l as f64 / t as f64).exp())
                .collect();
            let total: f64 = w.iter().sum();
            for (i, (&c, w)) in counts.iter().zip(&w).enumerate() {
                let p = w / total;
                let sd = (n as f64 * p * (1.0 - p)).sqrt();
                assert!(
                    (c as f64 - n as f64 * p).abs() <= 4.5 * sd + 1.0,
                    "T={t}, token {i}: {c} draws, expected {:.0}",
                    n as f64 * p
                );
            }
        }
    }

    #[test]
    fn top_k_keeps_the_lower_ids_among_ties_at_the_cut() {
        // Ties at the cut: ids 1, 2, 5 share the second-largest value; top-3 keeps 0, 1, 2.
        let logits = [5.0, 2.0, 2.0, -1.0, 0.0, 2.0];
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 3,
            ..Default::default()
        };
        let counts = draws(&logits, &p, 1, 3000);
        assert_eq!((counts[3], counts[4], counts[5]), (0, 0, 0), "{counts:?}");
        assert!(counts[1] > 0 && counts[2] > 0, "{counts:?}");
        assert_eq!(
            top_n(&logits, 3),
            vec![(0, 5.0), (1, 2.0), (2, 2.0)],
            "top-n orders ties by id too"
        );
    }

    #[test]
    fn top_p_keeps_every_token_tied_at_the_cut() {
        // e = [1, 1, e^-1, e^-1, e^-5]: top_p 0.5 is reached by the two largest.
        let logits = [3.0, 3.0, 2.0, 2.0, -2.0];
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            ..Default::default()
        };
        let counts = draws(&logits, &p, 3, 2000);
        assert_eq!(counts[2..], [0, 0, 0], "{counts:?}");
        // 0.75 needs one of the e^-1 pair: both are kept, the cut being a value.
        let p = SamplingParams { top_p: 0.75, ..p };
        let counts = draws(&logits, &p, 3, 4000);
        assert!(
            counts[2] > 0 && counts[3] > 0 && counts[4] == 0,
            "{counts:?}"
        );
    }

    #[test]
    fn masked_tokens_are_never_drawn_nor_listed() {
        let logits = [1.0, 4.0, 2.0, 3.0, 0.0];
        let allowed = [0b10101u32]; // tokens 0, 2 and 4
        let p = SamplingParams {
            temperature: 1.0,
            logprobs: 5,
            ..Default::default()
        };
        for position in 0..500 {
            let row = RowSampling {
                params: &p,
                seed: 5,
                position,
                penalized: &[],
                allowed: Some(&allowed),
            };
            let s = sample_row(&mut logits.to_vec(), &row);
            assert!([0, 2, 4].contains(&s.token), "{}", s.token);
            let listed: Vec<u32> = s.logprobs.unwrap().top.iter().map(|t| t.0).collect();
            assert_eq!(listed, vec![2, 0, 4]);
        }
    }

    /// The draw depends on (seed, position, logits) alone, and a new position draws anew.
    #[test]
    fn a_seeded_draw_is_a_function_of_seed_and_position() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 97) as f32 * 0.05).collect();
        let p = params(1.0);
        let draw = |seed, position| {
            let row = RowSampling {
                params: &p,
                seed,
                position,
                penalized: &[],
                allowed: None,
            };
            sample_row(&mut logits.clone(), &row).token
        };
        let first: Vec<u32> = (0..32).map(|pos| draw(9, pos)).collect();
        let again: Vec<u32> = (0..32).rev().map(|pos| draw(9, pos)).rev().collect();
        assert_eq!(first, again);
        let other: Vec<u32> = (0..32).map(|pos| draw(10, pos)).collect();
        assert_ne!(first, other);
        assert!(first.windows(2).any(|w| w[0] != w[1]));
    }

    #[test]
    fn repetition_applies_once_to_a_token_of_prompt_and_output() {
        let p = SamplingParams {
            repetition_penalty: 2.0,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..SamplingParams::greedy()
        };
        let mut logits = [4.0, -2.0, 1.0];
        // Token 0 generated twice (and in the prompt), token 1 in the prompt only.
        penalize(&mut logits, &p, &[(0, 2), (1, 0)]);
        assert_eq!(logits, [4.0 / 2.0 - (0.5 + 0.25 * 2.0), -4.0, 1.0]);
    }
}
