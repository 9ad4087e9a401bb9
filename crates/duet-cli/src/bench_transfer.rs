//! `duet bench transfer`: the gRPC KV transport alone. A real decode worker (in this process)
//! reserves KV for an N-token prompt and asks a stand-in prefill worker to fill it; the stand-in
//! computes nothing and pushes the prompt's KV (every layer, every block) through the same
//! transport code as the real prefill worker (`duet_transfer::grpc`: 1 MiB checksummed chunks),
//! timing from cutting the first chunk to the decode worker's acknowledgement.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use duet_cpu::CpuBackend;
use duet_engine::backend::{Backend, KvDtypeChoice, KvLayout};
use duet_engine::engine::EngineOptions;
use duet_model::model_files::open_model;
use duet_model::model_path::ModelArgs;
use duet_proto::v1;
use duet_transfer::grpc::GrpcTransport;
use duet_transfer::{KvTransport, KvWire, PushSpec, ReservationKey, TransferError};
use futures::StreamExt;
use tonic::{Request, Response, Status};

use crate::in_process;

#[derive(Args, Debug)]
pub struct TransferBenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt length whose KV is moved.
    #[arg(long, default_value_t = 2000)]
    pub prompt_tokens: usize,
    /// Transfers timed (the best is reported).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
}

/// What the stand-in measured for one push.
#[derive(Clone, Copy, Default)]
pub(crate) struct Measured {
    pub(crate) bytes: u64,
    pub(crate) seconds: f64,
}

/// The stand-in's worker id: the decode worker makes its reservations for it.
const STAND_IN: &str = "bench-stand-in";

/// A prefill worker that computes nothing: it pushes zeroed KV for the whole reservation
/// through the transport the real prefill worker uses.
struct StandIn {
    wire: KvWire,
    transport: GrpcTransport,
    last: Arc<Mutex<Measured>>,
}

impl StandIn {
    async fn push(&self, req: v1::PrefillRequest) -> Result<Measured, TransferError> {
        let dest = req
            .dest
            .ok_or_else(|| TransferError::Malformed("no destination".into()))?;
        let blocks = dest.cached_blocks as usize..dest.block_ids.len();
        let push = self.transport.open(
            &self.wire,
            PushSpec {
                address: dest.transfer_address,
                reservation_id: ReservationKey::from_wire(&dest.reservation_id)?,
                request_id: req.request_id,
                blocks: blocks.clone(),
                num_tokens: req.token_ids.len(),
                sender_worker_id: STAND_IN.into(),
                timeout: Duration::from_secs(60),
                dest_block_ids: dest.block_ids,
                offered: v1::TransportKind::Grpc,
                transport_params: Vec::new(),
            },
        )?;
        let started = Instant::now();
        let block_bytes = self.wire.block_bytes();
        let mut sender = push.sender;
        for layer in 0..self.wire.layout.num_layers {
            sender.send_layer(layer, blocks.clone(), &mut |range, out| {
                out.resize(out.len() + range.len() * block_bytes, 0);
                Ok(())
            })?;
        }
        sender.finish();
        let pushed = push.acked.await?;
        Ok(Measured {
            bytes: pushed.bytes_sent,
            seconds: started.elapsed().as_secs_f64(),
        })
    }
}

#[tonic::async_trait]
impl v1::prefill_worker_server::PrefillWorker for StandIn {
    async fn prefill(
        &self,
        request: Request<v1::PrefillRequest>,
    ) -> Result<Response<v1::PrefillResponse>, Status> {
        let m = self.push(request.into_inner()).await?;
        *self.last.lock().unwrap() = m;
        Ok(Response::new(v1::PrefillResponse {
            first_token: Some(v1::TokenLogprobs {
                token_id: 3,
                ..Default::default()
            }),
            bytes_sent: m.bytes,
            transfer_ms: m.seconds * 1e3,
            worker_id: STAND_IN.into(),
            ..Default::default()
        }))
    }
}

/// A real decode worker in this process and the stand-in prefill worker pushing into it.
pub(crate) struct TransferRig {
    decode: v1::decode_worker_client::DecodeWorkerClient<tonic::transport::Channel>,
    prefill_addr: std::net::SocketAddr,
    last: Arc<Mutex<Measured>>,
    vocab: u32,
    pushes: u32,
}

impl TransferRig {
    /// Starts both for `model`, with room for prompts of up to `max_tokens`.
    pub(crate) async fn start(model: &std::path::Path, max_tokens: usize) -> Result<Self> {
        let files = open_model(model)?;
        // The KV type the decode worker (default options, CPU) picks for this model.
        let kv_dtype =
            CpuBackend::new(1).kv_dtype(KvDtypeChoice::Auto, files.tensors.matrices_all_f32())?;
        let config = files.config;
        let engine = EngineOptions {
            threads: 1,
            block_size: 16,
            kv_cache_tokens: (max_tokens + 64).next_multiple_of(16) * 2,
            max_step_tokens: 512,
            ..Default::default()
        };
        // The stand-in's address first: the decode worker accepts it in a plan (--prefill).
        let prefill_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let prefill_addr = prefill_listener.local_addr()?;
        let decode = in_process::decode_worker(
            in_process::listen().await?,
            model,
            engine.clone(),
            vec![prefill_addr.to_string()],
        )
        .await?;
        let (url, fingerprint) = (decode.url, decode.fingerprint);
        let last = Arc::new(Mutex::new(Measured::default()));
        let stand_in = StandIn {
            wire: KvWire {
                fingerprint,
                layout: KvLayout {
                    num_layers: config.num_layers,
                    num_kv_heads: config.num_kv_heads,
                    head_dim: config.head_dim,
                    block_size: 16,
                    num_blocks: engine.kv_cache_tokens / 16,
                    dtype: kv_dtype,
                },
            },
            transport: GrpcTransport::default(),
            last: last.clone(),
        };
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(v1::prefill_worker_server::PrefillWorkerServer::new(
                    stand_in,
                ))
                .serve_with_incoming(duet_proto::incoming(prefill_listener)),
        );
        Ok(Self {
            decode: v1::decode_worker_client::DecodeWorkerClient::connect(url).await?,
            prefill_addr,
            last,
            vocab: config.vocab_size as u32,
            pushes: 0,
        })
    }

    /// The push of a fresh `tokens`-token prompt's KV: its bytes and time.
    pub(crate) async fn push(&mut self, tokens: usize) -> Result<Measured> {
        self.pushes += 1;
        let r = self.pushes;
        // A different prompt each time: nothing is found in the decode worker's prefix cache.
        let prompt: Vec<u32> = (0..tokens as u32)
            .map(|i| 300 + (i * 7919 + r * 31) % 40_000 % (self.vocab - 300))
            .collect();
        let req = v1::DecodeRequest {
            request_id: format!("transfer-{r}"),
            prompt_token_ids: prompt,
            sampling: Some(v1::SamplingParams {
                max_tokens: 1,
                top_p: 1.0,
                ..Default::default()
            }),
            plan: Some(v1::PrefillPlan {
                local: false,
                prefill_workers: vec![v1::PrefillTarget {
                    worker_id: STAND_IN.into(),
                    address: self.prefill_addr.to_string(),
                }],
            }),
            ..Default::default()
        };
        let mut stream = self.decode.decode(req).await?.into_inner();
        let mut local = false;
        while let Some(msg) = stream.next().await {
            local |= msg?.timings.is_some_and(|t| t.prefill_local);
        }
        anyhow::ensure!(
            !local,
            "the transfer failed and the decode worker prefilled locally"
        );
        Ok(*self.last.lock().unwrap())
    }
}

pub fn run(args: TransferBenchArgs) -> Result<()> {
    let path = args.model.resolve()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let mut rig = TransferRig::start(&path, args.prompt_tokens).await?;
        let mut best = Measured { bytes: 0, seconds: f64::INFINITY };
        for r in 0..args.repeats {
            let m = rig.push(args.prompt_tokens).await?;
            eprintln!("transfer {}: {} bytes in {:.1} ms ({:.2} GB/s)", r + 1, m.bytes, m.seconds * 1e3, m.bytes as f64 / m.seconds / 1e9);
            if m.seconds < best.seconds {
                best = m;
            }
        }
        println!(
            "KV of a {}-token prompt over gRPC on loopback: {:.1} MiB in {:.1} ms = {:.2} GB/s (best of {})",
            args.prompt_tokens,
            best.bytes as f64 / (1 << 20) as f64,
            best.seconds * 1e3,
            best.bytes as f64 / best.seconds / 1e9,
            args.repeats
        );
        Ok::<_, anyhow::Error>(())
    })
    .context("transfer benchmark")
}
