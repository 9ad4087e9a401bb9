//! The client side of the `grpc` KV transport: one `KvTransfer/Push` call per request, whose
//! stream is a `KvHeader`, the `KvData` chunks as the engine thread produces them, and a
//! closing `KvDone`; the decode worker's `PushAck` ends it.

use std::time::{Duration, Instant};

use duet_proto::v1::kv_chunk::Kind;
use duet_proto::v1::kv_transfer_client::KvTransferClient;
use duet_proto::v1::{KvChunk, KvDone, KvHeader, PushAck};
use futures::StreamExt;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::error::PrefillError;
use crate::scheduler::PushMsg;

/// A finished transfer.
#[derive(Debug)]
pub struct Pushed {
    pub ack: PushAck,
    /// Payload bytes sent.
    pub bytes_sent: u64,
    /// When the ack arrived.
    pub acked_at: Instant,
}

/// Pushes one request's KV to `address`: `header`, then every chunk from `rx` until
/// [`PushMsg::Finish`], then `KvDone`. Resolves once the decode worker has acknowledged (an ack
/// with `accepted = false` is an error). If `rx` closes without `Finish`, the stream stays open
/// (and the caller aborts this task): a push is never completed with missing data.
pub async fn push(
    channels: &duet_proto::Channels,
    address: &str,
    header: KvHeader,
    rx: UnboundedReceiver<PushMsg>,
    timeout: Duration,
) -> Result<Pushed, PrefillError> {
    let channel = channels
        .get(address)
        .map_err(|e| PrefillError::InvalidArgument(format!("dest.transfer_address: {e}")))?;
    let mut client = KvTransferClient::new(channel)
        .max_encoding_message_size(duet_proto::MAX_MESSAGE_BYTES)
        .max_decoding_message_size(duet_proto::MAX_MESSAGE_BYTES);
    let total_bytes = header.total_bytes;
    let first = futures::stream::once(async move {
        KvChunk {
            kind: Some(Kind::Header(header)),
        }
    });
    let rest = futures::stream::unfold(Some((rx, 0u64, 0u64)), |state| async move {
        let (mut rx, chunks, bytes) = state?;
        match rx.recv().await {
            Some(PushMsg::Data(d)) => {
                let len = d.payload.len() as u64;
                let chunk = KvChunk {
                    kind: Some(Kind::Data(d)),
                };
                Some((chunk, Some((rx, chunks + 1, bytes + len))))
            }
            Some(PushMsg::Finish) => {
                let done = KvChunk {
                    kind: Some(Kind::Done(KvDone {
                        num_chunks: chunks,
                        total_bytes: bytes,
                    })),
                };
                Some((done, None))
            }
            None => std::future::pending().await,
        }
    });
    let mut request = tonic::Request::new(first.chain(rest));
    request.set_timeout(timeout);
    let ack = client
        .push(request)
        .await
        .map_err(|status| PrefillError::Push {
            address: address.to_string(),
            status,
        })?
        .into_inner();
    if !ack.accepted {
        return Err(PrefillError::NotAccepted {
            address: address.to_string(),
            message: ack.message,
        });
    }
    Ok(Pushed {
        ack,
        bytes_sent: total_bytes,
        acked_at: Instant::now(),
    })
}
