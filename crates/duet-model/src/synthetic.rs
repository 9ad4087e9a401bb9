//! Random bf16 weights in a model's shapes, by GGUF tensor name: benchmarks run models of any size
//! (a Llama-3-8B shape on a GPU) without a file. Matrices are uniform in ±√(3/cols), so that
//! activations keep unit scale through the layers; norm weights are near 1.

use crate::config::ModelConfig;
use crate::model_files::RawTensor;
use crate::quant_type::QuantType;
use crate::storage::WeightBytes;

/// The tensor `name` of a `config`-shaped model, or `None` for a tensor the model does not have.
pub fn tensor(config: &ModelConfig, name: &str, seed: u64) -> Option<RawTensor> {
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
        _ => return None,
    };
    let is_norm = name.ends_with("norm.weight");
    let (center, half_width) = if is_norm {
        (1.0, 0.1)
    } else {
        (0.0, (3.0 / cols as f32).sqrt())
    };
    let mut noise = Uniform::new(seed ^ xxhash_name(name));
    let mut bytes = Vec::with_capacity(rows * cols * 2);
    for _ in 0..rows * cols {
        let v = center + half_width * noise.next_value();
        bytes.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes());
    }
    Some(RawTensor {
        name: name.to_string(),
        ty: QuantType::BF16,
        rows,
        cols,
        bytes: WeightBytes::from_vec(bytes),
    })
}

/// A seeded stream uniform in [-1, 1) (xorshift64*): weights here, random test inputs elsewhere.
pub struct Uniform(u64);

impl Uniform {
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    pub fn next_value(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let u = (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32;
        2.0 * u - 1.0
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
        let t = tensor(&c, "blk.1.ffn_down.weight", 0).unwrap();
        assert_eq!((t.rows, t.cols, t.bytes.len()), (64, 128, 64 * 128 * 2));
        assert!(tensor(&c, "blk.2.ffn_down.weight", 0).is_none());
        assert!(tensor(&c, "blk.0.attn_q.bias", 0).is_none());
        assert!(tensor(&c, "output.weight", 0).is_some());
    }
}
