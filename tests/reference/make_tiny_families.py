#!/usr/bin/env python3
"""Build tiny random checkpoints for RoPE scaling, Qwen3, Mixtral and Qwen3-MoE,
and their float64 reference logits.

    python3 tests/reference/make_tiny_families.py       # from the repo root

Writes (deterministically, fixed seeds; see tests/reference/README.md):

  tests/fixtures/tiny-rope-{llama3,linear,dynamic,yarn}/   HF Llama dirs, one per
                                            rope_scaling type, SAME weights
  tests/fixtures/tiny-rope-llama3.gguf      GGUF with the llama3 rope_freqs tensor
  tests/fixtures/tiny-rope-{...}-logits.json
  tests/fixtures/tiny-qwen3/ + tiny-qwen3.gguf + tiny-qwen3-logits.json
  tests/fixtures/tiny-mixtral/ + tiny-mixtral.gguf + tiny-mixtral-logits.json
  tests/fixtures/tiny-qwen3-moe/ + tiny-qwen3-moe.gguf + tiny-qwen3-moe-logits.json
  tests/fixtures/tiny-qwen3-moe-unnormalized/ + tiny-qwen3-moe-unnormalized-logits.json
  tests/fixtures/rope-scaling-inv-freq.json  inverse frequencies, theta 1e4, d 16

Every HF dir has config.json, model.safetensors (f32, HF names, [out, in]) and a
byte copy of tests/fixtures/tiny-llama/tokenizer.json (vocab 384).

Logits JSON: float64 logits rounded to 6 significant digits (more if a file had
|logit| >= 10; none does), so every value is within 5e-6 of the float64 one;
"logits_format" records this.  Prompts of up to 40 tokens record every
position.  The 100-token rope prompts record only LONG_PROMPT_POSITIONS, listed
in the case's "positions"; its "argmax" and "logits" then have one entry per
listed position, in that order.  Cases without "positions" cover every position.

Reference forward (float64, numpy only, written from the math):
  x = embed[ids]
  per layer:  h = rmsnorm(x, w_in)
              q, k, v = h Wq^T, h Wk^T, h Wv^T, split into heads of head_dim
              [qwen3, qwen3_moe] q, k = rmsnorm_per_head(q, q_norm), (k, k_norm)
              rotate-half RoPE on q and k with cos/sin = attention_factor *
              cos/sin(pos * inv_freq)   (inv_freq from the rope_scaling type)
              causal GQA attention, scale 1/sqrt(head_dim);  x += attn Wo^T
              h = rmsnorm(x, w_post)
              dense: x += Wdown (silu(Wgate h) * Wup h)
              MoE:   p = softmax(h Wrouter^T) (float64); the top_k experts by a
                     STABLE descending sort of p (equal p: lower expert index
                     first); weights p_sel, divided by their sum when the
                     family normalizes (Mixtral always; Qwen3-MoE iff
                     norm_topk_prob); x += sum_j w_j * expert_{e_j}(h)
  logits = rmsnorm(x, w_final) Wlm^T     (Wlm = embed when tie_word_embeddings)

RoPE scaling inverse frequencies (d = head_dim, i = 0..d/2-1,
inv_i = theta^(-2i/d)), from HF transformers' modeling_rope_utils:
  linear:  inv_i / factor
  dynamic: STATIC (vLLM) form, at every position:
           base' = theta * (factor * L / orig - (factor - 1)) ^ (d / (d - 2)),
           L = orig * factor;  inv'_i = base'^(-2i/d)
  llama3:  wavelen_i = 2 pi / inv_i;  lo_wl = orig / low_freq_factor,
           hi_wl = orig / high_freq_factor
           wavelen < hi_wl: inv_i;  wavelen > lo_wl: inv_i / factor;
           else s = (orig / wavelen - low_freq_factor) /
                    (high_freq_factor - low_freq_factor),
                inv_i * ((1 - s) / factor + s)
  yarn:    corr_dim(r) = d * ln(orig / (2 pi r)) / (2 ln theta)
           low = max(floor(corr_dim(beta_fast)), 0)
           high = min(ceil(corr_dim(beta_slow)), d - 1)
           ramp_i = clip((i - low) / (high - low), 0, 1)  (high += 0.001 if equal)
           extrap_i = 1 - ramp_i
           inv'_i = inv_i / factor * (1 - extrap_i) + inv_i * extrap_i
           attention_factor = 0.1 * ln(factor) + 1   (multiplies cos and sin)

GGUF (llama.cpp convert_hf_to_gguf.py conventions):
  * llama arch (tiny-rope-llama3, tiny-mixtral): attn_q / attn_k rows permuted
    (LlamaModel.permute, as make_tiny_llama.py); llama3 rope scaling is stored
    only as the tensor rope_freqs.weight [d/2] F32 with
        rope_freqs_i = 1 / (inv'_i / inv_i)
                     = 1 | factor | 1 / ((1 - s) / factor + s)
    (llama.cpp divides the rotation angle by it: theta_i = pos * inv_i / rope_freqs_i);
  * Mixtral: experts stacked to 3-D ffn_{gate,up,down}_exps [n_expert, out, in]
    (w1 = gate, w3 = up, w2 = down), router = ffn_gate_inp, llama.expert_count /
    llama.expert_used_count;
  * qwen3 / qwen3moe: no q/k permutation (NEOX rope in llama.cpp), q/k norms as
    attn_q_norm / attn_k_norm; qwen3moe adds expert_feed_forward_length.

The script asserts the GGUF files read back to the same weights (after
un-permuting / un-stacking) and reproduce the logits, that MoE selections
change between positions, that the Mixtral fixture hits an exact router tie at
the top-2 boundary, and that no other router decision is a near-tie.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
from safetensors.numpy import load_file, save_file

import gguf

# llama.cpp's q/k row permutation, as the tiny Llama fixture writes it.
from make_tiny_llama import permute, unpermute

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIX = os.path.join(REPO, "tests", "fixtures")
TOKENIZER_SRC = os.path.join(FIX, "tiny-llama", "tokenizer.json")
GENERATOR = "tests/reference/make_tiny_families.py (float64 numpy forward)"

VOCAB = 384
HIDDEN = 64
LAYERS = 2
N_HEADS = 4
N_KV = 2
MAX_POS = 256
BOS, EOS = 1, 2

# Router decisions whose selected/unselected probabilities differ by less than
# this (and are not exactly equal) are rejected when picking the prompts.
MIN_ROUTER_MARGIN = 2e-3
# Likewise for the top-1 minus top-2 logit at every position, so that an engine
# computing in float32 gets the same argmax.
MIN_ARGMAX_MARGIN = 1e-3

# FFN sizes.  They differ from hidden (64), so a transposed FFN or expert
# matrix fails on its shape, and are kept small: every weight is stored twice
# (safetensors and GGUF), the Qwen3-MoE ones three times and the rope ones
# five times (four dirs and a GGUF).
MIXTRAL_EXPERT_FF = 32
QWEN3_MOE_EXPERT_FF = 32
# Dense FFN sizes of tiny-qwen3 and of the rope dirs.
QWEN3_FF = 32
ROPE_FF = 32

# Logits JSON: prompts of up to FULL_LOGITS_MAX_LEN tokens record every
# position.  Longer ones (the 100-token rope prompts) record only these
# positions, listed in the case's "positions": 0 (no rotation), 1, and both
# sides of original_max_position_embeddings (32) and its multiples 64 and 96,
# up to the last position.
FULL_LOGITS_MAX_LEN = 40
LONG_PROMPT_POSITIONS = [0, 1, 15, 31, 32, 33, 47, 63, 64, 80, 96, 99]
# Logits are written rounded to this many significant digits, or more when a
# file has |logit| >= 10, so that the absolute rounding error stays <= 5e-6.
LOGIT_SIG_DIGITS = 6
LOGIT_MAX_ROUNDING_ERROR = 5e-6

SEED_ROPE = 20240701
SEED_QWEN3 = 20240702
SEED_MIXTRAL = 20240703
SEED_QWEN3_MOE = 20240704
SEED_CASES = 20240710

ROPE_THETA = 10000.0
ROPE_ORIG = 32
ROPE_TYPES = {
    # name -> (rope_scaling dict as written to config.json, max_position_embeddings)
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": ROPE_ORIG},
               MAX_POS),
    "linear": ({"type": "linear", "factor": 4.0}, MAX_POS),
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0,
                 "original_max_position_embeddings": ROPE_ORIG}, MAX_POS),
    # max_position_embeddings = factor * original (128): HF transformers 4.5x
    # replaces `factor` by max_position_embeddings / original_max_position_embeddings
    # when the latter is present, so this keeps every reading at factor 4.
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ROPE_ORIG,
              "beta_fast": 32, "beta_slow": 1}, 128),
}


# ---------------------------------------------------------------------------
# Tokenizer (shared with tiny-llama)
# ---------------------------------------------------------------------------
def load_tokenizer():
    with open(TOKENIZER_SRC, "rb") as f:
        raw = f.read()
    tj = json.loads(raw.decode("utf-8"))
    vocab = tj["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    assert len(tokens) == VOCAB and None not in tokens
    specials = [a["content"] for a in tj["added_tokens"]]
    assert specials == tokens[:3] == ["<unk>", "<s>", "</s>"]
    return raw, tokens, tj["model"]["merges"]


# ---------------------------------------------------------------------------
# RoPE scaling (float64)
# ---------------------------------------------------------------------------
def base_inv_freq(theta, d):
    return theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)


def rope_params(scaling, theta, d):
    """Returns (inv_freq [d/2] float64, attention_factor, extra info dict)."""
    inv = base_inv_freq(theta, d)
    if scaling is None:
        return inv, 1.0, {}
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor, 1.0, {}
    if kind == "dynamic":
        orig = scaling["original_max_position_embeddings"]
        L = orig * factor
        base2 = theta * ((factor * L / orig) - (factor - 1)) ** (d / (d - 2))
        return base_inv_freq(base2, d), 1.0, {"base": base2}
    if kind == "llama3":
        orig = scaling["original_max_position_embeddings"]
        lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
        lo_wl, hi_wl = orig / lo, orig / hi
        out, ff = np.empty_like(inv), np.empty_like(inv)
        for i, f in enumerate(inv):
            wl = 2 * math.pi / f
            if wl < hi_wl:
                out[i], ff[i] = f, 1.0
            elif wl > lo_wl:
                out[i], ff[i] = f / factor, factor
            else:
                s = (orig / wl - lo) / (hi - lo)
                out[i] = (1 - s) * f / factor + s * f
                ff[i] = 1.0 / ((1 - s) / factor + s)
        return out, 1.0, {"gguf_rope_freqs": ff}
    if kind == "yarn":
        orig = scaling["original_max_position_embeddings"]
        beta_fast = scaling.get("beta_fast") or 32
        beta_slow = scaling.get("beta_slow") or 1

        def corr_dim(rot):
            return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(corr_dim(beta_fast)), 0)
        high = min(math.ceil(corr_dim(beta_slow)), d - 1)
        hi_r = high + 0.001 if low == high else high
        ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (hi_r - low), 0, 1)
        extrap = 1.0 - ramp
        out = (inv / factor) * (1 - extrap) + inv * extrap
        attn = 0.1 * math.log(factor) + 1.0
        return out, attn, {"correction_range": [low, high], "extrapolation_factor": extrap}
    raise ValueError(kind)


# ---------------------------------------------------------------------------
# Reference forward pass (float64)
# ---------------------------------------------------------------------------
def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_rotate_half(x, cos, sin):
    d2 = x.shape[-1] // 2
    x1, x2 = x[..., :d2], x[..., d2:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def rope_interleaved(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x2 * c + x1 * s
    return out


def silu(g):
    return g / (1.0 + np.exp(-g))


def route(h, router, top_k, normalize):
    """Router: softmax in float64, stable descending sort (ties -> lower index),
    top_k.  Each expert's logit is its own mat-vec so equal rows give bitwise
    equal logits.  Returns (selected [T, k], weights [T, k], probs [T, E])."""
    logits = np.stack([h @ router[e] for e in range(router.shape[0])], axis=-1)
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    order = np.argsort(-p, axis=-1, kind="stable")
    sel = order[:, :top_k]
    wts = np.take_along_axis(p, sel, axis=-1)
    if normalize:
        wts = wts / wts.sum(axis=-1, keepdims=True)
    return sel, wts, p


def forward(m, w, ids, inv_freq=None, attn_factor=None, interleaved=False, trace=None):
    """m: model description (see the make_* functions); w: HF-named weights.
    trace, if a list, receives per layer (selected, probs) for MoE layers."""
    w = {k: np.asarray(v, dtype=np.float64) for k, v in w.items()}
    nh, nkv, hd, eps = m["nh"], m["nkv"], m["hd"], m["eps"]
    inv_freq = m["inv_freq"] if inv_freq is None else inv_freq
    attn_factor = m["attn_factor"] if attn_factor is None else attn_factor
    T = len(ids)
    x = w["model.embed_tokens.weight"][np.asarray(ids)]
    ang = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(ang) * attn_factor, np.sin(ang) * attn_factor
    rope = rope_interleaved if interleaved else rope_rotate_half
    mask = np.triu(np.full((T, T), -np.inf), k=1)
    group = nh // nkv
    for l in range(m["layers"]):
        p = f"model.layers.{l}."
        h = rmsnorm(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, nh, hd)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, hd)
        if m["qk_norm"]:
            q = rmsnorm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = rmsnorm(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        att = np.empty((T, nh, hd))
        for hh in range(nh):
            kv = hh // group
            s = q[:, hh, :] @ k[:, kv, :].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            s /= s.sum(axis=-1, keepdims=True)
            att[:, hh, :] = s @ v[:, kv, :]
        x = x + att.reshape(T, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        h = rmsnorm(x, w[p + "post_attention_layernorm.weight"], eps)
        moe = m["moe"]
        if moe is None:
            g = h @ w[p + "mlp.gate_proj.weight"].T
            u = h @ w[p + "mlp.up_proj.weight"].T
            x = x + (silu(g) * u) @ w[p + "mlp.down_proj.weight"].T
            continue
        sel, wts, probs = route(h, w[p + moe["router"]], moe["top_k"], moe["normalize"])
        if trace is not None:
            trace.append((sel, probs))
        out = np.zeros_like(x)
        for e in range(moe["n_experts"]):
            rows, slot = np.nonzero(sel == e)
            if len(rows) == 0:
                continue
            gate, up, down = (w[p + n.format(e=e)] for n in moe["expert_names"])
            he = h[rows]
            y = (silu(he @ gate.T) * (he @ up.T)) @ down.T
            out[rows] += wts[rows, slot][:, None] * y
        x = x + out
    x = rmsnorm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if m["tie"] else w["lm_head.weight"]
    return x @ head.T


# ---------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------
class Gen:
    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def normal(self, shape, std):
        return (self.rng.standard_normal(shape) * std).astype(np.float32)

    def norm(self, n):
        return (1.0 + 0.1 * self.rng.standard_normal(n)).astype(np.float32)


def make_weights(m, seed, qk_std=0.08, router_std=0.15):
    """Embedding std 0.5 (0.1 when tied, so the current token's own embedding
    does not dominate the tied LM head), q/k std qk_std, other matrices 0.08,
    router rows router_std, norms 1 + 0.1 randn."""
    g = Gen(seed)
    H, nh, nkv, hd = HIDDEN, m["nh"], m["nkv"], m["hd"]
    w = {"model.embed_tokens.weight": g.normal((VOCAB, H), 0.1 if m["tie"] else 0.5)}
    for l in range(m["layers"]):
        p = f"model.layers.{l}."
        w[p + "input_layernorm.weight"] = g.norm(H)
        w[p + "self_attn.q_proj.weight"] = g.normal((nh * hd, H), qk_std)
        w[p + "self_attn.k_proj.weight"] = g.normal((nkv * hd, H), qk_std)
        w[p + "self_attn.v_proj.weight"] = g.normal((nkv * hd, H), 0.08)
        w[p + "self_attn.o_proj.weight"] = g.normal((H, nh * hd), 0.08)
        if m["qk_norm"]:
            w[p + "self_attn.q_norm.weight"] = g.norm(hd)
            w[p + "self_attn.k_norm.weight"] = g.norm(hd)
        w[p + "post_attention_layernorm.weight"] = g.norm(H)
        moe = m["moe"]
        if moe is None:
            I = m["intermediate"]
            w[p + "mlp.gate_proj.weight"] = g.normal((I, H), 0.08)
            w[p + "mlp.up_proj.weight"] = g.normal((I, H), 0.08)
            w[p + "mlp.down_proj.weight"] = g.normal((H, I), 0.08)
        else:
            I = moe["expert_intermediate"]
            w[p + moe["router"]] = g.normal((moe["n_experts"], H), router_std)
            gname, uname, dname = moe["expert_names"]
            for e in range(moe["n_experts"]):
                w[p + gname.format(e=e)] = g.normal((I, H), 0.08)
                w[p + uname.format(e=e)] = g.normal((I, H), 0.08)
                w[p + dname.format(e=e)] = g.normal((H, I), 0.08)
    w["model.norm.weight"] = g.norm(H)
    if not m["tie"]:
        w["lm_head.weight"] = g.normal((VOCAB, H), 0.08)
    return w


# ---------------------------------------------------------------------------
# Model descriptions and HF configs
# ---------------------------------------------------------------------------
def llama_model(scaling, max_pos):
    inv, attn, info = rope_params(scaling, ROPE_THETA, 16)
    return dict(nh=N_HEADS, nkv=N_KV, hd=16, eps=1e-5, layers=LAYERS, qk_norm=False,
                tie=True, moe=None, intermediate=ROPE_FF, inv_freq=inv, attn_factor=attn,
                rope_info=info, config={
                    "architectures": ["LlamaForCausalLM"],
                    "model_type": "llama",
                    "hidden_act": "silu",
                    "attention_bias": False,
                    "mlp_bias": False,
                    "tie_word_embeddings": True,
                    "torch_dtype": "float32",
                    "initializer_range": 0.02,
                    "rope_scaling": scaling,
                    "use_cache": True,
                    "vocab_size": VOCAB,
                    "hidden_size": HIDDEN,
                    "intermediate_size": ROPE_FF,
                    "num_hidden_layers": LAYERS,
                    "num_attention_heads": N_HEADS,
                    "num_key_value_heads": N_KV,
                    "head_dim": 16,
                    "rope_theta": ROPE_THETA,
                    "rms_norm_eps": 1e-5,
                    "max_position_embeddings": max_pos,
                    "bos_token_id": BOS,
                    "eos_token_id": EOS,
                })


def qwen3_model():
    inv, attn, _ = rope_params(None, 1e6, 32)
    return dict(nh=N_HEADS, nkv=N_KV, hd=32, eps=1e-6, layers=LAYERS, qk_norm=True,
                tie=True, moe=None, intermediate=QWEN3_FF, inv_freq=inv, attn_factor=attn,
                config={
                    "architectures": ["Qwen3ForCausalLM"],
                    "model_type": "qwen3",
                    "hidden_act": "silu",
                    "attention_bias": False,
                    "attention_dropout": 0.0,
                    "tie_word_embeddings": True,
                    "torch_dtype": "float32",
                    "initializer_range": 0.02,
                    "rope_scaling": None,
                    "use_cache": True,
                    "use_sliding_window": False,
                    "sliding_window": None,
                    "max_window_layers": LAYERS,
                    "vocab_size": VOCAB,
                    "hidden_size": HIDDEN,
                    "intermediate_size": QWEN3_FF,
                    "num_hidden_layers": LAYERS,
                    "num_attention_heads": N_HEADS,
                    "num_key_value_heads": N_KV,
                    "head_dim": 32,
                    "rope_theta": 1000000.0,
                    "rms_norm_eps": 1e-6,
                    "max_position_embeddings": MAX_POS,
                    "bos_token_id": BOS,
                    "eos_token_id": EOS,
                })


def mixtral_model():
    inv, attn, _ = rope_params(None, 1e6, 16)
    moe = dict(n_experts=4, top_k=2, normalize=True, expert_intermediate=MIXTRAL_EXPERT_FF,
               router="block_sparse_moe.gate.weight",
               expert_names=("block_sparse_moe.experts.{e}.w1.weight",
                             "block_sparse_moe.experts.{e}.w3.weight",
                             "block_sparse_moe.experts.{e}.w2.weight"))
    return dict(nh=N_HEADS, nkv=N_KV, hd=16, eps=1e-5, layers=LAYERS, qk_norm=False,
                tie=False, moe=moe, inv_freq=inv, attn_factor=attn, config={
                    "architectures": ["MixtralForCausalLM"],
                    "model_type": "mixtral",
                    "hidden_act": "silu",
                    "attention_dropout": 0.0,
                    "tie_word_embeddings": False,
                    "torch_dtype": "float32",
                    "initializer_range": 0.02,
                    "rope_scaling": None,
                    "use_cache": True,
                    "sliding_window": None,
                    "vocab_size": VOCAB,
                    "hidden_size": HIDDEN,
                    "intermediate_size": MIXTRAL_EXPERT_FF,
                    "num_hidden_layers": LAYERS,
                    "num_attention_heads": N_HEADS,
                    "num_key_value_heads": N_KV,
                    "head_dim": 16,
                    "num_local_experts": 4,
                    "num_experts_per_tok": 2,
                    "output_router_logits": False,
                    "router_aux_loss_coef": 0.02,
                    "router_jitter_noise": 0.0,
                    "rope_theta": 1000000.0,
                    "rms_norm_eps": 1e-5,
                    "max_position_embeddings": MAX_POS,
                    "bos_token_id": BOS,
                    "eos_token_id": EOS,
                })


def qwen3_moe_model(norm_topk_prob):
    inv, attn, _ = rope_params(None, 1e6, 32)
    moe = dict(n_experts=4, top_k=2, normalize=norm_topk_prob,
               expert_intermediate=QWEN3_MOE_EXPERT_FF,
               router="mlp.gate.weight",
               expert_names=("mlp.experts.{e}.gate_proj.weight",
                             "mlp.experts.{e}.up_proj.weight",
                             "mlp.experts.{e}.down_proj.weight"))
    return dict(nh=N_HEADS, nkv=N_KV, hd=32, eps=1e-6, layers=LAYERS, qk_norm=True,
                tie=False, moe=moe, inv_freq=inv, attn_factor=attn, config={
                    "architectures": ["Qwen3MoeForCausalLM"],
                    "model_type": "qwen3_moe",
                    "hidden_act": "silu",
                    "attention_bias": False,
                    "attention_dropout": 0.0,
                    "tie_word_embeddings": False,
                    "torch_dtype": "float32",
                    "initializer_range": 0.02,
                    "rope_scaling": None,
                    "use_cache": True,
                    "use_sliding_window": False,
                    "sliding_window": None,
                    "max_window_layers": LAYERS,
                    "vocab_size": VOCAB,
                    "hidden_size": HIDDEN,
                    # dense FFN size, unused here (every layer is sparse); it is
                    # deliberately different from moe_intermediate_size
                    "intermediate_size": 128,
                    "moe_intermediate_size": QWEN3_MOE_EXPERT_FF,
                    "num_experts": 4,
                    "num_experts_per_tok": 2,
                    "norm_topk_prob": norm_topk_prob,
                    "decoder_sparse_step": 1,
                    "mlp_only_layers": [],
                    "output_router_logits": False,
                    "router_aux_loss_coef": 0.001,
                    "num_hidden_layers": LAYERS,
                    "num_attention_heads": N_HEADS,
                    "num_key_value_heads": N_KV,
                    "head_dim": 32,
                    "rope_theta": 1000000.0,
                    "rms_norm_eps": 1e-6,
                    "max_position_embeddings": MAX_POS,
                    "bos_token_id": BOS,
                    "eos_token_id": EOS,
                })


# ---------------------------------------------------------------------------
# Writing HF dirs
# ---------------------------------------------------------------------------
def write_hf_dir(name, config, weights, tok_raw):
    d = os.path.join(FIX, name)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "model.safetensors")
    save_file(weights, path, metadata={"format": "pt"})
    os.chmod(path, 0o644)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    with open(os.path.join(d, "tokenizer.json"), "wb") as f:
        f.write(tok_raw)
    back = load_file(path)
    assert sorted(back) == sorted(weights)
    assert all(np.array_equal(back[k], weights[k]) for k in weights)


# ---------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------
HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.gate": "ffn_gate_inp",
}
TOP_LEVEL = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


BLOCK_ORDER = ["attn_norm", "attn_q", "attn_q_norm", "attn_k", "attn_k_norm", "attn_v",
               "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
               "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]


def tensor_sort_key(name):
    """token_embd, rope_freqs, blk.0.*, blk.1.*, ..., output_norm, output."""
    if name.startswith("blk."):
        _, l, kind, _ = name.split(".")
        return (2, int(l), BLOCK_ORDER.index(kind))
    return ({"token_embd.weight": 0, "rope_freqs.weight": 1,
             "output_norm.weight": 3, "output.weight": 4}[name], 0, 0)


def gguf_tensors(m, weights, permute_qk):
    """HF weights -> list of (gguf name, f32 array) as llama.cpp's converter
    lays them out (experts stacked to [n_expert, out, in])."""
    out = []
    moe = m["moe"]
    for hf, t in weights.items():
        if hf in TOP_LEVEL:
            out.append((TOP_LEVEL[hf], t))
            continue
        if ".experts." in hf:
            continue  # stacked below
        parts = hf.split(".")
        l, key = int(parts[2]), ".".join(parts[3:-1])
        if permute_qk and key == "self_attn.q_proj":
            t = permute(t, m["nh"])
        elif permute_qk and key == "self_attn.k_proj":
            t = permute(t, m["nkv"])
        out.append((f"blk.{l}.{HF_TO_GGUF[key]}.weight", t))
    if moe is not None:
        for l in range(m["layers"]):
            p = f"model.layers.{l}."
            for gname, hfname in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"),
                                     moe["expert_names"]):
                stacked = np.stack([weights[p + hfname.format(e=e)]
                                    for e in range(moe["n_experts"])], axis=0)
                out.append((f"blk.{l}.{gname}.weight", stacked))
    return out


def write_gguf(path, arch, name, m, weights, tokens, merges, extra_kv, extra_tensors=()):
    cfg = m["config"]
    w = gguf.GGUFWriter(path, arch)
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    extra_kv(w)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    tensors = gguf_tensors(m, weights, permute_qk=(arch == "llama")) + list(extra_tensors)
    tensors.sort(key=lambda it: tensor_sort_key(it[0]))
    for n, t in tensors:
        w.add_tensor(n, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return [n for n, _ in tensors]


def read_gguf(path):
    """All tensors as float64 numpy arrays in HF [out, in] order (GGUF dims are
    ne0-first, so the numpy shape is the reversed GGUF shape), plus the fields."""
    r = gguf.GGUFReader(path)
    out = {}
    for t in r.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(s) for s in reversed(t.shape))
        out[t.name] = np.asarray(a, dtype=np.float64).reshape(shape)
    fields = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k.startswith("tokenizer."):
            continue
        v = f.contents()
        fields[k] = v
    return out, fields


def gguf_to_hf(m, g, unpermute_qk):
    """Inverse of gguf_tensors: GGUF tensors -> HF-named float64 weights."""
    inv = {v: k for k, v in HF_TO_GGUF.items()}
    moe = m["moe"]
    w = {}
    for n, a in g.items():
        if n == "rope_freqs.weight":
            continue
        top = {v: k for k, v in TOP_LEVEL.items()}
        if n in top:
            w[top[n]] = a
            continue
        _, l, kind, _ = n.split(".")
        p = f"model.layers.{l}."
        if kind.endswith("_exps"):
            hfname = moe["expert_names"][("ffn_gate_exps", "ffn_up_exps",
                                          "ffn_down_exps").index(kind)]
            for e in range(a.shape[0]):
                w[p + hfname.format(e=e)] = a[e]
            continue
        key = inv[kind]
        if kind == "ffn_gate_inp":
            key = moe["router"][:-len(".weight")]
        if unpermute_qk and kind == "attn_q":
            a = unpermute(a, m["nh"])
        elif unpermute_qk and kind == "attn_k":
            a = unpermute(a, m["nkv"])
        w[p + key + ".weight"] = a
    return w


# ---------------------------------------------------------------------------
# Cases and JSON
# ---------------------------------------------------------------------------
def random_ids(rng, n):
    return rng.integers(3, VOCAB, size=n).tolist()


def logit_digits(arrays):
    """Significant digits for a logits file: LOGIT_SIG_DIGITS, plus one per
    decade of max |logit| above 10, so the absolute rounding error stays
    <= LOGIT_MAX_ROUNDING_ERROR (x.xxxxx: 5e-6; xx.xxxxx needs 7 digits)."""
    mx = max(float(np.abs(a).max()) for a in arrays)
    extra = max(0, math.floor(math.log10(mx))) if mx > 0 else 0
    return LOGIT_SIG_DIGITS + extra


def round_logits(a, digits):
    """float64 logits -> nested lists of floats rounded (from float64) to
    `digits` significant digits; json writes each as its shortest repr."""
    return [[float(f"{v:.{digits}g}") for v in row.tolist()] for row in a]


def case_entry(name, ids, logits, experts=None):
    """One JSON case.  Prompts of up to FULL_LOGITS_MAX_LEN tokens keep every
    position (and have no "positions" key); longer ones keep the rows listed in
    "positions" (LONG_PROMPT_POSITIONS), and "argmax" / "logits" have one entry
    per listed position, in that order.  "experts" is always complete.
    "logits" stays a float64 array here; write_logits rounds it."""
    assert logits.shape == (len(ids), VOCAB)
    e = {"name": name, "token_ids": ids}
    if len(ids) > FULL_LOGITS_MAX_LEN:
        pos = [p for p in LONG_PROMPT_POSITIONS if p < len(ids)]
        assert pos[-1] == len(ids) - 1, "the last position is always recorded"
        e["positions"] = pos
        logits = logits[pos]
    e["argmax"] = logits.argmax(-1).tolist()
    if experts is not None:
        e["experts"] = experts
    e["logits"] = logits
    return e


def argmax_margin(logits):
    s = np.sort(logits, axis=-1)
    return float((s[:, -1] - s[:, -2]).min())


def write_logits(path, doc):
    """Writes doc with "cases" last, its float64 logits rounded as logit_digits
    says, and a "logits_format" entry recording how."""
    raw = [c["logits"] for c in doc["cases"]]
    digits = logit_digits(raw)
    cases = [dict(c, logits=round_logits(c["logits"], digits)) for c in doc["cases"]]
    err = max(float(np.abs(np.asarray(c["logits"], dtype=np.float64) - r).max())
              for c, r in zip(cases, raw))
    assert err <= LOGIT_MAX_ROUNDING_ERROR, err
    # rounding keeps every recorded argmax (margins are >= MIN_ARGMAX_MARGIN)
    for c in cases:
        assert np.asarray(c["logits"]).argmax(-1).tolist() == c["argmax"], c["name"]
        if "positions" in c:
            assert len(c["positions"]) == len(c["argmax"]) == len(c["logits"])
        else:
            assert len(c["token_ids"]) == len(c["argmax"]) == len(c["logits"])
    doc = {**{k: v for k, v in doc.items() if k != "cases"},
           "logits_format": {
               "significant_digits": digits,
               "rounded_from": "float64",
               "max_abs_rounding_error": float(f"{err:.3g}"),
               "positions": f"a case with more than {FULL_LOGITS_MAX_LEN} tokens "
                            "records only the positions in its \"positions\" list; "
                            "its argmax and logits have one entry per listed "
                            "position, in that order. Other cases have no "
                            "\"positions\" and record every position."},
           "cases": cases}
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")


def router_analysis(trace):
    """trace: list over layers of (sel [T,k], probs [T,E]).  Returns
    (min non-tie margin between a selected and an unselected expert,
     list of (layer, position) where a selected and an unselected expert have
     exactly equal probability)."""
    min_margin, ties = np.inf, []
    for l, (sel, probs) in enumerate(trace):
        E = probs.shape[1]
        for t in range(probs.shape[0]):
            chosen = set(sel[t].tolist())
            for i in chosen:
                for j in range(E):
                    if j in chosen:
                        continue
                    d = probs[t, i] - probs[t, j]
                    assert d >= 0, "top-k picked a lower probability"
                    if d == 0:
                        assert i < j, "tie must go to the lower expert index"
                        ties.append((l, t))
                    else:
                        min_margin = min(min_margin, d)
    return min_margin, sorted(set(ties))


def run_moe_cases(m, w, cases):
    """Forward every case; returns ({name: logits}, {name: trace})."""
    logits, traces = {}, {}
    for name, ids in cases:
        tr = []
        logits[name] = forward(m, w, ids, trace=tr)
        traces[name] = tr
    return logits, traces


# ---------------------------------------------------------------------------
# RoPE fixtures
# ---------------------------------------------------------------------------
def rope_cases(seed):
    rng = np.random.default_rng(seed)
    return [("len5", random_ids(rng, 5)), ("len40", random_ids(rng, 40)),
            ("len100", random_ids(rng, 100))]


def build_rope(tok_raw, tokens, merges):
    base_m = llama_model(None, MAX_POS)
    weights = make_weights(base_m, SEED_ROPE, qk_std=0.2)
    models = {kind: llama_model(scaling, max_pos)
              for kind, (scaling, max_pos) in ROPE_TYPES.items()}
    # one prompt set for all four types, every argmax margin >= MIN_ARGMAX_MARGIN
    for attempt in range(1000):
        cases = rope_cases(SEED_CASES + 1000 * attempt)
        results = {kind: {n: forward(m, weights, ids) for n, ids in cases}
                   for kind, m in models.items()}
        if all(argmax_margin(r[n]) >= MIN_ARGMAX_MARGIN
               for r in results.values() for n, _ in cases):
            break
    else:
        raise RuntimeError("no suitable rope prompts found")
    plain = {n: forward(base_m, weights, ids) for n, ids in cases}
    for kind, (scaling, max_pos) in ROPE_TYPES.items():
        name = f"tiny-rope-{kind}"
        m = models[kind]
        assert max(len(ids) for _, ids in cases) <= max_pos
        write_hf_dir(name, m["config"], weights, tok_raw)
        ref = results[kind]
        diff_plain = max(float(np.abs(ref[n] - plain[n]).max()) for n, _ in cases)
        # positions past original_max_position_embeddings differ the most
        assert diff_plain > 0.1, (kind, diff_plain)
        extra = {}
        if kind == "llama3":
            ff = m["rope_info"]["gguf_rope_freqs"].astype(np.float32)
            gpath = os.path.join(FIX, f"{name}.gguf")
            names = write_gguf(
                gpath, "llama", name, m, weights, tokens, merges,
                extra_kv=lambda w: (w.add_rope_dimension_count(16), w.add_vocab_size(VOCAB)),
                extra_tensors=[("rope_freqs.weight", ff)])
            g, fields = read_gguf(gpath)
            assert np.array_equal(g["rope_freqs.weight"], ff.astype(np.float64))
            # llama.cpp: angle = pos * theta^(-2i/d) / rope_freqs[i]
            inv_gguf = base_inv_freq(ROPE_THETA, 16) / g["rope_freqs.weight"]
            hf_un = gguf_to_hf(m, g, unpermute_qk=True)
            hf_perm = gguf_to_hf(m, g, unpermute_qk=False)
            for k in weights:
                assert np.array_equal(hf_un[k], weights[k].astype(np.float64)), k
            gmax = 0.0
            for n, ids in cases:
                a = forward(m, hf_un, ids, inv_freq=inv_gguf)
                b = forward(m, hf_perm, ids, inv_freq=inv_gguf, interleaved=True)
                gmax = max(gmax, float(np.abs(a - ref[n]).max()))
                assert np.allclose(b, a, rtol=0, atol=1e-10), n
            assert gmax < 1e-5, gmax
            extra["gguf"] = {"file": f"tests/fixtures/{name}.gguf", "tensors": names,
                             "max_abs_diff_gguf_rope_freqs_vs_hf": gmax}
            print(f"{name}.gguf: rope_freqs={ff.tolist()} max|diff| vs HF formula {gmax:.3g}")
        info = {"inv_freq": m["inv_freq"].tolist(), "attention_factor": m["attn_factor"]}
        for k, v in m["rope_info"].items():
            info[k] = v.tolist() if isinstance(v, np.ndarray) else v
        doc = {
            "source": f"tests/fixtures/{name}/model.safetensors"
                      + (f" (== tests/fixtures/{name}.gguf)" if kind == "llama3" else ""),
            "generator": GENERATOR,
            "config": m["config"],
            "rope": info,
            "max_abs_diff_vs_unscaled_rope": diff_plain,
            "min_argmax_margin": min(argmax_margin(ref[n]) for n, _ in cases),
            "case_search_attempt": attempt,
            "cases": [],
        }
        doc.update(extra)
        for n, ids in cases:
            doc["cases"].append(case_entry(n, ids, ref[n]))
        write_logits(os.path.join(FIX, f"{name}-logits.json"), doc)
        print(f"{name}: max|logits - unscaled rope logits| = {diff_plain:.3f}, "
              f"inv_freq={np.array2string(m['inv_freq'], precision=4)}, "
              f"attn={m['attn_factor']:.4f}")
    kinds = list(results)
    for i in range(len(kinds)):
        for j in range(i + 1, len(kinds)):
            d = max(float(np.abs(results[kinds[i]][n] - results[kinds[j]][n]).max())
                    for n, _ in cases)
            assert d > 0.1, (kinds[i], kinds[j], d)


def build_inv_freq_fixture():
    theta, d = 10000.0, 16
    types = [("default", None)] + [(k, s) for k, (s, _) in ROPE_TYPES.items()]
    out = []
    for name, scaling in types:
        inv, attn, info = rope_params(scaling, theta, d)
        e = {"name": name, "rope_scaling": scaling, "inv_freq": inv.tolist(),
             "attention_factor": attn}
        for k, v in info.items():
            e[k] = v.tolist() if isinstance(v, np.ndarray) else v
        out.append(e)
    doc = {"generator": "tests/reference/make_tiny_families.py (float64 numpy)",
           "theta": theta, "head_dim": d,
           "note": "inv_freq[i] for i in 0..head_dim/2-1 (rotate-half pairs (i, i+d/2)); "
                   "dynamic uses the static vLLM form; llama3 also lists the GGUF "
                   "rope_freqs factors (llama.cpp divides the angle by them); yarn "
                   "attention_factor multiplies cos and sin",
           "types": out}
    with open(os.path.join(FIX, "rope-scaling-inv-freq.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


# ---------------------------------------------------------------------------
# Qwen3 dense
# ---------------------------------------------------------------------------
def short_cases(seed):
    rng = np.random.default_rng(seed)
    return [("len5", random_ids(rng, 5)), ("len16", random_ids(rng, 16)),
            ("len40", random_ids(rng, 40))]


def qwen_kv(m, moe):
    def add(w):
        if moe:
            w.add_expert_count(m["config"]["num_experts"])
            w.add_expert_used_count(m["config"]["num_experts_per_tok"])
            w.add_expert_feed_forward_length(m["config"]["moe_intermediate_size"])
    return add


def check_gguf_roundtrip(m, gpath, weights, ref, cases, permuted):
    g, fields = read_gguf(gpath)
    assert fields["general.architecture"] == ("llama" if permuted else m["config"]["model_type"].replace("_", "")), fields["general.architecture"]
    hf = gguf_to_hf(m, g, unpermute_qk=permuted)
    assert sorted(hf) == sorted(weights), set(hf) ^ set(weights)
    for k in weights:
        assert np.array_equal(hf[k], weights[k].astype(np.float64)), k
    for n, ids in cases:
        assert np.array_equal(forward(m, hf, ids), ref[n]), n
    if permuted:
        hf_perm = gguf_to_hf(m, g, unpermute_qk=False)
        for n, ids in cases:
            b = forward(m, hf_perm, ids, interleaved=True)
            assert np.allclose(b, ref[n], rtol=0, atol=1e-10), n
    return fields


def build_qwen3(tok_raw, tokens, merges):
    m = qwen3_model()
    weights = make_weights(m, SEED_QWEN3)
    assert "lm_head.weight" not in weights
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (128, 64)
    assert weights["model.layers.0.self_attn.o_proj.weight"].shape == (64, 128)
    write_hf_dir("tiny-qwen3", m["config"], weights, tok_raw)
    for attempt in range(1000):
        cases = short_cases(SEED_CASES + 1 + 1000 * attempt)
        ref = {n: forward(m, weights, ids) for n, ids in cases}
        if all(argmax_margin(ref[n]) >= MIN_ARGMAX_MARGIN for n, _ in cases):
            break
    else:
        raise RuntimeError("no suitable qwen3 prompts found")
    gpath = os.path.join(FIX, "tiny-qwen3.gguf")
    names = write_gguf(gpath, "qwen3", "tiny-qwen3", m, weights, tokens, merges,
                       extra_kv=qwen_kv(m, False))
    check_gguf_roundtrip(m, gpath, weights, ref, cases, permuted=False)
    # q/k norm matters: dropping it changes the logits
    m_nonorm = dict(m, qk_norm=False)
    assert max(float(np.abs(forward(m_nonorm, weights, ids) - ref[n]).max())
               for n, ids in cases) > 0.1
    doc = {"source": "tests/fixtures/tiny-qwen3/model.safetensors "
                     "(== tests/fixtures/tiny-qwen3.gguf)",
           "generator": GENERATOR, "config": m["config"],
           "gguf": {"file": "tests/fixtures/tiny-qwen3.gguf", "tensors": names},
           "min_argmax_margin": min(argmax_margin(ref[n]) for n, _ in cases),
           "case_search_attempt": attempt,
           "cases": [case_entry(n, ids, ref[n]) for n, ids in cases]}
    write_logits(os.path.join(FIX, "tiny-qwen3-logits.json"), doc)
    print("tiny-qwen3: GGUF round trip exact")


# ---------------------------------------------------------------------------
# MoE fixtures
# ---------------------------------------------------------------------------
def experts_json(trace):
    """[[[e0, e1] per position] per layer], in selection order (descending
    probability, equal probability -> lower index first)."""
    return [sel.tolist() for sel, _ in trace]


def pick_moe_cases(ms_and_w, seed, need_tie):
    """Deterministically search case token ids until every model in ms_and_w
    has: selections that change between positions in every case and layer,
    no near-tie router decision, no near-tie argmax, and (need_tie) an exact
    top-k boundary tie."""
    for attempt in range(1000):
        cases = short_cases(seed + 1000 * attempt)
        ok, out = True, []
        for m, w in ms_and_w:
            logits, traces = run_moe_cases(m, w, cases)
            ties, margin = [], np.inf
            for n, ids in cases:
                mm, tt = router_analysis(traces[n])
                margin = min(margin, mm)
                ties += [(n, l, t) for l, t in tt]
                for sel, _ in traces[n]:
                    if len({tuple(r) for r in sel.tolist()}) < 2:
                        ok = False
            if margin < MIN_ROUTER_MARGIN or (need_tie and not ties):
                ok = False
            if any(argmax_margin(logits[n]) < MIN_ARGMAX_MARGIN for n, _ in cases):
                ok = False
            out.append((logits, traces, margin, ties))
        if ok:
            return cases, out, attempt
    raise RuntimeError("no suitable MoE prompts found")


def moe_doc(m, name, cases, logits, traces, margin, ties, gguf_info, attempt):
    doc = {"source": f"tests/fixtures/{name}/model.safetensors"
                     + (f" (== {gguf_info['file']})" if gguf_info else ""),
           "generator": GENERATOR, "config": m["config"],
           "routing": {
               "rule": "softmax(router logits) in float64; top-k by a stable "
                       "descending sort (equal probability -> lower expert "
                       "index first); weights = top-k probabilities"
                       + (" divided by their sum" if m["moe"]["normalize"]
                          else " as they are (not renormalized)"),
               "experts_layout": "cases[i].experts[layer][position] = [e0, e1] "
                                 "in selection order",
               "min_margin_selected_vs_unselected": margin,
               "exact_ties_at_top_k_boundary": [
                   {"case": n, "layer": l, "position": t} for n, l, t in ties],
           },
           "min_argmax_margin": min(argmax_margin(logits[n]) for n, _ in cases),
           "case_search_attempt": attempt,
           "cases": []}
    if gguf_info:
        doc["gguf"] = gguf_info
    for n, ids in cases:
        doc["cases"].append(case_entry(n, ids, logits[n], experts=experts_json(traces[n])))
    return doc


def build_mixtral(tok_raw, tokens, merges):
    m = mixtral_model()
    weights = make_weights(m, SEED_MIXTRAL)
    # identical router rows for experts 2 and 3 in layer 1 -> exact ties
    r = weights["model.layers.1.block_sparse_moe.gate.weight"]
    r[3] = r[2]
    write_hf_dir("tiny-mixtral", m["config"], weights, tok_raw)
    cases, [(logits, traces, margin, ties)], attempt = pick_moe_cases(
        [(m, weights)], SEED_CASES + 2, need_tie=True)
    assert all(l == 1 for _, l, _ in ties)
    gpath = os.path.join(FIX, "tiny-mixtral.gguf")

    def kv(w):
        w.add_rope_dimension_count(16)
        w.add_vocab_size(VOCAB)
        w.add_expert_count(4)
        w.add_expert_used_count(2)
    names = write_gguf(gpath, "llama", "tiny-mixtral", m, weights, tokens, merges, extra_kv=kv)
    check_gguf_roundtrip(m, gpath, weights, logits, cases, permuted=True)
    # the tie rule matters: breaking ties towards the HIGHER index changes logits
    swapped = dict(weights)
    for hf in ("w1", "w3", "w2"):
        a = f"model.layers.1.block_sparse_moe.experts.2.{hf}.weight"
        b = f"model.layers.1.block_sparse_moe.experts.3.{hf}.weight"
        swapped[a], swapped[b] = weights[b], weights[a]
    tie_cases = sorted({n for n, _, _ in ties})
    dmax = max(float(np.abs(forward(m, swapped, ids) - logits[n]).max())
               for n, ids in cases if n in tie_cases)
    assert dmax > 1e-3, dmax
    doc = moe_doc(m, "tiny-mixtral", cases, logits, traces, margin, ties,
                  {"file": "tests/fixtures/tiny-mixtral.gguf", "tensors": names}, attempt)
    doc["routing"]["identical_router_rows"] = {"layer": 1, "experts": [2, 3]}
    doc["routing"]["max_abs_logit_diff_if_ties_went_to_higher_index"] = dmax
    write_logits(os.path.join(FIX, "tiny-mixtral-logits.json"), doc)
    print(f"tiny-mixtral: router ties at (case, layer, pos) {ties}; min margin "
          f"{margin:.3g}; attempt {attempt}; tie rule flips logits by {dmax:.3g}")


def build_qwen3_moe(tok_raw, tokens, merges):
    m = qwen3_moe_model(True)
    mu = qwen3_moe_model(False)
    weights = make_weights(m, SEED_QWEN3_MOE)
    write_hf_dir("tiny-qwen3-moe", m["config"], weights, tok_raw)
    write_hf_dir("tiny-qwen3-moe-unnormalized", mu["config"], weights, tok_raw)
    cases, results, attempt = pick_moe_cases([(m, weights), (mu, weights)],
                                             SEED_CASES + 3, need_tie=False)
    gpath = os.path.join(FIX, "tiny-qwen3-moe.gguf")
    names = write_gguf(gpath, "qwen3moe", "tiny-qwen3-moe", m, weights, tokens, merges,
                       extra_kv=qwen_kv(m, True))
    check_gguf_roundtrip(m, gpath, weights, results[0][0], cases, permuted=False)
    d = max(float(np.abs(results[0][0][n] - results[1][0][n]).max()) for n, _ in cases)
    assert d > 0.05, d
    for (mm, name, gi), (logits, traces, margin, ties) in zip(
            [(m, "tiny-qwen3-moe", {"file": "tests/fixtures/tiny-qwen3-moe.gguf",
                                    "tensors": names}),
             (mu, "tiny-qwen3-moe-unnormalized", None)], results):
        doc = moe_doc(mm, name, cases, logits, traces, margin, ties, gi, attempt)
        if gi is None:
            doc["same_weights_as"] = "tests/fixtures/tiny-qwen3-moe/model.safetensors"
        doc["max_abs_diff_normalized_vs_unnormalized"] = d
        write_logits(os.path.join(FIX, f"{name}-logits.json"), doc)
        print(f"{name}: min router margin {margin:.3g}; attempt {attempt}")


def main():
    tok_raw, tokens, merges = load_tokenizer()
    build_inv_freq_fixture()
    build_rope(tok_raw, tokens, merges)
    build_qwen3(tok_raw, tokens, merges)
    build_mixtral(tok_raw, tokens, merges)
    build_qwen3_moe(tok_raw, tokens, merges)


if __name__ == "__main__":
    main()
