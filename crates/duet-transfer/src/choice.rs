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
use duet_proto::v1::{self, KvChunk, TransportKind};
use tokio::sync::mpsc::UnboundedSender;

use crate::grpc::GrpcTransport;
use crate::{KvSender, KvTransport, KvWire};

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
        "--kv-transport nccl: NCCL needs the two workers on two GPUs and is not on the workers' push path yet; use auto (cuda-ipc between two GPU workers on one node) or grpc"
    )]
    NotConnected { choice: TransportChoice },
    #[error(
        "--kv-transport {choice} needs a build with CUDA (`cargo build --release --features cuda`)"
    )]
    NotBuilt { choice: TransportChoice },
    #[error(
        "--kv-transport cuda-ipc: the decode worker cannot export its KV cache for CUDA IPC: {reason}"
    )]
    NoExport { reason: String },
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

    /// The fastest transport a worker started with this flag may push (prefill) or offer
    /// (decode) KV with: the flag checked against its device and against the transports the
    /// push path carries (gRPC, cuda-ipc). `auto` on a GPU is cuda-ipc, used per push where the
    /// decode worker offers it from this node and gRPC otherwise; on the CPU it is gRPC.
    pub fn for_worker(self, device: Device) -> Result<TransportKind, TransportError> {
        self.check_device(device)?;
        match (self, device) {
            (Self::Grpc, _) | (Self::Auto, Device::Cpu) => Ok(TransportKind::Grpc),
            (Self::Auto | Self::CudaIpc, _) if !cfg!(feature = "cuda") => {
                if self == Self::Auto {
                    Ok(TransportKind::Grpc)
                } else {
                    Err(TransportError::NotBuilt { choice: self })
                }
            }
            (Self::Auto | Self::CudaIpc, _) => Ok(TransportKind::CudaIpc),
            (Self::Nccl, _) => Err(TransportError::NotConnected { choice: self }),
        }
    }

    /// What a decode worker started with this flag puts in `KvDestination.transport` and
    /// `.transport_params`: its CUDA-IPC offer where the flag allows cuda-ipc and the export
    /// worked (`export`: the encoded [`IpcOffer`], or why there is none), else gRPC. An explicit
    /// cuda-ipc without an export is an error.
    pub fn decode_offer(
        self,
        device: Device,
        export: Result<Vec<u8>, String>,
    ) -> Result<(TransportKind, Vec<u8>), TransportError> {
        match self.for_worker(device)? {
            TransportKind::CudaIpc => match export {
                Ok(params) => Ok((TransportKind::CudaIpc, params)),
                Err(reason) if self == Self::CudaIpc => Err(TransportError::NoExport { reason }),
                Err(_) => Ok((TransportKind::Grpc, Vec::new())),
            },
            kind => Ok((kind, Vec::new())),
        }
    }
}

/// The sending side for a prefill worker started with `choice` on `device`, its control calls
/// authenticated by `auth`: gRPC, or cuda-ipc (which falls back to gRPC per push under `auto`).
pub fn open_transport(
    choice: TransportChoice,
    device: Device,
    auth: duet_proto::PeerAuth,
) -> Result<Arc<dyn KvTransport>, TransportError> {
    match choice.for_worker(device)? {
        TransportKind::CudaIpc => cuda_ipc_transport(choice, auth),
        _ => Ok(Arc::new(GrpcTransport::new(auth))),
    }
}

#[cfg(feature = "cuda")]
fn cuda_ipc_transport(
    choice: TransportChoice,
    auth: duet_proto::PeerAuth,
) -> Result<Arc<dyn KvTransport>, TransportError> {
    Ok(Arc::new(crate::cuda_ipc::CudaIpcTransport::new(
        auth,
        choice == TransportChoice::CudaIpc,
        node_name(),
    )))
}

#[cfg(not(feature = "cuda"))]
fn cuda_ipc_transport(
    choice: TransportChoice,
    _: duet_proto::PeerAuth,
) -> Result<Arc<dyn KvTransport>, TransportError> {
    Err(TransportError::NotBuilt { choice })
}

/// The encoded [`IpcOffer`] of an engine's KV store (`&B::KvStore`) in this process, or why
/// there is none (not a CUDA store, no CUDA in this build, the export failed).
pub fn ipc_offer(kv_store: &dyn std::any::Any) -> Result<Vec<u8>, String> {
    #[cfg(feature = "cuda")]
    {
        crate::cuda_ipc::offer(kv_store)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = kv_store;
        Err("this build has no CUDA support".into())
    }
}

/// The host's name (for same-node transports): `HOSTNAME`, else /etc/hostname, else "localhost".
pub fn node_name() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

const OFFER_MAGIC: &[u8; 8] = b"duetoff1";

/// A decode worker's CUDA-IPC offer (`KvDestination.transport_params`): where it runs (node and
/// process; a handle opens only on its node, and not in the process that exported it) and its
/// exported KV store (`cuda_ipc::KvIpcExport`, encoded).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpcOffer {
    pub node: String,
    pub pid: u32,
    pub export: Vec<u8>,
}

impl IpcOffer {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.node.len() + self.export.len());
        out.extend_from_slice(OFFER_MAGIC);
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&(self.node.len() as u32).to_le_bytes());
        out.extend_from_slice(self.node.as_bytes());
        out.extend_from_slice(&self.export);
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        let bad = |what: &str| format!("malformed CUDA-IPC transport parameters: {what}");
        let rest = bytes
            .strip_prefix(OFFER_MAGIC.as_slice())
            .ok_or_else(|| bad("no duetoff1 magic"))?;
        if rest.len() < 8 {
            return Err(bad("truncated"));
        }
        let pid = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes"));
        let len = u32::from_le_bytes(rest[4..8].try_into().expect("4 bytes")) as usize;
        let rest = &rest[8..];
        if rest.len() < len {
            return Err(bad("node name truncated"));
        }
        let node = std::str::from_utf8(&rest[..len])
            .map_err(|_| bad("node name is not UTF-8"))?
            .to_string();
        Ok(Self {
            node,
            pid,
            export: rest[len..].to_vec(),
        })
    }

    /// Whether a worker on `node`, in process `pid`, can open this offer; else why not.
    pub fn usable_from(&self, node: &str, pid: u32) -> Result<(), String> {
        if self.node != node {
            return Err(format!(
                "the decode worker runs on node {:?}, this worker on {node:?}",
                self.node
            ));
        }
        if self.pid == pid {
            return Err(
                "the decode worker runs in this process (CUDA IPC opens only another process's memory)"
                    .into(),
            );
        }
        Ok(())
    }
}

/// How a decode worker answers a peer's pull `request` of the prefix's blocks `..blocks_end`:
/// over CUDA IPC, into the caller's store its offer names, where the caller asks for it, this
/// worker offers cuda-ipc itself (`holder_offers`: a GPU worker whose `--kv-transport` allows
/// it), the offer opens from `node` and process `pid`, and it names a destination block for
/// every block; else over gRPC, with why not (`None`: the caller asked for gRPC).
pub fn pull_answer_transport(
    request: &v1::KvPullRequest,
    holder_offers: TransportKind,
    node: &str,
    pid: u32,
    blocks_end: usize,
) -> Result<IpcOffer, Option<String>> {
    if request.transport() != TransportKind::CudaIpc {
        return Err(None);
    }
    if holder_offers != TransportKind::CudaIpc {
        return Err(Some(format!(
            "this worker moves KV over {}, not cuda-ipc",
            transport_name(holder_offers)
        )));
    }
    let offer = IpcOffer::decode(&request.transport_params)?;
    offer.usable_from(node, pid)?;
    if request.dest_block_ids.len() < blocks_end {
        return Err(Some(format!(
            "dest_block_ids has {} blocks; the pull covers {blocks_end}",
            request.dest_block_ids.len()
        )));
    }
    Ok(offer)
}

/// A holder's side of pulls answered over CUDA IPC: each caller's KV store, opened once.
#[derive(Default)]
pub struct IpcPulls {
    #[cfg(feature = "cuda")]
    pulls: crate::cuda_ipc::CudaIpcPulls,
}

impl IpcPulls {
    /// The sender of the answer to pull `request_id` over CUDA IPC: it copies each layer's
    /// blocks into `dest_block_ids` of the store `offer` names, then sends the landed ranges and
    /// the closing message into `tx` (after the header). Why not, without CUDA in this build or
    /// where the offer does not open.
    pub fn sender(
        &self,
        wire: &KvWire,
        request_id: &str,
        offer: &IpcOffer,
        dest_block_ids: Vec<u32>,
        tx: UnboundedSender<KvChunk>,
    ) -> Result<Box<dyn KvSender>, String> {
        #[cfg(feature = "cuda")]
        {
            self.pulls
                .sender(wire, request_id, offer, dest_block_ids, tx)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (wire, request_id, offer, dest_block_ids, tx);
            Err("this build has no CUDA support".into())
        }
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
        let err = TransportChoice::Nccl
            .for_worker(Device::Cuda(0))
            .unwrap_err();
        assert!(err.to_string().contains("two GPUs"), "{err}");
        let err = TransportChoice::Nccl.for_worker(Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("--device cpu"), "{err}");
        let err = TransportChoice::CudaIpc
            .for_worker(Device::Cpu)
            .unwrap_err();
        assert!(err.to_string().contains("--device cpu"), "{err}");
    }

    #[test]
    fn gpu_workers_push_over_cuda_ipc_where_the_build_has_it() {
        let on_gpu = |c: TransportChoice| c.for_worker(Device::Cuda(0));
        if cfg!(feature = "cuda") {
            assert_eq!(on_gpu(TransportChoice::Auto), Ok(TransportKind::CudaIpc));
            assert_eq!(on_gpu(TransportChoice::CudaIpc), Ok(TransportKind::CudaIpc));
        } else {
            assert_eq!(on_gpu(TransportChoice::Auto), Ok(TransportKind::Grpc));
            let err = on_gpu(TransportChoice::CudaIpc).unwrap_err();
            assert!(err.to_string().contains("--features cuda"), "{err}");
        }
        let auth = duet_proto::PeerAuth::default();
        let grpc = open_transport(TransportChoice::Auto, Device::Cpu, auth.clone()).unwrap();
        assert_eq!(grpc.kind(), TransportKind::Grpc);
        let gpu = open_transport(TransportChoice::CudaIpc, Device::Cuda(0), auth.clone());
        let built = cfg!(feature = "cuda");
        match gpu {
            Ok(t) => assert_eq!((built, t.kind()), (true, TransportKind::CudaIpc)),
            Err(e) => assert!(
                !built && matches!(e, TransportError::NotBuilt { .. }),
                "{e}"
            ),
        }
        assert!(open_transport(TransportChoice::Nccl, Device::Cuda(0), auth).is_err());
    }

    #[test]
    fn the_decode_worker_offers_cuda_ipc_only_with_an_export() {
        let gpu = Device::Cuda(0);
        let export = || Ok(vec![1, 2, 3]);
        let none = || Err("cuIpcGetMemHandle failed".to_string());
        assert_eq!(
            TransportChoice::Grpc.decode_offer(gpu, export()),
            Ok((TransportKind::Grpc, vec![]))
        );
        assert_eq!(
            TransportChoice::Auto.decode_offer(Device::Cpu, none()),
            Ok((TransportKind::Grpc, vec![]))
        );
        assert_eq!(
            TransportChoice::Auto.decode_offer(gpu, none()),
            Ok((TransportKind::Grpc, vec![]))
        );
        if cfg!(feature = "cuda") {
            assert_eq!(
                TransportChoice::Auto.decode_offer(gpu, export()),
                Ok((TransportKind::CudaIpc, vec![1, 2, 3]))
            );
            let err = TransportChoice::CudaIpc
                .decode_offer(gpu, none())
                .unwrap_err();
            assert!(
                err.to_string().contains("cuIpcGetMemHandle failed"),
                "{err}"
            );
        }
    }

    #[test]
    fn an_ipc_offer_round_trips_and_opens_only_on_its_node_from_another_process() {
        let offer = IpcOffer {
            node: "gpu-node-7".into(),
            pid: 4242,
            export: (0..100).collect(),
        };
        let bytes = offer.encode();
        assert_eq!(IpcOffer::decode(&bytes), Ok(offer.clone()));
        for cut in [0, 7, 12, 17] {
            assert!(IpcOffer::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut wrong = bytes.clone();
        wrong[0] ^= 1;
        assert!(IpcOffer::decode(&wrong).unwrap_err().contains("magic"));
        assert_eq!(offer.usable_from("gpu-node-7", 1), Ok(()));
        let e = offer.usable_from("gpu-node-8", 1).unwrap_err();
        assert!(e.contains("gpu-node-8"), "{e}");
        let e = offer.usable_from("gpu-node-7", 4242).unwrap_err();
        assert!(e.contains("this process"), "{e}");
    }

    /// A pull is answered over CUDA IPC only where the caller asks, the holder is a cuda-ipc
    /// worker, the caller's store opens here (same node, another process) and every block has
    /// a destination; otherwise over gRPC, saying why where CUDA IPC was asked for.
    #[test]
    fn a_pull_is_answered_over_cuda_ipc_only_where_both_ends_can() {
        let offer = IpcOffer {
            node: "a".into(),
            pid: 7,
            export: vec![1, 2, 3],
        };
        let asked = v1::KvPullRequest {
            transport: TransportKind::CudaIpc as i32,
            transport_params: offer.encode(),
            dest_block_ids: vec![4, 5, 6],
            ..Default::default()
        };
        let ipc = TransportKind::CudaIpc;
        assert_eq!(pull_answer_transport(&asked, ipc, "a", 8, 3), Ok(offer));
        let grpc = |r: Result<IpcOffer, Option<String>>| r.unwrap_err();
        let not_asked = v1::KvPullRequest {
            transport: TransportKind::Grpc as i32,
            ..asked.clone()
        };
        assert_eq!(
            grpc(pull_answer_transport(&not_asked, ipc, "a", 8, 3)),
            None
        );
        let why = |r| grpc(r).expect("a reason");
        let cpu_holder = pull_answer_transport(&asked, TransportKind::Grpc, "a", 8, 3);
        assert!(why(cpu_holder).contains("not cuda-ipc"));
        assert!(why(pull_answer_transport(&asked, ipc, "b", 8, 3)).contains("node"));
        assert!(why(pull_answer_transport(&asked, ipc, "a", 7, 3)).contains("process"));
        assert!(why(pull_answer_transport(&asked, ipc, "a", 8, 4)).contains("dest_block_ids"));
        let garbled = v1::KvPullRequest {
            transport_params: vec![9; 12],
            ..asked
        };
        assert!(why(pull_answer_transport(&garbled, ipc, "a", 8, 3)).contains("malformed"));
    }
}
