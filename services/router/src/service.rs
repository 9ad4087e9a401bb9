//! The public `duet.v1.Generation` service: Generate (streamed relay of a decode worker's
//! stream, with failover), Complete (the same, gathered into one message), Tokenize and Info.
//!
//! Each Generate/Complete call is admitted against the in-flight limit (by the edge, before
//! the handler runs), its prompt text checked by length, then tokenized and validated on a
//! blocking thread (at most one per core at once, so a long prompt holds no async thread and
//! with it no other request's stream), then driven by one task ([`crate::relay`]) that relays
//! the decode worker's messages into a small bounded channel read by the client's stream.

use std::sync::Arc;
use std::time::Duration;

use duet_proto::v1;
use duet_proto::v1::generation_server::Generation;
use futures::StreamExt;
use tokio::sync::{Semaphore, mpsc};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::config::RoutingOptions;
use crate::error::RouterError;
use crate::metrics::{Outcome, RouterMetrics, error_type};
use crate::relay::{self, Item, Job};
use crate::routing::Pools;
use crate::validate::{PromptModel, ValidationError, random_u64};

/// Tokens per KV block reported by Info before any worker reported its own.
const DEFAULT_BLOCK_SIZE: u32 = 16;

/// Messages buffered between the decode stream and a slow client.
const RELAY_BUFFER: usize = 32;

/// Everything the service shares between calls.
#[derive(Debug)]
pub struct RouterState {
    pub model: PromptModel,
    /// Shown by Info (the model path's file stem).
    /// The model's name: the first of `served_names` (metrics and traces carry it).
    pub model_name: String,
    /// Every name the OpenAI API answers to (`--served-model-name`, else the model file's stem).
    pub served_names: Vec<String>,
    pub pools: Pools,
    /// How long a request waits for a routable decode worker (within its deadline).
    pub wait_for_worker: Duration,
    /// How long a running decode stream may go without a message before it fails over.
    pub decode_idle_timeout: Duration,
    pub metrics: RouterMetrics,
    /// Tokenizations running at once, at most one per core: more would only take the cores
    /// from the streams of requests already running.
    tokenizing: Semaphore,
}

/// One admitted request's messages, in order; an error ends them. Dropping it cancels the
/// request on every worker.
pub(crate) type Messages = mpsc::Receiver<Item>;

impl RouterState {
    /// Validates a request, waits (see [`Self::worker_wait_ends`]) until a decode worker is
    /// routable, and starts relaying it (the core of `Generate`, `Complete` and the HTTP API).
    /// The caller admitted it against the in-flight limit.
    ///
    /// Everything the request does happens in its `request` span: its events carry its id (a
    /// JSON log line's `span.request_id`), and its trace span has the OpenTelemetry GenAI
    /// attributes.
    pub(crate) async fn start(
        self: &Arc<Self>,
        req: v1::GenerateRequest,
        deadline: Instant,
    ) -> Result<Messages, RouterError> {
        let request_id = if req.request_id.is_empty() {
            format!("req-{:016x}", random_u64())
        } else {
            req.request_id.clone()
        };
        let span = tracing::info_span!(
            "request",
            request_id = %request_id,
            gen_ai.operation.name = if req.messages.is_empty() { "text_completion" } else { "chat" },
            gen_ai.request.model = %self.model_name,
            gen_ai.usage.input_tokens = tracing::field::Empty,
            gen_ai.usage.output_tokens = tracing::field::Empty,
            gen_ai.response.finish_reasons = tracing::field::Empty,
            error.type = tracing::field::Empty,
        );
        self.admit(req, request_id, deadline)
            .instrument(span.clone())
            .await
            .inspect_err(|e| {
                span.record("error.type", error_type(e.code()));
            })
    }

    async fn admit(
        self: &Arc<Self>,
        req: v1::GenerateRequest,
        request_id: String,
        deadline: Instant,
    ) -> Result<Messages, RouterError> {
        let start = Instant::now();
        // The cheap check by length first, before waiting for a tokenizing slot.
        let validated = match self.model.check_prompt_bytes(&req.prompt, &req.messages) {
            Ok(()) => {
                self.tokenize(move |model| model.validate(&req, random_u64))
                    .await
            }
            Err(e) => Err(e.into()),
        };
        let valid = match validated {
            Ok(valid) => self
                .pools
                .wait_for(self.worker_wait_ends(deadline), |p| {
                    p.any_decode_routable().then_some(())
                })
                .await
                .map(|()| valid)
                .ok_or(RouterError::NoDecodeWorker(None)),
            Err(e) => Err(e),
        };
        let valid = valid.inspect_err(|e| self.metrics.finished(Outcome::Failed(e.code())))?;
        tracing::Span::current().record("gen_ai.usage.input_tokens", valid.prompt.len() as i64);
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
        tokio::spawn(relay::relay(self.clone(), job, tx).in_current_span());
        Ok(rx)
    }

    /// The router's state serving `model` under `served_names` (at least one; the first is the
    /// model's name in metrics and traces).
    pub fn new(
        model: PromptModel,
        served_names: Vec<String>,
        pools: Pools,
        routing: &RoutingOptions,
    ) -> Self {
        let model_name = served_names.first().cloned().unwrap_or_default();
        Self {
            metrics: RouterMetrics::new(&model_name, pools.decisions.clone()),
            model,
            model_name,
            served_names,
            pools,
            wait_for_worker: Duration::from_millis(routing.wait_for_worker_ms),
            decode_idle_timeout: Duration::from_millis(routing.decode_idle_timeout_ms.max(1)),
            tokenizing: Semaphore::new(
                std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
            ),
        }
    }

    /// Runs `work`, which tokenizes, on a blocking thread once one of the tokenizing slots is
    /// free. Callers check the text's length first ([`PromptModel::check_prompt_bytes`]), so
    /// that text past the limit waits for no slot.
    async fn tokenize<T: Send + 'static>(
        &self,
        work: impl FnOnce(&PromptModel) -> Result<T, ValidationError> + Send + 'static,
    ) -> Result<T, RouterError> {
        let _slot = self
            .tokenizing
            .acquire()
            .await
            .map_err(|_| RouterError::Internal("the tokenizing slots were closed".into()))?;
        let model = self.model.clone();
        tokio::task::spawn_blocking(move || work(&model))
            .await
            .map_err(|e| RouterError::Internal(format!("tokenizing failed: {e}")))?
            .map_err(RouterError::from)
    }

    /// Until when a request that finds no routable decode worker, starting to wait now, waits
    /// for one: the bound, within the request's deadline.
    pub(crate) fn worker_wait_ends(&self, deadline: Instant) -> Instant {
        (Instant::now() + self.wait_for_worker).min(deadline)
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

/// A whole generation in one message (`Complete`, and the HTTP API's non-streaming calls).
pub(crate) async fn gather(mut rx: Messages) -> Result<v1::GenerateResponse, RouterError> {
    let mut whole = v1::GenerateResponse::default();
    while let Some(item) = rx.recv().await {
        let m = item?;
        whole.request_id = m.request_id;
        whole.text.push_str(&m.text);
        whole.token_ids.extend(m.token_ids);
        whole.logprobs.extend(m.logprobs);
        if m.finish_reason != v1::FinishReason::Unspecified as i32 {
            whole.finish_reason = m.finish_reason;
            whole.error = m.error;
            whole.usage = m.usage;
            whole.timings = m.timings;
            return Ok(whole);
        }
    }
    Err(RouterError::Internal(
        "the generation ended without a final message".into(),
    ))
}

#[tonic::async_trait]
impl Generation for GenerationService {
    type GenerateStream = futures::stream::Map<
        ReceiverStream<Item>,
        fn(Item) -> Result<v1::GenerateResponse, Status>,
    >;

    async fn generate(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let deadline = duet_proto::deadline(&request);
        let rx = self.state.start(request.into_inner(), deadline).await?;
        let stream: fn(Item) -> Result<v1::GenerateResponse, Status> =
            |item| item.map_err(Status::from);
        Ok(Response::new(ReceiverStream::new(rx).map(stream)))
    }

    async fn complete(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<v1::GenerateResponse>, Status> {
        let deadline = duet_proto::deadline(&request);
        let rx = self.state.start(request.into_inner(), deadline).await?;
        Ok(Response::new(gather(rx).await?))
    }

    async fn tokenize(
        &self,
        request: Request<v1::TokenizeRequest>,
    ) -> Result<Response<v1::TokenizeResponse>, Status> {
        let r = request.into_inner();
        let state = &self.state;
        state
            .model
            .check_prompt_bytes(&r.text, &r.messages)
            .map_err(RouterError::from)?;
        let response = state
            .tokenize(move |model| {
                let token_ids = if r.messages.is_empty() {
                    model.encode_text(&r.text)
                } else {
                    model.encode_messages(&r.messages, &r.chat_template_kwargs)
                }?;
                let tokens = token_ids
                    .iter()
                    .map(|&id| model.tokenizer.id_to_token(id).unwrap_or_default())
                    .collect();
                Ok(v1::TokenizeResponse { token_ids, tokens })
            })
            .await?;
        Ok(Response::new(response))
    }

    async fn info(
        &self,
        _request: Request<v1::InfoRequest>,
    ) -> Result<Response<v1::InfoResponse>, Status> {
        let s = &self.state;
        let (prefill_workers, decode_workers) = s.pools.infos();
        Ok(Response::new(v1::InfoResponse {
            model: s.model_name.clone(),
            served_model_names: s.served_names.clone(),
            model_fingerprint: s.pools.fingerprint().unwrap_or_default(),
            context_length: s.model.context_length,
            vocab_size: s.model.vocab_size,
            default_max_tokens: s.model.default_max_tokens,
            prefill_workers,
            decode_workers,
            block_size: s.pools.block_size().unwrap_or(DEFAULT_BLOCK_SIZE),
            version: env!("CARGO_PKG_VERSION").to_string(),
            routing: Some(s.pools.routing_stats()),
        }))
    }
}
