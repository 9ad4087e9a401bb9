//! The model's hyper-parameters, read from a HF `config.json` or from GGUF metadata.

use std::path::Path;

use serde_json::Value;

use crate::gguf::{GgufError, GgufFile};
use crate::quant_type::QuantType;
use crate::rope::{RopeError, RopeFrequencies, RopeScaling};

/// The decoder families we run. SmolLM and Llama 2/3 are `Llama`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    /// Qwen3 dense: per-head q/k RMSNorm, an explicit head dim.
    Qwen3,
    /// Llama with a sparse mixture-of-experts FFN.
    Mixtral,
    /// Qwen3 with a sparse mixture-of-experts FFN.
    Qwen3Moe,
}

impl Architecture {
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Mixtral => "mixtral",
            Self::Qwen3Moe => "qwen3_moe",
        }
    }
}

impl std::fmt::Display for Architecture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rope_theta: f32,
    /// How the rotary embeddings are scaled (Llama 3.1+, YaRN, ...).
    pub rope_scaling: RopeScaling,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (Qwen2).
    pub attention_bias: bool,
    /// Each head of q and k goes through an RMSNorm of its own weights before RoPE (Qwen3).
    pub qk_norm: bool,
    /// A sparse mixture-of-experts FFN in every layer instead of the dense one.
    pub moe: Option<MoeConfig>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// A sparse mixture-of-experts FFN (Mixtral, Qwen3-MoE): a token's FFN output is the weighted
/// sum of `experts_per_token` of `num_experts` SwiGLU experts, picked by a router (a linear layer,
/// softmax, top-k).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub experts_per_token: usize,
    /// Each expert's intermediate size.
    pub expert_intermediate_size: usize,
    /// The picked experts' probabilities are renormalized to sum to 1 (Mixtral always;
    /// Qwen3-MoE when `norm_topk_prob`), else used as the softmax gave them.
    pub normalize_top_k: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{origin}: cannot read model config: {source}")]
    Io {
        origin: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{origin}: model config is not valid JSON: {source}")]
    Json {
        origin: String,
        #[source]
        source: serde_json::Error,
    },
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{origin}: unsupported architecture {found:?} (supported: {supported})")]
    UnsupportedArchitecture {
        origin: String,
        found: String,
        supported: &'static str,
    },
    #[error("{origin}: required field {field:?} is missing")]
    Missing { origin: String, field: String },
    #[error("{origin}: field {field:?} has a bad value {value}: {why}")]
    BadValue {
        origin: String,
        field: String,
        value: String,
        why: String,
    },
    #[error("{origin}: unsupported: {what}")]
    Unsupported { origin: String, what: String },
    #[error("{origin}: inconsistent config: {why}")]
    Invalid { origin: String, why: String },
}

impl ModelConfig {
    /// Width of the concatenated query heads.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Width of the concatenated key (or value) heads.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// The rotary embeddings' inverse frequencies and attention factor, computed once at load.
    pub fn rope_frequencies(&self) -> Result<RopeFrequencies, RopeError> {
        self.rope_scaling
            .frequencies(self.rope_theta as f64, self.head_dim)
    }

    /// Weights of the matrix products one token goes through (every layer's projections and the
    /// LM head): its multiply-accumulates outside attention, and the elements a step of one
    /// token reads. With a mixture of experts, the active ones: the router and the experts a
    /// token goes to, not the others.
    pub fn matmul_params(&self) -> usize {
        let (h, q, kv) = (self.hidden_size, self.q_dim(), self.kv_dim());
        let ffn = match &self.moe {
            None => 3 * h * self.intermediate_size,
            Some(m) => m.experts_per_token * 3 * h * m.expert_intermediate_size + m.num_experts * h,
        };
        self.num_layers * (h * (q + 2 * kv) + q * h + ffn) + self.vocab_size * h
    }

    /// Reads a HF `config.json`.
    pub fn from_hf_config_file(path: &Path) -> Result<Self, ConfigError> {
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            origin: origin.clone(),
            source,
        })?;
        Self::from_hf_json(&text, &origin)
    }

    /// Parses the text of a HF `config.json`; `origin` names it in errors.
    pub fn from_hf_json(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let o = || origin.to_string();
        let v: Value = serde_json::from_str(text).map_err(|source| ConfigError::Json {
            origin: o(),
            source,
        })?;
        let Some(obj) = v.as_object() else {
            return Err(ConfigError::Invalid {
                origin: o(),
                why: "top level is not a JSON object".into(),
            });
        };
        let model_type = obj
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| ConfigError::Missing {
                origin: o(),
                field: "model_type".into(),
            })?;
        let architecture = match model_type {
            "llama" => Architecture::Llama,
            "mistral" => Architecture::Mistral,
            "qwen2" => Architecture::Qwen2,
            "qwen3" => Architecture::Qwen3,
            "mixtral" => Architecture::Mixtral,
            "qwen3_moe" => Architecture::Qwen3Moe,
            other => {
                return Err(ConfigError::UnsupportedArchitecture {
                    origin: o(),
                    found: other.into(),
                    supported: "llama, mistral, qwen2, qwen3, mixtral, qwen3_moe",
                });
            }
        };
        let bad = |field: &str, value: &Value, why: &str| ConfigError::BadValue {
            origin: o(),
            field: field.into(),
            value: value.to_string(),
            why: why.into(),
        };
        let opt_usize = |field: &str| -> Result<Option<usize>, ConfigError> {
            match obj.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_u64()
                    .and_then(|x| usize::try_from(x).ok())
                    .map(Some)
                    .ok_or_else(|| bad(field, v, "expected a non-negative integer")),
            }
        };
        let req_usize = |field: &str| -> Result<usize, ConfigError> {
            opt_usize(field)?.ok_or_else(|| ConfigError::Missing {
                origin: o(),
                field: field.into(),
            })
        };
        let opt_f32 = |field: &str| -> Result<Option<f32>, ConfigError> {
            match obj.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_f64()
                    .map(|x| Some(x as f32))
                    .ok_or_else(|| bad(field, v, "expected a number")),
            }
        };
        let opt_bool = |field: &str| -> Result<Option<bool>, ConfigError> {
            match obj.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_bool()
                    .map(Some)
                    .ok_or_else(|| bad(field, v, "expected true or false")),
            }
        };
        let token_id = |v: &Value, field: &str| -> Result<u32, ConfigError> {
            v.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| bad(field, v, "expected a token id"))
        };

        let max_position_embeddings = opt_usize("max_position_embeddings")?.unwrap_or(2048);
        let rope_scaling = match obj.get("rope_scaling") {
            None | Some(Value::Null) => RopeScaling::None,
            Some(Value::Object(scaling)) => RopeScaling::from_hf(scaling, max_position_embeddings)
                .map_err(|e| bad("rope_scaling", &Value::Object(scaling.clone()), &e.0))?,
            Some(v) => return Err(bad("rope_scaling", v, "expected an object")),
        };

        let hidden_size = req_usize("hidden_size")?;
        let num_heads = req_usize("num_attention_heads")?;
        let num_kv_heads = opt_usize("num_key_value_heads")?.unwrap_or(num_heads);
        let head_dim = match opt_usize("head_dim")? {
            Some(h) => h,
            None if num_heads > 0 => hidden_size / num_heads,
            None => 0,
        };
        let bos_token_id = match obj.get("bos_token_id") {
            None | Some(Value::Null) => None,
            Some(v) => Some(token_id(v, "bos_token_id")?),
        };
        let eos_token_ids = match obj.get("eos_token_id") {
            None | Some(Value::Null) => vec![],
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| token_id(v, "eos_token_id"))
                .collect::<Result<_, _>>()?,
            Some(v) => vec![token_id(v, "eos_token_id")?],
        };
        let cfg = Self {
            architecture,
            hidden_size,
            intermediate_size: req_usize("intermediate_size")?,
            num_layers: req_usize("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: req_usize("vocab_size")?,
            rope_theta: opt_f32("rope_theta")?.unwrap_or(10_000.0),
            rope_scaling,
            rms_norm_eps: opt_f32("rms_norm_eps")?.unwrap_or(1e-6),
            max_position_embeddings,
            tie_word_embeddings: opt_bool("tie_word_embeddings")?.unwrap_or(false),
            attention_bias: match architecture {
                // Qwen2 always has q/k/v biases (its config has no switch for it).
                Architecture::Qwen2 => true,
                _ => opt_bool("attention_bias")?.unwrap_or(false),
            },
            qk_norm: matches!(architecture, Architecture::Qwen3 | Architecture::Qwen3Moe),
            moe: match architecture {
                Architecture::Mixtral => Some(MoeConfig {
                    num_experts: req_usize("num_local_experts")?,
                    experts_per_token: req_usize("num_experts_per_tok")?,
                    expert_intermediate_size: req_usize("intermediate_size")?,
                    normalize_top_k: true,
                }),
                Architecture::Qwen3Moe => {
                    if let Some(step) = opt_usize("decoder_sparse_step")?
                        && step != 1
                    {
                        return Err(ConfigError::Unsupported {
                            origin: o(),
                            what: format!(
                                "decoder_sparse_step {step} (dense layers between MoE layers; only 1 is supported)"
                            ),
                        });
                    }
                    match obj.get("mlp_only_layers") {
                        None | Some(Value::Null) => {}
                        Some(Value::Array(a)) if a.is_empty() => {}
                        Some(v) => {
                            return Err(ConfigError::Unsupported {
                                origin: o(),
                                what: format!(
                                    "mlp_only_layers {v} (dense layers among MoE layers)"
                                ),
                            });
                        }
                    }
                    Some(MoeConfig {
                        num_experts: req_usize("num_experts")?,
                        experts_per_token: req_usize("num_experts_per_tok")?,
                        expert_intermediate_size: req_usize("moe_intermediate_size")?,
                        normalize_top_k: opt_bool("norm_topk_prob")?.unwrap_or(false),
                    })
                }
                _ => None,
            },
            bos_token_id,
            eos_token_ids,
        };
        cfg.validate(origin)?;
        Ok(cfg)
    }

    /// Reads the hyper-parameters from GGUF metadata (`general.architecture` llama or qwen2).
    pub fn from_gguf(file: &GgufFile) -> Result<Self, ConfigError> {
        let origin = file.path().display().to_string();
        let o = || origin.clone();
        let arch_name =
            file.require("general.architecture", file.get_str("general.architecture"))?;
        let architecture = match arch_name {
            // llama.cpp writes Mixtral as `llama` with experts.
            "llama" if file.get_u64("llama.expert_count")?.is_some_and(|n| n > 0) => {
                Architecture::Mixtral
            }
            "llama" => Architecture::Llama,
            "qwen2" => Architecture::Qwen2,
            "qwen3" => Architecture::Qwen3,
            "qwen3moe" => Architecture::Qwen3Moe,
            other => {
                return Err(ConfigError::UnsupportedArchitecture {
                    origin: o(),
                    found: other.into(),
                    supported: "llama (and Mixtral as llama with experts), qwen2, qwen3, qwen3moe",
                });
            }
        };
        let key = |k: &str| format!("{arch_name}.{k}");
        let usize_of = |k: &str| -> Result<Option<usize>, ConfigError> {
            let k = key(k);
            Ok(file
                .get_u64(&k)?
                .map(|x| usize::try_from(x).unwrap_or(usize::MAX)))
        };
        let req = |k: &str| -> Result<usize, ConfigError> {
            usize_of(k)?.ok_or_else(|| ConfigError::Missing {
                origin: o(),
                field: key(k),
            })
        };

        let rope_scaling = gguf_rope_scaling(file, arch_name, usize_of("context_length")?)?;
        let hidden_size = req("embedding_length")?;
        let num_heads = req("attention.head_count")?;
        let num_kv_heads = usize_of("attention.head_count_kv")?.unwrap_or(num_heads);
        let head_dim = match usize_of("attention.key_length")? {
            Some(h) => h,
            None => match usize_of("rope.dimension_count")? {
                Some(h) => h,
                None if num_heads > 0 => hidden_size / num_heads,
                None => 0,
            },
        };
        if let Some(rot) = usize_of("rope.dimension_count")?
            && rot != head_dim
        {
            return Err(ConfigError::Unsupported {
                origin: o(),
                what: format!(
                    "partial rotary embeddings ({} = {rot}, head dim {head_dim})",
                    key("rope.dimension_count")
                ),
            });
        }
        if let Some(v) = usize_of("attention.value_length")?
            && v != head_dim
        {
            return Err(ConfigError::Unsupported {
                origin: o(),
                what: format!("value head size {v} different from key head size {head_dim}"),
            });
        }
        let vocab_size = match usize_of("vocab_size")? {
            Some(v) => v,
            None => match file.get_array("tokenizer.ggml.tokens")? {
                Some(a) => a.len(),
                None => {
                    return Err(ConfigError::Missing {
                        origin: o(),
                        field: format!("{} (or tokenizer.ggml.tokens)", key("vocab_size")),
                    });
                }
            },
        };
        let bos_token_id = file.get_u32("tokenizer.ggml.bos_token_id")?;
        let mut eos_token_ids = Vec::new();
        for k in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
            if let Some(id) = file.get_u32(k)?
                && !eos_token_ids.contains(&id)
            {
                eos_token_ids.push(id);
            }
        }
        let cfg = Self {
            architecture,
            hidden_size,
            intermediate_size: req("feed_forward_length")?,
            num_layers: req("block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            rope_theta: file.get_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0),
            rope_scaling,
            rms_norm_eps: file
                .get_f32(&key("attention.layer_norm_rms_epsilon"))?
                .ok_or_else(|| ConfigError::Missing {
                    origin: o(),
                    field: key("attention.layer_norm_rms_epsilon"),
                })?,
            max_position_embeddings: usize_of("context_length")?.unwrap_or(2048),
            tie_word_embeddings: file.tensor("output.weight").is_none(),
            attention_bias: file.tensor("blk.0.attn_q.bias").is_some(),
            qk_norm: file.tensor("blk.0.attn_q_norm.weight").is_some(),
            moe: match usize_of("expert_count")? {
                None | Some(0) => None,
                Some(num_experts) => Some(MoeConfig {
                    num_experts,
                    experts_per_token: req("expert_used_count")?,
                    expert_intermediate_size: match usize_of("expert_feed_forward_length")? {
                        Some(n) => n,
                        None => req("feed_forward_length")?,
                    },
                    // llama.cpp renormalizes Mixtral's and Qwen3-MoE's top-k weights.
                    normalize_top_k: file.get_bool(&key("expert_weights_norm"))?.unwrap_or(true),
                }),
            },
            bos_token_id,
            eos_token_ids,
        };
        cfg.validate(&origin)?;
        Ok(cfg)
    }

    /// Checks the numbers fit together; `origin` names the source in errors.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        let invalid = |why: String| {
            Err(ConfigError::Invalid {
                origin: origin.into(),
                why,
            })
        };
        for (name, v) in [
            ("hidden size", self.hidden_size),
            ("intermediate size", self.intermediate_size),
            ("layer count", self.num_layers),
            ("attention head count", self.num_heads),
            ("key/value head count", self.num_kv_heads),
            ("head dim", self.head_dim),
            ("vocabulary size", self.vocab_size),
            ("context length", self.max_position_embeddings),
        ] {
            if v == 0 {
                return invalid(format!("{name} is 0"));
            }
        }
        // Sanity bounds: far beyond any real model, but keep arithmetic on them from overflowing.
        for (name, v, max) in [
            ("hidden size", self.hidden_size, 1 << 20),
            ("intermediate size", self.intermediate_size, 1 << 22),
            ("layer count", self.num_layers, 4096),
            ("attention head count", self.num_heads, 4096),
            ("head dim", self.head_dim, 4096),
            ("vocabulary size", self.vocab_size, 1 << 24),
            ("context length", self.max_position_embeddings, 1 << 26),
        ] {
            if v > max {
                return invalid(format!("{name} {v} is implausibly large (limit {max})"));
            }
        }
        if self.num_kv_heads > self.num_heads || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return invalid(format!(
                "{} attention heads are not a multiple of {} key/value heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if let Some(m) = &self.moe {
            if m.num_experts == 0 || m.expert_intermediate_size == 0 {
                return invalid(format!(
                    "a mixture of {} experts of intermediate size {}",
                    m.num_experts, m.expert_intermediate_size
                ));
            }
            if m.experts_per_token == 0 || m.experts_per_token > m.num_experts {
                return invalid(format!(
                    "{} experts per token (num_experts_per_tok) of {} experts: top-k must be 1 to the expert count",
                    m.experts_per_token, m.num_experts
                ));
            }
        }
        if !self.head_dim.is_multiple_of(2) {
            return invalid(format!(
                "head dim {} is odd (RoPE rotates pairs)",
                self.head_dim
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return invalid(format!(
                "rope theta {} is not a positive number",
                self.rope_theta
            ));
        }
        if let Err(e) = self.rope_frequencies() {
            return invalid(e.0);
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return invalid(format!(
                "rms norm epsilon {} is not a non-negative number",
                self.rms_norm_eps
            ));
        }
        for &id in self.bos_token_id.iter().chain(&self.eos_token_ids) {
            if id as usize >= self.vocab_size {
                return invalid(format!(
                    "special token id {id} is outside the vocabulary of {}",
                    self.vocab_size
                ));
            }
        }
        Ok(())
    }
}

/// The RoPE scaling of a GGUF file: `<arch>.rope.scaling.type` (`none`, `linear` or `yarn`, with
/// `.factor`, `.original_context_length`, `.attn_factor`, `.yarn_beta_fast`, `.yarn_beta_slow`),
/// or the per-frequency factors of a `rope_freqs.weight` tensor (llama.cpp writes Llama 3.1's
/// `llama3` scaling so). Anything else is refused naming the key.
fn gguf_rope_scaling(
    file: &GgufFile,
    arch: &str,
    context_length: Option<usize>,
) -> Result<RopeScaling, ConfigError> {
    let origin = file.path().display().to_string();
    let key = |k: &str| format!("{arch}.rope.scaling.{k}");
    if let Some(info) = file.tensor("rope_freqs.weight") {
        if info.ty != QuantType::F32 {
            return Err(ConfigError::Unsupported {
                origin,
                what: format!("rope_freqs.weight of type {:?} (F32 expected)", info.ty),
            });
        }
        let bytes = file.info_bytes(info);
        let factors = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        return Ok(RopeScaling::Factors(factors));
    }
    let Some(kind) = file.get_str(&key("type"))? else {
        return Ok(RopeScaling::None);
    };
    let factor = file.get_f32(&key("factor"))?.map(f64::from);
    let original = file
        .get_u64(&key("original_context_length"))?
        .map(|n| n as usize)
        .or(context_length)
        .unwrap_or(2048);
    let unsupported = |what: String| ConfigError::Unsupported {
        origin: origin.clone(),
        what,
    };
    let factor = |kind: &str| {
        factor.filter(|f| *f >= 1.0).ok_or_else(|| {
            unsupported(format!(
                "{} {kind:?} without a factor of at least 1",
                key("type")
            ))
        })
    };
    Ok(match kind {
        "none" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: factor(kind)?,
        },
        "yarn" => {
            let factor = factor(kind)?;
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: original,
                beta_fast: file
                    .get_f32(&key("yarn_beta_fast"))?
                    .map_or(32.0, f64::from),
                beta_slow: file.get_f32(&key("yarn_beta_slow"))?.map_or(1.0, f64::from),
                attention_factor: file
                    .get_f32(&key("attn_factor"))?
                    .map_or(0.1 * factor.ln() + 1.0, f64::from),
                truncate: true,
            }
        }
        other => {
            return Err(unsupported(format!(
                "{} {other:?} (supported: none, linear, yarn, and rope_freqs.weight)",
                key("type")
            )));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufValue;
    use crate::gguf::test_writer::GgufWriter;

    const SMOL: &str = r#"{
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
      "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
      "rope_theta": 100000, "rms_norm_eps": 1e-05, "max_position_embeddings": 8192,
      "tie_word_embeddings": true, "bos_token_id": 1, "eos_token_id": 2,
      "rope_scaling": null, "torch_dtype": "bfloat16"
    }"#;

    #[test]
    fn hf_llama() {
        let c = ModelConfig::from_hf_json(SMOL, "config.json").unwrap();
        assert_eq!(c.architecture, Architecture::Llama);
        assert_eq!(
            (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim),
            (30, 9, 3, 64)
        );
        assert_eq!(c.rope_theta, 100000.0);
        assert!(c.tie_word_embeddings && !c.attention_bias);
        assert_eq!(
            (c.bos_token_id, c.eos_token_ids.clone()),
            (Some(1), vec![2])
        );
        assert_eq!((c.q_dim(), c.kv_dim()), (576, 192));
    }

    #[test]
    fn hf_variants() {
        let j = SMOL
            .replace("\"eos_token_id\": 2", "\"eos_token_id\": [2, 0]")
            .replace("\"llama\"", "\"qwen2\"");
        let c = ModelConfig::from_hf_json(&j, "x").unwrap();
        assert_eq!(c.eos_token_ids, vec![2, 0]);
        assert_eq!(c.architecture, Architecture::Qwen2);
        assert!(c.attention_bias);
        let j = SMOL.replace(
            "\"rope_theta\": 100000,",
            "\"rope_theta\": 100000, \"head_dim\": 128,",
        );
        assert_eq!(ModelConfig::from_hf_json(&j, "x").unwrap().head_dim, 128);
        let j = SMOL.replace("\"llama\"", "\"mistral\"");
        assert_eq!(
            ModelConfig::from_hf_json(&j, "x").unwrap().architecture,
            Architecture::Mistral
        );
    }

    #[test]
    fn hf_errors() {
        let err = |j: &str| {
            ModelConfig::from_hf_json(j, "dir/config.json")
                .unwrap_err()
                .to_string()
        };
        for (scaling, says) in [
            (r#"{"type": "yarn"}"#, "has no factor"),
            (
                r#"{"rope_type": "longrope", "factor": 2}"#,
                "\"longrope\" is not supported",
            ),
            ("8", "expected an object"),
        ] {
            let e = err(&SMOL.replace(
                "\"rope_scaling\": null",
                &format!("\"rope_scaling\": {scaling}"),
            ));
            assert!(
                e.contains("rope_scaling") && e.contains(says) && e.contains("dir/config.json"),
                "{e}"
            );
        }
        let llama3 = SMOL.replace(
            "\"rope_scaling\": null",
            r#""rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 1024}"#,
        );
        let c = ModelConfig::from_hf_json(&llama3, "x").unwrap();
        assert!(
            matches!(c.rope_scaling, RopeScaling::Llama3 { factor: 8.0, .. }),
            "{:?}",
            c.rope_scaling
        );
        let e = err(&SMOL.replace("\"llama\"", "\"gpt_neox\""));
        assert!(e.contains("gpt_neox"), "{e}");
        let e = err(&SMOL.replace("\"num_key_value_heads\": 3", "\"num_key_value_heads\": 4"));
        assert!(e.contains("not a multiple"), "{e}");
        let e = err(&SMOL.replace("\"hidden_size\": 576,", ""));
        assert!(e.contains("\"hidden_size\" is missing"), "{e}");
        let e = err(&SMOL.replace("\"vocab_size\": 49152", "\"vocab_size\": -1"));
        assert!(e.contains("vocab_size"), "{e}");
        let e = err(&SMOL.replace("\"eos_token_id\": 2", "\"eos_token_id\": 60000"));
        assert!(e.contains("60000"), "{e}");
        let e = err("{not json");
        assert!(e.contains("not valid JSON"), "{e}");
    }

    fn gguf_meta(w: GgufWriter) -> GgufWriter {
        w.kv("general.architecture", GgufValue::String("llama".into()))
            .kv("llama.block_count", GgufValue::U32(2))
            .kv("llama.embedding_length", GgufValue::U32(64))
            .kv("llama.feed_forward_length", GgufValue::U32(128))
            .kv("llama.attention.head_count", GgufValue::U32(4))
            .kv("llama.attention.head_count_kv", GgufValue::U32(2))
            .kv(
                "llama.attention.layer_norm_rms_epsilon",
                GgufValue::F32(1e-5),
            )
            .kv("llama.context_length", GgufValue::U32(256))
            .kv("llama.rope.dimension_count", GgufValue::U32(16))
            .kv(
                "tokenizer.ggml.tokens",
                GgufValue::Array(crate::gguf::GgufArray::String(vec!["a".into(); 10])),
            )
            .kv("tokenizer.ggml.bos_token_id", GgufValue::U32(1))
            .kv("tokenizer.ggml.eos_token_id", GgufValue::U32(2))
            .kv("tokenizer.ggml.eot_token_id", GgufValue::U32(3))
    }

    #[test]
    fn from_gguf_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let p = gguf_meta(GgufWriter::new()).write(dir.path(), "a.gguf");
        let c = ModelConfig::from_gguf(&GgufFile::open(&p).unwrap()).unwrap();
        assert_eq!(c.architecture, Architecture::Llama);
        assert_eq!(
            (c.hidden_size, c.intermediate_size, c.num_layers),
            (64, 128, 2)
        );
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (4, 2, 16));
        assert_eq!(
            (c.vocab_size, c.rope_theta, c.max_position_embeddings),
            (10, 10000.0, 256)
        );
        assert!(c.tie_word_embeddings);
        assert_eq!(c.eos_token_ids, vec![2, 3]);

        let p = gguf_meta(GgufWriter::new())
            .kv("llama.rope.freq_base", GgufValue::F32(5e5))
            .f32_tensor("output.weight", &[64, 10])
            .write(dir.path(), "b.gguf");
        let c = ModelConfig::from_gguf(&GgufFile::open(&p).unwrap()).unwrap();
        assert!(!c.tie_word_embeddings);
        assert_eq!(c.rope_theta, 5e5);

        // Llama 3.1's scaling as llama.cpp writes it: one factor per frequency.
        let factors: Vec<u8> = [1.0f32, 1.0, 1.0, 1.5, 3.0, 8.0, 8.0, 8.0]
            .iter()
            .flat_map(|f| f.to_le_bytes())
            .collect();
        let p = gguf_meta(GgufWriter::new())
            .tensor("rope_freqs.weight", &[8], 0, factors)
            .write(dir.path(), "r.gguf");
        let c = ModelConfig::from_gguf(&GgufFile::open(&p).unwrap()).unwrap();
        let RopeScaling::Factors(f) = &c.rope_scaling else {
            panic!("{:?}", c.rope_scaling)
        };
        assert_eq!(f[5], 8.0);
        // A factor of 0 (the writer's 0, 1, 2, ...) is refused, naming the tensor.
        let p = gguf_meta(GgufWriter::new())
            .f32_tensor("rope_freqs.weight", &[8])
            .write(dir.path(), "r0.gguf");
        let e = ModelConfig::from_gguf(&GgufFile::open(&p).unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rope_freqs.weight") && e.contains("positive"),
            "{e}"
        );
        let p = gguf_meta(GgufWriter::new())
            .kv(
                "llama.rope.scaling.type",
                GgufValue::String("longrope".into()),
            )
            .kv("llama.rope.scaling.factor", GgufValue::F32(4.0))
            .write(dir.path(), "s.gguf");
        let e = ModelConfig::from_gguf(&GgufFile::open(&p).unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("llama.rope.scaling.type") && e.contains("longrope"),
            "{e}"
        );

        let p = GgufWriter::new()
            .kv("general.architecture", GgufValue::String("gemma".into()))
            .write(dir.path(), "c.gguf");
        let e = ModelConfig::from_gguf(&GgufFile::open(&p).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("gemma") && e.contains("c.gguf"), "{e}");

        let p = GgufWriter::new()
            .kv("general.architecture", GgufValue::String("llama".into()))
            .write(dir.path(), "d.gguf");
        let e = ModelConfig::from_gguf(&GgufFile::open(&p).unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("llama.embedding_length") && e.contains("missing"),
            "{e}"
        );
    }
}
