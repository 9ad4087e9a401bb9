"""Emulated test of kernels/norm.cu: rms_norm and add_rms_norm (residual update exact, output vs f64)."""
from harness import *

rng = np.random.default_rng(0)
# Ragged widths, widths above and below the block size, a single-warp block.
for cols, blk in ((1024, 256), (100, 64), (99, 64), (10000, 256), (2052, 32)):
    rows = 3
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    d = rng.standard_normal((rows, cols)).astype(np.float32)
    w = rng.standard_normal(cols).astype(np.float32)
    out = np.full_like(x, np.nan)
    launch('norm', 'rms_norm', (rows,), blk, x, w, out, c_void_p(0), c_int(cols), c_float(1e-5))
    xd = x.astype(np.float64)
    check_close(f'rms_norm cols={cols} block={blk}', out,
                xd / np.sqrt((xd ** 2).mean(1, keepdims=True) + 1e-5) * w, 2e-5)
    out_bf = np.full(x.shape, 0x7fa5, np.uint16)
    out1 = np.full_like(x, np.nan)
    launch('norm', 'rms_norm', (rows,), blk, x, w, out1, out_bf, c_int(cols), c_float(1e-5))
    check(f'rms_norm bf16 copy cols={cols}', np.array_equal(out1, out) and np.array_equal(out_bf, f2bf(out)))
    res = x.copy()
    out2 = np.full_like(x, np.nan)
    out2_bf = np.full(x.shape, 0x7fa5, np.uint16)
    launch('norm', 'add_rms_norm', (rows,), blk, res, d, w, out2, out2_bf, c_int(cols), c_float(1e-6))
    s = x + d
    check_close(f'add_rms_norm residual cols={cols}', res, s, 0)
    sd = s.astype(np.float64)
    check_close(f'add_rms_norm out cols={cols}', out2, sd / np.sqrt((sd ** 2).mean(1, keepdims=True) + 1e-6) * w, 2e-5)
    check(f'add_rms_norm bf16 copy cols={cols}', np.array_equal(out2_bf, f2bf(out2)))
finish()
