//! The planner at run time against a real cluster in this process: two decode workers whose
//! roles can switch serve an open-loop load of prompts whose prefill, by the profile the planner
//! simulates with, stalls a decode worker's batch past the TPOT SLO; the best split is one
//! prefill worker beside one decode worker, not the two decode workers it starts with. The
//! planner sees the load, re-plans at once (its first plan: a burst), switches one worker to
//! prefill, and every request succeeds; it exports the desired replicas on /metrics and the
//! decision (reason, predicted latencies, then the observed ones) on /decisions and in its log.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use duet_decode_worker::RoleSwitchArgs;
use duet_engine::device::Switch;
use duet_planner::profile::Profile;
use duet_planner::report::Slo;
use duet_planner::simulator::{Design, SimConfig};
use duet_planner_service::{Model, PlannerConfig};
use duet_proto::v1;
use duet_tests::*;

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    planner: PlannerConfig,
}

/// The tiny model's profile as the planner is told it: prompts cost 3 ms a token, a decode
/// step 2 ms (made up: the test is of the loop, not of the profile's fidelity).
fn profile(name: &str, fingerprint: &str) -> Profile {
    let mut p = duet_planner::testing::synthetic();
    p.model.name = name.into();
    p.model.fingerprint = fingerprint.into();
    p.kv.block_size = 16;
    p.prefill.fit.a_ms = 1.0;
    p.prefill.fit.b_ms_per_token = 3.0;
    p.decode.fit.a_ms = 2.0;
    p.decode.fit.b_ms_per_context_token = 0.0;
    p.decode.fit.c_ms_per_sequence = 0.1;
    p
}

async fn get(addr: SocketAddr, path: &str) -> String {
    tokio::task::spawn_blocking({
        let path = path.to_string();
        move || http(addr, "GET", &path, None, "").1
    })
    .await
    .unwrap()
}

#[test]
fn the_planner_switches_a_worker_toward_the_best_split_and_no_request_fails() {
    // Its own name for the model, so that this router's metrics are the only ones labelled
    // with it in this process (the planner reads the router's families of the profile's model).
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("planner-tiny");
    std::os::unix::fs::symlink(tiny_model(), &model).unwrap();
    let routing = RoutingOptions {
        local_prefill_threshold: 0,
        prefill_saturation_factor: 0.0,
        ..Default::default()
    };
    let mut spec = spec(model, 0, 2, routing);
    spec.decode.role_switch = RoleSwitchArgs {
        role_switch: Switch::On,
        ..Default::default()
    };
    let router_metrics = free_addr();
    spec.router.metrics.metrics_listen = Some(router_metrics);
    let cluster = Cluster::start(&spec).expect("starting the cluster");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let fingerprint = worker_stats(&cluster, cluster.decode[0])
            .await
            .model_fingerprint;
        let slo = Slo {
            ttft_ms: 2000.0,
            tpot_ms: 5.0,
        };
        let planner_addr = free_addr();
        let decisions_out = dir.path().join("decisions.jsonl");
        let flags = Flags::try_parse_from([
            "duet-planner".to_string(),
            format!("--router-metrics=http://{router_metrics}"),
            "--period-s=3".into(),
            "--poll-interval-s=0.5".into(),
            "--burst-window-s=3".into(),
            "--burst-min-requests=5".into(),
            format!("--ttft-slo-ms={}", slo.ttft_ms),
            format!("--tpot-slo-ms={}", slo.tpot_ms),
            "--sim-requests=200".into(),
            "--max-workers=3".into(),
            format!("--metrics-listen={planner_addr}"),
            format!("--decisions-out={}", decisions_out.display()),
            format!("--cluster={}", cluster.membership.cluster),
            format!("--cluster-token={}", cluster.token.as_str()),
        ])
        .unwrap();
        let model = Model {
            profile: profile("planner-tiny", &fingerprint),
            sim: SimConfig {
                slo,
                ..duet_planner::testing::config(Design::Disaggregated, 0, 2)
            },
        };
        let (stop_planner, planner_stopped) = tokio::sync::oneshot::channel::<()>();
        let planner = tokio::spawn(duet_planner_service::serve(flags.planner, model, async {
            let _ = planner_stopped.await;
        }));

        // Open loop: a request every 250 ms, each its own task, whatever the cluster does.
        let stop = Arc::new(AtomicBool::new(false));
        let router = cluster.router;
        let load = tokio::spawn({
            let stop = stop.clone();
            async move {
                let mut sent = Vec::new();
                let mut n = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    let prompt: Vec<u32> = [3 + n % 300, 3 + n / 300]
                        .into_iter()
                        .chain((2..48u32).map(|t| 1 + (t * 7 + n * 31) % 200))
                        .collect();
                    sent.push(tokio::spawn(generate(
                        router,
                        v1::GenerateRequest {
                            ignore_eos: true,
                            ..greedy_request(&prompt, 32)
                        },
                    )));
                    n += 1;
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                sent
            }
        });

        // One worker switched to prefill by the planner.
        let deadline = Instant::now() + Duration::from_secs(45);
        loop {
            let mut roles = Vec::new();
            for &w in &cluster.decode {
                roles.push(worker_stats(&cluster, w).await.role());
            }
            if roles.contains(&v1::WorkerRole::Prefill) {
                assert!(roles.contains(&v1::WorkerRole::Decode), "{roles:?}");
                break;
            }
            assert!(Instant::now() < deadline, "no worker was switched: {roles:?}, decisions: {}", get(planner_addr, "/decisions").await);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }

        // The decision, then (a period later) what was observed after it.
        let deadline = Instant::now() + Duration::from_secs(30);
        let switched = loop {
            let decisions: serde_json::Value =
                serde_json::from_str(&get(planner_addr, "/decisions").await).unwrap();
            let switched = decisions
                .as_array()
                .unwrap()
                .iter()
                .find(|d| d["action"] == "switch" && d["switch_error"].is_null())
                .cloned();
            if let Some(d) = switched.filter(|d| !d["observed"].is_null()) {
                break d;
            }
            assert!(Instant::now() < deadline, "no observed switch decision: {decisions}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert_eq!(switched["switch"]["to"], "prefill", "{switched}");
        assert_eq!(switched["live"], serde_json::json!({"prefill": 0, "decode": 2}));
        assert!(switched["reason"].as_str().unwrap().contains("1P+1D"), "{switched}");
        assert_eq!(switched["chosen"]["split"], serde_json::json!({"prefill": 1, "decode": 1}));
        assert!(switched["chosen"]["ttft_p90_ms"].as_f64().unwrap() > 0.0);
        assert!(switched["chosen"]["tpot_p90_ms"].as_f64().unwrap() > 0.0);
        assert!(switched["rate"].as_f64().unwrap() > 0.0);
        assert!(switched["observed"]["ttft_p90_ms"].as_f64().unwrap() > 0.0, "{switched}");
        assert!(switched["observed"]["tpot_p90_ms"].as_f64().unwrap() > 0.0, "{switched}");

        stop.store(true, Ordering::Relaxed);
        let mut served = 0;
        for request in load.await.unwrap() {
            let (ids, _, _) = request
                .await
                .unwrap()
                .unwrap_or_else(|e| panic!("a request failed: {e}"));
            assert_eq!(ids.len(), 32);
            served += 1;
        }
        assert!(served > 10, "{served}");

        // The desired replicas, for the autoscalers: a prefill worker and a decode worker.
        let metrics = get(planner_addr, "/metrics").await;
        let desired = |role: &str| {
            let series = format!("duet_planner_desired_replicas{{model=\"planner-tiny\",role=\"{role}\"}} ");
            metrics
                .lines()
                .find_map(|l| l.strip_prefix(&series))
                .unwrap_or_else(|| panic!("no {series}in {metrics}"))
                .parse::<f64>()
                .unwrap()
        };
        assert!(desired("prefill") >= 1.0 && desired("decode") >= 1.0, "{metrics}");
        assert!(metrics.contains("duet_planner_role_switches_total{model=\"planner-tiny\",outcome=\"ok\",to=\"prefill\"} 1"), "{metrics}");

        stop_planner.send(()).unwrap();
        planner.await.unwrap().expect("the planner ran until stopped");
        // The log holds the decision as made and again as observed.
        let log = std::fs::read_to_string(&decisions_out).unwrap();
        let id = &switched["id"];
        let lines: Vec<serde_json::Value> = log
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|d| &d["id"] == id)
            .collect();
        assert_eq!(lines.len(), 2, "{log}");
        assert!(lines[0]["observed"].is_null() && !lines[1]["observed"].is_null());
    });
}

#[test]
fn the_planner_refuses_an_unreachable_router_and_another_models_profile_naming_the_flag() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let model = Model {
        profile: profile("some-model", "fp"),
        sim: duet_planner::testing::config(Design::Disaggregated, 0, 1),
    };
    let flags = |router: SocketAddr| {
        Flags::try_parse_from([
            "duet-planner".to_string(),
            format!("--router-metrics=http://{router}"),
            "--cluster=planner-refusals".into(),
        ])
        .unwrap()
        .planner
    };
    runtime.block_on(async {
        let nobody = free_addr();
        let err = duet_planner_service::serve(flags(nobody), model.clone(), std::future::pending())
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--router-metrics") && err.contains(&nobody.to_string()),
            "{err}"
        );

        let zero_slo = PlannerConfig {
            ttft_slo_ms: 0.0,
            ..flags(nobody)
        };
        let err = duet_planner_service::serve(zero_slo, model.clone(), std::future::pending())
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("--ttft-slo-ms"), "{err}");

        // A router whose metrics serve another model than the profile's.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let router = listener.local_addr().unwrap();
        let app = other_models_router(listener);
        let err = duet_planner_service::serve(flags(router), model, std::future::pending())
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--profile") && err.contains("other-model"),
            "{err}"
        );
        app.abort();
    });
}

/// Serves, on `listener`, a router's received counter for model `other-model`.
fn other_models_router(listener: tokio::net::TcpListener) -> tokio::task::JoinHandle<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).await;
            let body = "duet_requests_received_total{role=\"router\",model=\"other-model\"} 1\n";
            let _ = s
                .write_all(
                    format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    )
                    .as_bytes(),
                )
                .await;
        }
    })
}
