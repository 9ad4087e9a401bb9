//! The gRPC services of a prefill worker: `PrefillWorker/Prefill` (validate, queue on the engine
//! thread, push the KV, answer once the decode worker acknowledged) and `WorkerControl/Stats`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use duet_model::params::SamplingParams;
use duet_proto::v1::prefill_worker_server::PrefillWorker;
use duet_proto::v1::worker_control_server::WorkerControl;
use duet_proto::v1::{
    KvDestination, KvHeader, PrefillRequest, PrefillResponse, StatsRequest, StatsResponse,
    TokenLogprobs, TransportKind, WorkerRole,
};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tonic::{Request, Response, Status};

use crate::error::PrefillError;
use crate::kv_push::{self, Pushed};
use crate::scheduler::{Command, PrefillJob, Prefilled, SchedulerHandle};

/// Serves `PrefillWorker` and `WorkerControl`; cheap to clone.
#[derive(Clone)]
pub struct PrefillService {
    inner: Arc<Inner>,
}

struct Inner {
    scheduler: SchedulerHandle,
    channels: Arc<duet_proto::Channels>,
    worker_id: String,
    incarnation: u64,
    max_queued_tokens: u64,
    next_job: AtomicU64,
}

impl PrefillService {
    pub fn new(scheduler: SchedulerHandle, worker_id: String, max_queued_tokens: u64) -> Self {
        let incarnation = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        Self {
            inner: Arc::new(Inner {
                scheduler,
                channels: Arc::default(),
                worker_id,
                incarnation,
                max_queued_tokens,
                next_job: AtomicU64::new(0),
            }),
        }
    }

    /// The model fingerprint this worker serves.
    pub fn fingerprint(&self) -> &str {
        &self.inner.scheduler.info.fingerprint
    }
}

#[tonic::async_trait]
impl PrefillWorker for PrefillService {
    async fn prefill(
        &self,
        request: Request<PrefillRequest>,
    ) -> Result<Response<PrefillResponse>, Status> {
        let received = Instant::now();
        let deadline = duet_proto::deadline(&request);
        let timeout = deadline.saturating_duration_since(tokio::time::Instant::now());
        let req = request.into_inner();
        let request_id = req.request_id.clone();
        let result =
            tokio::time::timeout_at(deadline, self.inner.prefill(req, received, deadline)).await;
        let result = result.unwrap_or_else(|_| {
            Err(PrefillError::DeadlineExceeded(format!(
                "the prefill did not finish within the call's deadline of {} ms",
                timeout.as_millis()
            )))
        });
        match result {
            Ok(r) => Ok(Response::new(r)),
            Err(e) => {
                tracing::info!(request_id, "prefill failed: {e}");
                Err(e.into())
            }
        }
    }
}

#[tonic::async_trait]
impl WorkerControl for PrefillService {
    async fn stats(&self, _: Request<StatsRequest>) -> Result<Response<StatsResponse>, Status> {
        let s = &self.inner.scheduler;
        let snap = s.state.snapshot();
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Ok(Response::new(StatsResponse {
            role: WorkerRole::Prefill as i32,
            worker_id: self.inner.worker_id.clone(),
            incarnation: self.inner.incarnation,
            kv_blocks_total: snap.pool.num_blocks as u32,
            kv_blocks_used: snap.pool.in_use as u32,
            kv_blocks_cached: snap.pool.cached as u32,
            kv_blocks_free: snap.pool.free as u32,
            block_size: s.info.block_size as u32,
            running_sequences: snap.running as u32,
            waiting_requests: snap.waiting as u32,
            queued_prefill_tokens: load(&s.state.queued_tokens),
            reservations_outstanding: 0,
            model_fingerprint: s.info.fingerprint.clone(),
            requests_served: load(&s.state.requests_served),
            prompt_tokens: load(&s.state.prompt_tokens),
            prefix_hit_tokens: load(&s.state.prefix_hit_tokens),
            transfer_bytes_in: 0,
            transfer_bytes_out: load(&s.state.transfer_bytes_out),
        }))
    }
}

/// Sends `Cancel` for a job when the request ends before the engine answered (the caller went
/// away, the deadline passed, the push failed).
struct CancelGuard<'a> {
    scheduler: &'a SchedulerHandle,
    job: u64,
    armed: bool,
}

impl Drop for CancelGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.scheduler.send(Command::Cancel(self.job));
        }
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Undoes a queue admission unless the job reached the engine thread.
struct Unqueue<'a> {
    scheduler: &'a SchedulerHandle,
    tokens: u64,
}

impl Drop for Unqueue<'_> {
    fn drop(&mut self) {
        self.scheduler
            .state
            .queued_tokens
            .fetch_sub(self.tokens, Ordering::Relaxed);
    }
}

impl Inner {
    async fn prefill(
        &self,
        req: PrefillRequest,
        received: Instant,
        deadline: tokio::time::Instant,
    ) -> Result<PrefillResponse, PrefillError> {
        let s = &self.scheduler;
        let dest = validate(&req, &s.info)?.clone();
        let params = req
            .sampling
            .as_ref()
            .map(SamplingParams::from)
            .unwrap_or_default();
        params
            .validate()
            .map_err(|e| PrefillError::InvalidArgument(e.0))?;
        let num_tokens = req.token_ids.len();
        let num_blocks = num_tokens.div_ceil(s.info.block_size);
        let first_block = dest.cached_blocks as usize;

        // Admission: refuse at once rather than queue past the limit.
        let n = num_tokens as u64;
        enqueue_tokens(&s.state.queued_tokens, n, self.max_queued_tokens)?;
        let unqueue = Unqueue {
            scheduler: s,
            tokens: n,
        };

        let total_blocks = num_blocks - first_block;
        let header = KvHeader {
            reservation_id: dest.reservation_id,
            request_id: req.request_id.clone(),
            model_fingerprint: s.info.fingerprint.clone(),
            block_size: s.info.block_size as u32,
            num_layers: s.info.num_layers as u32,
            num_kv_heads: s.info.num_kv_heads as u32,
            head_dim: s.info.head_dim as u32,
            dtype: s.info.kv_dtype.name().into(),
            layout: duet_proto::KV_WIRE_LAYOUT.into(),
            first_block: first_block as u32,
            total_blocks: total_blocks as u32,
            total_bytes: (s.info.num_layers * total_blocks * s.info.kv_block_bytes) as u64,
            num_tokens: num_tokens as u32,
            sender_worker_id: self.worker_id.clone(),
        };
        let (kv_tx, kv_rx) = mpsc::unbounded_channel();
        let address = dest.transfer_address.clone();
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        let channels = self.channels.clone();
        let mut push_task = AbortOnDrop(tokio::spawn(async move {
            kv_push::push(&channels, &address, header, kv_rx, remaining).await
        }));

        let (reply_tx, mut reply_rx) = oneshot::channel();
        let job = self.next_job.fetch_add(1, Ordering::Relaxed);
        s.send(Command::Prefill(PrefillJob {
            id: job,
            tokens: req.token_ids,
            cache_salt: req.cache_salt,
            params,
            first_block,
            kv_tx,
            reply: reply_tx,
            received,
        }))?;
        std::mem::forget(unqueue); // the engine thread accounts for the tokens from here on
        let mut cancel = CancelGuard {
            scheduler: s,
            job,
            armed: true,
        };

        let mut prefilled: Option<Prefilled> = None;
        let mut pushed: Option<Pushed> = None;
        while prefilled.is_none() || pushed.is_none() {
            tokio::select! {
                r = &mut reply_rx, if prefilled.is_none() => {
                    cancel.armed = false; // answered: the engine has dropped the sequence
                    prefilled = Some(r.map_err(|_| PrefillError::EngineGone)??);
                }
                r = &mut push_task.0, if pushed.is_none() => {
                    let r = r.map_err(|e| PrefillError::Push {
                        address: dest.transfer_address.clone(),
                        status: Status::unavailable(format!("push task failed: {e}")),
                    })?;
                    pushed = Some(r?);
                }
            }
        }
        let (prefilled, pushed) = (prefilled.expect("loop ends"), pushed.expect("loop ends"));
        s.state.requests_served.fetch_add(1, Ordering::Relaxed);
        s.state
            .transfer_bytes_out
            .fetch_add(pushed.bytes_sent, Ordering::Relaxed);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        Ok(PrefillResponse {
            first_token: Some(TokenLogprobs::from(&prefilled.first)),
            cached_tokens: prefilled.cached_tokens as u32,
            queue_ms: ms(prefilled.queue),
            prefill_ms: ms(prefilled.compute),
            transfer_ms: ms(pushed
                .acked_at
                .saturating_duration_since(prefilled.computed_at)),
            bytes_sent: pushed.bytes_sent,
            transport: TransportKind::Grpc as i32,
            worker_id: self.worker_id.clone(),
        })
    }
}

/// Counts `n` more queued prompt tokens, or refuses (RESOURCE_EXHAUSTED) when that would pass
/// `max`; a request arriving at an empty queue is always taken.
fn enqueue_tokens(queued: &AtomicU64, n: u64, max: u64) -> Result<(), PrefillError> {
    let before = queued.fetch_add(n, Ordering::Relaxed);
    if before > 0 && before + n > max {
        queued.fetch_sub(n, Ordering::Relaxed);
        return Err(PrefillError::ResourceExhausted(format!(
            "the prefill queue holds {before} tokens; {n} more would pass its limit of {max}"
        )));
    }
    Ok(())
}

/// Checks a request against this worker's model and KV geometry; returns its destination.
fn validate<'a>(
    req: &'a PrefillRequest,
    info: &crate::scheduler::EngineInfo,
) -> Result<&'a KvDestination, PrefillError> {
    use PrefillError::{FailedPrecondition, InvalidArgument};
    if req.model_fingerprint != info.fingerprint {
        return Err(FailedPrecondition(format!(
            "model fingerprint mismatch: the request is for {:?}, this prefill worker serves {:?}",
            req.model_fingerprint, info.fingerprint
        )));
    }
    let dest = req
        .dest
        .as_ref()
        .ok_or_else(|| InvalidArgument("dest (the KV destination) is missing".into()))?;
    if dest.block_size as usize != info.block_size {
        return Err(FailedPrecondition(format!(
            "KV block size mismatch: the decode worker uses {} tokens per block, this prefill worker {}",
            dest.block_size, info.block_size
        )));
    }
    let n = req.token_ids.len();
    if n == 0 {
        return Err(InvalidArgument("token_ids is empty".into()));
    }
    if let Some(&bad) = req
        .token_ids
        .iter()
        .find(|&&t| t as usize >= info.vocab_size)
    {
        return Err(InvalidArgument(format!(
            "token id {bad} is outside the vocabulary (0..{})",
            info.vocab_size
        )));
    }
    if n >= info.context_length {
        return Err(InvalidArgument(format!(
            "the prompt has {n} tokens; the model's context is {}",
            info.context_length
        )));
    }
    let blocks = n.div_ceil(info.block_size);
    if dest.block_ids.len() != blocks {
        return Err(InvalidArgument(format!(
            "dest.block_ids has {} blocks; {n} tokens need {blocks} blocks of {}",
            dest.block_ids.len(),
            info.block_size
        )));
    }
    if dest.cached_blocks as usize > blocks {
        return Err(InvalidArgument(format!(
            "dest.cached_blocks is {} but the prompt has only {blocks} blocks",
            dest.cached_blocks
        )));
    }
    if dest.transfer_address.is_empty() {
        return Err(InvalidArgument("dest.transfer_address is empty".into()));
    }
    if blocks > info.num_blocks {
        return Err(PrefillError::ResourceExhausted(format!(
            "the prompt needs {blocks} KV blocks; this prefill worker's cache holds {}",
            info.num_blocks
        )));
    }
    Ok(dest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::EngineInfo;

    fn info() -> EngineInfo {
        EngineInfo {
            fingerprint: "fp".into(),
            block_size: 4,
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 8,
            vocab_size: 100,
            context_length: 64,
            num_blocks: 8,
            kv_block_bytes: 2 * 2 * 4 * 8 * 4,
            kv_dtype: duet_engine::backend::KvDtype::F32,
        }
    }

    fn request(tokens: Vec<u32>, blocks: usize) -> PrefillRequest {
        PrefillRequest {
            token_ids: tokens,
            model_fingerprint: "fp".into(),
            dest: Some(KvDestination {
                transfer_address: "127.0.0.1:1".into(),
                block_ids: (0..blocks as u32).collect(),
                block_size: 4,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn code(r: Result<&KvDestination, PrefillError>) -> tonic::Code {
        Status::from(r.unwrap_err()).code()
    }

    #[test]
    fn validation() {
        let i = info();
        assert!(validate(&request(vec![1; 9], 3), &i).is_ok());
        use tonic::Code::*;
        assert_eq!(code(validate(&request(vec![], 0), &i)), InvalidArgument);
        assert_eq!(code(validate(&request(vec![1; 9], 2), &i)), InvalidArgument);
        assert_eq!(code(validate(&request(vec![100], 1), &i)), InvalidArgument);
        assert_eq!(
            code(validate(&request(vec![1; 64], 16), &i)),
            InvalidArgument
        );
        let mut r = request(vec![1; 9], 3);
        r.model_fingerprint = "other".into();
        let e = validate(&r, &i).unwrap_err().to_string();
        assert!(e.contains("\"other\"") && e.contains("\"fp\""), "{e}");
        assert_eq!(code(validate(&r, &i)), FailedPrecondition);
        let mut r = request(vec![1; 9], 3);
        r.dest.as_mut().unwrap().block_size = 16;
        assert_eq!(code(validate(&r, &i)), FailedPrecondition);
        let mut r = request(vec![1; 9], 3);
        r.dest.as_mut().unwrap().cached_blocks = 4;
        assert_eq!(code(validate(&r, &i)), InvalidArgument);
        let mut r = request(vec![1; 9], 3);
        r.dest = None;
        assert_eq!(code(validate(&r, &i)), InvalidArgument);
        assert_eq!(
            code(validate(&request(vec![1; 40], 10), &i)),
            ResourceExhausted
        );
    }

    #[test]
    fn queue_limit() {
        let q = AtomicU64::new(0);
        enqueue_tokens(&q, 100, 50).unwrap(); // an empty queue takes anything
        let e = enqueue_tokens(&q, 1, 50).unwrap_err();
        assert_eq!(Status::from(e).code(), tonic::Code::ResourceExhausted);
        assert_eq!(q.load(Ordering::Relaxed), 100);
        q.store(20, Ordering::Relaxed);
        enqueue_tokens(&q, 30, 50).unwrap();
        assert!(enqueue_tokens(&q, 1, 50).is_err());
        assert_eq!(q.load(Ordering::Relaxed), 50);
    }
}
