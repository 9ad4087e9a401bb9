//! The actor's decisions against a scripted engine: no model, no threads.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::Ordering;

use duet_engine::backend::KvDtype;
use duet_engine::engine::{Resumed, Speculation, StepOutput};
use duet_kv::{KvDigest, KvEvent, PoolStats};
use duet_model::grammar::Grammar;
use duet_model::params::{FinishReason, SamplingParams, StopCriteria};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use duet_transfer::transport::ReadBlocks;

use super::*;
use crate::KvOut;

const BLOCK_SIZE: usize = 2;
const NUM_BLOCKS: usize = 16;
const LEASE: Duration = Duration::from_secs(30);

/// One scripted sequence: its prompt computes `chunk` tokens per step, then it generates
/// tokens 100, 101, ... until `max_tokens`.
struct Script {
    tokens: Vec<u32>,
    computed: usize,
    generated: usize,
    max_tokens: usize,
    blocks: usize,
    finished: bool,
}

struct ScriptedEngine {
    free: usize,
    seqs: BTreeMap<SeqId, Script>,
    next: SeqId,
    /// Prompt tokens computed per step and sequence.
    chunk: usize,
    /// Prompt tokens every new sequence or reservation finds in the prefix cache.
    cached: usize,
    fail_next_step: Option<EngineError>,
    written: Vec<(usize, u32, Vec<u8>)>,
    /// Prefix-cache events for the actor to drain.
    kv_events: Vec<KvEvent>,
}

impl ScriptedEngine {
    fn new(chunk: usize) -> Self {
        Self {
            free: NUM_BLOCKS,
            seqs: BTreeMap::new(),
            next: 1,
            chunk,
            cached: 0,
            fail_next_step: None,
            written: Vec::new(),
            kv_events: Vec::new(),
        }
    }

    fn take_blocks(&mut self, tokens: usize) -> Result<usize, EngineError> {
        let needed = tokens.div_ceil(BLOCK_SIZE);
        if needed > self.free {
            return Err(duet_kv::KvError::Exhausted {
                requested: needed,
                available: self.free,
            }
            .into());
        }
        self.free -= needed;
        Ok(needed)
    }

    fn add(
        &mut self,
        tokens: Vec<u32>,
        computed: usize,
        max_tokens: usize,
    ) -> Result<SeqId, EngineError> {
        let blocks = self.take_blocks(tokens.len() + max_tokens)?;
        let id = self.next;
        self.next += 1;
        self.seqs.insert(
            id,
            Script {
                tokens,
                computed,
                generated: 0,
                max_tokens,
                blocks,
                finished: false,
            },
        );
        Ok(id)
    }

    /// Appends the next generated token to `seq`.
    fn generate(&mut self, seq: SeqId) -> StepOutput {
        let s = self.seqs.get_mut(&seq).expect("known sequence");
        let token = 100 + s.generated as u32;
        s.tokens.push(token);
        s.generated += 1;
        s.finished = s.generated >= s.max_tokens;
        StepOutput {
            seq,
            token: Sampled {
                token,
                logprobs: None,
            },
            text: String::new(),
            finish: s.finished.then_some(FinishReason::Length),
            error: None,
            speculation: Default::default(),
        }
    }
}

struct ScriptedLayer<'a> {
    layer: usize,
    plan: &'a [PlannedSeq],
}

impl LayerKv for ScriptedLayer<'_> {
    fn layer(&self) -> usize {
        self.layer
    }

    fn plan(&self) -> &[PlannedSeq] {
        self.plan
    }

    fn append_kv_blocks(&self, blocks: &[u32], out: &mut Vec<u8>) -> Result<(), EngineError> {
        for &block in blocks {
            out.extend([self.layer as u8, block as u8]);
        }
        Ok(())
    }
}

impl ActorEngine for ScriptedEngine {
    fn kv_layout(&self) -> KvLayout {
        KvLayout {
            num_layers: 2,
            num_kv_heads: 1,
            head_dim: 1,
            block_size: BLOCK_SIZE,
            num_blocks: NUM_BLOCKS,
            dtype: KvDtype::F32,
        }
    }

    fn record_kv_events(&mut self) {}

    fn kv_tier_stats(&self) -> Vec<duet_kv::TierStats> {
        Vec::new()
    }

    fn set_prefill_rate(&mut self, _: f64) {}

    fn take_kv_events(&mut self) -> (Vec<KvEvent>, KvDigest) {
        (std::mem::take(&mut self.kv_events), KvDigest::default())
    }

    fn pool_stats(&self) -> PoolStats {
        PoolStats {
            num_blocks: NUM_BLOCKS,
            in_use: NUM_BLOCKS - self.free,
            cached: 0,
            free: self.free,
        }
    }

    fn has_work(&self) -> bool {
        self.seqs.values().any(|s| !s.finished)
    }

    fn preemptions(&self) -> u64 {
        0
    }

    fn out_of_vocab_drafts(&self) -> u64 {
        0
    }

    fn speculation_totals(&self) -> Speculation {
        Speculation::default()
    }

    fn resume_sequence(
        &mut self,
        tokens: Vec<u32>,
        _: Resumed,
        _: &str,
        _: SamplingParams,
        _: Option<Grammar>,
        stop: StopCriteria,
    ) -> Result<SeqId, EngineError> {
        let cached = self.cached;
        self.add(tokens, cached, stop.max_tokens)
    }

    fn cached_prompt_tokens(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(&seq).map(|_| self.cached)
    }

    fn remove_sequence(&mut self, seq: SeqId) -> Result<(), EngineError> {
        let s = self
            .seqs
            .remove(&seq)
            .ok_or(EngineError::UnknownSequence(seq))?;
        self.free += s.blocks;
        Ok(())
    }

    fn reserve(&mut self, tokens: &[u32], _: &str) -> Result<KvReservation, EngineError> {
        let blocks = self.take_blocks(tokens.len())?;
        Ok(KvReservation {
            blocks: (0..blocks as u32).map(|b| 50 + b).collect(),
            cached_blocks: (self.cached / BLOCK_SIZE).min(blocks),
            num_tokens: tokens.len(),
            hash_seed: 0,
            hashes: Vec::new(),
            reused: false,
        })
    }

    fn release(&mut self, reservation: KvReservation) -> Result<(), EngineError> {
        self.free += reservation.blocks.len();
        Ok(())
    }

    /// The blocks a fence holds: taken from the free ones until it is lifted, whatever becomes
    /// of the reservation.
    type Fence = usize;

    fn fence(&mut self, r: &KvReservation) -> Result<usize, EngineError> {
        let written = r.blocks.len() - r.cached_blocks;
        self.free -= written;
        Ok(written)
    }

    fn lift_fence(&mut self, blocks: usize) -> Result<(), EngineError> {
        self.free += blocks;
        Ok(())
    }

    fn cache_reservation(&mut self, _: &[u32], r: KvReservation) -> Result<(), EngineError> {
        self.release(r)
    }

    fn send_prefix(
        &mut self,
        _: &[u32],
        _: &str,
        blocks_end: usize,
        on_layer: &mut dyn FnMut(&[u32], &dyn LayerKv),
    ) -> Result<bool, EngineError> {
        // Prefix block i is physical block 10 + i.
        let table: Vec<u32> = (0..blocks_end as u32).map(|b| 10 + b).collect();
        for layer in 0..self.kv_layout().num_layers {
            on_layer(&table, &ScriptedLayer { layer, plan: &[] });
        }
        Ok(true)
    }

    fn add_prefilled(
        &mut self,
        prompt: Vec<u32>,
        reservation: KvReservation,
        _: Sampled,
        _: SamplingParams,
        _: Option<Grammar>,
        stop: StopCriteria,
    ) -> Result<(SeqId, StepOutput), EngineError> {
        self.release(reservation)?;
        let computed = prompt.len();
        let seq = self.add(prompt, computed, stop.max_tokens)?;
        Ok((seq, self.generate(seq)))
    }

    fn write_kv_block(&mut self, layer: usize, block: u32, data: &[u8]) -> Result<(), EngineError> {
        if data.len() != 2 {
            return Err(EngineError::InvalidBatch(format!("{} bytes", data.len())));
        }
        self.written.push((layer, block, data.to_vec()));
        Ok(())
    }

    fn step_with(
        &mut self,
        on_layer: &mut dyn FnMut(&dyn LayerKv),
    ) -> Result<Vec<StepOutput>, EngineError> {
        if let Some(e) = self.fail_next_step.take() {
            return Err(e);
        }
        let plan: Vec<PlannedSeq> = self
            .seqs
            .iter()
            .filter(|(_, s)| !s.finished)
            .map(|(&seq, s)| PlannedSeq {
                seq,
                start_pos: s.computed,
                len: (s.tokens.len() - s.computed).min(self.chunk),
                draft: Vec::new(),
                block_table: (0..s.blocks as u32).map(|b| 10 * seq as u32 + b).collect(),
            })
            .collect();
        for layer in 0..2 {
            on_layer(&ScriptedLayer { layer, plan: &plan });
        }
        let mut outputs = Vec::new();
        for p in &plan {
            let s = self.seqs.get_mut(&p.seq).expect("planned");
            s.computed += p.len;
            if s.computed == s.tokens.len() {
                outputs.push(self.generate(p.seq));
            }
        }
        Ok(outputs)
    }
}

/// What a sender was given.
#[derive(Default)]
struct Shipped {
    layers: Vec<(usize, Range<usize>, Vec<u8>)>,
    finished: bool,
}

struct RecordingSender(Arc<Mutex<Shipped>>);

impl KvSender for RecordingSender {
    fn send_layer(
        &mut self,
        layer: usize,
        blocks: Range<usize>,
        read_blocks: &mut ReadBlocks<'_>,
    ) -> Result<(), TransferError> {
        let mut bytes = Vec::new();
        read_blocks(blocks.clone(), &mut bytes)?;
        self.0.lock().unwrap().layers.push((layer, blocks, bytes));
        Ok(())
    }

    fn finish(&mut self) {
        self.0.lock().unwrap().finished = true;
    }
}

fn actor(chunk: usize) -> Actor<ScriptedEngine> {
    Actor::new(ScriptedEngine::new(chunk), LEASE)
}

fn request(
    id: RequestId,
    prompt_len: usize,
    max_tokens: usize,
) -> (Request, UnboundedReceiver<Event>) {
    let (events, rx) = unbounded_channel();
    let request = Request {
        id,
        prompt: (1..=prompt_len as u32).collect(),
        resumed: Resumed::default(),
        cache_salt: String::new(),
        params: SamplingParams::default(),
        grammar: None,
        stop: StopCriteria {
            max_tokens,
            ..StopCriteria::default()
        },
        kv_out: None,
        events,
        received: Instant::now(),
    };
    (request, rx)
}

/// Submits as the handle does: the prompt counts as queued first.
fn submit(a: &mut Actor<ScriptedEngine>, r: Request) {
    a.counters
        .queued_tokens
        .fetch_add(r.prompt.len() as u64, Ordering::Relaxed);
    a.handle(Command::Submit(r));
}

fn drain(rx: &mut UnboundedReceiver<Event>) -> Vec<Event> {
    std::iter::from_fn(|| rx.try_recv().ok()).collect()
}

fn tokens(events: &[Event]) -> Vec<u32> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Output(o) => Some(o.token.token),
            _ => None,
        })
        .collect()
}

fn queued(a: &Actor<ScriptedEngine>) -> u64 {
    a.counters.queued_tokens.load(Ordering::Relaxed)
}

fn ask<T>(a: &mut Actor<ScriptedEngine>, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> T {
    let (tx, mut rx) = oneshot::channel();
    a.handle(make(tx));
    rx.try_recv().expect("answered at once")
}

#[test]
fn a_prefill_request_ships_each_block_once_complete_then_ends_with_its_first_token() {
    let mut a = actor(2);
    a.engine.cached = 0;
    let shipped = Arc::new(Mutex::new(Shipped::default()));
    let (mut r, mut rx) = request(1, 5, 2);
    // Block 0 is already cached at the destination: blocks 1 and 2 go out.
    r.kv_out = Some(KvOut {
        sender: Box::new(RecordingSender(shipped.clone())),
        first_block: 1,
    });
    submit(&mut a, r);
    let now = Instant::now();

    a.turn(now); // tokens 0..2: block 0 complete, not sent
    assert!(shipped.lock().unwrap().layers.is_empty());
    assert_eq!(queued(&a), 3);
    let snap = a.published.get();
    assert_eq!((snap.waiting, snap.running), (0, 1));

    a.turn(now); // tokens 2..4: block 1 complete
    a.turn(now); // token 4: the last, partial block, and the first token
    let s = shipped.lock().unwrap();
    let ranges: Vec<_> = s.layers.iter().map(|(l, b, _)| (*l, b.clone())).collect();
    assert_eq!(ranges, [(0, 1..2), (1, 1..2), (0, 2..3), (1, 2..3)]);
    // Layer 1's bytes of reservation block 2, read from the sequence's physical block 12.
    assert_eq!(s.layers[3].2, [1, 12]);
    assert!(s.finished, "the push is finished before the answer");
    drop(s);

    let events = drain(&mut rx);
    assert!(matches!(events[0], Event::Admitted { cached_tokens: 0 }));
    assert!(matches!(events[1], Event::Scheduled(t) if t == now));
    assert_eq!(
        tokens(&events),
        [100],
        "one token: the request ends with it"
    );
    assert!(a.engine.seqs.is_empty(), "the sequence is removed at once");
    assert_eq!(queued(&a), 0);
    assert_eq!(a.published.get().pool.free, NUM_BLOCKS);
}

#[test]
fn prefix_hits_leave_only_the_rest_queued() {
    let mut a = actor(8);
    a.engine.cached = 4;
    let (r, mut rx) = request(1, 6, 1);
    submit(&mut a, r);
    assert_eq!(queued(&a), 2);
    assert!(matches!(
        drain(&mut rx)[0],
        Event::Admitted { cached_tokens: 4 }
    ));
    a.turn(Instant::now());
    assert_eq!(queued(&a), 0);
}

#[test]
fn a_local_request_streams_every_token_and_is_removed_at_its_finish() {
    let mut a = actor(8);
    let (r, mut rx) = request(1, 3, 3);
    submit(&mut a, r);
    for _ in 0..3 {
        a.turn(Instant::now());
    }
    let events = drain(&mut rx);
    assert_eq!(tokens(&events), [100, 101, 102]);
    match events.last() {
        Some(Event::Output(o)) => assert_eq!(o.finish, Some(FinishReason::Length)),
        _ => panic!("the last event is the finishing token"),
    }
    assert!(a.engine.seqs.is_empty() && !a.engine.has_work());
    assert!(a.admitted.is_empty() && a.by_id.is_empty());
}

#[test]
fn a_request_whose_caller_left_is_dropped() {
    let mut a = actor(8);
    let (r, rx) = request(1, 3, 1);
    drop(rx);
    submit(&mut a, r);
    assert!(
        a.engine.seqs.is_empty(),
        "cancelled while queued: not admitted"
    );
    assert_eq!(queued(&a), 0);

    let (r, mut rx) = request(2, 3, 5);
    submit(&mut a, r);
    a.turn(Instant::now());
    assert_eq!(tokens(&drain(&mut rx)), [100]);
    drop(rx);
    a.turn(Instant::now());
    assert!(a.engine.seqs.is_empty(), "removed at its next token");
}

#[test]
fn cancel_frees_a_running_request_and_a_reservation() {
    let mut a = actor(2);
    let (r, mut rx) = request(1, 6, 4);
    submit(&mut a, r);
    a.turn(Instant::now());
    let info = ask(&mut a, |reply| Command::Reserve {
        id: 2,
        tokens: vec![1; 4],
        cache_salt: String::new(),
        reply,
    })
    .unwrap();
    assert_eq!(info.block_ids.len(), 2);
    assert_eq!(a.published.get().reservations, 0, "published at the turn");
    a.turn(Instant::now());
    assert_eq!(a.published.get().reservations, 1);

    a.handle(Command::Cancel(1));
    a.handle(Command::Cancel(2));
    a.turn(Instant::now());
    assert!(a.engine.seqs.is_empty());
    assert_eq!(queued(&a), 0, "the uncomputed prompt leaves the queue");
    assert_eq!(a.published.get().pool.free, NUM_BLOCKS);
    assert_eq!(a.published.get().reservations, 0);
    drain(&mut rx);
    assert!(rx.try_recv().is_err(), "no answer after a cancel");
}

#[test]
fn a_fence_holds_a_reservations_blocks_past_its_cancel_until_its_time_or_its_own_lift() {
    let mut a = actor(2);
    let reserve = |a: &mut Actor<ScriptedEngine>, id| {
        ask(a, |reply| Command::Reserve {
            id,
            tokens: vec![1; 4],
            cache_salt: String::new(),
            reply,
        })
        .unwrap()
    };
    let now = Instant::now();
    let secs = Duration::from_secs;
    reserve(&mut a, 1);
    a.handle(Command::Fence {
        id: 1,
        until: now + secs(5),
    });
    a.handle(Command::Cancel(1));
    a.turn(now);
    assert_eq!(a.published.get().reservations, 0);
    assert_eq!(
        a.published.get().pool.free,
        NUM_BLOCKS - 2,
        "held past the cancel"
    );
    assert_eq!(
        a.next_expiry(),
        Some(now + secs(5)),
        "the engine thread wakes for it"
    );
    a.turn(now + secs(5));
    assert_eq!(a.published.get().pool.free, NUM_BLOCKS);
    assert_eq!(a.next_expiry(), None);

    // Two attempts, each fenced: the second's answer lifts its own fence at once, the first's
    // keeps its time (that sender may still be copying).
    reserve(&mut a, 2);
    for until in [now + secs(10), now + secs(20)] {
        a.handle(Command::Fence { id: 2, until });
    }
    a.handle(Command::Cancel(2));
    a.turn(now);
    assert_eq!(a.published.get().pool.free, NUM_BLOCKS - 4);
    a.handle(Command::LiftFence {
        id: 2,
        until: now + secs(20),
    });
    a.turn(now);
    assert_eq!(a.published.get().pool.free, NUM_BLOCKS - 2);
    a.turn(now + secs(10));
    assert_eq!(a.published.get().pool.free, NUM_BLOCKS);

    // No reservation, nothing to hold.
    a.handle(Command::Fence {
        id: 3,
        until: now + secs(30),
    });
    assert!(a.fences.is_empty());
}

#[test]
fn a_reservation_takes_writes_then_activates_into_a_running_request() {
    let mut a = actor(8);
    let reserve = |a: &mut Actor<ScriptedEngine>, id| {
        ask(a, |reply| Command::Reserve {
            id,
            tokens: vec![1; 3],
            cache_salt: String::new(),
            reply,
        })
    };
    reserve(&mut a, 7).unwrap();
    let key = bind(&mut a, 7, "p").unwrap();
    assert_eq!(writable(&mut a, key, "p").unwrap(), Some(0..2));
    let write = |a: &mut Actor<ScriptedEngine>, blocks: Range<usize>, payload: Vec<u8>| {
        ask(a, |reply| Command::WriteKv {
            key,
            layer: 1,
            blocks,
            payload,
            reply,
        })
    };
    write(&mut a, 0..2, vec![1, 2, 3, 4]).unwrap();
    assert_eq!(a.engine.written, [(1, 50, vec![1, 2]), (1, 51, vec![3, 4])]);
    let e = write(&mut a, 1..3, vec![0; 4]).unwrap_err();
    assert!(matches!(e, TransferError::Malformed(_)), "{e}");

    let (r, mut rx) = request(7, 3, 2);
    a.handle(Command::Activate {
        request: r,
        first: Sampled {
            token: 9,
            logprobs: None,
        },
    });
    a.turn(Instant::now());
    assert_eq!(tokens(&drain(&mut rx)), [100, 101]);
    assert_eq!(a.published.get().reservations, 0);
}

fn bind(a: &mut Actor<ScriptedEngine>, id: RequestId, worker: &str) -> Option<ReservationKey> {
    bind_for(a, id, worker, Duration::ZERO)
}

fn bind_for(
    a: &mut Actor<ScriptedEngine>,
    id: RequestId,
    worker: &str,
    attempt: Duration,
) -> Option<ReservationKey> {
    ask(a, |reply| Command::Bind {
        id,
        prefill_worker: worker.into(),
        attempt,
        reply,
    })
}

fn writable(
    a: &mut Actor<ScriptedEngine>,
    key: ReservationKey,
    sender: &str,
) -> Result<Option<Range<usize>>, TransferError> {
    ask(a, |reply| Command::WritableBlocks {
        key,
        sender: sender.into(),
        reply,
    })
}

#[test]
fn only_the_asked_prefill_worker_writes_and_only_past_the_cached_blocks() {
    let mut a = actor(8);
    a.engine.cached = 2 * BLOCK_SIZE;
    let info = ask(&mut a, |reply| Command::Reserve {
        id: 7,
        tokens: vec![1; 4 * BLOCK_SIZE],
        cache_salt: String::new(),
        reply,
    })
    .unwrap();
    assert_eq!((info.block_ids.len(), info.cached_blocks), (4, 2));
    let first = bind(&mut a, 7, "p1").unwrap();
    assert_eq!(writable(&mut a, first, "p1").unwrap(), Some(2..4));
    let e = writable(&mut a, first, "intruder").unwrap_err();
    assert!(matches!(e, TransferError::Forbidden(_)), "{e}");
    let write = |a: &mut Actor<ScriptedEngine>, key, blocks: Range<usize>| {
        ask(a, |reply| Command::WriteKv {
            key,
            layer: 0,
            blocks,
            payload: vec![9; 4],
            reply,
        })
    };
    let e = write(&mut a, first, 1..3).unwrap_err();
    assert!(matches!(e, TransferError::Forbidden(_)), "{e}");
    assert!(a.engine.written.is_empty(), "cached blocks untouched");
    write(&mut a, first, 2..4).unwrap();

    // A retry on another prefill worker: the first attempt's key no longer names anything.
    let second = bind(&mut a, 7, "p2").unwrap();
    assert_ne!(first, second);
    assert_eq!(writable(&mut a, first, "p1").unwrap(), None);
    let e = write(&mut a, first, 2..4).unwrap_err();
    assert!(matches!(e, TransferError::ReservationGone(_)), "{e}");
    assert_eq!(writable(&mut a, second, "p2").unwrap(), Some(2..4));
    a.handle(Command::Cancel(7));
    assert_eq!(writable(&mut a, second, "p2").unwrap(), None);
    assert_eq!(bind(&mut a, 7, "p2"), None);
}

#[test]
fn a_reservation_expires_after_its_lease() {
    let mut a = actor(8);
    let (tx, mut reply) = oneshot::channel();
    a.handle(Command::Reserve {
        id: 7,
        tokens: vec![1; 4],
        cache_salt: String::new(),
        reply: tx,
    });
    reply.try_recv().unwrap().unwrap();
    let key = bind(&mut a, 7, "p").unwrap();
    assert!(
        a.next_expiry().is_some(),
        "an idle engine thread wakes for the lease"
    );
    a.turn(Instant::now() + LEASE + Duration::from_millis(1));
    assert_eq!(a.published.get().pool.free, NUM_BLOCKS, "blocks reclaimed");
    assert_eq!(writable(&mut a, key, "p").unwrap(), None);
    let e = ask(&mut a, |reply| Command::WriteKv {
        key,
        layer: 0,
        blocks: 0..1,
        payload: vec![0; 2],
        reply,
    })
    .unwrap_err();
    assert!(matches!(e, TransferError::ReservationGone(_)), "{e}");
    let (r, mut rx) = request(7, 4, 2);
    a.handle(Command::Activate {
        request: r,
        first: Sampled {
            token: 9,
            logprobs: None,
        },
    });
    match drain(&mut rx).as_slice() {
        [Event::Failed(WorkerError::NotFound(m))] => assert!(m.contains("expired"), "{m}"),
        other => panic!("expected NOT_FOUND, got {other:?}"),
    }
}

/// A prompt that waits in a prefill worker's queue longer than a lease keeps its reservation:
/// binding it to an attempt renews the lease past the attempt's end.
#[test]
fn a_bound_reservation_outlasts_its_attempt() {
    let mut a = actor(8);
    ask(&mut a, |reply| Command::Reserve {
        id: 7,
        tokens: vec![1; 4],
        cache_salt: String::new(),
        reply,
    })
    .unwrap();
    let attempt = LEASE * 10;
    let key = bind_for(&mut a, 7, "p", attempt).unwrap();
    a.turn(Instant::now() + LEASE * 5);
    assert_eq!(
        writable(&mut a, key, "p").unwrap(),
        Some(0..2),
        "still held"
    );
    a.turn(Instant::now() + attempt + LEASE + Duration::from_millis(10));
    assert_eq!(writable(&mut a, key, "p").unwrap(), None, "reclaimed after");
}

#[test]
fn a_full_cache_fails_the_newest_request_and_other_errors_fail_all() {
    let mut a = actor(2);
    let (r1, mut rx1) = request(1, 4, 3);
    let (r2, mut rx2) = request(2, 4, 3);
    submit(&mut a, r1);
    submit(&mut a, r2);
    a.engine.fail_next_step = Some(
        duet_kv::KvError::Exhausted {
            requested: 1,
            available: 0,
        }
        .into(),
    );
    a.turn(Instant::now());
    assert!(matches!(
        drain(&mut rx2).last(),
        Some(Event::Failed(WorkerError::ResourceExhausted(_)))
    ));
    assert!(!matches!(drain(&mut rx1).last(), Some(Event::Failed(_))));
    assert_eq!(a.engine.seqs.len(), 1, "the older request goes on");

    a.engine.fail_next_step = Some(EngineError::Device("lost".into()));
    a.turn(Instant::now());
    assert!(matches!(
        drain(&mut rx1).last(),
        Some(Event::Failed(WorkerError::Internal(_)))
    ));
    assert!(a.engine.seqs.is_empty());
    assert_eq!(queued(&a), 0);
}

#[test]
fn a_turn_publishes_the_engines_kv_events_and_its_prefill_rate() {
    use crate::kv_events::Read;
    let mut a = actor(32);
    a.engine.kv_events = vec![KvEvent::Stored(3), KvEvent::Stored(4)];
    let (r, _rx) = request(1, 20, 4);
    submit(&mut a, r);
    a.turn(Instant::now());
    let Read::Events { events, .. } = a.kv_events.read(1) else {
        panic!("events 1.. are in the ring");
    };
    let got: Vec<(u64, u64)> = events.iter().map(|e| (e.seq, e.block_hash)).collect();
    assert_eq!(got, [(1, 3), (2, 4)]);
    assert!(a.engine.kv_events.is_empty(), "drained once");
    // The step computed the 20-token prompt: a measured rate.
    assert!(a.published.get().prefill_tokens_per_s > 0.0);
}

/// A peer's pull is sent from the held prefix through whatever sender the answer chose, layer
/// by layer from the engine's physical blocks, and finished once every layer went out.
#[test]
fn a_pulled_prefix_is_sent_layer_by_layer_through_the_answers_sender() {
    let mut a = actor(2);
    let shipped = Arc::new(Mutex::new(Shipped::default()));
    let sender = Box::new(RecordingSender(shipped.clone()));
    let held = ask(&mut a, |reply| Command::SendPrefix {
        tokens: (0..3 * BLOCK_SIZE as u32).collect(),
        cache_salt: String::new(),
        blocks: 1..3,
        deadline: Instant::now() + LEASE,
        sender,
        reply,
    });
    assert!(held.unwrap());
    let s = shipped.lock().unwrap();
    let layers: Vec<_> = s.layers.iter().map(|(l, b, _)| (*l, b.clone())).collect();
    assert_eq!(layers, [(0, 1..3), (1, 1..3)]);
    // Layer 1's bytes of prefix blocks 1 and 2: physical blocks 11 and 12.
    assert_eq!(s.layers[1].2, [1, 11, 1, 12]);
    assert!(s.finished);
}

/// A caller gone past its deadline gets no layer: a sender copying into its blocks in place
/// must not start once its fence may have been lifted.
#[test]
fn a_pull_past_its_callers_deadline_sends_nothing() {
    let mut a = actor(2);
    let shipped = Arc::new(Mutex::new(Shipped::default()));
    let sender = Box::new(RecordingSender(shipped.clone()));
    let sent = ask(&mut a, |reply| Command::SendPrefix {
        tokens: (0..3 * BLOCK_SIZE as u32).collect(),
        cache_salt: String::new(),
        blocks: 1..3,
        deadline: Instant::now(),
        sender,
        reply,
    });
    let err = sent.unwrap_err();
    assert!(
        matches!(&err, WorkerError::DeadlineExceeded(m) if m.contains("layer 0")),
        "{err}"
    );
    let s = shipped.lock().unwrap();
    assert!(s.layers.is_empty() && !s.finished);
}
