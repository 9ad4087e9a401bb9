#!/usr/bin/env bash
# The test suite: unit, golden and integration tests of the whole workspace, optimized (the golden
# tests run the real default model) and built with the CUDA backend (`--features cuda`; CUDA
# libraries are opened at run time, so no GPU is needed) and NVRTC installed so that every kernel
# is compiled, then every kernel file run in a CPU emulation of CUDA against numpy references,
# then the deployment tests (the Helm chart validated offline, the OCI image built with buildah and
# run: scripts/test-deploy.sh). Fetches the default model, NVRTC, cargo-shear and the Python
# packages the tests drive first if missing, and refuses unused dependencies.
#
# Everything is built once, with the `ci` profile (Cargo.toml: release optimizations without LTO
# or debug info): the service binaries, the test binaries and the image's binaries are the same
# build output (target/ci/). Each stage's wall time is printed as it ends, and all of them with the
# total at the end, also when a stage fails.
set -euo pipefail
cd "$(dirname "$0")/.."
export DUET_BUILD_PROFILE=ci

suite_start=$SECONDS
timings=()
# cpu_seconds: sets CPU to the CPU seconds (user + system) of every command this shell has run and
# waited for so far (`times` in this shell, not in a subshell, which has no children). On a shared
# or loaded machine the wall time alone says little.
times_file=$(mktemp)
cpu_seconds() {
  times >"$times_file"
  CPU=$(awk 'NR == 2 { t = 0; for (i = 1; i <= 2; i++) { split($i, p, /[ms]/); t += p[1] * 60 + p[2] } printf "%d", t }' "$times_file")
}
# stage NAME COMMAND...: runs one stage and records its wall and CPU time.
stage() {
  local name=$1 start=$SECONDS cpu
  shift
  echo "== $name" >&2
  cpu_seconds
  cpu=$CPU
  "$@"
  cpu_seconds
  local wall=$((SECONDS - start)) cpu=$((CPU - cpu))
  timings+=("$(printf '%-18s %6d s wall %7d s CPU' "$name" "$wall" "$cpu")")
  echo "== $name: $wall s wall, $cpu s CPU" >&2
}
report() {
  local rc=$?
  cpu_seconds
  rm -f "$times_file"
  echo "== stage times (scripts/test.sh)" >&2
  [ ${#timings[@]} = 0 ] || printf '   %s\n' "${timings[@]}" >&2
  printf '   %-18s %6d s wall %7d s CPU%s\n' total $((SECONDS - suite_start)) "$CPU" \
    "$([ "$rc" = 0 ] || echo ", FAILED (exit $rc)")" >&2
}
trap report EXIT

# Python packages the tests drive, installed into whichever python3 is first on PATH (a pyenv
# interpreter on the CI machines, which Debian's python3-numpy does not reach): numpy for the
# kernel emulation's references, the official OpenAI client and `jsonschema` (which validates
# structured outputs) for the HTTP API's conformance test (tests/tests/it/openai.rs), grpcio and
# opentelemetry-proto for the OTLP receiver of the trace test (tests/otlp/receiver.py,
# tests/tests/it/otlp.rs).
pip_need() { # MODULE REQUIREMENT
  python3 -c "import $1" >/dev/null 2>&1 && return
  python3 -m pip install --quiet "$2" || python3 -m pip install --quiet --break-system-packages "$2"
}
tools() {
  pip_need numpy numpy
  pip_need ml_dtypes ml_dtypes==0.5.4
  pip_need openai openai==3.54.0
  pip_need jsonschema jsonschema==4.26.0
  pip_need grpc grpcio==1.85.1
  pip_need opentelemetry.proto opentelemetry-proto==1.45.2
  nvrtc=$(./scripts/fetch-nvrtc.sh)
  shear=$(./scripts/fetch-cargo-shear.sh)
}
stage tools tools
export LD_LIBRARY_PATH="$nvrtc${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Unused or misplaced dependencies fail the suite (cargo-shear reads every crate's manifest and
# sources; a prebuilt, pinned binary: nothing to compile).
stage "unused deps" "$shear/cargo-shear"
stage build cargo build --profile ci --locked --workspace --bins --features cuda
stage "model fetch" ./target/ci/duet model fetch
stage "cargo tests" cargo test --profile ci --locked --workspace --features cuda
stage "kernel emulation" ./scripts/test-kernels-emulated.sh
stage "gpu script dry run" ./scripts/gpu-verify.sh --dry-run
stage "deploy checks" ./scripts/test-deploy.sh
