//! `duet profile`'s served measurement ([`duet_planner::profile::ServingProfile`]): a real
//! prefill worker and a real decode worker in this process, with the profiled engine settings,
//! are sent requests over gRPC on loopback (`Decode`, as the router sends them).
//!
//! - Decode steps: `batch` requests at once, prefilled by the decode worker itself; the median
//!   gap between a stream's tokens while every stream decodes is a served decode step, set
//!   beside what the decode fit predicts for it.
//! - Prompts: one at a time, in turn prefilled by the decode worker itself and by the prefill
//!   worker pushing the KV to it; each worker's own account of the compute
//!   (`Timings.prefill_ms`). Measured in turn, the two share the machine's state: on a machine
//!   whose speed drifts (±8% within a minute on the 2-core Zen 5), their ratio is what pushing
//!   adds, where a served prompt set beside the fit measured earlier would be the drift.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Result, ensure};
use duet_engine::device::Device;
use duet_engine::engine::EngineOptions;
use duet_planner::profile::{Profile, PushedSample, ServedSample, ServingProfile, StepShape};
use duet_proto::v1;
use futures::StreamExt;

use crate::bench_engine::prompt_source;
use crate::in_process;
use crate::progress::Progress;

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
    pub(crate) fn points(&self) -> usize {
        self.batches.len() + self.prompt_tokens.len()
    }

    /// KV tokens a worker holds at once at most.
    fn kv_tokens(&self) -> usize {
        let batch = self.batches.iter().copied().max().unwrap_or(0);
        let prompt = self.prompt_tokens.iter().copied().max().unwrap_or(0);
        (batch * (self.decode_prompt + self.decode_tokens as usize + 16)).max(prompt + 32)
    }
}

/// Measures `plan` through a prefill and a decode worker serving `model` with `engine`'s
/// settings, against the bare engine's fits in `profile`.
pub(crate) async fn measure_served(
    model: &Path,
    mut engine: EngineOptions,
    vocab: usize,
    profile: &Profile,
    plan: &ServedPlan<'_>,
    progress: &Progress,
) -> Result<ServingProfile> {
    engine.kv_cache_tokens = engine
        .kv_cache_tokens
        .max(plan.kv_tokens().next_multiple_of(64));
    if let Device::Cuda(_) = engine.device {
        // Two workers on one GPU: half the memory each.
        engine.gpu_memory_fraction /= 2.0;
    }
    let (prefill_listener, decode_listener) =
        (in_process::listen().await?, in_process::listen().await?);
    let prefill_address = prefill_listener.local_addr()?.to_string();
    let decode = in_process::decode_worker(
        decode_listener,
        model,
        engine.clone(),
        vec![prefill_address],
    )
    .await?;
    let prefill_worker =
        in_process::prefill_worker(prefill_listener, model, engine, vec![decode.address]).await?;
    let remote = v1::PrefillPlan {
        local: false,
        prefill_workers: vec![v1::PrefillTarget {
            worker_id: prefill_worker.worker_id,
            address: prefill_worker.address,
        }],
    };
    let client = v1::decode_worker_client::DecodeWorkerClient::connect(decode.url).await?;
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

    let mut decode = Vec::new();
    for &batch in plan.batches {
        let mut gaps = Vec::new();
        for _ in 0..plan.repeats {
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
        }
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
        progress.inc(1);
    }

    let mut prefill = Vec::new();
    let mut ratios = Vec::new();
    for &tokens in plan.prompt_tokens {
        let (mut pushed, mut local_ms) = (Vec::new(), Vec::new());
        for _ in 0..plan.repeats {
            let here = prefill_ms(&client, prompt(tokens), local()).await?;
            let there = prefill_ms(&client, prompt(tokens), remote.clone()).await?;
            ratios.push(there / here);
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
    Ok(ServingProfile {
        decode,
        prefill,
        prefill_push_factor,
    })
}

fn local() -> v1::PrefillPlan {
    v1::PrefillPlan {
        local: true,
        prefill_workers: Vec::new(),
    }
}

/// The compute of one fresh prompt prefilled as `plan` says, as the worker that computed it
/// reports it; refused if the plan was not followed.
async fn prefill_ms(
    client: &v1::decode_worker_client::DecodeWorkerClient<tonic::transport::Channel>,
    prompt: Vec<u32>,
    plan: v1::PrefillPlan,
) -> Result<f64> {
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
    mut client: v1::decode_worker_client::DecodeWorkerClient<tonic::transport::Channel>,
    prompt: Vec<u32>,
    max_tokens: u32,
    plan: v1::PrefillPlan,
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
    while let Some(msg) = responses.next().await {
        let msg = msg?;
        ensure!(
            msg.error.is_empty(),
            "a served request failed: {}",
            msg.error
        );
        if !msg.token_ids.is_empty() {
            s.arrivals.push((Instant::now(), msg.token_ids.len()));
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
