"""Reference logits of the tiny Llama with an 8-bit KV cache.

  tests/fixtures/tiny-llama-int8-kv-logits.json

The cache this models keeps every token's K (after RoPE) and V of each KV head
as int8 with f32 scales: one per group of 32 key dimensions (or of the largest
power of two dividing head_dim, when 32 does not; the whole head of 16 here)
and one per value. In each group, scale = max |x| / 127, q = x / scale rounded
half to even (so -128 never occurs), read back as q * scale. Every other step is the
float64 numpy forward of make_tiny_llama.py over tests/fixtures/tiny-llama's
weights; the attention of each position reads its own token's K and V from the
cache too. The file also carries, per case, the largest logit difference from
the unquantized forward, so a test can tell the modelled rounding from none.
"""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import load_file

from make_tiny_llama import CFG, FIX, HF_DIR, f32round, forward, make_cases


def int8(x, group):
    """x [T, kv_head, head_dim] as int8 with a scale per token, head and group of dims."""
    t, h, d = x.shape
    g = x.reshape(t, h, d // group, group)
    scale = np.abs(g).max(axis=-1, keepdims=True) / 127.0
    safe = np.where(scale > 0, scale, 1.0)
    return (np.round(g / safe) * scale).reshape(t, h, d)


def key_group(head_dim):
    return min(32, head_dim & -head_dim)


def int8_cache(x, is_key):
    hd = x.shape[-1]
    return int8(x, key_group(hd) if is_key else hd)


def main():
    weights = load_file(os.path.join(HF_DIR, "model.safetensors"))
    doc = {
        "source": "tests/fixtures/tiny-llama/model.safetensors",
        "generator": "tests/reference/make_int8_kv_reference.py (float64 numpy forward, "
                     "int8 KV with a scale per token and KV head)",
        "config": dict(CFG, tie_word_embeddings=False, model_type="llama"),
        "cases": [],
    }
    for name, ids in make_cases():
        logits = forward(weights, ids, kv_cache=int8_cache)
        exact = forward(weights, ids)
        diff = float(np.abs(logits - exact).max())
        doc["cases"].append({"name": name, "token_ids": ids,
                             "argmax": logits.argmax(-1).tolist(),
                             "max_abs_diff_vs_unquantized_kv": diff,
                             "logits": f32round(logits)})
        print(f"case {name:9s} T={len(ids):3d} max |int8 KV - exact| = {diff:.3g}")
    path = os.path.join(FIX, "tiny-llama-int8-kv-logits.json")
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
