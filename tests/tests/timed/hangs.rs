//! Hung workers and long queues cost bounded time: a SIGSTOPped decode worker's stream goes on
//! elsewhere, a SIGSTOPped prefill worker costs one attempt and, resumed, takes its share of
//! later work again, and a prompt queued behind others keeps its KV reservation. The faults need
//! separate processes (SIGSTOP), except the queue.

use std::time::{Duration, Instant};

use duet_decode_worker::DecodeConfig;
use duet_tests::*;
use duet_worker::WorkerArgs;
use futures::StreamExt;

use crate::one_at_a_time;

/// A prompt of `n` tokens of no particular text (its greedy continuation does not stop early).
fn prompt(n: u32, salt: u32) -> Vec<u32> {
    (0..n)
        .map(|i| 300 + (i * 7919 + salt * 104_729) % 40_000)
        .collect()
}

fn in_processes(spec: ClusterSpec) -> Cluster {
    Cluster::start(&ClusterSpec {
        processes: true,
        bin_dir: Some(bin_dir()),
        ..spec
    })
    .unwrap()
}

#[test]
fn a_sigstopped_decode_workers_stream_continues_on_another() {
    let _alone = one_at_a_time();
    let model = checkout_default_model();
    let idle = Duration::from_millis(2000);
    let c = in_processes(spec(
        model.clone(),
        0,
        2,
        RoutingOptions {
            local_prefill_threshold: 10_000,
            decode_idle_timeout_ms: idle.as_millis() as u64,
            ..Default::default()
        },
    ));
    let p = prompt(120, 1);
    let want = reference(&model, std::slice::from_ref(&p), 48).remove(0);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut client = client(c.router).await;
        let mut stream = client
            .generate(greedy_request(&p, 48))
            .await
            .unwrap()
            .into_inner();
        let mut ids = Vec::new();
        while ids.len() < 4 {
            ids.extend(stream.next().await.unwrap().unwrap().token_ids);
        }
        // Stop whichever decode worker runs the request (process index = prefill count + i).
        let mut stopped = None;
        for (i, &addr) in c.decode.iter().enumerate() {
            if worker_stats(&c, addr).await.running_sequences > 0 {
                c.signal_process(i, "STOP").unwrap();
                stopped = Some(i);
                break;
            }
        }
        let stopped = stopped.expect("a decode worker runs the request");
        let (mut longest_gap, mut last_at, mut last) = (Duration::ZERO, Instant::now(), None);
        let rest = tokio::time::timeout(Duration::from_secs(60), async {
            while let Some(msg) = stream.next().await {
                let msg = msg.unwrap();
                longest_gap = longest_gap.max(last_at.elapsed());
                last_at = Instant::now();
                ids.extend(&msg.token_ids);
                last = Some(msg);
            }
        })
        .await;
        c.signal_process(stopped, "CONT").unwrap();
        rest.expect("the stream went on without its hung worker");
        assert_eq!(ids, want, "no token repeated or lost");
        let t = last.unwrap().timings.unwrap();
        assert_eq!(t.decode_failovers, 1, "{t:?}");
        // Within the idle timeout plus the other worker's prefill of the resumed prompt.
        assert!(
            longest_gap < idle + Duration::from_secs(8),
            "{longest_gap:?}"
        );
    });
}

#[test]
fn a_sigstopped_prefill_worker_costs_at_most_one_attempt() {
    let _alone = one_at_a_time();
    let model = checkout_default_model();
    let c = in_processes(spec(model.clone(), 2, 1, local_prefill_threshold(0)));
    let p = prompt(200, 2);
    let want = reference(&model, std::slice::from_ref(&p), 4).remove(0);
    // Idle prefill workers rank in their order: the first is asked first.
    c.signal_process(0, "STOP").unwrap();
    let deadline = Duration::from_secs(24);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let started = Instant::now();
    let result = rt.block_on(async {
        let mut client = client(c.router).await;
        let mut req = tonic::Request::new(greedy_request(&p, 4));
        req.set_timeout(deadline);
        client.complete(req).await
    });
    let elapsed = started.elapsed();
    c.signal_process(0, "CONT").unwrap();
    let whole = result
        .expect("the next prefill worker's turn came")
        .into_inner();
    assert_eq!(whole.token_ids, want);
    let t = whole.timings.unwrap();
    assert!(!t.prefill_local, "{t:?}");
    // One attempt's share of the deadline (a third: two prefill workers and the local prefill),
    // then the prompt's prefill and four tokens.
    assert!(
        elapsed < deadline / 3 + Duration::from_secs(8),
        "{elapsed:?}"
    );
}

#[test]
fn a_queued_prompts_reservation_does_not_expire() {
    let _alone = one_at_a_time();
    let model = checkout_default_model();
    // Leases far shorter than the prefill queue: every prompt after the first waits longer.
    let c = Cluster::start(&ClusterSpec {
        decode: DecodeConfig {
            reservation_timeout_ms: 200,
            worker: WorkerArgs {
                engine: engine_options(),
                ..Default::default()
            },
            ..Default::default()
        },
        // Every prompt joins the one prefill worker's queue, however long it grows.
        ..spec(
            model.clone(),
            1,
            1,
            RoutingOptions {
                prefill_saturation_factor: 0.0,
                ..local_prefill_threshold(0)
            },
        )
    })
    .unwrap();
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt(600, 10 + i)).collect();
    let want = reference(&model, &prompts, 3);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let router = c.router;
    let answers = rt.block_on(async {
        let calls = prompts.iter().map(|p| {
            let req = greedy_request(p, 3);
            async move { generate(router, req).await }
        });
        futures::future::join_all(calls).await
    });
    for (i, (answer, want)) in answers.into_iter().zip(want).enumerate() {
        let (ids, _, last) = answer.unwrap_or_else(|e| panic!("prompt {i}: {e}"));
        assert_eq!(ids, want, "prompt {i}");
        let t = last.timings.unwrap();
        assert!(
            !t.prefill_local && t.prefill_retries == 0,
            "prompt {i} was prefilled remotely at the first try: {t:?}"
        );
    }
}

/// A prefill worker stopped in the middle of its first prefill measures its prefill rate from
/// that stall. Resumed, it is sent work again (its rate is held to a share of the pool's and
/// decays toward it while nothing renews it), measures itself afresh (the stalled step is
/// outvoted by the next ones), and takes its share of a later burst of long prompts.
#[test]
fn a_prefill_worker_stalled_in_its_first_prefill_takes_its_share_of_a_later_burst() {
    let _alone = one_at_a_time();
    let model = checkout_default_model();
    let c = in_processes(spec(
        model,
        2,
        1,
        RoutingOptions {
            prefill_saturation_factor: 0.0,
            ..local_prefill_threshold(0)
        },
    ));
    let stalled = format!("prefill-{}", c.prefill[0].port());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let router = c.router;
    // Idle prefill workers rank in their order: the first prompt goes to the first worker.
    let first = rt.spawn(async move {
        let mut client = client(router).await;
        let mut req = tonic::Request::new(greedy_request(&prompt(1000, 900), 2));
        req.set_timeout(Duration::from_secs(15));
        client.complete(req).await
    });
    std::thread::sleep(Duration::from_millis(300));
    c.signal_process(0, "STOP").unwrap();
    std::thread::sleep(Duration::from_secs(8));
    c.signal_process(0, "CONT").unwrap();
    let first = rt
        .block_on(first)
        .unwrap()
        .expect("the first prompt is served");
    assert_eq!(first.into_inner().token_ids.len(), 2);
    let mut taken = Vec::new();
    for burst in 0..4u32 {
        let used: Vec<String> = rt.block_on(async {
            let calls = (0..6u32).map(|i| {
                generate(
                    router,
                    greedy_request(&prompt(1000, 1000 + burst * 10 + i), 2),
                )
            });
            futures::future::join_all(calls)
                .await
                .into_iter()
                .map(|r| r.unwrap().2.timings.unwrap().prefill_worker)
                .collect()
        });
        taken.push(used.iter().filter(|w| **w == stalled).count());
    }
    assert!(
        *taken.last().unwrap() >= 2,
        "the resumed worker took {taken:?} of each burst of 6"
    );
}
