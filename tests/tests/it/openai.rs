//! The router's OpenAI-compatible HTTP API on a cluster of the default model: the official
//! `openai` Python client (PyPI `openai`, installed by .ci/run) against it, and a client that
//! disconnects mid-stream freeing its KV blocks on both workers.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use duet_cluster::ClusterArgs;
use duet_model::model_path::ModelArgs;
use duet_proto::{ClusterAuth, v1};
use duet_router::RouterConfig;
use duet_tests::*;

/// Bodies past this are refused (413); small, so the test's oversized body fits in the socket.
const MAX_REQUEST_BYTES: usize = 64 << 10;

/// A cluster of the default model whose router serves HTTP too; prompts always prefill remotely.
/// A second name the main cluster's router answers to (`--served-model-name`).
const ALIAS: &str = "SmolLM2-135M-Instruct";

fn http_cluster(model: std::path::PathBuf) -> (Cluster, SocketAddr) {
    let mut spec = spec(
        model,
        1,
        1,
        RoutingOptions {
            local_prefill_threshold: 0,
            max_request_bytes: MAX_REQUEST_BYTES,
            ..Default::default()
        },
    );
    let http = free_addr();
    spec.router.http_listen = Some(http);
    // The file's stem first, and the name clients written for the model use.
    spec.router.served_model_name = vec![duet_router::model_name(&spec.model), ALIAS.to_string()];
    (Cluster::start(&spec).expect("starting the cluster"), http)
}

/// Starts a router in `rt` with the cluster's model, workers and token, serving HTTP only to
/// the test; returns its HTTP address.
fn side_router(
    rt: &tokio::runtime::Runtime,
    c: &Cluster,
    model: &std::path::Path,
    decode: Vec<String>,
    prefill: Vec<String>,
    routing: RoutingOptions,
) -> SocketAddr {
    let http = free_addr();
    let config = RouterConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        http_listen: Some(http),
        prefill,
        decode,
        model: ModelArgs {
            model: Some(model.to_path_buf()),
            ..Default::default()
        },
        routing: RoutingOptions {
            stats_interval_ms: 50,
            ..routing
        },
        auth: ClusterAuth::with_token(c.token.clone()),
        // A cluster of its own, so that it sees only the workers named above, not the cards of
        // the test's `duet up` in this process's embedded registry.
        cluster: ClusterArgs {
            cluster: format!("openai-side-{}", http.port()),
            ..Default::default()
        },
        ..RouterConfig::default()
    };
    rt.spawn(async move {
        let listener = tokio::net::TcpListener::bind(config.listen).await.unwrap();
        duet_router::serve(config, listener, std::future::pending())
            .await
            .unwrap();
    });
    http
}

/// Waits until `GET /health` answers `status` (the side routers poll their workers first).
fn wait_health(http: SocketAddr, status: u16) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(mut s) = std::net::TcpStream::connect(http) {
            let _ = write!(
                s,
                "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            );
            let mut line = String::new();
            let _ = BufReader::new(s).read_line(&mut line);
            if line.starts_with(&format!("HTTP/1.1 {status}")) {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{http}/health never said {status}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_openai_python_client_gets_what_grpc_gives_and_every_error_as_its_exception() {
    let model = checkout_default_model();
    let (c, http) = http_cluster(model.clone());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let decode: Vec<String> = c.decode.iter().map(|a| a.to_string()).collect();
    let prefill: Vec<String> = c.prefill.iter().map(|a| a.to_string()).collect();
    // Admits nothing: RESOURCE_EXHAUSTED at once.
    let limited = side_router(
        &rt,
        &c,
        &model,
        decode.clone(),
        prefill.clone(),
        RoutingOptions {
            max_queued_requests: 0,
            ..Default::default()
        },
    );
    // A 1 ms deadline: no token of the default model comes that soon.
    let deadline = side_router(
        &rt,
        &c,
        &model,
        decode,
        prefill,
        RoutingOptions {
            request_timeout_ms: 1,
            ..Default::default()
        },
    );
    // Its only decode worker does not exist: UNAVAILABLE.
    let down = side_router(
        &rt,
        &c,
        &model,
        vec![free_addr().to_string()],
        vec![],
        RoutingOptions::default(),
    );
    // Renders prompts with a template that shows the tools and teaches Hermes calls: serves
    // `tool_choice: "auto"`, which the default model's own template cannot.
    let tools = side_router(
        &rt,
        &c,
        &model,
        c.decode.iter().map(|a| a.to_string()).collect(),
        c.prefill.iter().map(|a| a.to_string()).collect(),
        RoutingOptions {
            chat_template: Some(repo().join("tests/fixtures/chat-templates/hermes-tools.jinja")),
            ..Default::default()
        },
    );
    wait_health(http, 200);
    wait_health(tools, 200);
    wait_health(limited, 200);
    wait_health(deadline, 200);
    wait_health(down, 503);

    let max_tokens = 16;
    let completion_prompt = "The capital of France is";
    let chat_messages = [("user", "What is the capital of France?")];
    let complete = |req: v1::GenerateRequest| {
        rt.block_on(async { client(c.router).await.complete(req).await })
            .unwrap()
            .into_inner()
            .text
    };
    let completion_text = complete(v1::GenerateRequest {
        prompt: completion_prompt.into(),
        max_tokens: Some(max_tokens),
        temperature: Some(0.0),
        ..Default::default()
    });
    // Token-in over gRPC: the prompt's tokens (from Tokenize) answer as its text does.
    let prompt_ids = rt
        .block_on(async {
            client(c.router)
                .await
                .tokenize(v1::TokenizeRequest {
                    text: completion_prompt.into(),
                    ..Default::default()
                })
                .await
        })
        .unwrap()
        .into_inner()
        .token_ids;
    let by_ids = complete(v1::GenerateRequest {
        token_ids: prompt_ids,
        max_tokens: Some(max_tokens),
        temperature: Some(0.0),
        ..Default::default()
    });
    assert_eq!(by_ids, completion_text);
    let chat_text = complete(v1::GenerateRequest {
        messages: chat_messages
            .iter()
            .map(|(role, content)| v1::ChatMessage {
                role: role.to_string(),
                content: content.to_string(),
                ..Default::default()
            })
            .collect(),
        max_tokens: Some(max_tokens),
        temperature: Some(0.0),
        ..Default::default()
    });
    let chat_messages: Vec<String> = chat_messages
        .iter()
        .map(|(role, content)| format!(r#"{{"role":"{role}","content":"{content}"}}"#))
        .collect();
    let json_str = |s: &str| format!("{s:?}");
    let args = format!(
        r#"{{"url":"http://{http}","limited_url":"http://{limited}","deadline_url":"http://{deadline}",
            "down_url":"http://{down}","tools_url":"http://{tools}","model":{model},"alias":{alias},"completion_prompt":{prompt},
            "completion_text":{completion},"chat_messages":[{messages}],"chat_text":{chat},
            "max_tokens":{max_tokens},"max_request_bytes":{MAX_REQUEST_BYTES}}}"#,
        model = json_str(&duet_router::model_name(&model)),
        alias = json_str(ALIAS),
        prompt = json_str(completion_prompt),
        completion = json_str(&completion_text),
        messages = chat_messages.join(","),
        chat = json_str(&chat_text),
    );
    let mut python = Command::new("python3")
        .arg(repo().join("tests/openai/conformance.py"))
        .stdin(Stdio::piped())
        .spawn()
        .expect("python3 (with PyPI `openai`, which .ci/run installs)");
    python
        .stdin
        .take()
        .unwrap()
        .write_all(args.as_bytes())
        .unwrap();
    let status = python.wait().unwrap();
    assert!(status.success(), "tests/openai/conformance.py failed");
}

/// The client reads the first chunk of a long stream, then closes its connection.
#[test]
fn an_http_client_that_disconnects_frees_its_blocks_on_both_workers() {
    let model = checkout_default_model();
    let name = duet_router::model_name(&model);
    let (c, http) = http_cluster(model);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let prompt: String = (0..60).map(|i| format!("word{i} ")).collect();
    let body = format!(
        r#"{{"model":"{name}","prompt":"{prompt}","max_tokens":3000,"ignore_eos":true,"stream":true}}"#
    );
    let mut socket = std::net::TcpStream::connect(http).unwrap();
    write!(
        socket,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reader = BufReader::new(socket.try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.starts_with("HTTP/1.1 200"), "{line}");
    while !line.starts_with("data: {") {
        line.clear();
        reader.read_line(&mut line).unwrap();
    }
    let during = rt.block_on(worker_stats(&c, c.decode[0]));
    assert!(during.kv_blocks_used > 0, "the request holds decode blocks");
    drop(reader);
    socket.shutdown(std::net::Shutdown::Both).unwrap();
    drop(socket);
    // Well before the 3000 tokens could have been generated.
    rt.block_on(wait_until_blocks_freed(
        &c,
        c.decode[0],
        c.prefill[0],
        Duration::from_secs(3),
    ));
}
