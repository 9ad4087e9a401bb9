//! The engine thread: the one place the model runs.
//!
//! Prefill is compute-bound, so the [`Engine`] lives on a dedicated OS thread and never on the
//! tokio runtime. Requests arrive as [`Command`]s over a channel, each with a oneshot for its
//! reply. The loop drains new commands, admits prompts into the engine (which reuses cached
//! prefix blocks), and runs steps: the engine batches every admitted prompt up to the step token
//! budget (`max_step_tokens`) and chunks long ones. A layer hook ships each layer's finished KV
//! blocks to the request's push task while the later layers still compute. After the step that
//! samples a request's first token, the request is answered and its sequence removed (its full
//! blocks stay in the prefix cache, LRU). With nothing to do the thread blocks on the channel.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use duet_device::{LoadedEngine, WithEngine};
use duet_engine::backend::{Backend, KvDtype};
use duet_engine::engine::{Engine, EngineOptions, LayerDone, PlannedSeq, Resumed, SeqId};
use duet_kv::PoolStats;
use duet_model::params::StopCriteria;
use duet_model::params::{Sampled, SamplingParams};
use duet_proto::v1::KvData;
use tokio::sync::{mpsc as tokio_mpsc, oneshot};

use crate::error::PrefillError;

/// Largest `KvData` payload we build (whole blocks; a single block larger than this is sent
/// alone).
pub const MAX_CHUNK_BYTES: usize = 1 << 20;

/// What the engine thread hands a request's push task.
#[derive(Debug)]
pub enum PushMsg {
    /// KV of a range of blocks of one layer.
    Data(KvData),
    /// Every block has been sent: the push may finish with `KvDone`.
    Finish,
}

/// Facts about the loaded model that requests are checked against.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    pub fingerprint: String,
    pub block_size: usize,
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    /// KV cache capacity in blocks.
    pub num_blocks: usize,
    /// Bytes of one (layer, block) of KV in transfer layout.
    pub kv_block_bytes: usize,
    /// Element type of the KV values pushed.
    pub kv_dtype: KvDtype,
}

/// A prompt to prefill, as the engine thread receives it.
pub struct PrefillJob {
    /// Chosen by the service; [`Command::Cancel`] names it.
    pub id: u64,
    pub tokens: Vec<u32>,
    /// Per-tenant prefix-cache namespace (empty: shared).
    pub cache_salt: String,
    pub params: SamplingParams,
    /// Index of the first reservation block to send (`KvDestination.cached_blocks`).
    pub first_block: usize,
    /// Where the KV chunks go.
    pub kv_tx: tokio_mpsc::UnboundedSender<PushMsg>,
    pub reply: oneshot::Sender<Result<Prefilled, PrefillError>>,
    /// When the worker received the request.
    pub received: Instant,
}

/// The engine's answer for one request.
#[derive(Debug)]
pub struct Prefilled {
    pub first: Sampled,
    /// Prompt tokens found in this worker's prefix cache.
    pub cached_tokens: usize,
    /// From receiving the request to its first step.
    pub queue: Duration,
    /// From its first step to the end of the step that sampled the first token.
    pub compute: Duration,
    /// When the last step of the request ended (all KV handed to the push task).
    pub computed_at: Instant,
}

/// Messages to the engine thread.
pub enum Command {
    Prefill(PrefillJob),
    /// Drops a request (its caller went away): its sequence is removed and its blocks freed.
    /// Unknown ids (already answered) are ignored.
    Cancel(u64),
}

/// Engine state published for `Stats` after every loop turn.
#[derive(Clone, Copy, Debug)]
pub struct Snapshot {
    pub pool: PoolStats,
    /// Admitted requests not yet in any step.
    pub waiting: usize,
    /// Requests with at least one prompt chunk computed.
    pub running: usize,
}

/// Counters and gauges shared between the service and the engine thread.
#[derive(Debug)]
pub struct WorkerState {
    /// Prompt tokens admitted but not computed yet (the service adds, the engine subtracts).
    pub queued_tokens: AtomicU64,
    pub requests_served: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub prefix_hit_tokens: AtomicU64,
    pub transfer_bytes_out: AtomicU64,
    pub snapshot: Mutex<Snapshot>,
}

impl WorkerState {
    fn new(pool: PoolStats) -> Self {
        Self {
            queued_tokens: AtomicU64::new(0),
            requests_served: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            prefix_hit_tokens: AtomicU64::new(0),
            transfer_bytes_out: AtomicU64::new(0),
            snapshot: Mutex::new(Snapshot {
                pool,
                waiting: 0,
                running: 0,
            }),
        }
    }

    pub fn snapshot(&self) -> Snapshot {
        *self.snapshot.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn unqueue(&self, tokens: usize) {
        self.queued_tokens
            .fetch_sub(tokens as u64, Ordering::Relaxed);
    }
}

/// The service's handle on the engine thread.
#[derive(Clone)]
pub struct SchedulerHandle {
    tx: mpsc::Sender<Command>,
    pub info: Arc<EngineInfo>,
    pub state: Arc<WorkerState>,
}

impl SchedulerHandle {
    /// Hands a command to the engine thread; fails once it has stopped.
    pub fn send(&self, cmd: Command) -> Result<(), PrefillError> {
        self.tx.send(cmd).map_err(|_| PrefillError::EngineGone)
    }
}

/// Loads the model on a new engine thread and starts its loop. The thread ends when every
/// [`SchedulerHandle`] is dropped and no request is left.
pub async fn spawn(
    model: std::path::PathBuf,
    options: EngineOptions,
) -> anyhow::Result<SchedulerHandle> {
    let (tx, rx) = mpsc::channel();
    let (ready_tx, ready_rx) = oneshot::channel();
    std::thread::Builder::new()
        .name("prefill-engine".into())
        .spawn(move || {
            let engine = match LoadedEngine::load(&model, options) {
                Ok(e) => e,
                Err(e) => {
                    let _ = ready_tx.send(Err(anyhow::anyhow!(
                        "loading model {}: {e}",
                        model.display()
                    )));
                    return;
                }
            };
            engine.run(RunLoop { rx, ready_tx });
        })?;
    let (info, state) = ready_rx
        .await
        .map_err(|_| anyhow::anyhow!("the engine thread died while loading the model"))??;
    Ok(SchedulerHandle { tx, info, state })
}

/// The engine thread's body, whatever the engine's backend.
struct RunLoop {
    rx: mpsc::Receiver<Command>,
    ready_tx: oneshot::Sender<anyhow::Result<(Arc<EngineInfo>, Arc<WorkerState>)>>,
}

impl WithEngine for RunLoop {
    type Output = ();

    fn run<B: Backend + 'static>(self, engine: Engine<B>) {
        let info = Arc::new(engine_info(&engine));
        let state = Arc::new(WorkerState::new(engine.block_pool().stats()));
        let _ = self.ready_tx.send(Ok((info.clone(), state.clone())));
        EngineLoop::new(engine, info, state).run(self.rx);
    }
}

fn engine_info<B: Backend>(engine: &Engine<B>) -> EngineInfo {
    let c = engine.config();
    EngineInfo {
        fingerprint: engine.fingerprint().to_string(),
        block_size: engine.options().block_size,
        num_layers: c.num_layers,
        num_kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
        vocab_size: c.vocab_size,
        context_length: c.max_position_embeddings,
        num_blocks: engine.block_pool().num_blocks(),
        kv_block_bytes: engine.kv_block_bytes(),
        kv_dtype: engine.kv_layout().dtype,
    }
}

/// A request admitted into the engine.
struct Active {
    job_id: u64,
    num_tokens: usize,
    /// Blocks of the reservation (`ceil(num_tokens / block_size)`).
    num_blocks: usize,
    /// Next reservation block index to send; blocks before it went out for every layer.
    next_block: usize,
    /// Prompt tokens not computed yet (counted in `queued_tokens`).
    remaining: usize,
    started: Option<Instant>,
    received: Instant,
    kv_tx: tokio_mpsc::UnboundedSender<PushMsg>,
    reply: oneshot::Sender<Result<Prefilled, PrefillError>>,
}

struct EngineLoop<B: Backend> {
    engine: Engine<B>,
    info: Arc<EngineInfo>,
    state: Arc<WorkerState>,
    active: BTreeMap<SeqId, Active>,
    by_job: HashMap<u64, SeqId>,
}

impl<B: Backend> EngineLoop<B> {
    fn new(engine: Engine<B>, info: Arc<EngineInfo>, state: Arc<WorkerState>) -> Self {
        Self {
            engine,
            info,
            state,
            active: BTreeMap::new(),
            by_job: HashMap::new(),
        }
    }

    fn run(mut self, rx: mpsc::Receiver<Command>) {
        loop {
            if self.active.is_empty() {
                // Idle: sleep until a command arrives; all senders gone means shutdown.
                match rx.recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(_) => break,
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                self.handle(cmd);
            }
            if !self.active.is_empty() {
                self.step();
            }
            self.publish();
        }
        tracing::debug!("prefill engine thread stopped");
    }

    fn publish(&self) {
        let started = self.active.values().filter(|a| a.started.is_some()).count();
        let snap = Snapshot {
            pool: self.engine.block_pool().stats(),
            waiting: self.active.len() - started,
            running: started,
        };
        *self
            .state
            .snapshot
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = snap;
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Prefill(job) => self.admit(job),
            Command::Cancel(id) => {
                if let Some(seq) = self.by_job.remove(&id) {
                    tracing::debug!(job = id, "prefill cancelled");
                    self.drop_seq(seq);
                }
            }
        }
    }

    fn admit(&mut self, job: PrefillJob) {
        let n = job.tokens.len();
        if job.reply.is_closed() {
            self.state.unqueue(n); // cancelled while queued
            return;
        }
        // Two tokens, so the sequence still holds its blocks after the step that samples the
        // first one (one when the prompt leaves room for just one).
        let max_tokens = 2.min(self.info.context_length.saturating_sub(n)).max(1);
        let stop = StopCriteria {
            max_tokens,
            ignore_eos: true,
            ..StopCriteria::default()
        };
        let seq = match self.engine.resume_sequence(
            job.tokens,
            Resumed::default(),
            &job.cache_salt,
            job.params,
            stop,
        ) {
            Ok(seq) => seq,
            Err(e) => {
                self.state.unqueue(n);
                let _ = job.reply.send(Err(e.into()));
                return;
            }
        };
        let cached = self.engine.cached_prompt_tokens(seq).unwrap_or(0);
        self.state.unqueue(cached);
        self.by_job.insert(job.id, seq);
        self.active.insert(
            seq,
            Active {
                job_id: job.id,
                num_tokens: n,
                num_blocks: n.div_ceil(self.info.block_size),
                next_block: job.first_block,
                remaining: n - cached,
                started: None,
                received: job.received,
                kv_tx: job.kv_tx,
                reply: job.reply,
            },
        );
    }

    /// Removes a sequence without answering (dropping the reply and the push channel).
    fn drop_seq(&mut self, seq: SeqId) -> Option<Active> {
        let a = self.active.remove(&seq)?;
        self.by_job.remove(&a.job_id);
        self.state.unqueue(a.remaining);
        if let Err(e) = self.engine.remove_sequence(seq) {
            tracing::error!(seq, "removing a prefill sequence: {e}");
        }
        Some(a)
    }

    fn fail(&mut self, seq: SeqId, err: PrefillError) {
        if let Some(a) = self.drop_seq(seq) {
            let _ = a.reply.send(Err(err));
        }
    }

    fn step(&mut self) {
        if !self.engine.has_work() {
            // Cannot happen (answered sequences are removed at once); never spin on it.
            tracing::error!("prefill requests are active but the engine has no work");
            for seq in self.active.keys().copied().collect::<Vec<_>>() {
                self.fail(seq, PrefillError::EngineGone);
            }
            return;
        }
        let info = self.info.clone();
        let active = &mut self.active;
        let state = &self.state;
        let step_start = Instant::now();
        let mut hook = |done: &LayerDone<'_, B>| {
            let last_layer = done.layer + 1 == info.num_layers;
            for p in done.plan {
                let Some(a) = active.get_mut(&p.seq) else {
                    continue;
                };
                a.started.get_or_insert(step_start);
                let end = ship_layer(a, p, done, &info);
                if last_layer {
                    // Every layer of this step has been shipped: commit.
                    a.next_block = a.next_block.max(end);
                    let computed = p.len.min(a.remaining);
                    a.remaining -= computed;
                    state.unqueue(computed);
                }
            }
        };
        let outputs = match self.engine.step_with(&mut hook) {
            Ok(o) => o,
            Err(e) => return self.step_failed(e),
        };
        let now = Instant::now();
        let mut answers = Vec::new();
        for out in outputs {
            let Some(a) = self.active.remove(&out.seq) else {
                continue;
            };
            self.by_job.remove(&a.job_id);
            let cached = self.engine.cached_prompt_tokens(out.seq).unwrap_or(0);
            if let Err(e) = self.engine.remove_sequence(out.seq) {
                tracing::error!(seq = out.seq, "removing a prefilled sequence: {e}");
            }
            self.state.unqueue(a.remaining);
            self.state
                .prompt_tokens
                .fetch_add(a.num_tokens as u64, Ordering::Relaxed);
            self.state
                .prefix_hit_tokens
                .fetch_add(cached as u64, Ordering::Relaxed);
            let started = a.started.unwrap_or(now);
            let prefilled = Prefilled {
                first: out.token,
                cached_tokens: cached,
                queue: started.saturating_duration_since(a.received),
                compute: now.saturating_duration_since(started),
                computed_at: now,
            };
            answers.push((a.kv_tx, a.reply, prefilled));
        }
        // Publish first, so a caller reading `Stats` after its answer sees this step's effect.
        self.publish();
        for (kv_tx, reply, prefilled) in answers {
            let _ = kv_tx.send(PushMsg::Finish);
            let _ = reply.send(Ok(prefilled));
        }
    }

    fn step_failed(&mut self, e: duet_engine::EngineError) {
        let exhausted = matches!(
            e,
            duet_engine::EngineError::Kv(duet_kv::KvError::Exhausted { .. })
        );
        if exhausted {
            // Admitted prompts hold their blocks chunk by chunk; when the oldest cannot go on,
            // give up the newest so the others can finish.
            if let Some(&newest) = self.active.keys().next_back() {
                tracing::warn!(seq = newest, "KV cache full; dropping the newest prefill");
                self.fail(
                    newest,
                    PrefillError::ResourceExhausted(format!(
                        "the prefill worker's KV cache is full ({e})"
                    )),
                );
            }
            return;
        }
        tracing::error!("prefill step failed: {e}");
        let msg = e.to_string();
        for seq in self.active.keys().copied().collect::<Vec<_>>() {
            self.fail(
                seq,
                PrefillError::Engine(duet_engine::EngineError::InvalidBatch(msg.clone())),
            );
        }
    }
}

/// Sends this layer's KV of the blocks of `a` that this step completes (from `a.next_block`),
/// in chunks of at most [`MAX_CHUNK_BYTES`]. Returns the end of the block range.
fn ship_layer<B: Backend>(
    a: &Active,
    p: &PlannedSeq,
    done: &LayerDone<'_, B>,
    info: &EngineInfo,
) -> usize {
    let computed = p.start_pos + p.len;
    let end = if computed >= a.num_tokens {
        a.num_blocks // the last partial block goes out with the final chunk
    } else {
        computed / info.block_size
    };
    let start = a.next_block;
    if end <= start {
        return end;
    }
    let per_chunk = (MAX_CHUNK_BYTES / info.kv_block_bytes).max(1);
    let mut block_start = start;
    while block_start < end {
        let block_end = (block_start + per_chunk).min(end);
        let mut payload = Vec::with_capacity((block_end - block_start) * info.kv_block_bytes);
        for &phys in &p.block_table[block_start..block_end] {
            if done.append_kv_block(phys, &mut payload).is_err() {
                // The device failed; the step reports it and the request fails unsent.
                return start;
            }
        }
        let xxh3 = xxhash_rust::xxh3::xxh3_64(&payload);
        // A closed channel means the push was abandoned; the request is being cancelled.
        let _ = a.kv_tx.send(PushMsg::Data(KvData {
            layer: done.layer as u32,
            block_start: block_start as u32,
            block_end: block_end as u32,
            payload,
            xxh3,
        }));
        block_start = block_end;
    }
    end
}
