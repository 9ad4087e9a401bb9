//! The decode worker's gRPC adapter: `DecodeWorker/Decode` (owns a request from reservation to
//! last token), `KvTransfer/Push` (KV arriving from prefill workers), `KvTransfer/Pull` (a
//! prefix held here, sent to a peer) and `WorkerControl/Stats`.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use duet_cluster::Role;
use duet_engine::engine::{Resumed, StepOutput};
use duet_model::params::{SamplingParams, StopCriteria};
use duet_proto::v1;
use duet_transfer::choice::transport_name;
use duet_worker::stats::{Counters, Direction, LocalFallback};
use duet_worker::{
    Command, EngineHandle, EngineInfo, Event, Identity, KnownPeers, Request, RequestId, RoleSwitch,
    WorkerError,
};
use futures::Stream;
use tokio::sync::mpsc;
use tonic::{Response, Status, Streaming};
use tracing::Instrument;

use crate::remote_prefill::{self, PrefillReport};

/// What every service of this worker shares.
pub struct WorkerState {
    pub identity: Identity,
    /// The address prefill workers push KV to.
    pub advertise: String,
    pub engine: EngineHandle,
    /// Longest one prefill attempt may take.
    pub prefill_timeout: Duration,
    /// Channels to prefill workers, reused across requests.
    pub channels: duet_proto::Channels,
    /// The KV transport offered in `KvDestination` (cuda-ipc: this worker's KV store exported,
    /// in `kv_transport_params`).
    pub kv_transport: v1::TransportKind,
    pub kv_transport_params: Vec<u8>,
    /// The prefill workers a plan may name.
    pub prefill_workers: KnownPeers,
    /// The decode workers a prefix may be pulled from.
    pub decode_peers: KnownPeers,
    /// Whether prefixes are pulled from peers (`--kv-peer-pull`).
    pub peer_pull: bool,
    /// Whether its role can switch (`--role-switch on`), as `Stats` reports.
    pub role_switch: bool,
    /// Whether pulls are asked for over CUDA IPC (`--kv-peer-pull-cuda-ipc`, where
    /// `kv_transport` is cuda-ipc).
    pub peer_pull_cuda_ipc: bool,
    /// Peers' pulls answered over CUDA IPC: their KV stores opened here.
    pub ipc_pulls: duet_transfer::choice::IpcPulls,
    /// This node's name (a CUDA IPC offer opens only on its node).
    pub node: String,
    /// The worker's role now (decode for good unless `--role-switch on`).
    pub role: Arc<RoleSwitch>,
}

/// How long past a transfer's deadline the blocks of a reservation stay fenced after a
/// transfer whose sender copies into them in place (CUDA IPC) did not answer: a sender launches
/// no copy past the deadline it was given (a pull's holder reads it from the call; a prefill
/// worker's engine drops the request when the call is given up), and a launched copy lands
/// within milliseconds; a second covers them and the call's trip.
const LATE_COPY_GRACE: Duration = Duration::from_secs(1);

impl WorkerState {
    /// Fences the blocks request `id`'s reservation offers a transfer over `transport` due by
    /// `deadline`, when its sender copies into them in place (CUDA IPC): no other sequence gets
    /// them before a late copy could have landed, whatever becomes of the transfer or the
    /// request. The fence's time, if it fenced: the transfer's answer then lifts it
    /// ([`lift_fence`](Self::lift_fence)).
    pub(crate) fn fence(
        &self,
        id: RequestId,
        transport: v1::TransportKind,
        deadline: Instant,
    ) -> Option<Instant> {
        if transport != v1::TransportKind::CudaIpc {
            return None;
        }
        let until = deadline + LATE_COPY_GRACE;
        let _ = self.engine.send(Command::Fence { id, until });
        Some(until)
    }

    /// The transfer fenced until `until` answered (its copies all landed): its fence goes.
    pub(crate) fn lift_fence(&self, id: RequestId, until: Option<Instant>) {
        if let Some(until) = until {
            let _ = self.engine.send(Command::LiftFence { id, until });
        }
    }
}

#[derive(Clone)]
pub struct DecodeService {
    pub state: Arc<WorkerState>,
}

type DecodeStream = Pin<Box<dyn Stream<Item = Result<v1::DecodeResponse, Status>> + Send>>;
type PullStream = Pin<Box<dyn Stream<Item = Result<v1::KvChunk, Status>> + Send>>;

#[tonic::async_trait]
impl v1::decode_worker_server::DecodeWorker for DecodeService {
    type DecodeStream = DecodeStream;

    async fn decode(
        &self,
        request: tonic::Request<v1::DecodeRequest>,
    ) -> Result<Response<DecodeStream>, Status> {
        let deadline = duet_proto::deadline(&request).into_std();
        let req = request.into_inner();
        let state = self.state.clone();
        let engine = &state.engine;
        let (params, stop) = check(&req, engine.info())?;
        // Off the engine thread, before the request is anywhere near it.
        let grammar = engine.compile(&params).await?;
        let id = engine.next_id();
        // Frees whatever the request holds on the engine thread once its stream goes away
        // (finished, failed, or dropped by a cancelling client).
        let guard = engine.cancel_on_drop(id);
        let (events, rx) = mpsc::unbounded_channel();
        let resumed = Resumed {
            generated: req.already_generated as usize,
            sent_text_bytes: req.already_sent_text_bytes as usize,
        };
        let received = Instant::now();
        let request = Request {
            id,
            prompt: req.prompt_token_ids.clone(),
            resumed,
            cache_salt: req.cache_salt.clone(),
            params,
            grammar,
            stop,
            kv_out: None,
            events,
            received,
        };
        let plan = accepted_plan(
            req.plan.clone().unwrap_or_default(),
            &state.prefill_workers,
            engine.counters(),
        );
        // A prefix a peer holds is pulled first, where the router expects that to beat
        // computing it; whatever the pull's outcome, the request goes on.
        if let Some(source) = req.pull.as_ref().filter(|_| state.peer_pull)
            && resumed.generated == 0
        {
            crate::peer_pull::pull_prefix(&state, &req, source, id, deadline).await;
        }
        // A resumed request (failover) is recomputed here: its prompt includes generated tokens
        // whose sampling state only this worker's engine can rebuild.
        let report = if plan.local || plan.prefill_workers.is_empty() || resumed.generated > 0 {
            remote_prefill::prefill_here(&state, request, PrefillReport::default())?
        } else {
            remote_prefill::run(&state, &req, &plan, request, deadline).await?
        };
        let counters = engine.counters();
        Counters::add(&counters.prompt_tokens, req.prompt_token_ids.len() as u64);
        Counters::add(&counters.requests_served, 1);
        let responses = Responses {
            prompt_tokens: req.prompt_token_ids.len() as u32 - req.already_generated,
            already_generated: req.already_generated,
            completion_tokens: 0,
            first_at: None,
            received,
            scheduled: None,
            report,
            decode_worker: state.identity.worker_id.clone(),
        };
        Ok(Response::new(stream(responses, rx, guard, state)))
    }
}

/// A request's sampling parameters, once it is checked against this worker.
fn check(
    req: &v1::DecodeRequest,
    info: &EngineInfo,
) -> Result<(SamplingParams, StopCriteria), WorkerError> {
    // A router that has not heard from any worker yet sends no fingerprint.
    if !req.model_fingerprint.is_empty() {
        info.wire
            .check_model("the router", &req.model_fingerprint)?;
    }
    let sampling = req
        .sampling
        .as_ref()
        .ok_or_else(|| WorkerError::InvalidArgument("sampling parameters are missing".into()))?;
    info.prompt_limits().check(&req.prompt_token_ids)?;
    Ok((SamplingParams::from(sampling), StopCriteria::from(sampling)))
}

/// A push over mutual TLS comes from the prefill worker it names: its certificate names one of
/// the addresses that worker is known at.
fn check_sender(
    leaf: &tonic::transport::CertificateDer<'_>,
    known: &KnownPeers,
    sender: &str,
) -> Result<(), duet_transfer::TransferError> {
    let addresses = known.addresses_of(sender);
    if addresses
        .iter()
        .any(|a| duet_proto::tls::certificate_names(leaf, a))
    {
        return Ok(());
    }
    Err(duet_transfer::TransferError::Forbidden(format!(
        "the push names prefill worker {sender:?}, but the sender's certificate names none of \
         the addresses it is known at ({addresses:?})"
    )))
}

/// The plan this worker carries out: the prefill workers of `plan` it accepts (a prefill card
/// of its cluster, or `--prefill`). Any other would have this worker send the prompt (and the
/// cluster token) to an address of the caller's choosing, and take KV from it, so it is never
/// asked. A plan left with none is prefilled here: counted and logged, never failed (a router
/// started with prefill workers this worker was not told of would otherwise fail every request
/// it planned remotely, failed-over streams included).
fn accepted_plan(
    plan: v1::PrefillPlan,
    known: &KnownPeers,
    counters: &Counters,
) -> v1::PrefillPlan {
    if plan.local {
        return plan;
    }
    let (accepted, refused): (Vec<_>, Vec<_>) = plan
        .prefill_workers
        .into_iter()
        .partition(|t| known.knows(&t.address, Some(&t.worker_id)));
    if !refused.is_empty() {
        let named: Vec<String> = refused
            .iter()
            .map(|t| format!("{:?} at {:?}", t.worker_id, t.address))
            .collect();
        let named = named.join(", ");
        match accepted.is_empty() {
            true => counters.fell_back_to_local_prefill(LocalFallback::RefusedPlan, &named),
            false => tracing::debug!(refused = named, "prefill workers left out of a plan"),
        }
    }
    v1::PrefillPlan {
        local: accepted.is_empty(),
        prefill_workers: accepted,
    }
}

fn saturating_u32(n: u64) -> u32 {
    n.try_into().unwrap_or(u32::MAX)
}

/// Turns a request's engine events into its response messages.
struct Responses {
    prompt_tokens: u32,
    already_generated: u32,
    completion_tokens: u32,
    first_at: Option<Instant>,
    /// When the request arrived, and when its first step was scheduled here (a prompt prefilled
    /// here: the end of its queueing).
    received: Instant,
    scheduled: Option<Instant>,
    report: PrefillReport,
    decode_worker: String,
}

impl Responses {
    /// The message for one generated token; the last one carries usage and timings.
    fn token(&mut self, out: StepOutput) -> v1::DecodeResponse {
        let first_at = *self.first_at.get_or_insert_with(Instant::now);
        self.completion_tokens += 1;
        let mut msg = v1::DecodeResponse {
            token_ids: vec![out.token.token],
            logprobs: out
                .token
                .logprobs
                .is_some()
                .then(|| v1::TokenLogprobs::from(&out.token))
                .into_iter()
                .collect(),
            text: out.text,
            ..Default::default()
        };
        if let Some(reason) = out.finish {
            msg.finish_reason = v1::FinishReason::from(reason) as i32;
            msg.error = out.error.unwrap_or_default();
            msg.usage = Some(v1::Usage {
                prompt_tokens: self.prompt_tokens,
                completion_tokens: self.completion_tokens + self.already_generated,
                cached_prompt_tokens: self.report.cached_tokens,
                decode_steps: saturating_u32(out.speculation.steps),
                draft_tokens: saturating_u32(out.speculation.draft_tokens),
                accepted_draft_tokens: saturating_u32(out.speculation.accepted_draft_tokens),
            });
            let r = &self.report;
            let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
            // Prefilled here: queued until its first step, then computed until its first token.
            let (queue_ms, prefill_ms) = match (&r.worker, self.scheduled) {
                (None, Some(scheduled)) => (
                    ms(scheduled.saturating_duration_since(self.received)),
                    ms(first_at.saturating_duration_since(scheduled)),
                ),
                _ => (r.queue_ms, r.prefill_ms),
            };
            msg.timings = Some(v1::Timings {
                queue_ms,
                prefill_ms,
                transfer_ms: r.transfer_ms,
                decode_ms: first_at.elapsed().as_secs_f64() * 1e3,
                prefill_worker: r
                    .worker
                    .clone()
                    .unwrap_or_else(|| self.decode_worker.clone()),
                decode_worker: self.decode_worker.clone(),
                prefill_local: r.worker.is_none(),
                prefill_retries: r.retries,
                ..Default::default()
            });
        }
        msg
    }
}

/// The response stream, fed by a task until the last token, a failure, or the client leaving
/// (then `guard` cancels the request); the task is the request's `decode` span.
fn stream(
    mut responses: Responses,
    mut events: mpsc::UnboundedReceiver<Event>,
    guard: duet_worker::CancelOnDrop,
    state: Arc<WorkerState>,
) -> DecodeStream {
    let (tx, rx) = mpsc::channel(64);
    let span = tracing::info_span!(
        "decode",
        gen_ai.usage.output_tokens = tracing::field::Empty,
        gen_ai.response.finish_reasons = tracing::field::Empty,
        ttft.queue_us = tracing::field::Empty,
        ttft.prefill_us = tracing::field::Empty,
        ttft.transfer_us = tracing::field::Empty,
    );
    let task = async move {
        let _guard = guard;
        while let Some(event) = events.recv().await {
            match event {
                Event::Admitted { cached_tokens } => {
                    let counters = state.engine.counters();
                    Counters::add(&counters.prefix_hit_tokens, cached_tokens as u64);
                    let cached = &mut responses.report.cached_tokens;
                    *cached = (*cached).max(cached_tokens as u32);
                }
                Event::Scheduled(at) => {
                    responses.scheduled.get_or_insert(at);
                }
                Event::Output(out) => {
                    let last = out.finish.is_some();
                    if let Some(reason) = out.finish {
                        let span = tracing::Span::current();
                        let tokens = i64::from(responses.completion_tokens) + 1;
                        span.record("gen_ai.usage.output_tokens", tokens);
                        span.record("gen_ai.response.finish_reasons", reason.as_str());
                    }
                    let msg = responses.token(out);
                    // The timings of the last response: the TTFT split, as the trace's too.
                    if let Some(t) = &msg.timings {
                        let span = tracing::Span::current();
                        let us = |ms: f64| (ms * 1e3).round() as i64;
                        span.record("ttft.queue_us", us(t.queue_ms));
                        span.record("ttft.prefill_us", us(t.prefill_ms));
                        span.record("ttft.transfer_us", us(t.transfer_ms));
                    }
                    if tx.send(Ok(msg)).await.is_err() || last {
                        return;
                    }
                }
                Event::Failed(e) => {
                    tracing::info!(error = %e, "decoding failed");
                    let _ = tx.send(Err(e.into())).await;
                    return;
                }
            }
        }
    };
    tokio::spawn(task.instrument(span));
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}

#[derive(Clone)]
pub struct TransferService {
    pub state: Arc<WorkerState>,
}

#[tonic::async_trait]
impl v1::kv_transfer_server::KvTransfer for TransferService {
    type PullStream = PullStream;

    async fn pull(
        &self,
        request: tonic::Request<v1::KvPullRequest>,
    ) -> Result<Response<PullStream>, Status> {
        let deadline = duet_proto::serve::deadline(&request).into_std();
        let chunks = crate::peer_pull::answer(&self.state, request.into_inner(), deadline).await?;
        Ok(Response::new(Box::pin(futures::stream::iter(
            chunks.into_iter().map(Ok),
        ))))
    }

    async fn push(
        &self,
        request: tonic::Request<Streaming<v1::KvChunk>>,
    ) -> Result<Response<v1::PushAck>, Status> {
        let engine = &self.state.engine;
        let mut transport = transport_name(v1::TransportKind::Grpc);
        let started = Instant::now();
        // With mutual TLS, the sender's certificate must name the address of the prefill worker
        // the header says sent it (and whose reservation key it must hold).
        let peer_certs = request.peer_certs();
        let ack = duet_transfer::grpc::receive(
            request.into_inner(),
            &engine.info().wire,
            engine,
            |header| {
                transport = transport_name(header.transport());
                match peer_certs.as_ref().and_then(|c| c.first()) {
                    Some(leaf) => {
                        check_sender(leaf, &self.state.prefill_workers, &header.sender_worker_id)
                    }
                    None => Ok(()),
                }
            },
        )
        .await
        .inspect_err(|e| {
            engine
                .counters()
                .transfer_failed(transport, Direction::In, e.reason())
        })?;
        // From the header's arrival to the last chunk written.
        engine.counters().transferred(
            transport,
            Direction::In,
            ack.bytes_received,
            started.elapsed().as_secs_f64(),
        );
        Ok(Response::new(ack))
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
        _: tonic::Request<v1::StatsRequest>,
    ) -> Result<Response<v1::StatsResponse>, Status> {
        let s = &self.state;
        let role = s.role.role();
        let mut stats = s
            .identity
            .stats(duet_worker::role_switch::worker_role(role), &s.engine);
        if role == Role::Decode {
            stats.accepted_prefill_workers = Some(v1::AcceptedPrefillWorkers {
                addresses: s.prefill_workers.addresses(),
            });
        }
        stats.kv_peer_pull = s.peer_pull;
        stats.role_switch = s.role_switch;
        Ok(Response::new(stats))
    }
}
