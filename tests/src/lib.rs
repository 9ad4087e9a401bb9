//! Shared helpers for the cross-service integration tests: fixture paths, reference generation
//! with the engine in one process, and gRPC calls against a cluster's router.

pub mod certs;
pub mod etcd;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use duet_decode_worker::DecodeConfig;
use duet_engine::engine::EngineOptions;
use duet_model::params::SamplingParams;
use duet_model::params::StopCriteria;
use duet_prefill_worker::PrefillConfig;
use duet_proto::v1;
use duet_router::RouterConfig;
pub use duet_router::RoutingOptions;
use duet_worker::WorkerArgs;
use futures::StreamExt;

pub use duet_cli::cluster::{Cluster, ClusterSpec};
pub use duet_model::model_path::checkout_default_model;

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

pub fn tiny_model() -> PathBuf {
    repo().join("tests/fixtures/tiny-llama")
}

pub fn engine_options() -> EngineOptions {
    EngineOptions {
        threads: 2,
        block_size: 16,
        kv_cache_tokens: 16384,
        max_step_tokens: 512,
        ..Default::default()
    }
}

/// A worker's `Stats`, asked with the cluster's token.
pub async fn worker_stats(cluster: &Cluster, worker: SocketAddr) -> v1::StatsResponse {
    let channel = duet_proto::channel(
        &worker.to_string(),
        &duet_proto::PeerAuth {
            token: Some(cluster.token.clone()),
            tls: None,
        },
    )
    .unwrap();
    v1::worker_control_client::WorkerControlClient::new(channel)
        .stats(v1::StatsRequest {})
        .await
        .unwrap()
        .into_inner()
}

/// One HTTP/1.1 call (`key`: its `Authorization` header): the status and the body.
pub fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: &str,
) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let auth = key.map_or(String::new(), |k| format!("Authorization: {k}\r\n"));
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{auth}\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let status = answer[9..12].parse().unwrap();
    let body = answer.split_once("\r\n\r\n").unwrap().1.to_string();
    (status, body)
}

/// The services of a cluster wired by hand, each served in `runtime` on its `listen` address
/// until the runtime is dropped.
pub fn spawn_prefill(runtime: &tokio::runtime::Runtime, config: PrefillConfig) {
    runtime.spawn(async move {
        let listener = tokio::net::TcpListener::bind(config.listen).await.unwrap();
        duet_prefill_worker::serve(config, listener, std::future::pending()).await
    });
}

/// See [`spawn_prefill`].
pub fn spawn_decode(runtime: &tokio::runtime::Runtime, config: DecodeConfig) {
    runtime.spawn(async move {
        let listener = tokio::net::TcpListener::bind(config.listen).await.unwrap();
        duet_decode_worker::serve(config, listener, std::future::pending()).await
    });
}

/// See [`spawn_prefill`].
pub fn spawn_router(runtime: &tokio::runtime::Runtime, config: RouterConfig) {
    runtime.spawn(async move {
        let listener = tokio::net::TcpListener::bind(config.listen).await.unwrap();
        duet_router::serve(config, listener, std::future::pending()).await
    });
}

/// A free loopback address for a service or a test's server to bind
/// ([`duet_cli::cluster::free_port`]: one no other test's server or kernel-picked port takes).
pub fn free_addr() -> SocketAddr {
    duet_cli::cluster::free_port(std::net::Ipv4Addr::LOCALHOST.into()).unwrap()
}

/// The launch spec of a cluster in this process whose workers use [`engine_options`].
pub fn spec(model: PathBuf, prefill: usize, decode: usize, routing: RoutingOptions) -> ClusterSpec {
    ClusterSpec {
        router: RouterConfig {
            listen: free_addr(),
            routing,
            ..Default::default()
        },
        prefill: PrefillConfig {
            worker: WorkerArgs {
                engine: engine_options(),
                ..Default::default()
            },
            ..Default::default()
        },
        decode: DecodeConfig {
            worker: WorkerArgs {
                engine: engine_options(),
                ..Default::default()
            },
            ..Default::default()
        },
        prefill_workers: prefill,
        decode_workers: decode,
        model,
        processes: false,
        bin_dir: None,
        telemetry: Default::default(),
        auth: Default::default(),
    }
}

pub fn cluster(model: PathBuf, prefill: usize, decode: usize, routing: RoutingOptions) -> Cluster {
    Cluster::start(&spec(model, prefill, decode, routing)).expect("starting the cluster")
}

/// The router's defaults, but prompts of at most `tokens` tokens prefill on the decode worker.
pub fn local_prefill_threshold(tokens: u32) -> RoutingOptions {
    RoutingOptions {
        local_prefill_threshold: tokens,
        ..Default::default()
    }
}

/// Greedy continuations computed by one engine in this process, one prompt at a time.
pub fn reference(
    model: &std::path::Path,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> Vec<Vec<u32>> {
    let mut e = duet_cpu::load_engine(model, engine_options()).unwrap();
    prompts
        .iter()
        .map(|p| {
            let stop = StopCriteria {
                max_tokens,
                ..Default::default()
            };
            let id = e
                .add_sequence(p.clone(), SamplingParams::greedy(), stop)
                .unwrap();
            // Every reported token, a final stop token included (as the API reports it).
            let mut out = Vec::new();
            while e.has_work() {
                out.extend(e.step().unwrap().into_iter().map(|o| o.token.token));
            }
            e.remove_sequence(id).unwrap();
            out
        })
        .collect()
}

pub async fn client(
    router: SocketAddr,
) -> v1::generation_client::GenerationClient<tonic::transport::Channel> {
    v1::generation_client::GenerationClient::connect(format!("http://{router}"))
        .await
        .unwrap()
}

pub fn greedy_request(prompt: &[u32], max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        token_ids: prompt.to_vec(),
        max_tokens: Some(max_tokens),
        temperature: Some(0.0),
        ..Default::default()
    }
}

/// Streams a Generate call; returns the token ids, the text, and the last message.
pub async fn generate(
    router: SocketAddr,
    req: v1::GenerateRequest,
) -> Result<(Vec<u32>, String, v1::GenerateResponse), tonic::Status> {
    let mut c = client(router).await;
    let mut stream = c.generate(req).await?.into_inner();
    let (mut ids, mut text, mut last) = (Vec::new(), String::new(), None);
    while let Some(msg) = stream.next().await {
        let msg = msg?;
        ids.extend(&msg.token_ids);
        text.push_str(&msg.text);
        last = Some(msg);
    }
    Ok((
        ids,
        text,
        last.expect("a Generate stream ends with a final message"),
    ))
}

/// Waits until the decode worker runs nothing and neither worker holds a KV block or a
/// reservation; panics with both workers' stats when that takes longer than `limit`.
pub async fn wait_until_blocks_freed(
    cluster: &Cluster,
    decode: SocketAddr,
    prefill: SocketAddr,
    limit: Duration,
) {
    let deadline = Instant::now() + limit;
    loop {
        let (d, p) = (
            worker_stats(cluster, decode).await,
            worker_stats(cluster, prefill).await,
        );
        if d.kv_blocks_used == 0
            && d.running_sequences == 0
            && d.reservations_outstanding == 0
            && p.kv_blocks_used == 0
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "blocks still held after cancel: decode {d:?}, prefill {p:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The service binaries next to this test executable (built by `cargo test --workspace`).
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
    for b in ["duet-router", "duet-prefill", "duet-decode"] {
        assert!(
            dir.join(b).exists(),
            "{} is missing: build the workspace binaries first (cargo build --workspace)",
            dir.join(b).display()
        );
    }
    dir
}

/// One service binary running as its own process; killed when dropped.
pub struct Process {
    pub name: String,
    child: std::process::Child,
}

impl Process {
    /// Starts `binary` (from [`bin_dir`]) with `args` and no `DUET_*` variables of this process.
    pub fn start(binary: &str, args: Vec<std::ffi::OsString>) -> Process {
        let mut command = std::process::Command::new(bin_dir().join(binary));
        command.args(args);
        for (name, _) in std::env::vars_os() {
            if name.as_encoded_bytes().starts_with(b"DUET_") {
                command.env_remove(name);
            }
        }
        Process {
            name: binary.to_string(),
            child: command.spawn().unwrap(),
        }
    }

    /// Sends SIGTERM (what Kubernetes sends to a pod it replaces).
    pub fn terminate(&self) {
        let ok = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -TERM {}", self.name);
    }

    /// Kills it at once (SIGKILL).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Its exit status, once it exited within `limit`.
    pub fn wait_exit(&mut self, limit: std::time::Duration) -> std::process::ExitStatus {
        let deadline = std::time::Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{} did not exit within {limit:?}",
                self.name
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A ready decode worker's card at 127.0.0.1:`port`, serving model "fp".
pub fn decode_card(id: &str, port: u16) -> duet_cluster::WorkerCard {
    duet_cluster::WorkerCard {
        worker_id: id.into(),
        role: duet_cluster::Role::Decode,
        grpc_address: format!("127.0.0.1:{port}"),
        kv_address: format!("127.0.0.1:{port}"),
        node: "host".into(),
        device: "cpu".into(),
        model_fingerprint: "fp".into(),
        block_size: 16,
        kv_capacity_blocks: 64,
        incarnation: 0,
        state: duet_cluster::CardState::Ready,
    }
}
