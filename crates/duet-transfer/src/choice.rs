//! Which KV transport a (prefill, decode) pair uses: `--kv-transport auto|grpc|cuda-ipc|nccl`
//! on each worker, resolved from both workers' placements (node and device).
//!
//! `auto` takes the fastest path the pair allows: two GPU workers on one node → `cuda-ipc`, on
//! different nodes → `nccl`, anything with a CPU worker → `grpc`. An explicit choice the pair
//! cannot use is an error, never a silent downgrade.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use duet_engine::device::Device;
use duet_proto::v1::TransportKind;

use crate::KvTransport;
use crate::grpc::GrpcTransport;

/// What a worker's `--kv-transport` flag asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TransportChoice {
    #[default]
    Auto,
    Grpc,
    CudaIpc,
    Nccl,
}

/// Where a worker runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The node (host) name: workers on one node can share GPU memory through CUDA IPC.
    pub node: String,
    pub device: Device,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TransportError {
    #[error("--kv-transport {choice} needs a GPU worker, and this one runs on --device cpu")]
    NeedsGpu { choice: TransportChoice },
    #[error(
        "--kv-transport cuda-ipc needs both workers on one node, but the prefill worker is on {prefill:?} and the decode worker on {decode:?}; use nccl or grpc"
    )]
    DifferentNodes { prefill: String, decode: String },
    #[error(
        "--kv-transport {choice}: the transport is built (duet-cuda) but the workers' push path does not use it yet; use auto or grpc"
    )]
    NotConnected { choice: TransportChoice },
    #[error(
        "--kv-transport {choice} needs both workers on GPUs; the {cpu_side} worker runs on the CPU"
    )]
    PeerOnCpu {
        choice: TransportChoice,
        cpu_side: &'static str,
    },
}

impl FromStr for TransportChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "grpc" => Ok(Self::Grpc),
            "cuda-ipc" => Ok(Self::CudaIpc),
            "nccl" => Ok(Self::Nccl),
            other => Err(format!(
                "unknown KV transport {other:?}: expected auto, grpc, cuda-ipc or nccl"
            )),
        }
    }
}

impl TransportChoice {
    /// The flag's value (and a transport's name in metrics and traces).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Grpc => "grpc",
            Self::CudaIpc => "cuda-ipc",
            Self::Nccl => "nccl",
        }
    }
}

/// A transport's name, as its `--kv-transport` value spells it.
pub fn transport_name(kind: TransportKind) -> &'static str {
    match kind {
        TransportKind::Grpc | TransportKind::Unspecified => TransportChoice::Grpc,
        TransportKind::CudaIpc => TransportChoice::CudaIpc,
        TransportKind::Nccl => TransportChoice::Nccl,
    }
    .as_str()
}

impl fmt::Display for TransportChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl TransportChoice {
    /// Checks the flag against the worker's own device at start-up.
    pub fn check_device(self, device: Device) -> Result<(), TransportError> {
        match (self, device) {
            (Self::CudaIpc | Self::Nccl, Device::Cpu) => {
                Err(TransportError::NeedsGpu { choice: self })
            }
            _ => Ok(()),
        }
    }

    /// What a worker started with this flag pushes KV with: the flag checked against its device,
    /// and against the transports the push path carries today (gRPC; `auto` resolves to it).
    pub fn for_worker(self, device: Device) -> Result<TransportKind, TransportError> {
        self.check_device(device)?;
        match self {
            Self::Auto | Self::Grpc => Ok(TransportKind::Grpc),
            Self::CudaIpc | Self::Nccl => Err(TransportError::NotConnected { choice: self }),
        }
    }
}

/// The sending side of `kind`, as this build carries it; its calls authenticated by `auth`.
pub fn open_transport(
    kind: TransportKind,
    auth: duet_proto::PeerAuth,
) -> Result<Arc<dyn KvTransport>, TransportError> {
    match kind {
        TransportKind::Grpc | TransportKind::Unspecified => Ok(Arc::new(GrpcTransport::new(auth))),
        TransportKind::CudaIpc => Err(TransportError::NotConnected {
            choice: TransportChoice::CudaIpc,
        }),
        TransportKind::Nccl => Err(TransportError::NotConnected {
            choice: TransportChoice::Nccl,
        }),
    }
}

/// Resolves the transport for one pair; `choice` is the prefill worker's flag (the sender picks,
/// within what the decode worker offers).
pub fn choose(
    choice: TransportChoice,
    prefill: &Placement,
    decode: &Placement,
) -> Result<TransportKind, TransportError> {
    let both_gpu = matches!(
        (prefill.device, decode.device),
        (Device::Cuda(_), Device::Cuda(_))
    );
    let same_node = prefill.node == decode.node;
    let cpu_side = if matches!(prefill.device, Device::Cpu) {
        "prefill"
    } else {
        "decode"
    };
    match choice {
        TransportChoice::Grpc => Ok(TransportKind::Grpc),
        TransportChoice::Auto if !both_gpu => Ok(TransportKind::Grpc),
        TransportChoice::Auto if same_node => Ok(TransportKind::CudaIpc),
        TransportChoice::Auto => Ok(TransportKind::Nccl),
        TransportChoice::CudaIpc | TransportChoice::Nccl if !both_gpu => {
            Err(TransportError::PeerOnCpu { choice, cpu_side })
        }
        TransportChoice::CudaIpc if !same_node => Err(TransportError::DifferentNodes {
            prefill: prefill.node.clone(),
            decode: decode.node.clone(),
        }),
        TransportChoice::CudaIpc => Ok(TransportKind::CudaIpc),
        TransportChoice::Nccl => Ok(TransportKind::Nccl),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(node: &str, device: Device) -> Placement {
        Placement {
            node: node.into(),
            device,
        }
    }

    #[test]
    fn auto_takes_the_fastest_path_the_pair_allows() {
        let gpu_a0 = at("a", Device::Cuda(0));
        let gpu_a1 = at("a", Device::Cuda(1));
        let gpu_b = at("b", Device::Cuda(0));
        let cpu_a = at("a", Device::Cpu);
        let auto = TransportChoice::Auto;
        assert_eq!(choose(auto, &gpu_a0, &gpu_a1), Ok(TransportKind::CudaIpc));
        assert_eq!(choose(auto, &gpu_a0, &gpu_a0), Ok(TransportKind::CudaIpc));
        assert_eq!(choose(auto, &gpu_a0, &gpu_b), Ok(TransportKind::Nccl));
        assert_eq!(choose(auto, &cpu_a, &gpu_a0), Ok(TransportKind::Grpc));
        assert_eq!(choose(auto, &gpu_a0, &cpu_a), Ok(TransportKind::Grpc));
        assert_eq!(
            choose(TransportChoice::Grpc, &gpu_a0, &gpu_a1),
            Ok(TransportKind::Grpc)
        );
    }

    #[test]
    fn an_explicit_choice_the_pair_cannot_use_is_an_error() {
        let gpu_a = at("a", Device::Cuda(0));
        let gpu_b = at("b", Device::Cuda(0));
        let cpu_a = at("a", Device::Cpu);
        let err = choose(TransportChoice::CudaIpc, &gpu_a, &gpu_b).unwrap_err();
        assert!(err.to_string().contains("one node"), "{err}");
        let err = choose(TransportChoice::Nccl, &gpu_a, &cpu_a).unwrap_err();
        assert!(
            err.to_string().contains("decode worker runs on the CPU"),
            "{err}"
        );
        assert_eq!(
            choose(TransportChoice::Nccl, &gpu_a, &gpu_b),
            Ok(TransportKind::Nccl)
        );
    }

    #[test]
    fn the_flag_is_checked_against_the_workers_device() {
        assert!(TransportChoice::CudaIpc.check_device(Device::Cpu).is_err());
        assert!(TransportChoice::Nccl.check_device(Device::Cpu).is_err());
        assert!(TransportChoice::Auto.check_device(Device::Cpu).is_ok());
        assert!(
            TransportChoice::CudaIpc
                .check_device(Device::Cuda(0))
                .is_ok()
        );
        for s in ["auto", "grpc", "cuda-ipc", "nccl"] {
            assert_eq!(s.parse::<TransportChoice>().unwrap().to_string(), s);
        }
        assert!(
            "ipc"
                .parse::<TransportChoice>()
                .unwrap_err()
                .contains("cuda-ipc")
        );
    }

    #[test]
    fn workers_refuse_a_transport_their_push_path_does_not_carry() {
        assert_eq!(
            TransportChoice::Auto.for_worker(Device::Cpu),
            Ok(TransportKind::Grpc)
        );
        assert_eq!(
            TransportChoice::Grpc.for_worker(Device::Cuda(0)),
            Ok(TransportKind::Grpc)
        );
        let err = TransportChoice::CudaIpc
            .for_worker(Device::Cuda(0))
            .unwrap_err();
        assert!(err.to_string().contains("use auto or grpc"), "{err}");
        let err = TransportChoice::Nccl.for_worker(Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("--device cpu"), "{err}");
    }
}
