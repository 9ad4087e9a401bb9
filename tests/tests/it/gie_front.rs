//! The GIE front (`duet-router --only-decode-worker`): a router beside one decode worker, as the
//! chart runs it in every decode pod for the Gateway API Inference Extension, whose endpoint
//! picker has already chosen the pod. Every request it takes decodes on that worker and on no
//! other, over gRPC and OpenAI HTTP alike, while its prompts are still prefilled on the
//! cluster's prefill pool.

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

#[test]
fn a_front_pinned_to_one_decode_worker_decodes_only_there_and_prefills_on_the_pool() {
    let (prefill, decode_a, decode_b) = (free_addr(), free_addr(), free_addr());
    let (router, http_addr) = (free_addr(), free_addr());
    let auth = ClusterAuth::with_token(ClusterToken::random());
    let tiny = ModelArgs {
        model: Some(tiny_model()),
        ..Default::default()
    };
    // Every service in one cluster of the embedded registry: the front learns its workers from
    // their cards, as it does from etcd in a pod.
    let cluster = ClusterArgs {
        cluster: "gie-front".into(),
        ..Default::default()
    };
    let worker = |id: &str| WorkerArgs {
        worker_id: Some(id.into()),
        model: tiny.clone(),
        engine: engine_options(),
        cluster: cluster.clone(),
        auth: auth.clone(),
        ..Default::default()
    };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let prefill_config = PrefillConfig {
        listen: prefill,
        worker: worker("prefill-p"),
        ..Default::default()
    };
    for (listen, id) in [(decode_a, "decode-a"), (decode_b, "decode-b")] {
        let config = DecodeConfig {
            listen,
            worker: worker(id),
            ..Default::default()
        };
        spawn_decode(&runtime, config);
    }
    let front = RouterConfig {
        listen: router,
        http_listen: Some(http_addr),
        only_decode_worker: Some("decode-b".into()),
        model: tiny.clone(),
        cluster: cluster.clone(),
        // Every prompt is planned on the prefill pool while its worker is routable: no prompt is
        // short enough to prefill locally, and the pool never counts as saturated (under a loaded
        // test machine the router's estimates could otherwise prefer the decode worker).
        routing: RoutingOptions {
            local_prefill_threshold: 0,
            prefill_saturation_factor: 0.0,
            ..Default::default()
        },
        auth: auth.clone(),
        ..Default::default()
    };
    spawn_prefill(&runtime, prefill_config);
    spawn_router(&runtime, front);
    // Ready once its decode worker and the prefill worker are routable; the other decode worker
    // is not its to route to.
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        if std::net::TcpStream::connect(http_addr).is_ok() {
            let (_, body) = http(http_addr, "GET", "/health", None, "");
            let health: serde_json::Value = serde_json::from_str(&body).unwrap();
            // Ready, and its decode worker accepts the prefill worker (the decode worker's
            // membership can lag the front's).
            if health["status"] == "ready"
                && health["prefill_workers_up"] == 1
                && health["refused_prefill"] == serde_json::json!([])
            {
                assert_eq!(health["decode_workers_up"], 1, "{health}");
                break;
            }
        }
        assert!(Instant::now() < until, "the front never became ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|p| (0..40).map(|i| 3 + (i * 37 + p * 101) % 370).collect())
        .collect();
    let want = reference(&tiny_model(), &prompts, 6);
    for (prompt, want) in prompts.iter().zip(&want) {
        let (ids, _, last) = runtime
            .block_on(generate(router, greedy_request(prompt, 6)))
            .expect("the front serves the request");
        assert_eq!(&ids, want);
        assert!(
            !last.timings.unwrap().prefill_local,
            "the prompt was prefilled on the prefill pool"
        );
    }
    // The gateway's path: OpenAI HTTP.
    let (status, body) = http(
        http_addr,
        "POST",
        "/v1/completions",
        None,
        r#"{"model": "tiny-llama", "prompt": "the front of a decode pod", "max_tokens": 4}"#,
    );
    assert_eq!(status, 200, "{body}");
    let served = |addr: SocketAddr| {
        let stats = runtime.block_on(async {
            let channel = duet_proto::channel(
                &addr.to_string(),
                &duet_proto::PeerAuth {
                    token: auth.token().unwrap(),
                    tls: None,
                },
            )
            .unwrap();
            duet_proto::v1::worker_control_client::WorkerControlClient::new(channel)
                .stats(duet_proto::v1::StatsRequest {})
                .await
                .unwrap()
                .into_inner()
        });
        (stats.requests_served, stats.transfer_bytes_out)
    };
    assert_eq!(
        served(decode_b).0,
        5,
        "every request decoded on the front's worker"
    );
    assert_eq!(served(decode_a).0, 0, "none on the other decode worker");
    assert!(
        served(prefill).1 > 0,
        "the prefill worker pushed the prompts' KV"
    );
}
