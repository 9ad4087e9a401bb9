//! The decode worker on its own: local prefill, fallback when every prefill worker is down,
//! KV pushes it must refuse, cancellation freeing blocks.

use std::path::PathBuf;
use std::time::Duration;

use duet_decode_worker::{DecodeConfig, serve};
use duet_engine::backend::{KvDtype, KvLayout};
use duet_engine::engine::EngineOptions;
use duet_model::params::SamplingParams;
use duet_model::params::StopCriteria;
use duet_proto::v1;
use duet_transfer::grpc::GrpcTransport;
use duet_transfer::{KvTransport, PushSpec, ReservationKey};
use duet_worker::WorkerArgs;
use futures::StreamExt;
use std::sync::{Arc, Mutex};
use tonic::Status;

fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama")
}

fn options() -> EngineOptions {
    EngineOptions {
        threads: 1,
        block_size: 4,
        kv_cache_tokens: 1024,
        max_step_tokens: 64,
        ..Default::default()
    }
}

/// A decode worker on the tiny model whose plans may name the prefill workers at `prefill`.
async fn start(prefill: &[String]) -> String {
    start_with_metrics(prefill, None).await
}

/// [`start`], serving Prometheus metrics on `metrics`.
async fn start_with_metrics(prefill: &[String], metrics: Option<std::net::SocketAddr>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = DecodeConfig {
        listen: addr,
        prefill: prefill.to_vec(),
        reservation_timeout_ms: 2_000,
        prefill_timeout_ms: 2_000,
        worker: WorkerArgs {
            // Its own id: the process's one metrics registry tells the tests' workers apart by it.
            worker_id: Some(format!("decode-test-{}", addr.port())),
            engine: options(),
            metrics: duet_telemetry::MetricsArgs {
                metrics_listen: metrics,
            },
            ..WorkerArgs::for_model(tiny())
        },
        ..Default::default()
    };
    tokio::spawn(serve(config, listener, std::future::pending()));
    let url = format!("http://{addr}");
    for _ in 0..200 {
        if let Ok(mut c) =
            v1::worker_control_client::WorkerControlClient::connect(url.clone()).await
            && c.stats(v1::StatsRequest {}).await.is_ok()
        {
            return url;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("decode worker did not start");
}

async fn stats(url: &str) -> v1::StatsResponse {
    let mut c = v1::worker_control_client::WorkerControlClient::connect(url.to_string())
        .await
        .unwrap();
    c.stats(v1::StatsRequest {}).await.unwrap().into_inner()
}

fn prompt() -> Vec<u32> {
    (0..23u32).map(|i| 3 + (i * 37) % 370).collect()
}

fn reference(prompt: &[u32], n: usize) -> Vec<u32> {
    let mut e = duet_cpu::load_engine(&tiny(), options()).unwrap();
    let id = e
        .add_sequence(
            prompt.to_vec(),
            SamplingParams::greedy(),
            StopCriteria {
                max_tokens: n,
                ignore_eos: true,
                ..Default::default()
            },
        )
        .unwrap();
    while e.has_work() {
        e.step().unwrap();
    }
    e.tokens(id).unwrap()[prompt.len()..].to_vec()
}

fn request(plan: v1::PrefillPlan, n: u32) -> v1::DecodeRequest {
    v1::DecodeRequest {
        request_id: "r1".into(),
        prompt_token_ids: prompt(),
        sampling: Some(v1::SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            max_tokens: n,
            ignore_eos: true,
            ..Default::default()
        }),
        plan: Some(plan),
        ..Default::default()
    }
}

async fn collect(url: &str, req: v1::DecodeRequest) -> (Vec<u32>, v1::DecodeResponse) {
    let mut client = v1::decode_worker_client::DecodeWorkerClient::connect(url.to_string())
        .await
        .unwrap();
    let mut stream = client.decode(req).await.unwrap().into_inner();
    let mut tokens = Vec::new();
    let mut last = None;
    while let Some(msg) = stream.next().await {
        let msg = msg.unwrap();
        tokens.extend(&msg.token_ids);
        last = Some(msg);
    }
    (tokens, last.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_prefill_streams_the_engines_tokens() {
    let url = start(&[]).await;
    let (tokens, last) = collect(
        &url,
        request(
            v1::PrefillPlan {
                local: true,
                prefill_workers: vec![],
            },
            9,
        ),
    )
    .await;
    assert_eq!(tokens, reference(&prompt(), 9));
    assert_eq!(last.finish_reason, v1::FinishReason::Length as i32);
    assert_eq!(last.usage.unwrap().completion_tokens, 9);
    let timings = last.timings.unwrap();
    assert!(timings.prefill_local);
    // The time to first token split for a prompt prefilled here: its queue and its compute.
    assert!(timings.prefill_ms > 0.0, "{timings:?}");
    assert!(timings.transfer_ms == 0.0 && timings.queue_ms >= 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_prefill_workers_fall_back_to_local_prefill() {
    let metrics = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let url =
        start_with_metrics(&["127.0.0.1:1".into(), "127.0.0.1:2".into()], Some(metrics)).await;
    let plan = v1::PrefillPlan {
        local: false,
        prefill_workers: vec![
            v1::PrefillTarget {
                worker_id: "gone-1".into(),
                address: "127.0.0.1:1".into(),
            },
            v1::PrefillTarget {
                worker_id: "gone-2".into(),
                address: "127.0.0.1:2".into(),
            },
        ],
    };
    let (tokens, last) = collect(&url, request(plan, 6)).await;
    assert_eq!(tokens, reference(&prompt(), 6));
    let t = last.timings.unwrap();
    assert!(t.prefill_local);
    assert_eq!(t.prefill_retries, 2);
    // The fallback is counted by its reason (the registry holds every test's workers).
    let scraped = scrape(metrics).await;
    let port = url.rsplit(':').next().unwrap();
    let line = |reason: &str| {
        scraped
            .lines()
            .find(|l| {
                l.starts_with("duet_local_prefill_fallbacks_total{")
                    && l.contains(&format!("engine=\"decode-test-{port}\""))
                    && l.contains(&format!("reason=\"{reason}\""))
            })
            .unwrap_or_else(|| panic!("no {reason} fallbacks in\n{scraped}"))
            .to_string()
    };
    assert!(
        line("unreachable").ends_with(" 1"),
        "{}",
        line("unreachable")
    );
    assert!(
        line("refused_push").ends_with(" 0"),
        "{}",
        line("refused_push")
    );
    // Nothing is left reserved or running.
    let s = stats(&url).await;
    assert_eq!((s.reservations_outstanding, s.kv_blocks_used), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_that_do_not_fit_are_refused() {
    let url = start(&[]).await;
    let mut kv = v1::kv_transfer_client::KvTransferClient::connect(url.clone())
        .await
        .unwrap();
    let header = |fingerprint: &str| v1::KvChunk {
        kind: Some(v1::kv_chunk::Kind::Header(v1::KvHeader {
            reservation_id: ReservationKey::random().to_wire(),
            model_fingerprint: fingerprint.into(),
            block_size: 4,
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 16,
            dtype: "f32".into(),
            layout: duet_proto::KV_WIRE_LAYOUT.into(),
            ..Default::default()
        })),
    };
    let err = kv
        .push(futures::stream::iter(vec![header("another model")]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
    // The right fingerprint but no such reservation: not accepted.
    let fp = stats(&url).await.model_fingerprint;
    let ack = kv
        .push(futures::stream::iter(vec![header(&fp)]))
        .await
        .unwrap()
        .into_inner();
    assert!(!ack.accepted);
}

/// A prefill worker that, asked to prefill, forges pushes into the reservation it was given
/// instead: as another worker, into the cached (shared prefix) blocks, and to a guessed
/// reservation. It reports how each was answered and then fails, so the decode worker
/// prefills locally.
struct Forger {
    wire: duet_transfer::KvWire,
    answers: Arc<Mutex<Vec<Result<(), tonic::Code>>>>,
}

const FORGER: &str = "forger";

impl Forger {
    async fn push(
        &self,
        dest: &v1::KvDestination,
        key: ReservationKey,
        sender: &str,
        blocks: std::ops::Range<usize>,
        num_tokens: usize,
    ) -> Result<(), tonic::Code> {
        let open = GrpcTransport::default()
            .open(
                &self.wire,
                PushSpec {
                    address: dest.transfer_address.clone(),
                    reservation_id: key,
                    request_id: "forged".into(),
                    blocks: blocks.clone(),
                    num_tokens,
                    sender_worker_id: sender.into(),
                    timeout: Duration::from_secs(10),
                    dest_block_ids: dest.block_ids.clone(),
                    offered: v1::TransportKind::Grpc,
                    transport_params: Vec::new(),
                },
            )
            .unwrap();
        let mut sender = open.sender;
        let block_bytes = self.wire.block_bytes();
        for layer in 0..self.wire.layout.num_layers {
            sender
                .send_layer(layer, blocks.clone(), &mut |range, out| {
                    out.extend(std::iter::repeat_n(0x7f, range.len() * block_bytes));
                    Ok(())
                })
                .unwrap();
        }
        sender.finish();
        match open.acked.await {
            Ok(_) => Ok(()),
            Err(e) => Err(Status::from(e).code()),
        }
    }
}

#[tonic::async_trait]
impl v1::prefill_worker_server::PrefillWorker for Forger {
    async fn prefill(
        &self,
        request: tonic::Request<v1::PrefillRequest>,
    ) -> Result<tonic::Response<v1::PrefillResponse>, Status> {
        let req = request.into_inner();
        let dest = req.dest.unwrap();
        let key = ReservationKey::from_wire(&dest.reservation_id).unwrap();
        let (n, all) = (req.token_ids.len(), 0..dest.block_ids.len());
        let uncached = dest.cached_blocks as usize..dest.block_ids.len();
        let answers = vec![
            self.push(&dest, key, FORGER, all, n).await,
            self.push(&dest, key, "intruder", uncached.clone(), n).await,
            self.push(&dest, ReservationKey::random(), FORGER, uncached, n)
                .await,
        ];
        *self.answers.lock().unwrap() = answers;
        Err(Status::unavailable("forged"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_pushes_are_refused_and_the_prefix_cache_stays_intact() {
    // The forger is a member (listed): its pushes are what is refused.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let forger_addr = listener.local_addr().unwrap();
    let url = start(&[forger_addr.to_string()]).await;
    let local = || v1::PrefillPlan {
        local: true,
        prefill_workers: vec![],
    };
    let (before, _) = collect(&url, request(local(), 8)).await;
    assert_eq!(before, reference(&prompt(), 8));

    let fingerprint = stats(&url).await.model_fingerprint;
    let answers = Arc::new(Mutex::new(Vec::new()));
    let forger = Forger {
        wire: duet_transfer::KvWire {
            fingerprint,
            layout: KvLayout {
                num_layers: 2,
                num_kv_heads: 2,
                head_dim: 16,
                block_size: 4,
                num_blocks: 256,
                dtype: KvDtype::F32,
            },
        },
        answers: answers.clone(),
    };
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(v1::prefill_worker_server::PrefillWorkerServer::new(forger))
            .serve_with_incoming(duet_proto::incoming(listener)),
    );
    let plan = v1::PrefillPlan {
        local: false,
        prefill_workers: vec![v1::PrefillTarget {
            worker_id: FORGER.into(),
            address: forger_addr.to_string(),
        }],
    };
    let (during, _) = collect(&url, request(plan, 8)).await;
    let answers = answers.lock().unwrap().clone();
    use tonic::Code::PermissionDenied;
    assert_eq!(
        answers,
        [
            Err(PermissionDenied),
            Err(PermissionDenied),
            Err(tonic::Code::Unavailable)
        ],
        "into cached blocks, by another worker, to a guessed reservation"
    );
    // The request sharing the prefix, and every later one, reads the cache as it was.
    assert_eq!(during, before);
    let (after, last) = collect(&url, request(local(), 8)).await;
    assert_eq!(after, before);
    assert!(
        last.usage.unwrap().cached_prompt_tokens >= 20,
        "the prefix was cached"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_stream_frees_the_blocks() {
    let url = start(&[]).await;
    let mut client = v1::decode_worker_client::DecodeWorkerClient::connect(url.clone())
        .await
        .unwrap();
    let mut stream = client
        .decode(request(
            v1::PrefillPlan {
                local: true,
                prefill_workers: vec![],
            },
            200,
        ))
        .await
        .unwrap()
        .into_inner();
    stream.next().await.unwrap().unwrap();
    drop(stream);
    for _ in 0..100 {
        let s = stats(&url).await;
        if s.running_sequences == 0 && s.kv_blocks_used == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the cancelled request still holds KV blocks");
}

/// A Decode call whose plan names only prefill workers outside the cluster (neither a card nor
/// --prefill) is prefilled here: the named workers are never called (they could place no block
/// in any cache, nor receive the prompt), the request is served, and the fallback is counted in
/// `Stats`. The worker's `Stats` say which prefill workers it accepts, so a router plans within
/// them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_naming_only_workers_outside_the_cluster_is_prefilled_here() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let outsider = listener.local_addr().unwrap();
    let called = Arc::new(Mutex::new(false));
    let url = start(&["127.0.0.1:1".into()]).await;
    {
        let called = called.clone();
        tokio::spawn(async move {
            // Any connection at all would mean the decode worker dialled the outsider.
            if listener.accept().await.is_ok() {
                *called.lock().unwrap() = true;
            }
        });
    }
    let accepted = stats(&url).await.accepted_prefill_workers.unwrap();
    assert_eq!(accepted.addresses, ["127.0.0.1:1"]);
    for (worker_id, address) in [
        ("outsider", outsider.to_string()),
        // A listed address cannot lend a member's standing to another name at another port.
        ("127.0.0.1:1", outsider.to_string()),
    ] {
        let plan = v1::PrefillPlan {
            local: false,
            prefill_workers: vec![v1::PrefillTarget {
                worker_id: worker_id.into(),
                address,
            }],
        };
        let (tokens, last) = collect(&url, request(plan, 4)).await;
        assert_eq!(tokens, reference(&prompt(), 4));
        assert!(last.timings.unwrap().prefill_local, "prefilled here");
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!*called.lock().unwrap(), "the outsider was never called");
    let s = stats(&url).await;
    assert_eq!(s.refused_prefill_plans, 2);
    assert_eq!((s.reservations_outstanding, s.kv_blocks_used), (0, 0));
}

/// The Prometheus text a worker serves on `addr`.
async fn scrape(addr: std::net::SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    stream.read_to_string(&mut body).await.unwrap();
    body
}

/// A request whose grammar fails part way (a failover replaying a token the grammar forbids)
/// ends with finish_reason ERROR and the reason, counted in `duet_grammar_failures_total`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grammar_that_fails_ends_the_stream_with_the_error() {
    let metrics = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let url = start_with_metrics(&[], Some(metrics)).await;
    let mut req = request(
        v1::PrefillPlan {
            local: true,
            prefill_workers: vec![],
        },
        20,
    );
    // "1" and then "a" were streamed by a decode worker that died: "a" breaks the grammar.
    req.prompt_token_ids
        .extend([3 + u32::from(b'1'), 3 + u32::from(b'a')]);
    req.already_generated = 2;
    req.already_sent_text_bytes = 2;
    req.sampling.as_mut().unwrap().constraint = Some(v1::Constraint {
        kind: Some(v1::constraint::Kind::Regex("[0-9]{8}".into())),
    });
    let (_, last) = collect(&url, req).await;
    assert_eq!(last.finish_reason, v1::FinishReason::Error as i32);
    assert!(!last.error.is_empty());
    let scraped = scrape(metrics).await;
    let port = url.rsplit(':').next().unwrap();
    let counted = scraped.lines().find(|l| {
        l.starts_with("duet_grammar_failures_total{")
            && l.contains(&format!("engine=\"decode-test-{port}\""))
    });
    assert!(
        counted.is_some_and(|l| l.ends_with(" 1")),
        "{counted:?} in\n{scraped}"
    );
}
