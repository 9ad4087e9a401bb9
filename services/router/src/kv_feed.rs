//! One worker's KV events into the [`KvIndex`]: subscribe, apply every message, and subscribe
//! again where the index says (a gap: ranged replay; a new incarnation or drift: snapshot; a
//! broken stream: from the last event applied, after a pause). A worker that does not serve
//! `KvEvents` (UNIMPLEMENTED) is simply not indexed. The feed ends, dropping the worker's
//! entries, once the worker is gone from the pools.

use std::sync::{Arc, Weak};
use std::time::Duration;

use duet_proto::v1;
use duet_proto::v1::kv_events_client::KvEventsClient;
use tonic::Code;

use crate::kv_index::{Applied, KvIndex, WorkerSlot};
use crate::worker::Worker;

/// Pause before subscribing again after a broken stream.
const RETRY: Duration = Duration::from_millis(500);

/// How often a feed checks that its worker still exists while the stream is quiet.
const ALIVE_CHECK: Duration = Duration::from_secs(1);

/// Follows `worker`'s KV events into `index` while the worker exists.
pub fn spawn(worker: &Arc<Worker>, index: Arc<KvIndex>) {
    let weak = Arc::downgrade(worker);
    let slot = worker.slot();
    tokio::spawn(async move {
        follow(&weak, slot, &index).await;
        index.remove_worker(slot);
    });
}

async fn follow(weak: &Weak<Worker>, slot: WorkerSlot, index: &KvIndex) {
    let mut resume = index.resume(slot);
    loop {
        let Some(channel) = weak.upgrade().map(|w| w.channel()) else {
            return;
        };
        let request = v1::KvSubscribeRequest {
            incarnation: resume.incarnation,
            from_seq: resume.from_seq,
        };
        let mut client =
            KvEventsClient::new(channel).max_decoding_message_size(duet_proto::MAX_MESSAGE_BYTES);
        let mut stream = match client.subscribe(request).await {
            Ok(r) => r.into_inner(),
            Err(s) if s.code() == Code::Unimplemented => {
                tracing::debug!(slot, "worker serves no KV events; not indexed");
                return;
            }
            Err(s) => {
                tracing::debug!(slot, error = %s.message(), "KV events subscription failed");
                tokio::time::sleep(RETRY).await;
                resume = index.resume(slot);
                continue;
            }
        };
        let mut alive = tokio::time::interval(ALIVE_CHECK);
        resume = loop {
            tokio::select! {
                msg = stream.message() => match msg {
                    Ok(Some(msg)) => match index.apply(slot, &msg) {
                        Applied::Ok => {}
                        Applied::Resubscribe(r) => break r,
                    },
                    Ok(None) | Err(_) => {
                        tokio::time::sleep(RETRY).await;
                        break index.resume(slot);
                    }
                },
                _ = alive.tick() => if weak.strong_count() == 0 { return },
            }
        };
    }
}
