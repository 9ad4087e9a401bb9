//! `duet bench serve --chaos` as a CI script runs it: a disaggregated cluster of separate
//! processes (1 prefill + 2 decode workers, the tiny fixture) under load while a decode worker is
//! killed (and started again), the prefill worker is stopped and resumed, and the other decode
//! worker restarted (SIGTERM: it must finish draining by itself); the report must show all three
//! faults injected, no failed request, no stream differing from its solo greedy run and no
//! KV block held afterwards, and the command must exit 0.

use std::process::{Command, Output};

use duet_tests::*;

fn duet() -> Command {
    Command::new(bin_dir().join("duet"))
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn faults_under_load_lose_no_request_repeat_no_token_and_leak_no_block() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("report.json");
    let out = duet()
        .args([
            "bench",
            "serve",
            "--launch",
            "disaggregated",
            "--processes",
            "--prefill-workers",
            "1",
            "--decode-workers",
            "2",
            // Open loop: the arrivals span ~5 s, so the faults land while requests run.
            "--requests",
            "40",
            "--rate",
            "8",
            "--prompt-tokens",
            "40..80",
            "--output-tokens",
            "100",
            "--chaos",
            "kill:decode0@500ms+500ms,stop:prefill0@1500ms+1s,restart:decode1@3s",
            "--threads",
            "2",
        ])
        .arg("--model")
        .arg(tiny_model())
        .arg("--json-out")
        .arg(&json)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let chaos = &report["runs"][0]["chaos"];
    let injected: Vec<&str> = chaos["faults"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            assert!(f["error"].is_null(), "{f}");
            f["fault"].as_str().unwrap()
        })
        .collect();
    assert_eq!(
        injected,
        // The restart's drain ends by itself (no open KV event subscription holds it).
        [
            "kill:decode0@500ms+500ms",
            "stop:prefill0@1500ms+1s",
            "restart:decode1@3s"
        ],
        "{chaos}"
    );
    assert_eq!(chaos["completed"], 40, "{chaos}");
    assert_eq!(chaos["failed"], serde_json::json!({}), "{chaos}");
    assert_eq!(chaos["differing"], serde_json::json!([]), "{chaos}");
    let workers = chaos["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 3, "{chaos}");
    for w in workers {
        assert!(w["error"].is_null(), "{w}");
        for held in [
            "kv_blocks_used",
            "reservations_outstanding",
            "running_sequences",
        ] {
            assert_eq!(w[held], 0, "{w}");
        }
    }
    // The table a user reads says the same.
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("3 of 3 faults injected")
            && table.contains("completed 40, failed 0, differing streams 0"),
        "{table}"
    );
}

#[test]
fn chaos_needs_launched_processes_and_a_valid_spec() {
    let bench = |extra: &[&str]| {
        duet()
            .args(["bench", "serve", "--launch", "disaggregated"])
            .args(extra)
            .arg("--model")
            .arg(tiny_model())
            .output()
            .unwrap()
    };
    for (extra, why) in [
        (&["--chaos", "kill:decode0@1s"][..], "--processes"),
        (
            &["--processes", "--chaos", "kill:decode0@1"],
            "`kill:decode0@1`: `1`: a duration needs a unit",
        ),
        // A worker the cluster lacks is refused before the load.
        (
            &["--processes", "--chaos", "stop:prefill3@1s+1s"],
            "names prefill3, but the cluster has 1 prefill and 1 decode",
        ),
    ] {
        let out = bench(extra);
        assert!(!out.status.success(), "{extra:?}");
        assert!(stderr(&out).contains(why), "{extra:?}: {}", stderr(&out));
    }
}
