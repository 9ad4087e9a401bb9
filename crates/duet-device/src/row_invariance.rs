//! Whether a backend computes a position's logits as the same bits however a step holds it:
//! decoded alone, one token per step, or as one row of a sequence verifying a draft (several of
//! its positions in one step) beside other sequences' prompt chunks and decodes. Speculative
//! decoding keeps outputs exactly those of one token per step only where it does
//! (`Backend::batch_invariant`); `duet bench gpu` reports it for the CUDA backend, and the CPU
//! backend's claim is tested here.

use duet_engine::EngineError;
use duet_engine::backend::{Backend, KvDtypeChoice};
use duet_engine::batch::{ForwardBatch, LogitsWanted, SeqInput};
use duet_engine::llama::{Llama, Logits};

/// How the positions of a verified draft compare with the same positions decoded alone.
#[derive(Clone, Debug, PartialEq)]
pub struct RowInvariance {
    /// Positions compared.
    pub rows: usize,
    /// Positions whose logits differ in any bit.
    pub differing_rows: usize,
    /// The largest difference of one logit.
    pub max_abs_diff: f32,
}

impl RowInvariance {
    pub fn holds(&self) -> bool {
        self.differing_rows == 0
    }
}

const BLOCK_SIZE: usize = 16;
/// Tokens of context before the compared positions; enough for several KV blocks.
const CONTEXT: usize = 40;
/// Positions compared: a draft of four tokens and the token before it.
const VERIFIED: usize = 5;

/// Compares, on `model`'s backend, the logits of `VERIFIED` positions decoded one per step with
/// those of the same positions computed in one step as a verified draft, beside a 30-token
/// prompt chunk and another sequence's decode.
pub fn row_invariance<B: Backend>(model: &Llama<B>) -> Result<RowInvariance, EngineError> {
    let config = model.config();
    let vocab = config.vocab_size as u32;
    let tokens = |n: usize, seed: u32| -> Vec<u32> {
        (0..n as u32)
            .map(|i| (i.wrapping_mul(7919) ^ seed) % vocab)
            .collect()
    };
    let (drafted, prompt, decoding) = (tokens(CONTEXT + VERIFIED, 1), tokens(30, 2), tokens(20, 3));
    let blocks_per_seq = (CONTEXT + VERIFIED).div_ceil(BLOCK_SIZE);
    let num_blocks = 4 * blocks_per_seq;
    let table = |seq: usize| -> Vec<u32> {
        (seq * blocks_per_seq..(seq + 1) * blocks_per_seq)
            .map(|b| b as u32)
            .collect()
    };
    let dtype = model.backend().kv_dtype(KvDtypeChoice::Auto, false)?;
    let mut kv = model
        .backend()
        .alloc_kv(model.kv_layout(BLOCK_SIZE, num_blocks, dtype))?;
    let mut forward = |inputs: &[SeqInput<'_>]| -> Result<Logits, EngineError> {
        let batch = ForwardBatch::new(
            inputs,
            BLOCK_SIZE,
            num_blocks,
            config.vocab_size,
            config.max_position_embeddings,
        )?;
        model.forward(&batch, &mut kv, &mut |_, _| {})
    };
    let (alone_table, verified_table, prompt_table, decoding_table) =
        (table(0), table(1), table(2), table(3));
    // Alone: the context, then one position per step.
    forward(&[SeqInput::span(
        &drafted,
        0,
        CONTEXT,
        &alone_table,
        LogitsWanted::None,
    )])?;
    let mut alone = Vec::new();
    for p in CONTEXT..CONTEXT + VERIFIED {
        let l = forward(&[SeqInput::span(
            &drafted,
            p,
            p + 1,
            &alone_table,
            LogitsWanted::Last,
        )])?;
        alone.push(l.row(0).to_vec());
    }
    // Verified: the context, then every position in one step between a prompt chunk and a
    // decode.
    forward(&[
        SeqInput::span(&drafted, 0, CONTEXT, &verified_table, LogitsWanted::None),
        SeqInput::span(&decoding, 0, 19, &decoding_table, LogitsWanted::None),
    ])?;
    let verified = forward(&[
        SeqInput::span(&prompt, 0, 30, &prompt_table, LogitsWanted::None),
        SeqInput::span(
            &drafted,
            CONTEXT,
            CONTEXT + VERIFIED,
            &verified_table,
            LogitsWanted::All,
        ),
        SeqInput::span(&decoding, 19, 20, &decoding_table, LogitsWanted::Last),
    ])?;
    let mut result = RowInvariance {
        rows: VERIFIED,
        differing_rows: 0,
        max_abs_diff: 0.0,
    };
    for (i, row) in alone.iter().enumerate() {
        let bits_equal = row
            .iter()
            .zip(verified.row(i))
            .all(|(a, b)| a.to_bits() == b.to_bits());
        result.differing_rows += usize::from(!bits_equal);
        for (a, b) in row.iter().zip(verified.row(i)) {
            result.max_abs_diff = result.max_abs_diff.max((a - b).abs());
        }
    }
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;
    use duet_cpu::CpuBackend;
    use duet_model::model_files::open_model;

    /// The CPU backend's claim (`batch_invariant`) holds on the tiny fixture, at one kernel
    /// thread and at two.
    #[test]
    fn the_cpu_backend_computes_a_verified_draft_as_it_decodes_alone() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/tiny-llama");
        let files = open_model(&path).unwrap();
        for threads in [1, 2] {
            let model = Llama::load(CpuBackend::new(threads), &files).unwrap();
            assert!(model.backend().batch_invariant());
            let r = row_invariance(&model).unwrap();
            assert_eq!(r.rows, VERIFIED);
            assert!(r.holds(), "{threads} threads: {r:?}");
            assert_eq!(r.max_abs_diff, 0.0);
        }
    }
}
