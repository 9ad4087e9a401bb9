"""Emulated test of kernels/sampling.cu's sample_rows against float64 numpy references: greedy
tokens (lowest id on ties), log-probabilities and the top-n list, draws only from the support
top-k / top-p / min-p / a grammar's mask leave, draw frequencies at the softmax's probabilities,
and penalties. (crates/duet-cuda/tests/sampling_emulated.rs checks the same kernel against the
CPU sampler bit for bit.)"""
from harness import *

rng = np.random.default_rng(4)
WORDS, OUT, MAX_TOP, NO_MASK = 16, 3 + 2 * 20, 20, 0xffffffff


def f2u(x):
    return int(np.float32(x).view(np.uint32))


def row(T=1.0, k=0, tp=1.0, mp=0.0, rep=1.0, pres=0.0, freq=0.0, n=0, seed=1, pos=0,
        pen=(0, 0), allowed=(0, NO_MASK)):
    return [f2u(T), k, f2u(tp), f2u(mp), f2u(rep), f2u(pres), f2u(freq), n,
            seed & 0xffffffff, seed >> 32, pos & 0xffffffff, pos >> 32, pen[0], pen[1],
            allowed[0], allowed[1]]


def run(x, rows, penalized=(0,), allowed=(0,)):
    x = np.ascontiguousarray(x, np.float32).copy()
    work = np.full_like(x, np.nan)
    params = np.array(rows, np.uint32).reshape(-1)
    out = np.full(len(rows) * OUT, 0xffffffff, np.uint32)
    launch('sampling', 'sample_rows', (len(rows),), 256, x, work, c_int(x.shape[1]), params,
           np.array(penalized, np.uint32), np.array(allowed, np.uint32), out)
    return x, out.reshape(len(rows), OUT)


def log_softmax(x):
    x = x.astype(np.float64)
    fin = x[np.isfinite(x)]
    m = fin.max()
    return x - (m + np.log(np.exp(fin - m).sum()))


# Greedy with ties, log-probabilities and the top-n list.
V = 3000
x = (rng.standard_normal((3, V)) * 4).astype(np.float32)
x[1, 17] = x[1, 2900] = x[1].max() + 1
x[2, :] = np.round(x[2, :])
_, out = run(x, [row(T=0.0, n=20), row(T=0.0, n=5), row(T=0.0, n=20)])
for r in range(3):
    lp = log_softmax(x[r])
    order = sorted(range(V), key=lambda i: (-x[r, i], i))
    n = out[r, 2]
    top = out[r, 3:3 + n]
    top_lp = out[r, 23:23 + n].view(np.float32)
    check(f'greedy row {r}: lowest id among the largest', out[r, 0] == order[0], f'{out[r, 0]} vs {order[0]}')
    check(f'greedy row {r}: logprob', abs(out[r, 1:2].view(np.float32)[0] - lp[order[0]]) < 2e-5)
    check(f'greedy row {r}: top-n ids', list(top) == order[:n], f'{list(top)[:5]} vs {order[:5]}')
    check_close(f'greedy row {r}: top-n logprobs', top_lp, lp[order[:n]], 2e-5)

# Support: top-k, top-p, min-p and a grammar's mask never let a token outside through.
V = 1000
x = (rng.standard_normal(V) * 3).astype(np.float32)
p = np.exp(x.astype(np.float64) - x.max()); p /= p.sum()
by_p = np.argsort(-p, kind='stable')
topk = set(by_p[:10].tolist())
cum = np.cumsum(p[by_p])
topp = set(by_p[:int(np.searchsorted(cum, 0.7)) + 1].tolist())
minp = set(np.nonzero(p >= 0.2 * p.max())[0].tolist())
allowed_ids = set(rng.choice(V, 40, replace=False).tolist())
bitmap = np.zeros((V + 31) // 32, np.uint32)
for t in allowed_ids:
    bitmap[t // 32] |= np.uint32(1 << (t % 32))
for name, kw, support in (('top-k 10', dict(k=10), topk), ('top-p 0.7', dict(tp=0.7), topp),
                          ('min-p 0.2', dict(mp=0.2), minp),
                          ('grammar mask', dict(allowed=(0, len(bitmap))), allowed_ids)):
    rows = [row(pos=i, seed=3, **kw) for i in range(32)]
    _, out = run(np.tile(x, (32, 1)), rows, allowed=bitmap)
    drawn = set(out[:, 0].tolist())
    check(f'{name}: draws stay in the support', drawn <= support, f'{sorted(drawn - support)[:5]}')
    check(f'{name}: draws spread over it', len(drawn) > 1)

# Frequencies: 1200 draws (positions) of a small vocabulary at the softmax's probabilities.
V, N = 8, 1200
x = np.array([1.0, 3.0, 2.0, 3.0, -1.0, 0.5, -3.0, 0.0], np.float32)
_, out = run(np.tile(x, (N, 1)), [row(T=0.7, seed=99, pos=i) for i in range(N)])
counts = np.bincount(out[:, 0], minlength=V)
p = np.exp(x.astype(np.float64) / 0.7); p /= p.sum()
sd = np.sqrt(N * p * (1 - p))
check('draw frequencies within 4.5 sd of the softmax', np.all(np.abs(counts - N * p) <= 4.5 * sd + 1),
      f'{counts} vs {np.round(N * p)}')

# Penalties, once per distinct token: repetition, presence + frequency x count.
V = 64
x = (rng.standard_normal((1, V)) * 2).astype(np.float32)
pen = [(3, 0), (5, 2), (9, 1), (70, 1)]  # the last is past the vocabulary
left, _ = run(x, [row(T=0.0, rep=1.5, pres=0.25, freq=0.5, pen=(0, len(pen)))],
              penalized=[v for tc in pen for v in tc])
ref = x[0].astype(np.float64).copy()
for t, c in pen[:3]:
    ref[t] = ref[t] / 1.5 if ref[t] > 0 else ref[t] * 1.5
    if c:
        ref[t] -= 0.25 + 0.5 * c
check_close('penalties', left[0], ref, 1e-6)
finish()
