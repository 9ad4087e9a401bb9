#!/usr/bin/env python3
"""Build the tiny random Llama fixture and its reference logits.

    python3 tests/reference/make_tiny_llama.py          # from the repo root

Writes (deterministically, fixed seeds):

  tests/fixtures/tiny-llama/config.json          HF config (LlamaForCausalLM)
  tests/fixtures/tiny-llama/model.safetensors    f32 weights, HF names, [out, in]
  tests/fixtures/tiny-llama/tokenizer.json       HF tokenizers byte-level BPE (384 ids)
  tests/fixtures/tiny-llama.gguf                 same model, GGUF v3, F32, llama.cpp layout
  tests/fixtures/tiny-llama-q8_0.gguf            same, 2-D weights quantized to Q8_0
  tests/fixtures/tiny-llama-logits.json          float64 numpy forward of the f32 model
  tests/fixtures/tiny-llama-q8_0-logits.json     float64 numpy forward of the
                                                 dequantized Q8_0 weights
  tests/fixtures/tiny-llama-tokenizer-cases.json text -> ids with the tiny tokenizer

Reference forward pass (float64, written here, no ML framework):
  x = embed[ids]
  per layer:  h = rmsnorm(x, w_in);  q,k,v = h Wq^T, h Wk^T, h Wv^T
              rotate-half RoPE (HF convention) on q and k, inv_freq = theta^(-2i/d)
              causal GQA attention (kv head = q head // (n_heads / n_kv_heads)),
              softmax scale 1/sqrt(head_dim);  x += attn Wo^T
              h = rmsnorm(x, w_post);  x += Wdown (silu(Wgate h) * Wup h)
  logits = rmsnorm(x, w_final) Wlm^T
  rmsnorm(x, w) = x / sqrt(mean(x^2) + eps) * w

GGUF q/k layout: llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute) stores
attn_q / attn_k with rows permuted so that llama.cpp can use *interleaved*
(adjacent-pair) RoPE:
    w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)
with n_head = n_kv_heads for attn_k.  This script asserts two things on the
GGUF file it wrote (read back with gguf.GGUFReader):
  * un-permuting q/k and running the HF (rotate-half) forward reproduces the
    safetensors logits exactly;
  * running an interleaved-RoPE forward directly on the permuted weights gives
    the same logits (so either engine strategy is valid).
"""

from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np
import regex
from safetensors.numpy import load_file, save_file

import gguf

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIX = os.path.join(REPO, "tests", "fixtures")
HF_DIR = os.path.join(FIX, "tiny-llama")

# ---------------------------------------------------------------------------
# Model hyper-parameters
# ---------------------------------------------------------------------------
CFG = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)
SEED = 20240611

# ---------------------------------------------------------------------------
# Tokenizer: 3 specials + 256 byte symbols + 125 greedily learned merges
# ---------------------------------------------------------------------------
SPECIALS = ["<unk>", "<s>", "</s>"]
N_MERGES = CFG["vocab_size"] - len(SPECIALS) - 256  # 125
GPT2_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox
ran into the forest. In the beginning there was nothing but the sound of the wind
and the rain on the roof of the old house. She said that they would go to the
market in the morning, and then they would come back to the house in the evening.
There is a theory that the world is made of small things that interact with each
other. The model reads the text and predicts the next token, one token at a time.
It is the best of times, it is the worst of times; it is the age of wisdom, it is
the age of foolishness. We are testing a tiny language model with a tiny tokenizer,
and the tokenizer should learn the most common pairs of characters in this text.
Hello world! How are you doing today? I am doing well, thank you for asking.
The cat sat on the mat, and the rat ran under the hat. These are the things that
matter: the weather, the season, the hour, and the people that we meet.
"""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def learn_tokenizer():
    """Greedy BPE training: most frequent adjacent pair first; ties broken by the
    lexicographically smallest (left, right) pair.  A pair whose concatenation
    is already a vocab entry is skipped so every merge adds a new token."""
    b2u = bytes_to_unicode()
    tokens = list(SPECIALS) + [b2u[b] for b in range(256)]
    vocab = set(tokens)
    words = Counter()
    for w in regex.findall(GPT2_PATTERN, TRAINING_TEXT):
        words[tuple(b2u[b] for b in w.encode("utf-8"))] += 1
    words = {w: c for w, c in words.items()}
    merges = []
    banned = set()
    while len(merges) < N_MERGES:
        pairs = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += c
        cands = [(-c, p) for p, c in pairs.items() if p not in banned]
        if not cands:
            raise RuntimeError("training text too small for the requested merges")
        _, best = min(cands)
        if best[0] + best[1] in vocab:
            banned.add(best)
            continue
        merges.append(best)
        tokens.append(best[0] + best[1])
        vocab.add(best[0] + best[1])
        new_words = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i < len(w) - 1 and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] = new_words.get(tuple(out), 0) + c
        words = new_words
    assert len(tokens) == CFG["vocab_size"] and len(set(tokens)) == len(tokens)
    return tokens, merges


def tokenizer_json(tokens, merges):
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": t, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
            for i, t in enumerate(SPECIALS)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                          "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False,
                    "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": [f"{a} {b}" for a, b in merges],
        },
    }


# ---------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------
def make_weights():
    rng = np.random.default_rng(SEED)
    H, I, V = CFG["hidden_size"], CFG["intermediate_size"], CFG["vocab_size"]
    nh, nkv, hd = CFG["num_attention_heads"], CFG["num_key_value_heads"], CFG["head_dim"]

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm_w(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": normal((V, H), 0.5)}
    for l in range(CFG["num_hidden_layers"]):
        p = f"model.layers.{l}."
        w[p + "input_layernorm.weight"] = norm_w(H)
        w[p + "self_attn.q_proj.weight"] = normal((nh * hd, H), 0.08)
        w[p + "self_attn.k_proj.weight"] = normal((nkv * hd, H), 0.08)
        w[p + "self_attn.v_proj.weight"] = normal((nkv * hd, H), 0.08)
        w[p + "self_attn.o_proj.weight"] = normal((H, nh * hd), 0.08)
        w[p + "post_attention_layernorm.weight"] = norm_w(H)
        w[p + "mlp.gate_proj.weight"] = normal((I, H), 0.08)
        w[p + "mlp.up_proj.weight"] = normal((I, H), 0.08)
        w[p + "mlp.down_proj.weight"] = normal((H, I), 0.08)
    w["model.norm.weight"] = norm_w(H)
    w["lm_head.weight"] = normal((V, H), 0.08)
    return w


# ---------------------------------------------------------------------------
# llama.cpp q/k row permutation (convert_hf_to_gguf.py, LlamaModel.permute)
# ---------------------------------------------------------------------------
def permute(w, n_head):
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


def unpermute(w, n_head):
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf):
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    l = parts[2]
    key = ".".join(parts[3:-1])
    return f"blk.{l}.{HF_TO_GGUF[key]}.weight"


def write_gguf(path, weights, tokens, merges, quant):
    """quant: None (all F32) or 'Q8_0' (2-D matrices Q8_0, 1-D norms F32)."""
    nh, nkv = CFG["num_attention_heads"], CFG["num_key_value_heads"]
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny-llama")
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if quant is None
                    else gguf.LlamaFileType.MOSTLY_Q8_0)
    if quant is not None:
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(CFG["num_hidden_layers"])
    w.add_context_length(CFG["max_position_embeddings"])
    w.add_embedding_length(CFG["hidden_size"])
    w.add_feed_forward_length(CFG["intermediate_size"])
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_freq_base(CFG["rope_theta"])
    w.add_layer_norm_rms_eps(CFG["rms_norm_eps"])
    w.add_rope_dimension_count(CFG["head_dim"])
    w.add_key_length(CFG["head_dim"])
    w.add_value_length(CFG["head_dim"])
    w.add_vocab_size(CFG["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS)
                      + [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(CFG["bos_token_id"])
    w.add_eos_token_id(CFG["eos_token_id"])
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    for hf, t in weights.items():
        t = np.ascontiguousarray(t, dtype=np.float32)
        if ".q_proj." in hf:
            t = permute(t, nh)
        elif ".k_proj." in hf:
            t = permute(t, nkv)
        name = gguf_name(hf)
        if quant == "Q8_0" and t.ndim == 2:
            q = gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_gguf_as_hf(path, interleaved):
    """Read a GGUF back into HF-named float64 arrays (dequantizing).  If
    interleaved is False, q/k rows are un-permuted to the HF layout."""
    nh, nkv = CFG["num_attention_heads"], CFG["num_key_value_heads"]
    r = gguf.GGUFReader(path)
    inv = {gguf_name(k): k for k in make_weights_names()}
    out = {}
    for t in r.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(s) for s in reversed(t.shape))  # GGUF dims are ne0-first
        a = np.asarray(a, dtype=np.float64).reshape(shape)
        hf = inv[t.name]
        if not interleaved:
            if ".q_proj." in hf:
                a = unpermute(a, nh)
            elif ".k_proj." in hf:
                a = unpermute(a, nkv)
        out[hf] = a
    return out


def make_weights_names():
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for l in range(CFG["num_hidden_layers"]):
        for k in HF_TO_GGUF:
            names.append(f"model.layers.{l}.{k}.weight")
    return names


# ---------------------------------------------------------------------------
# Reference forward pass (float64)
# ---------------------------------------------------------------------------
def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_tables(T, d, theta):
    inv_freq = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # [d/2]
    ang = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]  # [T, d/2]
    return np.cos(ang), np.sin(ang)


def rope_rotate_half(x, cos, sin):
    """HF convention: pairs (i, i + d/2). x: [T, heads, d]."""
    d2 = x.shape[-1] // 2
    x1, x2 = x[..., :d2], x[..., d2:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def rope_interleaved(x, cos, sin):
    """llama.cpp 'normal' rope: pairs (2i, 2i+1)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x2 * c + x1 * s
    return out


def forward(w, ids, interleaved=False, kv_cache=None):
    """Full-sequence causal forward; returns float64 logits [T, vocab].

    kv_cache(x, is_key), when given, maps each layer's keys (after RoPE) and
    values, each [T, kv_head, head_dim], to what a KV cache holds of them."""
    H = CFG["hidden_size"]
    nh, nkv, hd = CFG["num_attention_heads"], CFG["num_key_value_heads"], CFG["head_dim"]
    eps = CFG["rms_norm_eps"]
    w = {k: np.asarray(v, dtype=np.float64) for k, v in w.items()}
    T = len(ids)
    x = w["model.embed_tokens.weight"][np.asarray(ids)]
    cos, sin = rope_tables(T, hd, CFG["rope_theta"])
    rope = rope_interleaved if interleaved else rope_rotate_half
    mask = np.triu(np.full((T, T), -np.inf), k=1)
    group = nh // nkv
    for l in range(CFG["num_hidden_layers"]):
        p = f"model.layers.{l}."
        h = rmsnorm(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, nh, hd)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, hd)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache(k, True), kv_cache(v, False)
        att = np.empty((T, nh, hd))
        for hh in range(nh):
            kv = hh // group
            s = q[:, hh, :] @ k[:, kv, :].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            s /= s.sum(axis=-1, keepdims=True)
            att[:, hh, :] = s @ v[:, kv, :]
        x = x + att.reshape(T, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        h = rmsnorm(x, w[p + "post_attention_layernorm.weight"], eps)
        g = h @ w[p + "mlp.gate_proj.weight"].T
        u = h @ w[p + "mlp.up_proj.weight"].T
        x = x + ((g / (1.0 + np.exp(-g))) * u) @ w[p + "mlp.down_proj.weight"].T
    x = rmsnorm(x, w["model.norm.weight"], eps)
    return x @ w["lm_head.weight"].T


# Prompts: case (a) plus mixed lengths 1, 5, 23, 40 for batched tests.
def make_cases():
    rng = np.random.default_rng(SEED + 1)
    cases = [("prompt12", [1, 17, 250, 3, 99, 42, 7, 300, 5, 128, 64, 11])]
    for n in (1, 5, 23, 40):
        ids = [1] + rng.integers(3, CFG["vocab_size"], size=n - 1).tolist()
        cases.append((f"len{n}", ids))
    return cases


def f32round(a):
    """float64 -> nearest float32 -> 7 significant digits (round-trips well
    within any sane tolerance; keeps the JSON small)."""
    return [[float(f"{v:.7g}") for v in row] for row in a.astype(np.float32)]


def write_logits(path, weights, cases, source, extra=None):
    doc = {
        "source": source,
        "generator": "tests/reference/make_tiny_llama.py (float64 numpy forward)",
        "config": dict(CFG, tie_word_embeddings=False, model_type="llama"),
        "cases": [],
    }
    if extra:
        doc.update(extra)
    for name, ids in cases:
        logits = forward(weights, ids)
        doc["cases"].append({"name": name, "token_ids": ids,
                             "argmax": logits.argmax(-1).tolist(),
                             "logits": f32round(logits)})
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")


TOKENIZER_CASES = [
    "The quick brown fox jumps over the lazy dog.",
    "<s>Hello world!</s>",
    "numbers 12345 and 3.14",
    "naïve café 🚀",
    "a  b   c\t\td\n\n\ne",
    "   leading and trailing   ",
    "it's what they've said",
    "",
]


def write_tokenizer_cases(tokens, merges):
    """Encode a few strings with the independent pure-Python BPE from
    bpe_reference.py (GPT-2 regex only -- no digit splitting for this
    tokenizer -- plus the 3 specials matched literally)."""
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bpe_reference import ByteLevelBPE
    bpe = ByteLevelBPE(tokens, [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)),
                       [f"{a} {b}" for a, b in merges], split_digits=False)
    try:
        from tokenizers import Tokenizer
        hf = Tokenizer.from_file(os.path.join(HF_DIR, "tokenizer.json"))
    except ImportError:
        hf = None
    cases = []
    for text in TOKENIZER_CASES:
        ids = bpe.encode(text)
        assert bpe.decode(ids) == text
        if hf is not None:  # cross-check only
            assert hf.encode(text, add_special_tokens=False).ids == ids, text
        cases.append({"text": text, "ids": ids})
    with open(os.path.join(FIX, "tiny-llama-tokenizer-cases.json"), "w",
              encoding="utf-8") as f:
        json.dump({"generator": "tests/reference/make_tiny_llama.py "
                                "(pure-Python BPE from bpe_reference.py)",
                   "add_bos": False, "cases": cases}, f, ensure_ascii=False, indent=1)
        f.write("\n")


def main():
    os.makedirs(HF_DIR, exist_ok=True)

    # --- tokenizer ---------------------------------------------------------
    tokens, merges = learn_tokenizer()
    tj = tokenizer_json(tokens, merges)
    with open(os.path.join(HF_DIR, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False, indent=1)
        f.write("\n")
    try:  # optional sanity check with the HF tokenizers Python binding
        from tokenizers import Tokenizer
        tk = Tokenizer.from_file(os.path.join(HF_DIR, "tokenizer.json"))
        assert tk.get_vocab_size(with_added_tokens=True) == CFG["vocab_size"]
        s = "<s>The quick brown fox, naïve 🚀!</s>"
        enc = tk.encode(s, add_special_tokens=False)
        assert enc.ids[0] == 1 and enc.ids[-1] == 2
        assert tk.decode(enc.ids, skip_special_tokens=False) == s, tk.decode(enc.ids)
        print("tokenizer.json loads with HF tokenizers; sample ids:", enc.ids)
    except ImportError:
        print("tokenizers not installed; skipped tokenizer.json load check")

    write_tokenizer_cases(tokens, merges)

    # --- HF checkpoint -----------------------------------------------------
    weights = make_weights()
    save_file(weights, os.path.join(HF_DIR, "model.safetensors"),
              metadata={"format": "pt"})
    os.chmod(os.path.join(HF_DIR, "model.safetensors"), 0o644)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        "rope_scaling": None,
        "use_cache": True,
        **CFG,
    }
    with open(os.path.join(HF_DIR, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    # sanity: what we saved is what we use
    back = load_file(os.path.join(HF_DIR, "model.safetensors"))
    assert all(np.array_equal(back[k], weights[k]) for k in weights)

    # --- GGUF (F32 and Q8_0) ----------------------------------------------
    f32_path = os.path.join(FIX, "tiny-llama.gguf")
    q8_path = os.path.join(FIX, "tiny-llama-q8_0.gguf")
    write_gguf(f32_path, weights, tokens, merges, quant=None)
    write_gguf(q8_path, weights, tokens, merges, quant="Q8_0")

    # --- reference logits ---------------------------------------------------
    cases = make_cases()
    ref = {name: forward(weights, ids) for name, ids in cases}

    # GGUF F32 round-trip checks (both RoPE strategies)
    g_unperm = read_gguf_as_hf(f32_path, interleaved=False)
    g_perm = read_gguf_as_hf(f32_path, interleaved=True)
    for k in weights:
        assert np.array_equal(g_unperm[k], weights[k].astype(np.float64)), k
    for name, ids in cases:
        a = forward(g_unperm, ids)
        b = forward(g_perm, ids, interleaved=True)
        assert np.array_equal(a, ref[name]), name
        assert np.allclose(b, ref[name], rtol=0, atol=1e-10), (name, np.abs(b - ref[name]).max())
    print("GGUF F32: un-permuted rotate-half and permuted interleaved forwards "
          "both match the safetensors forward")

    write_logits(os.path.join(FIX, "tiny-llama-logits.json"), weights, cases,
                 source="tests/fixtures/tiny-llama/model.safetensors "
                        "(== tests/fixtures/tiny-llama.gguf)")

    # Q8_0: reference from the dequantized Q8_0 weights
    q8 = read_gguf_as_hf(q8_path, interleaved=False)
    q8_perm = read_gguf_as_hf(q8_path, interleaved=True)
    maxdiff = 0.0
    for name, ids in cases:
        a = forward(q8, ids)
        b = forward(q8_perm, ids, interleaved=True)
        assert np.allclose(a, b, rtol=0, atol=1e-10), name
        maxdiff = max(maxdiff, float(np.abs(a - ref[name]).max()))
    print(f"Q8_0 weights vs f32: max |logit diff| = {maxdiff:.4g}")
    write_logits(os.path.join(FIX, "tiny-llama-q8_0-logits.json"), q8, cases,
                 source="dequantized weights of tests/fixtures/tiny-llama-q8_0.gguf",
                 extra={"max_abs_diff_vs_f32_logits": maxdiff})

    for name, ids in cases:
        l = ref[name]
        print(f"case {name:9s} T={len(ids):3d} logit std={l.std():.3f} "
              f"argmax={l.argmax(-1)[:8].tolist()}")


if __name__ == "__main__":
    main()
