//! The `cuda-ipc` KV transport, for two processes on one node: the decode worker exports its KV
//! store once ([`KvIpcExport`], sent in `KvDestination.transport_params`); the prefill worker
//! opens it ([`KvIpcPeer`]) and copies each finished (layer, block) chunk from its own store
//! straight into the decode worker's reserved block, device to device, on its own stream.

use std::sync::Arc;

use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{CudaContext, CudaStream};
use duet_engine::backend::{KvDtype, KvLayout};

use duet_cuda::CudaError;
use duet_cuda::backend::CudaKvStore;

const MAGIC: &[u8; 8] = b"duetipc1";

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
            layout: store.layout(),
        })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + 64 + 8 + 5 * 4);
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
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, CudaError> {
        let bad = || CudaError::Unsupported("malformed CUDA IPC transport parameters".into());
        if bytes.len() != 8 + 64 + 8 + 20 || &bytes[..8] != MAGIC {
            return Err(bad());
        }
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
                dtype: KvDtype::Bf16,
            },
        })
    }
}

/// A decode worker's KV store, opened in the prefill worker's process.
pub struct KvIpcPeer {
    ptr: CUdeviceptr,
    layout: KvLayout,
    ctx: Arc<CudaContext>,
}

impl KvIpcPeer {
    /// Opens `export`; its geometry must equal ours except for the number of blocks.
    pub fn open(
        ctx: &Arc<CudaContext>,
        export: &KvIpcExport,
        ours: KvLayout,
    ) -> Result<Self, CudaError> {
        let l = export.layout;
        if (l.num_layers, l.num_kv_heads, l.head_dim, l.block_size)
            != (
                ours.num_layers,
                ours.num_kv_heads,
                ours.head_dim,
                ours.block_size,
            )
        {
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
        let chunk_bytes = src.chunk_elems() * 2;
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
        assert!(KvIpcExport::decode(&bytes[..bytes.len() - 1]).is_err());
        let mut wrong = bytes.clone();
        wrong[0] ^= 1;
        assert!(KvIpcExport::decode(&wrong).is_err());
    }
}
