//! The router's configuration: command-line flags, each with an environment variable.

use std::net::SocketAddr;

use clap::Args;
use duet_model::model_path::ModelArgs;

/// How the router is run: where it listens, which workers it routes to, the model it serves
/// (config, tokenizer and chat template only; never the weights) and its limits.
#[derive(Args, Clone, Debug)]
pub struct RouterConfig {
    /// Address to serve the public `duet.v1.Generation` API on (with health and reflection).
    #[arg(long, env = "DUET_ROUTER_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,

    /// A prefill worker's gRPC address (host:port). Repeat the flag, or give a comma-separated
    /// list in the environment variable.
    #[arg(
        long = "prefill",
        value_name = "ADDR",
        env = "DUET_PREFILL_WORKERS",
        value_delimiter = ','
    )]
    pub prefill: Vec<String>,

    /// A decode worker's gRPC address (host:port). Repeat the flag, or give a comma-separated
    /// list in the environment variable.
    #[arg(
        long = "decode",
        value_name = "ADDR",
        env = "DUET_DECODE_WORKERS",
        value_delimiter = ','
    )]
    pub decode: Vec<String>,

    /// The served model (the router reads its config, tokenizer and chat template).
    #[command(flatten)]
    pub model: ModelArgs,

    /// `max_tokens` of requests that do not set it (lowered to fit the context).
    #[arg(long, env = "DUET_DEFAULT_MAX_TOKENS", default_value_t = 256)]
    pub default_max_tokens: u32,

    /// Prompts of at most this many tokens are prefilled on the decode worker itself (no KV
    /// transfer).
    #[arg(long, env = "DUET_LOCAL_PREFILL_THRESHOLD", default_value_t = 32)]
    pub local_prefill_threshold: u32,

    /// Requests in flight past which `Generate` and `Complete` answer RESOURCE_EXHAUSTED at once.
    #[arg(long, env = "DUET_MAX_QUEUED_REQUESTS", default_value_t = 256)]
    pub max_queued_requests: usize,

    /// Largest request message accepted, in bytes.
    #[arg(long, env = "DUET_MAX_REQUEST_BYTES", default_value_t = 4 * 1024 * 1024)]
    pub max_request_bytes: usize,

    /// How often each worker's health and stats are polled, in milliseconds.
    #[arg(long, env = "DUET_STATS_INTERVAL_MS", default_value_t = 500)]
    pub stats_interval_ms: u64,

    /// Deadline of requests whose client sets none (no `grpc-timeout`), in milliseconds.
    #[arg(long, env = "DUET_REQUEST_TIMEOUT_MS", default_value_t = 600_000)]
    pub request_timeout_ms: u64,
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        config: RouterConfig,
    }

    #[test]
    fn flags_and_defaults() {
        Cli::command().debug_assert();
        let c = Cli::try_parse_from([
            "duet-router",
            "--decode",
            "a:1",
            "--decode",
            "b:2,c:3",
            "--prefill",
            "p:1",
            "--model",
            "m.gguf",
        ])
        .unwrap()
        .config;
        assert_eq!(c.decode, ["a:1", "b:2", "c:3"]);
        assert_eq!(c.prefill, ["p:1"]);
        assert_eq!(c.listen.to_string(), "127.0.0.1:50051");
        assert_eq!(
            c.model.model.as_deref(),
            Some(std::path::Path::new("m.gguf"))
        );
        assert_eq!((c.default_max_tokens, c.local_prefill_threshold), (256, 32));
        assert_eq!((c.max_queued_requests, c.max_request_bytes), (256, 4 << 20));
        assert_eq!((c.stats_interval_ms, c.request_timeout_ms), (500, 600_000));
    }
}
