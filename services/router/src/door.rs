//! The one door both fronts (gRPC `Generation`, the OpenAI HTTP API) enter the router's core
//! by: [`Core`], which [`RouterState`] opens.
//!
//! A generation is admitted against the in-flight limit by its front, then [`Core::start`]s
//! here: its prompt text checked by length, then tokenized and validated on a blocking thread
//! (at most one per core at once, so a long prompt holds no async thread and with it no other
//! request's stream), then driven by one task ([`crate::relay`]) that relays the decode
//! worker's messages into a small bounded channel, [`Messages`], which the front reads.

use std::sync::Arc;
use std::time::Duration;

use duet_proto::v1;
use tokio::sync::{Semaphore, mpsc};
use tokio::time::Instant;
use tracing::Instrument;

use crate::error::RouterError;
use crate::ids;
use crate::metrics::{Outcome, RouterMetrics, error_type};
use crate::relay::{self, Job, Relay};
use crate::routing::{Pools, RefusedPrefill};
use crate::validate::{PromptModel, ValidationError};

pub use crate::relay::{Item, finish_reason};

/// Messages buffered between the decode stream and a slow client.
const RELAY_BUFFER: usize = 32;

/// Tokens per KV block reported by Info before any worker reported its own.
const DEFAULT_BLOCK_SIZE: u32 = 16;

/// One started request's messages, in order; an error ends them. Dropping it cancels the
/// request on every worker.
pub type Messages = mpsc::Receiver<Item>;

/// Whether the cluster can take requests: a decode worker is routable, and so is a prefill
/// path (a prefill worker, or none configured: every prompt prefills on its decode worker).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Readiness {
    pub decode_workers_up: usize,
    pub prefill_workers_up: usize,
    pub ready: bool,
    /// Prefill workers a decode worker refuses in a plan (a cluster started with mismatched
    /// flags), and the plans it prefilled itself for that reason.
    pub refused_prefill: Vec<RefusedPrefill>,
    pub refused_prefill_plans: u64,
}

/// The door into the core: what a front may ask of it.
pub trait Core: Send + Sync + 'static {
    /// Validates `req`, waits (within `deadline`) until a decode worker is routable, and starts
    /// relaying it. The caller admitted it against the in-flight limit.
    fn start(
        &self,
        req: v1::GenerateRequest,
        deadline: Instant,
    ) -> impl Future<Output = Result<Messages, RouterError>> + Send;

    /// Tokenizes a text or a conversation as a generation's prompt would be.
    fn tokenize(
        &self,
        req: v1::TokenizeRequest,
    ) -> impl Future<Output = Result<v1::TokenizeResponse, RouterError>> + Send;

    /// Whether the cluster can take requests now.
    fn readiness(&self) -> Readiness;
}

/// How long the core waits on workers.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    /// How long a request waits for a routable decode worker (within its deadline).
    pub wait_for_worker: Duration,
    /// How long a running decode stream may go without a message before it fails over.
    pub decode_idle: Duration,
}

/// Everything the core shares between calls.
#[derive(Debug)]
pub struct RouterState {
    pub model: PromptModel,
    /// The model's name: the first of `served_names` (metrics, traces and Info carry it).
    pub model_name: String,
    /// Every name the OpenAI API answers to (`--served-model-name`, else the model file's stem).
    pub served_names: Vec<String>,
    relay: Arc<Relay>,
    /// Tokenizations running at once, at most one per core: more would only take the cores
    /// from the streams of requests already running.
    tokenizing: Semaphore,
}

impl Core for RouterState {
    /// Everything the request does happens in its `request` span: its events carry its id (a
    /// JSON log line's `span.request_id`), and its trace span has the OpenTelemetry GenAI
    /// attributes.
    async fn start(
        &self,
        req: v1::GenerateRequest,
        deadline: Instant,
    ) -> Result<Messages, RouterError> {
        let request_id = if req.request_id.is_empty() {
            ids::request_id()
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

    async fn tokenize(&self, r: v1::TokenizeRequest) -> Result<v1::TokenizeResponse, RouterError> {
        self.model.check_prompt_bytes(&r.text, &r.messages)?;
        self.on_tokenizing_thread(move |model| {
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
        .await
    }

    fn readiness(&self) -> Readiness {
        let pools = &self.relay.pools;
        let (prefill_workers_up, decode_workers_up) = pools.routable_counts();
        Readiness {
            decode_workers_up,
            prefill_workers_up,
            ready: decode_workers_up > 0 && (prefill_workers_up > 0 || pools.prefill().is_empty()),
            refused_prefill: pools.refused_prefill(),
            refused_prefill_plans: pools.refused_prefill_plans(),
        }
    }
}

impl RouterState {
    /// The router's state serving `model` under `served_names` (at least one; the first is the
    /// model's name in metrics and traces) over `pools`.
    pub fn new(
        model: PromptModel,
        served_names: Vec<String>,
        pools: Pools,
        timeouts: Timeouts,
    ) -> Self {
        let model_name = served_names.first().cloned().unwrap_or_default();
        Self {
            relay: Arc::new(Relay {
                metrics: RouterMetrics::new(&model_name, pools.decisions.clone()),
                pools,
                wait_for_worker: timeouts.wait_for_worker,
                decode_idle_timeout: timeouts.decode_idle,
            }),
            model,
            model_name,
            served_names,
            tokenizing: Semaphore::new(
                std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
            ),
        }
    }

    /// The worker pools the core routes over.
    pub fn pools(&self) -> &Pools {
        &self.relay.pools
    }

    /// The router's metric families.
    pub fn metrics(&self) -> &RouterMetrics {
        &self.relay.metrics
    }

    async fn admit(
        &self,
        req: v1::GenerateRequest,
        request_id: String,
        deadline: Instant,
    ) -> Result<Messages, RouterError> {
        let start = Instant::now();
        let relay = &self.relay;
        // The cheap check by length first, before waiting for a tokenizing slot.
        let validated = match self.model.check_prompt_bytes(&req.prompt, &req.messages) {
            Ok(()) => {
                self.on_tokenizing_thread(move |model| model.validate(&req, ids::random_u64))
                    .await
            }
            Err(e) => Err(e.into()),
        };
        let valid = match validated {
            Ok(valid) => relay
                .pools
                .wait_for(relay.worker_wait_ends(deadline), |p| {
                    p.any_decode_routable().then_some(())
                })
                .await
                .map(|()| valid)
                .ok_or(RouterError::NoDecodeWorker(None)),
            Err(e) => Err(e),
        };
        let valid = valid.inspect_err(|e| relay.metrics.finished(Outcome::Failed(e.code())))?;
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
        tokio::spawn(relay::relay(relay.clone(), job, tx).in_current_span());
        Ok(rx)
    }

    /// Runs `work`, which tokenizes, on a blocking thread once one of the tokenizing slots is
    /// free. Callers check the text's length first ([`PromptModel::check_prompt_bytes`]), so
    /// that text past the limit waits for no slot.
    async fn on_tokenizing_thread<T: Send + 'static>(
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

    /// What `Info` answers: the model, the workers, the routing's counts.
    pub fn info(&self) -> v1::InfoResponse {
        let pools = self.pools();
        let (prefill_workers, decode_workers) = pools.infos();
        v1::InfoResponse {
            model: self.model_name.clone(),
            served_model_names: self.served_names.clone(),
            model_fingerprint: pools.fingerprint().unwrap_or_default(),
            context_length: self.model.context_length,
            vocab_size: self.model.vocab_size,
            default_max_tokens: self.model.default_max_tokens,
            prefill_workers,
            decode_workers,
            block_size: pools.block_size().unwrap_or(DEFAULT_BLOCK_SIZE),
            version: env!("CARGO_PKG_VERSION").to_string(),
            routing: Some(pools.routing_stats()),
        }
    }
}

/// A whole generation in one message (`Complete`, and the HTTP API's non-streaming calls).
pub async fn gather(mut rx: Messages) -> Result<v1::GenerateResponse, RouterError> {
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
