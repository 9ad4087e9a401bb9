//! A cluster started by hand with static flags, where the decode worker was not told of the
//! prefill worker (no `--prefill`): the decode worker says which prefill workers it accepts, so
//! the router plans every request within them (here: on the decode worker itself) and none
//! fails; the router's readiness endpoint names the refused pair.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use duet_cluster::ClusterArgs;
use duet_decode_worker::DecodeConfig;
use duet_model::model_path::ModelArgs;
use duet_prefill_worker::PrefillConfig;
use duet_proto::{ClusterAuth, ClusterToken};
use duet_router::RouterConfig;
use duet_tests::*;
use duet_worker::WorkerArgs;

/// Waits until the router's `GET /health` answers with a body `done` accepts; returns it.
fn health_until(
    http_addr: SocketAddr,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(stream) = std::net::TcpStream::connect(http_addr) {
            drop(stream);
            let (_, body) = http(http_addr, "GET", "/health", None, "");
            let body: serde_json::Value = serde_json::from_str(&body).unwrap();
            if done(&body) {
                return body;
            }
            assert!(Instant::now() < until, "the router never got there: {body}");
        }
        assert!(
            Instant::now() < until,
            "the router's HTTP port never opened"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_router_plans_only_the_prefill_workers_its_decode_workers_accept() {
    let (prefill, decode, router, http_addr) = (free_addr(), free_addr(), free_addr(), free_addr());
    let auth = ClusterAuth::with_token(ClusterToken::random());
    // Each service alone in a cluster of its own name: nobody learns a peer from a card.
    let worker = |cluster: &str| WorkerArgs {
        model: ModelArgs {
            model: Some(tiny_model()),
            ..Default::default()
        },
        engine: engine_options(),
        cluster: ClusterArgs {
            cluster: cluster.into(),
            ..Default::default()
        },
        auth: auth.clone(),
        ..Default::default()
    };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let prefill_config = PrefillConfig {
        listen: prefill,
        decode: vec![decode.to_string()],
        worker: worker("refused-prefill-p"),
        ..Default::default()
    };
    let decode_config = DecodeConfig {
        listen: decode,
        prefill: Vec::new(),
        worker: worker("refused-prefill-d"),
        ..Default::default()
    };
    let router_config = RouterConfig {
        listen: router,
        http_listen: Some(http_addr),
        prefill: vec![prefill.to_string()],
        decode: vec![decode.to_string()],
        model: ModelArgs {
            model: Some(tiny_model()),
            ..Default::default()
        },
        cluster: ClusterArgs {
            cluster: "refused-prefill-r".into(),
            ..Default::default()
        },
        // Every prompt past 0 uncached tokens would be planned on the prefill worker.
        routing: local_prefill_threshold(0),
        auth: auth.clone(),
        ..Default::default()
    };
    spawn_prefill(&runtime, prefill_config);
    spawn_decode(&runtime, decode_config);
    spawn_router(&runtime, router_config);
    let health = health_until(http_addr, |h| {
        h["decode_workers_up"] == 1 && h["prefill_workers_up"] == 1
    });
    assert_eq!(
        health["refused_prefill"],
        serde_json::json!([{"decode": decode.to_string(), "prefill": prefill.to_string()}]),
        "{health}"
    );
    let prompt: Vec<u32> = (0..60).map(|i| 3 + (i * 37) % 370).collect();
    let want = reference(&tiny_model(), std::slice::from_ref(&prompt), 6).remove(0);
    for _ in 0..3 {
        let (ids, _, last) = runtime
            .block_on(generate(router, greedy_request(&prompt, 6)))
            .expect("a request the decode worker cannot prefill remotely is served");
        assert_eq!(ids, want);
        assert!(last.timings.unwrap().prefill_local);
    }
    // Nothing was refused at the decode worker: the router never planned the pair.
    let health = health_until(http_addr, |_| true);
    assert_eq!(health["refused_prefill_plans"], 0, "{health}");
}
