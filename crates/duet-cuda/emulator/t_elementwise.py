"""Emulated test of kernels/elementwise.cu: every kernel, grid-stride loops with ragged sizes, exact bf16 rounding."""
from harness import *

rng = np.random.default_rng(0)
n = 1000
g = rng.standard_normal(n).astype(np.float32)
u = rng.standard_normal(n).astype(np.float32)
g2 = g.copy()
launch('elementwise', 'silu_mul', (2,), 64, g2, u, c_ulonglong(n))
gd = g.astype(np.float64)
check_close('silu_mul', g2, gd / (1 + np.exp(-gd)) * u, 1e-5)

rows, inter = 5, 37
gu = rng.standard_normal((rows, 2 * inter)).astype(np.float32)
o = np.full((rows, inter), np.nan, np.float32)
ob = np.full((rows, inter), 0xffff, np.uint16)
launch('elementwise', 'silu_mul_stacked', (1,), 64, gu, o, ob, c_int(rows), c_int(inter))
a = gu[:, :inter].astype(np.float64)
check_close('silu_mul_stacked', o, a / (1 + np.exp(-a)) * gu[:, inter:], 1e-5)
check('silu_mul_stacked: its bf16 copy is the f32 result rounded', np.array_equal(ob, f2bf(o)))

x = g.copy()
launch('elementwise', 'add_inplace', (3,), 32, x, u, c_ulonglong(n))
check_close('add_inplace', x, g + u, 0)

xb = rng.standard_normal((rows, inter)).astype(np.float32)
b = rng.standard_normal(inter).astype(np.float32)
x = xb.copy()
launch('elementwise', 'add_bias_rows', (2,), 32, x, b, c_int(rows), c_int(inter))
check_close('add_bias_rows', x, xb + b, 0)

# Round-to-nearest-even ties, infinities, signed zero, overflow to inf, NaN.
src = np.concatenate([rng.standard_normal(500).astype(np.float32) * 1000,
                      np.array([np.inf, -np.inf, 0, -0.0, 1.00390625, 1.01171875, 3.4e38, np.nan, -np.nan], np.float32)])
ob = np.full(src.size + 3, 0xdead, np.uint16)  # 3 poisoned elements past the end must stay untouched
launch('elementwise', 'f32_to_bf16_n', (1,), 64, src, ob, c_ulonglong(src.size))
check('f32_to_bf16_n', np.array_equal(ob[:src.size], f2bf(src)) and np.all(ob[src.size:] == 0xdead))

cols, cs, wd = 50, 7, 20
x = rng.standard_normal((rows, cols)).astype(np.float32)
o = np.full((rows, wd), np.nan, np.float32)
launch('elementwise', 'copy_cols', (1,), 64, x, c_int(rows), c_int(cols), c_int(cs), c_int(wd), o)
check_close('copy_cols', o, x[:, cs:cs + wd], 0)

idx = np.array([4, 0, 2, 2], np.uint32)
o = np.full((4, cols), np.nan, np.float32)
launch('elementwise', 'gather_rows', (4,), 32, x, idx, o, c_int(cols))
check_close('gather_rows', o, x[idx], 0)

# scatter_add_rows: an expert's outputs added back, weighted, to the rows it was picked for.
out = rng.standard_normal((6, cols)).astype(np.float32)
y = rng.standard_normal((3, cols)).astype(np.float32)
rows_to = np.array([4, 0, 2], np.uint32)
w = np.array([0.25, 0.5, 1.5], np.float32)
ref = out.astype(np.float64)
ref[rows_to] += w[:, None].astype(np.float64) * y.astype(np.float64)
launch('elementwise', 'scatter_add_rows', (3,), 32, out, y, rows_to, w, c_int(cols))
check_close('scatter_add_rows', out, ref, 1e-6)
finish()
