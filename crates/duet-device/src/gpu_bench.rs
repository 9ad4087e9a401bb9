//! `duet bench gpu`: every GPU check and timing of one run, as a table and as JSON.
//!
//! - Ceilings measured in the same run: device-to-device copy bandwidth (bytes read + written)
//!   and the cuBLAS bf16 matrix rate (8192³).
//! - Correctness: paged attention against a float64 host reference on random ragged batches
//!   (decode rows past several 512-token partitions, prefill with cached prefixes, GQA), output
//!   poisoned with NaN first; logits of the CUDA backend against the CPU backend (‖Δ‖/‖ref‖) and
//!   greedy tokens equal, on the models given; whether a draft's positions verified in one step
//!   are the same bits as decoded alone (speculative decoding needs it: `Backend::batch_invariant`).
//! - Speed on a Llama-3-8B-shaped model with random bf16 weights: decode at batch 1 and at batch
//!   64 with 1024-token contexts against the bandwidth roofline; one 2048- and one 8192-token
//!   prefill, and the 2048-token prefill's attention alone, against the matrix rate; the mixed
//!   load (`mixed_load`): the TPOT of 32 decodes while an 8192-token prompt prefills beside them
//!   in chunks, against their TPOT alone, per step token budget.
//! - Every check and prefill timing runs with each prefill attention kernel
//!   (`--prefill-attention legacy` and `fa`), so one run compares them.

use std::path::PathBuf;
use std::time::Instant;

use duet_cpu::CpuBackend;
use duet_engine::EngineError;
use duet_engine::backend::{AttentionShape, Backend, KvDtype, KvDtypeChoice, KvLayout};
use duet_engine::batch::{ForwardBatch, LogitsWanted, SeqInput};
use duet_engine::device::Device;
use duet_engine::engine::EngineOptions;
use duet_engine::llama::Llama;
use duet_model::config::ModelConfig;
use duet_model::model_files::open_model;
use duet_model::params::{SamplingParams, StopCriteria};
use duet_model::quant_type::QuantType;
use duet_model::storage::WeightBytes;
use duet_model::synthetic::Uniform;
use serde::Serialize;

use crate::LoadedEngine;
use crate::mixed_load::{MixedLoad, MixedLoadShape, mixed_load};
use duet_cuda::backend::{CudaBackend, bf16_bits};
use duet_engine::backend::PrefillAttention;
use duet_engine::model_runner::ModelRunner;

pub struct GpuBenchOptions {
    pub ordinal: usize,
    /// Models whose CUDA logits and greedy tokens are checked against the CPU backend.
    pub models: Vec<PathBuf>,
    pub prompts: Vec<String>,
    /// Skip the Llama-3-8B-shaped timings (a quick correctness run).
    pub skip_speed: bool,
}

#[derive(Serialize)]
pub struct Check {
    pub name: String,
    pub passed: bool,
    pub detail: String,
}

#[derive(Serialize)]
pub struct Timing {
    pub name: String,
    /// The prefill attention kernel it ran with, where it has prefill in it.
    pub prefill_attention: Option<String>,
    pub value: f64,
    pub unit: &'static str,
    /// Share of the roofline (bandwidth for decode, matrix rate for prefill).
    pub of_roofline: f64,
}

impl Timing {
    /// The name and, in brackets, the prefill attention kernel.
    pub fn label(&self) -> String {
        match &self.prefill_attention {
            Some(kernel) => format!("{} [{kernel}]", self.name),
            None => self.name.clone(),
        }
    }
}

/// The mixed load at one step token budget with one prefill attention kernel.
#[derive(Serialize)]
pub struct MixedLoadRun {
    pub prefill_attention: String,
    #[serde(flatten)]
    pub load: MixedLoad,
    /// TPOT while the prompt prefills over TPOT alone (the target: at most 1.5).
    pub slowdown: f64,
}

#[derive(Serialize)]
pub struct GpuReport {
    pub device: String,
    pub copy_gb_per_s: f64,
    pub bf16_tflop_per_s: f64,
    pub checks: Vec<Check>,
    pub timings: Vec<Timing>,
    pub mixed_load: Vec<MixedLoadRun>,
}

type Result<T> = std::result::Result<T, EngineError>;

pub fn run(options: &GpuBenchOptions) -> Result<GpuReport> {
    let backend = CudaBackend::new(options.ordinal, 0.9)?;
    let device = format!(
        "{} (sm_{}{}, {:.0} GiB)",
        backend.device_info().name,
        backend.device_info().compute_capability.0,
        backend.device_info().compute_capability.1,
        backend.device_info().total_memory as f64 / (1u64 << 30) as f64
    );
    eprintln!("[1/4] ceilings on {device}");
    let copy = copy_bandwidth(&backend)?;
    let tflops = matrix_rate(&backend)?;
    let mut checks = Vec::new();
    eprintln!("[2/4] paged attention against a float64 reference, prefill by each kernel");
    for kernel in PREFILL_KERNELS {
        backend.set_prefill_attention(kernel)?;
        for (heads, kv_heads, head_dim) in [(9, 3, 64), (32, 8, 128)] {
            checks.push(attention_check(
                &backend, kernel, heads, kv_heads, head_dim,
            )?);
        }
    }
    eprintln!("[3/4] CUDA against the CPU backend, prefill by each kernel");
    let ordinal = options.ordinal;
    for model in &options.models {
        checks.extend(logits_checks(ordinal, model)?);
        for kernel in PREFILL_KERNELS {
            checks.push(batch_invariance_check(ordinal, kernel, model)?);
        }
        checks.extend(greedy_checks(options, model)?);
    }
    let (mut timings, mut mixed) = (Vec::new(), Vec::new());
    if !options.skip_speed {
        eprintln!("[4/4] Llama-3-8B shape, random bf16 weights");
        drop(backend);
        (timings, mixed) = llama3_8b_timings(options.ordinal, copy, tflops)?;
    }
    Ok(GpuReport {
        device,
        copy_gb_per_s: copy / 1e9,
        bf16_tflop_per_s: tflops / 1e12,
        checks,
        timings,
        mixed_load: mixed,
    })
}

/// The prefill attention kernels every check and prefill timing runs with.
const PREFILL_KERNELS: [PrefillAttention; 2] = [PrefillAttention::Legacy, PrefillAttention::Fa];

/// A CUDA backend on GPU `ordinal` computing prefill attention with `kernel`.
fn cuda(ordinal: usize, memory_fraction: f64, kernel: PrefillAttention) -> Result<CudaBackend> {
    let backend = CudaBackend::new(ordinal, memory_fraction)?;
    backend.set_prefill_attention(kernel)?;
    Ok(backend)
}

impl GpuReport {
    pub fn table(&self) -> String {
        let mut s = format!(
            "device: {}\ncopy bandwidth {:.0} GB/s (read + write), bf16 matrix rate {:.0} TFLOP/s\n\n",
            self.device, self.copy_gb_per_s, self.bf16_tflop_per_s
        );
        s += &format!("{:<58} {:<6} {}\n", "check", "result", "detail");
        for c in &self.checks {
            let r = if c.passed { "PASS" } else { "FAIL" };
            s += &format!("{:<58} {:<6} {}\n", c.name, r, c.detail);
        }
        if !self.timings.is_empty() {
            s += &format!("\n{:<58} {:>12} {:>10}\n", "timing", "value", "roofline");
            for t in &self.timings {
                s += &format!(
                    "{:<58} {:>8.1} {:<4}{:>9.0}%\n",
                    t.label(),
                    t.value,
                    t.unit,
                    100.0 * t.of_roofline
                );
            }
        }
        if !self.mixed_load.is_empty() {
            s += &format!(
                "\nmixed load: TPOT of {MIXED_DECODES} decodes ({MIXED_CONTEXT}-token contexts) while a \
                 {MIXED_PROMPT}-token prompt prefills beside them\n{:<8} {:>12} {:>10} {:>10} {:>9} {:>10} {:>12} {:>7}\n",
                "kernel",
                "step tokens",
                "alone ms",
                "mixed ms",
                "mixed/alone",
                "worst ms",
                "prefill ms",
                "steps"
            );
            for m in &self.mixed_load {
                let l = &m.load;
                s += &format!(
                    "{:<8} {:>12} {:>10.2} {:>10.2} {:>11.2} {:>10.2} {:>12.1} {:>7}\n",
                    m.prefill_attention,
                    l.step_tokens,
                    l.tpot_alone_ms,
                    l.tpot_mixed_ms,
                    m.slowdown,
                    l.worst_step_ms,
                    l.prefill_ms,
                    l.chunk_steps
                );
            }
        }
        s
    }

    pub fn all_passed(&self) -> bool {
        self.checks.iter().all(|c| c.passed)
    }
}

/// Seconds per call of `f`, after warm-up, with the device synchronized around the timed calls.
fn time<B: Backend>(backend: &B, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..2 {
        f()?;
    }
    backend.sync()?;
    let start = Instant::now();
    for _ in 0..reps {
        f()?;
    }
    backend.sync()?;
    Ok(start.elapsed().as_secs_f64() / reps as f64)
}

fn bf16_bytes(values: &[f32]) -> Vec<u8> {
    bf16_bits(values)
        .iter()
        .flat_map(|b| b.to_le_bytes())
        .collect()
}

/// Device-to-device copy bandwidth in bytes/s, counting bytes read and written.
fn copy_bandwidth(backend: &CudaBackend) -> Result<f64> {
    let len = 1usize << 31;
    let stream = backend.stream();
    let driver = |e: cudarc::driver::DriverError| EngineError::Device(e.to_string());
    let src = stream.alloc_zeros::<u8>(len).map_err(driver)?;
    let mut dst = stream.alloc_zeros::<u8>(len).map_err(driver)?;
    let secs = time(backend, 10, || {
        stream.memcpy_dtod(&src, &mut dst).map_err(driver)
    })?;
    Ok(2.0 * len as f64 / secs)
}

/// cuBLAS bf16 matrix rate in FLOP/s on 8192³ random operands.
fn matrix_rate(backend: &CudaBackend) -> Result<f64> {
    let n = 8192;
    let mut noise = Uniform::new(11);
    let w = backend.load_matrix(
        "rate.w",
        QuantType::BF16,
        n,
        n,
        WeightBytes::from_vec(bf16_bytes(&noise.values(n * n))),
    )?;
    let x = backend
        .stream()
        .clone_htod(&bf16_bits(&noise.values(n * n)))
        .map_err(|e| EngineError::Device(e.to_string()))?;
    let mut out = backend.alloc(n, n);
    let secs = time(backend, 10, || {
        backend.gemm_bf16(&w, &x, n, &mut out);
        Ok(())
    })?;
    Ok(2.0 * (n as f64).powi(3) / secs)
}

/// Attention over random K/V for ragged sequences (decode rows across partitions, prefill with
/// a cached prefix), compared with a float64 reference over the same bf16 values.
fn attention_check(
    backend: &CudaBackend,
    kernel: PrefillAttention,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<Check> {
    let block_size = 16;
    let num_blocks = 256;
    let layout = KvLayout {
        num_layers: 2,
        num_kv_heads: kv_heads,
        head_dim,
        block_size,
        num_blocks,
        dtype: KvDtype::Bf16,
    };
    let layer = 1;
    let mut noise = Uniform::new(heads as u64 * 1000 + head_dim as u64);
    let mut kv = backend.alloc_kv(layout)?;
    let chunk = 2 * kv_heads * block_size * head_dim;
    let mut host_kv = vec![0f32; num_blocks * chunk];
    for b in 0..num_blocks {
        let values: Vec<f32> = noise
            .values(chunk)
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        backend.write_kv_block(&mut kv, layer, b, &bf16_bytes(&values));
        host_kv[b * chunk..(b + 1) * chunk].copy_from_slice(&values);
    }
    // (start position, new tokens): decode rows at 1 to 3 partitions, prefill with and without
    // a cached prefix, ragged lengths.
    let shapes = [
        (0usize, 37usize),
        (700, 1),
        (1300, 1),
        (64, 70),
        (5, 1),
        (511, 2),
    ];
    let mut next_block = 0u32;
    let tables: Vec<Vec<u32>> = shapes
        .iter()
        .map(|&(start, len)| {
            let n = (start + len).div_ceil(block_size) as u32;
            // Blocks in a scattered order, as a real pool hands them out.
            let t: Vec<u32> = (0..n)
                .map(|i| (next_block + i * 7) % num_blocks as u32)
                .collect();
            next_block += 1;
            t
        })
        .collect();
    let tokens: Vec<Vec<u32>> = shapes.iter().map(|&(_, len)| vec![1; len]).collect();
    let inputs: Vec<SeqInput<'_>> = shapes
        .iter()
        .zip(&tables)
        .zip(&tokens)
        .map(|((&(start, _), table), tokens)| SeqInput {
            tokens,
            start_pos: start,
            block_table: table,
            logits: LogitsWanted::None,
        })
        .collect();
    let batch = ForwardBatch::new(&inputs, block_size, num_blocks, 2, 1 << 20)?;
    let rows = batch.num_rows();
    let q_host = noise.values(rows * heads * head_dim);
    let q = backend.upload_activations(rows, heads * head_dim, &q_host)?;
    let mut out = backend.upload_activations(
        rows,
        heads * head_dim,
        &vec![f32::NAN; rows * heads * head_dim],
    )?;
    let shape = AttentionShape {
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
    };
    let prepared = backend.prepare_batch(&batch);
    backend.attention(&q, &kv, layer, shape, &prepared, &mut out);
    let got = backend.to_host(out);
    backend.sync()?;

    // K of (block, slot, kv head) at chunk-relative [0][h][s][d], V at [1][h][s][d].
    let at = |block: u32, slot: usize, kvh: usize, which: usize, d: usize| {
        host_kv
            [block as usize * chunk + ((which * kv_heads + kvh) * block_size + slot) * head_dim + d]
            as f64
    };
    let (mut err2, mut ref2, mut unwritten) = (0f64, 0f64, 0usize);
    for r in 0..rows {
        let seq = batch.row_seq[r] as usize;
        let table = &tables[seq];
        let pos = batch.positions[r] as usize;
        for h in 0..heads {
            let kvh = h / (heads / kv_heads);
            let qv = &q_host[(r * heads + h) * head_dim..(r * heads + h + 1) * head_dim];
            let scores: Vec<f64> = (0..=pos)
                .map(|t| {
                    let (b, s) = (table[t / block_size], t % block_size);
                    (0..head_dim)
                        .map(|d| qv[d] as f64 * at(b, s, kvh, 0, d))
                        .sum::<f64>()
                        / (head_dim as f64).sqrt()
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::MIN, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            for d in 0..head_dim {
                let expected: f64 = (0..=pos)
                    .map(|t| weights[t] * at(table[t / block_size], t % block_size, kvh, 1, d))
                    .sum::<f64>()
                    / total;
                let v = got[(r * heads + h) * head_dim + d] as f64;
                if !v.is_finite() {
                    unwritten += 1;
                }
                err2 += (v - expected).powi(2);
                ref2 += expected.powi(2);
            }
        }
    }
    let rel = (err2 / ref2).sqrt();
    // fa's Q and P are one bf16 term each (~1e-3 from float64 by themselves); legacy's two.
    let bound = match kernel {
        PrefillAttention::Legacy => 1e-3,
        PrefillAttention::Fa => 2e-3,
    };
    Ok(Check {
        name: format!(
            "paged attention vs f64, {kernel} prefill, {heads}/{kv_heads} heads, head_dim {head_dim}"
        ),
        passed: unwritten == 0 && rel <= bound,
        detail: format!(
            "‖Δ‖/‖ref‖ = {rel:.2e} (bound {bound:.0e}), {unwritten} unwritten of {}",
            got.len()
        ),
    })
}

/// Last-position logits of a fixed prompt on the CPU backend and on the GPU with each prefill
/// attention kernel.
fn logits_checks(ordinal: usize, path: &std::path::Path) -> Result<Vec<Check>> {
    let files = open_model(path)?;
    let vocab = files.config.vocab_size as u32;
    let tokens: Vec<u32> = (0..40u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let cpu = last_logits(Llama::load(CpuBackend::new(0), &files)?, &tokens)?;
    let norm: f64 = cpu.iter().map(|a| (*a as f64).powi(2)).sum();
    // The token greedy sampling would pick from each.
    let argmax = duet_engine::sampling::argmax;
    PREFILL_KERNELS
        .iter()
        .map(|&kernel| {
            let gpu = last_logits(Llama::load(cuda(ordinal, 0.5, kernel)?, &files)?, &tokens)?;
            let err: f64 = cpu
                .iter()
                .zip(&gpu)
                .map(|(a, b)| ((a - b) as f64).powi(2))
                .sum();
            let rel = (err / norm).sqrt();
            Ok(Check {
                name: format!("logits CUDA vs CPU, {kernel} prefill, {}", file_name(path)),
                passed: rel <= 1e-2 && gpu.iter().all(|v| v.is_finite()),
                detail: format!(
                    "‖Δ‖/‖ref‖ = {rel:.2e}, argmax {} vs {}",
                    argmax(&gpu),
                    argmax(&cpu)
                ),
            })
        })
        .collect()
}

/// Whether `Backend::batch_invariant`, which speculative decoding needs, says what the CUDA
/// backend does: a draft's positions verified in one step beside other sequences against the
/// same positions decoded alone. A backend that does not claim it passes either way; the detail
/// says whether it could.
fn batch_invariance_check(
    ordinal: usize,
    kernel: PrefillAttention,
    path: &std::path::Path,
) -> Result<Check> {
    let model = Llama::load(cuda(ordinal, 0.5, kernel)?, &open_model(path)?)?;
    let claimed = model.backend().batch_invariant();
    let measured = crate::row_invariance::row_invariance(&model)?;
    Ok(Check {
        name: format!(
            "batch_invariant ({claimed}) as measured, {kernel} prefill, {}",
            file_name(path)
        ),
        passed: !claimed || measured.holds(),
        detail: format!(
            "{} of {} verified positions differ from decoding alone, max |Δ| {:.2e}",
            measured.differing_rows, measured.rows, measured.max_abs_diff
        ),
    })
}

fn last_logits<B: Backend>(model: Llama<B>, tokens: &[u32]) -> Result<Vec<f32>> {
    let block_size = 16;
    let num_blocks = tokens.len().div_ceil(block_size);
    // The most precise KV type each backend keeps (f32 on a CPU, bf16 on a GPU).
    let dtype = model.backend().kv_dtype(KvDtypeChoice::Auto, true)?;
    let mut kv = model
        .backend()
        .alloc_kv(model.kv_layout(block_size, num_blocks, dtype))?;
    let table: Vec<u32> = (0..num_blocks as u32).collect();
    let c = model.config();
    let batch = ForwardBatch::new(
        &[SeqInput {
            tokens,
            start_pos: 0,
            block_table: &table,
            logits: LogitsWanted::Last,
        }],
        block_size,
        num_blocks,
        c.vocab_size,
        c.max_position_embeddings,
    )?;
    Ok(model
        .forward(&batch, &mut kv, &mut |_, _| {})?
        .row(0)
        .to_vec())
}

/// Greedy continuations through the engine (paged cache, scheduling and all) on the CPU and on
/// the GPU with each prefill attention kernel.
fn greedy_checks(options: &GpuBenchOptions, path: &std::path::Path) -> Result<Vec<Check>> {
    let run = |device: Device, prefill_attention: PrefillAttention| -> Result<Vec<Vec<u32>>> {
        let engine = LoadedEngine::load(
            path,
            EngineOptions {
                device,
                kv_cache_tokens: 4096,
                prefill_attention,
                ..Default::default()
            },
        )?;
        engine.run(Greedy(&options.prompts))
    };
    let cpu = run(Device::Cpu, PrefillAttention::default())?;
    let mut checks = Vec::new();
    for kernel in PREFILL_KERNELS {
        let gpu = run(Device::Cuda(options.ordinal), kernel)?;
        checks.extend(
            options
                .prompts
                .iter()
                .zip(cpu.iter().zip(&gpu))
                .map(|(prompt, (c, g))| Check {
                    name: format!(
                        "greedy tokens CUDA == CPU, {kernel} prefill, {}: {prompt:?}",
                        file_name(path)
                    ),
                    passed: c == g,
                    detail: if c == g {
                        format!("{} tokens", c.len())
                    } else {
                        format!("cpu {c:?} / cuda {g:?}")
                    },
                }),
        );
    }
    Ok(checks)
}

struct Greedy<'a>(&'a [String]);

impl crate::WithEngine for Greedy<'_> {
    type Output = Result<Vec<Vec<u32>>>;

    fn run<B: Backend + 'static>(self, mut engine: duet_engine::engine::Engine<B>) -> Self::Output {
        self.0
            .iter()
            .map(|prompt| {
                let tokens = engine.encode(prompt)?;
                let stop = StopCriteria {
                    max_tokens: 24,
                    ..Default::default()
                };
                let id = engine.add_sequence(tokens, SamplingParams::greedy(), stop)?;
                let mut out = Vec::new();
                loop {
                    let steps = engine.step()?;
                    let Some(s) = steps.into_iter().find(|s| s.seq == id) else {
                        continue;
                    };
                    out.push(s.token.token);
                    if s.finish.is_some() {
                        break;
                    }
                }
                engine.remove_sequence(id)?;
                Ok(out)
            })
            .collect()
    }
}

fn file_name(path: &std::path::Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

/// The Llama-3-8B shape the issue names.
pub fn llama3_8b() -> ModelConfig {
    let json = r#"{"model_type":"llama","architectures":["LlamaForCausalLM"],"hidden_size":4096,
        "intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,
        "num_key_value_heads":8,"vocab_size":128256,"rms_norm_eps":1e-5,"rope_theta":500000.0,
        "max_position_embeddings":8192,"tie_word_embeddings":false}"#;
    ModelConfig::from_hf_json(json, "llama-3-8b shape").expect("a valid config")
}

/// The mixed load: decoding sequences, their contexts, the prompt prefilled beside them, and the
/// step token budgets tried.
const MIXED_DECODES: usize = 32;
const MIXED_CONTEXT: usize = 512;
const MIXED_PROMPT: usize = 8192;
const MIXED_STEP_TOKENS: [usize; 5] = [256, 512, 1024, 2048, 4096];

fn llama3_8b_timings(
    ordinal: usize,
    copy: f64,
    matrix_rate: f64,
) -> Result<(Vec<Timing>, Vec<MixedLoadRun>)> {
    let c = llama3_8b();
    let model = Llama::synthetic(CudaBackend::new(ordinal, 0.9)?, c.clone(), 7)?;
    let b = model.backend();
    let block_size = 16;
    let (batch, context) = (64usize, 1024usize);
    let num_blocks = batch * (context + 64).div_ceil(block_size) + 256;
    let mut kv = b.alloc_kv(model.kv_layout(block_size, num_blocks, KvDtype::Bf16))?;
    let kv_bytes_per_token = (c.num_layers * 2 * c.kv_dim() * 2) as f64;
    let matmul_params = c.matmul_params() as f64;
    // Per step every weight is read once (the embedding rows read are negligible).
    let weight_bytes = 2.0 * matmul_params;

    let step = |kv: &mut duet_cuda::backend::CudaKvStore,
                seqs: usize,
                start: usize,
                len: usize|
     -> Result<f64> {
        let per_seq = (start + len).div_ceil(block_size);
        let tables: Vec<Vec<u32>> = (0..seqs)
            .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
            .collect();
        let tokens: Vec<Vec<u32>> = (0..seqs)
            .map(|s| {
                (0..len)
                    .map(|i| ((s * 31 + i * 7) % c.vocab_size) as u32)
                    .collect()
            })
            .collect();
        let inputs: Vec<SeqInput<'_>> = tables
            .iter()
            .zip(&tokens)
            .map(|(table, tokens)| SeqInput {
                tokens,
                start_pos: start,
                block_table: table,
                logits: LogitsWanted::Last,
            })
            .collect();
        let fb = ForwardBatch::new(
            &inputs,
            block_size,
            num_blocks,
            c.vocab_size,
            c.max_position_embeddings,
        )?;
        time(b, 10, || model.forward(&fb, kv, &mut |_, _| {}).map(|_| ()))
    };

    let t1 = step(&mut kv, 1, 128, 1)?;
    let roof1 = (weight_bytes + 129.0 * kv_bytes_per_token) / copy;
    let t64 = step(&mut kv, batch, context, 1)?;
    let roof64 = (weight_bytes + (batch * (context + 1)) as f64 * kv_bytes_per_token) / copy;
    let mut timings = vec![
        Timing {
            name: "decode, batch 1, context 128 (tokens/s)".into(),
            prefill_attention: None,
            value: 1.0 / t1,
            unit: "tok/s",
            of_roofline: roof1 / t1,
        },
        Timing {
            name: "decode, batch 64, context 1024 (tokens/s)".into(),
            prefill_attention: None,
            value: batch as f64 / t64,
            unit: "tok/s",
            of_roofline: roof64 / t64,
        },
    ];
    // Causal: half of the n x n scores, two products of head_dim each.
    let attention_flops =
        |n: usize| (4 * c.num_layers * c.num_heads * c.head_dim) as f64 * (n * n) as f64 / 2.0;
    for kernel in PREFILL_KERNELS {
        b.set_prefill_attention(kernel)?;
        for n in [2048usize, 8192] {
            let tp = step(&mut kv, 1, 0, n)?;
            let prefill_flops = 2.0 * matmul_params * n as f64 + attention_flops(n);
            timings.push(Timing {
                name: format!("prefill, one {n}-token prompt (ms)"),
                prefill_attention: Some(kernel.to_string()),
                value: tp * 1e3,
                unit: "ms",
                of_roofline: prefill_flops / tp / matrix_rate,
            });
            if n == 2048 {
                let ta = prefill_attention_time(b, &c, &kv, n)?;
                timings.push(Timing {
                    name: "  of which attention, all layers (ms)".into(),
                    prefill_attention: Some(kernel.to_string()),
                    value: ta * 1e3,
                    unit: "ms",
                    of_roofline: attention_flops(n) / ta / matrix_rate,
                });
            }
        }
    }
    drop(kv);

    let shape = MixedLoadShape {
        decodes: MIXED_DECODES,
        decode_context: MIXED_CONTEXT,
        prompt_tokens: MIXED_PROMPT,
        alone_steps: 20,
    };
    // The smallest budget takes the most steps, so the most KV.
    let blocks = shape.blocks_needed(block_size, MIXED_STEP_TOKENS[0]);
    let layout = model.kv_layout(block_size, blocks, KvDtype::Bf16);
    let mut runner = ModelRunner::new(model, layout)?;
    let mut mixed = Vec::new();
    for kernel in PREFILL_KERNELS {
        runner.model().backend().set_prefill_attention(kernel)?;
        for budget in MIXED_STEP_TOKENS {
            let load = mixed_load(&mut runner, &shape, budget)?;
            mixed.push(MixedLoadRun {
                prefill_attention: kernel.to_string(),
                slowdown: load.slowdown(),
                load,
            });
        }
    }
    Ok((timings, mixed))
}

/// Seconds of the prefill attention alone for one `n`-token prompt, over every layer: the share
/// of the prefill that is ours rather than cuBLAS's.
fn prefill_attention_time(
    b: &CudaBackend,
    c: &ModelConfig,
    kv: &duet_cuda::backend::CudaKvStore,
    n: usize,
) -> Result<f64> {
    let block_size = kv.layout().block_size;
    let table: Vec<u32> = (0..n.div_ceil(block_size) as u32).collect();
    let tokens = vec![1u32; n];
    let inputs = [SeqInput {
        tokens: &tokens,
        start_pos: 0,
        block_table: &table,
        logits: LogitsWanted::None,
    }];
    let fb = ForwardBatch::new(
        &inputs,
        block_size,
        kv.layout().num_blocks,
        c.vocab_size,
        c.max_position_embeddings,
    )?;
    let prepared = b.prepare_batch(&fb);
    let width = c.num_heads * c.head_dim;
    let q = b.upload_activations(n, width, &Uniform::new(5).values(n * width))?;
    let mut out = b.alloc(n, width);
    let shape = AttentionShape {
        num_heads: c.num_heads,
        num_kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
    };
    time(b, 10, || {
        for layer in 0..c.num_layers {
            b.attention(&q, kv, layer, shape, &prepared, &mut out);
        }
        Ok(())
    })
}
