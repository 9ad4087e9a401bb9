"""attn_ref.py — shared fixtures and the float64 reference for the emulated attention tests
(t_paged_attention.py, t_prefill_attention.py): a bf16 or FP8 paged KV store with shuffled block tables."""
import numpy as np

from harness import bf2f, e4m32f, f2bf, f2e4m3


def make_store(rng, L, NB, nkv, bs, hd, draw=None):
    """Paged KV store [layer][block][k|v][kv_head][slot][head_dim] of bf16, values from
    draw(n) (default: standard normal)."""
    n = L * NB * 2 * nkv * bs * hd
    return f2bf((draw(n) if draw else rng.standard_normal(n)).astype(np.float32))


def make_store_fp8(rng, L, NB, nkv, bs, hd, scales, draw=None):
    """The same store in E4M3: x / scales[0] for K, x / scales[1] for V. Its bytes, and the values
    x [layer][block][k|v][kv_head][slot][head_dim] it holds (f32)."""
    n = L * NB * 2 * nkv * bs * hd
    x = (draw(n) if draw else rng.standard_normal(n)).astype(np.float32).reshape(L, NB, 2, nkv, bs, hd)
    return f2e4m3(x / np.array(scales, np.float32).reshape(1, 1, 2, 1, 1, 1)).reshape(-1), x


def fp8_values(scales):
    """What an FP8 store's bytes hold, to gather_kv: E4M3 · scale (K's, V's)."""
    sc = np.array(scales, np.float64).reshape(2, 1, 1, 1)
    return lambda store, shape: (e4m32f(store).reshape(shape).astype(np.float64) * sc)


def make_tables(rng, nblocks_per_seq, spare):
    """Shuffled physical blocks: per-sequence tables, concatenated tables and their offsets."""
    NB = sum(nblocks_per_seq) + spare
    perm = rng.permutation(NB).astype(np.uint32)
    tables, offs, o = [], [], 0
    for mb in nblocks_per_seq:
        offs.append(o); tables.append(perm[o:o + mb]); o += mb
    return NB, tables, np.concatenate(tables).astype(np.uint32), np.array(offs, np.uint32)


def gather_kv(store, L, NB, nkv, bs, hd, layer, table, ntok, values=None):
    """K and V [ntok, kv_head, head_dim] (float64) of the first ntok tokens through `table`; the
    store's values are bf16 bits, or values(store, shape) (fp8_values; for f32 values themselves,
    `lambda x, shape: x.reshape(shape)`)."""
    shape = (L, NB, 2, nkv, bs, hd)
    S = values(store, shape) if values else bf2f(store).reshape(shape)
    t = np.arange(ntok)
    blk, sl = table[t // bs], t % bs
    K = S[layer, blk, 0][t, :, sl]  # [ntok, nkv, hd]
    V = S[layer, blk, 1][t, :, sl]
    return K.astype(np.float64), V.astype(np.float64)


def ref_attn(qrow, K, V, nh, nkv, scale, ntok):
    """Causal attention of one query row over the first ntok keys; query head h uses kv head h // (nh / nkv)."""
    G = nh // nkv
    out = np.zeros((nh, qrow.shape[1]))
    for h in range(nh):
        kh = h // G
        s = (K[:ntok, kh] @ qrow[h]) * scale
        p = np.exp(s - s.max()); p /= p.sum()
        out[h] = p @ V[:ntok, kh]
    return out


def ref_attn_fa(qrow, K, V, nh, nkv, scale, ntok):
    """What FlashAttention's numerics give in exact arithmetic: ref_attn with Q (scaled by
    scale·log2 e) and P each rounded to one bf16 term, the row sum taken over the unrounded P."""
    G = nh // nkv
    out = np.zeros((nh, qrow.shape[1]))
    for h in range(nh):
        kh = h // G
        qb = bf2f(f2bf(np.float32(qrow[h] * (scale * np.log2(np.e))))).astype(np.float64)
        s = K[:ntok, kh] @ qb
        p = np.exp2(s - s.max())
        out[h] = bf2f(f2bf(p.astype(np.float32))).astype(np.float64) @ V[:ntok, kh] / p.sum()
    return out
