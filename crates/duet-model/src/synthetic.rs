//! Random weights in a model's shapes, by GGUF tensor name: benchmarks run models of any size
//! (a Llama-3-8B shape on a GPU) without a file. Matrices are bf16 values uniform in ±√(3/cols),
//! so that activations keep unit scale through the layers, or random blocks of a GGUF block
//! format whose dequantized values have the same spread ([`random_blocks`]); norm weights (and
//! biases) are bf16 near 1.

use crate::config::ModelConfig;
use crate::model_files::RawTensor;
use crate::quant_type::QuantType;
use crate::storage::WeightBytes;

#[derive(Debug, thiserror::Error)]
pub enum SyntheticError {
    #[error("synthetic weights are made in BF16 or a GGUF block format, not {0}")]
    Unsupported(QuantType),
    #[error("{name}: {cols} columns are not whole {ty} blocks of {block_len} values")]
    NotWholeBlocks {
        name: String,
        ty: QuantType,
        cols: usize,
        block_len: usize,
    },
}

/// The tensor `name` of a `config`-shaped model, its matrices stored as `ty` (BF16 or a block
/// format), or `None` for a tensor the model does not have.
pub fn tensor(
    config: &ModelConfig,
    name: &str,
    ty: QuantType,
    seed: u64,
) -> Result<Option<RawTensor>, SyntheticError> {
    let c = config;
    let (h, q, kv, ffn) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    let layer_part = name
        .strip_prefix("blk.")
        .and_then(|rest| rest.split_once('.'))
        .filter(|(i, _)| i.parse::<usize>().is_ok_and(|i| i < c.num_layers))
        .map(|(_, part)| part);
    let (rows, cols) = match (name, layer_part) {
        ("token_embd.weight", _) => (c.vocab_size, h),
        ("output.weight", _) if !c.tie_word_embeddings => (c.vocab_size, h),
        ("output_norm.weight", _) => (1, h),
        (_, Some("attn_norm.weight" | "ffn_norm.weight")) => (1, h),
        (_, Some("attn_q.weight")) => (q, h),
        (_, Some("attn_k.weight" | "attn_v.weight")) => (kv, h),
        (_, Some("attn_output.weight")) => (h, q),
        (_, Some("ffn_gate.weight" | "ffn_up.weight")) => (ffn, h),
        (_, Some("ffn_down.weight")) => (h, ffn),
        (_, Some("attn_q.bias")) if c.attention_bias => (1, q),
        (_, Some("attn_k.bias" | "attn_v.bias")) if c.attention_bias => (1, kv),
        (_, Some("attn_q_norm.weight" | "attn_k_norm.weight")) if c.qk_norm => (1, c.head_dim),
        _ => return Ok(None),
    };
    let mut noise = Uniform::new(seed ^ xxhash_name(name));
    let half_width = (3.0 / cols as f32).sqrt();
    let is_matrix = rows > 1;
    let (ty, bytes) = match ty {
        QuantType::BF16 => (ty, bf16_values(rows * cols, name, half_width, &mut noise)),
        _ if !is_matrix => (
            QuantType::BF16,
            bf16_values(rows * cols, name, half_width, &mut noise),
        ),
        QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q8_0 | QuantType::Q4_K | QuantType::Q6_K => {
            if cols % ty.block_len() != 0 {
                return Err(SyntheticError::NotWholeBlocks {
                    name: name.to_string(),
                    ty,
                    cols,
                    block_len: ty.block_len(),
                });
            }
            let spread = half_width / 3f32.sqrt();
            (ty, random_blocks(ty, rows, cols, spread, &mut noise))
        }
        QuantType::F32 | QuantType::F16 => return Err(SyntheticError::Unsupported(ty)),
    };
    Ok(Some(RawTensor {
        name: name.to_string(),
        ty,
        rows,
        cols,
        bytes: WeightBytes::from_vec(bytes),
    }))
}

/// `n` bf16 values uniform in ±`half_width` (centered on 1 for a norm's weights).
fn bf16_values(n: usize, name: &str, half_width: f32, noise: &mut Uniform) -> Vec<u8> {
    let (center, half_width) = match name.ends_with("norm.weight") {
        true => (1.0, 0.1),
        false => (0.0, half_width),
    };
    let mut bytes = Vec::with_capacity(n * 2);
    for _ in 0..n {
        let v = center + half_width * noise.next_value();
        bytes.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes());
    }
    bytes
}

/// `rows` × `cols` values of block format `ty` (`cols` whole blocks): random quants, and scales
/// set so that the dequantized values have root mean square `spread` (each block's scale varied
/// by ×0.5–1.5, as a trained model's are). Q4_1's minimum centers its block; Q4_K's 6-bit
/// scales and minimums are random and independent, its `dmin` 7.5 × `d` (the minimums then
/// center the sub-blocks on average); Q6_K's 8-bit scales take both signs.
///
/// Panics if `ty` is not a block format or `cols` is not whole blocks.
pub fn random_blocks(
    ty: QuantType,
    rows: usize,
    cols: usize,
    spread: f32,
    noise: &mut Uniform,
) -> Vec<u8> {
    assert!(
        ty.block_len() > 1 && cols.is_multiple_of(ty.block_len()),
        "{ty}: {cols} columns are not whole blocks"
    );
    // The root mean square of the dequantized values at a scale of 1 (quants uniform).
    let unit_rms: f32 = match ty {
        // (q − 8), q uniform in 0..16.
        QuantType::Q4_0 => 21.5f32.sqrt(),
        // (q − 7.5).
        QuantType::Q4_1 => 21.25f32.sqrt(),
        // q uniform in −128..128.
        QuantType::Q8_0 => 5461.5f32.sqrt(),
        // sc·q − 7.5·m, sc and m uniform in 1..64.
        QuantType::Q4_K => 65_986.7f32.sqrt(),
        // sc·(q − 32), sc uniform in −128..128, q in 0..64.
        QuantType::Q6_K => (5461.5f32 * 341.5).sqrt(),
        _ => unreachable!("a block format"),
    };
    // E[(0.5 + u)²] = 13/12 for u uniform in [0, 1).
    let scale = spread / unit_rms / (13.0f32 / 12.0).sqrt();
    let mut bytes = vec![0u8; rows * cols / ty.block_len() * ty.block_bytes()];
    noise.fill_bytes(&mut bytes);
    let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
    for block in bytes.chunks_exact_mut(ty.block_bytes()) {
        let d = scale * (1.0 + noise.next_value()).mul_add(0.5, 0.5);
        match ty {
            QuantType::Q4_0 | QuantType::Q8_0 => block[0..2].copy_from_slice(&f16(d)),
            QuantType::Q4_1 => {
                block[0..2].copy_from_slice(&f16(d));
                block[2..4].copy_from_slice(&f16(-7.5 * d));
            }
            QuantType::Q4_K => {
                block[0..2].copy_from_slice(&f16(d));
                block[2..4].copy_from_slice(&f16(7.5 * d));
                // Eight (scale, min) pairs of 6 bits, packed as GGML's `get_scale_min_k4` reads.
                let pair = |b: u8| 1 + b % 63;
                let sc: [u8; 8] = std::array::from_fn(|j| pair(block[4 + j]));
                let m: [u8; 8] = std::array::from_fn(|j| pair(block[12 + j]));
                let packed = &mut block[4..16];
                for j in 0..4 {
                    packed[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
                    packed[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
                    packed[j + 8] = (sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4);
                }
            }
            QuantType::Q6_K => block[208..210].copy_from_slice(&f16(d)),
            _ => unreachable!("a block format"),
        }
    }
    bytes
}

/// A seeded stream uniform in [-1, 1) (xorshift64*): weights here, random test inputs elsewhere.
pub struct Uniform(u64);

impl Uniform {
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn next_value(&mut self) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        2.0 * u - 1.0
    }

    /// Uniform random bytes.
    pub fn fill_bytes(&mut self, out: &mut [u8]) {
        let mut chunks = out.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let last = self.next_u64().to_le_bytes();
        let n = rest.len();
        rest.copy_from_slice(&last[..n]);
    }

    pub fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next_value()).collect()
    }
}

/// FNV-1a of the name: each tensor gets its own stream.
fn xxhash_name(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> ModelConfig {
        let json = r#"{"model_type":"llama","architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,
            "rms_norm_eps":1e-5,"max_position_embeddings":256,"tie_word_embeddings":false}"#;
        ModelConfig::from_hf_json(json, "synthetic").unwrap()
    }

    #[test]
    fn shapes_follow_the_config_and_unknown_names_are_absent() {
        let c = tiny();
        let bf16 = QuantType::BF16;
        let t = tensor(&c, "blk.1.ffn_down.weight", bf16, 0)
            .unwrap()
            .unwrap();
        assert_eq!((t.rows, t.cols, t.bytes.len()), (64, 128, 64 * 128 * 2));
        assert!(
            tensor(&c, "blk.2.ffn_down.weight", bf16, 0)
                .unwrap()
                .is_none()
        );
        assert!(tensor(&c, "blk.0.attn_q.bias", bf16, 0).unwrap().is_none());
        assert!(tensor(&c, "output.weight", bf16, 0).unwrap().is_some());
    }

    #[test]
    fn block_formats_hold_the_matrices_and_norms_stay_bf16() {
        let c = tiny();
        let t = tensor(&c, "blk.0.ffn_up.weight", QuantType::Q8_0, 0)
            .unwrap()
            .unwrap();
        assert_eq!((t.ty, t.rows, t.cols), (QuantType::Q8_0, 128, 64));
        assert_eq!(t.bytes.len(), 128 * 2 * 34);
        let norm = tensor(&c, "blk.0.ffn_norm.weight", QuantType::Q8_0, 0)
            .unwrap()
            .unwrap();
        assert_eq!(norm.ty, QuantType::BF16);
        // 64 columns are a quarter of a K-quant block.
        let err = tensor(&c, "blk.0.ffn_up.weight", QuantType::Q4_K, 0).unwrap_err();
        assert_eq!(
            err.to_string(),
            "blk.0.ffn_up.weight: 64 columns are not whole Q4_K blocks of 256 values"
        );
        assert!(matches!(
            tensor(&c, "blk.0.ffn_up.weight", QuantType::F16, 0),
            Err(SyntheticError::Unsupported(QuantType::F16))
        ));
    }

    /// Each format's dequantized values have the spread asked for (what keeps a random model's
    /// activations at unit scale), centered, with per-block scales that vary.
    #[test]
    fn random_blocks_dequantize_to_the_spread_asked_for() {
        let (rows, cols, spread) = (64, 4096, 1.0 / 64.0);
        for ty in QuantType::BLOCK_FORMATS {
            let bytes = random_blocks(ty, rows, cols, spread, &mut Uniform::new(3));
            assert_eq!(Some(bytes.len()), ty.row_bytes(cols).map(|r| r * rows));
            let mut values = vec![0f32; rows * cols];
            let row_bytes = bytes.len() / rows;
            for (row, out) in bytes
                .chunks_exact(row_bytes)
                .zip(values.chunks_exact_mut(cols))
            {
                crate::dequant::dequantize_row(ty, row, out);
            }
            let n = values.len() as f64;
            let mean = values.iter().map(|&v| v as f64).sum::<f64>() / n;
            let rms = (values.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / n).sqrt();
            let spread = spread as f64;
            assert!(
                (rms / spread - 1.0).abs() < 0.05,
                "{ty}: rms {rms:e} for {spread:e}"
            );
            // Q4_0's quants run from −8 to 7: its values lean by half a step.
            let expected_mean = match ty {
                QuantType::Q4_0 => -0.5 / 21.5f64.sqrt() * spread,
                _ => 0.0,
            };
            assert!(
                (mean - expected_mean).abs() < 0.02 * spread,
                "{ty}: mean {mean:e}"
            );
            // Blocks' largest magnitudes differ: scales are per block.
            let block_max: Vec<f32> = values
                .chunks_exact(ty.block_len())
                .take(16)
                .map(|b| b.iter().fold(0f32, |m, v| m.max(v.abs())))
                .collect();
            let (lo, hi) = block_max
                .iter()
                .fold((f32::MAX, 0f32), |(lo, hi), &m| (lo.min(m), hi.max(m)));
            assert!(hi > 1.5 * lo, "{ty}: block maxima {block_max:?}");
        }
    }
}
