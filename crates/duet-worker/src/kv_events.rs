//! The worker's prefix-cache events, numbered and kept for subscribers (the router's index).
//!
//! The engine thread drains the block pool's [`KvEvent`]s once per turn and appends them to the
//! [`KvEventLog`] under one lock: events are per block, never per token. The log numbers them
//! 1, 2, 3, ... for this incarnation, keeps the newest in a bounded ring buffer for ranged
//! replay, and mirrors the (block, tier) pairs they describe for snapshots, so
//! `KvEvents/Subscribe` ([`KvEventsService`]) never waits on the engine thread.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use duet_kv::{BlockHash, HeldBlocks, KvDigest, KvEvent, Tier};
use duet_proto::convert::kv_event_to_wire;
use duet_proto::v1;
use tokio::sync::{mpsc, watch};
use tonic::{Response, Status};

/// Events kept for ranged replay by default.
pub const DEFAULT_RING_EVENTS: usize = 65_536;

/// How often a subscriber is sent a digest by default.
pub const DEFAULT_DIGEST_INTERVAL: Duration = Duration::from_secs(2);

/// Hashes per snapshot message, over all tiers (8 bytes each, well inside the message limit).
const SNAPSHOT_CHUNK: usize = 65_536;

/// The numbered events of this incarnation and the set of hashes they lead to.
pub struct KvEventLog {
    state: Mutex<LogState>,
    /// The last event's number, for waking subscribers.
    last_seq: watch::Sender<u64>,
    capacity: usize,
}

struct LogState {
    /// Events `last_seq - ring.len() + 1 ..= last_seq`.
    ring: VecDeque<KvEvent>,
    last_seq: u64,
    present: HeldBlocks,
    /// The pool's own digest after event `last_seq`.
    digest: KvDigest,
}

/// What a subscriber at `from_seq` gets next.
#[derive(Debug, PartialEq, Eq)]
pub enum Read {
    /// Events `from_seq..` (possibly none), and the digest after the last of them.
    Events {
        events: Vec<v1::KvEvent>,
        digest: v1::KvDigest,
    },
    /// The ring no longer holds `from_seq` (or never will): a snapshot is due.
    Gone,
}

/// Every (block, tier) pair held as of event `seq`.
#[derive(Debug, PartialEq, Eq)]
pub struct Snapshot {
    pub seq: u64,
    pub blocks: Vec<(BlockHash, Tier)>,
}

impl KvEventLog {
    /// A log keeping the last `capacity` events.
    pub fn new(capacity: usize) -> Self {
        Self {
            state: Mutex::new(LogState {
                ring: VecDeque::new(),
                last_seq: 0,
                present: HeldBlocks::default(),
                digest: KvDigest::default(),
            }),
            last_seq: watch::Sender::new(0),
            capacity: capacity.max(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LogState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Numbers and keeps `events` (from the engine thread); `digest` is the pool's after them.
    pub fn append(&self, events: Vec<KvEvent>, digest: KvDigest) {
        if events.is_empty() {
            return;
        }
        let last = {
            let mut s = self.lock();
            for e in events {
                s.present.apply(e);
                if s.ring.len() == self.capacity {
                    s.ring.pop_front();
                }
                s.ring.push_back(e);
                s.last_seq += 1;
            }
            s.digest = digest;
            s.last_seq
        };
        self.last_seq.send_replace(last);
    }

    /// The events from `from_seq` on, or [`Read::Gone`] when the ring does not hold them.
    pub fn read(&self, from_seq: u64) -> Read {
        let s = self.lock();
        let first = s.last_seq + 1 - s.ring.len() as u64;
        if from_seq < first.max(1) || from_seq > s.last_seq + 1 {
            return Read::Gone;
        }
        let skip = (from_seq - first) as usize;
        let events = s
            .ring
            .iter()
            .skip(skip)
            .zip(from_seq..)
            .map(|(e, seq)| kv_event_to_wire(seq, *e))
            .collect();
        Read::Events {
            events,
            digest: v1::KvDigest {
                seq: s.last_seq,
                block_count: s.digest.block_count,
                hash_xor: s.digest.hash_xor,
            },
        }
    }

    /// Every (block, tier) pair held now, and the event it is as of.
    pub fn snapshot(&self) -> Snapshot {
        let s = self.lock();
        Snapshot {
            seq: s.last_seq,
            blocks: s.present.iter().collect(),
        }
    }

    /// Wakes when events are appended.
    pub fn watch(&self) -> watch::Receiver<u64> {
        self.last_seq.subscribe()
    }
}

/// One part of a snapshot: its pairs in the message's per-tier lists.
fn snapshot_part(seq: u64, part: &[(BlockHash, Tier)], last: bool) -> v1::KvSnapshot {
    let mut msg = v1::KvSnapshot {
        seq,
        last,
        ..Default::default()
    };
    for &(hash, tier) in part {
        match tier {
            Tier::Device => msg.block_hashes.push(hash),
            Tier::Host => msg.host_block_hashes.push(hash),
            Tier::Disk => msg.disk_block_hashes.push(hash),
        }
    }
    msg
}

/// `KvEvents/Subscribe` over a worker's log.
#[derive(Clone)]
pub struct KvEventsService {
    log: Arc<KvEventLog>,
    incarnation: u64,
    digest_interval: Duration,
    /// Subscriptions end when the worker drains, so its graceful shutdown need not wait for
    /// the router to hang up.
    drain: duet_proto::DrainBegun,
}

impl KvEventsService {
    pub fn new(
        log: Arc<KvEventLog>,
        incarnation: u64,
        digest_interval: Duration,
        drain: duet_proto::DrainBegun,
    ) -> Self {
        Self {
            log,
            incarnation,
            digest_interval,
            drain,
        }
    }

    fn message(&self) -> v1::KvEventsMessage {
        v1::KvEventsMessage {
            incarnation: self.incarnation,
            ..Default::default()
        }
    }

    /// Sends a snapshot in parts; the next event wanted after it, or `None` once the
    /// subscriber has gone.
    async fn send_snapshot(
        &self,
        tx: &mpsc::Sender<Result<v1::KvEventsMessage, Status>>,
    ) -> Option<u64> {
        let snapshot = self.log.snapshot();
        let parts: Vec<&[(BlockHash, Tier)]> = if snapshot.blocks.is_empty() {
            vec![&[]]
        } else {
            snapshot.blocks.chunks(SNAPSHOT_CHUNK).collect()
        };
        let n = parts.len();
        for (i, part) in parts.into_iter().enumerate() {
            let msg = v1::KvEventsMessage {
                snapshot: Some(snapshot_part(snapshot.seq, part, i + 1 == n)),
                ..self.message()
            };
            tx.send(Ok(msg)).await.ok()?;
        }
        Some(snapshot.seq + 1)
    }

    /// Feeds one subscriber until it goes away.
    async fn feed(
        mut self,
        request: v1::KvSubscribeRequest,
        tx: mpsc::Sender<Result<v1::KvEventsMessage, Status>>,
    ) {
        let mut changed = self.log.watch();
        let mut next = request.from_seq.max(1);
        if request.incarnation != self.incarnation {
            let Some(n) = self.send_snapshot(&tx).await else {
                return;
            };
            next = n;
        }
        let mut digest_tick = tokio::time::interval(self.digest_interval);
        digest_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        digest_tick.reset();
        let mut digest_due = false;
        loop {
            match self.log.read(next) {
                Read::Gone => match self.send_snapshot(&tx).await {
                    Some(n) => next = n,
                    None => return,
                },
                Read::Events { events, digest } => {
                    if let Some(last) = events.last() {
                        next = last.seq + 1;
                        let msg = v1::KvEventsMessage {
                            events,
                            ..self.message()
                        };
                        if tx.send(Ok(msg)).await.is_err() {
                            return;
                        }
                    }
                    if std::mem::take(&mut digest_due) {
                        let msg = v1::KvEventsMessage {
                            digest: Some(digest),
                            ..self.message()
                        };
                        if tx.send(Ok(msg)).await.is_err() {
                            return;
                        }
                    }
                }
            }
            tokio::select! {
                r = changed.changed() => if r.is_err() { return },
                _ = digest_tick.tick() => digest_due = true,
                () = tx.closed() => return,
                () = self.drain.wait() => return,
            }
        }
    }
}

type EventStream = Pin<Box<dyn futures::Stream<Item = Result<v1::KvEventsMessage, Status>> + Send>>;

#[tonic::async_trait]
impl v1::kv_events_server::KvEvents for KvEventsService {
    type SubscribeStream = EventStream;

    async fn subscribe(
        &self,
        request: tonic::Request<v1::KvSubscribeRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(self.clone().feed(request.into_inner(), tx));
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(block_count: u64, hash_xor: u64) -> KvDigest {
        KvDigest {
            block_count,
            hash_xor,
        }
    }

    fn seqs(r: &Read) -> Vec<u64> {
        match r {
            Read::Events { events, .. } => events.iter().map(|e| e.seq).collect(),
            Read::Gone => panic!("gone"),
        }
    }

    #[test]
    fn numbers_replays_and_forgets_the_oldest() {
        let log = KvEventLog::new(3);
        assert_eq!(seqs(&log.read(1)), Vec::<u64>::new(), "nothing yet");
        log.append(
            vec![KvEvent::Stored(7), KvEvent::Stored(8)],
            digest(2, 7 ^ 8),
        );
        assert_eq!(seqs(&log.read(1)), [1, 2]);
        assert_eq!(seqs(&log.read(2)), [2]);
        log.append(
            vec![
                KvEvent::Removed {
                    hash: 7,
                    tier: Tier::Device,
                },
                KvEvent::Stored(9),
            ],
            digest(2, 8 ^ 9),
        );
        // Event 1 left the ring of 3.
        assert_eq!(log.read(1), Read::Gone);
        assert_eq!(seqs(&log.read(2)), [2, 3, 4]);
        assert_eq!(log.read(6), Read::Gone, "a future event");
        let Read::Events { events, digest: d } = log.read(4) else {
            panic!()
        };
        assert_eq!(events[0].kind, v1::KvEventKind::BlockStored as i32);
        assert_eq!(events[0].block_hash, 9);
        assert_eq!((d.seq, d.block_count, d.hash_xor), (4, 2, 8 ^ 9));
        let mut snap = log.snapshot();
        snap.blocks.sort();
        assert_eq!(
            snap,
            Snapshot {
                seq: 4,
                blocks: vec![(8, Tier::Device), (9, Tier::Device)]
            }
        );
        // A block moved down is in the snapshot's list of its tier.
        log.append(
            vec![KvEvent::MovedDown {
                hash: 8,
                from: Tier::Device,
                to: Tier::Disk,
            }],
            digest(2, 9 ^ Tier::Disk.digest_key(8)),
        );
        let part = snapshot_part(5, &log.snapshot().blocks, true);
        assert_eq!(
            (
                part.block_hashes,
                part.host_block_hashes,
                part.disk_block_hashes
            ),
            (vec![9], vec![], vec![8])
        );
        log.append(vec![KvEvent::Cleared], digest(0, 0));
        assert_eq!(log.snapshot().blocks, Vec::new());
    }

    fn edge() -> duet_proto::Edge {
        duet_proto::Edge::new(duet_proto::EdgeOptions {
            default_deadline: Duration::from_secs(5),
            max_in_flight: 4,
            cluster_token: None,
            tls: None,
        })
    }

    #[tokio::test]
    async fn subscriptions_end_when_the_worker_drains() {
        use futures::StreamExt;
        use v1::kv_events_server::KvEvents;
        let edge = edge();
        let log = Arc::new(KvEventLog::new(2));
        let service = KvEventsService::new(log, 7, Duration::from_secs(60), edge.drain_begun());
        let subscribe = || {
            service.subscribe(tonic::Request::new(v1::KvSubscribeRequest {
                incarnation: 7,
                from_seq: 1,
            }))
        };
        let mut open = subscribe().await.unwrap().into_inner();
        assert!(
            tokio::time::timeout(Duration::from_millis(200), open.next())
                .await
                .is_err(),
            "nothing to send yet: the subscription stays open"
        );
        edge.draining().begin().await;
        let ended = tokio::time::timeout(Duration::from_secs(5), open.next()).await;
        assert!(matches!(ended, Ok(None)), "{ended:?}");
        let mut late = subscribe().await.unwrap().into_inner();
        let ended = tokio::time::timeout(Duration::from_secs(5), late.next()).await;
        assert!(matches!(ended, Ok(None)), "subscribed after: {ended:?}");
    }

    async fn next(s: &mut EventStream) -> v1::KvEventsMessage {
        use futures::StreamExt;
        tokio::time::timeout(Duration::from_secs(5), s.next())
            .await
            .expect("a message in time")
            .expect("stream open")
            .expect("ok")
    }

    #[tokio::test]
    async fn subscribers_get_a_snapshot_then_live_events_and_digests() {
        use v1::kv_events_server::KvEvents;
        let log = Arc::new(KvEventLog::new(2));
        log.append(vec![KvEvent::Stored(5)], digest(1, 5));
        let service = KvEventsService::new(
            log.clone(),
            42,
            Duration::from_millis(50),
            edge().drain_begun(),
        );
        let subscribe = |incarnation, from_seq| {
            service.subscribe(tonic::Request::new(v1::KvSubscribeRequest {
                incarnation,
                from_seq,
            }))
        };
        // Another incarnation: a snapshot first.
        let mut s = subscribe(0, 0).await.unwrap().into_inner();
        let m = next(&mut s).await;
        assert_eq!(m.incarnation, 42);
        let snap = m.snapshot.unwrap();
        assert_eq!((snap.seq, snap.block_hashes, snap.last), (1, vec![5], true));
        log.append(vec![KvEvent::Stored(6)], digest(2, 5 ^ 6));
        let m = next(&mut s).await;
        assert_eq!(m.events.iter().map(|e| e.seq).collect::<Vec<_>>(), [2]);
        let d = loop {
            if let Some(d) = next(&mut s).await.digest {
                break d;
            }
        };
        assert_eq!((d.seq, d.block_count, d.hash_xor), (2, 2, 5 ^ 6));
        // Same incarnation, event still in the ring: replayed, no snapshot.
        let mut s = subscribe(42, 2).await.unwrap().into_inner();
        let m = next(&mut s).await;
        assert!(m.snapshot.is_none());
        assert_eq!(m.events[0].block_hash, 6);
        // Gone from the ring: a snapshot.
        log.append(
            vec![
                KvEvent::Removed {
                    hash: 5,
                    tier: Tier::Device,
                },
                KvEvent::Stored(7),
            ],
            digest(2, 6 ^ 7),
        );
        let mut s = subscribe(42, 1).await.unwrap().into_inner();
        let snap = next(&mut s).await.snapshot.unwrap();
        assert_eq!(snap.seq, 4);
    }
}
