//! The prefill worker's gRPC adapter: `PrefillWorker/Prefill` (validate, submit to the engine
//! thread with a KV push opened to the decode worker, answer once the push is acknowledged) and
//! `WorkerControl/Stats`; `KvEvents` from the worker runtime.

use std::sync::Arc;
use std::time::{Duration, Instant};

use duet_model::params::{SamplingParams, StopCriteria};
use duet_proto::v1::prefill_worker_server::PrefillWorker;
use duet_proto::v1::worker_control_server::WorkerControl;
use duet_proto::v1::{
    KvDestination, PrefillRequest, PrefillResponse, StatsRequest, StatsResponse, TokenLogprobs,
    WorkerRole,
};
use duet_transfer::choice::transport_name;
use duet_transfer::{KvTransport, PushSpec, Pushed, ReservationKey, TransferError};
use duet_worker::kv_events::{DEFAULT_DIGEST_INTERVAL, KvEventsService};
use duet_worker::stats::{Counters, Direction};
use duet_worker::{
    EngineHandle, EngineInfo, Event, Identity, KnownPeers, KvOut, Request, WorkerError,
};
use tokio::sync::mpsc;
use tonic::{Response, Status};
use tracing::Instrument;

/// Serves `PrefillWorker` and `WorkerControl`; cheap to clone.
#[derive(Clone)]
pub struct PrefillService {
    inner: Arc<Inner>,
}

struct Inner {
    engine: EngineHandle,
    transport: Arc<dyn KvTransport>,
    decode_workers: KnownPeers,
    identity: Identity,
    max_queued_tokens: u64,
}

impl PrefillService {
    /// A service pushing KV through `transport`, to `decode_workers` only.
    pub fn new(
        engine: EngineHandle,
        transport: Arc<dyn KvTransport>,
        decode_workers: KnownPeers,
        worker_id: String,
        max_queued_tokens: u64,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                engine,
                transport,
                decode_workers,
                identity: Identity::new(worker_id),
                max_queued_tokens,
            }),
        }
    }

    /// The model fingerprint this worker serves.
    pub fn fingerprint(&self) -> &str {
        &self.inner.engine.info().wire.fingerprint
    }

    /// `KvEvents` for this worker's prefix cache; subscriptions end at `drain`.
    pub fn kv_events(&self, drain: duet_proto::DrainBegun) -> KvEventsService {
        KvEventsService::new(
            self.inner.engine.kv_events().clone(),
            self.inner.identity.incarnation,
            DEFAULT_DIGEST_INTERVAL,
            drain,
        )
    }
}

#[tonic::async_trait]
impl PrefillWorker for PrefillService {
    async fn prefill(
        &self,
        request: tonic::Request<PrefillRequest>,
    ) -> Result<Response<PrefillResponse>, Status> {
        let received = Instant::now();
        let deadline = duet_proto::deadline(&request);
        let timeout = deadline.saturating_duration_since(tokio::time::Instant::now());
        let req = request.into_inner();
        let request_id = req.request_id.clone();
        let span = tracing::info_span!(
            "prefill",
            request_id,
            prompt_tokens = req.token_ids.len() as i64,
            cached_tokens = tracing::field::Empty,
        );
        let prefill = self.inner.prefill(req, received, timeout).instrument(span);
        let result = tokio::time::timeout(timeout, prefill)
            .await
            .unwrap_or_else(|_| {
                Err(WorkerError::DeadlineExceeded(format!(
                    "the prefill did not finish within the call's deadline of {} ms",
                    timeout.as_millis()
                )))
            });
        result.map(Response::new).map_err(|e| {
            tracing::info!(request_id, "prefill failed: {e}");
            e.into()
        })
    }
}

#[tonic::async_trait]
impl WorkerControl for PrefillService {
    async fn stats(
        &self,
        _: tonic::Request<StatsRequest>,
    ) -> Result<Response<StatsResponse>, Status> {
        let inner = &self.inner;
        Ok(Response::new(
            inner.identity.stats(WorkerRole::Prefill, &inner.engine),
        ))
    }
}

/// What the engine thread reported for one prefill.
struct Prefilled {
    first: TokenLogprobs,
    cached_tokens: usize,
    /// From receiving the request to its first step.
    queue: Duration,
    /// From its first step to the end of the step that sampled the first token.
    compute: Duration,
    /// When the first token arrived (all KV handed to the transport).
    computed_at: Instant,
}

impl Inner {
    async fn prefill(
        &self,
        req: PrefillRequest,
        received: Instant,
        timeout: Duration,
    ) -> Result<PrefillResponse, WorkerError> {
        let info = self.engine.info();
        let dest = validate(&req, info)?;
        if !self.decode_workers.knows(&dest.transfer_address, None) {
            return Err(TransferError::Forbidden(format!(
                "dest.transfer_address {:?} is not a decode worker this prefill worker knows (--decode, or a decode card of its cluster)",
                dest.transfer_address
            ))
            .into());
        }
        let params = req
            .sampling
            .as_ref()
            .map(SamplingParams::from)
            .unwrap_or_default();
        params
            .validate()
            .map_err(|e| WorkerError::InvalidArgument(e.0))?;
        // Off the engine thread, before the request is anywhere near it.
        let grammar = self.engine.compile(&params).await?;
        let n = req.token_ids.len();
        let first_block = dest.cached_blocks as usize;
        let blocks = first_block..n.div_ceil(info.wire.layout.block_size);
        let num_blocks = blocks.len();
        let push = self.transport.open(
            &info.wire,
            PushSpec {
                address: dest.transfer_address.clone(),
                reservation_id: ReservationKey::from_wire(&dest.reservation_id)?,
                request_id: req.request_id.clone(),
                blocks,
                num_tokens: n,
                sender_worker_id: self.identity.worker_id.clone(),
                timeout,
                dest_block_ids: dest.block_ids.clone(),
                offered: dest.transport(),
                transport_params: dest.transport_params.clone(),
            },
        )?;
        let transport = transport_name(push.kind);
        tracing::info!(
            request_id = req.request_id,
            transport,
            blocks = num_blocks,
            decode = dest.transfer_address,
            "KV push opened"
        );
        // From opening the push to the receiver's acknowledgement (it overlaps the compute).
        let transfer_span = tracing::info_span!(
            "kv_transfer",
            transport,
            blocks = num_blocks as i64,
            bytes = tracing::field::Empty,
            chunks = tracing::field::Empty,
        );
        let (events, mut rx) = mpsc::unbounded_channel();
        // Two tokens, so the sequence still holds its blocks after the step that samples the
        // first one (one when the prompt leaves room for just one).
        let stop = StopCriteria {
            max_tokens: 2.min(info.context_length.saturating_sub(n)).max(1),
            ignore_eos: true,
            ..StopCriteria::default()
        };
        let id = self.engine.next_id();
        let mut cancel = self.engine.cancel_on_drop(id);
        // Until the engine's first step on the prompt.
        let mut queue_span = Some(tracing::info_span!("queue"));
        self.engine.submit(
            Request {
                id,
                prompt: req.token_ids,
                resumed: Default::default(),
                cache_salt: req.cache_salt,
                params,
                grammar,
                stop,
                kv_out: Some(KvOut {
                    sender: push.sender,
                    first_block,
                }),
                events,
                received,
            },
            self.max_queued_tokens,
        )?;

        let push_kind = push.kind;
        let mut acked = push.acked.instrument(transfer_span.clone());
        let (mut cached_tokens, mut scheduled) = (0, None);
        let mut prefilled: Option<Prefilled> = None;
        let mut pushed: Option<Pushed> = None;
        while prefilled.is_none() || pushed.is_none() {
            tokio::select! {
                event = rx.recv(), if prefilled.is_none() => match event {
                    Some(Event::Admitted { cached_tokens: c }) => cached_tokens = c,
                    Some(Event::Scheduled(at)) => {
                        scheduled = Some(at);
                        drop(queue_span.take());
                    }
                    Some(Event::Output(out)) => {
                        drop(queue_span.take());
                        cancel.disarm(); // answered: the engine has dropped the sequence
                        // The decode worker then prefills here itself, and ends the request
                        // with the failure.
                        if let Some(error) = out.error {
                            return Err(WorkerError::Internal(format!(
                                "the request's grammar failed at its first token: {error}"
                            )));
                        }
                        let now = Instant::now();
                        let started = scheduled.unwrap_or(now);
                        prefilled = Some(Prefilled {
                            first: TokenLogprobs::from(&out.token),
                            cached_tokens,
                            queue: started.saturating_duration_since(received),
                            compute: now.saturating_duration_since(started),
                            computed_at: now,
                        });
                    }
                    Some(Event::Failed(e)) => {
                        cancel.disarm();
                        return Err(e);
                    }
                    None => return Err(WorkerError::EngineStopped),
                },
                result = &mut acked, if pushed.is_none() => pushed = Some(result.inspect_err(|e| {
                    self.engine.counters().transfer_failed(transport, Direction::Out, e.reason());
                })?),
            }
        }
        let (prefilled, pushed) = (prefilled.expect("loop ends"), pushed.expect("loop ends"));
        transfer_span.record("bytes", pushed.bytes_sent as i64);
        transfer_span.record("chunks", pushed.chunks as i64);
        drop(transfer_span);
        tracing::Span::current().record("cached_tokens", prefilled.cached_tokens as i64);
        let counters = self.engine.counters();
        Counters::add(&counters.requests_served, 1);
        Counters::add(&counters.prompt_tokens, n as u64);
        Counters::add(&counters.prefix_hit_tokens, prefilled.cached_tokens as u64);
        // The transfer's time is what compute did not hide: from the last layer computed to the
        // receiver's acknowledgement (the response's transfer_ms).
        let transfer = pushed
            .acked_at
            .saturating_duration_since(prefilled.computed_at);
        counters.transferred(
            transport,
            Direction::Out,
            pushed.bytes_sent,
            transfer.as_secs_f64(),
        );
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        Ok(PrefillResponse {
            first_token: Some(prefilled.first),
            cached_tokens: prefilled.cached_tokens as u32,
            queue_ms: ms(prefilled.queue),
            prefill_ms: ms(prefilled.compute),
            transfer_ms: ms(transfer),
            bytes_sent: pushed.bytes_sent,
            transport: push_kind as i32,
            worker_id: self.identity.worker_id.clone(),
        })
    }
}

/// Checks a request against this worker's model and KV geometry; returns its destination.
fn validate<'a>(
    req: &'a PrefillRequest,
    info: &EngineInfo,
) -> Result<&'a KvDestination, WorkerError> {
    use WorkerError::{FailedPrecondition, InvalidArgument};
    let layout = &info.wire.layout;
    info.wire
        .check_model("the request", &req.model_fingerprint)?;
    let dest = req
        .dest
        .as_ref()
        .ok_or_else(|| InvalidArgument("dest (the KV destination) is missing".into()))?;
    if dest.block_size as usize != layout.block_size {
        return Err(FailedPrecondition(format!(
            "KV block size mismatch: the decode worker uses {} tokens per block, this prefill worker {}",
            dest.block_size, layout.block_size
        )));
    }
    let n = req.token_ids.len();
    info.prompt_limits().check(&req.token_ids)?;
    let blocks = n.div_ceil(layout.block_size);
    if dest.block_ids.len() != blocks {
        return Err(InvalidArgument(format!(
            "dest.block_ids has {} blocks; {n} tokens need {blocks} blocks of {}",
            dest.block_ids.len(),
            layout.block_size
        )));
    }
    if dest.cached_blocks as usize > blocks {
        return Err(InvalidArgument(format!(
            "dest.cached_blocks is {} but the prompt has only {blocks} blocks",
            dest.cached_blocks
        )));
    }
    if dest.transfer_address.is_empty() {
        return Err(InvalidArgument("dest.transfer_address is empty".into()));
    }
    if blocks > layout.num_blocks {
        return Err(WorkerError::ResourceExhausted(format!(
            "the prompt needs {blocks} KV blocks; this prefill worker's cache holds {}",
            layout.num_blocks
        )));
    }
    Ok(dest)
}

#[cfg(test)]
mod tests {
    use duet_engine::backend::{KvDtype, KvLayout};
    use duet_transfer::KvWire;

    use super::*;

    fn info() -> EngineInfo {
        EngineInfo {
            wire: KvWire {
                fingerprint: "fp".into(),
                layout: KvLayout {
                    num_layers: 2,
                    num_kv_heads: 2,
                    head_dim: 8,
                    block_size: 4,
                    num_blocks: 8,
                    dtype: KvDtype::F32,
                },
            },
            vocab_size: 100,
            context_length: 64,
            kv_ipc_offer: Err("a CPU engine".into()),
        }
    }

    fn request(tokens: Vec<u32>, blocks: usize) -> PrefillRequest {
        PrefillRequest {
            token_ids: tokens,
            model_fingerprint: "fp".into(),
            dest: Some(KvDestination {
                transfer_address: "127.0.0.1:1".into(),
                block_ids: (0..blocks as u32).collect(),
                block_size: 4,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn code(r: Result<&KvDestination, WorkerError>) -> tonic::Code {
        Status::from(r.unwrap_err()).code()
    }

    #[test]
    fn validation() {
        let i = info();
        assert!(validate(&request(vec![1; 9], 3), &i).is_ok());
        use tonic::Code::*;
        assert_eq!(code(validate(&request(vec![], 0), &i)), InvalidArgument);
        assert_eq!(code(validate(&request(vec![1; 9], 2), &i)), InvalidArgument);
        assert_eq!(code(validate(&request(vec![100], 1), &i)), InvalidArgument);
        assert_eq!(
            code(validate(&request(vec![1; 64], 16), &i)),
            InvalidArgument
        );
        let mut r = request(vec![1; 9], 3);
        r.model_fingerprint = "other".into();
        let e = validate(&r, &i).unwrap_err().to_string();
        assert!(e.contains("\"other\"") && e.contains("\"fp\""), "{e}");
        assert_eq!(code(validate(&r, &i)), FailedPrecondition);
        let mut r = request(vec![1; 9], 3);
        r.dest.as_mut().unwrap().block_size = 16;
        assert_eq!(code(validate(&r, &i)), FailedPrecondition);
        let mut r = request(vec![1; 9], 3);
        r.dest.as_mut().unwrap().cached_blocks = 4;
        assert_eq!(code(validate(&r, &i)), InvalidArgument);
        let mut r = request(vec![1; 9], 3);
        r.dest = None;
        assert_eq!(code(validate(&r, &i)), InvalidArgument);
        assert_eq!(
            code(validate(&request(vec![1; 40], 10), &i)),
            ResourceExhausted
        );
    }
}
