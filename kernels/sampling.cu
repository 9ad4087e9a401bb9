// sampling.cu — one row of logits to one token, bit for bit as duet's CPU sampler
// (crates/duet-engine/src/sampling_steps.rs, whose module doc defines every step; the
// comments here name them). Compiled with --fmad=false: every product and sum is rounded on
// its own, as on the host, and exp/ln are our own (sp_exp, sp_ln), not libdevice's.
//
// sample_rows(logits, work, vocab, params, penalized, allowed, out)
//   Launch: grid.x = rows, block = SP_THREADS (256) threads exactly (the canonical sum's lanes),
//   no dynamic shared memory. Row r reads and modifies logits[r*vocab ..] (masked and penalised
//   in place, as the CPU leaves them) and uses work[r*vocab ..] as scratch.
//   params[r*SP_WORDS + ...] (32-bit words; f32 as bits):
//     SP_TEMPERATURE, SP_TOP_K, SP_TOP_P, SP_MIN_P, SP_REPETITION, SP_PRESENCE, SP_FREQUENCY,
//     SP_LOGPROBS (top-n, <= SP_MAX_TOP), SP_SEED_LO/HI, SP_POSITION_LO/HI,
//     SP_PENALIZED_AT / SP_PENALIZED_LEN (pairs (token, times generated) at penalized[2*at ..]),
//     SP_ALLOWED_AT / SP_ALLOWED_WORDS (the grammar's bitmap at allowed[at ..];
//     SP_UNCONSTRAINED words: no grammar).
//   out[r*SO_WORDS + ...]: SO_TOKEN, SO_LOGPROB (f32 bits), SO_TOP_LEN, then SP_MAX_TOP token ids
//   at SO_TOP_IDS and their log-probabilities at SO_TOP_LOGPROBS (f32 bits).

#define SP_THREADS 256
#define SP_WORDS 16
#define SP_TEMPERATURE 0
#define SP_TOP_K 1
#define SP_TOP_P 2
#define SP_MIN_P 3
#define SP_REPETITION 4
#define SP_PRESENCE 5
#define SP_FREQUENCY 6
#define SP_LOGPROBS 7
#define SP_SEED_LO 8
#define SP_SEED_HI 9
#define SP_POSITION_LO 10
#define SP_POSITION_HI 11
#define SP_PENALIZED_AT 12
#define SP_PENALIZED_LEN 13
#define SP_ALLOWED_AT 14
#define SP_ALLOWED_WORDS 15
#define SP_UNCONSTRAINED 0xffffffffu
#define SP_MAX_TOP 20
#define SO_TOKEN 0
#define SO_LOGPROB 1
#define SO_TOP_LEN 2
#define SO_TOP_IDS 3
#define SO_TOP_LOGPROBS (SO_TOP_IDS + SP_MAX_TOP)
#define SO_WORDS (SO_TOP_LOGPROBS + SP_MAX_TOP)

// ---- exp, ln, Philox, the uniform and the exponential (sampling_steps.rs's twins) ----

#define SP_LN2_HI __uint_as_float(0x3f317200u)
#define SP_LN2_LO __uint_as_float(0x35bfbe8eu)
#define SP_LOG2_E __uint_as_float(0x3fb8aa3bu)
#define SP_SQRT_2 __uint_as_float(0x3fb504f3u)
#define SP_INF __int_as_float(0x7f800000)

__device__ __forceinline__ float sp_exp(float x) {
    if (x != x || x < -87.0f) return 0.0f;
    if (x > 88.0f) return SP_INF;
    const float n = rintf(x * SP_LOG2_E);
    const float r = (x - n * SP_LN2_HI) - n * SP_LN2_LO;
    float q = 1.0f / 5040.0f;
    q = q * r + 1.0f / 720.0f;
    q = q * r + 1.0f / 120.0f;
    q = q * r + 1.0f / 24.0f;
    q = q * r + 1.0f / 6.0f;
    q = q * r + 0.5f;
    q = q * r + 1.0f;
    q = q * r + 1.0f;
    return q * __uint_as_float(((unsigned)((int)n + 127)) << 23);
}

__device__ __forceinline__ float sp_ln(float x) {
    if (x != x || x == SP_INF) return x;
    if (x <= 0.0f) return NEG_INF;
    unsigned bits = __float_as_uint(x);
    int e = 0;
    if (bits < 0x00800000u) {
        bits = __float_as_uint(x * 16777216.0f);
        e = -24;
    }
    e += (int)(bits >> 23) - 127;
    float m = __uint_as_float((bits & 0x007fffffu) | 0x3f800000u);
    if (m > SP_SQRT_2) {
        m *= 0.5f;
        e += 1;
    }
    const float f = m - 1.0f;
    const float s = f / (2.0f + f);
    const float z = s * s;
    float q = 1.0f / 11.0f;
    q = q * z + 1.0f / 9.0f;
    q = q * z + 1.0f / 7.0f;
    q = q * z + 1.0f / 5.0f;
    q = q * z + 1.0f / 3.0f;
    q = q * z + 1.0f;
    const float ef = (float)e;
    return ef * SP_LN2_HI + (ef * SP_LN2_LO + 2.0f * s * q);
}

// The first word of Philox4x32-10 with counter (c0, c1, c2, 0) and key (k0, k1).
__device__ __forceinline__ unsigned sp_philox_word0(unsigned c0, unsigned c1, unsigned c2,
                                                    unsigned k0, unsigned k1) {
    unsigned c3 = 0u;
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    return c0;
}

__device__ __forceinline__ float sp_exponential(float u) {
    if (u < 1.0f / 256.0f) return u * (1.0f + u * (0.5f + u * (1.0f / 3.0f)));
    return 0.0f - sp_ln(1.0f - u);
}

// ---- keys and block reductions (256 threads, every thread calls, every thread gets the result) --

__device__ __forceinline__ unsigned sp_total_key(float f) {
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ unsigned long long sp_rank_key(float v, unsigned id) {
    return ((unsigned long long)sp_total_key(v) << 32) | (unsigned long long)(~id);
}

// The canonical sum: `lane` is this thread's sum over its ids in order; the lanes are added
// pairwise, lane[i] += lane[i + s] for s = 128 .. 1.
__device__ float sp_lane_tree(float lane) {
    __shared__ float lanes[SP_THREADS];
    __syncthreads();  // a previous reduction may still be reading
    lanes[threadIdx.x] = lane;
    __syncthreads();
    for (int s = SP_THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) lanes[threadIdx.x] += lanes[threadIdx.x + s];
        __syncthreads();
    }
    return lanes[0];
}

__device__ unsigned sp_count(unsigned c) {
    __shared__ unsigned counts[SP_THREADS];
    __syncthreads();
    counts[threadIdx.x] = c;
    __syncthreads();
    for (int s = SP_THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) counts[threadIdx.x] += counts[threadIdx.x + s];
        __syncthreads();
    }
    return counts[0];
}

__device__ unsigned long long sp_max_u64(unsigned long long v) {
    __shared__ unsigned long long keys[SP_THREADS];
    __syncthreads();
    keys[threadIdx.x] = v;
    __syncthreads();
    for (int s = SP_THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s && keys[threadIdx.x + s] > keys[threadIdx.x])
            keys[threadIdx.x] = keys[threadIdx.x + s];
        __syncthreads();
    }
    return keys[0];
}

// fmaxf over the block (NaNs ignored, -inf when every value is NaN).
__device__ float sp_max_f32(float v) {
    __shared__ float values[SP_THREADS];
    __syncthreads();
    values[threadIdx.x] = v;
    __syncthreads();
    for (int s = SP_THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s)
            values[threadIdx.x] = fmaxf(values[threadIdx.x], values[threadIdx.x + s]);
        __syncthreads();
    }
    return values[0];
}

// (value, id) with the largest value, the lowest id among equals; NaNs and "none"
// (id = 0xffffffff) never win. Returns the id (0xffffffff: none).
__device__ unsigned sp_argmax(float v, unsigned id) {
    __shared__ float values[SP_THREADS];
    __shared__ unsigned ids[SP_THREADS];
    __syncthreads();
    values[threadIdx.x] = v;
    ids[threadIdx.x] = id;
    __syncthreads();
    for (int s = SP_THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) {
            const float v2 = values[threadIdx.x + s];
            const unsigned i2 = ids[threadIdx.x + s];
            const float v1 = values[threadIdx.x];
            const unsigned i1 = ids[threadIdx.x];
            if (i2 != 0xffffffffu &&
                (i1 == 0xffffffffu || v2 > v1 || (v2 == v1 && i2 < i1))) {
                values[threadIdx.x] = v2;
                ids[threadIdx.x] = i2;
            }
        }
        __syncthreads();
    }
    return ids[0];
}

// A thread's best (value, id) so far: `x` at `i` replaces it when larger (NaN never).
__device__ __forceinline__ void sp_consider(float& v, unsigned& id, float x, unsigned i) {
    if (x == x && (id == 0xffffffffu || x > v)) {
        v = x;
        id = i;
    }
}

extern "C" __global__ void __launch_bounds__(SP_THREADS) sample_rows(float* logits, float* work, int vocab, const unsigned* params, const unsigned* penalized, const unsigned* allowed, unsigned* out) {
    const unsigned r = blockIdx.x;
    const unsigned tid = threadIdx.x;
    const unsigned V = (unsigned)vocab;
    float* l = logits + (unsigned long long)r * V;
    float* w = work + (unsigned long long)r * V;
    const unsigned* p = params + (unsigned long long)r * SP_WORDS;
    unsigned* o = out + (unsigned long long)r * SO_WORDS;

    // Step 1: the grammar's mask.
    const unsigned words = p[SP_ALLOWED_WORDS];
    if (words != SP_UNCONSTRAINED) {
        const unsigned* a = allowed + p[SP_ALLOWED_AT];
        for (unsigned i = tid; i < V; i += SP_THREADS) {
            const unsigned word = (i >> 5) < words ? a[i >> 5] : 0u;
            if (((word >> (i & 31u)) & 1u) == 0u) l[i] = NEG_INF;
        }
    }
    __syncthreads();

    // Step 2: penalties, one thread per distinct token.
    const float rep = __uint_as_float(p[SP_REPETITION]);
    const float presence = __uint_as_float(p[SP_PRESENCE]);
    const float frequency = __uint_as_float(p[SP_FREQUENCY]);
    const bool repetition = rep != 1.0f;
    const bool additive = presence != 0.0f || frequency != 0.0f;
    if (repetition || additive) {
        const unsigned* pen = penalized + 2ull * p[SP_PENALIZED_AT];
        for (unsigned j = tid; j < p[SP_PENALIZED_LEN]; j += SP_THREADS) {
            const unsigned t = pen[2 * j];
            const unsigned count = pen[2 * j + 1];
            if (t >= V) continue;
            float x = l[t];
            if (repetition) x = x > 0.0f ? x / rep : x * rep;
            if (additive && count > 0u) x -= presence + frequency * (float)count;
            l[t] = x;
        }
    }
    __syncthreads();

    // Step 4's argmax (also the fallback of a draw with no score).
    unsigned greedy;
    {
        float v = 0.0f;
        unsigned id = 0xffffffffu;
        for (unsigned i = tid; i < V; i += SP_THREADS) sp_consider(v, id, l[i], i);
        greedy = sp_argmax(v, id);
        if (greedy == 0xffffffffu || l[0] != l[0]) greedy = 0;
    }

    unsigned token = greedy;
    const float temperature = __uint_as_float(p[SP_TEMPERATURE]);
    if (temperature != 0.0f) {
        // Step 5: s = l / T; top-k as a rank-key threshold (kept: rank key >= K).
        const float inv_t = 1.0f / temperature;
        const unsigned k = p[SP_TOP_K];
        unsigned long long cut = 0ull;  // the k-th largest rank key; 0 keeps every token
        if (k > 0u && k < V) {
            // The largest value key T with at least k tokens at or above it, bit by bit.
            unsigned t_key = 0u;
            for (int bit = 31; bit >= 0; --bit) {
                const unsigned cand = t_key | (1u << bit);
                unsigned c = 0u;
                for (unsigned i = tid; i < V; i += SP_THREADS)
                    c += sp_total_key(l[i] * inv_t) >= cand ? 1u : 0u;
                if (sp_count(c) >= k) t_key = cand;
            }
            unsigned at_or_above = 0u, above = 0u;
            for (unsigned i = tid; i < V; i += SP_THREADS) {
                const unsigned key = sp_total_key(l[i] * inv_t);
                at_or_above += key >= t_key ? 1u : 0u;
                above += key > t_key ? 1u : 0u;
            }
            cut = (unsigned long long)t_key << 32;  // every token at T kept
            if (sp_count(at_or_above) > k) {
                // Of the tokens tied at T, the lowest ids fill the k: the last one kept is the
                // largest id b with fewer than `need` ties below it.
                const unsigned need = k - sp_count(above);
                unsigned last = 0u;
                for (int bit = 31; bit >= 0; --bit) {
                    const unsigned cand = last | (1u << bit);
                    if (cand > V) continue;  // uniform: every thread skips alike
                    unsigned c = 0u;
                    for (unsigned i = tid; i < cand; i += SP_THREADS)
                        c += sp_total_key(l[i] * inv_t) == t_key ? 1u : 0u;
                    if (sp_count(c) < need) last = cand;
                }
                cut |= (unsigned long long)(~last);
            }
        }
        float m = NEG_INF;
        for (unsigned i = tid; i < V; i += SP_THREADS) {
            const float s = l[i] * inv_t;
            if (sp_rank_key(s, i) >= cut) m = fmaxf(m, s);
        }
        m = sp_max_f32(m);
        // e over the kept tokens, min-p; w = e (kept) or -1 (not kept).
        const float min_p = __uint_as_float(p[SP_MIN_P]);
        for (unsigned i = tid; i < V; i += SP_THREADS) {
            const float s = l[i] * inv_t;
            float e = -1.0f;
            if (sp_rank_key(s, i) >= cut) {
                e = sp_exp(s - m);
                if (min_p > 0.0f && !(e >= min_p)) e = -1.0f;
            }
            w[i] = e;
        }
        __syncthreads();
        // Top-p: the largest theta whose mass of w >= theta reaches top_p of the whole.
        float theta = 0.0f;
        const float top_p = __uint_as_float(p[SP_TOP_P]);
        if (top_p < 1.0f) {
            float lane = 0.0f;
            for (unsigned i = tid; i < V; i += SP_THREADS)
                if (w[i] >= 0.0f) lane += w[i];
            const float target = top_p * sp_lane_tree(lane);
            unsigned lo = 0u, hi = 0x3f800000u;
            while (lo < hi) {
                const unsigned mid = lo + (hi - lo + 1u) / 2u;
                const float th = __uint_as_float(mid);
                float part = 0.0f;
                for (unsigned i = tid; i < V; i += SP_THREADS)
                    if (w[i] >= th) part += w[i];
                if (sp_lane_tree(part) >= target) lo = mid;
                else hi = mid - 1u;
            }
            theta = __uint_as_float(lo);
        }
        // Step 6: the exponential race over the kept tokens.
        const unsigned seed_lo = p[SP_SEED_LO], seed_hi = p[SP_SEED_HI];
        const unsigned pos_lo = p[SP_POSITION_LO], pos_hi = p[SP_POSITION_HI];
        float best = 0.0f;
        unsigned best_id = 0xffffffffu;
        for (unsigned i = tid; i < V; i += SP_THREADS) {
            const float e = w[i];
            if (e >= theta && e >= 0.0f) {
                const unsigned x = sp_philox_word0(i, pos_lo, pos_hi, seed_lo, seed_hi);
                const float u = ((float)x + 0.5f) * (1.0f / 4294967296.0f);
                sp_consider(best, best_id, e / sp_exponential(u), i);
            }
        }
        const unsigned won = sp_argmax(best, best_id);
        if (won != 0xffffffffu) token = won;
    }

    // Step 3: log-probabilities of the penalised logits.
    const unsigned n = p[SP_LOGPROBS] < SP_MAX_TOP ? p[SP_LOGPROBS] : SP_MAX_TOP;
    float lse = 0.0f;
    unsigned listed = 0u;
    if (n > 0u) {
        float m = NEG_INF;
        for (unsigned i = tid; i < V; i += SP_THREADS) m = fmaxf(m, l[i]);
        m = sp_max_f32(m);
        float lane = 0.0f;
        for (unsigned i = tid; i < V; i += SP_THREADS) lane += sp_exp(l[i] - m);
        lse = m + sp_ln(sp_lane_tree(lane));
        // The n largest rank keys, masked tokens (-inf) left out, each round below the last.
        unsigned long long below = ~0ull;
        for (unsigned j = 0; j < n; ++j) {
            unsigned long long best = 0ull;
            for (unsigned i = tid; i < V; i += SP_THREADS) {
                const float x = l[i];
                if (x == NEG_INF) continue;
                const unsigned long long key = sp_rank_key(x, i);
                if (key < below && key > best) best = key;
            }
            best = sp_max_u64(best);
            if (best == 0ull) break;
            below = best;
            const unsigned id = ~(unsigned)(best & 0xffffffffull);
            if (tid == 0) {
                o[SO_TOP_IDS + j] = id;
                o[SO_TOP_LOGPROBS + j] = __float_as_uint(l[id] - lse);
            }
            ++listed;
        }
    }
    if (tid == 0) {
        o[SO_TOKEN] = token;
        o[SO_LOGPROB] = __float_as_uint(l[token] - lse);
        o[SO_TOP_LEN] = listed;
    }
}
