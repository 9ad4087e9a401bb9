//! Tiers below the KV pool on a whole cluster on loopback (the tiny fixture): a reused prefix
//! evicted from a decode worker's pool moves to its disk tier and is brought back up instead of
//! computed, with the engine's tokens; a corrupt tier file is a miss, counted, never served.

use std::path::Path;

use duet_engine::kv_tiers::KvTierOptions;
use duet_proto::v1;
use duet_tests::*;

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
