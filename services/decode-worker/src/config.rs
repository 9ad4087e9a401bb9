//! Flags of the decode worker (each also an environment variable).

use std::ffi::OsString;
use std::net::SocketAddr;

use duet_cluster::{ClusterArgs, LeaseArgs};
use duet_engine::engine::EngineOptions;
use duet_model::model_path::ModelArgs;
use duet_proto::{ClusterAuth, TlsArgs};
use duet_telemetry::MetricsArgs;
use duet_transfer::choice::TransportChoice;

#[derive(clap::Args, Clone, Debug, PartialEq)]
pub struct DecodeConfig {
    /// Address to serve DecodeWorker, KvTransfer and WorkerControl on.
    #[arg(long, env = "DUET_DECODE_LISTEN", default_value_t = DecodeConfig::default().listen)]
    pub listen: SocketAddr,
    /// The address others dial to reach this worker, and prefill workers push KV to (default:
    /// the listen address).
    #[arg(long, env = "DUET_DECODE_ADVERTISE")]
    pub advertise: Option<String>,
    /// This worker's id in the cluster (default: decode-<port>).
    #[arg(long, env = "DUET_WORKER_ID")]
    pub worker_id: Option<String>,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    #[command(flatten)]
    pub lease: LeaseArgs,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub metrics: MetricsArgs,
    #[command(flatten)]
    pub engine: EngineOptions,
    /// KV transport between the pools: auto, grpc, cuda-ipc or nccl. The push path carries gRPC
    /// today (auto resolves to it); cuda-ipc and nccl are refused at start until it carries them.
    #[arg(long, env = "DUET_KV_TRANSPORT", default_value_t = DecodeConfig::default().kv_transport)]
    pub kv_transport: TransportChoice,
    /// How long KV blocks reserved for a transfer are held before they are reclaimed.
    #[arg(long, env = "DUET_RESERVATION_TIMEOUT_MS", default_value_t = DecodeConfig::default().reservation_timeout_ms)]
    pub reservation_timeout_ms: u64,
    /// Longest a single prefill attempt may take before the next prefill worker is tried.
    #[arg(long, env = "DUET_PREFILL_TIMEOUT_MS", default_value_t = DecodeConfig::default().prefill_timeout_ms)]
    pub prefill_timeout_ms: u64,
    /// Deadline of calls that carry none (no `grpc-timeout`), in milliseconds.
    #[arg(long, env = "DUET_REQUEST_TIMEOUT_MS", default_value_t = DecodeConfig::default().request_timeout_ms)]
    pub request_timeout_ms: u64,
    /// Calls served at once (a Decode stream counts until it ends); past it RESOURCE_EXHAUSTED
    /// at once.
    #[arg(long, env = "DUET_MAX_IN_FLIGHT", default_value_t = DecodeConfig::default().max_in_flight)]
    pub max_in_flight: usize,
    /// Cluster token of internal calls (see `duet_proto::auth`).
    #[command(flatten)]
    pub auth: ClusterAuth,
    /// TLS on its ports and its calls to peers (see `duet_proto::tls`).
    #[command(flatten)]
    pub tls: TlsArgs,
}

/// The flags' defaults (the flags take theirs from here).
impl Default for DecodeConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 50071)),
            advertise: None,
            worker_id: None,
            cluster: ClusterArgs::default(),
            lease: LeaseArgs::default(),
            model: ModelArgs::default(),
            metrics: MetricsArgs::default(),
            engine: EngineOptions::default(),
            kv_transport: TransportChoice::Auto,
            reservation_timeout_ms: 30_000,
            prefill_timeout_ms: 60_000,
            request_timeout_ms: 600_000,
            max_in_flight: 4096,
            auth: ClusterAuth::default(),
            tls: TlsArgs::default(),
        }
    }
}

impl DecodeConfig {
    /// This configuration as the worker's command line (without the program name): parsed back,
    /// it gives `self`.
    pub fn to_args(&self) -> Vec<OsString> {
        let Self {
            listen,
            advertise,
            worker_id,
            cluster,
            lease,
            model,
            metrics,
            engine,
            kv_transport,
            reservation_timeout_ms,
            prefill_timeout_ms,
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
        args.extend(model.to_args());
        args.extend(metrics.to_args());
        args.extend(engine.to_args());
        args.extend(
            [
                format!("--kv-transport={kv_transport}"),
                format!("--reservation-timeout-ms={reservation_timeout_ms}"),
                format!("--prefill-timeout-ms={prefill_timeout_ms}"),
                format!("--request-timeout-ms={request_timeout_ms}"),
                format!("--max-in-flight={max_in_flight}"),
            ]
            .map(Into::into),
        );
        args.extend(auth.to_args());
        args.extend(tls.to_args());
        args
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
        config: DecodeConfig,
    }

    #[test]
    fn no_flags_give_the_default() {
        let c = Cli::try_parse_from(["duet-decode"]).unwrap().config;
        assert_eq!(c, DecodeConfig::default());
    }

    /// Every field (the engine's and the model's too) differs from its default, so a flag
    /// `to_args` leaves out fails the test.
    #[test]
    fn to_args_parses_back_to_the_same_config() {
        let c = DecodeConfig {
            listen: "0.0.0.0:7003".parse().unwrap(),
            advertise: Some("decode.example:7003".into()),
            worker_id: Some("d-7".into()),
            cluster: ClusterArgs {
                etcd: vec!["etcd-a:2379".into()],
                cluster: "prod".into(),
            },
            lease: LeaseArgs {
                lease_ttl_s: 5,
                drain_timeout_s: 6,
            },
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
                kv_dtype: KvDtypeChoice::F16,
                cpu_kernels: CpuKernels::Portable,
            },
            kv_transport: TransportChoice::CudaIpc,
            reservation_timeout_ms: 1,
            prefill_timeout_ms: 2,
            request_timeout_ms: 3,
            max_in_flight: 4,
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
        let argv = std::iter::once("duet-decode".into()).chain(c.to_args());
        assert_eq!(Cli::try_parse_from(argv).unwrap().config, c);
    }
}
