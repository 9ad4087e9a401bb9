"""Emulated test of kernels/qkv_rope_kv.cu: qkv_rope_write_kv against a float64 reference (Q
rotated, K rotated and V stored in bf16 at each row's slot; a row with no slot stores nothing;
other blocks and layers untouched), and against the separate kernels it replaces (copy_cols,
rope_rotate_half, write_kv), bit for bit. qkv_rope_write_kv_fp8: V as ml_dtypes encodes v / v_scale,
and everything the same bits as rope_rotate_half and write_kv_fp8."""
from harness import *

rng = np.random.default_rng(5)
for hd, nh, nkv in ((64, 4, 2), (128, 8, 8)):
    L, NB, bs, rows, theta, scale = 2, 6, 16, 5, 500000.0, 1.1
    half, width = hd // 2, (nh + 2 * nkv) * hd
    inv = (1.0 / np.power(np.float64(theta), 2 * np.arange(half) / hd) / np.linspace(1, 4, half)).astype(np.float32)
    qkv = rng.standard_normal((rows, width)).astype(np.float32)
    pos = np.array([0, 1, 17, 3000, 95], np.uint32)
    slots = np.array([0, 17, 33, 94, 0xffffffff], np.uint32)  # the last row: no slot
    poison = 0x7fa5
    q = np.full((rows, nh * hd), np.nan, np.float32)
    store = np.full(L * NB * 2 * nkv * bs * hd, poison, np.uint16)
    launch('qkv_rope_kv', 'qkv_rope_write_kv', (rows, nh + 2 * nkv), half, qkv, q, store, pos, slots, inv,
           c_int(1), c_int(NB), c_int(nh), c_int(nkv), c_int(bs), c_int(hd), c_float(scale))

    ang = pos[:, None].astype(np.float64) * inv.astype(np.float64)[None, :]
    c, s = scale * np.cos(ang)[:, None, :], scale * np.sin(ang)[:, None, :]

    def rot(x, heads):
        x = x.reshape(rows, heads, hd).astype(np.float64)
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    qr = rot(qkv[:, :nh * hd], nh).reshape(rows, nh * hd)
    kr = rot(qkv[:, nh * hd:(nh + nkv) * hd], nkv)
    v = qkv[:, (nh + nkv) * hd:].reshape(rows, nkv, hd)
    check_close(f'q rotated, head_dim {hd}', q, qr, 2e-3)
    got = store.reshape(L, NB, 2, nkv, bs, hd)
    ok_k = ok_v = True
    written = np.zeros(got.shape, bool)
    for r in range(rows - 1):
        b, sl = divmod(int(slots[r]), bs)
        ok_k &= np.allclose(bf2f(got[1, b, 0, :, sl, :]), kr[r], atol=2e-3 + 1e-2 * np.abs(kr[r]))
        ok_v &= np.array_equal(got[1, b, 1, :, sl, :], f2bf(v[r]))
        written[1, b, :, :, sl, :] = True
    check(f'k rotated into the cache, head_dim {hd}', ok_k)
    check(f'v into the cache, head_dim {hd}', ok_v)
    check(f'nothing else written, head_dim {hd}', np.all(got[~written] == poison))

    # The separate kernels on the same input: the same bits.
    qs = np.ascontiguousarray(qkv[:, :nh * hd])
    ks = np.ascontiguousarray(qkv[:, nh * hd:(nh + nkv) * hd])
    vs = np.ascontiguousarray(qkv[:, (nh + nkv) * hd:])
    launch('rope', 'rope_rotate_half', (rows, nh), half, qs, pos, inv, c_int(nh), c_int(hd), c_float(scale))
    launch('rope', 'rope_rotate_half', (rows, nkv), half, ks, pos, inv, c_int(nkv), c_int(hd), c_float(scale))
    store2 = np.full_like(store, poison)
    launch('kv_cache', 'write_kv', (rows,), 128, store2, ks, vs, slots, c_int(1), c_int(NB), c_int(nkv), c_int(bs), c_int(hd))
    check(f'same bits as rope_rotate_half and write_kv, head_dim {hd}',
          np.array_equal(q.view(np.uint32), qs.view(np.uint32)) and np.array_equal(store, store2))

    # Into an FP8 cache, scales that are not powers of two.
    ksc, vsc = 0.8, 1.7
    q8 = np.full((rows, nh * hd), np.nan, np.float32)
    store8 = np.full(L * NB * 2 * nkv * bs * hd, 0xa5, np.uint8)
    launch('qkv_rope_kv', 'qkv_rope_write_kv_fp8', (rows, nh + 2 * nkv), half, qkv, q8, store8, pos, slots, inv,
           c_int(1), c_int(NB), c_int(nh), c_int(nkv), c_int(bs), c_int(hd), c_float(scale), c_float(ksc),
           c_float(vsc))
    got8 = store8.reshape(L, NB, 2, nkv, bs, hd)
    ok_v = all(np.array_equal(got8[1, int(slots[r]) // bs, 1, :, int(slots[r]) % bs, :],
                              f2e4m3(v[r] / np.float32(vsc))) for r in range(rows - 1))
    check(f'fp8: v / v_scale into the cache as ml_dtypes encodes it, head_dim {hd}', ok_v)
    store9 = np.full_like(store8, 0xa5)
    launch('kv_cache', 'write_kv_fp8', (rows,), 128, store9, ks, vs, slots, c_int(1), c_int(NB), c_int(nkv), c_int(bs),
           c_int(hd), c_float(ksc), c_float(vsc))
    check(f'fp8: same bits as rope_rotate_half and write_kv_fp8, head_dim {hd}',
          np.array_equal(q8.view(np.uint32), qs.view(np.uint32)) and np.array_equal(store8, store9))
finish()
