//! What a request asks of generation, and what sampling gives back: the sampling parameters and
//! stop criteria (with the range checks the router and the workers share), a sampled token with
//! its log-probabilities, and why a sequence ended. Plain data: the router validates requests
//! with these without linking the engine.

/// A request parameter out of range; the message names the field and the allowed range.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidParams(pub String);

/// What a model can take: the one place a prompt is checked against the model, by the router,
/// the engine and both workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptLimits {
    /// Positions in the context: the prompt plus every generated token.
    pub context_length: usize,
    pub vocab_size: usize,
}

/// A prompt the model cannot take.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PromptError {
    #[error("the prompt is empty")]
    Empty,
    #[error("token_ids[{index}] = {id} is outside the vocabulary (valid ids are 0..{vocab_size})")]
    TokenOutOfVocab {
        index: usize,
        id: u32,
        vocab_size: usize,
    },
    #[error(
        "prompt too long: {len} tokens, but the context holds {context} (the prompt plus at \
         least one generated token must fit)"
    )]
    TooLong { len: usize, context: usize },
    #[error(
        "max_tokens {max_tokens} past the context: the prompt has {prompt} tokens and the \
         context holds {context}, so max_tokens can be at most {room}"
    )]
    PastContext {
        max_tokens: usize,
        prompt: usize,
        context: usize,
        room: usize,
    },
}

impl PromptLimits {
    /// A prompt of known tokens, short enough to leave room for one generated token.
    pub fn check(&self, prompt: &[u32]) -> Result<(), PromptError> {
        if prompt.is_empty() {
            return Err(PromptError::Empty);
        }
        if let Some((index, &id)) = prompt
            .iter()
            .enumerate()
            .find(|&(_, &id)| id as usize >= self.vocab_size)
        {
            return Err(PromptError::TokenOutOfVocab {
                index,
                id,
                vocab_size: self.vocab_size,
            });
        }
        self.check_length(prompt.len())
    }

    /// A prompt length that leaves room for one generated token.
    pub fn check_length(&self, len: usize) -> Result<(), PromptError> {
        if len >= self.context_length {
            return Err(PromptError::TooLong {
                len,
                context: self.context_length,
            });
        }
        Ok(())
    }

    /// Tokens that may be generated after a prompt of `prompt` tokens (which
    /// [`check_length`](Self::check_length) passed).
    pub fn room(&self, prompt: usize) -> usize {
        self.context_length.saturating_sub(prompt)
    }

    /// `max_tokens` generated after a prompt of `prompt` tokens fit the context.
    pub fn check_max_tokens(&self, prompt: usize, max_tokens: usize) -> Result<(), PromptError> {
        let room = self.room(prompt);
        if max_tokens > room {
            return Err(PromptError::PastContext {
                max_tokens,
                prompt,
                context: self.context_length,
                room,
            });
        }
        Ok(())
    }
}

/// How to pick each next token.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables.
    pub top_k: u32,
    /// Keep the smallest set of tokens whose probability reaches `top_p`; 1 disables.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p ×` the most likely one; 0 disables.
    pub min_p: f32,
    /// Divides positive (multiplies negative) logits of tokens already seen; 1 disables.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token generated so far.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated.
    pub frequency_penalty: f32,
    /// Same seed, same tokens. `None` draws a seed.
    pub seed: Option<u64>,
    /// Number of most likely alternatives to report with each token (0: none).
    pub logprobs: u32,
    /// What the generated text must conform to (structured outputs); `None`: anything.
    pub constraint: Option<Constraint>,
    /// Whether the worker's speculative decoding may draft for this request (it never changes
    /// the output, only how many tokens a step yields); `false` opts out.
    pub speculative: bool,
}

/// A grammar the generated text must follow: every token is drawn from those that keep the text
/// a prefix of a sentence of the grammar, and the generation ends when the grammar is complete.
#[derive(Clone, Debug, PartialEq)]
pub enum Constraint {
    /// A JSON Schema, as JSON text.
    JsonSchema(String),
    /// Any JSON object.
    JsonObject,
    /// A regular expression the whole text matches.
    Regex(String),
    /// A Lark grammar (llguidance's dialect, starting at the `start` rule).
    Lark(String),
}

impl Constraint {
    /// The kind, as the APIs name it.
    pub fn kind(&self) -> &'static str {
        match self {
            Constraint::JsonSchema(_) => "json_schema",
            Constraint::JsonObject => "json_object",
            Constraint::Regex(_) => "regex",
            Constraint::Lark(_) => "lark",
        }
    }

    /// Bytes of its text (what the size limit counts).
    pub fn text_bytes(&self) -> usize {
        match self {
            Constraint::JsonSchema(t) | Constraint::Regex(t) | Constraint::Lark(t) => t.len(),
            Constraint::JsonObject => 0,
        }
    }
}

/// The longest constraint the router and the workers take by default, in bytes
/// (`--max-constraint-bytes`).
pub const DEFAULT_MAX_CONSTRAINT_BYTES: usize = 64 * 1024;

/// Longest `cache_salt` a request may carry, in bytes.
pub const MAX_CACHE_SALT_BYTES: usize = 256;

/// Most alternatives a caller may ask log-probabilities for.
pub const MAX_LOGPROBS: u32 = 20;

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logprobs: 0,
            constraint: None,
            speculative: true,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Checks every field's range; the error names the field and the allowed range.
    pub fn validate(&self) -> Result<(), InvalidParams> {
        let bad = |msg: String| Err(InvalidParams(msg));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return bad(format!(
                "repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            ));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        if self.logprobs > MAX_LOGPROBS {
            return bad(format!(
                "logprobs must be at most {MAX_LOGPROBS}, got {}",
                self.logprobs
            ));
        }
        Ok(())
    }
}

/// One sampled token.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// Present when the parameters asked for log-probabilities.
    pub logprobs: Option<Logprobs>,
}

/// Log-probabilities at one position (after penalties, before temperature and truncation).
#[derive(Clone, Debug, PartialEq)]
pub struct Logprobs {
    /// Of the sampled token.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// An end-of-sequence token, a stop token id or a stop string.
    Stop,
    /// `max_tokens` generated, or the context is full.
    Length,
    /// The generation failed part way (a grammar that could not go on); the output says why.
    Error,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Error => "error",
        }
    }
}

/// Most stop strings a request may carry, and their longest length in bytes.
pub const MAX_STOP_STRINGS: usize = 16;
pub const MAX_STOP_STRING_BYTES: usize = 256;

/// When to stop generating.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StopCriteria {
    pub max_tokens: usize,
    /// Extra token ids that end the sequence (the model's end-of-sequence ids are added unless
    /// `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    pub stop_strings: Vec<String>,
    pub ignore_eos: bool,
}

impl StopCriteria {
    pub fn validate(&self) -> Result<(), InvalidParams> {
        let bad = |m: String| Err(InvalidParams(m));
        if self.max_tokens == 0 {
            return bad("max_tokens must be at least 1".into());
        }
        if self.stop_strings.len() > MAX_STOP_STRINGS {
            return bad(format!(
                "at most {MAX_STOP_STRINGS} stop strings are allowed, got {}",
                self.stop_strings.len()
            ));
        }
        for s in &self.stop_strings {
            if s.is_empty() {
                return bad("stop strings must not be empty".into());
            }
            if s.len() > MAX_STOP_STRING_BYTES {
                return bad(format!(
                    "stop strings must be at most {MAX_STOP_STRING_BYTES} bytes, got {}",
                    s.len()
                ));
            }
        }
        Ok(())
    }
}
