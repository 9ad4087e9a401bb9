//! The cluster token: every internal RPC of a running cluster refuses a caller without it, or
//! with a wrong one, with UNAUTHENTICATED and an error that says nothing about the model, while
//! health checks, reflection and the public API stay open and the cluster itself serves.

use std::net::SocketAddr;

use duet_proto::{ClusterToken, v1};
use duet_tests::*;
use tonic::{Code, Status};

/// Every internal RPC of the workers, called through a channel carrying `token`; the status
/// each one was answered with (`Ok` when the call got past authentication).
async fn internal_calls(
    c: &Cluster,
    token: Option<ClusterToken>,
) -> Vec<(&'static str, Result<(), Status>)> {
    let auth = duet_proto::PeerAuth { token, tls: None };
    let ch = |addr: SocketAddr| duet_proto::channel(&addr.to_string(), &auth).unwrap();
    let (decode, prefill) = (ch(c.decode[0]), ch(c.prefill[0]));
    let decode_call = v1::decode_worker_client::DecodeWorkerClient::new(decode.clone())
        .decode(v1::DecodeRequest {
            request_id: "forged".into(),
            prompt_token_ids: vec![1, 2, 3],
            sampling: Some(v1::SamplingParams {
                max_tokens: 1,
                top_p: 1.0,
                ..Default::default()
            }),
            plan: Some(v1::PrefillPlan {
                local: true,
                prefill_workers: vec![],
            }),
            ..Default::default()
        })
        .await
        .map(drop);
    let prefill_call = v1::prefill_worker_client::PrefillWorkerClient::new(prefill.clone())
        .prefill(v1::PrefillRequest {
            request_id: "forged".into(),
            token_ids: vec![1, 2, 3],
            model_fingerprint: "a guess".into(),
            ..Default::default()
        })
        .await
        .map(drop);
    let header = v1::KvChunk {
        kind: Some(v1::kv_chunk::Kind::Header(v1::KvHeader {
            reservation_id: vec![0; 16],
            model_fingerprint: "a guess".into(),
            ..Default::default()
        })),
    };
    let push_call = v1::kv_transfer_client::KvTransferClient::new(decode.clone())
        .push(futures::stream::iter([header]))
        .await
        .map(drop);
    let mut calls = vec![
        ("Decode", decode_call),
        ("Prefill", prefill_call),
        ("KvTransfer/Push", push_call),
    ];
    for (name, channel) in [("Stats (decode)", decode), ("Stats (prefill)", prefill)] {
        let stats = v1::worker_control_client::WorkerControlClient::new(channel)
            .stats(v1::StatsRequest {})
            .await
            .map(drop);
        calls.push((name, stats));
    }
    calls
}

#[test]
fn internal_calls_without_the_cluster_token_are_refused_and_learn_nothing() {
    let c = cluster(tiny_model(), 1, 1, RoutingOptions::default());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let fingerprint = worker_stats(&c, c.decode[0]).await.model_fingerprint;
        let wrong: ClusterToken = "not-the-cluster-token".parse().unwrap();
        for token in [None, Some(wrong)] {
            for (call, result) in internal_calls(&c, token.clone()).await {
                let status = result.expect_err(call);
                assert_eq!(status.code(), Code::Unauthenticated, "{call}: {status:?}");
                let message = status.message();
                assert!(
                    !message.contains(&fingerprint) && !message.contains("head"),
                    "{call} tells an unauthenticated caller about the model: {message}"
                );
            }
        }
        // With the token the same forged calls reach the workers, which answer on their own.
        for (call, result) in internal_calls(&c, Some(c.token.clone())).await {
            if let Err(status) = result {
                assert_ne!(status.code(), Code::Unauthenticated, "{call}: {status:?}");
            }
        }
        // Health stays open to anyone, and the public API serves through the workers.
        for worker in [c.decode[0], c.prefill[0]] {
            let channel = duet_proto::channel(&worker.to_string(), &Default::default()).unwrap();
            let health = tonic_health::pb::health_client::HealthClient::new(channel)
                .check(tonic_health::pb::HealthCheckRequest::default())
                .await;
            assert!(health.is_ok(), "{health:?}");
        }
        let (ids, _, _) = generate(c.router, greedy_request(&[1, 2, 3, 4], 3))
            .await
            .unwrap();
        assert_eq!(ids.len(), 3);
    });
}
