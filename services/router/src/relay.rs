//! Relaying one admitted request: call `DecodeWorker/Decode` with the request's remaining
//! deadline and pass every message on to the client. When the client goes away the task ends,
//! dropping the upstream call (tonic cancels it). When the decode stream fails before its final
//! message the request is re-submitted to another decode worker with the tokens already
//! streamed (`already_generated`, `already_sent_text_bytes`, same seed), and relaying goes on.
//! A stream also fails over when its worker stops answering health checks (a hung process), and
//! when, after its first message, none comes for the decode idle timeout.
//!
//! It runs in the request's span (see [`crate::door::RouterState::start`]): each routing
//! decision in a `route` span, each failover an event; the outcome is recorded as GenAI
//! attributes.

use std::sync::Arc;
use std::time::Duration;

use duet_proto::v1;
use duet_proto::v1::decode_worker_client::DecodeWorkerClient;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::{Code, Request, Status};
use tracing::Instrument;

use crate::error::{RouterError, is_retryable};
use crate::metrics::{Outcome, RouterMetrics, error_type};
use crate::routing::{Pools, RouteRequest};
use crate::validate::ValidRequest;
use crate::worker::{Planned, Worker};
use duet_routing::NoRoute;

/// What relaying needs: the pools it routes over, the metrics it counts in, and how long it
/// waits.
#[derive(Debug)]
pub(crate) struct Relay {
    pub pools: Pools,
    pub metrics: RouterMetrics,
    /// How long a request waits for a routable decode worker (within its deadline).
    pub wait_for_worker: Duration,
    /// How long a running decode stream may go without a message before it fails over.
    pub decode_idle_timeout: Duration,
}

impl Relay {
    /// Until when a request that finds no routable decode worker, starting to wait now, waits
    /// for one: the bound, within the request's deadline.
    pub fn worker_wait_ends(&self, deadline: Instant) -> Instant {
        (Instant::now() + self.wait_for_worker).min(deadline)
    }
}

/// One admitted request.
pub(crate) struct Job {
    pub request_id: String,
    pub valid: ValidRequest,
    pub start: Instant,
    pub deadline: Instant,
}

/// A message for the client's stream (an error ends it).
pub type Item = Result<v1::GenerateResponse, RouterError>;

/// Drives one request until it finishes, fails, passes its deadline or the client leaves.
pub(crate) async fn relay(state: Arc<Relay>, job: Job, tx: mpsc::Sender<Item>) {
    let mut progress = Progress::default();
    state.metrics.received();
    let result = tokio::select! {
        r = tokio::time::timeout_at(job.deadline, run(&state, &job, &tx, &mut progress)) => {
            Some(r.unwrap_or_else(|_| Err(RouterError::DeadlineExceeded(job.deadline - job.start))))
        }
        () = tx.closed() => None,
    };
    let metrics = &state.metrics;
    let span = tracing::Span::current();
    span.record(
        "gen_ai.usage.output_tokens",
        progress.generated.len() as i64,
    );
    match result {
        Some(Ok(())) if !progress.finished => {
            tracing::debug!(request_id = %job.request_id, "client went away; request cancelled");
            span.record("error.type", error_type(Code::Cancelled));
            metrics.finished(Outcome::Cancelled);
        }
        Some(Ok(())) => {
            metrics.finished(Outcome::Success);
            metrics.completed(
                job.start,
                progress.first_token_at,
                job.valid.prompt.len(),
                progress.generated.len(),
                progress.timings.as_ref(),
            );
        }
        Some(Err(e)) => {
            tracing::info!(request_id = %job.request_id, error = %e, "request failed");
            span.record("error.type", error_type(e.code()));
            metrics.finished(Outcome::Failed(e.code()));
            let _ = tx.send(Err(e)).await;
        }
        None => {
            tracing::debug!(request_id = %job.request_id, "client went away; request cancelled");
            span.record("error.type", error_type(Code::Cancelled));
            metrics.finished(Outcome::Cancelled);
        }
    }
}

/// What the client has been sent so far, carried across failovers.
#[derive(Default)]
struct Progress {
    generated: Vec<u32>,
    sent_text_bytes: u64,
    first_token_at: Option<Instant>,
    last_token_at: Option<Instant>,
    failovers: u32,
    /// Cached prompt tokens the final message reported.
    cached_reported: Option<u32>,
    /// The final message's timings.
    timings: Option<v1::Timings>,
    /// The client was sent the final message.
    finished: bool,
}

/// How one decode attempt ended.
enum Attempt {
    /// The final message was relayed, or the client went away.
    Done,
    Failed(Status),
}

/// Calls decode workers (failing over) and relays their messages to `tx`.
async fn run(
    state: &Relay,
    job: &Job,
    tx: &mpsc::Sender<Item>,
    progress: &mut Progress,
) -> Result<(), RouterError> {
    let mut tried: Vec<String> = Vec::new();
    let mut last: Option<(String, Status)> = None;
    loop {
        let mut tokens = job.valid.prompt.clone();
        tokens.extend_from_slice(&progress.generated);
        // None while no decode worker is routable, so that it is waited for.
        let pick = |pools: &Pools| {
            let routed = pools.route(RouteRequest {
                tokens: &tokens,
                cache_salt: &job.valid.cache_salt,
                exclude: &tried,
                deadline_left: job.deadline.saturating_duration_since(Instant::now()),
            });
            (!matches!(routed, Err(NoRoute::NoDecodeWorker))).then_some(routed)
        };
        let span = tracing::info_span!(
            "route",
            decision = tracing::field::Empty,
            decode_worker = tracing::field::Empty,
            predicted_cached_tokens = tracing::field::Empty,
        );
        // No worker left to fail over to: wait a while for one to come back.
        let routed = match span.in_scope(|| pick(&state.pools)) {
            Some(routed) => Some(routed),
            None => {
                state
                    .pools
                    .wait_for(state.worker_wait_ends(job.deadline), pick)
                    .instrument(span.clone())
                    .await
            }
        };
        if let Some(Ok(route)) = &routed {
            span.record("decision", route.decision.name());
            span.record("decode_worker", tracing::field::display(route.decode.id()));
            span.record(
                "predicted_cached_tokens",
                i64::from(route.predicted_cached_tokens),
            );
        }
        drop(span);
        let route = match routed {
            Some(Ok(route)) => route,
            Some(Err(NoRoute::DeadlineTooShort { alone, left })) => {
                return Err(RouterError::DeadlineTooShort { alone, left });
            }
            Some(Err(NoRoute::PastDeadline { estimated, left })) => {
                return Err(RouterError::TtftPastDeadline { estimated, left });
            }
            Some(Err(NoRoute::NoDecodeWorker)) | None => {
                return Err(match last {
                    Some((worker, status)) => RouterError::AllDecodeWorkersFailed {
                        attempts: tried.len(),
                        last: format!("{worker}: {}", status.message()),
                        last_code: status.code(),
                    },
                    None => RouterError::NoDecodeWorker(None),
                });
            }
        };
        tried.push(route.decode.address.clone());
        let worker = route.decode.clone();
        let worker_id = worker.id();
        let _busy = worker.begin();
        let prompt_tokens = tokens.len() as u32;
        let call = progress.decode_request(job, tokens, route.plan, route.pull, route.fingerprint);
        tracing::debug!(
            request_id = %job.request_id,
            worker = %worker_id,
            already_generated = progress.generated.len(),
            decision = route.decision.name(),
            predicted_cached_tokens = route.predicted_cached_tokens,
            estimated_ttft_ms = route.estimated_ttft.as_millis() as u64,
            "decode attempt"
        );
        let to = Target {
            worker: &worker,
            worker_id: &worker_id,
            planned: route.planned,
        };
        let attempted = attempt(state, to, call, job, progress, tx);
        let failure = match attempted.await {
            Attempt::Done => {
                if let Some(actual) = progress.cached_reported {
                    state.pools.decisions.finished(
                        prompt_tokens,
                        route.predicted_cached_tokens,
                        actual,
                    );
                    if let Some(p) = route
                        .pending
                        .filter(|_| actual < route.predicted_cached_tokens)
                    {
                        state.pools.index.missed(p.slot, p.first_block, p.id);
                    }
                }
                return Ok(());
            }
            Attempt::Failed(status) => status,
        };
        // A call cut short by the request's own deadline failed the request, not the worker
        // (tonic reports its client-side timeout as CANCELLED).
        if Instant::now() >= job.deadline {
            return Err(RouterError::DeadlineExceeded(job.deadline - job.start));
        }
        if !is_retryable(&failure) {
            return Err(RouterError::Worker {
                worker: worker_id,
                status: failure,
            });
        }
        tracing::warn!(
            request_id = %job.request_id,
            worker = %worker_id,
            code = ?failure.code(),
            error = failure.message(),
            streamed = progress.generated.len(),
            "decode attempt failed; failing over"
        );
        if failure.code() != Code::ResourceExhausted {
            worker.mark_failed(failure.message());
        }
        progress.failovers += 1;
        state.metrics.failed_over();
        if progress.generated.len() >= job.valid.sampling.max_tokens as usize {
            // Every token was streamed; only the final message was lost.
            progress.finished = tx
                .send(Ok(progress.lost_final(job, worker_id)))
                .await
                .is_ok();
            return Ok(());
        }
        last = Some((worker_id, failure));
    }
}

/// The decode worker an attempt calls, and the prefill it planned for it.
struct Target<'a> {
    worker: &'a Worker,
    worker_id: &'a str,
    planned: Planned,
}

/// How often a waiting attempt looks whether its worker stopped answering health checks.
const ROTATION_CHECK: Duration = Duration::from_millis(50);

/// `next`, while `worker` keeps answering health checks and, with `idle` set, for at most `idle`.
async fn bounded<T>(
    worker: &Worker,
    idle: Option<Duration>,
    next: impl Future<Output = Result<T, Status>>,
) -> Result<T, Status> {
    let give_up = idle.map(|d| (Instant::now() + d, d));
    tokio::pin!(next);
    loop {
        let check = Instant::now() + ROTATION_CHECK;
        let wake = give_up.map_or(check, |(at, _)| at.min(check));
        if let Ok(out) = tokio::time::timeout_at(wake, &mut next).await {
            return out;
        }
        if let Some((at, d)) = give_up
            && Instant::now() >= at
        {
            return Err(Status::unavailable(format!(
                "no message from the decode worker for {} ms",
                d.as_millis()
            )));
        }
        if worker.status().unresponsive() {
            return Err(Status::unavailable(
                "the decode worker stopped answering health checks",
            ));
        }
    }
}

/// One call to a decode worker, relayed until it ends. Before the first message (which may wait
/// for a prefill) the call lasts while the worker answers health checks; after it, each message
/// must come within `idle_timeout`. The prefill the route planned stops counting at the first
/// message (the prompt is computed) or when the attempt ends.
async fn attempt(
    state: &Relay,
    to: Target<'_>,
    call: Request<v1::DecodeRequest>,
    job: &Job,
    progress: &mut Progress,
    tx: &mpsc::Sender<Item>,
) -> Attempt {
    let Target {
        worker,
        worker_id,
        planned,
    } = to;
    let (idle_timeout, metrics) = (state.decode_idle_timeout, &state.metrics);
    let mut planned = Some(planned);
    let mut client = DecodeWorkerClient::new(worker.channel())
        .max_decoding_message_size(duet_proto::MAX_MESSAGE_BYTES);
    let mut stream = match bounded(worker, None, client.decode(call)).await {
        Ok(response) => response.into_inner(),
        Err(status) => return Attempt::Failed(status),
    };
    let mut idle = None;
    loop {
        let next = bounded(worker, idle, stream.message()).await;
        idle = Some(idle_timeout);
        let msg = match next {
            Ok(Some(msg)) => msg,
            Ok(None) => {
                return Attempt::Failed(Status::unavailable(
                    "the decode stream ended without a final message",
                ));
            }
            Err(status) => return Attempt::Failed(status),
        };
        planned.take();
        let (out, finished) = progress.relayed(job, msg, worker_id, metrics);
        // A closed channel: the client went away.
        if tx.send(Ok(out)).await.is_err() {
            return Attempt::Done;
        }
        if finished {
            progress.finished = true;
            return Attempt::Done;
        }
    }
}

impl Progress {
    /// The call that resumes the request from here (`tokens`: the prompt and what was
    /// generated) on the routed worker.
    fn decode_request(
        &self,
        job: &Job,
        tokens: Vec<u32>,
        plan: v1::PrefillPlan,
        pull: Option<v1::KvPullSource>,
        fingerprint: String,
    ) -> Request<v1::DecodeRequest> {
        let mut call = Request::new(v1::DecodeRequest {
            request_id: job.request_id.clone(),
            prompt_token_ids: tokens,
            sampling: Some(job.valid.sampling.clone()),
            plan: Some(plan),
            already_generated: self.generated.len() as u32,
            already_sent_text_bytes: self.sent_text_bytes,
            cache_salt: job.valid.cache_salt.clone(),
            model_fingerprint: fingerprint,
            pull,
        });
        call.set_timeout(job.deadline.saturating_duration_since(Instant::now()));
        call
    }

    /// Records a decode worker's message and turns it into the client's; `true` when it is the
    /// final one.
    fn relayed(
        &mut self,
        job: &Job,
        msg: v1::DecodeResponse,
        worker_id: &str,
        metrics: &RouterMetrics,
    ) -> (v1::GenerateResponse, bool) {
        let finished = msg.finish_reason != v1::FinishReason::Unspecified as i32;
        self.generated.extend_from_slice(&msg.token_ids);
        self.sent_text_bytes += msg.text.len() as u64;
        if !msg.token_ids.is_empty() {
            let now = Instant::now();
            match self.last_token_at {
                Some(last) => metrics.next_token(now - last),
                None => metrics.first_token(now - job.start),
            }
            self.first_token_at.get_or_insert(now);
            self.last_token_at = Some(now);
        }
        let mut out = v1::GenerateResponse {
            request_id: job.request_id.clone(),
            text: msg.text,
            token_ids: msg.token_ids,
            logprobs: msg.logprobs,
            finish_reason: msg.finish_reason,
            usage: None,
            timings: None,
            error: msg.error,
        };
        if finished {
            let worker_usage = msg.usage.unwrap_or_default();
            self.cached_reported = Some(worker_usage.cached_prompt_tokens);
            out.usage = Some(self.usage(job, &worker_usage));
            let mut t = msg.timings.unwrap_or_default();
            self.stamp(job, &mut t);
            if t.decode_worker.is_empty() {
                t.decode_worker = worker_id.to_string();
            }
            self.timings = Some(t.clone());
            out.timings = Some(t);
            tracing::Span::current().record("gen_ai.response.finish_reasons", finish_reason(&out));
        }
        (out, finished)
    }

    /// The final message when every token was streamed but the worker's own final message was
    /// lost.
    fn lost_final(&self, job: &Job, worker_id: String) -> v1::GenerateResponse {
        let mut timings = v1::Timings {
            decode_worker: worker_id,
            ..Default::default()
        };
        self.stamp(job, &mut timings);
        v1::GenerateResponse {
            request_id: job.request_id.clone(),
            finish_reason: v1::FinishReason::Length as i32,
            usage: Some(self.usage(job, &v1::Usage::default())),
            timings: Some(timings),
            ..Default::default()
        }
    }

    /// The request's usage: the router's own counts, and what the worker that finished it
    /// reported (`worker`: its prefix-cache hits and speculation).
    fn usage(&self, job: &Job, worker: &v1::Usage) -> v1::Usage {
        let prompt = job.valid.prompt.len() as u32;
        v1::Usage {
            prompt_tokens: prompt,
            completion_tokens: self.generated.len() as u32,
            cached_prompt_tokens: worker.cached_prompt_tokens.min(prompt),
            decode_steps: worker.decode_steps,
            draft_tokens: worker.draft_tokens,
            accepted_draft_tokens: worker.accepted_draft_tokens,
        }
    }

    /// The router's own timings: time to first token, total time, failovers.
    fn stamp(&self, job: &Job, t: &mut v1::Timings) {
        let now = Instant::now();
        t.ttft_ms = ms(self.first_token_at.unwrap_or(now) - job.start);
        t.total_ms = ms(now - job.start);
        t.decode_failovers = self.failovers;
    }
}

/// A message's finish reason as clients name it (OpenAI's `finish_reason`, the GenAI trace
/// attribute): `None` until the last message.
pub fn finish_reason(m: &v1::GenerateResponse) -> Option<&'static str> {
    match v1::FinishReason::try_from(m.finish_reason).unwrap_or_default() {
        v1::FinishReason::Unspecified => None,
        v1::FinishReason::Stop => Some("stop"),
        v1::FinishReason::Length => Some("length"),
        v1::FinishReason::Aborted => Some("abort"),
        v1::FinishReason::Error => Some("error"),
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
