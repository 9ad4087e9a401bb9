#!/usr/bin/env bash
# Builds the CPU emulator's library of kernel files: BUILD/lib_NAME.so from KERNELS/NAME.cu for
# each NAME, or from the emulator's own NAME.cu (its self-test) where KERNELS has none (gen.py's
# translation unit compiled with emu.cpp's BUILD/emu.o, built first if missing), in parallel, each
# with its log in BUILD/build_NAME.log. Exits non-zero if one fails.
# Used by scripts/test-kernels-emulated.sh and by the Rust tests that drive a kernel through the
# emulator (crates/duet-cuda/tests/it/sampling_emulated.rs).
# Usage: build-lib.sh KERNELS_DIR BUILD_DIR NAME...   (CXX: a C++17 compiler, default g++ or c++)
set -euo pipefail
emu=$(cd "$(dirname "$0")" && pwd)
kernels=$1 build=$2
shift 2
cxx=${CXX:-$(command -v g++ || command -v c++)}
# No _FORTIFY_SOURCE for the fiber scheduler: its longjmp check rejects switching between stacks.
[[ -f "$build/emu.o" ]] ||
    "$cxx" -std=c++17 -O2 -fPIC -U_FORTIFY_SOURCE -D_FORTIFY_SOURCE=0 -c "$emu/emu.cpp" -o "$build/emu.o"
pids=()
for name in "$@"; do
    src=$kernels/$name.cu
    [[ -f "$src" ]] || src=$emu/$name.cu
    (
        python3 "$emu/gen.py" --kernels "$kernels" "$src" "$build/t_$name.cpp" &&
        "$cxx" -std=c++17 -O2 -fPIC -shared -I"$emu" "$build/t_$name.cpp" "$build/emu.o" -o "$build/lib_$name.so"
    ) >"$build/build_$name.log" 2>&1 &
    pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
exit "$failed"
