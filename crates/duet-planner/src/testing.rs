//! A profile of made-up numbers and a simulated cluster to time by it, for tests of the
//! simulator and of what runs it (the run-time planner's); behind the `testing` feature outside
//! this crate. No device measured them.

use duet_routing::{PolicyParams, RoutingPolicy};

use crate::fit::FitError;
use crate::profile::{
    DecodeFit, DecodeProfile, DeviceInfo, KvInfo, ModelInfo, PROFILE_FORMAT, PrefillFit,
    PrefillProfile, Profile, SpeedFlags, TransferFit, TransferProfile,
};
use crate::report::Slo;
use crate::sim_worker::Sharing;
use crate::simulator::{Design, RouterShape, SimConfig};

/// A synthetic profile: prefill 2 ms + 0.1 ms/token (no attention cost), decode 5 ms +
/// 0.001 ms per context token + 0.2 ms per row, a grpc link at 1 ms + 2 ms/MiB.
pub fn synthetic() -> Profile {
    Profile {
        format: PROFILE_FORMAT,
        device: DeviceInfo {
            kind: "cpu".into(),
            name: "test".into(),
            cores: 2,
        },
        model: ModelInfo {
            name: "test".into(),
            fingerprint: "fp".into(),
            num_layers: 4,
        },
        commit: "test".into(),
        source: "synthetic".into(),
        flags: SpeedFlags {
            threads: 1,
            cpu_kernels: "portable".into(),
            kv_dtype: "f16".into(),
            max_step_tokens: 512,
        },
        kv: KvInfo {
            block_size: 16,
            block_bytes: 1 << 16,
            memory_bytes: None,
        },
        prefill: PrefillProfile {
            samples: Vec::new(),
            fit: PrefillFit {
                a_ms: 2.0,
                b_ms_per_token: 0.1,
                c_ms_per_attended_token: 0.0,
            },
            error: FitError::default(),
        },
        decode: DecodeProfile {
            samples: Vec::new(),
            fit: DecodeFit {
                a_ms: 5.0,
                b_ms_per_context_token: 0.001,
                c_ms_per_sequence: 0.2,
            },
            error: FitError::default(),
        },
        transfer: vec![TransferProfile {
            transport: "grpc".into(),
            samples: Vec::new(),
            fit: TransferFit {
                a_ms: 1.0,
                ms_per_mib: 2.0,
            },
            error: FitError::default(),
        }],
        serving: None,
    }
}

/// A cluster of `design` on dedicated devices, timed by the synthetic profile.
pub fn config(design: Design, prefill: usize, decode: usize) -> SimConfig {
    SimConfig {
        design,
        prefill_workers: prefill,
        decode_workers: decode,
        max_step_tokens: 512,
        kv_cache_tokens: 16 * 1024,
        routing: RouterShape {
            policy: PolicyParams {
                policy: RoutingPolicy::CacheAware,
                local_prefill_threshold: match design {
                    Design::Disaggregated => 0,
                    Design::Colocated => u32::MAX,
                },
                kv_link_bytes_per_s: 1e9,
                prefill_saturation_factor: 0.0,
            },
            stats_interval_s: 0.5,
            pending_prefix_ttl_s: 10.0,
            max_queued_requests: 256,
            request_timeout_s: 600.0,
        },
        prefill_max_queued_tokens: 65536,
        sharing: Sharing::Dedicated,
        transport: "grpc".into(),
        slo: Slo {
            ttft_ms: 1000.0,
            tpot_ms: 100.0,
        },
        timeline_window_s: 1.0,
        keep_outcomes: false,
    }
}
