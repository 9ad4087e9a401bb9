#!/usr/bin/env python3
"""llama.cpp (through llama-cpp-python) on a GGUF file: prefill and single-stream decode
throughput, measured the way `duet bench engine` measures ours. Prints one JSON line.

Prefill: a fresh prompt of --prompt-tokens random ids evaluated at once (best of --repeats).
Decode: --decode-steps single tokens evaluated one at a time after a 64-token context.
"""
import argparse, json, random, sys, time

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    import llama_cpp
    llm = llama_cpp.Llama(model_path=a.model, n_ctx=2048, n_batch=512, n_threads=a.threads,
                          n_threads_batch=a.threads, verbose=False)
    vocab = llm.n_vocab()
    rng = random.Random(7)
    prompt = lambda n: [rng.randrange(300, vocab) for _ in range(n)]

    best_prefill = 0.0
    for _ in range(a.repeats):
        llm.reset()
        llm._ctx.kv_cache_clear() if hasattr(llm._ctx, "kv_cache_clear") else None
        toks = prompt(a.prompt_tokens)
        t = time.perf_counter()
        llm.eval(toks)
        best_prefill = max(best_prefill, len(toks) / (time.perf_counter() - t))

    best_decode = 0.0
    for _ in range(a.repeats):
        llm.reset()
        llm.eval(prompt(64))
        t = time.perf_counter()
        for tok in prompt(a.decode_steps):
            llm.eval([tok])
        best_decode = max(best_decode, a.decode_steps / (time.perf_counter() - t))

    print(json.dumps({"prefill_tokens_per_s": best_prefill, "decode_tokens_per_s": best_decode,
                      "version": getattr(llama_cpp, "__version__", "")}))

if __name__ == "__main__":
    sys.exit(main())
