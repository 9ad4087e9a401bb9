//! The prefill worker's configuration: command-line flags, each with an environment variable.

use std::net::SocketAddr;

use duet_engine::engine::EngineOptions;
use duet_model::model_path::ModelArgs;
use duet_transfer::choice::TransportChoice;

/// Everything a prefill worker needs to start.
#[derive(Clone, Debug, clap::Args)]
pub struct PrefillConfig {
    /// Address to serve gRPC on (PrefillWorker, WorkerControl, health, reflection).
    #[arg(long, env = "DUET_PREFILL_LISTEN", default_value = "127.0.0.1:50061")]
    pub listen: SocketAddr,
    /// This worker's id in the cluster (default: "prefill-<port>", the port actually bound).
    #[arg(long, env = "DUET_WORKER_ID")]
    pub worker_id: Option<String>,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Engine sizes; `max_step_tokens` is the prefill token budget of one batch.
    #[command(flatten)]
    pub engine: EngineOptions,
    /// KV transport between the pools: auto, grpc, cuda-ipc or nccl. The push path carries gRPC
    /// today (auto resolves to it); cuda-ipc and nccl are refused at start until it carries them.
    #[arg(long, env = "DUET_KV_TRANSPORT", default_value_t = TransportChoice::Auto)]
    pub kv_transport: TransportChoice,
    /// Most prompt tokens waiting to be computed; past it, `Prefill` answers RESOURCE_EXHAUSTED
    /// at once (a request arriving at an empty queue is always taken).
    #[arg(long, env = "DUET_PREFILL_MAX_QUEUED_TOKENS", default_value_t = 65536)]
    pub max_queued_tokens: u64,
    /// Deadline of calls that carry none (no `grpc-timeout`), in milliseconds.
    #[arg(long, env = "DUET_REQUEST_TIMEOUT_MS", default_value_t = 600_000)]
    pub request_timeout_ms: u64,
    /// Calls served at once; past it RESOURCE_EXHAUSTED at once.
    #[arg(long, env = "DUET_MAX_IN_FLIGHT", default_value_t = 4096)]
    pub max_in_flight: usize,
}

impl PrefillConfig {
    /// A configuration with every default, serving `model`.
    pub fn for_model(model: std::path::PathBuf) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 50061)),
            worker_id: None,
            model: ModelArgs {
                model: Some(model),
                models_dir: "models".into(),
            },
            engine: EngineOptions::default(),
            kv_transport: TransportChoice::Auto,
            max_queued_tokens: 65536,
            request_timeout_ms: 600_000,
            max_in_flight: 4096,
        }
    }

    /// The worker id: the configured one, else "prefill-<port>".
    pub fn worker_id_for(&self, port: u16) -> String {
        self.worker_id
            .clone()
            .unwrap_or_else(|| format!("prefill-{port}"))
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        config: PrefillConfig,
    }

    #[test]
    fn defaults_and_flags() {
        let cli = Cli::try_parse_from(["duet-prefill", "--model", "m.gguf"]).unwrap();
        let c = cli.config;
        assert_eq!(c.listen.to_string(), "127.0.0.1:50061");
        assert_eq!(c.max_queued_tokens, 65536);
        assert_eq!(c.engine.block_size, 16);
        assert_eq!(c.worker_id_for(50061), "prefill-50061");

        let cli = Cli::try_parse_from([
            "duet-prefill",
            "--listen",
            "0.0.0.0:7000",
            "--worker-id",
            "p1",
            "--max-queued-tokens",
            "10",
            "--max-step-tokens",
            "64",
        ])
        .unwrap();
        assert_eq!(cli.config.worker_id_for(7000), "p1");
        assert_eq!(cli.config.max_queued_tokens, 10);
        assert_eq!(cli.config.engine.max_step_tokens, 64);
    }
}
