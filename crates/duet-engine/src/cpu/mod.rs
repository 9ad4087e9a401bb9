//! The CPU backend: quantized weights used in place, f32 activations, an f32 paged KV store,
//! every op split over the kernel thread pool.

mod attention;
mod vector;

use std::sync::Arc;

use crate::EngineError;
use crate::backend::{AttentionShape, Backend, KvLayout};
use crate::batch::ForwardBatch;
use crate::quant::{QMatrix, QuantType};
use crate::storage::WeightBytes;
use crate::threadpool::ThreadPool;

pub use attention::CpuKvStore;

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
}

impl CpuBackend {
    /// A backend with `threads` kernel threads (0: one per core). Backends in one process with
    /// the same thread count share one pool, so engines living side by side (`duet up` runs a
    /// prefill and a decode worker in one process) take turns instead of oversubscribing cores.
    pub fn new(threads: usize) -> Self {
        Self {
            pool: shared_pool(threads),
        }
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

/// Rows below which an elementwise op is not worth dispatching to the pool.
const PARALLEL_ROWS: usize = 16;

impl Backend for CpuBackend {
    type Matrix = QMatrix;
    type Vector = Vec<f32>;
    type Activations = CpuTensor;
    type KvStore = CpuKvStore;
    type Batch<'a> = &'a ForwardBatch;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn kv_dtype(&self) -> &'static str {
        "f32"
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

    fn stack_matrices(&self, parts: &[&QMatrix]) -> Option<QMatrix> {
        let first = parts.first()?;
        if parts
            .iter()
            .any(|m| m.ty() != first.ty() || m.cols() != first.cols())
        {
            return None;
        }
        let rows: usize = parts.iter().map(|m| m.rows()).sum();
        let mut bytes = Vec::with_capacity(parts.iter().map(|m| m.size_bytes()).sum());
        for m in parts {
            for r in 0..m.rows() {
                bytes.extend_from_slice(&m.row_bytes_ggml(r));
            }
        }
        QMatrix::new(first.ty(), rows, first.cols(), WeightBytes::from_vec(bytes)).ok()
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
        kv.layer_block(0, 0).len() * 4
    }

    fn read_kv_block(&self, kv: &CpuKvStore, layer: usize, block: usize, out: &mut [u8]) {
        for (o, v) in out.chunks_exact_mut(4).zip(kv.layer_block(layer, block)) {
            o.copy_from_slice(&v.to_le_bytes());
        }
    }

    fn write_kv_block(&self, kv: &mut CpuKvStore, layer: usize, block: usize, data: &[u8]) {
        for (v, b) in kv
            .layer_block_mut(layer, block)
            .iter_mut()
            .zip(data.chunks_exact(4))
        {
            *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
    }

    fn prepare_batch<'a>(&self, batch: &'a ForwardBatch) -> &'a ForwardBatch {
        batch
    }

    fn alloc(&self, rows: usize, cols: usize) -> CpuTensor {
        CpuTensor {
            data: vec![0.0; rows * cols],
            rows,
            cols,
        }
    }

    fn embed(&self, table: &QMatrix, tokens: &[u32], out: &mut CpuTensor) {
        debug_assert_eq!(out.rows, tokens.len());
        for (t, row) in tokens.iter().zip(out.data.chunks_exact_mut(out.cols)) {
            table.row_f32(*t as usize, row);
        }
    }

    fn rms_norm(&self, x: &CpuTensor, w: &Vec<f32>, eps: f32, out: &mut CpuTensor) {
        let cols = x.cols;
        let run = |xs: &[f32], os: &mut [f32]| {
            for (xr, or) in xs.chunks_exact(cols).zip(os.chunks_exact_mut(cols)) {
                vector::rms_norm(xr, w, eps, or);
            }
        };
        if x.rows < PARALLEL_ROWS {
            run(&x.data, &mut out.data);
        } else {
            let out_ptr = SendPtr(out.data.as_mut_ptr());
            self.pool.for_each_range(x.rows, |r| {
                // SAFETY: ranges are disjoint rows of `out`.
                let os = unsafe { out_ptr.slice(r.start * cols, r.len() * cols) };
                run(&x.data[r.start * cols..r.end * cols], os);
            });
        }
    }

    fn matmul(&self, w: &QMatrix, x: &CpuTensor, out: &mut CpuTensor) {
        debug_assert_eq!(x.cols, w.cols());
        if out.rows != x.rows || out.cols != w.rows() {
            *out = self.alloc(x.rows, w.rows());
        }
        w.matmul(&x.data, x.rows, &mut out.data, &self.pool);
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

    fn rope(&self, x: &mut CpuTensor, head_dim: usize, theta: f32, batch: &&ForwardBatch) {
        let cols = x.cols;
        let half = head_dim / 2;
        let inv_freq: Vec<f64> = (0..half)
            .map(|i| (theta as f64).powf(-((2 * i) as f64) / head_dim as f64))
            .collect();
        let mut cos = vec![0f32; half];
        let mut sin = vec![0f32; half];
        for (row, &pos) in x.data.chunks_exact_mut(cols).zip(&batch.positions) {
            for i in 0..half {
                let (s, c) = (pos as f64 * inv_freq[i]).sin_cos();
                cos[i] = c as f32;
                sin[i] = s as f32;
            }
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
        batch: &&ForwardBatch,
    ) {
        kv.write(layer, &k.data, &v.data, &batch.slots);
    }

    fn attention(
        &self,
        q: &CpuTensor,
        kv: &CpuKvStore,
        layer: usize,
        shape: AttentionShape,
        batch: &&ForwardBatch,
        out: &mut CpuTensor,
    ) {
        attention::paged_attention(&self.pool, q, kv, layer, shape, batch, out);
    }

    fn silu_mul(&self, gate: &mut CpuTensor, up: &CpuTensor) {
        for (g, u) in gate.data.iter_mut().zip(&up.data) {
            *g = *g / (1.0 + (-*g).exp()) * u;
        }
    }

    fn silu_mul_stacked(&self, gate_up: &CpuTensor, out: &mut CpuTensor) {
        let inter = gate_up.cols / 2;
        if out.rows != gate_up.rows || out.cols != inter {
            *out = self.alloc(gate_up.rows, inter);
        }
        for (o, row) in out
            .data
            .chunks_exact_mut(inter)
            .zip(gate_up.data.chunks_exact(gate_up.cols))
        {
            let (gate, up) = row.split_at(inter);
            for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
                *o = g / (1.0 + (-g).exp()) * u;
            }
        }
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

    fn to_host(&self, x: CpuTensor) -> Vec<f32> {
        x.data
    }

    fn sync(&self) -> Result<(), EngineError> {
        Ok(())
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
