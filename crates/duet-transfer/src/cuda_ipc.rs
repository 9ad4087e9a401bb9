//! The `cuda-ipc` KV transport, for two processes on one node: the decode worker exports its KV
//! store once ([`KvIpcExport`], sent in `KvDestination.transport_params`); the prefill worker
//! opens it ([`KvIpcPeer`]) and copies each finished (layer, block) chunk from its own store
//! straight into the decode worker's reserved block, device to device, on its own stream. A
//! decode worker answering a peer's pull does the same into the caller's reserved blocks
//! ([`CudaIpcPulls`]), the answer's messages standing in for the push's control call.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{CudaContext, CudaStream};
use duet_engine::backend::{KvDtype, KvLayout};
use duet_proto::v1::kv_chunk::Kind;
use duet_proto::v1::{self, KvChunk, KvData, KvDone};
use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};
use tokio::sync::oneshot;

use duet_cuda::CudaError;
use duet_cuda::backend::{CudaBackend, CudaKvStore};

use crate::choice::IpcOffer;
use crate::grpc::GrpcTransport;
use crate::transport::{LayerSource, ReadBlocks};
use crate::{KvSender, KvTransport, KvWire, OpenPush, PushSpec, TransferError};

const MAGIC: &[u8; 8] = b"duetipc2";
/// Bytes of the KV type's name in the transport parameters (zero-padded).
const DTYPE_NAME_BYTES: usize = 8;
const ENCODED_BYTES: usize = 8 + 64 + 8 + 5 * 4 + DTYPE_NAME_BYTES;

/// What a decode worker publishes about its KV store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvIpcExport {
    pub handle: [u8; 64],
    pub bytes: u64,
    pub layout: KvLayout,
}

impl KvIpcExport {
    pub fn new(store: &CudaKvStore) -> Result<Self, CudaError> {
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: the base of a cuMemAlloc allocation, alive as long as `store`.
        unsafe { sys::cuIpcGetMemHandle(&mut handle, store.base_ptr()) }
            .result()
            .map_err(|e| CudaError::Driver(format!("exporting the KV cache for CUDA IPC: {e}")))?;
        Ok(Self {
            handle: handle.reserved.map(|c| c as u8),
            bytes: store.bytes() as u64,
            // As stored (the scratch block too): the peer computes addresses from it.
            layout: store.physical_layout(),
        })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(ENCODED_BYTES);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.handle);
        out.extend_from_slice(&self.bytes.to_le_bytes());
        let l = &self.layout;
        for v in [
            l.num_layers,
            l.num_kv_heads,
            l.head_dim,
            l.block_size,
            l.num_blocks,
        ] {
            out.extend_from_slice(&(v as u32).to_le_bytes());
        }
        let mut name = [0u8; DTYPE_NAME_BYTES];
        let dtype = l.dtype.name().as_bytes();
        name[..dtype.len()].copy_from_slice(dtype);
        out.extend_from_slice(&name);
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, CudaError> {
        let bad = || CudaError::Unsupported("malformed CUDA IPC transport parameters".into());
        if bytes.len() != ENCODED_BYTES || &bytes[..8] != MAGIC {
            return Err(bad());
        }
        let name = &bytes[100..];
        let dtype =
            std::str::from_utf8(&name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())])
                .ok()
                .and_then(KvDtype::from_name)
                .ok_or_else(bad)?;
        let u32_at =
            |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes")) as usize;
        Ok(Self {
            handle: bytes[8..72].try_into().map_err(|_| bad())?,
            bytes: u64::from_le_bytes(bytes[72..80].try_into().map_err(|_| bad())?),
            layout: KvLayout {
                num_layers: u32_at(80),
                num_kv_heads: u32_at(84),
                head_dim: u32_at(88),
                block_size: u32_at(92),
                num_blocks: u32_at(96),
                dtype,
            },
        })
    }
}

/// The encoded [`IpcOffer`] of `kv_store` (a [`CudaKvStore`]) from this node and process.
pub fn offer(kv_store: &dyn std::any::Any) -> Result<Vec<u8>, String> {
    let store = kv_store
        .downcast_ref::<CudaKvStore>()
        .ok_or("the engine's KV cache is not on a GPU")?;
    let export = KvIpcExport::new(store).map_err(|e| e.to_string())?;
    Ok(IpcOffer {
        node: crate::choice::node_name(),
        pid: std::process::id(),
        export: export.encode(),
    }
    .encode())
}

/// A decode worker's KV store, opened in the prefill worker's process.
pub struct KvIpcPeer {
    ptr: CUdeviceptr,
    layout: KvLayout,
    ctx: Arc<CudaContext>,
}

impl KvIpcPeer {
    /// Opens `export`; its geometry and KV type must equal ours, except for the number of blocks.
    pub fn open(
        ctx: &Arc<CudaContext>,
        export: &KvIpcExport,
        ours: KvLayout,
    ) -> Result<Self, CudaError> {
        let l = export.layout;
        if (
            l.num_layers,
            l.num_kv_heads,
            l.head_dim,
            l.block_size,
            l.dtype,
        ) != (
            ours.num_layers,
            ours.num_kv_heads,
            ours.head_dim,
            ours.block_size,
            ours.dtype,
        ) {
            return Err(CudaError::Unsupported(format!(
                "the decode worker's KV geometry {l:?} differs from this worker's {ours:?}"
            )));
        }
        ctx.bind_to_thread()?;
        let handle = sys::CUipcMemHandle {
            reserved: export.handle.map(|b| b as _),
        };
        let mut ptr = 0;
        // SAFETY: `handle` names a live allocation of another process on this node.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                handle,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(|e| CudaError::Driver(format!("opening the decode worker's KV cache: {e}")))?;
        Ok(Self {
            ptr,
            layout: l,
            ctx: ctx.clone(),
        })
    }

    /// Queues copies of `layer`'s chunks `src_block → dst_block` from `src` into the peer's
    /// store on `stream`. The caller synchronizes `stream` before telling the peer they landed.
    pub fn copy_blocks(
        &self,
        stream: &CudaStream,
        src: &CudaKvStore,
        layer: usize,
        pairs: &[(u32, u32)],
    ) -> Result<(), CudaError> {
        let chunk_bytes = src.chunk_bytes();
        for &(s, d) in pairs {
            if d as usize >= self.layout.num_blocks {
                return Err(CudaError::Unsupported(format!(
                    "block {d} is outside the decode worker's {} blocks",
                    self.layout.num_blocks
                )));
            }
            let dst =
                self.ptr + ((layer * self.layout.num_blocks + d as usize) * chunk_bytes) as u64;
            // SAFETY: both chunks lie inside their allocations (checked above and by the engine).
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    dst,
                    src.chunk_ptr(layer, s as usize),
                    chunk_bytes,
                    stream.cu_stream(),
                )
            }?;
        }
        Ok(())
    }
}

impl Drop for KvIpcPeer {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: opened by cuIpcOpenMemHandle, closed once.
        unsafe {
            let _ = sys::cuIpcCloseMemHandle(self.ptr);
        }
    }
}

/// Pushes KV over CUDA IPC to decode workers on this node that offer it, with the `KvTransfer`
/// call of the gRPC path as the control channel: the same header (checked by the decode worker
/// against its model and reservation), one empty-payload `KvData` per copied range once the
/// copies have completed ("landed"), `KvDone`, and the decode worker's acknowledgement. Under
/// `auto` (not `strict`) a destination without a usable offer gets a gRPC push.
pub struct CudaIpcTransport {
    grpc: GrpcTransport,
    strict: bool,
    node: String,
    /// Each decode worker's KV store, opened once (keyed by its IPC handle).
    peers: Arc<Mutex<HashMap<[u8; 64], Arc<KvIpcPeer>>>>,
}

impl CudaIpcTransport {
    /// `strict`: `--kv-transport cuda-ipc` (a destination without a usable offer is an error).
    pub fn new(auth: duet_proto::PeerAuth, strict: bool, node: String) -> Self {
        Self {
            grpc: GrpcTransport::new(auth),
            strict,
            node,
            peers: Arc::default(),
        }
    }

    /// The decode worker's export, if `spec` offers one this process can open.
    fn usable_export(&self, spec: &PushSpec) -> Result<KvIpcExport, String> {
        if spec.offered != v1::TransportKind::CudaIpc {
            return Err(format!(
                "the decode worker offers {}, not cuda-ipc",
                crate::choice::transport_name(spec.offered)
            ));
        }
        let offer = IpcOffer::decode(&spec.transport_params)?;
        offer.usable_from(&self.node, std::process::id())?;
        KvIpcExport::decode(&offer.export).map_err(|e| e.to_string())
    }
}

impl KvTransport for CudaIpcTransport {
    fn kind(&self) -> v1::TransportKind {
        v1::TransportKind::CudaIpc
    }

    fn open(&self, wire: &KvWire, spec: PushSpec) -> Result<OpenPush, TransferError> {
        let export = match self.usable_export(&spec) {
            Ok(export) => export,
            Err(reason) if self.strict => {
                return Err(TransferError::Mismatch(format!(
                    "--kv-transport cuda-ipc: cannot push request {} to the decode worker at {} over CUDA IPC: {reason}",
                    spec.request_id, spec.address
                )));
            }
            Err(reason) => {
                tracing::debug!(
                    request_id = spec.request_id,
                    "cuda-ipc not usable, pushing over gRPC: {reason}"
                );
                return self.grpc.open(wire, spec);
            }
        };
        if spec.dest_block_ids.len() < spec.blocks.end {
            return Err(TransferError::Malformed(format!(
                "dest.block_ids has {} blocks; the push covers reservation blocks {:?}",
                spec.dest_block_ids.len(),
                spec.blocks
            )));
        }
        let (tx, rx) = unbounded_channel();
        let mut header = wire.header(&spec);
        header.transport = v1::TransportKind::CudaIpc as i32;
        let (failed_tx, failed_rx) = oneshot::channel();
        let sender = IpcSender {
            request_id: spec.request_id.clone(),
            tx,
            export,
            peers: self.peers.clone(),
            dest_block_ids: spec.dest_block_ids.clone(),
            block_bytes: wire.block_bytes(),
            copy: None,
            landed: Vec::new(),
            bytes: 0,
            on_failure: Some(failed_tx),
        };
        let control = self.grpc.control(spec, header, rx)?;
        let acked = async move {
            tokio::select! {
                pushed = control => pushed,
                Ok(e) = failed_rx => Err(e),
            }
        };
        Ok(OpenPush {
            kind: v1::TransportKind::CudaIpc,
            sender: Box::new(sender),
            acked: Box::pin(acked),
        })
    }
}

/// A holder's side of pulls answered over CUDA IPC: each caller's KV store, opened once.
#[derive(Default)]
pub struct CudaIpcPulls {
    peers: Arc<Mutex<HashMap<[u8; 64], Arc<KvIpcPeer>>>>,
}

impl CudaIpcPulls {
    /// See [`IpcPulls::sender`](crate::choice::IpcPulls::sender).
    pub fn sender(
        &self,
        wire: &KvWire,
        request_id: &str,
        offer: &IpcOffer,
        dest_block_ids: Vec<u32>,
        tx: UnboundedSender<KvChunk>,
    ) -> Result<Box<dyn KvSender>, String> {
        let export = KvIpcExport::decode(&offer.export).map_err(|e| e.to_string())?;
        // A failed answer fails its call (the caller computes or asks again over gRPC); no
        // acknowledgement waits on it.
        let (failed_tx, _) = oneshot::channel();
        Ok(Box::new(IpcSender {
            request_id: request_id.to_string(),
            tx,
            export,
            peers: self.peers.clone(),
            dest_block_ids,
            block_bytes: wire.block_bytes(),
            copy: None,
            landed: Vec::new(),
            bytes: 0,
            on_failure: Some(failed_tx),
        }))
    }
}

/// The engine thread's end of a cuda-ipc push, or of a pull's answer.
struct IpcSender {
    request_id: String,
    tx: UnboundedSender<KvChunk>,
    export: KvIpcExport,
    peers: Arc<Mutex<HashMap<[u8; 64], Arc<KvIpcPeer>>>>,
    dest_block_ids: Vec<u32>,
    block_bytes: usize,
    /// The peer and this push's copy stream, from the first layer on.
    copy: Option<(Arc<KvIpcPeer>, Arc<CudaStream>)>,
    /// The ranges queued on the copy stream, announced once it has completed.
    landed: Vec<KvData>,
    bytes: u64,
    /// Fails the push (its acknowledgement future) with the first error; `None` once failed.
    on_failure: Option<oneshot::Sender<TransferError>>,
}

impl IpcSender {
    fn fail(&mut self, e: TransferError) -> TransferError {
        tracing::warn!(request_id = self.request_id, "cuda-ipc KV push failed: {e}");
        if let Some((_, stream)) = &self.copy {
            // Copies already queued finish before the failure is reported: the receiver may
            // write the same blocks another way (a pull asked again over gRPC), and this
            // worker may reuse the blocks they read.
            let _ = stream.synchronize();
        }
        if let Some(tx) = self.on_failure.take() {
            let _ = tx.send(TransferError::Cache(e.to_string()));
        }
        e
    }

    /// The peer (opened once per decode worker) and a copy stream of `backend`'s context.
    fn copy_path(
        &mut self,
        backend: &CudaBackend,
        ours: KvLayout,
    ) -> Result<(Arc<KvIpcPeer>, Arc<CudaStream>), CudaError> {
        if let Some((peer, stream)) = &self.copy {
            return Ok((peer.clone(), stream.clone()));
        }
        let ctx = backend.context();
        let peer = {
            let mut peers = self.peers.lock().expect("peers lock");
            match peers.get(&self.export.handle) {
                Some(peer) => peer.clone(),
                None => {
                    let peer = Arc::new(KvIpcPeer::open(ctx, &self.export, ours)?);
                    peers.insert(self.export.handle, peer.clone());
                    peer
                }
            }
        };
        let stream = ctx.new_stream().map_err(|e| {
            CudaError::Driver(format!("cuStreamCreate (the cuda-ipc copy stream): {e}"))
        })?;
        self.copy = Some((peer.clone(), stream.clone()));
        Ok((peer, stream))
    }

    fn copy_layer(
        &mut self,
        layer: usize,
        blocks: Range<usize>,
        source: &LayerSource<'_, '_>,
    ) -> Result<(), TransferError> {
        let request_id = self.request_id.clone();
        let range = blocks.clone();
        let cache = |step: &str, e: &dyn std::fmt::Display| {
            TransferError::Cache(format!(
                "cuda-ipc push of request {request_id}, layer {layer}, blocks {range:?}: {step}: {e}"
            ))
        };
        let (backend, store) = source
            .device
            .and_then(|(b, s)| {
                Some((
                    b.downcast_ref::<CudaBackend>()?,
                    s.downcast_ref::<CudaKvStore>()?,
                ))
            })
            .ok_or_else(|| {
                cache(
                    "reading the engine's KV store",
                    &"the engine does not run on the CUDA backend",
                )
            })?;
        if blocks.end > source.block_table.len() || blocks.end > self.dest_block_ids.len() {
            return Err(cache(
                "mapping blocks",
                &format!(
                    "the engine's block table has {} blocks, the destination {}",
                    source.block_table.len(),
                    self.dest_block_ids.len()
                ),
            ));
        }
        let (peer, stream) = self.copy_path(backend, store.layout()).map_err(|e| {
            cache(
                "opening the decode worker's KV cache (cuIpcOpenMemHandle)",
                &e,
            )
        })?;
        // The layer's KV is queued on the engine's stream: the copies wait for it there.
        let computed = backend
            .stream()
            .record_event(None)
            .map_err(|e| cache("cuEventRecord on the engine stream", &e))?;
        stream
            .wait(&computed)
            .map_err(|e| cache("cuStreamWaitEvent on the copy stream", &e))?;
        let pairs: Vec<(u32, u32)> = blocks
            .clone()
            .map(|i| (source.block_table[i], self.dest_block_ids[i]))
            .collect();
        peer.copy_blocks(&stream, store, layer, &pairs)
            .map_err(|e| cache("cuMemcpyDtoDAsync into the decode worker's blocks", &e))?;
        self.bytes += (blocks.len() * self.block_bytes) as u64;
        self.landed.push(KvData {
            layer: layer as u32,
            block_start: blocks.start as u32,
            block_end: blocks.end as u32,
            xxh3: 0,
            payload: Vec::new(),
        });
        Ok(())
    }
}

impl KvSender for IpcSender {
    fn send_layer(
        &mut self,
        layer: usize,
        blocks: Range<usize>,
        _: &mut ReadBlocks<'_>,
    ) -> Result<(), TransferError> {
        let e = TransferError::Cache(format!(
            "cuda-ipc push of request {}, layer {layer}, blocks {blocks:?}: the engine gave no device KV store",
            self.request_id
        ));
        Err(self.fail(e))
    }

    fn send_layer_from(
        &mut self,
        layer: usize,
        blocks: Range<usize>,
        source: &mut LayerSource<'_, '_>,
    ) -> Result<(), TransferError> {
        if self.on_failure.is_none() {
            return Err(TransferError::Cache(format!(
                "cuda-ipc push of request {} already failed",
                self.request_id
            )));
        }
        self.copy_layer(layer, blocks, source)
            .map_err(|e| self.fail(e))
    }

    fn finish(&mut self) {
        if self.on_failure.is_none() {
            return; // failed: the acknowledgement future reports it; never complete the push
        }
        if let Some((_, stream)) = &self.copy {
            // The prompt's last step has completed, so this waits for the last layer's copies
            // at most; afterwards the blocks may be reused and the decode worker may read.
            if let Err(e) = stream.synchronize() {
                let e = TransferError::Cache(format!(
                    "cuda-ipc push of request {}: cuStreamSynchronize on the copy stream: {e}",
                    self.request_id
                ));
                self.fail(e);
                return;
            }
        }
        let chunks = self.landed.len() as u64;
        for d in self.landed.drain(..) {
            let _ = self.tx.send(KvChunk {
                kind: Some(Kind::Data(d)),
            });
        }
        let _ = self.tx.send(KvChunk {
            kind: Some(Kind::Done(KvDone {
                num_chunks: chunks,
                total_bytes: self.bytes,
            })),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_params_round_trip_and_reject_garbage() {
        let export = KvIpcExport {
            handle: std::array::from_fn(|i| i as u8 * 3),
            bytes: 123 << 20,
            layout: KvLayout {
                num_layers: 30,
                num_kv_heads: 3,
                head_dim: 64,
                block_size: 16,
                num_blocks: 4096,
                dtype: KvDtype::Bf16,
            },
        };
        let bytes = export.encode();
        assert_eq!(KvIpcExport::decode(&bytes).unwrap(), export);
        // The KV type travels: an FP8 store is not read as a bf16 one.
        let fp8 = KvIpcExport {
            layout: KvLayout {
                dtype: KvDtype::Fp8E4m3,
                ..export.layout
            },
            ..export.clone()
        };
        assert_eq!(KvIpcExport::decode(&fp8.encode()).unwrap(), fp8);
        assert!(KvIpcExport::decode(&bytes[..bytes.len() - 1]).is_err());
        let mut wrong = bytes.clone();
        wrong[0] ^= 1;
        assert!(KvIpcExport::decode(&wrong).is_err());
    }
}
