//! The engine thread: iteration-level continuous batching over one [`Engine`].
//!
//! Everything that touches the engine (KV reservations, KV written by transfers, admitting
//! sequences, the batched forward steps, cancellation) is a [`Command`] processed here in order,
//! between steps, so a running batch never waits on the network. Requests get their tokens back
//! through their own [`Event`] channel.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use duet_device::{LoadedEngine, WithEngine};
use duet_engine::backend::Backend;
use duet_engine::engine::{Engine, KvReservation, Resumed, SeqId, StepOutput};
use duet_kv::PoolStats;
use duet_model::params::StopCriteria;
use duet_model::params::{Sampled, SamplingParams};
use tokio::sync::{mpsc, oneshot};

use crate::error::DecodeError;

/// A request's id on this worker; also the id of its KV reservation.
pub type JobId = u64;

/// What a request receives from the engine thread.
#[derive(Debug)]
pub enum Event {
    /// A prompt prefilled here was admitted; this many of its tokens came from the prefix cache.
    PrefixHit(usize),
    Output(StepOutput),
    Failed(DecodeError),
}

/// The blocks of a reservation, as a prefill worker needs them.
#[derive(Clone, Debug)]
pub struct ReservationInfo {
    pub block_ids: Vec<u32>,
    pub cached_blocks: usize,
}

/// A snapshot for `WorkerControl/Stats`.
#[derive(Clone, Debug)]
pub struct SchedulerStats {
    pub pool: PoolStats,
    pub running: usize,
    pub reservations: usize,
    pub waiting: usize,
}

pub struct Generation {
    pub prompt: Vec<u32>,
    /// Set when resuming a request another decode worker started (failover).
    pub resumed: Resumed,
    /// Per-tenant prefix-cache namespace (empty: shared).
    pub cache_salt: String,
    pub params: SamplingParams,
    pub stop: StopCriteria,
    pub events: mpsc::UnboundedSender<Event>,
}

pub enum Command {
    /// Hold KV blocks for a prompt that a prefill worker will compute.
    Reserve {
        job: JobId,
        tokens: Vec<u32>,
        cache_salt: String,
        reply: oneshot::Sender<Result<ReservationInfo, DecodeError>>,
    },
    /// Number of blocks of a live reservation (a transfer checks its header against it).
    ReservationBlocks {
        job: JobId,
        reply: oneshot::Sender<Option<usize>>,
    },
    /// KV of blocks `start..end` (indices into the reservation) of one layer.
    WriteKv {
        job: JobId,
        layer: usize,
        start: usize,
        end: usize,
        payload: Vec<u8>,
        reply: oneshot::Sender<Result<(), DecodeError>>,
    },
    /// The reservation's KV is complete: start generating after the prefill's first token.
    Activate {
        job: JobId,
        first: Sampled,
        generation: Generation,
    },
    /// Prefill here (no reservation needed, or remote prefill failed).
    Local { job: JobId, generation: Generation },
    /// The request is gone (client cancelled, failed): free whatever it holds.
    Cancel { job: JobId },
    Stats {
        reply: oneshot::Sender<SchedulerStats>,
    },
}

struct Running {
    seq: SeqId,
    events: mpsc::UnboundedSender<Event>,
}

pub struct Scheduler<B: Backend> {
    engine: Engine<B>,
    commands: Receiver<Command>,
    lease: Duration,
    reservations: HashMap<JobId, (KvReservation, Instant)>,
    running: HashMap<JobId, Running>,
    by_seq: HashMap<SeqId, JobId>,
}

impl<B: Backend> Scheduler<B> {
    pub fn new(engine: Engine<B>, commands: Receiver<Command>, lease: Duration) -> Self {
        Self {
            engine,
            commands,
            lease,
            reservations: HashMap::new(),
            running: HashMap::new(),
            by_seq: HashMap::new(),
        }
    }

    /// Runs until every command sender is gone.
    pub fn run(mut self) {
        loop {
            // Block for work only when nothing runs; otherwise take what arrived and step.
            if self.engine.has_work() {
                while let Ok(cmd) = self.commands.try_recv() {
                    self.handle(cmd);
                }
            } else {
                match self.commands.recv_timeout(Duration::from_millis(100)) {
                    Ok(cmd) => {
                        self.handle(cmd);
                        while let Ok(cmd) = self.commands.try_recv() {
                            self.handle(cmd);
                        }
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            self.expire_leases();
            if self.engine.has_work() {
                self.step();
            }
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Reserve {
                job,
                tokens,
                cache_salt,
                reply,
            } => {
                let r = self
                    .engine
                    .reserve(&tokens, &cache_salt)
                    .map_err(DecodeError::from)
                    .map(|r| {
                        let info = ReservationInfo {
                            block_ids: r.blocks.clone(),
                            cached_blocks: r.cached_blocks,
                        };
                        self.reservations
                            .insert(job, (r, Instant::now() + self.lease));
                        info
                    });
                let _ = reply.send(r);
            }
            Command::ReservationBlocks { job, reply } => {
                let _ = reply.send(self.reservations.get(&job).map(|(r, _)| r.blocks.len()));
            }
            Command::WriteKv {
                job,
                layer,
                start,
                end,
                payload,
                reply,
            } => {
                let _ = reply.send(self.write_kv(job, layer, start, end, &payload));
            }
            Command::Activate {
                job,
                first,
                generation,
            } => {
                let Some((reservation, _)) = self.reservations.remove(&job) else {
                    let _ = generation
                        .events
                        .send(Event::Failed(DecodeError::NotFound(format!(
                            "reservation {job} expired before its KV arrived"
                        ))));
                    return;
                };
                let Generation {
                    prompt,
                    params,
                    stop,
                    events,
                    ..
                } = generation;
                match self
                    .engine
                    .add_prefilled(prompt, reservation, first, params, stop)
                {
                    Ok((seq, out)) => self.admitted(job, seq, events, Some(out)),
                    Err(e) => {
                        let _ = events.send(Event::Failed(e.into()));
                    }
                }
            }
            Command::Local { job, generation } => {
                if let Some((r, _)) = self.reservations.remove(&job) {
                    let _ = self.engine.release(r);
                }
                let Generation {
                    prompt,
                    resumed,
                    cache_salt,
                    params,
                    stop,
                    events,
                } = generation;
                match self
                    .engine
                    .resume_sequence(prompt, resumed, &cache_salt, params, stop)
                {
                    Ok(seq) => {
                        let cached = self.engine.cached_prompt_tokens(seq).unwrap_or(0);
                        let _ = events.send(Event::PrefixHit(cached));
                        self.admitted(job, seq, events, None)
                    }
                    Err(e) => {
                        let _ = events.send(Event::Failed(e.into()));
                    }
                }
            }
            Command::Cancel { job } => {
                if let Some((r, _)) = self.reservations.remove(&job) {
                    let _ = self.engine.release(r);
                }
                if let Some(run) = self.running.remove(&job) {
                    self.by_seq.remove(&run.seq);
                    let _ = self.engine.remove_sequence(run.seq);
                }
            }
            Command::Stats { reply } => {
                let _ = reply.send(SchedulerStats {
                    pool: self.engine.block_pool().stats(),
                    running: self.running.len(),
                    reservations: self.reservations.len(),
                    waiting: 0,
                });
            }
        }
    }

    fn admitted(
        &mut self,
        job: JobId,
        seq: SeqId,
        events: mpsc::UnboundedSender<Event>,
        first: Option<StepOutput>,
    ) {
        if let Some(out) = first {
            let done = out.finish.is_some();
            let _ = events.send(Event::Output(out));
            if done {
                let _ = self.engine.remove_sequence(seq);
                return;
            }
        }
        self.by_seq.insert(seq, job);
        self.running.insert(job, Running { seq, events });
    }

    fn write_kv(
        &mut self,
        job: JobId,
        layer: usize,
        start: usize,
        end: usize,
        payload: &[u8],
    ) -> Result<(), DecodeError> {
        let (r, _) = self.reservations.get(&job).ok_or_else(|| {
            DecodeError::NotFound(format!("no reservation {job} (expired or cancelled)"))
        })?;
        let block_bytes = self.engine.kv_block_bytes();
        if start >= end || end > r.blocks.len() || payload.len() != (end - start) * block_bytes {
            return Err(DecodeError::InvalidArgument(format!(
                "KV chunk for blocks {start}..{end} with {} bytes does not fit a reservation of {} blocks of {block_bytes} bytes",
                payload.len(),
                r.blocks.len()
            )));
        }
        let blocks: Vec<u32> = r.blocks[start..end].to_vec();
        for (i, block) in blocks.into_iter().enumerate() {
            self.engine
                .write_kv_block(
                    layer,
                    block,
                    &payload[i * block_bytes..(i + 1) * block_bytes],
                )
                .map_err(|e| DecodeError::InvalidArgument(e.to_string()))?;
        }
        Ok(())
    }

    fn expire_leases(&mut self) {
        let now = Instant::now();
        let expired: Vec<JobId> = self
            .reservations
            .iter()
            .filter(|(_, (_, t))| *t <= now)
            .map(|(&j, _)| j)
            .collect();
        for job in expired {
            if let Some((r, _)) = self.reservations.remove(&job) {
                tracing::warn!(
                    job,
                    "KV reservation expired before its transfer completed; blocks reclaimed"
                );
                let _ = self.engine.release(r);
            }
        }
    }

    fn step(&mut self) {
        match self.engine.step() {
            Ok(outputs) => {
                for out in outputs {
                    let Some(&job) = self.by_seq.get(&out.seq) else {
                        continue;
                    };
                    let done = out.finish.is_some();
                    let seq = out.seq;
                    let delivered = self.running[&job].events.send(Event::Output(out)).is_ok();
                    if done || !delivered {
                        self.running.remove(&job);
                        self.by_seq.remove(&seq);
                        let _ = self.engine.remove_sequence(seq);
                    }
                }
            }
            Err(e) => {
                // A step that cannot run fails every running request rather than spinning.
                tracing::error!(error = %e, "decode step failed");
                for (_, run) in self.running.drain() {
                    let _ = run
                        .events
                        .send(Event::Failed(DecodeError::Internal(e.to_string())));
                    let _ = self.engine.remove_sequence(run.seq);
                }
                self.by_seq.clear();
            }
        }
    }
}

/// The engine thread's body, whatever the engine's backend.
struct RunScheduler {
    commands: Receiver<Command>,
    lease: Duration,
}

impl WithEngine for RunScheduler {
    type Output = ();

    fn run<B: Backend + 'static>(self, engine: Engine<B>) {
        Scheduler::new(engine, self.commands, self.lease).run()
    }
}

/// A handle to the engine thread.
#[derive(Clone)]
pub struct SchedulerHandle {
    tx: Sender<Command>,
}

impl SchedulerHandle {
    pub fn spawn(engine: LoadedEngine, lease: Duration) -> Self {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("duet-decode-engine".into())
            .spawn(move || {
                engine.run(RunScheduler {
                    commands: rx,
                    lease,
                })
            })
            .expect("spawning the engine thread");
        Self { tx }
    }

    pub fn send(&self, cmd: Command) -> Result<(), DecodeError> {
        self.tx
            .send(cmd)
            .map_err(|_| DecodeError::Unavailable("the engine thread has stopped".into()))
    }

    /// Sends a command built around a reply channel and awaits the reply.
    pub async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, DecodeError> {
        Self::reply(self.request(make)?).await
    }

    /// Sends a command built around a reply channel without waiting: commands sent this way are
    /// all handled at the engine thread's next pause between steps, not one per step.
    pub fn request<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<oneshot::Receiver<T>, DecodeError> {
        let (tx, rx) = oneshot::channel();
        self.send(make(tx))?;
        Ok(rx)
    }

    /// The reply to a [`SchedulerHandle::request`].
    pub async fn reply<T>(rx: oneshot::Receiver<T>) -> Result<T, DecodeError> {
        rx.await
            .map_err(|_| DecodeError::Unavailable("the engine thread has stopped".into()))
    }
}
