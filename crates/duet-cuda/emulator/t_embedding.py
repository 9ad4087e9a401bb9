"""Emulated test of kernels/embedding.cu: embed_rows gathers bf16 table rows into f32 (exact)."""
from harness import *

rng = np.random.default_rng(0)
for hidden in (72, 68, 256):  # 72, 68: not a multiple of 8 bf16 (no 16-byte path for the tail)
    V, n = 50, 7
    table = f2bf(rng.standard_normal((V, hidden)).astype(np.float32))
    toks = rng.integers(0, V, n).astype(np.uint32)
    out = np.full((n, hidden), np.nan, np.float32)
    launch('embedding', 'embed_rows', (n,), 64, table, toks, out, c_int(hidden))
    check_close(f'embed_rows hidden={hidden}', out, bf2f(table)[toks], 0)
finish()
