//! Rotary position embeddings: the base θ and the scaling a model was trained or extended with,
//! read from a HF config's `rope_scaling` or GGUF metadata, and the per-pair inverse
//! frequencies (and attention factor) they come to, computed once at load. Every backend rotates
//! with these same frequencies (rotate-half, as HF Llama does).
//!
//! The scalings follow HF transformers' `modeling_rope_utils`:
//! - `linear` (position interpolation): every frequency divided by `factor`;
//! - `dynamic` (NTK-aware): the base raised for the longest context the model is run at. HF
//!   recomputes it from the current batch's longest sequence, which would make a sequence's
//!   logits depend on its batch companions; like vLLM, duet fixes it for
//!   `original_max_position_embeddings × factor` positions;
//! - `llama3` (Llama 3.1 / 3.2 / 3.3): low frequencies divided by `factor`, high ones kept, a
//!   smooth ramp between, by wavelength against the original context;
//! - `yarn`: interpolation and extrapolation blended per frequency by a linear ramp between the
//!   correction dimensions of `beta_fast` and `beta_slow`, and cos/sin scaled by the attention
//!   factor (`0.1 ln(factor) + 1` unless given);
//! - GGUF's `rope_freqs.weight` (what llama.cpp's converter writes for `llama3`): each frequency
//!   divided by its own factor.

use serde_json::{Map, Value};

/// How a model's rotary embeddings are scaled.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    Linear {
        factor: f64,
    },
    Dynamic {
        factor: f64,
        original_max_position_embeddings: usize,
    },
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        beta_fast: f64,
        beta_slow: f64,
        /// cos/sin scale: given, or from `mscale` / `mscale_all_dim`, or `0.1 ln(factor) + 1`.
        attention_factor: f64,
        /// Whether the correction range is rounded to whole dimensions (HF's `truncate`).
        truncate: bool,
    },
    /// One divisor per frequency (GGUF `rope_freqs.weight`).
    Factors(Vec<f32>),
}

/// What a rotation needs, per frequency pair of a head.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeFrequencies {
    /// `head_dim / 2` inverse frequencies: pair `i` of a row at position `p` turns by
    /// `p × inv_freq[i]`.
    pub inv_freq: Vec<f32>,
    /// cos and sin are multiplied by this (1 but for YaRN).
    pub attention_factor: f32,
}

/// A `rope_scaling` that cannot be used; the message names the key and the problem.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct RopeError(pub String);

impl RopeScaling {
    /// Reads a HF config's `rope_scaling` object (`rope_type`, or the older `type`);
    /// `max_position_embeddings` is the config's, the default original context.
    pub fn from_hf(
        scaling: &Map<String, Value>,
        max_position_embeddings: usize,
    ) -> Result<Self, RopeError> {
        let kind = scaling
            .get("rope_type")
            .or_else(|| scaling.get("type"))
            .and_then(Value::as_str)
            .ok_or_else(|| RopeError("rope_scaling has no rope_type (or type)".into()))?;
        let num = |key: &str| -> Result<Option<f64>, RopeError> {
            match scaling.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_f64()
                    .filter(|x| x.is_finite())
                    .map(Some)
                    .ok_or_else(|| RopeError(format!("rope_scaling.{key} {v} is not a number"))),
            }
        };
        let factor = || -> Result<f64, RopeError> {
            let f = num("factor")?
                .ok_or_else(|| RopeError(format!("rope_scaling of type {kind} has no factor")))?;
            if f < 1.0 {
                return Err(RopeError(format!(
                    "rope_scaling.factor {f} is below 1 (it stretches the context)"
                )));
            }
            Ok(f)
        };
        let original = || -> Result<usize, RopeError> {
            match num("original_max_position_embeddings")? {
                None => Ok(max_position_embeddings),
                Some(n) if n >= 1.0 && n.fract() == 0.0 => Ok(n as usize),
                Some(n) => Err(RopeError(format!(
                    "rope_scaling.original_max_position_embeddings {n} is not a positive integer"
                ))),
            }
        };
        let scaling = match kind {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear { factor: factor()? },
            "dynamic" => RopeScaling::Dynamic {
                factor: factor()?,
                original_max_position_embeddings: original()?,
            },
            "llama3" => {
                let low = num("low_freq_factor")?.unwrap_or(1.0);
                let high = num("high_freq_factor")?.unwrap_or(4.0);
                if high <= low {
                    return Err(RopeError(format!(
                        "rope_scaling.high_freq_factor {high} must exceed low_freq_factor {low}"
                    )));
                }
                RopeScaling::Llama3 {
                    factor: factor()?,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_position_embeddings: original()?,
                }
            }
            "yarn" => {
                let factor = factor()?;
                let attention_factor = match num("attention_factor")? {
                    Some(a) => a,
                    None => match (num("mscale")?, num("mscale_all_dim")?) {
                        (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                            yarn_mscale(factor, m) / yarn_mscale(factor, all)
                        }
                        _ => yarn_mscale(factor, 1.0),
                    },
                };
                RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings: original()?,
                    beta_fast: num("beta_fast")?.unwrap_or(32.0),
                    beta_slow: num("beta_slow")?.unwrap_or(1.0),
                    attention_factor,
                    truncate: scaling
                        .get("truncate")
                        .and_then(Value::as_bool)
                        .unwrap_or(true),
                }
            }
            other => {
                return Err(RopeError(format!(
                    "rope_scaling type {other:?} is not supported (supported: default, linear, \
                     dynamic, llama3, yarn)"
                )));
            }
        };
        Ok(scaling)
    }

    /// The inverse frequencies and attention factor for heads of `head_dim` with base `theta`.
    /// A [`RopeScaling::Factors`] of the wrong length is an error naming both lengths.
    pub fn frequencies(&self, theta: f64, head_dim: usize) -> Result<RopeFrequencies, RopeError> {
        let half = head_dim / 2;
        let plain = |base: f64| -> Vec<f64> {
            (0..half)
                .map(|i| 1.0 / base.powf((2 * i) as f64 / head_dim as f64))
                .collect()
        };
        let mut attention_factor = 1.0;
        let inv_freq: Vec<f64> = match self {
            RopeScaling::None => plain(theta),
            RopeScaling::Linear { factor } => plain(theta).iter().map(|f| f / factor).collect(),
            RopeScaling::Dynamic {
                factor,
                original_max_position_embeddings,
            } => {
                // HF's formula at seq_len = original × factor.
                let seq = *original_max_position_embeddings as f64 * factor;
                let orig = *original_max_position_embeddings as f64;
                let d = head_dim as f64;
                let base = theta * ((factor * seq / orig) - (factor - 1.0)).powf(d / (d - 2.0));
                plain(base)
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old = *original_max_position_embeddings as f64;
                let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
                plain(theta)
                    .into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor: a,
                truncate,
            } => {
                attention_factor = *a;
                let d = head_dim as f64;
                let max_pos = *original_max_position_embeddings as f64;
                let correction_dim = |rotations: f64| {
                    (d * (max_pos / (rotations * 2.0 * std::f64::consts::PI)).ln())
                        / (2.0 * theta.ln())
                };
                let (mut low, mut high) = (correction_dim(*beta_fast), correction_dim(*beta_slow));
                if *truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
                if low == high {
                    high += 0.001;
                }
                plain(theta)
                    .into_iter()
                    .enumerate()
                    .map(|(i, extrapolation)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let keep = 1.0 - ramp;
                        extrapolation / factor * (1.0 - keep) + extrapolation * keep
                    })
                    .collect()
            }
            RopeScaling::Factors(factors) => {
                if factors.len() != half {
                    return Err(RopeError(format!(
                        "rope_freqs.weight has {} factors; heads of {head_dim} need {half}",
                        factors.len()
                    )));
                }
                if let Some(bad) = factors.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
                    return Err(RopeError(format!(
                        "rope_freqs.weight holds {bad}, not a positive factor"
                    )));
                }
                plain(theta)
                    .iter()
                    .zip(factors)
                    .map(|(f, &d)| f / d as f64)
                    .collect()
            }
        };
        Ok(RopeFrequencies {
            inv_freq: inv_freq.into_iter().map(|f| f as f32).collect(),
            attention_factor: attention_factor as f32,
        })
    }

    /// A short text that differs between any two scalings (for the model fingerprint).
    pub fn tag(&self) -> String {
        match self {
            RopeScaling::None => "none".into(),
            RopeScaling::Linear { factor } => format!("linear{factor}"),
            RopeScaling::Dynamic {
                factor,
                original_max_position_embeddings: o,
            } => format!("dynamic{factor}@{o}"),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: o,
            } => format!("llama3{factor}-{low_freq_factor}-{high_freq_factor}@{o}"),
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: o,
                beta_fast,
                beta_slow,
                attention_factor,
                truncate,
            } => format!("yarn{factor}@{o}-{beta_fast}-{beta_slow}-{attention_factor}-{truncate}"),
            RopeScaling::Factors(f) => format!(
                "factors{:08x}",
                f.iter()
                    .fold(f.len() as u32, |h, x| h.rotate_left(5) ^ x.to_bits())
            ),
        }
    }
}

/// YaRN's magnitude correction: `0.1 mscale ln(scale) + 1` for a scale above 1.
fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hf(json: &str) -> Result<RopeScaling, RopeError> {
        let v: Value = serde_json::from_str(json).unwrap();
        RopeScaling::from_hf(v.as_object().unwrap(), 131_072)
    }

    #[test]
    fn every_hf_type_is_read_and_others_are_refused_by_name() {
        let llama3 = hf(
            r#"{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#,
        )
        .unwrap();
        assert_eq!(
            llama3,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192
            }
        );
        assert_eq!(
            hf(r#"{"type": "linear", "factor": 2}"#).unwrap(),
            RopeScaling::Linear { factor: 2.0 }
        );
        let yarn = hf(
            r#"{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}"#,
        )
        .unwrap();
        let RopeScaling::Yarn {
            attention_factor, ..
        } = yarn
        else {
            panic!("{yarn:?}")
        };
        assert!((attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
        for (bad, says) in [
            (
                r#"{"rope_type": "longrope", "factor": 2}"#,
                "\"longrope\" is not supported",
            ),
            (r#"{"rope_type": "linear"}"#, "has no factor"),
            (r#"{"rope_type": "linear", "factor": 0.5}"#, "below 1"),
            (r#"{"factor": 2}"#, "no rope_type"),
            (
                r#"{"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1}"#,
                "must exceed",
            ),
        ] {
            let e = hf(bad).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn plain_rope_is_the_textbook_frequencies_and_factors_divide_them() {
        let f = RopeScaling::None.frequencies(10_000.0, 8).unwrap();
        let want = [1.0, 0.1, 0.01, 0.001];
        // Stored as f32, as HF keeps inv_freq.
        for (a, b) in f.inv_freq.iter().zip(want) {
            assert!((*a as f64 - b).abs() <= 1e-7 * b, "{:?}", f.inv_freq);
        }
        assert_eq!(f.attention_factor, 1.0);
        let halved = RopeScaling::Factors(vec![1.0, 2.0, 4.0, 8.0])
            .frequencies(10_000.0, 8)
            .unwrap();
        assert!((halved.inv_freq[3] as f64 - 0.001 / 8.0).abs() <= 1e-7 * 0.001 / 8.0);
        let e = RopeScaling::Factors(vec![1.0; 3])
            .frequencies(10_000.0, 8)
            .unwrap_err();
        assert!(e.to_string().contains("3 factors"), "{e}");
    }
}
