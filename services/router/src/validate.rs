//! Request validation: a client's `GenerateRequest` becomes the prompt's token ids and the
//! worker-protocol `SamplingParams` with every field resolved, or a typed [`ValidationError`]
//! that says what was wrong (answered as INVALID_ARGUMENT).

use std::sync::{Arc, OnceLock};

use duet_model::chat::{ChatError, ChatMessage, ChatTemplate, TemplateVariables};
use duet_model::grammar::{GrammarCompiler, GrammarError};
use duet_model::params::{Constraint, MAX_CACHE_SALT_BYTES, SamplingParams as EngineSampling};
use duet_model::params::{PromptError, PromptLimits, StopCriteria};
use duet_model::tokenizer::{Tokenizer, TokenizerError};
use duet_proto::convert::constraint_from_wire;
use duet_proto::v1;

/// A bad request. Every variant is the client's to fix.
#[derive(Debug, thiserror::Error)]
pub enum ValidationError {
    #[error("empty prompt: token_ids, messages and prompt are all empty")]
    EmptyPrompt,
    #[error("empty prompt: the prompt tokenizes to no tokens")]
    EmptyAfterTokenization,
    #[error(
        "prompt too long: {len} bytes of text, past the router's limit of {max} bytes \
         (--max-prompt-bytes)"
    )]
    PromptTooManyBytes { len: usize, max: usize },
    /// A prompt of tokens the model cannot take (out of the vocabulary, past the context), or
    /// `max_tokens` past the context.
    #[error(transparent)]
    Prompt(#[from] PromptError),
    #[error("max_tokens must be at least 1, got 0")]
    MaxTokensZero,
    #[error("cache_salt must be at most {max} bytes, got {len}")]
    CacheSaltTooLong { len: usize, max: usize },
    #[error("top_k must be >= 0, got {0}")]
    NegativeTopK(i32),
    /// A sampling parameter out of range (the message names it and the allowed range).
    #[error("{0}")]
    Sampling(String),
    /// Bad stop strings (too many, too long or empty).
    #[error("stop: {0}")]
    Stop(String),
    #[error(
        "stop_token_ids[{index}] = {id} is outside the vocabulary (valid ids are 0..{vocab_size})"
    )]
    StopTokenOutOfVocab {
        index: usize,
        id: u32,
        vocab_size: u32,
    },
    /// The chat template refused the conversation (unknown role, template's own check).
    #[error("messages: {0}")]
    Chat(#[from] ChatError),
    /// `chat_template_kwargs` that are not a JSON object, set a variable the server sets, or
    /// come without `messages`.
    #[error("{0}")]
    TemplateVariables(ChatError),
    #[error("prompt: {0}")]
    Tokenize(#[from] TokenizerError),
    #[error(
        "constraint too long: {len} bytes, past the router's limit of {max} bytes \
         (--max-constraint-bytes)"
    )]
    ConstraintTooLong { len: usize, max: usize },
    /// A constraint that does not compile or cannot produce any token.
    #[error(transparent)]
    Constraint(#[from] GrammarError),
    /// A `Constraint` message with no kind set (it would run unconstrained).
    #[error(
        "constraint: no kind set; set one of json_schema, json_object, regex or lark (or leave \
         the constraint out)"
    )]
    ConstraintWithoutKind,
}

/// A validated request: what the decode worker needs.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidRequest {
    /// The prompt's token ids (non-empty, all in the vocabulary, shorter than the context).
    pub prompt: Vec<u32>,
    /// Every field resolved; `seed` always set, `max_tokens` >= 1 and fits the context.
    pub sampling: v1::SamplingParams,
    pub cache_salt: String,
}

/// What the router knows of the model: enough to tokenize and check requests.
#[derive(Debug, Clone)]
pub struct PromptModel {
    pub tokenizer: Tokenizer,
    /// The model's chat template (or `--chat-template`), or ChatML when it has none.
    pub chat: std::sync::Arc<ChatTemplate>,
    /// Tokens of one sequence, prompt plus generated.
    pub context_length: u32,
    /// Valid token ids are `0..vocab_size`.
    pub vocab_size: u32,
    /// `max_tokens` of requests that set none (lowered to fit the context).
    pub default_max_tokens: u32,
    /// Text to tokenize past this many bytes is refused before tokenizing (see
    /// [`max_prompt_bytes_for`]).
    pub max_prompt_bytes: usize,
    /// Constraints past this many bytes are refused before compiling.
    pub max_constraint_bytes: usize,
    /// Compiles constraints to check them; built on the first constrained request and shared
    /// by every copy of this model.
    pub grammars: Arc<OnceLock<Result<GrammarCompiler, String>>>,
}

/// The default `--max-prompt-bytes`: the context's tokens times the most bytes one token
/// stands for. A text longer than that encodes to more tokens than the context holds, so the
/// bound refuses no prompt that would fit, and caps a tokenization's work at a context's worth.
pub fn max_prompt_bytes_for(tokenizer: &Tokenizer, context_length: u32) -> usize {
    (context_length as usize).saturating_mul(tokenizer.longest_token_bytes())
}

impl PromptModel {
    /// Refuses `len` bytes of text to tokenize past the limit.
    fn check_bytes(&self, len: usize) -> Result<(), ValidationError> {
        if len > self.max_prompt_bytes {
            return Err(ValidationError::PromptTooManyBytes {
                len,
                max: self.max_prompt_bytes,
            });
        }
        Ok(())
    }

    /// The length check of what a request would tokenize (`messages`' contents, else
    /// `prompt`; `token_ids` need none), by lengths alone: the router runs it before waiting
    /// for a tokenizing thread. Tokenizing checks it again, so every caller is covered.
    pub fn check_prompt_bytes(
        &self,
        text: &str,
        messages: &[v1::ChatMessage],
    ) -> Result<(), ValidationError> {
        if messages.is_empty() {
            self.check_bytes(text.len())
        } else {
            self.check_bytes(
                messages
                    .iter()
                    .map(|m| {
                        let calls = m.tool_calls.iter();
                        m.content.len()
                            + calls
                                .map(|c| c.arguments.len() + c.name.len())
                                .sum::<usize>()
                    })
                    .sum(),
            )
        }
    }

    /// Tokenizes plain text as `GenerateRequest.prompt` is.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>, ValidationError> {
        self.check_bytes(text.len())?;
        Ok(self.tokenizer.encode(text)?)
    }

    /// Renders a conversation with the chat template (with the generation prompt) and
    /// tokenizes it.
    pub fn encode_messages(
        &self,
        messages: &[v1::ChatMessage],
        chat_template_kwargs: &str,
    ) -> Result<Vec<u32>, ValidationError> {
        // The contents bound the rendered text's tokens (the markup only adds some), so they
        // are checked before rendering, which copies them.
        self.check_prompt_bytes("", messages)?;
        let msgs: Vec<ChatMessage> = messages.iter().map(ChatMessage::from).collect();
        let variables = TemplateVariables::parse(chat_template_kwargs)
            .map_err(ValidationError::TemplateVariables)?;
        let text =
            self.chat
                .apply_with(&msgs, true, &self.tokenizer.special_tokens(), &variables)?;
        Ok(self.tokenizer.encode(&text)?)
    }

    /// The prompt of a request: `token_ids` if non-empty, else `messages`, else `prompt`.
    pub fn resolve_prompt(&self, req: &v1::GenerateRequest) -> Result<Vec<u32>, ValidationError> {
        if !req.chat_template_kwargs.is_empty()
            && (req.messages.is_empty() || !req.token_ids.is_empty())
        {
            return Err(ValidationError::TemplateVariables(ChatError::Variables(
                "given without messages to render (token_ids or prompt need no template)".into(),
            )));
        }
        let ids = if !req.token_ids.is_empty() {
            req.token_ids.clone()
        } else if !req.messages.is_empty() {
            self.encode_messages(&req.messages, &req.chat_template_kwargs)?
        } else if !req.prompt.is_empty() {
            self.encode_text(&req.prompt)?
        } else {
            return Err(ValidationError::EmptyPrompt);
        };
        if ids.is_empty() {
            return Err(ValidationError::EmptyAfterTokenization);
        }
        self.limits().check(&ids)?;
        Ok(ids)
    }

    /// Checks that a request's constraint names a kind, fits the limit and compiles, before
    /// anything is queued (the workers compile it again to use it).
    fn check_constraint(&self, c: &v1::Constraint) -> Result<Constraint, ValidationError> {
        let constraint = constraint_from_wire(c).ok_or(ValidationError::ConstraintWithoutKind)?;
        if constraint.text_bytes() > self.max_constraint_bytes {
            return Err(ValidationError::ConstraintTooLong {
                len: constraint.text_bytes(),
                max: self.max_constraint_bytes,
            });
        }
        let compiler = self.grammars.get_or_init(|| {
            GrammarCompiler::new(&self.tokenizer, self.vocab_size as usize)
                .map_err(|e| e.to_string())
        });
        let compiler = compiler.as_ref().map_err(|reason| GrammarError {
            kind: constraint.kind(),
            reason: reason.clone(),
        })?;
        compiler.compile(&constraint)?;
        Ok(constraint)
    }

    /// What a prompt must fit.
    pub fn limits(&self) -> PromptLimits {
        PromptLimits {
            context_length: self.context_length as usize,
            vocab_size: self.vocab_size as usize,
        }
    }

    /// Validates a request and resolves its prompt and parameters. `random_seed` gives the seed
    /// when the client set none.
    pub fn validate(
        &self,
        req: &v1::GenerateRequest,
        random_seed: impl FnOnce() -> u64,
    ) -> Result<ValidRequest, ValidationError> {
        let prompt = self.resolve_prompt(req)?;
        let limits = self.limits();
        let max_tokens = match req.max_tokens {
            Some(0) => return Err(ValidationError::MaxTokensZero),
            Some(n) => {
                limits.check_max_tokens(prompt.len(), n as usize)?;
                n
            }
            // The room is >= 1 (the prompt passed `check`); the default may be configured as 0
            // only by mistake.
            None => (self.default_max_tokens as usize).clamp(1, limits.room(prompt.len())) as u32,
        };
        if req.cache_salt.len() > MAX_CACHE_SALT_BYTES {
            return Err(ValidationError::CacheSaltTooLong {
                len: req.cache_salt.len(),
                max: MAX_CACHE_SALT_BYTES,
            });
        }
        if req.top_k < 0 {
            return Err(ValidationError::NegativeTopK(req.top_k));
        }
        let engine = EngineSampling {
            temperature: req.temperature.unwrap_or(1.0),
            top_k: req.top_k as u32,
            top_p: req.top_p.unwrap_or(1.0),
            min_p: req.min_p.unwrap_or(0.0),
            repetition_penalty: req.repetition_penalty.unwrap_or(1.0),
            presence_penalty: req.presence_penalty.unwrap_or(0.0),
            frequency_penalty: req.frequency_penalty.unwrap_or(0.0),
            seed: req.seed,
            logprobs: req.logprobs,
            constraint: None,
            speculative: req.speculative.unwrap_or(true),
        };
        engine
            .validate()
            .map_err(|e| ValidationError::Sampling(e.0))?;
        StopCriteria {
            max_tokens: max_tokens as usize,
            stop_token_ids: req.stop_token_ids.clone(),
            stop_strings: req.stop.clone(),
            ignore_eos: req.ignore_eos,
        }
        .validate()
        .map_err(|e| ValidationError::Stop(e.0))?;
        if let Some((index, &id)) = req
            .stop_token_ids
            .iter()
            .enumerate()
            .find(|&(_, &id)| id >= self.vocab_size)
        {
            return Err(ValidationError::StopTokenOutOfVocab {
                index,
                id,
                vocab_size: self.vocab_size,
            });
        }
        let constraint = match &req.constraint {
            Some(c) => Some(self.check_constraint(c)?),
            None => None,
        };
        let sampling = v1::SamplingParams {
            temperature: engine.temperature,
            top_p: engine.top_p,
            top_k: engine.top_k,
            min_p: engine.min_p,
            repetition_penalty: engine.repetition_penalty,
            presence_penalty: engine.presence_penalty,
            frequency_penalty: engine.frequency_penalty,
            seed: Some(req.seed.unwrap_or_else(random_seed)),
            logprobs: engine.logprobs,
            max_tokens,
            stop: req.stop.clone(),
            stop_token_ids: req.stop_token_ids.clone(),
            ignore_eos: req.ignore_eos,
            constraint: constraint.as_ref().map(v1::Constraint::from),
            speculative: engine.speculative,
        };
        Ok(ValidRequest {
            prompt,
            sampling,
            cache_salt: req.cache_salt.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn model() -> PromptModel {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama");
        let files = duet_model::model_files::open_model(&dir).expect("tiny-llama opens");
        let context_length = files.config.max_position_embeddings as u32;
        PromptModel {
            max_prompt_bytes: max_prompt_bytes_for(&files.tokenizer, context_length),
            tokenizer: files.tokenizer,
            chat: std::sync::Arc::new(files.chat_template.unwrap_or_else(ChatTemplate::chatml)),
            context_length,
            vocab_size: files.config.vocab_size as u32,
            default_max_tokens: 256,
            max_constraint_bytes: 1024,
            grammars: Default::default(),
        }
    }

    fn req() -> v1::GenerateRequest {
        v1::GenerateRequest {
            prompt: "hello world".into(),
            ..Default::default()
        }
    }

    fn err(m: &PromptModel, r: v1::GenerateRequest) -> String {
        m.validate(&r, || 7).unwrap_err().to_string()
    }

    fn assert_err(m: &PromptModel, r: v1::GenerateRequest, words: &[&str]) {
        let e = err(m, r);
        for w in words {
            assert!(e.contains(w), "{e:?} lacks {w:?}");
        }
    }

    #[test]
    fn good_request_is_resolved() {
        let m = model();
        let v = m.validate(&req(), || 42).unwrap();
        assert!(!v.prompt.is_empty());
        let s = &v.sampling;
        assert_eq!(s.seed, Some(42));
        assert_eq!((s.temperature, s.top_p, s.top_k), (1.0, 1.0, 0));
        assert_eq!((s.min_p, s.repetition_penalty), (0.0, 1.0));
        assert_eq!((s.presence_penalty, s.frequency_penalty), (0.0, 0.0));
        // Default 256 lowered to fit the 256-token context.
        assert_eq!(s.max_tokens as usize, 256 - v.prompt.len());

        let r = v1::GenerateRequest {
            seed: Some(5),
            max_tokens: Some(3),
            temperature: Some(0.0),
            top_p: Some(0.5),
            top_k: 4,
            min_p: Some(0.1),
            repetition_penalty: Some(1.1),
            presence_penalty: Some(-2.0),
            frequency_penalty: Some(2.0),
            logprobs: 20,
            stop: vec!["x".into()],
            stop_token_ids: vec![2],
            ignore_eos: true,
            cache_salt: "t".into(),
            ..req()
        };
        let v = m.validate(&r, || unreachable!()).unwrap();
        let s = &v.sampling;
        assert_eq!(s.seed, Some(5));
        assert_eq!(
            (s.max_tokens, s.temperature, s.top_p, s.top_k),
            (3, 0.0, 0.5, 4)
        );
        assert_eq!((s.logprobs, s.ignore_eos), (20, true));
        assert_eq!(s.stop, ["x"]);
        assert_eq!(s.stop_token_ids, [2]);
        assert_eq!(v.cache_salt, "t");
    }

    #[test]
    fn prompt_forms() {
        let m = model();
        let ids = v1::GenerateRequest {
            token_ids: vec![1, 5, 9],
            prompt: "ignored".into(),
            ..Default::default()
        };
        assert_eq!(m.validate(&ids, || 0).unwrap().prompt, [1, 5, 9]);
        let chat = v1::GenerateRequest {
            messages: vec![v1::ChatMessage {
                role: "user".into(),
                content: "hi".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let p = m.validate(&chat, || 0).unwrap().prompt;
        let expect = m
            .encode_text("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
            .unwrap();
        assert_eq!(p, expect);
    }

    #[test]
    fn empty_prompt() {
        let m = model();
        assert_err(&m, v1::GenerateRequest::default(), &["empty prompt"]);
        assert_err(
            &m,
            v1::GenerateRequest {
                prompt: String::new(),
                max_tokens: Some(4),
                ..Default::default()
            },
            &["empty prompt"],
        );
    }

    #[test]
    fn prompt_too_long() {
        let m = model();
        let r = v1::GenerateRequest {
            token_ids: vec![5; 256],
            ..Default::default()
        };
        assert_err(
            &m,
            r,
            &["prompt too long", "256 tokens", "context holds 256"],
        );
        let r = v1::GenerateRequest {
            prompt: "hello world ".repeat(300),
            ..Default::default()
        };
        assert_err(&m, r, &["prompt too long"]);
        // 255 tokens leave room for one.
        let r = v1::GenerateRequest {
            token_ids: vec![5; 255],
            ..Default::default()
        };
        assert_eq!(m.validate(&r, || 0).unwrap().sampling.max_tokens, 1);
    }

    /// The derived limit is the context times the longest token; text at the limit is
    /// tokenized (and judged by its tokens), one byte more is refused by its length alone,
    /// with a message naming the limit.
    #[test]
    fn prompt_bytes_limit() {
        let m = model();
        let longest = m.tokenizer.longest_token_bytes();
        assert_eq!(m.max_prompt_bytes, 256 * longest);
        let at_limit = v1::GenerateRequest {
            prompt: "a".repeat(m.max_prompt_bytes),
            ..Default::default()
        };
        let e = m.validate(&at_limit, || 0).unwrap_err();
        assert!(
            matches!(e, ValidationError::Prompt(PromptError::TooLong { .. })),
            "{e}"
        );
        let over = "a".repeat(m.max_prompt_bytes + 1);
        let words = [
            &format!("{} bytes", m.max_prompt_bytes + 1),
            &format!("limit of {} bytes", m.max_prompt_bytes),
            "--max-prompt-bytes",
        ];
        assert_err(
            &m,
            v1::GenerateRequest {
                prompt: over.clone(),
                ..Default::default()
            },
            &words,
        );
        // Messages count their contents together.
        let half = |n: usize| v1::ChatMessage {
            role: "user".into(),
            content: "b".repeat(n),
            ..Default::default()
        };
        let n = m.max_prompt_bytes / 2 + 1;
        let r = v1::GenerateRequest {
            messages: vec![half(n), half(n)],
            ..Default::default()
        };
        let e = m.validate(&r, || 0).unwrap_err();
        assert!(
            matches!(e, ValidationError::PromptTooManyBytes { .. }),
            "{e}"
        );
        let e = m.check_prompt_bytes(&over, &[]).unwrap_err();
        assert!(
            matches!(e, ValidationError::PromptTooManyBytes { .. }),
            "{e}"
        );
        // A short conversation passes.
        assert!(m.check_prompt_bytes("", &[half(1)]).is_ok());
    }

    #[test]
    fn token_ids_outside_vocab() {
        let m = model();
        let r = v1::GenerateRequest {
            token_ids: vec![1, 384],
            ..Default::default()
        };
        assert_err(
            &m,
            r,
            &["token_ids[1] = 384", "outside the vocabulary", "0..384"],
        );
    }

    #[test]
    fn cache_salt_length() {
        let m = model();
        let salted = |n: usize| v1::GenerateRequest {
            cache_salt: "x".repeat(n),
            ..req()
        };
        assert_eq!(
            m.validate(&salted(256), || 0).unwrap().cache_salt.len(),
            256
        );
        assert_err(
            &m,
            salted(257),
            &["cache_salt", "at most 256 bytes", "got 257"],
        );
    }

    #[test]
    fn max_tokens() {
        let m = model();
        let r = v1::GenerateRequest {
            max_tokens: Some(0),
            ..req()
        };
        assert_err(&m, r, &["max_tokens must be at least 1"]);
        let r = v1::GenerateRequest {
            token_ids: vec![5; 200],
            max_tokens: Some(57),
            ..Default::default()
        };
        assert_err(&m, r, &["max_tokens 57 past the context", "at most 56"]);
        let r = v1::GenerateRequest {
            token_ids: vec![5; 200],
            max_tokens: Some(56),
            ..Default::default()
        };
        assert_eq!(m.validate(&r, || 0).unwrap().sampling.max_tokens, 56);
    }

    #[test]
    fn sampling_ranges() {
        let m = model();
        let cases: Vec<(v1::GenerateRequest, &str)> = vec![
            (
                v1::GenerateRequest {
                    temperature: Some(-0.5),
                    ..req()
                },
                "temperature must be >= 0",
            ),
            (
                v1::GenerateRequest {
                    temperature: Some(f32::NAN),
                    ..req()
                },
                "temperature",
            ),
            (
                v1::GenerateRequest {
                    top_p: Some(0.0),
                    ..req()
                },
                "top_p must be in (0, 1]",
            ),
            (
                v1::GenerateRequest {
                    top_p: Some(1.5),
                    ..req()
                },
                "top_p must be in (0, 1]",
            ),
            (
                v1::GenerateRequest {
                    top_p: Some(f32::NAN),
                    ..req()
                },
                "top_p",
            ),
            (
                v1::GenerateRequest { top_k: -1, ..req() },
                "top_k must be >= 0, got -1",
            ),
            (
                v1::GenerateRequest {
                    min_p: Some(1.5),
                    ..req()
                },
                "min_p must be in [0, 1]",
            ),
            (
                v1::GenerateRequest {
                    min_p: Some(-0.1),
                    ..req()
                },
                "min_p",
            ),
            (
                v1::GenerateRequest {
                    repetition_penalty: Some(0.0),
                    ..req()
                },
                "repetition_penalty must be > 0",
            ),
            (
                v1::GenerateRequest {
                    presence_penalty: Some(2.5),
                    ..req()
                },
                "presence_penalty must be in [-2, 2]",
            ),
            (
                v1::GenerateRequest {
                    frequency_penalty: Some(-3.0),
                    ..req()
                },
                "frequency_penalty must be in [-2, 2]",
            ),
            (
                v1::GenerateRequest {
                    logprobs: 21,
                    ..req()
                },
                "logprobs must be at most 20",
            ),
        ];
        for (r, words) in cases {
            let e = m.validate(&r, || 0).unwrap_err();
            assert!(
                matches!(
                    e,
                    ValidationError::Sampling(_) | ValidationError::NegativeTopK(_)
                ),
                "{e:?}"
            );
            assert!(e.to_string().contains(words), "{e} lacks {words:?}");
        }
    }

    #[test]
    fn stop_strings() {
        let m = model();
        let r = v1::GenerateRequest {
            stop: (0..17).map(|i| format!("s{i}")).collect(),
            ..req()
        };
        assert_err(&m, r, &["stop", "at most 16 stop strings", "got 17"]);
        let r = v1::GenerateRequest {
            stop: vec!["x".repeat(257)],
            ..req()
        };
        assert_err(&m, r, &["at most 256 bytes", "got 257"]);
        let r = v1::GenerateRequest {
            stop: vec![String::new()],
            ..req()
        };
        assert_err(&m, r, &["must not be empty"]);
        let r = v1::GenerateRequest {
            stop: (0..16).map(|_| "y".repeat(256)).collect(),
            ..req()
        };
        assert!(m.validate(&r, || 0).is_ok());
    }

    #[test]
    fn stop_token_ids_outside_vocab() {
        let m = model();
        let r = v1::GenerateRequest {
            stop_token_ids: vec![2, 1000],
            ..req()
        };
        assert_err(
            &m,
            r,
            &["stop_token_ids[1] = 1000", "outside the vocabulary"],
        );
    }

    /// A constraint is compiled before anything is queued: a good one travels to the workers,
    /// a bad one, one past --max-constraint-bytes, or one of no kind (which would run
    /// unconstrained) is refused with the reason.
    #[test]
    fn constraints_are_checked_before_queueing() {
        use v1::constraint::Kind;
        let m = model();
        let with = |kind: Kind| v1::GenerateRequest {
            constraint: Some(v1::Constraint { kind: Some(kind) }),
            ..req()
        };
        let schema = r#"{"type":"object","properties":{"a":{"type":"integer"}}}"#;
        let ok = m
            .validate(&with(Kind::JsonSchema(schema.into())), || 1)
            .unwrap();
        assert_eq!(
            ok.sampling.constraint.and_then(|c| c.kind),
            Some(Kind::JsonSchema(schema.into()))
        );
        assert_err(
            &m,
            with(Kind::JsonSchema("{oops".into())),
            &["json_schema", "not JSON"],
        );
        assert_err(
            &m,
            with(Kind::Lark("start: nowhere".into())),
            &["lark", "nowhere"],
        );
        assert_err(
            &m,
            with(Kind::Regex("a".repeat(1025))),
            &["1025 bytes", "--max-constraint-bytes"],
        );
        let none = v1::GenerateRequest {
            constraint: Some(v1::Constraint { kind: None }),
            ..req()
        };
        assert_err(&m, none, &["constraint: no kind set", "json_schema"]);
        // A keyword llguidance does not implement is refused by name.
        assert_err(
            &m,
            with(Kind::JsonSchema(
                r#"{"type":"array","items":{"type":"integer"},"uniqueItems":true}"#.into(),
            )),
            &["json_schema", "uniqueItems"],
        );
    }

    #[test]
    fn unknown_chat_role() {
        let m = model();
        let r = v1::GenerateRequest {
            messages: vec![v1::ChatMessage {
                role: "wizard".into(),
                content: "hi".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let e = m.validate(&r, || 0).unwrap_err();
        assert!(matches!(e, ValidationError::Chat(_)), "{e:?}");
        assert!(
            e.to_string().contains("unknown chat role \"wizard\""),
            "{e}"
        );
    }

    #[test]
    fn chat_template_kwargs_are_refused_when_they_cannot_apply() {
        let m = model();
        let user = vec![v1::ChatMessage {
            role: "user".into(),
            content: "hi".into(),
            ..Default::default()
        }];
        let plain = m
            .validate(
                &v1::GenerateRequest {
                    messages: user.clone(),
                    ..Default::default()
                },
                || 0,
            )
            .unwrap();
        // A variable the template does not read changes nothing.
        let with = m
            .validate(
                &v1::GenerateRequest {
                    messages: user.clone(),
                    chat_template_kwargs: r#"{"enable_thinking": false}"#.into(),
                    ..Default::default()
                },
                || 0,
            )
            .unwrap();
        assert_eq!(with.prompt, plain.prompt);
        for (r, why) in [
            (
                v1::GenerateRequest {
                    messages: user.clone(),
                    chat_template_kwargs: "[true]".into(),
                    ..Default::default()
                },
                "chat_template_kwargs: must be a JSON object",
            ),
            (
                v1::GenerateRequest {
                    messages: user.clone(),
                    chat_template_kwargs: r#"{"bos_token": "x"}"#.into(),
                    ..Default::default()
                },
                "chat_template_kwargs: `bos_token` is set by the server",
            ),
            (
                v1::GenerateRequest {
                    prompt: "hi".into(),
                    chat_template_kwargs: "{}".into(),
                    ..Default::default()
                },
                "chat_template_kwargs: given without messages",
            ),
        ] {
            let e = m.validate(&r, || 0).unwrap_err();
            assert!(
                matches!(e, ValidationError::TemplateVariables(_))
                    && e.to_string().starts_with(why),
                "{e}"
            );
        }
    }
}
