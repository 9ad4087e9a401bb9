//! The `nccl` KV transport, across GPUs and nodes: one communicator per (prefill, decode) pair,
//! rank 0 the prefill worker and rank 1 the decode worker, made from a unique id that the decode
//! worker creates and sends in `KvDestination.transport_params`. The sender packs a layer's
//! (layer, block) chunks into one staging buffer and sends it on the link's own stream; the
//! receiver unpacks into its reserved blocks.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use cudarc::nccl::{Comm, Id};

use duet_cuda::CudaError;
use duet_cuda::backend::{CudaBackend, CudaKvStore};
use duet_cuda::probe;

/// An NCCL unique id (128 bytes) as it travels in the transport parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UniqueId(pub [u8; 128]);

impl UniqueId {
    pub fn new() -> Result<Self, CudaError> {
        probe::require_nccl()?;
        let id = Id::new().map_err(|e| CudaError::Nccl(format!("{e:?}")))?;
        Ok(Self(id.internal().map(|c| c as u8)))
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, CudaError> {
        bytes.try_into().map(Self).map_err(|_| {
            CudaError::Unsupported(format!(
                "an NCCL unique id has 128 bytes, not {}",
                bytes.len()
            ))
        })
    }
}

pub const PREFILL_RANK: usize = 0;
pub const DECODE_RANK: usize = 1;

/// One side of a pair's communicator.
pub struct KvNcclLink {
    comm: Comm,
    stream: Arc<CudaStream>,
}

impl KvNcclLink {
    /// Joins the pair's communicator (both sides call this; it returns once both have).
    pub fn connect(backend: &CudaBackend, id: UniqueId, rank: usize) -> Result<Self, CudaError> {
        probe::require_nccl()?;
        let stream = backend.context().new_stream()?;
        let comm = Comm::from_rank(stream.clone(), rank, 2, Id::uninit(id.0.map(|b| b as _)))
            .map_err(|e| CudaError::Nccl(format!("joining the KV link as rank {rank}: {e:?}")))?;
        Ok(Self { comm, stream })
    }

    /// Sends the chunks `chunks` (indices [`CudaKvStore::chunk_index`]) of `store`.
    pub fn send(
        &self,
        backend: &CudaBackend,
        store: &CudaKvStore,
        chunks: &[u32],
    ) -> Result<(), CudaError> {
        let staging = backend.pack_chunks(store, chunks)?;
        // The link stream waits for the packing on the backend's stream.
        self.stream.join(backend.stream())?;
        self.comm
            .send(&staging, (1 - self.comm.rank()) as i32)
            .map_err(|e| CudaError::Nccl(format!("sending KV: {e:?}")))?;
        self.stream.synchronize()?;
        Ok(())
    }

    /// Receives the chunks `chunks` into `store`.
    pub fn recv(
        &self,
        backend: &CudaBackend,
        store: &mut CudaKvStore,
        chunks: &[u32],
    ) -> Result<(), CudaError> {
        let mut staging: CudaSlice<u8> = self
            .stream
            .alloc_zeros(chunks.len() * store.chunk_bytes())?;
        self.comm
            .recv(&mut staging, (1 - self.comm.rank()) as i32)
            .map_err(|e| CudaError::Nccl(format!("receiving KV: {e:?}")))?;
        backend.stream().join(&self.stream)?;
        backend.unpack_chunks(store, chunks, &staging)
    }
}
