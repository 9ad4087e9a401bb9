#!/usr/bin/env python3
"""Greedy-decoding reference for the default model (SmolLM2-135M-Instruct Q4_1).

    python3 tests/reference/smollm2_reference.py        # from the repo root (~30 s)

Writes ``tests/fixtures/smollm2-greedy.json``.

How it is computed (no ML framework, nothing from the Rust engine):
  * weights: every tensor of ``models/SmolLM2-135M-Instruct.Q4_1.gguf`` is read
    with ``gguf.GGUFReader`` and dequantized with ``gguf.quants.dequantize``
    (Q4_1 matrices, Q8_0 token_embd, F32 norms) to float32, then widened to
    float64 for the arithmetic (so the reference is the exact function of the
    dequantized weights, up to float64 rounding).
  * q/k layout: llama.cpp stores attn_q / attn_k rows permuted for interleaved
    RoPE.  This script UN-PERMUTES them (n_head 9 for q, n_head_kv 3 for k) back
    to the HF layout and uses HF rotate-half RoPE (pairs (i, i + d/2)).  That is
    mathematically identical to applying interleaved RoPE to the permuted rows.
  * the first rows of a few Q4_1 and Q8_0 tensors are also dequantized by
    hand (ggml block layouts) and asserted equal to gguf.quants.dequantize.
  * RoPE theta and RMSNorm eps come from the GGUF metadata (100000.0 and
    float32(1e-5)); inv_freq = theta^(-2i/64).
  * tied embeddings: the file has no ``output.weight``; the LM head is
    ``token_embd``.
  * prompts: token ids from the independent tokenizer in ``bpe_reference.py``
    (no BOS is added: tokenizer.ggml.add_bos_token is false).
  * decoding: prefill the prompt, then 24 greedy steps with a numpy KV cache.
    Generation does NOT stop at EOS; ``first_eos_index`` records the index in
    ``greedy_ids`` of the first EOS-like token (<|im_end|> = 2 or
    <|endoftext|> = 0), or null, so an engine that stops at EOS can compare
    the prefix ``greedy_ids[:first_eos_index + 1]``.
  * ``margins[i]`` = top-1 logit minus top-2 logit at the step that produced
    ``greedy_ids[i]``.  An engine with quantized activations may legitimately
    diverge where this margin is tiny; a test should only require agreement
    up to the first step whose margin is below its tolerance.
  * prompt 0 additionally stores ``last_logits``: all 49152 logits at the last
    prompt position (5 significant digits).
  * as a sanity check the same greedy decode is repeated in float32 and the
    ids are compared (reported in ``float32_agrees``; mismatches only happen at
    near-ties).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import gguf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bpe_reference import load_from_gguf  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GGUF_PATH = os.path.join(REPO, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
OUT = os.path.join(REPO, "tests", "fixtures", "smollm2-greedy.json")
N_NEW = 24

PROMPTS = [
    ("capital", "The capital of France is"),
    ("code", "def fibonacci(n):"),
    ("count", "1, 2, 3, 4, 5,"),
    ("chat", "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
             "trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the "
             "capital of France?<|im_end|>\n<|im_start|>assistant\n"),
]
EOS_LIKE = (0, 2)


def unpermute(w, n_head):
    """Inverse of llama.cpp convert_hf_to_gguf.py LlamaModel.permute."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


def manual_dequant_rows(t, nrows=4):
    """Hand-written dequantization of the first rows of a Q4_1 / Q8_0 tensor
    (ggml block layouts), used to cross-check gguf.quants.dequantize."""
    raw = np.asarray(t.data[:nrows], dtype=np.uint8)
    if t.tensor_type == gguf.GGMLQuantizationType.Q4_1:
        # block of 32: f16 d, f16 m, 16 bytes; low nibbles -> x[0..16], high -> x[16..32]
        b = raw.reshape(nrows, -1, 20)
        d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
        m = b[..., 2:4].copy().view(np.float16).astype(np.float32)
        qs = b[..., 4:20]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
        return (q * d + m).reshape(nrows, -1)
    if t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
        # block of 32: f16 d, 32 x int8
        b = raw.reshape(nrows, -1, 34)
        d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
        q = b[..., 2:34].copy().view(np.int8).astype(np.float32)
        return (q * d).reshape(nrows, -1)
    return None


class Model:
    def __init__(self, path, dtype):
        r = gguf.GGUFReader(path)
        meta = {k: f.contents() for k, f in r.fields.items()
                if k.startswith("llama.")}
        self.n_layer = int(meta["llama.block_count"])
        self.n_embd = int(meta["llama.embedding_length"])
        self.n_head = int(meta["llama.attention.head_count"])
        self.n_kv = int(meta["llama.attention.head_count_kv"])
        self.hd = self.n_embd // self.n_head
        self.theta = float(meta["llama.rope.freq_base"])
        self.eps = float(meta["llama.attention.layer_norm_rms_epsilon"])
        assert int(meta["llama.rope.dimension_count"]) == self.hd
        self.dtype = dtype
        self.w = {}
        for t in r.tensors:
            a = gguf.quants.dequantize(t.data, t.tensor_type)
            a = np.asarray(a, dtype=np.float32).reshape(
                tuple(int(s) for s in reversed(t.shape)))
            if t.name in ("token_embd.weight", "blk.0.attn_q.weight",
                          "blk.29.ffn_down.weight"):
                ref = manual_dequant_rows(t)
                assert ref is not None and np.array_equal(ref, a[:4]), t.name
            if t.name.endswith("attn_q.weight"):
                a = unpermute(a, self.n_head)
            elif t.name.endswith("attn_k.weight"):
                a = unpermute(a, self.n_kv)
            self.w[t.name] = np.ascontiguousarray(a, dtype=dtype)
        assert "output.weight" not in self.w, "expected tied embeddings"
        self.w["output.weight"] = self.w["token_embd.weight"]
        self.meta = meta

    def rmsnorm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos):
        """HF rotate-half RoPE. x: [T, heads, hd]; pos: [T]."""
        d2 = self.hd // 2
        inv = self.theta ** (-np.arange(0, self.hd, 2, dtype=np.float64) / self.hd)
        ang = np.asarray(pos, dtype=np.float64)[:, None] * inv[None, :]
        c = np.cos(ang).astype(self.dtype)[:, None, :]
        s = np.sin(ang).astype(self.dtype)[:, None, :]
        x1, x2 = x[..., :d2], x[..., d2:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

    def step(self, ids, cache):
        """Process ids (continuing after cache); returns logits of the last
        position [vocab] and optionally all positions.  cache: list of (K, V)."""
        w, dt = self.w, self.dtype
        T = len(ids)
        start = cache[0][0].shape[0] if cache[0] is not None else 0
        pos = np.arange(start, start + T)
        x = w["token_embd.weight"][np.asarray(ids)]
        group = self.n_head // self.n_kv
        scale = dt(1.0 / np.sqrt(self.hd))
        for l in range(self.n_layer):
            p = f"blk.{l}."
            h = self.rmsnorm(x, w[p + "attn_norm.weight"])
            q = (h @ w[p + "attn_q.weight"].T).reshape(T, self.n_head, self.hd)
            k = (h @ w[p + "attn_k.weight"].T).reshape(T, self.n_kv, self.hd)
            v = (h @ w[p + "attn_v.weight"].T).reshape(T, self.n_kv, self.hd)
            q, k = self.rope(q, pos), self.rope(k, pos)
            if cache[l] is not None:
                k = np.concatenate([cache[l][0], k], axis=0)
                v = np.concatenate([cache[l][1], v], axis=0)
            cache[l] = (k, v)
            S = k.shape[0]
            # causal mask: query at absolute position start+i sees keys 0..start+i
            mask = np.where(np.arange(S)[None, :] <= pos[:, None], 0.0, -np.inf).astype(dt)
            att = np.empty((T, self.n_head, self.hd), dtype=dt)
            for hh in range(self.n_head):
                kv = hh // group
                s = q[:, hh, :] @ k[:, kv, :].T * scale + mask
                s = np.exp(s - s.max(axis=-1, keepdims=True))
                s /= s.sum(axis=-1, keepdims=True)
                att[:, hh, :] = s @ v[:, kv, :]
            x = x + att.reshape(T, -1) @ w[p + "attn_output.weight"].T
            h = self.rmsnorm(x, w[p + "ffn_norm.weight"])
            g = h @ w[p + "ffn_gate.weight"].T
            u = h @ w[p + "ffn_up.weight"].T
            x = x + ((g / (1 + np.exp(-g))) * u) @ w[p + "ffn_down.weight"].T
        x = self.rmsnorm(x[-1:], w["output_norm.weight"])
        return (x @ w["output.weight"].T)[0]

    def greedy(self, prompt_ids, n_new):
        cache = [None] * self.n_layer
        logits = self.step(prompt_ids, cache)
        first_logits = logits.copy()
        ids, margins = [], []
        for i in range(n_new):
            top2 = np.argpartition(-logits, 2)[:2]
            top2 = top2[np.argsort(-logits[top2], kind="stable")]
            nxt = int(np.argmax(logits))  # lowest id on exact ties
            assert logits[nxt] == logits[top2[0]]
            ids.append(nxt)
            margins.append(float(logits[top2[0]] - logits[top2[1]]))
            if i + 1 < n_new:
                logits = self.step([nxt], cache)
        return ids, margins, first_logits


def sig(x, n):
    return float(f"{x:.{n}g}")


def main():
    t0 = time.time()
    tok = load_from_gguf(GGUF_PATH)
    m64 = Model(GGUF_PATH, np.float64)
    print(f"loaded+dequantized in {time.time() - t0:.1f}s; layers={m64.n_layer} "
          f"heads={m64.n_head}/{m64.n_kv} hd={m64.hd} theta={m64.theta} eps={m64.eps}")
    results = []
    for idx, (name, text) in enumerate(PROMPTS):
        pids = tok.encode(text)
        assert tok.decode(pids) == text
        t1 = time.time()
        ids, margins, last = m64.greedy(pids, N_NEW)
        # KV-cache consistency: a fresh, cache-less prefill of prompt + all but
        # the last generated token must predict the last token with the same margin
        chk = m64.step(pids + ids[:-1], [None] * m64.n_layer)
        srt = np.sort(chk)
        assert int(np.argmax(chk)) == ids[-1]
        assert abs((srt[-1] - srt[-2]) - margins[-1]) < 1e-8
        eos = next((i for i, t in enumerate(ids) if t in EOS_LIKE), None)
        rec = {
            "name": name,
            "text": text,
            "prompt_ids": pids,
            "greedy_ids": ids,
            "greedy_text": tok.decode(ids),
            "first_eos_index": eos,
            "margins": [sig(x, 6) for x in margins],
        }
        if idx == 0:
            rec["last_logits"] = [sig(float(x), 5) for x in last]
        results.append(rec)
        print(f"[{name}] {time.time() - t1:.1f}s prompt_len={len(pids)} "
              f"min_margin={min(margins):.4f} eos_at={eos}\n  -> {rec['greedy_text']!r}")
    del m64

    # float32 cross-check of the greedy ids
    m32 = Model(GGUF_PATH, np.float32)
    for rec in results:
        ids32, _, _ = m32.greedy(rec["prompt_ids"], N_NEW)
        rec["float32_agrees"] = ids32 == rec["greedy_ids"]
        if not rec["float32_agrees"]:
            d = next(i for i, (a, b) in enumerate(zip(ids32, rec["greedy_ids"])) if a != b)
            print(f"[{rec['name']}] float32 diverges at step {d} "
                  f"(margin {rec['margins'][d]})")
    doc = {
        "model": "models/SmolLM2-135M-Instruct.Q4_1.gguf",
        "generator": "tests/reference/smollm2_reference.py (float64 numpy forward "
                     "over gguf-dequantized weights, HF rotate-half RoPE after "
                     "un-permuting attn_q/attn_k)",
        "n_new_tokens": N_NEW,
        "add_bos": False,
        "eos_like_ids": list(EOS_LIKE),
        "notes": "greedy_ids continue past EOS; margins[i] = top1 - top2 logit at "
                 "step i; last_logits (prompt 0 only) = logits at the last prompt "
                 "position",
        "prompts": results,
    }
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes) in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
