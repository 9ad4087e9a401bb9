#!/usr/bin/env bash
# Installs cuBLAS (CUDA 13.0 update 2, the release of scripts/fetch-nvrtc.sh's NVRTC) under
# .tools/ from the PyPI wheel nvidia-cublas==13.0.2.14 and prints its lib folder. Only the GPU
# image needs it (scripts/build-image.sh --gpu); on a GPU machine the driver comes from the host.
exec "$(dirname "$0")/fetch-wheel.sh" nvidia-cublas 13.0.2.14 \
  nvidia_cublas-13.0.2.14-py3-none-manylinux_2_27_x86_64.whl \
  0cf238ffdbe46c00cb9aa98e7bca745c223a5ca5a53e686ac8b3e5a08fe80d6c nvidia/cu13/lib
