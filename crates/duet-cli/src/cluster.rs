//! A whole cluster on loopback — router + N prefill + M decode workers — in this process or as
//! separate processes. Every service gets a typed configuration: in this process it is handed to
//! the service's `serve` as it is; a separate process gets it as its command line through the
//! config's `to_args`, which parses back to an equal configuration (tested in each service), so
//! both kinds of cluster run the same configuration, and one cluster token (the given one, else a
//! random one). Used by `duet up`, `duet bench serve` and the integration tests.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{Context, Result, bail};
use duet_cluster::ClusterArgs;
use duet_decode_worker::DecodeConfig;
use duet_model::model_path::ModelArgs;
use duet_prefill_worker::PrefillConfig;
use duet_proto::{ClusterAuth, ClusterToken, v1};
use duet_router::RouterConfig;
use duet_telemetry::{MetricsArgs, TelemetryArgs};
use duet_worker::WorkerArgs;
use tonic::transport::ClientTlsConfig;

/// What to start: a configuration for each kind of service. The launcher fills in what it owns:
/// the workers' `listen` (free loopback ports), how they find each other, the cluster token and
/// every service's model; the rest is taken as it is (leave the workers' `worker_id` unset:
/// each defaults to one from its port).
///
/// How they find each other: through etcd when `router.cluster` names it (every service joins
/// that cluster); in this process, through the embedded registry under a cluster name of its
/// own (several clusters may run in one process: the tests do); as separate processes without
/// etcd, from the router's `--prefill`/`--decode` flags.
#[derive(Clone, Debug)]
pub struct ClusterSpec {
    /// The router; its `listen` is the cluster's address.
    pub router: RouterConfig,
    /// Every prefill worker.
    pub prefill: PrefillConfig,
    /// Every decode worker.
    pub decode: DecodeConfig,
    pub prefill_workers: usize,
    pub decode_workers: usize,
    /// The model every service serves.
    pub model: PathBuf,
    /// Separate processes (the service binaries next to the current executable, or in `bin_dir`).
    pub processes: bool,
    pub bin_dir: Option<PathBuf>,
    /// The log format and trace export of separate processes (in this process, whoever
    /// installed the logger chose them).
    pub telemetry: TelemetryArgs,
    /// The cluster token every service gets (the services' own `auth` is replaced by it); unset:
    /// a random one.
    pub auth: ClusterAuth,
}

/// A running cluster; dropping it stops it (child processes are killed; in-process services stop
/// with their runtime).
pub struct Cluster {
    pub router: SocketAddr,
    pub prefill: Vec<SocketAddr>,
    pub decode: Vec<SocketAddr>,
    /// The token the workers' internal RPCs require.
    pub token: ClusterToken,
    /// Where the workers' cards are: the membership flags every service was given (the
    /// embedded registry under this cluster's own name, in this process).
    pub membership: ClusterArgs,
    /// The Prometheus endpoints, when `router.metrics` names one: that one alone in one process
    /// (it serves every service's families), else the router's then each worker's (free
    /// loopback ports, in start order).
    pub metrics: Vec<SocketAddr>,
    children: Vec<ChildProcess>,
    runtime: Option<tokio::runtime::Runtime>,
}

/// A service running as a child process, with what started it (to start it again).
struct ChildProcess {
    name: &'static str,
    child: Child,
    dir: PathBuf,
    args: Vec<OsString>,
    env: Option<(&'static str, String)>,
}

impl ChildProcess {
    fn spawn(
        dir: PathBuf,
        name: &'static str,
        args: Vec<OsString>,
        env: Option<(&'static str, String)>,
    ) -> Result<ChildProcess> {
        let child = spawn_process(
            &dir,
            name,
            &args,
            env.as_ref().map(|(k, v)| (*k, v.as_str())),
        )?;
        Ok(ChildProcess {
            name,
            child,
            dir,
            args,
            env,
        })
    }
}

/// One service's full configuration.
enum Service {
    Router(RouterConfig),
    Prefill(PrefillConfig),
    Decode(DecodeConfig),
}

impl Service {
    fn binary(&self) -> &'static str {
        match self {
            Service::Router(_) => "duet-router",
            Service::Prefill(_) => "duet-prefill",
            Service::Decode(_) => "duet-decode",
        }
    }

    /// The cluster token, which a child process gets in its environment, never on its
    /// command line.
    fn env(&self) -> Option<(&'static str, &str)> {
        match self {
            Service::Router(c) => c.auth.to_env(),
            Service::Prefill(c) => c.worker.auth.to_env(),
            Service::Decode(c) => c.worker.auth.to_env(),
        }
    }

    fn args(&self) -> Vec<OsString> {
        match self {
            Service::Router(c) => c.to_args(),
            Service::Prefill(c) => c.to_args(),
            Service::Decode(c) => c.to_args(),
        }
    }

    /// Binds the service's address and serves on it until the runtime stops.
    async fn serve(self) -> Result<()> {
        let never = std::future::pending::<()>();
        match self {
            Service::Router(c) => {
                let listener = bind(c.listen).await?;
                duet_router::serve(c, listener, never).await
            }
            Service::Prefill(c) => {
                let listener = bind(c.listen).await?;
                duet_prefill_worker::serve(c, listener, never).await
            }
            Service::Decode(c) => {
                let listener = bind(c.listen).await?;
                duet_decode_worker::serve(c, listener, never).await
            }
        }
    }
}

impl Cluster {
    /// Starts every service and returns once a one-token `Generate` succeeds.
    pub fn start(spec: &ClusterSpec) -> Result<Cluster> {
        Self::start_unless(spec, std::future::pending())
    }

    /// [`Self::start`], given up with the services started so far stopped if `stop` completes
    /// first (a stop signal: [`duet_proto::serve::terminated`]).
    pub fn start_unless(spec: &ClusterSpec, stop: impl Future<Output = ()>) -> Result<Cluster> {
        // Without a decode worker no request can be served (a prefill worker only feeds one).
        anyhow::ensure!(
            spec.decode_workers > 0,
            "a cluster needs at least one decode worker (--decode-workers)"
        );
        // Port 0 becomes a free port here: the readiness probe and the ready line need the one
        // the router serves on.
        let router = match spec.router.listen {
            a if a.port() == 0 => free_port(a.ip())?,
            a => a,
        };
        let prefill = free_ports(spec.prefill_workers)?;
        let decode = free_ports(spec.decode_workers)?;
        let token = spec.auth.token()?.unwrap_or_else(ClusterToken::random);
        let auth = ClusterAuth::with_token(token.clone());
        let model = |template: &ModelArgs| ModelArgs {
            model: Some(spec.model.clone()),
            ..template.clone()
        };
        let by_flags = spec.processes && spec.router.cluster.etcd.is_empty();
        let cluster = if spec.processes || !spec.router.cluster.etcd.is_empty() {
            spec.router.cluster.clone()
        } else {
            in_process_cluster(&spec.router.cluster)
        };
        // Separate processes each serve their own metrics; in one process the router's endpoint
        // serves every service's.
        let router_metrics = spec.router.metrics.metrics_listen;
        let worker_metrics = match router_metrics {
            Some(_) if spec.processes => free_ports(spec.prefill_workers + spec.decode_workers)?
                .into_iter()
                .map(Some)
                .collect(),
            _ => vec![None; spec.prefill_workers + spec.decode_workers],
        };
        let metrics = |i: usize| MetricsArgs {
            metrics_listen: worker_metrics[i],
        };
        let listed = |addrs: &[SocketAddr]| -> Vec<String> {
            if by_flags {
                addrs.iter().map(SocketAddr::to_string).collect()
            } else {
                Vec::new()
            }
        };
        // Start order: prefill workers, then decode workers (the indices of `kill_process`).
        let mut services: Vec<Service> = Vec::new();
        services.extend(prefill.iter().enumerate().map(|(i, &listen)| {
            Service::Prefill(PrefillConfig {
                listen,
                decode: listed(&decode),
                worker: WorkerArgs {
                    model: model(&spec.prefill.worker.model),
                    cluster: cluster.clone(),
                    auth: auth.clone(),
                    metrics: metrics(i),
                    ..spec.prefill.worker.clone()
                },
                ..spec.prefill.clone()
            })
        }));
        services.extend(decode.iter().enumerate().map(|(i, &listen)| {
            Service::Decode(DecodeConfig {
                listen,
                prefill: listed(&prefill),
                worker: WorkerArgs {
                    model: model(&spec.decode.worker.model),
                    cluster: cluster.clone(),
                    auth: auth.clone(),
                    metrics: metrics(prefill.len() + i),
                    ..spec.decode.worker.clone()
                },
                ..spec.decode.clone()
            })
        }));
        services.push(Service::Router(RouterConfig {
            listen: router,
            prefill: listed(&prefill),
            decode: listed(&decode),
            model: model(&spec.router.model),
            cluster: cluster.clone(),
            auth,
            ..spec.router.clone()
        }));

        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let mut cluster = Cluster {
            router,
            metrics: router_metrics
                .into_iter()
                .chain(worker_metrics.into_iter().flatten())
                .collect(),
            prefill,
            decode,
            token,
            membership: cluster.clone(),
            children: Vec::new(),
            runtime: None,
        };
        for service in services {
            let binary = service.binary();
            if spec.processes {
                let dir = match &spec.bin_dir {
                    Some(d) => d.clone(),
                    None => std::env::current_exe()?
                        .parent()
                        .context("executable without a directory")?
                        .to_path_buf(),
                };
                let mut args = service.args();
                args.extend(spec.telemetry.to_args());
                let env = service.env().map(|(k, v)| (k, v.to_string()));
                cluster
                    .children
                    .push(ChildProcess::spawn(dir, binary, args, env)?);
            } else {
                runtime.spawn(async move { report(binary, service.serve().await) });
            }
        }
        // The readiness probe is a public call: with API keys, it carries the first.
        let key = match &spec.router.api_keys_file {
            Some(path) => Some(
                duet_router::api_keys::ApiKeys::load(path)?
                    .first()
                    .to_owned(),
            ),
            None => None,
        };
        let tls = spec.router.tls.load()?.map(|t| t.client());
        // An error here drops `cluster`, which stops the service processes already started: a
        // stop signal or a service that died while starting leaves none of them behind.
        runtime.block_on(async {
            tokio::select! {
                r = wait_until_serving(
                    router,
                    key.as_deref(),
                    tls.as_ref(),
                    (spec.prefill_workers, spec.decode_workers),
                    Duration::from_secs(300),
                    || cluster.exited_process(),
                ) => r,
                () = stop => bail!("stopped while starting"),
            }
        })?;
        cluster.runtime = Some(runtime);
        Ok(cluster)
    }

    /// An error naming the first service process that has exited, if one has.
    fn exited_process(&mut self) -> Result<()> {
        for p in &mut self.children {
            if let Some(status) = p.child.try_wait()? {
                bail!(
                    "{} exited while the cluster was starting ({status})",
                    p.name
                );
            }
        }
        Ok(())
    }

    /// Kills one service process (failure tests); `index` counts prefill workers then decode
    /// workers in start order.
    pub fn kill_process(&mut self, index: usize) -> Result<()> {
        let p = self.children.get_mut(index).context("no such process")?;
        p.child.kill()?;
        p.child.wait()?;
        Ok(())
    }

    /// The operating system's id of one service process; `index` as for
    /// [`Self::kill_process`].
    pub fn process_id(&self, index: usize) -> Result<u32> {
        Ok(self
            .children
            .get(index)
            .context("no such process")?
            .child
            .id())
    }

    /// Every worker's address in process order: prefill workers, then decode workers.
    pub fn workers(&self) -> Vec<SocketAddr> {
        self.prefill.iter().chain(&self.decode).copied().collect()
    }

    /// Waits up to `limit` for one service process to exit; whether it did.
    pub fn wait_process(&mut self, index: usize, limit: Duration) -> Result<bool> {
        let p = self.children.get_mut(index).context("no such process")?;
        let deadline = Instant::now() + limit;
        while p.child.try_wait()?.is_none() {
            if Instant::now() >= deadline {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(true)
    }

    /// Starts an exited service process again with the same command line, so on the same port;
    /// `index` as for [`Self::kill_process`].
    pub fn respawn_process(&mut self, index: usize) -> Result<()> {
        let p = self.children.get_mut(index).context("no such process")?;
        if p.child.try_wait()?.is_none() {
            bail!("{} (process {index}) is still running", p.name);
        }
        *p = ChildProcess::spawn(p.dir.clone(), p.name, p.args.clone(), p.env.clone())?;
        Ok(())
    }

    /// Sends `signal` (a name `kill` knows: `STOP`, `CONT`, `TERM`…) to one service process;
    /// `index` as for [`Self::kill_process`].
    pub fn signal_process(&self, index: usize, signal: &str) -> Result<()> {
        let p = self.children.get(index).context("no such process")?;
        let name = p.name;
        let status = std::process::Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(p.child.id().to_string())
            .status()?;
        anyhow::ensure!(status.success(), "kill -{signal} {name} failed: {status}");
        Ok(())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for p in &mut self.children {
            let _ = p.child.kill();
            let _ = p.child.wait();
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// `base` for the first cluster run in this process, `base-2`, `base-3`… after it, so that
/// clusters sharing the embedded registry stay apart.
fn in_process_cluster(base: &ClusterArgs) -> ClusterArgs {
    static STARTED: AtomicUsize = AtomicUsize::new(0);
    let n = STARTED.fetch_add(1, Ordering::Relaxed);
    ClusterArgs {
        etcd: Vec::new(),
        cluster: if n == 0 {
            base.cluster.clone()
        } else {
            format!("{}-{}", base.cluster, n + 1)
        },
        ..ClusterArgs::default()
    }
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

fn spawn_process(
    dir: &Path,
    binary: &str,
    args: &[OsString],
    env: Option<(&str, &str)>,
) -> Result<Child> {
    let path = dir.join(binary);
    if !path.exists() {
        bail!(
            "{} not found (build it with `cargo build --release --workspace`)",
            path.display()
        );
    }
    let mut command = Command::new(&path);
    command.args(args);
    // The command line is the whole configuration: a `DUET_*` variable of this process would
    // fill a flag it leaves out (an unset worker id, an empty worker list) in every service.
    for (name, _) in std::env::vars_os() {
        if name.as_encoded_bytes().starts_with(b"DUET_") {
            command.env_remove(name);
        }
    }
    command.envs(env);
    command
        .spawn()
        .with_context(|| format!("starting {}", path.display()))
}

/// Loopback addresses with free ports for the workers.
fn free_ports(n: usize) -> Result<Vec<SocketAddr>> {
    (0..n)
        .map(|_| free_port(std::net::Ipv4Addr::LOCALHOST.into()))
        .collect()
}

/// A router for a measurement's own cluster: on a free loopback port, in cluster `name`, with
/// every other setting at its default.
pub fn loopback_router(name: &str) -> Result<RouterConfig> {
    Ok(RouterConfig {
        listen: free_port(std::net::Ipv4Addr::LOCALHOST.into())?,
        cluster: ClusterArgs {
            cluster: name.into(),
            ..ClusterArgs::default()
        },
        ..RouterConfig::default()
    })
}

/// A port on `ip` that nothing listens on, for a service or a test server to bind soon after.
///
/// Checking a port and binding it later leaves a window in which a port the kernel picks (a
/// bind to port 0, or an outgoing connection's own port, in any process) can land on it, and the
/// service then fails to start. So the port comes from below the kernel's ephemeral range, where
/// the kernel never picks, and no two calls in one process return the same port (a count from a
/// random start: processes started together take different ones). Where no such range exists,
/// the kernel picks.
pub fn free_port(ip: std::net::IpAddr) -> Result<SocketAddr> {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    // The range and the random start, found once per process.
    static RANGE: std::sync::OnceLock<(std::ops::Range<u16>, usize)> = std::sync::OnceLock::new();
    let (ports, start) = RANGE.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        let start = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish() as usize;
        (below_ephemeral_ports(), start)
    });
    let (ports, start) = (ports.clone(), *start);
    for _ in 0..ports.len() {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = ports.start + ((start + n) % ports.len()) as u16;
        if let Ok(listener) = std::net::TcpListener::bind((ip, port)) {
            return Ok(listener.local_addr()?);
        }
    }
    std::net::TcpListener::bind((ip, 0))
        .and_then(|l| l.local_addr())
        .with_context(|| format!("finding a free port on {ip}"))
}

/// The 16384 ports below the kernel's ephemeral range (Linux's `ip_local_port_range`, 32768 by
/// default), above the privileged ones; empty where the range cannot be read or starts too low.
fn below_ephemeral_ports() -> std::ops::Range<u16> {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(0);
    low.saturating_sub(16384).max(1024)..low.max(1024)
}

/// Polls with a one-token `Generate` until one succeeds (only then would a user's call succeed)
/// and the router's `Info` shows the `(prefill, decode)` workers launched all routable (a
/// prefill worker is ready once it knows a decode worker to push to, and the router sees that
/// at its next poll) and every decode worker accepting every prefill worker in a plan. Stops at the first error of `services_alive`, checked before each try.
async fn wait_until_serving(
    router: SocketAddr,
    key: Option<&str>,
    tls: Option<&ClientTlsConfig>,
    workers: (usize, usize),
    limit: Duration,
    mut services_alive: impl FnMut() -> Result<()>,
) -> Result<()> {
    let deadline = Instant::now() + limit;
    let mut last_error = String::from("not started");
    while Instant::now() < deadline {
        services_alive()?;
        match probe(router, key, tls, workers).await {
            Ok(()) => return Ok(()),
            // The configuration refuses every call (a prompt limit below the probe's, say):
            // waiting would not change that.
            Err(e)
                if e.downcast_ref::<tonic::Status>().is_some_and(|s| {
                    matches!(
                        s.code(),
                        tonic::Code::InvalidArgument
                            | tonic::Code::Unauthenticated
                            | tonic::Code::PermissionDenied
                    )
                }) =>
            {
                bail!("the router refuses the readiness probe (a one-token Generate): {e:#}")
            }
            Err(e) => last_error = format!("{e:#}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("the cluster did not become ready within {limit:?}: {last_error}")
}

/// `message` as a call to a router carrying `key` (`authorization: Bearer KEY`) when there is
/// one.
pub fn with_api_key<T>(message: T, key: Option<&str>) -> Result<tonic::Request<T>> {
    let mut request = tonic::Request::new(message);
    if let Some(key) = key {
        let value = format!("Bearer {key}")
            .parse()
            .context("the API key is not a valid header value")?;
        request.metadata_mut().insert("authorization", value);
    }
    Ok(request)
}

async fn probe(
    router: SocketAddr,
    key: Option<&str>,
    tls: Option<&ClientTlsConfig>,
    (prefill, decode): (usize, usize),
) -> Result<()> {
    let channel = duet_proto::channels::endpoint(&router.to_string(), tls)?
        .connect()
        .await?;
    let mut client = v1::generation_client::GenerationClient::new(channel);
    let mut req = with_api_key(
        v1::GenerateRequest {
            prompt: "ready?".into(),
            max_tokens: Some(1),
            temperature: Some(0.0),
            ..Default::default()
        },
        key,
    )?;
    req.set_timeout(Duration::from_secs(30));
    client.complete(req).await?;
    let info = client
        .info(with_api_key(v1::InfoRequest {}, key)?)
        .await?
        .into_inner();
    let routable = |w: &[v1::WorkerInfo]| w.iter().filter(|w| w.healthy).count();
    let (p, d) = (
        routable(&info.prefill_workers),
        routable(&info.decode_workers),
    );
    if p < prefill || d < decode {
        bail!("{p} of {prefill} prefill and {d} of {decode} decode workers routable");
    }
    // A decode worker learns the prefill workers from the membership on its own schedule; until
    // it accepts them the router prefills its prompts on it, and the cluster is not yet the one
    // launched.
    if let Some(w) = info
        .decode_workers
        .iter()
        .find(|w| !w.refused_prefill_workers.is_empty())
    {
        bail!(
            "decode worker {} does not accept prefill workers {:?} yet",
            w.address,
            w.refused_prefill_workers
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_distinct_unbound_and_never_ones_the_kernel_picks() {
        let ephemeral = below_ephemeral_ports().end;
        let ports: Vec<SocketAddr> = free_ports(64).unwrap();
        let mut distinct: Vec<u16> = ports.iter().map(|a| a.port()).collect();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), ports.len(), "{ports:?}");
        for a in &ports {
            assert!(a.ip().is_loopback(), "{a}");
            if ephemeral > 1024 {
                assert!((1024..ephemeral).contains(&a.port()), "{a}");
            }
            // Free when returned: a service can bind it.
            std::net::TcpListener::bind(a).unwrap();
        }
    }
}
