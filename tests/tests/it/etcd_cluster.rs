//! A cluster whose services find each other through a real etcd, each service its own process,
//! under load: workers join and are used, a worker drained by SIGTERM finishes what it holds and
//! exits 0, etcd stopped for 15 s costs no request, and a worker restarted on its address comes
//! back as a new incarnation.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use duet_cluster::{ClusterArgs, LeaseArgs};
use duet_decode_worker::DecodeConfig;
use duet_model::model_path::ModelArgs;
use duet_prefill_worker::PrefillConfig;
use duet_proto::v1;
use duet_router::RouterConfig;
use duet_tests::etcd::Etcd;
use duet_tests::*;
use duet_worker::WorkerArgs;

fn membership(etcd: &Etcd, cluster: &str) -> ClusterArgs {
    ClusterArgs {
        etcd: vec![etcd.url()],
        cluster: cluster.into(),
        ..Default::default()
    }
}

fn tiny() -> ModelArgs {
    ModelArgs {
        model: Some(tiny_model()),
        ..Default::default()
    }
}

fn lease() -> LeaseArgs {
    LeaseArgs {
        lease_ttl_s: 10,
        drain_timeout_s: 20,
    }
}

/// The flags both workers take: this etcd's cluster, the tiny model.
fn worker_args(etcd: &Etcd, cluster: &str) -> WorkerArgs {
    WorkerArgs {
        cluster: membership(etcd, cluster),
        lease: lease(),
        model: tiny(),
        engine: engine_options(),
        ..Default::default()
    }
}

fn decode(etcd: &Etcd, cluster: &str, listen: SocketAddr) -> Process {
    let config = DecodeConfig {
        listen,
        worker: worker_args(etcd, cluster),
        ..Default::default()
    };
    Process::start("duet-decode", config.to_args())
}

fn prefill(etcd: &Etcd, cluster: &str, listen: SocketAddr) -> Process {
    let config = PrefillConfig {
        listen,
        worker: worker_args(etcd, cluster),
        ..Default::default()
    };
    Process::start("duet-prefill", config.to_args())
}

fn router(etcd: &Etcd, cluster: &str) -> (Process, SocketAddr) {
    let config = RouterConfig {
        listen: free_addr(),
        cluster: membership(etcd, cluster),
        model: tiny(),
        routing: RoutingOptions {
            stats_interval_ms: 100,
            // Prompts of the load prefill on prefill workers when there are any.
            local_prefill_threshold: 8,
            ..Default::default()
        },
        ..Default::default()
    };
    let addr = config.listen;
    (Process::start("duet-router", config.to_args()), addr)
}

/// Requests from a few concurrent clients until stopped; every failure is kept.
struct Load {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    tasks: Vec<tokio::task::JoinHandle<Vec<String>>>,
}

impl Load {
    fn start(rt: &tokio::runtime::Runtime, router: SocketAddr) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let tasks = (0..3u32)
            .map(|client| {
                let (stop, ok) = (stop.clone(), ok.clone());
                rt.spawn(async move {
                    let mut failures = Vec::new();
                    let mut i = 0u32;
                    while !stop.load(Ordering::Relaxed) {
                        i += 1;
                        let prompt: Vec<u32> = (0..20)
                            .map(|t| 3 + (client * 31 + i * 7 + t * 13) % 250)
                            .collect();
                        let mut req = greedy_request(&prompt, 24);
                        req.ignore_eos = true;
                        match generate(router, req).await {
                            Ok((ids, _, _)) if ids.len() == 24 => {
                                ok.fetch_add(1, Ordering::Relaxed);
                            }
                            Ok((ids, _, _)) => failures.push(format!("{} tokens", ids.len())),
                            Err(s) => failures.push(format!("{:?}: {}", s.code(), s.message())),
                        }
                    }
                    failures
                })
            })
            .collect();
        Load { stop, ok, tasks }
    }

    fn ok(&self) -> u64 {
        self.ok.load(Ordering::Relaxed)
    }

    /// Stops and checks that no request failed; the number that succeeded.
    fn finish(self, rt: &tokio::runtime::Runtime) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        let mut failures = Vec::new();
        for t in self.tasks {
            failures.extend(rt.block_on(t).unwrap());
        }
        assert!(failures.is_empty(), "requests failed: {failures:?}");
        self.ok.load(Ordering::Relaxed)
    }
}

async fn stats(addr: SocketAddr) -> Option<v1::StatsResponse> {
    let mut c = v1::worker_control_client::WorkerControlClient::connect(format!("http://{addr}"))
        .await
        .ok()?;
    c.stats(v1::StatsRequest {})
        .await
        .ok()
        .map(|r| r.into_inner())
}

/// The router's Info (`None` while it does not answer).
async fn info(router: SocketAddr) -> Option<v1::InfoResponse> {
    let mut c = v1::generation_client::GenerationClient::connect(format!("http://{router}"))
        .await
        .ok()?;
    c.info(v1::InfoRequest {})
        .await
        .ok()
        .map(|r| r.into_inner())
}

/// Polls `f` every 100 ms for up to `secs`.
fn until<T>(
    rt: &tokio::runtime::Runtime,
    secs: u64,
    what: &str,
    mut f: impl AsyncFnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(t) = rt.block_on(f()) {
            return t;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Serves a request through the router.
async fn serves(router: SocketAddr) -> Option<()> {
    // Not listening yet while the router starts (`generate` expects a listening router).
    tokio::net::TcpStream::connect(router).await.ok()?;
    generate(router, greedy_request(&[1, 17, 250, 3], 2))
        .await
        .ok()
        .map(|_| ())
}

/// The cards under the cluster's prefix, as etcdctl prints them (keys and values).
fn cards(etcd: &Etcd, cluster: &str) -> String {
    etcd.ctl(&["get", "--prefix", &format!("/duet/{cluster}/workers/")])
        .unwrap()
}

#[test]
fn workers_join_under_load_and_a_sigterm_drains_one_without_a_failed_request() {
    let etcd = Etcd::start();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (_router, router_addr) = router(&etcd, "join");
    let first_addr = free_addr();
    let mut first = decode(&etcd, "join", first_addr);
    until(
        &rt,
        60,
        "the router serving through the first worker",
        async || serves(router_addr).await,
    );

    let load = Load::start(&rt, router_addr);
    let second_addr = free_addr();
    let _second = decode(&etcd, "join", second_addr);
    until(&rt, 60, "the joined worker used", async || {
        stats(second_addr).await.filter(|s| s.requests_served > 0)
    });

    // A rolling update replaces the first worker. As the drain begins its health turns
    // NOT_SERVING (what takes it out of the router's rotation and Kubernetes' endpoints) on a
    // connection opened before.
    let health = rt.block_on(async {
        tonic::transport::Endpoint::from_shared(format!("http://{first_addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap()
    });
    first.terminate();
    let drained_health = rt.block_on(async {
        use tonic_health::pb::HealthCheckRequest;
        use tonic_health::pb::health_check_response::ServingStatus;
        let mut client = tonic_health::pb::health_client::HealthClient::new(health);
        for _ in 0..200 {
            let check = client.check(HealthCheckRequest {
                service: String::new(),
            });
            match check.await.map(|r| r.into_inner().status()) {
                Ok(ServingStatus::Serving) => tokio::time::sleep(Duration::from_millis(10)).await,
                answered => return format!("{answered:?}"),
            }
        }
        "still SERVING after 2 s".to_string()
    });
    assert_eq!(drained_health, "Ok(NotServing)");
    let status = first.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "a drained worker exits 0: {status}");
    assert!(
        !cards(&etcd, "join").contains(&format!("decode-{}", first_addr.port())),
        "its card is gone"
    );
    let served_then = rt.block_on(stats(second_addr)).unwrap().requests_served;
    let ok_then = load.ok();
    until(&rt, 30, "requests served after the drain", async || {
        (load.ok() > ok_then + 5).then_some(())
    });
    let total = load.finish(&rt);
    let served_now = rt.block_on(stats(second_addr)).unwrap().requests_served;
    assert!(
        served_now > served_then,
        "new requests go to the remaining worker"
    );
    assert!(total > 10, "the load ran: {total} requests");
}

/// The router routes to 2 decode workers and 1 prefill worker.
async fn all_healthy(router: SocketAddr) -> Option<()> {
    let i = info(router).await?;
    (i.decode_workers.iter().filter(|w| w.healthy).count() == 2
        && i.prefill_workers.iter().filter(|w| w.healthy).count() == 1)
        .then_some(())
}

#[test]
fn etcd_stopped_for_15_s_under_load_fails_no_request_and_membership_converges() {
    let mut etcd = Etcd::start();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (_router, router_addr) = router(&etcd, "outage");
    let _workers = [
        prefill(&etcd, "outage", free_addr()),
        decode(&etcd, "outage", free_addr()),
        decode(&etcd, "outage", free_addr()),
    ];
    until(&rt, 60, "every worker routable", async || {
        all_healthy(router_addr).await
    });

    let load = Load::start(&rt, router_addr);
    std::thread::sleep(Duration::from_secs(1));
    etcd.stop();
    let ok_before = load.ok();
    std::thread::sleep(Duration::from_secs(15));
    assert!(
        load.ok() > ok_before,
        "requests are served while etcd is down"
    );
    etcd.start_again();
    std::thread::sleep(Duration::from_secs(2));
    load.finish(&rt);

    until(
        &rt,
        30,
        "membership converged after etcd returned",
        async || all_healthy(router_addr).await,
    );
    // A worker joining now is seen: the router watches etcd again.
    let late = free_addr();
    let _late = decode(&etcd, "outage", late);
    until(&rt, 60, "the late worker routable", async || {
        let i = info(router_addr).await?;
        i.decode_workers
            .iter()
            .any(|w| w.address == late.to_string() && w.healthy)
            .then_some(())
    });
    assert_eq!(
        cards(&etcd, "outage")
            .matches("/duet/outage/workers/")
            .count(),
        4
    );
}

#[test]
fn a_worker_restarted_on_its_address_is_a_new_incarnation_and_replaces_the_old() {
    let etcd = Etcd::start();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (_router, router_addr) = router(&etcd, "restart");
    let addr = free_addr();
    let mut worker = decode(&etcd, "restart", addr);
    until(&rt, 60, "serving", async || serves(router_addr).await);
    let incarnation = |cards: &str| -> u64 {
        let at = cards.find(r#""incarnation":"#).expect("a card") + 14;
        cards[at..]
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let before = incarnation(&cards(&etcd, "restart"));

    worker.kill();
    let _again = decode(&etcd, "restart", addr);
    let after = until(&rt, 60, "a new incarnation", async || {
        let now = incarnation(&cards(&etcd, "restart"));
        (now != before).then_some(now)
    });
    assert!(after > before);
    until(&rt, 60, "serving through the new incarnation", async || {
        serves(router_addr).await
    });
    let i = rt.block_on(info(router_addr)).unwrap();
    assert_eq!(
        i.decode_workers.len(),
        1,
        "the old incarnation is dropped: {:?}",
        i.decode_workers
    );
}
