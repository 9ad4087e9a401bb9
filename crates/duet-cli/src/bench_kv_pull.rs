//! `duet bench kv-pull`: a prefix pulled from a peer against the same length computed. Two
//! decode workers of one launched cluster (no prefill pool, `--kv-peer-pull on`); each
//! repetition sends a fresh prefix and a question to worker A (which caches the prefix), then
//! to worker B the prefix and another question naming A as the holder to pull from, and
//! another fresh prefix of the same length with that question, which B computes. It times B's
//! first token both ways (the Decode call straight to the worker, as the router makes it). With
//! `--pull-cuda-ipc on` the pulls are asked for over CUDA IPC (`--kv-peer-pull-cuda-ipc on`),
//! the workers in processes of their own.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use duet_decode_worker::{DecodeConfig, PeerPullArgs};
use duet_engine::device::Switch;
use duet_engine::engine::EngineOptions;
use duet_model::model_path::ModelArgs;
use duet_proto::v1;
use duet_worker::WorkerArgs;
use futures::StreamExt;
use serde::Serialize;

use crate::cluster::{Cluster, ClusterSpec};
use crate::progress::{Progress, Unit};

#[derive(Args, Debug)]
pub struct KvPullBenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineOptions,
    /// Tokens of the prefix worker A holds.
    #[arg(long, default_value_t = 2000)]
    pub prefix_tokens: usize,
    /// Tokens of the question after it.
    #[arg(long, default_value_t = 16)]
    pub question_tokens: usize,
    /// Repetitions timed, each with fresh prefixes (after one untimed).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Ask for the pulls over CUDA IPC (`--kv-peer-pull-cuda-ipc on`; GPU workers, which then
    /// run in processes of their own: CUDA IPC opens only another process's memory), on or off.
    #[arg(long, value_enum, default_value_t = Switch::Off)]
    pub pull_cuda_ipc: Switch,
    /// Write the JSON report here.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
}

#[derive(Serialize)]
struct Report {
    prefix_tokens: usize,
    question_tokens: usize,
    repeats: usize,
    /// B's time to first token, pulling the prefix from A, and computing it.
    pull_ttft_ms: Vec<f64>,
    recompute_ttft_ms: Vec<f64>,
    pull_ttft_p50_ms: f64,
    recompute_ttft_p50_ms: f64,
    /// Pull ÷ recompute, of the medians.
    ratio: f64,
    /// Whether the pulls were asked for over CUDA IPC.
    pull_cuda_ipc: bool,
    /// B's prefix pulls by outcome, and those answered over CUDA IPC.
    pulls: std::collections::BTreeMap<String, u64>,
    pulls_cuda_ipc: std::collections::BTreeMap<String, u64>,
}

pub fn run(args: KvPullBenchArgs) -> Result<()> {
    let spec = ClusterSpec {
        router: crate::cluster::loopback_router("bench-kv-pull")?,
        prefill: Default::default(),
        decode: DecodeConfig {
            worker: WorkerArgs {
                engine: args.engine.clone(),
                ..WorkerArgs::default()
            },
            peer_pull: PeerPullArgs {
                kv_peer_pull: Switch::On,
                kv_peer_pull_cuda_ipc: args.pull_cuda_ipc,
            },
            ..DecodeConfig::default()
        },
        prefill_workers: 0,
        decode_workers: 2,
        model: args.model.resolve()?,
        processes: args.pull_cuda_ipc.is_on(),
        bin_dir: None,
        telemetry: Default::default(),
        auth: Default::default(),
    };
    eprintln!(
        "launching 2 decode workers (--kv-peer-pull on, --kv-peer-pull-cuda-ipc {})",
        args.pull_cuda_ipc
    );
    let cluster = Cluster::start(&spec)?;
    let runtime = tokio::runtime::Runtime::new()?;
    let report = runtime.block_on(measure(&args, &cluster))?;
    println!(
        "{}-token prefix + {}-token question on worker B, TTFT p50: pulled from A{} {:.1} ms, computed {:.1} ms: {:.2}×",
        report.prefix_tokens,
        report.question_tokens,
        match report.pull_cuda_ipc {
            true => " over CUDA IPC",
            false => "",
        },
        report.pull_ttft_p50_ms,
        report.recompute_ttft_p50_ms,
        report.ratio
    );
    crate::bench_engine::print_json(&report, args.json_out.as_deref())
}

async fn measure(args: &KvPullBenchArgs, cluster: &Cluster) -> Result<Report> {
    let auth = duet_proto::PeerAuth {
        token: Some(cluster.token.clone()),
        tls: None,
    };
    let (a, b) = (cluster.decode[0], cluster.decode[1]);
    let channel = |addr: std::net::SocketAddr| duet_proto::channel(&addr.to_string(), &auth);
    let (ca, cb) = (channel(a)?, channel(b)?);
    let stats = |c: &duet_proto::PeerChannel| {
        let c = c.clone();
        async move {
            v1::worker_control_client::WorkerControlClient::new(c)
                .stats(v1::StatsRequest {})
                .await
                .map(|r| r.into_inner())
        }
    };
    let sa = stats(&ca).await?;
    let info = v1::generation_client::GenerationClient::new(
        crate::generate::router_channel(&cluster.router.to_string(), None).await?,
    )
    .info(v1::InfoRequest {})
    .await?
    .into_inner();
    let block_size = sa.block_size as usize;
    let fingerprint = sa.model_fingerprint.clone();
    let mut tokens = crate::bench_engine::prompt_source(info.vocab_size as usize);
    let source = v1::KvPullSource {
        worker_id: sa.worker_id.clone(),
        address: a.to_string(),
        blocks: (args.prefix_tokens / block_size) as u32,
    };
    let progress = Progress::new("[kv-pull]", (args.repeats + 1) as u64, Unit::Requests);
    let (mut pulled, mut computed) = (Vec::new(), Vec::new());
    for rep in 0..=args.repeats {
        let prefix = tokens(args.prefix_tokens);
        let question = tokens(args.question_tokens);
        let with = |q: &[u32], p: &[u32]| [p, q].concat();
        // A computes the prefix (and caches it).
        first_token(
            &ca,
            with(&tokens(args.question_tokens), &prefix),
            None,
            &fingerprint,
        )
        .await?;
        let (pull_ms, cached) = first_token(
            &cb,
            with(&question, &prefix),
            Some(source.clone()),
            &fingerprint,
        )
        .await?;
        if (cached as usize) < source.blocks as usize * block_size {
            bail!(
                "worker B found {cached} tokens cached after the pull; the pull did not land (see its log)"
            );
        }
        let fresh = tokens(args.prefix_tokens);
        let (compute_ms, _) = first_token(&cb, with(&question, &fresh), None, &fingerprint).await?;
        // The first repetition warms both workers up.
        if rep > 0 {
            pulled.push(pull_ms);
            computed.push(compute_ms);
        }
        progress.inc(1);
    }
    progress.finish();
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (pull, compute) = (median(&pulled), median(&computed));
    let b_stats = stats(&cb).await?;
    Ok(Report {
        prefix_tokens: args.prefix_tokens,
        question_tokens: args.question_tokens,
        repeats: args.repeats,
        pull_ttft_p50_ms: pull,
        recompute_ttft_p50_ms: compute,
        ratio: pull / compute,
        pull_ttft_ms: pulled,
        recompute_ttft_ms: computed,
        pull_cuda_ipc: args.pull_cuda_ipc.is_on(),
        pulls: b_stats.kv_peer_pulls.into_iter().collect(),
        pulls_cuda_ipc: b_stats.kv_peer_pulls_cuda_ipc.into_iter().collect(),
    })
}

/// Milliseconds to the first token of a greedy one-token Decode of `prompt` prefilled on the
/// worker itself, pulling from `pull`; and the prompt tokens it found cached.
async fn first_token(
    channel: &duet_proto::PeerChannel,
    prompt: Vec<u32>,
    pull: Option<v1::KvPullSource>,
    fingerprint: &str,
) -> Result<(f64, u32)> {
    let mut client = v1::decode_worker_client::DecodeWorkerClient::new(channel.clone());
    let mut request = tonic::Request::new(v1::DecodeRequest {
        request_id: "bench-kv-pull".into(),
        prompt_token_ids: prompt,
        sampling: Some(v1::SamplingParams {
            max_tokens: 1,
            seed: Some(1),
            ..Default::default()
        }),
        plan: Some(v1::PrefillPlan {
            local: true,
            prefill_workers: Vec::new(),
        }),
        model_fingerprint: fingerprint.to_string(),
        pull,
        ..Default::default()
    });
    request.set_timeout(Duration::from_secs(300));
    let started = Instant::now();
    let mut stream = client.decode(request).await.context("Decode")?.into_inner();
    let mut first = None;
    let mut cached = 0;
    while let Some(msg) = stream.next().await {
        let msg = msg.context("Decode stream")?;
        first.get_or_insert_with(|| started.elapsed().as_secs_f64() * 1e3);
        if let Some(u) = msg.usage {
            cached = u.cached_prompt_tokens;
        }
    }
    Ok((first.context("no token came back")?, cached))
}
