"""Reference logits of the tiny Llama with an 8-bit KV cache.

  tests/fixtures/tiny-llama-int8-kv-logits.json

The cache this models keeps every token's K (after RoPE) and V of each KV head
as int8 with one scale: scale = max |x| / 127, q = x / scale rounded half to
even (so -128 never occurs), read back as q * scale. Every other step is the
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


def int8_cache(x):
    """x [T, kv_head, head_dim] as an int8 cache with a scale per token and head returns it."""
    scale = np.abs(x).max(axis=-1, keepdims=True) / 127.0
    safe = np.where(scale > 0, scale, 1.0)
    return np.round(x / safe) * scale


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
