//! The default model (SmolLM2-135M-Instruct Q4_1) against an independent f32 numpy forward
//! pass over its dequantized weights (tests/reference/smollm2_reference.py): the logits of a
//! prompt's last position, and greedy continuations of fixed prompts.
//!
//! The engine multiplies quantized weights by 16-bit-quantized activations and keeps an f16 KV
//! cache, so its logits differ slightly from the f32 reference. Greedy ids must agree wherever the
//! reference's top-2 logit gap exceeds that error; at a near tie the continuation may
//! legitimately take the other branch, after which comparing further is meaningless.

use crate::common::*;
use duet_cpu::CpuBackend;
use duet_cpu::quant::KernelPath;
use duet_engine::backend::CpuKernels;
use duet_engine::batch::{LogitsWanted, SeqInput};
use duet_engine::engine::{Engine, EngineOptions};
use duet_model::params::SamplingParams;
use duet_model::params::StopCriteria;

/// A reference top-2 gap below this may flip under activation quantization.
const NEAR_TIE: f32 = 0.1;

fn engine(path: &std::path::Path, cpu_kernels: CpuKernels) -> Engine<CpuBackend> {
    duet_cpu::load_engine(
        path,
        EngineOptions {
            threads: 2,
            cpu_kernels,
            ..Default::default()
        },
    )
    .unwrap()
}

#[test]
fn last_position_logits_match_reference() {
    let path = checkout_default_model();
    let golden = read_json("smollm2-greedy.json");
    let p = &golden["prompts"][0];
    let want = floats(&p["last_logits"]);
    let mut h = Harness::load(&path, 2);
    let got = h.prompt_logits(&ids(&p["prompt_ids"])).pop().unwrap();
    let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let diff: Vec<f32> = got.iter().zip(&want).map(|(a, b)| a - b).collect();
    let rel = norm(&diff) / norm(&want);
    assert!(rel < 0.02, "‖Δlogits‖/‖ref‖ = {rel:.4} (≥ 2%)");
    assert_eq!(
        duet_engine::sampling::argmax(&got),
        duet_engine::sampling::argmax(&want),
        "most likely next token differs"
    );
}

/// On every kernel path this CPU can run (`--cpu-kernels`), the portable one included.
#[test]
fn greedy_continuations_match_reference() {
    let path = checkout_default_model();
    let golden = read_json("smollm2-greedy.json");
    let paths = [
        CpuKernels::Portable,
        CpuKernels::Avx2,
        CpuKernels::Avx2Vnni,
        CpuKernels::Avx512,
    ];
    for kernels in paths.into_iter().filter(|&k| KernelPath::choose(k).is_ok()) {
        eprintln!("--cpu-kernels {kernels}");
        greedy_continuations_match(&mut engine(&path, kernels), &golden);
    }
}

fn greedy_continuations_match(engine: &mut Engine<CpuBackend>, golden: &serde_json::Value) {
    for p in golden["prompts"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap();
        let want = ids(&p["greedy_ids"]);
        let margins = floats(&p["margins"]);
        let stop = StopCriteria {
            max_tokens: want.len(),
            ignore_eos: true,
            ..Default::default()
        };
        let id = engine
            .add_sequence(ids(&p["prompt_ids"]), SamplingParams::greedy(), stop)
            .unwrap();
        while engine.has_work() {
            engine.step().unwrap();
        }
        let tokens = engine.tokens(id).unwrap().to_vec();
        let got = &tokens[tokens.len() - want.len()..];
        engine.remove_sequence(id).unwrap();
        let mut agreed = 0;
        for i in 0..want.len() {
            if got[i] == want[i] {
                agreed += 1;
                continue;
            }
            assert!(
                margins[i] < NEAR_TIE,
                "{name}: token {i} is {} but the reference says {} with a clear margin of {} (got {:?}, want {:?})",
                got[i],
                want[i],
                margins[i],
                got,
                want
            );
            break;
        }
        eprintln!(
            "{name}: {agreed}/{} greedy tokens equal to the reference",
            want.len()
        );
        assert!(
            agreed >= 4,
            "{name}: only {agreed} tokens agree before a near tie"
        );
    }
}

#[test]
fn batched_greedy_equals_solo_runs() {
    let path = checkout_default_model();
    let golden = read_json("smollm2-greedy.json");
    let prompts: Vec<Vec<u32>> = golden["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| ids(&p["prompt_ids"]))
        .collect();
    let stop = StopCriteria {
        max_tokens: 12,
        ignore_eos: true,
        ..Default::default()
    };
    let run = |engine: &mut Engine<CpuBackend>, batch: &[Vec<u32>]| -> Vec<Vec<u32>> {
        let ids: Vec<_> = batch
            .iter()
            .map(|p| {
                engine
                    .add_sequence(p.clone(), SamplingParams::greedy(), stop.clone())
                    .unwrap()
            })
            .collect();
        while engine.has_work() {
            engine.step().unwrap();
        }
        ids.iter()
            .map(|&id| {
                let t = engine.tokens(id).unwrap().to_vec();
                engine.remove_sequence(id).unwrap();
                t
            })
            .collect()
    };
    let mut engine = engine(&path, CpuKernels::Auto);
    let solo: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| run(&mut engine, std::slice::from_ref(p)).remove(0))
        .collect();
    engine.clear_prefix_cache();
    let together = run(&mut engine, &prompts);
    assert_eq!(
        solo, together,
        "a sequence's tokens depend on its batch companions"
    );
}

/// The logits of a sequence's position are the same bits however they are computed: decoded
/// alone or beside other sequences' prompts and decodes, on one thread or two, and as the last
/// row of a whole prompt (what a worker taking over a stream computes). So a stream that fails
/// over, or shares its steps, continues exactly as it would have alone. The context is long
/// enough that attention cuts it into several spans.
#[test]
fn a_position_has_the_same_logits_alone_in_a_batch_and_in_a_prompt() {
    let path = checkout_default_model();
    let tokens = |n: usize, seed: u32| -> Vec<u32> {
        (0..n as u32)
            .map(|i| (i.wrapping_mul(7919) ^ seed) % 49152)
            .collect()
    };
    let (a, b, c) = (tokens(300, 1), tokens(200, 2), tokens(90, 3));
    let last_bits = |l: &duet_engine::llama::Logits, row: usize| -> Vec<u32> {
        l.row(row).iter().map(|x| x.to_bits()).collect()
    };
    let mut runs: Vec<(String, Vec<u32>)> = Vec::new();
    for threads in [1, 2] {
        let mut h = Harness::load(&path, threads);
        // Alone: the prompt, then its last token decoded.
        let t = h.blocks_for(a.len());
        h.forward(&[SeqInput::span(&a, 0, 299, &t, LogitsWanted::None)]);
        let l = h.forward(&[SeqInput::span(&a, 299, 300, &t, LogitsWanted::Last)]);
        runs.push((
            format!("decoded alone, {threads} threads"),
            last_bits(&l, 0),
        ));
        // As the last row of the whole prompt.
        let t = h.blocks_for(a.len());
        let l = h.forward(&[SeqInput::span(&a, 0, 300, &t, LogitsWanted::Last)]);
        runs.push((
            format!("the last row of a prompt, {threads} threads"),
            last_bits(&l, 0),
        ));
    }
    // In batches: the prompt in two chunks beside another prompt and a decode, then the last
    // token decoded beside a decode and a 30-row prompt chunk.
    let mut h = Harness::load(&path, 2);
    let (ta, tb, tc) = (
        h.blocks_for(a.len()),
        h.blocks_for(b.len()),
        h.blocks_for(c.len()),
    );
    h.forward(&[
        SeqInput::span(&b, 0, 199, &tb, LogitsWanted::None),
        SeqInput::span(&a, 0, 150, &ta, LogitsWanted::None),
    ]);
    h.forward(&[
        SeqInput::span(&a, 150, 299, &ta, LogitsWanted::None),
        SeqInput::span(&b, 199, 200, &tb, LogitsWanted::Last),
        SeqInput::span(&c, 0, 60, &tc, LogitsWanted::None),
    ]);
    let l = h.forward(&[
        SeqInput::span(&c, 60, 90, &tc, LogitsWanted::Last),
        SeqInput::span(&a, 299, 300, &ta, LogitsWanted::Last),
    ]);
    runs.push(("decoded in a batch, 2 threads".into(), last_bits(&l, 1)));
    for (what, bits) in &runs[1..] {
        assert!(
            *bits == runs[0].1,
            "{what}: logits differ from {} ({} of {} values)",
            runs[0].0,
            bits.iter().zip(&runs[0].1).filter(|(x, y)| x != y).count(),
            bits.len()
        );
    }
}
