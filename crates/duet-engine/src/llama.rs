//! The Llama-family decoder (Llama 2/3, Mistral, SmolLM, Qwen2) over any [`Backend`].
//!
//! RMSNorm → attention (GQA, rotate-half RoPE, optional q/k/v bias) → residual → RMSNorm →
//! SwiGLU MLP → residual, for every layer; final norm and the (optionally tied) output
//! projection only for the rows whose logits are wanted.

use crate::EngineError;
use crate::backend::{AttentionShape, Backend, KvDtype, KvLayout, StepMemoryPlan};
use crate::batch::ForwardBatch;
use crate::sampling_steps::RowSampling;
use duet_model::config::{ModelConfig, MoeConfig};
use duet_model::dequant::dequantize_row;
use duet_model::fp8::{Fp8Matrix, Quantization};
use duet_model::model_files::{ModelFiles, RawTensor, expert_tensor_name};
use duet_model::params::Sampled;
use duet_model::quant_type::QuantType;

struct Layer<B: Backend> {
    attn_norm: B::Vector,
    /// Q, K and V stacked into one matrix when the backend can, else separately.
    qkv: Projection<B>,
    qkv_bias: Option<[B::Vector; 3]>,
    /// Per-head RMSNorm weights of q and k (Qwen3).
    qk_norm: Option<[B::Vector; 2]>,
    attn_output: B::Matrix,
    ffn_norm: B::Vector,
    ffn: Ffn<B>,
}

/// A layer's feed-forward network.
enum Ffn<B: Backend> {
    /// One SwiGLU MLP.
    Dense(Mlp<B>),
    /// A router and its experts (Mixtral, Qwen3-MoE): each token through the experts the router
    /// picks for it, their outputs weighted (see [`crate::moe`]).
    Mixture {
        router: B::Matrix,
        experts: Vec<Mlp<B>>,
        config: MoeConfig,
    },
}

/// A SwiGLU MLP: `down(silu(gate(x)) * up(x))`.
struct Mlp<B: Backend> {
    /// Gate and up stacked when possible.
    gate_up: Projection<B>,
    down: B::Matrix,
}

enum Projection<B: Backend> {
    Stacked(B::Matrix),
    Separate(Vec<B::Matrix>),
}

pub struct Llama<B: Backend> {
    backend: B,
    config: ModelConfig,
    embedding: B::Matrix,
    /// `None` when tied to the embedding.
    output: Option<B::Matrix>,
    output_norm: B::Vector,
    layers: Vec<Layer<B>>,
    /// The rotary embeddings' inverse frequencies (with the config's scaling), and the factor
    /// cos and sin are scaled by.
    rope: Rope<B>,
}

struct Rope<B: Backend> {
    inv_freq: B::Vector,
    attention_factor: f32,
}

/// Logits for the rows a step asked for.
#[derive(Clone, Debug)]
pub struct Logits {
    pub data: Vec<f32>,
    pub vocab_size: usize,
    /// The step row each logits row belongs to.
    pub rows: Vec<usize>,
}

impl Logits {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab_size..(i + 1) * self.vocab_size]
    }

    pub fn row_mut(&mut self, i: usize) -> &mut [f32] {
        &mut self.data[i * self.vocab_size..(i + 1) * self.vocab_size]
    }

    pub fn num_rows(&self) -> usize {
        self.rows.len()
    }
}

impl<B: Backend> Llama<B> {
    /// Builds the model on `backend` from opened model files (validated shapes), its matrices
    /// as stored.
    pub fn load(backend: B, files: &ModelFiles) -> Result<Self, EngineError> {
        Self::load_quantized(backend, files, Quantization::None)
    }

    /// [`Llama::load`], the layers' projections quantized as `quantization` asks (`--quantization`).
    pub fn load_quantized(
        backend: B,
        files: &ModelFiles,
        quantization: Quantization,
    ) -> Result<Self, EngineError> {
        duet_model::model_files::validate_llama_tensors(files)?;
        let tensors = |name: &str| -> Result<Option<RawTensor>, EngineError> {
            if files.tensors.contains(name) {
                Ok(Some(files.tensors.get(name)?))
            } else {
                Ok(None)
            }
        };
        Self::build(
            backend,
            files.config.clone(),
            files.qk_rows_interleaved(),
            &tensors,
            &|name| files.tensors.fp8(name),
            quantization,
        )
    }

    /// A model of `config`'s shapes with random weights, its matrices stored as `ty` (BF16 or a
    /// GGUF block format; see [`duet_model::synthetic`]) and the layers' projections quantized as
    /// `quantization` asks: for benchmarks at sizes no file on hand has.
    pub fn synthetic(
        backend: B,
        config: ModelConfig,
        ty: QuantType,
        quantization: Quantization,
        seed: u64,
    ) -> Result<Self, EngineError> {
        let tensors = |name: &str| {
            duet_model::synthetic::tensor(&config, name, ty, seed)
                .map_err(|e| EngineError::Weights(e.to_string()))
        };
        Self::build(
            backend,
            config.clone(),
            false,
            &tensors,
            &|_| None,
            quantization,
        )
    }

    /// Builds the model from named tensors (`None`: absent) and FP8 matrices (an FP8
    /// checkpoint's), GGUF names and shapes.
    fn build(
        backend: B,
        cfg: ModelConfig,
        interleaved: bool,
        tensors: &dyn Fn(&str) -> Result<Option<RawTensor>, EngineError>,
        fp8: &dyn Fn(&str) -> Option<Fp8Matrix>,
        quantization: Quantization,
    ) -> Result<Self, EngineError> {
        backend.check_model(&cfg)?;
        let tensor = |name: &str| {
            tensors(name)?.ok_or_else(|| EngineError::Weights(format!("missing tensor {name}")))
        };
        // A weight matrix as stored, with the row order this engine's RoPE expects.
        let weights =
            |name: &str, unpermute_heads: Option<usize>| -> Result<RawTensor, EngineError> {
                let t = tensor(name)?;
                match unpermute_heads {
                    Some(heads) if interleaved => unpermute_rows(t, heads),
                    _ => Ok(t),
                }
            };
        let load = |t: RawTensor| backend.load_matrix(&t.name, t.ty, t.rows, t.cols, t.bytes);
        // A layer's projection: FP8 as the checkpoint stores it or quantized at load, else as
        // stored. (FP8 checkpoints are safetensors: their rows are never interleaved.)
        let projection = |name: &str, unpermute_heads: Option<usize>| {
            if let Some(m) = fp8(name) {
                return Ok(ProjectionWeights::Fp8(m));
            }
            let t = weights(name, unpermute_heads)?;
            Ok::<_, EngineError>(match quantization {
                Quantization::None => ProjectionWeights::Stored(t),
                Quantization::Fp8 => ProjectionWeights::Fp8(
                    Fp8Matrix::quantize(&t).map_err(|e| EngineError::Weights(e.to_string()))?,
                ),
            })
        };
        let load_projection = |p: ProjectionWeights| match p {
            ProjectionWeights::Stored(t) => load(t),
            ProjectionWeights::Fp8(m) => backend.load_fp8_matrix(m),
        };
        let matrix = |name: &str| load(weights(name, None)?);
        let stack = |parts: Vec<ProjectionWeights>| -> Result<Projection<B>, EngineError> {
            let separate: Vec<ProjectionWeights> = match Parts::of(parts) {
                Parts::Stored(stored) => match backend.load_stacked_matrix(&stored)? {
                    Some(m) => return Ok(Projection::Stacked(m)),
                    None => stored.into_iter().map(ProjectionWeights::Stored).collect(),
                },
                Parts::Fp8(fp8) => match Fp8Matrix::stack(&fp8) {
                    Some(m) => return Ok(Projection::Stacked(backend.load_fp8_matrix(m)?)),
                    None => fp8.into_iter().map(ProjectionWeights::Fp8).collect(),
                },
                Parts::Mixed(parts) => parts,
            };
            Ok(Projection::Separate(
                separate
                    .into_iter()
                    .map(load_projection)
                    .collect::<Result<_, _>>()?,
            ))
        };
        let vector = |name: &str| -> Result<B::Vector, EngineError> {
            backend.load_vector(tensor_f32(&tensor(name)?))
        };

        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = |s: &str| format!("blk.{i}.{s}");
            let qkv = stack(vec![
                projection(&p("attn_q.weight"), Some(cfg.num_heads))?,
                projection(&p("attn_k.weight"), Some(cfg.num_kv_heads))?,
                projection(&p("attn_v.weight"), None)?,
            ])?;
            let qkv_bias = if cfg.attention_bias {
                Some([
                    vector(&p("attn_q.bias"))?,
                    vector(&p("attn_k.bias"))?,
                    vector(&p("attn_v.bias"))?,
                ])
            } else {
                None
            };
            let mlp = |gate: &str, up: &str, down: &str| -> Result<Mlp<B>, EngineError> {
                Ok(Mlp {
                    gate_up: stack(vec![projection(gate, None)?, projection(up, None)?])?,
                    down: load_projection(projection(down, None)?)?,
                })
            };
            let ffn = match cfg.moe {
                None => Ffn::Dense(mlp(
                    &p("ffn_gate.weight"),
                    &p("ffn_up.weight"),
                    &p("ffn_down.weight"),
                )?),
                Some(config) => Ffn::Mixture {
                    router: matrix(&p("ffn_gate_inp.weight"))?,
                    experts: (0..config.num_experts)
                        .map(|e| {
                            mlp(
                                &expert_tensor_name(i, "gate", e),
                                &expert_tensor_name(i, "up", e),
                                &expert_tensor_name(i, "down", e),
                            )
                        })
                        .collect::<Result<_, _>>()?,
                    config,
                },
            };
            let qk_norm = if cfg.qk_norm {
                Some([
                    vector(&p("attn_q_norm.weight"))?,
                    vector(&p("attn_k_norm.weight"))?,
                ])
            } else {
                None
            };
            layers.push(Layer {
                attn_norm: vector(&p("attn_norm.weight"))?,
                qkv,
                qkv_bias,
                qk_norm,
                attn_output: load_projection(projection(&p("attn_output.weight"), None)?)?,
                ffn_norm: vector(&p("ffn_norm.weight"))?,
                ffn,
            });
        }
        let embedding = matrix("token_embd.weight")?;
        let output = match tensors("output.weight")? {
            Some(_) => Some(matrix("output.weight")?),
            None => None,
        };
        let output_norm = vector("output_norm.weight")?;
        let frequencies = cfg
            .rope_frequencies()
            .map_err(|e| EngineError::Config(e.0))?;
        let rope = Rope {
            inv_freq: backend.load_vector(frequencies.inv_freq)?,
            attention_factor: frequencies.attention_factor,
        };
        Ok(Self {
            backend,
            config: cfg,
            embedding,
            output,
            output_norm,
            layers,
            rope,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The KV layout this model needs for `num_blocks` blocks of `block_size` tokens of `dtype`.
    pub fn kv_layout(&self, block_size: usize, num_blocks: usize, dtype: KvDtype) -> KvLayout {
        KvLayout {
            num_layers: self.config.num_layers,
            num_kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
            block_size,
            num_blocks,
            dtype,
        }
    }

    /// Runs one step: writes every row's K/V into the cache and returns the wanted logits.
    /// `on_layer(layer, kv)` runs as soon as a layer's K/V are in the cache.
    pub fn forward(
        &self,
        batch: &ForwardBatch,
        kv: &mut B::KvStore,
        on_layer: &mut dyn FnMut(usize, &B::KvStore),
    ) -> Result<Logits, EngineError> {
        let b = &self.backend;
        let vocab = self.config.vocab_size;
        let _turn = b.step_turn();
        let mut data = match self.run(batch, kv, on_layer) {
            Some(logits) => b.to_host(logits),
            None => Vec::new(),
        };
        b.sync()?;
        // Rows a backend padded the step with come last.
        data.truncate(batch.logit_rows.len() * vocab);
        Ok(Logits {
            data,
            vocab_size: vocab,
            rows: batch.logit_rows.clone(),
        })
    }

    /// Runs one step as [`Self::forward`] does and draws a token for each row whose logits it
    /// wants, `rows[i]` saying how for the `i`-th (see [`Backend::sample`]): on the device where
    /// the backend samples there, so the logits never come to the host.
    pub fn forward_sampled(
        &self,
        batch: &ForwardBatch,
        kv: &mut B::KvStore,
        on_layer: &mut dyn FnMut(usize, &B::KvStore),
        rows: &[RowSampling<'_>],
    ) -> Result<Vec<Sampled>, EngineError> {
        if rows.len() != batch.logit_rows.len() {
            return Err(EngineError::InvalidBatch(format!(
                "{} sampling rows for a step with {} logit rows",
                rows.len(),
                batch.logit_rows.len()
            )));
        }
        let b = &self.backend;
        let _turn = b.step_turn();
        let sampled = match self.run(batch, kv, on_layer) {
            Some(logits) => b.sample(logits, self.config.vocab_size, rows),
            None => Vec::new(),
        };
        b.sync()?;
        Ok(sampled)
    }

    /// Sizes the backend's step memory for steps of up to `max_rows` rows (see
    /// [`Backend::reserve_step_memory`]), with KV blocks of `block_size` tokens.
    pub fn reserve_step_memory(&self, max_rows: usize, block_size: usize) {
        // Logits of more rows than this are rare (steps of that many sequences): they grow it.
        const RESERVED_LOGIT_ROWS: usize = 256;
        let max_logit_rows = max_rows.min(RESERVED_LOGIT_ROWS);
        self.backend.reserve_step_memory(&StepMemoryPlan {
            config: &self.config,
            max_rows,
            max_logit_rows,
            activations: &self.step_activations(max_rows, max_logit_rows),
            block_size,
        });
    }

    /// The activations `[rows][cols]` a step of `rows` rows, `logit_rows` of them wanting
    /// logits, allocates in [`Self::run`], in its order (a dense model's; a mixture's experts
    /// allocate more).
    fn step_activations(&self, rows: usize, logit_rows: usize) -> Vec<(usize, usize)> {
        let c = &self.config;
        let (q_dim, kv_dim) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        vec![
            (rows, c.hidden_size),           // x
            (rows, c.hidden_size),           // h
            (rows, q_dim),                   // q
            (rows, kv_dim),                  // k
            (rows, kv_dim),                  // v
            (rows, q_dim + 2 * kv_dim),      // qkv
            (rows, q_dim),                   // attn
            (rows, c.hidden_size),           // o
            (rows, c.intermediate_size),     // act
            (rows, 2 * c.intermediate_size), // the feed-forward's gate and up
            (logit_rows, c.hidden_size),     // the logit rows
            (logit_rows, c.hidden_size),     // normed
            (logit_rows, c.vocab_size),      // logits
        ]
    }

    /// The step's layers and output projection: the logits activations of the rows that want
    /// them (and any padded rows), `None` when none do.
    fn run(
        &self,
        batch: &ForwardBatch,
        kv: &mut B::KvStore,
        on_layer: &mut dyn FnMut(usize, &B::KvStore),
    ) -> Option<B::Activations> {
        let b = &self.backend;
        let c = &self.config;
        let (q_dim, kv_dim) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let shape = AttentionShape {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
        };

        let device_batch = b.prepare_batch(batch);
        let batch_on_device = &device_batch;
        let rows = b.step_rows(batch_on_device);
        let n = rows.rows;
        let mut x = b.alloc(n, c.hidden_size);
        let mut h = b.alloc(n, c.hidden_size);
        let mut q = b.alloc(n, q_dim);
        let mut k = b.alloc(n, kv_dim);
        let mut v = b.alloc(n, kv_dim);
        let mut qkv = b.alloc(n, q_dim + 2 * kv_dim);
        let mut attn = b.alloc(n, q_dim);
        let mut o = b.alloc(n, c.hidden_size);
        let mut act = b.alloc(n, c.intermediate_size);
        let mut ffn_scratch = FfnScratch::default();
        b.embed(&self.embedding, batch_on_device, &mut x);

        if let Some(first) = self.layers.first() {
            b.rms_norm(&x, &first.attn_norm, c.rms_norm_eps, &mut h);
        }
        let rope = &self.rope;
        for (li, layer) in self.layers.iter().enumerate() {
            match (&layer.qkv, &layer.qkv_bias, &layer.qk_norm) {
                // The projection's output straight to attention's inputs (fused on a GPU).
                (Projection::Stacked(w), None, None) => {
                    b.matmul(w, &h, &mut qkv);
                    b.qkv_rope_write_kv(
                        &qkv,
                        &mut q,
                        &mut k,
                        &mut v,
                        kv,
                        li,
                        shape,
                        &rope.inv_freq,
                        rope.attention_factor,
                        batch_on_device,
                    );
                }
                (proj, bias, qk_norm) => {
                    self.project(proj, &h, &mut qkv, &mut [&mut q, &mut k, &mut v]);
                    if let Some([bq, bk, bv]) = bias {
                        b.add_bias(&mut q, bq);
                        b.add_bias(&mut k, bk);
                        b.add_bias(&mut v, bv);
                    }
                    if let Some([nq, nk]) = qk_norm {
                        b.head_rms_norm(&mut q, nq, c.head_dim, c.rms_norm_eps);
                        b.head_rms_norm(&mut k, nk, c.head_dim, c.rms_norm_eps);
                    }
                    for x in [&mut q, &mut k] {
                        b.rope(
                            x,
                            c.head_dim,
                            &rope.inv_freq,
                            rope.attention_factor,
                            batch_on_device,
                        );
                    }
                    b.write_kv(kv, li, &k, &v, batch_on_device);
                }
            }
            on_layer(li, kv);
            b.attention(&q, kv, li, shape, batch_on_device, &mut attn);
            b.matmul(&layer.attn_output, &attn, &mut o);
            b.add_rms_norm(&mut x, &o, &layer.ffn_norm, c.rms_norm_eps, &mut h);

            match &layer.ffn {
                Ffn::Dense(mlp) => {
                    self.feed_forward_activation(&mlp.gate_up, &h, n, &mut ffn_scratch, &mut act);
                    b.matmul(&mlp.down, &act, &mut o);
                }
                Ffn::Mixture {
                    router,
                    experts,
                    config,
                } => self.mixture(router, experts, config, &h, n, &mut o),
            }
            // The residual add and the next layer's attention norm, as one op.
            match self.layers.get(li + 1) {
                Some(next) => b.add_rms_norm(&mut x, &o, &next.attn_norm, c.rms_norm_eps, &mut h),
                None => b.add(&mut x, &o),
            }
        }

        let m = rows.logit_rows;
        if m == 0 {
            return None;
        }
        let mut last = b.alloc(m, c.hidden_size);
        b.gather_logit_rows(&x, batch_on_device, &mut last);
        let mut normed = b.alloc(m, c.hidden_size);
        b.rms_norm(&last, &self.output_norm, c.rms_norm_eps, &mut normed);
        let mut logits = b.alloc(m, c.vocab_size);
        b.matmul(
            self.output.as_ref().unwrap_or(&self.embedding),
            &normed,
            &mut logits,
        );
        Some(logits)
    }

    /// `out[r] = Σ weight · expert(x[r])` over the experts the router picks for row `r`: the
    /// router's logits come to the host, each chosen expert runs once over the rows it was
    /// picked for (gathered), and its outputs are added back weighted.
    fn mixture(
        &self,
        router: &B::Matrix,
        experts: &[Mlp<B>],
        config: &MoeConfig,
        x: &B::Activations,
        rows: usize,
        out: &mut B::Activations,
    ) {
        let b = &self.backend;
        let hidden = self.config.hidden_size;
        let mut logits = b.alloc(rows, config.num_experts);
        b.matmul(router, x, &mut logits);
        let logits = b.to_host(logits);
        *out = b.alloc_zeroed(rows, hidden);
        for (expert, group) in experts
            .iter()
            .zip(crate::moe::group_tokens(&logits, rows, config))
        {
            let m = group.rows.len();
            if m == 0 {
                continue;
            }
            let mut picked = b.alloc(m, hidden);
            b.gather_rows(x, &group.rows, &mut picked);
            let mut act = b.alloc(m, config.expert_intermediate_size);
            let mut scratch = FfnScratch::default();
            self.feed_forward_activation(&expert.gate_up, &picked, m, &mut scratch, &mut act);
            let mut y = b.alloc(m, hidden);
            b.matmul(&expert.down, &act, &mut y);
            b.scatter_add_rows(out, &y, &group.rows, &group.weights);
        }
    }

    /// `out = silu(x·gateᵀ) * (x·upᵀ)` for `rows` rows of `x`.
    fn feed_forward_activation(
        &self,
        proj: &Projection<B>,
        x: &B::Activations,
        rows: usize,
        scratch: &mut FfnScratch<B>,
        out: &mut B::Activations,
    ) {
        let b = &self.backend;
        match proj {
            Projection::Stacked(w) => {
                let gate_up = scratch
                    .gate_up
                    .get_or_insert_with(|| b.alloc(rows, b.matrix_rows(w)));
                b.matmul(w, x, gate_up);
                b.silu_mul_stacked(gate_up, out);
            }
            Projection::Separate(ws) => {
                let up = scratch
                    .up
                    .get_or_insert_with(|| b.alloc(rows, b.matrix_rows(&ws[1])));
                b.matmul(&ws[0], x, out);
                b.matmul(&ws[1], x, up);
                b.silu_mul(out, up);
            }
        }
    }

    fn project(
        &self,
        proj: &Projection<B>,
        x: &B::Activations,
        stacked_out: &mut B::Activations,
        outs: &mut [&mut B::Activations],
    ) {
        match proj {
            Projection::Stacked(w) => {
                self.backend.matmul(w, x, stacked_out);
                self.backend.split_cols(stacked_out, outs);
            }
            Projection::Separate(ws) => {
                for (w, out) in ws.iter().zip(outs.iter_mut()) {
                    self.backend.matmul(w, x, out);
                }
            }
        }
    }
}

/// A layer projection's weights before loading: as stored, or FP8.
enum ProjectionWeights {
    Stored(RawTensor),
    Fp8(Fp8Matrix),
}

/// A projection's parts (q, k, v; gate, up) by how they are stored.
enum Parts {
    Stored(Vec<RawTensor>),
    Fp8(Vec<Fp8Matrix>),
    Mixed(Vec<ProjectionWeights>),
}

impl Parts {
    fn of(parts: Vec<ProjectionWeights>) -> Self {
        let (mut stored, mut fp8) = (Vec::new(), Vec::new());
        for p in &parts {
            match p {
                ProjectionWeights::Stored(t) => stored.push(t.clone()),
                ProjectionWeights::Fp8(m) => fp8.push(m.clone()),
            }
        }
        match (stored.is_empty(), fp8.is_empty()) {
            (false, true) => Self::Stored(stored),
            (true, false) => Self::Fp8(fp8),
            _ => Self::Mixed(parts),
        }
    }
}

/// Buffers of the feed-forward activation, made on first use in a step: layers may differ in
/// whether gate and up are stacked (mixed quantization types).
struct FfnScratch<B: Backend> {
    gate_up: Option<B::Activations>,
    up: Option<B::Activations>,
}

impl<B: Backend> Default for FfnScratch<B> {
    fn default() -> Self {
        Self {
            gate_up: None,
            up: None,
        }
    }
}

/// Undoes the row permutation GGUF converters apply to Q and K for interleaved RoPE: within each
/// head, converted row `2i + j` is original row `j·(head_dim/2) + i`.
fn unpermute_rows(t: RawTensor, heads: usize) -> Result<RawTensor, EngineError> {
    let head_dim = t.rows / heads;
    let half = head_dim / 2;
    let row_bytes = t.ty.row_bytes(t.cols).ok_or_else(|| {
        EngineError::Weights(format!("tensor {}: bad row length {}", t.name, t.cols))
    })?;
    let mut out = vec![0u8; t.bytes.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let src = h * head_dim + 2 * i + j;
                let dst = h * head_dim + j * half + i;
                out[dst * row_bytes..(dst + 1) * row_bytes]
                    .copy_from_slice(&t.bytes[src * row_bytes..(src + 1) * row_bytes]);
            }
        }
    }
    Ok(RawTensor {
        bytes: duet_model::storage::WeightBytes::from_vec(out),
        ..t
    })
}

/// A 1-D tensor (norm weight, bias) as f32, whatever its stored type.
fn tensor_f32(t: &RawTensor) -> Vec<f32> {
    let len = t.rows * t.cols;
    let mut out = vec![0f32; len];
    if t.ty == QuantType::F32 {
        for (o, b) in out.iter_mut().zip(t.bytes.chunks_exact(4)) {
            *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
    } else {
        dequantize_row(t.ty, &t.bytes, &mut out);
    }
    out
}
