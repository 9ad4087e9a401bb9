#!/usr/bin/env bash
# The test suite: unit, golden and integration tests of the whole workspace, in release mode
# (the golden tests run the real default model), built with the CUDA backend (`--features cuda`;
# CUDA libraries are opened at run time, so no GPU is needed) and NVRTC installed so that every
# kernel is compiled, then every kernel file run in a CPU emulation of CUDA against numpy
# references, then the deployment tests (the Helm chart validated offline, the OCI image built with
# buildah and run: scripts/test-deploy.sh). Fetches the default model, NVRTC and the `openai` Python
# client first if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH="$(./scripts/fetch-nvrtc.sh)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The official OpenAI client, which the HTTP API's conformance test (tests/tests/openai.rs) drives.
if ! python3 -c 'import openai' >/dev/null 2>&1; then
  python3 -m pip install --quiet openai==3.54.0 ||
    python3 -m pip install --quiet --break-system-packages openai==3.54.0
fi
cargo build --release --locked --workspace --bins --features cuda
./target/release/duet model fetch
cargo test --release --locked --workspace --features cuda
./scripts/test-kernels-emulated.sh
./scripts/test-deploy.sh
