//! A whole cluster on loopback — router + N prefill + M decode workers — in this process or as
//! separate processes. Every service is configured through the same command line its own binary
//! takes, so the in-process and multi-process clusters are the same configuration. Used by
//! `duet up` and the integration tests.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use duet_engine::engine::EngineOptions;
use duet_proto::v1;
use duet_transfer::choice::TransportChoice;

/// What to start.
#[derive(Clone, Debug)]
pub struct ClusterSpec {
    pub router_listen: SocketAddr,
    pub prefill_workers: usize,
    pub decode_workers: usize,
    pub model: PathBuf,
    pub engine: EngineOptions,
    pub kv_transport: TransportChoice,
    /// Extra router flags (`--local-prefill-threshold=0`, ...).
    pub router_args: Vec<String>,
    /// Separate processes (the service binaries next to the current executable, or in `bin_dir`).
    pub processes: bool,
    pub bin_dir: Option<PathBuf>,
}

/// A running cluster; dropping it stops it (child processes are killed; in-process services stop
/// with their runtime).
pub struct Cluster {
    pub router: SocketAddr,
    pub prefill: Vec<SocketAddr>,
    pub decode: Vec<SocketAddr>,
    children: Vec<(String, Child)>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Cluster {
    /// Starts every service and returns once a one-token `Generate` succeeds.
    pub fn start(spec: &ClusterSpec) -> Result<Cluster> {
        let prefill = free_ports(spec.prefill_workers)?;
        let decode = free_ports(spec.decode_workers)?;
        let worker = |listen: SocketAddr| -> Vec<String> {
            let e = &spec.engine;
            vec![
                format!("--listen={listen}"),
                format!("--model={}", spec.model.display()),
                format!("--threads={}", e.threads),
                format!("--block-size={}", e.block_size),
                format!("--kv-cache-tokens={}", e.kv_cache_tokens),
                format!("--max-step-tokens={}", e.max_step_tokens),
                format!("--device={}", e.device),
                format!("--gpu-memory-fraction={}", e.gpu_memory_fraction),
                format!("--kv-dtype={}", e.kv_dtype),
                format!("--kv-transport={}", spec.kv_transport),
            ]
        };
        let mut services: Vec<(&'static str, Vec<String>)> = Vec::new();
        services.extend(prefill.iter().map(|a| ("duet-prefill", worker(*a))));
        services.extend(decode.iter().map(|a| ("duet-decode", worker(*a))));
        let mut router = vec![
            format!("--listen={}", spec.router_listen),
            format!("--model={}", spec.model.display()),
        ];
        router.extend(prefill.iter().map(|a| format!("--prefill={a}")));
        router.extend(decode.iter().map(|a| format!("--decode={a}")));
        router.extend(spec.router_args.iter().cloned());
        services.push(("duet-router", router));

        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let mut cluster = Cluster {
            router: spec.router_listen,
            prefill,
            decode,
            children: Vec::new(),
            runtime: None,
        };
        for (binary, args) in services {
            if spec.processes {
                let dir = match &spec.bin_dir {
                    Some(d) => d.clone(),
                    None => std::env::current_exe()?
                        .parent()
                        .context("executable without a directory")?
                        .to_path_buf(),
                };
                cluster
                    .children
                    .push((binary.to_string(), spawn_process(&dir, binary, &args)?));
            } else {
                runtime.spawn(serve_in_process(binary, args)?);
            }
        }
        let router = cluster.router;
        runtime.block_on(wait_until_serving(router, Duration::from_secs(300)))?;
        cluster.runtime = Some(runtime);
        Ok(cluster)
    }

    /// Kills one service process (failure tests); `index` counts prefill workers then decode
    /// workers in start order.
    pub fn kill_process(&mut self, index: usize) -> Result<()> {
        let (_, child) = self.children.get_mut(index).context("no such process")?;
        child.kill()?;
        child.wait()?;
        Ok(())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (_, c) in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// Parses a service's command line with its own flag definitions and returns its server future.
fn serve_in_process(
    binary: &'static str,
    args: Vec<String>,
) -> Result<std::pin::Pin<Box<dyn Future<Output = ()> + Send>>> {
    #[derive(Parser)]
    struct Router {
        #[command(flatten)]
        c: duet_router::RouterConfig,
    }
    #[derive(Parser)]
    struct Prefill {
        #[command(flatten)]
        c: duet_prefill_worker::PrefillConfig,
    }
    #[derive(Parser)]
    struct Decode {
        #[command(flatten)]
        c: duet_decode_worker::DecodeConfig,
    }
    let argv = std::iter::once(binary.to_string()).chain(args);
    let never = std::future::pending::<()>();
    Ok(match binary {
        "duet-router" => {
            let c = Router::try_parse_from(argv)?.c;
            Box::pin(async move {
                report(
                    binary,
                    async { duet_router::serve(c.clone(), bind(c.listen).await?, never).await }
                        .await,
                )
            })
        }
        "duet-prefill" => {
            let c = Prefill::try_parse_from(argv)?.c;
            Box::pin(async move {
                report(
                    binary,
                    async {
                        duet_prefill_worker::serve(c.clone(), bind(c.listen).await?, never).await
                    }
                    .await,
                )
            })
        }
        "duet-decode" => {
            let c = Decode::try_parse_from(argv)?.c;
            Box::pin(async move {
                report(
                    binary,
                    async {
                        duet_decode_worker::serve(c.clone(), bind(c.listen).await?, never).await
                    }
                    .await,
                )
            })
        }
        other => bail!("unknown service {other}"),
    })
}

async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))
}

fn report(service: &str, r: Result<()>) {
    if let Err(e) = r {
        eprintln!("error: {service} stopped: {e:#}");
        std::process::exit(1);
    }
}

fn spawn_process(dir: &Path, binary: &str, args: &[String]) -> Result<Child> {
    let path = dir.join(binary);
    if !path.exists() {
        bail!(
            "{} not found (build it with `cargo build --release --workspace`)",
            path.display()
        );
    }
    Command::new(&path)
        .args(args)
        .spawn()
        .with_context(|| format!("starting {}", path.display()))
}

/// Loopback addresses with free ports for the workers.
fn free_ports(n: usize) -> Result<Vec<SocketAddr>> {
    let listeners: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<_>>()?;
    Ok(listeners
        .iter()
        .map(|l| l.local_addr())
        .collect::<std::io::Result<_>>()?)
}

/// Polls with a one-token `Generate` until one succeeds: only then would a user's call succeed.
async fn wait_until_serving(router: SocketAddr, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    let mut last_error = String::from("not started");
    while Instant::now() < deadline {
        match probe(router).await {
            Ok(()) => return Ok(()),
            Err(e) => last_error = format!("{e:#}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("the cluster did not become ready within {limit:?}: {last_error}")
}

async fn probe(router: SocketAddr) -> Result<()> {
    let mut client =
        v1::generation_client::GenerationClient::connect(format!("http://{router}")).await?;
    let mut req = tonic::Request::new(v1::GenerateRequest {
        prompt: "ready?".into(),
        max_tokens: Some(1),
        temperature: Some(0.0),
        ..Default::default()
    });
    req.set_timeout(Duration::from_secs(30));
    client.complete(req).await?;
    Ok(())
}
