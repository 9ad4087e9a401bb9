"""Emulated test of kernels/rope.cu: rope_rotate_half in place, vs an f64 reference, head_dim 64
and 128, with plain frequencies and with scaled ones (a per-frequency divisor and a cos/sin scale,
as the model's RoPE scaling gives)."""
from harness import *

rng = np.random.default_rng(0)
for hd in (64, 128):
    for scaled in (False, True):
        rows, nh, theta = 4, 3, 500000.0
        half = hd // 2
        inv = 1.0 / np.power(np.float64(theta), 2 * np.arange(half) / hd)
        scale = 1.0
        if scaled:
            inv = inv / np.linspace(1.0, 8.0, half)
            scale = 1.1386
        inv32 = inv.astype(np.float32)
        x = rng.standard_normal((rows, nh * hd)).astype(np.float32)
        pos = np.array([0, 1, 17, 3000], np.uint32)
        y = x.copy()
        launch('rope', 'rope_rotate_half', (rows, nh), hd // 2, y, pos, inv32, c_int(nh), c_int(hd),
               c_float(scale))
        ang = pos[:, None].astype(np.float64) * inv32.astype(np.float64)[None, :]
        c, s = scale * np.cos(ang)[:, None, :], scale * np.sin(ang)[:, None, :]
        xr = x.reshape(rows, nh, hd).astype(np.float64)
        x1, x2 = xr[..., :half], xr[..., half:]
        ref = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1).reshape(rows, nh * hd)
        # f32 angles at position 3000
        check_close(f'rope_rotate_half head_dim={hd} scaled={scaled}', y, ref, 2e-3)
finish()
