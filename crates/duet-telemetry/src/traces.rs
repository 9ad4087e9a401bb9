//! OpenTelemetry traces over OTLP/gRPC (`--otlp-endpoint`, or the standard
//! `OTEL_EXPORTER_OTLP_ENDPOINT`): the process's `tracing` spans become OpenTelemetry spans,
//! batched and exported by a thread of their own; W3C `traceparent` carries a trace across
//! processes ([`inject`] on every outgoing internal call, [`set_remote_parent`] at every edge).
//!
//! Span fields become span attributes; numbers must be recorded as `i64` (tracing-opentelemetry
//! writes unsigned ones as strings).
//!
//! Without an endpoint nothing is built: no exporter, no layer, no propagator, and [`inject`]
//! and [`set_remote_parent`] return at once.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use opentelemetry::propagation::TextMapPropagator;
pub use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Subscriber;
use tracing::dispatcher::WeakDispatch;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::registry::LookupSpan;

/// Whether this process exports traces (set once, by [`Exporter::start`]).
static EXPORTING: AtomicBool = AtomicBool::new(false);

/// The installed subscriber, for reading a span's trace id while formatting a log line (where
/// the current dispatcher cannot be asked again).
static DISPATCH: OnceLock<WeakDispatch> = OnceLock::new();

/// An OTLP exporter that could not be built (a malformed endpoint).
#[derive(Debug, thiserror::Error)]
pub enum TracesError {
    #[error("OTLP exporter for {endpoint:?}: {source}")]
    Exporter {
        endpoint: String,
        source: opentelemetry_otlp::ExporterBuildError,
    },
    #[error("the OTLP export thread's runtime: {0}")]
    Runtime(std::io::Error),
}

/// The running export: spans are batched and sent from threads of its own, never a serving
/// thread. Dropping it flushes what is left and stops.
pub struct Exporter {
    provider: SdkTracerProvider,
    /// The runtime the exporter's gRPC channel lives on (the batch processor's thread awaits it).
    runtime: Option<tokio::runtime::Runtime>,
}

/// How long shutting down may take to send the last spans.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

impl Exporter {
    /// Starts exporting to `endpoint` (`http://host:4317`) as `service_name`, with the W3C trace
    /// context as the process's propagator.
    pub fn start(endpoint: &str, service_name: &'static str) -> Result<Self, TracesError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("otlp-export")
            .enable_all()
            .build()
            .map_err(TracesError::Runtime)?;
        let exporter = {
            let _in_runtime = runtime.enter();
            opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint)
                .build()
                .map_err(|source| TracesError::Exporter {
                    endpoint: endpoint.to_string(),
                    source,
                })?
        };
        let provider = SdkTracerProvider::builder()
            .with_resource(Resource::builder().with_service_name(service_name).build())
            .with_batch_exporter(exporter)
            .build();
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        EXPORTING.store(true, Ordering::Release);
        Ok(Self {
            provider,
            runtime: Some(runtime),
        })
    }

    /// The `tracing` layer that turns spans into this exporter's OpenTelemetry spans (events in
    /// a span become its span events).
    pub fn layer<S>(&self) -> impl tracing_subscriber::Layer<S> + use<S>
    where
        S: Subscriber + for<'a> LookupSpan<'a>,
    {
        tracing_opentelemetry::layer()
            .with_tracer(self.provider.tracer("duet"))
            .with_threads(false)
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        if let Err(e) = self.provider.shutdown_with_timeout(FLUSH_TIMEOUT) {
            eprintln!("flushing OpenTelemetry spans failed: {e}");
        }
        if let Some(runtime) = self.runtime.take() {
            // Dropped from async code too (a service's main): never block on the runtime.
            runtime.shutdown_background();
        }
    }
}

/// Remembers the installed subscriber (see [`trace_id`]).
pub(crate) fn remember_dispatch() {
    tracing::dispatcher::get_default(|d| {
        let _ = DISPATCH.set(d.downgrade());
    });
}

/// Whether this process exports traces.
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Acquire)
}

/// Writes the current span's trace context (`traceparent`, `tracestate`) into an outgoing call.
pub fn inject(carrier: &mut dyn Injector) {
    if !exporting() {
        return;
    }
    let cx = tracing::Span::current().context();
    TraceContextPropagator::new().inject_context(&cx, carrier);
}

/// The trace context a caller sent in `carrier`, when traces are exported and it sent one.
pub fn caller_context(carrier: &dyn Extractor) -> Option<CallerContext> {
    if !exporting() {
        return None;
    }
    let cx = TraceContextPropagator::new().extract(carrier);
    cx.span()
        .span_context()
        .is_valid()
        .then(|| CallerContext(cx.clone()))
}

/// A caller's trace context (see [`caller_context`]).
pub struct CallerContext(opentelemetry::Context);

impl CallerContext {
    /// Makes `span` (just created, not yet entered) a child of the caller's span.
    pub fn adopt(self, span: &tracing::Span) {
        // A span not yet started takes any parent; a failure would leave it a root.
        let _ = span.set_parent(self.0);
    }
}

/// Reads a trace context from HTTP headers (gRPC metadata is HTTP/2 headers).
pub struct HeaderReader<'h>(pub &'h http::HeaderMap);

impl Extractor for HeaderReader<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

/// The trace id (32 hex digits) of span `id`, when it belongs to an exported trace.
pub(crate) fn trace_id(id: &tracing::span::Id) -> Option<String> {
    if !exporting() {
        return None;
    }
    let dispatch = DISPATCH.get()?.upgrade()?;
    let cx = tracing_opentelemetry::get_otel_context(id, &dispatch)?;
    let span = cx.span();
    let context = span.span_context();
    context.is_valid().then(|| context.trace_id().to_string())
}
