//! Prometheus metrics: the process's registry, the `/metrics` endpoint that exposes it
//! (`--metrics-listen`, `DUET_METRICS_LISTEN`), and what every service's metric families share:
//! the `duet_` names' labels and vLLM's bucket boundaries, so dashboards built for vLLM translate.
//!
//! Each service defines its own families (the router's in `duet_router::metrics`, the workers'
//! in `duet_worker::metrics`) and registers them here for as long as it runs. One endpoint
//! serves everything its process registered: `duet up` in one process serves every role's
//! families from the router's `--metrics-listen`, told apart by their `role` label.

use std::ffi::OsString;
use std::net::SocketAddr;

use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use prometheus::core::Collector;
use prometheus::{Encoder, TextEncoder};

/// Every metric's label naming the service that exports it: `router`, `prefill` or `decode`.
pub const ROLE: &str = "role";
/// Every metric's label naming the served model (the model path's file stem, as Info shows it).
pub const MODEL: &str = "model";
/// A worker's metrics' label naming the worker (its id): workers in one process stay apart.
pub const ENGINE: &str = "engine";

/// vLLM's `time_to_first_token_seconds` buckets.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's `inter_token_latency_seconds` and `request_time_per_output_token_seconds` buckets
/// (duet's step time too: a decode step is one inter-token interval), with four below vLLM's
/// first: a decode step takes a few milliseconds (3 on a 2-core CPU with the default model, 7
/// for an 8B model's batch on an H200), and with 10 ms as the first bound every step lands in
/// one bucket and a dashboard's quantile reads 9 ms whatever they take. vLLM's bounds are all
/// kept, so queries written for it still hold.
pub const TOKEN_LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];
/// vLLM's `e2e_request_latency_seconds` buckets.
pub const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// vLLM's `iteration_tokens_total` buckets (tokens computed in one engine step).
pub const STEP_TOKENS_BUCKETS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
];
/// Tokens of one request's prompt or output (vLLM's `request_prompt_tokens` 1-2-5 series, to
/// 100,000 tokens).
pub const REQUEST_TOKENS_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0,
    50000.0, 100000.0,
];
/// KV transfer time of one request (vLLM's KV connectors' transfer-time buckets).
pub const KV_TRANSFER_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0,
];

/// The metrics flag of every service.
#[derive(clap::Args, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MetricsArgs {
    /// Address to serve Prometheus metrics on (`GET /metrics`). Unset: no endpoint (the
    /// metrics are still counted; they cost a few atomic adds per request).
    #[arg(long, value_name = "ADDR", env = "DUET_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
}

impl MetricsArgs {
    /// The flag as command line arguments (for a service this process starts).
    pub fn to_args(self) -> Vec<OsString> {
        self.metrics_listen
            .map(|a| format!("--metrics-listen={a}").into())
            .into_iter()
            .collect()
    }

    /// Binds the endpoint, if one is asked for, and serves it until `shutdown` resolves.
    pub async fn serve(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<Option<tokio::task::JoinHandle<std::io::Result<()>>>> {
        let Some(addr) = self.metrics_listen else {
            return Ok(None);
        };
        let listener = tokio::net::TcpListener::bind(addr).await?;
        tracing::info!(%addr, "Prometheus metrics serving on /metrics");
        Ok(Some(tokio::spawn(serve(listener, shutdown))))
    }
}

/// Serves `GET /metrics` (the text exposition of everything registered in this process) on
/// `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, routes())
        .with_graceful_shutdown(shutdown)
        .await
}

/// `GET /metrics`, for a service that serves more beside it on the same endpoint.
pub fn routes() -> axum::Router {
    axum::Router::new().route("/metrics", axum::routing::get(exposition))
}

async fn exposition() -> impl IntoResponse {
    let encoder = TextEncoder::new();
    let mut body = Vec::new();
    match encoder.encode(&prometheus::gather(), &mut body) {
        Ok(()) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, encoder.format_type().to_string())],
            body,
        ),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain".to_string())],
            e.to_string().into_bytes(),
        ),
    }
}

/// A service's metric families, exported from the process's registry until this is dropped
/// (a service stopped in a process that goes on, as in tests, takes its families with it).
pub struct Registration {
    collector: Option<Box<dyn Collector>>,
}

impl Registration {
    /// Registers `collector`. A second service of the same role and labels in one process
    /// (never in a deployment) cannot be told apart: its families are counted but not
    /// exported, and a warning says so.
    pub fn new<C: Collector + Clone + 'static>(collector: &C) -> Self {
        match prometheus::register(Box::new(collector.clone())) {
            Ok(()) => Self {
                collector: Some(Box::new(collector.clone())),
            },
            Err(e) => {
                tracing::warn!(error = %e, "metrics not exported: another service of this process exports the same");
                Self { collector: None }
            }
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(c) = self.collector.take() {
            let _ = prometheus::unregister(c);
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use prometheus::{IntCounter, Opts};

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        metrics: MetricsArgs,
    }

    #[test]
    fn the_flag_parses_and_round_trips() {
        let parse = |args: &[&str]| Cli::try_parse_from(args).map(|c| c.metrics);
        assert_eq!(parse(&["x"]).unwrap(), MetricsArgs::default());
        let set = parse(&["x", "--metrics-listen", "127.0.0.1:9100"]).unwrap();
        assert_eq!(set.metrics_listen, Some("127.0.0.1:9100".parse().unwrap()));
        let argv: Vec<OsString> = std::iter::once("x".into()).chain(set.to_args()).collect();
        assert_eq!(Cli::try_parse_from(argv).unwrap().metrics, set);
        assert!(parse(&["x", "--metrics-listen", "nowhere"]).is_err());
    }

    /// A 3 ms and a 7 ms decode step fall in buckets of their own, below vLLM's first bound,
    /// and every bound of vLLM's is kept.
    #[test]
    fn token_latency_buckets_tell_millisecond_steps_apart_and_keep_vllms_bounds() {
        let vllm = [
            0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0,
        ];
        assert!(vllm.iter().all(|b| TOKEN_LATENCY_BUCKETS.contains(b)));
        let bucket = |seconds: f64| TOKEN_LATENCY_BUCKETS.iter().position(|&b| seconds <= b);
        assert_ne!(bucket(0.003), bucket(0.007));
        assert!(bucket(0.007) < bucket(0.0095));
    }

    #[test]
    fn buckets_ascend() {
        for b in [
            TTFT_BUCKETS,
            TOKEN_LATENCY_BUCKETS,
            E2E_BUCKETS,
            STEP_TOKENS_BUCKETS,
            KV_TRANSFER_BUCKETS,
            REQUEST_TOKENS_BUCKETS,
        ] {
            assert!(b.windows(2).all(|w| w[0] < w[1]), "{b:?}");
        }
    }

    /// What a registration exports is served on /metrics until the registration drops; a
    /// second one of the same family and labels is refused without disturbing the first.
    #[tokio::test]
    async fn the_endpoint_serves_what_is_registered() {
        let counter = IntCounter::with_opts(
            Opts::new("duet_test_endpoint_total", "test").const_label(ROLE, "router"),
        )
        .unwrap();
        let registration = Registration::new(&counter);
        let twin = Registration::new(&counter);
        assert!(twin.collector.is_none());
        drop(twin);
        counter.inc_by(3);

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, async {
            let _ = stopped.await;
        }));
        let scrape = || async {
            let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            stream
                .write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                .await
                .unwrap();
            let mut text = String::new();
            stream.read_to_string(&mut text).await.unwrap();
            text
        };
        let text = scrape().await;
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        assert!(text.contains("text/plain; version=0.0.4"), "{text}");
        assert!(
            text.contains("duet_test_endpoint_total{role=\"router\"} 3"),
            "{text}"
        );
        drop(registration);
        assert!(!scrape().await.contains("duet_test_endpoint_total"));
        stop.send(()).unwrap();
        server.await.unwrap().unwrap();
    }
}
