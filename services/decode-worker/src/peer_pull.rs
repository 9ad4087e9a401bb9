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
//! (`duet_kv_peer_pulls_total{outcome}`).
//!
//! The holder ([`answer`]): hashes the tokens it is sent with the caller's cache salt itself,
//! so a caller gets only KV of tokens it knows, in its own tenant's namespace, and reads the
//! blocks from its pool or brings them up from its tiers below.

use std::time::{Duration, Instant};

use duet_proto::v1;
use duet_transfer::{ReservationKey, TransferError};
use duet_worker::stats::{Direction, PullOutcome};
use duet_worker::{Command, RequestId, WorkerError};

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
    let outcome = match try_pull(state, req, source, id, deadline).await {
        Ok(None) => return,
        Ok(Some(bytes)) => {
            let seconds = started.elapsed().as_secs_f64();
            counters.transferred("pull", Direction::In, bytes, seconds);
            PullOutcome::Pulled
        }
        Err((outcome, why)) => {
            tracing::info!(
                request = %req.request_id,
                peer = %source.worker_id,
                outcome = outcome.as_str(),
                "prefix pull fell back to computing it: {why}"
            );
            outcome
        }
    };
    counters.pulled(outcome);
}

type Failure = (PullOutcome, String);

fn failed(e: impl std::fmt::Display) -> Failure {
    (PullOutcome::Failed, e.to_string())
}

/// The pull: `None` when there was nothing to pull (this worker holds as much), else the bytes
/// that arrived.
async fn try_pull(
    state: &WorkerState,
    req: &v1::DecodeRequest,
    source: &v1::KvPullSource,
    id: RequestId,
    deadline: Instant,
) -> Result<Option<u64>, Failure> {
    if !state
        .decode_peers
        .knows(&source.address, Some(&source.worker_id))
    {
        return Err((
            PullOutcome::Refused,
            format!(
                "{:?} at {:?} is not a decode worker of this cluster",
                source.worker_id, source.address
            ),
        ));
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
        .map_err(failed)?
        .map_err(failed)?;
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
    let pulled = pull_into(
        state,
        req,
        source,
        id,
        &tokens,
        reserved.cached_blocks,
        timeout,
    )
    .await;
    match pulled {
        Ok(bytes) => {
            state
                .engine
                .ask(|reply| Command::CachePulled { id, tokens, reply })
                .await
                .map_err(failed)?
                .map_err(failed)?;
            Ok(Some(bytes))
        }
        Err(e) => {
            // The reservation goes; the prompt is computed.
            let _ = state.engine.send(Command::Cancel(id));
            Err(e)
        }
    }
}

/// Binds the reservation of request `id` to `source` and takes its answer into it.
async fn pull_into(
    state: &WorkerState,
    req: &v1::DecodeRequest,
    source: &v1::KvPullSource,
    id: RequestId,
    tokens: &[u32],
    first_block: usize,
    timeout: Duration,
) -> Result<u64, Failure> {
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
        .map_err(failed)?
        .ok_or_else(|| failed("the reservation was reclaimed"))?;
    let msg = v1::KvPullRequest {
        request_id: req.request_id.clone(),
        token_ids: tokens.to_vec(),
        cache_salt: req.cache_salt.clone(),
        first_block: first_block as u32,
        reservation_id: key.to_wire(),
        model_fingerprint: state.engine.info().wire.fingerprint.clone(),
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
        Ok(ack) if ack.accepted => Ok(ack.bytes_received),
        Ok(ack) => Err(failed(ack.message)),
        Err(TransferError::Call { status, .. }) => Err(match status.code() {
            tonic::Code::NotFound => (PullOutcome::Missing, status.message().to_string()),
            tonic::Code::DeadlineExceeded => (PullOutcome::Slow, status.message().to_string()),
            _ => failed(status.message()),
        }),
        Err(e) => Err(failed(e)),
    }
}

/// The holder's side: the KV of the blocks of `req`'s prefix it asks for, as the messages of a
/// push into the caller's reservation.
pub async fn answer(
    state: &WorkerState,
    req: v1::KvPullRequest,
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
    let (tokens, cache_salt, range) = (
        req.token_ids.clone(),
        req.cache_salt.clone(),
        blocks.clone(),
    );
    let read = engine
        .ask(|reply| Command::ReadPrefix {
            tokens,
            cache_salt,
            blocks: range,
            reply,
        })
        .await??;
    let Some(kv) = read else {
        return Err(WorkerError::NotFound(format!(
            "this worker no longer holds the {num_blocks} blocks of the prefix"
        )));
    };
    let header = wire.header_of(
        key,
        req.request_id.clone(),
        blocks,
        req.token_ids.len(),
        state.identity.worker_id.clone(),
    );
    let bytes = header.total_bytes;
    let chunks = duet_transfer::grpc::pull_answer(wire, header, &kv);
    engine.counters().transferred(
        "pull",
        Direction::Out,
        bytes,
        started.elapsed().as_secs_f64(),
    );
    Ok(chunks)
}
