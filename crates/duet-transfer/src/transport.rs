//! The seam every KV transport implements: a sending side, opened per request by the prefill
//! worker and fed by its engine thread layer by layer while later layers still compute, and a
//! receiving side, the decode worker's reservations that the transport writes into.

use std::any::Any;
use std::future::Future;
use std::ops::Range;
use std::time::{Duration, Instant};

use duet_engine::backend::KvLayout;
use duet_proto::v1;
use futures::future::BoxFuture;

use crate::TransferError;

/// One side's KV as it travels: the model that computed it and the cache geometry. Both ends
/// must agree on everything but the number of blocks.
#[derive(Clone, Debug)]
pub struct KvWire {
    pub fingerprint: String,
    pub layout: KvLayout,
}

/// A peer's message for another model than the one this worker serves.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("model fingerprint mismatch: {peer} is for {theirs:?}, this worker serves {ours:?}")]
pub struct ModelMismatch {
    /// Who sent it: "the router", "the request", "the sender".
    pub peer: &'static str,
    pub theirs: String,
    pub ours: String,
}

impl KvWire {
    /// The one check that what `peer` sent (a request, a push) is for this worker's model.
    pub fn check_model(&self, peer: &'static str, theirs: &str) -> Result<(), ModelMismatch> {
        if theirs != self.fingerprint {
            return Err(ModelMismatch {
                peer,
                theirs: theirs.to_string(),
                ours: self.fingerprint.clone(),
            });
        }
        Ok(())
    }

    /// Bytes of one (layer, block) in the wire layout: K then V, each
    /// `[kv_head][slot][head_dim]`, then the scales of a scaled type, K then V, each
    /// `[kv_head][slot]`.
    pub fn block_bytes(&self) -> usize {
        self.layout.layer_block_bytes()
    }

    /// The header that opens a push of `spec`'s blocks from this (sending) side.
    pub fn header(&self, spec: &PushSpec) -> v1::KvHeader {
        let l = &self.layout;
        v1::KvHeader {
            reservation_id: spec.reservation_id.to_wire(),
            request_id: spec.request_id.clone(),
            model_fingerprint: self.fingerprint.clone(),
            block_size: l.block_size as u32,
            num_layers: l.num_layers as u32,
            num_kv_heads: l.num_kv_heads as u32,
            head_dim: l.head_dim as u32,
            dtype: l.dtype.name().into(),
            layout: duet_proto::KV_WIRE_LAYOUT.into(),
            first_block: spec.blocks.start as u32,
            total_blocks: spec.blocks.len() as u32,
            total_bytes: (l.num_layers * spec.blocks.len() * self.block_bytes()) as u64,
            num_tokens: spec.num_tokens as u32,
            sender_worker_id: spec.sender_worker_id.clone(),
            transport: v1::TransportKind::Grpc as i32,
        }
    }

    /// Checks a sender's header against this (receiving) side.
    pub fn check(&self, h: &v1::KvHeader) -> Result<(), TransferError> {
        self.check_model("the sender", &h.model_fingerprint)
            .map_err(|e| TransferError::Mismatch(e.to_string()))?;
        let l = &self.layout;
        let geometry = (
            h.block_size as usize,
            h.num_layers as usize,
            h.num_kv_heads as usize,
            h.head_dim as usize,
        );
        if geometry != (l.block_size, l.num_layers, l.num_kv_heads, l.head_dim)
            || h.dtype != l.dtype.name()
            || h.layout != duet_proto::KV_WIRE_LAYOUT
        {
            return Err(TransferError::Mismatch(format!(
                "KV geometry mismatch: sender (block {}, layers {}, kv heads {}, head dim {}, {} {}), receiver (block {}, layers {}, kv heads {}, head dim {}, {} {})",
                h.block_size,
                h.num_layers,
                h.num_kv_heads,
                h.head_dim,
                h.dtype,
                h.layout,
                l.block_size,
                l.num_layers,
                l.num_kv_heads,
                l.head_dim,
                l.dtype,
                duet_proto::KV_WIRE_LAYOUT
            )));
        }
        Ok(())
    }
}

/// Where one request's KV goes and what it covers.
#[derive(Clone, Debug)]
pub struct PushSpec {
    /// The decode worker's KV address (`KvDestination.transfer_address`).
    pub address: String,
    pub reservation_id: ReservationKey,
    pub request_id: String,
    /// Reservation block indices sent (from `KvDestination.cached_blocks` to the prompt's end).
    pub blocks: Range<usize>,
    pub num_tokens: usize,
    pub sender_worker_id: String,
    /// How long the whole push may take.
    pub timeout: Duration,
    /// The decode worker's physical block of each reservation block (`KvDestination.block_ids`).
    pub dest_block_ids: Vec<u32>,
    /// The transport the decode worker offers and its parameters (`KvDestination.transport`,
    /// `.transport_params`).
    pub offered: v1::TransportKind,
    pub transport_params: Vec<u8>,
}

/// A reservation's name on the wire (`KvDestination.reservation_id`): 128 bits from the OS's
/// random source, so only the prefill worker it was handed to can name it. Never logged.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReservationKey([u8; 16]);

impl ReservationKey {
    pub fn random() -> Self {
        let mut bytes = [0; 16];
        // Linux's getrandom(2) fails only on a kernel without it (before 3.17) and no /dev/urandom.
        getrandom::fill(&mut bytes).expect("the operating system's random source failed");
        Self(bytes)
    }

    /// The key a peer sent, which must be 16 bytes.
    pub fn from_wire(bytes: &[u8]) -> Result<Self, TransferError> {
        <[u8; 16]>::try_from(bytes).map(Self).map_err(|_| {
            TransferError::Malformed(format!(
                "reservation_id has {} bytes; a reservation id has 16",
                bytes.len()
            ))
        })
    }

    pub fn to_wire(self) -> Vec<u8> {
        self.0.to_vec()
    }
}

impl std::fmt::Debug for ReservationKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReservationKey(..)")
    }
}

/// A finished push.
#[derive(Debug)]
pub struct Pushed {
    /// Payload bytes sent.
    pub bytes_sent: u64,
    /// Messages the payload was cut into, as the receiver counted them.
    pub chunks: u64,
    /// When the receiver acknowledged.
    pub acked_at: Instant,
}

/// Appends the wire-layout bytes of reservation blocks (a range of indices), one after another,
/// to a payload, reading them from the engine's cache (a GPU's in one copy).
pub type ReadBlocks<'a> = dyn FnMut(Range<usize>, &mut Vec<u8>) -> Result<(), TransferError> + 'a;

/// One finished layer as the engine holds it, for [`KvSender::send_layer_from`].
pub struct LayerSource<'a, 'b> {
    /// The engine's physical block of each reservation block (indexed by reservation block).
    pub block_table: &'a [u32],
    /// The engine's backend and KV store (`&B`, `&B::KvStore`), for transports that copy device
    /// memory directly and downcast them; `None` where the engine does not expose them.
    pub device: Option<(&'a dyn Any, &'a dyn Any)>,
    /// Reads blocks into host memory in the wire layout.
    pub read_blocks: &'a mut ReadBlocks<'b>,
}

/// The engine thread's end of one push.
pub trait KvSender: Send {
    /// What the engine thread calls: [`KvSender::send_layer`] through `source.read_blocks`
    /// unless the transport moves the bytes itself (cuda-ipc).
    fn send_layer_from(
        &mut self,
        layer: usize,
        blocks: Range<usize>,
        source: &mut LayerSource<'_, '_>,
    ) -> Result<(), TransferError> {
        self.send_layer(layer, blocks, source.read_blocks)
    }

    /// Ships `layer`'s KV of reservation blocks `blocks`. `read_blocks(range, out)` appends the
    /// bytes of the blocks of `range` in the wire layout, read from the engine's cache.
    fn send_layer(
        &mut self,
        layer: usize,
        blocks: Range<usize>,
        read_blocks: &mut ReadBlocks<'_>,
    ) -> Result<(), TransferError>;

    /// Every block of every layer has been shipped: the push may complete.
    fn finish(&mut self);
}

/// A push in flight: the sender for the engine thread, and the receiver's acknowledgement.
/// Dropping the sender without [`KvSender::finish`] never completes the push with missing data.
pub struct OpenPush {
    /// The transport this push uses (a transport may fall back per push, e.g. `auto` to gRPC).
    pub kind: v1::TransportKind,
    pub sender: Box<dyn KvSender>,
    pub acked: BoxFuture<'static, Result<Pushed, TransferError>>,
}

/// The sending side of a transport.
pub trait KvTransport: Send + Sync {
    /// The kind reported to the decode worker and in metrics.
    fn kind(&self) -> v1::TransportKind;

    /// Starts pushing `spec`'s blocks of KV laid out as `wire` describes.
    fn open(&self, wire: &KvWire, spec: PushSpec) -> Result<OpenPush, TransferError>;
}

/// The receiving side: a decode worker's reservations, as a transport fills them.
pub trait KvSink: Sync {
    /// The reservation blocks a push from prefill worker `sender` may write into reservation
    /// `key`: those after its cached blocks (shared prefix-cache KV that no push may
    /// overwrite) to its end. `None` once it is gone (cancelled or expired);
    /// [`TransferError::Forbidden`] when `sender` is not the prefill worker it was handed to.
    fn writable_blocks(
        &self,
        key: ReservationKey,
        sender: &str,
    ) -> impl Future<Output = Result<Option<Range<usize>>, TransferError>> + Send;

    /// Starts writing `payload`, the KV of reservation blocks `blocks` of `layer`. An empty
    /// `payload` says the transport already wrote those blocks in place (cuda-ipc): only the
    /// checks run. The returned
    /// future resolves once it is in the cache; a transport starts every write of a push before
    /// awaiting any, so a running batch is not paused once per chunk.
    fn write(
        &self,
        key: ReservationKey,
        layer: usize,
        blocks: Range<usize>,
        payload: Vec<u8>,
    ) -> Result<impl Future<Output = Result<(), TransferError>> + Send + 'static, TransferError>;
}
