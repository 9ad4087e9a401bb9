//! Model families beyond Llama against an independent float64 numpy forward
//! (tests/reference/make_tiny_families.py): Qwen3 dense (per-head q/k RMSNorm before RoPE, a head
//! dim of 32 that is not hidden ÷ heads, tied embeddings), from its HF directory and from its GGUF
//! conversion, every position of every prompt, whole prompts and token by token.

use crate::common::*;
use duet_engine::batch::{LogitsWanted, SeqInput};
use duet_model::config::Architecture;

#[test]
fn qwen3_matches_the_reference() {
    let dir = fixtures().join("tiny-qwen3");
    let config = duet_model::model_files::open_model(&dir).unwrap().config;
    assert_eq!(config.architecture, Architecture::Qwen3);
    assert!(config.qk_norm && config.tie_word_embeddings);
    assert_eq!(
        (config.head_dim, config.hidden_size / config.num_heads),
        (32, 16)
    );
    check(&dir, "tiny-qwen3-logits.json");
}

#[test]
fn qwen3_from_gguf_matches_the_same_reference() {
    check(
        &fixtures().join("tiny-qwen3.gguf"),
        "tiny-qwen3-logits.json",
    );
}

/// Decoding one token at a time through the paged cache gives the whole prompt's logits: the
/// q/k norms apply to the cached keys as to the new ones.
#[test]
fn qwen3_token_by_token_through_the_cache_matches_the_reference() {
    let mut h = Harness::load(&fixtures().join("tiny-qwen3"), 2);
    let case = cases("tiny-qwen3-logits.json")
        .into_iter()
        .max_by_key(|c| c.tokens.len())
        .unwrap();
    let table = h.blocks_for(case.tokens.len());
    for (pos, t) in case.tokens.iter().enumerate() {
        let got = h.forward(&[SeqInput {
            tokens: std::slice::from_ref(t),
            start_pos: pos,
            block_table: &table,
            logits: LogitsWanted::Last,
        }]);
        let d = max_abs_diff(got.row(0), &case.logits[pos]);
        assert!(d <= TOL, "{}: position {pos} differs by {d}", case.name);
    }
}

/// Mixtral: 4 experts, top 2, renormalized; in layer 1 two router rows are equal, so some tokens
/// tie at the top-2 boundary and take the lower expert (the reference's rule; the other choice
/// moves the logits far past the tolerance).
#[test]
fn mixtral_matches_the_reference_ties_included() {
    let dir = fixtures().join("tiny-mixtral");
    let config = duet_model::model_files::open_model(&dir).unwrap().config;
    assert_eq!(config.architecture, Architecture::Mixtral);
    let moe = config.moe.unwrap();
    assert_eq!(
        (moe.num_experts, moe.experts_per_token, moe.normalize_top_k),
        (4, 2, true)
    );
    check(&dir, "tiny-mixtral-logits.json");
}

#[test]
fn mixtral_from_gguf_stacked_experts_matches_the_same_reference() {
    check(
        &fixtures().join("tiny-mixtral.gguf"),
        "tiny-mixtral-logits.json",
    );
}

/// Qwen3-MoE with `norm_topk_prob` true and false: the picked experts' weights renormalized or
/// used as the softmax gave them (the two differ in logits and in some picks).
#[test]
fn qwen3_moe_matches_the_reference_with_and_without_renormalizing() {
    for (dir, normalized) in [
        ("tiny-qwen3-moe", true),
        ("tiny-qwen3-moe-unnormalized", false),
    ] {
        let path = fixtures().join(dir);
        let config = duet_model::model_files::open_model(&path).unwrap().config;
        assert_eq!(config.architecture, Architecture::Qwen3Moe);
        assert!(config.qk_norm);
        assert_eq!(config.moe.unwrap().normalize_top_k, normalized);
        check(&path, &format!("{dir}-logits.json"));
    }
}

#[test]
fn qwen3_moe_from_gguf_matches_the_same_reference() {
    check(
        &fixtures().join("tiny-qwen3-moe.gguf"),
        "tiny-qwen3-moe-logits.json",
    );
}

/// A step of several sequences routes each token by itself: a batch of every case's prompt at
/// once gives each its own logits.
#[test]
fn mixtral_batches_route_each_token_alone() {
    let mut h = Harness::load(&fixtures().join("tiny-mixtral"), 2);
    let cases = cases("tiny-mixtral-logits.json");
    let tables: Vec<Vec<u32>> = cases.iter().map(|c| h.blocks_for(c.tokens.len())).collect();
    let inputs: Vec<SeqInput> = cases
        .iter()
        .zip(&tables)
        .map(|(c, t)| SeqInput {
            tokens: &c.tokens,
            start_pos: 0,
            block_table: t,
            logits: LogitsWanted::All,
        })
        .collect();
    let got = h.forward(&inputs);
    let mut row = 0;
    for case in &cases {
        for (pos, want) in case.logits.iter().enumerate() {
            let d = max_abs_diff(got.row(row), want);
            assert!(d <= TOL, "{} position {pos} in a batch: {d}", case.name);
            row += 1;
        }
    }
}

/// A config asking more experts per token than it has, and a checkpoint missing an expert the
/// config names, are clear errors naming the file and what is wrong.
#[test]
fn bad_moe_configs_and_missing_experts_are_refused_naming_them() {
    let src = fixtures().join("tiny-mixtral");
    let config = std::fs::read_to_string(src.join("config.json")).unwrap();
    let top_k = config.replace("\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 5");
    assert_ne!(top_k, config, "the fixture names num_experts_per_tok");
    let e = duet_model::config::ModelConfig::from_hf_json(&top_k, "tiny-mixtral/config.json")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tiny-mixtral/config.json")
            && e.contains("num_experts_per_tok")
            && e.contains("5"),
        "{e}"
    );
    // The checkpoint without layer 0's expert 3 (its safetensors rewritten without the tensor).
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let missing = "model.layers.0.block_sparse_moe.experts.3.w2.weight";
    std::fs::write(
        dir.path().join("model.safetensors"),
        safetensors_without(
            &std::fs::read(src.join("model.safetensors")).unwrap(),
            missing,
        ),
    )
    .unwrap();
    let files = duet_model::model_files::open_model(dir.path()).unwrap();
    let e = duet_model::model_files::validate_llama_tensors(&files)
        .unwrap_err()
        .to_string();
    assert!(e.contains("blk.0.ffn_down_exps.3.weight"), "{e}");
}

/// A safetensors file's bytes with the tensor `name` left out.
fn safetensors_without(file: &[u8], name: &str) -> Vec<u8> {
    let header_len = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&file[8..8 + header_len]).unwrap();
    let data = &file[8 + header_len..];
    let (mut kept, mut bytes) = (serde_json::Map::new(), Vec::new());
    for (key, entry) in header {
        if key == name || key == "__metadata__" {
            continue;
        }
        let offsets = entry["data_offsets"].as_array().unwrap();
        let (start, end) = (offsets[0].as_u64().unwrap(), offsets[1].as_u64().unwrap());
        let at = bytes.len() as u64;
        bytes.extend_from_slice(&data[start as usize..end as usize]);
        let mut entry = entry.clone();
        entry["data_offsets"] = serde_json::json!([at, at + end - start]);
        kept.insert(key, entry);
    }
    let header = serde_json::to_vec(&kept).unwrap();
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    out.extend_from_slice(&bytes);
    out
}
