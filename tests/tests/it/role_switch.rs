//! A worker whose role can switch (`--role-switch on`) is switched from decode to prefill and
//! back while requests stream through the cluster: none fails, and the router routes by the new
//! role (as a prefill worker it computes prompts and pushes their KV to the other decode worker;
//! back in the decode role it serves requests again). The switch is an internal RPC: a caller
//! without the cluster token, or with another, is refused.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use duet_decode_worker::RoleSwitchArgs;
use duet_engine::device::Switch;
use duet_proto::{ClusterToken, v1};
use duet_tests::*;
use tonic::Code;

async fn switch_role(
    worker: SocketAddr,
    token: Option<ClusterToken>,
    role: v1::WorkerRole,
) -> Result<v1::SwitchRoleResponse, tonic::Status> {
    let auth = duet_proto::PeerAuth { token, tls: None };
    let channel = duet_proto::channel(&worker.to_string(), &auth).unwrap();
    v1::worker_admin_client::WorkerAdminClient::new(channel)
        .switch_role(v1::SwitchRoleRequest { role: role.into() })
        .await
        .map(tonic::Response::into_inner)
}

/// Waits up to 30 s for the worker's stats to satisfy `done`.
async fn until_stats(
    cluster: &Cluster,
    worker: SocketAddr,
    what: &str,
    done: impl Fn(&v1::StatsResponse) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let stats = worker_stats(cluster, worker).await;
        if done(&stats) {
            return;
        }
        assert!(Instant::now() < deadline, "never {what}: {stats:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[test]
fn a_worker_switches_role_under_load_and_no_request_fails() {
    // Two decode workers whose roles can switch, no prefill worker; every prompt is prefilled
    // on a prefill worker while one is routable (threshold 0, never saturated: the tiny model
    // prefills faster on a decode worker than the router's prior for a new prefill worker).
    let routing = RoutingOptions {
        local_prefill_threshold: 0,
        prefill_saturation_factor: 0.0,
        ..Default::default()
    };
    let mut spec = spec(tiny_model(), 0, 2, routing);
    spec.decode.role_switch = RoleSwitchArgs {
        role_switch: Switch::On,
        ..Default::default()
    };
    let cluster = Cluster::start(&spec).expect("starting the cluster");
    let (router, switched) = (cluster.router, cluster.decode[1]);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let stop = Arc::new(AtomicBool::new(false));
        let clients: Vec<_> = (0..3u32)
            .map(|client| {
                let stop = stop.clone();
                tokio::spawn(async move {
                    let mut served = 0u32;
                    while !stop.load(Ordering::Relaxed) {
                        // Every prompt's first block its own (client and count in its first
                        // tokens): no prefix is cached anywhere, so where a prompt is prefilled
                        // is the router's plan alone, however many requests ran before.
                        let prompt: Vec<u32> = [3 + client, 3 + served % 300, 3 + served / 300]
                            .into_iter()
                            .chain(
                                (3..48u32).map(|t| 1 + (t * 7 + client * 13 + served * 31) % 200),
                            )
                            .collect();
                        let (ids, _, _) = generate(
                            router,
                            v1::GenerateRequest {
                                ignore_eos: true,
                                ..greedy_request(&prompt, 12)
                            },
                        )
                        .await
                        .unwrap_or_else(|e| panic!("request {served} of client {client}: {e}"));
                        assert_eq!(ids.len(), 12);
                        served += 1;
                    }
                    served
                })
            })
            .collect();
        until_stats(&cluster, switched, "served as a decode worker", |s| {
            s.requests_served > 0
        })
        .await;

        let done = switch_role(
            switched,
            Some(cluster.token.clone()),
            v1::WorkerRole::Prefill,
        )
        .await
        .expect("switching to prefill");
        assert_eq!(
            (done.previous(), done.role()),
            (v1::WorkerRole::Decode, v1::WorkerRole::Prefill)
        );
        let stats = worker_stats(&cluster, switched).await;
        assert_eq!(stats.role(), v1::WorkerRole::Prefill);
        // Routed by its new role: the router plans prompts on it, and it pushes their KV to the
        // other decode worker.
        let pushed = stats.transfer_bytes_out;
        until_stats(&cluster, switched, "pushed KV as a prefill worker", |s| {
            s.transfer_bytes_out > pushed
        })
        .await;
        until_stats(&cluster, cluster.decode[0], "received KV", |s| {
            s.transfer_bytes_in > 0
        })
        .await;

        let done = switch_role(
            switched,
            Some(cluster.token.clone()),
            v1::WorkerRole::Decode,
        )
        .await
        .expect("switching back to decode");
        assert_eq!(done.role(), v1::WorkerRole::Decode);
        let received = worker_stats(&cluster, switched).await.transfer_bytes_in;
        let other_pushed = worker_stats(&cluster, cluster.decode[0])
            .await
            .transfer_bytes_out;
        // A decode worker again: requests reach it, prefilled on it (no prefill worker is left).
        let served = worker_stats(&cluster, switched).await.requests_served;
        until_stats(&cluster, switched, "served as a decode worker again", |s| {
            s.requests_served > served && s.role() == v1::WorkerRole::Decode
        })
        .await;
        assert_eq!(
            worker_stats(&cluster, switched).await.transfer_bytes_in,
            received,
            "no KV pushed to it: nobody is a prefill worker now"
        );
        assert_eq!(
            worker_stats(&cluster, cluster.decode[0])
                .await
                .transfer_bytes_out,
            other_pushed
        );

        stop.store(true, Ordering::Relaxed);
        for client in clients {
            assert!(client.await.expect("no request failed") > 0);
        }

        // From outside the cluster: no token, or another, is refused before anything drains.
        for token in [None, Some(ClusterToken::random())] {
            let refused = switch_role(switched, token, v1::WorkerRole::Prefill)
                .await
                .expect_err("a call without the cluster token is refused");
            assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
        }
        assert_eq!(
            worker_stats(&cluster, switched).await.role(),
            v1::WorkerRole::Decode
        );
        let unspecified = switch_role(
            switched,
            Some(cluster.token.clone()),
            v1::WorkerRole::Unspecified,
        )
        .await
        .expect_err("no role named");
        assert_eq!(unspecified.code(), Code::InvalidArgument);
    });
}
