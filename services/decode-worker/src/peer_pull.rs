//! Prefixes pulled from a peer instead of computed, both ends of `KvTransfer/Pull`.
//!
//! The puller (the decode worker a request was sent to): the router names a peer holding more
//! of the prompt ([`v1::KvPullSource`]); this worker reserves KV for the peer's part of the
//! prefix, binds the reservation to that peer, and takes the peer's answer with every check of
//! a push (`duet_transfer::grpc::pull`). The filled reservation becomes a cached prefix here,
//! which the request then finds like any other. The pull may take only as long as computing the
//! missing blocks would (at this worker's measured prefill rate); a peer that is not a decode
//! worker of the cluster, no longer holds the prefix, fails, dies mid-stream or is too slow
//! costs the request nothing but the time spent: it is computed instead, and counted
//! (`duet_kv_peer_pulls_total{outcome,transport}`). With `--kv-peer-pull-cuda-ipc on` (and this
//! worker offering cuda-ipc) the pull asks for the blocks over CUDA IPC, copied by the holder
//! straight into the reservation; one that fails so is asked again over gRPC in the time left.
//!
//! The holder ([`answer`]): hashes the tokens it is sent with the caller's cache salt itself,
//! so a caller gets only KV of tokens it knows, in its own tenant's namespace, and sends the
//! blocks from its pool, or brought up from its tiers below, through a push's sender: over CUDA
//! IPC where the caller asks and both ends can (`duet_transfer::choice::pull_answer_transport`),
//! else the gRPC chunks, each checksummed.

use std::time::{Duration, Instant};

use duet_proto::v1;
use duet_proto::v1::TransportKind;
use duet_transfer::grpc::ChunkSender;
use duet_transfer::{KvSender, ReservationKey, TransferError};
use duet_worker::stats::{Direction, PullOutcome};
use duet_worker::{Command, RequestId, WorkerError};
use tokio::sync::mpsc::unbounded_channel;

use crate::service::WorkerState;

/// Pulls the prefix `source` holds for request `id` (see the module docs). Never fails: the
/// outcome is counted, and the request computes whatever did not arrive.
pub async fn pull_prefix(
    state: &WorkerState,
    req: &v1::DecodeRequest,
    source: &v1::KvPullSource,
    id: RequestId,
    deadline: Instant,
) {
    let started = Instant::now();
    let counters = state.engine.counters();
    match try_pull(state, req, source, id, deadline).await {
        Ok(None) => {}
        Ok(Some((bytes, transport))) => {
            let seconds = started.elapsed().as_secs_f64();
            counters.transferred("pull", Direction::In, bytes, seconds);
            counters.pulled(PullOutcome::Pulled, transport);
        }
        Err(((outcome, why), transport)) => {
            tracing::info!(
                request = %req.request_id,
                peer = %source.worker_id,
                outcome = outcome.as_str(),
                transport = duet_transfer::choice::transport_name(transport),
                "prefix pull fell back to computing it: {why}"
            );
            counters.pulled(outcome, transport);
        }
    }
}

type Failure = (PullOutcome, String);

fn failed(e: impl std::fmt::Display) -> Failure {
    (PullOutcome::Failed, e.to_string())
}

/// The transport a pull asks for: CUDA IPC with `--kv-peer-pull-cuda-ipc on` where this worker
/// offers it (`offered`: its KV store exported), else gRPC.
fn asked_transport(cuda_ipc: bool, offered: TransportKind) -> TransportKind {
    match cuda_ipc && offered == TransportKind::CudaIpc {
        true => TransportKind::CudaIpc,
        false => TransportKind::Grpc,
    }
}

/// Whether a pull that failed with `outcome` over CUDA IPC is asked again over gRPC: not when
/// the peer no longer holds the prefix, or time is up.
fn retried_over_grpc(outcome: PullOutcome) -> bool {
    matches!(outcome, PullOutcome::Failed)
}

/// The pull: `None` when there was nothing to pull (this worker holds as much), else the bytes
/// that arrived and the transport they took; a failure with the transport of the last attempt.
async fn try_pull(
    state: &WorkerState,
    req: &v1::DecodeRequest,
    source: &v1::KvPullSource,
    id: RequestId,
    deadline: Instant,
) -> Result<Option<(u64, TransportKind)>, (Failure, TransportKind)> {
    let asked = asked_transport(state.peer_pull_cuda_ipc, state.kv_transport);
    let with = |f: Failure| (f, asked);
    if !state
        .decode_peers
        .knows(&source.address, Some(&source.worker_id))
    {
        return Err(with((
            PullOutcome::Refused,
            format!(
                "{:?} at {:?} is not a decode worker of this cluster",
                source.worker_id, source.address
            ),
        )));
    }
    let info = state.engine.info();
    let block_size = info.wire.layout.block_size;
    // Whole blocks, leaving the prompt's last token to compute.
    let blocks =
        (source.blocks as usize).min(req.prompt_token_ids.len().saturating_sub(1) / block_size);
    if blocks == 0 {
        return Ok(None);
    }
    let tokens = req.prompt_token_ids[..blocks * block_size].to_vec();
    let (tokens_sent, cache_salt) = (tokens.clone(), req.cache_salt.clone());
    let reserved = state
        .engine
        .ask(|reply| Command::Reserve {
            id,
            tokens: tokens_sent,
            cache_salt,
            reply,
        })
        .await
        .map_err(|e| with(failed(e)))?
        .map_err(|e| with(failed(e)))?;
    if reserved.cached_blocks >= blocks {
        let _ = state.engine.send(Command::Cancel(id));
        return Ok(None);
    }
    // Worth it only while faster than computing the blocks missing here.
    let missing = ((blocks - reserved.cached_blocks) * block_size) as f64;
    let rate = match state.engine.snapshot().prefill_tokens_per_s {
        r if r > 0.0 => r,
        _ => duet_kv::PRIOR_PREFILL_TOKENS_PER_S,
    };
    let timeout = Duration::from_secs_f64(missing / rate)
        .min(deadline.saturating_duration_since(Instant::now()) / 2);
    let pull_deadline = Instant::now() + timeout;
    let dest = Destination {
        tokens: &tokens,
        first_block: reserved.cached_blocks,
        block_ids: &reserved.block_ids,
    };
    let fence = state.fence(id, asked, pull_deadline);
    let mut pulled = pull_into(state, req, source, id, &dest, asked, timeout).await;
    if pulled.is_ok() {
        state.lift_fence(id, fence);
    }
    if let Err((failure, TransportKind::CudaIpc)) = &pulled
        && retried_over_grpc(failure.0)
    {
        tracing::info!(
            request = %req.request_id,
            peer = %source.worker_id,
            "prefix pull over cuda-ipc failed, asking again over grpc: {}",
            failure.1
        );
        state
            .engine
            .counters()
            .pulled(failure.0, TransportKind::CudaIpc);
        let left = pull_deadline.saturating_duration_since(Instant::now());
        pulled = pull_into(state, req, source, id, &dest, TransportKind::Grpc, left).await;
    }
    match pulled {
        Ok((bytes, transport)) => {
            state
                .engine
                .ask(|reply| Command::CachePulled { id, tokens, reply })
                .await
                .map_err(|e| (failed(e), transport))?
                .map_err(|e| (failed(e), transport))?;
            Ok(Some((bytes, transport)))
        }
        Err(e) => {
            // The reservation goes; the prompt is computed.
            let _ = state.engine.send(Command::Cancel(id));
            Err(e)
        }
    }
}

/// Where a pull's blocks go: the reservation of the prefix `tokens`, from its block
/// `first_block` (those before it are cached here), `block_ids` its physical blocks.
struct Destination<'a> {
    tokens: &'a [u32],
    first_block: usize,
    block_ids: &'a [u32],
}

/// Binds the reservation of request `id` to `source` and takes its answer into it, asked for
/// over `transport`: the bytes that arrived and the transport the answer took, or the failure
/// and the transport asked for.
async fn pull_into(
    state: &WorkerState,
    req: &v1::DecodeRequest,
    source: &v1::KvPullSource,
    id: RequestId,
    dest: &Destination<'_>,
    transport: TransportKind,
    timeout: Duration,
) -> Result<(u64, TransportKind), (Failure, TransportKind)> {
    let with = |f: Failure| (f, transport);
    let prefill_worker = source.worker_id.clone();
    let key = state
        .engine
        .ask(|reply| Command::Bind {
            id,
            prefill_worker,
            attempt: timeout,
            reply,
        })
        .await
        .map_err(|e| with(failed(e)))?
        .ok_or_else(|| with(failed("the reservation was reclaimed")))?;
    let ipc = transport == TransportKind::CudaIpc;
    let msg = v1::KvPullRequest {
        request_id: req.request_id.clone(),
        token_ids: dest.tokens.to_vec(),
        cache_salt: req.cache_salt.clone(),
        first_block: dest.first_block as u32,
        reservation_id: key.to_wire(),
        model_fingerprint: state.engine.info().wire.fingerprint.clone(),
        transport: transport as i32,
        transport_params: match ipc {
            true => state.kv_transport_params.clone(),
            false => Vec::new(),
        },
        dest_block_ids: match ipc {
            true => dest.block_ids.to_vec(),
            false => Vec::new(),
        },
    };
    let wire = &state.engine.info().wire;
    match duet_transfer::grpc::pull(
        &state.channels,
        &source.address,
        msg,
        timeout,
        wire,
        &state.engine,
    )
    .await
    {
        Ok((ack, answered)) if ack.accepted => Ok((ack.bytes_received, answered)),
        Ok((ack, _)) => Err(with(failed(ack.message))),
        Err(TransferError::Call { status, .. }) => Err(with(match status.code() {
            tonic::Code::NotFound => (PullOutcome::Missing, status.message().to_string()),
            tonic::Code::DeadlineExceeded => (PullOutcome::Slow, status.message().to_string()),
            _ => failed(status.message()),
        })),
        Err(e) => Err(with(failed(e))),
    }
}

/// The holder's side: the KV of the blocks of `req`'s prefix it asks for, as the messages of a
/// push into the caller's reservation.
pub async fn answer(
    state: &WorkerState,
    req: v1::KvPullRequest,
    deadline: Instant,
) -> Result<Vec<v1::KvChunk>, WorkerError> {
    let started = Instant::now();
    let engine = &state.engine;
    let wire = &engine.info().wire;
    wire.check_model("the caller", &req.model_fingerprint)?;
    let block_size = wire.layout.block_size;
    let num_blocks = req.token_ids.len() / block_size;
    if req.token_ids.is_empty() || !req.token_ids.len().is_multiple_of(block_size) {
        return Err(WorkerError::InvalidArgument(format!(
            "a pull names whole blocks of {block_size} tokens, not {} tokens",
            req.token_ids.len()
        )));
    }
    let blocks = req.first_block as usize..num_blocks;
    if blocks.is_empty() {
        return Err(WorkerError::InvalidArgument(format!(
            "first_block {} leaves none of the {num_blocks} blocks to send",
            req.first_block
        )));
    }
    let key = ReservationKey::from_wire(&req.reservation_id)?;
    let (tx, mut rx) = unbounded_channel();
    let ipc = duet_transfer::choice::pull_answer_transport(
        &req,
        state.kv_transport,
        &state.node,
        std::process::id(),
        num_blocks,
    )
    .map_err(|why| why.unwrap_or_default())
    .and_then(|offer| {
        state.ipc_pulls.sender(
            wire,
            &req.request_id,
            &offer,
            req.dest_block_ids.clone(),
            tx.clone(),
        )
    });
    let (transport, sender): (TransportKind, Box<dyn KvSender>) = match ipc {
        Ok(sender) => (TransportKind::CudaIpc, sender),
        Err(why) => {
            if req.transport() == TransportKind::CudaIpc {
                tracing::info!(
                    request = %req.request_id,
                    "answering a pull asked over cuda-ipc over grpc: {why}"
                );
            }
            let sender = ChunkSender::new(tx, wire.block_bytes());
            (TransportKind::Grpc, Box::new(sender))
        }
    };
    let (tokens, cache_salt, range) = (
        req.token_ids.clone(),
        req.cache_salt.clone(),
        blocks.clone(),
    );
    let held = engine
        .ask(|reply| Command::SendPrefix {
            tokens,
            cache_salt,
            blocks: range,
            deadline,
            sender,
            reply,
        })
        .await??;
    if !held {
        return Err(WorkerError::NotFound(format!(
            "this worker no longer holds the {num_blocks} blocks of the prefix"
        )));
    }
    let mut header = wire.header_of(
        key,
        req.request_id.clone(),
        blocks,
        req.token_ids.len(),
        state.identity.worker_id.clone(),
    );
    header.transport = transport as i32;
    let bytes = header.total_bytes;
    let mut chunks = vec![v1::KvChunk {
        kind: Some(v1::kv_chunk::Kind::Header(header)),
    }];
    // The engine thread sent every message before it replied.
    while let Ok(chunk) = rx.try_recv() {
        chunks.push(chunk);
    }
    engine.counters().transferred(
        "pull",
        Direction::Out,
        bytes,
        started.elapsed().as_secs_f64(),
    );
    Ok(chunks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pull_asks_for_cuda_ipc_only_where_switched_on_and_offered() {
        use TransportKind::*;
        assert_eq!(asked_transport(true, CudaIpc), CudaIpc);
        assert_eq!(asked_transport(false, CudaIpc), Grpc);
        assert_eq!(
            asked_transport(true, Grpc),
            Grpc,
            "a CPU worker exports no store"
        );
    }

    /// A CUDA-IPC pull that failed is asked again over gRPC, one whose prefix is gone or whose
    /// time ran out is not (a gRPC pull would fare no better); a refused peer never got that far.
    #[test]
    fn only_a_failed_cuda_ipc_pull_is_asked_again_over_grpc() {
        let retried: Vec<_> = PullOutcome::ALL
            .into_iter()
            .filter(|&o| retried_over_grpc(o))
            .collect();
        assert_eq!(retried, [PullOutcome::Failed]);
    }
}
