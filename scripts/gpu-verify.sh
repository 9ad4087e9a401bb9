#!/usr/bin/env bash
# The GPU checks, in one run on a machine with an NVIDIA GPU (CUDA 13 driver): build here with
#   cargo build --release --features cuda --workspace --bins && ./target/release/duet model fetch
# then run this script where the GPU is (it needs target/release/, models/ and tests/fixtures/;
# NVRTC and cuBLAS from the CUDA toolkit or the nvidia-* wheels on LD_LIBRARY_PATH).
# It prints a table: greedy tokens on the GPU vs the CPU backend (tiny fixture, default model);
# the disaggregated path on the GPU (`duet up --device cuda --processes`, one prefill and one
# decode process on the one GPU) with the KV over CUDA IPC and over gRPC, the same tokens both
# ways and the transfer time of each; `duet bench gpu --compare-hf` (its own table: checks,
# rooflines, HF transformers side by side); and the engine benchmark on the GPU.
# Logs and JSON go to $OUT (default /tmp/duet-gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
bin=./target/release
out=${OUT:-/tmp/duet-gpu}
mkdir -p "$out"
rows=()
row() { rows+=("$(printf '%-58s %-6s %s' "$1" "$2" "$3")"); }

ids() { python3 -c 'import json,sys; print(json.load(sys.stdin)["token_ids"])'; }

compare_generate() { # name model prompt
  local cpu gpu
  cpu=$($bin/duet generate --json --temperature 0 --max-tokens 24 --model "$2" --prompt "$3" --device cpu | ids)
  gpu=$($bin/duet generate --json --temperature 0 --max-tokens 24 --model "$2" --prompt "$3" --device cuda 2>"$out/generate.err" | ids)
  if [ -n "$gpu" ] && [ "$cpu" = "$gpu" ]; then row "greedy tokens GPU == CPU: $1" PASS "$gpu"
  else row "greedy tokens GPU == CPU: $1" FAIL "cpu=$cpu gpu=$gpu $(tail -1 "$out/generate.err")"; fi
}

# Waits until no process holds the GPU (the workers of a stopped `duet up` free it on exit).
gpu_idle() {
  for _ in $(seq 60); do
    [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ] && return 0
    sleep 0.5
  done
  echo "the GPU is still held by: $(nvidia-smi --query-compute-apps=pid,name --format=csv,noheader)" >&2
}

# `duet up --device cuda --processes` with KV transport $1: greedy tokens of a short prompt (must
# equal the CPU's; the decode worker prefills short prompts itself) and of a ~4800-token prompt
# (prefilled by the prefill process and pushed; must be the same over both transports), the
# transport the prefill worker used, and its KV transfer time per request.
long_prompt=$(python3 -c "print(' '.join(f'item {i} is {i*i % 97};' for i in range(500)))")
serve() {
  local t=$1 log="$out/up-$1.log" port=50551
  $bin/duet up --processes --device cuda --kv-transport "$t" --listen 127.0.0.1:$port \
    --metrics-listen 127.0.0.1:0 >"$log" 2>&1 &
  local up=$!
  # Stop waiting as soon as `duet up` exits (a missing binary, a port taken): its log says why.
  for _ in $(seq 120); do grep -q "duet is ready" "$log" && break; kill -0 $up 2>/dev/null || break; sleep 1; done
  short[$t]=$($bin/duet generate --server 127.0.0.1:$port --json --temperature 0 --max-tokens 24 --prompt "The capital of France is" | ids)
  long[$t]=$($bin/duet generate --server 127.0.0.1:$port --json --temperature 0 --max-tokens 24 --prompt "$long_prompt" | ids)
  used[$t]=$(sed 's/\x1b\[[0-9;]*m//g' "$log" | grep -o 'KV push opened.*' | grep -o 'transport=[a-z"-]*' | sort | uniq -c | tr -s ' ' | tr '\n' ' ')
  transfer[$t]=""
  for m in $(grep -o 'Prometheus metrics on http://[0-9.:]*' "$log" | awk '{print $4}'); do
    transfer[$t]+=$(curl -s "$m/metrics" | awk '/^duet_kv_transfer_seconds_(sum|count)\{.*direction="out"/ {split($0,a," "); v[$1 ~ /_sum/ ? "s" : "c"]+=a[2]} END {if (v["c"]) printf "%.2f ms/request over %d requests", 1e3*v["s"]/v["c"], v["c"]}')
  done
  kill $up 2>/dev/null; wait $up 2>/dev/null; gpu_idle
}

# `duet up --processes` starts the worker binaries beside duet: all four must have been built.
for b in duet duet-prefill duet-decode duet-router; do
  [ -x "$bin/$b" ] || { echo "$bin/$b is missing: cargo build --release --features cuda --workspace --bins" >&2; exit 2; }
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
compare_generate tiny tests/fixtures/tiny-llama "hello world"
for p in "The capital of France is" "def fibonacci(n):" "1, 2, 3, 4,"; do
  compare_generate "smollm2: $p" models/SmolLM2-135M-Instruct.Q4_1.gguf "$p"
done

declare -A short long used transfer
cpu=$($bin/duet generate --json --temperature 0 --max-tokens 24 --prompt "The capital of France is" --device cpu | ids)
for t in cuda-ipc grpc; do
  serve $t
  if [ -n "${short[$t]}" ] && [ "$cpu" = "${short[$t]}" ]; then
    row "duet up --device cuda --processes ($t): short prompt == CPU" PASS "${short[$t]}"
  else row "duet up --device cuda --processes ($t): short prompt == CPU" FAIL "cpu=$cpu got=${short[$t]} (see up-$t.log)"; fi
  if [[ "${used[$t]}" == *"$t"* ]]; then row "  long prompt's KV pushed over $t" PASS "${used[$t]}"
  else row "  long prompt's KV pushed over $t" FAIL "pushes: ${used[$t]:-none} (see up-$t.log)"; fi
  row "  KV transfer time, $t" INFO "${transfer[$t]:-no metrics}"
done
if [ -n "${long[cuda-ipc]}" ] && [ "${long[cuda-ipc]}" = "${long[grpc]}" ]; then
  row "~4800-token prompt: same tokens over cuda-ipc and grpc" PASS "${long[grpc]}"
else row "~4800-token prompt: same tokens over cuda-ipc and grpc" FAIL "cuda-ipc=${long[cuda-ipc]} grpc=${long[grpc]}"; fi

# CUDA vs CPU logits, paged attention vs a float64 reference, Llama-3-8B-shaped timings against
# the rooflines, and HF transformers on the same shapes (its own table).
if $bin/duet bench gpu --compare-hf --json-out "$out/bench-gpu.json" 2>&1 | tee "$out/bench-gpu.log"; then
  row "duet bench gpu --compare-hf" PASS "$out/bench-gpu.json"
else row "duet bench gpu --compare-hf" FAIL "$(tail -1 "$out/bench-gpu.log")"; fi
gpu_idle

if $bin/duet bench engine --device cuda --json-out "$out/bench-engine-cuda.json" >"$out/bench.log" 2>&1; then
  row "duet bench engine --device cuda" DONE "$out/bench-engine-cuda.json"
else row "duet bench engine --device cuda" FAIL "$(tail -1 "$out/bench.log")"; fi

# --- KV tiers (issue 84) ------------------------------------------------------------------------
# The tiers below the KV pool and peer pulls on the GPU, through the generic path (blocks copied
# device to pageable host memory; a pinned host tier and CUDA IPC pulls are not built yet): a
# multi-turn chat without and with a host tier, and a 2,000-token prefix pulled from a peer
# decode worker against computed (both workers on the one GPU). A pool of 0.25% of the GPU
# (~8-15k tokens) holds a third to a half of the 16 conversations (~27k tokens).
gpu_idle
if $bin/duet bench serve --launch colocated --device cuda --workload shared-prefix --groups 4 \
    --users 4 --turns 5 --system-tokens 1024 --question-tokens 64 --output-tokens 64 --concurrency 4 \
    --interleave --gpu-memory-fraction 0.0025 --kv-offload-tokens 65536 \
    --compare-kv-tiers --json-out "$out/kv-tiers.json" >"$out/kv-tiers.log" 2>&1; then
  row "KV tiers on the GPU: turns 2+ TTFT, with/without" DONE "$(grep -h 'with tiers' "$out/kv-tiers.log")"
  row "  host tier restore" INFO "$(grep -h 'host tier' "$out/kv-tiers.log")"
else row "KV tiers on the GPU" FAIL "$(tail -1 "$out/kv-tiers.log")"; fi
gpu_idle
if $bin/duet bench kv-pull --device cuda --gpu-memory-fraction 0.2 --prefix-tokens 2000 \
    --json-out "$out/kv-pull.json" >"$out/kv-pull.log" 2>&1; then
  row "KV pull from a peer on the GPU (2,000 tokens)" DONE "$(head -1 "$out/kv-pull.log")"
else row "KV pull from a peer on the GPU" FAIL "$(tail -1 "$out/kv-pull.log")"; fi
# --- end of KV tiers ------------------------------------------------------------------------------

printf '\n%-58s %-6s %s\n' check result detail
printf '%s\n' "${rows[@]}"
