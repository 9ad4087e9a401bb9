//! The OpenAI-compatible HTTP front of the router (axum): `/v1/completions` and
//! `/v1/chat/completions` (whole, or streamed as server-sent events ending with `[DONE]`),
//! `/v1/models`, vLLM's `/tokenize` and `/detokenize`, `/health` and `/live`; its API-key
//! layer; and the tool-call format requests are answered in ([`ServedModel::auto_tool_calls`]).
//!
//! A call is admitted against the same in-flight limit as the gRPC API, turned into a
//! `GenerateRequest` ([`super::request`]) and handed to the core through its door
//! ([`Core::start`]), as `Generate`/`Complete` are. Errors are mapped here, once, from the
//! core's gRPC code to an HTTP status in OpenAI's envelope. A client that disconnects drops the
//! response, and with it the request's channel: the relay ends and cancels the call on every
//! worker.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use duet_model::tokenizer::Tokenizer;
use duet_model::tool_calls::ToolCallFormat;
use duet_proto::InFlightLimitLayer;
use duet_proto::serve::{Protocol, TraceContextLayer};
use duet_proto::v1;
use tokio::time::Instant;
use tonic::Code;

use super::request::{Answer, OpenAiError, ToolCallParser};
use super::response::{Endpoint, Reply, json_event};
use super::tool_stream::ToolCallStream;
use super::wire::{
    ChatRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse, ErrorBody,
    ErrorEnvelope, ModelCard, ModelList, TokenizeRequest, TokenizeResponse,
};
use crate::api_keys::{AUTHORIZATION, ApiKeys};
use crate::door::{Core, Item, Messages, finish_reason, gather};
use crate::error::RouterError;
use crate::https::TlsListener;
use crate::validate::PromptModel;

/// Seconds a client told 429 should wait before retrying.
const RETRY_AFTER_SECONDS: &str = "1";

/// What the front knows of the model it serves.
#[derive(Clone, Debug)]
pub struct ServedModel {
    /// Every name requests may give as `model` (the first is the model's).
    pub names: Vec<String>,
    /// Writes tokens' text (logprobs, `/detokenize`).
    pub tokenizer: Tokenizer,
    /// Valid token ids are `0..vocab_size`.
    pub vocab_size: u32,
    /// Tokens of one sequence, prompt plus generated.
    pub context_length: u32,
    /// The markup the model's tool calls are read in under `tool_choice: "auto"`, or why
    /// `auto` is not served ([`super::request::ToolCallParser::auto_tool_calls`]).
    pub auto_tool_calls: Result<ToolCallFormat, String>,
}

impl ServedModel {
    /// The front's view of `model`, served under `names`; `parser` says how `tool_choice:
    /// "auto"` is read (logged).
    pub fn new(names: Vec<String>, model: &PromptModel, parser: ToolCallParser) -> Self {
        let auto_tool_calls = parser.auto_tool_calls(&model.chat, &model.tokenizer);
        match &auto_tool_calls {
            Ok(format) => {
                tracing::info!(format = format.name(), "tool_choice auto reads tool calls")
            }
            Err(why) => tracing::info!("tool_choice auto is refused: {why}"),
        }
        Self {
            names,
            tokenizer: model.tokenizer.clone(),
            vocab_size: model.vocab_size,
            context_length: model.context_length,
            auto_tool_calls,
        }
    }
}

/// What every handler shares.
pub struct HttpFront<C> {
    pub core: Arc<C>,
    pub model: ServedModel,
    /// The gRPC edge's limit on calls in flight, shared.
    pub limit: InFlightLimitLayer,
    /// Deadline of every call (HTTP clients send none the router reads).
    pub request_timeout: Duration,
}

/// The HTTP front's routes; bodies past `max_body_bytes` are refused with 413. Completions
/// continue the caller's trace (its `traceparent` header). With `keys`, the API's routes (all
/// but `/health` and `/live`) answer 401 to calls without one of them (before the body is
/// read).
pub fn app<C: Core>(
    front: Arc<HttpFront<C>>,
    max_body_bytes: usize,
    keys: Option<Arc<ApiKeys>>,
) -> axum::Router {
    let api = axum::Router::new()
        .route("/v1/completions", post(completions::<C>))
        .route("/v1/chat/completions", post(chat_completions::<C>))
        .route_layer(TraceContextLayer(Protocol::Http))
        .route("/v1/models", get(models::<C>))
        .route("/tokenize", post(tokenize::<C>))
        .route("/detokenize", post(detokenize::<C>));
    let api = match keys {
        Some(keys) => api.route_layer(axum::middleware::from_fn_with_state(keys, require_api_key)),
        None => api,
    };
    api.route("/health", get(health::<C>))
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

/// The API-key check, an axum middleware on the `/v1/` routes: 401 in OpenAI's error envelope.
async fn require_api_key(
    State(keys): State<Arc<ApiKeys>>,
    request: Request,
    next: Next,
) -> Response {
    let value = request.headers().get(AUTHORIZATION).map(|v| v.as_bytes());
    match keys.check(value) {
        Ok(()) => next.run(request).await,
        Err(e) => HttpError::from(RouterError::from(e)).into_response(),
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

async fn completions<C: Core>(
    State(front): State<Arc<HttpFront<C>>>,
    headers: HeaderMap,
    body: Result<Json<CompletionRequest>, JsonRejection>,
) -> Result<Response, HttpError> {
    let Json(body) = body?;
    let (req, answer) = body.to_generate(&front.model.names, front.model.vocab_size)?;
    let model = body.common.model.clone();
    generate(front, &headers, req, Endpoint::Completions, answer, &model).await
}

async fn chat_completions<C: Core>(
    State(front): State<Arc<HttpFront<C>>>,
    headers: HeaderMap,
    body: Result<Json<ChatRequest>, JsonRejection>,
) -> Result<Response, HttpError> {
    let Json(body) = body?;
    let auto_tool_calls = front.model.auto_tool_calls.as_ref();
    let (req, answer) = body.to_generate(
        &front.model.names,
        auto_tool_calls.copied().map_err(String::as_str),
    )?;
    let model = body.common.model.clone();
    generate(front, &headers, req, Endpoint::Chat, answer, &model).await
}

/// Admits, starts and answers one generation, whole or streamed; the answer names the model as
/// the request did (any of the served names).
async fn generate<C: Core>(
    front: Arc<HttpFront<C>>,
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
    let mut messages = front.core.start(req, deadline).await?;
    if !reply.answer.stream {
        let whole = gather(messages).await?;
        failed(&whole)?;
        reply.id = whole.request_id.clone();
        return Ok(reply.whole(&front.model.tokenizer, &whole));
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
struct Streaming<C> {
    front: Arc<HttpFront<C>>,
    messages: Messages,
    reply: Reply,
    first: Option<Item>,
    pending: VecDeque<Event>,
    done: bool,
    /// Counts the call in flight until the stream ends or the client leaves.
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl<C: Core> Streaming<C> {
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
                    let chunk = self.reply.chunk(&self.front.model.tokenizer, &m);
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

/// `POST /tokenize`: the prompt's tokens as a generation would take them (admitted against the
/// in-flight limit: tokenizing is the core's work).
async fn tokenize<C: Core>(
    State(front): State<Arc<HttpFront<C>>>,
    body: Result<Json<TokenizeRequest>, JsonRejection>,
) -> Result<Json<TokenizeResponse>, HttpError> {
    let Json(body) = body?;
    let req = body.to_core(&front.model.names)?;
    let _permit = front.limit.try_admit().map_err(RouterError::from)?;
    let r = front.core.tokenize(req).await?;
    Ok(Json(TokenizeResponse {
        count: r.token_ids.len(),
        max_model_len: front.model.context_length,
        tokens: r.token_ids,
        token_strs: body.return_token_strs.then_some(r.tokens),
    }))
}

/// `POST /detokenize`: the tokens' text, special tokens included.
async fn detokenize<C: Core>(
    State(front): State<Arc<HttpFront<C>>>,
    body: Result<Json<DetokenizeRequest>, JsonRejection>,
) -> Result<Json<DetokenizeResponse>, HttpError> {
    let Json(body) = body?;
    body.check(&front.model.names, front.model.vocab_size)?;
    let prompt = front
        .model
        .tokenizer
        .decode(&body.tokens, false)
        .map_err(|e| OpenAiError::Invalid {
            param: "tokens",
            message: format!("tokens: {e}"),
        })?;
    Ok(Json(DetokenizeResponse { prompt }))
}

async fn models<C: Core>(State(front): State<Arc<HttpFront<C>>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: front
            .model
            .names
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

/// Ready (200) when a decode worker is routable and so is a prefill path: a prefill worker, or
/// none configured (every prompt prefills on its decode worker). 503 otherwise.
async fn health<C: Core>(
    State(front): State<Arc<HttpFront<C>>>,
) -> (StatusCode, Json<serde_json::Value>) {
    let r = front.core.readiness();
    let status = if r.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(serde_json::json!({
            "status": if r.ready { "ready" } else { "unavailable" },
            "decode_workers_up": r.decode_workers_up,
            "prefill_workers_up": r.prefill_workers_up,
            "refused_prefill": r.refused_prefill,
            "refused_prefill_plans": r.refused_prefill_plans,
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

#[cfg(test)]
pub(crate) mod tests {
    use std::path::Path;
    use std::sync::Mutex;

    use axum::body::Body;
    use tokio::sync::mpsc;
    use tower::Service;

    use super::*;
    use crate::door::Readiness;
    use crate::validate::ValidationError;

    /// A core whose generations answer with the scripted messages, in order.
    #[derive(Default)]
    pub(crate) struct ScriptedCore {
        answers: Mutex<VecDeque<Result<Vec<v1::GenerateResponse>, RouterError>>>,
        /// Every request started, as the front made it.
        pub started: Mutex<Vec<v1::GenerateRequest>>,
        /// Every request tokenized.
        tokenized: Mutex<Vec<v1::TokenizeRequest>>,
        ready: bool,
    }

    impl ScriptedCore {
        pub(crate) fn answering(
            answers: impl IntoIterator<Item = Result<Vec<v1::GenerateResponse>, RouterError>>,
        ) -> Self {
            Self {
                answers: Mutex::new(answers.into_iter().collect()),
                ready: true,
                ..Default::default()
            }
        }
    }

    impl Core for ScriptedCore {
        async fn start(
            &self,
            req: v1::GenerateRequest,
            _deadline: Instant,
        ) -> Result<Messages, RouterError> {
            self.started.lock().unwrap().push(req);
            let messages = self
                .answers
                .lock()
                .unwrap()
                .pop_front()
                .expect("scripted")?;
            let (tx, rx) = mpsc::channel(messages.len().max(1));
            for m in messages {
                tx.try_send(Ok(m)).unwrap();
            }
            Ok(rx)
        }

        /// The text's bytes as ids, or one id per message (its content's length).
        async fn tokenize(
            &self,
            req: v1::TokenizeRequest,
        ) -> Result<v1::TokenizeResponse, RouterError> {
            let token_ids: Vec<u32> = if req.messages.is_empty() {
                req.text.bytes().map(u32::from).collect()
            } else {
                req.messages
                    .iter()
                    .map(|m| m.content.len() as u32)
                    .collect()
            };
            let tokens = token_ids.iter().map(|id| format!("<{id}>")).collect();
            self.tokenized.lock().unwrap().push(req);
            Ok(v1::TokenizeResponse { token_ids, tokens })
        }

        fn readiness(&self) -> Readiness {
            Readiness {
                decode_workers_up: usize::from(self.ready),
                prefill_workers_up: 0,
                ready: self.ready,
                refused_prefill: Vec::new(),
                refused_prefill_plans: 0,
            }
        }
    }

    pub(crate) fn tiny_tokenizer() -> Tokenizer {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama");
        duet_model::model_files::open_model(&dir)
            .expect("tiny-llama opens")
            .tokenizer
    }

    /// The messages of an answer in `pieces` of text (one token each) that ends with `finish`.
    pub(crate) fn answer(pieces: &[&str], finish: v1::FinishReason) -> Vec<v1::GenerateResponse> {
        let last = pieces.len() - 1;
        pieces
            .iter()
            .enumerate()
            .map(|(i, text)| v1::GenerateResponse {
                request_id: "7".into(),
                text: text.to_string(),
                token_ids: vec![5],
                finish_reason: if i == last { finish as i32 } else { 0 },
                usage: (i == last).then(|| v1::Usage {
                    prompt_tokens: 3,
                    completion_tokens: pieces.len() as u32,
                    ..Default::default()
                }),
                ..Default::default()
            })
            .collect()
    }

    /// The front over `core`, serving the model as `m`, with tool calls read in Hermes markup.
    pub(crate) fn front_app(core: Arc<ScriptedCore>, limit: usize) -> axum::Router {
        let front = HttpFront {
            core,
            model: ServedModel {
                names: vec!["m".into()],
                tokenizer: tiny_tokenizer(),
                vocab_size: 384,
                context_length: 256,
                auto_tool_calls: Ok(ToolCallFormat::Hermes),
            },
            limit: InFlightLimitLayer::new(limit),
            request_timeout: Duration::from_secs(60),
        };
        app(Arc::new(front), 1 << 20, None)
    }

    /// One call: the status and the body.
    pub(crate) async fn call(
        app: &mut axum::Router,
        method: &str,
        path: &str,
        body: &str,
    ) -> (StatusCode, axum::http::HeaderMap, String) {
        let request = axum::http::Request::builder()
            .method(method)
            .uri(path)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_string()))
            .unwrap();
        let response = app.call(request).await.unwrap();
        let (parts, body) = response.into_parts();
        let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
        (
            parts.status,
            parts.headers,
            String::from_utf8(bytes.to_vec()).unwrap(),
        )
    }

    /// The JSON of each `data:` event of a stream, up to `[DONE]` (which must end it).
    pub(crate) fn events(body: &str) -> Vec<serde_json::Value> {
        let data: Vec<&str> = body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .collect();
        assert_eq!(data.last(), Some(&"[DONE]"), "{body}");
        data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    }

    const CHAT: &str = r#"{"model":"m","messages":[{"role":"user","content":"Hi"}]"#;

    /// A chat answer whole and streamed: the same text, its role first when streamed, the
    /// finish reason and usage; the request reaches the core as a conversation.
    #[tokio::test]
    async fn a_chat_answer_is_the_cores_text_whole_and_streamed() {
        let core = Arc::new(ScriptedCore::answering([
            Ok(answer(&["Hel", "lo"], v1::FinishReason::Stop)),
            Ok(answer(&["Hel", "lo"], v1::FinishReason::Length)),
        ]));
        let mut app = front_app(core.clone(), 8);
        let (status, _, body) = call(
            &mut app,
            "POST",
            "/v1/chat/completions",
            &format!("{CHAT}}}"),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let whole: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(whole["object"], "chat.completion");
        assert_eq!(whole["id"], "chatcmpl-7");
        assert_eq!(whole["choices"][0]["message"]["content"], "Hello");
        assert_eq!(whole["choices"][0]["finish_reason"], "stop");
        assert_eq!(whole["usage"]["total_tokens"], 5);
        let started = core.started.lock().unwrap()[0].clone();
        assert_eq!(started.messages[0].content, "Hi");
        let (status, _, body) = call(
            &mut app,
            "POST",
            "/v1/chat/completions",
            &format!(r#"{CHAT},"stream":true}}"#),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        let chunks = events(&body);
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(text, "Hello");
        assert_eq!(
            chunks.last().unwrap()["choices"][0]["finish_reason"],
            "length"
        );
    }

    /// Under a named or `required` tool choice the answer is always a call, whole and streamed,
    /// and one cut short by `max_tokens` says `length`; a schema-held answer cut short too.
    #[tokio::test]
    async fn a_tool_call_cut_short_is_still_a_call_that_says_length() {
        let tools = r#""tools":[{"type":"function","function":{"name":"get_weather",
            "parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]"#;
        let named = r#""tool_choice":{"type":"function","function":{"name":"get_weather"}}"#;
        let cases = [
            (
                named,
                &["{\"city\":", "\"Par"][..],
                "get_weather",
                "{\"city\":\"Par",
            ),
            (
                r#""tool_choice":"required""#,
                &["{\"name\":\"get_wea"][..],
                "get_wea",
                "",
            ),
            (
                r#""tool_choice":"required""#,
                &["{\"name\":\"get_weather\",", "\"arguments\":{\"ci"][..],
                "get_weather",
                "{\"ci",
            ),
        ];
        for (choice, pieces, name, arguments) in cases {
            let core = Arc::new(ScriptedCore::answering([
                Ok(answer(pieces, v1::FinishReason::Length)),
                Ok(answer(pieces, v1::FinishReason::Length)),
            ]));
            let mut app = front_app(core, 8);
            let body = format!("{CHAT},{tools},{choice}");
            let (status, _, whole) = call(
                &mut app,
                "POST",
                "/v1/chat/completions",
                &format!("{body}}}"),
            )
            .await;
            assert_eq!(status, StatusCode::OK, "{whole}");
            let whole: serde_json::Value = serde_json::from_str(&whole).unwrap();
            let choice_out = &whole["choices"][0];
            assert_eq!(choice_out["finish_reason"], "length", "{whole}");
            assert!(choice_out["message"]["content"].is_null(), "{whole}");
            let call_out = &choice_out["message"]["tool_calls"][0];
            assert_eq!(call_out["function"]["name"], name, "{whole}");
            assert_eq!(call_out["function"]["arguments"], arguments, "{whole}");
            let (_, _, streamed) = call(
                &mut app,
                "POST",
                "/v1/chat/completions",
                &format!(r#"{body},"stream":true}}"#),
            )
            .await;
            let chunks = events(&streamed);
            assert!(
                chunks.iter().all(|c| c["choices"][0]["delta"]["content"]
                    .as_str()
                    .is_none_or(str::is_empty)),
                "{streamed}"
            );
            let deltas: Vec<&serde_json::Value> = chunks
                .iter()
                .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
                .flatten()
                .collect();
            assert_eq!(deltas[0]["function"]["name"], name, "{streamed}");
            let joined: String = deltas
                .iter()
                .filter_map(|d| d["function"]["arguments"].as_str())
                .collect();
            assert_eq!(joined, arguments, "{streamed}");
            assert_eq!(
                chunks.last().unwrap()["choices"][0]["finish_reason"],
                "length",
                "{streamed}"
            );
        }
        // Not cut: the call finishes with `tool_calls`.
        let core = Arc::new(ScriptedCore::answering([Ok(answer(
            &["{\"city\":\"Paris\"}"],
            v1::FinishReason::Stop,
        ))]));
        let mut app = front_app(core, 8);
        let (_, _, whole) = call(
            &mut app,
            "POST",
            "/v1/chat/completions",
            &format!("{CHAT},{tools},{named}}}"),
        )
        .await;
        assert!(whole.contains(r#""finish_reason":"tool_calls""#), "{whole}");
        // A schema-held answer cut short says `length` too.
        let core = Arc::new(ScriptedCore::answering([Ok(answer(
            &["{\"a\":1"],
            v1::FinishReason::Length,
        ))]));
        let mut app = front_app(core, 8);
        let (_, _, whole) = call(
            &mut app,
            "POST",
            "/v1/chat/completions",
            &format!(r#"{CHAT},"response_format":{{"type":"json_object"}}}}"#),
        )
        .await;
        assert!(whole.contains(r#""finish_reason":"length""#), "{whole}");
    }

    /// `/tokenize` takes a prompt or messages (the template's variables with them) and answers
    /// the core's tokens, their count and the context; `/detokenize` gives the tokens' text;
    /// bad input is 400 naming the field.
    #[tokio::test]
    async fn tokenize_and_detokenize_answer_as_vllm_and_name_bad_fields() {
        let core = Arc::new(ScriptedCore::answering([]));
        let mut app = front_app(core.clone(), 8);
        let (status, _, body) = call(
            &mut app,
            "POST",
            "/tokenize",
            r#"{"model":"m","prompt":"Hi"}"#,
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let r: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            r,
            serde_json::json!({"count": 2, "max_model_len": 256, "tokens": [72, 105],
                                         "token_strs": null})
        );
        let (_, _, body) = call(
            &mut app,
            "POST",
            "/tokenize",
            r#"{"messages":[{"role":"user","content":"abc"}],"return_token_strs":true,
                "chat_template_kwargs":{"x":1},"tools":[{"type":"function","function":{"name":"f"}}]}"#,
        )
        .await;
        let r: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            (&r["tokens"], &r["token_strs"]),
            (&serde_json::json!([3]), &serde_json::json!(["<3>"]))
        );
        let asked = core.tokenized.lock().unwrap()[1].clone();
        let vars: serde_json::Value = serde_json::from_str(&asked.chat_template_kwargs).unwrap();
        assert_eq!(
            (&vars["x"], &vars["tools"][0]["function"]["name"]),
            (&serde_json::json!(1), &serde_json::json!("f"))
        );
        let (status, _, body) = call(
            &mut app,
            "POST",
            "/detokenize",
            r#"{"model":"m","tokens":[75,108]}"#,
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let text = tiny_tokenizer().decode(&[75, 108], false).unwrap();
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&body).unwrap()["prompt"],
            text
        );
        for (path, body, param) in [
            ("/tokenize", r#"{"model":"m"}"#, "prompt"),
            (
                "/tokenize",
                r#"{"prompt":"a","messages":[{"role":"user","content":"b"}]}"#,
                "messages",
            ),
            ("/tokenize", r#"{"messages":[]}"#, "messages"),
            (
                "/tokenize",
                r#"{"prompt":"a","add_special_tokens":false}"#,
                "add_special_tokens",
            ),
            (
                "/tokenize",
                r#"{"prompt":"a","tools":[{"type":"function","function":{"name":"f"}}]}"#,
                "tools",
            ),
            (
                "/tokenize",
                r#"{"messages":[{"role":"user","content":"b"}],"add_generation_prompt":false}"#,
                "add_generation_prompt",
            ),
            ("/detokenize", r#"{"tokens":[1,384]}"#, "tokens"),
            (
                "/v1/completions",
                r#"{"model":"m","prompt":[1,2,999]}"#,
                "prompt",
            ),
        ] {
            let (status, _, answer) = call(&mut app, "POST", path, body).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {body}: {answer}");
            let e: serde_json::Value = serde_json::from_str(&answer).unwrap();
            assert_eq!(e["error"]["param"], param, "{path} {body}: {answer}");
        }
        let (status, _, answer) =
            call(&mut app, "POST", "/detokenize", r#"{"tokens":[1,384]}"#).await;
        assert!(
            status == StatusCode::BAD_REQUEST && answer.contains("tokens[1] = 384"),
            "{answer}"
        );
        let (status, _, _) = call(
            &mut app,
            "POST",
            "/tokenize",
            r#"{"model":"x","prompt":"a"}"#,
        )
        .await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        let (status, _, answer) =
            call(&mut app, "POST", "/detokenize", r#"{"tokens":["a"]}"#).await;
        assert!(
            status == StatusCode::UNPROCESSABLE_ENTITY && answer.contains("tokens[0]"),
            "{answer}"
        );
    }

    /// The core's errors and the front's own refusals, each as its status in OpenAI's envelope.
    #[tokio::test]
    async fn errors_are_answered_with_their_status_in_the_envelope() {
        let core = Arc::new(ScriptedCore::answering([
            Err(RouterError::Invalid(ValidationError::EmptyPrompt)),
            Err(RouterError::NoDecodeWorker(None)),
            Err(RouterError::DeadlineExceeded(Duration::from_millis(1))),
        ]));
        let mut app = front_app(core, 8);
        let chat = format!("{CHAT}}}");
        for (status, kind) in [
            (StatusCode::BAD_REQUEST, "invalid_request_error"),
            (StatusCode::SERVICE_UNAVAILABLE, "server_error"),
            (StatusCode::GATEWAY_TIMEOUT, "server_error"),
        ] {
            let (got, _, body) = call(&mut app, "POST", "/v1/chat/completions", &chat).await;
            assert_eq!(got, status, "{body}");
            let e: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(e["error"]["type"], kind, "{body}");
            assert!(
                e["error"]["message"]
                    .as_str()
                    .is_some_and(|m| !m.is_empty())
            );
        }
        let (got, _, body) = call(
            &mut app,
            "POST",
            "/v1/chat/completions",
            r#"{"model":"x","messages":[{"role":"user","content":"Hi"}]}"#,
        )
        .await;
        assert_eq!(got, StatusCode::NOT_FOUND);
        assert!(body.contains("model_not_found"), "{body}");
        let (got, _, body) = call(&mut app, "POST", "/v1/completions", r#"{"model":"m"}"#).await;
        assert_eq!(got, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        let (got, _, _) = call(&mut app, "GET", "/nowhere", "").await;
        assert_eq!(got, StatusCode::NOT_FOUND);
        let mut full = front_app(Arc::new(ScriptedCore::default()), 0);
        let (got, headers, _) = call(&mut full, "POST", "/v1/chat/completions", &chat).await;
        assert_eq!(got, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(headers[header::RETRY_AFTER], "1");
        let (got, _, body) = call(&mut full, "GET", "/health", "").await;
        assert_eq!(got, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        let (got, _, body) = call(&mut app, "GET", "/health", "").await;
        assert_eq!(got, StatusCode::OK, "{body}");
        let (got, _, body) = call(&mut app, "GET", "/v1/models", "").await;
        assert_eq!(got, StatusCode::OK);
        assert!(body.contains(r#""id":"m""#), "{body}");
    }
}
