//! One forward step's worth of work: several sequences, each bringing any number of new tokens.
//!
//! The step is flattened into rows (one per new token) so that every weight matrix is read once
//! per step whatever the mix of prompts, prompt chunks and decode tokens; attention then walks
//! each row's own sequence through its block table.

use crate::EngineError;

/// What a sequence contributes to a step.
#[derive(Clone, Debug)]
pub struct SeqInput<'a> {
    /// Tokens whose KV is not yet in the cache, starting at position `start_pos`.
    pub tokens: &'a [u32],
    /// Number of tokens of this sequence already in the cache.
    pub start_pos: usize,
    /// Blocks holding positions `0..start_pos + tokens.len()`.
    pub block_table: &'a [u32],
    /// Which rows need logits.
    pub logits: LogitsWanted,
}

impl<'a> SeqInput<'a> {
    /// Positions `from..to` of a sequence of `tokens`, those before `from` already cached.
    pub fn span(
        tokens: &'a [u32],
        from: usize,
        to: usize,
        block_table: &'a [u32],
        logits: LogitsWanted,
    ) -> Self {
        Self {
            tokens: &tokens[from..to],
            start_pos: from,
            block_table,
            logits,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    /// None (a prompt chunk that is not the last one).
    None,
    /// The last new token only (sampling the next token).
    Last,
    /// Every new token (scoring a prompt).
    All,
}

/// A sequence's rows inside the flattened step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqSpan {
    /// First row of this sequence in the step.
    pub row_start: usize,
    /// Number of new tokens (rows).
    pub len: usize,
    /// Position of the first new token.
    pub start_pos: usize,
    /// Blocks of the sequence, in order.
    pub block_table: Vec<u32>,
}

impl SeqSpan {
    /// Number of cached positions the last row attends to.
    pub fn context_len(&self) -> usize {
        self.start_pos + self.len
    }
}

/// The flattened step handed to a backend.
#[derive(Clone, Debug)]
pub struct ForwardBatch {
    pub tokens: Vec<u32>,
    /// Position of each row within its sequence.
    pub positions: Vec<u32>,
    /// Cache slot (`block * block_size + offset`) where each row's K and V are written.
    pub slots: Vec<u32>,
    /// The sequence each row belongs to (index into `seqs`).
    pub row_seq: Vec<u32>,
    pub seqs: Vec<SeqSpan>,
    /// Rows whose logits are returned, in order.
    pub logit_rows: Vec<usize>,
    pub block_size: usize,
}

impl ForwardBatch {
    /// Flattens and validates `inputs` against the cache geometry and the model's vocabulary and
    /// context.
    pub fn new(
        inputs: &[SeqInput<'_>],
        block_size: usize,
        num_blocks: usize,
        vocab_size: usize,
        max_positions: usize,
    ) -> Result<Self, EngineError> {
        let total: usize = inputs.iter().map(|s| s.tokens.len()).sum();
        let mut b = ForwardBatch {
            tokens: Vec::with_capacity(total),
            positions: Vec::with_capacity(total),
            slots: Vec::with_capacity(total),
            row_seq: Vec::with_capacity(total),
            seqs: Vec::with_capacity(inputs.len()),
            logit_rows: Vec::new(),
            block_size,
        };
        for (i, s) in inputs.iter().enumerate() {
            if s.tokens.is_empty() {
                return Err(EngineError::InvalidBatch(format!(
                    "sequence {i} brings no tokens"
                )));
            }
            let end = s.start_pos + s.tokens.len();
            if end > max_positions {
                return Err(EngineError::InvalidBatch(format!(
                    "sequence {i} reaches position {end}, past the model's context of {max_positions}"
                )));
            }
            if s.block_table.len() * block_size < end {
                return Err(EngineError::InvalidBatch(format!(
                    "sequence {i} needs {} blocks for {end} positions but its block table has {}",
                    end.div_ceil(block_size),
                    s.block_table.len()
                )));
            }
            if let Some(&bad) = s
                .block_table
                .iter()
                .find(|&&blk| blk as usize >= num_blocks)
            {
                return Err(EngineError::InvalidBatch(format!(
                    "sequence {i} refers to block {bad} of a {num_blocks}-block cache"
                )));
            }
            if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= vocab_size) {
                return Err(EngineError::InvalidBatch(format!(
                    "token id {bad} is outside the vocabulary of {vocab_size}"
                )));
            }
            let row_start = b.tokens.len();
            for (j, &t) in s.tokens.iter().enumerate() {
                let pos = s.start_pos + j;
                b.tokens.push(t);
                b.positions.push(pos as u32);
                b.slots.push(
                    s.block_table[pos / block_size] * block_size as u32 + (pos % block_size) as u32,
                );
                b.row_seq.push(i as u32);
            }
            match s.logits {
                LogitsWanted::None => {}
                LogitsWanted::Last => b.logit_rows.push(b.tokens.len() - 1),
                LogitsWanted::All => b.logit_rows.extend(row_start..b.tokens.len()),
            }
            b.seqs.push(SeqSpan {
                row_start,
                len: s.tokens.len(),
                start_pos: s.start_pos,
                block_table: s.block_table[..end.div_ceil(block_size)].to_vec(),
            });
        }
        Ok(b)
    }

    pub fn num_rows(&self) -> usize {
        self.tokens.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flattens_rows_slots_and_logit_rows() {
        let inputs = [
            SeqInput {
                tokens: &[5, 6, 7],
                start_pos: 0,
                block_table: &[3, 1],
                logits: LogitsWanted::Last,
            },
            SeqInput {
                tokens: &[9],
                start_pos: 4,
                block_table: &[0, 2],
                logits: LogitsWanted::All,
            },
        ];
        let b = ForwardBatch::new(&inputs, 4, 8, 10, 100).unwrap();
        assert_eq!(b.positions, vec![0, 1, 2, 4]);
        assert_eq!(b.slots, vec![12, 13, 14, 8]);
        assert_eq!(b.row_seq, vec![0, 0, 0, 1]);
        assert_eq!(b.logit_rows, vec![2, 3]);
        assert_eq!(b.seqs[1].context_len(), 5);
    }

    #[test]
    fn rejects_bad_steps() {
        let bad_table = [SeqInput {
            tokens: &[1; 5],
            start_pos: 0,
            block_table: &[0],
            logits: LogitsWanted::Last,
        }];
        assert!(ForwardBatch::new(&bad_table, 4, 8, 10, 100).is_err());
        let bad_token = [SeqInput {
            tokens: &[10],
            start_pos: 0,
            block_table: &[0],
            logits: LogitsWanted::Last,
        }];
        let e = ForwardBatch::new(&bad_token, 4, 8, 10, 100)
            .unwrap_err()
            .to_string();
        assert!(e.contains("outside the vocabulary"), "{e}");
        let too_long = [SeqInput {
            tokens: &[1; 3],
            start_pos: 0,
            block_table: &[0],
            logits: LogitsWanted::Last,
        }];
        assert!(ForwardBatch::new(&too_long, 4, 8, 10, 2).is_err());
        let bad_block = [SeqInput {
            tokens: &[1],
            start_pos: 0,
            block_table: &[8],
            logits: LogitsWanted::Last,
        }];
        assert!(ForwardBatch::new(&bad_block, 4, 8, 10, 100).is_err());
    }
}
