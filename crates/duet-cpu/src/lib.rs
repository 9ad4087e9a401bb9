//! The CPU backend: quantized weights used in place, f32 activations, an f32 or f16 paged KV
//! store, every op split over the kernel thread pool.

mod attention;
mod huge_pages;
mod kv_store;
pub mod quant;
pub mod threadpool;
mod vector;

use std::path::Path;
use std::sync::{Arc, OnceLock};

use crate::quant::{KernelPath, QMatrix, QuantType};
use crate::threadpool::ThreadPool;
use duet_engine::EngineError;
use duet_engine::backend::{AttentionShape, Backend, KvDtype, KvDtypeChoice, KvLayout, StepRows};
use duet_engine::batch::ForwardBatch;
use duet_engine::engine::{Engine, EngineOptions};
use duet_model::model_files::{RawTensor, open_model};
use duet_model::storage::WeightBytes;

pub use kv_store::CpuKvStore;

/// Row-major f32 activations.
#[derive(Clone, Debug, PartialEq)]
pub struct CpuTensor {
    pub data: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
}

impl CpuTensor {
    fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

pub struct CpuBackend {
    pool: Arc<ThreadPool>,
    kernels: KernelPath,
}

impl CpuBackend {
    /// A backend with `threads` kernel threads (0: one per core) on the best kernels this CPU
    /// supports. Backends in one process with the same thread count share one pool, so engines
    /// living side by side (`duet up` runs a prefill and a decode worker in one process) take
    /// turns instead of oversubscribing cores.
    pub fn new(threads: usize) -> Self {
        Self::with_kernels(threads, KernelPath::detect())
    }

    /// [`CpuBackend::new`] on a kernel path this CPU supports (see [`KernelPath::choose`]).
    pub fn with_kernels(threads: usize, kernels: KernelPath) -> Self {
        assert!(
            kernels.supported(),
            "{kernels:?} kernels on a CPU without them"
        );
        Self {
            pool: shared_pool(threads),
            kernels,
        }
    }

    pub fn kernels(&self) -> KernelPath {
        self.kernels
    }

    pub fn threads(&self) -> usize {
        self.pool.n_threads()
    }

    pub fn pool(&self) -> &ThreadPool {
        &self.pool
    }
}

fn shared_pool(threads: usize) -> Arc<ThreadPool> {
    static POOLS: std::sync::Mutex<Vec<Arc<ThreadPool>>> = std::sync::Mutex::new(Vec::new());
    let n = if threads == 0 {
        crate::threadpool::default_threads()
    } else {
        threads
    };
    let mut pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = pools.iter().find(|p| p.n_threads() == n) {
        return p.clone();
    }
    let pool = Arc::new(ThreadPool::new(n));
    pools.push(pool.clone());
    pool
}

/// Loads a model (GGUF file or HF directory) into an engine on the CPU backend.
pub fn load_engine(path: &Path, options: EngineOptions) -> Result<Engine<CpuBackend>, EngineError> {
    let files = open_model(path)?;
    let kernels = KernelPath::choose(options.cpu_kernels)?;
    Engine::with_backend(
        CpuBackend::with_kernels(options.threads, kernels),
        files,
        options,
    )
}

/// Rows below which an elementwise op is not worth dispatching to the pool.
const PARALLEL_ROWS: usize = 16;

impl Backend for CpuBackend {
    type Matrix = QMatrix;
    type Vector = Vec<f32>;
    type Activations = CpuTensor;
    type KvStore = CpuKvStore;
    type Batch<'a> = CpuBatch<'a>;

    fn name(&self) -> &'static str {
        "cpu"
    }

    /// Every kernel path is bit-identical for a row alone and in any batch (tested in
    /// `duet-engine`'s golden tests and the attention kernels' own).
    fn batch_invariant(&self) -> bool {
        true
    }

    /// Kernels split their work over every thread of the pool; a core is free only when the pool
    /// has fewer threads than the process has cores (`--threads`).
    fn host_core_free_during_forward(&self) -> bool {
        self.pool.n_threads() < crate::threadpool::default_threads()
    }

    /// The same kernel path and thread pool: the draft model's steps take turns with the
    /// target's.
    fn sibling(&self) -> Option<Self> {
        Some(Self {
            pool: self.pool.clone(),
            kernels: self.kernels,
        })
    }

    fn kv_dtype(&self, choice: KvDtypeChoice, f32_weights: bool) -> Result<KvDtype, EngineError> {
        match choice.fixed() {
            Some(KvDtype::Bf16) => Err(EngineError::Config(
                "the CPU KV cache stores f32 or f16, not bf16 (--kv-dtype)".into(),
            )),
            Some(KvDtype::Fp8E4m3) => Err(EngineError::Config(
                "--kv-dtype fp8 is a CUDA KV cache (--device cuda); the CPU's stores f32, f16 or \
                 int8"
                    .into(),
            )),
            Some(d) => Ok(d),
            // f32 weights keep their precision end to end (the tiny fixtures check logits to
            // 1e-4); quantized weights already round far more than f16 does.
            None if f32_weights => Ok(KvDtype::F32),
            None => Ok(KvDtype::F16),
        }
    }

    fn load_matrix(
        &self,
        name: &str,
        ty: QuantType,
        rows: usize,
        cols: usize,
        bytes: WeightBytes,
    ) -> Result<QMatrix, EngineError> {
        QMatrix::new(ty, rows, cols, bytes)
            .map_err(|e| EngineError::Weights(format!("tensor {name}: {e}")))
    }

    fn load_stacked_matrix(&self, parts: &[RawTensor]) -> Result<Option<QMatrix>, EngineError> {
        let Some(first) = parts.first() else {
            return Ok(None);
        };
        // A part of another type or width, or whose bytes are not its rows, loads on its own
        // (where a wrong size is an error naming it).
        let whole =
            |t: &RawTensor| t.ty.row_bytes(t.cols).map(|rb| rb * t.rows) == Some(t.bytes.len());
        if parts
            .iter()
            .any(|t| t.ty != first.ty || t.cols != first.cols || !whole(t))
        {
            return Ok(None);
        }
        // GGML rows are whole blocks, so the parts' bytes one after another are the stack's.
        let mut bytes = Vec::with_capacity(parts.iter().map(|t| t.bytes.len()).sum());
        for t in parts {
            bytes.extend_from_slice(&t.bytes);
        }
        let rows = parts.iter().map(|t| t.rows).sum();
        let names: Vec<&str> = parts.iter().map(|t| t.name.as_str()).collect();
        self.load_matrix(
            &names.join(" + "),
            first.ty,
            rows,
            first.cols,
            WeightBytes::from_vec(bytes),
        )
        .map(Some)
    }

    fn matrix_rows(&self, m: &QMatrix) -> usize {
        m.rows()
    }

    fn load_vector(&self, values: Vec<f32>) -> Result<Vec<f32>, EngineError> {
        Ok(values)
    }

    fn alloc_kv(&self, layout: KvLayout) -> Result<CpuKvStore, EngineError> {
        CpuKvStore::new(layout)
    }

    fn kv_block_bytes(&self, kv: &CpuKvStore) -> usize {
        kv.layer_block_bytes()
    }

    fn read_kv_block(&self, kv: &CpuKvStore, layer: usize, block: usize, out: &mut [u8]) {
        kv.read_layer_block(layer, block, out);
    }

    fn write_kv_block(&self, kv: &mut CpuKvStore, layer: usize, block: usize, data: &[u8]) {
        kv.write_layer_block(layer, block, data);
    }

    /// Keys stay transposed: bringing a block up from a tier is a copy.
    fn read_stored_block(&self, kv: &CpuKvStore, block: usize, out: &mut [u8]) {
        kv.read_stored_block(block, out);
    }

    fn write_stored_block(&self, kv: &mut CpuKvStore, block: usize, data: &[u8]) {
        kv.write_stored_block(block, data);
    }

    type StepTurn<'a> = crate::threadpool::Turn<'a>;

    fn step_turn(&self) -> crate::threadpool::Turn<'_> {
        self.pool.turn()
    }

    fn prepare_batch<'a>(&self, batch: &'a ForwardBatch) -> CpuBatch<'a> {
        CpuBatch {
            forward: batch,
            rope: OnceLock::new(),
        }
    }

    /// Zeros, as [`Backend::alloc_zeroed`] needs.
    fn alloc(&self, rows: usize, cols: usize) -> CpuTensor {
        CpuTensor {
            data: vec![0.0; rows * cols],
            rows,
            cols,
        }
    }

    fn step_rows(&self, batch: &CpuBatch<'_>) -> StepRows {
        StepRows {
            rows: batch.forward.num_rows(),
            logit_rows: batch.forward.logit_rows.len(),
        }
    }

    fn embed(&self, table: &QMatrix, batch: &CpuBatch<'_>, out: &mut CpuTensor) {
        let tokens = &batch.forward.tokens;
        debug_assert_eq!(out.rows, tokens.len());
        for (t, row) in tokens.iter().zip(out.data.chunks_exact_mut(out.cols)) {
            table.row_f32(*t as usize, row);
        }
    }

    fn rms_norm(&self, x: &CpuTensor, w: &Vec<f32>, eps: f32, out: &mut CpuTensor) {
        let cols = x.cols;
        self.for_rows(x.rows, &mut out.data, cols, |rows, os| {
            let xs = &x.data[rows.start * cols..rows.end * cols];
            for (xr, or) in xs.chunks_exact(cols).zip(os.chunks_exact_mut(cols)) {
                vector::rms_norm(xr, w, eps, or);
            }
        });
    }

    fn head_rms_norm(&self, x: &mut CpuTensor, w: &Vec<f32>, head_dim: usize, eps: f32) {
        let mut normed = vec![0.0f32; head_dim];
        for head in x.data.chunks_exact_mut(head_dim) {
            vector::rms_norm(head, w, eps, &mut normed);
            head.copy_from_slice(&normed);
        }
    }

    fn matmul(&self, w: &QMatrix, x: &CpuTensor, out: &mut CpuTensor) {
        debug_assert_eq!(x.cols, w.cols());
        if out.rows != x.rows || out.cols != w.rows() {
            *out = self.alloc(x.rows, w.rows());
        }
        w.matmul_with(self.kernels, &x.data, x.rows, &mut out.data, &self.pool);
    }

    fn split_cols(&self, x: &CpuTensor, parts: &mut [&mut CpuTensor]) {
        let mut offset = 0;
        for p in parts.iter_mut() {
            debug_assert_eq!(p.rows, x.rows);
            for r in 0..x.rows {
                p.data[r * p.cols..(r + 1) * p.cols]
                    .copy_from_slice(&x.row(r)[offset..offset + p.cols]);
            }
            offset += p.cols;
        }
        debug_assert_eq!(offset, x.cols);
    }

    fn add_bias(&self, x: &mut CpuTensor, bias: &Vec<f32>) {
        for row in x.data.chunks_exact_mut(x.cols) {
            for (a, b) in row.iter_mut().zip(bias) {
                *a += b;
            }
        }
    }

    fn rope(
        &self,
        x: &mut CpuTensor,
        head_dim: usize,
        inv_freq: &Vec<f32>,
        attention_factor: f32,
        batch: &CpuBatch<'_>,
    ) {
        let computed;
        let new = || RopeTable::new(batch.forward, head_dim, inv_freq, attention_factor);
        let table = match batch.rope.get_or_init(new) {
            t if t.head_dim == head_dim && t.inv_freq == inv_freq.as_ptr() => t,
            _ => {
                computed = new();
                &computed
            }
        };
        let half = head_dim / 2;
        for (row, (cos, sin)) in x.data.chunks_exact_mut(x.cols).zip(
            table
                .cos
                .chunks_exact(half)
                .zip(table.sin.chunks_exact(half)),
        ) {
            for head in row.chunks_exact_mut(head_dim) {
                let (lo, hi) = head.split_at_mut(half);
                for i in 0..half {
                    let (a, b) = (lo[i], hi[i]);
                    lo[i] = a * cos[i] - b * sin[i];
                    hi[i] = b * cos[i] + a * sin[i];
                }
            }
        }
    }

    fn write_kv(
        &self,
        kv: &mut CpuKvStore,
        layer: usize,
        k: &CpuTensor,
        v: &CpuTensor,
        batch: &CpuBatch<'_>,
    ) {
        kv.write(layer, &k.data, &v.data, &batch.forward.slots);
    }

    fn attention(
        &self,
        q: &CpuTensor,
        kv: &CpuKvStore,
        layer: usize,
        shape: AttentionShape,
        batch: &CpuBatch<'_>,
        out: &mut CpuTensor,
    ) {
        attention::paged_attention(self, q, kv, layer, shape, batch.forward, out);
    }

    fn silu_mul(&self, gate: &mut CpuTensor, up: &CpuTensor) {
        let cols = gate.cols;
        self.for_rows(gate.rows, &mut gate.data, cols, |rows, gs| {
            let us = &up.data[rows.start * cols..rows.end * cols];
            for (g, &u) in gs.iter_mut().zip(us) {
                *g = vector::silu_mul(*g, u);
            }
        });
    }

    fn silu_mul_stacked(&self, gate_up: &CpuTensor, out: &mut CpuTensor) {
        let inter = gate_up.cols / 2;
        if out.rows != gate_up.rows || out.cols != inter {
            *out = self.alloc(gate_up.rows, inter);
        }
        let (stacked, path) = (gate_up.cols, self.kernels);
        self.for_rows(gate_up.rows, &mut out.data, inter, |rows, os| {
            let ins = &gate_up.data[rows.start * stacked..rows.end * stacked];
            for (o, row) in os.chunks_exact_mut(inter).zip(ins.chunks_exact(stacked)) {
                let (gate, up) = row.split_at(inter);
                vector::silu_mul_slices(path, gate, up, o);
            }
        });
    }

    fn add(&self, x: &mut CpuTensor, y: &CpuTensor) {
        for (a, b) in x.data.iter_mut().zip(&y.data) {
            *a += b;
        }
    }

    fn gather_rows(&self, x: &CpuTensor, rows: &[usize], out: &mut CpuTensor) {
        *out = CpuTensor {
            data: Vec::with_capacity(rows.len() * x.cols),
            rows: rows.len(),
            cols: x.cols,
        };
        for &r in rows {
            out.data.extend_from_slice(x.row(r));
        }
    }

    fn gather_logit_rows(&self, x: &CpuTensor, batch: &CpuBatch<'_>, out: &mut CpuTensor) {
        self.gather_rows(x, &batch.forward.logit_rows, out);
    }

    fn scatter_add_rows(
        &self,
        out: &mut CpuTensor,
        y: &CpuTensor,
        rows: &[usize],
        weights: &[f32],
    ) {
        let cols = out.cols;
        for (i, (&r, &w)) in rows.iter().zip(weights).enumerate() {
            let src = &y.data[i * cols..(i + 1) * cols];
            for (o, v) in out.data[r * cols..(r + 1) * cols].iter_mut().zip(src) {
                *o += w * v;
            }
        }
    }

    fn to_host(&self, x: CpuTensor) -> Vec<f32> {
        x.data
    }

    fn sync(&self) -> Result<(), EngineError> {
        Ok(())
    }
}

/// A step's batch on the CPU: the host metadata, and the rotary angles of its rows, computed by
/// the first layer and reused by the others.
pub struct CpuBatch<'a> {
    forward: &'a ForwardBatch,
    rope: OnceLock<RopeTable>,
}

/// `cos` and `sin` of every row's position times each rotary frequency, `[row][head_dim / 2]`.
struct RopeTable {
    head_dim: usize,
    /// Which frequencies it was made from (the model's one vector).
    inv_freq: *const f32,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

// The pointer only identifies the frequencies the table was made from; it is never read.
unsafe impl Send for RopeTable {}
unsafe impl Sync for RopeTable {}

impl RopeTable {
    fn new(batch: &ForwardBatch, head_dim: usize, inv_freq: &[f32], scale: f32) -> Self {
        let half = head_dim / 2;
        let n = batch.positions.len() * half;
        let (mut cos, mut sin) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for &pos in &batch.positions {
            for &f in &inv_freq[..half] {
                let (s, c) = (pos as f64 * f as f64).sin_cos();
                cos.push((c * scale as f64) as f32);
                sin.push((s * scale as f64) as f32);
            }
        }
        Self {
            head_dim,
            inv_freq: inv_freq.as_ptr(),
            cos,
            sin,
        }
    }
}

impl CpuBackend {
    /// Runs `f(rows, out_rows)` over `0..rows`, where `out_rows` is those rows of `out` (`cols`
    /// values each): on the pool in disjoint ranges when there are enough rows, else inline.
    fn for_rows(
        &self,
        rows: usize,
        out: &mut [f32],
        cols: usize,
        f: impl Fn(std::ops::Range<usize>, &mut [f32]) + Sync,
    ) {
        debug_assert_eq!(out.len(), rows * cols);
        if rows < PARALLEL_ROWS {
            return f(0..rows, out);
        }
        let out_ptr = SendPtr(out.as_mut_ptr());
        self.pool.for_each_range(rows, |r| {
            // SAFETY: ranges are disjoint rows of `out`.
            let os = unsafe { out_ptr.slice(r.start * cols, r.len() * cols) };
            f(r, os);
        });
    }
}

/// A raw pointer that may cross to the pool's threads; users split it into disjoint ranges.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr(pub *mut f32);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// # Safety
    /// The range must be in bounds and not accessed by anyone else meanwhile.
    pub(crate) unsafe fn slice<'a>(self, start: usize, len: usize) -> &'a mut [f32] {
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

#[cfg(test)]
mod synthetic_model {
    use duet_engine::backend::{Backend, KvDtype};
    use duet_engine::batch::{ForwardBatch, LogitsWanted, SeqInput};
    use duet_engine::llama::Llama;
    use duet_model::config::ModelConfig;

    use super::{CpuBackend, QuantType};

    fn tiny() -> ModelConfig {
        let json = r#"{"model_type":"llama","architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,
            "rms_norm_eps":1e-5,"max_position_embeddings":256,"tie_word_embeddings":false}"#;
        ModelConfig::from_hf_json(json, "synthetic").unwrap()
    }

    fn logits(seed: u64) -> Vec<f32> {
        let model = Llama::synthetic(
            CpuBackend::new(1),
            tiny(),
            QuantType::BF16,
            duet_model::fp8::Quantization::None,
            seed,
        )
        .unwrap();
        let mut kv =
            Backend::alloc_kv(model.backend(), model.kv_layout(4, 4, KvDtype::F32)).unwrap();
        let tokens = [1u32, 7, 42, 99, 3];
        let batch = ForwardBatch::new(
            &[SeqInput {
                tokens: &tokens,
                start_pos: 0,
                block_table: &[0, 1],
                logits: LogitsWanted::Last,
            }],
            4,
            4,
            100,
            256,
        )
        .unwrap();
        model
            .forward(&batch, &mut kv, &mut |_, _| {})
            .unwrap()
            .row(0)
            .to_vec()
    }

    #[test]
    fn a_synthetic_model_runs_and_is_determined_by_its_seed() {
        let a = logits(1);
        assert_eq!(a.len(), 100);
        assert!(a.iter().all(|v| v.is_finite()));
        // Unit-scale activations: the logits neither vanish nor explode.
        let rms = (a.iter().map(|v| v * v).sum::<f32>() / a.len() as f32).sqrt();
        assert!((0.05..50.0).contains(&rms), "logit rms {rms}");
        assert_eq!(a, logits(1));
        assert_ne!(a, logits(2));
    }

    #[test]
    fn an_fp8_kv_cache_is_refused_with_the_device_that_has_one() {
        use duet_engine::backend::KvDtypeChoice;
        let backend = CpuBackend::new(1);
        let e = backend
            .kv_dtype(KvDtypeChoice::Fp8, false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--kv-dtype fp8") && e.contains("--device cuda"),
            "{e}"
        );
        let model = Llama::synthetic(
            backend,
            tiny(),
            QuantType::BF16,
            duet_model::fp8::Quantization::None,
            1,
        )
        .unwrap();
        let layout = model.kv_layout(4, 4, KvDtype::Fp8E4m3);
        let e = Backend::alloc_kv(model.backend(), layout)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("not fp8"), "{e}");
    }
}

#[cfg(test)]
mod stacking {
    use duet_engine::backend::Backend;
    use duet_model::model_files::RawTensor;
    use duet_model::storage::WeightBytes;

    use super::{CpuBackend, QuantType};

    /// `rows × cols` Q8_0 weights: scale 1/64, quants counting up from `seed`.
    fn q8_0(name: &str, rows: usize, cols: usize, seed: u8) -> RawTensor {
        let mut bytes = Vec::new();
        for b in 0..rows * cols / 32 {
            bytes.extend_from_slice(&half::f16::from_f32(1.0 / 64.0).to_bits().to_le_bytes());
            bytes.extend((0..32u8).map(|i| seed.wrapping_add(i).wrapping_mul(b as u8 | 1)));
        }
        RawTensor {
            name: name.into(),
            ty: QuantType::Q8_0,
            rows,
            cols,
            bytes: WeightBytes::from_vec(bytes),
        }
    }

    /// A stack of stored tensors computes exactly what its parts compute one by one, and parts
    /// of different types are left to load separately.
    #[test]
    fn a_stack_is_its_parts_rows_one_after_another() {
        let backend = CpuBackend::new(2);
        let (q, k) = (q8_0("q", 48, 64, 3), q8_0("k", 16, 64, 90));
        let stacked = backend
            .load_stacked_matrix(&[q.clone(), k.clone()])
            .unwrap()
            .expect("same type and width stack");
        let x: Vec<f32> = (0..2 * 64).map(|i| (i as f32 * 0.37).sin()).collect();
        let product = |t: &RawTensor| {
            let m = backend
                .load_matrix(&t.name, t.ty, t.rows, t.cols, t.bytes.clone())
                .unwrap();
            let mut out = vec![0.0; 2 * t.rows];
            m.matmul(&x, 2, &mut out, backend.pool());
            out
        };
        let mut all = vec![0.0; 2 * 64];
        stacked.matmul(&x, 2, &mut all, backend.pool());
        let (pq, pk) = (product(&q), product(&k));
        for token in 0..2 {
            let row = &all[token * 64..][..64];
            assert_eq!(row[..48], pq[token * 48..][..48]);
            assert_eq!(row[48..], pk[token * 16..][..16]);
        }
        let f32_part = RawTensor {
            name: "v".into(),
            ty: QuantType::F32,
            rows: 1,
            cols: 64,
            bytes: WeightBytes::from_vec(vec![0; 64 * 4]),
        };
        assert!(
            backend
                .load_stacked_matrix(&[q.clone(), f32_part])
                .unwrap()
                .is_none()
        );
        // Bytes that are not the part's rows are not stacked (the total would hide them): the
        // part then fails to load on its own.
        let mut short = k.clone();
        short.rows = 15;
        assert!(backend.load_stacked_matrix(&[q, short]).unwrap().is_none());
    }
}
