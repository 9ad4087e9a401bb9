//! Model families beyond Llama against an independent float64 numpy forward
//! (tests/reference/make_tiny_families.py): Qwen3 dense (per-head q/k RMSNorm before RoPE, a head
//! dim of 32 that is not hidden ÷ heads, tied embeddings), from its HF directory and from its GGUF
//! conversion, every position of every prompt, whole prompts and token by token.

mod common;

use common::*;
use duet_engine::batch::{LogitsWanted, SeqInput};
use duet_model::config::Architecture;

const TOL: f32 = 1e-4;

/// The model at `path` against `file`'s cases, whole prompts at once.
fn check(path: &std::path::Path, file: &str) {
    let mut h = Harness::load(path, 2);
    for case in cases(file) {
        let got = h.prompt_logits(&case.tokens);
        for (&pos, want) in case.positions.iter().zip(&case.logits) {
            let d = max_abs_diff(&got[pos], want);
            assert!(
                d <= TOL,
                "{} {}: position {pos} differs from the reference by {d} (tolerance {TOL})",
                path.display(),
                case.name
            );
        }
    }
}

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
