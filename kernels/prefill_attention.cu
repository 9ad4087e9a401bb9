// prefill_attention.cu — causal prefill attention over the paged KV store on the tensor cores,
// tiled in the FlashAttention-2 manner: a block of 4 warps takes PREFILL_BLOCK_M query rows of
// one head (16 rows a warp), streams the K/V of the sequence (cached prefix + the new tokens, all
// already in the store) through shared memory in tiles of BN keys, and keeps an online softmax in
// f32. Both products (Q·Kᵀ and P·V) are bf16 mma.sync m16n8k16 with f32 accumulation.
//
// Near-f32 accuracy from bf16 tensor cores: K and V are bf16 already (exact operands); Q and P
// (f32) are each split into two bf16 terms (hi + lo carry 16 bits of the mantissa), each term its
// own mma into the same accumulator. Against a float64 reference on random data the error is
// under 1e-5 (the emulated test) and 2e-6 relative (`duet bench gpu` on an H100), where one bf16
// term would give ~1e-3.
//
// prefill_attention_hd{64,128,256}(q, store, seq_row_start, seq_len, seq_start_pos,
//     block_tables, table_offsets, layer, num_blocks, num_heads, num_kv_heads,
//     block_size, head_dim, scale, out)
//   The entry point is the smallest of 64, 128, 256 that holds head_dim.
//   Sequence s has seq_len[s] query rows starting at row seq_row_start[s];
//   query j of s sits at position seq_start_pos[s] + j and attends to
//   positions 0 ..= seq_start_pos[s] + j, read through s's block table
//   (block = table[t / block_size], slot = t % block_size).
//   q and out are f32 [rows][num_heads*head_dim]; query head qh reads kv head
//   qh / (num_heads / num_kv_heads).
//   Launch: grid = (ceil(max_s seq_len[s] / PREFILL_BLOCK_M), num_heads, num_seqs),
//           block = PF_THREADS (128) threads exactly, static shared memory only.
//   Block (x, qh, s) handles the query tile mt = gridDim.x - 1 - x (the longest first):
//   queries [mt*PREFILL_BLOCK_M, (mt+1)*PREFILL_BLOCK_M)
//   of sequence s (exits if that start is >= seq_len[s]); key tiles past the
//   causal limit of the block's last query are not loaded, and a warp skips the
//   tiles past its own last query.
//
// prefill_attention_fp8_hd{64,128,256}(..., scale, out, k_scale, v_scale)
//   The same over an FP8 cache (K = k_scale · stored E4M3, V = v_scale · stored E4M3): the E4M3
//   values, exact in bf16, are converted as they are staged; K's scale multiplies Q's, V's the
//   output. The same launch.
//
// Fragments (PTX ISA, mma.m16n8k16, lane = 4g + t): A a0 = (row g, k 2t..2t+1),
// a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..); B b0 = (k 2t..2t+1, col g),
// b1 = (k 2t+8.., col g); C c0,c1 = (row g, cols 2t, 2t+1), c2,c3 = (row g+8, ...).
// The Q·Kᵀ accumulator of two neighbouring 8-key tiles is exactly the A fragment of
// P for one 16-key step of P·V, so P never leaves registers. K sits in shared
// memory as [key][dim] and V transposed as [dim][key], rows padded by 16 bytes so
// that a warp's 32-bit fragment loads hit 32 different banks.
// head_dim is padded to HDP in {64, 128, 256} (padding dims are zero).
//
// Host guarantees: head_dim % 8 == 0, 8 <= head_dim <= 256;
// num_heads % num_kv_heads == 0; q/out/store 16-byte aligned; all block table
// entries the sequence needs are valid.

#define PREFILL_BLOCK_M 64
#define PF_THREADS 128
#define PF_ROWS_PER_WARP 16
#define PF_LOG2E 1.4426950408889634f

template <int HDP>
struct PrefillTile {
    static constexpr int BN = HDP >= 256 ? 32 : 64;  // keys per tile
    static constexpr int KS = HDP + 8;               // K row stride in bf16 (padded)
    static constexpr int VS = BN + 8;                // Vᵀ row stride in bf16 (padded)
    static constexpr int SMEM = BN * KS + HDP * VS;
};

// Splits x into `terms` bf16 values whose sum is x to the precision the terms carry.
template <int TERMS>
__device__ __forceinline__ void split_bf16(float x, bf16* out) {
#pragma unroll
    for (int i = 0; i < TERMS; ++i) {
        out[i] = f32_to_bf16(x);
        x -= bf16_to_f32(out[i]);
    }
}

// Packs the split terms of two neighbouring values (a first) into one 32-bit register per term.
template <int TERMS>
__device__ __forceinline__ void split_pair(float a, float b, unsigned* regs, int stride) {
    bf16 ta[TERMS], tb[TERMS];
    split_bf16<TERMS>(a, ta);
    split_bf16<TERMS>(b, tb);
#pragma unroll
    for (int i = 0; i < TERMS; ++i) regs[i * stride] = (unsigned)ta[i] | ((unsigned)tb[i] << 16);
}

template <int HDP, class KV>
__device__ __forceinline__ void prefill_tile(const float* q, const typename KV::Elem* store,
                                             const unsigned* table, int layer, int num_blocks,
                                             int num_heads, int num_kv_heads, int block_size,
                                             int head_dim, float scale, float k_scale,
                                             float v_scale, float* out, bf16* smem,
                                             unsigned row_start, int len, int start_pos, int m0,
                                             int qh) {
    typedef PrefillTile<HDP> T;
    constexpr int BN = T::BN;
    constexpr int KSTEPS = HDP / 16;  // k steps of Q·Kᵀ
    constexpr int NT = BN / 8;        // 8-key tiles of S
    constexpr int DT = HDP / 8;       // 8-dim tiles of O
    constexpr int CPK = HDP / 8;      // 16-byte chunks per key row (padded)
    constexpr int QTERMS = 2;
    constexpr int PTERMS = 2;
    bf16* ks = smem;               // [BN][KS]
    bf16* vt = smem + BN * T::KS;  // [HDP][VS]

    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int kvh = qh / (num_heads / num_kv_heads);
    const unsigned long long hd = (unsigned long long)head_dim;
    const unsigned long long row_stride = (unsigned long long)num_heads * hd;
    const unsigned long long layer_base = (unsigned long long)layer * (unsigned long long)num_blocks;
    const unsigned long long nkv = (unsigned long long)num_kv_heads;
    const unsigned long long bs = (unsigned long long)block_size;
    const int hchunks = head_dim >> 3;  // real 16-byte chunks per key row

    const int block_end = min(m0 + PREFILL_BLOCK_M, len);  // exclusive
    const int kv_end = start_pos + block_end;               // keys [0, kv_end) are needed
    const int w0 = m0 + warp * PF_ROWS_PER_WARP;            // this warp's first query
    const bool warp_live = w0 < len;
    // Keys past this are masked for every row of the warp.
    const int warp_last_pos = start_pos + min(w0 + PF_ROWS_PER_WARP, len) - 1;
    int qpos[2];
    bool row_ok[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int mi = w0 + g + 8 * h;
        row_ok[h] = mi < len;
        qpos[h] = row_ok[h] ? start_pos + mi : kv_end - 1;
    }

    // ---- Q fragments (pre-scaled to log2 units), QTERMS bf16 terms each ----
    unsigned qf[QTERMS][KSTEPS][4];
    {
        const float qscale = scale * k_scale * PF_LOG2E;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int h = r & 1;              // a0/a2: row g, a1/a3: row g+8
                const int d = kk * 16 + 2 * t4 + 8 * (r >> 1);
                float a = 0.0f, b = 0.0f;
                if (row_ok[h] && d < head_dim) {
                    const float* qrow = q + (unsigned long long)(row_start + w0 + g + 8 * h) * row_stride +
                                        (unsigned long long)qh * hd;
                    a = qrow[d] * qscale;
                    b = qrow[d + 1] * qscale;
                }
                split_pair<QTERMS>(a, b, &qf[0][kk][r], KSTEPS * 4);
            }
        }
    }

    float o[DT][4];
#pragma unroll
    for (int i = 0; i < DT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m_run[2] = {NEG_INF, NEG_INF};
    float l_run[2] = {0.0f, 0.0f};  // this lane's columns only; summed over the quad at the end

    for (int n0 = 0; n0 < kv_end; n0 += BN) {
        __syncthreads();  // previous tile fully consumed
        // ---- Stage K as [key][dim] and V as [dim][key]; keys past kv_end are zeros ----
        for (int c = tid; c < BN * CPK; c += PF_THREADS) {
            // K: consecutive threads take consecutive chunks of one key (coalesced loads).
            // V: consecutive threads take consecutive keys of one chunk (conflict-free Vᵀ stores).
#pragma unroll
            for (int which = 0; which < 2; ++which) {
                const int n = which == 0 ? c / CPK : c % BN;
                const int ch = which == 0 ? c % CPK : c / BN;
                const int tk = n0 + n;
                uint4 raw = make_uint4(0u, 0u, 0u, 0u);
                if (tk < kv_end && ch < hchunks) {
                    const unsigned blk = table[(unsigned)tk / (unsigned)block_size];
                    const unsigned slot = (unsigned)tk % (unsigned)block_size;
                    const unsigned long long idx =
                        ((((layer_base + blk) * 2ull + (unsigned long long)which) * nkv +
                          (unsigned long long)kvh) * bs + slot) * hd +
                        (unsigned long long)(ch * 8);
                    raw = KV::to_bf16x8(*reinterpret_cast<const typename KV::Chunk8*>(store + idx));
                }
                if (which == 0) {
                    *reinterpret_cast<uint4*>(ks + n * T::KS + ch * 8) = raw;
                } else {
                    const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        vt[(ch * 8 + 2 * i) * T::VS + n] = (bf16)(w[i] & 0xffffu);
                        vt[(ch * 8 + 2 * i + 1) * T::VS + n] = (bf16)(w[i] >> 16);
                    }
                }
            }
        }
        __syncthreads();
        if (!warp_live || n0 > warp_last_pos) continue;  // uniform per warp

        // ---- S = Q·Kᵀ for the warp's 16 rows and the BN keys ----
        float s[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const bf16* kp = ks + (nt * 8 + g) * T::KS + kk * 16 + 2 * t4;
                const unsigned b[2] = {*reinterpret_cast<const unsigned*>(kp),
                                       *reinterpret_cast<const unsigned*>(kp + 8)};
#pragma unroll
                for (int term = 0; term < QTERMS; ++term) mma_bf16_16816(s[nt], qf[term][kk], b);
            }
        }

        // ---- Causal mask and online softmax, rows g (h = 0) and g + 8 (h = 1) ----
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float m_tile = NEG_INF;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int key = n0 + nt * 8 + 2 * t4 + c;
                    float v = s[nt][2 * h + c];
                    v = key <= qpos[h] ? v : NEG_INF;  // also masks the padding keys
                    s[nt][2 * h + c] = v;
                    m_tile = fmaxf(m_tile, v);
                }
            }
            m_tile = fmaxf(m_tile, __shfl_xor_sync(FULL_MASK, m_tile, 1));
            m_tile = fmaxf(m_tile, __shfl_xor_sync(FULL_MASK, m_tile, 2));
            // Finite: key 0 is in the first tile, and every row sees it.
            const float m_new = fmaxf(m_run[h], m_tile);
            alpha[h] = exp2f(m_run[h] - m_new);
            float psum = 0.0f;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const float p = exp2f(s[nt][2 * h + c] - m_new);
                    s[nt][2 * h + c] = p;
                    psum += p;
                }
            }
            l_run[h] = l_run[h] * alpha[h] + psum;
            m_run[h] = m_new;
        }
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            o[dt][0] *= alpha[0];
            o[dt][1] *= alpha[0];
            o[dt][2] *= alpha[1];
            o[dt][3] *= alpha[1];
        }

        // ---- O += P·V, P straight from the S accumulators ----
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            unsigned pf[PTERMS][4];
            split_pair<PTERMS>(s[2 * kk][0], s[2 * kk][1], &pf[0][0], 4);
            split_pair<PTERMS>(s[2 * kk][2], s[2 * kk][3], &pf[0][1], 4);
            split_pair<PTERMS>(s[2 * kk + 1][0], s[2 * kk + 1][1], &pf[0][2], 4);
            split_pair<PTERMS>(s[2 * kk + 1][2], s[2 * kk + 1][3], &pf[0][3], 4);
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                const bf16* vp = vt + (dt * 8 + g) * T::VS + kk * 16 + 2 * t4;
                const unsigned b[2] = {*reinterpret_cast<const unsigned*>(vp),
                                       *reinterpret_cast<const unsigned*>(vp + 8)};
#pragma unroll
                for (int term = 0; term < PTERMS; ++term) mma_bf16_16816(o[dt], pf[term], b);
            }
        }
    }
    if (!warp_live) return;

    // ---- Normalise and store ----
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float l = l_run[h];
        l += __shfl_xor_sync(FULL_MASK, l, 1);
        l += __shfl_xor_sync(FULL_MASK, l, 2);
        if (!row_ok[h]) continue;
        const float inv = v_scale / l;
        float* orow = out + (unsigned long long)(row_start + w0 + g + 8 * h) * row_stride +
                      (unsigned long long)qh * hd;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            const int d = dt * 8 + 2 * t4;
            if (d < head_dim)
                *reinterpret_cast<float2*>(orow + d) =
                    make_float2(o[dt][2 * h] * inv, o[dt][2 * h + 1] * inv);
        }
    }
}

// The block's sequence, head and query tile, then the tile itself.
template <int HDP, class KV>
__device__ __forceinline__ void prefill_block(const float* q, const typename KV::Elem* store,
                                              const unsigned* seq_row_start, const unsigned* seq_len,
                                              const unsigned* seq_start_pos,
                                              const unsigned* block_tables,
                                              const unsigned* table_offsets, int layer,
                                              int num_blocks, int num_heads, int num_kv_heads,
                                              int block_size, int head_dim, float scale,
                                              float* out, float k_scale, float v_scale) {
    __shared__ __align__(16) bf16 smem[PrefillTile<HDP>::SMEM];
    const int qh = blockIdx.y;
    const unsigned s = blockIdx.z;
    // The last query tiles, which see the most keys, are started first, so that the grid does not
    // end on a few long blocks.
    const int m0 = (gridDim.x - 1 - blockIdx.x) * PREFILL_BLOCK_M;
    const int len = (int)seq_len[s];
    if (qh >= num_heads || m0 >= len) return;  // uniform per block
    prefill_tile<HDP, KV>(q, store, block_tables + table_offsets[s], layer, num_blocks, num_heads,
                          num_kv_heads, block_size, head_dim, scale, k_scale, v_scale, out, smem,
                          seq_row_start[s], len, (int)seq_start_pos[s], m0, qh);
}

// One entry point per padded head size and cache type, so that each gets the registers it needs
// (the 256 one would otherwise set the register count, and the occupancy, of the others).
extern "C" __global__ void __launch_bounds__(PF_THREADS) prefill_attention_hd64(
    const float* q, const bf16* store, const unsigned* seq_row_start, const unsigned* seq_len,
    const unsigned* seq_start_pos, const unsigned* block_tables, const unsigned* table_offsets,
    int layer, int num_blocks, int num_heads, int num_kv_heads, int block_size, int head_dim,
    float scale, float* out) {
    prefill_block<64, KvBf16>(q, store, seq_row_start, seq_len, seq_start_pos, block_tables,
                              table_offsets, layer, num_blocks, num_heads, num_kv_heads,
                              block_size, head_dim, scale, out, 1.0f, 1.0f);
}

extern "C" __global__ void __launch_bounds__(PF_THREADS) prefill_attention_hd128(
    const float* q, const bf16* store, const unsigned* seq_row_start, const unsigned* seq_len,
    const unsigned* seq_start_pos, const unsigned* block_tables, const unsigned* table_offsets,
    int layer, int num_blocks, int num_heads, int num_kv_heads, int block_size, int head_dim,
    float scale, float* out) {
    prefill_block<128, KvBf16>(q, store, seq_row_start, seq_len, seq_start_pos, block_tables,
                              table_offsets, layer, num_blocks, num_heads, num_kv_heads,
                              block_size, head_dim, scale, out, 1.0f, 1.0f);
}

extern "C" __global__ void __launch_bounds__(PF_THREADS) prefill_attention_hd256(
    const float* q, const bf16* store, const unsigned* seq_row_start, const unsigned* seq_len,
    const unsigned* seq_start_pos, const unsigned* block_tables, const unsigned* table_offsets,
    int layer, int num_blocks, int num_heads, int num_kv_heads, int block_size, int head_dim,
    float scale, float* out) {
    prefill_block<256, KvBf16>(q, store, seq_row_start, seq_len, seq_start_pos, block_tables,
                              table_offsets, layer, num_blocks, num_heads, num_kv_heads,
                              block_size, head_dim, scale, out, 1.0f, 1.0f);
}

extern "C" __global__ void __launch_bounds__(PF_THREADS) prefill_attention_fp8_hd64(
    const float* q, const unsigned char* store, const unsigned* seq_row_start,
    const unsigned* seq_len, const unsigned* seq_start_pos, const unsigned* block_tables,
    const unsigned* table_offsets, int layer, int num_blocks, int num_heads, int num_kv_heads,
    int block_size, int head_dim, float scale, float* out, float k_scale, float v_scale) {
    prefill_block<64, KvE4m3>(q, store, seq_row_start, seq_len, seq_start_pos, block_tables,
                              table_offsets, layer, num_blocks, num_heads, num_kv_heads,
                              block_size, head_dim, scale, out, k_scale, v_scale);
}

extern "C" __global__ void __launch_bounds__(PF_THREADS) prefill_attention_fp8_hd128(
    const float* q, const unsigned char* store, const unsigned* seq_row_start,
    const unsigned* seq_len, const unsigned* seq_start_pos, const unsigned* block_tables,
    const unsigned* table_offsets, int layer, int num_blocks, int num_heads, int num_kv_heads,
    int block_size, int head_dim, float scale, float* out, float k_scale, float v_scale) {
    prefill_block<128, KvE4m3>(q, store, seq_row_start, seq_len, seq_start_pos, block_tables,
                              table_offsets, layer, num_blocks, num_heads, num_kv_heads,
                              block_size, head_dim, scale, out, k_scale, v_scale);
}

extern "C" __global__ void __launch_bounds__(PF_THREADS) prefill_attention_fp8_hd256(
    const float* q, const unsigned char* store, const unsigned* seq_row_start,
    const unsigned* seq_len, const unsigned* seq_start_pos, const unsigned* block_tables,
    const unsigned* table_offsets, int layer, int num_blocks, int num_heads, int num_kv_heads,
    int block_size, int head_dim, float scale, float* out, float k_scale, float v_scale) {
    prefill_block<256, KvE4m3>(q, store, seq_row_start, seq_len, seq_start_pos, block_tables,
                              table_offsets, layer, num_blocks, num_heads, num_kv_heads,
                              block_size, head_dim, scale, out, k_scale, v_scale);
}
