"""Emulated test of kernels/fp8_weights.cu against numpy with ml_dtypes' float8_e4m3fn (an
independent E4M3 encoder; tests/reference/fp8_reference.py): the quantized input's bytes and
scales bit for bit, dynamic (a scale per row, a row of zeros among them) and static, ties and
saturation included; and the scaled output of an FP8 product within f32 rounding of the float64
product of the dequantized operands."""
import os

from harness import *

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', '..', 'tests', 'reference'))
import ml_dtypes  # noqa: E402
from fp8_reference import dequantize_rows, quantize_rows  # noqa: E402

rng = np.random.default_rng(8)
rows, cols = 6, 300
x = (rng.standard_normal((rows, cols)) * np.exp2(rng.integers(-12, 6, (rows, cols)))).astype(np.float32)
x[2] = 0.0
# Ties between E4M3 steps of row 4's scale (its amax is 448 exactly: scale 1).
x[4, :3] = np.array([448.0, 1.0625, 3.0 * 2.0 ** -10], np.float32)
x[4, 3:] = np.clip(x[4, 3:], -440, 440)
q = np.full((rows, cols), 0xAB, np.uint8)
s = np.full(rows, np.nan, np.float32)
launch('fp8_weights', 'quantize_rows_e4m3', (rows,), 64, x, q, s, c_int(rows), c_int(cols), c_float(0.0))
ref_q, ref_s = quantize_rows(x)
check('quantize_rows_e4m3 (dynamic): scales as numpy', np.array_equal(s, ref_s), f'{s} vs {ref_s}')
check('quantize_rows_e4m3 (dynamic): bytes as ml_dtypes', np.array_equal(q, ref_q),
      f'{int(np.sum(q != ref_q))} differ')
check('quantize_rows_e4m3: a row of zeros has scale 1', s[2] == 1.0 and not q[2].any())

# A static input scale: values past 448·scale saturate to ±448 (ml_dtypes would give NaN there).
static = np.float32(0.01)
launch('fp8_weights', 'quantize_rows_e4m3', (rows,), 64, x, q, s, c_int(rows), c_int(cols), c_float(static))
scaled = np.clip(x / static, -448, 448)
check('quantize_rows_e4m3 (static): every row takes the static scale', np.all(s == static))
check('quantize_rows_e4m3 (static): bytes as ml_dtypes, saturated',
      np.array_equal(q, scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)))

# An FP8 product: x quantized per row, w per output row; the GEMM's unscaled f32 sums (what
# cuBLASLt writes) scaled by fp8_scale_output.
n = 40
w = rng.standard_normal((n, cols)).astype(np.float32) * 0.05
wq, ws = quantize_rows(w)
launch('fp8_weights', 'quantize_rows_e4m3', (rows,), 64, x, q, s, c_int(rows), c_int(cols), c_float(0.0))
xe = q.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
we = wq.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
out = (xe @ we.T).astype(np.float32)
launch('fp8_weights', 'fp8_scale_output', (3,), 64, out, s, ws, c_int(rows), c_int(n))
ref = dequantize_rows(q, s) @ dequantize_rows(wq, ws).T
check_close('fp8_scale_output: the dequantized operands\' product', out, ref, 1e-6)
exact = x.astype(np.float64) @ w.astype(np.float64).T
err = np.linalg.norm(out - exact) / np.linalg.norm(exact)
check('the FP8 product is within 5e-2 of the unquantized one', err < 5e-2, f'|d|/|ref| = {err:.2e}')
finish()
