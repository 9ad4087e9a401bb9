//! The engine against logits of a tiny random Llama computed by an independent numpy forward
//! pass (tests/reference/make_tiny_llama.py): whole prompts, token-by-token decoding through the
//! paged KV cache, mixed-length batches, and the same model loaded from GGUF (F32 and Q8_0).

use crate::common::*;
use duet_engine::backend::KvDtypeChoice;
use duet_engine::batch::{LogitsWanted, SeqInput};
use duet_model::fp8::Quantization;

const TOL: f32 = 1e-4;

fn assert_close(got: &[Vec<f32>], want: &[Vec<f32>], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: number of positions");
    for (pos, (g, w)) in got.iter().zip(want).enumerate() {
        let d = max_abs_diff(g, w);
        assert!(
            d <= tol,
            "{what}: position {pos} differs from the reference by {d} (tolerance {tol})"
        );
    }
}

fn tiny_hf() -> Harness {
    Harness::load(&fixtures().join("tiny-llama"), 2)
}

#[test]
fn full_prompt_matches_reference() {
    let mut h = tiny_hf();
    for case in cases("tiny-llama-logits.json") {
        let got = h.prompt_logits(&case.tokens);
        assert_close(&got, &case.logits, TOL, &case.name);
    }
}

#[test]
fn token_by_token_decoding_through_the_cache_matches_reference() {
    let mut h = tiny_hf();
    let case = cases("tiny-llama-logits.json")
        .into_iter()
        .find(|c| c.name == "prompt12")
        .unwrap();
    let table = h.blocks_for(case.tokens.len());
    let mut got = Vec::new();
    for (pos, t) in case.tokens.iter().enumerate() {
        let l = h.forward(&[SeqInput {
            tokens: std::slice::from_ref(t),
            start_pos: pos,
            block_table: &table,
            logits: LogitsWanted::Last,
        }]);
        got.push(l.row(0).to_vec());
    }
    assert_close(&got, &case.logits, TOL, "token by token");
}

#[test]
fn prompt_in_chunks_matches_reference() {
    let mut h = tiny_hf();
    let case = cases("tiny-llama-logits.json")
        .into_iter()
        .find(|c| c.name == "len40")
        .unwrap();
    let table = h.blocks_for(case.tokens.len());
    let mut got = Vec::new();
    // Chunks that do not line up with the 4-token blocks.
    let mut start = 0;
    for len in [7, 1, 13, 19] {
        let l = h.forward(&[SeqInput {
            tokens: &case.tokens[start..start + len],
            start_pos: start,
            block_table: &table,
            logits: LogitsWanted::All,
        }]);
        got.extend((0..l.num_rows()).map(|i| l.row(i).to_vec()));
        start += len;
    }
    assert_close(&got, &case.logits, TOL, "chunked prompt");
}

#[test]
fn mixed_length_batch_equals_each_solo_run() {
    let mut h = tiny_hf();
    let cases = cases("tiny-llama-logits.json");
    // Step 1: every prompt but its last token, all in one batch.
    let tables: Vec<Vec<u32>> = cases.iter().map(|c| h.blocks_for(c.tokens.len())).collect();
    let prefill: Vec<SeqInput<'_>> = cases
        .iter()
        .zip(&tables)
        .filter(|(c, _)| c.tokens.len() > 1)
        .map(|(c, t)| SeqInput {
            tokens: &c.tokens[..c.tokens.len() - 1],
            start_pos: 0,
            block_table: t,
            logits: LogitsWanted::All,
        })
        .collect();
    let l = h.forward(&prefill);
    let mut row = 0;
    for c in cases.iter().filter(|c| c.tokens.len() > 1) {
        let got: Vec<Vec<f32>> = (row..row + c.tokens.len() - 1)
            .map(|i| l.row(i).to_vec())
            .collect();
        assert_close(
            &got,
            &c.logits[..c.tokens.len() - 1],
            TOL,
            &format!("{} in a mixed prefill batch", c.name),
        );
        row += c.tokens.len() - 1;
    }
    // Step 2: the last token of each (a decode step for most, a whole prompt for `len1`).
    let decode: Vec<SeqInput<'_>> = cases
        .iter()
        .zip(&tables)
        .map(|(c, t)| SeqInput {
            tokens: &c.tokens[c.tokens.len() - 1..],
            start_pos: c.tokens.len() - 1,
            block_table: t,
            logits: LogitsWanted::Last,
        })
        .collect();
    let l = h.forward(&decode);
    for (i, c) in cases.iter().enumerate() {
        let d = max_abs_diff(l.row(i), c.logits.last().unwrap());
        assert!(
            d <= TOL,
            "{}: last position in a mixed decode batch differs by {d}",
            c.name
        );
    }
}

#[test]
fn gguf_f32_with_permuted_qk_matches_reference() {
    let mut h = Harness::load(&fixtures().join("tiny-llama.gguf"), 1);
    for case in cases("tiny-llama-logits.json") {
        let got = h.prompt_logits(&case.tokens);
        assert_close(&got, &case.logits, TOL, &format!("GGUF {}", case.name));
    }
}

#[test]
fn gguf_q8_0_matches_reference_of_dequantized_weights() {
    // The engine quantizes activations to 8 bits for the integer dot products (as llama.cpp does),
    // so the tolerance allows one more 8-bit rounding; a misread block (scale, offset) moves logits by
    // whole units.
    let mut h = Harness::load(&fixtures().join("tiny-llama-q8_0.gguf"), 2);
    for case in cases("tiny-llama-q8_0-logits.json") {
        let got = h.prompt_logits(&case.tokens);
        assert_close(
            &got,
            &case.logits,
            5e-2,
            &format!("GGUF Q8_0 {}", case.name),
        );
    }
}

/// Largest logit difference an int8 KV cache may show from the float64 forward that models the
/// same cache (tests/reference/make_int8_kv_reference.py). The engine matches it to 1e-5 on an
/// AMD Zen 4; the margin is for a key or value whose f32 value lands on the other side of a
/// rounding step on another kernel path. Without the modelled rounding the difference is 7e-3
/// or more on every case.
const INT8_KV_TOL: f32 = 1e-3;

/// An int8 KV cache (a scale per token and KV head) computes the logits of a float64 forward
/// whose cache rounds the same way, for whole prompts and token by token through the cache.
#[test]
fn int8_kv_cache_matches_a_reference_with_the_same_rounding() {
    let int8 = || Harness::load_with_kv(&fixtures().join("tiny-llama"), 2, KvDtypeChoice::Int8);
    let reference = read_json("tiny-llama-int8-kv-logits.json");
    for (case, doc) in cases("tiny-llama-int8-kv-logits.json")
        .iter()
        .zip(reference["cases"].as_array().unwrap())
    {
        let unquantized = doc["max_abs_diff_vs_unquantized_kv"].as_f64().unwrap() as f32;
        assert!(
            unquantized > 5.0 * INT8_KV_TOL,
            "{}: {unquantized}",
            case.name
        );
        let got = int8().prompt_logits(&case.tokens);
        assert_close(
            &got,
            &case.logits,
            INT8_KV_TOL,
            &format!("{} int8 KV", case.name),
        );
        let mut h = int8();
        let table = h.blocks_for(case.tokens.len());
        let got: Vec<Vec<f32>> = (0..case.tokens.len())
            .map(|pos| {
                let l = h.forward(&[SeqInput {
                    tokens: &case.tokens[pos..pos + 1],
                    start_pos: pos,
                    block_table: &table,
                    logits: LogitsWanted::Last,
                }]);
                l.row(0).to_vec()
            })
            .collect();
        let what = format!("{} int8 KV token by token", case.name);
        assert_close(&got, &case.logits, INT8_KV_TOL, &what);
    }
}

/// Largest logit difference the CPU may show on the FP8 checkpoint from the float64 forward of its
/// dequantized weights (tests/reference/make_tiny_fp8.py): the CPU serves FP8 weights as bf16
/// (`e4m3 · scale` rounded to 8 significant bits), which moves these logits by less than 8e-3 (on
/// an AVX-512 Xeon; the margin is for other kernel paths); a misread scale or E4M3 byte moves them
/// by whole units.
const FP8_TOL: f32 = 1e-2;

/// The FP8 quantization's own error on this model, ‖Δ‖/‖ref‖ of the logits against the f32
/// model's (3.0e-2 in the reference; the bound for FP8 against bf16 is 5e-2).
const FP8_VS_F32_BOUND: f64 = 5e-2;

/// ‖got − want‖ / ‖want‖ over every position.
fn relative_distance(got: &[Vec<f32>], want: &[Vec<f32>]) -> f64 {
    let (mut d, mut r) = (0.0, 0.0);
    for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
        d += (*g as f64 - *w as f64).powi(2);
        r += (*w as f64).powi(2);
    }
    (d / r).sqrt()
}

/// An FP8 checkpoint in vLLM's layout (E4M3 projections, a scale per output channel), served by
/// the CPU dequantized at load: the logits of a float64 forward over the dequantized weights, and
/// within the stated bound of the f32 model's. `--quantization fp8` on the f32 model quantizes
/// to the same bytes and scales as numpy and ml_dtypes did for the checkpoint, so its logits are
/// the checkpoint's, bit for bit.
#[test]
fn fp8_weights_on_the_cpu_match_the_reference_of_their_dequantized_values() {
    let load = |path: &str, quantization| {
        Harness::load_quantized(&fixtures().join(path), 2, KvDtypeChoice::F32, quantization)
    };
    let f32_cases = cases("tiny-llama-logits.json");
    for (case, f32_case) in cases("tiny-llama-fp8-logits.json").iter().zip(&f32_cases) {
        let got = load("tiny-llama-fp8", Quantization::None).prompt_logits(&case.tokens);
        assert_close(&got, &case.logits, FP8_TOL, &format!("FP8 {}", case.name));
        let distance = relative_distance(&got, &f32_case.logits);
        assert!(
            distance <= FP8_VS_F32_BOUND,
            "{}: FP8 logits are {distance:.3e} from the f32 model's",
            case.name
        );
        let quantized = load("tiny-llama", Quantization::Fp8).prompt_logits(&case.tokens);
        assert_eq!(quantized, got, "{}: --quantization fp8", case.name);
    }
}
