//! The router in-process on loopback against fake decode workers written here (tonic
//! `DecodeWorker` + `WorkerControl` + health): bad input, overload, failover, Complete vs
//! Generate, health and reflection.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use duet_model::model_path::ModelArgs;
use duet_proto::v1;
use duet_proto::v1::decode_worker_server::{DecodeWorker, DecodeWorkerServer};
use duet_proto::v1::generation_client::GenerationClient;
use duet_proto::v1::worker_control_server::{WorkerControl, WorkerControlServer};
use duet_router::{RouterConfig, RoutingOptions};
use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

/// Tokens every fake worker generates, in order (each message: one token, text `<id>`).
const TOKENS: [u32; 8] = [10, 11, 12, 13, 14, 15, 16, 17];
const FINGERPRINT: &str = "fp-test";

fn text_of(t: u32) -> String {
    format!("<{t}>")
}

#[derive(Clone, Copy, Debug)]
enum Behavior {
    /// Streams the tokens, then a final message.
    Fixed,
    /// Streams this many messages, then fails the stream with UNAVAILABLE.
    DieAfter(usize),
    /// Never sends anything (until cancelled).
    Block,
    /// Streams this many messages, then nothing more (a hung process), until cancelled.
    StallAfter(usize),
    /// Streams this many messages, then a last one that ends with finish_reason ERROR and
    /// [`FAILURE`] (a grammar that failed on the worker).
    FailAfter(usize),
}

const FAILURE: &str = "the fake grammar failed";

#[derive(Clone)]
struct FakeDecode {
    name: String,
    behavior: Behavior,
    free_blocks: u32,
    /// Every Decode request received.
    seen: Arc<Mutex<Vec<v1::DecodeRequest>>>,
    /// Streams whose receiver (the router) went away.
    cancelled: Arc<AtomicUsize>,
    /// How long every `Stats` call after the first takes (a busy worker).
    stats_delay: Duration,
    stats_calls: Arc<AtomicUsize>,
}

type DecodeStream = Pin<Box<dyn Stream<Item = Result<v1::DecodeResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DecodeWorker for FakeDecode {
    type DecodeStream = DecodeStream;

    async fn decode(
        &self,
        request: Request<v1::DecodeRequest>,
    ) -> Result<Response<DecodeStream>, Status> {
        assert!(
            request.metadata().get("grpc-timeout").is_some(),
            "the router must always send a deadline"
        );
        let req = request.into_inner();
        self.seen.lock().unwrap().push(req.clone());
        let (tx, rx) = mpsc::channel(4);
        let behavior = self.behavior;
        let name = self.name.clone();
        let cancelled = self.cancelled.clone();
        tokio::spawn(async move {
            if let Behavior::Block = behavior {
                tx.closed().await;
                cancelled.fetch_add(1, Ordering::SeqCst);
                return;
            }
            let max = req.sampling.as_ref().unwrap().max_tokens as usize;
            let end = max.min(TOKENS.len());
            let start = req.already_generated as usize;
            let prompt_len = req.prompt_token_ids.len() - start;
            for (sent, i) in (start..end).enumerate() {
                if let Behavior::DieAfter(n) = behavior
                    && sent == n
                {
                    let _ = tx.send(Err(Status::unavailable("fake worker died"))).await;
                    return;
                }
                if let Behavior::StallAfter(n) = behavior
                    && sent == n
                {
                    tx.closed().await;
                    cancelled.fetch_add(1, Ordering::SeqCst);
                    return;
                }
                let failing = matches!(behavior, Behavior::FailAfter(n) if sent == n);
                let last = failing || i + 1 == end;
                let msg = v1::DecodeResponse {
                    token_ids: vec![TOKENS[i]],
                    text: text_of(TOKENS[i]),
                    finish_reason: if failing {
                        v1::FinishReason::Error as i32
                    } else if last {
                        v1::FinishReason::Length as i32
                    } else {
                        0
                    },
                    error: if failing {
                        FAILURE.into()
                    } else {
                        String::new()
                    },
                    usage: last.then_some(v1::Usage {
                        prompt_tokens: prompt_len as u32,
                        completion_tokens: end as u32,
                        cached_prompt_tokens: 0,
                        // As a speculating worker: two steps, 3 drafted and 1 kept.
                        decode_steps: 2,
                        draft_tokens: 3,
                        accepted_draft_tokens: 1,
                    }),
                    timings: last.then(|| v1::Timings {
                        decode_worker: name.clone(),
                        prefill_worker: name.clone(),
                        prefill_local: true,
                        ..Default::default()
                    }),
                    ..Default::default()
                };
                if tx.send(Ok(msg)).await.is_err() || last {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

#[tonic::async_trait]
impl WorkerControl for FakeDecode {
    async fn stats(
        &self,
        _request: Request<v1::StatsRequest>,
    ) -> Result<Response<v1::StatsResponse>, Status> {
        if self.stats_calls.fetch_add(1, Ordering::SeqCst) > 0 {
            tokio::time::sleep(self.stats_delay).await;
        }
        Ok(Response::new(v1::StatsResponse {
            role: v1::WorkerRole::Decode as i32,
            worker_id: self.name.clone(),
            kv_blocks_total: 2000,
            kv_blocks_free: self.free_blocks,
            block_size: 16,
            model_fingerprint: FINGERPRINT.into(),
            ..Default::default()
        }))
    }
}

impl FakeDecode {
    fn new(name: &str, behavior: Behavior, free_blocks: u32) -> Self {
        Self {
            name: name.into(),
            behavior,
            free_blocks,
            seen: Arc::default(),
            cancelled: Arc::default(),
            stats_delay: Duration::ZERO,
            stats_calls: Arc::default(),
        }
    }

    fn seen(&self) -> Vec<v1::DecodeRequest> {
        self.seen.lock().unwrap().clone()
    }

    async fn spawn(&self) -> SocketAddr {
        self.spawn_on(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap())
            .await
    }

    async fn spawn_on(&self, listener: tokio::net::TcpListener) -> SocketAddr {
        let addr = listener.local_addr().unwrap();
        let (reporter, health) = tonic_health::server::health_reporter();
        reporter
            .set_service_status("", tonic_health::ServingStatus::Serving)
            .await;
        let svc = self.clone();
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(health)
                .add_service(DecodeWorkerServer::new(svc.clone()))
                .add_service(WorkerControlServer::new(svc))
                .serve_with_incoming(TcpListenerStream::new(listener))
                .await
                .unwrap();
        });
        addr
    }
}

fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama")
}

fn config(decode: Vec<String>, max_queued: usize) -> RouterConfig {
    RouterConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        http_listen: None,
        prefill: vec![],
        decode,
        model: ModelArgs {
            model: Some(model_dir()),
            models_dir: PathBuf::from("models"),
        },
        routing: RoutingOptions {
            max_queued_requests: max_queued,
            stats_interval_ms: 50,
            wait_for_worker_ms: 500,
            decode_idle_timeout_ms: 300,
            request_timeout_ms: 30_000,
            ..Default::default()
        },
        ..Default::default()
    }
}

struct Router {
    addr: SocketAddr,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl Router {
    async fn client(&self) -> GenerationClient<Channel> {
        GenerationClient::connect(format!("http://{}", self.addr))
            .await
            .unwrap()
    }

    async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.addr))
            .unwrap()
            .connect()
            .await
            .unwrap()
    }
}

/// Starts the router against `workers`; with `wait_healthy`, returns once Info shows every
/// decode worker healthy.
async fn start_router(workers: &[&FakeDecode], max_queued: usize, wait_healthy: bool) -> Router {
    let mut addrs = vec![];
    for w in workers {
        addrs.push(w.spawn().await.to_string());
    }
    start_router_at(addrs, max_queued, wait_healthy).await
}

async fn start_router_at(decode: Vec<String>, max_queued: usize, wait_healthy: bool) -> Router {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let n = decode.len();
    tokio::spawn(async move {
        duet_router::serve(config(decode, max_queued), listener, async {
            let _ = stopped.await;
        })
        .await
        .unwrap();
    });
    let router = Router { addr, _stop: stop };
    if wait_healthy {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(mut c) = GenerationClient::connect(format!("http://{addr}")).await
                && let Ok(info) = c.info(v1::InfoRequest {}).await
            {
                let info = info.into_inner();
                if info.decode_workers.len() == n && info.decode_workers.iter().all(|w| w.healthy) {
                    break;
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "workers never became healthy"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    router
}

fn req(prompt: &str, max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        prompt: prompt.into(),
        max_tokens: Some(max_tokens),
        seed: Some(1234),
        ..Default::default()
    }
}

/// Runs Generate to the end: every message, or the status that ended it.
async fn generate_all(
    client: &mut GenerationClient<Channel>,
    r: v1::GenerateRequest,
) -> (Vec<v1::GenerateResponse>, Option<Status>) {
    let mut stream = match client.generate(r).await {
        Ok(s) => s.into_inner(),
        Err(s) => return (vec![], Some(s)),
    };
    let mut out = vec![];
    while let Some(item) = stream.next().await {
        match item {
            Ok(m) => out.push(m),
            Err(s) => return (out, Some(s)),
        }
    }
    (out, None)
}

fn tokens(msgs: &[v1::GenerateResponse]) -> Vec<u32> {
    msgs.iter().flat_map(|m| m.token_ids.clone()).collect()
}

fn text(msgs: &[v1::GenerateResponse]) -> String {
    msgs.iter().map(|m| m.text.as_str()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_are_invalid_argument_and_serving_goes_on() {
    let w = FakeDecode::new("d1", Behavior::Fixed, 100);
    let router = start_router(&[&w], 16, true).await;
    let mut c = router.client().await;
    let chat = |role: &str| v1::GenerateRequest {
        messages: vec![v1::ChatMessage {
            role: role.into(),
            content: "hi".into(),
            ..Default::default()
        }],
        ..Default::default()
    };
    let cases: Vec<(v1::GenerateRequest, &[&str])> = vec![
        (v1::GenerateRequest::default(), &["empty prompt"]),
        (
            v1::GenerateRequest {
                token_ids: vec![5; 300],
                ..Default::default()
            },
            &["prompt too long", "300 tokens", "256"],
        ),
        (
            v1::GenerateRequest {
                token_ids: vec![1, 2, 999],
                ..Default::default()
            },
            &["token_ids[2] = 999", "outside the vocabulary"],
        ),
        (req("hello", 0), &["max_tokens must be at least 1"]),
        (req("hello", 10_000), &["max_tokens 10000 past the context"]),
        (
            v1::GenerateRequest {
                temperature: Some(-1.0),
                ..req("hello", 4)
            },
            &["temperature must be >= 0"],
        ),
        (
            v1::GenerateRequest {
                top_p: Some(0.0),
                ..req("hello", 4)
            },
            &["top_p must be in (0, 1]"],
        ),
        (
            v1::GenerateRequest {
                top_k: -3,
                ..req("hello", 4)
            },
            &["top_k must be >= 0"],
        ),
        (
            v1::GenerateRequest {
                min_p: Some(2.0),
                ..req("hello", 4)
            },
            &["min_p"],
        ),
        (
            v1::GenerateRequest {
                presence_penalty: Some(5.0),
                ..req("hello", 4)
            },
            &["presence_penalty"],
        ),
        (
            v1::GenerateRequest {
                stop: (0..17).map(|i| i.to_string()).collect(),
                ..req("hello", 4)
            },
            &["at most 16 stop strings"],
        ),
        (
            v1::GenerateRequest {
                stop: vec!["z".repeat(300)],
                ..req("hello", 4)
            },
            &["at most 256 bytes"],
        ),
        (
            v1::GenerateRequest {
                logprobs: 21,
                ..req("hello", 4)
            },
            &["logprobs must be at most 20"],
        ),
        (chat("wizard"), &["unknown chat role \"wizard\""]),
        (
            v1::GenerateRequest {
                stop_token_ids: vec![384],
                ..req("hello", 4)
            },
            &["stop_token_ids[0] = 384"],
        ),
    ];
    for (r, words) in cases {
        for status in [
            c.generate(r.clone()).await.err(),
            c.complete(r.clone()).await.err(),
        ] {
            let s = status.unwrap_or_else(|| panic!("{r:?} was accepted"));
            assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
            for word in words {
                assert!(
                    s.message().contains(word),
                    "{:?} lacks {word:?}",
                    s.message()
                );
            }
        }
    }
    assert!(w.seen().is_empty(), "nothing bad reached the worker");

    // A good request still works; the router resolved every parameter.
    let (msgs, err) = generate_all(&mut c, req("hello world", 3)).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(tokens(&msgs), [10, 11, 12]);
    let last = msgs.last().unwrap();
    assert_eq!(last.finish_reason, v1::FinishReason::Length as i32);
    assert!(!last.request_id.is_empty());
    assert!(msgs.iter().all(|m| m.request_id == last.request_id));
    let usage = last.usage.unwrap();
    assert_eq!(usage.completion_tokens, 3);
    assert_eq!(
        (
            usage.decode_steps,
            usage.draft_tokens,
            usage.accepted_draft_tokens
        ),
        (2, 3, 1),
        "the worker's speculation is relayed"
    );
    let prompt = c
        .tokenize(v1::TokenizeRequest {
            text: "hello world".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(usage.prompt_tokens as usize, prompt.token_ids.len());
    assert_eq!(prompt.tokens.len(), prompt.token_ids.len());
    let t = last.timings.clone().unwrap();
    assert_eq!(t.decode_worker, "d1");
    assert!(t.total_ms >= t.ttft_ms && t.ttft_ms > 0.0, "{t:?}");
    let seen = w.seen();
    assert_eq!(seen.len(), 1);
    let d = &seen[0];
    assert_eq!(d.prompt_token_ids, prompt.token_ids);
    assert_eq!(d.already_generated, 0);
    assert!(
        d.plan.as_ref().unwrap().local,
        "short prompt, no prefill workers"
    );
    assert_eq!(d.model_fingerprint, FINGERPRINT);
    let s = d.sampling.clone().unwrap();
    assert_eq!((s.max_tokens, s.seed, s.top_p), (3, Some(1234), 1.0));

    // Unset max_tokens: the default lowered to fit; an unset seed is still sent.
    let r = v1::GenerateRequest {
        token_ids: vec![1; 250],
        ..Default::default()
    };
    let (_, err) = generate_all(&mut c, r).await;
    assert!(err.is_none(), "{err:?}");
    let s = w.seen()[1].sampling.clone().unwrap();
    assert_eq!(s.max_tokens, 6);
    assert!(s.seed.is_some());

    let info = c.info(v1::InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.model, "tiny-llama");
    assert_eq!(info.model_fingerprint, FINGERPRINT);
    assert_eq!((info.context_length, info.vocab_size), (256, 384));
    assert_eq!((info.default_max_tokens, info.block_size), (256, 16));
    assert_eq!(info.decode_workers[0].id, "d1");
    assert_eq!(info.decode_workers[0].kv_blocks_free, 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_is_resource_exhausted_at_once() {
    let w = FakeDecode::new("blocker", Behavior::Block, 100);
    let router = start_router(&[&w], 2, true).await;
    let mut c = router.client().await;
    let a = c.generate(req("one", 4)).await.unwrap().into_inner();
    let b = c.generate(req("two", 4)).await.unwrap().into_inner();
    let t = std::time::Instant::now();
    let s = c.generate(req("three", 4)).await.unwrap_err();
    assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
    assert!(s.message().contains("overloaded"), "{}", s.message());
    let s = c.complete(req("four", 4)).await.unwrap_err();
    assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
    assert!(t.elapsed() < Duration::from_secs(2), "rejected at once");

    // Dropping the client streams cancels the upstream calls and frees the slots.
    drop((a, b));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while w.cancelled.load(Ordering::SeqCst) < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "upstream calls were not cancelled"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match c.generate(req("five", 4)).await {
            Ok(_) => break,
            Err(s) => assert_eq!(s.code(), Code::ResourceExhausted),
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "slots were never freed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_deadline_is_deadline_exceeded() {
    let w = FakeDecode::new("blocker", Behavior::Block, 100);
    let router = start_router(&[&w], 4, true).await;
    let mut c = router.client().await;
    let mut r = Request::new(req("slow", 4));
    r.set_timeout(Duration::from_millis(300));
    let stream = c.generate(r).await;
    let status = match stream {
        Err(s) => s,
        Ok(s) => s.into_inner().next().await.unwrap().unwrap_err(),
    };
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    // The worker got a deadline no longer than the client's.
    let seen = w.seen();
    assert_eq!(seen.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_continues_the_stream_without_repeats() {
    // The dying worker has more free blocks, so it is chosen first.
    let dying = FakeDecode::new("dying", Behavior::DieAfter(2), 1000);
    let good = FakeDecode::new("good", Behavior::Fixed, 10);
    let router = start_router(&[&dying, &good], 16, true).await;
    let mut c = router.client().await;
    let (msgs, err) = generate_all(&mut c, req("hello world", 6)).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(tokens(&msgs), TOKENS[..6]);
    let expect: String = TOKENS[..6].iter().map(|&t| text_of(t)).collect();
    assert_eq!(text(&msgs), expect);
    let last = msgs.last().unwrap();
    assert_eq!(last.finish_reason, v1::FinishReason::Length as i32);
    assert_eq!(last.usage.unwrap().completion_tokens, 6);
    let t = last.timings.clone().unwrap();
    assert_eq!((t.decode_failovers, t.decode_worker.as_str()), (1, "good"));

    let first = dying.seen();
    let second = good.seen();
    assert_eq!((first.len(), second.len()), (1, 1));
    let (first, second) = (&first[0], &second[0]);
    assert_eq!(first.already_generated, 0);
    assert_eq!(second.already_generated, 2);
    assert_eq!(
        second.already_sent_text_bytes as usize,
        text_of(10).len() + text_of(11).len()
    );
    let mut resumed = first.prompt_token_ids.clone();
    resumed.extend_from_slice(&TOKENS[..2]);
    assert_eq!(second.prompt_token_ids, resumed);
    assert_eq!(second.request_id, first.request_id);
    assert_eq!(second.sampling, first.sampling, "same seed and parameters");

    // Complete over the same failover gives the same whole answer.
    let whole = c
        .complete(req("hello world", 6))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(whole.token_ids, TOKENS[..6]);
    assert_eq!(whole.text, expect);
}

/// A stream that stops mid-way (its worker hung) fails over after the idle timeout and goes on
/// elsewhere without repeats; the hung stream is cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_stream_fails_over_after_the_idle_timeout() {
    let stalling = FakeDecode::new("stalling", Behavior::StallAfter(3), 1000);
    let good = FakeDecode::new("good", Behavior::Fixed, 10);
    let router = start_router(&[&stalling, &good], 16, true).await;
    let mut c = router.client().await;
    let started = tokio::time::Instant::now();
    let (msgs, err) = generate_all(&mut c, req("hello world", 6)).await;
    assert!(err.is_none(), "{err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(tokens(&msgs), TOKENS[..6]);
    let t = msgs.last().unwrap().timings.clone().unwrap();
    assert_eq!((t.decode_failovers, t.decode_worker.as_str()), (1, "good"));
    assert_eq!(good.seen()[0].already_generated, 3);
    assert_eq!(stalling.cancelled.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_decode_workers_failing_is_unavailable() {
    let a = FakeDecode::new("a", Behavior::DieAfter(2), 1000);
    let b = FakeDecode::new("b", Behavior::DieAfter(2), 10);
    let router = start_router(&[&a, &b], 16, true).await;
    let mut c = router.client().await;
    let (msgs, err) = generate_all(&mut c, req("hello world", 8)).await;
    let err = err.expect("the stream fails");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("decode worker"), "{}", err.message());
    // Two tokens from each, none repeated.
    assert_eq!(tokens(&msgs), TOKENS[..4]);

    // Nothing listening: UNAVAILABLE once the wait for a worker is over.
    let dead = start_router_at(vec!["127.0.0.1:9".into()], 4, false).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let s = dead
        .client()
        .await
        .generate(req("hi", 2))
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::Unavailable, "{s:?}");
    assert!(
        s.message().contains("no healthy decode worker"),
        "{}",
        s.message()
    );
}

/// A decode worker whose stats answer slower than the poll timeout (its engine busy) stays in
/// rotation: health comes from the health check on the poll connection, and no request fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_with_slow_stats_stays_in_rotation() {
    let w = FakeDecode {
        stats_delay: Duration::from_secs(2),
        ..FakeDecode::new("busy", Behavior::Fixed, 100)
    };
    let router = start_router(&[&w], 16, true).await;
    let mut c = router.client().await;
    let started = tokio::time::Instant::now();
    let mut served = 0;
    // Many polls (50 ms apart, 200 ms timeout) time out on stats meanwhile.
    while started.elapsed() < Duration::from_millis(1500) {
        let (msgs, err) = generate_all(&mut c, req("hello", 3)).await;
        assert!(err.is_none(), "request {served} failed: {err:?}");
        assert_eq!(tokens(&msgs), TOKENS[..3]);
        served += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        w.stats_calls.load(Ordering::SeqCst) > 1,
        "stats were polled again"
    );
    let info = c.info(v1::InfoRequest {}).await.unwrap().into_inner();
    assert!(info.decode_workers[0].healthy, "{info:?}");
}

/// A request that finds no routable decode worker waits (within its deadline, up to
/// `--wait-for-worker-ms`) for one to come back instead of failing at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_for_a_decode_worker_to_come_back() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let router = start_router_at(vec![addr.to_string()], 4, false).await;
    let mut c = router.client().await;
    let pending = tokio::spawn(async move { generate_all(&mut c, req("hello", 4)).await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let w = FakeDecode::new("late", Behavior::Fixed, 100);
    w.spawn_on(tokio::net::TcpListener::bind(addr).await.unwrap())
        .await;
    let (msgs, err) = pending.await.unwrap();
    assert!(err.is_none(), "{err:?}");
    assert_eq!(tokens(&msgs), TOKENS[..4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_equals_concatenated_generate() {
    let w = FakeDecode::new("d1", Behavior::Fixed, 100);
    let router = start_router(&[&w], 16, true).await;
    let mut c = router.client().await;
    let r = v1::GenerateRequest {
        request_id: "mine".into(),
        messages: vec![v1::ChatMessage {
            role: "user".into(),
            content: "hi".into(),
            ..Default::default()
        }],
        max_tokens: Some(5),
        ..Default::default()
    };
    let (msgs, err) = generate_all(&mut c, r.clone()).await;
    assert!(err.is_none(), "{err:?}");
    assert!(msgs.len() > 1, "streamed in pieces");
    let whole = c.complete(r).await.unwrap().into_inner();
    assert_eq!(whole.request_id, "mine");
    assert_eq!(whole.token_ids, tokens(&msgs));
    assert_eq!(whole.text, text(&msgs));
    let last = msgs.last().unwrap();
    assert_eq!(whole.finish_reason, last.finish_reason);
    assert_eq!(whole.usage, last.usage);
    assert!(whole.timings.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_reflection_are_served() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    let router = start_router_at(vec![], 4, false).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let ch = router.channel().await;
    let mut health = HealthClient::new(ch.clone());
    for service in ["", "duet.v1.Generation"] {
        let r = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.status, 1, "{service:?} is SERVING");
    }
    let mut refl = ServerReflectionClient::new(ch);
    let out = refl
        .server_reflection_info(futures::stream::iter([ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        }]))
        .await
        .unwrap()
        .into_inner()
        .next()
        .await
        .unwrap()
        .unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = out.message_response else {
        panic!("{out:?}");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(names.iter().any(|n| n == "duet.v1.Generation"), "{names:?}");
    assert!(
        names.iter().any(|n| n == "grpc.health.v1.Health"),
        "{names:?}"
    );
}

/// `GenerateRequest.prompt` (field 2) as bytes: what a client sending invalid UTF-8 encodes.
#[derive(Clone, PartialEq, prost::Message)]
struct RawPrompt {
    #[prost(bytes = "vec", tag = "2")]
    prompt: Vec<u8>,
}

async fn complete_raw(router: &Router, prompt: Vec<u8>) -> Status {
    let mut grpc = tonic::client::Grpc::new(router.channel().await);
    grpc.ready().await.unwrap();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/duet.v1.Generation/Complete");
    grpc.unary::<RawPrompt, v1::GenerateResponse, _>(
        Request::new(RawPrompt { prompt }),
        path,
        tonic_prost::ProstCodec::default(),
    )
    .await
    .unwrap_err()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_requests_are_invalid_argument_saying_what_was_wrong() {
    let router = start_router_at(vec![], 8, false).await;
    let s = complete_raw(&router, vec![b'h', 0xff, 0xfe]).await;
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    assert!(
        s.message().contains("GenerateRequest.prompt") && s.message().contains("UTF-8"),
        "{s:?}"
    );
    let s = complete_raw(&router, vec![b'a'; 5 << 20]).await;
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    assert!(s.message().contains("too large"), "{s:?}");
}

/// A router started on its own with neither decode workers nor a registry could never serve: it
/// is refused at start, saying what it needs, before it binds its port.
#[test]
fn a_router_with_no_way_to_find_decode_workers_is_refused() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_duet-router"))
        .args(["--listen", "127.0.0.1:0"])
        .env_remove("DUET_DECODE_WORKERS")
        .env_remove("DUET_ETCD")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--decode ADDR"), "{err}");
    assert!(err.contains("--etcd URL"), "{err}");
}

/// A generation that ends with finish_reason ERROR on its worker (a grammar that failed part
/// way) reaches the client so, with the reason, streamed and whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_generation_reaches_the_client_with_its_error() {
    let w = FakeDecode::new("d1", Behavior::FailAfter(2), 100);
    let router = start_router(&[&w], 16, true).await;
    let mut c = router.client().await;
    let (msgs, status) = generate_all(&mut c, req("hi", 8)).await;
    assert!(status.is_none(), "{status:?}");
    assert_eq!(tokens(&msgs), TOKENS[..3]);
    let last = msgs.last().unwrap();
    assert_eq!(
        (last.finish_reason, last.error.as_str()),
        (v1::FinishReason::Error as i32, FAILURE)
    );
    assert!(msgs[..msgs.len() - 1].iter().all(|m| m.error.is_empty()));
    let whole = c.complete(req("hi", 8)).await.unwrap().into_inner();
    assert_eq!(
        (whole.finish_reason, whole.error.as_str()),
        (v1::FinishReason::Error as i32, FAILURE)
    );
    assert_eq!(whole.token_ids, TOKENS[..3]);
}
