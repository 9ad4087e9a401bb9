//! FP8 weights: the E4M3 format (`float8_e4m3fn`: 1 sign, 4 exponent and 3 mantissa bits, bias
//! 7, no infinities, largest finite value 448), matrices of E4M3 values with a scale per output
//! row, as vLLM and llm-compressor checkpoints store them (`weight` in `F8_E4M3`, `weight_scale`,
//! optional `input_scale`), and the quantizer behind `--quantization fp8`.

use crate::dequant::dequantize_row;
use crate::model_files::RawTensor;
use crate::quant_type::QuantType;
use crate::storage::WeightBytes;

/// The largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// How weight matrices are stored for the forward pass (`--quantization`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Quantization {
    /// As the file stores them (FP8 checkpoints stay FP8).
    #[default]
    None,
    /// The layers' projections quantized to E4M3 at load, a scale per output row (amax/448).
    Fp8,
}

impl std::fmt::Display for Quantization {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::None => "none",
            Self::Fp8 => "fp8",
        })
    }
}

/// `x` as E4M3 bits, rounded to nearest even; beyond ±448 saturates to ±448 (as the GPU's
/// `satfinite` conversion; a scaled weight never gets there), NaN is 0x7F.
pub fn e4m3_from_f32(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a.is_nan() {
        return 0x7F;
    }
    let a = a.min(E4M3_MAX);
    // Below the smallest normal (2^-6) the steps are 2^-9 apart: q·2^-9, q = 0..=8 (8 is the
    // smallest normal's bits, 0x08).
    if a < 2f32.powi(-6) {
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let exp = ((a.to_bits() >> 23) as i32) - 127;
    let mantissa = ((a / 2f32.powi(exp) - 1.0) * 8.0).round_ties_even() as i32;
    // A mantissa rounded up to 8 carries into the exponent.
    let (exp, mantissa) = if mantissa == 8 {
        (exp + 1, 0)
    } else {
        (exp, mantissa)
    };
    sign | (((exp + 7) as u8) << 3) | mantissa as u8
}

/// The value of E4M3 bits `b`.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((b >> 3) & 0x0F) as i32;
    let mantissa = (b & 0x07) as f32;
    if exp == 0x0F && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    sign * match exp {
        0 => mantissa * 2f32.powi(-9),
        _ => (1.0 + mantissa / 8.0) * 2f32.powi(exp - 7),
    }
}

/// The scale a row (or token) of largest magnitude `amax` is quantized with: `amax/448`, so its
/// largest value maps to E4M3's largest; 1 for a row of zeros (any scale gives zero bytes).
pub fn e4m3_scale(amax: f32) -> f32 {
    if amax > 0.0 { amax / E4M3_MAX } else { 1.0 }
}

#[derive(Debug, thiserror::Error)]
pub enum Fp8Error {
    #[error(
        "tensor {name}: --quantization fp8 quantizes F32, F16 or BF16 weights, not {ty} (its file is already quantized)"
    )]
    NotFloat { name: String, ty: QuantType },
    #[error("tensor {name}: {bytes} bytes of E4M3 for [{rows}, {cols}] (rows, cols)")]
    BadSize {
        name: String,
        rows: usize,
        cols: usize,
        bytes: usize,
    },
}

/// A weight matrix `[rows][cols]` (out, in) of E4M3 values: row `r` is `e4m3 · scales[r]`.
#[derive(Clone, Debug)]
pub struct Fp8Matrix {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    /// `rows × cols` E4M3 bytes, rows contiguous.
    pub weights: WeightBytes,
    /// One scale per row (a per-tensor scale repeated).
    pub scales: Vec<f32>,
    /// The static scale of the product's input (`input_scale`): the input is quantized as
    /// `x / input_scale`; `None` quantizes each input row with its own scale (amax/448).
    pub input_scale: Option<f32>,
}

impl Fp8Matrix {
    /// A checked matrix of E4M3 `weights` and a scale per row.
    pub fn new(
        name: &str,
        rows: usize,
        cols: usize,
        weights: WeightBytes,
        scales: Vec<f32>,
        input_scale: Option<f32>,
    ) -> Result<Self, Fp8Error> {
        if weights.len() != rows * cols || scales.len() != rows {
            return Err(Fp8Error::BadSize {
                name: name.to_string(),
                rows,
                cols,
                bytes: weights.len(),
            });
        }
        Ok(Self {
            name: name.to_string(),
            rows,
            cols,
            weights,
            scales,
            input_scale,
        })
    }

    /// `t` (F32, F16 or BF16) quantized a row at a time: scale `amax/448`, each value
    /// `e4m3(w / scale)`.
    pub fn quantize(t: &RawTensor) -> Result<Self, Fp8Error> {
        if !matches!(t.ty, QuantType::F32 | QuantType::F16 | QuantType::BF16) {
            return Err(Fp8Error::NotFloat {
                name: t.name.clone(),
                ty: t.ty,
            });
        }
        let row_bytes = t.ty.row_bytes(t.cols).expect("float rows");
        if t.bytes.len() != row_bytes * t.rows {
            return Err(Fp8Error::BadSize {
                name: t.name.clone(),
                rows: t.rows,
                cols: t.cols,
                bytes: t.bytes.len(),
            });
        }
        let (rows, cols) = (t.rows, t.cols.max(1));
        let mut weights = vec![0u8; rows * t.cols];
        let mut scales = vec![1f32; rows];
        // Rows are independent: a band of them per core (a Llama-3-8B shape's 7 billion weights
        // quantize in seconds, not a minute).
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let band = rows.div_ceil(threads).max(1);
        std::thread::scope(|scope| {
            for (i, (w, s)) in weights
                .chunks_mut(band * cols)
                .zip(scales.chunks_mut(band))
                .enumerate()
            {
                let bytes = &t.bytes[i * band * row_bytes..];
                scope.spawn(move || {
                    let mut row = vec![0f32; t.cols];
                    for (r, (out, scale)) in w.chunks_exact_mut(cols).zip(s).enumerate() {
                        dequantize_row(t.ty, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut row);
                        *scale = e4m3_scale(row.iter().fold(0f32, |m, v| m.max(v.abs())));
                        for (o, v) in out.iter_mut().zip(&row) {
                            *o = e4m3_from_f32(v / *scale);
                        }
                    }
                });
            }
        });
        Self::new(
            &t.name,
            t.rows,
            t.cols,
            WeightBytes::from_vec(weights),
            scales,
            None,
        )
    }

    /// The values as BF16 (`e4m3 · scale` rounded to nearest even): how a device without FP8
    /// products (the CPU) serves the matrix.
    pub fn dequantize_bf16(&self) -> RawTensor {
        let mut bytes = Vec::with_capacity(self.rows * self.cols * 2);
        for (row, &scale) in self
            .weights
            .chunks_exact(self.cols.max(1))
            .zip(&self.scales)
        {
            for &b in row {
                let v = half::bf16::from_f32(e4m3_to_f32(b) * scale);
                bytes.extend_from_slice(&v.to_bits().to_le_bytes());
            }
        }
        RawTensor {
            name: self.name.clone(),
            ty: QuantType::BF16,
            rows: self.rows,
            cols: self.cols,
            bytes: WeightBytes::from_vec(bytes),
        }
    }

    /// `parts` stacked (rows concatenated, scales with them) so that projections of one input
    /// run as one product; `None` when their widths differ. The stack's input scale is the
    /// largest of the parts' (vLLM's choice for fused QKV: no part's input overflows), or
    /// dynamic when any part's is.
    pub fn stack(parts: &[Fp8Matrix]) -> Option<Fp8Matrix> {
        let first = parts.first()?;
        if parts.iter().any(|p| p.cols != first.cols) {
            return None;
        }
        let input_scale = parts
            .iter()
            .map(|p| p.input_scale)
            .try_fold(0f32, |m, s| s.map(|s| m.max(s)));
        let mut weights = Vec::with_capacity(parts.iter().map(|p| p.weights.len()).sum());
        let mut scales = Vec::new();
        for p in parts {
            weights.extend_from_slice(&p.weights);
            scales.extend_from_slice(&p.scales);
        }
        let names: Vec<&str> = parts.iter().map(|p| p.name.as_str()).collect();
        Some(Fp8Matrix {
            name: names.join(" + "),
            rows: scales.len(),
            cols: first.cols,
            weights: WeightBytes::from_vec(weights),
            scales,
            input_scale,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_round_trips_every_finite_value() {
        for b in 0..=255u8 {
            let v = e4m3_to_f32(b);
            if v.is_nan() {
                assert_eq!(b & 0x7F, 0x7F);
                continue;
            }
            // -0 and +0 are distinct bits.
            assert_eq!(e4m3_from_f32(v), b, "{b:#04x} = {v}");
        }
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
    }

    #[test]
    fn e4m3_rounds_to_nearest_even_and_saturates() {
        // 1.0625 is halfway between 1 (mantissa 0) and 1.125 (mantissa 1): even wins.
        assert_eq!(e4m3_from_f32(1.0625), 0x38);
        assert_eq!(e4m3_from_f32(1.1875), 0x3A);
        assert_eq!(e4m3_from_f32(1.07), 0x39);
        // 1.9375 rounds up past the mantissa into the next exponent.
        assert_eq!(e4m3_from_f32(1.9375), 0x40);
        assert_eq!(e4m3_from_f32(1e9), 0x7E);
        assert_eq!(e4m3_from_f32(-1e9), 0xFE);
        assert_eq!(e4m3_from_f32(f32::NAN), 0x7F);
        // Halfway between subnormal steps 0 and 2^-9.
        assert_eq!(e4m3_from_f32(2f32.powi(-10)), 0x00);
        assert_eq!(e4m3_from_f32(3.0 * 2f32.powi(-10)), 0x02);
    }

    fn bf16_tensor(name: &str, rows: usize, cols: usize, values: &[f32]) -> RawTensor {
        let bytes = values
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
            .collect();
        RawTensor {
            name: name.into(),
            ty: QuantType::BF16,
            rows,
            cols,
            bytes: WeightBytes::from_vec(bytes),
        }
    }

    #[test]
    fn quantizing_scales_each_row_to_its_largest_value() {
        let t = bf16_tensor(
            "w",
            3,
            4,
            &[
                1.0, -2.0, 0.5, 0.25, 0.0, 0.0, 0.0, 0.0, 3.0, 3.0, 3.0, -6.0,
            ],
        );
        let m = Fp8Matrix::quantize(&t).unwrap();
        assert_eq!(m.scales, vec![2.0 / 448.0, 1.0, 6.0 / 448.0]);
        // Each row's largest magnitude is 448.
        assert_eq!(
            &m.weights[..4],
            &[
                e4m3_from_f32(224.0),
                0xFE,
                e4m3_from_f32(112.0),
                e4m3_from_f32(56.0)
            ]
        );
        assert_eq!(&m.weights[4..8], &[0; 4]);
        assert_eq!(m.weights[11], 0xFE);
        let back = m.dequantize_bf16();
        let mut values = vec![0f32; 12];
        dequantize_row(QuantType::BF16, &back.bytes, &mut values);
        assert_eq!(values[..4], [1.0, -2.0, 0.5, 0.25]);

        let q4 = RawTensor {
            ty: QuantType::Q4_0,
            ..t
        };
        let e = Fp8Matrix::quantize(&q4).unwrap_err().to_string();
        assert!(e.contains("tensor w") && e.contains("Q4_0"), "{e}");
    }

    /// The quantizer against numpy with ml_dtypes' `float8_e4m3fn` (an independent encoder,
    /// `tests/reference/fp8_reference.py`): the same bytes and scales, bit for bit, over rows
    /// whose values span E4M3's subnormals to its largest, ties included, and a row of zeros.
    #[test]
    fn the_quantizer_writes_what_numpy_and_ml_dtypes_write() {
        let (rows, cols) = (7usize, 96usize);
        let mut noise = crate::synthetic::Uniform::new(5);
        let mut values = Vec::with_capacity(rows * cols);
        for r in 0..rows {
            for c in 0..cols {
                // Magnitudes over 2^-14 .. 2^6 (values far below a row's largest land among
                // E4M3's subnormals), every ninth a tie of the row's steps.
                let v = match r {
                    3 => 0.0,
                    _ if c % 9 == 0 => (c as f32 + 0.5) / 8.0,
                    _ => noise.next_value() * 2f32.powi((c % 21) as i32 - 14),
                };
                values.push(if c % 2 == 0 { v } else { -v });
            }
        }
        let t = RawTensor {
            name: "w".into(),
            ty: QuantType::F32,
            rows,
            cols,
            bytes: WeightBytes::from_vec(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
        };
        let dir = tempfile::tempdir().unwrap();
        let (src, dst) = (dir.path().join("w.f32"), dir.path().join("q.bin"));
        std::fs::write(&src, &t.bytes[..]).unwrap();
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/reference/fp8_reference.py"
        );
        let out = std::process::Command::new("python3")
            .args([script, &rows.to_string(), &cols.to_string()])
            .arg(&src)
            .arg(&dst)
            .output()
            .expect("python3 runs (the suite installs numpy and ml_dtypes)");
        assert!(
            out.status.success(),
            "{script}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let reference = std::fs::read(&dst).unwrap();
        let (bytes, scales) = reference.split_at(rows * cols);
        let scales: Vec<f32> = scales
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let m = Fp8Matrix::quantize(&t).unwrap();
        assert_eq!(m.scales, scales);
        assert_eq!(m.scales[3], 1.0);
        let differing = (0..rows * cols)
            .filter(|&i| m.weights[i] != bytes[i])
            .count();
        assert_eq!(differing, 0, "bytes differing from numpy's");
        // Subnormals and both signs were exercised.
        assert!(m.weights.iter().any(|&b| b & 0x78 == 0 && b & 0x07 != 0));
        assert!(m.weights.iter().any(|&b| b & 0x80 != 0));
    }

    #[test]
    fn stacking_keeps_each_part_s_scales_and_the_largest_input_scale() {
        let part = |name: &str, rows: usize, input_scale| Fp8Matrix {
            name: name.into(),
            rows,
            cols: 2,
            weights: WeightBytes::from_vec(vec![rows as u8; rows * 2]),
            scales: vec![rows as f32; rows],
            input_scale,
        };
        let s = Fp8Matrix::stack(&[part("q", 2, Some(0.5)), part("k", 1, Some(2.0))]).unwrap();
        assert_eq!((s.rows, s.cols, s.name.as_str()), (3, 2, "q + k"));
        assert_eq!(s.scales, vec![2.0, 2.0, 1.0]);
        assert_eq!(&s.weights[..], &[2, 2, 2, 2, 1, 1]);
        assert_eq!(s.input_scale, Some(2.0));
        let dynamic = Fp8Matrix::stack(&[part("q", 2, Some(0.5)), part("k", 1, None)]).unwrap();
        assert_eq!(dynamic.input_scale, None);
        let mut wide = part("v", 1, None);
        wide.cols = 3;
        assert!(Fp8Matrix::stack(&[part("q", 2, None), wide]).is_none());
    }
}
