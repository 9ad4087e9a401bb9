"""A lean PyTorch Llama decoder, written to be fast, as the peer of `duet bench gpu`'s decode timings.

The Llama-3-8B shape with random bf16 weights made on the GPU; one decode step is: embedding,
then per layer RMSNorm, the QKV product (one stacked cuBLAS GEMM), rotary embedding, the new K/V
written into a static cache, SDPA over that cache (GQA), the output product, the residual,
RMSNorm, the gate/up product (stacked), SiLU·up, the down product, the residual; the final norm,
the LM head and the greedy token. The whole step is captured once as a CUDA graph and replayed,
as vLLM and SGLang do. Timed as duet times its decode: the same step (same positions) replayed,
with CUDA events, after warm-up.

Prints one JSON object whose keys are `duet bench gpu`'s timing names (tokens/s). Run by
`duet bench gpu --compare-torch`; `--tiny` runs a small shape (a smoke test; with `--device cpu`
eagerly, without a graph).
"""

import argparse
import json
import sys

import torch
import torch.nn.functional as F

LLAMA3_8B = dict(hidden=4096, inter=14336, layers=32, heads=32, kv_heads=8, vocab=128256, theta=500000.0)
TINY = dict(hidden=64, inter=128, layers=2, heads=4, kv_heads=2, vocab=256, theta=10000.0)


class Decoder:
    """Weights and a static KV cache for `batch` sequences of `context` cached tokens each."""

    def __init__(self, cfg, batch, context, device):
        g = torch.Generator(device=device).manual_seed(0)
        h, hd = cfg["hidden"], cfg["hidden"] // cfg["heads"]
        self.cfg, self.hd = cfg, hd
        q_dim, kv_dim = cfg["heads"] * hd, cfg["kv_heads"] * hd

        def w(rows, cols):
            return (torch.randn(rows, cols, generator=g, device=device, dtype=torch.float32) * cols ** -0.5).to(torch.bfloat16)

        self.embed = w(cfg["vocab"], h)
        self.lm_head = w(cfg["vocab"], h)
        self.final_norm = torch.ones(h, device=device, dtype=torch.bfloat16)
        self.layers = [
            dict(
                attn_norm=torch.ones(h, device=device, dtype=torch.bfloat16),
                wqkv=w(q_dim + 2 * kv_dim, h),
                wo=w(h, q_dim),
                ffn_norm=torch.ones(h, device=device, dtype=torch.bfloat16),
                wgu=w(2 * cfg["inter"], h),
                wdown=w(h, cfg["inter"]),
            )
            for _ in range(cfg["layers"])
        ]
        # The cache holds the context and the step's own token (the step writes position `context`).
        length = context + 1
        shape = (batch, cfg["kv_heads"], length, hd)
        self.k_cache = [torch.randn(shape, generator=g, device=device).to(torch.bfloat16) for _ in self.layers]
        self.v_cache = [torch.randn(shape, generator=g, device=device).to(torch.bfloat16) for _ in self.layers]
        inv_freq = 1.0 / cfg["theta"] ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd)
        angles = torch.arange(length, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.cos = torch.cat([angles.cos(), angles.cos()], -1).to(torch.bfloat16)
        self.sin = torch.cat([angles.sin(), angles.sin()], -1).to(torch.bfloat16)
        # The step's inputs, static so that a graph replays them.
        self.tokens = torch.randint(0, cfg["vocab"], (batch,), generator=g, device=device)
        self.position = torch.full((1,), context, device=device, dtype=torch.long)

    def rope(self, x, cos, sin):
        half = self.hd // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    @torch.no_grad()
    def step(self):
        cfg, hd = self.cfg, self.hd
        b = self.tokens.shape[0]
        heads, kv_heads = cfg["heads"], cfg["kv_heads"]
        q_dim, kv_dim = heads * hd, kv_heads * hd
        cos = self.cos.index_select(0, self.position).view(1, 1, 1, hd)
        sin = self.sin.index_select(0, self.position).view(1, 1, 1, hd)
        x = self.embed.index_select(0, self.tokens)
        for layer, k_cache, v_cache in zip(self.layers, self.k_cache, self.v_cache):
            h = F.rms_norm(x, (cfg["hidden"],), layer["attn_norm"], 1e-5)
            qkv = h @ layer["wqkv"].T
            q = qkv[:, :q_dim].view(b, heads, 1, hd)
            k = qkv[:, q_dim:q_dim + kv_dim].view(b, kv_heads, 1, hd)
            v = qkv[:, q_dim + kv_dim:].view(b, kv_heads, 1, hd)
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
            k_cache.index_copy_(2, self.position, k)
            v_cache.index_copy_(2, self.position, v)
            attn = F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)
            x = x + attn.reshape(b, q_dim) @ layer["wo"].T
            h = F.rms_norm(x, (cfg["hidden"],), layer["ffn_norm"], 1e-5)
            gate, up = (h @ layer["wgu"].T).chunk(2, -1)
            x = x + (F.silu(gate) * up) @ layer["wdown"].T
        logits = F.rms_norm(x, (cfg["hidden"],), self.final_norm, 1e-5) @ self.lm_head.T
        return logits.argmax(-1)


def tokens_per_s(cfg, batch, context, device, graphs, reps=20):
    d = Decoder(cfg, batch, context, device)
    if not graphs:
        for _ in range(2):
            d.step()
        if device == "cuda":
            torch.cuda.synchronize()
        import time
        start = time.perf_counter()
        for _ in range(reps):
            d.step()
        if device == "cuda":
            torch.cuda.synchronize()
        return batch * reps / (time.perf_counter() - start)
    # Warm up on a side stream (cuBLAS and SDPA pick their kernels), then capture the step.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            d.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        d.step()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return batch * reps / (start.elapsed_time(end) / 1e3)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a small shape (smoke test)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("torch_decode.py: no CUDA device (use --device cpu --tiny for a smoke test)")
    cfg = TINY if a.tiny else LLAMA3_8B
    graphs = a.device == "cuda"
    result = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "shape": "tiny" if a.tiny else "llama-3-8b",
        "cuda_graphs": graphs,
        "decode, batch 1, context 128 (tokens/s)": tokens_per_s(cfg, 1, 128, a.device, graphs),
        "decode, batch 64, context 1024 (tokens/s)": tokens_per_s(cfg, 64, 1024, a.device, graphs),
    }
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
