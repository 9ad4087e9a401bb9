// sampling.cu — greedy and stochastic token selection over f32 logits.
//
// argmax_rows(logits, vocab, out_token, out_logprob)
//   Per row r: out_token[r] = index of the max logit (lowest index on ties),
//   out_logprob[r] = its log-softmax value = -log(sum_i exp(x_i - max)).
//   Launch: grid.x = rows, block = 1024 threads (any multiple of 32 up to
//   1024 works), no dynamic shared memory.
//
// sample_rows(logits, vocab, temperature, top_k, top_p, uniform, out_token)
//   Per row r. Launch: grid.x = rows, block = 1024 threads (any multiple of 32
//   up to 1024), no dynamic shared memory.
//   * temperature[r] <= 0: argmax (as above).
//   * otherwise p_i ∝ exp((x_i - max) / temperature[r]);
//     1. top_k[r] > 0 (and < vocab): keep the tokens whose logit is >= the
//        k-th largest logit;
//     2. top_p[r] < 1: of those, keep the tokens whose logit is >= the largest
//        threshold t such that the mass of kept tokens with logit >= t is
//        >= top_p[r] * (mass kept by step 1), i.e. the smallest set of
//        largest probabilities reaching top_p of the renormalised mass;
//     3. draw: the first token, in index order over kept tokens, at which the
//        cumulative kept mass exceeds uniform[r] * (total kept mass).
//        Always returns a kept token (the last kept one if rounding leaves
//        the draw past the end).
//   Thresholds are found exactly by bisection on the order-preserving 32-bit
//   key of the f32 logits (<= 32 block-wide count / mass passes each; no sort).
//   Ties: every token whose logit equals the threshold logit is kept, so the
//   kept set may exceed top_k (or the top-p minimum) by tokens tied exactly
//   at the cut-off. Deterministic for given inputs (fixed reduction order).
//
// Host guarantees: 1 <= vocab < 2^24; logits contain no NaN.

// Order-preserving map from f32 to u32 (larger float -> larger key).
__device__ __forceinline__ unsigned float_key(float f) {
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Calls f(index, value) for every element of the row this thread owns
// (block-strided; 16-byte loads when possible).
template <class F>
__device__ __forceinline__ void for_row(const float* row, int vocab, F&& f) {
    if ((vocab & 3) == 0 && (((unsigned long long)row) & 15ull) == 0) {
        const float4* r4 = reinterpret_cast<const float4*>(row);
        const unsigned n4 = (unsigned)vocab >> 2;
        for (unsigned i = threadIdx.x; i < n4; i += blockDim.x) {
            const float4 v = r4[i];
            f(4 * i + 0, v.x);
            f(4 * i + 1, v.y);
            f(4 * i + 2, v.z);
            f(4 * i + 3, v.w);
        }
    } else {
        for (unsigned i = threadIdx.x; i < (unsigned)vocab; i += blockDim.x) f(i, row[i]);
    }
}

__device__ __forceinline__ void argmax_merge(float& v, unsigned& i, float v2, unsigned i2) {
    if (v2 > v || (v2 == v && i2 < i)) {
        v = v2;
        i = i2;
    }
}

// Block-wide (value, index) argmax, lowest index on ties. Result in all threads.
__device__ __forceinline__ void block_argmax(float& v, unsigned& idx) {
    __shared__ float am_v[32];
    __shared__ unsigned am_i[32];
    const int lane = threadIdx.x & 31;
    const int wid = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_merge(v, idx, __shfl_xor_sync(FULL_MASK, v, o), __shfl_xor_sync(FULL_MASK, idx, o));
    __syncthreads();
    if (lane == 0) {
        am_v[wid] = v;
        am_i[wid] = idx;
    }
    __syncthreads();
    v = (lane < nwarps) ? am_v[lane] : NEG_INF;
    idx = (lane < nwarps) ? am_i[lane] : 0xffffffffu;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_merge(v, idx, __shfl_xor_sync(FULL_MASK, v, o), __shfl_xor_sync(FULL_MASK, idx, o));
}

__device__ __forceinline__ unsigned block_min_u(unsigned v) {
    __shared__ unsigned mn_scratch[32];
    const int lane = threadIdx.x & 31;
    const int wid = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(FULL_MASK, v, o));
    __syncthreads();
    if (lane == 0) mn_scratch[wid] = v;
    __syncthreads();
    v = (lane < nwarps) ? mn_scratch[lane] : 0xffffffffu;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ unsigned block_max_u(unsigned v) {
    __shared__ unsigned mx_scratch[32];
    const int lane = threadIdx.x & 31;
    const int wid = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(FULL_MASK, v, o));
    __syncthreads();
    if (lane == 0) mx_scratch[wid] = v;
    __syncthreads();
    v = (lane < nwarps) ? mx_scratch[lane] : 0u;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Exclusive prefix sum over the block in thread order; `total` gets the block
// total (bitwise identical in every thread).
__device__ __forceinline__ float block_exclusive_scan(float v, float& total) {
    __shared__ float scan_scratch[32];
    const int lane = threadIdx.x & 31;
    const int wid = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
    float incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float y = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += y;
    }
    float excl = __shfl_up_sync(FULL_MASK, incl, 1);
    if (lane == 0) excl = 0.0f;
    __syncthreads();
    if (lane == 31) scan_scratch[wid] = incl;
    __syncthreads();
    float before = 0.0f, all = 0.0f;
    for (int w = 0; w < nwarps; ++w) {
        const float s = scan_scratch[w];
        if (w < wid) before += s;
        all += s;
    }
    total = all;
    return before + excl;
}

// Row argmax (value, lowest index); result in all threads.
__device__ __forceinline__ void row_argmax(const float* row, int vocab, float& mval,
                                           unsigned& midx) {
    float v = NEG_INF;
    unsigned idx = 0xffffffffu;
    for_row(row, vocab, [&](unsigned i, float x) { argmax_merge(v, idx, x, i); });
    block_argmax(v, idx);
    if (idx >= (unsigned)vocab) idx = 0;  // only if every logit is NaN
    mval = v;
    midx = idx;
}

extern "C" __global__ void argmax_rows(const float* logits, int vocab, unsigned* out_token,
                                       float* out_logprob) {
    const unsigned r = blockIdx.x;
    const float* row = logits + (unsigned long long)r * (unsigned long long)vocab;
    float m;
    unsigned idx;
    row_argmax(row, vocab, m, idx);
    float s = 0.0f;
    if (m != NEG_INF) for_row(row, vocab, [&](unsigned, float x) { s += expf(x - m); });
    s = block_sum(s);
    if (threadIdx.x == 0) {
        out_token[r] = idx;
        // All logits -inf: treat as uniform.
        out_logprob[r] = (m != NEG_INF) ? -logf(s) : -logf((float)vocab);
    }
}

extern "C" __global__ void sample_rows(const float* logits, int vocab, const float* temperature,
                                       const int* top_k, const float* top_p, const float* uniform,
                                       unsigned* out_token) {
    const unsigned r = blockIdx.x;
    const float* row = logits + (unsigned long long)r * (unsigned long long)vocab;
    float m;
    unsigned midx;
    row_argmax(row, vocab, m, midx);
    const float temp = temperature[r];
    if (!(temp > 0.0f) || m == NEG_INF) {  // block-uniform
        if (threadIdx.x == 0) out_token[r] = midx;
        return;
    }
    const float inv_t = 1.0f / temp;
    const int k = top_k[r];
    const float tp = top_p[r];
    const unsigned key_max = float_key(m);

    // Number of tokens with key >= t.
    auto count_ge = [&](unsigned t) {
        float c = 0.0f;
        for_row(row, vocab, [&](unsigned, float x) { c += (float_key(x) >= t) ? 1.0f : 0.0f; });
        return block_sum(c);
    };
    // Unnormalised probability mass of tokens with key >= t.
    auto mass_ge = [&](unsigned t) {
        float s = 0.0f;
        for_row(row, vocab, [&](unsigned, float x) {
            if (float_key(x) >= t) s += expf((x - m) * inv_t);
        });
        return block_sum(s);
    };

    unsigned thr = 0u;  // keep tokens with key >= thr (0 keeps everything)

    // ---- top-k: largest thr with count(key >= thr) >= k ----
    if (k > 0 && k < vocab) {
        const float kf = (float)k;
        if (count_ge(key_max) >= kf) {
            thr = key_max;
        } else {
            unsigned lo = 0u, hi = key_max;  // count(lo) >= k > count(hi)
            while (hi - lo > 1u) {
                const unsigned mid = lo + ((hi - lo) >> 1);
                const float c = count_ge(mid);
                if (c >= kf) {
                    lo = mid;
                    if (c == kf) break;  // exactly the top k: nothing tighter keeps k
                } else {
                    hi = mid;
                }
            }
            thr = lo;
        }
    }

    // ---- top-p: largest t >= thr with mass(key >= t) >= tp * mass(key >= thr) ----
    if (tp < 1.0f) {
        const float target = tp * mass_ge(thr);
        if (mass_ge(key_max) >= target) {
            thr = key_max;
        } else {
            unsigned lo = thr, hi = key_max;  // mass(lo) >= target > mass(hi)
            while (hi - lo > 1u) {
                const unsigned mid = lo + ((hi - lo) >> 1);
                if (mass_ge(mid) >= target) lo = mid;
                else hi = mid;
            }
            thr = lo;
        }
    }

    // ---- draw: contiguous segment per thread so a block scan gives index order ----
    const unsigned nthreads = blockDim.x;
    const unsigned seg = ((unsigned)vocab + nthreads - 1u) / nthreads;
    const unsigned begin = min(threadIdx.x * seg, (unsigned)vocab);
    const unsigned end = min(begin + seg, (unsigned)vocab);
    float local = 0.0f;
    unsigned last_kept = 0u;
    bool any_kept = false;
    for (unsigned i = begin; i < end; ++i) {
        const float x = row[i];
        if (float_key(x) >= thr) {
            local += expf((x - m) * inv_t);
            last_kept = i;
            any_kept = true;
        }
    }
    float total;
    const float prefix = block_exclusive_scan(local, total);
    const float target = uniform[r] * total;
    unsigned found = 0xffffffffu;
    if (any_kept && prefix + local > target) {
        float c = prefix;
        for (unsigned i = begin; i < end; ++i) {
            const float x = row[i];
            if (float_key(x) >= thr) {
                c += expf((x - m) * inv_t);
                if (c > target) {
                    found = i;
                    break;
                }
            }
        }
    }
    found = block_min_u(found);
    // Rounding left the draw past the end: take the last kept token. The argmax
    // token is always kept, so some thread has any_kept.
    const unsigned last = block_max_u(any_kept ? last_kept : 0u);
    if (threadIdx.x == 0) out_token[r] = (found != 0xffffffffu) ? found : last;
}
