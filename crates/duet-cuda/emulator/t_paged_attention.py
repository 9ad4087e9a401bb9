"""Emulated test of kernels/paged_attention.cu: paged_attention_partial + paged_attention_reduce (decode)
vs a float64 reference. Covers ragged context lengths, several 512-token partitions (and exactly 512/513),
GQA groups (incl. G > PA_MAX_G), head_dim 32/64/96/128/256, block sizes 8/16/32, rows not listed in
row_ids (their output must stay poisoned) and empty partitions (max -inf, sum 0, zero output)."""
from harness import *
from attn_ref import gather_kv, make_store, make_tables, ref_attn

rng = np.random.default_rng(1)
POISON = -7.0


def test_decode(nh, nkv, hd, bs, ctxs, layer=1, L=2):
    nseq = len(ctxs)
    NB, tables, block_tables, table_offsets = make_tables(rng, [(c + bs - 1) // bs for c in ctxs], 3)
    store = make_store(rng, L, NB, nkv, bs, hd)
    # One row per sequence plus an extra row (seq 0, earlier position) that is not listed in row_ids.
    rows = nseq + 1
    row_seq = np.array(list(range(nseq)) + [0], np.uint32)
    positions = np.array([c - 1 for c in ctxs] + [0], np.uint32)
    row_ids = np.array(list(range(nseq))[::-1], np.uint32)  # listed rows, reversed
    q = rng.standard_normal((rows, nh * hd)).astype(np.float32)
    scale = 1.0 / np.sqrt(hd)
    maxp = max((c + 511) // 512 for c in ctxs) + 1  # one more partition than any row needs
    nl = len(row_ids)
    po = np.full(nl * nh * maxp * hd, np.nan, np.float32)
    pm = np.full(nl * nh * maxp, np.nan, np.float32)
    ps = pm.copy()
    launch('paged_attention', 'paged_attention_partial', (nl, nkv, maxp), 128, q, store, row_ids, row_seq, positions,
           block_tables, table_offsets, c_int(layer), c_int(NB), c_int(nh), c_int(nkv), c_int(bs), c_int(hd),
           c_float(scale), c_int(maxp), po, pm, ps)
    out = np.full((rows, nh * hd), POISON, np.float32)
    launch('paged_attention', 'paged_attention_reduce', (nl, nh), ((hd + 31) // 32) * 32, po, pm, ps, row_ids,
           positions, c_int(nh), c_int(hd), c_int(maxp), out, c_void_p(0))
    # With the bf16 copy: the same f32 output, and the copy its rounding.
    out2 = np.full((rows, nh * hd), POISON, np.float32)
    out_bf = np.full((rows, nh * hd), 0x7fa5, np.uint16)
    launch('paged_attention', 'paged_attention_reduce', (nl, nh), ((hd + 31) // 32) * 32, po, pm, ps, row_ids,
           positions, c_int(nh), c_int(hd), c_int(maxp), out2, out_bf)
    listed = np.sort(row_ids)
    bf_ok = np.array_equal(out2, out) and np.array_equal(out_bf[listed], f2bf(out[listed]))
    err, empty_ok = 0.0, True
    for i, r in enumerate(row_ids):
        ntok = positions[r] + 1
        K, V = gather_kv(store, L, NB, nkv, bs, hd, layer, tables[row_seq[r]], ntok)
        ref = ref_attn(q[r].reshape(nh, hd).astype(np.float64), K, V, nh, nkv, scale, ntok)
        err = max(err, float(np.max(np.abs(out[r].reshape(nh, hd) - ref))))
        used = (ntok + 511) // 512
        empty_ok &= bool(np.all(np.isneginf(pm.reshape(nl, nh, maxp)[i][:, used:]))
                         and np.all(ps.reshape(nl, nh, maxp)[i][:, used:] == 0)
                         and np.all(po.reshape(nl, nh, maxp, hd)[i][:, used:] == 0))
    untouched = bool(np.all(out[rows - 1] == POISON))
    check(f'decode nh={nh} nkv={nkv} hd={hd} bs={bs} ctxs={ctxs}', err < 2e-5 and untouched and empty_ok and bf_ok,
          f'maxerr={err:.2e} unlisted_row_untouched={untouched} empty_partitions_ok={empty_ok} bf16_copy_ok={bf_ok}')


test_decode(4, 2, 64, 16, [1, 37, 600])
test_decode(8, 1, 128, 16, [1100, 5])
test_decode(2, 2, 128, 32, [513, 512])
test_decode(20, 2, 64, 8, [70])      # G = 10 > PA_MAX_G
test_decode(2, 1, 96, 16, [45])      # head dim padded to a multiple of 32
test_decode(2, 1, 256, 16, [300])
test_decode(1, 1, 32, 16, [40])
finish()
