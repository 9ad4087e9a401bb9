//! API keys on the public APIs (`--api-keys-file`): a gRPC `Generation` call and an OpenAI HTTP
//! call without a listed key are refused (UNAUTHENTICATED / 401 in OpenAI's error envelope),
//! with one they are served (`duet generate --api-key-file` too), and health stays open on both.

use duet_proto::v1;
use duet_tests::*;
use tonic::Code;

const KEYS: &str = "# the test's keys\nsk-first-key\n\n  sk-second-key  \n";

/// A call with `authorization` metadata when given.
fn with_key<T>(message: T, key: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert("authorization", key.parse().unwrap());
    }
    request
}

#[test]
fn calls_without_a_listed_key_are_refused_on_both_apis_and_health_stays_open() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::write(&keys, KEYS).unwrap();
    let http_addr = free_addr();
    let mut spec = spec(tiny_model(), 0, 1, RoutingOptions::default());
    spec.router.api_keys_file = Some(keys);
    spec.router.http_listen = Some(http_addr);
    let c = Cluster::start(&spec).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut client = client(c.router).await;
        let req = || v1::GenerateRequest {
            prompt: "hello".into(),
            max_tokens: Some(4),
            ..Default::default()
        };
        for refused in [
            None,
            Some("Bearer sk-wrong-key"),
            Some("Bearer sk-first-ke"),
            Some("sk-first-key"),
            Some("Bearer # the test's keys"),
        ] {
            let e = client.complete(with_key(req(), refused)).await.unwrap_err();
            assert_eq!(e.code(), Code::Unauthenticated, "{refused:?}: {e:?}");
            assert!(e.message().contains("API key"), "{e:?}");
            let e = client
                .info(with_key(v1::InfoRequest {}, refused))
                .await
                .unwrap_err();
            assert_eq!(e.code(), Code::Unauthenticated, "{refused:?}: {e:?}");
        }
        for key in ["Bearer sk-first-key", "bearer sk-second-key"] {
            let done = client.complete(with_key(req(), Some(key))).await.unwrap();
            assert!(done.into_inner().usage.unwrap().completion_tokens >= 1);
        }
        let mut health = tonic_health::pb::health_client::HealthClient::new(
            tonic::transport::Channel::from_shared(format!("http://{}", c.router))
                .unwrap()
                .connect()
                .await
                .unwrap(),
        );
        let serving = health
            .check(tonic_health::pb::HealthCheckRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            serving.status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );
    });

    let body = format!(
        r#"{{"model":"{}","prompt":"hello","max_tokens":4}}"#,
        duet_router::model_name(&tiny_model())
    );
    for refused in [
        None,
        Some("Bearer sk-wrong-key"),
        Some("Basic sk-first-key"),
    ] {
        let (status, answer) = http(http_addr, "POST", "/v1/completions", refused, &body);
        assert_eq!(status, 401, "{refused:?}: {answer}");
        let error: serde_json::Value = serde_json::from_str(&answer).unwrap();
        assert_eq!(error["error"]["code"], "invalid_api_key", "{answer}");
        assert_eq!(error["error"]["type"], "invalid_request_error", "{answer}");
        assert!(
            error["error"]["message"]
                .as_str()
                .unwrap()
                .contains("API key"),
            "{answer}"
        );
        let (status, _) = http(http_addr, "GET", "/v1/models", refused, "");
        assert_eq!(status, 401);
    }
    let (status, answer) = http(
        http_addr,
        "POST",
        "/v1/completions",
        Some("Bearer sk-second-key"),
        &body,
    );
    assert_eq!(status, 200, "{answer}");
    let done: serde_json::Value = serde_json::from_str(&answer).unwrap();
    assert!(
        done["usage"]["completion_tokens"].as_u64().unwrap() >= 1,
        "{answer}"
    );
    let (status, answer) = http(http_addr, "GET", "/health", None, "");
    assert_eq!(status, 200, "{answer}");

    // `duet generate --api-key-file` (what the chart's `helm test` pod runs) calls with the
    // file's first key; without it, the call is refused.
    let generate = |with_keys: bool| {
        let mut command = std::process::Command::new(bin_dir().join("duet"));
        command.args([
            "generate",
            "--server",
            &c.router.to_string(),
            "--prompt",
            "hello",
        ]);
        command.args(["--max-tokens", "4", "--temperature", "0"]);
        if with_keys {
            command.arg("--api-key-file").arg(dir.path().join("keys"));
        }
        command.output().unwrap()
    };
    let served = generate(true);
    assert!(served.status.success(), "{served:?}");
    let refused = generate(false);
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("API key"),
        "{refused:?}"
    );
}
