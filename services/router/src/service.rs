//! The public `duet.v1.Generation` service: Generate (streamed relay of a decode worker's
//! stream, with failover), Complete (the same, gathered into one message), Tokenize and Info.
//!
//! Each Generate/Complete call is validated, admitted against the in-flight limit, then driven
//! by one task that calls `DecodeWorker/Decode` with the request's remaining deadline and
//! relays every message into a small bounded channel read by the client's stream. When the
//! client goes away the task ends, dropping the upstream call (tonic cancels it). When the
//! decode stream fails before its final message the task re-submits the request to another
//! decode worker with the tokens already streamed (`already_generated`,
//! `already_sent_text_bytes`, same seed) and keeps relaying.

use std::sync::Arc;
use std::time::Duration;

use duet_proto::v1;
use duet_proto::v1::decode_worker_client::DecodeWorkerClient;
use duet_proto::v1::generation_server::Generation;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request, Response, Status};

use crate::error::{RouterError, is_retryable};
use crate::routing::Pools;
use crate::validate::{PromptModel, ValidRequest, random_u64};

/// Tokens per KV block reported by Info before any worker reported its own.
const DEFAULT_BLOCK_SIZE: u32 = 16;

/// Messages buffered between the decode stream and a slow client.
const RELAY_BUFFER: usize = 32;

/// Everything the service shares between calls.
#[derive(Debug)]
pub struct RouterState {
    pub model: PromptModel,
    /// Shown by Info (the model path's file stem).
    pub model_name: String,
    pub pools: Pools,
    /// Uncached prompts of at most this many tokens are prefilled on the decode worker.
    pub local_prefill_threshold: u32,
}

impl RouterState {
    pub fn new(
        model: PromptModel,
        model_name: String,
        pools: Pools,
        local_prefill_threshold: u32,
    ) -> Self {
        Self {
            model,
            model_name,
            pools,
            local_prefill_threshold,
        }
    }
}

/// The `Generation` service.
#[derive(Clone, Debug)]
pub struct GenerationService {
    state: Arc<RouterState>,
}

impl GenerationService {
    pub fn new(state: Arc<RouterState>) -> Self {
        Self { state }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// One admitted request.
struct Job {
    request_id: String,
    valid: ValidRequest,
    start: Instant,
    deadline: Instant,
}

type Item = Result<v1::GenerateResponse, Status>;

impl GenerationService {
    /// Validates and admits a request and starts relaying it; the receiver yields the client's
    /// messages (an error ends it).
    fn start(
        &self,
        req: Request<v1::GenerateRequest>,
    ) -> Result<mpsc::Receiver<Item>, RouterError> {
        let start = Instant::now();
        let deadline = duet_proto::deadline(&req);
        let req = req.into_inner();
        let valid = self.state.model.validate(&req, random_u64)?;
        if !self.state.pools.any_decode_routable() {
            return Err(RouterError::NoDecodeWorker(None));
        }
        let request_id = if req.request_id.is_empty() {
            format!("req-{:016x}", random_u64())
        } else {
            req.request_id
        };
        let job = Job {
            request_id,
            valid,
            start,
            deadline,
        };
        tracing::debug!(
            request_id = %job.request_id,
            prompt_tokens = job.valid.prompt.len(),
            max_tokens = job.valid.sampling.max_tokens,
            "admitted"
        );
        let (tx, rx) = mpsc::channel(RELAY_BUFFER);
        tokio::spawn(relay(self.state.clone(), job, tx));
        Ok(rx)
    }
}

/// Drives one request until it finishes, fails, passes its deadline or the client leaves.
async fn relay(state: Arc<RouterState>, job: Job, tx: mpsc::Sender<Item>) {
    let result = tokio::select! {
        r = tokio::time::timeout_at(job.deadline, run(&state, &job, &tx)) => {
            r.unwrap_or_else(|_| Err(RouterError::DeadlineExceeded(job.deadline - job.start)))
        }
        () = tx.closed() => {
            tracing::debug!(request_id = %job.request_id, "client went away; request cancelled");
            return;
        }
    };
    if let Err(e) = result {
        tracing::info!(request_id = %job.request_id, error = %e, "request failed");
        let _ = tx.send(Err(e.into())).await;
    }
}

/// Calls decode workers (failing over) and relays their messages to `tx`.
async fn run(state: &RouterState, job: &Job, tx: &mpsc::Sender<Item>) -> Result<(), RouterError> {
    let prompt = &job.valid.prompt;
    let max_tokens = job.valid.sampling.max_tokens as usize;
    let mut generated: Vec<u32> = Vec::new();
    let mut sent_text_bytes: u64 = 0;
    let mut tried: Vec<usize> = Vec::new();
    let mut failures: u32 = 0;
    let mut last: Option<(String, Status)> = None;
    let mut first_token_at: Option<Instant> = None;
    let usage = |generated: usize, cached: u32| v1::Usage {
        prompt_tokens: prompt.len() as u32,
        completion_tokens: generated as u32,
        cached_prompt_tokens: cached.min(prompt.len() as u32),
    };
    loop {
        let Some(route) = state.pools.route(
            prompt.len() + generated.len(),
            state.local_prefill_threshold,
            &tried,
        ) else {
            return Err(match last {
                Some((worker, status)) => RouterError::AllDecodeWorkersFailed {
                    attempts: tried.len(),
                    last: format!("{worker}: {}", status.message()),
                    last_code: status.code(),
                },
                None => RouterError::NoDecodeWorker(None),
            });
        };
        tried.push(route.decode_index);
        let worker = route.decode.clone();
        let worker_id = worker.id();
        let _busy = worker.begin();
        let mut tokens = prompt.clone();
        tokens.extend_from_slice(&generated);
        let mut call = Request::new(v1::DecodeRequest {
            request_id: job.request_id.clone(),
            prompt_token_ids: tokens,
            sampling: Some(job.valid.sampling.clone()),
            plan: Some(route.plan),
            already_generated: generated.len() as u32,
            already_sent_text_bytes: sent_text_bytes,
            cache_salt: job.valid.cache_salt.clone(),
            model_fingerprint: route.fingerprint,
        });
        call.set_timeout(job.deadline.saturating_duration_since(Instant::now()));
        tracing::debug!(
            request_id = %job.request_id,
            worker = %worker_id,
            already_generated = generated.len(),
            "decode attempt"
        );
        let mut client = DecodeWorkerClient::new(worker.channel())
            .max_decoding_message_size(duet_proto::MAX_MESSAGE_BYTES);
        let failure: Status = match client.decode(call).await {
            Err(s) => s,
            Ok(resp) => {
                let mut stream = resp.into_inner();
                loop {
                    let msg = match stream.message().await {
                        Ok(Some(msg)) => msg,
                        Ok(None) => {
                            break Status::unavailable(
                                "the decode stream ended without a final message",
                            );
                        }
                        Err(s) => break s,
                    };
                    let finished = msg.finish_reason != v1::FinishReason::Unspecified as i32;
                    generated.extend_from_slice(&msg.token_ids);
                    sent_text_bytes += msg.text.len() as u64;
                    if first_token_at.is_none() && !msg.token_ids.is_empty() {
                        first_token_at = Some(Instant::now());
                    }
                    let mut out = v1::GenerateResponse {
                        request_id: job.request_id.clone(),
                        text: msg.text,
                        token_ids: msg.token_ids,
                        logprobs: msg.logprobs,
                        finish_reason: msg.finish_reason,
                        usage: None,
                        timings: None,
                    };
                    if finished {
                        let cached = msg.usage.map(|u| u.cached_prompt_tokens).unwrap_or(0);
                        out.usage = Some(usage(generated.len(), cached));
                        let mut t = msg.timings.unwrap_or_default();
                        let now = Instant::now();
                        t.ttft_ms = ms(first_token_at.unwrap_or(now) - job.start);
                        t.total_ms = ms(now - job.start);
                        t.decode_failovers = failures;
                        if t.decode_worker.is_empty() {
                            t.decode_worker = worker_id.clone();
                        }
                        out.timings = Some(t);
                        let _ = tx.send(Ok(out)).await;
                        return Ok(());
                    }
                    if tx.send(Ok(out)).await.is_err() {
                        return Ok(()); // the client went away
                    }
                }
            }
        };
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
            streamed = generated.len(),
            "decode attempt failed; failing over"
        );
        if failure.code() != Code::ResourceExhausted {
            worker.mark_failed(failure.message());
        }
        failures += 1;
        last = Some((worker_id.clone(), failure));
        if generated.len() >= max_tokens {
            // Every token was streamed; only the final message was lost.
            let now = Instant::now();
            let out = v1::GenerateResponse {
                request_id: job.request_id.clone(),
                finish_reason: v1::FinishReason::Length as i32,
                usage: Some(usage(generated.len(), 0)),
                timings: Some(v1::Timings {
                    ttft_ms: ms(first_token_at.unwrap_or(now) - job.start),
                    total_ms: ms(now - job.start),
                    decode_worker: worker_id,
                    decode_failovers: failures,
                    ..Default::default()
                }),
                ..Default::default()
            };
            let _ = tx.send(Ok(out)).await;
            return Ok(());
        }
    }
}

#[tonic::async_trait]
impl Generation for GenerationService {
    type GenerateStream = ReceiverStream<Item>;

    async fn generate(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let rx = self.start(request)?;
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn complete(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<v1::GenerateResponse>, Status> {
        let mut rx = self.start(request)?;
        let mut whole = v1::GenerateResponse::default();
        while let Some(item) = rx.recv().await {
            let m = item?;
            whole.request_id = m.request_id;
            whole.text.push_str(&m.text);
            whole.token_ids.extend(m.token_ids);
            whole.logprobs.extend(m.logprobs);
            if m.finish_reason != v1::FinishReason::Unspecified as i32 {
                whole.finish_reason = m.finish_reason;
                whole.usage = m.usage;
                whole.timings = m.timings;
                return Ok(Response::new(whole));
            }
        }
        Err(RouterError::Internal("the generation ended without a final message".into()).into())
    }

    async fn tokenize(
        &self,
        request: Request<v1::TokenizeRequest>,
    ) -> Result<Response<v1::TokenizeResponse>, Status> {
        let r = request.into_inner();
        let model = &self.state.model;
        let ids = if r.messages.is_empty() {
            model.encode_text(&r.text)
        } else {
            model.encode_messages(&r.messages)
        }
        .map_err(RouterError::from)?;
        let tokens = ids
            .iter()
            .map(|&id| model.tokenizer.id_to_token(id).unwrap_or_default())
            .collect();
        Ok(Response::new(v1::TokenizeResponse {
            token_ids: ids,
            tokens,
        }))
    }

    async fn info(
        &self,
        _request: Request<v1::InfoRequest>,
    ) -> Result<Response<v1::InfoResponse>, Status> {
        let s = &self.state;
        let (prefill_workers, decode_workers) = s.pools.infos();
        Ok(Response::new(v1::InfoResponse {
            model: s.model_name.clone(),
            model_fingerprint: s.pools.fingerprint().unwrap_or_default(),
            context_length: s.model.context_length,
            vocab_size: s.model.vocab_size,
            default_max_tokens: s.model.default_max_tokens,
            prefill_workers,
            decode_workers,
            block_size: s.pools.block_size().unwrap_or(DEFAULT_BLOCK_SIZE),
            version: env!("CARGO_PKG_VERSION").to_string(),
        }))
    }
}
