//! Telemetry every duet service shares: its logs, as text for people or as JSON lines for log
//! collectors (`--log-format`, `DUET_LOG_FORMAT`; `RUST_LOG` filters them, default `info`), and
//! its traces, exported over OTLP when `--otlp-endpoint` (`OTEL_EXPORTER_OTLP_ENDPOINT`) names a
//! collector ([`traces`]).
//!
//! A request's events happen inside its `request` span (the router's relay opens it), so JSON
//! lines carry `request_id` in their `span` object, and `trace_id` when the span belongs to an
//! exported trace.
//!
//! Prometheus metrics ([`metrics`]): the process's registry and its `/metrics` endpoint.

pub mod metrics;
pub mod traces;

use std::ffi::OsString;
use std::fmt;

use tracing::{Event, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::{JsonFields, Writer};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, MakeWriter};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

pub use metrics::MetricsArgs;
pub use traces::{Exporter, TracesError};

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `fields`, the current `span`
    /// with its fields (a request's `request_id`), and `trace_id` when traces are exported.
    Json,
}

impl fmt::Display for LogFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        })
    }
}

/// The logging and tracing flags of every service.
#[derive(clap::Args, Clone, Debug, Default, PartialEq, Eq)]
pub struct TelemetryArgs {
    /// Log line format: text or json (JSON lines carry the request id, and the trace id when
    /// traces are exported).
    #[arg(long, env = "DUET_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// OTLP/gRPC collector to export traces to (`http://host:4317`). Unset: no traces, at no
    /// cost.
    #[arg(long, value_name = "URL", env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
}

impl TelemetryArgs {
    /// The flags as command line arguments (for a service this process starts).
    pub fn to_args(&self) -> Vec<OsString> {
        let mut args = vec![format!("--log-format={}", self.log_format).into()];
        if let Some(endpoint) = &self.otlp_endpoint {
            args.push(format!("--otlp-endpoint={endpoint}").into());
        }
        args
    }

    /// The trace exporter these flags ask for (`None` without an endpoint: nothing is built).
    pub fn exporter(&self, service_name: &'static str) -> Result<Option<Exporter>, TracesError> {
        self.otlp_endpoint
            .as_deref()
            .map(|endpoint| Exporter::start(endpoint, service_name))
            .transpose()
    }

    /// Installs the process's logger, writing to `writer` (`std::io::stdout`, `std::io::stderr`),
    /// and its trace export as `service_name` (`duet-router`...). Keep the returned exporter
    /// until the process ends: dropping it sends the last spans.
    pub fn init<W>(
        &self,
        service_name: &'static str,
        writer: W,
    ) -> Result<Option<Exporter>, TracesError>
    where
        W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
    {
        let exporter = self.exporter(service_name)?;
        let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
        let registry = tracing_subscriber::registry()
            .with(filter)
            .with(exporter.as_ref().map(Exporter::layer));
        let lines = tracing_subscriber::fmt::layer().with_writer(writer);
        match self.log_format {
            LogFormat::Text => registry.with(lines).init(),
            LogFormat::Json => registry
                .with(
                    lines
                        .fmt_fields(JsonFields::new())
                        .event_format(WithTraceId(
                            tracing_subscriber::fmt::format()
                                .json()
                                .with_current_span(true)
                                .with_span_list(false),
                        )),
                )
                .init(),
        }
        traces::remember_dispatch();
        Ok(exporter)
    }
}

/// A JSON line formatter that puts the current span's `trace_id` first in each line.
struct WithTraceId<F>(F);

impl<S, N, F> FormatEvent<S, N> for WithTraceId<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let trace_id = ctx
            .lookup_current()
            .and_then(|span| traces::trace_id(&span.id()));
        let Some(trace_id) = trace_id else {
            return self.0.format_event(ctx, writer, event);
        };
        let mut line = String::new();
        self.0.format_event(ctx, Writer::new(&mut line), event)?;
        match line.strip_prefix('{') {
            Some(rest) => write!(writer, "{{\"trace_id\":\"{trace_id}\",{rest}"),
            None => writer.write_str(&line),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        telemetry: TelemetryArgs,
    }

    #[test]
    fn the_flags_parse_and_round_trip() {
        let parse = |args: &[&str]| Cli::try_parse_from(args).map(|c| c.telemetry);
        let plain = parse(&["x"]).unwrap();
        assert_eq!(plain.log_format, LogFormat::Text);
        assert_eq!(plain.otlp_endpoint, None);
        let set = parse(&[
            "x",
            "--log-format",
            "json",
            "--otlp-endpoint",
            "http://127.0.0.1:4317",
        ])
        .unwrap();
        assert_eq!(set.log_format, LogFormat::Json);
        assert_eq!(set.otlp_endpoint.as_deref(), Some("http://127.0.0.1:4317"));
        let round = set.to_args();
        let mut argv = vec!["x"];
        argv.extend(round.iter().map(|a| a.to_str().unwrap()));
        assert_eq!(parse(&argv).unwrap(), set);
        assert!(parse(&["x", "--log-format", "xml"]).is_err());
    }

    /// Without an endpoint tracing costs nothing: no exporter (so no layer, no propagator).
    #[test]
    fn no_endpoint_builds_no_exporter() {
        assert!(
            TelemetryArgs::default()
                .exporter("duet-test")
                .unwrap()
                .is_none()
        );
    }

    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buffer {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'w> MakeWriter<'w> for Buffer {
        type Writer = Buffer;
        fn make_writer(&'w self) -> Buffer {
            self.clone()
        }
    }

    /// The process-wide logger, installed once, exporting traces (to a port nothing listens on:
    /// the exporter connects lazily); an event in a request's span whose caller sent a
    /// `traceparent` is one JSON line with the request id and the caller's trace id.
    #[test]
    fn json_lines_carry_the_request_id_and_trace_id() {
        let buffer = Buffer::default();
        let exporter = TelemetryArgs {
            log_format: LogFormat::Json,
            otlp_endpoint: Some("http://127.0.0.1:9".into()),
        }
        .init("duet-test", buffer.clone())
        .unwrap();
        assert!(exporter.is_some());
        let mut headers = http::HeaderMap::new();
        headers.insert(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
                .parse()
                .unwrap(),
        );
        let span = tracing::info_span!("request", request_id = "req-7");
        traces::caller_context(&traces::HeaderReader(&headers))
            .unwrap()
            .adopt(&span);
        span.in_scope(|| {
            tracing::info!(worker = "d1", "decode attempt");
        });
        tracing::info!("outside any span");
        let text = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2, "{text}");
        let line = &lines[0];
        assert_eq!(line["level"], "INFO");
        assert_eq!(line["fields"]["message"], "decode attempt");
        assert_eq!(line["fields"]["worker"], "d1");
        assert_eq!(line["span"]["request_id"], "req-7");
        assert_eq!(line["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(lines[1].get("trace_id"), None, "{text}");
    }
}
