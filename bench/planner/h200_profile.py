#!/usr/bin/env python3
"""Derives a duet profile of a Llama-3-8B-shaped model on an NVIDIA H200 from the GPU numbers
committed in bench/results/gpu-h200.json (`duet bench gpu` on a lent H200, commit 855ce6a), for
`duet simulate` and `duet plan` at scale. No GPU was lent to this work, so the profile is
derived, not measured by `duet profile --device cuda`; every assumption is stated below and in
the profile's `source`.

Measured (bench/results/gpu-h200.json, `timings`):
  - decode, batch 1, context 128:   151.70 tokens/s  -> one step 6.592 ms
  - decode, batch 64, context 1024: 4117.73 tokens/s -> one step 15.543 ms
  - prefill, one 2048-token prompt: 80.81 ms, of which attention (all layers) 27.12 ms
  - KV transfer (gpu-h200.txt, duet up --processes on one H200): a ~4,800-token prompt of
    SmolLM2-135M (23,040 B of bf16 KV per token: 110.6 MB) in 1.15 ms over cuda-ipc, 67.22 ms
    over gRPC.
Assumed:
  - decode's cost per context token is the KV read at the bandwidth the batch-1 step reads the
    weights at (16.06 GB of bf16 weights in 6.592 ms = 2.44 TB/s); with it the two decode
    points give the fixed cost and the cost per sequence;
  - prefill's quadratic term is the measured attention time (27.12 ms = c * 2048^2), and its
    fixed cost is decode's (one pass over the weights), which leaves the cost per token;
  - an NCCL link between nodes at 50 GB/s (400 Gb/s InfiniBand per GPU), 0.05 ms per push;
  - the KV cache gets 120 GB of the H200's 141 GB (weights 16 GB, activations and workspace
    5 GB).
"""
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
gpu = json.load(open(os.path.join(ROOT, "bench/results/gpu-h200.json")))
t = {x["name"]: x["value"] for x in gpu["timings"]}

# Llama-3-8B's shape.
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
PARAMS = 8.03e9
kv_token_bytes = LAYERS * KV_HEADS * HEAD_DIM * 2 * 2  # K and V, bf16
weight_bytes = PARAMS * 2

t1 = 1e3 / t["decode, batch 1, context 128 (tokens/s)"]
t64 = 64e3 / t["decode, batch 64, context 1024 (tokens/s)"]
read_bw = weight_bytes / (t1 / 1e3)  # bytes/s
b_dec = kv_token_bytes / read_bw * 1e3  # ms per context token
a_plus_c = t1 - 128 * b_dec
a_plus_64c = t64 - 64 * 1024 * b_dec
c_dec = (a_plus_64c - a_plus_c) / 63
a_dec = a_plus_c - c_dec

prefill_ms = t["prefill, one 2048-token prompt (ms)"]
attention_ms = t["  of which attention, all layers (ms)"]
c_pre = attention_ms / 2048**2
a_pre = a_dec
b_pre = (prefill_ms - attention_ms - a_pre) / 2048

MiB = 1 << 20
smol_bytes = 4800 * 30 * 3 * 64 * 2 * 2
ipc_ms_per_mib = 1.15 / (smol_bytes / MiB)
grpc_ms_per_mib = 67.22 / (smol_bytes / MiB)
nccl_ms_per_mib = MiB / 50e9 * 1e3


def fit_error(points, model):
    errs = [abs(model(*p[:-1]) - p[-1]) / p[-1] * 100 for p in points]
    return {"mean_abs_pct": sum(errs) / len(errs), "max_abs_pct": max(errs), "samples": len(errs)}


decode_samples = [{"batch": 1, "context": 128, "ms": t1}, {"batch": 64, "context": 1024, "ms": t64}]
dec = lambda b, ctx: a_dec + b_dec * b * ctx + c_dec * b
prefill_samples = [{"seqs": 1, "new_tokens": 2048, "cached_tokens": 0, "attention": 2048.0**2, "ms": prefill_ms}]
pre = lambda n: a_pre + b_pre * n + c_pre * n * n


def transfer(name, a, per_mib, samples):
    return {
        "transport": name,
        "samples": samples,
        "fit": {"a_ms": a, "ms_per_mib": per_mib},
        "error": fit_error([(s["bytes"], s["ms"]) for s in samples], lambda b: a + per_mib * b / MiB)
        if samples else {"mean_abs_pct": 0.0, "max_abs_pct": 0.0, "samples": 0},
    }


profile = {
    "format": 1,
    "device": {"kind": "cuda", "name": gpu["device"], "cores": 16},
    "model": {"name": "Llama-3-8B-shape", "fingerprint": "derived:llama-3-8b-shape:bf16:16", "num_layers": LAYERS},
    "commit": "855ce6a",
    "source": "bench/planner/h200_profile.py from bench/results/gpu-h200.json (duet bench gpu on an NVIDIA H200, "
    "Llama-3-8B-shaped bf16 weights); derived, with the assumptions the script states",
    "flags": {"threads": 16, "cpu_kernels": "-", "kv_dtype": "bf16", "max_step_tokens": 2048},
    "kv": {"block_size": BLOCK, "block_bytes": kv_token_bytes * BLOCK, "memory_bytes": int(120e9)},
    "prefill": {
        "samples": prefill_samples,
        "fit": {"a_ms": a_pre, "b_ms_per_token": b_pre, "c_ms_per_attended_token": c_pre},
        "error": fit_error([(2048, prefill_ms)], pre),
    },
    "decode": {
        "samples": decode_samples,
        "fit": {"a_ms": a_dec, "b_ms_per_context_token": b_dec, "c_ms_per_sequence": c_dec},
        "error": fit_error([(1, 128, t1), (64, 1024, t64)], dec),
    },
    "transfer": [
        transfer("cuda-ipc", 0.0, ipc_ms_per_mib, [{"bytes": smol_bytes, "ms": 1.15}]),
        transfer("grpc", 0.0, grpc_ms_per_mib, [{"bytes": smol_bytes, "ms": 67.22}]),
        transfer("nccl", 0.05, nccl_ms_per_mib, []),
    ],
}
out = os.path.join(ROOT, "bench/results/planner/profile-h200-llama3-8b.json")
with open(out, "w") as f:
    json.dump(profile, f, indent=2)
    f.write("\n")
print(f"decode step: {a_dec:.3f} ms + {b_dec:.3e} ms/ctx token + {c_dec:.4f} ms/seq")
print(f"prefill step: {a_pre:.3f} ms + {b_pre:.5f} ms/token + {c_pre:.3e} ms/attended token")
print(f"transfer ms/MiB: cuda-ipc {ipc_ms_per_mib:.4f}, grpc {grpc_ms_per_mib:.3f}, nccl {nccl_ms_per_mib:.4f}")
print(f"written to {out}")
