#!/usr/bin/env bash
# The GPU checks, in one run on a machine with an NVIDIA GPU (CUDA 13 driver): build here with
#   cargo build --release --features cuda --workspace --bins && ./target/release/duet model fetch
# then run this script where the GPU is (it needs target/release/, models/ and tests/fixtures/).
# It prints a table: greedy tokens on the GPU vs the CPU backend (tiny fixture, default model),
# the disaggregated path on the GPU (`duet up --device cuda --processes`), `duet bench gpu`
# (its own table: checks, rooflines, HF transformers side by side) and the engine benchmark on
# the GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=./target/release
out=${OUT:-/tmp/duet-gpu}
mkdir -p "$out"
rows=()
row() { rows+=("$(printf '%-52s %-8s %s' "$1" "$2" "$3")"); }

ids() { python3 -c 'import json,sys; print(json.load(sys.stdin)["token_ids"])'; }

compare_generate() { # name model prompt
  local cpu gpu
  cpu=$($bin/duet generate --json --temperature 0 --max-tokens 24 --model "$2" --prompt "$3" --device cpu | ids)
  gpu=$($bin/duet generate --json --temperature 0 --max-tokens 24 --model "$2" --prompt "$3" --device cuda 2>"$out/$1.err" | ids)
  if [ -n "$gpu" ] && [ "$cpu" = "$gpu" ]; then row "greedy tokens GPU == CPU: $1" PASS "$gpu"
  else row "greedy tokens GPU == CPU: $1" FAIL "cpu=$cpu gpu=$gpu $(tail -1 "$out/$1.err")"; fi
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
compare_generate tiny tests/fixtures/tiny-llama "hello world"
for p in "The capital of France is" "def fibonacci(n):" "1, 2, 3, 4,"; do
  compare_generate "smollm2: $p" models/SmolLM2-135M-Instruct.Q4_1.gguf "$p"
done

# The disaggregated path: router + prefill + decode processes sharing the GPU.
$bin/duet up --processes --device cuda --listen 127.0.0.1:50551 >"$out/up.log" 2>&1 &
up=$!
for _ in $(seq 120); do grep -q "ready" "$out/up.log" && break; sleep 1; done
cpu=$($bin/duet generate --json --temperature 0 --max-tokens 24 --prompt "The capital of France is" --device cpu | ids)
gpu=$($bin/duet generate --server 127.0.0.1:50551 --json --temperature 0 --max-tokens 24 --prompt "The capital of France is" | ids)
kill $up 2>/dev/null; wait $up 2>/dev/null
if [ -n "$gpu" ] && [ "$cpu" = "$gpu" ]; then row "duet up --device cuda: Generate == CPU" PASS "$gpu"
else row "duet up --device cuda: Generate == CPU" FAIL "cpu=$cpu up=$gpu (see up.log)"; fi

# CUDA vs CPU logits, paged attention vs a float64 reference, Llama-3-8B-shaped timings against
# the rooflines, and HF transformers on the same shapes (its own table).
if $bin/duet bench gpu --compare-hf --json-out "$out/bench-gpu.json" 2>&1 | tee "$out/bench-gpu.log"; then
  row "duet bench gpu --compare-hf" PASS "$out/bench-gpu.json"
else row "duet bench gpu --compare-hf" FAIL "$(tail -1 "$out/bench-gpu.log")"; fi

if $bin/duet bench engine --device cuda --json-out "$out/bench-engine-cuda.json" >"$out/bench.log" 2>&1; then
  row "duet bench engine --device cuda" DONE "$out/bench-engine-cuda.json"
else row "duet bench engine --device cuda" FAIL "$(tail -1 "$out/bench.log")"; fi

printf '\n%-52s %-8s %s\n' check result detail
printf '%s\n' "${rows[@]}"
