"""Emulated test of kernels/quant_matvec.cu against numpy's reading of the GGUF formats (Q4_0,
Q4_1, Q8_0, Q4_K, Q6_K, written here from GGML's layouts): quant_to_bf16 and quant_embed_rows
bit for bit (each value dequantized in f32 as GGML does, then rounded to bf16 or kept), and
quant_matvec against float64 on the same packed bytes, ragged rows and columns.
The Rust test crates/duet-cuda/tests/it/quant_emulated.rs checks the same kernels against duet's
own CPU dequantization."""
from harness import *

# type: (ggml id, values per block, bytes per block)
FORMATS = {'q4_0': (32, 18), 'q4_1': (32, 20), 'q8_0': (32, 34), 'q4_k': (256, 144), 'q6_k': (256, 210)}
rng = np.random.default_rng(7)


def f16(x):
    return np.asarray(x, np.float16).view(np.uint8).reshape(-1, 2)


def random_blocks(t, count):
    """`count` blocks of type t: random quants, positive scales of a realistic size."""
    bl, bb = FORMATS[t]
    b = rng.integers(0, 256, (count, bb), dtype=np.uint8)
    small = lambda: f16(rng.uniform(0.001, 0.02, count))
    if t in ('q4_0', 'q8_0'):
        b[:, 0:2] = small()
    elif t == 'q4_1':
        b[:, 0:2] = small()
        b[:, 2:4] = f16(rng.uniform(-0.1, 0.1, count))
    elif t == 'q4_k':
        b[:, 0:2] = f16(rng.uniform(1e-4, 1e-3, count))
        b[:, 2:4] = f16(rng.uniform(1e-4, 1e-3, count))
    elif t == 'q6_k':
        b[:, 208:210] = small()
    return b


def h(b, at):
    return b[:, at:at + 2].copy().view(np.float16).astype(np.float32)  # [count, 1]


def dequant(t, b):
    """f32 values [count, block length] of blocks b, each product rounded in f32."""
    if t == 'q4_0':
        q = b[:, 2:18]
        v = np.concatenate([(q & 15).astype(np.int32) - 8, (q >> 4).astype(np.int32) - 8], 1)
        return v.astype(np.float32) * h(b, 0)
    if t == 'q4_1':
        q = b[:, 4:20]
        v = np.concatenate([q & 15, q >> 4], 1).astype(np.float32)
        return v * h(b, 0) + h(b, 2)
    if t == 'q8_0':
        return b[:, 2:34].view(np.int8).astype(np.float32) * h(b, 0)
    if t == 'q4_k':
        d, dmin, s, qs = h(b, 0), h(b, 2), b[:, 4:16].astype(np.int32), b[:, 16:144]
        out = np.empty((len(b), 256), np.float32)
        for j in range(8):
            if j < 4:
                sc, mn = s[:, j] & 63, s[:, j + 4] & 63
            else:
                sc = (s[:, j + 4] & 15) | ((s[:, j - 4] >> 6) << 4)
                mn = (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)
            q = qs[:, 32 * (j // 2):32 * (j // 2) + 32]
            q = (q & 15) if j % 2 == 0 else (q >> 4)
            dj = d * sc[:, None].astype(np.float32)
            mj = dmin * mn[:, None].astype(np.float32)
            out[:, 32 * j:32 * j + 32] = dj * q.astype(np.float32) - mj
        return out
    if t == 'q6_k':
        ql, qh, sc, d = b[:, 0:128].astype(np.int32), b[:, 128:192].astype(np.int32), b[:, 192:208].view(np.int8), h(b, 208)
        out = np.empty((len(b), 256), np.float32)
        for n in range(2):
            for l in range(32):
                lo, hi, hb = ql[:, 64 * n + l], ql[:, 64 * n + l + 32], qh[:, 32 * n + l]
                qv = [(lo & 15) | ((hb & 3) << 4), (hi & 15) | (((hb >> 2) & 3) << 4),
                      (lo >> 4) | (((hb >> 4) & 3) << 4), (hi >> 4) | (((hb >> 6) & 3) << 4)]
                for p in range(4):
                    s = sc[:, 8 * n + l // 16 + 2 * p].astype(np.float32)
                    out[:, 128 * n + 32 * p + l] = (d[:, 0] * s) * (qv[p] - 32).astype(np.float32)
        return out
    raise ValueError(t)


for t, (bl, bb) in FORMATS.items():
    for n, k in ((13, bl * 7), (6, bl * 34 if bl == 32 else bl * 5)):  # fewer and more units than lanes
        blocks = random_blocks(t, n * k // bl)
        w = np.ascontiguousarray(blocks.reshape(n, -1))
        values = dequant(t, blocks).reshape(n, k)

        bf = np.full((n, k), 0xffff, np.uint16)
        launch('quant_matvec', f'quant_to_bf16_{t}', (5,), 64, w, bf, c_int(n), c_int(k))
        check_close(f'quant_to_bf16_{t} {n}x{k}', bf, f2bf(values), 0)

        toks = rng.integers(0, n, 9).astype(np.uint32)
        emb = np.full((len(toks), k), np.nan, np.float32)
        launch('quant_matvec', f'quant_embed_rows_{t}', (len(toks),), 128, w, toks, emb, c_int(k))
        check_close(f'quant_embed_rows_{t} {n}x{k}', emb, values[toks], 0)

        for rows in (1, 3, 8, 11):
            x = rng.standard_normal((rows, k)).astype(np.float32)
            out = np.full((rows, n), np.nan, np.float32)
            grid = ((n + 3) // 4, (rows + 7) // 8)
            launch('quant_matvec', f'quant_matvec_{t}', grid, 128, w, x, out, c_int(rows), c_int(n), c_int(k))
            ref = x.astype(np.float64) @ values.astype(np.float64).T
            rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
            check(f'quant_matvec_{t} rows={rows} {n}x{k}', np.isfinite(out).all() and rel < 1e-6, f'rel={rel:.1e}')
finish()
