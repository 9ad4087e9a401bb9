#!/usr/bin/env bash
# The test suite: unit, golden and integration tests of the whole workspace, in release mode
# (the golden tests run the real default model), built with the CUDA backend (`--features cuda`;
# CUDA libraries are opened at run time, so no GPU is needed) and NVRTC installed so that every
# kernel is compiled, then every kernel file run in a CPU emulation of CUDA against numpy
# references, then the deployment tests (the Helm chart validated offline, the OCI image built with
# buildah and run: scripts/test-deploy.sh). Fetches the default model, NVRTC and the `openai` Python
# client first if missing, and refuses unused dependencies (cargo-machete, installed if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH="$(./scripts/fetch-nvrtc.sh)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Python packages the tests drive, installed into whichever python3 is first on PATH (a pyenv
# interpreter on the CI machines, which Debian's python3-numpy does not reach): numpy for the
# kernel emulation's references, the official OpenAI client and `jsonschema` (which validates
# structured outputs) for the HTTP API's conformance test (tests/tests/openai.rs), grpcio and opentelemetry-proto for the OTLP receiver of the trace test
# (tests/otlp/receiver.py, tests/tests/otlp.rs).
pip_need() { # MODULE REQUIREMENT
  python3 -c "import $1" >/dev/null 2>&1 && return
  python3 -m pip install --quiet "$2" || python3 -m pip install --quiet --break-system-packages "$2"
}
pip_need numpy numpy
pip_need openai openai==3.54.0
pip_need jsonschema jsonschema==4.26.0
pip_need grpc grpcio==1.85.1
pip_need opentelemetry.proto opentelemetry-proto==1.45.2
# Unused dependencies fail the suite (cargo-machete reads every crate's manifest and sources).
command -v cargo-machete >/dev/null 2>&1 || cargo install --locked --quiet cargo-machete@0.9.2
cargo machete
cargo build --release --locked --workspace --bins --features cuda
./target/release/duet model fetch
cargo test --release --locked --workspace --features cuda
./scripts/test-kernels-emulated.sh
BIN_DIR=target/release ./scripts/gpu-verify.sh --dry-run
./scripts/test-deploy.sh
