//! The engine as the actor drives it: [`Engine`] in production, a scripted engine in the
//! actor's tests, so the actor's decisions are tested without threads or a model.

use duet_engine::EngineError;
use duet_engine::backend::{Backend, KvLayout};
use duet_engine::engine::{
    Engine, KvFence, KvReservation, LayerDone, PlannedSeq, Resumed, SeqId, Speculation, StepOutput,
};
use duet_kv::{KvDigest, KvEvent, PoolStats, TierStats};
use duet_model::grammar::Grammar;
use duet_model::params::{Sampled, SamplingParams, StopCriteria};

/// One layer's K/V, finished during a step.
pub trait LayerKv {
    fn layer(&self) -> usize;
    /// Every sequence's share of the step.
    fn plan(&self) -> &[PlannedSeq];
    /// Appends this layer's KV of physical `blocks`, one after another, in the wire layout.
    fn append_kv_blocks(&self, blocks: &[u32], out: &mut Vec<u8>) -> Result<(), EngineError>;
    /// The backend and KV store (`&B`, `&B::KvStore`), for transports that copy device memory
    /// themselves (cuda-ipc downcasts them).
    fn device(&self) -> Option<(&dyn std::any::Any, &dyn std::any::Any)> {
        None
    }
}

impl<B: Backend + 'static> LayerKv for LayerDone<'_, B> {
    fn layer(&self) -> usize {
        self.layer
    }

    fn plan(&self) -> &[PlannedSeq] {
        self.plan
    }

    fn append_kv_blocks(&self, blocks: &[u32], out: &mut Vec<u8>) -> Result<(), EngineError> {
        LayerDone::append_kv_blocks(self, blocks, out)
    }

    fn device(&self) -> Option<(&dyn std::any::Any, &dyn std::any::Any)> {
        Some((self.backend, self.kv))
    }
}

/// The engine operations the actor uses (see [`Engine`] for each one's contract).
pub trait ActorEngine {
    fn kv_layout(&self) -> KvLayout;
    fn pool_stats(&self) -> PoolStats;
    fn kv_tier_stats(&self) -> Vec<TierStats>;
    fn set_prefill_rate(&mut self, tokens_per_s: f64);
    fn record_kv_events(&mut self);
    fn take_kv_events(&mut self) -> (Vec<KvEvent>, KvDigest);
    fn has_work(&self) -> bool;
    fn preemptions(&self) -> u64;
    fn out_of_vocab_drafts(&self) -> u64;
    fn speculation_totals(&self) -> Speculation;
    fn resume_sequence(
        &mut self,
        tokens: Vec<u32>,
        resumed: Resumed,
        cache_salt: &str,
        params: SamplingParams,
        grammar: Option<Grammar>,
        stop: StopCriteria,
    ) -> Result<SeqId, EngineError>;
    fn cached_prompt_tokens(&self, seq: SeqId) -> Option<usize>;
    fn remove_sequence(&mut self, seq: SeqId) -> Result<(), EngineError>;
    fn reserve(&mut self, tokens: &[u32], cache_salt: &str) -> Result<KvReservation, EngineError>;
    fn release(&mut self, reservation: KvReservation) -> Result<(), EngineError>;
    /// Blocks held against a transfer's late writes (`Engine::fence`).
    type Fence;
    fn fence(&mut self, reservation: &KvReservation) -> Result<Self::Fence, EngineError>;
    fn lift_fence(&mut self, fence: Self::Fence) -> Result<(), EngineError>;
    fn cache_reservation(
        &mut self,
        tokens: &[u32],
        reservation: KvReservation,
    ) -> Result<(), EngineError>;
    fn send_prefix(
        &mut self,
        tokens: &[u32],
        cache_salt: &str,
        blocks_end: usize,
        on_layer: &mut dyn FnMut(&[u32], &dyn LayerKv),
    ) -> Result<bool, EngineError>;
    fn add_prefilled(
        &mut self,
        prompt: Vec<u32>,
        reservation: KvReservation,
        first: Sampled,
        params: SamplingParams,
        grammar: Option<Grammar>,
        stop: StopCriteria,
    ) -> Result<(SeqId, StepOutput), EngineError>;
    fn write_kv_block(&mut self, layer: usize, block: u32, data: &[u8]) -> Result<(), EngineError>;
    /// One forward step; `on_layer` sees each layer's K/V once written.
    fn step_with(
        &mut self,
        on_layer: &mut dyn FnMut(&dyn LayerKv),
    ) -> Result<Vec<StepOutput>, EngineError>;
}

impl<B: Backend + 'static> ActorEngine for Engine<B> {
    fn kv_layout(&self) -> KvLayout {
        Engine::kv_layout(self)
    }

    fn pool_stats(&self) -> PoolStats {
        self.block_pool().stats()
    }

    fn kv_tier_stats(&self) -> Vec<TierStats> {
        Engine::kv_tier_stats(self)
    }

    fn set_prefill_rate(&mut self, tokens_per_s: f64) {
        Engine::set_prefill_rate(self, tokens_per_s)
    }

    fn record_kv_events(&mut self) {
        Engine::record_kv_events(self)
    }

    fn take_kv_events(&mut self) -> (Vec<KvEvent>, KvDigest) {
        Engine::take_kv_events(self)
    }

    fn has_work(&self) -> bool {
        Engine::has_work(self)
    }

    fn preemptions(&self) -> u64 {
        Engine::preemptions(self)
    }

    fn out_of_vocab_drafts(&self) -> u64 {
        Engine::out_of_vocab_drafts(self)
    }

    fn speculation_totals(&self) -> Speculation {
        Engine::speculation_totals(self)
    }

    fn resume_sequence(
        &mut self,
        tokens: Vec<u32>,
        resumed: Resumed,
        cache_salt: &str,
        params: SamplingParams,
        grammar: Option<Grammar>,
        stop: StopCriteria,
    ) -> Result<SeqId, EngineError> {
        Engine::resume_sequence(self, tokens, resumed, cache_salt, params, grammar, stop)
    }

    fn cached_prompt_tokens(&self, seq: SeqId) -> Option<usize> {
        Engine::cached_prompt_tokens(self, seq)
    }

    fn remove_sequence(&mut self, seq: SeqId) -> Result<(), EngineError> {
        Engine::remove_sequence(self, seq)
    }

    fn reserve(&mut self, tokens: &[u32], cache_salt: &str) -> Result<KvReservation, EngineError> {
        Engine::reserve(self, tokens, cache_salt)
    }

    fn release(&mut self, reservation: KvReservation) -> Result<(), EngineError> {
        Engine::release(self, reservation)
    }

    type Fence = KvFence;

    fn fence(&mut self, reservation: &KvReservation) -> Result<KvFence, EngineError> {
        Engine::fence(self, reservation)
    }

    fn lift_fence(&mut self, fence: KvFence) -> Result<(), EngineError> {
        Engine::lift_fence(self, fence)
    }

    fn cache_reservation(
        &mut self,
        tokens: &[u32],
        reservation: KvReservation,
    ) -> Result<(), EngineError> {
        Engine::cache_reservation(self, tokens, reservation)
    }

    fn send_prefix(
        &mut self,
        tokens: &[u32],
        cache_salt: &str,
        blocks_end: usize,
        on_layer: &mut dyn FnMut(&[u32], &dyn LayerKv),
    ) -> Result<bool, EngineError> {
        Engine::send_prefix(self, tokens, cache_salt, blocks_end, &mut |table, done| {
            on_layer(table, done)
        })
    }

    fn add_prefilled(
        &mut self,
        prompt: Vec<u32>,
        reservation: KvReservation,
        first: Sampled,
        params: SamplingParams,
        grammar: Option<Grammar>,
        stop: StopCriteria,
    ) -> Result<(SeqId, StepOutput), EngineError> {
        Engine::add_prefilled(self, prompt, reservation, first, params, grammar, stop)
    }

    fn write_kv_block(&mut self, layer: usize, block: u32, data: &[u8]) -> Result<(), EngineError> {
        Engine::write_kv_block(self, layer, block, data)
    }

    fn step_with(
        &mut self,
        on_layer: &mut dyn FnMut(&dyn LayerKv),
    ) -> Result<Vec<StepOutput>, EngineError> {
        Engine::step_with(self, &mut |done: &LayerDone<'_, B>| on_layer(done))
    }
}
