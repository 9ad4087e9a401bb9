//! Shared helpers for the engine's golden tests: fixture paths and a one-call forward.

use std::path::PathBuf;

use duet_cpu::{CpuBackend, CpuKvStore};
use duet_engine::backend::{Backend, KvDtypeChoice};
use duet_engine::batch::{ForwardBatch, LogitsWanted, SeqInput};
use duet_engine::llama::{Llama, Logits};
use duet_model::fp8::Quantization;
use duet_model::model_files::open_model;
pub use duet_model::model_path::checkout_default_model;

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

pub fn read_json(name: &str) -> serde_json::Value {
    let path = fixtures().join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

pub fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// A model with its own KV store and a trivial block allocator (blocks handed out in order).
pub struct Harness {
    pub model: Llama<CpuBackend>,
    pub kv: CpuKvStore,
    pub block_size: usize,
    next_block: u32,
}

pub const BLOCK_SIZE: usize = 4;

impl Harness {
    /// With the KV type the engine picks for this model (f16 for quantized weights).
    pub fn load(path: &std::path::Path, threads: usize) -> Self {
        Self::load_with_kv(path, threads, KvDtypeChoice::Auto)
    }

    pub fn load_with_kv(path: &std::path::Path, threads: usize, kv: KvDtypeChoice) -> Self {
        Self::load_quantized(path, threads, kv, Quantization::None)
    }

    /// With the layers' projections quantized as `quantization` asks (`--quantization`).
    pub fn load_quantized(
        path: &std::path::Path,
        threads: usize,
        kv: KvDtypeChoice,
        quantization: Quantization,
    ) -> Self {
        let files = open_model(path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
        let model = Llama::load_quantized(CpuBackend::new(threads), &files, quantization).unwrap();
        let dtype = model
            .backend()
            .kv_dtype(kv, files.tensors.matrices_all_f32())
            .unwrap();
        let kv = model
            .backend()
            .alloc_kv(model.kv_layout(BLOCK_SIZE, 512, dtype))
            .unwrap();
        Self {
            model,
            kv,
            block_size: BLOCK_SIZE,
            next_block: 0,
        }
    }

    /// Fresh (non-contiguous, to exercise the block table) blocks for `tokens` positions.
    pub fn blocks_for(&mut self, tokens: usize) -> Vec<u32> {
        let n = tokens.div_ceil(self.block_size);
        // Hand out every other block so tables are never the identity.
        let out = (0..n as u32)
            .map(|i| self.next_block + 2 * i)
            .collect::<Vec<_>>();
        self.next_block += 2 * n as u32;
        out
    }

    pub fn forward(&mut self, inputs: &[SeqInput<'_>]) -> Logits {
        let cfg = self.model.config();
        let batch = ForwardBatch::new(
            inputs,
            self.block_size,
            512,
            cfg.vocab_size,
            cfg.max_position_embeddings,
        )
        .unwrap();
        self.model
            .forward(&batch, &mut self.kv, &mut |_, _| {})
            .unwrap()
    }

    /// Logits of every position of `tokens`, computed as one prompt.
    pub fn prompt_logits(&mut self, tokens: &[u32]) -> Vec<Vec<f32>> {
        let table = self.blocks_for(tokens.len());
        let l = self.forward(&[SeqInput {
            tokens,
            start_pos: 0,
            block_table: &table,
            logits: LogitsWanted::All,
        }]);
        (0..l.num_rows()).map(|i| l.row(i).to_vec()).collect()
    }
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// One prompt's reference logits (the fixtures' `cases`): at every position, or at the listed
/// `positions` of a long prompt.
pub struct Case {
    pub name: String,
    pub tokens: Vec<u32>,
    pub positions: Vec<usize>,
    pub logits: Vec<Vec<f32>>,
}

/// The cases of a reference logits file.
pub fn cases(file: &str) -> Vec<Case> {
    read_json(file)["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let tokens = ids(&c["token_ids"]);
            let positions = match c.get("positions") {
                Some(p) => ids(p).into_iter().map(|p| p as usize).collect(),
                None => (0..tokens.len()).collect(),
            };
            Case {
                name: c["name"].as_str().unwrap().to_string(),
                tokens,
                positions,
                logits: c["logits"].as_array().unwrap().iter().map(floats).collect(),
            }
        })
        .collect()
}

/// Largest logit difference from a float64 reference the family and RoPE-scaling checks allow.
pub const TOL: f32 = 1e-4;

/// The model at `path` against `file`'s cases, whole prompts at once.
pub fn check(path: &std::path::Path, file: &str) {
    let mut h = Harness::load(path, 2);
    for case in cases(file) {
        let got = h.prompt_logits(&case.tokens);
        for (&pos, want) in case.positions.iter().zip(&case.logits) {
            let d = max_abs_diff(&got[pos], want);
            assert!(
                d <= TOL,
                "{} {}: position {pos} differs from the reference by {d} (tolerance {TOL})",
                path.display(),
                case.name
            );
        }
    }
}
