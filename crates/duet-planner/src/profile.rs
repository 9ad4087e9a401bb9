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

    /// Milliseconds one step of `shape` takes on this device alone.
    pub fn step_ms(&self, shape: &StepShape) -> f64 {
        let p = &self.prefill.fit;
        let d = &self.decode.fit;
        let prompt = p.b_ms_per_token * shape.prefill_tokens
            + p.c_ms_per_attended_token * shape.prefill_attention;
        if shape.decode_rows == 0 {
            p.a_ms + prompt
        } else {
            d.a_ms
                + d.b_ms_per_context_token * shape.decode_context
                + d.c_ms_per_sequence * shape.decode_rows as f64
                + prompt
        }
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
    }
}
