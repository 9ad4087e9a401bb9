//! RoPE scaling (Llama 3.1's `llama3`, `linear`, `dynamic`, `yarn`, and GGUF's `rope_freqs`)
//! against an independent float64 numpy forward (tests/reference/make_tiny_families.py): each
//! tiny model's logits at positions before and far past its `original_max_position_embeddings`
//! (32), and the inverse frequencies of each type.

use crate::common::*;
use duet_model::config::ModelConfig;
use duet_model::rope::RopeScaling;

#[test]
fn llama3_scaling_matches_the_reference_past_the_original_context() {
    check(
        &fixtures().join("tiny-rope-llama3"),
        "tiny-rope-llama3-logits.json",
    );
}

#[test]
fn llama3_scaling_from_gguf_rope_freqs_matches_the_same_reference() {
    let gguf = fixtures().join("tiny-rope-llama3.gguf");
    let config = duet_model::model_files::open_model(&gguf).unwrap().config;
    assert!(
        matches!(config.rope_scaling, RopeScaling::Factors(_)),
        "{:?}",
        config.rope_scaling
    );
    check(&gguf, "tiny-rope-llama3-logits.json");
}

#[test]
fn linear_scaling_matches_the_reference() {
    check(
        &fixtures().join("tiny-rope-linear"),
        "tiny-rope-linear-logits.json",
    );
}

#[test]
fn dynamic_scaling_matches_the_reference() {
    check(
        &fixtures().join("tiny-rope-dynamic"),
        "tiny-rope-dynamic-logits.json",
    );
}

#[test]
fn yarn_scaling_matches_the_reference() {
    check(
        &fixtures().join("tiny-rope-yarn"),
        "tiny-rope-yarn-logits.json",
    );
}

/// Each type's inverse frequencies (and YaRN's attention factor), as the config gives them,
/// against the reference's float64 values at θ 10000 and head dim 16.
#[test]
fn inverse_frequencies_match_the_reference() {
    let reference = read_json("rope-scaling-inv-freq.json");
    let theta = reference["theta"].as_f64().unwrap();
    let head_dim = reference["head_dim"].as_u64().unwrap() as usize;
    let types = reference["types"].as_array().unwrap();
    assert!(types.len() >= 5, "{types:?}");
    for t in types {
        let name = t["name"].as_str().unwrap();
        let scaling = match t["rope_scaling"].as_object() {
            None => RopeScaling::None,
            Some(map) => RopeScaling::from_hf(map, 256).unwrap(),
        };
        let got = scaling.frequencies(theta, head_dim).unwrap();
        let want: Vec<f64> = t["inv_freq"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        for (i, (g, w)) in got.inv_freq.iter().zip(&want).enumerate() {
            // Kept in f32, as HF keeps them.
            assert!(
                (*g as f64 - w).abs() <= 1e-6 * w.abs(),
                "{name}: inv_freq[{i}] {g} against {w}"
            );
        }
        let factor = t["attention_factor"].as_f64().unwrap();
        assert!(
            (got.attention_factor as f64 - factor).abs() < 1e-6,
            "{name}: {got:?}"
        );
        if let Some(factors) = t.get("gguf_rope_freqs") {
            let factors: Vec<f32> = floats(factors);
            let from_gguf = RopeScaling::Factors(factors)
                .frequencies(theta, head_dim)
                .unwrap();
            for (a, b) in from_gguf.inv_freq.iter().zip(&got.inv_freq) {
                assert!(
                    (a - b).abs() <= 1e-6 * b.abs(),
                    "{name}: GGUF factors give {a}, HF {b}"
                );
            }
        }
    }
}

/// A config whose scaling the engine does not know is refused at load, naming the type.
#[test]
fn an_unknown_rope_type_is_refused_naming_it() {
    let path = fixtures().join("tiny-rope-yarn/config.json");
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("\"yarn\"", "\"longrope\"");
    let e = ModelConfig::from_hf_json(&text, "tiny-rope-yarn/config.json")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("longrope") && e.contains("tiny-rope-yarn/config.json"),
        "{e}"
    );
}
