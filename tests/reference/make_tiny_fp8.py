#!/usr/bin/env python3
"""Build the tiny Llama's FP8 checkpoint and its reference logits.

    python3 tests/reference/make_tiny_fp8.py          # from the repo root; after make_tiny_llama.py

Reads tests/fixtures/tiny-llama/ (f32) and writes, deterministically:

  tests/fixtures/tiny-llama-fp8/config.json        the tiny config with vLLM's
                                                   quantization_config (fp8, dynamic activations)
  tests/fixtures/tiny-llama-fp8/model.safetensors  the layers' projections in F8_E4M3 with a
                                                   per-output-channel F32 weight_scale [out, 1]
                                                   (llm-compressor's FP8_DYNAMIC layout);
                                                   embeddings, norms and lm_head in F32
  tests/fixtures/tiny-llama-fp8/tokenizer.json     copied
  tests/fixtures/tiny-llama-fp8-logits.json        float64 numpy forward of the dequantized
                                                   weights (e4m3 value x scale), with the largest
                                                   difference from the f32 model's logits and
                                                   their relative distance ||d|| / ||ref||

The quantizer is fp8_reference.quantize_rows (numpy + ml_dtypes float8_e4m3fn); the safetensors
file is written by hand here (the safetensors package has no FP8 numpy dtype).
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
from safetensors.numpy import load_file

from fp8_reference import dequantize_rows, quantize_rows
from make_tiny_llama import CFG, FIX, HF_DIR, forward, make_cases, write_logits

OUT_DIR = os.path.join(FIX, "tiny-llama-fp8")
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def write_safetensors(path, tensors):
    """tensors: name -> (dtype string, shape, bytes), in file order."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for _, _, data in tensors.values():
            f.write(data)


def main():
    os.makedirs(OUT_DIR, exist_ok=True)
    weights = load_file(os.path.join(HF_DIR, "model.safetensors"))
    tensors, dequantized = {}, {}
    for name in sorted(weights):
        w = weights[name].astype(np.float32)
        stem = name.removesuffix(".weight")
        if any(stem.endswith(p) for p in PROJECTIONS):
            q, scale = quantize_rows(w)
            tensors[name] = ("F8_E4M3", w.shape, q.tobytes())
            tensors[stem + ".weight_scale"] = ("F32", (w.shape[0], 1), scale.astype("<f4").tobytes())
            dequantized[name] = dequantize_rows(q, scale)
        else:
            tensors[name] = ("F32", w.shape, w.astype("<f4").tobytes())
            dequantized[name] = w.astype(np.float64)
    write_safetensors(os.path.join(OUT_DIR, "model.safetensors"), tensors)
    with open(os.path.join(HF_DIR, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    with open(os.path.join(OUT_DIR, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    shutil.copyfile(os.path.join(HF_DIR, "tokenizer.json"), os.path.join(OUT_DIR, "tokenizer.json"))

    cases = make_cases()
    maxdiff, num, den = 0.0, 0.0, 0.0
    for _, ids in cases:
        ref, got = forward(weights, ids), forward(dequantized, ids)
        maxdiff = max(maxdiff, float(np.abs(got - ref).max()))
        num += float(np.sum((got - ref) ** 2))
        den += float(np.sum(ref ** 2))
    relative = (num / den) ** 0.5
    print(f"FP8 weights vs f32: max |logit diff| = {maxdiff:.4g}, ||d|| / ||ref|| = {relative:.4g}")
    write_logits(os.path.join(FIX, "tiny-llama-fp8-logits.json"), dequantized, cases,
                 source="dequantized weights of tests/fixtures/tiny-llama-fp8 (tests/reference/make_tiny_fp8.py)",
                 extra={"max_abs_diff_vs_f32_logits": maxdiff, "relative_diff_vs_f32_logits": relative})
    assert CFG["hidden_size"] % 16 == 0  # cuBLASLt's FP8 GEMM takes dimensions multiple of 16


if __name__ == "__main__":
    main()
