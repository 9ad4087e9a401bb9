"""harness.py — Python side of the CPU kernel emulator (see README.md).

Loads lib_<kernel file>.so from $DUET_EMU_BUILD (built by scripts/test-kernels-emulated.sh),
launches kernels through their generated L_<kernel> wrappers, and provides bf16
conversions and the check/report plumbing shared by the t_*.py tests.
"""
import ctypes
import os
import sys

import numpy as np
from ctypes import c_int, c_uint, c_float, c_ulonglong, c_void_p  # noqa: F401 (re-exported)

_libs = {}
_failures = []
_checks = 0


def lib(name):
    if name not in _libs:
        build = os.environ.get('DUET_EMU_BUILD')
        if not build:
            sys.exit('DUET_EMU_BUILD is not set; run scripts/test-kernels-emulated.sh')
        _libs[name] = ctypes.CDLL(os.path.join(build, f'lib_{name}.so'))
    return _libs[name]


def launch(libname, kname, grid, block, *args, smem=0):
    """Launch kernel `kname` of kernels/<libname>.cu with a 1-D block of `block` threads and `smem`
    bytes of dynamic shared memory. numpy arrays are passed as device pointers (the emulator
    shares host memory); scalars must already be ctypes values matching the kernel's parameter types."""
    g = list(grid) + [1] * (3 - len(grid))
    lib(libname).emu_set_dynamic_smem(c_uint(smem))
    conv = [c_void_p(a.ctypes.data) if isinstance(a, np.ndarray) else a for a in args]
    for a in args:
        if isinstance(a, np.ndarray):
            assert a.flags.c_contiguous, 'arrays passed to kernels must be C-contiguous'
    getattr(lib(libname), 'L_' + kname)(c_uint(g[0]), c_uint(g[1]), c_uint(g[2]), c_uint(block), *conv)


def f2bf(x):
    """f32 -> bf16 bits, round to nearest even, NaN stays a (quiet) NaN: the reference for f32_to_bf16."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7fff + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return r


def bf2f(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def f2e4m3(x):
    """f32 -> E4M3 bits by ml_dtypes' float8_e4m3fn (an independent encoder): round to nearest
    even, NaN stays NaN (its sign kept). Clipped to ±448 first: the kernels saturate there, as PTX's
    cvt.rn.satfinite does, where ml_dtypes gives NaN. The reference for f32_to_e4m3."""
    import ml_dtypes
    return np.clip(np.asarray(x, np.float32), -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def e4m32f(b):
    """E4M3 bits -> f32 by ml_dtypes (exact)."""
    import ml_dtypes
    return np.asarray(b, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def e4m3_edges():
    """f32 values at E4M3's rounding edges: every finite code's value, the midpoints between
    neighbours (ties, to even) and one f32 ulp either side, values past 448 up to infinity,
    below the smallest subnormal, f32 subnormals, NaN; both signs."""
    codes = e4m32f(np.arange(0x7f, dtype=np.uint8))  # 0 .. 448, increasing
    mids = (codes[:-1] + codes[1:]) / np.float32(2)
    v = np.concatenate([codes, mids, np.nextafter(mids, np.float32(np.inf)),
                        np.nextafter(mids, np.float32(0)),
                        np.array([448.5, 463.9, 464, 465, 1e6, 3e38, np.inf, 2.0 ** -10, 2.0 ** -11,
                                  1e-20, 1e-40, np.nan], np.float32)]).astype(np.float32)
    return np.concatenate([v, -v])


def check(name, good, detail=''):
    global _checks
    _checks += 1
    good = bool(good)
    if not good:
        _failures.append(name)
    print(('ok   ' if good else 'FAIL ') + name + (f'  {detail}' if detail else ''))
    return good


def kernel_define(libname, name):
    """The integer value of `#define name` in kernels/<libname>.cu (launch constants the host reads too)."""
    kernels = os.environ.get('DUET_EMU_KERNELS') or os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', '..', 'kernels')
    with open(os.path.join(kernels, libname + '.cu')) as f:
        for line in f:
            parts = line.split()
            if parts[:2] == ['#define', name]:
                return int(parts[2])
    sys.exit(f'kernels/{libname}.cu defines no {name}')


def check_close(name, got, ref, tol=1e-5):
    """allclose(rtol=atol=tol) against a float64 reference; tol=0 means bitwise-equal values."""
    ref = np.asarray(ref, np.float64)
    aerr = float(np.max(np.abs(got.astype(np.float64) - ref))) if ref.size else 0.0
    return check(name, got.shape == ref.shape and np.allclose(got, ref, rtol=tol, atol=tol), f'maxabs={aerr:.2e}')


def finish():
    """Print the summary line read by the runner and exit non-zero on any failure."""
    if _failures:
        print(f'SUMMARY {len(_failures)}/{_checks} checks failed: {", ".join(_failures)}')
        sys.exit(1)
    print(f'SUMMARY {_checks} checks passed')
