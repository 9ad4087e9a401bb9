//! Prometheus metrics against a real Prometheus (Debian's `prometheus`, installed by `.ci/run`):
//! `duet up --metrics-listen` on the tiny model, scraped every second by a Prometheus on
//! loopback; after a few requests (and one refused KV push) its HTTP API answers the dashboards'
//! queries, and every metric the chart's Grafana dashboard
//! (`deploy/helm/duet/dashboards/duet.json`) queries is one Prometheus has scraped, so the
//! dashboard cannot drift from the code.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use duet_tests::*;

/// Requests the test sends; `duet up` sent one more (its readiness probe) before it said ready.
const REQUESTS: u64 = 5;

/// A child process killed when the test ends, however it ends.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The cluster token `duet up` runs with (given in its environment).
const TOKEN: &str = "prometheus-test-cluster-token";

/// `duet up` in one process, prompts prefilled on the prefill worker (their KV transferred);
/// returns once it printed its ready line.
fn duet_up(router: SocketAddr, metrics: SocketAddr) -> Killed {
    let mut child = Killed(
        Command::new(bin_dir().join("duet"))
            .env(duet_proto::auth::CLUSTER_TOKEN_ENV, TOKEN)
            .arg("up")
            .arg(format!("--listen={router}"))
            .arg(format!("--metrics-listen={metrics}"))
            .arg(format!("--model={}", tiny_model().display()))
            .args(["--threads=2", "--local-prefill-threshold=0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting duet up"),
    );
    let stdout = child.0.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    loop {
        let line = lines
            .next()
            .expect("duet up exited before it was ready")
            .unwrap();
        if line.starts_with("duet is ready") {
            break;
        }
    }
    // Keep reading, so the child never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    child
}

/// Prometheus on `web`, scraping `target` every second, its data in `dir`.
fn prometheus(web: SocketAddr, target: SocketAddr, dir: &Path) -> Killed {
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             scrape_configs:\n  - job_name: duet\n    static_configs:\n      - targets: ['{target}']\n"
        ),
    )
    .unwrap();
    let child = Command::new("prometheus")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address={web}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting prometheus: install Debian's prometheus (.ci/run does)");
    Killed(child)
}

/// The body of `GET path` on `addr` (HTTP/1.1, plain or chunked), or `None` when it cannot
/// be had (not listening yet, not 200).
fn http_get(addr: SocketAddr, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let raw = String::from_utf8(raw).ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    if !head.starts_with("HTTP/1.1 200") {
        return None;
    }
    if !head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return Some(body.to_string());
    }
    let (mut rest, mut out) = (body, String::new());
    loop {
        let (size, after) = rest.split_once("\r\n")?;
        let size = usize::from_str_radix(size.trim(), 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        out.push_str(after.get(..size)?);
        rest = after.get(size + 2..)?;
    }
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The values of an instant PromQL query (`None` while Prometheus cannot answer).
fn query(prometheus: SocketAddr, promql: &str) -> Option<Vec<f64>> {
    let body = http_get(
        prometheus,
        &format!("/api/v1/query?query={}", percent_encode(promql)),
    )?;
    let v: serde_json::Value = serde_json::from_str(&body).ok()?;
    assert_eq!(v["status"], "success", "{promql}: {body}");
    let result = v["data"]["result"].as_array()?;
    Some(
        result
            .iter()
            .map(|r| r["value"][1].as_str().unwrap().parse::<f64>().unwrap())
            .collect(),
    )
}

/// Polls `promql` until `accept` takes its values; panics with the last values after 60 s.
fn wait_for(prometheus: SocketAddr, promql: &str, accept: impl Fn(&[f64]) -> bool) -> Vec<f64> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = None;
    loop {
        if let Some(values) = query(prometheus, promql) {
            if accept(&values) {
                return values;
            }
            last = Some(values);
        }
        assert!(
            Instant::now() < deadline,
            "{promql}: never accepted; last {last:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn prometheus_scrapes_duet_up_and_answers_the_dashboards_queries() {
    let (router, metrics, web) = (free_addr(), free_addr(), free_addr());
    let _duet = duet_up(router, metrics);
    let dir = tempfile::tempdir().unwrap();
    let _prometheus = prometheus(web, metrics, dir.path());

    // Requests only after a first scrape, so that the rates below see them arrive.
    wait_for(web, "up{job=\"duet\"}", |v| v == [1.0]);
    // The readiness probe's prompt went remote only if the prefill worker had registered by
    // then; count the transfers from here on.
    let transfers_out = "sum(duet_kv_transfer_seconds_count{direction=\"out\"})";
    let probe_transfers = query(web, transfers_out).unwrap().first().copied();
    // duet up's readiness probe sends a Generate until the router lists every worker
    // routable, so once or more: count the requests from here on too.
    let router_requests = "sum(duet_requests_total{role=\"router\"})";
    let succeeded = "duet_requests_total{role=\"router\",status=\"success\",error_type=\"none\"}";
    let at_first_scrape = |promql| query(web, promql).unwrap().first().copied().unwrap_or(0.0);
    let (probe_requests, probe_successes) =
        (at_first_scrape(router_requests), at_first_scrape(succeeded));
    assert!(
        probe_successes >= 1.0,
        "the readiness probe succeeded once at least"
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    for i in 0..REQUESTS {
        // A first token of its own each: no prompt finds the one before it in the decode
        // worker's prefix cache, which would let the router prefill its short rest there (no
        // transfer).
        let prompt: Vec<u32> = std::iter::once(300 + i as u32).chain(1..40).collect();
        let mut req = greedy_request(&prompt, 4 + i as u32);
        req.request_id = format!("prometheus-{i}");
        let (ids, _, _) = rt.block_on(generate(router, req)).expect("generate");
        assert!(!ids.is_empty());
    }

    wait_for(web, router_requests, |v| {
        v == [probe_requests + REQUESTS as f64]
    });
    let by_status = query(web, succeeded).unwrap();
    assert_eq!(by_status, [probe_successes + REQUESTS as f64]);
    let p90 = wait_for(
        web,
        "histogram_quantile(0.9, rate(duet_time_to_first_token_seconds_bucket[1m]))",
        |v| v.len() == 1 && v[0].is_finite(),
    );
    assert!(p90[0] > 0.0, "p90 TTFT {p90:?}");
    // Every family a dashboard needs is there, from every role.
    for family in [
        "duet_inter_token_latency_seconds_count",
        "duet_request_time_per_output_token_seconds_count",
        "duet_e2e_request_latency_seconds_count",
        "duet_routing_decisions_total{reason=\"remote\"}",
        "duet_num_requests_running{role=\"decode\"}",
        "duet_kv_blocks_free{role=\"decode\"}",
        "duet_kv_blocks_used{role=\"prefill\"}",
        "duet_prefix_cache_queries_total{role=\"prefill\"}",
        "duet_iteration_tokens_total_count{role=\"decode\"}",
        "duet_num_preemptions_total{role=\"decode\"}",
    ] {
        let values = query(web, family).unwrap();
        assert_eq!(values.len(), 1, "{family}: {values:?}");
    }
    // Every prompt but the probe's was prefilled remotely: the KV bytes the prefill worker
    // sent over gRPC are the bytes the decode worker received.
    let kv = |direction: &str| {
        query(
            web,
            &format!(
                "duet_kv_transfer_bytes_total{{transport=\"grpc\",direction=\"{direction}\"}}"
            ),
        )
        .unwrap()
    };
    let sent_bytes = kv("out");
    assert_eq!(sent_bytes.len(), 1);
    assert!(sent_bytes[0] > 0.0);
    assert_eq!(kv("in"), sent_bytes);
    let transfers = query(web, transfers_out).unwrap();
    assert_eq!(
        transfers,
        [probe_transfers.unwrap_or(0.0) + REQUESTS as f64]
    );

    // A KV push the decode worker refuses (another model's header) is counted as a failed
    // transfer, the one family only a failure brings.
    rt.block_on(refused_push(router));
    wait_for(
        web,
        "sum(duet_kv_transfer_failures_total{direction=\"in\"})",
        |v| v == [1.0],
    );
    dashboard_queries_only_scraped_metrics(web);
}

/// Pushes a header for another model to the cluster's decode worker (found through the
/// router's `Info`); the push is refused.
async fn refused_push(router: SocketAddr) {
    use duet_proto::v1;
    let info = client(router)
        .await
        .info(v1::InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    let decode = &info.decode_workers[0].address;
    let auth = duet_proto::PeerAuth {
        token: Some(TOKEN.parse().unwrap()),
        tls: None,
    };
    let channel = duet_proto::channel(decode, &auth).unwrap();
    let header = v1::KvChunk {
        kind: Some(v1::kv_chunk::Kind::Header(v1::KvHeader {
            model_fingerprint: "another model".into(),
            ..Default::default()
        })),
    };
    let refused = v1::kv_transfer_client::KvTransferClient::new(channel)
        .push(futures::stream::iter(vec![header]))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused}");
}

/// Every `duet_*` metric named in the Grafana dashboard's queries is one Prometheus scraped.
fn dashboard_queries_only_scraped_metrics(prometheus: SocketAddr) {
    let path = repo().join("deploy/helm/duet/dashboards/duet.json");
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut exprs = Vec::new();
    collect_exprs(&dashboard, &mut exprs);
    assert!(
        exprs.len() >= 10,
        "{} queries in {}",
        exprs.len(),
        path.display()
    );
    let mut used: Vec<String> = exprs.iter().flat_map(|e| metric_names(e)).collect();
    used.sort();
    used.dedup();
    let body = http_get(prometheus, "/api/v1/label/__name__/values").unwrap();
    let scraped: serde_json::Value = serde_json::from_str(&body).unwrap();
    let scraped: Vec<&str> = scraped["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n.as_str())
        .collect();
    let missing: Vec<&String> = used
        .iter()
        .filter(|n| !scraped.contains(&n.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "the dashboard queries metrics no scrape has: {missing:?} (scraped: {scraped:?})"
    );
}

/// Every `expr` string anywhere in a dashboard.
fn collect_exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                match (k.as_str(), v) {
                    ("expr", serde_json::Value::String(e)) => out.push(e.clone()),
                    _ => collect_exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| collect_exprs(v, out)),
        _ => {}
    }
}

/// The `duet_…` identifiers in a PromQL expression.
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(at) = expr[i..].find("duet_") {
        let start = i + at;
        let word_start =
            start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let end = start
            + expr[start..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(expr.len() - start);
        if word_start {
            names.push(expr[start..end].to_string());
        }
        i = end;
    }
    names
}
