//! The mixed-load measurement of `duet bench gpu`: the time per output token (TPOT) of running
//! decodes while a long prompt is prefilled beside them in chunks, against their TPOT alone, at a
//! step token budget (`--max-step-tokens`). The engine's own scheduler plans every step and the
//! model runner runs it, so the chunks are the ones serving would run: each step carries every
//! decoding sequence's token and as much of the prompt as the budget leaves.

use duet_engine::EngineError;
use duet_engine::backend::Backend;
use duet_engine::model_runner::ModelRunner;
use duet_engine::scheduler::{PlannedSeq, Scheduler};
use duet_kv::{KvCacheManager, SeqId};
use serde::Serialize;
use std::time::Instant;

/// What runs beside what.
#[derive(Clone, Debug)]
pub struct MixedLoadShape {
    /// Sequences decoding throughout.
    pub decodes: usize,
    /// Tokens of context each decoding sequence has before the timed steps.
    pub decode_context: usize,
    /// The prompt prefilled beside them.
    pub prompt_tokens: usize,
    /// Decode-only steps timed before the prompt arrives.
    pub alone_steps: usize,
}

impl MixedLoadShape {
    /// KV blocks of `block_size` tokens a run at `step_tokens` a step needs: every decoding
    /// sequence grows by a token a step, over the steps alone and the prompt's chunk steps.
    pub fn blocks_needed(&self, block_size: usize, step_tokens: usize) -> usize {
        let chunk_steps = self
            .prompt_tokens
            .div_ceil(step_tokens.saturating_sub(self.decodes).max(1));
        let decode_tokens = self.decode_context + self.alone_steps + chunk_steps + 1;
        self.decodes * decode_tokens.div_ceil(block_size) + self.prompt_tokens.div_ceil(block_size)
    }
}

/// One run at one step token budget.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MixedLoad {
    pub step_tokens: usize,
    /// Mean step time of the decodes alone.
    pub tpot_alone_ms: f64,
    /// Mean step time of the steps that carried a chunk of the prompt: the decodes' TPOT then.
    pub tpot_mixed_ms: f64,
    /// The slowest of those steps.
    pub worst_step_ms: f64,
    /// Steps the prompt took, and their total time (its prefill time under this load).
    pub chunk_steps: usize,
    pub prefill_ms: f64,
}

impl MixedLoad {
    /// TPOT while the prompt prefills over TPOT alone.
    pub fn slowdown(&self) -> f64 {
        self.tpot_mixed_ms / self.tpot_alone_ms
    }
}

/// Runs `shape` on `runner` at a budget of `step_tokens` tokens a step. The runner's KV store must
/// hold [`MixedLoadShape::blocks_needed`] blocks (a smaller budget needs more); what it held
/// before is overwritten.
pub fn mixed_load<B: Backend>(
    runner: &mut ModelRunner<B>,
    shape: &MixedLoadShape,
    step_tokens: usize,
) -> Result<MixedLoad, EngineError> {
    let layout = runner.kv_layout();
    let vocab = runner.model().config().vocab_size as u32;
    // Distinct tokens per sequence, so no prefix is shared through the cache.
    let tokens = |n: usize, seed: u32| -> Vec<u32> {
        (0..n as u32)
            .map(|i| (i.wrapping_mul(7919) ^ seed.wrapping_mul(104_729)) % vocab)
            .collect()
    };
    if shape.decodes >= step_tokens {
        return Err(EngineError::Config(format!(
            "a step budget of {step_tokens} tokens leaves no room for a prompt beside {} decodes",
            shape.decodes
        )));
    }
    let needed = shape.blocks_needed(layout.block_size, step_tokens);
    if layout.num_blocks < needed {
        return Err(EngineError::Config(format!(
            "the mixed-load run needs {needed} KV blocks, the store has {}",
            layout.num_blocks
        )));
    }
    let cache = KvCacheManager::new(layout.num_blocks, layout.block_size, "mixed-load");
    let mut scheduler = Scheduler::new(cache, step_tokens, 0, vocab as usize);
    let decodes: Vec<SeqId> = (0..shape.decodes as SeqId).collect();
    for &id in &decodes {
        scheduler.add_sequence(id, tokens(shape.decode_context, id as u32 + 1), "")?;
    }
    // The decodes' contexts, untimed, until every one of them has its first token.
    let mut decoding = std::collections::HashSet::new();
    while decoding.len() < decodes.len() {
        decoding.extend(step(runner, &mut scheduler)?);
    }
    device_sync(runner)?;
    let mut alone = Vec::with_capacity(shape.alone_steps);
    for _ in 0..shape.alone_steps {
        let start = Instant::now();
        step(runner, &mut scheduler)?;
        device_sync(runner)?;
        alone.push(start.elapsed().as_secs_f64() * 1e3);
    }
    let prompt = shape.decodes as SeqId;
    scheduler.add_sequence(prompt, tokens(shape.prompt_tokens, 0), "")?;
    let mut mixed = Vec::new();
    loop {
        let start = Instant::now();
        let completed = step(runner, &mut scheduler)?;
        device_sync(runner)?;
        mixed.push(start.elapsed().as_secs_f64() * 1e3);
        if completed.contains(&prompt) {
            break;
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    Ok(MixedLoad {
        step_tokens,
        tpot_alone_ms: mean(&alone),
        tpot_mixed_ms: mean(&mixed),
        worst_step_ms: mixed.iter().cloned().fold(0.0, f64::max),
        chunk_steps: mixed.len(),
        prefill_ms: mixed.iter().sum(),
    })
}

/// One engine step without sampling: the scheduler's plan through the runner, then a fixed next
/// token for each sequence whose tokens are all computed. Returns those sequences.
fn step<B: Backend>(
    runner: &mut ModelRunner<B>,
    scheduler: &mut Scheduler,
) -> Result<Vec<SeqId>, EngineError> {
    let plan: Vec<PlannedSeq> = scheduler.plan_step(&mut |_, _| Vec::new())?;
    // The logits reach the host as serving's would, and go unsampled.
    drop(runner.forward(
        &plan,
        |id| scheduler.tokens(id).expect("a planned sequence is tracked"),
        &mut |_| {},
    )?);
    runner.end_step(&plan);
    let mut completed = Vec::new();
    for p in &plan {
        if scheduler.record_computed(p)? {
            scheduler.append_token(p.seq, 1)?;
            completed.push(p.seq);
        }
    }
    Ok(completed)
}

/// Waits for the device, so that a step's wall time is its whole time.
fn device_sync<B: Backend>(runner: &ModelRunner<B>) -> Result<(), EngineError> {
    runner.model().backend().sync()
}

#[cfg(test)]
mod tests {
    use super::*;
    use duet_cpu::CpuBackend;
    use duet_engine::backend::KvDtypeChoice;
    use duet_engine::llama::Llama;
    use duet_model::model_files::open_model;
    use std::path::Path;

    /// The measurement's dry run on the CPU backend and the tiny fixture: the prompt goes through
    /// in chunks of what the decodes leave of each step's budget, and every time is a time.
    #[test]
    fn the_prompt_is_prefilled_in_chunks_beside_the_decodes() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama");
        let model = Llama::load(CpuBackend::new(1), &open_model(&dir).unwrap()).unwrap();
        let shape = MixedLoadShape {
            decodes: 4,
            decode_context: 20,
            prompt_tokens: 100,
            alone_steps: 3,
        };
        let block_size = 16;
        let dtype = model
            .backend()
            .kv_dtype(KvDtypeChoice::Auto, false)
            .unwrap();
        let layout = model.kv_layout(block_size, shape.blocks_needed(block_size, 16), dtype);
        let mut runner = ModelRunner::new(model, layout).unwrap();
        for budget in [16, 64] {
            let run = mixed_load(&mut runner, &shape, budget).unwrap();
            assert_eq!(run.step_tokens, budget);
            assert_eq!(run.chunk_steps, 100usize.div_ceil(budget - 4), "{run:?}");
            for t in [run.tpot_alone_ms, run.tpot_mixed_ms, run.worst_step_ms] {
                assert!(t > 0.0 && t.is_finite(), "{run:?}");
            }
            assert!(run.worst_step_ms >= run.tpot_mixed_ms && run.prefill_ms >= run.worst_step_ms);
        }
        let err = mixed_load(&mut runner, &shape, 4).unwrap_err().to_string();
        assert!(
            err.contains("no room for a prompt beside 4 decodes"),
            "{err}"
        );
    }
}
