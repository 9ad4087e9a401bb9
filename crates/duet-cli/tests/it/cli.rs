//! The `duet` command as a user runs it.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::duet;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn assert_succeeded(out: &std::process::Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn generate_json_prints_exactly_one_object() {
    let out = duet()
        .args([
            "generate",
            "--json",
            "--temperature",
            "0",
            "--max-tokens",
            "5",
            "--ignore-eos",
            "--prompt",
            "hello world",
        ])
        .arg("--model")
        .arg(fixture("tiny-llama"))
        .output()
        .unwrap();
    assert_succeeded(&out);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        stdout.trim().lines().count(),
        1,
        "one JSON object on one line: {stdout}"
    );
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["token_ids"].as_array().unwrap().len(), 5);
    assert_eq!(v["finish_reason"], "length");
    assert!(!v["prompt_token_ids"].as_array().unwrap().is_empty());
    assert!(v["text"].is_string());
    for key in [
        "prefill_ms",
        "decode_ms",
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
    ] {
        assert!(v["timings"][key].as_f64().unwrap() >= 0.0, "timings.{key}");
    }
}

#[test]
fn greedy_generation_is_deterministic_and_seeded_sampling_repeats() {
    let run = |extra: &[&str]| {
        let out = duet()
            .args([
                "generate",
                "--json",
                "--max-tokens",
                "8",
                "--ignore-eos",
                "--prompt",
                "the cat",
            ])
            .arg("--model")
            .arg(fixture("tiny-llama"))
            .args(extra)
            .output()
            .unwrap();
        assert_succeeded(&out);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["token_ids"].clone()
    };
    assert_eq!(run(&["--temperature", "0"]), run(&["--temperature", "0"]));
    assert_eq!(run(&["--seed", "7"]), run(&["--seed", "7"]));
}

#[test]
fn missing_default_model_says_how_to_fetch_it() {
    let empty = tempfile::tempdir().unwrap();
    let out = duet()
        .args(["generate", "--prompt", "hi"])
        .arg("--models-dir")
        .arg(empty.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("duet model fetch"), "{err}");
}

#[test]
fn bad_sampling_parameters_are_rejected_with_the_field_named() {
    for (flag, value, field) in [
        ("--temperature", "-1", "temperature"),
        ("--top-p", "0", "top_p"),
        ("--max-tokens", "0", "max_tokens"),
        ("--prompt", "", "the prompt is empty"),
    ] {
        let out = duet()
            .args(["generate", flag, value])
            .args(if flag == "--prompt" {
                vec![]
            } else {
                vec!["--prompt", "hi"]
            })
            .arg("--model")
            .arg(fixture("tiny-llama"))
            .output()
            .unwrap();
        assert!(!out.status.success(), "{flag} {value} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(field), "{flag} {value}: {err}");
    }
}

#[test]
fn corrupt_model_file_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.gguf");
    std::fs::write(&bad, b"NOPE this is not a gguf file").unwrap();
    let out = duet()
        .args(["generate", "--prompt", "hi"])
        .arg("--model")
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bad.gguf") && err.to_lowercase().contains("magic"),
        "{err}"
    );
}

#[test]
fn asking_for_a_gpu_that_is_not_there_is_a_clear_error() {
    let mut generate = duet();
    generate
        .args(["generate", "--device", "cuda:0", "--prompt", "hi"])
        .arg("--model")
        .arg(fixture("tiny-llama"));
    let mut bench = duet();
    bench.args(["bench", "gpu", "--skip-speed"]);
    for mut command in [generate, bench] {
        let out = command.output().unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        // A build without the feature says how to get it; with it, this GPU-less machine lacks
        // the driver library, and the message says so instead of a panic from a failed dlopen.
        assert!(
            err.contains("--features cuda") || err.contains("libcuda.so"),
            "{err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }

    let out = duet()
        .args(["generate", "--device", "gpu", "--prompt", "hi"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("expected cpu, cuda or cuda:N"), "{err}");
}

#[test]
fn a_kv_transport_the_worker_cannot_use_stops_it_at_start() {
    let out = duet()
        .args(["up", "--exit-when-ready", "--listen", "127.0.0.1:0"])
        .args(["--kv-transport", "cuda-ipc"])
        .arg("--model")
        .arg(fixture("tiny-llama"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--kv-transport cuda-ipc needs a GPU worker"),
        "{err}"
    );
}

/// Runs `duet bench ARGS` on the tiny fixture and returns its JSON report.
fn bench_report(args: &[&str]) -> serde_json::Value {
    let json = std::env::temp_dir().join(format!(
        "duet-bench-{}-{}.json",
        args[0],
        std::process::id()
    ));
    let out = duet()
        .arg("bench")
        .args(args)
        .arg("--model")
        .arg(fixture("tiny-llama"))
        .arg("--json-out")
        .arg(&json)
        .output()
        .unwrap();
    assert_succeeded(&out);
    let v = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    v
}

/// `duet bench serve` launches both designs, completes every request, and brackets each run with
/// measurements of the engine alone (one before the first run, one after each).
#[test]
fn bench_serve_reports_both_designs_against_the_engine_alone() {
    let v = bench_report(&[
        "serve",
        "--requests",
        "6",
        "--concurrency",
        "2",
        "--prompt-tokens",
        "4..6",
        "--output-tokens",
        "3",
        "--compare-engine",
    ]);
    let runs = v["runs"].as_array().unwrap();
    let designs: Vec<&str> = runs.iter().map(|r| r["design"].as_str().unwrap()).collect();
    assert_eq!(designs, ["disaggregated", "colocated"]);
    for r in runs {
        assert_eq!(
            (r["requests"].as_u64(), r["failed"].as_u64()),
            (Some(6), Some(0))
        );
        let tokens = r["output_tokens_per_s"].as_f64().unwrap() * r["duration_s"].as_f64().unwrap();
        assert!(
            (tokens - 18.0).abs() < 1e-6,
            "6 requests × 3 tokens, got {tokens}"
        );
        let full = &r["full_concurrency"];
        assert!(full["window_s"].as_f64().unwrap() <= r["duration_s"].as_f64().unwrap());
        assert!(full["output_tokens_per_s"].as_f64().unwrap() > 0.0);
    }
    let engine = &v["engine_alone"];
    assert_eq!(
        (engine["batch"].as_u64(), engine["context"].as_u64()),
        (Some(2), Some(5))
    );
    for series in ["decode_tokens_per_s", "prefill_ms"] {
        let values = engine[series].as_array().unwrap();
        assert_eq!(values.len(), runs.len() + 1, "{series}");
        assert!(values.iter().all(|x| x.as_f64().unwrap() > 0.0), "{series}");
    }
}

/// `duet bench structured --auto-tools` times `tool_choice: "auto"`'s grammar (free text, Hermes
/// calls held to a tool's schema) against the same tokens unconstrained, and says so.
#[test]
fn bench_structured_times_the_auto_tool_grammar() {
    let v = bench_report(&[
        "structured",
        "--auto-tools",
        "--batch=2",
        "--max-tokens=6",
        "--repeats=1",
    ]);
    assert_eq!(v["kind"], "lark");
    let grammar = v["grammar"].as_str().unwrap();
    assert!(
        grammar.contains("<tool_call>") && grammar.contains("get_weather"),
        "{grammar}"
    );
    assert_eq!(v["tokens"].as_array().unwrap().len(), 2);
    for field in ["constrained_tpot_ms", "unconstrained_tpot_ms"] {
        assert!(v[field].as_f64().unwrap() > 0.0, "{field}");
    }
    assert_eq!(v["all_answers_parse"], true);
}

/// `duet bench engine` measures every (batch, context) point of its sweep and every prefill
/// length, each decode sequence on its own copy of the context's KV.
#[test]
fn bench_engine_sweeps_every_point_with_private_kv() {
    let (contexts, batches, steps) = ([16, 40], [1, 3], 4);
    let v = bench_report(&[
        "engine",
        "--contexts=16,40",
        "--batch=1,3",
        "--prefill-tokens=20,33",
        "--decode-steps=4",
        "--repeats=2",
        "--bandwidth-mib=8",
    ]);

    // The CPU by name, family and model number (one name covers several generations).
    for field in ["model", "family", "model_number"] {
        assert!(!v["cpu"][field].as_str().unwrap().is_empty(), "{field}");
    }
    assert!(!v["kernel_path"].as_str().unwrap().is_empty());
    let prefill: Vec<(u64, f64)> = v["prefill"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["tokens"].as_u64().unwrap(),
                p["tokens_per_s"].as_f64().unwrap(),
            )
        })
        .collect();
    assert_eq!(prefill.iter().map(|p| p.0).collect::<Vec<_>>(), [20, 33]);
    assert!(prefill.iter().all(|p| p.1 > 0.0), "{prefill:?}");

    let decode = v["decode"].as_array().unwrap();
    let block_size = 16;
    let mut seen = Vec::new();
    for d in decode {
        let (batch, context) = (d["batch"].as_u64().unwrap(), d["context"].as_u64().unwrap());
        seen.push((batch, context));
        assert!(d["tokens_per_s"].as_f64().unwrap() > 0.0, "{d}");
        // Every sequence holds its own blocks for the context and the decoded tokens.
        let blocks = d["kv_blocks"].as_u64().unwrap();
        assert_eq!(blocks, d["kv_blocks_distinct"].as_u64().unwrap(), "{d}");
        assert!(
            blocks >= batch * (context + 1 + steps).div_ceil(block_size),
            "{d}"
        );
        if batch == 1 {
            assert!(d["roofline_fraction"].as_f64().unwrap() > 0.0, "{d}");
            // Judged by the bandwidth read right around the point, the higher of the two.
            let read = |when: &str| d["bandwidth"][when]["bytes_per_s"].as_f64().unwrap();
            let higher = read("before").max(read("after"));
            assert!(read("before") > 0.0 && read("after") > 0.0, "{d}");
            let (rate, roofline) = (
                d["tokens_per_s"].as_f64().unwrap(),
                d["roofline_tokens_per_s"].as_f64().unwrap(),
            );
            let fraction = d["roofline_fraction"].as_f64().unwrap();
            assert!((rate / roofline - fraction).abs() < 1e-9, "{d}");
            // The roofline is that bandwidth over the weights and the mean KV of the timed steps.
            let m = &v["memory_roofline"];
            let kv_tokens = context as f64 + (steps as f64 + 3.0) / 2.0;
            let bytes = m["weight_bytes_per_token"].as_f64().unwrap()
                + kv_tokens * m["kv_bytes_per_context_token"].as_f64().unwrap();
            assert!((roofline * bytes / higher - 1.0).abs() < 1e-9, "{d}");
        } else {
            assert!(d["bandwidth"].is_null(), "{d}");
        }
    }
    let expected: Vec<(u64, u64)> = contexts
        .iter()
        .flat_map(|&c| batches.iter().map(move |&b| (b, c)))
        .collect();
    assert_eq!(seen, expected);
    // The compute ceiling is the higher of its measures before and after the sweep (a host that
    // starves a core through one of them would otherwise halve it); none on the portable path.
    let c = &v["compute_ceiling"];
    if v["kernel_path"] != "Scalar" {
        let rate = |f: &str| c[f].as_f64().unwrap();
        let (before, after) = (
            rate("integer_macs_per_s_before_sweep"),
            rate("integer_macs_per_s_after_sweep"),
        );
        assert!(before > 0.0 && after > 0.0, "{c}");
        assert_eq!(rate("integer_macs_per_s"), before.max(after), "{c}");
    } else {
        assert!(c.is_null(), "{c}");
    }
    assert!(
        v["memory_roofline"]["bandwidth"]["bytes_per_s"]
            .as_f64()
            .unwrap()
            > 0.0
    );
}

/// A KV cache the user sized too small for the sweep is an error that names the flag and the
/// size needed, not a failed measurement.
#[test]
fn bench_engine_says_what_kv_cache_its_sweep_needs() {
    let out = duet()
        .args([
            "bench",
            "engine",
            "--contexts=40",
            "--batch=3",
            "--prefill-tokens=20",
            "--decode-steps=4",
            "--kv-cache-tokens=64",
        ])
        .arg("--model")
        .arg(fixture("tiny-llama"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    // The copied-from prompt (3 blocks) and 3 sequences of 45 tokens (3 blocks each).
    assert!(
        err.contains("--kv-cache-tokens 64 is too small for this run: it needs 192"),
        "{err}"
    );
}

/// A router that answers `Generate` with a stream that ends cleanly and carries no token.
struct TokenlessRouter;

#[tonic::async_trait]
impl duet_proto::v1::generation_server::Generation for TokenlessRouter {
    type GenerateStream = std::pin::Pin<
        Box<
            dyn futures::Stream<Item = Result<duet_proto::v1::GenerateResponse, tonic::Status>>
                + Send,
        >,
    >;

    async fn generate(
        &self,
        _: tonic::Request<duet_proto::v1::GenerateRequest>,
    ) -> Result<tonic::Response<Self::GenerateStream>, tonic::Status> {
        Ok(tonic::Response::new(Box::pin(futures::stream::empty())))
    }

    async fn complete(
        &self,
        _: tonic::Request<duet_proto::v1::GenerateRequest>,
    ) -> Result<tonic::Response<duet_proto::v1::GenerateResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("complete"))
    }

    async fn tokenize(
        &self,
        _: tonic::Request<duet_proto::v1::TokenizeRequest>,
    ) -> Result<tonic::Response<duet_proto::v1::TokenizeResponse>, tonic::Status> {
        Ok(tonic::Response::new(duet_proto::v1::TokenizeResponse {
            token_ids: vec![1, 2, 3],
            ..Default::default()
        }))
    }

    async fn info(
        &self,
        _: tonic::Request<duet_proto::v1::InfoRequest>,
    ) -> Result<tonic::Response<duet_proto::v1::InfoResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("info"))
    }
}

/// `helm test` runs `duet generate --server`: it must fail unless tokens come back.
#[test]
fn generate_through_a_server_fails_unless_tokens_come_back() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    runtime.spawn(
        tonic::transport::Server::builder()
            .add_service(duet_proto::v1::generation_server::GenerationServer::new(
                TokenlessRouter,
            ))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let out = duet()
        .args(["generate", "--json", "--prompt", "hello", "--server"])
        .arg(addr.to_string())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "succeeded with no token: {stderr}");
    assert!(
        stderr.contains("ended the Generate stream without a token"),
        "{stderr}"
    );
}

/// Process ids whose parent is `parent` (from /proc).
fn children_of(parent: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // pid (comm) state ppid ...: the fields after the last ')'.
            let fields: Vec<&str> = stat
                .rsplit(')')
                .next()
                .unwrap_or("")
                .split_whitespace()
                .collect();
            fields.get(1).and_then(|p| p.parse::<u32>().ok()) == Some(parent)
        })
        .collect()
}

/// Running: /proc has it and it is not a zombie waiting to be reaped.
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| {
            stat.rsplit(')')
                .next()
                .unwrap_or("")
                .split_whitespace()
                .next()
                != Some("Z")
        })
        .unwrap_or(false)
}

/// SIGTERM (what `kill`, systemd and Kubernetes send) stops `duet up --processes` and its worker
/// processes with it: left running, they would keep their ports and, on a GPU, its memory.
#[test]
fn sigterm_stops_duet_up_and_its_worker_processes() {
    let port = free_port();
    let mut up = duet()
        .args([
            "up",
            "--processes",
            "--listen",
            &format!("127.0.0.1:{port}"),
        ])
        .arg("--model")
        .arg(fixture("tiny-llama"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = BufReader::new(up.stdout.take().unwrap());
    let ready = stdout
        .lines()
        .map_while(Result::ok)
        .any(|l| l.starts_with("duet is ready"));
    assert!(ready, "duet up --processes did not become ready");
    let workers = children_of(up.id());
    assert!(
        workers.len() >= 2,
        "worker processes of duet up: {workers:?}"
    );

    sigterm(up.id());
    let deadline = Instant::now() + Duration::from_secs(20);
    exited_within(up, Duration::from_secs(20), "duet up after SIGTERM");
    while workers.iter().any(|&pid| running(pid)) {
        assert!(
            Instant::now() < deadline,
            "worker processes still running after duet up exited: {:?}",
            workers.iter().filter(|&&p| running(p)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A free loopback port, for a router of `--processes` (its own process, which needs one named).
fn free_port() -> u16 {
    duet_cli::cluster::free_port(std::net::Ipv4Addr::LOCALHOST.into())
        .unwrap()
        .port()
}

/// `duet up ARGS` on the tiny fixture, its stderr piped.
fn spawn_up(args: &[&str]) -> std::process::Child {
    duet()
        .arg("up")
        .args(args)
        .arg("--model")
        .arg(fixture("tiny-llama"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Sends SIGTERM to `pid`.
fn sigterm(pid: u32) {
    let killed = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
}

/// Waits for `child` to exit, up to `limit`; whether it succeeded, and its stderr.
fn exited_within(mut child: std::process::Child, limit: Duration, what: &str) -> (bool, String) {
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() >= deadline {
            let _ = child.kill();
            panic!("{what}: still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A worker process that dies while the cluster starts (here: a KV transport its CPU cannot
/// use) stops `duet up --processes` at once, naming it, and takes the router it started down
/// with it, instead of waiting minutes for a cluster that cannot become ready.
#[test]
fn a_worker_process_dying_at_start_stops_duet_up_and_the_rest() {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let up = spawn_up(&[
        "--processes",
        "--kv-transport",
        "cuda-ipc",
        "--listen",
        &listen,
    ]);
    let (ok, err) = exited_within(up, Duration::from_secs(60), "duet up with a dying worker");
    assert!(!ok);
    assert!(
        err.contains("exited while the cluster was starting"),
        "{err}"
    );
    // The router process held this port; gone with it, the port is free again.
    std::net::TcpListener::bind(("127.0.0.1", port)).expect("the router's port is still held");
}

/// SIGTERM while the cluster is still starting (a registry that cannot be reached keeps it from
/// becoming ready) stops the worker processes started so far too.
#[test]
fn sigterm_while_starting_stops_the_worker_processes_started_so_far() {
    let port = free_port();
    let dead_etcd = free_port();
    let (listen, etcd) = (
        format!("127.0.0.1:{port}"),
        format!("http://127.0.0.1:{dead_etcd}"),
    );
    let up = spawn_up(&["--processes", "--listen", &listen, "--etcd", &etcd]);
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut workers = children_of(up.id());
    while workers.len() < 3 {
        assert!(
            Instant::now() < deadline,
            "processes of duet up: {workers:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
        workers = children_of(up.id());
    }
    sigterm(up.id());
    let (ok, err) = exited_within(up, Duration::from_secs(20), "duet up after SIGTERM");
    assert!(!ok);
    assert!(err.contains("stopped while starting"), "{err}");
    let left: Vec<_> = workers.iter().filter(|&&p| running(p)).collect();
    assert!(left.is_empty(), "worker processes still running: {left:?}");
}

/// A configuration that refuses every call (here: prompts of at most one byte) fails `duet up`
/// at once with the router's reason, not after minutes of retrying.
#[test]
fn a_router_refusing_every_call_fails_duet_up_with_its_reason() {
    let up = spawn_up(&["--listen", "127.0.0.1:0", "--max-prompt-bytes", "1"]);
    let (ok, err) = exited_within(up, Duration::from_secs(60), "duet up refusing every call");
    assert!(!ok);
    assert!(err.contains("refuses the readiness probe"), "{err}");
    assert!(err.contains("--max-prompt-bytes"), "{err}");
}

/// A cluster that could never serve is refused before anything starts.
#[test]
fn duet_up_without_a_decode_worker_is_refused() {
    let up = spawn_up(&["--listen", "127.0.0.1:0", "--decode-workers", "0"]);
    let (ok, err) = exited_within(up, Duration::from_secs(10), "duet up --decode-workers 0");
    assert!(!ok);
    assert!(err.contains("at least one decode worker"), "{err}");
}

/// `--listen` on port 0 serves on a free port, which the ready line names.
#[test]
fn duet_up_on_port_zero_becomes_ready_on_the_port_it_names() {
    let out = duet()
        .args(["up", "--exit-when-ready", "--listen", "127.0.0.1:0"])
        .arg("--model")
        .arg(fixture("tiny-llama"))
        .output()
        .unwrap();
    assert_succeeded(&out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let ready = stdout
        .lines()
        .find(|l| l.starts_with("duet is ready on 127.0.0.1:"))
        .unwrap_or_else(|| panic!("no ready line: {stdout}"));
    assert!(
        !ready.starts_with("duet is ready on 127.0.0.1:0 "),
        "{ready}"
    );
}
