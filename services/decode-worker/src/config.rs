//! Flags of the decode worker (each also an environment variable).

use std::net::SocketAddr;

use duet_engine::engine::EngineOptions;
use duet_model::model_path::ModelArgs;
use duet_transfer::choice::TransportChoice;

#[derive(clap::Args, Clone, Debug)]
pub struct DecodeConfig {
    /// Address to serve DecodeWorker, KvTransfer and WorkerControl on.
    #[arg(long, env = "DUET_DECODE_LISTEN", default_value = "127.0.0.1:50071")]
    pub listen: SocketAddr,
    /// Address prefill workers push KV to (default: the listen address).
    #[arg(long, env = "DUET_DECODE_ADVERTISE")]
    pub advertise: Option<String>,
    /// This worker's id in the cluster (default: decode-<port>).
    #[arg(long, env = "DUET_WORKER_ID")]
    pub worker_id: Option<String>,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineOptions,
    /// KV transport between the pools: auto, grpc, cuda-ipc or nccl. The push path carries gRPC
    /// today (auto resolves to it); cuda-ipc and nccl are refused at start until it carries them.
    #[arg(long, env = "DUET_KV_TRANSPORT", default_value_t = TransportChoice::Auto)]
    pub kv_transport: TransportChoice,
    /// How long KV blocks reserved for a transfer are held before they are reclaimed.
    #[arg(long, env = "DUET_RESERVATION_TIMEOUT_MS", default_value_t = 30_000)]
    pub reservation_timeout_ms: u64,
    /// Longest a single prefill attempt may take before the next prefill worker is tried.
    #[arg(long, env = "DUET_PREFILL_TIMEOUT_MS", default_value_t = 60_000)]
    pub prefill_timeout_ms: u64,
    /// Deadline of calls that carry none (no `grpc-timeout`), in milliseconds.
    #[arg(long, env = "DUET_REQUEST_TIMEOUT_MS", default_value_t = 600_000)]
    pub request_timeout_ms: u64,
    /// Calls served at once (a Decode stream counts until it ends); past it RESOURCE_EXHAUSTED
    /// at once.
    #[arg(long, env = "DUET_MAX_IN_FLIGHT", default_value_t = 4096)]
    pub max_in_flight: usize,
}
