//! Tiers below the KV pool on a whole cluster on loopback (the tiny fixture): a reused prefix
//! evicted from a decode worker's pool moves to its disk tier and is brought back up instead of
//! computed, with the engine's tokens; a corrupt tier file is a miss, counted, never served. A
//! prefix another decode worker holds is pulled instead of computed, with the engine's tokens;
//! a pull that cannot be served is computed instead, counted, and fails nothing.

use std::net::SocketAddr;
use std::path::Path;

use duet_decode_worker::PeerPullArgs;
use duet_engine::device::Switch;
use duet_engine::kv_tiers::KvTierOptions;
use duet_proto::v1;
use duet_tests::*;
use futures::StreamExt;

/// A prompt of `n` tokens from `seed` (ids inside the tiny model's vocabulary of 384).
fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|j| 3 + (j * 31 + seed * 101) % 370)
        .collect()
}

fn disk_tier(stats: &v1::StatsResponse) -> v1::KvTierStats {
    stats
        .kv_tiers
        .iter()
        .find(|t| t.tier == v1::KvTier::Disk as i32)
        .cloned()
        .expect("the decode worker reports its disk tier")
}

/// Flips a byte in the middle of every block file under `dir`; how many.
fn corrupt_files(dir: &Path) -> usize {
    let mut n = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            n += corrupt_files(&path);
        } else if path.extension().is_some_and(|e| e == "kvb") {
            let mut bytes = std::fs::read(&path).unwrap();
            let mid = bytes.len() / 2;
            bytes[mid] ^= 0x40;
            std::fs::write(&path, bytes).unwrap();
            n += 1;
        }
    }
    n
}

#[test]
fn a_prefix_evicted_to_disk_comes_back_up_and_a_corrupt_file_is_a_miss() {
    let dir = tempfile::tempdir().unwrap();
    // One decode worker prefilling everything itself, with a pool of 4 blocks of 16 tokens and
    // a disk tier below it.
    let mut spec = spec(tiny_model(), 0, 1, local_prefill_threshold(100_000));
    spec.decode.worker.engine.kv_cache_tokens = 64;
    spec.decode.worker.engine.kv_tiers = KvTierOptions {
        kv_disk_dir: Some(dir.path().to_path_buf()),
        ..Default::default()
    };
    let c = Cluster::start(&spec).unwrap();
    // p holds 2 full blocks to reuse; q (4 blocks with its answer) takes the whole pool.
    let (p, q) = (prompt(1, 40), prompt(2, 56));
    let want = reference(&tiny_model(), std::slice::from_ref(&p), 8).remove(0);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let run = |prompt: &[u32]| {
        let (ids, _, last) = rt
            .block_on(generate(c.router, greedy_request(prompt, 8)))
            .unwrap();
        (ids, last.usage.unwrap().cached_prompt_tokens)
    };
    let stats = || rt.block_on(worker_stats(&c, c.decode[0]));
    assert_eq!(run(&p), (want.clone(), 0));
    // Found again in the pool: reused, so its blocks move down when evicted.
    assert_eq!(run(&p), (want.clone(), 32));
    run(&q);
    assert_eq!(disk_tier(&stats()).stored, 2, "p's blocks moved down");
    assert_eq!(
        run(&p),
        (want.clone(), 32),
        "brought back up from disk instead of computed"
    );
    let disk = disk_tier(&stats());
    assert_eq!((disk.hits, disk.corrupt), (2, 0), "{disk:?}");
    // Every file damaged. Evicted again, p's blocks keep their copies on disk as they are.
    assert!(corrupt_files(dir.path()) >= 2);
    run(&q);
    let (ids, cached) = run(&p);
    assert_eq!(ids, want, "a corrupt file is never served");
    assert_eq!(cached, 0, "a corrupt file is a miss");
    let disk = disk_tier(&stats());
    assert!(disk.corrupt >= 1, "{disk:?}");
}

/// A greedy Decode of `prompt` (6 tokens) prefilled on the decode worker at `worker` itself,
/// pulling from `pull`: its tokens, and the prompt tokens it found cached.
async fn decode(
    c: &Cluster,
    worker: SocketAddr,
    prompt: Vec<u32>,
    pull: Option<v1::KvPullSource>,
) -> (Vec<u32>, u32) {
    let auth = duet_proto::PeerAuth {
        token: Some(c.token.clone()),
        tls: None,
    };
    let channel = duet_proto::channel(&worker.to_string(), &auth).unwrap();
    let request = v1::DecodeRequest {
        request_id: "kv-tiers-test".into(),
        prompt_token_ids: prompt,
        sampling: Some(v1::SamplingParams {
            max_tokens: 6,
            ..Default::default()
        }),
        plan: Some(v1::PrefillPlan {
            local: true,
            prefill_workers: Vec::new(),
        }),
        pull,
        ..Default::default()
    };
    let mut stream = v1::decode_worker_client::DecodeWorkerClient::new(channel)
        .decode(request)
        .await
        .unwrap()
        .into_inner();
    let (mut ids, mut cached) = (Vec::new(), 0);
    while let Some(msg) = stream.next().await {
        let msg = msg.unwrap();
        ids.extend(msg.token_ids);
        if let Some(u) = msg.usage {
            cached = u.cached_prompt_tokens;
        }
    }
    (ids, cached)
}

#[test]
fn a_prefix_is_pulled_from_a_peer_and_a_pull_that_cannot_be_served_is_computed() {
    let mut spec = spec(tiny_model(), 0, 2, local_prefill_threshold(100_000));
    // Asking for CUDA IPC changes nothing between CPU workers: they offer gRPC only.
    spec.decode.peer_pull = PeerPullArgs {
        kv_peer_pull: Switch::On,
        kv_peer_pull_cuda_ipc: Switch::On,
    };
    let c = Cluster::start(&spec).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (a, b) = (c.decode[0], c.decode[1]);
    let holder = rt.block_on(worker_stats(&c, a)).worker_id;
    // 4 blocks of prefix, then a question.
    let (prefix, question) = (prompt(1, 64), prompt(2, 8));
    let asked = [prefix.clone(), question.clone()].concat();
    let unheld = [prompt(3, 64), question.clone()].concat();
    let stray = [prompt(4, 64), question].concat();
    let want = reference(
        &tiny_model(),
        &[asked.clone(), unheld.clone(), stray.clone()],
        6,
    );
    // A computes the prefix (with another question).
    rt.block_on(decode(&c, a, [prefix, prompt(5, 8)].concat(), None));
    let source = v1::KvPullSource {
        worker_id: holder,
        address: a.to_string(),
        blocks: 4,
    };
    let (ids, cached) = rt.block_on(decode(&c, b, asked, Some(source.clone())));
    assert_eq!(ids, want[0], "a pulled prefix gives the engine's tokens");
    assert_eq!(cached, 64, "the prefix was pulled, not computed");
    // A prefix A does not hold: the pull misses, and B computes it.
    let (ids, cached) = rt.block_on(decode(&c, b, unheld, Some(source)));
    assert_eq!((ids, cached), (want[1].clone(), 0));
    // A peer that is not a decode worker of the cluster is never called.
    let stranger = v1::KvPullSource {
        worker_id: "stranger".into(),
        address: free_addr().to_string(),
        blocks: 4,
    };
    let (ids, cached) = rt.block_on(decode(&c, b, stray, Some(stranger)));
    assert_eq!((ids, cached), (want[2].clone(), 0));
    let stats = rt.block_on(worker_stats(&c, b));
    let pulls = stats.kv_peer_pulls;
    let count = |o: &str| pulls.get(o).copied().unwrap_or(0);
    assert_eq!(
        (
            count("pulled"),
            count("missing"),
            count("refused"),
            count("failed")
        ),
        (1, 1, 1, 0),
        "{pulls:?}"
    );
    let over_ipc = stats.kv_peer_pulls_cuda_ipc;
    assert!(over_ipc.values().all(|&n| n == 0), "{over_ipc:?}");
}
