#!/usr/bin/env bash
# Installs NVRTC (CUDA 13.0) under .tools/ from the PyPI wheel nvidia-cuda-nvrtc==13.0.88 and
# prints the folder to put on LD_LIBRARY_PATH. NVRTC runs without a GPU: the tests compile every
# kernel in kernels/ with it, so a kernel that does not compile fails the suite.
exec "$(dirname "$0")/fetch-wheel.sh" nvidia-cuda-nvrtc 13.0.88 \
  nvidia_cuda_nvrtc-13.0.88-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl \
  ad9b6d2ead2435f11cbb6868809d2adeeee302e9bb94bcf0539c7a40d80e8575 nvidia/cu13/lib
