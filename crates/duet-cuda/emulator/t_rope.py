"""Emulated test of kernels/rope.cu: rope_rotate_half in place, vs an f64 reference, head_dim 64 and 128."""
from harness import *

rng = np.random.default_rng(0)
for hd in (64, 128):
    rows, nh, theta = 4, 3, 500000.0
    x = rng.standard_normal((rows, nh * hd)).astype(np.float32)
    pos = np.array([0, 1, 17, 3000], np.uint32)
    y = x.copy()
    launch('rope', 'rope_rotate_half', (rows, nh), hd // 2, y, pos, c_int(nh), c_int(hd), c_float(theta))
    half = hd // 2
    inv = 1.0 / np.power(np.float64(theta), 2 * np.arange(half) / hd)
    ang = pos[:, None].astype(np.float64) * inv[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    xr = x.reshape(rows, nh, hd).astype(np.float64)
    x1, x2 = xr[..., :half], xr[..., half:]
    ref = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1).reshape(rows, nh * hd)
    check_close(f'rope_rotate_half head_dim={hd}', y, ref, 2e-3)  # f32 angles at position 3000
finish()
