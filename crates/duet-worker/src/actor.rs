//! The engine-thread actor: the one place the model runs, in the manner of TGI's `queue_task`.
//!
//! Everything that touches the engine (admitting prompts, KV reservations and the writes that
//! fill them, forward steps, cancellation) is a [`Command`] processed here in order, between
//! steps. With nothing to compute the thread sleeps on its channel (until the next reservation
//! lease runs out); otherwise each turn takes every command that arrived, expires leases, runs
//! one step over everything admitted (the engine batches decode tokens and prompt chunks up to
//! its step budget), and publishes a [`Snapshot`] for `Stats` and the turn's prefix-cache events
//! to the [`KvEventLog`].

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use duet_engine::EngineError;
use duet_engine::backend::KvLayout;
use duet_engine::engine::{KvReservation, PlannedSeq, SeqId, StepOutput};
use duet_model::params::Sampled;
use duet_transfer::{KvSender, LayerSource, ReservationKey, TransferError};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;

use crate::actor_engine::{ActorEngine, LayerKv};
use crate::kv_events::{DEFAULT_RING_EVENTS, KvEventLog};
use crate::stats::{Counters, PrefillRate, Published, Snapshot};
use crate::{Event, Request, RequestId, WorkerError};

/// What the services ask of the engine thread.
pub enum Command {
    /// Runs a prompt here: prefill, then generate (or, with a `kv_out`, ship the KV and end with
    /// the first token). A reservation held under the same id is released first.
    Submit(Request),
    /// Holds KV blocks for a prompt another worker will prefill, until the lease runs out.
    Reserve {
        id: RequestId,
        tokens: Vec<u32>,
        cache_salt: String,
        reply: oneshot::Sender<Result<ReservationInfo, WorkerError>>,
    },
    /// Hands a reservation to the prefill worker about to be asked for it: a fresh key that only
    /// a push naming that worker may use (an earlier attempt's key stops working). The lease is
    /// renewed to outlast the attempt (`attempt`, however long the prompt waits in that worker's
    /// queue, plus a lease). `None` once the reservation is gone.
    Bind {
        id: RequestId,
        prefill_worker: String,
        attempt: Duration,
        reply: oneshot::Sender<Option<ReservationKey>>,
    },
    /// The blocks a push from `sender` may write (see [`duet_transfer::KvSink::writable_blocks`]).
    WritableBlocks {
        key: ReservationKey,
        sender: String,
        reply: oneshot::Sender<Result<Option<Range<usize>>, TransferError>>,
    },
    /// KV of reservation blocks `blocks` of one layer, from a transfer.
    WriteKv {
        key: ReservationKey,
        layer: usize,
        blocks: Range<usize>,
        payload: Vec<u8>,
        reply: oneshot::Sender<Result<(), TransferError>>,
    },
    /// The reservation is filled: generate on from the prefill's first token.
    Activate { request: Request, first: Sampled },
    /// The request is gone (client cancelled, deadline, failure): free whatever it holds.
    Cancel(RequestId),
    /// Holds the blocks a transfer due by `until` writes into request `id`'s reservation until
    /// then (or [`LiftFence`](Self::LiftFence)), whatever becomes of the reservation: a sender
    /// that writes them in place (CUDA IPC) may still land copies after the transfer was given
    /// up, and no other sequence may have them by then. Each attempt fences the blocks it is
    /// offered (a fresh reservation's too).
    Fence { id: RequestId, until: Instant },
    /// The transfer fenced until `until` answered (its copies all landed): its fence goes. An
    /// earlier attempt's fence keeps its time: that sender may still be copying.
    LiftFence { id: RequestId, until: Instant },
    /// Sends the KV of blocks `blocks` of the prefix of `tokens` held here through `sender`,
    /// for a peer's pull (see `Engine::send_prefix`), and finishes it; `false` (nothing sent)
    /// unless every block is held. No layer is sent past `deadline` (the caller's): a sender
    /// writing into the caller's blocks in place must not start after the caller gave up and
    /// its fence may have gone.
    SendPrefix {
        tokens: Vec<u32>,
        cache_salt: String,
        blocks: Range<usize>,
        deadline: Instant,
        sender: Box<dyn KvSender>,
        reply: oneshot::Sender<Result<bool, WorkerError>>,
    },
    /// The reservation of request `id`, filled by a pull of `tokens` (whole blocks), becomes a
    /// cached prefix here.
    CachePulled {
        id: RequestId,
        tokens: Vec<u32>,
        reply: oneshot::Sender<Result<(), WorkerError>>,
    },
}

/// The blocks of a reservation, as a prefill worker needs them.
#[derive(Clone, Debug)]
pub struct ReservationInfo {
    pub block_ids: Vec<u32>,
    /// Leading blocks already holding the prompt's KV here (not sent).
    pub cached_blocks: usize,
}

/// A request admitted into the engine.
struct Admitted {
    id: RequestId,
    events: UnboundedSender<Event>,
    shipping: Option<Shipping>,
    /// Prompt tokens not computed yet (counted in `Counters::queued_tokens`).
    remaining: usize,
    scheduled: bool,
}

/// A prefill request's KV on its way out.
struct Shipping {
    sender: Box<dyn KvSender>,
    /// Next reservation block to send; the blocks before it went out for every layer.
    next_block: usize,
    num_blocks: usize,
    num_tokens: usize,
}

impl Shipping {
    /// Sends this layer's KV of the blocks that the planned chunk `p` completes; the last
    /// layer commits them. A block is sent once every layer of it is computed; the last,
    /// partial block goes out with the prompt's final chunk.
    fn ship(&mut self, p: &PlannedSeq, done: &dyn LayerKv, block_size: usize, last_layer: bool) {
        let computed = p.start_pos + p.len;
        let end = if computed >= self.num_tokens {
            self.num_blocks
        } else {
            computed / block_size
        };
        if end <= self.next_block {
            return;
        }
        let sent = send_layer(
            &mut *self.sender,
            done,
            &p.block_table,
            self.next_block..end,
        );
        // A device failure fails the step, and with it the request, unsent.
        if sent.is_ok() && last_layer {
            self.next_block = end;
        }
    }
}

/// Sends `done`'s layer of `blocks` (indices into `table`, the engine's physical block of each)
/// through `sender`.
fn send_layer(
    sender: &mut dyn KvSender,
    done: &dyn LayerKv,
    table: &[u32],
    blocks: Range<usize>,
) -> Result<(), TransferError> {
    let mut read = |blocks: Range<usize>, out: &mut Vec<u8>| {
        done.append_kv_blocks(&table[blocks], out)
            .map_err(|e| TransferError::Cache(e.to_string()))
    };
    sender.send_layer_from(
        done.layer(),
        blocks,
        &mut LayerSource {
            block_table: table,
            device: done.device(),
            read_blocks: &mut read,
        },
    )
}

/// KV blocks held for a transfer.
struct Reserved {
    kv: KvReservation,
    expires: Instant,
    /// The current prefill attempt's key and the prefill worker it was made for.
    holder: Option<(ReservationKey, String)>,
}

pub struct Actor<E: ActorEngine> {
    engine: E,
    layout: KvLayout,
    /// How long a reservation waits for its transfer.
    lease: Duration,
    counters: Arc<Counters>,
    published: Arc<Published>,
    kv_events: Arc<KvEventLog>,
    prefill_rate: PrefillRate,
    reservations: HashMap<RequestId, Reserved>,
    /// The reservation each live key names.
    keys: HashMap<ReservationKey, RequestId>,
    /// Blocks held against late writes: the request, until when, the blocks.
    fences: Vec<(RequestId, Instant, E::Fence)>,
    admitted: BTreeMap<SeqId, Admitted>,
    by_id: HashMap<RequestId, SeqId>,
}

impl<E: ActorEngine> Actor<E> {
    pub fn new(mut engine: E, lease: Duration) -> Self {
        let published = Arc::new(Published::new(Snapshot {
            pool: engine.pool_stats(),
            waiting: 0,
            running: 0,
            reservations: 0,
            prefill_tokens_per_s: 0.0,
            preemptions: 0,
            out_of_vocab_drafts: 0,
            speculation: Default::default(),
            kv_tiers: engine.kv_tier_stats(),
        }));
        engine.record_kv_events();
        Self {
            layout: engine.kv_layout(),
            engine,
            lease,
            counters: Arc::default(),
            published,
            kv_events: Arc::new(KvEventLog::new(DEFAULT_RING_EVENTS)),
            prefill_rate: PrefillRate::default(),
            reservations: HashMap::new(),
            keys: HashMap::new(),
            fences: Vec::new(),
            admitted: BTreeMap::new(),
            by_id: HashMap::new(),
        }
    }

    pub fn engine(&self) -> &E {
        &self.engine
    }

    pub(crate) fn shared(&self) -> (Arc<Counters>, Arc<Published>, Arc<KvEventLog>) {
        (
            self.counters.clone(),
            self.published.clone(),
            self.kv_events.clone(),
        )
    }

    /// Runs until every command sender is gone and nothing is left to compute.
    pub fn run(mut self, commands: Receiver<Command>) {
        loop {
            if !self.engine.has_work() {
                let next = match self.next_expiry() {
                    Some(at) => {
                        match commands.recv_timeout(at.saturating_duration_since(Instant::now())) {
                            Ok(cmd) => Some(cmd),
                            Err(RecvTimeoutError::Timeout) => None,
                            Err(RecvTimeoutError::Disconnected) => break,
                        }
                    }
                    None => match commands.recv() {
                        Ok(cmd) => Some(cmd),
                        Err(_) => break,
                    },
                };
                if let Some(cmd) = next {
                    self.handle(cmd);
                }
            }
            while let Ok(cmd) = commands.try_recv() {
                self.handle(cmd);
            }
            self.turn(Instant::now());
        }
        tracing::debug!("engine thread stopped");
    }

    fn next_expiry(&self) -> Option<Instant> {
        let fences = self.fences.iter().map(|&(_, until, _)| until);
        self.reservations
            .values()
            .map(|r| r.expires)
            .chain(fences)
            .min()
    }

    pub fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(request) => self.submit(request),
            Command::Reserve {
                id,
                tokens,
                cache_salt,
                reply,
            } => {
                let _ = reply.send(self.reserve(id, &tokens, &cache_salt));
            }
            Command::Bind {
                id,
                prefill_worker,
                attempt,
                reply,
            } => {
                let _ = reply.send(self.bind(id, prefill_worker, attempt));
            }
            Command::WritableBlocks { key, sender, reply } => {
                let _ = reply.send(self.writable_blocks(key, &sender));
            }
            Command::WriteKv {
                key,
                layer,
                blocks,
                payload,
                reply,
            } => {
                let _ = reply.send(self.write_kv(key, layer, blocks, &payload));
            }
            Command::Activate { request, first } => self.activate(request, first),
            Command::Cancel(id) => {
                self.release_reservation(id);
                if let Some(&seq) = self.by_id.get(&id) {
                    tracing::debug!(request = id, "cancelled");
                    self.remove(seq);
                }
            }
            Command::Fence { id, until } => self.fence(id, until),
            Command::LiftFence { id, until } => {
                self.lift_fences(|&(i, u, _)| i == id && u == until)
            }
            Command::SendPrefix {
                tokens,
                cache_salt,
                blocks,
                deadline,
                sender,
                reply,
            } => {
                let sent = self.send_prefix(&tokens, &cache_salt, blocks, deadline, sender);
                let _ = reply.send(sent);
            }
            Command::CachePulled { id, tokens, reply } => {
                let _ = reply.send(self.cache_pulled(id, &tokens));
            }
        }
    }

    fn send_prefix(
        &mut self,
        tokens: &[u32],
        cache_salt: &str,
        blocks: Range<usize>,
        deadline: Instant,
        mut sender: Box<dyn KvSender>,
    ) -> Result<bool, WorkerError> {
        let mut failed: Option<WorkerError> = None;
        let held =
            self.engine
                .send_prefix(tokens, cache_salt, blocks.end, &mut |table, done| {
                    if failed.is_some() {
                        return;
                    }
                    if Instant::now() >= deadline {
                        failed = Some(WorkerError::DeadlineExceeded(format!(
                            "the caller's deadline passed before layer {} was sent",
                            done.layer()
                        )));
                        return;
                    }
                    failed = send_layer(&mut *sender, done, table, blocks.clone())
                        .err()
                        .map(Into::into);
                })?;
        if let Some(e) = failed {
            return Err(e);
        }
        if held {
            sender.finish();
        }
        Ok(held)
    }

    fn cache_pulled(&mut self, id: RequestId, tokens: &[u32]) -> Result<(), WorkerError> {
        let r = self.reservations.remove(&id).ok_or_else(|| {
            WorkerError::NotFound(format!(
                "reservation {id} expired before its pull completed"
            ))
        })?;
        if let Some((key, _)) = r.holder {
            self.keys.remove(&key);
        }
        Ok(self.engine.cache_reservation(tokens, r.kv)?)
    }

    /// One turn after the commands: expire leases, step, publish.
    pub fn turn(&mut self, now: Instant) {
        self.expire_leases(now);
        if self.engine.has_work() {
            self.step(now);
        }
        self.publish();
    }

    fn submit(&mut self, r: Request) {
        let n = r.prompt.len();
        if r.events.is_closed() {
            self.counters.unqueue(n); // cancelled while queued
            return;
        }
        self.release_reservation(r.id);
        let seq = match self.engine.resume_sequence(
            r.prompt,
            r.resumed,
            &r.cache_salt,
            r.params,
            r.grammar,
            r.stop,
        ) {
            Ok(seq) => seq,
            Err(e) => {
                self.counters.unqueue(n);
                let _ = r.events.send(Event::Failed(e.into()));
                return;
            }
        };
        let cached = self.engine.cached_prompt_tokens(seq).unwrap_or(0);
        self.counters.unqueue(cached);
        let _ = r.events.send(Event::Admitted {
            cached_tokens: cached,
        });
        let shipping = r.kv_out.map(|k| Shipping {
            sender: k.sender,
            next_block: k.first_block,
            num_blocks: n.div_ceil(self.layout.block_size),
            num_tokens: n,
        });
        self.insert(
            seq,
            Admitted {
                id: r.id,
                events: r.events,
                shipping,
                remaining: n - cached,
                scheduled: false,
            },
        );
    }

    fn insert(&mut self, seq: SeqId, a: Admitted) {
        self.by_id.insert(a.id, seq);
        self.admitted.insert(seq, a);
    }

    fn reserve(
        &mut self,
        id: RequestId,
        tokens: &[u32],
        cache_salt: &str,
    ) -> Result<ReservationInfo, WorkerError> {
        self.release_reservation(id);
        let r = self.engine.reserve(tokens, cache_salt)?;
        let info = ReservationInfo {
            block_ids: r.blocks.clone(),
            cached_blocks: r.cached_blocks,
        };
        self.reservations.insert(
            id,
            Reserved {
                kv: r,
                expires: Instant::now() + self.lease,
                holder: None,
            },
        );
        Ok(info)
    }

    fn bind(
        &mut self,
        id: RequestId,
        prefill_worker: String,
        attempt: Duration,
    ) -> Option<ReservationKey> {
        let r = self.reservations.get_mut(&id)?;
        r.expires = r.expires.max(Instant::now() + attempt + self.lease);
        let key = ReservationKey::random();
        if let Some((old, _)) = r.holder.replace((key, prefill_worker)) {
            self.keys.remove(&old);
        }
        self.keys.insert(key, id);
        Some(key)
    }

    fn release_reservation(&mut self, id: RequestId) {
        let Some(r) = self.reservations.remove(&id) else {
            return;
        };
        if let Some((key, _)) = r.holder {
            self.keys.remove(&key);
        }
        if let Err(e) = self.engine.release(r.kv) {
            tracing::error!(request = id, "releasing a KV reservation: {e}");
        }
    }

    fn writable_blocks(
        &self,
        key: ReservationKey,
        sender: &str,
    ) -> Result<Option<Range<usize>>, TransferError> {
        let Some(r) = self.keys.get(&key).and_then(|id| self.reservations.get(id)) else {
            return Ok(None);
        };
        match &r.holder {
            Some((_, holder)) if holder == sender => {
                Ok(Some(r.kv.cached_blocks..r.kv.blocks.len()))
            }
            _ => Err(TransferError::Forbidden(format!(
                "the reservation was not made for prefill worker {sender:?}"
            ))),
        }
    }

    fn write_kv(
        &mut self,
        key: ReservationKey,
        layer: usize,
        blocks: Range<usize>,
        payload: &[u8],
    ) -> Result<(), TransferError> {
        let r = self
            .keys
            .get(&key)
            .and_then(|id| self.reservations.get(id))
            .map(|r| &r.kv)
            .ok_or_else(|| {
                TransferError::ReservationGone("the reservation expired or was cancelled".into())
            })?;
        // Cached blocks hold prefix KV other requests share: never written by a transfer.
        if blocks.start < r.cached_blocks {
            return Err(TransferError::Forbidden(format!(
                "KV chunk for blocks {blocks:?}, but blocks before {} of the reservation hold cached KV",
                r.cached_blocks
            )));
        }
        // The engine checks each block's size against its cache; here, the range and the split.
        if blocks.is_empty()
            || blocks.end > r.blocks.len()
            || layer >= self.layout.num_layers
            || !payload.len().is_multiple_of(blocks.len())
        {
            return Err(TransferError::Malformed(format!(
                "KV chunk for layer {layer} blocks {blocks:?} with {} bytes does not fit a reservation of {} blocks",
                payload.len(),
                r.blocks.len()
            )));
        }
        if payload.is_empty() {
            return Ok(()); // copied in place by the transport (cuda-ipc): only the checks
        }
        let block_bytes = payload.len() / blocks.len();
        for (chunk, &block) in payload.chunks(block_bytes).zip(&r.blocks[blocks]) {
            self.engine
                .write_kv_block(layer, block, chunk)
                .map_err(|e| TransferError::Malformed(e.to_string()))?;
        }
        Ok(())
    }

    fn activate(&mut self, request: Request, first: Sampled) {
        let id = request.id;
        let Some(reserved) = self.reservations.remove(&id) else {
            let _ = request
                .events
                .send(Event::Failed(WorkerError::NotFound(format!(
                    "reservation {id} expired before its KV arrived"
                ))));
            return;
        };
        if let Some((key, _)) = reserved.holder {
            self.keys.remove(&key);
        }
        let added = self.engine.add_prefilled(
            request.prompt,
            reserved.kv,
            first,
            request.params,
            request.grammar,
            request.stop,
        );
        match added {
            Ok((seq, out)) => {
                self.note_failure(id, &out);
                let done = out.finish.is_some();
                let delivered = request.events.send(Event::Output(out)).is_ok();
                if done || !delivered {
                    self.remove_sequence(seq);
                    return;
                }
                self.insert(
                    seq,
                    Admitted {
                        id,
                        events: request.events,
                        shipping: None,
                        remaining: 0,
                        scheduled: true,
                    },
                );
            }
            Err(e) => {
                let _ = request.events.send(Event::Failed(e.into()));
            }
        }
    }

    fn fence(&mut self, id: RequestId, until: Instant) {
        let Some(r) = self.reservations.get(&id) else {
            return; // nothing left to write into
        };
        match self.engine.fence(&r.kv) {
            Ok(fence) => self.fences.push((id, until, fence)),
            Err(e) => tracing::error!(request = id, "fencing a KV reservation: {e}"),
        }
    }

    /// Lifts the fences `which` picks.
    fn lift_fences(&mut self, which: impl Fn(&(RequestId, Instant, E::Fence)) -> bool) {
        let (lifted, kept) = std::mem::take(&mut self.fences)
            .into_iter()
            .partition(which);
        self.fences = kept;
        for (id, _, fence) in lifted {
            if let Err(e) = self.engine.lift_fence(fence) {
                tracing::error!(request = id, "lifting a KV fence: {e}");
            }
        }
    }

    fn expire_leases(&mut self, now: Instant) {
        self.lift_fences(|&(_, until, _)| until <= now);
        let expired: Vec<RequestId> = self
            .reservations
            .iter()
            .filter(|(_, r)| r.expires <= now)
            .map(|(&id, _)| id)
            .collect();
        for id in expired {
            tracing::warn!(
                request = id,
                "KV reservation expired before its transfer completed; blocks reclaimed"
            );
            self.release_reservation(id);
        }
    }

    /// Takes a request out of the engine without answering it.
    fn remove(&mut self, seq: SeqId) -> Option<Admitted> {
        let a = self.admitted.remove(&seq)?;
        self.by_id.remove(&a.id);
        self.counters.unqueue(a.remaining);
        self.remove_sequence(seq);
        Some(a)
    }

    fn remove_sequence(&mut self, seq: SeqId) {
        if let Err(e) = self.engine.remove_sequence(seq) {
            tracing::error!(seq, "removing a sequence: {e}");
        }
    }

    fn fail(&mut self, seq: SeqId, e: WorkerError) {
        if let Some(a) = self.remove(seq) {
            let _ = a.events.send(Event::Failed(e));
        }
    }

    fn step(&mut self, now: Instant) {
        let (num_layers, block_size) = (self.layout.num_layers, self.layout.block_size);
        // Only prefill requests need every layer; the others are accounted for once a step.
        let shipping = self.admitted.values().any(|a| a.shipping.is_some());
        let admitted = &mut self.admitted;
        let counters = &self.counters;
        let mut prompt_tokens = 0;
        let mut step_tokens = 0;
        let mut on_layer = |done: &dyn LayerKv| {
            let last_layer = done.layer() + 1 == num_layers;
            if !last_layer && !shipping {
                return;
            }
            if last_layer {
                step_tokens = done.plan().iter().map(PlannedSeq::rows).sum();
            }
            for p in done.plan() {
                let Some(a) = admitted.get_mut(&p.seq) else {
                    continue;
                };
                if !a.scheduled {
                    a.scheduled = true;
                    let _ = a.events.send(Event::Scheduled(now));
                }
                if let Some(s) = a.shipping.as_mut() {
                    s.ship(p, done, block_size, last_layer);
                }
                if last_layer {
                    let computed = p.len.min(a.remaining);
                    a.remaining -= computed;
                    prompt_tokens += computed;
                    counters.unqueue(computed);
                }
            }
        };
        let started = Instant::now();
        let outputs = match self.engine.step_with(&mut on_layer) {
            Ok(outputs) => outputs,
            Err(e) => return self.step_failed(e),
        };
        self.prefill_rate.measured(prompt_tokens, started.elapsed());
        // The cost model weighs loading a block from a tier against computing it at this rate.
        self.engine
            .set_prefill_rate(self.prefill_rate.tokens_per_s());
        self.counters
            .step_seconds
            .observe(started.elapsed().as_secs_f64());
        self.counters.step_tokens.observe(step_tokens as f64);
        let mut deliveries = Vec::with_capacity(outputs.len());
        for out in outputs {
            let Some(a) = self.admitted.get(&out.seq) else {
                continue;
            };
            self.note_failure(a.id, &out);
            // A prefill request ends with its first token; others at their finish, or when
            // their caller has gone.
            if out.finish.is_some() || a.shipping.is_some() || a.events.is_closed() {
                let a = self.remove(out.seq).expect("admitted");
                deliveries.push((Delivery::Last(a), out));
            } else {
                deliveries.push((Delivery::Next(a.events.clone()), out));
            }
        }
        // Publish first, so a caller reading `Stats` after its answer sees this step's effect.
        self.publish();
        for (delivery, out) in deliveries {
            match delivery {
                Delivery::Next(events) => {
                    let _ = events.send(Event::Output(out));
                }
                Delivery::Last(mut a) => {
                    if let Some(s) = a.shipping.as_mut() {
                        s.sender.finish();
                    }
                    let _ = a.events.send(Event::Output(out));
                }
            }
        }
    }

    /// A request whose generation failed part way (its grammar could not go on) ends with
    /// finish_reason error and the reason: counted and logged here.
    fn note_failure(&self, id: RequestId, out: &StepOutput) {
        if let Some(error) = out.error.as_deref() {
            Counters::add(&self.counters.grammar_failures, 1);
            tracing::warn!(
                request = id,
                error,
                "the request's grammar failed part way; it ends with finish_reason error"
            );
        }
    }

    fn step_failed(&mut self, e: EngineError) {
        if matches!(e, EngineError::Kv(duet_kv::KvError::Exhausted { .. })) {
            // Admitted prompts hold their blocks chunk by chunk; when the oldest cannot go on,
            // give up the newest so the others can finish.
            if let Some(&newest) = self.admitted.keys().next_back() {
                tracing::warn!(seq = newest, "KV cache full; failing the newest request");
                self.fail(
                    newest,
                    WorkerError::ResourceExhausted(format!("the KV cache is full ({e})")),
                );
            }
            return;
        }
        // A step that cannot run fails every request rather than spinning.
        tracing::error!("step failed: {e}");
        let message = e.to_string();
        for seq in self.admitted.keys().copied().collect::<Vec<_>>() {
            self.fail(seq, WorkerError::Internal(message.clone()));
        }
    }

    fn publish(&mut self) {
        let (events, digest) = self.engine.take_kv_events();
        self.kv_events.append(events, digest);
        let scheduled = self.admitted.values().filter(|a| a.scheduled).count();
        self.published.set(Snapshot {
            pool: self.engine.pool_stats(),
            waiting: self.admitted.len() - scheduled,
            running: scheduled,
            reservations: self.reservations.len(),
            prefill_tokens_per_s: self.prefill_rate.tokens_per_s(),
            preemptions: self.engine.preemptions(),
            out_of_vocab_drafts: self.engine.out_of_vocab_drafts(),
            speculation: self.engine.speculation_totals(),
            kv_tiers: self.engine.kv_tier_stats(),
        });
    }
}

/// Where a step's output goes.
enum Delivery {
    Next(UnboundedSender<Event>),
    Last(Admitted),
}

#[cfg(test)]
mod tests;
