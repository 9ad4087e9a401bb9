//! The services' handle on the engine thread: the one way in.

use std::future::Future;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use duet_device::{LoadedEngine, WithEngine};
use duet_engine::backend::Backend;
use duet_engine::engine::{Engine, EngineOptions};
use duet_engine::grammars::Grammars;
use duet_model::grammar::Grammar;
use duet_model::params::{PromptLimits, SamplingParams};
use duet_transfer::{KvSink, KvWire, ReservationKey, TransferError};
use tokio::sync::oneshot;

use crate::actor::{Actor, Command};
use crate::kv_events::KvEventLog;
use crate::stats::{Counters, Published, Snapshot};
use crate::{Request, RequestId, WorkerError};

/// Facts about the loaded model that requests are checked against.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    /// Fingerprint and KV geometry (`layout.num_blocks` is this worker's capacity).
    pub wire: KvWire,
    pub vocab_size: usize,
    pub context_length: usize,
    /// This engine's KV store offered for CUDA IPC (`KvDestination.transport_params` of a
    /// decode worker on a GPU: [`duet_transfer::choice::IpcOffer`], encoded), or why there is
    /// none (a CPU engine, a build without CUDA, a failed `cuIpcGetMemHandle`).
    pub kv_ipc_offer: Result<Vec<u8>, String>,
}

impl EngineInfo {
    /// What a prompt must fit.
    pub fn prompt_limits(&self) -> PromptLimits {
        PromptLimits {
            context_length: self.context_length,
            vocab_size: self.vocab_size,
        }
    }
}

/// A handle on the engine thread; cheap to clone. The thread ends once every handle is dropped
/// and nothing is left to compute.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    info: Arc<EngineInfo>,
    counters: Arc<Counters>,
    published: Arc<Published>,
    kv_events: Arc<KvEventLog>,
    next_id: Arc<AtomicU64>,
    grammars: Grammars,
    /// Longest constraint [`compile`](Self::compile) takes, in bytes.
    max_constraint_bytes: usize,
}

/// What the engine thread hands back once the model is loaded.
struct Loaded {
    info: EngineInfo,
    counters: Arc<Counters>,
    published: Arc<Published>,
    kv_events: Arc<KvEventLog>,
    grammars: Grammars,
}

type Ready = anyhow::Result<Loaded>;

impl EngineHandle {
    /// Loads `model` on a new engine thread named `thread_name` and starts its actor; KV
    /// reservations are held for `reservation_lease` at most, and constraints of more than
    /// `max_constraint_bytes` are refused.
    pub async fn spawn(
        thread_name: &str,
        model: PathBuf,
        options: EngineOptions,
        reservation_lease: Duration,
        max_constraint_bytes: usize,
    ) -> anyhow::Result<Self> {
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = oneshot::channel::<Ready>();
        std::thread::Builder::new().name(thread_name.into()).spawn(
            move || match LoadedEngine::load(&model, options) {
                Ok(engine) => engine.run(Start {
                    commands: rx,
                    ready: ready_tx,
                    lease: reservation_lease,
                }),
                Err(e) => {
                    let _ = ready_tx.send(Err(anyhow::anyhow!(
                        "loading model {}: {e}",
                        model.display()
                    )));
                }
            },
        )?;
        let loaded = ready_rx
            .await
            .map_err(|_| anyhow::anyhow!("the engine thread died while loading the model"))??;
        Ok(Self {
            tx,
            info: Arc::new(loaded.info),
            counters: loaded.counters,
            published: loaded.published,
            kv_events: loaded.kv_events,
            next_id: Arc::new(AtomicU64::new(1)),
            grammars: loaded.grammars,
            max_constraint_bytes,
        })
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// The engine thread's state after its last turn (never waits for a step).
    pub fn snapshot(&self) -> Snapshot {
        self.published.get()
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// The engine's prefix-cache events (what `KvEvents/Subscribe` serves).
    pub fn kv_events(&self) -> &Arc<KvEventLog> {
        &self.kv_events
    }

    pub(crate) fn shared(&self) -> (Arc<Counters>, Arc<Published>) {
        (self.counters.clone(), self.published.clone())
    }

    /// A fresh request id.
    pub fn next_id(&self) -> RequestId {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Compiles a request's constraint (`None` without one) for [`Request::grammar`], on a
    /// blocking thread of the runtime: never on the engine thread, where a slow compile would
    /// stall every running sequence. A constraint past `--max-constraint-bytes`, or one that
    /// does not compile, is INVALID_ARGUMENT.
    pub async fn compile(&self, params: &SamplingParams) -> Result<Option<Grammar>, WorkerError> {
        let Some(constraint) = params.constraint.clone() else {
            return Ok(None);
        };
        let (len, max) = (constraint.text_bytes(), self.max_constraint_bytes);
        if len > max {
            return Err(WorkerError::InvalidArgument(format!(
                "constraint too long: {len} bytes, past this worker's limit of {max} bytes \
                 (--max-constraint-bytes)"
            )));
        }
        let grammars = self.grammars.clone();
        let compiled = tokio::task::spawn_blocking(move || grammars.compile(&constraint))
            .await
            .map_err(|e| WorkerError::Internal(format!("compiling the constraint: {e}")))?;
        compiled
            .map(Some)
            .map_err(|e| WorkerError::InvalidArgument(e.to_string()))
    }

    /// Hands a command to the engine thread; fails once it has stopped.
    pub fn send(&self, cmd: Command) -> Result<(), WorkerError> {
        self.tx.send(cmd).map_err(|_| WorkerError::EngineStopped)
    }

    /// Sends a command built around a reply channel and awaits the reply.
    pub async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, WorkerError> {
        self.request(make)?
            .await
            .map_err(|_| WorkerError::EngineStopped)
    }

    /// Sends a command built around a reply channel without waiting: commands sent this way
    /// are all handled at the engine thread's next pause between steps, not one per step.
    pub fn request<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<oneshot::Receiver<T>, WorkerError> {
        let (tx, rx) = oneshot::channel();
        self.send(make(tx))?;
        Ok(rx)
    }

    /// Admits `request`: counts its prompt as queued, refusing at once (RESOURCE_EXHAUSTED)
    /// when that would pass `max_queued_tokens`, and hands it to the engine thread.
    pub fn submit(&self, request: Request, max_queued_tokens: u64) -> Result<(), WorkerError> {
        let n = request.prompt.len() as u64;
        enqueue_tokens(&self.counters.queued_tokens, n, max_queued_tokens)?;
        self.send(Command::Submit(request)).inspect_err(|_| {
            self.counters.unqueue(n as usize);
        })
    }

    /// A guard that cancels request `id` when dropped.
    pub fn cancel_on_drop(&self, id: RequestId) -> CancelOnDrop {
        CancelOnDrop {
            tx: self.tx.clone(),
            id,
            armed: true,
        }
    }
}

/// Counts `n` more queued prompt tokens, or refuses when that would pass `max`; a request
/// arriving at an empty queue is always taken.
fn enqueue_tokens(queued: &AtomicU64, n: u64, max: u64) -> Result<(), WorkerError> {
    let before = queued.fetch_add(n, Ordering::Relaxed);
    if before > 0 && before + n > max {
        queued.fetch_sub(n, Ordering::Relaxed);
        return Err(WorkerError::ResourceExhausted(format!(
            "the queue holds {before} prompt tokens; {n} more would pass its limit of {max}"
        )));
    }
    Ok(())
}

/// Cancels a request on the engine thread when the call serving it ends early (the caller
/// went away, the deadline passed, a push failed).
pub struct CancelOnDrop {
    tx: mpsc::Sender<Command>,
    id: RequestId,
    armed: bool,
}

impl CancelOnDrop {
    /// The request ended by itself: nothing to cancel.
    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.tx.send(Command::Cancel(self.id));
        }
    }
}

/// The engine thread's body once the model is loaded, whatever its backend.
struct Start {
    commands: mpsc::Receiver<Command>,
    ready: oneshot::Sender<Ready>,
    lease: Duration,
}

impl WithEngine for Start {
    type Output = ();

    fn run<B: Backend + 'static>(self, engine: Engine<B>) {
        let info = EngineInfo {
            wire: KvWire {
                fingerprint: engine.fingerprint().to_string(),
                layout: engine.kv_layout(),
            },
            vocab_size: engine.config().vocab_size,
            context_length: engine.config().max_position_embeddings,
            kv_ipc_offer: duet_transfer::choice::ipc_offer(engine.kv_store()),
        };
        let grammars = engine.grammars().clone();
        let actor = Actor::new(engine, self.lease);
        let (counters, published, kv_events) = actor.shared();
        let loaded = Loaded {
            info,
            counters,
            published,
            kv_events,
            grammars,
        };
        if self.ready.send(Ok(loaded)).is_ok() {
            actor.run(self.commands);
        }
    }
}

fn stopped<T>(_: T) -> TransferError {
    TransferError::Unavailable("the engine thread has stopped".into())
}

/// A decode worker's reservations, as a transport fills them.
impl KvSink for EngineHandle {
    async fn writable_blocks(
        &self,
        key: ReservationKey,
        sender: &str,
    ) -> Result<Option<Range<usize>>, TransferError> {
        let sender = sender.to_string();
        self.ask(|reply| Command::WritableBlocks { key, sender, reply })
            .await
            .map_err(stopped)?
    }

    fn write(
        &self,
        key: ReservationKey,
        layer: usize,
        blocks: Range<usize>,
        payload: Vec<u8>,
    ) -> Result<impl Future<Output = Result<(), TransferError>> + Send + 'static, TransferError>
    {
        let reply = self
            .request(|reply| Command::WriteKv {
                key,
                layer,
                blocks,
                payload,
                reply,
            })
            .map_err(stopped)?;
        Ok(async move { reply.await.map_err(stopped)? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_limit() {
        let q = AtomicU64::new(0);
        enqueue_tokens(&q, 100, 50).unwrap(); // an empty queue takes anything
        let e = enqueue_tokens(&q, 1, 50).unwrap_err();
        assert_eq!(
            tonic::Status::from(e).code(),
            tonic::Code::ResourceExhausted
        );
        assert_eq!(q.load(Ordering::Relaxed), 100);
        q.store(20, Ordering::Relaxed);
        enqueue_tokens(&q, 30, 50).unwrap();
        assert!(enqueue_tokens(&q, 1, 50).is_err());
        assert_eq!(q.load(Ordering::Relaxed), 50);
    }
}
