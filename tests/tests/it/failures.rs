//! Failures a cluster must survive: a cancelled stream frees KV on both workers; a prefill worker
//! killed mid-request (separate processes) is replaced by the next one or by local prefill
//! without a hang; bad input through the whole cluster leaves it serving.

use std::time::{Duration, Instant};

use duet_proto::v1;
use duet_tests::*;
use futures::StreamExt;

/// On the default model: the tiny one generates its whole context in a few milliseconds, so the
/// request could end before the test looks at it running.
#[test]
fn cancelling_a_stream_frees_its_blocks_on_both_workers() {
    let model = checkout_default_model();
    let c = cluster(model, 1, 1, local_prefill_threshold(0));
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let prompt: Vec<u32> = (0..70u32).map(|i| 3 + (i * 11) % 370).collect();
        let mut client = client(c.router).await;
        let mut req = greedy_request(&prompt, 1000);
        req.ignore_eos = true;
        let mut stream = client.generate(req).await.unwrap().into_inner();
        stream.next().await.unwrap().unwrap();
        let during = worker_stats(&c, c.decode[0]).await;
        assert!(
            during.kv_blocks_used > 0,
            "the request holds decode blocks while it runs"
        );
        drop(stream);
        wait_until_blocks_freed(&c, c.decode[0], c.prefill[0], Duration::from_secs(10)).await;
    });
}

#[test]
fn bad_input_through_the_cluster_is_rejected_and_it_keeps_serving() {
    let c = cluster(tiny_model(), 1, 1, RoutingOptions::default());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut client = client(c.router).await;
        let cases: Vec<(v1::GenerateRequest, &str)> = vec![
            (v1::GenerateRequest::default(), "empty"),
            (
                v1::GenerateRequest {
                    token_ids: vec![1, 99_999],
                    ..Default::default()
                },
                "vocabulary",
            ),
            (
                v1::GenerateRequest {
                    prompt: "hi".into(),
                    max_tokens: Some(0),
                    ..Default::default()
                },
                "max_tokens",
            ),
            (
                v1::GenerateRequest {
                    prompt: "hi".into(),
                    temperature: Some(-1.0),
                    ..Default::default()
                },
                "temperature",
            ),
            (
                v1::GenerateRequest {
                    prompt: "hi".into(),
                    top_p: Some(1.5),
                    ..Default::default()
                },
                "top_p",
            ),
            (
                v1::GenerateRequest {
                    prompt: "hi".into(),
                    top_k: -2,
                    ..Default::default()
                },
                "top_k",
            ),
            (
                v1::GenerateRequest {
                    prompt: "hi".into(),
                    stop: vec!["x".into(); 17],
                    ..Default::default()
                },
                "stop",
            ),
            (
                v1::GenerateRequest {
                    messages: vec![v1::ChatMessage {
                        role: "wizard".into(),
                        content: "hi".into(),
                        ..Default::default()
                    }],
                    ..Default::default()
                },
                "role",
            ),
            (
                v1::GenerateRequest {
                    token_ids: vec![5; 300],
                    ..Default::default()
                },
                "context",
            ),
        ];
        for (req, word) in cases {
            let err = client.complete(req).await.expect_err(word);
            assert_eq!(err.code(), tonic::Code::InvalidArgument, "{word}: {err}");
            assert!(
                err.message().to_lowercase().contains(word),
                "{word}: {}",
                err.message()
            );
        }
        let ok = client
            .complete(greedy_request(&[1, 17, 250, 3], 3))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(ok.token_ids.len(), 3);
    });
}

#[test]
fn a_prefill_worker_killed_mid_request_is_survived() {
    let model = checkout_default_model();
    let spec = ClusterSpec {
        processes: true,
        bin_dir: Some(bin_dir()),
        ..spec(model.clone(), 2, 1, local_prefill_threshold(0))
    };
    let mut c = Cluster::start(&spec).unwrap();
    // A long prompt keeps the prefill worker busy for a while.
    let prompt: Vec<u32> = (0..1000u32).map(|i| 300 + (i * 7919) % 40_000).collect();
    let want = reference(&model, std::slice::from_ref(&prompt), 8).remove(0);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let router = c.router;
    let pending = rt.spawn(async move { generate(router, greedy_request(&prompt, 8)).await });
    // Kill whichever prefill worker is computing: both, one after the other, then the request
    // must still complete (through the second worker or locally on the decode worker).
    std::thread::sleep(Duration::from_millis(400));
    c.kill_process(0).unwrap();
    std::thread::sleep(Duration::from_millis(400));
    c.kill_process(1).unwrap();
    let started = Instant::now();
    let (ids, _, last) = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(120), pending).await })
        .expect("no hang")
        .unwrap()
        .unwrap();
    assert_eq!(ids, want);
    let t = last.timings.unwrap();
    assert!(
        t.prefill_local,
        "with every prefill worker gone the prompt is computed locally: {t:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(120));
    // And a new request still completes, locally.
    let (ids, _, _) = rt
        .block_on(generate(
            c.router,
            greedy_request(&[1, 504, 3575, 282, 4649, 314], 4),
        ))
        .unwrap();
    assert_eq!(ids.len(), 4);
}
