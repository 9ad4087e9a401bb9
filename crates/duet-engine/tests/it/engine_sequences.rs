//! Engine-level behaviour the services build on: KV moved between two engines gives the same
//! tokens as one engine doing both phases; preemption under KV pressure and prefix-cache hits
//! do not change anyone's tokens; cancellation frees blocks; grammar masks computed beside the
//! forward pass constrain exactly as those computed after it; a grammar that fails ends its
//! request with the error.

use crate::common::fixtures;
use duet_cpu::CpuBackend;
use duet_engine::backend::KvDtypeChoice;
use duet_engine::engine::{Engine, EngineOptions, Resumed, SeqId};
use duet_model::fp8::Quantization;
use duet_model::params::StopCriteria;
use duet_model::params::{Constraint, SamplingParams};

fn tiny(kv_cache_tokens: usize) -> Engine<CpuBackend> {
    tiny_with(kv_cache_tokens, KvDtypeChoice::Auto)
}

fn tiny_with(kv_cache_tokens: usize, kv_dtype: KvDtypeChoice) -> Engine<CpuBackend> {
    let options = EngineOptions {
        threads: 2,
        block_size: 4,
        kv_cache_tokens,
        max_step_tokens: 64,
        kv_dtype,
        ..Default::default()
    };
    duet_cpu::load_engine(&fixtures().join("tiny-llama"), options).unwrap()
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 3 + (i * 7919 + seed * 104_729) % 380)
        .collect()
}

fn stop(n: usize) -> StopCriteria {
    StopCriteria {
        max_tokens: n,
        ignore_eos: true,
        ..Default::default()
    }
}

/// Runs every sequence to the end and returns their generated tokens, in order of `ids`.
fn finish_all(
    engine: &mut Engine<CpuBackend>,
    ids: &[SeqId],
    prompt_lens: &[usize],
) -> Vec<Vec<u32>> {
    while engine.has_work() {
        engine.step().unwrap();
    }
    ids.iter()
        .zip(prompt_lens)
        .map(|(&id, &n)| {
            let t = engine.tokens(id).unwrap()[n..].to_vec();
            engine.remove_sequence(id).unwrap();
            t
        })
        .collect()
}

fn solo(p: &[u32], n: usize, params: SamplingParams) -> Vec<u32> {
    solo_with(p, n, params, KvDtypeChoice::Auto)
}

fn solo_with(p: &[u32], n: usize, params: SamplingParams, kv: KvDtypeChoice) -> Vec<u32> {
    let mut e = tiny_with(1024, kv);
    let id = e.add_sequence(p.to_vec(), params, stop(n)).unwrap();
    finish_all(&mut e, &[id], &[p.len()]).remove(0)
}

/// For the default KV type (f32 for the f32 fixture) and an int8 cache, whose blocks carry their
/// tokens' scales.
#[test]
fn kv_moved_between_engines_continues_exactly() {
    for kv in [KvDtypeChoice::Auto, KvDtypeChoice::Int8] {
        kv_moved_between_engines_continues_exactly_with(kv);
    }
}

fn kv_moved_between_engines_continues_exactly_with(kv: KvDtypeChoice) {
    for params in [
        SamplingParams::greedy(),
        SamplingParams {
            temperature: 0.9,
            seed: Some(11),
            ..Default::default()
        },
    ] {
        let p = prompt(1, 27);
        let want = solo_with(&p, 10, params.clone(), kv);

        // Prefill engine: compute the prompt and its first token (max_tokens 2 keeps the
        // sequence, and so its blocks, alive after this step).
        let mut prefill = tiny_with(1024, kv);
        let pid = prefill
            .add_sequence(p.clone(), params.clone(), stop(2))
            .unwrap();
        let first = prefill.step().unwrap().remove(0).token;
        let src_blocks = prefill.block_table(pid).unwrap().to_vec();

        // Decode engine: reserve, receive every (layer, block), continue.
        let mut decode = tiny_with(1024, kv);
        assert!(
            prefill
                .fingerprint()
                .contains(&format!("kv-{}", decode.kv_layout().dtype))
        );
        let r = decode.reserve(&p, "").unwrap();
        assert_eq!(r.blocks.len(), src_blocks.len());
        assert_eq!(r.cached_blocks, 0);
        let mut buf = vec![0u8; prefill.kv_block_bytes()];
        for layer in 0..prefill.config().num_layers {
            for (src, dst) in src_blocks.iter().zip(&r.blocks) {
                prefill.read_kv_block(layer, *src, &mut buf).unwrap();
                decode.write_kv_block(layer, *dst, &buf).unwrap();
            }
        }
        let (id, out) = decode
            .add_prefilled(p.clone(), r, first, params.clone(), None, stop(10))
            .unwrap();
        assert_eq!(out.token.token, want[0]);
        let got = finish_all(&mut decode, &[id], &[p.len()]).remove(0);
        assert_eq!(
            got, want,
            "disaggregated continuation differs (KV {kv}, params {params:?})"
        );
    }
}

#[test]
fn reservation_reuses_local_prefix_and_release_frees_it() {
    let mut e = tiny(64);
    let p = prompt(2, 18);
    let id = e
        .add_sequence(p.clone(), SamplingParams::greedy(), stop(2))
        .unwrap();
    finish_all(&mut e, &[id], &[p.len()]);
    let free_before = e.block_pool().available();
    let r = e.reserve(&p, "").unwrap();
    assert_eq!(
        r.cached_blocks, 4,
        "18 tokens = 4 full blocks cached from the first run"
    );
    assert_eq!(r.blocks.len(), 5);
    e.release(r).unwrap();
    assert_eq!(e.block_pool().available(), free_before);
    assert_eq!(e.block_pool().stats().in_use, 0);
}

#[test]
fn prefix_cache_is_shared_only_within_one_cache_salt() {
    let mut e = tiny(256);
    let p = prompt(5, 18);
    let run = |e: &mut Engine<CpuBackend>, salt: &str| {
        let id = e
            .resume_sequence(
                p.clone(),
                Resumed::default(),
                salt,
                SamplingParams::greedy(),
                None,
                stop(2),
            )
            .unwrap();
        let cached = e.cached_prompt_tokens(id).unwrap();
        let tokens = finish_all(e, &[id], &[p.len()]).remove(0);
        (cached, tokens)
    };
    let (cached, first) = run(&mut e, "tenant-a");
    assert_eq!(cached, 0, "nothing cached yet");
    let (cached, other) = run(&mut e, "tenant-b");
    assert_eq!(cached, 0, "another tenant's prefix is not reused");
    assert_eq!(other, first);
    let (cached, again) = run(&mut e, "tenant-a");
    assert_eq!(cached, 16, "the same tenant reuses its 4 full blocks");
    assert_eq!(again, first);
    let (cached, _) = run(&mut e, "");
    assert_eq!(cached, 0, "the shared namespace is a namespace of its own");
    // The decode side's reservation honours the salt the same way.
    let r = e.reserve(&p, "tenant-c").unwrap();
    assert_eq!(r.cached_blocks, 0);
    e.release(r).unwrap();
    let r = e.reserve(&p, "tenant-b").unwrap();
    assert_eq!(r.cached_blocks, 4);
    e.release(r).unwrap();
}

#[test]
fn bad_kv_writes_are_refused() {
    let mut e = tiny(64);
    let n = e.kv_block_bytes();
    assert!(
        e.write_kv_block(0, 0, &vec![0u8; n - 4]).is_err(),
        "short block"
    );
    assert!(
        e.write_kv_block(99, 0, &vec![0u8; n]).is_err(),
        "no such layer"
    );
    assert!(
        e.write_kv_block(0, 16, &vec![0u8; n]).is_err(),
        "no such block"
    );
}

#[test]
fn preemption_under_kv_pressure_keeps_every_sequence_exact() {
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| prompt(10 + i, 9 + 3 * i as usize)).collect();
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| solo(p, 20, SamplingParams::greedy()))
        .collect();
    // 6 sequences of up to 44 tokens in 96 slots: they cannot all fit.
    let mut e = tiny(96);
    let ids: Vec<SeqId> = prompts
        .iter()
        .map(|p| {
            e.add_sequence(p.clone(), SamplingParams::greedy(), stop(20))
                .unwrap()
        })
        .collect();
    let lens: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
    let got = finish_all(&mut e, &ids, &lens);
    assert!(e.preemptions() > 0, "the test must actually preempt");
    assert_eq!(got, want);
    assert_eq!(e.block_pool().stats().in_use, 0, "every block released");
}

#[test]
fn prefix_cache_hit_skips_work_and_keeps_tokens() {
    let mut e = tiny(1024);
    let p = prompt(3, 30);
    let a = e
        .add_sequence(p.clone(), SamplingParams::greedy(), stop(8))
        .unwrap();
    let first = finish_all(&mut e, &[a], &[p.len()]).remove(0);
    let b = e
        .add_sequence(p.clone(), SamplingParams::greedy(), stop(8))
        .unwrap();
    assert_eq!(
        e.cached_prompt_tokens(b),
        Some(28),
        "7 full blocks reused, the last token recomputed"
    );
    let second = finish_all(&mut e, &[b], &[p.len()]).remove(0);
    assert_eq!(first, second);
}

#[test]
fn removing_a_running_sequence_frees_its_blocks() {
    let mut e = tiny(256);
    let p = prompt(4, 21);
    let id = e
        .add_sequence(p, SamplingParams::greedy(), stop(50))
        .unwrap();
    e.step().unwrap();
    e.step().unwrap();
    assert!(e.block_pool().stats().in_use > 0);
    e.remove_sequence(id).unwrap();
    assert_eq!(e.block_pool().stats().in_use, 0);
    assert!(e.remove_sequence(id).is_err(), "unknown sequence");
}

#[test]
fn a_resumed_request_continues_without_repeats() {
    use duet_engine::engine::Resumed;
    let params = SamplingParams {
        temperature: 0.8,
        seed: Some(5),
        ..Default::default()
    };
    let p = prompt(6, 19);
    // The uninterrupted run: tokens and the text released with each.
    let mut e = tiny(1024);
    let id = e.add_sequence(p.clone(), params.clone(), stop(14)).unwrap();
    let mut pieces: Vec<(u32, String)> = Vec::new();
    while e.has_work() {
        pieces.extend(
            e.step()
                .unwrap()
                .into_iter()
                .map(|o| (o.token.token, o.text)),
        );
    }
    e.remove_sequence(id).unwrap();
    for k in [1, 6, 13] {
        // A worker that streamed k tokens died; another resumes from prompt + those tokens.
        let mut tokens = p.clone();
        tokens.extend(pieces[..k].iter().map(|(t, _)| *t));
        let sent: usize = pieces[..k].iter().map(|(_, s)| s.len()).sum();
        let mut other = tiny(1024);
        let resumed = Resumed {
            generated: k,
            sent_text_bytes: sent,
        };
        let id = other
            .resume_sequence(tokens, resumed, "", params.clone(), None, stop(14))
            .unwrap();
        let mut rest = Vec::new();
        while other.has_work() {
            rest.extend(
                other
                    .step()
                    .unwrap()
                    .into_iter()
                    .map(|o| (o.token.token, o.text)),
            );
        }
        other.remove_sequence(id).unwrap();
        assert_eq!(
            rest.iter().map(|r| r.0).collect::<Vec<_>>(),
            pieces[k..].iter().map(|r| r.0).collect::<Vec<_>>(),
            "tokens after {k}"
        );
        let text = |v: &[(u32, String)]| v.iter().map(|r| r.1.as_str()).collect::<String>();
        assert_eq!(text(&rest), text(&pieces[k..]), "text after {k}");
    }
}

/// With a core to spare (one kernel thread on a machine of several), the masks of a constrained
/// batch are computed while the forward pass runs; the batch decodes exactly the tokens it does
/// when every core runs kernels and the masks follow the forward pass, and its text validates.
#[test]
fn grammar_masks_computed_beside_the_forward_pass_constrain_the_same_tokens() {
    // JSON with no room for the tiny model's favourite whitespace, so every answer completes.
    let regex = r#"\{"id":(0|[1-9][0-9]{0,3}),"tags":\[("[a-z]{1,5}",){0,2}"[a-z]{1,5}"\]\}"#;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let run = |threads: usize| {
        let options = EngineOptions {
            threads,
            block_size: 4,
            kv_cache_tokens: 4096,
            max_step_tokens: 64,
            ..Default::default()
        };
        let mut engine = duet_cpu::load_engine(&fixtures().join("tiny-llama"), options).unwrap();
        let overlapped = engine.overlaps_grammar_masks();
        let ids: Vec<SeqId> = (0..4)
            .map(|i| {
                let params = SamplingParams {
                    temperature: 0.8,
                    seed: Some(i),
                    constraint: Some(Constraint::Regex(regex.into())),
                    ..Default::default()
                };
                let stop = StopCriteria {
                    max_tokens: 120,
                    ..Default::default()
                };
                engine
                    .add_sequence(prompt(i as u32, 9), params, stop)
                    .unwrap()
            })
            .collect();
        let mut texts = vec![String::new(); ids.len()];
        while engine.has_work() {
            for out in engine.step().unwrap() {
                texts[ids.iter().position(|&id| id == out.seq).unwrap()].push_str(&out.text);
            }
        }
        (overlapped, texts)
    };
    let (overlapped, after) = run(cores);
    assert!(
        !overlapped,
        "every core runs kernels: nothing is free for masks"
    );
    let (overlapped, beside) = run(1);
    assert_eq!(
        overlapped,
        cores > 1,
        "one kernel thread leaves {} cores",
        cores - 1
    );
    assert_eq!(beside, after);
    for text in &after {
        let v: serde_json::Value =
            serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(
            v["id"].is_i64() && v["tags"].as_array().is_some_and(|t| t.len() <= 3),
            "{text}"
        );
    }
}

/// A grammar that fails part way (here: a failover replays a token it forbids) ends its
/// sequence with finish reason `error` and llguidance's reason, not `stop` with a cut text; the
/// other sequences of the step go on.
#[test]
fn a_grammar_that_fails_part_way_ends_its_request_with_the_error() {
    use duet_model::params::FinishReason;
    let mut e = tiny(1024);
    let params = SamplingParams {
        constraint: Some(Constraint::Regex("[0-9]{8}".into())),
        ..SamplingParams::greedy()
    };
    // "1", "2" and then "a" were streamed: "a" breaks the grammar.
    let streamed = [3 + b'1' as u32, 3 + b'2' as u32, 3 + b'a' as u32];
    let tokens = [prompt(3, 7), streamed.to_vec()].concat();
    let resumed = Resumed {
        generated: 3,
        sent_text_bytes: 3,
    };
    let failing = e
        .resume_sequence(tokens, resumed, "", params.clone(), None, stop(20))
        .unwrap();
    let other = e.add_sequence(prompt(4, 7), params, stop(20)).unwrap();
    let mut ends = std::collections::HashMap::new();
    let mut texts = std::collections::HashMap::<SeqId, String>::new();
    while e.has_work() {
        for out in e.step().unwrap() {
            texts.entry(out.seq).or_default().push_str(&out.text);
            if let Some(finish) = out.finish {
                ends.insert(out.seq, (finish, out.error));
            }
        }
    }
    let (finish, error) = &ends[&failing];
    assert_eq!(*finish, FinishReason::Error, "{error:?}");
    assert!(error.as_deref().is_some_and(|e| !e.is_empty()), "{error:?}");
    assert_eq!(texts[&failing], "", "nothing past what was streamed");
    assert_eq!(ends[&other], (FinishReason::Stop, None));
    assert_eq!(texts[&other].len(), 8, "{:?}", texts[&other]);
}

/// Weights quantized at load compute other KV than the file's own: `--quantization fp8` is in
/// the model fingerprint (a worker of the other setting refuses the push), `none` leaves it as
/// it was.
#[test]
fn quantizing_the_weights_at_load_changes_the_fingerprint() {
    let fingerprint = |quantization| {
        let options = EngineOptions {
            threads: 1,
            block_size: 4,
            kv_cache_tokens: 64,
            quantization,
            ..Default::default()
        };
        duet_cpu::load_engine(&fixtures().join("tiny-llama"), options)
            .unwrap()
            .fingerprint()
            .to_string()
    };
    let (plain, fp8) = (
        fingerprint(Quantization::None),
        fingerprint(Quantization::Fp8),
    );
    assert!(!plain.contains("/q-"), "{plain}");
    assert_eq!(fp8, format!("{plain}/q-fp8"));
}
