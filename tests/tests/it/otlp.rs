//! OpenTelemetry traces over OTLP: a cluster of separate processes (router, prefill, decode)
//! exports to a real OTLP/gRPC receiver on loopback (tests/otlp/receiver.py: PyPI `grpcio` and
//! `opentelemetry-proto`, installed by .ci/run), and one Generate call carrying a client's
//! `traceparent` is one trace across the three processes, its phases parented as the request
//! flows: router -> decode worker -> prefill worker -> KV push.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use duet_telemetry::TelemetryArgs;
use duet_tests::*;
use futures::StreamExt;
use serde_json::Value;

/// The receiver, killed on drop; it appends every span it receives to `spans`.
struct Receiver {
    child: Child,
    endpoint: String,
    spans: PathBuf,
    _dir: tempfile::TempDir,
}

impl Receiver {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let spans = dir.path().join("spans.jsonl");
        let mut child = Command::new("python3")
            .arg(repo().join("tests/otlp/receiver.py"))
            .arg("--out")
            .arg(&spans)
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 (with PyPI grpcio and opentelemetry-proto, which .ci/run installs)");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line
            .strip_prefix("listening ")
            .unwrap_or_else(|| panic!("the receiver did not start: {line:?}"))
            .trim()
            .to_string();
        Receiver {
            child,
            endpoint: format!("http://127.0.0.1:{port}"),
            spans,
            _dir: dir,
        }
    }

    /// Every span received so far.
    fn spans(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.spans)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN_ID: &str = "00f067aa0ba902b7";

/// The spans a remotely prefilled request makes, by name (servers' spans are named after the
/// method).
const PHASES: &[&str] = &[
    "duet.v1.Generation/Generate",
    "request",
    "route",
    "duet.v1.DecodeWorker/Decode",
    "decode_admission",
    "duet.v1.PrefillWorker/Prefill",
    "prefill",
    "queue",
    "kv_transfer",
    "duet.v1.KvTransfer/Push",
    "decode",
];

#[test]
fn one_generate_is_one_trace_across_router_decode_and_prefill() {
    let receiver = Receiver::start();
    // Every prompt prefilled remotely: with the tiny model a prompt prefills so fast on the
    // decode worker that the router's saturation check (the prefill worker's estimate against
    // twice the local one) sometimes kept one local, and this trace then had no prefill phases.
    let routing = RoutingOptions {
        prefill_saturation_factor: 0.0,
        ..local_prefill_threshold(0)
    };
    let mut spec = spec(tiny_model(), 1, 1, routing);
    spec.processes = true;
    spec.bin_dir = Some(bin_dir());
    spec.telemetry = TelemetryArgs {
        otlp_endpoint: Some(receiver.endpoint.clone()),
        ..Default::default()
    };
    let c = Cluster::start(&spec).unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| 10 + i).collect();
    let max_tokens = 6;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let generated = rt.block_on(async {
        let mut call = tonic::Request::new(greedy_request(&prompt, max_tokens));
        call.metadata_mut().insert(
            "traceparent",
            format!("00-{TRACE_ID}-{CLIENT_SPAN_ID}-01")
                .parse()
                .unwrap(),
        );
        let mut stream = client(c.router)
            .await
            .generate(call)
            .await
            .unwrap()
            .into_inner();
        let mut ids = Vec::new();
        while let Some(msg) = stream.next().await {
            ids.extend(msg.unwrap().token_ids);
        }
        ids
    });
    assert_eq!(generated.len(), max_tokens as usize);

    // Spans are exported in batches (every 5 s by default): wait for every phase of the trace.
    // (The cluster's readiness check made a request of its own: another trace.) A span that
    // lost the client's trace context would be missing here.
    let started = Instant::now();
    let by_name = loop {
        let mut by_name: HashMap<String, Vec<Value>> = HashMap::new();
        let spans = receiver.spans();
        for span in spans.into_iter().filter(|s| s["trace_id"] == TRACE_ID) {
            by_name
                .entry(span["name"].as_str().unwrap().to_string())
                .or_default()
                .push(span);
        }
        if PHASES.iter().all(|p| by_name.contains_key(*p)) {
            break by_name;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "spans missing after 60 s; got {:?} (route: {:?})",
            by_name.keys().collect::<Vec<_>>(),
            by_name.get("route").map(|r| &r[0]["attributes"])
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    drop(c);

    // One request: one span per phase.
    let one = |name: &str| -> &Value {
        let spans = &by_name[name];
        assert_eq!(spans.len(), 1, "{name}: {spans:#?}");
        &spans[0]
    };
    for (name, service) in [
        ("duet.v1.Generation/Generate", "duet-router"),
        ("request", "duet-router"),
        ("route", "duet-router"),
        ("duet.v1.DecodeWorker/Decode", "duet-decode"),
        ("decode_admission", "duet-decode"),
        ("decode", "duet-decode"),
        ("duet.v1.KvTransfer/Push", "duet-decode"),
        ("duet.v1.PrefillWorker/Prefill", "duet-prefill"),
        ("prefill", "duet-prefill"),
        ("queue", "duet-prefill"),
        ("kv_transfer", "duet-prefill"),
    ] {
        assert_eq!(one(name)["service_name"], service, "{name}");
    }
    // Each span's parent, up to the client's span.
    let id = |name: &str| one(name)["span_id"].as_str().unwrap().to_string();
    for (child, parent) in [
        ("request", id("duet.v1.Generation/Generate")),
        ("route", id("request")),
        ("duet.v1.DecodeWorker/Decode", id("request")),
        ("decode_admission", id("duet.v1.DecodeWorker/Decode")),
        ("decode", id("duet.v1.DecodeWorker/Decode")),
        (
            "duet.v1.PrefillWorker/Prefill",
            id("duet.v1.DecodeWorker/Decode"),
        ),
        ("prefill", id("duet.v1.PrefillWorker/Prefill")),
        ("queue", id("prefill")),
        ("kv_transfer", id("prefill")),
        ("duet.v1.KvTransfer/Push", id("kv_transfer")),
        ("duet.v1.Generation/Generate", CLIENT_SPAN_ID.to_string()),
    ] {
        assert_eq!(one(child)["parent_span_id"], parent.as_str(), "{child}");
    }

    let transfer = &one("kv_transfer")["attributes"];
    assert!(
        transfer["bytes"].as_i64().is_some_and(|n| n > 0),
        "{transfer}"
    );
    assert!(
        transfer["chunks"].as_i64().is_some_and(|n| n > 0),
        "{transfer}"
    );
    assert!(
        transfer["blocks"].as_i64().is_some_and(|n| n > 0),
        "{transfer}"
    );
    assert_eq!(transfer["transport"], "grpc");

    let request = &one("request")["attributes"];
    assert_eq!(request["gen_ai.operation.name"], "text_completion");
    assert_eq!(request["gen_ai.request.model"], "tiny-llama");
    assert_eq!(request["gen_ai.usage.input_tokens"], prompt.len() as i64);
    assert_eq!(request["gen_ai.usage.output_tokens"], max_tokens as i64);
    assert_eq!(request["gen_ai.response.finish_reasons"], "length");
    assert_eq!(request.get("error.type"), None, "{request}");
    let decode = &one("decode")["attributes"];
    assert_eq!(decode["gen_ai.usage.output_tokens"], max_tokens as i64);
    // The TTFT split of a remotely prefilled prompt: every part recorded, and a prefill that
    // took time.
    for part in ["ttft.queue_us", "ttft.prefill_us", "ttft.transfer_us"] {
        assert!(
            decode[part].as_i64().is_some_and(|us| us >= 0),
            "{part}: {decode}"
        );
    }
    assert!(decode["ttft.prefill_us"].as_i64().unwrap() > 0, "{decode}");
}
