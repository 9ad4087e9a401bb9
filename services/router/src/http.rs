//! The OpenAI-compatible HTTP front of the router (axum): `/v1/completions` and
//! `/v1/chat/completions` (whole, or streamed as server-sent events ending with `[DONE]`),
//! `/v1/models`, `/health` and `/live`.
//!
//! A call is admitted against the same in-flight limit as the gRPC API, turned into a
//! `GenerateRequest` (`openai.rs`) and handed to the same router core as `Generate`/`Complete`
//! ([`RouterState::start`]). Errors are mapped here, once, from the core's gRPC code to an HTTP
//! status in OpenAI's envelope. A client that disconnects drops the response, and with it the
//! request's channel: the relay ends and cancels the call on every worker.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use duet_proto::InFlightLimitLayer;
use duet_proto::serve::{Protocol, TraceContextLayer};
use duet_proto::v1;
use tokio::time::Instant;
use tonic::Code;

use crate::api_keys::{ApiKeys, require_api_key};
use crate::error::RouterError;
use crate::https::TlsListener;
use crate::openai::{
    Answer, ChatChoice, ChatCompletion, ChatLogprobs, ChatMessageOut, ChatRequest, Completion,
    CompletionChoice, CompletionLogprobs, CompletionRequest, ErrorBody, ErrorEnvelope, ModelCard,
    ModelList, OpenAiError, ToolCalls, Usage, finish_reason,
};
use crate::relay::Item;
use crate::service::{Messages, RouterState, gather};
use crate::tool_stream::ToolCallStream;

/// Seconds a client told 429 should wait before retrying.
const RETRY_AFTER_SECONDS: &str = "1";

/// What every handler shares.
pub struct HttpFront {
    pub state: Arc<RouterState>,
    /// The gRPC edge's limit on calls in flight, shared.
    pub limit: InFlightLimitLayer,
    /// Deadline of every call (HTTP clients send none the router reads).
    pub request_timeout: Duration,
}

/// The HTTP front's routes; bodies past `max_body_bytes` are refused with 413. Completions
/// continue the caller's trace (its `traceparent` header). With `keys`, the `/v1/` routes
/// answer 401 to calls without one of them (before the body is read).
pub fn app(
    front: Arc<HttpFront>,
    max_body_bytes: usize,
    keys: Option<Arc<ApiKeys>>,
) -> axum::Router {
    let api = axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route_layer(TraceContextLayer(Protocol::Http))
        .route("/v1/models", get(models));
    let api = match keys {
        Some(keys) => api.route_layer(axum::middleware::from_fn_with_state(keys, require_api_key)),
        None => api,
    };
    api.route("/health", get(health))
        .route("/live", get(live))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(front)
}

/// Serves `app` on `listener` (HTTPS with `tls`, else plain HTTP) until `shutdown` resolves.
pub async fn serve(
    app: axum::Router,
    listener: tokio::net::TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    match tls {
        Some(tls) => {
            axum::serve(TlsListener::new(listener, tls)?, app)
                .with_graceful_shutdown(shutdown)
                .await
        }
        None => {
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
        }
    }
}

/// Everything a call can fail with, answered in OpenAI's envelope.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error(transparent)]
    Request(#[from] OpenAiError),
    #[error(transparent)]
    Router(#[from] RouterError),
    /// The body was not JSON of the right shape, not JSON at all, or too large.
    #[error("{}", .0.body_text())]
    Body(#[from] JsonRejection),
}

impl HttpError {
    fn status_type_code(&self) -> (StatusCode, &'static str, Option<&'static str>) {
        match self {
            HttpError::Request(OpenAiError::Invalid { .. }) => {
                (StatusCode::BAD_REQUEST, "invalid_request_error", None)
            }
            HttpError::Request(OpenAiError::UnknownModel { .. }) => (
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                Some("model_not_found"),
            ),
            HttpError::Body(r) => (r.status(), "invalid_request_error", None),
            HttpError::Router(e) => match e.code() {
                Code::InvalidArgument | Code::OutOfRange => {
                    (StatusCode::BAD_REQUEST, "invalid_request_error", None)
                }
                Code::NotFound => (StatusCode::NOT_FOUND, "invalid_request_error", None),
                Code::Unauthenticated => (
                    StatusCode::UNAUTHORIZED,
                    "invalid_request_error",
                    Some("invalid_api_key"),
                ),
                Code::ResourceExhausted => (
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    Some("overloaded"),
                ),
                Code::Unavailable => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "server_error",
                    Some("unavailable"),
                ),
                Code::DeadlineExceeded => (
                    StatusCode::GATEWAY_TIMEOUT,
                    "server_error",
                    Some("deadline_exceeded"),
                ),
                _ => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None),
            },
        }
    }

    fn envelope(&self) -> ErrorEnvelope {
        let (_, kind, code) = self.status_type_code();
        let param = match self {
            HttpError::Request(OpenAiError::Invalid { param, .. }) => Some(*param),
            HttpError::Request(OpenAiError::UnknownModel { .. }) => Some("model"),
            _ => None,
        };
        ErrorEnvelope {
            error: ErrorBody {
                message: self.to_string(),
                kind,
                param,
                code,
            },
        }
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let (status, _, _) = self.status_type_code();
        let mut response = (status, Json(self.envelope())).into_response();
        if status == StatusCode::TOO_MANY_REQUESTS {
            response.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from_static(RETRY_AFTER_SECONDS),
            );
        }
        response
    }
}

async fn completions(
    State(front): State<Arc<HttpFront>>,
    headers: HeaderMap,
    body: Result<Json<CompletionRequest>, JsonRejection>,
) -> Result<Response, HttpError> {
    let Json(body) = body?;
    let (req, answer) = body.to_generate(&front.state.served_names)?;
    let model = body.common.model.clone();
    generate(front, &headers, req, Endpoint::Completions, answer, &model).await
}

async fn chat_completions(
    State(front): State<Arc<HttpFront>>,
    headers: HeaderMap,
    body: Result<Json<ChatRequest>, JsonRejection>,
) -> Result<Response, HttpError> {
    let Json(body) = body?;
    let auto_tool_calls = front.state.model.auto_tool_calls.as_ref();
    let (req, answer) = body.to_generate(
        &front.state.served_names,
        auto_tool_calls.copied().map_err(String::as_str),
    )?;
    let model = body.common.model.clone();
    generate(front, &headers, req, Endpoint::Chat, answer, &model).await
}

/// Admits, starts and answers one generation, whole or streamed; the answer names the model as
/// the request did (any of the served names).
async fn generate(
    front: Arc<HttpFront>,
    headers: &HeaderMap,
    mut req: v1::GenerateRequest,
    endpoint: Endpoint,
    answer: Answer,
    model: &str,
) -> Result<Response, HttpError> {
    let mut reply = Reply::new(endpoint, answer, model);
    let permit = front.limit.try_admit().map_err(RouterError::from)?;
    if let Some(id) = headers.get("x-request-id").and_then(|v| v.to_str().ok()) {
        req.request_id = id.to_string();
    }
    let deadline = Instant::now() + front.request_timeout;
    let mut messages = front.state.start(req, deadline).await?;
    if !reply.answer.stream {
        let whole = gather(messages).await?;
        failed(&whole)?;
        reply.id = whole.request_id.clone();
        return Ok(reply.whole(&front.state, &whole));
    }
    // The first message decides the status: an error before any token keeps its own.
    let first = messages.recv().await.unwrap_or_else(|| {
        Err(RouterError::Internal(
            "the generation ended without a message".into(),
        ))
    })?;
    reply.id = first.request_id.clone();
    reply.tool_stream = ToolCallStream::new(&reply.answer.tools, &reply.id);
    let mut pending = VecDeque::new();
    if let Some(role) = reply.role_chunk() {
        pending.push_back(role);
    }
    let stream = Streaming {
        front,
        messages,
        reply,
        first: Some(Ok(first)),
        pending,
        done: false,
        _permit: permit,
    };
    let events = futures::stream::unfold(stream, |mut s| async move {
        let event = s.next().await?;
        Some((Ok::<_, Infallible>(event), s))
    });
    Ok(Sse::new(events).into_response())
}

/// A streamed answer: its events are made as the core's messages arrive.
struct Streaming {
    front: Arc<HttpFront>,
    messages: Messages,
    reply: Reply,
    first: Option<Item>,
    pending: VecDeque<Event>,
    done: bool,
    /// Counts the call in flight until the stream ends or the client leaves.
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Streaming {
    async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Some(e);
            }
            if self.done {
                return None;
            }
            let item = match self.first.take() {
                Some(item) => Some(item),
                None => self.messages.recv().await,
            };
            let finished = match item {
                Some(Ok(m)) => {
                    let chunk = self.reply.chunk(&self.front.state, &m);
                    self.pending.push_back(chunk);
                    if finish_reason(&m).is_some() {
                        if let Some(u) =
                            m.usage.as_ref().filter(|_| self.reply.answer.include_usage)
                        {
                            self.pending.push_back(self.reply.usage_chunk(u));
                        }
                        if let Err(e) = failed(&m) {
                            self.pending
                                .push_back(json_event(&HttpError::from(e).envelope()));
                        }
                        true
                    } else {
                        false
                    }
                }
                Some(Err(e)) => {
                    self.pending
                        .push_back(json_event(&HttpError::from(e).envelope()));
                    true
                }
                None => {
                    let e = RouterError::Internal(
                        "the generation ended without a final message".into(),
                    );
                    self.pending
                        .push_back(json_event(&HttpError::from(e).envelope()));
                    true
                }
            };
            if finished {
                self.pending.push_back(Event::default().data("[DONE]"));
                self.done = true;
            }
        }
    }
}

/// A generation that ended with finish_reason `error`, as the error its client is told: the
/// answer of a call that is not streamed, an error event after a stream's last chunk.
fn failed(m: &v1::GenerateResponse) -> Result<(), RouterError> {
    if m.finish_reason == v1::FinishReason::Error as i32 {
        return Err(RouterError::Internal(format!(
            "the generation failed part way: {}",
            m.error
        )));
    }
    Ok(())
}

fn json_event(value: &impl serde::Serialize) -> Event {
    Event::default()
        .json_data(value)
        .unwrap_or_else(|e| Event::default().data(format!("{{\"error\":\"{e}\"}}")))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Endpoint {
    Completions,
    Chat,
}

/// How one call's answer is written.
struct Reply {
    endpoint: Endpoint,
    answer: Answer,
    /// The core's request id (known once it answered).
    id: String,
    created: u64,
    model: String,
    /// A streamed answer that calls a tool: its text becomes `tool_calls` deltas.
    tool_stream: Option<ToolCallStream>,
}

impl Reply {
    fn new(endpoint: Endpoint, answer: Answer, model: &str) -> Self {
        Self {
            endpoint,
            answer,
            model: model.to_string(),
            id: String::new(),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            tool_stream: None,
        }
    }

    fn object_id(&self) -> String {
        match self.endpoint {
            Endpoint::Completions => format!("cmpl-{}", self.id),
            Endpoint::Chat => format!("chatcmpl-{}", self.id),
        }
    }

    /// The whole answer of a non-streaming call.
    fn whole(&self, state: &RouterState, m: &v1::GenerateResponse) -> Response {
        let usage = m.usage.as_ref().map(Usage::from);
        match self.endpoint {
            Endpoint::Completions => {
                Json(self.completion(state, m, "text_completion", usage)).into_response()
            }
            Endpoint::Chat => {
                let (content, calls) = self.answer.tools.answer(&m.text, &self.id);
                let called = !calls.is_empty();
                let message = ChatMessageOut {
                    role: Some("assistant"),
                    content,
                    tool_calls: called.then_some(ToolCalls::Whole(calls)),
                };
                let answer = self.chat(state, m, "chat.completion", Some(message), None, usage);
                Json(answer.calling(called)).into_response()
            }
        }
    }

    /// One chunk of a stream: a message's text (or what it adds to a tool call), tokens'
    /// logprobs and finish reason.
    fn chunk(&mut self, state: &RouterState, m: &v1::GenerateResponse) -> Event {
        match (self.endpoint, &mut self.tool_stream) {
            (Endpoint::Completions, _) => {
                json_event(&self.completion(state, m, "text_completion", None))
            }
            (Endpoint::Chat, None) => {
                let delta = ChatMessageOut {
                    role: None,
                    content: Some(m.text.clone()),
                    tool_calls: None,
                };
                json_event(&self.chat(state, m, "chat.completion.chunk", None, Some(delta), None))
            }
            (Endpoint::Chat, Some(tools)) => {
                let piece = tools.push(&m.text, finish_reason(m).is_some());
                let called = tools.called();
                let delta = ChatMessageOut {
                    role: None,
                    content: piece.content,
                    tool_calls: (!piece.tool_calls.is_empty())
                        .then_some(ToolCalls::Chunk(piece.tool_calls)),
                };
                let chunk = self.chat(state, m, "chat.completion.chunk", None, Some(delta), None);
                json_event(&chunk.calling(called))
            }
        }
    }

    /// The chat stream's first chunk: the assistant's role.
    fn role_chunk(&self) -> Option<Event> {
        (self.endpoint == Endpoint::Chat).then(|| {
            json_event(&ChatCompletion {
                id: self.object_id(),
                object: "chat.completion.chunk",
                created: self.created,
                model: self.model.clone(),
                choices: vec![ChatChoice {
                    index: 0,
                    message: None,
                    delta: Some(ChatMessageOut {
                        role: Some("assistant"),
                        // A tool call's message has no content.
                        content: self.tool_stream.is_none().then(String::new),
                        tool_calls: None,
                    }),
                    finish_reason: None,
                    logprobs: None,
                }],
                usage: None,
            })
        })
    }

    /// The chunk `stream_options.include_usage` adds before `[DONE]`: usage, no choices.
    fn usage_chunk(&self, usage: &v1::Usage) -> Event {
        let usage = Some(Usage::from(usage));
        match self.endpoint {
            Endpoint::Completions => json_event(&Completion {
                id: self.object_id(),
                object: "text_completion",
                created: self.created,
                model: self.model.clone(),
                choices: Vec::new(),
                usage,
            }),
            Endpoint::Chat => json_event(&ChatCompletion {
                id: self.object_id(),
                object: "chat.completion.chunk",
                created: self.created,
                model: self.model.clone(),
                choices: Vec::new(),
                usage,
            }),
        }
    }

    fn completion(
        &self,
        state: &RouterState,
        m: &v1::GenerateResponse,
        object: &'static str,
        usage: Option<Usage>,
    ) -> Completion {
        Completion {
            id: self.object_id(),
            object,
            created: self.created,
            model: self.model.clone(),
            choices: vec![CompletionChoice {
                index: 0,
                text: m.text.clone(),
                finish_reason: finish_reason(m),
                logprobs: self
                    .answer
                    .top_logprobs
                    .map(|top| CompletionLogprobs::new(&state.model.tokenizer, &m.logprobs, top)),
            }],
            usage,
        }
    }

    fn chat(
        &self,
        state: &RouterState,
        m: &v1::GenerateResponse,
        object: &'static str,
        message: Option<ChatMessageOut>,
        delta: Option<ChatMessageOut>,
        usage: Option<Usage>,
    ) -> ChatCompletion {
        ChatCompletion {
            id: self.object_id(),
            object,
            created: self.created,
            model: self.model.clone(),
            choices: vec![ChatChoice {
                index: 0,
                message,
                delta,
                finish_reason: finish_reason(m),
                logprobs: self
                    .answer
                    .top_logprobs
                    .map(|top| ChatLogprobs::new(&state.model.tokenizer, &m.logprobs, top)),
            }],
            usage,
        }
    }
}

async fn models(State(front): State<Arc<HttpFront>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: front
            .state
            .served_names
            .iter()
            .map(|name| ModelCard {
                id: name.clone(),
                object: "model",
                created: 0,
                owned_by: "duet",
            })
            .collect(),
    })
}

/// Ready (200) when a decode worker is routable and so is a prefill path: a prefill worker, or
/// none configured (every prompt prefills on its decode worker). 503 otherwise.
async fn health(State(front): State<Arc<HttpFront>>) -> (StatusCode, Json<serde_json::Value>) {
    let pools = &front.state.pools;
    let (prefill_up, decode_up) = pools.routable_counts();
    let ready = decode_up > 0 && (prefill_up > 0 || pools.prefill().is_empty());
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(serde_json::json!({
            "status": if ready { "ready" } else { "unavailable" },
            "decode_workers_up": decode_up,
            "prefill_workers_up": prefill_up,
            // Prefill workers a decode worker refuses in a plan (a cluster started with
            // mismatched flags), and the plans it prefilled itself for that reason.
            "refused_prefill": pools.refused_prefill(),
            "refused_prefill_plans": pools.refused_prefill_plans(),
        })),
    )
}

/// The process answers: 200 whatever its workers' state.
async fn live() -> &'static str {
    "ok"
}

async fn not_found() -> Response {
    let envelope = ErrorEnvelope {
        error: ErrorBody {
            message: "no such endpoint".into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        },
    };
    (StatusCode::NOT_FOUND, Json(envelope)).into_response()
}
