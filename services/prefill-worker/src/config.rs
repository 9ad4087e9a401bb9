//! The prefill worker's configuration: command-line flags, each with an environment variable.

use std::ffi::OsString;
use std::net::SocketAddr;

use duet_cluster::{ClusterArgs, LeaseArgs};
use duet_engine::engine::EngineOptions;
use duet_model::model_path::ModelArgs;
use duet_proto::{ClusterAuth, TlsArgs};
use duet_telemetry::MetricsArgs;
use duet_transfer::choice::TransportChoice;

/// Everything a prefill worker needs to start.
#[derive(Clone, Debug, PartialEq, clap::Args)]
pub struct PrefillConfig {
    /// Address to serve gRPC on (PrefillWorker, WorkerControl, health, reflection).
    #[arg(long, env = "DUET_PREFILL_LISTEN", default_value_t = PrefillConfig::default().listen)]
    pub listen: SocketAddr,
    /// The address others dial to reach this worker (default: the listen address).
    #[arg(long, env = "DUET_PREFILL_ADVERTISE")]
    pub advertise: Option<String>,
    /// This worker's id in the cluster (default: "prefill-<port>", the port actually bound).
    #[arg(long, env = "DUET_WORKER_ID")]
    pub worker_id: Option<String>,
    /// A decode worker's KV transfer address (its --advertise, by default its gRPC address)
    /// that this worker may push KV to, besides the decode workers whose cards are in its
    /// cluster; a Prefill naming any other is refused (PERMISSION_DENIED). Repeat the flag, or
    /// give a comma-separated list in the environment variable.
    #[arg(
        long = "decode",
        value_name = "ADDR",
        env = "DUET_DECODE_WORKERS",
        value_delimiter = ','
    )]
    pub decode: Vec<String>,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    #[command(flatten)]
    pub lease: LeaseArgs,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub metrics: MetricsArgs,
    /// Engine sizes; `max_step_tokens` is the prefill token budget of one batch.
    #[command(flatten)]
    pub engine: EngineOptions,
    /// KV transport between the pools: auto, grpc, cuda-ipc or nccl. The push path carries gRPC
    /// today (auto resolves to it); cuda-ipc and nccl are refused at start until it carries them.
    #[arg(long, env = "DUET_KV_TRANSPORT", default_value_t = PrefillConfig::default().kv_transport)]
    pub kv_transport: TransportChoice,
    /// Most prompt tokens waiting to be computed; past it, `Prefill` answers RESOURCE_EXHAUSTED
    /// at once (a request arriving at an empty queue is always taken).
    #[arg(long, env = "DUET_PREFILL_MAX_QUEUED_TOKENS", default_value_t = PrefillConfig::default().max_queued_tokens)]
    pub max_queued_tokens: u64,
    /// Deadline of calls that carry none (no `grpc-timeout`), in milliseconds.
    #[arg(long, env = "DUET_REQUEST_TIMEOUT_MS", default_value_t = PrefillConfig::default().request_timeout_ms)]
    pub request_timeout_ms: u64,
    /// Calls served at once; past it RESOURCE_EXHAUSTED at once.
    #[arg(long, env = "DUET_MAX_IN_FLIGHT", default_value_t = PrefillConfig::default().max_in_flight)]
    pub max_in_flight: usize,
    /// Cluster token of internal calls (see `duet_proto::auth`).
    #[command(flatten)]
    pub auth: ClusterAuth,
    /// TLS on its ports and its calls to peers (see `duet_proto::tls`).
    #[command(flatten)]
    pub tls: TlsArgs,
}

/// The flags' defaults (the flags take theirs from here).
impl Default for PrefillConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 50061)),
            advertise: None,
            worker_id: None,
            cluster: ClusterArgs::default(),
            lease: LeaseArgs::default(),
            decode: Vec::new(),
            model: ModelArgs::default(),
            metrics: MetricsArgs::default(),
            engine: EngineOptions::default(),
            kv_transport: TransportChoice::Auto,
            max_queued_tokens: 65536,
            request_timeout_ms: 600_000,
            max_in_flight: 4096,
            auth: ClusterAuth::default(),
            tls: TlsArgs::default(),
        }
    }
}

impl PrefillConfig {
    /// A configuration with every default, serving `model`.
    pub fn for_model(model: std::path::PathBuf) -> Self {
        Self {
            model: ModelArgs {
                model: Some(model),
                ..ModelArgs::default()
            },
            ..Self::default()
        }
    }

    /// This configuration as the worker's command line (without the program name): parsed back,
    /// it gives `self`.
    pub fn to_args(&self) -> Vec<OsString> {
        let Self {
            listen,
            advertise,
            worker_id,
            cluster,
            lease,
            decode,
            model,
            metrics,
            engine,
            kv_transport,
            max_queued_tokens,
            request_timeout_ms,
            max_in_flight,
            auth,
            tls,
        } = self;
        let mut args: Vec<OsString> = vec![format!("--listen={listen}").into()];
        args.extend(advertise.iter().map(|a| format!("--advertise={a}").into()));
        args.extend(
            worker_id
                .iter()
                .map(|id| format!("--worker-id={id}").into()),
        );
        args.extend(cluster.to_args());
        args.extend(lease.to_args());
        args.extend(decode.iter().map(|a| format!("--decode={a}").into()));
        args.extend(model.to_args());
        args.extend(metrics.to_args());
        args.extend(engine.to_args());
        args.extend(
            [
                format!("--kv-transport={kv_transport}"),
                format!("--max-queued-tokens={max_queued_tokens}"),
                format!("--request-timeout-ms={request_timeout_ms}"),
                format!("--max-in-flight={max_in_flight}"),
            ]
            .map(Into::into),
        );
        args.extend(auth.to_args());
        args.extend(tls.to_args());
        args
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
    use duet_engine::backend::{CpuKernels, KvDtypeChoice};
    use duet_engine::device::Device;

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

    #[test]
    fn no_flags_give_the_default() {
        let c = Cli::try_parse_from(["duet-prefill"]).unwrap().config;
        assert_eq!(c, PrefillConfig::default());
    }

    /// Every field (the engine's and the model's too) differs from its default, so a flag
    /// `to_args` leaves out fails the test.
    #[test]
    fn to_args_parses_back_to_the_same_config() {
        let c = PrefillConfig {
            listen: "0.0.0.0:7002".parse().unwrap(),
            advertise: Some("prefill.example:7002".into()),
            worker_id: Some("p-7".into()),
            cluster: ClusterArgs {
                etcd: vec!["etcd-a:2379".into(), "http://etcd-b:2379".into()],
                cluster: "prod".into(),
            },
            lease: LeaseArgs {
                lease_ttl_s: 3,
                drain_timeout_s: 4,
            },
            decode: vec!["d:1".into(), "d:2".into()],
            model: ModelArgs {
                model: Some("some dir/m.gguf".into()),
                models_dir: "elsewhere".into(),
            },
            metrics: MetricsArgs {
                metrics_listen: Some("0.0.0.0:9100".parse().unwrap()),
            },
            engine: EngineOptions {
                threads: 3,
                block_size: 8,
                kv_cache_tokens: 999,
                max_step_tokens: 77,
                device: Device::Cuda(2),
                gpu_memory_fraction: 0.123,
                kv_dtype: KvDtypeChoice::Bf16,
                cpu_kernels: CpuKernels::Avx2,
            },
            kv_transport: TransportChoice::Nccl,
            max_queued_tokens: 5,
            request_timeout_ms: 6,
            max_in_flight: 7,
            auth: ClusterAuth {
                cluster_token: None,
                cluster_token_file: Some("secret dir/token".into()),
            },
            tls: TlsArgs::new(
                "certs dir/cert.pem".into(),
                "key.pem".into(),
                "ca.pem".into(),
            ),
        };
        let argv = std::iter::once("duet-prefill".into()).chain(c.to_args());
        assert_eq!(Cli::try_parse_from(argv).unwrap().config, c);
    }
}
