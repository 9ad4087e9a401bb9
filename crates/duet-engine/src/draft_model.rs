//! Speculative decoding's draft model: a smaller model of the target's tokenizer, loaded beside
//! it, proposes each draft as its greedy continuation of the sequence.
//!
//! The draft model has its own paged KV store and blocks (its layers and heads are not the
//! target's) and remembers, per sequence, the tokens its cache holds. Before drafting, a
//! sequence's cache catches up on the tokens it has not seen: the whole prompt the first time (a
//! decode worker received the target's KV of it, not the draft's), afterwards the tokens decided
//! since its last draft. Rolling back a rejected draft costs nothing: the tokens held are cut to
//! where they still match the sequence, and later writes overwrite the slots.
//!
//! A greedy draft is deterministic, so the engine verifies it with the rule it uses for n-gram
//! drafts (`engine::verify`): output is exactly that of decoding one token per step, greedy or
//! sampled.

use crate::EngineError;
use crate::backend::Backend;
use crate::engine::EngineOptions;
use crate::model_runner::ModelRunner;
use crate::sampling::argmax;
use crate::scheduler::PlannedSeq;
use duet_kv::{BlockId, BlockPool, KvError, SeqId};
use duet_model::model_files::ModelFiles;
use duet_model::tokenizer::Tokenizer;
use std::collections::HashMap;

pub struct DraftModel<B: Backend> {
    runner: ModelRunner<B>,
    blocks: BlockPool,
    caches: HashMap<SeqId, DraftCache>,
    /// Most tokens of catch-up one step computes (the engine's step budget).
    max_step_tokens: usize,
}

/// One sequence's part of the draft model's KV store.
#[derive(Default)]
struct DraftCache {
    block_table: Vec<BlockId>,
    /// The tokens whose K/V the cache holds, from position 0.
    tokens: Vec<u32>,
}

impl<B: Backend> DraftModel<B> {
    /// Loads the draft model of `files` on `backend`, with a KV store as large as the target's
    /// (`options`). Its vocabulary must be the target's (`target`): the same tokenizer, token for
    /// token, and no more logits (padding rows included: a draft with more could propose ids the
    /// target lacks). Fewer padding rows are fine: Qwen2.5-0.5B (151,936 logits) drafts for
    /// Qwen2.5-7B (152,064) with the same tokenizer.
    pub fn load(
        backend: B,
        files: &ModelFiles,
        target: &ModelFiles,
        options: &EngineOptions,
    ) -> Result<Self, EngineError> {
        let (logits, target_logits) = (files.config.vocab_size, target.config.vocab_size);
        if logits > target_logits {
            return Err(EngineError::Config(format!(
                "the draft model's config has vocab_size {logits}, the target's {target_logits}; a draft model must share the target's tokenizer and have no more logits (padding rows included) than the target, which could not score the ids past its own"
            )));
        }
        if let Some(difference) = vocabulary_difference(&target.tokenizer, &files.tokenizer) {
            return Err(EngineError::Config(format!(
                "the draft model's tokenizer is not the target's ({difference}); a draft model must share the target's vocabulary"
            )));
        }
        let runner = ModelRunner::load(backend, files, options)?;
        let layout = runner.kv_layout();
        Ok(Self {
            runner,
            blocks: BlockPool::new(layout.num_blocks, layout.block_size),
            caches: HashMap::new(),
            max_step_tokens: options.step_tokens(),
        })
    }

    /// Up to `max_len` tokens the draft model predicts after `tokens`, each its most likely next
    /// token; fewer where its context ends, none when its cache has no room for them or is still
    /// catching up on a long prompt.
    pub fn propose(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        max_len: usize,
    ) -> Result<Vec<u32>, EngineError> {
        let max_positions = self.runner.model().config().max_position_embeddings;
        // The last drafted token is only proposed, never computed.
        let max_len = max_len.min((max_positions + 1).saturating_sub(tokens.len()));
        if max_len == 0 || tokens.is_empty() {
            return Ok(Vec::new());
        }
        let cache = self.caches.entry(seq).or_default();
        // What still matches the sequence stays; its last token is always computed again, as its
        // logits start the draft.
        let held = cache
            .tokens
            .iter()
            .zip(tokens)
            .take_while(|(held, token)| held == token)
            .count()
            .min(tokens.len() - 1);
        cache.tokens.truncate(held);
        // A long catch-up (a prompt the draft model has not seen) is spread over steps, a step
        // budget's worth each, as the target prefills: it never stalls the other sequences' step
        // for long. The sequence drafts once caught up.
        let catching_up = tokens.len() - held > self.max_step_tokens;
        let (computed, slots) = match catching_up {
            true => (held + self.max_step_tokens, held + self.max_step_tokens),
            false => (tokens.len(), tokens.len() + max_len - 1),
        };
        let missing = slots
            .div_ceil(self.blocks.block_size())
            .saturating_sub(cache.block_table.len());
        if missing > 0 {
            match self.blocks.allocate(missing) {
                Ok(blocks) => cache.block_table.extend(blocks),
                Err(KvError::Exhausted { .. }) => return Ok(Vec::new()),
                Err(e) => return Err(e.into()),
            }
        }
        cache.tokens.extend_from_slice(&tokens[held..computed]);
        let mut token = self.forward(seq, held)?;
        if catching_up {
            return Ok(Vec::new());
        }
        let mut draft = vec![token];
        while draft.len() < max_len {
            let cache = self.caches.get_mut(&seq).expect("the sequence's cache");
            let start = cache.tokens.len();
            cache.tokens.push(token);
            token = self.forward(seq, start)?;
            draft.push(token);
        }
        Ok(draft)
    }

    /// Computes the tokens `seq`'s cache holds from position `start` on, and returns the draft
    /// model's most likely token after the last of them.
    fn forward(&mut self, seq: SeqId, start: usize) -> Result<u32, EngineError> {
        let cache = &self.caches[&seq];
        let plan = [PlannedSeq {
            seq,
            start_pos: start,
            len: cache.tokens.len() - start,
            draft: Vec::new(),
            block_table: cache.block_table.clone(),
        }];
        let logits = self.runner.forward(&plan, |_| &cache.tokens, &mut |_| {})?;
        let token = argmax(logits.row(0));
        drop(logits);
        self.runner.end_step(&plan);
        Ok(token)
    }

    /// Gives a finished or removed sequence's blocks back.
    pub fn release(&mut self, seq: SeqId) -> Result<(), EngineError> {
        if let Some(cache) = self.caches.remove(&seq) {
            self.blocks.release(&cache.block_table)?;
        }
        Ok(())
    }

    /// Blocks of the draft model's KV store not held by any sequence.
    pub fn available_blocks(&self) -> usize {
        self.blocks.available()
    }
}

/// Where two tokenizers' vocabularies first differ, `None` when they are the same.
fn vocabulary_difference(target: &Tokenizer, draft: &Tokenizer) -> Option<String> {
    if target.vocab_size() != draft.vocab_size() {
        return Some(format!(
            "{} tokens against the target's {}",
            draft.vocab_size(),
            target.vocab_size()
        ));
    }
    (0..target.vocab_size() as u32)
        .find(|&id| target.id_to_token(id) != draft.id_to_token(id))
        .map(|id| {
            format!(
                "token {id} is {:?}, the target's {:?}",
                draft.id_to_token(id).unwrap_or_default(),
                target.id_to_token(id).unwrap_or_default()
            )
        })
}
