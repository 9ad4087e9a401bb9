"""How the scale granularity of an FP8 (E4M3) KV cache changes the tiny Llama's logits.

Prints, for the prompts of make_tiny_llama.py, ‖Δ‖/‖ref‖ of the logits against the unquantized
float64 forward (and the largest |Δ| and the argmax changes) with every layer's K and V stored as
E4M3 of x / scale and read back as e4m3 · scale, for two granularities:
  - one scale of 1 per layer (what `--kv-dtype fp8` on the CUDA backend stores), and
  - a scale per token and KV head (amax / 448).
ml_dtypes' float8_e4m3fn is the encoder (round to nearest even); values are clipped to ±448 first,
as the kernels saturate. A measurement for docs/gpu.md, not a fixture: it writes nothing.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file

from make_tiny_llama import HF_DIR, forward, make_cases

E4M3 = ml_dtypes.float8_e4m3fn


def fp8(x, scale):
    return np.clip(x / scale, -448, 448).astype(np.float32).astype(E4M3).astype(np.float64) * scale


def per_layer(x, is_key):
    return fp8(x, 1.0)


def per_token_head(x, is_key):
    scale = np.abs(x).max(axis=-1, keepdims=True) / 448
    return fp8(x, np.where(scale > 0, scale, 1.0))


def main():
    weights = load_file(os.path.join(HF_DIR, "model.safetensors"))
    for label, cache in [("scale 1 per layer", per_layer), ("scale per token and KV head", per_token_head)]:
        d2 = r2 = worst = 0.0
        flips = 0
        for _, ids in make_cases():
            ref = forward(weights, ids)
            got = forward(weights, ids, kv_cache=cache)
            d2 += float(((got - ref) ** 2).sum())
            r2 += float((ref ** 2).sum())
            worst = max(worst, float(np.abs(got - ref).max()))
            flips += int((got.argmax(-1) != ref.argmax(-1)).sum())
        print(f"{label:28s} ‖Δ‖/‖ref‖ = {np.sqrt(d2 / r2):.2e}  max |Δ| = {worst:.3f}  argmax changed: {flips}")


if __name__ == "__main__":
    main()
