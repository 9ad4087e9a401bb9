//! The `grpc` KV transport, both sides of `KvTransfer/Push`: one client-streaming call per
//! request whose stream is a `KvHeader`, the `KvData` chunks (whole blocks, at most
//! [`MAX_CHUNK_BYTES`], each with its xxh3) as the engine produces them, and a closing `KvDone`;
//! the receiver's `PushAck` ends it. The caller's side of `KvTransfer/Pull` too: the holder of a
//! prefix answers with the messages of a push (its engine feeds a [`ChunkSender`], or a cuda-ipc
//! sender, from the held blocks) and the caller takes them with the push's checks ([`pull`]).

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use duet_proto::v1::kv_chunk::Kind;
use duet_proto::v1::kv_transfer_client::KvTransferClient;
use duet_proto::v1::{self, KvChunk, KvData, KvDone, PushAck};
use futures::{Stream, StreamExt};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tonic::Status;

use crate::transport::ReadBlocks;
use crate::{
    KvSender, KvSink, KvTransport, KvWire, OpenPush, PushSpec, Pushed, ReservationKey,
    TransferError,
};

/// Largest `KvData` payload built (whole blocks; a single larger block is sent alone).
pub const MAX_CHUNK_BYTES: usize = 1 << 20;

/// Pushes over gRPC on channels reused across requests.
#[derive(Debug, Default)]
pub struct GrpcTransport {
    channels: Arc<duet_proto::Channels>,
}

impl GrpcTransport {
    /// Pushes authenticated by `auth` (cluster token, TLS).
    pub fn new(auth: duet_proto::PeerAuth) -> Self {
        Self {
            channels: Arc::new(duet_proto::Channels::new(auth)),
        }
    }
}

impl KvTransport for GrpcTransport {
    fn kind(&self) -> v1::TransportKind {
        v1::TransportKind::Grpc
    }

    fn open(&self, wire: &KvWire, spec: PushSpec) -> Result<OpenPush, TransferError> {
        let (tx, rx) = unbounded_channel();
        let header = wire.header(&spec);
        let acked = self.control(spec, header, rx)?;
        Ok(OpenPush {
            kind: v1::TransportKind::Grpc,
            sender: Box::new(ChunkSender::new(tx, wire.block_bytes())),
            acked: Box::pin(acked),
        })
    }
}

impl GrpcTransport {
    /// The `KvTransfer/Push` call of one push: `header`, then what arrives on `rx` until
    /// `KvDone`; resolves with the receiver's acknowledgement. Every transport's control path
    /// (cuda-ipc sends its "landed" notices through it).
    pub(crate) fn control(
        &self,
        spec: PushSpec,
        header: v1::KvHeader,
        rx: UnboundedReceiver<KvChunk>,
    ) -> Result<impl Future<Output = Result<Pushed, TransferError>> + Send + 'static, TransferError>
    {
        let channel = self
            .channels
            .get(&spec.address)
            .map_err(|e| TransferError::Malformed(format!("dest.transfer_address: {e}")))?;
        Ok(push(KvTransferClient::new(channel), spec, header, rx))
    }
}

/// Cuts each layer's blocks into checksummed chunks for the push task.
#[derive(Debug)]
pub struct ChunkSender {
    tx: UnboundedSender<KvChunk>,
    block_bytes: usize,
    num_chunks: u64,
    bytes: u64,
}

impl ChunkSender {
    pub fn new(tx: UnboundedSender<KvChunk>, block_bytes: usize) -> Self {
        Self {
            tx,
            block_bytes,
            num_chunks: 0,
            bytes: 0,
        }
    }

    fn send(&self, kind: Kind) {
        // A closed channel means the push was abandoned: the request is being cancelled.
        let _ = self.tx.send(KvChunk { kind: Some(kind) });
    }
}

impl KvSender for ChunkSender {
    fn send_layer(
        &mut self,
        layer: usize,
        blocks: Range<usize>,
        read_blocks: &mut ReadBlocks<'_>,
    ) -> Result<(), TransferError> {
        // The whole layer's blocks in one read, then cut into messages.
        let mut layer_bytes = Vec::with_capacity(blocks.len() * self.block_bytes);
        read_blocks(blocks.clone(), &mut layer_bytes)?;
        let expected = blocks.len() * self.block_bytes;
        if layer_bytes.len() != expected {
            // A reader that read too little or too much fails its push, never the process.
            return Err(TransferError::Cache(format!(
                "layer {layer}'s blocks {blocks:?} read as {} bytes, not {expected}",
                layer_bytes.len()
            )));
        }
        let per_chunk = (MAX_CHUNK_BYTES / self.block_bytes).max(1);
        let mut start = blocks.start;
        while start < blocks.end {
            let end = (start + per_chunk).min(blocks.end);
            let offset = (start - blocks.start) * self.block_bytes;
            let payload = layer_bytes[offset..offset + (end - start) * self.block_bytes].to_vec();
            self.num_chunks += 1;
            self.bytes += payload.len() as u64;
            self.send(Kind::Data(KvData {
                layer: layer as u32,
                block_start: start as u32,
                block_end: end as u32,
                xxh3: xxhash_rust::xxh3::xxh3_64(&payload),
                payload,
            }));
            start = end;
        }
        Ok(())
    }

    fn finish(&mut self) {
        self.send(Kind::Done(KvDone {
            num_chunks: self.num_chunks,
            total_bytes: self.bytes,
        }));
    }
}

/// The push's request stream: the header, then the chunks until `KvDone`. If the sender goes
/// away before `KvDone` the stream stays open (and the caller drops the push): a push is never
/// completed with missing data.
fn chunk_stream(
    header: v1::KvHeader,
    rx: UnboundedReceiver<KvChunk>,
) -> impl Stream<Item = KvChunk> + Send + 'static {
    let first = futures::stream::once(async move {
        KvChunk {
            kind: Some(Kind::Header(header)),
        }
    });
    let rest = futures::stream::unfold(Some(rx), |rx| async move {
        let mut rx = rx?;
        match rx.recv().await {
            Some(chunk) => {
                let last = matches!(chunk.kind, Some(Kind::Done(_)));
                Some((chunk, (!last).then_some(rx)))
            }
            None => std::future::pending().await,
        }
    });
    first.chain(rest)
}

async fn push(
    mut client: KvTransferClient<duet_proto::PeerChannel>,
    spec: PushSpec,
    header: v1::KvHeader,
    rx: UnboundedReceiver<KvChunk>,
) -> Result<Pushed, TransferError> {
    client = client
        .max_encoding_message_size(duet_proto::MAX_MESSAGE_BYTES)
        .max_decoding_message_size(duet_proto::MAX_MESSAGE_BYTES);
    let bytes_sent = header.total_bytes;
    let mut request = tonic::Request::new(chunk_stream(header, rx));
    request.set_timeout(spec.timeout);
    let ack = client
        .push(request)
        .await
        .map_err(|status| TransferError::Call {
            address: spec.address.clone(),
            status,
        })?
        .into_inner();
    if !ack.accepted {
        return Err(TransferError::Rejected {
            address: spec.address,
            message: ack.message,
        });
    }
    Ok(Pushed {
        bytes_sent,
        chunks: ack.chunks_received,
        acked_at: Instant::now(),
    })
}

/// Serves one `KvTransfer/Push`: checks the header against `wire`, every chunk's checksum and
/// range, writes the chunks into `sink`'s reservation, and acknowledges once every (layer,
/// block) arrived exactly once. A reservation that is gone is answered `accepted = false`.
///
/// A cuda-ipc push (`KvHeader.transport`) runs the same checks on chunks whose payload is
/// empty: the sender already copied their blocks in place, and `sink` is told they landed.
/// `on_header` sees the header once it is checked (the transport, for metrics).
pub async fn receive<S, K>(
    mut chunks: S,
    wire: &KvWire,
    sink: &K,
    on_header: impl FnOnce(&v1::KvHeader) -> Result<(), TransferError>,
) -> Result<PushAck, TransferError>
where
    S: Stream<Item = Result<KvChunk, Status>> + Unpin,
    K: KvSink,
{
    let header = match chunks
        .next()
        .await
        .transpose()
        .map_err(TransferError::Stream)?
    {
        Some(KvChunk {
            kind: Some(Kind::Header(h)),
        }) => h,
        _ => {
            return Err(TransferError::Malformed(
                "a KV push must start with a header".into(),
            ));
        }
    };
    wire.check(&header)?;
    on_header(&header)?;
    let key = ReservationKey::from_wire(&header.reservation_id)?;
    let Some(writable) = sink.writable_blocks(key, &header.sender_worker_id).await? else {
        return Ok(rejected(
            "the reservation is gone (cancelled or expired)".into(),
        ));
    };
    let mut tracker = PushTracker::new(&header, wire, writable)?;
    let mut writes = Vec::new();
    while let Some(chunk) = chunks
        .next()
        .await
        .transpose()
        .map_err(TransferError::Stream)?
    {
        match chunk.kind {
            Some(Kind::Data(d)) => {
                let blocks = tracker.accept(&d)?;
                writes.push(sink.write(key, d.layer as usize, blocks, d.payload)?);
            }
            Some(Kind::Done(done)) => {
                for write in writes.drain(..) {
                    match write.await {
                        Ok(()) => {}
                        Err(e @ TransferError::ReservationGone(_)) => {
                            return Ok(rejected(e.to_string()));
                        }
                        Err(e) => return Err(e),
                    }
                }
                tracker.complete(&done)?;
                return Ok(PushAck {
                    accepted: true,
                    bytes_received: tracker.bytes,
                    chunks_received: tracker.chunks,
                    message: String::new(),
                });
            }
            _ => {
                return Err(TransferError::Malformed(
                    "a second header in one KV push".into(),
                ));
            }
        }
    }
    Err(TransferError::Corrupt(
        "the KV push ended without its final message".into(),
    ))
}

/// Pulls a prefix from the decode worker at `address` into `sink`'s reservation named in
/// `request`, with every check of a push: the header against `wire`, each chunk's checksum and
/// range (a cuda-ipc answer's blocks were copied in place, as a cuda-ipc push's), every
/// (layer, block) exactly once, the totals, and the reservation bound to the peer as its
/// sender. The whole pull is bounded by `timeout`. Also the transport the answer took.
pub async fn pull<K: KvSink>(
    channels: &duet_proto::Channels,
    address: &str,
    request: v1::KvPullRequest,
    timeout: std::time::Duration,
    wire: &KvWire,
    sink: &K,
) -> Result<(PushAck, v1::TransportKind), TransferError> {
    let call = async {
        let channel = channels
            .get(address)
            .map_err(|e| TransferError::Malformed(format!("pull.address: {e}")))?;
        let mut client = KvTransferClient::new(channel)
            .max_encoding_message_size(duet_proto::MAX_MESSAGE_BYTES)
            .max_decoding_message_size(duet_proto::MAX_MESSAGE_BYTES);
        let mut request = tonic::Request::new(request);
        request.set_timeout(timeout);
        let chunks = client
            .pull(request)
            .await
            .map_err(|status| TransferError::Call {
                address: address.to_string(),
                status,
            })?
            .into_inner();
        let mut transport = v1::TransportKind::Grpc;
        let ack = receive(chunks, wire, sink, |h| {
            transport = h.transport();
            Ok(())
        })
        .await?;
        Ok((ack, transport))
    };
    tokio::time::timeout(timeout, call)
        .await
        .map_err(|_| TransferError::Call {
            address: address.to_string(),
            status: Status::deadline_exceeded("the pull outlasted computing the prefix"),
        })?
}

fn rejected(message: String) -> PushAck {
    PushAck {
        accepted: false,
        message,
        ..Default::default()
    }
}

/// What a receiver has seen of one push: every (layer, block) of the announced range exactly
/// once, and the totals `KvDone` must match.
#[derive(Debug)]
struct PushTracker {
    blocks: Range<usize>,
    num_layers: usize,
    block_bytes: usize,
    /// The blocks were copied in place (cuda-ipc): payloads are empty.
    in_place: bool,
    seen: Vec<bool>,
    chunks: u64,
    bytes: u64,
}

impl PushTracker {
    /// A push announced by `header` into a reservation whose blocks `writable` it may fill.
    fn new(
        header: &v1::KvHeader,
        wire: &KvWire,
        writable: Range<usize>,
    ) -> Result<Self, TransferError> {
        let num_layers = wire.layout.num_layers;
        let in_place = match header.transport() {
            v1::TransportKind::Grpc | v1::TransportKind::Unspecified => false,
            v1::TransportKind::CudaIpc => true,
            other => {
                return Err(TransferError::Malformed(format!(
                    "a KV push announced over {} cannot be received by KvTransfer/Push",
                    crate::choice::transport_name(other)
                )));
            }
        };
        let first = header.first_block as usize;
        let blocks = first..first + header.total_blocks as usize;
        if blocks.start < writable.start {
            return Err(TransferError::Forbidden(format!(
                "the push covers blocks {blocks:?}, but blocks before {} of the reservation hold cached KV",
                writable.start
            )));
        }
        if blocks != writable {
            return Err(TransferError::Malformed(format!(
                "the push covers blocks {blocks:?}; the reservation takes blocks {writable:?}"
            )));
        }
        Ok(Self {
            seen: vec![false; num_layers * blocks.len()],
            blocks,
            num_layers,
            block_bytes: wire.block_bytes(),
            in_place,
            chunks: 0,
            bytes: 0,
        })
    }

    /// Checks one chunk; returns its block range.
    fn accept(&mut self, d: &KvData) -> Result<Range<usize>, TransferError> {
        if self.in_place && !d.payload.is_empty() {
            return Err(TransferError::Malformed(format!(
                "a cuda-ipc KV push sent {} payload bytes for layer {}; its blocks are copied in place",
                d.payload.len(),
                d.layer
            )));
        }
        if !self.in_place && xxhash_rust::xxh3::xxh3_64(&d.payload) != d.xxh3 {
            return Err(TransferError::Corrupt(format!(
                "checksum mismatch in the KV of layer {}",
                d.layer
            )));
        }
        let (layer, start, end) = (
            d.layer as usize,
            d.block_start as usize,
            d.block_end as usize,
        );
        if layer >= self.num_layers
            || start < self.blocks.start
            || end > self.blocks.end
            || start >= end
        {
            return Err(TransferError::Malformed(format!(
                "KV chunk out of range: layer {layer}, blocks {start}..{end}"
            )));
        }
        let bytes = (end - start) * self.block_bytes;
        if !self.in_place && d.payload.len() != bytes {
            return Err(TransferError::Malformed(format!(
                "KV chunk of layer {layer} blocks {start}..{end} has {} bytes; {} blocks of {} bytes were expected",
                d.payload.len(),
                end - start,
                self.block_bytes
            )));
        }
        for b in start..end {
            let slot = &mut self.seen[layer * self.blocks.len() + b - self.blocks.start];
            if *slot {
                return Err(TransferError::Malformed(format!(
                    "KV of layer {layer} block {b} sent twice"
                )));
            }
            *slot = true;
        }
        self.chunks += 1;
        self.bytes += bytes as u64;
        Ok(start..end)
    }

    /// Checks the closing message against what arrived.
    fn complete(&self, done: &KvDone) -> Result<(), TransferError> {
        let missing = self.seen.iter().filter(|s| !**s).count();
        if done.num_chunks != self.chunks || done.total_bytes != self.bytes || missing > 0 {
            return Err(TransferError::Corrupt(format!(
                "incomplete KV push: {} chunks / {} bytes received, {} / {} announced, {missing} blocks missing",
                self.chunks, self.bytes, done.num_chunks, done.total_bytes
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Mutex;
    use std::time::Duration;

    use duet_engine::backend::{KvDtype, KvLayout};

    use super::*;

    fn wire() -> KvWire {
        KvWire {
            fingerprint: "fp".into(),
            layout: KvLayout {
                num_layers: 2,
                num_kv_heads: 1,
                head_dim: 4,
                block_size: 2,
                num_blocks: 8,
                dtype: KvDtype::F32,
            },
        }
    }

    /// A reservation whose writable blocks are `blocks`, handed to prefill worker "p", whose
    /// writes land in a map.
    struct MemorySink {
        blocks: Option<Range<usize>>,
        written: Mutex<HashMap<(usize, usize), Vec<u8>>>,
        block_bytes: usize,
    }

    impl KvSink for MemorySink {
        async fn writable_blocks(
            &self,
            _: ReservationKey,
            sender: &str,
        ) -> Result<Option<Range<usize>>, TransferError> {
            if sender != "p" {
                return Err(TransferError::Forbidden(format!("not handed to {sender}")));
            }
            Ok(self.blocks.clone())
        }

        fn write(
            &self,
            _: ReservationKey,
            layer: usize,
            blocks: Range<usize>,
            payload: Vec<u8>,
        ) -> Result<impl Future<Output = Result<(), TransferError>> + Send + 'static, TransferError>
        {
            let mut w = self.written.lock().unwrap();
            for (i, b) in blocks.enumerate() {
                // An empty payload: landed in place (cuda-ipc), recorded as no bytes.
                let bytes = payload
                    .get(i * self.block_bytes..(i + 1) * self.block_bytes)
                    .unwrap_or_default()
                    .to_vec();
                w.insert((layer, b), bytes);
            }
            Ok(std::future::ready(Ok(())))
        }
    }

    fn sink(blocks: Option<Range<usize>>) -> MemorySink {
        MemorySink {
            blocks,
            written: Mutex::default(),
            block_bytes: wire().block_bytes(),
        }
    }

    fn spec(blocks: Range<usize>) -> PushSpec {
        PushSpec {
            address: "127.0.0.1:1".into(),
            reservation_id: ReservationKey::random(),
            request_id: "r".into(),
            blocks,
            num_tokens: 10,
            sender_worker_id: "p".into(),
            timeout: Duration::from_secs(1),
            dest_block_ids: Vec::new(),
            offered: v1::TransportKind::Grpc,
            transport_params: Vec::new(),
        }
    }

    /// The chunks a sender produces for blocks `blocks` of every layer, each block's bytes
    /// holding its (layer, block).
    fn produce(blocks: Range<usize>, block_bytes: usize) -> Vec<KvChunk> {
        let w = wire();
        let (tx, rx) = unbounded_channel();
        let mut sender = ChunkSender::new(tx, block_bytes);
        for layer in 0..w.layout.num_layers {
            sender
                .send_layer(layer, blocks.clone(), &mut |range, out| {
                    for b in range {
                        out.extend(std::iter::repeat_n((layer * 16 + b) as u8, block_bytes));
                    }
                    Ok(())
                })
                .unwrap();
        }
        sender.finish();
        drop(sender);
        let stream = chunk_stream(w.header(&spec(blocks)), rx);
        futures::executor::block_on(stream.collect())
    }

    fn receive_all(chunks: Vec<KvChunk>, sink: &MemorySink) -> Result<PushAck, TransferError> {
        let stream = futures::stream::iter(chunks.into_iter().map(Ok));
        futures::executor::block_on(receive(stream, &wire(), sink, |_| Ok(())))
    }

    #[test]
    fn a_push_round_trips_every_block_of_every_layer() {
        let w = wire();
        let chunks = produce(1..5, w.block_bytes());
        assert!(matches!(chunks.last().unwrap().kind, Some(Kind::Done(_))));
        let s = sink(Some(1..5));
        let ack = receive_all(chunks, &s).unwrap();
        assert!(ack.accepted, "{}", ack.message);
        assert_eq!(ack.bytes_received, (2 * 4 * w.block_bytes()) as u64);
        let written = s.written.lock().unwrap();
        assert_eq!(written.len(), 8);
        assert!(!written.contains_key(&(0, 0)), "cached block 0 is not sent");
        assert_eq!(written[&(1, 3)], vec![19u8; w.block_bytes()]);
    }

    #[test]
    fn chunks_hold_whole_blocks_within_the_size_limit() {
        let block_bytes = MAX_CHUNK_BYTES / 3 + 1; // two blocks per chunk would pass the limit
        let chunks = produce(0..5, block_bytes);
        let data: Vec<_> = chunks
            .iter()
            .filter_map(|c| match &c.kind {
                Some(Kind::Data(d)) => Some(d),
                _ => None,
            })
            .collect();
        assert_eq!(data.len(), 2 * 3, "5 blocks in chunks of 2 per layer");
        assert!(data.iter().all(|d| d.payload.len() <= MAX_CHUNK_BYTES));
        assert_eq!((data[2].block_start, data[2].block_end), (4, 5));
    }

    #[test]
    fn damaged_duplicated_missing_or_foreign_pushes_are_refused() {
        let w = wire();
        let good = produce(0..3, w.block_bytes());
        let data_at = |chunks: &mut Vec<KvChunk>, i: usize| -> KvData {
            match chunks[i].kind.clone() {
                Some(Kind::Data(d)) => d,
                _ => panic!("chunk {i} is not data"),
            }
        };

        let mut damaged = good.clone();
        let mut d = data_at(&mut damaged, 1);
        d.payload[0] ^= 1;
        damaged[1].kind = Some(Kind::Data(d));
        let e = receive_all(damaged, &sink(Some(0..3))).unwrap_err();
        assert!(matches!(e, TransferError::Corrupt(_)), "{e}");

        let mut twice = good.clone();
        let again = twice[1].clone();
        twice.insert(2, again);
        let e = receive_all(twice, &sink(Some(0..3))).unwrap_err();
        assert!(e.to_string().contains("sent twice"), "{e}");

        let mut missing = good.clone();
        missing.remove(1);
        let e = receive_all(missing, &sink(Some(0..3))).unwrap_err();
        assert!(e.to_string().contains("incomplete"), "{e}");

        let mut cut = good.clone();
        cut.pop();
        let e = receive_all(cut, &sink(Some(0..3))).unwrap_err();
        assert!(matches!(e, TransferError::Corrupt(_)), "{e}");

        let mut foreign = good.clone();
        let mut h = match foreign[0].kind.clone() {
            Some(Kind::Header(h)) => h,
            _ => panic!("the first chunk is the header"),
        };
        h.head_dim = 8;
        foreign[0].kind = Some(Kind::Header(h));
        let e = receive_all(foreign, &sink(Some(0..3))).unwrap_err();
        assert!(matches!(e, TransferError::Mismatch(_)), "{e}");

        // KV of another type (an FP8 cache's) under the same model is refused too.
        let mut other_type = good.clone();
        let mut h = match other_type[0].kind.clone() {
            Some(Kind::Header(h)) => h,
            _ => panic!("the first chunk is the header"),
        };
        h.dtype = KvDtype::Fp8E4m3.name().into();
        other_type[0].kind = Some(Kind::Header(h));
        let e = receive_all(other_type, &sink(Some(0..3))).unwrap_err();
        assert!(
            matches!(e, TransferError::Mismatch(_)) && e.to_string().contains("fp8"),
            "{e}"
        );

        let e = receive_all(good.clone(), &sink(Some(0..4))).unwrap_err();
        assert!(matches!(e, TransferError::Malformed(_)), "{e}");

        let e = receive_all(good.clone(), &sink(Some(1..3))).unwrap_err();
        assert!(
            matches!(e, TransferError::Forbidden(_)),
            "a push into cached blocks: {e}"
        );

        let mut other_sender = good.clone();
        let mut h = match other_sender[0].kind.clone() {
            Some(Kind::Header(h)) => h,
            _ => panic!("the first chunk is the header"),
        };
        h.sender_worker_id = "q".into();
        other_sender[0].kind = Some(Kind::Header(h));
        let e = receive_all(other_sender, &sink(Some(0..3))).unwrap_err();
        assert!(matches!(e, TransferError::Forbidden(_)), "{e}");

        let ack = receive_all(good, &sink(None)).unwrap();
        assert!(!ack.accepted && ack.message.contains("gone"), "{ack:?}");
    }

    /// A cuda-ipc push as its sender produces it: the header marked CUDA_IPC, one empty
    /// "landed" chunk per (layer, range), `KvDone` counting the bytes copied in place.
    fn landed(blocks: Range<usize>) -> Vec<KvChunk> {
        let w = wire();
        let mut header = w.header(&spec(blocks.clone()));
        header.transport = v1::TransportKind::CudaIpc as i32;
        let mut chunks = vec![KvChunk {
            kind: Some(Kind::Header(header)),
        }];
        for layer in 0..w.layout.num_layers {
            chunks.push(KvChunk {
                kind: Some(Kind::Data(KvData {
                    layer: layer as u32,
                    block_start: blocks.start as u32,
                    block_end: blocks.end as u32,
                    xxh3: 0,
                    payload: Vec::new(),
                })),
            });
        }
        chunks.push(KvChunk {
            kind: Some(Kind::Done(KvDone {
                num_chunks: w.layout.num_layers as u64,
                total_bytes: (w.layout.num_layers * blocks.len() * w.block_bytes()) as u64,
            })),
        });
        chunks
    }

    #[test]
    fn a_cuda_ipc_push_runs_the_same_checks_without_payloads() {
        let w = wire();
        let s = sink(Some(1..4));
        let mut seen = None;
        let stream = futures::stream::iter(landed(1..4).into_iter().map(Ok));
        let ack = futures::executor::block_on(receive(stream, &w, &s, |h| {
            seen = Some(h.transport());
            Ok(())
        }))
        .unwrap();
        assert_eq!(seen, Some(v1::TransportKind::CudaIpc));
        assert!(ack.accepted, "{}", ack.message);
        assert_eq!(ack.bytes_received, (2 * 3 * w.block_bytes()) as u64);
        // The sink was told every (layer, block) landed, with nothing to write.
        let written = s.written.lock().unwrap();
        assert_eq!(written.len(), 2 * 3);
        assert!(written.values().all(|b| b.is_empty()));
        drop(written);

        let mut missing = landed(1..4);
        missing.remove(2);
        let e = receive_all(missing, &sink(Some(1..4))).unwrap_err();
        assert!(e.to_string().contains("incomplete"), "{e}");

        let mut with_payload = landed(1..4);
        if let Some(Kind::Data(d)) = &mut with_payload[1].kind {
            d.payload = vec![0; 3 * w.block_bytes()];
        }
        let e = receive_all(with_payload, &sink(Some(1..4))).unwrap_err();
        assert!(e.to_string().contains("copied in place"), "{e}");

        let e = receive_all(landed(1..4), &sink(Some(0..4))).unwrap_err();
        assert!(matches!(e, TransferError::Malformed(_)), "{e}");
        let ack = receive_all(landed(1..4), &sink(None)).unwrap();
        assert!(!ack.accepted && ack.message.contains("gone"), "{ack:?}");
    }

    #[test]
    fn a_grpc_chunk_must_hold_its_blocks_bytes() {
        // Empty payloads mean "landed in place" only on a cuda-ipc push.
        let mut chunks = landed(0..2);
        if let Some(Kind::Header(h)) = &mut chunks[0].kind {
            h.transport = v1::TransportKind::Grpc as i32;
        }
        for c in &mut chunks {
            if let Some(Kind::Data(d)) = &mut c.kind {
                d.xxh3 = xxhash_rust::xxh3::xxh3_64(&[]);
            }
        }
        let e = receive_all(chunks, &sink(Some(0..2))).unwrap_err();
        assert!(e.to_string().contains("bytes were expected"), "{e}");
    }

    #[test]
    fn a_reader_that_reads_one_block_of_several_fails_its_push_not_the_process() {
        let w = wire();
        let (tx, _rx) = unbounded_channel();
        let mut sender = ChunkSender::new(tx, w.block_bytes());
        let e = sender
            .send_layer(0, 0..3, &mut |_, out| {
                out.resize(out.len() + w.block_bytes(), 0);
                Ok(())
            })
            .unwrap_err();
        assert!(e.to_string().contains("read as"), "{e}");
    }

    #[test]
    fn an_abandoned_sender_never_completes_the_stream() {
        let w = wire();
        let (tx, rx) = unbounded_channel();
        let mut sender = ChunkSender::new(tx, w.block_bytes());
        sender
            .send_layer(0, 0..1, &mut |range, out| {
                out.resize(out.len() + range.len() * w.block_bytes(), 0);
                Ok(())
            })
            .unwrap();
        drop(sender);
        let mut stream = Box::pin(chunk_stream(w.header(&spec(0..1)), rx));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            assert!(stream.next().await.is_some()); // header
            assert!(stream.next().await.is_some()); // data
            let end = tokio::time::timeout(Duration::from_millis(50), stream.next()).await;
            assert!(end.is_err(), "the stream must stay open, not end");
        });
    }
}
