//! Turning logits into the next token: a grammar's mask, penalties, temperature, top-k, top-p,
//! min-p, seeded sampling, and optional top-n log-probabilities.
//!
//! Order of operations (as in vLLM/HF): the grammar's mask (structured outputs: disallowed tokens
//! get −∞), repetition penalty (prompt and output tokens), presence and frequency penalties
//! (output tokens), then log-probabilities are taken, then temperature, top-k, min-p and top-p
//! narrow the distribution that is sampled. Temperature 0 is greedy (ties go to the lowest id).
//! Each step is defined once in [`crate::sampling_steps`], which a GPU reproduces bit for bit;
//! this module keeps a request's state between draws.

use std::collections::HashMap;

use duet_model::grammar::Grammar;
use duet_model::params::{Sampled, SamplingParams};

use crate::sampling_steps::{RowSampling, sample_row};

pub use crate::sampling_steps::argmax;

/// Per-sequence sampling state: the seed and position that key the random draw, the token counts
/// the penalties need, and the place in the grammar of a constrained request.
pub struct Sampler {
    params: SamplingParams,
    grammar: Option<Grammar>,
    seed: u64,
    /// Position of the next token drawn: the prompt's tokens and those generated so far.
    position: u64,
    /// Distinct tokens the penalties apply to, with how often each was generated (see
    /// [`RowSampling::penalized`]); kept only when a penalty is set.
    penalized: Vec<(u32, u32)>,
    /// Where each token of `penalized` is.
    penalized_at: HashMap<u32, usize>,
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let seed = params.seed.unwrap_or_else(random_seed);
        let mut sampler = Self {
            params,
            grammar: None,
            seed,
            position: prompt.len() as u64,
            penalized: Vec::new(),
            penalized_at: HashMap::new(),
        };
        if sampler.params.repetition_penalty != 1.0 {
            for &t in prompt {
                sampler.penalize(t, 0);
            }
        }
        sampler
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Draws only tokens `grammar` allows (from its current place on).
    pub fn with_grammar(mut self, grammar: Grammar) -> Self {
        self.grammar = Some(grammar);
        self
    }

    /// Whether the request is constrained by a grammar.
    pub fn constrained(&self) -> bool {
        self.grammar.is_some()
    }

    /// Computes the grammar's mask for the next draw ahead of [`Self::sample`] (see
    /// [`Grammar::prepare_mask`]); nothing for an unconstrained request.
    pub fn prepare_mask(&mut self) {
        if let Some(g) = &mut self.grammar {
            g.prepare_mask();
        }
    }

    /// The grammar of a constrained request is complete: nothing may follow.
    pub fn grammar_complete(&self) -> bool {
        self.grammar.as_ref().is_some_and(Grammar::is_complete)
    }

    /// Why the grammar of a constrained request cannot go on, once it failed.
    pub fn grammar_failure(&self) -> Option<String> {
        self.grammar.as_ref().and_then(Grammar::failure)
    }

    /// What drawing the next token needs, for a device that samples (the grammar's mask
    /// prepared first by [`Self::prepare_mask`]); [`Self::accept`] the token it draws.
    pub fn row(&self) -> RowSampling<'_> {
        RowSampling {
            params: &self.params,
            seed: self.seed,
            position: self.position,
            penalized: &self.penalized,
            allowed: self.grammar.as_ref().and_then(Grammar::prepared_mask),
        }
    }

    /// Records tokens generated elsewhere (a prefill worker's first token, tokens streamed before
    /// a failover) as if sampled here: penalties count them and the position moves past them, so
    /// the continuation is the one a single sampler would have produced.
    pub fn record(&mut self, tokens: &[u32]) {
        for &t in tokens {
            self.accept(t);
        }
    }

    /// Moves past `token`, drawn from [`Self::row`] (here or on a device).
    pub fn accept(&mut self, token: u32) {
        if let Some(g) = &mut self.grammar {
            g.accept(token);
        }
        let p = &self.params;
        if p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            self.penalize(token, 1);
        }
        self.position += 1;
    }

    /// Picks the next token from `logits` (modified in place) and records it as generated.
    pub fn sample(&mut self, logits: &mut [f32]) -> Sampled {
        self.prepare_mask();
        let sampled = sample_row(logits, &self.row());
        self.accept(sampled.token);
        sampled
    }

    /// Counts `generated` more generations of `token` (0: a prompt token).
    fn penalize(&mut self, token: u32, generated: u32) {
        match self.penalized_at.get(&token) {
            Some(&i) => self.penalized[i].1 += generated,
            None => {
                self.penalized_at.insert(token, self.penalized.len());
                self.penalized.push((token, generated));
            }
        }
    }
}

fn random_seed() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    nanos
        ^ COUNTER.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
        ^ (std::process::id() as u64) << 32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.0, 3.0, -1.0, 0.5]
    }

    /// The one-loop scan `argmax` replaces: the first index holding the largest value.
    fn argmax_by_scan(logits: &[f32]) -> u32 {
        let mut best = 0;
        for (i, &l) in logits.iter().enumerate() {
            if l > logits[best] {
                best = i;
            }
        }
        best as u32
    }

    #[test]
    fn argmax_is_the_first_largest_logit_at_every_length_and_with_nans() {
        let mut seed = 7u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for len in [0, 1, 2, 15, 16, 17, 31, 33, 100, 49152] {
            for case in 0..24 {
                // Few distinct values, so the largest is often tied across blocks and lanes.
                let mut v: Vec<f32> = (0..len).map(|_| (next() % 7) as f32 - 3.0).collect();
                if len > 0 {
                    let at = next() as usize % len;
                    match case % 6 {
                        1 => v[at] = f32::NAN,
                        2 => v[at] = f32::INFINITY,
                        3 => v[0] = f32::NAN,
                        4 => v
                            .iter_mut()
                            .for_each(|x| *x = if *x > 0.0 { -0.0 } else { 0.0 }),
                        5 => v.iter_mut().for_each(|x| *x = f32::NEG_INFINITY),
                        _ => {}
                    }
                }
                assert_eq!(
                    argmax(&v),
                    argmax_by_scan(&v),
                    "len {len}, case {case}: {:?}",
                    &v[..len.min(40)]
                );
            }
        }
    }

    #[test]
    fn greedy_takes_lowest_id_among_ties() {
        let mut s = Sampler::new(SamplingParams::greedy(), &[]);
        assert_eq!(s.sample(&mut logits()).token, 1);
    }

    #[test]
    fn same_seed_same_tokens_different_seed_differs() {
        let params = SamplingParams {
            temperature: 1.5,
            seed: Some(42),
            ..Default::default()
        };
        let draw = |p: SamplingParams| {
            let mut s = Sampler::new(p, &[]);
            (0..64)
                .map(|_| s.sample(&mut logits()).token)
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(params.clone()), draw(params.clone()));
        assert_ne!(
            draw(params.clone()),
            draw(SamplingParams {
                seed: Some(43),
                ..params
            })
        );
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 2,
            seed: Some(1),
            ..Default::default()
        };
        let mut s = Sampler::new(params, &[]);
        for _ in 0..200 {
            let t = s.sample(&mut logits()).token;
            assert!(
                t == 1 || t == 3,
                "top_k=2 keeps the two 3.0 logits, got {t}"
            );
        }
        // probabilities ≈ [.08,.31,.11,.31,.01,.05]: top_p 0.6 keeps ids 1 and 3 only.
        let params = SamplingParams {
            temperature: 1.0,
            top_p: 0.6,
            seed: Some(2),
            ..Default::default()
        };
        let mut s = Sampler::new(params, &[]);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..300 {
            seen.insert(s.sample(&mut logits()).token);
        }
        assert_eq!(seen, [1, 3].into_iter().collect());
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        let params = SamplingParams {
            temperature: 1.0,
            min_p: 0.5,
            seed: Some(3),
            ..Default::default()
        };
        let mut s = Sampler::new(params, &[]);
        for _ in 0..300 {
            let t = s.sample(&mut logits()).token;
            assert!(
                [1, 3].contains(&t),
                "min_p 0.5 keeps tokens within e^-0.69 of the best, got {t}"
            );
        }
    }

    #[test]
    fn penalties_steer_away_from_repeats() {
        // Repetition penalty applies to prompt tokens: 1 and 3 fall from 3.0 to 1.0.
        let params = SamplingParams {
            repetition_penalty: 3.0,
            ..SamplingParams::greedy()
        };
        let mut s = Sampler::new(params, &[1, 3]);
        assert_eq!(s.sample(&mut logits()).token, 2);
        // Presence penalty applies to generated tokens only.
        let params = SamplingParams {
            presence_penalty: 1.5,
            ..SamplingParams::greedy()
        };
        let mut s = Sampler::new(params, &[1, 3]);
        assert_eq!(s.sample(&mut logits()).token, 1);
        assert_eq!(
            s.sample(&mut logits()).token,
            3,
            "1 was generated, so it is penalised"
        );
        // Frequency penalty grows with the count.
        let params = SamplingParams {
            frequency_penalty: 0.6,
            ..SamplingParams::greedy()
        };
        let mut s = Sampler::new(params, &[]);
        let seq: Vec<u32> = (0..4).map(|_| s.sample(&mut logits()).token).collect();
        assert_eq!(seq, vec![1, 3, 1, 3]);
    }

    #[test]
    fn logprobs_are_normalised_and_ordered() {
        let params = SamplingParams {
            logprobs: 3,
            ..SamplingParams::greedy()
        };
        let mut s = Sampler::new(params, &[]);
        let out = s.sample(&mut logits()).logprobs.unwrap();
        assert_eq!(
            out.top.iter().map(|t| t.0).collect::<Vec<_>>(),
            vec![1, 3, 2]
        );
        let total: f32 = logits().iter().map(|l| l.exp()).sum();
        assert!((out.logprob - (3.0f32.exp() / total).ln()).abs() < 1e-5);
        assert_eq!(out.top[0].1, out.logprob);
        let mut plain = Sampler::new(SamplingParams::greedy(), &[]);
        assert_eq!(
            plain.sample(&mut logits()).logprobs,
            None,
            "computed only when asked for"
        );
    }

    #[test]
    fn validation_names_the_field() {
        let cases = [
            (
                SamplingParams {
                    temperature: -0.1,
                    ..Default::default()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..Default::default()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_p: 1.5,
                    ..Default::default()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    min_p: -1.0,
                    ..Default::default()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..Default::default()
                },
                "repetition_penalty",
            ),
            (
                SamplingParams {
                    presence_penalty: 3.0,
                    ..Default::default()
                },
                "presence_penalty",
            ),
            (
                SamplingParams {
                    logprobs: 99,
                    ..Default::default()
                },
                "logprobs",
            ),
        ];
        for (p, field) in cases {
            let e = p.validate().unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
        assert!(SamplingParams::default().validate().is_ok());
    }

    /// The tiny fixture's tokenizer (384 ids, `</s>` = 2 ends a sequence) and its grammar
    /// compiler.
    fn tiny_grammars() -> (
        duet_model::tokenizer::Tokenizer,
        duet_model::grammar::GrammarCompiler,
    ) {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/tiny-llama/tokenizer.json");
        let tokenizer = duet_model::tokenizer::Tokenizer::from_hf_file(&path)
            .unwrap()
            .with_special_ids(Some(1), &[2]);
        let compiler = duet_model::grammar::GrammarCompiler::new(&tokenizer, 384).unwrap();
        (tokenizer, compiler)
    }

    /// Under a grammar, `top_logprobs` lists only tokens the grammar allows (fewer than asked
    /// where fewer are allowed), never a masked one at −∞.
    #[test]
    fn top_logprobs_under_a_grammar_list_only_allowed_tokens() {
        use duet_model::params::Constraint;
        let (_, compiler) = tiny_grammars();
        let constraint = Constraint::Regex("a|b".into());
        let allowed: Vec<u32> = {
            let mut logits = vec![0f32; 384];
            compiler.compile(&constraint).unwrap().mask(&mut logits);
            (0..384u32)
                .filter(|&t| logits[t as usize].is_finite())
                .collect()
        };
        assert!(
            (1..5).contains(&allowed.len()),
            "the test needs fewer allowed tokens than asked for: {allowed:?}"
        );
        let params = SamplingParams {
            logprobs: 5,
            constraint: Some(constraint.clone()),
            ..SamplingParams::greedy()
        };
        let mut sampler =
            Sampler::new(params, &[]).with_grammar(compiler.compile(&constraint).unwrap());
        let mut logits = duet_model::synthetic::Uniform::new(4).values(384);
        let out = sampler.sample(&mut logits).logprobs.unwrap();
        let mut listed: Vec<u32> = out.top.iter().map(|t| t.0).collect();
        listed.sort_unstable();
        assert_eq!(listed, allowed);
        assert!(out.top.iter().all(|t| t.1.is_finite()), "{:?}", out.top);
    }

    /// A constrained sampler draws only what its grammar allows, at any temperature, and says
    /// when the grammar is complete; a sampler that records the first tokens (a failover's
    /// replay) draws the rest exactly as the original did, grammar and random stream alike.
    #[test]
    fn a_grammar_holds_every_draw_and_a_replay_continues_it() {
        use duet_model::params::Constraint;
        let (tokenizer, compiler) = tiny_grammars();
        let constraint = Constraint::Regex("(ab|cd){3}".into());
        let params = SamplingParams {
            temperature: 1.5,
            seed: Some(3),
            constraint: Some(constraint.clone()),
            ..Default::default()
        };
        let sampler = || {
            Sampler::new(params.clone(), &[]).with_grammar(compiler.compile(&constraint).unwrap())
        };
        let logits: Vec<Vec<f32>> = {
            let mut rng = duet_model::synthetic::Uniform::new(9);
            (0..12).map(|_| rng.values(384)).collect()
        };
        let mut original = sampler();
        let mut drawn = Vec::new();
        while !original.grammar_complete() {
            let mut l = logits[drawn.len()].clone();
            drawn.push(original.sample(&mut l).token);
            assert!(
                drawn.len() < logits.len(),
                "the grammar never completed: {drawn:?}"
            );
        }
        let text = tokenizer.decode(&drawn, false).unwrap();
        assert_eq!(text.len(), 6, "{text:?}");
        let pairs: Vec<&str> = (0..3).map(|i| &text[2 * i..2 * i + 2]).collect();
        assert!(pairs.iter().all(|p| *p == "ab" || *p == "cd"), "{text:?}");
        for cut in 1..drawn.len() {
            let mut replayed = sampler();
            replayed.record(&drawn[..cut]);
            let rest: Vec<u32> = (cut..drawn.len())
                .map(|i| replayed.sample(&mut logits[i].clone()).token)
                .collect();
            assert_eq!(rest, drawn[cut..], "replayed after {cut} tokens");
            assert!(replayed.grammar_complete());
        }
    }
}
