"""HF transformers on the Llama-3-8B shape `duet bench gpu` times, on the same GPU in the same run.

Random bf16 weights made on the GPU; decode steps through the model's KV cache (eager attention
as transformers ships it), prefill of one 2048-token and one 8192-token prompt. Prints one JSON
object whose keys are `duet bench gpu`'s timing names. Run by `duet bench gpu --compare-hf`.
"""

import json
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    cfg = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    model.eval()
    vocab = cfg.vocab_size

    def timed(fn, reps):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / reps

    @torch.no_grad()
    def decode_tokens_per_s(batch: int, context: int) -> float:
        ids = torch.randint(0, vocab, (batch, context), device="cuda")
        past = model(ids, use_cache=True, logits_to_keep=1).past_key_values
        step_ids = torch.randint(0, vocab, (batch, 1), device="cuda")
        # Each timed step appends one position, as a real decode step does.
        def step():
            model(step_ids, past_key_values=past, use_cache=True)

        return batch / timed(step, 10)

    @torch.no_grad()
    def prefill_ms(n: int) -> float:
        ids = torch.randint(0, vocab, (1, n), device="cuda")
        return 1e3 * timed(lambda: model(ids, use_cache=False, logits_to_keep=1), 5)

    result = {
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "decode, batch 1, context 128 (tokens/s)": decode_tokens_per_s(1, 128),
        "decode, batch 64, context 1024 (tokens/s)": decode_tokens_per_s(64, 1024),
        "prefill, one 2048-token prompt (ms)": prefill_ms(2048),
        "prefill, one 8192-token prompt (ms)": prefill_ms(8192),
    }
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
