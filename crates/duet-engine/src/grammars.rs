//! The model's grammar compiler for structured outputs, built on first use and shared by every
//! thread: a worker compiles each request's constraint on its own threads before the request
//! reaches the engine thread, so a slow compile never stalls the running batch; the engine
//! compiles itself only for callers that hand it none (`duet generate`, the benches).

use std::sync::{Arc, OnceLock};

use duet_model::grammar::{Grammar, GrammarCompiler, GrammarError};
use duet_model::params::Constraint;
use duet_model::tokenizer::Tokenizer;

/// Cheap to clone; every clone shares one compiler.
#[derive(Clone)]
pub struct Grammars {
    tokenizer: Tokenizer,
    vocab_size: usize,
    /// Built by the first compile (a token trie over the vocabulary), or why it cannot be.
    compiler: Arc<OnceLock<Result<GrammarCompiler, GrammarError>>>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("vocab_size", &self.vocab_size)
            .field("built", &self.compiler.get().is_some())
            .finish()
    }
}

impl Grammars {
    /// For a model of `vocab_size` logits whose text comes from `tokenizer`.
    pub fn new(tokenizer: Tokenizer, vocab_size: usize) -> Self {
        Self {
            tokenizer,
            vocab_size,
            compiler: Arc::default(),
        }
    }

    /// A fresh grammar state for `constraint` (see [`GrammarCompiler::compile`]).
    pub fn compile(&self, constraint: &Constraint) -> Result<Grammar, GrammarError> {
        let compiler = self
            .compiler
            .get_or_init(|| GrammarCompiler::new(&self.tokenizer, self.vocab_size));
        match compiler {
            Ok(compiler) => compiler.compile(constraint),
            Err(e) => Err(GrammarError {
                kind: e.kind,
                reason: e.reason.clone(),
            }),
        }
    }
}
