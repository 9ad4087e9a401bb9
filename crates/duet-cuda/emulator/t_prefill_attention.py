"""Emulated test of kernels/prefill_attention.cu: causal prefill over a paged KV store vs a float64
reference. Covers ragged sequence lengths (tiles of 64 query rows, 16 a warp), cached prefixes (start_pos > 0),
GQA, head_dim 32/64/96/128/256, block sizes 8/16, and rows outside every sequence (must stay poisoned)."""
from harness import *
from attn_ref import gather_kv, make_store, make_tables, ref_attn

rng = np.random.default_rng(1)
POISON = -7.0
BLOCK_M = 64  # PREFILL_BLOCK_M


def test_prefill(nh, nkv, hd, bs, seqs, layer=0, L=1):
    """seqs: list of (start_pos, len): len new tokens after start_pos cached ones."""
    NB, tables, block_tables, table_offsets = make_tables(rng, [(sp + ln + bs - 1) // bs for sp, ln in seqs], 2)
    store = make_store(rng, L, NB, nkv, bs, hd)
    rows = sum(ln for _, ln in seqs) + 2  # 2 leading rows belong to no sequence
    starts, r = [], 2
    for _, ln in seqs:
        starts.append(r); r += ln
    q = rng.standard_normal((rows, nh * hd)).astype(np.float32)
    out = np.full((rows, nh * hd), POISON, np.float32)
    scale = 1.0 / np.sqrt(hd)
    seq_row_start = np.array(starts, np.uint32)
    seq_len = np.array([ln for _, ln in seqs], np.uint32)
    seq_start_pos = np.array([sp for sp, _ in seqs], np.uint32)
    maxlen = max(ln for _, ln in seqs)
    kernel = 'prefill_attention_hd' + str(64 if hd <= 64 else 128 if hd <= 128 else 256)
    launch('prefill_attention', kernel, ((maxlen + BLOCK_M - 1) // BLOCK_M, nh, len(seqs)), 128,
           q, store, seq_row_start, seq_len, seq_start_pos, block_tables, table_offsets, c_int(layer), c_int(NB),
           c_int(nh), c_int(nkv), c_int(bs), c_int(hd), c_float(scale), out)
    err = 0.0
    for si, (sp, ln) in enumerate(seqs):
        K, V = gather_kv(store, L, NB, nkv, bs, hd, layer, tables[si], sp + ln)
        for j in range(ln):
            r = starts[si] + j
            ref = ref_attn(q[r].reshape(nh, hd).astype(np.float64), K, V, nh, nkv, scale, sp + j + 1)
            err = max(err, float(np.max(np.abs(out[r].reshape(nh, hd) - ref))))
    untouched = bool(np.all(out[:2] == POISON))
    check(f'prefill nh={nh} nkv={nkv} hd={hd} bs={bs} seqs={seqs}', err < 2e-5 and untouched,
          f'maxerr={err:.2e} foreign_rows_untouched={untouched}')


test_prefill(2, 1, 64, 16, [(0, 40), (10, 5), (0, 1)])
test_prefill(4, 2, 128, 16, [(33, 70), (0, 33)])
test_prefill(2, 2, 256, 16, [(5, 50)])
test_prefill(2, 1, 96, 8, [(0, 20), (100, 3)])
test_prefill(1, 1, 32, 16, [(3, 35)])
finish()
