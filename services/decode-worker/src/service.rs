//! The decode worker's gRPC services: `DecodeWorker/Decode` (owns a request from reservation to
//! last token), `KvTransfer/Push` (KV arriving from prefill workers) and `WorkerControl/Stats`.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use duet_engine::backend::KvLayout;
use duet_engine::engine::Resumed;
use duet_model::params::{SamplingParams, StopCriteria};
use duet_proto::{KV_WIRE_LAYOUT, v1};
use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tonic::{Request, Response, Status, Streaming};

use crate::error::DecodeError;
use crate::scheduler::{Command, Event, Generation, JobId, SchedulerHandle};

/// What every service of this worker shares.
pub struct WorkerState {
    pub worker_id: String,
    pub advertise: String,
    pub fingerprint: String,
    /// The KV cache's geometry and element type (pushes must match it; `num_blocks` is this
    /// worker's own capacity).
    pub kv: KvLayout,
    pub scheduler: SchedulerHandle,
    pub prefill_timeout: Duration,
    /// Channels to prefill workers, reused across requests.
    pub channels: duet_proto::Channels,
    pub incarnation: u64,
    next_job: AtomicU64,
    pub served: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub prefix_hit_tokens: AtomicU64,
    pub bytes_in: AtomicU64,
}

impl WorkerState {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        worker_id: String,
        advertise: String,
        fingerprint: String,
        kv: KvLayout,
        scheduler: SchedulerHandle,
        prefill_timeout: Duration,
    ) -> Self {
        let incarnation = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        Self {
            worker_id,
            advertise,
            fingerprint,
            kv,
            scheduler,
            prefill_timeout,
            channels: duet_proto::Channels::default(),
            incarnation,
            next_job: AtomicU64::new(1),
            served: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            prefix_hit_tokens: AtomicU64::new(0),
            bytes_in: AtomicU64::new(0),
        }
    }
}

#[derive(Clone)]
pub struct DecodeService {
    pub state: Arc<WorkerState>,
}

/// Frees the request's resources on the engine thread when the response stream goes away
/// (finished, failed, or dropped by a cancelling client).
struct CancelOnDrop {
    job: JobId,
    scheduler: SchedulerHandle,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        let _ = self.scheduler.send(Command::Cancel { job: self.job });
    }
}

type DecodeStream = Pin<Box<dyn Stream<Item = Result<v1::DecodeResponse, Status>> + Send>>;

/// Where the request's time went before decoding started.
#[derive(Default, Clone)]
struct PrefillReport {
    queue_ms: f64,
    prefill_ms: f64,
    transfer_ms: f64,
    worker: String,
    local: bool,
    cached_tokens: u32,
    retries: u32,
}

#[tonic::async_trait]
impl v1::decode_worker_server::DecodeWorker for DecodeService {
    type DecodeStream = DecodeStream;

    async fn decode(
        &self,
        request: Request<v1::DecodeRequest>,
    ) -> Result<Response<DecodeStream>, Status> {
        let deadline = Some(duet_proto::deadline(&request).into_std());
        let req = request.into_inner();
        let state = self.state.clone();
        if !req.model_fingerprint.is_empty() && req.model_fingerprint != state.fingerprint {
            return Err(DecodeError::FailedPrecondition(format!(
                "model fingerprint mismatch: the router expects {}, this worker runs {}",
                req.model_fingerprint, state.fingerprint
            ))
            .into());
        }
        let sampling = req
            .sampling
            .clone()
            .ok_or_else(|| Status::invalid_argument("sampling parameters are missing"))?;
        if req.prompt_token_ids.is_empty() {
            return Err(Status::invalid_argument("the prompt is empty"));
        }
        let (params, stop) = (
            SamplingParams::from(&sampling),
            StopCriteria::from(&sampling),
        );
        let job = state.next_job.fetch_add(1, Ordering::Relaxed);
        let guard = CancelOnDrop {
            job,
            scheduler: state.scheduler.clone(),
        };
        let (events_tx, mut events) = mpsc::unbounded_channel();
        let resumed = Resumed {
            generated: req.already_generated as usize,
            sent_text_bytes: req.already_sent_text_bytes as usize,
        };
        let generation = Generation {
            prompt: req.prompt_token_ids.clone(),
            resumed,
            cache_salt: req.cache_salt.clone(),
            params,
            stop,
            events: events_tx,
        };
        let plan = req.plan.clone().unwrap_or_default();
        // A resumed request (failover) is recomputed here: its prompt includes generated tokens
        // whose sampling state only this worker's engine can rebuild.
        let report = if plan.local || plan.prefill_workers.is_empty() || resumed.generated > 0 {
            state.scheduler.send(Command::Local { job, generation })?;
            PrefillReport {
                worker: state.worker_id.clone(),
                local: true,
                ..Default::default()
            }
        } else {
            prefill_remotely(&state, job, &req, &plan, generation, deadline).await?
        };
        state
            .prompt_tokens
            .fetch_add(req.prompt_token_ids.len() as u64, Ordering::Relaxed);

        let prompt_tokens = req.prompt_token_ids.len() as u32;
        let already = req.already_generated;
        let worker_id = state.worker_id.clone();
        let stats = state.clone();
        let stream = async_stream(move |tx| async move {
            let _guard = guard;
            let mut completion = 0u32;
            let mut first_at = None;
            let mut cached_tokens = report.cached_tokens;
            while let Some(ev) = events.recv().await {
                match ev {
                    Event::PrefixHit(n) => {
                        stats
                            .prefix_hit_tokens
                            .fetch_add(n as u64, Ordering::Relaxed);
                        cached_tokens = cached_tokens.max(n as u32);
                    }
                    Event::Output(out) => {
                        first_at.get_or_insert_with(Instant::now);
                        completion += 1;
                        let mut msg = v1::DecodeResponse {
                            token_ids: vec![out.token.token],
                            text: out.text.clone(),
                            logprobs: out
                                .token
                                .logprobs
                                .is_some()
                                .then(|| v1::TokenLogprobs::from(&out.token))
                                .into_iter()
                                .collect(),
                            ..Default::default()
                        };
                        if let Some(reason) = out.finish {
                            msg.finish_reason = v1::FinishReason::from(reason) as i32;
                            msg.usage = Some(v1::Usage {
                                prompt_tokens: prompt_tokens - already,
                                completion_tokens: completion + already,
                                cached_prompt_tokens: cached_tokens,
                            });
                            let decode_ms =
                                first_at.map_or(0.0, |t: Instant| t.elapsed().as_secs_f64() * 1e3);
                            msg.timings = Some(v1::Timings {
                                queue_ms: report.queue_ms,
                                prefill_ms: report.prefill_ms,
                                transfer_ms: report.transfer_ms,
                                decode_ms,
                                prefill_worker: report.worker.clone(),
                                decode_worker: worker_id.clone(),
                                prefill_local: report.local,
                                prefill_retries: report.retries,
                                ..Default::default()
                            });
                            let _ = tx.send(Ok(msg)).await;
                            return;
                        }
                        if tx.send(Ok(msg)).await.is_err() {
                            return; // client gone: the guard cancels
                        }
                    }
                    Event::Failed(e) => {
                        let _ = tx.send(Err(e.into())).await;
                        return;
                    }
                }
            }
        });
        state.served.fetch_add(1, Ordering::Relaxed);
        Ok(Response::new(stream))
    }
}

/// Reserves KV for the prompt, then asks the plan's prefill workers in order to compute it and
/// push the KV into the reservation; falls back to prefilling here.
async fn prefill_remotely(
    state: &Arc<WorkerState>,
    job: JobId,
    req: &v1::DecodeRequest,
    plan: &v1::PrefillPlan,
    generation: Generation,
    deadline: Option<Instant>,
) -> Result<PrefillReport, Status> {
    let started = Instant::now();
    let tokens = req.prompt_token_ids.clone();
    let cache_salt = req.cache_salt.clone();
    let reservation = state
        .scheduler
        .ask(|reply| Command::Reserve {
            job,
            tokens,
            cache_salt,
            reply,
        })
        .await?;
    let reservation = match reservation {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(job, error = %e, "no KV room for a transfer; prefilling locally");
            state.scheduler.send(Command::Local { job, generation })?;
            return Ok(PrefillReport {
                worker: state.worker_id.clone(),
                local: true,
                ..Default::default()
            });
        }
    };
    let queue_ms = started.elapsed().as_secs_f64() * 1e3;
    let cached_here = (reservation.cached_blocks * state.kv.block_size) as u32;
    let mut retries = 0;
    for target in &plan.prefill_workers {
        let mut timeout = state.prefill_timeout;
        if let Some(d) = deadline {
            timeout = timeout.min(d.saturating_duration_since(Instant::now()));
        }
        if timeout.is_zero() {
            break;
        }
        let msg = v1::PrefillRequest {
            request_id: req.request_id.clone(),
            token_ids: req.prompt_token_ids.clone(),
            sampling: req.sampling.clone(),
            dest: Some(v1::KvDestination {
                transfer_address: state.advertise.clone(),
                reservation_id: job,
                block_ids: reservation.block_ids.clone(),
                cached_blocks: reservation.cached_blocks as u32,
                transport: v1::TransportKind::Grpc as i32,
                transport_params: Vec::new(),
                block_size: state.kv.block_size as u32,
                decode_worker_id: state.worker_id.clone(),
            }),
            model_fingerprint: state.fingerprint.clone(),
            cache_salt: req.cache_salt.clone(),
            already_generated: req.already_generated,
        };
        match call_prefill(&state.channels, &target.address, msg, timeout).await {
            Ok(resp) => {
                let first = resp
                    .first_token
                    .as_ref()
                    .ok_or_else(|| Status::internal("prefill returned no first token"))?;
                let want_logprobs = req.sampling.as_ref().is_some_and(|s| s.logprobs > 0);
                let first = duet_proto::convert::sampled(first, want_logprobs);
                state.prefix_hit_tokens.fetch_add(
                    cached_here.max(resp.cached_tokens) as u64,
                    Ordering::Relaxed,
                );
                state.scheduler.send(Command::Activate {
                    job,
                    first,
                    generation,
                })?;
                return Ok(PrefillReport {
                    queue_ms: queue_ms + resp.queue_ms,
                    prefill_ms: resp.prefill_ms,
                    transfer_ms: resp.transfer_ms,
                    worker: resp.worker_id,
                    local: false,
                    cached_tokens: cached_here.max(resp.cached_tokens),
                    retries,
                });
            }
            Err(status) => {
                retries += 1;
                tracing::warn!(job, worker = %target.address, %status, "prefill attempt failed; trying the next");
            }
        }
    }
    // No prefill worker succeeded: compute the prompt here (the reservation is released first).
    state.scheduler.send(Command::Local { job, generation })?;
    Ok(PrefillReport {
        queue_ms,
        worker: state.worker_id.clone(),
        local: true,
        retries,
        ..Default::default()
    })
}

async fn call_prefill(
    channels: &duet_proto::Channels,
    address: &str,
    msg: v1::PrefillRequest,
    timeout: Duration,
) -> Result<v1::PrefillResponse, Status> {
    let channel = channels
        .get(address)
        .map_err(|e| Status::invalid_argument(e.to_string()))?;
    let mut client = v1::prefill_worker_client::PrefillWorkerClient::new(channel)
        .max_decoding_message_size(duet_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(duet_proto::MAX_MESSAGE_BYTES);
    let mut request = Request::new(msg);
    request.set_timeout(timeout);
    // The attempt's timeout also bounds connecting, which the call's own deadline does not.
    tokio::time::timeout(timeout, client.prefill(request))
        .await
        .map_err(|_| Status::deadline_exceeded(format!("prefill at {address} timed out")))?
        .map(|r| r.into_inner())
}

/// A response stream fed by a task (no extra dependency for `async_stream`).
fn async_stream<F, Fut>(f: F) -> DecodeStream
where
    F: FnOnce(mpsc::Sender<Result<v1::DecodeResponse, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(f(tx));
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}

#[derive(Clone)]
pub struct TransferService {
    pub state: Arc<WorkerState>,
}

#[tonic::async_trait]
impl v1::kv_transfer_server::KvTransfer for TransferService {
    async fn push(
        &self,
        request: Request<Streaming<v1::KvChunk>>,
    ) -> Result<Response<v1::PushAck>, Status> {
        let state = &self.state;
        let mut chunks = request.into_inner();
        let header = match chunks.next().await {
            Some(Ok(v1::KvChunk {
                kind: Some(v1::kv_chunk::Kind::Header(h)),
            })) => h,
            Some(Err(e)) => return Err(e),
            _ => {
                return Err(Status::invalid_argument(
                    "a KV push must start with a header",
                ));
            }
        };
        if header.model_fingerprint != state.fingerprint {
            return Err(Status::failed_precondition(format!(
                "model fingerprint mismatch: sender {}, receiver {}",
                header.model_fingerprint, state.fingerprint
            )));
        }
        let geometry = (
            header.block_size as usize,
            header.num_layers as usize,
            header.num_kv_heads as usize,
            header.head_dim as usize,
        );
        let kv = &state.kv;
        if geometry != (kv.block_size, kv.num_layers, kv.num_kv_heads, kv.head_dim)
            || header.dtype != kv.dtype.name()
            || header.layout != KV_WIRE_LAYOUT
        {
            return Err(Status::failed_precondition(format!(
                "KV geometry mismatch: sender (block {}, layers {}, kv heads {}, head dim {}, {} {}), receiver (block {}, layers {}, kv heads {}, head dim {}, {} {KV_WIRE_LAYOUT})",
                header.block_size,
                header.num_layers,
                header.num_kv_heads,
                header.head_dim,
                header.dtype,
                header.layout,
                kv.block_size,
                kv.num_layers,
                kv.num_kv_heads,
                kv.head_dim,
                kv.dtype
            )));
        }
        let job = header.reservation_id;
        let Some(blocks) = state
            .scheduler
            .ask(|reply| Command::ReservationBlocks { job, reply })
            .await?
        else {
            return Ok(Response::new(v1::PushAck {
                accepted: false,
                message: format!("reservation {job} is gone (cancelled or expired)"),
                ..Default::default()
            }));
        };
        let (first, total) = (header.first_block as usize, header.total_blocks as usize);
        if first + total != blocks {
            return Err(Status::invalid_argument(format!(
                "the push covers blocks {first}..{} but the reservation has {blocks}",
                first + total
            )));
        }
        // Every (layer, block) of the range exactly once.
        let mut seen = vec![false; state.kv.num_layers * total];
        let (mut received, mut n_chunks) = (0u64, 0u64);
        let mut writes = Vec::new();
        while let Some(chunk) = chunks.next().await {
            match chunk?.kind {
                Some(v1::kv_chunk::Kind::Data(d)) => {
                    if xxhash_rust::xxh3::xxh3_64(&d.payload) != d.xxh3 {
                        return Err(Status::data_loss(format!(
                            "checksum mismatch in the KV of layer {}",
                            d.layer
                        )));
                    }
                    let (layer, start, end) = (
                        d.layer as usize,
                        d.block_start as usize,
                        d.block_end as usize,
                    );
                    if layer >= state.kv.num_layers
                        || start < first
                        || end > first + total
                        || start >= end
                    {
                        return Err(Status::invalid_argument(format!(
                            "KV chunk out of range: layer {layer}, blocks {start}..{end}"
                        )));
                    }
                    for b in start..end {
                        let slot = &mut seen[layer * total + b - first];
                        if *slot {
                            return Err(Status::invalid_argument(format!(
                                "KV of layer {layer} block {b} sent twice"
                            )));
                        }
                        *slot = true;
                    }
                    received += d.payload.len() as u64;
                    n_chunks += 1;
                    // Not awaited here: the engine thread handles commands only between
                    // steps, so waiting for each chunk would cost a decode step per layer.
                    let payload = d.payload;
                    writes.push(state.scheduler.request(|reply| Command::WriteKv {
                        job,
                        layer,
                        start,
                        end,
                        payload,
                        reply,
                    })?);
                }
                Some(v1::kv_chunk::Kind::Done(done)) => {
                    for write in writes.drain(..) {
                        match SchedulerHandle::reply(write).await? {
                            Ok(()) => {}
                            Err(e @ DecodeError::NotFound(_)) => {
                                return Ok(Response::new(v1::PushAck {
                                    accepted: false,
                                    message: e.to_string(),
                                    ..Default::default()
                                }));
                            }
                            Err(e) => return Err(e.into()),
                        }
                    }
                    if done.num_chunks != n_chunks
                        || done.total_bytes != received
                        || seen.iter().any(|s| !s)
                    {
                        return Err(Status::data_loss(format!(
                            "incomplete KV push: {n_chunks} chunks / {received} bytes received, {} / {} announced, {} blocks missing",
                            done.num_chunks,
                            done.total_bytes,
                            seen.iter().filter(|s| !**s).count()
                        )));
                    }
                    state.bytes_in.fetch_add(received, Ordering::Relaxed);
                    return Ok(Response::new(v1::PushAck {
                        accepted: true,
                        bytes_received: received,
                        chunks_received: n_chunks,
                        message: String::new(),
                    }));
                }
                _ => return Err(Status::invalid_argument("a second header in one KV push")),
            }
        }
        Err(Status::data_loss(
            "the KV push ended without its final message",
        ))
    }
}

#[derive(Clone)]
pub struct ControlService {
    pub state: Arc<WorkerState>,
}

#[tonic::async_trait]
impl v1::worker_control_server::WorkerControl for ControlService {
    async fn stats(
        &self,
        _: Request<v1::StatsRequest>,
    ) -> Result<Response<v1::StatsResponse>, Status> {
        let s = &self.state;
        let stats = s.scheduler.ask(|reply| Command::Stats { reply }).await?;
        Ok(Response::new(v1::StatsResponse {
            role: v1::WorkerRole::Decode as i32,
            worker_id: s.worker_id.clone(),
            incarnation: s.incarnation,
            kv_blocks_total: stats.pool.num_blocks as u32,
            kv_blocks_used: stats.pool.in_use as u32,
            kv_blocks_cached: stats.pool.cached as u32,
            kv_blocks_free: stats.pool.free as u32,
            block_size: s.kv.block_size as u32,
            running_sequences: stats.running as u32,
            waiting_requests: stats.waiting as u32,
            queued_prefill_tokens: 0,
            reservations_outstanding: stats.reservations as u32,
            model_fingerprint: s.fingerprint.clone(),
            requests_served: s.served.load(Ordering::Relaxed),
            prompt_tokens: s.prompt_tokens.load(Ordering::Relaxed),
            prefix_hit_tokens: s.prefix_hit_tokens.load(Ordering::Relaxed),
            transfer_bytes_in: s.bytes_in.load(Ordering::Relaxed),
            transfer_bytes_out: 0,
        }))
    }
}
