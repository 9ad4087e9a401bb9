//! Decode attention benchmark: `cargo bench -p duet-cpu --bench attention [-- --threads N]
//! [--points B:C,...] [--kernels portable|avx2|avx2-vnni|avx512] [--kv-dtype f16|int8|f32]
//! [--scattered] [--hot]`.
//!
//! One decode step's attention over all 30 layers of a SmolLM2-135M-shaped model (9 query heads,
//! 3 KV heads of 64, f16 cache unless told, 16-token blocks), for `batch` sequences of `context`
//! tokens each,
//! every sequence on its own blocks of a pool much larger than the last-level cache: consecutive
//! blocks, as a fresh server's allocator hands them out, or with `--scattered` drawn at random
//! (a server that has run a while). Between layers a 3 MiB slice of a "weights" buffer is read, as
//! the matrix products between two attention calls read theirs (on every thread of the pool), so
//! the KV cache is as cold as in the engine. `--hot` leaves that out and reuses 8 blocks per
//! sequence instead (KV read from cache: the kernel's arithmetic alone). Prints ms per step and
//! the KV read rate (KV bytes ÷ time).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use duet_cpu::CpuBackend;
use duet_cpu::quant::KernelPath;
use duet_engine::backend::{AttentionShape, Backend, KvDtype, KvLayout};
use duet_engine::batch::{ForwardBatch, LogitsWanted, SeqInput};
use duet_model::synthetic::Uniform;

const LAYERS: usize = 30;
const HEADS: usize = 9;
const KV_HEADS: usize = 3;
const HEAD_DIM: usize = 64;
const BLOCK: usize = 16;
/// Bytes of weights the matrix products of one layer read (~96 MB / 30 layers).
const WEIGHTS_PER_LAYER: usize = 3 << 20;

struct Options {
    threads: usize,
    points: Vec<(usize, usize)>,
    kernels: KernelPath,
    hot: bool,
    scattered: bool,
    dtype: KvDtype,
}

fn options() -> Options {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let points = value("--points")
        .unwrap_or_else(|| "1:512,1:2048,32:64,32:512".into())
        .split(',')
        .map(|p| {
            let (b, c) = p.split_once(':').expect("--points B:C,...");
            (b.parse().expect("batch"), c.parse().expect("context"))
        })
        .collect();
    Options {
        threads: value("--threads").map_or(0, |t| t.parse().expect("--threads N")),
        points,
        kernels: value("--kernels").map_or_else(KernelPath::detect, |k| {
            let path = KernelPath::ALL
                .into_iter()
                .find(|p| p.name() == k)
                .expect("--kernels portable|avx2|avx2-vnni|avx512");
            assert!(path.supported(), "this CPU cannot run the {k} kernels");
            path
        }),
        hot: args.iter().any(|a| a == "--hot"),
        dtype: match value("--kv-dtype").as_deref() {
            None | Some("f16") => KvDtype::F16,
            Some("int8") => KvDtype::Int8,
            Some("f32") => KvDtype::F32,
            Some(other) => panic!("--kv-dtype f16|int8|f32, not {other}"),
        },
        scattered: args.iter().any(|a| a == "--scattered"),
    }
}

fn main() {
    let o = options();
    let backend = CpuBackend::with_kernels(o.threads, o.kernels);
    let shape = AttentionShape {
        num_heads: HEADS,
        num_kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
    };
    println!(
        "decode attention, {LAYERS} layers, {HEADS} heads / {KV_HEADS} KV heads of {HEAD_DIM}, {} \
         KV, {} threads, {:?} kernels, {} blocks{}",
        o.dtype,
        backend.threads(),
        backend.kernels(),
        if o.scattered {
            "scattered"
        } else {
            "consecutive"
        },
        if o.hot { ", KV hot" } else { "" }
    );
    let weights = vec![1u8; LAYERS * WEIGHTS_PER_LAYER];
    let mut rng = Uniform::new(17);
    for &(batch, context) in &o.points {
        let per_seq = context.div_ceil(BLOCK);
        // Four times the blocks in use, at least 1 GiB of cache: reads land all over memory.
        let layout = KvLayout {
            num_layers: LAYERS,
            num_kv_heads: KV_HEADS,
            head_dim: HEAD_DIM,
            block_size: BLOCK,
            num_blocks: 0,
            dtype: o.dtype,
        };
        let num_blocks = (4 * batch * per_seq).max((1 << 30) / layout.block_bytes());
        let layout = KvLayout {
            num_blocks,
            ..layout
        };
        let mut kv = backend.alloc_kv(layout).expect("KV cache");
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        if o.scattered {
            for i in (1..ids.len()).rev() {
                let r = (rng.next_value() + 1.0) / 2.0 * (i + 1) as f32;
                ids.swap(i, (r as usize).min(i));
            }
        }
        let tables: Vec<Vec<u32>> = (0..batch)
            .map(|s| {
                let own = &ids[s * per_seq..(s + 1) * per_seq];
                if o.hot {
                    (0..per_seq).map(|b| own[b % 8]).collect()
                } else {
                    own.to_vec()
                }
            })
            .collect();
        // Every block of the pool written once (the OS backs the whole cache, as in a busy server).
        let width = KV_HEADS * HEAD_DIM;
        let chunk = 4096;
        let values = rng.values(chunk * width);
        for layer in 0..LAYERS {
            let mut slot = 0u32;
            while (slot as usize) < num_blocks * BLOCK {
                let n = chunk.min(num_blocks * BLOCK - slot as usize);
                let slots: Vec<u32> = (slot..slot + n as u32).collect();
                kv.write(layer, &values[..n * width], &values[..n * width], &slots);
                slot += n as u32;
            }
        }
        let token = [1u32];
        let inputs: Vec<SeqInput> = tables
            .iter()
            .map(|t| SeqInput {
                tokens: &token,
                start_pos: context - 1,
                block_table: t,
                logits: LogitsWanted::Last,
            })
            .collect();
        let forward = ForwardBatch::new(&inputs, BLOCK, num_blocks, 2, context).expect("batch");
        let prepared = backend.prepare_batch(&forward);
        let q = duet_cpu::CpuTensor {
            data: rng.values(batch * HEADS * HEAD_DIM),
            rows: batch,
            cols: HEADS * HEAD_DIM,
        };
        let mut out = backend.alloc(batch, HEADS * HEAD_DIM);
        let sink = AtomicU64::new(0);
        let mut step = |timed: &mut f64| {
            for layer in 0..LAYERS {
                if !o.hot {
                    // Read by every thread of the pool, as the matrix products do: a caller
                    // reading alone would leave the others idle long enough to park, and the
                    // attention call would then time their wake-up.
                    let w = &weights[layer * WEIGHTS_PER_LAYER..][..WEIGHTS_PER_LAYER];
                    backend.pool().for_each_range(w.len() / 4096, |pages| {
                        let read: u64 = w[pages.start * 4096..pages.end * 4096]
                            .iter()
                            .step_by(64)
                            .map(|&b| b as u64)
                            .sum();
                        sink.fetch_add(read, Ordering::Relaxed);
                    });
                }
                let t = Instant::now();
                backend.attention(&q, &kv, layer, shape, &prepared, &mut out);
                *timed += t.elapsed().as_secs_f64();
            }
        };
        let mut warm = 0.0;
        step(&mut warm);
        let (mut best, start) = (f64::MAX, Instant::now());
        let mut rounds = 0;
        while rounds < 5 || start.elapsed().as_secs_f64() < 2.0 {
            let mut t = 0.0;
            step(&mut t);
            best = best.min(t);
            rounds += 1;
        }
        std::hint::black_box((sink.load(Ordering::Relaxed), &out));
        let kv_bytes = (batch * context * layout.bytes_per_token()) as f64;
        println!(
            "batch {batch:>3} context {context:>5}: {:7.3} ms per step, KV read at {:5.1} GB/s \
             (best of {rounds})",
            best * 1e3,
            kv_bytes / best / 1e9
        );
    }
}
