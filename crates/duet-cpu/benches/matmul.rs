//! Matmul kernel benchmark: `cargo bench -p duet-cpu --bench matmul [-- --all-paths] [-- --threads N]`.
//!
//! First the cost of one empty pool dispatch. Per-shape numbers repeat one matrix (it stays in
//! cache after the first call); the "whole model" numbers (1, 32 and 128 tokens) run all 211
//! distinct matrices of a SmolLM2-135M forward step in order, so decode streams ~96 MB of weights
//! from memory as it would in the real model. The integer kernels' rates are also given as a share
//! of their path's compute ceiling on as many threads (`KernelPath::integer_macs_per_s_on`, what
//! `duet bench engine` divides by; `--bench dot_mix` shows what each batched kernel's instruction
//! mix allows of it).

use std::time::{Duration, Instant};

use duet_cpu::quant::{KernelPath, QMatrix, QuantType};
use duet_cpu::threadpool::ThreadPool;
use duet_model::storage::WeightBytes;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn f(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn random_matrix(ty: QuantType, rows: usize, cols: usize, rng: &mut Rng) -> QMatrix {
    let bb = ty.block_bytes();
    let n_blocks = rows * cols / ty.block_len();
    let mut raw = vec![0u8; n_blocks * bb];
    if ty.block_len() == 1 {
        for v in raw.chunks_exact_mut(bb) {
            let f = rng.f();
            match ty {
                QuantType::F32 => v.copy_from_slice(&f.to_le_bytes()),
                QuantType::F16 => {
                    v.copy_from_slice(&half::f16::from_f32(f).to_bits().to_le_bytes())
                }
                _ => v.copy_from_slice(&((f.to_bits() >> 16) as u16).to_le_bytes()),
            }
        }
        return QMatrix::new(ty, rows, cols, WeightBytes::from_vec(raw)).unwrap();
    }
    for blk in raw.chunks_exact_mut(bb) {
        for b in blk.iter_mut() {
            *b = rng.next() as u8;
        }
        let d = half::f16::from_f32(0.01 + 0.01 * rng.f())
            .to_bits()
            .to_le_bytes();
        blk[0..2].copy_from_slice(&d);
        if ty == QuantType::Q4_1 {
            let m = half::f16::from_f32(-0.08).to_bits().to_le_bytes();
            blk[2..4].copy_from_slice(&m);
        }
    }
    QMatrix::new(ty, rows, cols, WeightBytes::from_vec(raw)).unwrap()
}

/// Mean seconds per call of `f`, run for about `budget` after a warm-up.
fn time<F: FnMut()>(mut f: F, budget: Duration) -> f64 {
    f();
    let start = Instant::now();
    let mut n = 0u32;
    while start.elapsed() < budget || n < 3 {
        f();
        n += 1;
    }
    start.elapsed().as_secs_f64() / n as f64
}

const HIDDEN: usize = 576;
const FFN: usize = 1536;
const KV: usize = 192;
const LAYERS: usize = 30;
const VOCAB: usize = 49152;

fn layer_shapes() -> [(&'static str, usize, usize); 7] {
    [
        ("q", HIDDEN, HIDDEN),
        ("k", KV, HIDDEN),
        ("v", KV, HIDDEN),
        ("o", HIDDEN, HIDDEN),
        ("gate", FFN, HIDDEN),
        ("up", FFN, HIDDEN),
        ("down", HIDDEN, FFN),
    ]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let all_paths = args.iter().any(|a| a == "--all-paths");
    let threads = args
        .iter()
        .position(|a| a == "--threads")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let pool = ThreadPool::new(threads);
    let mut paths = vec![KernelPath::detect()];
    if all_paths {
        for p in KernelPath::ALL.into_iter().rev() {
            if p.supported() && !paths.contains(&p) {
                paths.push(p);
            }
        }
    }
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let budget = Duration::from_millis(300);
    println!(
        "threads: {threads}, detected kernel path: {:?}",
        KernelPath::detect()
    );

    // What every matrix call pays before any weight is read: waking the workers and waiting for
    // the last one (a decode step makes ~150 such calls: 5 per layer and the output).
    let dispatch = time(|| pool.run(|_, _| {}), budget);
    println!("pool dispatch (empty job): {:.2} us", dispatch * 1e6);

    // Each path's ceiling on this many threads, in GFLOP/s (two per multiply-accumulate).
    let ceilings: Vec<Option<f64>> = paths
        .iter()
        .map(|p| p.integer_macs_per_s_on(threads).map(|m| 2.0 * m / 1e9))
        .collect();
    let of_ceiling = |gflops: f64, ceiling: Option<f64>| {
        ceiling.map_or_else(
            || "-".to_string(),
            |c| format!("{:.0}%", 100.0 * gflops / c),
        )
    };
    for (&path, &ceiling) in paths.iter().zip(&ceilings) {
        println!("\n== path {path:?}: per shape (weights hot in cache after the first call) ==");
        if let Some(c) = ceiling {
            println!("compute ceiling on {threads} threads: {c:.1} GFLOP/s");
        }
        println!(
            "{:<22} {:>6} {:>10} {:>9} {:>9} {:>8}",
            "matrix (rows x cols)", "tokens", "us/call", "GB/s", "GFLOP/s", "ceiling"
        );
        let shapes = [
            (QuantType::Q4_1, HIDDEN, FFN),
            (QuantType::Q4_1, FFN, HIDDEN),
            (QuantType::Q4_1, HIDDEN, HIDDEN),
            (QuantType::Q4_1, KV, HIDDEN),
            (QuantType::Q8_0, VOCAB, HIDDEN),
        ];
        let mut per_shape = std::collections::HashMap::new();
        for (ty, rows, cols) in shapes {
            let m = random_matrix(ty, rows, cols, &mut rng);
            for n_tokens in [1usize, 128] {
                let x: Vec<f32> = (0..n_tokens * cols).map(|_| rng.f()).collect();
                let mut out = vec![0.0f32; n_tokens * rows];
                let s = time(
                    || m.matmul_with(path, &x, n_tokens, &mut out, &pool),
                    budget,
                );
                let gbs = m.size_bytes() as f64 / s / 1e9;
                let gflops = 2.0 * (rows * cols * n_tokens) as f64 / s / 1e9;
                println!(
                    "{:<22} {:>6} {:>10.1} {:>9.2} {:>9.1} {:>8}",
                    format!("{} {}x{}", ty.name(), rows, cols),
                    n_tokens,
                    s * 1e6,
                    gbs,
                    gflops,
                    of_ceiling(gflops, ceiling)
                );
                per_shape.insert((ty, rows, cols, n_tokens), s);
            }
        }
        for n_tokens in [1usize, 128] {
            let layer: f64 = layer_shapes()
                .iter()
                .map(|&(_, r, c)| per_shape[&(QuantType::Q4_1, r, c, n_tokens)])
                .sum();
            let total =
                LAYERS as f64 * layer + per_shape[&(QuantType::Q8_0, VOCAB, HIDDEN, n_tokens)];
            println!(
                "estimate from hot per-shape times, n_tokens={n_tokens}: {:.3} ms per step = {:.1} tok/s",
                total * 1e3,
                n_tokens as f64 / total
            );
        }
    }

    // Other weight types (integer kernels for the block types, dequantize-then-FMA for floats).
    println!("\n== other types, 576x1536, detected path ==");
    println!(
        "{:<22} {:>6} {:>10} {:>9} {:>9}",
        "matrix (rows x cols)", "tokens", "us/call", "GB/s", "GFLOP/s"
    );
    for ty in [
        QuantType::Q4_0,
        QuantType::Q8_0,
        QuantType::Q4_K,
        QuantType::Q6_K,
        QuantType::F16,
        QuantType::BF16,
    ] {
        let (rows, cols) = (HIDDEN, FFN);
        let m = random_matrix(ty, rows, cols, &mut rng);
        for n_tokens in [1usize, 128] {
            let x: Vec<f32> = (0..n_tokens * cols).map(|_| rng.f()).collect();
            let mut out = vec![0.0f32; n_tokens * rows];
            let s = time(|| m.matmul(&x, n_tokens, &mut out, &pool), budget);
            println!(
                "{:<22} {:>6} {:>10.1} {:>9.2} {:>9.1}",
                format!("{} {}x{}", ty.name(), rows, cols),
                n_tokens,
                s * 1e6,
                m.size_bytes() as f64 / s / 1e9,
                2.0 * (rows * cols * n_tokens) as f64 / s / 1e9
            );
        }
    }

    // The real thing: all 211 distinct matrices, weights streamed from memory.
    println!(
        "\n== whole SmolLM2-135M step, 30 layers x 7 Q4_1 matrices + Q8_0 output, distinct weights =="
    );
    let mut mats = Vec::new();
    for _ in 0..LAYERS {
        for (_, r, c) in layer_shapes() {
            mats.push(random_matrix(QuantType::Q4_1, r, c, &mut rng));
        }
    }
    mats.push(random_matrix(QuantType::Q8_0, VOCAB, HIDDEN, &mut rng));
    let bytes: usize = mats.iter().map(|m| m.size_bytes()).sum();
    println!("weights: {:.1} MB", bytes as f64 / 1e6);
    for (&path, &ceiling) in paths.iter().zip(&ceilings) {
        for n_tokens in [1usize, 32, 128] {
            let xs: Vec<Vec<f32>> = [HIDDEN, FFN]
                .iter()
                .map(|&c| (0..n_tokens * c).map(|_| rng.f()).collect())
                .collect();
            let mut out = vec![0.0f32; n_tokens * VOCAB];
            let s = time(
                || {
                    for m in &mats {
                        let x = if m.cols() == HIDDEN { &xs[0] } else { &xs[1] };
                        m.matmul_with(path, x, n_tokens, &mut out[..n_tokens * m.rows()], &pool);
                    }
                },
                Duration::from_millis(1500),
            );
            let flops = 2.0
                * mats.iter().map(|m| m.rows() * m.cols()).sum::<usize>() as f64
                * n_tokens as f64;
            println!(
                "{path:?} n_tokens={n_tokens:>3}: {:.3} ms per step, {:.1} tok/s, {:.2} GB/s weights, {:.1} GFLOP/s ({} of the ceiling)",
                s * 1e3,
                n_tokens as f64 / s,
                bytes as f64 / s / 1e9,
                flops / s / 1e9,
                of_ceiling(flops / s / 1e9, ceiling)
            );
        }
    }
}
