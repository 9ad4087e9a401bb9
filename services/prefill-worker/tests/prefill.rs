//! End-to-end tests of a prefill worker served in-process on loopback, pushing KV into a fake
//! `KvTransfer` server that records what arrives, checked against a local engine running the
//! same tiny model.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use duet_engine::engine::EngineOptions;
use duet_model::params::SamplingParams;
use duet_model::params::StopCriteria;
use duet_prefill_worker::PrefillConfig;
use duet_proto::v1::kv_chunk::Kind;
use duet_proto::v1::kv_transfer_server::{KvTransfer, KvTransferServer};
use duet_proto::v1::prefill_worker_client::PrefillWorkerClient;
use duet_proto::v1::worker_control_client::WorkerControlClient;
use duet_proto::v1::{
    KvChunk, KvDestination, KvDone, KvHeader, PrefillRequest, PrefillResponse, PushAck,
    StatsRequest, StatsResponse, WorkerRole,
};
use tokio::sync::oneshot;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Code, Request, Response, Status, Streaming};

const BLOCK_SIZE: usize = 4;
const PROMPT_LEN: usize = 37;
const CACHED_BLOCKS: u32 = 3;
/// The reservation the test's decode side hands out (any 16 bytes).
const RESERVATION: [u8; 16] = *b"reservation-0042";

fn fixture() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/tiny-llama"
    ))
}

fn engine_options() -> EngineOptions {
    EngineOptions {
        threads: 2,
        block_size: BLOCK_SIZE,
        kv_cache_tokens: 256,
        // Smaller than the prompt: it is prefilled in chunks of 16, 16 and 5 tokens.
        max_step_tokens: 16,
        ..Default::default()
    }
}

fn prompt() -> Vec<u32> {
    (0..PROMPT_LEN as u32).map(|i| (i * 7 + 3) % 384).collect()
}

// ---- the fake decode worker -------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Accept,
    Refuse,
    /// Never answers (until the sender goes away).
    Hang,
}

#[derive(Debug, Default, Clone)]
struct Pushed {
    header: Option<KvHeader>,
    /// (layer, block_start, block_end, payload)
    chunks: Vec<(u32, u32, u32, Vec<u8>)>,
    bad_checksums: usize,
    done: Option<KvDone>,
}

#[derive(Clone)]
struct FakeDecode {
    mode: Mode,
    pushes: Arc<Mutex<Vec<Pushed>>>,
}

#[tonic::async_trait]
impl KvTransfer for FakeDecode {
    type PullStream = futures::stream::Empty<Result<KvChunk, Status>>;

    /// Prefill workers never pull; this decode worker holds no prefix to give.
    async fn pull(
        &self,
        _: Request<duet_proto::v1::KvPullRequest>,
    ) -> Result<Response<Self::PullStream>, Status> {
        Err(Status::not_found("the fake decode worker holds no prefix"))
    }

    async fn push(
        &self,
        request: Request<Streaming<KvChunk>>,
    ) -> Result<Response<PushAck>, Status> {
        let mut stream = request.into_inner();
        let mut p = Pushed::default();
        let mut bytes = 0u64;
        loop {
            let msg = match stream.message().await {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) => {
                    self.pushes.lock().unwrap().push(p);
                    return Err(e);
                }
            };
            match msg.kind {
                Some(Kind::Header(h)) => p.header = Some(h),
                Some(Kind::Data(d)) => {
                    if xxhash_rust::xxh3::xxh3_64(&d.payload) != d.xxh3 {
                        p.bad_checksums += 1;
                    }
                    bytes += d.payload.len() as u64;
                    p.chunks
                        .push((d.layer, d.block_start, d.block_end, d.payload));
                }
                Some(Kind::Done(d)) => {
                    p.done = Some(d);
                    if self.mode == Mode::Hang {
                        self.pushes.lock().unwrap().push(p);
                        // Until the caller gives up and the call is dropped.
                        std::future::pending::<()>().await;
                        unreachable!();
                    }
                }
                None => return Err(Status::invalid_argument("empty chunk")),
            }
        }
        let chunks = p.chunks.len() as u64;
        self.pushes.lock().unwrap().push(p);
        Ok(Response::new(PushAck {
            accepted: self.mode == Mode::Accept,
            bytes_received: bytes,
            message: if self.mode == Mode::Accept {
                String::new()
            } else {
                "reservation released".into()
            },
            chunks_received: chunks,
        }))
    }
}

async fn start_fake_decode(mode: Mode) -> (SocketAddr, Arc<Mutex<Vec<Pushed>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let pushes = Arc::new(Mutex::new(Vec::new()));
    let svc = FakeDecode {
        mode,
        pushes: pushes.clone(),
    };
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(KvTransferServer::new(svc).max_decoding_message_size(16 << 20))
            .serve_with_incoming(TcpListenerStream::new(listener))
            .await
            .unwrap();
    });
    (addr, pushes)
}

// ---- the worker under test --------------------------------------------------------------------

struct Worker {
    addr: SocketAddr,
    _stop: oneshot::Sender<()>,
}

/// The worker under test, knowing the decode workers at `decode` (their transfer addresses).
async fn start_worker(decode: &[SocketAddr]) -> Worker {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut config = PrefillConfig::for_model(fixture());
    config.worker.engine = engine_options();
    config.worker.worker_id = Some("prefill-test".into());
    config.decode = decode.iter().map(SocketAddr::to_string).collect();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(async move {
        duet_prefill_worker::serve(config, listener, async {
            let _ = stopped.await;
        })
        .await
        .unwrap();
    });
    Worker { addr, _stop: stop }
}

impl Worker {
    async fn client(&self) -> PrefillWorkerClient<tonic::transport::Channel> {
        PrefillWorkerClient::connect(format!("http://{}", self.addr))
            .await
            .unwrap()
    }

    async fn stats(&self) -> StatsResponse {
        WorkerControlClient::connect(format!("http://{}", self.addr))
            .await
            .unwrap()
            .stats(StatsRequest {})
            .await
            .unwrap()
            .into_inner()
    }

    async fn prefill(
        &self,
        req: PrefillRequest,
        timeout: Duration,
    ) -> Result<PrefillResponse, Status> {
        let mut request = Request::new(req);
        request.set_timeout(timeout);
        self.client()
            .await
            .prefill(request)
            .await
            .map(Response::into_inner)
    }
}

// ---- the reference --------------------------------------------------------------------------------

struct Reference {
    fingerprint: String,
    first_token: u32,
    /// KV of each (layer, prompt block), transfer layout.
    blocks: BTreeMap<(u32, u32), Vec<u8>>,
}

fn reference(tokens: &[u32]) -> Reference {
    let mut engine = duet_cpu::load_engine(&fixture(), engine_options()).unwrap();
    let stop = StopCriteria {
        max_tokens: 2,
        ignore_eos: true,
        ..StopCriteria::default()
    };
    let seq = engine
        .add_sequence(tokens.to_vec(), SamplingParams::greedy(), stop)
        .unwrap();
    let first_token = loop {
        let out = engine.step().unwrap();
        if let Some(o) = out.into_iter().find(|o| o.seq == seq) {
            break o.token.token;
        }
    };
    let table = engine.block_table(seq).unwrap().to_vec();
    assert_eq!(table.len(), tokens.len().div_ceil(BLOCK_SIZE));
    let mut blocks = BTreeMap::new();
    for layer in 0..engine.config().num_layers {
        for (i, &b) in table.iter().enumerate() {
            let mut buf = vec![0u8; engine.kv_block_bytes()];
            engine.read_kv_block(layer, b, &mut buf).unwrap();
            blocks.insert((layer as u32, i as u32), buf);
        }
    }
    Reference {
        fingerprint: engine.fingerprint().to_string(),
        first_token,
        blocks,
    }
}

fn request(tokens: Vec<u32>, fingerprint: &str, transfer: SocketAddr) -> PrefillRequest {
    let n = tokens.len().div_ceil(BLOCK_SIZE) as u32;
    PrefillRequest {
        request_id: "req-1".into(),
        token_ids: tokens,
        sampling: Some(duet_proto::v1::SamplingParams {
            temperature: 0.0,
            max_tokens: 8,
            seed: Some(1),
            ..Default::default()
        }),
        dest: Some(KvDestination {
            transfer_address: transfer.to_string(),
            reservation_id: RESERVATION.to_vec(),
            // Deliberately not 0..n: indices in KvData are positions in this list.
            block_ids: (100..100 + n).collect(),
            cached_blocks: CACHED_BLOCKS,
            block_size: BLOCK_SIZE as u32,
            decode_worker_id: "decode-test".into(),
            ..Default::default()
        }),
        model_fingerprint: fingerprint.into(),
        ..Default::default()
    }
}

/// Whether two (layer, block) payloads agree on the slots below `valid` (K then V, each
/// `[kv_head][slot][head_dim]` f32): slots past the prompt's end are ignored by the receiver.
fn same_valid_slots(a: &[u8], b: &[u8], valid: usize, kv_heads: usize, head_dim: usize) -> bool {
    assert_eq!(a.len(), b.len());
    let row = head_dim * 4;
    for kv in 0..2 {
        for h in 0..kv_heads {
            let base = ((kv * kv_heads + h) * BLOCK_SIZE) * row;
            if a[base..base + valid * row] != b[base..base + valid * row] {
                return false;
            }
        }
    }
    true
}

/// Checks one recorded push against the reference: every (layer, block) from `CACHED_BLOCKS`
/// on arrived exactly once, intact and equal to the local engine's KV.
fn check_push(p: &Pushed, r: &Reference, tokens: usize) {
    let h = p.header.as_ref().expect("a header");
    let blocks = tokens.div_ceil(BLOCK_SIZE) as u32;
    assert_eq!(h.reservation_id, RESERVATION);
    assert_eq!(h.request_id, "req-1");
    assert_eq!(h.model_fingerprint, r.fingerprint);
    assert_eq!(h.block_size as usize, BLOCK_SIZE);
    assert_eq!(h.num_layers, 2);
    assert_eq!(h.num_kv_heads, 2);
    assert_eq!(h.head_dim, 16);
    assert_eq!(h.dtype, "f32");
    assert_eq!(h.layout, duet_proto::KV_WIRE_LAYOUT);
    assert_eq!(h.first_block, CACHED_BLOCKS);
    assert_eq!(h.total_blocks, blocks - CACHED_BLOCKS);
    assert_eq!(h.num_tokens as usize, tokens);
    assert_eq!(h.sender_worker_id, "prefill-test");
    assert_eq!(p.bad_checksums, 0, "every chunk's xxh3 matches its payload");

    let block_bytes = 2 * 2 * BLOCK_SIZE * 16 * 4;
    let mut seen: BTreeMap<(u32, u32), usize> = BTreeMap::new();
    let mut total = 0u64;
    for (layer, start, end, payload) in &p.chunks {
        assert!(start < end, "non-empty chunk");
        assert!(payload.len() <= 1 << 20);
        assert_eq!(payload.len(), (end - start) as usize * block_bytes);
        total += payload.len() as u64;
        for (i, b) in (*start..*end).enumerate() {
            *seen.entry((*layer, b)).or_default() += 1;
            let got = &payload[i * block_bytes..(i + 1) * block_bytes];
            let want = &r.blocks[&(*layer, b)];
            let valid = (tokens - b as usize * BLOCK_SIZE).min(BLOCK_SIZE);
            assert!(
                same_valid_slots(got, want, valid, 2, 16),
                "layer {layer} block {b}: KV differs from the local engine's"
            );
        }
    }
    let expected: Vec<(u32, u32)> = (0..2)
        .flat_map(|l| (CACHED_BLOCKS..blocks).map(move |b| (l, b)))
        .collect();
    assert_eq!(seen.keys().copied().collect::<Vec<_>>(), expected);
    assert!(
        seen.values().all(|&n| n == 1),
        "each (layer, block) once: {seen:?}"
    );
    assert_eq!(total, h.total_bytes);
    let done = p.done.as_ref().expect("a KvDone");
    assert_eq!(done.num_chunks, p.chunks.len() as u64);
    assert_eq!(done.total_bytes, total);
}

const T: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_pushes_kv_and_returns_the_first_token() {
    let (decode, pushes) = start_fake_decode(Mode::Accept).await;
    let worker = start_worker(&[decode]).await;
    let tokens = prompt();
    let r = tokio::task::spawn_blocking({
        let t = tokens.clone();
        move || reference(&t)
    })
    .await
    .unwrap();

    let resp = worker
        .prefill(request(tokens.clone(), &r.fingerprint, decode), T)
        .await
        .unwrap();
    let first = resp.first_token.as_ref().unwrap();
    assert_eq!(first.token_id, r.first_token);
    assert_eq!(resp.cached_tokens, 0);
    assert_eq!(resp.worker_id, "prefill-test");
    assert_eq!(resp.transport, duet_proto::v1::TransportKind::Grpc as i32);
    assert!(resp.prefill_ms > 0.0);

    let recorded = pushes.lock().unwrap().clone();
    assert_eq!(recorded.len(), 1);
    check_push(&recorded[0], &r, PROMPT_LEN);
    assert_eq!(
        resp.bytes_sent,
        recorded[0].header.as_ref().unwrap().total_bytes
    );

    let s = worker.stats().await;
    assert_eq!(s.role, WorkerRole::Prefill as i32);
    assert_eq!(s.worker_id, "prefill-test");
    assert_eq!(s.model_fingerprint, r.fingerprint);
    assert_eq!(s.block_size as usize, BLOCK_SIZE);
    assert_eq!(s.kv_blocks_total, 64);
    assert_eq!(s.requests_served, 1);
    assert_eq!(s.prompt_tokens, PROMPT_LEN as u64);
    assert_eq!(s.prefix_hit_tokens, 0);
    assert_eq!(s.transfer_bytes_out, resp.bytes_sent);
    assert_eq!(s.queued_prefill_tokens, 0);
    assert_eq!(s.waiting_requests, 0);
    assert_eq!(s.kv_blocks_used, 0, "the sequence was removed");
    assert_eq!(s.kv_blocks_cached, (PROMPT_LEN / BLOCK_SIZE) as u32);
    assert_eq!(
        s.kv_blocks_total,
        s.kv_blocks_used + s.kv_blocks_cached + s.kv_blocks_free
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_prompt_twice_hits_the_prefix_cache() {
    let (decode, pushes) = start_fake_decode(Mode::Accept).await;
    let worker = start_worker(&[decode]).await;
    let tokens = prompt();
    let r = tokio::task::spawn_blocking({
        let t = tokens.clone();
        move || reference(&t)
    })
    .await
    .unwrap();

    let first = worker
        .prefill(request(tokens.clone(), &r.fingerprint, decode), T)
        .await
        .unwrap();
    let second = worker
        .prefill(request(tokens.clone(), &r.fingerprint, decode), T)
        .await
        .unwrap();
    assert_eq!(first.cached_tokens, 0);
    // Every full block but the one holding the last token comes from the cache.
    assert_eq!(
        second.cached_tokens as usize,
        (PROMPT_LEN - 1) / BLOCK_SIZE * BLOCK_SIZE
    );
    assert_eq!(second.first_token.unwrap().token_id, r.first_token);
    let recorded = pushes.lock().unwrap().clone();
    assert_eq!(recorded.len(), 2);
    check_push(&recorded[1], &r, PROMPT_LEN);

    let s = worker.stats().await;
    assert_eq!(s.requests_served, 2);
    assert_eq!(s.prompt_tokens, 2 * PROMPT_LEN as u64);
    assert_eq!(s.prefix_hit_tokens, second.cached_tokens as u64);
    assert!(s.prefill_tokens_per_s > 0.0, "the prefill rate is measured");
    assert!(s.kv_block_bytes > 0);
}

/// The worker's KV events name exactly the blocks the router computes for the same prompt with
/// duet-kv's one hash function: what makes the router's index exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_name_the_prompts_blocks_as_the_router_hashes_them() {
    use duet_proto::v1::kv_events_client::KvEventsClient;
    use duet_proto::v1::{KvEventKind, KvSubscribeRequest};
    let (decode, _pushes) = start_fake_decode(Mode::Accept).await;
    let worker = start_worker(&[decode]).await;
    let tokens = prompt();
    let fingerprint = worker.stats().await.model_fingerprint;
    let mut events = KvEventsClient::connect(format!("http://{}", worker.addr))
        .await
        .unwrap()
        .subscribe(KvSubscribeRequest::default())
        .await
        .unwrap()
        .into_inner();
    // A new subscriber starts from a snapshot: the cache is empty.
    let first = events.message().await.unwrap().unwrap();
    let incarnation = first.incarnation;
    let snapshot = first.snapshot.expect("a snapshot first");
    assert!(snapshot.block_hashes.is_empty() && snapshot.last);
    worker
        .prefill(request(tokens.clone(), &fingerprint, decode), T)
        .await
        .unwrap();
    let seed = duet_kv::request_hash_seed(&fingerprint, "");
    let expected = duet_kv::block_hashes(seed, &tokens, BLOCK_SIZE);
    let mut stored = Vec::new();
    while stored.len() < expected.len() {
        let m = tokio::time::timeout(T, events.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(m.incarnation, incarnation);
        for e in m.events {
            assert_eq!(e.kind, KvEventKind::BlockStored as i32);
            assert_eq!(
                e.seq,
                snapshot.seq + 1 + stored.len() as u64,
                "numbered without gaps"
            );
            stored.push(e.block_hash);
        }
    }
    assert_eq!(stored, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_with_clear_statuses() {
    let (decode, pushes) = start_fake_decode(Mode::Accept).await;
    let worker = start_worker(&[decode]).await;
    let fingerprint = worker.stats().await.model_fingerprint;

    let e = worker
        .prefill(request(prompt(), "some-other-model", decode), T)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("some-other-model") && e.message().contains(&fingerprint));

    let e = worker
        .prefill(request(vec![], &fingerprint, decode), T)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("empty"), "{}", e.message());

    let e = worker
        .prefill(request(vec![1, 2, 384], &fingerprint, decode), T)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("384"), "{}", e.message());

    let mut req = request(prompt(), &fingerprint, decode);
    req.dest.as_mut().unwrap().block_ids.pop();
    let e = worker.prefill(req, T).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");

    let mut req = request(prompt(), &fingerprint, decode);
    req.sampling.as_mut().unwrap().temperature = -1.0;
    let e = worker.prefill(req, T).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");

    assert!(pushes.lock().unwrap().is_empty(), "nothing was pushed");
    assert_eq!(worker.stats().await.requests_served, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_push_fails_the_prefill() {
    let (refusing, _) = start_fake_decode(Mode::Refuse).await;
    let (decode, _) = start_fake_decode(Mode::Accept).await;
    // An unreachable decode worker (bound but never served).
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_addr = dead.local_addr().unwrap();
    drop(dead);
    let worker = start_worker(&[refusing, decode, dead_addr]).await;
    let fingerprint = worker.stats().await.model_fingerprint;
    let e = worker
        .prefill(request(prompt(), &fingerprint, refusing), T)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(
        e.message().contains("reservation released"),
        "{}",
        e.message()
    );

    // An unreachable decode worker is UNAVAILABLE too.
    let e = worker
        .prefill(request(prompt(), &fingerprint, dead_addr), T)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");

    // The worker goes on serving, with nothing left held.
    worker
        .prefill(request(prompt(), &fingerprint, decode), T)
        .await
        .unwrap();
    let s = worker.stats().await;
    assert_eq!(s.requests_served, 1);
    assert_eq!(s.kv_blocks_used, 0);
    assert_eq!(s.queued_prefill_tokens, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missed_deadline_frees_everything() {
    let (hanging, pushes) = start_fake_decode(Mode::Hang).await;
    let worker = start_worker(&[hanging]).await;
    let fingerprint = worker.stats().await.model_fingerprint;
    let e = worker
        .prefill(
            request(prompt(), &fingerprint, hanging),
            Duration::from_millis(1500),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(e.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{e:?}"
    );
    // The whole KV went out; only the ack never came.
    assert_eq!(pushes.lock().unwrap().len(), 1);
    let s = worker.stats().await;
    assert_eq!(s.kv_blocks_used, 0);
    assert_eq!(s.queued_prefill_tokens, 0);
    assert_eq!(s.requests_served, 0);
}

/// Health is served for the worker ("") and each service; SERVING only once a decode worker
/// is known to push KV to (here by --decode; its cluster has no decode card).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_served_once_a_decode_worker_is_known() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let (decode, _) = start_fake_decode(Mode::Accept).await;
    for (known, expected) in [
        (vec![], ServingStatus::NotServing),
        (vec![decode], ServingStatus::Serving),
    ] {
        let worker = start_worker(&known).await;
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", worker.addr))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut health = HealthClient::new(channel);
        for service in ["", "duet.v1.PrefillWorker", "duet.v1.WorkerControl"] {
            let status = health
                .check(HealthCheckRequest {
                    service: service.into(),
                })
                .await
                .unwrap()
                .into_inner()
                .status;
            assert_eq!(
                status, expected as i32,
                "{service:?}, decode workers {known:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_prompts_are_batched_and_each_gets_its_own_kv() {
    let (decode, pushes) = start_fake_decode(Mode::Accept).await;
    let worker = start_worker(&[decode]).await;
    // 37 tokens: chunked; 21: shares a step with it; 12: all 3 blocks already on the decode
    // side, so nothing but the header and `KvDone` is pushed.
    let prompts: Vec<Vec<u32>> = [37usize, 21, 12]
        .iter()
        .enumerate()
        .map(|(k, &n)| {
            (0..n as u32)
                .map(|i| (i * 13 + 5 + 50 * k as u32) % 384)
                .collect()
        })
        .collect();
    let refs = tokio::task::spawn_blocking({
        let p = prompts.clone();
        move || p.iter().map(|t| reference(t)).collect::<Vec<_>>()
    })
    .await
    .unwrap();
    let calls = prompts.iter().zip(&refs).map(|(t, r)| {
        let mut req = request(t.clone(), &r.fingerprint, decode);
        req.request_id = format!("req-{}", t.len());
        worker.prefill(req, T)
    });
    let answers = futures::future::join_all(calls).await;
    for ((answer, r), t) in answers.into_iter().zip(&refs).zip(&prompts) {
        let answer = answer.unwrap();
        assert_eq!(answer.first_token.unwrap().token_id, r.first_token);
        let recorded = pushes.lock().unwrap().clone();
        let mut push = recorded
            .iter()
            .find(|p| p.header.as_ref().unwrap().request_id == format!("req-{}", t.len()))
            .expect("a push per request")
            .clone();
        push.header.as_mut().unwrap().request_id = "req-1".into();
        check_push(&push, r, t.len());
    }
    let s = worker.stats().await;
    assert_eq!(s.requests_served, 3);
    assert_eq!(s.prompt_tokens, 37 + 21 + 12);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_goes_only_to_decode_workers_the_worker_knows() {
    let (known, _) = start_fake_decode(Mode::Accept).await;
    let (stranger, pushes) = start_fake_decode(Mode::Accept).await;
    let worker = start_worker(&[known]).await;
    let fingerprint = worker.stats().await.model_fingerprint;
    let e = worker
        .prefill(request(prompt(), &fingerprint, stranger), T)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains(&stranger.to_string()), "{e:?}");
    assert!(
        pushes.lock().unwrap().is_empty(),
        "nothing pushed to the stranger"
    );
    worker
        .prefill(request(prompt(), &fingerprint, known), T)
        .await
        .unwrap();
}
