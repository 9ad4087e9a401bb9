#!/usr/bin/env python3
"""Writes a Mixtral-shaped GGUF with random Q4_0 weights, scaled down to fit a small machine, for
`duet bench engine` to time a mixture of experts. The tokenizer (and chat template) is the default
model's, so the file serves like any other.

Usage: make_moe_model.py SMOLLM2.gguf OUT.gguf [--hidden 1024] [--layers 8] [--experts 8]
[--top-k 2]. Mixtral-8x7B is hidden 4096, 32 layers, 32 query / 8 KV heads of 128, 8 experts of
14336, top 2; the defaults keep its proportions (expert width 3.5 x hidden, 4 query heads per KV
head, top 2 of 8) at a quarter of the width and a quarter of the depth, head dim 64.

Weights are uniform in +-sqrt(3/cols) (activations keep unit scale through the layers); the
router's rows are random too, so tokens spread over the experts as in a trained model's typical
step. Prints the parameter counts: total, and active per token (what a decode step reads).
"""
import argparse
import sys

import numpy as np
import gguf

Q = gguf.GGMLQuantizationType.Q4_0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tokenizer_from", help="a GGUF whose tokenizer the model takes (SmolLM2)")
    ap.add_argument("out")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if a.hidden % a.head_dim or a.hidden % 32 or not 0 < a.top_k <= a.experts:
        ap.error("--hidden must be a multiple of --head-dim and of 32; 0 < --top-k <= --experts")

    src = gguf.GGUFReader(a.tokenizer_from)

    def field(name):
        f = src.fields[name]
        if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
            if f.types[-1] == gguf.GGUFValueType.STRING:
                return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
            return [f.parts[i][0].item() for i in f.data]
        if f.types[0] == gguf.GGUFValueType.STRING:
            return bytes(f.parts[f.data[0]]).decode("utf-8")
        return f.parts[f.data[0]][0].item()

    tokens = field("tokenizer.ggml.tokens")
    vocab = len(tokens)
    heads = a.hidden // a.head_dim
    kv_heads = max(1, heads // 4)
    ffn = a.hidden * 7 // 2
    rng = np.random.default_rng(a.seed)

    w = gguf.GGUFWriter(a.out, "llama")
    w.add_name(f"random Mixtral shape {a.experts}x{ffn} hidden {a.hidden} x{a.layers}")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_block_count(a.layers)
    w.add_context_length(8192)
    w.add_embedding_length(a.hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(a.experts)
    w.add_expert_used_count(a.top_k)
    w.add_tokenizer_model(field("tokenizer.ggml.model"))
    w.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    w.add_token_list(tokens)
    w.add_token_types(field("tokenizer.ggml.token_type"))
    w.add_token_merges(field("tokenizer.ggml.merges"))
    w.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))
    w.add_add_bos_token(False)
    if "tokenizer.chat_template" in src.fields:
        w.add_chat_template(field("tokenizer.chat_template"))

    counts = {"total": 0, "active": 0}

    def matrix(name, *shape, active_share=1.0):
        cols = shape[-1]
        t = rng.uniform(-1.0, 1.0, size=shape).astype(np.float32) * np.float32((3.0 / cols) ** 0.5)
        q = gguf.quants.quantize(t, Q)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=Q)
        n = int(np.prod(shape))
        counts["total"] += n
        counts["active"] += int(n * active_share)

    def norm(name):
        w.add_tensor(name, (1.0 + 0.1 * rng.uniform(-1, 1, size=a.hidden)).astype(np.float32))

    # Tied embeddings (no output.weight), as SmolLM2: the head reads token_embd every step.
    matrix("token_embd.weight", vocab, a.hidden)
    share = a.top_k / a.experts
    for l in range(a.layers):
        p = f"blk.{l}."
        norm(p + "attn_norm.weight")
        matrix(p + "attn_q.weight", heads * a.head_dim, a.hidden)
        matrix(p + "attn_k.weight", kv_heads * a.head_dim, a.hidden)
        matrix(p + "attn_v.weight", kv_heads * a.head_dim, a.hidden)
        matrix(p + "attn_output.weight", a.hidden, heads * a.head_dim)
        norm(p + "ffn_norm.weight")
        matrix(p + "ffn_gate_inp.weight", a.experts, a.hidden)
        matrix(p + "ffn_gate_exps.weight", a.experts, ffn, a.hidden, active_share=share)
        matrix(p + "ffn_up_exps.weight", a.experts, ffn, a.hidden, active_share=share)
        matrix(p + "ffn_down_exps.weight", a.experts, a.hidden, ffn, active_share=share)
        print(f"layer {l + 1}/{a.layers}", file=sys.stderr, flush=True)
    norm("output_norm.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{a.out}: {counts['total'] / 1e6:.1f} M matrix parameters, "
          f"{counts['active'] / 1e6:.1f} M active per token (top {a.top_k} of {a.experts} experts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
