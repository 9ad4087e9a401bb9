// paged_attention.cu — decode attention over the paged KV store, split over
// the context in partitions of PARTITION_TOKENS tokens (FlashDecoding / vLLM
// v2 style). All math in f32; K/V are read as bf16 with 16-byte loads (E4M3 with 8-byte loads
// from an FP8 cache, converted in registers).
//
// paged_attention_partial(q, store, row_ids, row_seq, positions, block_tables,
//     table_offsets, layer, num_blocks, num_heads, num_kv_heads, block_size,
//     head_dim, scale, max_partitions, part_out, part_max, part_sum)
//   Launch: grid = (num_listed_rows, num_kv_heads, max_partitions),
//           block = PA_THREADS (128) threads exactly,
//           static shared memory 32 KB, no dynamic shared memory.
//   Block (i, kvh, p) handles row r = row_ids[i], kv head kvh and all query
//   heads of its GQA group (qh = kvh*G .. kvh*G+G-1, G = num_heads/num_kv_heads,
//   processed PA_MAX_G at a time, so K/V are read once per group when G <= 8),
//   over context tokens [p*512, min((p+1)*512, positions[r]+1)).
//   Writes, for each of those heads qh, with o = (i*num_heads + qh)*max_partitions + p:
//     part_max[o] = max_t s_t, part_sum[o] = sum_t exp(s_t - max),
//     part_out[o*head_dim + d] = sum_t exp(s_t - max) * v_t[d]   (unnormalised)
//   where s_t = scale * dot(q[r*num_heads*head_dim + qh*head_dim + :], k_t).
//   Empty partitions write part_max = -inf, part_sum = 0, part_out = 0.
//
// paged_attention_partial_fp8(..., part_out, part_max, part_sum, k_scale, v_scale)
//   The same over an FP8 cache: k_t = k_scale · (stored E4M3), v_t = v_scale · (stored E4M3); the
//   scales multiply the logits' scale and part_out, not each value.
//
// paged_attention_reduce(part_out, part_max, part_sum, row_ids, positions,
//     num_heads, head_dim, max_partitions, out, out_bf16)
//   Launch: grid = (num_listed_rows, num_heads), block = head_dim threads
//   (rounding up is fine: extra threads idle), no shared memory.
//   Combines the ceil((positions[r]+1)/512) partitions of row r = row_ids[i]
//   with the log-sum-exp rescale and writes
//   out[r*num_heads*head_dim + qh*head_dim + d], and the same rounded to bf16 into out_bf16
//   unless it is null (the output projection's operand, which then needs no cast).
//
// Host guarantees: head_dim % 8 == 0 and head_dim <= 256 (64 and 128 are the
// main cases; 96, 160, ... also work); num_heads % num_kv_heads == 0;
// max_partitions >= ceil((positions[r]+1)/512) for every listed row; the
// store is 16-byte aligned; q is 16-byte aligned; positions[r] < 2^31 - 512;
// every block table entry a row needs is valid.

#define PARTITION_TOKENS 512
#define PA_THREADS 128
#define PA_WARPS (PA_THREADS / 32)
#define PA_MAX_G 8
#define PA_MAX_HEAD_DIM 256
#define PA_UNROLL 4

// Pointer to the 8-element chunk `sub` of token t's K (kv = 0) or V (kv = 1).
template <class KV>
__device__ __forceinline__ const typename KV::Chunk8* pa_kv_chunk(const typename KV::Elem* store,
                                                    const unsigned* table,
                                                    unsigned long long layer_base, int t,
                                                    int block_size, int kv,
                                                    unsigned long long nkv, int kvh,
                                                    int head_dim, int sub) {
    const unsigned blk = table[(unsigned)t / (unsigned)block_size];
    const unsigned slot = (unsigned)t % (unsigned)block_size;
    const unsigned long long off =
        ((((layer_base + blk) * 2ull + (unsigned long long)kv) * nkv + (unsigned long long)kvh) *
             (unsigned long long)block_size +
         slot) *
            (unsigned long long)head_dim +
        (unsigned long long)(sub * 8);
    return reinterpret_cast<const typename KV::Chunk8*>(store + off);
}

template <class KV>
__device__ __forceinline__ void pa_partial(
    const float* q, const typename KV::Elem* store, const unsigned* row_ids,
    const unsigned* row_seq, const unsigned* positions, const unsigned* block_tables,
    const unsigned* table_offsets, int layer, int num_blocks, int num_heads, int num_kv_heads,
    int block_size, int head_dim, float scale, int max_partitions, float* part_out,
    float* part_max, float* part_sum, float k_scale, float v_scale) {
    typedef typename KV::Chunk8 Chunk8;
    // Phases 1-3: logits / probabilities [PA_MAX_G][PARTITION_TOKENS].
    // Phase 4: cross-warp reduction buffer [PA_WARPS][PA_MAX_G][head_dim].
    __shared__ float smem[PA_WARPS * PA_MAX_G * PA_MAX_HEAD_DIM];

    const int kvh = blockIdx.y;
    const int p = blockIdx.z;
    if (kvh >= num_kv_heads || p >= max_partitions) return;  // uniform per block
    const unsigned i = blockIdx.x;
    const unsigned r = row_ids[i];
    const unsigned seq = row_seq[r];
    const int ctx = (int)positions[r] + 1;
    const int t0 = p * PARTITION_TOKENS;
    const int t1 = min(t0 + PARTITION_TOKENS, ctx);
    const int G = num_heads / num_kv_heads;
    const int qh0 = kvh * G;
    const unsigned long long maxp = (unsigned long long)max_partitions;
    const unsigned long long hd = (unsigned long long)head_dim;
    const unsigned long long head_base = (unsigned long long)i * num_heads + qh0;
    const int tid = threadIdx.x;

    if (t0 >= t1) {
        // Partition beyond this row's context.
        for (int idx = tid; idx < G * head_dim; idx += PA_THREADS) {
            const int g = idx / head_dim;
            const int d = idx - g * head_dim;
            part_out[((head_base + g) * maxp + p) * hd + d] = 0.0f;
        }
        for (int g = tid; g < G; g += PA_THREADS) {
            part_max[(head_base + g) * maxp + p] = NEG_INF;
            part_sum[(head_base + g) * maxp + p] = 0.0f;
        }
        return;
    }

    const int n = t1 - t0;
    const int nchunks = head_dim >> 3;  // 16-byte chunks per head vector (<= 32)
    int tpt = 1;                        // threads per token: power of two >= nchunks
    while (tpt < nchunks) tpt <<= 1;
    const int tpb = PA_THREADS / tpt;  // tokens per block step
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int sub = tid & (tpt - 1);  // chunk of the head vector this thread holds
    const int tok = tid / tpt;        // token within a block step
    const bool active = sub < nchunks;
    const unsigned* table = block_tables + table_offsets[seq];
    const unsigned long long layer_base = (unsigned long long)layer * (unsigned long long)num_blocks;
    const unsigned long long nkv = (unsigned long long)num_kv_heads;
    const float* qrow = q + (unsigned long long)r * (unsigned long long)num_heads * hd;
    float* logits = smem;
    const float logit_scale = scale * k_scale;

    for (int hg = 0; hg < G; hg += PA_MAX_G) {
        const int ng = min(PA_MAX_G, G - hg);  // heads in this pass (block-uniform)

        // ---- Phase 1: scores s_t = scale * q.k_t into logits ----
        {
            float qv[PA_MAX_G][8];
#pragma unroll
            for (int g = 0; g < PA_MAX_G; ++g) {
                float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
                if (g < ng && active) {
                    const float4* q4 = reinterpret_cast<const float4*>(
                        qrow + (unsigned long long)(qh0 + hg + g) * hd + sub * 8);
                    a = q4[0];
                    b = q4[1];
                }
                qv[g][0] = a.x; qv[g][1] = a.y; qv[g][2] = a.z; qv[g][3] = a.w;
                qv[g][4] = b.x; qv[g][5] = b.y; qv[g][6] = b.z; qv[g][7] = b.w;
            }
            for (int base = t0; base < t1; base += tpb * PA_UNROLL) {
                Chunk8 kr[PA_UNROLL];
#pragma unroll
                for (int u = 0; u < PA_UNROLL; ++u) {
                    const int t = base + u * tpb + tok;
                    kr[u] = KV::zero8();
                    if (active && t < t1)
                        kr[u] = *pa_kv_chunk<KV>(store, table, layer_base, t, block_size, 0, nkv,
                                                 kvh, head_dim, sub);
                }
#pragma unroll
                for (int u = 0; u < PA_UNROLL; ++u) {
                    const int t = base + u * tpb + tok;
                    float kf[8];
                    KV::to_f32x8(kr[u], kf);
#pragma unroll
                    for (int g = 0; g < PA_MAX_G; ++g) {
                        if (g < ng) {  // uniform: every lane takes part in the shuffles
                            float dot = 0.0f;
#pragma unroll
                            for (int e = 0; e < 8; ++e) dot = fmaf(qv[g][e], kf[e], dot);
                            for (int o = tpt >> 1; o > 0; o >>= 1)
                                dot += __shfl_xor_sync(FULL_MASK, dot, o);
                            if (sub == 0 && t < t1) logits[g * PARTITION_TOKENS + (t - t0)] = dot * logit_scale;
                        }
                    }
                }
            }
        }
        __syncthreads();

        // ---- Phase 2: per-head max and exp-sum (one warp per head) ----
        for (int g = warp; g < ng; g += PA_WARPS) {
            float* lg = logits + g * PARTITION_TOKENS;
            float m = NEG_INF;
            for (int j = lane; j < n; j += 32) m = fmaxf(m, lg[j]);
            m = warp_max(m);
            float s = 0.0f;
            for (int j = lane; j < n; j += 32) {
                const float e = expf(lg[j] - m);
                lg[j] = e;
                s += e;
            }
            s = warp_sum(s);
            if (lane == 0) {
                const unsigned long long o = (head_base + hg + g) * maxp + p;
                part_max[o] = m;
                part_sum[o] = s;
            }
        }
        __syncthreads();

        // ---- Phase 3: acc[g][:] = sum_t p_t * v_t over this thread's tokens ----
        float acc[PA_MAX_G][8];
#pragma unroll
        for (int g = 0; g < PA_MAX_G; ++g)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[g][e] = 0.0f;
        for (int base = t0; base < t1; base += tpb * PA_UNROLL) {
            Chunk8 vr[PA_UNROLL];
#pragma unroll
            for (int u = 0; u < PA_UNROLL; ++u) {
                const int t = base + u * tpb + tok;
                vr[u] = KV::zero8();
                if (active && t < t1)
                    vr[u] = *pa_kv_chunk<KV>(store, table, layer_base, t, block_size, 1, nkv, kvh,
                                             head_dim, sub);
            }
#pragma unroll
            for (int u = 0; u < PA_UNROLL; ++u) {
                const int t = base + u * tpb + tok;
                if (t < t1) {
                    float vf[8];
                    KV::to_f32x8(vr[u], vf);
#pragma unroll
                    for (int g = 0; g < PA_MAX_G; ++g) {
                        if (g < ng) {
                            const float pg = logits[g * PARTITION_TOKENS + (t - t0)];
#pragma unroll
                            for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(pg, vf[e], acc[g][e]);
                        }
                    }
                }
            }
        }
        // Sum over the tokens a warp held side by side (lanes with equal `sub`).
#pragma unroll
        for (int g = 0; g < PA_MAX_G; ++g) {
            if (g < ng) {
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    for (int o = tpt; o < 32; o <<= 1)
                        acc[g][e] += __shfl_xor_sync(FULL_MASK, acc[g][e], o);
            }
        }
        __syncthreads();  // logits are no longer read: reuse smem

        // ---- Phase 4: cross-warp sum and store ----
        float* red = smem;
        if (lane < tpt && active) {
#pragma unroll
            for (int g = 0; g < PA_MAX_G; ++g) {
                if (g < ng) {
#pragma unroll
                    for (int e = 0; e < 8; ++e)
                        red[(warp * PA_MAX_G + g) * head_dim + sub * 8 + e] = acc[g][e];
                }
            }
        }
        __syncthreads();
        for (int idx = tid; idx < ng * head_dim; idx += PA_THREADS) {
            const int g = idx / head_dim;
            const int d = idx - g * head_dim;
            float s = 0.0f;
#pragma unroll
            for (int w = 0; w < PA_WARPS; ++w) s += red[(w * PA_MAX_G + g) * head_dim + d];
            part_out[((head_base + hg + g) * maxp + p) * hd + d] = s * v_scale;
        }
        __syncthreads();  // before the next head group reuses smem
    }
}

extern "C" __global__ void __launch_bounds__(PA_THREADS) paged_attention_partial(
    const float* q, const bf16* store, const unsigned* row_ids, const unsigned* row_seq,
    const unsigned* positions, const unsigned* block_tables, const unsigned* table_offsets,
    int layer, int num_blocks, int num_heads, int num_kv_heads, int block_size, int head_dim,
    float scale, int max_partitions, float* part_out, float* part_max, float* part_sum) {
    pa_partial<KvBf16>(q, store, row_ids, row_seq, positions, block_tables, table_offsets, layer,
                       num_blocks, num_heads, num_kv_heads, block_size, head_dim, scale,
                       max_partitions, part_out, part_max, part_sum, 1.0f, 1.0f);
}

extern "C" __global__ void __launch_bounds__(PA_THREADS) paged_attention_partial_fp8(
    const float* q, const unsigned char* store, const unsigned* row_ids, const unsigned* row_seq,
    const unsigned* positions, const unsigned* block_tables, const unsigned* table_offsets,
    int layer, int num_blocks, int num_heads, int num_kv_heads, int block_size, int head_dim,
    float scale, int max_partitions, float* part_out, float* part_max, float* part_sum,
    float k_scale, float v_scale) {
    pa_partial<KvE4m3>(q, store, row_ids, row_seq, positions, block_tables, table_offsets, layer,
                       num_blocks, num_heads, num_kv_heads, block_size, head_dim, scale,
                       max_partitions, part_out, part_max, part_sum, k_scale, v_scale);
}

extern "C" __global__ void paged_attention_reduce(const float* part_out, const float* part_max,
                                                  const float* part_sum, const unsigned* row_ids,
                                                  const unsigned* positions, int num_heads,
                                                  int head_dim, int max_partitions, float* out,
                                                  bf16* out_bf16) {
    const int d = threadIdx.x;
    const int qh = blockIdx.y;
    if (d >= head_dim || qh >= num_heads) return;
    const unsigned i = blockIdx.x;
    const unsigned r = row_ids[i];
    const unsigned long long ctx = (unsigned long long)positions[r] + 1ull;
    int np = (int)((ctx + PARTITION_TOKENS - 1) / PARTITION_TOKENS);
    if (np > max_partitions) np = max_partitions;
    const unsigned long long base =
        ((unsigned long long)i * (unsigned long long)num_heads + (unsigned long long)qh) *
        (unsigned long long)max_partitions;
    float m = NEG_INF;
    for (int p = 0; p < np; ++p) m = fmaxf(m, part_max[base + p]);
    float total = 0.0f, acc = 0.0f;
    for (int p = 0; p < np; ++p) {
        const float w = expf(part_max[base + p] - m);
        total = fmaf(part_sum[base + p], w, total);
        acc = fmaf(part_out[(base + p) * (unsigned long long)head_dim + d], w, acc);
    }
    const unsigned long long o =
        ((unsigned long long)r * (unsigned long long)num_heads + (unsigned long long)qh) *
            (unsigned long long)head_dim +
        d;
    out[o] = acc / total;
    if (out_bf16) out_bf16[o] = f32_to_bf16(out[o]);
}
