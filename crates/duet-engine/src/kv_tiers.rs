//! The tiers below the engine's KV pool, as the engine builds and feeds them: host memory
//! (`--kv-offload-tokens`) and a local directory (`--kv-disk-dir`, `--kv-disk-bytes`), off until
//! set. The bookkeeping (admission, eviction order, cost model) is duet-kv's
//! ([`LowerTiers`]); the bytes move here, between the device store and the tiers, because only
//! the engine owns the store.

use std::path::PathBuf;

use duet_kv::{DiskTier, HostTier, KvCacheManager, LowerTiers, Stopwatch, TierStore};

use crate::EngineError;
use crate::backend::{Backend, KvLayout};
use crate::device::Switch;
use crate::model_runner::ModelRunner;

/// Default byte limit of the disk tier.
pub const DEFAULT_DISK_BYTES: u64 = 4 << 30;

/// Ghost hashes remembered per block the worker can hold (device and tiers below).
const GHOSTS_PER_BLOCK: usize = 4;

/// The tiers below the KV pool (also flags of every command that loads a model).
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct KvTierOptions {
    /// Capacity of the host-memory tier below the KV pool, in tokens (0: none). A reused
    /// prefix evicted from the pool moves here instead of being lost, and a prompt that finds
    /// it here is loaded instead of prefilled again. Blocks keep the pool's element type (a
    /// restored prefix computes the same tokens as the original).
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "DUET_KV_OFFLOAD_TOKENS", default_value_t = 0)
    )]
    pub kv_offload_tokens: usize,
    /// A directory for the disk tier, below the host tier (unset: none). The worker writes its
    /// blocks, checksummed, into a directory of its own inside it and removes that at exit.
    #[cfg_attr(feature = "cli", arg(long, env = "DUET_KV_DISK_DIR"))]
    pub kv_disk_dir: Option<PathBuf>,
    /// Most bytes the disk tier's files take.
    #[cfg_attr(feature = "cli", arg(long, env = "DUET_KV_DISK_BYTES", default_value_t = DEFAULT_DISK_BYTES))]
    pub kv_disk_bytes: u64,
    /// On a GPU: blocks brought up from a tier below are copied on a stream of their own, beside
    /// the step in flight, and their sequence joins the step after the copies complete, on or
    /// off. Off until it has run on a GPU; the CPU copies at once either way.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "DUET_KV_LOAD_STREAM", value_enum, default_value_t = Switch::Off)
    )]
    pub kv_load_stream: Switch,
    /// On a GPU: the host tier in page-locked memory, on or off. The copy engine then reads a
    /// block brought up straight from its slot, and writes a block moving down straight into
    /// one, without the driver staging each copy; the whole tier is allocated and locked at
    /// start. Off until it has run on a GPU; the CPU's tier is ordinary memory either way.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "DUET_KV_HOST_PINNED", value_enum, default_value_t = Switch::Off)
    )]
    pub kv_host_pinned: Switch,
}

impl Default for KvTierOptions {
    fn default() -> Self {
        Self {
            kv_offload_tokens: 0,
            kv_disk_dir: None,
            kv_disk_bytes: DEFAULT_DISK_BYTES,
            kv_load_stream: Switch::Off,
            kv_host_pinned: Switch::Off,
        }
    }
}

impl KvTierOptions {
    /// Whether any tier below the pool is configured.
    pub fn any(&self) -> bool {
        self.kv_offload_tokens > 0 || self.kv_disk_dir.is_some()
    }

    /// These options as flags (see `EngineOptions::to_args`).
    pub fn to_args(&self) -> Vec<String> {
        let mut args = vec![
            format!("--kv-offload-tokens={}", self.kv_offload_tokens),
            format!("--kv-disk-bytes={}", self.kv_disk_bytes),
            format!("--kv-load-stream={}", self.kv_load_stream),
            format!("--kv-host-pinned={}", self.kv_host_pinned),
        ];
        if let Some(dir) = &self.kv_disk_dir {
            args.push(format!("--kv-disk-dir={}", dir.display()));
        }
        args
    }

    /// The tiers these options ask for, below a pool of `layout` (blocks of `block_bytes`, in
    /// the store's own layout) whose model fingerprint is `fingerprint`, the host tier in
    /// memory `backend` gives; `None` when none is asked for.
    pub fn build<B: Backend>(
        &self,
        backend: &B,
        layout: &KvLayout,
        block_bytes: usize,
        fingerprint: &str,
    ) -> Result<Option<LowerTiers>, EngineError> {
        if !self.any() {
            return Ok(None);
        }
        let mut tiers: Vec<Box<dyn TierStore>> = Vec::new();
        let host_blocks = self.kv_offload_tokens / layout.block_size;
        if host_blocks > 0 {
            let memory = backend.host_tier_memory(host_blocks * block_bytes)?;
            tiers.push(Box::new(HostTier::in_memory(
                host_blocks,
                block_bytes,
                memory,
            )));
        }
        if let Some(dir) = &self.kv_disk_dir {
            let namespace = xxhash_namespace(fingerprint);
            let disk = DiskTier::new(dir, self.kv_disk_bytes, block_bytes, namespace)
                .map_err(|e| EngineError::Config(e.to_string()))?;
            tiers.push(Box::new(disk));
        }
        let blocks: usize =
            layout.num_blocks + tiers.iter().map(|t| t.capacity_blocks()).sum::<usize>();
        Ok(Some(LowerTiers::new(
            tiers,
            layout.block_size,
            block_bytes,
            blocks.saturating_mul(GHOSTS_PER_BLOCK),
        )))
    }
}

/// A fingerprint as the namespace the disk tier checks its files against.
fn xxhash_namespace(fingerprint: &str) -> u64 {
    duet_kv::hash_seed(fingerprint.as_bytes(), None)
}

/// Moves what the KV cache manager owes between the device store and the tiers below: first
/// the KV of evicted blocks down (before anything writes their slots), each read straight into
/// its tier's memory, then loaded blocks into their new slots. Called after every manager call
/// that may allocate, whatever it returned. Returns whether blocks were written that a step
/// may read only once the backend's stored writes are done ([`stored_writes_done`]).
pub(crate) fn settle_kv_moves<B: Backend>(
    runner: &mut ModelRunner<B>,
    kv: &mut KvCacheManager,
) -> Result<bool, EngineError> {
    let moves = kv.take_moves();
    if moves.spills.is_empty() && moves.loads.is_empty() {
        return Ok(false);
    }
    let loaded = !moves.loads.is_empty();
    let mut failed = None;
    for (block, hash) in moves.spills {
        if failed.is_some() {
            // The device failed (sticky): nothing more moves down.
            kv.spill_failed(hash);
            continue;
        }
        let mut fill = |out: &mut [u8]| match runner.read_stored_block(block, out) {
            Ok(()) => true,
            Err(e) => {
                failed = Some(e);
                false
            }
        };
        // A block moving into a slot a copy to the device still reads waits for the copies.
        let backend = runner.model().backend();
        let mut wait_for_copies = || backend.finish_stored_writes().is_ok();
        kv.store_below(hash, &mut fill, &mut wait_for_copies);
    }
    if let Some(e) = failed {
        return Err(e);
    }
    for load in moves.loads {
        let watch = Stopwatch::start();
        runner.write_stored_block(load.block, kv.start_copy(&load.bytes))?;
        let mut took = load.read;
        took += watch.elapsed();
        kv.loaded(load.tier, 1, took);
    }
    Ok(loaded)
}

/// Whether every block brought up so far is written ([`Backend::stored_writes_done`]), without
/// waiting; once they are, the tier slots their copies read are free to reuse.
pub(crate) fn stored_writes_done<B: Backend>(
    runner: &ModelRunner<B>,
    kv: &mut KvCacheManager,
) -> bool {
    let done = runner.model().backend().stored_writes_done();
    if done {
        kv.copies_done();
    }
    done
}

/// Waits until every block brought up so far is written ([`Backend::finish_stored_writes`]);
/// the tier slots their copies read are then free to reuse.
pub(crate) fn finish_stored_writes<B: Backend>(
    runner: &ModelRunner<B>,
    kv: &mut KvCacheManager,
) -> Result<(), EngineError> {
    runner.model().backend().finish_stored_writes()?;
    kv.copies_done();
    Ok(())
}
