//! Cache-aware routing on a whole cluster on loopback (2 prefill + 2 decode workers): the
//! router's index follows the workers' KV events, a prompt goes where its prefix is cached and
//! reports it, a follow-up sent at once finds the prefix the router just placed, a burst sharing
//! a fresh prompt lands where it is computed while unrelated prompts spread over idle prefill
//! workers, lost events are repaired by a replay, and a new router rebuilds its index from the
//! workers' snapshots.

use std::time::{Duration, Instant};

use duet_proto::v1;
use duet_router::routing::Pools;
use duet_router::{RouterConfig, RoutingOptions};
use duet_routing::RoutingPolicy;
use duet_tests::*;

const BLOCK: usize = 16;

/// A prompt of `n` tokens from `seed` (ids inside the tiny model's vocabulary of 384).
fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|j| 3 + (j * 31 + seed * 101) % 370)
        .collect()
}

fn routing() -> RoutingOptions {
    RoutingOptions {
        routing: RoutingPolicy::CacheAware,
        // Always through a prefill worker: these tests are about where a prompt is prefilled,
        // not about the decode workers taking over a busy pool (saturation), which tests run in
        // parallel on two cores would make of stale queue reports.
        local_prefill_threshold: 0,
        prefill_saturation_factor: 0.0,
        ..Default::default()
    }
}

async fn routing_stats(router: std::net::SocketAddr) -> v1::RoutingStats {
    client(router)
        .await
        .info(v1::InfoRequest {})
        .await
        .unwrap()
        .into_inner()
        .routing
        .expect("Info carries the routing stats")
}

/// Waits until `f` holds, for at most `secs`.
async fn until<T>(secs: u64, what: &str, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[test]
fn the_same_prefix_lands_where_it_is_cached_and_reports_it() {
    let c = cluster(tiny_model(), 2, 2, routing());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let shared = prompt(1, 160);
        let mut first_prompt = shared.clone();
        first_prompt.extend(prompt(2, 40));
        let mut second_prompt = shared.clone();
        second_prompt.extend(prompt(3, 40));
        // The cluster's readiness probe was routed already.
        let before = routing_stats(c.router).await;
        let (_, _, first) = generate(c.router, greedy_request(&first_prompt, 4))
            .await
            .unwrap();
        let first_t = first.timings.unwrap();
        assert!(!first_t.prefill_local);
        assert_eq!(first.usage.unwrap().cached_prompt_tokens, 0);
        // The prefill and the decode worker both announced the prompt's 12 full blocks.
        until(10, "the index to hold the first prompt", async || {
            (routing_stats(c.router).await.indexed_blocks >= 2 * 12).then_some(())
        })
        .await;
        // And the router's stats to show the first request gone from its decode worker: with
        // the workers otherwise alike, the cost of moving KV then decides the decode worker.
        until(10, "stats without the first request", async || {
            let info = client(c.router)
                .await
                .info(v1::InfoRequest {})
                .await
                .ok()?
                .into_inner();
            info.decode_workers
                .iter()
                .all(|w| w.running_sequences == 0)
                .then_some(())
        })
        .await;
        // The router counts the first request on its decode worker until its relay ends, just
        // after the client's last message (a penalty of a running sequence); and the stats poll
        // after that shows the worker's blocks released.
        tokio::time::sleep(Duration::from_millis(600)).await;
        let (_, _, second) = generate(c.router, greedy_request(&second_prompt, 4))
            .await
            .unwrap();
        let second_t = second.timings.unwrap();
        assert_eq!(second_t.prefill_worker, first_t.prefill_worker);
        assert_eq!(second_t.decode_worker, first_t.decode_worker);
        let cached = second.usage.unwrap().cached_prompt_tokens as usize;
        assert_eq!(
            cached,
            shared.len() / BLOCK * BLOCK,
            "the shared prefix is reported cached"
        );
        let s = routing_stats(c.router).await;
        assert_eq!(s.policy, "cache-aware");
        assert_eq!(s.decisions["remote"] - before.decisions["remote"], 2);
        let predicted = s.predicted_cached_tokens - before.predicted_cached_tokens;
        let actual = s.actual_cached_tokens - before.actual_cached_tokens;
        assert_eq!((predicted, actual), (cached as u64, cached as u64));
    });
}

/// The default model: its context holds the long prompts below (the tiny one's holds 256).
fn long_context_model() -> std::path::PathBuf {
    checkout_default_model()
}

/// A request sent the moment the previous one with the same prompt returned, before the
/// prefill worker's KV events can have reached the router, still goes to the worker that holds
/// the prompt and finds it cached: the router counted the placement at once.
#[test]
fn a_follow_up_sent_at_once_finds_the_prefix_it_just_placed() {
    let c = cluster(long_context_model(), 2, 2, routing());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        for round in 0..3 {
            let shared = prompt(100 + round, 600);
            let mut follow_up = shared.clone();
            follow_up.extend(prompt(200 + round, 8));
            let (_, _, first) = generate(c.router, greedy_request(&shared, 1))
                .await
                .unwrap();
            let (_, _, second) = generate(c.router, greedy_request(&follow_up, 1))
                .await
                .unwrap();
            let (first_t, second_t) = (first.timings.unwrap(), second.timings.unwrap());
            assert!(
                !first_t.prefill_local && !second_t.prefill_local,
                "round {round}: {first_t:?} {second_t:?}; decisions {:?}",
                routing_stats(c.router).await.decisions
            );
            assert_eq!(
                second_t.prefill_worker, first_t.prefill_worker,
                "round {round}: the follow-up went where its prefix was just computed"
            );
            assert_eq!(
                second.usage.unwrap().cached_prompt_tokens as usize,
                shared.len() / BLOCK * BLOCK,
                "round {round}: the follow-up found the prefix cached"
            );
        }
    });
}

/// Agentic fan-out: 8 calls at once sharing a fresh 1,000-token system prompt, each with its
/// own question, land on one prefill worker (which computes the prompt once), while 4
/// unrelated prompts of the same length sent at once still spread over both.
#[test]
fn a_burst_sharing_a_fresh_prompt_lands_where_it_is_computed() {
    let c = cluster(long_context_model(), 2, 2, routing());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let prefill_workers = |prompts: Vec<Vec<u32>>| async move {
        let calls = prompts
            .iter()
            .map(|p| generate(c.router, greedy_request(p, 1)))
            .collect::<Vec<_>>();
        futures::future::join_all(calls)
            .await
            .into_iter()
            .map(|r| r.unwrap().2.timings.unwrap())
            .inspect(|t| assert!(!t.prefill_local, "{t:?}"))
            .map(|t| t.prefill_worker)
            .collect::<Vec<String>>()
    };
    rt.block_on(async {
        let system = prompt(300, 1000);
        let burst = (0..8u32)
            .map(|i| {
                let mut p = system.clone();
                p.extend(prompt(400 + i, 12));
                p
            })
            .collect();
        let used = prefill_workers(burst).await;
        let most = used
            .iter()
            .map(|w| used.iter().filter(|u| *u == w).count())
            .max()
            .unwrap();
        assert!(most >= 7, "at least 7 of 8 on one prefill worker: {used:?}");
        let unrelated = (0..4u32).map(|i| prompt(500 + i, 1000)).collect();
        let mut used = prefill_workers(unrelated).await;
        used.sort();
        used.dedup();
        assert_eq!(used.len(), 2, "unrelated prompts spread: {used:?}");
    });
}

#[test]
fn lost_events_are_replayed_and_a_new_router_rebuilds_from_snapshots() {
    let c = cluster(tiny_model(), 2, 2, routing());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // A second view of the same workers, with the test hook at hand.
        let pools = Pools::new(
            &c.decode.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
            &c.prefill.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
            duet_proto::PeerAuth {
                token: Some(c.token.clone()),
                tls: None,
            },
            routing().params(),
        )
        .unwrap();
        pools.start_polling(Duration::from_millis(100));
        let counters = &pools.index.counters;
        until(10, "a snapshot from every worker", async || {
            (counters
                .snapshots
                .load(std::sync::atomic::Ordering::Relaxed)
                >= 4)
                .then_some(())
        })
        .await;
        pools.index.drop_next_events(3);
        generate(c.router, greedy_request(&prompt(20, 200), 4))
            .await
            .unwrap();
        let indexed = until(10, "the router's index to settle", async || {
            let n = routing_stats(c.router).await.indexed_blocks;
            (n >= 2 * 12).then_some(n)
        })
        .await;
        until(10, "the lost events to be replayed", async || {
            (pools.index.total_blocks() as u64 == indexed).then_some(())
        })
        .await;
        use std::sync::atomic::Ordering::Relaxed;
        assert!(
            counters.gaps.load(Relaxed) >= 1,
            "the loss was seen as a gap"
        );
        assert_eq!(
            counters.snapshots.load(Relaxed),
            4,
            "repaired by a replay, no snapshot"
        );

        // A router started now knows nothing yet: it rebuilds from the workers' snapshots.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let config = RouterConfig {
            listen: addr,
            prefill: c.prefill.iter().map(|a| a.to_string()).collect(),
            decode: c.decode.iter().map(|a| a.to_string()).collect(),
            cluster: duet_cluster::ClusterArgs {
                cluster: "kv-routing-second-router".into(),
                ..Default::default()
            },
            model: duet_model::model_path::ModelArgs {
                model: Some(tiny_model()),
                ..Default::default()
            },
            routing: routing(),
            auth: duet_proto::ClusterAuth::with_token(c.token.clone()),
            ..Default::default()
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(duet_router::serve(config, listener, async {
            let _ = stopped.await;
        }));
        // The two workers without blocks answer with empty snapshots, which may come last:
        // the index is whole only once all four have been taken.
        until(20, "four snapshots in the new router", async || {
            let s = tokio::time::timeout(Duration::from_secs(1), async {
                let mut c =
                    v1::generation_client::GenerationClient::connect(format!("http://{addr}"))
                        .await
                        .ok()?;
                c.info(v1::InfoRequest {}).await.ok()?.into_inner().routing
            })
            .await
            .ok()??;
            (s.kv_snapshots >= 4 && s.indexed_blocks == indexed).then_some(())
        })
        .await;
        drop(stop);
    });
}
