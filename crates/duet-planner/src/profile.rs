//! A profile: what `duet profile` measured of one engine on one device, and DistServe's latency
//! forms fitted to it, which is all the simulator knows of time.
//!
//! - A step that computes prompt tokens only takes `a + b·Σnew + c·Σnew·(cached + new)`: per
//!   prompt chunk, `new` tokens computed after `cached` ones already in the KV cache (a prefix
//!   hit, or the earlier chunks of a long prompt). With nothing cached this is DistServe's
//!   prefill form `a + b·Σlen + c·Σlen²`; the quadratic term is attention.
//! - A step of decode rows only takes `a + b·Σctx + c·batch`, DistServe's decode form: `ctx` is
//!   each row's context (its KV read), `batch` the rows.
//! - A step that does both (chunked prefill beside decoding) pays the decode's fixed cost once
//!   and each part's per-token cost: `a_dec + b_dec·Σctx + c_dec·batch + b_pre·Σnew + c_pre·Σnew·
//!   (cached + new)`.
//! - A KV transfer of `bytes` takes `a + bytes / bandwidth` when pushed alone; pushed layer by
//!   layer while the prompt computes, only what compute did not hide shows (see
//!   [`Profile::exposed_transfer_ms`]).
//! - A served worker's decode step takes longer than the bare engine's that the forms above were
//!   fitted to (its engine thread also answers its channels, and each token is detokenized and
//!   streamed), and the linear form misses small batches (a step of one row reads every weight
//!   however little it computes). Where the profile measured a served worker
//!   ([`ServingProfile`]), a step with decode rows costs what served steps of as many rows
//!   measured beyond the fit, and a prefill worker's step what pushing its KV as it computes
//!   added to a prompt.
//! - Two served workers computing at once on a machine whose cores their kernel threads fill
//!   run slower than either alone: the threads that serve them find no idle core. Where the
//!   profile measured it ([`Contention`]), the simulator slows such steps by the factor
//!   measured (see `sim_worker::Machine`).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::PlannerError;
use crate::fit::FitError;

/// The profile format this build reads and writes.
pub const PROFILE_FORMAT: u32 = 1;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub format: u32,
    pub device: DeviceInfo,
    pub model: ModelInfo,
    /// The commit of the build that measured it (or that derived it, see `source`).
    pub commit: String,
    /// How it was made: the command line that measured it, or how it was derived.
    pub source: String,
    /// The engine flags that shape speed, as measured.
    pub flags: SpeedFlags,
    pub kv: KvInfo,
    pub prefill: PrefillProfile,
    pub decode: DecodeProfile,
    /// One entry per KV transport measured.
    pub transfer: Vec<TransferProfile>,
    /// What a served worker's steps cost beyond the bare engine's; absent: not measured (a
    /// profile derived from elsewhere, or `duet profile --skip-served`), steps cost the fits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serving: Option<ServingProfile>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceInfo {
    /// `cpu` or `cuda`.
    pub kind: String,
    /// The CPU's model name (and family/model), or the GPU's name.
    pub name: String,
    /// Cores (hardware threads) of the machine it was measured on.
    pub cores: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelInfo {
    /// The model file's or directory's name.
    pub name: String,
    /// The engine's model fingerprint (architecture, weights, KV type, block size).
    pub fingerprint: String,
    pub num_layers: usize,
}

/// The engine flags that shape a step's speed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpeedFlags {
    /// Kernel threads the engine ran with (resolved: never 0).
    pub threads: usize,
    /// `--cpu-kernels` as resolved (`avx512`, ...), or `-` on a GPU.
    pub cpu_kernels: String,
    /// The KV cache's element type as resolved.
    pub kv_dtype: String,
    /// The largest step the prefill grid measured; a longer chunk is an extrapolation.
    pub max_step_tokens: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvInfo {
    /// Tokens per block.
    pub block_size: usize,
    /// Bytes of one block, every layer, K and V: what moving it costs.
    pub block_bytes: u64,
    /// Bytes of device memory left for the KV cache of one worker (weights taken), when known:
    /// what bounds `--kv-cache-tokens` on this device.
    pub memory_bytes: Option<u64>,
}

/// One measured prefill step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillSample {
    /// Prompts in the step.
    pub seqs: usize,
    /// Tokens computed (Σnew).
    pub new_tokens: usize,
    /// Tokens each prompt found in the cache, summed (Σcached).
    pub cached_tokens: usize,
    /// Σ new·(cached + new).
    pub attention: f64,
    pub ms: f64,
}

/// `a + b·Σnew + c·Σnew·(cached + new)`, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillFit {
    pub a_ms: f64,
    pub b_ms_per_token: f64,
    pub c_ms_per_attended_token: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillProfile {
    pub samples: Vec<PrefillSample>,
    pub fit: PrefillFit,
    pub error: FitError,
}

/// One measured decode step: `batch` rows each at `context` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodeSample {
    pub batch: usize,
    pub context: usize,
    pub ms: f64,
}

/// `a + b·Σctx + c·batch`, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodeFit {
    pub a_ms: f64,
    pub b_ms_per_context_token: f64,
    pub c_ms_per_sequence: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodeProfile {
    pub samples: Vec<DecodeSample>,
    pub fit: DecodeFit,
    pub error: FitError,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransferSample {
    pub bytes: u64,
    pub ms: f64,
}

/// `a + bytes / bandwidth`, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransferFit {
    pub a_ms: f64,
    pub ms_per_mib: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransferProfile {
    /// `grpc`, `cuda-ipc` or `nccl`.
    pub transport: String,
    pub samples: Vec<TransferSample>,
    pub fit: TransferFit,
    pub error: FitError,
}

/// A decode step measured through a served worker beside what the bare engine's fit predicts
/// for it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServedSample {
    /// Concurrent streams: the step's rows.
    pub batch: usize,
    /// Each row's context (the middle of the timed steps).
    pub context: usize,
    /// The median gap between a stream's tokens at the client while every stream decoded.
    pub served_ms: f64,
    /// What the bare engine's fit predicts for the same step.
    pub engine_ms: f64,
}

/// A prompt computed by a served prefill worker while its KV streamed out to a decode worker,
/// beside the same length computed by the decode worker itself, measured in turn (so that a
/// machine's drift cancels), each the worker's own `Timings.prefill_ms`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PushedSample {
    pub tokens: usize,
    /// The median as the prefill worker computed it, pushing.
    pub pushed_ms: f64,
    /// The median as the decode worker computed it, its KV staying.
    pub local_ms: f64,
}

/// What serving adds to a step, measured through workers in the profiling process (gRPC on
/// loopback, requests sent as the router sends them).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServingProfile {
    /// Decode steps of a decode worker, one sample per batch of concurrent streams, batches
    /// increasing.
    pub decode: Vec<ServedSample>,
    /// Prompts computed by a prefill worker and by a decode worker in turn.
    pub prefill: Vec<PushedSample>,
    /// A prefill worker's step over the same step computed where its KV stays: the median of
    /// the prompt samples' ratios (1 without any). Its KV streams out layer by layer as it
    /// computes, and copying, checksumming and sending it takes CPU and memory bandwidth.
    pub prefill_push_factor: f64,
    /// What a step loses when two served workers compute at once (absent: not measured, as in
    /// profiles of earlier builds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub contention: Option<Contention>,
}

/// Two served workers computing at once, with the profile's kernel threads each: a prefill
/// worker pushing prompts to a decode worker that decodes a stream meanwhile. Where their
/// kernel threads fill the machine's cores (one each on 2 cores), the threads that serve them
/// (RPC, pushes, the stream's tokens) find no idle core and take the engines' time, and each
/// engine thread also runs slower itself. Where cores are left over, both factors come out
/// near 1.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Contention {
    /// A pushed prompt's compute beside the decoding stream over the same prompt pushed to an
    /// idle decode worker (the median of pairs measured in turn): a prefill worker's steps.
    pub prefill_factor: f64,
    /// The stream's decode steps while the prompt computes over its steps just before it (the
    /// median over the pairs): the steps of a worker whose KV stays, whatever they compute.
    pub decode_factor: f64,
}

impl Contention {
    /// The factor for a step of `shape`. A prefill worker's step pays for its KV push's
    /// threads too; a decode or colocated worker's, prompt chunks or not, has no push (the
    /// prompts' factor made a decode worker's local prefills 30% slower than measured:
    /// `bench/results/planner/contention-zen5/`).
    pub fn factor(&self, shape: &StepShape) -> f64 {
        if shape.kv_pushed {
            self.prefill_factor
        } else {
            self.decode_factor
        }
    }
}

impl ServingProfile {
    /// Milliseconds a served decode step of `rows` sequences takes beyond the fit's: the
    /// measured difference, interpolated between the batches measured and held beyond them.
    /// It carries both what serving adds and where the fit's linear form misses the measured
    /// batches (a step of one row reads every weight however little it computes).
    pub fn decode_overhead_ms(&self, rows: usize) -> f64 {
        let diff = |s: &ServedSample| s.served_ms - s.engine_ms;
        let rows = rows as f64;
        let Some(first) = self.decode.first() else {
            return 0.0;
        };
        if rows <= first.batch as f64 {
            return diff(first);
        }
        for w in self.decode.windows(2) {
            let (lo, hi) = (w[0].batch as f64, w[1].batch as f64);
            if rows <= hi {
                let t = (rows - lo) / (hi - lo);
                return diff(&w[0]) + t * (diff(&w[1]) - diff(&w[0]));
            }
        }
        self.decode.last().map_or(0.0, diff)
    }

    fn check(&self) -> Result<(), String> {
        let positive = |v: f64, field: String| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(format!(
                    "`serving.{field}` is {v}: it must be a finite number above 0"
                ))
            }
        };
        for (i, s) in self.decode.iter().enumerate() {
            positive(s.served_ms, format!("decode[{i}].served_ms"))?;
            positive(s.engine_ms, format!("decode[{i}].engine_ms"))?;
        }
        for (i, s) in self.prefill.iter().enumerate() {
            positive(s.pushed_ms, format!("prefill[{i}].pushed_ms"))?;
            positive(s.local_ms, format!("prefill[{i}].local_ms"))?;
        }
        positive(self.prefill_push_factor, "prefill_push_factor".into())?;
        if let Some(c) = &self.contention {
            positive(c.prefill_factor, "contention.prefill_factor".into())?;
            positive(c.decode_factor, "contention.decode_factor".into())?;
        }
        if let Some(i) = self
            .decode
            .windows(2)
            .position(|w| w[1].batch <= w[0].batch)
        {
            return Err(format!(
                "`serving.decode[{}].batch` is {}, after {}: the batches must increase",
                i + 1,
                self.decode[i + 1].batch,
                self.decode[i].batch
            ));
        }
        Ok(())
    }
}

/// What one step computes, as the latency forms see it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepShape {
    /// Σnew over prompt chunks.
    pub prefill_tokens: f64,
    /// Σ new·(cached + new) over prompt chunks.
    pub prefill_attention: f64,
    /// Decode rows.
    pub decode_rows: usize,
    /// Σctx over decode rows.
    pub decode_context: f64,
    /// The prompt chunks' KV streams out to a decode worker as they compute (a prefill
    /// worker's step).
    pub kv_pushed: bool,
}

impl StepShape {
    /// Adds a prompt chunk of `new` tokens after `cached` ones.
    pub fn chunk(&mut self, cached: usize, new: usize) {
        self.prefill_tokens += new as f64;
        self.prefill_attention += new as f64 * (cached + new) as f64;
    }

    /// Adds a decode row at `context` tokens.
    pub fn row(&mut self, context: usize) {
        self.decode_rows += 1;
        self.decode_context += context as f64;
    }
}

impl Profile {
    /// Reads and checks a profile file; every problem names the file and the field.
    pub fn load(path: &Path) -> Result<Self, PlannerError> {
        let text = std::fs::read_to_string(path).map_err(|e| PlannerError::Io {
            path: path.display().to_string(),
            source: e,
        })?;
        let profile: Profile = serde_json::from_str(&text).map_err(|e| {
            PlannerError::Profile(format!("{}: not a duet profile: {e}", path.display()))
        })?;
        profile
            .check()
            .map_err(|e| PlannerError::Profile(format!("{}: {e}", path.display())))?;
        Ok(profile)
    }

    /// Refuses a profile whose numbers cannot describe time, naming the field.
    pub fn check(&self) -> Result<(), String> {
        if self.format != PROFILE_FORMAT {
            return Err(format!(
                "`format` is {}, this build reads profiles of format {PROFILE_FORMAT}: measure \
                 it again with this build's `duet profile`",
                self.format
            ));
        }
        let non_negative = |v: f64, field: &str| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(format!(
                    "`{field}` is {v}: it must be a finite number of at least 0"
                ))
            }
        };
        let p = &self.prefill.fit;
        non_negative(p.a_ms, "prefill.fit.a_ms")?;
        non_negative(p.b_ms_per_token, "prefill.fit.b_ms_per_token")?;
        non_negative(
            p.c_ms_per_attended_token,
            "prefill.fit.c_ms_per_attended_token",
        )?;
        let d = &self.decode.fit;
        non_negative(d.a_ms, "decode.fit.a_ms")?;
        non_negative(
            d.b_ms_per_context_token,
            "decode.fit.b_ms_per_context_token",
        )?;
        non_negative(d.c_ms_per_sequence, "decode.fit.c_ms_per_sequence")?;
        if p.b_ms_per_token + p.c_ms_per_attended_token <= 0.0 {
            return Err(
                "`prefill.fit` gives prompt tokens no cost: b_ms_per_token and \
                 c_ms_per_attended_token are both 0"
                    .into(),
            );
        }
        if d.a_ms + d.c_ms_per_sequence <= 0.0 {
            return Err(
                "`decode.fit` gives a decode step no cost: a_ms and c_ms_per_sequence are both 0"
                    .into(),
            );
        }
        if let Some(s) = &self.serving {
            s.check()?;
        }
        for (i, t) in self.transfer.iter().enumerate() {
            non_negative(t.fit.a_ms, &format!("transfer[{i}].fit.a_ms"))?;
            non_negative(t.fit.ms_per_mib, &format!("transfer[{i}].fit.ms_per_mib"))?;
        }
        if self.kv.block_size == 0 {
            return Err("`kv.block_size` is 0".into());
        }
        if self.kv.block_bytes == 0 {
            return Err("`kv.block_bytes` is 0".into());
        }
        if self.model.num_layers == 0 {
            return Err("`model.num_layers` is 0".into());
        }
        if self.flags.threads == 0 {
            return Err("`flags.threads` is 0: a profile records the threads it ran with".into());
        }
        Ok(())
    }

    /// Milliseconds one step of `shape` takes on this device alone, in a served worker where
    /// the profile measured one.
    pub fn step_ms(&self, shape: &StepShape) -> f64 {
        let engine = self.engine_step_ms(shape);
        match &self.serving {
            Some(s) if shape.decode_rows == 0 && shape.kv_pushed => engine * s.prefill_push_factor,
            Some(s) if shape.decode_rows > 0 => {
                let decode = engine - self.prompt_ms(shape);
                // Never below half the fit's: a difference measured at short contexts, applied
                // far from them, must not make a step free.
                let served = (decode + s.decode_overhead_ms(shape.decode_rows)).max(decode / 2.0);
                engine - decode + served
            }
            _ => engine,
        }
    }

    /// How much slower a step of `shape` runs while served workers fill every core
    /// ([`Contention`]); 1 where the profile did not measure it.
    pub fn contended_factor(&self, shape: &StepShape) -> f64 {
        self.serving
            .as_ref()
            .and_then(|s| s.contention)
            .map_or(1.0, |c| c.factor(shape))
    }

    /// Milliseconds one step of `shape` takes in the bare engine: the fits alone.
    pub fn engine_step_ms(&self, shape: &StepShape) -> f64 {
        let p = &self.prefill.fit;
        let d = &self.decode.fit;
        let prompt = self.prompt_ms(shape);
        if shape.decode_rows == 0 {
            p.a_ms + prompt
        } else {
            d.a_ms
                + d.b_ms_per_context_token * shape.decode_context
                + d.c_ms_per_sequence * shape.decode_rows as f64
                + prompt
        }
    }

    /// The per-token part of a step's prompt chunks.
    fn prompt_ms(&self, shape: &StepShape) -> f64 {
        let p = &self.prefill.fit;
        p.b_ms_per_token * shape.prefill_tokens
            + p.c_ms_per_attended_token * shape.prefill_attention
    }

    /// This profile on a device whose compute takes `scale`× the time: every step's fit and
    /// served step scaled, KV transfers (the link's) kept. For a machine whose speed moved
    /// since it was profiled (the same short benchmark run then and now gives the factor), or
    /// a what-if for a slower or faster device.
    pub fn scale_compute(mut self, scale: f64) -> Result<Self, PlannerError> {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(PlannerError::Profile(format!(
                "a compute scale of {scale}: it must be a finite number above 0"
            )));
        }
        let p = &mut self.prefill.fit;
        p.a_ms *= scale;
        p.b_ms_per_token *= scale;
        p.c_ms_per_attended_token *= scale;
        let d = &mut self.decode.fit;
        d.a_ms *= scale;
        d.b_ms_per_context_token *= scale;
        d.c_ms_per_sequence *= scale;
        for s in self.serving.iter_mut().flat_map(|s| s.decode.iter_mut()) {
            s.served_ms *= scale;
            s.engine_ms *= scale;
        }
        if scale != 1.0 {
            self.source = format!("{} (compute ×{scale})", self.source);
        }
        Ok(self)
    }

    /// The transfer fit of `transport`, or an error listing those measured.
    pub fn transfer(&self, transport: &str) -> Result<&TransferFit, PlannerError> {
        self.transfer
            .iter()
            .find(|t| t.transport == transport)
            .map(|t| &t.fit)
            .ok_or_else(|| {
                let measured: Vec<&str> =
                    self.transfer.iter().map(|t| t.transport.as_str()).collect();
                PlannerError::Profile(format!(
                    "the profile measured no `{transport}` KV transfer (it has: {}); choose one \
                     with --kv-transport, or profile that transport",
                    if measured.is_empty() {
                        "none".into()
                    } else {
                        measured.join(", ")
                    }
                ))
            })
    }

    /// Milliseconds a push of `bytes` adds to the time to first token when it streams layer by
    /// layer beside `compute_ms` of prefill: the push of the last layer at least, and whatever
    /// the whole push takes beyond the compute it overlapped.
    pub fn exposed_transfer_ms(&self, fit: &TransferFit, bytes: u64, compute_ms: f64) -> f64 {
        if bytes == 0 {
            return 0.0;
        }
        let whole = bytes as f64 / (1u64 << 20) as f64 * fit.ms_per_mib;
        let last_layer = whole / self.model.num_layers as f64;
        fit.a_ms + last_layer.max(whole - compute_ms)
    }

    /// Refuses to stand for a deployment on another device, model or engine settings, naming
    /// what differs and the flag that set it.
    pub fn check_matches(&self, target: &Target) -> Result<(), PlannerError> {
        let differ =
            |what: &str, profile: &dyn std::fmt::Display, target: &dyn std::fmt::Display| {
                Err(PlannerError::Profile(format!(
                    "the profile was measured with {what} {profile}, but this run has {target}: \
                 measure a profile for it (`duet profile`), or pass the profile's settings"
                )))
            };
        if let Some(kind) = &target.device_kind
            && *kind != self.device.kind
        {
            return differ("`device.kind` (--device)", &self.device.kind, kind);
        }
        if let Some(name) = &target.model_name
            && *name != self.model.name
        {
            return differ("`model.name` (--model)", &self.model.name, name);
        }
        if let Some(threads) = target.threads
            && threads != self.flags.threads
        {
            return differ("`flags.threads` (--threads)", &self.flags.threads, &threads);
        }
        if let Some(block_size) = target.block_size
            && block_size != self.kv.block_size
        {
            return differ(
                "`kv.block_size` (--block-size)",
                &self.kv.block_size,
                &block_size,
            );
        }
        Ok(())
    }
}

/// What a simulated deployment runs, as far as it is known; `None`: not given.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Target {
    pub device_kind: Option<String>,
    /// The model's name (its file's or directory's).
    pub model_name: Option<String>,
    pub threads: Option<usize>,
    pub block_size: Option<usize>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::synthetic;

    #[test]
    fn a_step_costs_its_parts() {
        let p = synthetic();
        let mut s = StepShape::default();
        s.chunk(0, 100);
        assert!((p.step_ms(&s) - 12.0).abs() < 1e-9);
        let mut s = StepShape::default();
        s.row(1000);
        s.row(1000);
        assert!((p.step_ms(&s) - (5.0 + 2.0 + 0.4)).abs() < 1e-9);
        // Mixed: the decode's fixed cost once, and each part's per-token cost.
        s.chunk(0, 100);
        assert!((p.step_ms(&s) - (5.0 + 2.0 + 0.4 + 10.0)).abs() < 1e-9);
    }

    #[test]
    fn a_served_step_costs_what_serving_adds() {
        let mut p = synthetic();
        let sample = |batch, served_ms, engine_ms| ServedSample {
            batch,
            context: 1000,
            served_ms,
            engine_ms,
        };
        p.serving = Some(ServingProfile {
            // Served steps 0.5 ms over the fit at 1 row, 0.3 under at 4 rows.
            decode: vec![sample(1, 6.7, 6.2), sample(4, 8.7, 9.0)],
            prefill: Vec::new(),
            prefill_push_factor: 1.05,
            contention: None,
        });
        // A prompt alone: the fit's; on a prefill worker, pushing its KV, 5% more.
        let mut s = StepShape::default();
        s.chunk(0, 100);
        assert!((p.step_ms(&s) - 12.0).abs() < 1e-9);
        s.kv_pushed = true;
        assert!((p.step_ms(&s) - 12.6).abs() < 1e-9);
        // Two decode rows: 7.4 ms bare, and a third of the way from +0.5 to −0.3.
        let mut s = StepShape::default();
        s.row(1000);
        s.row(1000);
        let two = 7.4 + 0.5 - 0.8 / 3.0;
        assert!((p.step_ms(&s) - two).abs() < 1e-9, "{}", p.step_ms(&s));
        // Mixed: the prompt's 10 ms per-token part beside the served decode.
        s.chunk(0, 100);
        assert!((p.step_ms(&s) - (two + 10.0)).abs() < 1e-9);
        assert!((p.engine_step_ms(&s) - 17.4).abs() < 1e-9);
        // No contention measured: none.
        assert_eq!(p.contended_factor(&s), 1.0);
        p.serving.as_mut().unwrap().contention = Some(Contention {
            prefill_factor: 1.25,
            decode_factor: 1.1,
        });
        // A prefill worker's step pays the push's; any other, prompt chunks or not, the
        // decode worker's.
        assert_eq!(p.contended_factor(&s), 1.1);
        let mut rows = StepShape::default();
        rows.row(1000);
        assert_eq!(p.contended_factor(&rows), 1.1);
        let mut pushed = StepShape::default();
        pushed.chunk(0, 100);
        pushed.kv_pushed = true;
        assert_eq!(p.contended_factor(&pushed), 1.25);
        // Held beyond the batches measured.
        let serving = p.serving.as_ref().unwrap();
        assert!((serving.decode_overhead_ms(32) + 0.3).abs() < 1e-9);
        assert!((serving.decode_overhead_ms(1) - 0.5).abs() < 1e-9);
        // Far below the fit at 4 rows: never under half the fit's decode.
        p.serving.as_mut().unwrap().decode[1].served_ms = 1.0;
        let mut s = StepShape::default();
        (0..4).for_each(|_| s.row(10));
        assert!((p.step_ms(&s) - p.engine_step_ms(&s) / 2.0).abs() < 1e-9);
    }

    #[test]
    fn a_scaled_profile_slows_compute_and_keeps_the_link() {
        let mut p = synthetic();
        p.serving = Some(ServingProfile {
            decode: vec![ServedSample {
                batch: 1,
                context: 1000,
                served_ms: 6.7,
                engine_ms: 6.2,
            }],
            prefill: Vec::new(),
            prefill_push_factor: 1.05,
            contention: None,
        });
        let mut prompt = StepShape::default();
        prompt.chunk(0, 100);
        let mut row = StepShape::default();
        row.row(1000);
        let (prompt_ms, row_ms) = (p.step_ms(&prompt), p.step_ms(&row));
        let link = *p.transfer("grpc").unwrap();
        let slow = p.clone().scale_compute(1.25).unwrap();
        assert!((slow.step_ms(&prompt) - 1.25 * prompt_ms).abs() < 1e-9);
        assert!((slow.step_ms(&row) - 1.25 * row_ms).abs() < 1e-9);
        assert_eq!(*slow.transfer("grpc").unwrap(), link);
        assert!(slow.source.ends_with("(compute ×1.25)"), "{}", slow.source);
        let err = p.scale_compute(0.0).unwrap_err().to_string();
        assert!(err.contains("compute scale of 0"), "{err}");
    }

    #[test]
    fn a_transfer_shows_only_what_compute_did_not_hide() {
        let p = synthetic();
        let fit = *p.transfer("grpc").unwrap();
        // 4 MiB: 8 ms whole, 2 ms for the last of 4 layers.
        let mib4 = 4 << 20;
        assert!((p.exposed_transfer_ms(&fit, mib4, 100.0) - 3.0).abs() < 1e-9);
        assert!((p.exposed_transfer_ms(&fit, mib4, 1.0) - 8.0).abs() < 1e-9);
        assert_eq!(p.exposed_transfer_ms(&fit, 0, 1.0), 0.0);
        let err = p.transfer("nccl").unwrap_err().to_string();
        assert!(err.contains("`nccl`") && err.contains("grpc"), "{err}");
    }

    #[test]
    fn a_profile_from_elsewhere_is_refused_naming_what_differs() {
        let p = synthetic();
        let other_model = Target {
            model_name: Some("other".into()),
            ..Default::default()
        };
        let err = p.check_matches(&other_model).unwrap_err().to_string();
        assert!(err.contains("model.name") && err.contains("other"), "{err}");
        let gpu = Target {
            device_kind: Some("cuda".into()),
            ..Default::default()
        };
        assert!(
            p.check_matches(&gpu)
                .unwrap_err()
                .to_string()
                .contains("device.kind")
        );
        let threads = Target {
            threads: Some(2),
            ..Default::default()
        };
        assert!(
            p.check_matches(&threads)
                .unwrap_err()
                .to_string()
                .contains("--threads")
        );
        assert!(p.check_matches(&Target::default()).is_ok());
    }

    #[test]
    fn a_broken_profile_file_names_its_field() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.json");
        let mut v = serde_json::to_value(synthetic()).unwrap();
        v["decode"]["fit"]["a_ms"] = serde_json::json!(-1.0);
        std::fs::write(&path, v.to_string()).unwrap();
        let err = Profile::load(&path).unwrap_err().to_string();
        assert!(err.contains("decode.fit.a_ms"), "{err}");
        v["decode"].as_object_mut().unwrap().remove("fit");
        std::fs::write(&path, v.to_string()).unwrap();
        let err = Profile::load(&path).unwrap_err().to_string();
        assert!(err.contains("missing field `fit`"), "{err}");
        std::fs::write(
            &path,
            serde_json::to_string(&synthetic())
                .unwrap()
                .replace("\"format\":1", "\"format\":99"),
        )
        .unwrap();
        let err = Profile::load(&path).unwrap_err().to_string();
        assert!(err.contains("`format` is 99"), "{err}");
        let mut v = serde_json::to_value(synthetic()).unwrap();
        let step = |batch, served_ms| serde_json::json!({"batch": batch, "context": 160, "served_ms": served_ms, "engine_ms": 3.0});
        v["serving"] = serde_json::json!({
            "decode": [step(1, 3.2)], "prefill": [], "prefill_push_factor": 0.0,
        });
        std::fs::write(&path, v.to_string()).unwrap();
        let err = Profile::load(&path).unwrap_err().to_string();
        assert!(err.contains("serving.prefill_push_factor"), "{err}");
        v["serving"]["prefill_push_factor"] = serde_json::json!(1.0);
        v["serving"]["decode"] = serde_json::json!([step(4, 5.0), step(1, 3.2)]);
        std::fs::write(&path, v.to_string()).unwrap();
        let err = Profile::load(&path).unwrap_err().to_string();
        assert!(err.contains("serving.decode[1].batch"), "{err}");
        v["serving"]["decode"] = serde_json::json!([step(1, -1.0)]);
        std::fs::write(&path, v.to_string()).unwrap();
        let err = Profile::load(&path).unwrap_err().to_string();
        assert!(err.contains("serving.decode[0].served_ms"), "{err}");
        v["serving"]["decode"] = serde_json::json!([step(1, 3.2)]);
        v["serving"]["contention"] =
            serde_json::json!({"prefill_factor": 1.2, "decode_factor": -1.0});
        std::fs::write(&path, v.to_string()).unwrap();
        let err = Profile::load(&path).unwrap_err().to_string();
        assert!(err.contains("serving.contention.decode_factor"), "{err}");
        // Measured before contention was: none.
        v["serving"].as_object_mut().unwrap().remove("contention");
        std::fs::write(&path, v.to_string()).unwrap();
        let serving = Profile::load(&path).unwrap().serving.unwrap();
        assert_eq!(serving.contention, None);
        // A profile without the section (measured before it, or derived) still loads.
        v.as_object_mut().unwrap().remove("serving");
        std::fs::write(&path, v.to_string()).unwrap();
        assert_eq!(Profile::load(&path).unwrap().serving, None);
    }
}
