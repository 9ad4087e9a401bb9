#!/usr/bin/env bash
# Runs every CUDA kernel file on the CPU emulator (crates/duet-cuda/emulator, see its README.md)
# and checks it against numpy float64/bit-exact references; then the emulator's own models of
# ldmatrix and cp.async against the PTX ISA (emulator/emu_selftest.cu). No GPU or CUDA toolkit needed:
# only a C++17 compiler (g++ or c++) and python3 with numpy and ml_dtypes (the independent E4M3
# encoder of the FP8 KV cases). Prints one PASS/FAIL line per kernel
# file (a kernel file without a t_<name>.py test fails too) and exits non-zero on any failure.
# KERNELS_DIR may point at another copy of the kernel files (used to check that breakage is caught).
set -euo pipefail
cd "$(dirname "$0")/.."

EMU=crates/duet-cuda/emulator
KERNELS=${KERNELS_DIR:-kernels}
CXX=${CXX:-$(command -v g++ || command -v c++)}
BUILD=$(mktemp -d "${TMPDIR:-/tmp}/duet-kernel-emu.XXXXXX")
trap 'rm -rf "$BUILD"' EXIT

python3 -c 'import numpy, ml_dtypes' 2>/dev/null || { echo "python3 with numpy and ml_dtypes is required" >&2; exit 1; }

# Build: emu.o once, then one shared library per kernel file, in parallel.
names=()
for cu in "$KERNELS"/*.cu "$EMU/emu_selftest.cu"; do names+=("$(basename "$cu" .cu)"); done
CXX="$CXX" "$EMU/build-lib.sh" "$KERNELS" "$BUILD" "${names[@]}" || true

export DUET_EMU_BUILD="$BUILD" DUET_EMU_KERNELS="$(cd "$KERNELS" && pwd)" PYTHONDONTWRITEBYTECODE=1
failed=0
for name in "${names[@]}"; do
    log="$BUILD/run_$name.log"
    start=$SECONDS
    if [[ ! -f "$BUILD/lib_$name.so" ]]; then
        echo "FAIL $name.cu: does not build for the emulator"; cat "$BUILD/build_$name.log"; failed=1; continue
    fi
    if [[ ! -f "$EMU/t_$name.py" ]]; then
        echo "FAIL $name.cu: no test $EMU/t_$name.py"; failed=1; continue
    fi
    if (cd "$EMU" && python3 "t_$name.py") >"$log" 2>&1; then
        echo "PASS $name.cu: $(grep '^SUMMARY' "$log" | cut -d' ' -f2-) ($((SECONDS - start)) s)"
    else
        echo "FAIL $name.cu ($((SECONDS - start)) s):"; sed 's/^/    /' "$log"; failed=1
    fi
done
exit "$failed"
