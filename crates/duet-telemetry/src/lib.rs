//! Telemetry every duet service shares: its logs, as text for people or as JSON lines for log
//! collectors (`--log-format`, `DUET_LOG_FORMAT`); `RUST_LOG` filters them (default `info`).
//!
//! A request's events happen inside its `request` span (the router's relay opens it), so JSON
//! lines carry `request_id` in their `span` object.
//!
//! Prometheus metrics ([`metrics`]): the process's registry and its `/metrics` endpoint.

pub mod metrics;

use std::fmt;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;

pub use metrics::MetricsArgs;

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `fields`, and the current
    /// `span` with its fields (a request's `request_id`).
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

/// The logging flag of every service.
#[derive(clap::Args, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogArgs {
    /// Log line format: text or json (JSON lines carry the request id).
    #[arg(long, env = "DUET_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

impl LogArgs {
    /// The flag as a command line argument (for a service this process starts).
    pub fn to_arg(self) -> String {
        format!("--log-format={}", self.log_format)
    }

    /// Installs the process's logger, writing to `writer` (`std::io::stdout`, `std::io::stderr`).
    pub fn init<W>(self, writer: W)
    where
        W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
    {
        let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
        let builder = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(writer);
        match self.log_format {
            LogFormat::Text => builder.init(),
            LogFormat::Json => builder
                .json()
                .with_current_span(true)
                .with_span_list(false)
                .init(),
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
        log: LogArgs,
    }

    #[test]
    fn the_flag_parses_and_round_trips() {
        let parse = |args: &[&str]| Cli::try_parse_from(args).map(|c| c.log);
        assert_eq!(parse(&["x"]).unwrap().log_format, LogFormat::Text);
        let json = parse(&["x", "--log-format", "json"]).unwrap();
        assert_eq!(json.log_format, LogFormat::Json);
        assert_eq!(parse(&["x", &json.to_arg()]).unwrap(), json);
        assert!(parse(&["x", "--log-format", "xml"]).is_err());
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

    /// The process-wide logger, installed once; an event in a request's span is one JSON line
    /// with the request id.
    #[test]
    fn json_lines_carry_the_request_id() {
        let buffer = Buffer::default();
        LogArgs {
            log_format: LogFormat::Json,
        }
        .init(buffer.clone());
        tracing::info_span!("request", request_id = "req-7").in_scope(|| {
            tracing::info!(worker = "d1", "decode attempt");
        });
        let text = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 1, "{text}");
        let line: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
        assert_eq!(line["level"], "INFO");
        assert_eq!(line["fields"]["message"], "decode attempt");
        assert_eq!(line["fields"]["worker"], "d1");
        assert_eq!(line["span"]["request_id"], "req-7");
    }
}
