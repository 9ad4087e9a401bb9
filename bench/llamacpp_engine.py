#!/usr/bin/env python3
"""llama.cpp (through llama-cpp-python's low-level API) on a GGUF file, measured the way
`duet bench engine` measures duet, at the same points. Prints one JSON object on stdout:

  {"version", "system_info",
   "prefill": [{"tokens", "tokens_per_s"}],
   "decode": [{"batch", "context", "tokens_per_s"}]}

Prefill: one fresh prompt of each --prefill-tokens length, decoded in llama.cpp's own batches
until its last token's logits (best of --repeats).

Decode, at every (--batch, --contexts) point: a context with n_seq_max = batch and a separate KV
stream per sequence (kv_unified = false), so each sequence reads its own KV as in duet; one
prompt of `context` tokens prefilled into sequence 0 and copied to the others with
llama_memory_seq_cp (across streams that copies the buffer: distinct memory, not shared cells).
Each repeat drops what earlier repeats decoded (back to `context`), runs one untimed step, then
times --decode-steps steps of a llama_batch holding one token per sequence, logits for each.
Other context parameters are llama.cpp's defaults (f16 KV, flash attention on auto).

llama.cpp's extra buffer types (AMX, CPU repacking) stay on unless a probe (this script in a child
process, one short prefill) dies of a signal: llama.cpp's AMX matrix kernels crash the process on
some Xeons (0.3.36 on an Intel model-207 VM: SIGILL at its first tile load in a worker thread,
although the tile state is enabled and the permission granted). Then they are off, and the result
says so ("extra_buffer_types": false, and in "system_info").
"""
import argparse
import ctypes
import json
import random
import subprocess
import sys
import time


def ints(s):
    return [int(x) for x in s.split(",") if x]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", type=ints, default=[64, 512, 2048])
    ap.add_argument("--batch", type=ints, default=[1, 8, 32])
    ap.add_argument("--prefill-tokens", type=ints, default=[200, 2000])
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--extra-buffer-types", choices=["probe", "on", "off"], default="probe")
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.extra_buffer_types == "probe":
        child = subprocess.run([sys.executable, __file__, "--model", a.model, "--threads",
                                str(a.threads), "--extra-buffer-types", "on", "--probe"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if child.returncode < 0:
            print(f"llama.cpp: a prefill with its extra buffer types (AMX, repacking) died of "
                  f"signal {-child.returncode}; measuring without them", file=sys.stderr, flush=True)
        a.extra_buffer_types = "off" if child.returncode < 0 else "on"
    extra = a.extra_buffer_types == "on"

    import llama_cpp as L

    # llama.cpp logs every context it creates to stderr; only our progress lines should be there.
    @L.llama_log_callback
    def quiet(level, text, user_data):
        pass

    L.llama_log_set(quiet, ctypes.c_void_p())
    L.llama_backend_init()
    params = L.llama_model_default_params()
    params.use_extra_bufts = extra
    model = L.llama_model_load_from_file(a.model.encode(), params)
    if not model:
        sys.exit(f"llama.cpp could not load {a.model}")
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    rng = random.Random(7)

    def prompt(n):
        # The same range as duet's prompts: above the low ids where special tokens live.
        return [rng.randrange(300, vocab) for _ in range(n)]

    def new_context(n_seq, tokens_per_seq):
        p = L.llama_context_default_params()
        p.n_ctx = n_seq * tokens_per_seq
        p.n_seq_max = n_seq
        p.kv_unified = False
        p.n_threads = p.n_threads_batch = a.threads
        p.no_perf = True
        ctx = L.llama_init_from_model(model, p)
        if not ctx:
            sys.exit(f"llama.cpp could not make a context of {p.n_ctx} tokens for {n_seq} sequences")
        return ctx

    def decode(ctx, batch, rows):
        """Decodes `rows`, each (token, pos, seq, logits)."""
        for i, (tok, pos, seq, logits) in enumerate(rows):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        batch.n_tokens = len(rows)
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            sys.exit(f"llama_decode failed ({rc})")
        L.llama_synchronize(ctx)

    def prefill(ctx, batch, tokens):
        """Prompt `tokens` into sequence 0 from position 0, in the context's batches."""
        n = L.llama_n_batch(ctx)
        for start in range(0, len(tokens), n):
            chunk = tokens[start:start + n]
            last = start + len(chunk) == len(tokens)
            decode(ctx, batch, [(t, start + i, 0, last and i == len(chunk) - 1)
                                for i, t in enumerate(chunk)])

    def progress(line):
        print(f"llama.cpp: {line}", file=sys.stderr, flush=True)

    batch = L.llama_batch_init(max(a.prefill_tokens + a.contexts + a.batch), 0, 1)
    if a.probe:
        ctx = new_context(1, 64)
        prefill(ctx, batch, prompt(32))
        return 0
    system_info = L.llama_print_system_info().decode().strip()
    if not extra:
        system_info += " EXTRA_BUFFER_TYPES = 0 |"
    result = {"version": L.__version__, "system_info": system_info,
              "extra_buffer_types": extra, "prefill": [], "decode": []}

    ctx = new_context(1, max(a.prefill_tokens))
    mem = L.llama_get_memory(ctx)
    for n in a.prefill_tokens:
        best = 0.0
        for _ in range(a.repeats):
            L.llama_memory_clear(mem, True)
            toks = prompt(n)
            t = time.perf_counter()
            prefill(ctx, batch, toks)
            best = max(best, n / (time.perf_counter() - t))
        progress(f"prefill {n} tokens: {best:.1f} tok/s")
        result["prefill"].append({"tokens": n, "tokens_per_s": best})
    L.llama_free(ctx)

    for b in a.batch:
        # Room per sequence: the prompt, the untimed step and the timed steps.
        ctx = new_context(b, max(a.contexts) + a.decode_steps + 1)
        mem = L.llama_get_memory(ctx)
        for c in a.contexts:
            L.llama_memory_clear(mem, True)
            prefill(ctx, batch, prompt(c))
            for s in range(1, b):
                L.llama_memory_seq_cp(mem, 0, s, -1, -1)
            best = 0.0
            for _ in range(a.repeats):
                L.llama_memory_seq_rm(mem, -1, c, -1)
                # Untimed: also where llama.cpp performs the pending cross-stream copies.
                decode(ctx, batch, [(tok, c, s, True) for s, tok in enumerate(prompt(b))])
                steps = [prompt(b) for _ in range(a.decode_steps)]
                t = time.perf_counter()
                for k, toks in enumerate(steps):
                    decode(ctx, batch, [(tok, c + 1 + k, s, True) for s, tok in enumerate(toks)])
                best = max(best, b * a.decode_steps / (time.perf_counter() - t))
            progress(f"decode batch {b} at context {c}: {best:.1f} tok/s")
            result["decode"].append({"batch": b, "context": c, "tokens_per_s": best})
        L.llama_free(ctx)

    L.llama_batch_free(batch)
    L.llama_model_free(model)
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
