//! `duet up`: a whole cluster on loopback (see [`crate::cluster`]), on the default model and the
//! CPU backend. It prints a ready line only once a `Generate` call succeeds.

use std::net::SocketAddr;
use std::time::Instant;

use anyhow::Result;
use clap::Args;
use duet_cluster::ClusterArgs;
use duet_decode_worker::DecodeConfig;
use duet_engine::engine::EngineOptions;
use duet_model::model_path::ModelArgs;
use duet_prefill_worker::PrefillConfig;
use duet_proto::{ClusterAuth, TlsArgs};
use duet_router::{RouterConfig, RoutingOptions};
use duet_telemetry::{MetricsArgs, TelemetryArgs};
use duet_transfer::choice::TransportChoice;
use duet_worker::WorkerArgs;

use crate::cluster::{Cluster, ClusterSpec};

#[derive(Args, Debug)]
pub struct UpArgs {
    /// Address the router listens on.
    #[arg(long, env = "DUET_ROUTER_LISTEN", default_value_t = RouterConfig::default().listen)]
    pub listen: SocketAddr,
    /// Address of the router's OpenAI-compatible HTTP API (`/v1/chat/completions`, ...).
    /// Unset: none.
    #[arg(long, value_name = "ADDR", env = "DUET_HTTP_LISTEN")]
    pub http_listen: Option<SocketAddr>,
    /// File of the API keys the router's public APIs require (`duet-router --api-keys-file`).
    /// Unset: no key needed.
    #[arg(long, value_name = "PATH", env = "DUET_API_KEYS_FILE")]
    pub api_keys_file: Option<std::path::PathBuf>,
    /// A name the router's OpenAI API answers to (`duet-router --served-model-name`); repeat
    /// the flag for aliases. Unset: the model file's stem.
    #[arg(
        long = "served-model-name",
        value_name = "NAME",
        env = "DUET_SERVED_MODEL_NAME",
        value_delimiter = ',',
        value_parser = duet_router::config::parse_served_name
    )]
    pub served_model_name: Vec<String>,
    /// Number of prefill workers.
    #[arg(long, env = "DUET_PREFILL_WORKERS_COUNT", default_value_t = 1)]
    pub prefill_workers: usize,
    /// Number of decode workers.
    #[arg(long, env = "DUET_DECODE_WORKERS_COUNT", default_value_t = 1)]
    pub decode_workers: usize,
    /// Run each service as its own process (the `duet-router`, `duet-prefill` and `duet-decode`
    /// binaries next to this one) instead of all in this process.
    #[arg(long)]
    pub processes: bool,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineOptions,
    /// KV transport between the pools: auto (CUDA IPC between GPU processes on one node, else
    /// gRPC), grpc, cuda-ipc or nccl (see duet-prefill --help).
    #[arg(long, env = "DUET_KV_TRANSPORT", default_value_t = TransportChoice::Auto)]
    pub kv_transport: TransportChoice,
    /// Membership: etcd (every service joins its cluster), else the embedded registry of this
    /// process (with --processes and no etcd, the router is given the workers' addresses).
    #[command(flatten)]
    pub cluster: ClusterArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
    /// Prometheus metrics: in one process the router's endpoint serves every service's families
    /// (told apart by `role`); with --processes each worker serves its own on a free loopback
    /// port, printed at start.
    #[command(flatten)]
    pub metrics: MetricsArgs,
    /// Exit after the cluster is ready and one sample request succeeded (for scripts and tests).
    #[arg(long, hide = true)]
    pub exit_when_ready: bool,
    /// The token of the cluster's internal calls (default: a random one for this run).
    #[command(flatten)]
    pub auth: ClusterAuth,
    /// TLS of every service (the `duet-router`/worker flags of the same names): mutual TLS
    /// between them, TLS on the router's gRPC port.
    #[command(flatten)]
    pub tls: TlsArgs,
    /// The router's routing and limits (the `duet-router` flags of the same names).
    // Last: the heading applies to every flag after it.
    #[command(flatten, next_help_heading = "Router")]
    pub routing: RoutingOptions,
}

pub fn run(args: UpArgs) -> Result<()> {
    let spec = ClusterSpec {
        router: RouterConfig {
            listen: args.listen,
            http_listen: args.http_listen,
            api_keys_file: args.api_keys_file.clone(),
            served_model_name: args.served_model_name.clone(),
            cluster: args.cluster.clone(),
            metrics: args.metrics,
            routing: args.routing.clone(),
            tls: args.tls.clone(),
            ..RouterConfig::default()
        },
        prefill: PrefillConfig {
            worker: WorkerArgs {
                engine: args.engine.clone(),
                kv_transport: args.kv_transport,
                tls: args.tls.clone(),
                max_constraint_bytes: args.routing.max_constraint_bytes,
                ..WorkerArgs::default()
            },
            ..PrefillConfig::default()
        },
        decode: DecodeConfig {
            worker: WorkerArgs {
                engine: args.engine.clone(),
                kv_transport: args.kv_transport,
                tls: args.tls.clone(),
                max_constraint_bytes: args.routing.max_constraint_bytes,
                ..WorkerArgs::default()
            },
            ..DecodeConfig::default()
        },
        prefill_workers: args.prefill_workers,
        decode_workers: args.decode_workers,
        model: args.model.resolve()?,
        processes: args.processes,
        bin_dir: None,
        telemetry: args.telemetry.clone(),
        auth: args.auth.clone(),
    };
    // Logs go to stderr: stdout is the ready line's.
    // Kept to the end: dropping it sends the last spans.
    let _exporter = args.telemetry.init("duet", std::io::stderr)?;
    let started = Instant::now();
    let cluster = Cluster::start_unless(&spec, duet_proto::serve::terminated())?;
    println!(
        "duet is ready on {} (router + {} prefill + {} decode, {}) after {:.1}s; try: duet generate --server {} --prompt \"Hello\"",
        cluster.router,
        args.prefill_workers,
        args.decode_workers,
        if args.processes {
            "separate processes"
        } else {
            "one process"
        },
        started.elapsed().as_secs_f64(),
        cluster.router
    );
    if let Some(http) = args.http_listen {
        println!("OpenAI-compatible HTTP API on http://{http}/v1");
    }
    for endpoint in &cluster.metrics {
        println!("Prometheus metrics on http://{endpoint}/metrics");
    }
    if !args.exit_when_ready {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        // Ctrl-C or SIGTERM: either stops the cluster below, its worker processes included (on
        // SIGTERM's default action they would be left running).
        rt.block_on(duet_proto::serve::terminated());
    }
    drop(cluster);
    Ok(())
}
