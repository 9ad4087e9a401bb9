//! The planner's verbs as a user runs them, on the tiny fixture: `duet profile` measures and
//! fits, `duet simulate` writes the keys `duet bench serve` writes for the same workload (run
//! for real from the trace the simulation wrote), `duet plan` writes Helm values, and bad input
//! is refused naming the line, the field or the flag.

use std::path::{Path, PathBuf};
use std::process::Output;

use crate::duet;

fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama")
}

fn succeeded(out: Output) -> Output {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn failed_saying(out: Output, what: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "succeeded: {stderr}");
    assert!(
        stderr.contains(what),
        "the error does not say {what:?}: {stderr}"
    );
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// A small profile of the tiny fixture with one kernel thread.
fn profile(dir: &Path) -> PathBuf {
    let out = dir.join("profile.json");
    succeeded(
        duet()
            .args(["profile", "--threads", "1", "--prefill-tokens", "16,48"])
            .args(["--cached-fractions", "0,0.5", "--prefill-batch", "2"])
            .args([
                "--decode-batches",
                "1,4",
                "--decode-contexts",
                "16,64",
                "--decode-steps",
                "2",
            ])
            .args(["--transfer-tokens", "16,128", "--repeats", "2"])
            // Long answers: the tiny model's steps are so short that a stream of a few tokens
            // ends before the next one starts.
            .args(["--served-batches", "1,2", "--served-decode-prompt", "16"])
            .args([
                "--served-decode-tokens",
                "200",
                "--served-prompt-tokens",
                "16,48",
            ])
            .arg("--out")
            .arg(&out)
            .arg("--model")
            .arg(tiny())
            .output()
            .unwrap(),
    );
    out
}

#[test]
fn profile_fits_every_form_and_says_how_well() {
    let dir = tempfile::tempdir().unwrap();
    let p = json(&profile(dir.path()));
    assert_eq!(p["model"]["name"], "tiny-llama");
    assert_eq!(p["flags"]["threads"], 1);
    assert_eq!(p["device"]["kind"], "cpu");
    // 2 token counts × 2 cached fractions, and each count split over 2 prompts.
    assert_eq!(p["prefill"]["samples"].as_array().unwrap().len(), 6);
    assert_eq!(p["decode"]["samples"].as_array().unwrap().len(), 4);
    assert_eq!(p["transfer"][0]["transport"], "grpc");
    for form in [&p["prefill"], &p["decode"], &p["transfer"][0]] {
        let e = &form["error"];
        assert!(e["mean_abs_pct"].as_f64().unwrap() >= 0.0, "{form}");
        assert!(e["samples"].as_u64().unwrap() >= 2, "{form}");
    }
    assert!(p["decode"]["fit"]["a_ms"].as_f64().unwrap() > 0.0);
    // Decode steps through a served worker, beside the fit's prediction at the same context.
    let served = p["serving"]["decode"].as_array().unwrap();
    assert_eq!(served.len(), 2, "{served:?}");
    for (s, batch) in served.iter().zip([1, 2]) {
        assert_eq!(s["batch"], batch);
        assert_eq!(s["context"], 16 + 200 / 2);
        assert!(s["served_ms"].as_f64().unwrap() > 0.0, "{s}");
        assert!(s["engine_ms"].as_f64().unwrap() > 0.0, "{s}");
    }
    // Prompts computed by the decode worker and by the prefill worker pushing their KV.
    let prompts = p["serving"]["prefill"].as_array().unwrap();
    assert_eq!(prompts.len(), 2, "{prompts:?}");
    for (s, tokens) in prompts.iter().zip([16, 48]) {
        assert_eq!(s["tokens"], tokens);
        assert!(s["pushed_ms"].as_f64().unwrap() > 0.0, "{s}");
        assert!(s["local_ms"].as_f64().unwrap() > 0.0, "{s}");
    }
    assert!(p["serving"]["prefill_push_factor"].as_f64().unwrap() > 0.0);
    // Each prompt once more beside a decoding stream: both workers' contention.
    let contention = &p["serving"]["contention"];
    for factor in ["prefill_factor", "decode_factor"] {
        assert!(contention[factor].as_f64().unwrap() > 0.0, "{contention}");
    }
}

/// `duet profile` with `args` on the tiny fixture, which must fail without writing a profile:
/// its error.
fn profile_refused(dir: &Path, args: &[&str]) -> String {
    let out = duet()
        .arg("profile")
        .args(args)
        .arg("--out")
        .arg(dir.join("p.json"))
        .arg("--model")
        .arg(tiny())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(!dir.join("p.json").exists());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn profile_refuses_served_batches_out_of_order_before_measuring() {
    let dir = tempfile::tempdir().unwrap();
    let err = profile_refused(dir.path(), &["--served-batches", "4,1"]);
    assert!(err.contains("--served-batches"), "{err}");
    // A served prompt longer than the model's context (256 tokens), refused before measuring.
    let err = profile_refused(dir.path(), &["--served-prompt-tokens", "300"]);
    assert!(
        err.contains("--served-prompt-tokens 300") && err.contains("context of 256"),
        "{err}"
    );
}

#[test]
fn simulate_writes_bench_serves_keys_for_the_same_trace_and_plan_writes_values() {
    let dir = tempfile::tempdir().unwrap();
    let profile = profile(dir.path());
    let (sim, trace) = (dir.path().join("sim.json"), dir.path().join("trace.jsonl"));
    let load = [
        "--threads",
        "1",
        "--rate",
        "8",
        "--prompt-tokens",
        "20..60",
        "--output-tokens",
        "4",
        "--local-prefill-threshold",
        "0",
    ];
    let workload = [&load[..], &["--requests", "24"]].concat();
    let (sim_requests, bench_requests) = (
        dir.path().join("sim-requests.jsonl"),
        dir.path().join("bench-requests.jsonl"),
    );
    let out = succeeded(
        duet()
            .arg("simulate")
            .arg("--profile")
            .arg(&profile)
            .args(&workload)
            .arg("--json-out")
            .arg(&sim)
            .arg("--trace-out")
            .arg(&trace)
            .arg("--requests-out")
            .arg(&sim_requests)
            .output()
            .unwrap(),
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("TTFT p50 as the servers saw it"));
    let sim = json(&sim);
    // The same requests on a device whose compute takes twice the profile's time: slower.
    let slow = dir.path().join("slow.json");
    succeeded(
        duet()
            .arg("simulate")
            .arg("--profile")
            .arg(&profile)
            .args(&workload)
            .args(["--compute-scale", "2", "--json-out"])
            .arg(&slow)
            .output()
            .unwrap(),
    );
    let slow = json(&slow);
    let e2e_p50 = |report: &serde_json::Value| report["runs"][0]["e2e_ms"]["p50"].as_f64().unwrap();
    assert!(e2e_p50(&slow) > e2e_p50(&sim), "{slow}");
    assert!(
        slow["profile"].as_str().unwrap().ends_with("(compute ×2)"),
        "{slow}"
    );
    // The same requests at the same times, through a real cluster.
    let bench = dir.path().join("bench.json");
    succeeded(
        duet()
            .args([
                "bench",
                "serve",
                "--threads",
                "1",
                "--requests",
                "24",
                "--local-prefill-threshold",
                "0",
            ])
            .arg("--trace")
            .arg(&trace)
            .arg("--model")
            .arg(tiny())
            .arg("--json-out")
            .arg(&bench)
            .arg("--requests-out")
            .arg(&bench_requests)
            .output()
            .unwrap(),
    );
    let bench = json(&bench);
    // Request by request: the same prompts at the same times, each with its servers' split.
    let records = |path: &std::path::Path| -> Vec<serde_json::Value> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let (simulated, measured) = (records(&sim_requests), records(&bench_requests));
    assert_eq!(simulated.len(), 48, "24 requests of each design");
    assert_eq!(measured.len(), 48);
    for (s, b) in simulated.iter().zip(&measured) {
        assert_eq!(s["design"], b["design"]);
        assert_eq!(s["prompt_tokens"], b["prompt_tokens"], "{s} / {b}");
        let (at_s, at_b) = (
            s["arrival_s"].as_f64().unwrap(),
            b["arrival_s"].as_f64().unwrap(),
        );
        assert!((at_s - at_b).abs() < 0.5, "{s} / {b}");
        // A colocated worker prefills every prompt itself.
        if s["design"] == "colocated" {
            assert_eq!(s["server_prefill_local"], true, "{s}");
            assert_eq!(b["server_prefill_local"], true, "{b}");
        }
        for key in [
            "ttft_ms",
            "tpot_ms",
            "e2e_ms",
            "server_prefill_ms",
            "server_queue_ms",
        ] {
            assert!(s[key].as_f64().unwrap() >= 0.0, "{key}: {s}");
            assert!(b[key].as_f64().unwrap() >= 0.0, "{key}: {b}");
        }
    }
    for (s, b) in sim["runs"]
        .as_array()
        .unwrap()
        .iter()
        .zip(bench["runs"].as_array().unwrap())
    {
        assert_eq!(s["design"], b["design"]);
        assert_eq!(
            (s["requests"].as_u64(), b["requests"].as_u64()),
            (Some(24), Some(24))
        );
        for key in [
            "failed",
            "duration_s",
            "request_throughput",
            "output_tokens_per_s",
            "ttft_ms",
            "tpot_ms",
            "itl_ms",
            "e2e_ms",
            "server_ttft_ms",
            "slo_attainment",
            "goodput_rps",
            "shed",
            "prefix_hit_rate",
        ] {
            assert!(!s[key].is_null() && !b[key].is_null(), "{key}: {s} / {b}");
        }
        for part in ["queue_ms", "prefill_ms", "transfer_ms", "ttft_ms"] {
            assert!(s["server_ttft_ms"][part]["p50"].is_number(), "{part}");
            assert!(b["server_ttft_ms"][part]["p50"].is_number(), "{part}");
        }
        // Attainment over time: every request in the window it arrived in.
        for run in [s, b] {
            let windows = run["timeline"].as_array().unwrap();
            let counted: u64 = windows
                .iter()
                .map(|w| w["requests"].as_u64().unwrap())
                .sum();
            assert_eq!(counted, 24, "{run}");
            assert_eq!(windows[0]["start_s"], 0.0);
            assert!(
                windows
                    .iter()
                    .all(|w| w["attained"].as_u64() <= w["requests"].as_u64())
            );
        }
    }
    assert_eq!(sim["workload"]["arrivals"]["kind"], "poisson");
    assert_eq!(bench["workload"]["arrivals"]["kind"], "trace");

    let values = dir.path().join("values.yaml");
    let plot = dir.path().join("attainment.svg");
    let out = succeeded(
        duet()
            .args([
                "plan",
                "--devices",
                "2",
                "--iterations",
                "2",
                "--step-tokens",
                "64",
            ])
            // SLOs a burst of the tiny model's requests misses: the search finds a knee.
            .args(["--ttft-slo-ms", "5", "--tpot-slo-ms", "2"])
            .arg("--profile")
            .arg(&profile)
            // Enough requests that a burst of them misses the SLOs below.
            .args(load)
            .args(["--requests", "200"])
            .arg("--values-out")
            .arg(&values)
            .arg("--plot-out")
            .arg(&plot)
            .output()
            .unwrap(),
    );
    let table = String::from_utf8_lossy(&out.stdout);
    for placement in ["colocated ×1", "colocated ×2", "1P+1D"] {
        assert!(table.contains(placement), "{table}");
    }
    assert!(table.contains('←'), "the winner is marked: {table}");
    let values = std::fs::read_to_string(&values).unwrap();
    for key in [
        "prefill:\n  replicas:",
        "decode:\n  replicas:",
        "--max-step-tokens=64",
        "--threads=1",
    ] {
        assert!(values.contains(key), "{values}");
    }
    assert!(std::fs::read_to_string(&plot).unwrap().starts_with("<svg"));
}

#[test]
fn bad_planner_input_names_its_line_field_or_flag() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("bad.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 30, \"output_length\": 2}\n{\"timestamp\": 5, \"output_length\": 2}\n",
    )
    .unwrap();
    let profile = dir.path().join("p.json");
    std::fs::write(&profile, "{\"format\": 1}").unwrap();
    let simulate = |args: &[&str]| {
        duet()
            .arg("simulate")
            .arg("--profile")
            .arg(&profile)
            .args(args)
            .output()
            .unwrap()
    };
    failed_saying(simulate(&[]), "missing field");
    // A profile measured elsewhere: another model, device or thread count.
    let measured = dir.path().join("measured.json");
    let mut p: serde_json::Value = serde_json::from_str(include_str!(
        "../../../../bench/results/planner/profile-h200-llama3-8b.json"
    ))
    .unwrap();
    std::fs::write(&measured, p.to_string()).unwrap();
    let run = |args: &[&str]| {
        duet()
            .arg("simulate")
            .arg("--profile")
            .arg(&measured)
            .args(args)
            .output()
            .unwrap()
    };
    failed_saying(run(&["--device", "cpu"]), "`device.kind` (--device)");
    failed_saying(
        run(&["--device", "cuda", "--model", "other.gguf"]),
        "`model.name` (--model)",
    );
    failed_saying(
        run(&["--device", "cuda", "--ttft-slo-ms", "0"]),
        "--ttft-slo-ms must be a positive number",
    );
    failed_saying(
        run(&["--device", "cuda", "--timeline-window-s", "0"]),
        "\"0\" is not a positive number of seconds",
    );
    failed_saying(
        run(&["--device", "cuda", "--trace", trace.to_str().unwrap()]),
        "bad.jsonl:2: not a trace line: missing field `input_length`",
    );
    // A requests file that cannot be written is refused before simulating: no report either.
    let report = dir.path().join("report.json");
    let nowhere = dir.path().join("no-such-dir").join("requests.jsonl");
    let (report_arg, nowhere_arg) = (report.to_str().unwrap(), nowhere.to_str().unwrap());
    failed_saying(
        run(&[
            "--device",
            "cuda",
            "--json-out",
            report_arg,
            "--requests-out",
            nowhere_arg,
        ]),
        &format!("--requests-out {nowhere_arg}"),
    );
    assert!(!report.exists());
    p["decode"]["fit"]["a_ms"] = serde_json::json!(-2.0);
    std::fs::write(&measured, p.to_string()).unwrap();
    failed_saying(run(&["--device", "cuda"]), "`decode.fit.a_ms` is -2");
}

#[test]
fn the_run_time_planner_refuses_bad_input_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let measured = dir.path().join("measured.json");
    std::fs::write(
        &measured,
        include_str!("../../../../bench/results/planner/profile-h200-llama3-8b.json"),
    )
    .unwrap();
    // Nothing listens there.
    let router = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let planner = |profile: &std::path::Path, args: &[&str]| {
        duet()
            .arg("planner")
            .arg("--profile")
            .arg(profile)
            .arg(format!("--router-metrics=http://{router}"))
            .args(args)
            .output()
            .unwrap()
    };
    failed_saying(
        planner(&dir.path().join("missing.json"), &["--device", "cuda"]),
        "--profile",
    );
    failed_saying(
        planner(&measured, &["--device", "cpu"]),
        "`device.kind` (--device)",
    );
    failed_saying(
        planner(&measured, &["--device", "cuda", "--tpot-slo-ms", "0"]),
        "--tpot-slo-ms must be a positive number",
    );
    failed_saying(
        planner(&measured, &["--device", "cuda"]),
        &format!("--router-metrics: cannot reach http://{router}/metrics"),
    );
}
