//! The engine's error type: one variant per concern, each message saying what was wrong.

use duet_model::chat::ChatError;
use duet_model::model_files::LoadError;
use duet_model::model_path::ModelNotFound;
use duet_model::params::InvalidParams;
use duet_model::tokenizer::TokenizerError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Chat(#[from] ChatError),
    #[error(transparent)]
    Kv(#[from] duet_kv::KvError),
    /// A prompt the model cannot take.
    #[error("invalid request: {0}")]
    Prompt(#[from] duet_model::params::PromptError),
    /// A request the caller can fix (empty prompt, parameter out of range, ...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A forward step that does not fit the cache or the model (a scheduler bug).
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    #[error("bad weights: {0}")]
    Weights(String),
    #[error("bad engine configuration: {0}")]
    Config(String),
    #[error(transparent)]
    ModelNotFound(#[from] ModelNotFound),
    /// The device is missing, misconfigured or failed (CUDA library not found, kernel fault, ...).
    #[error("device: {0}")]
    Device(String),
    #[error("no sequence {0} in this engine")]
    UnknownSequence(u64),
}

/// A constraint the request cannot use is the caller's to fix.
impl From<duet_model::grammar::GrammarError> for EngineError {
    fn from(e: duet_model::grammar::GrammarError) -> Self {
        EngineError::InvalidRequest(e.to_string())
    }
}

impl From<InvalidParams> for EngineError {
    fn from(e: InvalidParams) -> Self {
        EngineError::InvalidRequest(e.0)
    }
}
