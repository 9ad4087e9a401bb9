"""Emulated test of kernels/kv_cache.cu: write_kv (bf16 rounding, skipped slot, other layers untouched),
pack_kv_chunks / unpack_kv_chunks (bit-exact, chunks not listed left untouched)."""
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
finish()
