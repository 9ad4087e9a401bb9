//! The one record of a request on a worker, from the service to the engine thread, and what the
//! engine thread tells it back.

use std::time::Instant;

use duet_engine::engine::{Resumed, StepOutput};
use duet_model::grammar::Grammar;
use duet_model::params::{SamplingParams, StopCriteria};
use duet_transfer::KvSender;
use tokio::sync::mpsc::UnboundedSender;

use crate::WorkerError;

/// A request's id on this worker; on a decode worker also the id of its KV reservation.
pub type RequestId = u64;

/// A prompt to run on this worker's engine.
pub struct Request {
    pub id: RequestId,
    /// The prompt, ending with the tokens already generated when `resumed` says so.
    pub prompt: Vec<u32>,
    /// Set when resuming a request another decode worker started (failover).
    pub resumed: Resumed,
    /// Per-tenant prefix-cache namespace (empty: shared).
    pub cache_salt: String,
    pub params: SamplingParams,
    /// `params.constraint` compiled ([`crate::EngineHandle::compile`]): the engine thread never
    /// compiles one, which would stall every running sequence.
    pub grammar: Option<Grammar>,
    pub stop: StopCriteria,
    /// On a prefill worker: where the prompt's KV goes. The request then ends with its first
    /// token, once every block has been handed to the transport.
    pub kv_out: Option<KvOut>,
    pub events: UnboundedSender<Event>,
    /// When the worker received the request.
    pub received: Instant,
}

/// Where a prefilled prompt's KV goes.
pub struct KvOut {
    pub sender: Box<dyn KvSender>,
    /// Index of the first reservation block to send (the blocks before it are cached there).
    pub first_block: usize,
}

/// What a request hears from the engine thread, in this order.
#[derive(Debug)]
pub enum Event {
    /// The prompt was admitted; this many of its tokens came from the prefix cache.
    Admitted {
        cached_tokens: usize,
    },
    /// The request's first forward step began: its time in the queue ended.
    Scheduled(Instant),
    /// A generated token; the last one has `finish` set (a prefill request ends after its first).
    Output(StepOutput),
    Failed(WorkerError),
}
