//! Speculative decoding changes how many tokens a step yields, never which tokens: greedy and
//! seeded outputs equal decoding one token per step, token for token (alone, in a batch, under a
//! grammar, at max_tokens and stop strings); sampled outputs follow the same distribution; and
//! the drafts really are verified (acceptance counted, rejected slots given back).

use std::collections::HashMap;

use crate::common::{checkout_default_model, fixtures};
use duet_cpu::CpuBackend;
use duet_engine::engine::{Engine, EngineOptions, SeqId, Speculation};
use duet_engine::speculator::SpeculativeMode;
use duet_model::params::{Constraint, FinishReason, Logprobs, SamplingParams, StopCriteria};

fn options(speculative: SpeculativeMode) -> EngineOptions {
    EngineOptions {
        threads: 2,
        block_size: 4,
        kv_cache_tokens: 4096,
        max_step_tokens: 64,
        speculative,
        num_speculative_tokens: 5,
        // Every sequence of a batch drafts (the default keeps large batches from drafting).
        speculative_max_step_rows: 64,
        ..Default::default()
    }
}

fn tiny(speculative: SpeculativeMode) -> Engine<CpuBackend> {
    duet_cpu::load_engine(&fixtures().join("tiny-llama"), options(speculative)).unwrap()
}

fn stop(n: usize) -> StopCriteria {
    StopCriteria {
        max_tokens: n,
        ignore_eos: true,
        ..Default::default()
    }
}

/// What one sequence produced: its tokens (and their log-probabilities, when asked for),
/// finish reason, and speculation.
#[derive(Debug, PartialEq)]
struct Run {
    tokens: Vec<u32>,
    logprobs: Vec<Option<Logprobs>>,
    finish: Option<FinishReason>,
    text: String,
    speculation: Speculation,
}

/// Runs every request to its end in one batch; also the most tokens one step gave a sequence.
fn run_all(
    engine: &mut Engine<CpuBackend>,
    requests: &[(Vec<u32>, SamplingParams, StopCriteria)],
) -> (Vec<Run>, usize) {
    let ids: Vec<SeqId> = requests
        .iter()
        .map(|(p, params, stop)| {
            engine
                .add_sequence(p.clone(), params.clone(), stop.clone())
                .unwrap()
        })
        .collect();
    let mut runs: HashMap<SeqId, Run> = HashMap::new();
    let mut most_per_step = 0;
    while engine.has_work() {
        let outputs = engine.step().unwrap();
        let mut per_seq: HashMap<SeqId, usize> = HashMap::new();
        for out in outputs {
            *per_seq.entry(out.seq).or_default() += 1;
            let run = runs.entry(out.seq).or_insert(Run {
                tokens: Vec::new(),
                logprobs: Vec::new(),
                finish: None,
                text: String::new(),
                speculation: Speculation::default(),
            });
            assert!(run.finish.is_none(), "an output after the finish");
            run.tokens.push(out.token.token);
            run.logprobs.push(out.token.logprobs);
            run.text.push_str(&out.text);
            run.finish = out.finish;
            run.speculation = out.speculation;
        }
        most_per_step = most_per_step.max(per_seq.values().copied().max().unwrap_or(0));
    }
    let runs = ids
        .iter()
        .map(|id| {
            engine.remove_sequence(*id).unwrap();
            runs.remove(id).unwrap()
        })
        .collect();
    (runs, most_per_step)
}

/// A prompt with a repeated span, so that drafts are proposed and some accepted.
fn repetitive_prompt(seed: u32) -> Vec<u32> {
    let span: Vec<u32> = (0..12).map(|i| 3 + (i * 37 + seed * 101) % 380).collect();
    [
        span.clone(),
        vec![5, 6],
        span.clone(),
        vec![7],
        span[..6].to_vec(),
    ]
    .concat()
}

fn seeded(temperature: f32, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature,
        seed: Some(seed),
        ..Default::default()
    }
}

#[test]
fn greedy_and_seeded_outputs_equal_decoding_one_token_per_step() {
    let requests: Vec<_> = (0..6)
        .map(|i| {
            let params = match i % 3 {
                0 => SamplingParams::greedy(),
                1 => seeded(0.8, 100 + i as u64),
                _ => SamplingParams {
                    top_k: 5,
                    repetition_penalty: 1.1,
                    frequency_penalty: 0.3,
                    ..seeded(1.0, 200 + i as u64)
                },
            };
            (repetitive_prompt(i), params, stop(40))
        })
        .collect();
    let (off, off_most) = run_all(&mut tiny(SpeculativeMode::Off), &requests);
    assert_eq!(off_most, 1);
    // All at once (each sequence drafts as the budget allows), then one by one.
    let (batched, most) = run_all(&mut tiny(SpeculativeMode::Ngram), &requests);
    let mut spec = tiny(SpeculativeMode::Ngram);
    let alone: Vec<Run> = requests
        .iter()
        .map(|r| run_all(&mut spec, std::slice::from_ref(r)).0.remove(0))
        .collect();
    for ((off, batched), alone) in off.iter().zip(&batched).zip(&alone) {
        assert_eq!(
            off.tokens, batched.tokens,
            "batched speculation changed the output"
        );
        assert_eq!(off.tokens, alone.tokens, "speculation changed the output");
        assert_eq!((off.finish, &off.text), (batched.finish, &batched.text));
        assert_eq!(off.speculation.draft_tokens, 0);
        assert_eq!(off.speculation.steps as usize, off.tokens.len());
    }
    let drafted: u64 = batched.iter().map(|r| r.speculation.draft_tokens).sum();
    let accepted: u64 = batched
        .iter()
        .map(|r| r.speculation.accepted_draft_tokens)
        .sum();
    assert!(accepted > 0, "{accepted} of {drafted} accepted");
    assert!(most > 1, "no step yielded more than one token");
    for r in &batched {
        // Each step yields one token and one per accepted draft token.
        let s = r.speculation;
        assert_eq!(
            s.steps + s.accepted_draft_tokens,
            r.tokens.len() as u64,
            "{s:?}"
        );
    }
}

/// Log-probabilities are those of decoding one token per step too: a drafted row's come from its
/// own logits, after the same penalties, whether its token is accepted or not.
#[test]
fn logprobs_while_speculating_equal_decoding_one_token_per_step() {
    let requests: Vec<_> = (0..3)
        .map(|i| {
            let params = match i {
                0 => SamplingParams::greedy(),
                1 => SamplingParams {
                    repetition_penalty: 1.2,
                    ..SamplingParams::greedy()
                },
                _ => seeded(0.8, 17),
            };
            let params = SamplingParams {
                logprobs: 5,
                ..params
            };
            (repetitive_prompt(20 + i), params, stop(30))
        })
        .collect();
    let (off, _) = run_all(&mut tiny(SpeculativeMode::Off), &requests);
    let (spec, _) = run_all(&mut tiny(SpeculativeMode::Ngram), &requests);
    for (off, spec) in off.iter().zip(&spec) {
        assert_eq!(spec.tokens, off.tokens);
        assert_eq!(spec.logprobs, off.logprobs);
        assert!(
            off.logprobs
                .iter()
                .all(|l| l.as_ref().is_some_and(|l| l.top.len() == 5))
        );
    }
    let accepted: u64 = spec
        .iter()
        .map(|r| r.speculation.accepted_draft_tokens)
        .sum();
    assert!(
        accepted > 0,
        "no drafted token was accepted: nothing was verified"
    );
}

/// The tiny fixture, with `extra` ends of sequence besides its own `</s>`.
fn tiny_ending_also_at(extra: u32) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let tiny = fixtures().join("tiny-llama");
    for file in ["tokenizer.json", "model.safetensors"] {
        std::fs::copy(tiny.join(file), dir.path().join(file)).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tiny.join("config.json")).unwrap()).unwrap();
    config["eos_token_id"] = serde_json::json!([2, extra]);
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    dir
}

/// An end of sequence drafted and accepted in the middle of a draft ends the sequence there: the
/// drafted tokens after it are not output, and the output is that of one token per step.
#[test]
fn an_end_of_sequence_inside_a_draft_ends_the_sequence_there() {
    // A start, the model's own continuation of it, and the start again: drafts copy the
    // continuation, and the model often follows them.
    let start: Vec<u32> = (0..8).map(|i| 3 + (i * 53) % 380).collect();
    let (continued, _) = run_all(
        &mut tiny(SpeculativeMode::Off),
        &[(start.clone(), SamplingParams::greedy(), stop(12))],
    );
    let p = [start.clone(), continued[0].tokens.clone(), start].concat();
    // What each step of a speculating run yields.
    let steps = |engine: &mut Engine<CpuBackend>, stop: StopCriteria| {
        let id = engine
            .add_sequence(p.clone(), SamplingParams::greedy(), stop)
            .unwrap();
        let mut steps = Vec::new();
        while engine.has_work() {
            let step: Vec<u32> = engine
                .step()
                .unwrap()
                .iter()
                .map(|o| o.token.token)
                .collect();
            if !step.is_empty() {
                steps.push(step);
            }
        }
        engine.remove_sequence(id).unwrap();
        steps
    };
    let probe = steps(&mut tiny(SpeculativeMode::Ngram), stop(24));
    let output = probe.concat();
    // The first token of a step that yielded three or more: a drafted token the model accepted,
    // with more of its draft after it. Made an end of sequence where it first occurs (and no
    // `</s>` before it), the run ends there, inside the draft.
    let mut at = 0;
    let (end_at, end) = probe
        .iter()
        .find_map(|step| {
            let found =
                (step.len() >= 3 && !output[..at].contains(&step[0]) && !output[..at].contains(&2))
                    .then_some((at, step[0]));
            at += step.len();
            found
        })
        .expect("no step accepted two drafted tokens");
    let model = tiny_ending_also_at(end);
    let load = |mode| duet_cpu::load_engine(model.path(), options(mode)).unwrap();
    let until_eos = StopCriteria {
        max_tokens: 24,
        ..Default::default()
    };
    let request = [(p.clone(), SamplingParams::greedy(), until_eos.clone())];
    let (want, _) = run_all(&mut load(SpeculativeMode::Off), &request);
    let (got, _) = run_all(&mut load(SpeculativeMode::Ngram), &request);
    assert_eq!(want[0].tokens, output[..=end_at]);
    assert_eq!(want[0].finish, Some(FinishReason::Stop));
    assert_eq!(
        (&got[0].tokens, got[0].finish, &got[0].text),
        (&want[0].tokens, want[0].finish, &want[0].text)
    );
    // The last step yielded the end of sequence first, where the probe went on with its draft.
    let last = steps(&mut load(SpeculativeMode::Ngram), until_eos);
    assert_eq!(last.last().unwrap(), &[end]);
    assert_eq!(last.concat(), output[..=end_at]);
}

#[test]
fn max_tokens_stop_strings_and_opting_out_hold_while_speculating() {
    let p = repetitive_prompt(3);
    let mut off = tiny(SpeculativeMode::Off);
    let mut spec = tiny(SpeculativeMode::Ngram);
    let text = {
        let (r, _) = run_all(&mut off, &[(p.clone(), SamplingParams::greedy(), stop(30))]);
        r[0].text.clone()
    };
    // A stop string from the middle of the greedy text, and max_tokens inside a long draft.
    let cut = text.char_indices().nth(text.chars().count() / 2).unwrap().0;
    let stop_string: String = text[cut..].chars().take(3).collect();
    for (max_tokens, stop_strings) in [(1, vec![]), (7, vec![]), (30, vec![stop_string])] {
        let criteria = StopCriteria {
            max_tokens,
            stop_strings,
            ignore_eos: true,
            ..Default::default()
        };
        let request = [(p.clone(), SamplingParams::greedy(), criteria)];
        let (want, _) = run_all(&mut off, &request);
        let (got, _) = run_all(&mut spec, &request);
        assert_eq!(got[0].tokens, want[0].tokens);
        assert_eq!(
            (got[0].finish, &got[0].text),
            (want[0].finish, &want[0].text)
        );
        assert!(got[0].tokens.len() <= max_tokens);
    }
    // A request that opts out decodes one token per step.
    let opted_out = SamplingParams {
        speculative: false,
        ..SamplingParams::greedy()
    };
    let (r, most) = run_all(&mut spec, &[(p.clone(), opted_out, stop(30))]);
    assert_eq!((r[0].speculation.draft_tokens, most), (0, 1));
}

#[test]
fn speculating_with_no_draft_tokens_is_refused() {
    let options = EngineOptions {
        num_speculative_tokens: 0,
        ..options(SpeculativeMode::Ngram)
    };
    let e = duet_cpu::load_engine(&fixtures().join("tiny-llama"), options)
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("--num-speculative-tokens"), "{e}");
}

#[test]
fn rejected_drafts_give_their_blocks_back() {
    let mut spec = tiny(SpeculativeMode::Ngram);
    let requests: Vec<_> = (0..4)
        .map(|i| (repetitive_prompt(10 + i), seeded(1.0, i as u64), stop(50)))
        .collect();
    run_all(&mut spec, &requests);
    let pool = spec.block_pool().stats();
    assert_eq!(pool.in_use, 0, "every block is back: {pool:?}");
    assert_eq!(pool.free + pool.cached, pool.num_blocks);
}

#[test]
fn a_grammar_holds_while_speculating() {
    let schema = r#"{"type":"object","properties":{"a":{"type":"array","items":{"type":"integer"}}},"required":["a"]}"#;
    let params = SamplingParams {
        constraint: Some(Constraint::JsonSchema(schema.into())),
        ..seeded(0.7, 5)
    };
    let p = repetitive_prompt(4);
    let request = [(p, params, stop(60))];
    let (want, _) = run_all(&mut tiny(SpeculativeMode::Off), &request);
    let (got, _) = run_all(&mut tiny(SpeculativeMode::Ngram), &request);
    assert_eq!(
        got,
        [Run {
            speculation: got[0].speculation,
            ..want.into_iter().next().unwrap()
        }]
    );
}

/// Two samples of the first three tokens (top-2 sampling at temperature 1: eight outcomes), one
/// with speculation and one without, from disjoint seeds: a chi-square test of homogeneity. The
/// repetitive prompt makes the drafts verified at the second and third tokens accepted or
/// rejected often; were an accepted draft not drawn with the model's probability (say, accepted
/// whenever it is among the candidates), the outcomes would shift.
#[test]
fn sampled_outputs_follow_the_model_distribution() {
    const RUNS: u64 = 1500;
    // The model's own greedy continuation of a start, then the start again: drafts copy the
    // continuation, which top-2 sampling picks often but not always.
    let start: Vec<u32> = (0..8).map(|i| 3 + (i * 53) % 380).collect();
    let (greedy, _) = run_all(
        &mut tiny(SpeculativeMode::Off),
        &[(start.clone(), SamplingParams::greedy(), stop(12))],
    );
    let p = [start.clone(), greedy[0].tokens.clone(), start].concat();
    let params = |seed| SamplingParams {
        top_k: 2,
        ..seeded(1.0, seed)
    };
    let sample = |mode, seeds: std::ops::Range<u64>| {
        let mut engine = tiny(mode);
        let mut counts: HashMap<Vec<u32>, u64> = HashMap::new();
        let mut speculation = (0, 0);
        let seeds: Vec<u64> = seeds.collect();
        // Batches whose prompts prefill in one step: drafts take only the budget prompts leave,
        // and these runs decode just three tokens, so every run must be decoding by its second.
        for chunk in seeds.chunks(2) {
            let requests: Vec<_> = chunk
                .iter()
                .map(|&s| (p.clone(), params(s), stop(3)))
                .collect();
            for r in run_all(&mut engine, &requests).0 {
                speculation.0 += r.speculation.draft_tokens;
                speculation.1 += r.speculation.accepted_draft_tokens;
                *counts.entry(r.tokens).or_default() += 1;
            }
        }
        (counts, speculation)
    };
    let (off, _) = sample(SpeculativeMode::Off, 0..RUNS);
    let (spec, (drafted, accepted)) = sample(SpeculativeMode::Ngram, RUNS..2 * RUNS);
    // Drafts are accepted and rejected about equally often here: a fifth of the runs is plenty.
    assert!(
        accepted > RUNS / 5 && drafted - accepted > RUNS / 5,
        "the test needs drafts both accepted and rejected: {accepted} of {drafted}"
    );
    let outcomes: std::collections::BTreeSet<&Vec<u32>> = off.keys().chain(spec.keys()).collect();
    let mut chi2 = 0.0;
    for o in &outcomes {
        let (a, b) = (
            *off.get(*o).unwrap_or(&0) as f64,
            *spec.get(*o).unwrap_or(&0) as f64,
        );
        // Equal sample sizes: expected a count of (a + b) / 2 in each.
        let e = (a + b) / 2.0;
        chi2 += (a - e).powi(2) / e + (b - e).powi(2) / e;
    }
    let df = outcomes.len() - 1;
    // The 0.999 quantile of chi-square with df degrees of freedom (Wilson–Hilferty).
    let z = 3.09;
    let k = df as f64;
    let limit = k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3);
    assert!(
        chi2 < limit,
        "chi-square {chi2:.1} ≥ {limit:.1} ({df} degrees of freedom): {off:?} against {spec:?}"
    );
}

/// The default model copying code from its prompt: greedy outputs equal, most drafts accepted.
#[test]
fn default_model_copying_its_prompt_gives_the_same_tokens_in_fewer_steps() {
    let path = checkout_default_model();
    let load = |speculative| {
        let options = EngineOptions {
            block_size: 16,
            max_step_tokens: 128,
            ..options(speculative)
        };
        duet_cpu::load_engine(&path, options).unwrap()
    };
    let mut off = load(SpeculativeMode::Off);
    let prompt = off
        .encode(
            "<|im_start|>user\nFix the spelling mistakes in this text and return the corrected \
             text: The quick brown fox jumpps over the lazy dog. The dog was not amused and barkd \
             loudly at the fox, who ran away into the forrest.<|im_end|>\n<|im_start|>assistant\n",
        )
        .unwrap();
    let until_eos = StopCriteria {
        max_tokens: 64,
        ..Default::default()
    };
    let request = [(prompt, SamplingParams::greedy(), until_eos)];
    let (want, _) = run_all(&mut off, &request);
    let (got, _) = run_all(&mut load(SpeculativeMode::Ngram), &request);
    assert_eq!(got[0].tokens, want[0].tokens, "{:?}", got[0].text);
    let s = got[0].speculation;
    assert!(
        2 * s.accepted_draft_tokens > s.draft_tokens && 2 * s.steps < want[0].tokens.len() as u64,
        "copying should accept most drafts and need under half the steps: {s:?} for {} tokens",
        want[0].tokens.len()
    );
}

fn draft_model(file: &str) -> SpeculativeMode {
    SpeculativeMode::Draft(fixtures().join(file))
}

/// Tokens that repeat nothing (no n-gram draft would be proposed): what a draft model adds.
fn plain_prompt(seed: u32) -> Vec<u32> {
    (0..10).map(|i| 3 + (i * 53 + seed * 29) % 380).collect()
}

#[test]
fn a_draft_model_speculates_without_changing_outputs() {
    let requests: Vec<_> = (0..6)
        .map(|i| {
            let params = match i % 3 {
                0 => SamplingParams::greedy(),
                1 => seeded(0.7, 300 + i as u64),
                _ => SamplingParams {
                    top_p: 0.9,
                    presence_penalty: 0.4,
                    ..seeded(1.0, 400 + i as u64)
                },
            };
            (plain_prompt(i), params, stop(30))
        })
        .collect();
    let (off, _) = run_all(&mut tiny(SpeculativeMode::Off), &requests);
    // The q8_0 copy of the tiny fixture drafts for it: the same tokenizer, nearly its logits.
    let mut spec = tiny(draft_model("tiny-llama-q8_0.gguf"));
    let (batched, most) = run_all(&mut spec, &requests);
    let alone: Vec<Run> = requests
        .iter()
        .flat_map(|r| run_all(&mut spec, std::slice::from_ref(r)).0)
        .collect();
    for ((off, batched), alone) in off.iter().zip(&batched).zip(&alone) {
        assert_eq!(
            (&off.tokens, off.finish, &off.text),
            (&batched.tokens, batched.finish, &batched.text)
        );
        assert_eq!(batched.tokens, alone.tokens);
    }
    let totals = spec.speculation_totals();
    assert!(
        totals.accepted_draft_tokens * 2 > totals.draft_tokens,
        "a near-copy of the model should have most drafts accepted: {totals:?}"
    );
    assert!(most > 1, "no step gave a sequence more than one token");
    let greedy = &batched[0].speculation;
    assert!(
        greedy.steps < 30 && greedy.accepted_draft_tokens > 0,
        "{greedy:?}"
    );
}

#[test]
fn a_draft_model_proposes_its_greedy_continuation_and_rolls_back_rejected_tokens() {
    use duet_engine::draft_model::DraftModel;
    let path = fixtures().join("tiny-llama.gguf");
    // Greedy continuations by the engine itself, one token per step.
    let greedy = |prompt: &[u32], n: usize| -> Vec<u32> {
        let mut engine = duet_cpu::load_engine(&path, options(SpeculativeMode::Off)).unwrap();
        let request = (prompt.to_vec(), SamplingParams::greedy(), stop(n));
        run_all(&mut engine, &[request]).0.remove(0).tokens
    };
    let prompt = plain_prompt(7);
    let continued = greedy(&prompt, 16);
    let files = duet_model::model_files::open_model(&path).unwrap();
    let mut draft = DraftModel::load(
        CpuBackend::new(2),
        &files,
        &files,
        &options(SpeculativeMode::Off),
    )
    .unwrap();
    let all_blocks = draft.available_blocks();
    assert_eq!(draft.propose(1, &prompt, 6).unwrap(), continued[..6]);
    // The target kept two drafted tokens and picked another third: the draft's cache forgets
    // the rest of its draft and continues from the new token.
    let other = (continued[2] + 1) % 400;
    let diverged = [&prompt[..], &continued[..2], &[other]].concat();
    assert_eq!(
        draft.propose(1, &diverged, 5).unwrap(),
        greedy(&diverged, 5)
    );
    // A whole draft accepted and the token after it: the draft continues past both.
    let accepted = [&prompt[..], &continued[..8]].concat();
    let mut other_seq = draft.propose(2, &accepted, 8).unwrap();
    assert_eq!(other_seq, continued[8..16]);
    other_seq = draft
        .propose(2, &[&accepted[..], &other_seq].concat(), 0)
        .unwrap();
    assert!(other_seq.is_empty(), "nothing asked, nothing drafted");
    // A prompt of 150 tokens is caught up on a step budget (64) at a time, drafting only after.
    let long: Vec<u32> = (0..15u32).flat_map(plain_prompt).collect();
    assert_eq!(draft.propose(3, &long, 4).unwrap(), Vec::<u32>::new());
    assert_eq!(draft.propose(3, &long, 4).unwrap(), Vec::<u32>::new());
    assert_eq!(draft.propose(3, &long, 4).unwrap(), greedy(&long, 4));
    for seq in 1..=3 {
        draft.release(seq).unwrap();
    }
    assert_eq!(draft.available_blocks(), all_blocks);
}

#[test]
fn a_draft_model_of_another_vocabulary_or_a_missing_file_is_refused_at_load() {
    let load = |mode| duet_cpu::load_engine(&fixtures().join("tiny-llama"), options(mode));
    // The tiny fixture with two of its tokens' ids swapped.
    let other = tempfile::tempdir().unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(
            fixtures().join("tiny-llama").join(file),
            other.path().join(file),
        )
        .unwrap();
    }
    let mut tokenizer: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("tiny-llama/tokenizer.json")).unwrap(),
    )
    .unwrap();
    let vocab = &mut tokenizer["model"]["vocab"];
    vocab["Ā"] = 4.into();
    vocab["ā"] = 3.into();
    std::fs::write(
        other.path().join("tokenizer.json"),
        serde_json::to_string(&tokenizer).unwrap(),
    )
    .unwrap();
    let err = load(SpeculativeMode::Draft(other.path().into()))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("tokenizer is not the target's (token 3 is \"ā\", the target's \"Ā\")"),
        "{err}"
    );
    let err = load(draft_model("no-such-draft.gguf"))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("no-such-draft.gguf"), "{err}");
    // Another architecture of the same vocabulary drafts as well.
    let mut engine = load(draft_model("tiny-qwen3.gguf")).unwrap();
    let request = (plain_prompt(3), SamplingParams::greedy(), stop(12));
    let (want, _) = run_all(
        &mut tiny(SpeculativeMode::Off),
        std::slice::from_ref(&request),
    );
    assert_eq!(run_all(&mut engine, &[request]).0[0].tokens, want[0].tokens);
}

/// Copies the safetensors file `src` to `dst` with the embedding and output matrices padded with
/// zero rows to `rows` (as models padded for their kernels ship them).
fn pad_vocabulary_rows(src: &std::path::Path, dst: &std::path::Path, rows: usize) {
    let bytes = std::fs::read(src).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let offset = |v: &serde_json::Value, i: usize| v["data_offsets"][i].as_u64().unwrap() as usize;
    let mut tensors: Vec<(String, serde_json::Value)> = header
        .into_iter()
        .filter(|(name, _)| name != "__metadata__")
        .collect();
    tensors.sort_by_key(|(_, v)| offset(v, 0));
    let (mut out_header, mut out_data) = (serde_json::Map::new(), Vec::new());
    for (name, mut v) in tensors {
        let start = out_data.len();
        out_data.extend_from_slice(&data[offset(&v, 0)..offset(&v, 1)]);
        if name == "lm_head.weight" || name == "model.embed_tokens.weight" {
            let (had, cols) = (
                v["shape"][0].as_u64().unwrap(),
                v["shape"][1].as_u64().unwrap(),
            );
            out_data.resize(
                out_data.len() + (rows - had as usize) * cols as usize * 4,
                0,
            );
            v["shape"][0] = rows.into();
        }
        v["data_offsets"] = serde_json::json!([start, out_data.len()]);
        out_header.insert(name, v);
    }
    let header = serde_json::to_vec(&out_header).unwrap();
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend(header);
    file.extend(out_data);
    std::fs::write(dst, file).unwrap();
}

/// A draft model of the target's tokenizer whose logits are padded past it could propose ids
/// the target has no row for: it is refused at load, naming both sizes.
#[test]
fn a_draft_model_with_more_logits_than_the_target_is_refused_at_load_and_one_with_fewer_loads() {
    let padded = tempfile::tempdir().unwrap();
    let tiny = fixtures().join("tiny-llama");
    std::fs::copy(
        tiny.join("tokenizer.json"),
        padded.path().join("tokenizer.json"),
    )
    .unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tiny.join("config.json")).unwrap()).unwrap();
    config["vocab_size"] = 400.into();
    std::fs::write(padded.path().join("config.json"), config.to_string()).unwrap();
    pad_vocabulary_rows(
        &tiny.join("model.safetensors"),
        &padded.path().join("model.safetensors"),
        400,
    );
    // The padded copy is a model of its own that loads.
    duet_cpu::load_engine(padded.path(), options(SpeculativeMode::Off)).unwrap();
    let err = duet_cpu::load_engine(&tiny, options(SpeculativeMode::Draft(padded.path().into())))
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("vocab_size 400, the target's 384"), "{err}");
    // Fewer padding rows than the target's, with its tokenizer, is a draft model that fits (as
    // Qwen2.5-0.5B for Qwen2.5-7B): its ids are all ids of the target.
    duet_cpu::load_engine(padded.path(), options(SpeculativeMode::Draft(tiny.clone()))).unwrap();
}
