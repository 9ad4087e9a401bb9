//! Prefill on another worker: reserve KV for the prompt here, ask the plan's prefill workers in
//! order to compute it and push its KV into the reservation, then activate it with their first
//! token; when none succeeds, prefill here.
//!
//! Each attempt gets at most `--prefill-timeout-ms` and an equal share of what is left of the
//! deadline (shared with the attempts after it and the local prefill), so a hung prefill worker
//! costs one attempt, never the whole deadline. Binding the reservation to an attempt renews its
//! lease past the attempt's end, so a prompt queued behind others keeps its KV; a reservation
//! gone anyway (reclaimed, or never made for lack of room) is made afresh for the next attempt.

use std::sync::Arc;
use std::time::{Duration, Instant};

use duet_proto::v1;
use duet_transfer::ReservationKey;
use duet_worker::stats::{Counters, LocalFallback};
use duet_worker::{Command, Request, ReservationInfo, WorkerError};
use tonic::Status;
use tracing::Instrument;

use crate::service::WorkerState;

/// Where a request's time went before decoding started.
#[derive(Clone, Debug, Default)]
pub struct PrefillReport {
    pub queue_ms: f64,
    pub prefill_ms: f64,
    pub transfer_ms: f64,
    /// The prefill worker that computed the prompt; `None`: this worker did.
    pub worker: Option<String>,
    pub cached_tokens: u32,
    pub retries: u32,
}

/// Hands the request to this worker's engine to prefill here.
pub fn prefill_here(
    state: &WorkerState,
    request: Request,
    report: PrefillReport,
) -> Result<PrefillReport, WorkerError> {
    // Decode admission is the KV cache's (the engine preempts), not a token queue.
    state.engine.submit(request, u64::MAX)?;
    Ok(PrefillReport {
        worker: None,
        ..report
    })
}

/// Prefills `request` on the plan's workers (see the module docs).
pub async fn run(
    state: &Arc<WorkerState>,
    req: &v1::DecodeRequest,
    plan: &v1::PrefillPlan,
    request: Request,
    deadline: Instant,
) -> Result<PrefillReport, WorkerError> {
    let started = Instant::now();
    let counters = state.engine.counters();
    let Some(mut reservation) = reserve(state, &request).await? else {
        counters.fell_back_to_local_prefill(LocalFallback::NoReservation, "");
        return prefill_here(state, request, PrefillReport::default());
    };
    let id = request.id;
    // Until the prefill worker that answers is called: reserving, binding, earlier attempts.
    let mut queue_ms = started.elapsed().as_secs_f64() * 1e3;
    let block_size = state.engine.info().wire.layout.block_size;
    let mut retries = 0;
    // Why the last attempt failed (none made: the deadline left no time for one).
    let mut failed = (
        LocalFallback::Unreachable,
        String::from("no time left for an attempt"),
    );
    for (n, target) in plan.prefill_workers.iter().enumerate() {
        // This attempt, the ones after it and the local prefill share what is left.
        let shares = (plan.prefill_workers.len() - n + 1) as u32;
        let timeout = state
            .prefill_timeout
            .min(deadline.saturating_duration_since(Instant::now()) / shares);
        if timeout.is_zero() {
            break;
        }
        // Each attempt gets its own key, made for this prefill worker alone: an earlier
        // attempt that wakes up late can no longer write into the reservation.
        let bind = |prefill_worker: String| {
            state.engine.ask(move |reply| Command::Bind {
                id,
                prefill_worker,
                attempt: timeout,
                reply,
            })
        };
        let key = match bind(target.worker_id.clone()).await? {
            Some(key) => key,
            None => {
                tracing::warn!(
                    request = id,
                    "the KV reservation was reclaimed; reserving again"
                );
                let Some(fresh) = reserve(state, &request).await? else {
                    failed = (LocalFallback::NoReservation, String::new());
                    break;
                };
                reservation = fresh;
                bind(target.worker_id.clone()).await?.ok_or_else(|| {
                    WorkerError::Internal("a fresh KV reservation vanished".into())
                })?
            }
        };
        let cached_here = (reservation.cached_blocks * block_size) as u32;
        let msg = prefill_request(state, req, key, &reservation);
        queue_ms = started.elapsed().as_secs_f64() * 1e3;
        let fence = state.fence(id, state.kv_transport, Instant::now() + timeout);
        match call(&state.channels, &target.address, msg, timeout).await {
            Ok(resp) => {
                state.lift_fence(id, fence);
                let first = resp.first_token.as_ref().ok_or_else(|| {
                    WorkerError::Internal("prefill returned no first token".into())
                })?;
                let want_logprobs = req.sampling.as_ref().is_some_and(|s| s.logprobs > 0);
                let first = duet_proto::convert::sampled(first, want_logprobs);
                let cached_tokens = cached_here.max(resp.cached_tokens);
                Counters::add(
                    &state.engine.counters().prefix_hit_tokens,
                    cached_tokens as u64,
                );
                state.engine.send(Command::Activate { request, first })?;
                return Ok(PrefillReport {
                    queue_ms: queue_ms + resp.queue_ms,
                    prefill_ms: resp.prefill_ms,
                    transfer_ms: resp.transfer_ms,
                    worker: Some(resp.worker_id),
                    cached_tokens,
                    retries,
                });
            }
            Err(status) => {
                retries += 1;
                tracing::warn!(request = id, worker = %target.address, %status, "prefill attempt failed; trying the next");
                failed = (
                    LocalFallback::of(status.code()),
                    format!("{}: {}", target.address, status.message()),
                );
            }
        }
    }
    counters.fell_back_to_local_prefill(failed.0, &failed.1);
    // No prefill worker succeeded: the reservation is released and the prompt computed here.
    prefill_here(
        state,
        request,
        PrefillReport {
            queue_ms,
            retries,
            ..PrefillReport::default()
        },
    )
}

/// Reserves KV for `request`'s prompt, in a `decode_admission` span: KV arrives only where
/// memory is already held. `None` when there is no room (the caller prefills here). (The future
/// holds copies, not the request, which is not `Sync`.)
fn reserve<'a>(
    state: &'a WorkerState,
    request: &Request,
) -> impl Future<Output = Result<Option<ReservationInfo>, WorkerError>> + 'a {
    let (id, tokens, cache_salt) = (
        request.id,
        request.prompt.clone(),
        request.cache_salt.clone(),
    );
    let span = tracing::info_span!("decode_admission", prompt_tokens = tokens.len() as i64);
    async move {
        let reservation = state
            .engine
            .ask(|reply| Command::Reserve {
                id,
                tokens,
                cache_salt,
                reply,
            })
            .await?;
        match reservation {
            Ok(r) => Ok(Some(r)),
            Err(e) => {
                tracing::warn!(request = id, error = %e, "no KV room for a transfer; prefilling here");
                Ok(None)
            }
        }
    }
    .instrument(span)
}

fn prefill_request(
    state: &WorkerState,
    req: &v1::DecodeRequest,
    key: ReservationKey,
    reservation: &ReservationInfo,
) -> v1::PrefillRequest {
    v1::PrefillRequest {
        request_id: req.request_id.clone(),
        token_ids: req.prompt_token_ids.clone(),
        sampling: req.sampling.clone(),
        dest: Some(v1::KvDestination {
            transfer_address: state.advertise.clone(),
            reservation_id: key.to_wire(),
            block_ids: reservation.block_ids.clone(),
            cached_blocks: reservation.cached_blocks as u32,
            transport: state.kv_transport as i32,
            transport_params: state.kv_transport_params.clone(),
            block_size: state.engine.info().wire.layout.block_size as u32,
            decode_worker_id: state.identity.worker_id.clone(),
        }),
        model_fingerprint: state.engine.info().wire.fingerprint.clone(),
        cache_salt: req.cache_salt.clone(),
        already_generated: req.already_generated,
    }
}

async fn call(
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
    let mut request = tonic::Request::new(msg);
    request.set_timeout(timeout);
    // The attempt's timeout also bounds connecting, which the call's own deadline does not.
    tokio::time::timeout(timeout, client.prefill(request))
        .await
        .map_err(|_| Status::deadline_exceeded(format!("prefill at {address} timed out")))?
        .map(|r| r.into_inner())
}
