//! Every service's gRPC edge, built once from tower layers: the call's deadline from
//! `grpc-timeout` (one policy, with a configurable default), a limit on calls in flight that sheds
//! the excess at once with RESOURCE_EXHAUSTED (a stream counts until it ends), the cluster token
//! on internal calls ([`crate::auth`]), INVALID_ARGUMENT for a request that cannot be decoded
//! ([`crate::malformed`]), each call's server span joined to its caller's trace
//! ([`TraceContextLayer`]), Nagle's algorithm off, `grpc.health.v1` and server reflection (v1
//! and v1alpha) for every service added; and [`terminated`], the signal every service and
//! `duet up` stop on.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::service::RoutesBuilder;
use tonic_health::server::{HealthReporter, HealthService};
use tower::{Layer, Service};
use tracing::Instrument;
use tracing::instrument::Instrumented;

use crate::auth::{ClusterAuthLayer, ClusterToken};
use crate::malformed::MalformedRequestLayer;

/// Largest gRPC message any duet service or client sends or accepts (KV chunks are 1 MiB; a
/// stream of logprobs can be large). The router's public limit is its own flag.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// How a service's edge treats calls.
#[derive(Clone, Debug)]
pub struct EdgeOptions {
    /// Deadline of a call that carries no `grpc-timeout`.
    pub default_deadline: Duration,
    /// Calls served at once; past it a call is refused with RESOURCE_EXHAUSTED at once. Health
    /// checks and reflection are never counted or refused.
    pub max_in_flight: usize,
    /// The token internal calls must carry; `None`: they are open.
    pub cluster_token: Option<ClusterToken>,
    /// TLS on the port ([`crate::Tls::server_requiring_client_certs`] on internal ports,
    /// [`crate::Tls::server`] on public ones); `None`: plaintext.
    pub tls: Option<tonic::transport::ServerTlsConfig>,
}

/// The deadline of a call: its `grpc-timeout` from when it arrived, or the edge's default.
/// Handlers read it with [`deadline`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deadline(pub Instant);

/// The default of every service's `--request-timeout-ms`, and the deadline of a call that did
/// not come through an edge and carries no `grpc-timeout` (a handler called directly in a test).
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(600);

/// The deadline the edge gave this call (one that did not come through an edge gets its
/// `grpc-timeout`, else [`DEFAULT_DEADLINE`]: the same policy).
pub fn deadline<T>(request: &tonic::Request<T>) -> Instant {
    match request.extensions().get::<Deadline>() {
        Some(d) => d.0,
        None => {
            Instant::now() + grpc_timeout(request.metadata().as_ref()).unwrap_or(DEFAULT_DEADLINE)
        }
    }
}

/// The caller's remaining time from the `grpc-timeout` header (`<digits><unit>`, unit one of
/// H M S m u n). `None` when the caller set no deadline or the header is malformed.
fn grpc_timeout(headers: &http::HeaderMap) -> Option<Duration> {
    let v = headers.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// Whether a path belongs to a service the edge never limits (health, reflection).
pub(crate) fn is_infrastructure(path: &str) -> bool {
    path.starts_with("/grpc.health.v1.") || path.starts_with("/grpc.reflection.")
}

/// Sets [`Deadline`] on every call.
#[derive(Clone, Copy, Debug)]
pub struct DeadlineLayer {
    default: Duration,
}

impl<S> Layer<S> for DeadlineLayer {
    type Service = DeadlineService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        DeadlineService {
            inner,
            default: self.default,
        }
    }
}

#[derive(Clone, Debug)]
pub struct DeadlineService<S> {
    inner: S,
    default: Duration,
}

impl<S, B> Service<Request<B>> for DeadlineService<S>
where
    S: Service<Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let timeout = grpc_timeout(request.headers()).unwrap_or(self.default);
        request
            .extensions_mut()
            .insert(Deadline(Instant::now() + timeout));
        self.inner.call(request)
    }
}

/// Which protocol a [`TraceContextLayer`] names server spans for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// `package.Service/Method`, as OpenTelemetry's RPC conventions name a gRPC server span.
    Grpc,
    /// `METHOD /path` (the router's OpenAI-compatible HTTP API).
    Http,
}

/// Runs each call in a server span that continues the caller's trace (W3C `traceparent` in its
/// headers), so the spans its handler opens join that trace. A call to the public API without
/// one starts a trace; an internal call without one (the router's stats polls, KV event feeds)
/// gets no span, nor do health checks and reflection, nor anything while traces are not
/// exported.
#[derive(Clone, Copy, Debug)]
pub struct TraceContextLayer(pub Protocol);

impl<S> Layer<S> for TraceContextLayer {
    type Service = TraceContext<S>;

    fn layer(&self, inner: S) -> Self::Service {
        TraceContext {
            inner,
            protocol: self.0,
        }
    }
}

#[derive(Clone, Debug)]
pub struct TraceContext<S> {
    inner: S,
    protocol: Protocol,
}

impl<S, B> Service<Request<B>> for TraceContext<S>
where
    S: Service<Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Instrumented<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        use duet_telemetry::traces::{HeaderReader, caller_context, exporting};
        let path = request.uri().path();
        let traced = exporting() && !is_infrastructure(path);
        let caller = traced
            .then(|| caller_context(&HeaderReader(request.headers())))
            .flatten();
        let public = self.protocol == Protocol::Http || crate::auth::is_open(path);
        let span = if !traced || (caller.is_none() && !public) {
            tracing::Span::none()
        } else {
            let span = match self.protocol {
                Protocol::Grpc => tracing::info_span!(
                    "rpc",
                    otel.name = path.trim_start_matches('/'),
                    otel.kind = "server",
                    rpc.system = "grpc",
                ),
                Protocol::Http => tracing::info_span!(
                    "http",
                    otel.name = %format_args!("{} {path}", request.method()),
                    otel.kind = "server",
                    http.request.method = %request.method(),
                    url.path = path,
                ),
            };
            if let Some(caller) = caller {
                caller.adopt(&span);
            }
            span
        };
        self.inner.call(request).instrument(span)
    }
}

/// A call refused because the service already has its limit of calls in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("overloaded: {limit} calls are already in flight; retry later")]
pub struct Overloaded {
    pub limit: usize,
}

/// Limits the calls in flight; the excess is refused at once (load shedding), never queued.
/// Clones share one limit, so another front of the same service (the router's HTTP API) can
/// admit its calls against it with [`InFlightLimitLayer::try_admit`].
#[derive(Clone)]
pub struct InFlightLimitLayer {
    permits: Arc<Semaphore>,
    limit: usize,
    /// Told of every refusal (the service's request metrics: a refused call never reaches it).
    on_refused: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl std::fmt::Debug for InFlightLimitLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlightLimitLayer")
            .field("limit", &self.limit)
            .field("available", &self.permits.available_permits())
            .finish_non_exhaustive()
    }
}

impl InFlightLimitLayer {
    pub fn new(limit: usize) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(limit)),
            limit,
            on_refused: None,
        }
    }

    /// Admits one call, counted until the permit drops.
    pub fn try_admit(&self) -> Result<OwnedSemaphorePermit, Overloaded> {
        self.permits.clone().try_acquire_owned().map_err(|_| {
            if let Some(f) = &self.on_refused {
                f();
            }
            Overloaded { limit: self.limit }
        })
    }
}

impl<S> Layer<S> for InFlightLimitLayer {
    type Service = InFlightLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        InFlightLimit {
            inner,
            limit: self.clone(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct InFlightLimit<S> {
    inner: S,
    limit: InFlightLimitLayer,
}

pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S> Service<Request<Body>> for InFlightLimit<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        if is_infrastructure(request.uri().path()) {
            return Box::pin(self.inner.call(request));
        }
        let permit = match self.limit.try_admit() {
            Ok(permit) => permit,
            Err(overloaded) => {
                let status = tonic::Status::resource_exhausted(overloaded.to_string());
                return Box::pin(std::future::ready(Ok(status.into_http())));
            }
        };
        let response = self.inner.call(request);
        Box::pin(async move {
            let response = response.await?;
            // The permit lives as long as the response body: a stream counts until it ends.
            Ok(response.map(|body| Holding::body(body, permit)))
        })
    }
}

/// A response body that holds `G` (an in-flight permit, a gate's pass) until it is dropped.
pub(crate) struct Holding<G> {
    body: Body,
    _guard: G,
}

impl<G: Send + Unpin + 'static> Holding<G> {
    /// `body`, holding `guard` as long as it lives.
    pub(crate) fn body(body: Body, guard: G) -> Body {
        Body::new(Self {
            body,
            _guard: guard,
        })
    }
}

impl<G: Unpin> http_body::Body for Holding<G> {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// A service's gRPC edge: the services it serves, with health and reflection added for them.
pub struct Edge {
    options: EdgeOptions,
    limit: InFlightLimitLayer,
    routes: RoutesBuilder,
    names: Vec<&'static str>,
    health: HealthReporter,
    drain: Arc<tokio::sync::watch::Sender<bool>>,
    /// Health follows it (SERVING while true) until the drain begins; `None`: always SERVING.
    ready: Option<tokio::sync::watch::Receiver<bool>>,
}

/// Resolves when the edge's drain begins, for the calls that would otherwise never end (KV event
/// subscriptions): a graceful shutdown waits for every open call, so such a call would hold the
/// drain until its timeout.
#[derive(Clone, Debug)]
pub struct DrainBegun(tokio::sync::watch::Receiver<bool>);

impl DrainBegun {
    pub async fn wait(&mut self) {
        if self.0.wait_for(|&begun| begun).await.is_err() {
            // The edge is gone without draining: nothing will begin one.
            std::future::pending::<()>().await;
        }
    }
}

/// Turns an edge's health NOT_SERVING (every service, and ""), for a worker that drains: the
/// router and Kubernetes' readiness probe stop sending it work while its calls finish.
#[derive(Clone, Debug)]
pub struct Draining {
    health: HealthReporter,
    names: Vec<&'static str>,
    drain: Arc<tokio::sync::watch::Sender<bool>>,
}

impl Draining {
    /// Health NOT_SERVING, and the calls waiting on [`DrainBegun`] end.
    pub async fn begin(&self) {
        self.set(tonic_health::ServingStatus::NotServing).await;
        self.drain.send_replace(true);
    }

    /// Every service's status, and the server's ("").
    async fn set(&self, status: tonic_health::ServingStatus) {
        for name in std::iter::once("").chain(self.names.iter().copied()) {
            self.health.set_service_status(name, status).await;
        }
    }
}

impl Edge {
    pub fn new(options: EdgeOptions) -> Self {
        Self {
            limit: InFlightLimitLayer::new(options.max_in_flight),
            options,
            routes: RoutesBuilder::default(),
            names: Vec::new(),
            health: HealthReporter::new(),
            drain: Arc::new(tokio::sync::watch::Sender::new(false)),
            ready: None,
        }
    }

    /// Health SERVING only while `ready` holds true (until the drain begins, which turns it
    /// NOT_SERVING for good): for a worker that cannot do its work yet.
    pub fn ready_when(mut self, ready: tokio::sync::watch::Receiver<bool>) -> Self {
        self.ready = Some(ready);
        self
    }

    /// The signal a never-ending call stops on (see [`DrainBegun`]).
    pub fn drain_begun(&self) -> DrainBegun {
        DrainBegun(self.drain.subscribe())
    }

    /// The handle that marks this edge's health NOT_SERVING (take it once every service is
    /// added).
    pub fn draining(&self) -> Draining {
        Draining {
            health: self.health.clone(),
            names: self.names.clone(),
            drain: self.drain.clone(),
        }
    }

    /// Calls `f` for every call the in-flight limit refuses (set it before sharing the limit).
    pub fn on_refused(mut self, f: impl Fn() + Send + Sync + 'static) -> Self {
        self.limit.on_refused = Some(Arc::new(f));
        self
    }

    /// The edge's limit on calls in flight, for another front of the same service to share.
    pub fn in_flight_limit(&self) -> InFlightLimitLayer {
        self.limit.clone()
    }

    /// Adds a service (a generated `…Server`, already given its message-size limits).
    pub fn service<S>(mut self, service: S) -> Self
    where
        S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
            + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Future: Send + 'static,
    {
        self.names.push(S::NAME);
        self.routes.add_service(service);
        self
    }

    /// Serves every added service, health (SERVING for each, and for "") and reflection on
    /// `listener` (over TLS when the options have it) until `shutdown` resolves (then drains open calls).
    pub async fn serve(
        mut self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), tonic::transport::Error> {
        let draining = self.draining();
        match self.ready.take() {
            None => draining.set(tonic_health::ServingStatus::Serving).await,
            Some(mut ready) => {
                let mut drain = self.drain.subscribe();
                let status = |ready: bool| match ready {
                    true => tonic_health::ServingStatus::Serving,
                    false => tonic_health::ServingStatus::NotServing,
                };
                let now = *ready.borrow_and_update();
                draining.set(status(now)).await;
                // Ends when the drain begins (or whoever says `ready` is gone).
                tokio::spawn(async move {
                    loop {
                        tokio::select! {
                            changed = ready.changed() => {
                                let now = *ready.borrow_and_update();
                                if changed.is_err() || *drain.borrow() {
                                    return;
                                }
                                draining.set(status(now)).await;
                            }
                            changed = drain.changed() => {
                                if changed.is_err() || *drain.borrow() {
                                    return;
                                }
                            }
                        }
                    }
                });
            }
        }
        let health = tonic_health::pb::health_server::HealthServer::new(
            HealthService::from_health_reporter(self.health.clone()),
        );
        let (reflection_v1, reflection_v1alpha) = crate::reflection_services();
        self.routes
            .add_service(health)
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha);
        let mut server = tonic::transport::Server::builder();
        if let Some(tls) = self.options.tls {
            server = server.tls_config(tls)?;
        }
        server
            // Outermost: a caller without the token costs nothing further.
            .layer(ClusterAuthLayer::new(self.options.cluster_token))
            .layer(TraceContextLayer(Protocol::Grpc))
            .layer(DeadlineLayer {
                default: self.options.default_deadline,
            })
            .layer(self.limit)
            .layer(MalformedRequestLayer)
            .add_routes(self.routes.routes())
            .serve_with_incoming_shutdown(crate::incoming(listener), shutdown)
            .await
    }
}

/// Resolves on SIGTERM (what `kill`, systemd and Kubernetes send) or ctrl-c: the one stop signal
/// of every service and of `duet up`.
pub async fn terminated() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing the SIGTERM handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM"),
        _ = tokio::signal::ctrl_c() => tracing::info!("ctrl-c"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_parses_every_unit_and_rejects_garbage() {
        let mut h = http::HeaderMap::new();
        assert_eq!(grpc_timeout(&h), None);
        for (v, d) in [
            ("2H", Duration::from_secs(7200)),
            ("3M", Duration::from_secs(180)),
            ("5S", Duration::from_secs(5)),
            ("250m", Duration::from_millis(250)),
            ("7u", Duration::from_micros(7)),
            ("9n", Duration::from_nanos(9)),
        ] {
            h.insert("grpc-timeout", v.parse().unwrap());
            assert_eq!(grpc_timeout(&h), Some(d), "{v}");
        }
        for bad in ["12x", "S", "5", "-5S", "+5S"] {
            h.insert("grpc-timeout", bad.parse().unwrap());
            assert_eq!(grpc_timeout(&h), None, "{bad}");
        }
    }

    #[test]
    fn health_and_reflection_are_never_limited() {
        assert!(is_infrastructure("/grpc.health.v1.Health/Check"));
        assert!(is_infrastructure(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
        ));
        assert!(!is_infrastructure("/duet.v1.Generation/Generate"));
    }
}
