//! `duet profile`'s served measurement ([`duet_planner::profile::ServingProfile`]): a real
//! prefill worker and a real decode worker, processes as the simulated shapes' workers are,
//! with the profiled engine settings, are sent requests over gRPC on loopback (`Decode`, as the
//! router sends them).
//!
//! - Decode steps: `batch` requests at once, prefilled by the decode worker itself; the median
//!   gap between a stream's tokens while every stream decodes is a served decode step, set
//!   beside what the decode fit predicts for it.
//! - Prompts: one at a time, in turn prefilled by the decode worker itself and by the prefill
//!   worker pushing the KV to it; each worker's own account of the compute
//!   (`Timings.prefill_ms`). Measured in turn, the two share the machine's state: on a machine
//!   whose speed drifts (±8% within a minute on the 2-core Zen 5), their ratio is what pushing
//!   adds, where a served prompt set beside the fit measured earlier would be the drift.
//! - Contention: in turn with those, each prompt pushed once more while the decode worker
//!   decodes a stream of its own. The prompt's compute over the pushed one's, and the stream's
//!   steps while it computes over its steps just before, are what two served workers computing
//!   at once cost each other ([`Contention`]).

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Result, ensure};
use duet_decode_worker::DecodeConfig;
use duet_engine::device::Device;
use duet_engine::engine::EngineOptions;
use duet_planner::profile::{
    Contention, Profile, PushedSample, ServedSample, ServingProfile, StepShape,
};
use duet_prefill_worker::PrefillConfig;
use duet_proto::v1;
use duet_worker::WorkerArgs;
use futures::StreamExt;

use crate::bench_engine::prompt_source;
use crate::cluster::{Cluster, ClusterSpec};
use crate::progress::Progress;

/// A decode worker's client, carrying the cluster token.
type Client = v1::decode_worker_client::DecodeWorkerClient<duet_proto::PeerChannel>;

/// What to send the served worker.
pub(crate) struct ServedPlan<'a> {
    pub(crate) batches: &'a [usize],
    pub(crate) prompt_tokens: &'a [usize],
    /// Each decode stream's prompt and answer lengths.
    pub(crate) decode_prompt: usize,
    pub(crate) decode_tokens: u32,
    pub(crate) repeats: usize,
}

impl ServedPlan<'_> {
    /// Steps of the progress bar: each stream count's repeats, and each prompt length.
    pub(crate) fn points(&self) -> usize {
        self.batches.len() * self.repeats + self.prompt_tokens.len()
    }

    /// The most tokens the contention stream may answer in a model of `context` tokens; it is
    /// cancelled once its prompt is computed.
    fn contention_stream_tokens(&self, context: usize) -> u32 {
        (context.saturating_sub(self.decode_prompt + 1) as u32).min(1024)
    }

    /// KV tokens a worker holds at once at most: the largest batch, or a prompt beside the
    /// contention stream.
    fn kv_tokens(&self, context: usize) -> usize {
        let batch = self.batches.iter().copied().max().unwrap_or(0);
        let prompt = self.prompt_tokens.iter().copied().max().unwrap_or(0);
        let beside = self.decode_prompt + self.contention_stream_tokens(context) as usize;
        (batch * (self.decode_prompt + self.decode_tokens as usize + 16)).max(prompt + 32 + beside)
    }
}

/// The contention stream's tokens before its prompt is sent (its steps alone).
const ALONE_TOKENS: usize = 24;

/// The cluster the served measurement runs through: a prefill and a decode worker as processes
/// (as the shapes the simulator predicts run), serving `model` with `engine`'s settings, a KV
/// cache holding `plan`'s largest point, and a router that nothing calls.
pub(crate) fn served_cluster(
    model: &Path,
    mut engine: EngineOptions,
    plan: &ServedPlan<'_>,
    context: usize,
) -> Result<ClusterSpec> {
    engine.kv_cache_tokens = engine
        .kv_cache_tokens
        .max(plan.kv_tokens(context).next_multiple_of(64));
    if let Device::Cuda(_) = engine.device {
        // Two workers on one GPU: half the memory each.
        engine.gpu_memory_fraction /= 2.0;
    }
    let worker = WorkerArgs {
        engine,
        ..WorkerArgs::default()
    };
    Ok(ClusterSpec {
        router: crate::cluster::loopback_router("duet-profile")?,
        prefill: PrefillConfig {
            worker: worker.clone(),
            ..PrefillConfig::default()
        },
        decode: DecodeConfig {
            worker,
            ..DecodeConfig::default()
        },
        prefill_workers: 1,
        decode_workers: 1,
        model: model.to_path_buf(),
        processes: true,
        bin_dir: None,
        telemetry: Default::default(),
        auth: Default::default(),
    })
}

/// Measures `plan` through `cluster`'s prefill and decode worker (serving a model of `vocab`
/// tokens and a context of `context`), against the bare engine's fits in `profile`.
pub(crate) async fn measure_served(
    cluster: &Cluster,
    (vocab, context): (usize, usize),
    profile: &Profile,
    plan: &ServedPlan<'_>,
    progress: &Progress,
) -> Result<ServingProfile> {
    let auth = duet_proto::PeerAuth {
        token: Some(cluster.token.clone()),
        tls: None,
    };
    let prefill_address = cluster.prefill[0].to_string();
    let prefill_stats = v1::worker_control_client::WorkerControlClient::new(duet_proto::channel(
        &prefill_address,
        &auth,
    )?)
    .stats(v1::StatsRequest {})
    .await?
    .into_inner();
    let remote = v1::PrefillPlan {
        local: false,
        prefill_workers: vec![v1::PrefillTarget {
            worker_id: prefill_stats.worker_id,
            address: prefill_address,
        }],
    };
    let client = Client::new(duet_proto::channel(&cluster.decode[0].to_string(), &auth)?);
    let mut prompt = prompt_source(vocab);
    // One untimed request each first: a worker's first steps allocate their buffers.
    stream(client.clone(), prompt(plan.decode_prompt), 4, local()).await?;
    stream(
        client.clone(),
        prompt(plan.decode_prompt),
        1,
        remote.clone(),
    )
    .await?;

    // The repeats go round the stream counts rather than one count after another, so that the
    // machine's drift over the measurement (and whatever the workers' first steps still cost)
    // falls on every count alike, not on the first.
    let mut gaps = vec![Vec::new(); plan.batches.len()];
    for _ in 0..plan.repeats {
        for (&batch, gaps) in plan.batches.iter().zip(&mut gaps) {
            let streams = futures::future::try_join_all((0..batch).map(|_| {
                stream(
                    client.clone(),
                    prompt(plan.decode_prompt),
                    plan.decode_tokens,
                    local(),
                )
            }))
            .await?;
            gaps.extend(decoding_gaps(&streams));
            progress.inc(1);
        }
    }
    let mut decode = Vec::new();
    for (&batch, mut gaps) in plan.batches.iter().zip(gaps) {
        ensure!(
            !gaps.is_empty(),
            "no decode step of {batch} streams was timed: raise --served-decode-tokens"
        );
        let context = plan.decode_prompt + plan.decode_tokens as usize / 2;
        let mut shape = StepShape::default();
        for _ in 0..batch {
            shape.row(context);
        }
        decode.push(ServedSample {
            batch,
            context,
            served_ms: median(&mut gaps),
            engine_ms: profile.engine_step_ms(&shape),
        });
    }

    let mut prefill = Vec::new();
    let mut ratios = Vec::new();
    let (mut prefill_beside, mut decode_beside) = (Vec::new(), Vec::new());
    for &tokens in plan.prompt_tokens {
        let (mut pushed, mut local_ms) = (Vec::new(), Vec::new());
        for _ in 0..plan.repeats {
            let here = prefill_ms(&client, prompt(tokens), local()).await?;
            let there = prefill_ms(&client, prompt(tokens), remote.clone()).await?;
            let beside = prompt_beside_stream(
                &client,
                (
                    prompt(plan.decode_prompt),
                    plan.contention_stream_tokens(context),
                ),
                prompt(tokens),
                remote.clone(),
            )
            .await?;
            ratios.push(there / here);
            prefill_beside.push(beside.prefill_ms / there);
            if let Some(ratio) = beside.decode_ratio {
                decode_beside.push(ratio);
            }
            local_ms.push(here);
            pushed.push(there);
        }
        prefill.push(PushedSample {
            tokens,
            pushed_ms: median(&mut pushed),
            local_ms: median(&mut local_ms),
        });
        progress.inc(1);
    }
    let prefill_push_factor = if ratios.is_empty() {
        1.0
    } else {
        median(&mut ratios)
    };
    // Without a decode step inside any prompt (prompts shorter than a step), contention was
    // not measured.
    let contention =
        (!prefill_beside.is_empty() && !decode_beside.is_empty()).then(|| Contention {
            prefill_factor: median(&mut prefill_beside),
            decode_factor: median(&mut decode_beside),
        });
    Ok(ServingProfile {
        decode,
        prefill,
        prefill_push_factor,
        contention,
    })
}

/// A prompt computed beside a decoding stream: its compute, and the stream's median step
/// while it computed over its median step before (`None` without a step inside the prompt).
struct Beside {
    prefill_ms: f64,
    decode_ratio: Option<f64>,
}

/// Streams `stream_prompt` from the decode worker (prefilled there, `stream_tokens` at most, then
/// again) and, once its first [`ALONE_TOKENS`] tokens have come, has `prompt` prefilled as
/// `plan` says; then cancels the stream.
async fn prompt_beside_stream(
    client: &Client,
    (stream_prompt, stream_tokens): (Vec<u32>, u32),
    prompt: Vec<u32>,
    plan: v1::PrefillPlan,
) -> Result<Beside> {
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let decoding = tokio::spawn(decode_until(
        client.clone(),
        (stream_prompt, stream_tokens),
        ready_tx,
        stop_rx,
    ));
    if ready_rx.await.is_err() {
        // The stream ended (or failed) before its first tokens: its error says why.
        decoding.await??;
        anyhow::bail!(
            "the contention stream ended before {ALONE_TOKENS} tokens: \
             --served-decode-prompt leaves it no room in the model's context"
        );
    }
    let sent = Instant::now();
    let prefill_ms = prefill_ms(client, prompt, plan).await?;
    let done = Instant::now();
    let _ = stop_tx.send(true);
    let streams = decoding.await??;
    let gaps = |inside: &dyn Fn(Instant, Instant) -> bool| {
        let mut gaps: Vec<f64> = streams
            .iter()
            .flat_map(|s| s.arrivals.windows(2))
            .filter(|w| inside(w[0].0, w[1].0))
            .map(|w| (w[1].0 - w[0].0).as_secs_f64() * 1e3 / w[1].1 as f64)
            .collect();
        (!gaps.is_empty()).then(|| median(&mut gaps))
    };
    let alone = gaps(&|_, to| to <= sent);
    let beside = gaps(&|from, to| from >= sent && to <= done);
    Ok(Beside {
        prefill_ms,
        decode_ratio: alone.zip(beside).map(|(alone, beside)| beside / alone),
    })
}

/// Streams `prompt` for `max_tokens` from the decode worker, again and again (a small model's
/// context ends a stream sooner than a prompt computes), until `stop`; tells `ready` once the
/// first stream has [`ALONE_TOKENS`] tokens.
async fn decode_until(
    client: Client,
    (prompt, max_tokens): (Vec<u32>, u32),
    ready: tokio::sync::oneshot::Sender<()>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<Vec<Streamed>> {
    let mut ready = Some((ALONE_TOKENS, ready));
    let mut streams = Vec::new();
    while !*stop.borrow() {
        let mut stop = stop.clone();
        let stopped = async move {
            let _ = stop.wait_for(|stop| *stop).await;
        };
        streams.push(
            stream_until(
                client.clone(),
                prompt.clone(),
                max_tokens,
                local(),
                ready.take(),
                stopped,
            )
            .await?,
        );
    }
    Ok(streams)
}

fn local() -> v1::PrefillPlan {
    v1::PrefillPlan {
        local: true,
        prefill_workers: Vec::new(),
    }
}

/// The compute of one fresh prompt prefilled as `plan` says, as the worker that computed it
/// reports it; refused if the plan was not followed.
async fn prefill_ms(client: &Client, prompt: Vec<u32>, plan: v1::PrefillPlan) -> Result<f64> {
    let local = plan.local;
    let timings = stream(client.clone(), prompt, 1, plan)
        .await?
        .timings
        .ok_or_else(|| anyhow::anyhow!("a served prompt ended without its timings"))?;
    ensure!(
        timings.prefill_local == local,
        "a served prompt meant for the {} worker was prefilled by the {} one",
        if local { "decode" } else { "prefill" },
        if timings.prefill_local {
            "decode"
        } else {
            "prefill"
        },
    );
    Ok(timings.prefill_ms)
}

/// Served requests sent, for their ids.
static REQUESTS: AtomicU64 = AtomicU64::new(0);

/// One served request as the client saw it.
struct Streamed {
    /// When each message with tokens arrived, and how many it carried.
    arrivals: Vec<(Instant, usize)>,
    /// The last message's.
    timings: Option<v1::Timings>,
}

/// Sends `prompt` for `max_tokens` greedy tokens (end of sequence ignored), prefilled as `plan`
/// says, and reads the stream to its end.
async fn stream(
    client: Client,
    prompt: Vec<u32>,
    max_tokens: u32,
    plan: v1::PrefillPlan,
) -> Result<Streamed> {
    stream_until(
        client,
        prompt,
        max_tokens,
        plan,
        None,
        std::future::pending(),
    )
    .await
}

/// [`stream`], telling `ready` once that many tokens have come, and cancelling the request
/// when `stop` completes.
async fn stream_until(
    mut client: Client,
    prompt: Vec<u32>,
    max_tokens: u32,
    plan: v1::PrefillPlan,
    mut ready: Option<(usize, tokio::sync::oneshot::Sender<()>)>,
    stop: impl std::future::Future<Output = ()>,
) -> Result<Streamed> {
    let request = v1::DecodeRequest {
        request_id: format!("profile-{}", REQUESTS.fetch_add(1, Ordering::Relaxed)),
        prompt_token_ids: prompt,
        sampling: Some(v1::SamplingParams {
            max_tokens,
            temperature: 0.0,
            top_p: 1.0,
            ignore_eos: true,
            ..Default::default()
        }),
        plan: Some(plan),
        ..Default::default()
    };
    let mut responses = client.decode(request).await?.into_inner();
    let mut s = Streamed {
        arrivals: Vec::new(),
        timings: None,
    };
    let mut stop = std::pin::pin!(stop);
    let mut tokens = 0;
    loop {
        let msg = tokio::select! {
            msg = responses.next() => msg,
            () = &mut stop => break,
        };
        let Some(msg) = msg else { break };
        let msg = msg?;
        ensure!(
            msg.error.is_empty(),
            "a served request failed: {}",
            msg.error
        );
        if !msg.token_ids.is_empty() {
            s.arrivals.push((Instant::now(), msg.token_ids.len()));
            tokens += msg.token_ids.len();
        }
        if let Some((_, tx)) = ready.take_if(|(n, _)| tokens >= *n) {
            let _ = tx.send(());
        }
        s.timings = msg.timings.or(s.timings);
    }
    Ok(s)
}

/// Each stream's time per token between consecutive messages, only while every stream was
/// decoding: after the last one's first token, before the first one's last.
fn decoding_gaps(streams: &[Streamed]) -> Vec<f64> {
    let first = streams
        .iter()
        .filter_map(|s| s.arrivals.first())
        .map(|a| a.0)
        .max();
    let last = streams
        .iter()
        .filter_map(|s| s.arrivals.last())
        .map(|a| a.0)
        .min();
    let (Some(first), Some(last)) = (first, last) else {
        return Vec::new();
    };
    streams
        .iter()
        .flat_map(|s| s.arrivals.windows(2))
        .filter(|w| w[0].0 >= first && w[1].0 <= last)
        .map(|w| (w[1].0 - w[0].0).as_secs_f64() * 1e3 / w[1].1 as f64)
        .collect()
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(base: Instant, ms: &[u64]) -> Streamed {
        Streamed {
            arrivals: ms
                .iter()
                .map(|&m| (base + Duration::from_millis(m), 1))
                .collect(),
            timings: None,
        }
    }

    #[test]
    fn only_gaps_while_every_stream_decodes_are_timed() {
        let base = Instant::now();
        // The second stream's first token at 20 ms, the first's last at 50 ms.
        let streams = [
            at(base, &[0, 10, 20, 30, 40, 50]),
            at(base, &[20, 30, 40, 55, 70]),
        ];
        let mut gaps = decoding_gaps(&streams);
        gaps.sort_by(f64::total_cmp);
        // First stream: 20→30, 30→40, 40→50; second: 20→30, 30→40 (40→55 ends past 50).
        assert_eq!(gaps.len(), 5, "{gaps:?}");
        assert!(gaps.iter().all(|g| (g - 10.0).abs() < 1e-6), "{gaps:?}");
        // A message carrying two tokens counts as two steps.
        let two = Streamed {
            arrivals: vec![(base, 1), (base + Duration::from_millis(8), 2)],
            timings: None,
        };
        assert!((decoding_gaps(&[two])[0] - 4.0).abs() < 1e-6);
        assert!(decoding_gaps(&[]).is_empty());
    }
}
