//! The flags both workers take (each also an environment variable); each worker's config adds
//! its own listen address and role-specific flags around them.

use std::ffi::OsString;

use duet_cluster::{ClusterArgs, LeaseArgs, Role};
use duet_engine::engine::EngineOptions;
use duet_model::model_path::ModelArgs;
use duet_model::params::DEFAULT_MAX_CONSTRAINT_BYTES;
use duet_proto::{ClusterAuth, TlsArgs};
use duet_telemetry::MetricsArgs;
use duet_transfer::choice::TransportChoice;

/// The flags a prefill and a decode worker share.
#[derive(Clone, Debug, PartialEq, clap::Args)]
pub struct WorkerArgs {
    /// This worker's id in the cluster (default: "prefill-<port>" or "decode-<port>", the port
    /// actually bound).
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
    /// Engine sizes; on a prefill worker `max_step_tokens` is the prompt token budget of one
    /// batch.
    #[command(flatten)]
    pub engine: EngineOptions,
    /// KV transport between the pools: auto (cuda-ipc between GPU workers of one node, else
    /// gRPC), grpc, cuda-ipc (GPU workers of one node, a build with the cuda feature) or nccl
    /// (refused at start: not on the push path yet). A choice the worker cannot use is refused at
    /// start, never downgraded.
    #[arg(long, env = "DUET_KV_TRANSPORT", default_value_t = WorkerArgs::default().kv_transport)]
    pub kv_transport: TransportChoice,
    /// Deadline of calls that carry none (no `grpc-timeout`), in milliseconds.
    #[arg(long, env = "DUET_REQUEST_TIMEOUT_MS", default_value_t = WorkerArgs::default().request_timeout_ms)]
    pub request_timeout_ms: u64,
    /// Calls served at once (a stream counts until it ends); past it RESOURCE_EXHAUSTED at once.
    #[arg(long, env = "DUET_MAX_IN_FLIGHT", default_value_t = WorkerArgs::default().max_in_flight)]
    pub max_in_flight: usize,
    /// A structured-output constraint (JSON Schema, regex, Lark grammar) past this many bytes is
    /// refused with INVALID_ARGUMENT before it is compiled (as the router's flag of the same
    /// name: a worker called directly holds the same line).
    #[arg(long, value_name = "BYTES", env = "DUET_MAX_CONSTRAINT_BYTES", default_value_t = WorkerArgs::default().max_constraint_bytes)]
    pub max_constraint_bytes: usize,
    /// Cluster token of internal calls (see `duet_proto::auth`).
    #[command(flatten)]
    pub auth: ClusterAuth,
    /// TLS on its ports and its calls to peers (see `duet_proto::tls`).
    #[command(flatten)]
    pub tls: TlsArgs,
}

/// The flags' defaults (the flags take theirs from here).
impl Default for WorkerArgs {
    fn default() -> Self {
        Self {
            worker_id: None,
            cluster: ClusterArgs::default(),
            lease: LeaseArgs::default(),
            model: ModelArgs::default(),
            metrics: MetricsArgs::default(),
            engine: EngineOptions::default(),
            kv_transport: TransportChoice::Auto,
            request_timeout_ms: 600_000,
            max_in_flight: 4096,
            max_constraint_bytes: DEFAULT_MAX_CONSTRAINT_BYTES,
            auth: ClusterAuth::default(),
            tls: TlsArgs::default(),
        }
    }
}

impl WorkerArgs {
    /// Every default, serving `model`.
    pub fn for_model(model: std::path::PathBuf) -> Self {
        Self {
            model: ModelArgs {
                model: Some(model),
                ..ModelArgs::default()
            },
            ..Self::default()
        }
    }

    /// The worker id: the configured one, else "<role>-<port>".
    pub fn worker_id_for(&self, role: Role, port: u16) -> String {
        self.worker_id
            .clone()
            .unwrap_or_else(|| format!("{}-{port}", role.as_str()))
    }

    /// These flags as a command line: parsed back, they give `self`.
    pub fn to_args(&self) -> Vec<OsString> {
        let Self {
            worker_id,
            cluster,
            lease,
            model,
            metrics,
            engine,
            kv_transport,
            request_timeout_ms,
            max_in_flight,
            max_constraint_bytes,
            auth,
            tls,
        } = self;
        let mut args: Vec<OsString> = worker_id
            .iter()
            .map(|id| format!("--worker-id={id}").into())
            .collect();
        args.extend(cluster.to_args());
        args.extend(lease.to_args());
        args.extend(model.to_args());
        args.extend(metrics.to_args());
        args.extend(engine.to_args());
        args.extend(
            [
                format!("--kv-transport={kv_transport}"),
                format!("--request-timeout-ms={request_timeout_ms}"),
                format!("--max-in-flight={max_in_flight}"),
                format!("--max-constraint-bytes={max_constraint_bytes}"),
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
    use duet_engine::backend::{CpuKernels, KvDtypeChoice, PrefillAttention};
    use duet_engine::device::{Device, GpuWeights, Switch};
    use duet_engine::kv_tiers::KvTierOptions;
    use duet_engine::speculator::SpeculativeMode;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: WorkerArgs,
    }

    #[test]
    fn no_flags_give_the_default() {
        let args = Cli::try_parse_from(["duet-worker"]).unwrap().args;
        assert_eq!(args, WorkerArgs::default());
        assert_eq!(args.worker_id_for(Role::Prefill, 50061), "prefill-50061");
        assert_eq!(args.worker_id_for(Role::Decode, 50071), "decode-50071");
    }

    /// Every field (the engine's and the model's too) differs from its default, so a flag
    /// `to_args` leaves out fails the test.
    #[test]
    fn to_args_parses_back_to_the_same_flags() {
        let args = WorkerArgs {
            worker_id: Some("w-7".into()),
            cluster: ClusterArgs {
                etcd: vec!["etcd-a:2379".into(), "http://etcd-b:2379".into()],
                cluster: "prod".into(),
                ..Default::default()
            },
            lease: LeaseArgs {
                lease_ttl_s: 3,
                drain_timeout_s: 4,
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
                kv_dtype: KvDtypeChoice::Bf16,
                cpu_kernels: CpuKernels::Avx2,
                prefill_attention: PrefillAttention::Fa,
                speculative: SpeculativeMode::Draft("models dir/draft.gguf".into()),
                num_speculative_tokens: 6,
                speculative_max_step_rows: 5,
                cuda_graphs: Switch::On,
                device_sampling: Switch::On,
                fused_kernels: Switch::On,
                gpu_weights: GpuWeights::Packed,
                quantization: duet_model::fp8::Quantization::Fp8,
                kv_tiers: KvTierOptions {
                    kv_offload_tokens: 4096,
                    kv_disk_dir: Some("kv dir/blocks".into()),
                    kv_disk_bytes: 123_456,
                    kv_load_stream: Switch::On,
                    kv_host_pinned: Switch::On,
                },
            },
            kv_transport: TransportChoice::Nccl,
            request_timeout_ms: 6,
            max_in_flight: 7,
            max_constraint_bytes: 8,
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
        let argv = std::iter::once("duet-worker".into()).chain(args.to_args());
        assert_eq!(Cli::try_parse_from(argv).unwrap().args, args);
    }
}
