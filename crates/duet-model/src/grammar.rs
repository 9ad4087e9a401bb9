//! Structured outputs: a request's [`Constraint`] compiled by llguidance against the model's
//! tokenizer, and the per-sequence [`Grammar`] that masks each step's logits to the tokens that
//! keep the text inside the grammar.
//!
//! The tokenizer is handed to llguidance as a token trie of every id's bytes (special tokens
//! marked as such, so text never matches them); the compiler is built once per model and shared
//! by every request. A grammar that is complete ends its sequence (see [`Grammar::is_complete`]):
//! no end-of-sequence token is needed. One that fails part way (an llguidance error: a limit
//! passed, a token it cannot take) ends it too, with the reason ([`Grammar::failure`]). JSON
//! Schemas are compiled as duet holds them ([`json_schema::with_defaults`]).

use std::sync::Arc;

use crate::json_schema;
use crate::params::Constraint;
use crate::tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

/// A constraint that cannot be used, with the reason.
#[derive(Debug, thiserror::Error)]
#[error("invalid {kind} constraint: {reason}")]
pub struct GrammarError {
    pub kind: &'static str,
    pub reason: String,
}

/// Compiles constraints for one model's vocabulary.
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler").finish_non_exhaustive()
    }
}

impl GrammarCompiler {
    /// For a model of `vocab_size` logits whose text comes from `tokenizer`.
    pub fn new(tokenizer: &Tokenizer, vocab_size: usize) -> Result<Self, GrammarError> {
        let setup = |reason: String| GrammarError {
            kind: "any",
            reason: format!("the tokenizer cannot be used for constraints: {reason}"),
        };
        // Every end id of the model ends a grammar's sentence (Llama 3 Instruct ends a turn with
        // `<|eot_id|>` and a text with `<|end_of_text|>`): llguidance allows all of them where
        // the grammar may end.
        let eos: Vec<u32> = tokenizer
            .eos_token_ids()
            .iter()
            .copied()
            .filter(|&id| (id as usize) < vocab_size)
            .collect();
        let first_eos = *eos
            .first()
            .ok_or_else(|| setup("it has no end-of-sequence token".into()))?;
        let words: Vec<Vec<u8>> = (0..vocab_size as u32)
            .map(|id| match tokenizer.id_to_token(id) {
                Some(name) if tokenizer.is_special(id) => special(&name),
                Some(_) => tokenizer
                    .token_bytes(id)
                    .unwrap_or_else(|_| special(&id.to_string())),
                // Logits past the tokenizer's vocabulary (padding rows) never match text.
                None => special(&format!("<|unused_{id}|>")),
            })
            .collect();
        let info = TokRxInfo {
            vocab_size: vocab_size as u32,
            tok_eos: first_eos,
            tok_bos: tokenizer.bos_token_id(),
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: None,
        };
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| setup(e.to_string()))?;
        factory.quiet();
        Ok(Self {
            factory: Arc::new(factory),
        })
    }

    /// A fresh grammar state for `constraint`: an error when it does not parse, uses what
    /// llguidance does not support, or cannot produce any token.
    pub fn compile(&self, constraint: &Constraint) -> Result<Grammar, GrammarError> {
        let kind = constraint.kind();
        let invalid = |reason: String| GrammarError { kind, reason };
        let grammar = match constraint {
            Constraint::JsonSchema(text) => {
                let schema: serde_json::Value = serde_json::from_str(text)
                    .map_err(|e| invalid(format!("the schema is not JSON: {e}")))?;
                TopLevelGrammar::from_json_schema(json_schema::with_defaults(schema))
            }
            Constraint::JsonObject => TopLevelGrammar::from_json_schema(
                json_schema::with_defaults(serde_json::json!({"type": "object"})),
            ),
            Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Constraint::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| invalid(e.to_string()))?;
        let mut matcher = Matcher::new(Ok(parser));
        let mask = matcher.compute_mask().map_err(|e| invalid(e.to_string()))?;
        if mask.is_zero() {
            return Err(invalid("the grammar cannot produce any token".into()));
        }
        Ok(Grammar {
            matcher,
            eos: self.factory.tok_env().tok_trie().eos_token(),
            next_mask: None,
        })
    }
}

/// `\xFF` + name: how the token trie marks a special token.
fn special(name: &str) -> Vec<u8> {
    let mut word = vec![TokTrie::SPECIAL_TOKEN_MARKER];
    word.extend_from_slice(name.as_bytes());
    word
}

/// One sequence's place in its grammar.
pub struct Grammar {
    matcher: Matcher,
    eos: u32,
    /// The tokens allowed next, computed ahead by [`Self::prepare_mask`]; cleared when the
    /// grammar moves on.
    next_mask: Option<SimpleVob>,
}

impl Grammar {
    /// Computes the tokens allowed next, ahead of [`Self::mask`]: the costly half of masking,
    /// which needs only the tokens so far, so it can run while the forward step computes the
    /// logits.
    pub fn prepare_mask(&mut self) {
        if self.next_mask.is_none() {
            self.next_mask = Some(self.allowed());
        }
    }

    /// The tokens the grammar allows next. A grammar that failed allows only the end-of-sequence
    /// token: something must be drawn, and the sequence ends with the failure (see
    /// [`Self::failure`]).
    fn allowed(&mut self) -> SimpleVob {
        self.matcher.compute_mask_or_eos().unwrap_or_else(|_| {
            let mut only_eos = SimpleVob::alloc(self.eos as usize + 1);
            only_eos.allow_token(self.eos);
            only_eos
        })
    }

    /// Sets the logits of every token the grammar does not allow next to −∞.
    pub fn mask(&mut self, logits: &mut [f32]) {
        self.prepare_mask();
        if let Some(allowed) = self.prepared_mask() {
            mask_logits(allowed, logits);
        }
    }

    /// The tokens allowed next as bits (bit `t % 32` of word `t / 32`), once
    /// [`Self::prepare_mask`] has computed them; `None` before.
    pub fn prepared_mask(&self) -> Option<&[u32]> {
        self.next_mask.as_ref().map(|m| m.as_slice())
    }

    /// Moves past `token` (sampled under [`Self::mask`], or replayed after a failover).
    pub fn accept(&mut self, token: u32) {
        self.next_mask = None;
        if !self.matcher.is_stopped() {
            // An error leaves the matcher failed: `failure` says why.
            let _ = self.matcher.consume_token(token);
        }
    }

    /// The text is a whole sentence of the grammar and nothing may follow it.
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped() && !self.matcher.is_error()
    }

    /// Why the grammar cannot go on, once it failed (llguidance's message).
    pub fn failure(&self) -> Option<String> {
        self.matcher.get_error()
    }
}

/// Sets every logit whose bit in `allowed` (bit `t % 32` of word `t / 32`) is clear to −∞, and
/// every logit past the bitmap's words (none when the vocabularies agree).
pub fn mask_logits(allowed: &[u32], logits: &mut [f32]) {
    // A word at a time: most are all clear (or all set) under a grammar.
    for (&word, chunk) in allowed.iter().zip(logits.chunks_mut(32)) {
        match word {
            0 => chunk.fill(f32::NEG_INFINITY),
            u32::MAX => {}
            _ => {
                for (bit, logit) in chunk.iter_mut().enumerate() {
                    if word >> bit & 1 == 0 {
                        *logit = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }
    if let Some(rest) = logits.get_mut(allowed.len() * 32..) {
        rest.fill(f32::NEG_INFINITY);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::path::PathBuf;

    /// The tiny fixture's byte-level BPE tokenizer (384 ids; `</s>` = 2 ends a sequence).
    pub(crate) fn compiler() -> (GrammarCompiler, Tokenizer) {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/tiny-llama/tokenizer.json");
        let tokenizer = Tokenizer::from_hf_file(&path)
            .unwrap()
            .with_special_ids(Some(1), &[2]);
        (GrammarCompiler::new(&tokenizer, 384).unwrap(), tokenizer)
    }

    /// Generates under `constraint` with a stand-in model whose logits are pseudo-random (the
    /// single-byte tokens of `closing`, ids 3 + byte, favoured so that open-ended grammars end),
    /// until the grammar is complete or the model picks the end of sequence. Returns the text
    /// and the tokens.
    fn generate(constraint: Constraint, seed: u64, closing: &[u8]) -> (String, Vec<u32>) {
        let (compiler, tokenizer) = compiler();
        let mut grammar = compiler.compile(&constraint).unwrap();
        let mut rng = crate::synthetic::Uniform::new(seed);
        let mut tokens = Vec::new();
        while !grammar.is_complete() && tokens.len() < 200 {
            let mut logits = rng.values(384);
            for &b in closing {
                logits[3 + b as usize] += 1.5;
            }
            grammar.mask(&mut logits);
            let token = (0..384u32)
                .max_by(|&a, &b| logits[a as usize].total_cmp(&logits[b as usize]))
                .unwrap();
            assert!(logits[token as usize].is_finite(), "no token allowed");
            if token == 2 {
                break;
            }
            grammar.accept(token);
            tokens.push(token);
        }
        (tokenizer.decode(&tokens, false).unwrap(), tokens)
    }

    /// A mask computed ahead (on another thread, as while a forward pass runs) is the mask of
    /// the tokens accepted so far, and moving on discards it: two grammars, one masking ahead
    /// and one not, mask every step's logits alike.
    #[test]
    fn a_mask_prepared_ahead_is_the_mask_of_the_tokens_so_far() {
        let (compiler, _) = compiler();
        let constraint = Constraint::JsonSchema(
            r#"{"type":"object","properties":{"k":{"type":"array","items":{"type":"integer"}}},"required":["k"]}"#.into(),
        );
        let mut ahead = compiler.compile(&constraint).unwrap();
        let mut inline = compiler.compile(&constraint).unwrap();
        let mut rng = crate::synthetic::Uniform::new(3);
        let mut steps = 0;
        while !inline.is_complete() && steps < 200 {
            ahead = std::thread::spawn(move || {
                ahead.prepare_mask();
                ahead
            })
            .join()
            .unwrap();
            let mut logits = rng.values(384);
            for b in *b"]}" {
                logits[3 + b as usize] += 1.0;
            }
            let (mut a, mut b) = (logits.clone(), logits);
            ahead.mask(&mut a);
            inline.mask(&mut b);
            assert_eq!(a, b, "step {steps}");
            let token = (0..384u32)
                .max_by(|&x, &y| b[x as usize].total_cmp(&b[y as usize]))
                .unwrap();
            // A mask prepared and then passed by (a token replayed after a failover) is dropped.
            ahead.prepare_mask();
            ahead.accept(token);
            inline.accept(token);
            steps += 1;
        }
        assert!(inline.is_complete() && ahead.is_complete(), "{steps} steps");
    }

    /// Text generated under a JSON Schema parses and has the schema's shape, whatever the
    /// model prefers.
    #[test]
    fn a_json_schema_shapes_the_text() {
        let schema = r#"{"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
            "required": ["name", "age", "tags"], "additionalProperties": false}"#;
        for seed in 0..8 {
            let (text, _) = generate(Constraint::JsonSchema(schema.into()), seed, b"");
            let v: serde_json::Value =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            let o = v.as_object().unwrap();
            assert_eq!(o.len(), 3, "{text}");
            assert!(o["name"].as_str().unwrap().chars().count() <= 8, "{text}");
            assert!((0..=99).contains(&o["age"].as_i64().unwrap()), "{text}");
            let tags = o["tags"].as_array().unwrap();
            assert!(
                tags.len() <= 3 && tags.iter().all(|t| t == "a" || t == "b"),
                "{text}"
            );
        }
    }

    /// `json_object` gives an object; a regular expression is matched whole; a Lark grammar is
    /// followed.
    #[test]
    fn json_objects_regexes_and_lark_grammars_shape_the_text() {
        for seed in 0..4 {
            let (text, _) = generate(Constraint::JsonObject, seed, b"\"}");
            let v: serde_json::Value =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert!(v.is_object(), "{text}");
            let (text, _) = generate(Constraint::Regex("[0-9]{3}-[a-c]{2,4}".into()), seed, b"");
            let (digits, letters) = text.split_once('-').unwrap_or_else(|| panic!("{text:?}"));
            assert!(
                digits.len() == 3 && digits.bytes().all(|b| b.is_ascii_digit()),
                "{text}"
            );
            assert!((2..=4).contains(&letters.len()), "{text}");
            assert!(
                letters.bytes().all(|b| (b'a'..=b'c').contains(&b)),
                "{text}"
            );
            let lark = r#"start: "yes" | "no" | "maybe " NUM
                          NUM: /[0-9]/"#;
            let (text, _) = generate(Constraint::Lark(lark.into()), seed, b"");
            let maybe = text.strip_prefix("maybe ").is_some_and(|n| n.len() == 1);
            assert!(text == "yes" || text == "no" || maybe, "{text:?}");
        }
    }

    /// A grammar fed tokens generated under it (a failover's replay) allows what the original
    /// did at the same place.
    #[test]
    fn a_replayed_grammar_continues_where_the_original_was() {
        let schema = r#"{"type": "object", "properties": {"x": {"type": "string", "maxLength": 9}},
                         "required": ["x"], "additionalProperties": false}"#;
        let constraint = Constraint::JsonSchema(schema.into());
        let (_, tokens) = generate(constraint.clone(), 3, b"");
        let (compiler, _) = compiler();
        let (mut original, mut replayed) = (
            compiler.compile(&constraint).unwrap(),
            compiler.compile(&constraint).unwrap(),
        );
        let cut = tokens.len() / 2;
        for &t in &tokens[..cut] {
            original.accept(t);
            replayed.accept(t);
        }
        let allowed = |g: &mut Grammar| {
            let mut logits = vec![0f32; 384];
            g.mask(&mut logits);
            logits.iter().map(|l| l.is_finite()).collect::<Vec<_>>()
        };
        assert_eq!(allowed(&mut original), allowed(&mut replayed));
        for &t in &tokens[cut..] {
            replayed.accept(t);
        }
        assert!(replayed.is_complete());
    }

    /// Every end id of a model with several (Llama 3 Instruct's `<|eot_id|>` and
    /// `<|end_of_text|>`; here the fixture's `</s>` and `<unk>`) may end an open grammar: a
    /// regular expression, a Lark grammar, `tool_choice: "auto"`'s grammar.
    #[test]
    fn every_end_id_of_the_model_ends_an_open_grammar() {
        use crate::tool_calls::{ToolCallFormat, call_schema};
        let (_, tokenizer) = compiler();
        let tokenizer = tokenizer.with_special_ids(None, &[0]);
        assert_eq!(tokenizer.eos_token_ids(), [2, 0]);
        let compiler = GrammarCompiler::new(&tokenizer, 384).unwrap();
        let tools = call_schema([("f", serde_json::json!({"type": "object"}))]);
        for constraint in [
            Constraint::Regex("[a-z]+".into()),
            Constraint::Lark("start: /[a-z]+/ | \"yes\"".into()),
            Constraint::Lark(ToolCallFormat::Hermes.grammar(&tools)),
        ] {
            for end in [2, 0] {
                let mut grammar = compiler.compile(&constraint).unwrap();
                grammar.accept(100); // "a"
                let mut logits = vec![0f32; 384];
                grammar.mask(&mut logits);
                assert!(
                    logits[2].is_finite() && logits[0].is_finite(),
                    "{constraint:?}: an end id is masked"
                );
                grammar.accept(end);
                assert!(grammar.is_complete(), "{constraint:?} after {end}");
            }
        }
    }

    /// A grammar that fails part way (here a token it forbids, as a failover could replay) says
    /// why, and is not complete: its sequence must not end as if the text were whole.
    #[test]
    fn a_grammar_that_fails_says_why_and_is_not_complete() {
        let (compiler, _) = compiler();
        let mut grammar = compiler
            .compile(&Constraint::Regex("[0-9]+".into()))
            .unwrap();
        grammar.accept(3 + b'7' as u32);
        assert_eq!(grammar.failure(), None);
        grammar.accept(100); // "a"
        let failure = grammar
            .failure()
            .expect("a forbidden token fails the grammar");
        assert!(!failure.is_empty());
        assert!(!grammar.is_complete());
        // What is left to draw is an end of sequence, which ends it.
        let mut logits = vec![0f32; 384];
        grammar.mask(&mut logits);
        let allowed: Vec<usize> = (0..384).filter(|&t| logits[t].is_finite()).collect();
        assert_eq!(allowed, [2]);
    }

    /// Bad constraints are refused with the reason, before anything is generated.
    #[test]
    fn bad_constraints_are_refused_with_the_reason() {
        let (compiler, _) = compiler();
        for (constraint, reason) in [
            (Constraint::JsonSchema("{not json".into()), "not JSON"),
            (
                Constraint::JsonSchema(r#"{"type": "strnig"}"#.into()),
                "strnig",
            ),
            (Constraint::Regex("[a-".into()), ""),
            (
                Constraint::Lark("start: missing_rule".into()),
                "missing_rule",
            ),
        ] {
            let kind = constraint.kind();
            let e = compiler
                .compile(&constraint)
                .err()
                .unwrap_or_else(|| panic!("{constraint:?} was accepted"));
            let text = e.to_string();
            assert!(text.contains(kind) && text.contains(reason), "{text}");
        }
    }
}
