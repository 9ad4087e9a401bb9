"""Emulated test of kernels/kv_cache.cu: write_kv (bf16 rounding, skipped slot, other layers untouched),
write_kv_fp8 (E4M3 bits as ml_dtypes encodes x / scale, bit for bit, at every rounding edge and on
random values with scales that are not powers of two; the same placement), pack_kv_chunks /
unpack_kv_chunks (bit-exact, chunks not listed left untouched; an FP8 chunk moves as half as many
bf16 elements)."""
from harness import *

rng = np.random.default_rng(0)
L, NB, nkv, bs, hd = 2, 5, 2, 16, 64
rows = 6
poison = 0x7fa5
store = np.full(L * NB * 2 * nkv * bs * hd, poison, np.uint16)
k = rng.standard_normal((rows, nkv * hd)).astype(np.float32)
v = rng.standard_normal((rows, nkv * hd)).astype(np.float32)
slots = np.array([0, 17, 33, 79, 45, 0xffffffff], np.uint32)  # last row: no slot, must be skipped
launch('kv_cache', 'write_kv', (rows,), 128, store, k, v, slots, c_int(1), c_int(NB), c_int(nkv), c_int(bs), c_int(hd))
ref = np.full((L, NB, 2, nkv, bs, hd), poison, np.uint16)
for r in range(rows - 1):
    blk, s = divmod(int(slots[r]), bs)
    ref[1, blk, 0, :, s, :] = f2bf(k[r]).reshape(nkv, hd)
    ref[1, blk, 1, :, s, :] = f2bf(v[r]).reshape(nkv, hd)
check('write_kv', np.array_equal(store.reshape(ref.shape), ref))


def write_fp8(k, v, k_scale, v_scale):
    """write_kv_fp8 of k, v (rows of nkv*hd values) into a poisoned FP8 store; the store, and the
    reference placement of f2e4m3(x / scale)."""
    n = len(k)
    slots = np.array([(r * 7 + 3) % (NB * bs) for r in range(n - 1)] + [0xffffffff], np.uint32)
    store = np.full(L * NB * 2 * nkv * bs * hd, 0xa5, np.uint8)
    launch('kv_cache', 'write_kv_fp8', (n,), 128, store, k, v, slots, c_int(1), c_int(NB), c_int(nkv),
           c_int(bs), c_int(hd), c_float(k_scale), c_float(v_scale))
    ref = np.full((L, NB, 2, nkv, bs, hd), 0xa5, np.uint8)
    for r in range(n - 1):
        blk, s = divmod(int(slots[r]), bs)
        ref[1, blk, 0, :, s, :] = f2e4m3(k[r] / np.float32(k_scale)).reshape(nkv, hd)
        ref[1, blk, 1, :, s, :] = f2e4m3(v[r] / np.float32(v_scale)).reshape(nkv, hd)
    return store.reshape(ref.shape), ref


edges = e4m3_edges()
width = nkv * hd
padded = np.concatenate([edges, rng.standard_normal(-len(edges) % width).astype(np.float32)])
ke = np.ascontiguousarray(padded.reshape(-1, width))
ke = np.concatenate([ke, ke[:1]])  # one more row, with no slot
got, ref = write_fp8(ke, ke[::-1].copy(), 1.0, 1.0)
check('write_kv_fp8 at every E4M3 rounding edge: ml_dtypes bits', np.array_equal(got, ref),
      f'{int(np.sum(got != ref))} bytes differ of {got.size}')
# Values over six decades, scales that are not powers of two (x / scale rounds first).
kr = (rng.standard_normal((9, width)) * 10.0 ** rng.uniform(-4, 2.5, (9, width))).astype(np.float32)
vr = (rng.standard_normal((9, width)) * 10.0 ** rng.uniform(-4, 2.5, (9, width))).astype(np.float32)
got, ref = write_fp8(kr, vr, 0.37, 2.5)
check('write_kv_fp8 with scales 0.37 / 2.5: ml_dtypes bits', np.array_equal(got, ref),
      f'{int(np.sum(got != ref))} bytes differ of {got.size}')
# Round trip (what attention reads back): within half an E4M3 step of the value, or ±448 · scale
# past that.
back = e4m32f(got[1, :, 0]) * np.float32(0.37)
src = np.zeros_like(back)
for r in range(8):
    blk, s = divmod((r * 7 + 3) % (NB * bs), bs)
    src[blk, :, s, :] = kr[r].reshape(nkv, hd)
inside = (src != 0) & (np.abs(src) <= 448 * np.float32(0.37))
rel = np.abs(back[inside] - src[inside]) / np.maximum(np.abs(src[inside]), 2.0 ** -6 * 0.37)
saturated = np.abs(src) > 448 * np.float32(0.37)
check('fp8 round trip within half a step (2^-4 relative, 2^-10 · scale absolute below 2^-6 · scale)',
      np.max(rel) <= 2.0 ** -4 and np.array_equal(back[saturated], np.sign(src[saturated]) * (np.float32(448) * np.float32(0.37))),
      f'max={np.max(rel):.4f} rms={np.sqrt(np.mean(rel ** 2)):.4f} saturated={int(saturated.sum())}')

store = rng.integers(0, 65535, L * NB * 2 * nkv * bs * hd).astype(np.uint16)
ce = 2 * nkv * bs * hd  # elements per (layer, block) chunk
chunks = np.array([7, 2, 9], np.uint32)
packed = np.zeros(3 * ce, np.uint16)
launch('kv_cache', 'pack_kv_chunks', (3, 3), 64, store, chunks, c_ulonglong(ce), packed)
check('pack_kv_chunks', np.array_equal(packed.reshape(3, ce), store.reshape(-1, ce)[chunks]))

st2 = np.full_like(store, poison)
launch('kv_cache', 'unpack_kv_chunks', (2, 3), 32, st2, chunks, c_ulonglong(ce), packed)
ref = np.full_like(store, poison).reshape(-1, ce)
ref[chunks] = store.reshape(-1, ce)[chunks]
check('unpack_kv_chunks', np.array_equal(st2.reshape(-1, ce), ref))

# An FP8 store: chunks of ce bytes move as ce / 2 bf16 elements.
st8 = rng.integers(0, 256, L * NB * ce).astype(np.uint8)
packed8 = np.zeros(3 * ce, np.uint8)
launch('kv_cache', 'pack_kv_chunks', (3, 3), 64, st8, chunks, c_ulonglong(ce // 2), packed8)
check('pack_kv_chunks of an fp8 store', np.array_equal(packed8.reshape(3, ce), st8.reshape(-1, ce)[chunks]))
finish()
