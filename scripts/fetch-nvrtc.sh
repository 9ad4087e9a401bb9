#!/usr/bin/env bash
# Installs NVRTC (CUDA 13.0) under .tools/nvrtc from the PyPI wheel nvidia-cuda-nvrtc==13.0.88 and
# prints the folder to put on LD_LIBRARY_PATH. NVRTC runs without a GPU: the tests compile every
# kernel in kernels/ with it, so a kernel that does not compile fails the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.tools/nvrtc
lib="$dest/nvidia/cu13/lib"
if [ ! -f "$lib/libnvrtc.so.13" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "fetching NVRTC 13.0.88 (PyPI nvidia-cuda-nvrtc) into $dest" >&2
  python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 \
    -d "$tmp" nvidia-cuda-nvrtc==13.0.88 >&2
  wheel=$(ls "$tmp"/nvidia_cuda_nvrtc-13.0.88-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl)
  echo "ad9b6d2ead2435f11cbb6868809d2adeeee302e9bb94bcf0539c7a40d80e8575  $wheel" | sha256sum -c --quiet - >&2
  mkdir -p "$dest"
  python3 -m zipfile -e "$wheel" "$dest"
fi
echo "$PWD/$lib"
