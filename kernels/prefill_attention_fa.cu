// prefill_attention_fa.cu — causal prefill attention over the paged KV store with FlashAttention's
// numerics, tiled to feed the tensor cores as FlashAttention-2 does (`--prefill-attention fa`; the
// older kernel, prefill_attention.cu, is `legacy`).
//
// Numerics (as every serving engine's attention): Q (pre-scaled by scale·log2 e) and P are each
// ONE bf16 term, K and V are bf16 as stored, both products accumulate in f32 (mma.sync m16n8k16),
// and the softmax statistics (running max, running sum of the f32 weights) stay in f32.
// Against a float64 reference that is ‖Δ‖/‖ref‖ ≈ 1e-3 (the emulated test's bound is 2e-3).
// An FP8 cache's E4M3 values are exact in bf16: its tiles are converted on their way into shared
// memory (plain loads, not cp.async, which cannot convert), K's scale multiplies Q's, V's the
// output.
//
// Tiles: a block of 4 warps takes BM = 64·WM query rows of one (sequence, head); warp w owns the
// m16 row tiles i·64 + 16w (i < WM), so each K/V fragment it loads feeds WM products. K/V tiles of
// BN keys stream through shared memory in two stages: cp.async (16 bytes a thread, straight from
// the paged store through the block table, zero-filled past the block's last key and past
// head_dim) fills stage (j+1)&1 while the warps compute on stage j&1, one __syncthreads a tile.
// Q is converted to bf16 into shared memory once; the warps read Q and K with ldmatrix.x4 and V
// with ldmatrix.x4.trans (V stays [key][dim] as stored: the transposing load makes the B operand
// of P·V). S's accumulator of two neighbouring 8-key tiles is exactly P's A fragment for one
// 16-key step of P·V, so P never leaves registers. Shared-memory rows are padded by 16 bytes, so
// the 8 rows of an ldmatrix matrix fall in 8 different bank groups.
//
// Causal blocks: only the key tiles up to the block's last query are loaded; a warp skips the
// tiles past its own last query; the mask is computed only on tiles that cross a row's causal
// limit (the diagonal and the tail). Blocks of the last query tiles, which see the most keys,
// are started first, every head at once (blockIdx.x is the head, so the heads of one GQA group
// run side by side and share their K/V through L2).
//
// prefill_attention_fa_hd{64,128,256}(q, store, seq_row_start, seq_len, seq_start_pos,
//     block_tables, table_offsets, layer, num_blocks, num_heads, num_kv_heads,
//     block_size, head_dim, scale, out)
//   The arguments, layouts and guarantees of prefill_attention.cu's kernels; the entry point is
//   the smallest of 64, 128, 256 that holds head_dim (padding dims are zero).
//   Launch: grid = (num_heads, ceil(max_s seq_len[s] / FA_BLOCK_M_HD<n>), num_seqs),
//           block = FA_THREADS (128) threads exactly,
//           dynamic shared memory FA_SMEM_HD<n> bytes (over 48 KiB: the host raises the limit).
//   Block (qh, y, s) handles the queries [m0, m0 + BM) of sequence s, m0 = (gridDim.y - 1 - y)·BM
//   (exits if m0 >= seq_len[s]).
// prefill_attention_fa_fp8_hd{64,128,256}(..., scale, out, k_scale, v_scale)
//   The same over an FP8 cache (K = k_scale · stored E4M3, V = v_scale · stored E4M3); the same
//   launch.
//
// Fragments (PTX ISA; lane = 4g + t): mma.m16n8k16's A a0 = (row g, k 2t..2t+1), a1 = (g+8, 2t..),
// a2 = (g, 2t+8..), a3 = (g+8, 2t+8..); B b0 = (k 2t..2t+1, col g), b1 = (k 2t+8.., col g);
// C c0,c1 = (row g, cols 2t, 2t+1), c2,c3 = (row g+8, ...). An ldmatrix.x4 whose lane l points at
// row (l & 15), column 8(l >> 4) of a 16x16 Q block gives a0..a3; at key 16p + 8(l >> 4) + (l & 7),
// dims 16k + 8((l >> 3) & 1) of K, b0, b1 of key tile 2p then 2p+1; .trans at key
// 16k + 8((l >> 3) & 1) + (l & 7), dims 16p + 8(l >> 4) of V, b0, b1 of dim tile 2p then 2p+1.

#define FA_THREADS 128
#define FA_WARPS 4
#define FA_LOG2E 1.4426950408889634f

// Per padded head size, the query rows of a block and its dynamic shared memory (the host reads
// these; static_asserts below tie them to the tile shapes).
#define FA_BLOCK_M_HD64 128
#define FA_SMEM_HD64 55296
#define FA_BLOCK_M_HD128 128
#define FA_SMEM_HD128 104448
#define FA_BLOCK_M_HD256 64
#define FA_SMEM_HD256 101376

// WM m16 row tiles per warp, BN keys per K/V tile. FlashAttention-2 takes 128x128 at head_dim 64
// (here 128x64: 128 keys spill), 128x64 at 128, and 64x64 at 256 (here 64x32, so that both stages
// fit in ~100 KiB and two blocks share an SM). Every shape is spill-free in the sm_90 CUBIN.
template <int HDP_, int WM_, int BN_>
struct FaTile {
    static constexpr int HDP = HDP_, WM = WM_, BN = BN_;
    static constexpr int BM = FA_WARPS * 16 * WM;  // query rows a block
    static constexpr int STRIDE = HDP + 8;         // bf16 a shared-memory row (16 bytes of padding)
    static constexpr int Q_ELEMS = BM * STRIDE;
    static constexpr int KV_ELEMS = BN * STRIDE;   // one K or one V tile
    // Q, then two stages of (K, V).
    static constexpr int SMEM_BYTES = (Q_ELEMS + 4 * KV_ELEMS) * 2;
};
typedef FaTile<64, 2, 64> FaHd64;
typedef FaTile<128, 2, 64> FaHd128;
typedef FaTile<256, 1, 32> FaHd256;
static_assert(FaHd64::BM == FA_BLOCK_M_HD64 && FaHd64::SMEM_BYTES == FA_SMEM_HD64, "hd64 tile");
static_assert(FaHd128::BM == FA_BLOCK_M_HD128 && FaHd128::SMEM_BYTES == FA_SMEM_HD128, "hd128 tile");
static_assert(FaHd256::BM == FA_BLOCK_M_HD256 && FaHd256::SMEM_BYTES == FA_SMEM_HD256, "hd256 tile");

// Two f32 as one register of bf16 (lo in the low half), rounded to nearest even.
#ifndef DUET_EMULATOR
__device__ __forceinline__ unsigned fa_bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
#else
inline unsigned fa_bf16x2(float lo, float hi) { return pack_bf16x2(lo, hi); }
#endif

// 8 values of a K/V row into shared memory as bf16 (zeros when !valid): cp.async from a bf16
// cache, a load converted in registers from an FP8 one.
__device__ __forceinline__ void fa_stage8(KvBf16, bf16* dst, const bf16* src, bool valid) {
    cp_async_16(dst, src, valid);
}
__device__ __forceinline__ void fa_stage8(KvE4m3, bf16* dst, const unsigned char* src, bool valid) {
    *reinterpret_cast<uint4*>(dst) =
        valid ? KvE4m3::to_bf16x8(*reinterpret_cast<const uint2*>(src)) : make_uint4(0u, 0u, 0u, 0u);
}

template <class T, class KV>
__device__ __forceinline__ void fa_tile(const float* q, const typename KV::Elem* store,
                                        const unsigned* table, int layer, int num_blocks,
                                        int num_heads, int num_kv_heads, int block_size,
                                        int head_dim, float scale, float k_scale, float v_scale,
                                        float* out, bf16* smem, unsigned row_start, int len,
                                        int start_pos, int m0, int qh) {
    typedef typename KV::Elem Elem;
    constexpr int HDP = T::HDP, WM = T::WM, BN = T::BN, BM = T::BM, S = T::STRIDE;
    constexpr int KSTEPS = HDP / 16;  // k steps of Q·Kᵀ
    constexpr int NT = BN / 8;        // 8-key tiles of S
    constexpr int DT = HDP / 8;       // 8-dim tiles of O
    constexpr int CPR = HDP / 8;      // 16-byte chunks a row
    bf16* qs = smem;                  // [BM][S]
    bf16* kvs = smem + T::Q_ELEMS;    // stage st: K [BN][S] at 2·st tiles, V right after

    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int kvh = qh / (num_heads / num_kv_heads);
    const unsigned long long hd = (unsigned long long)head_dim;
    const unsigned long long row_stride = (unsigned long long)num_heads * hd;
    const unsigned long long bs = (unsigned long long)block_size;
    const unsigned long long nkv = (unsigned long long)num_kv_heads;
    // Store index of (layer, block 0, K, kvh, slot 0, dim 0); a block adds 2·nkv·bs·hd, V nkv·bs·hd.
    const unsigned long long head_base =
        (((unsigned long long)layer * (unsigned long long)num_blocks * 2ull) * nkv +
         (unsigned long long)kvh) * bs * hd;
    const unsigned long long v_offset = nkv * bs * hd;
    const int hchunks = head_dim >> 3;  // real 16-byte chunks a row

    const int block_end = min(m0 + BM, len);  // exclusive
    const int kv_end = start_pos + block_end;  // keys [0, kv_end) are needed
    const int ntiles = (kv_end + BN - 1) / BN;

    // ---- K/V tile `tile` into stage `stage`: cp.async through the block table ----
    auto load_kv = [&](int tile, int stage) {
        bf16* ks = kvs + 2 * stage * T::KV_ELEMS;
        bf16* vs = ks + T::KV_ELEMS;
        // Consecutive threads take consecutive chunks of one key: coalesced 16-byte reads. Not
        // unrolled: hoisting every chunk's offsets would hold registers the products need.
#pragma unroll 1
        for (int c = tid; c < BN * CPR; c += FA_THREADS) {
            const int n = c / CPR, ch = c % CPR;
            const int tk = tile * BN + n;
            const bool valid = tk < kv_end && ch < hchunks;
            const Elem* k_src = store;
            if (valid) {
                const unsigned blk = table[(unsigned)tk / (unsigned)block_size];
                const unsigned slot = (unsigned)tk % (unsigned)block_size;
                k_src = store + head_base + (unsigned long long)blk * 2ull * v_offset +
                        (unsigned long long)slot * hd + (unsigned long long)(ch * 8);
            }
            fa_stage8(KV(), ks + n * S + ch * 8, k_src, valid);
            fa_stage8(KV(), vs + n * S + ch * 8, valid ? k_src + v_offset : store, valid);
        }
    };
    load_kv(0, 0);
    cp_async_commit();

    // ---- Q: f32 rows, scaled to log2 units, one bf16 term, into shared memory ----
    {
        const float qscale = scale * k_scale * FA_LOG2E;
        for (int c = tid; c < BM * CPR; c += FA_THREADS) {
            const int r = c / CPR, ch = c % CPR;
            uint4 packed = make_uint4(0u, 0u, 0u, 0u);
            if (m0 + r < len && ch < hchunks) {
                const float* src = q + (unsigned long long)(row_start + m0 + r) * row_stride +
                                   (unsigned long long)qh * hd + (unsigned long long)(ch * 8);
                const float4 a = *reinterpret_cast<const float4*>(src);
                const float4 b = *reinterpret_cast<const float4*>(src + 4);
                packed = make_uint4(fa_bf16x2(a.x * qscale, a.y * qscale),
                                    fa_bf16x2(a.z * qscale, a.w * qscale),
                                    fa_bf16x2(b.x * qscale, b.y * qscale),
                                    fa_bf16x2(b.z * qscale, b.w * qscale));
            }
            *reinterpret_cast<uint4*>(qs + r * S + ch * 8) = packed;
        }
    }

    // ---- This warp's rows: m16 tile i covers block rows i·64 + 16·warp + [0, 16) ----
    const bool warp_live = m0 + warp * 16 < len;
    // Keys past this are masked for every row of the warp; keys up to this one for none.
    const int warp_last_pos = start_pos + min(m0 + (WM - 1) * 64 + warp * 16 + 16, len) - 1;
    const int warp_first_pos = start_pos + m0 + warp * 16;
    int qpos[WM][2];
    bool row_ok[WM][2];
#pragma unroll
    for (int i = 0; i < WM; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = m0 + i * 64 + warp * 16 + g + 8 * h;
            row_ok[i][h] = r < len;
            // Rows past the sequence see every key (finite, never stored).
            qpos[i][h] = row_ok[i][h] ? start_pos + r : kv_end - 1;
        }
    }

    float o[WM][DT][4];
    float m_run[WM][2], l_run[WM][2];  // l_run: this lane's columns; summed over the quad at the end
#pragma unroll
    for (int i = 0; i < WM; ++i) {
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) o[i][dt][0] = o[i][dt][1] = o[i][dt][2] = o[i][dt][3] = 0.0f;
        m_run[i][0] = m_run[i][1] = NEG_INF;
        l_run[i][0] = l_run[i][1] = 0.0f;
    }

    for (int j = 0; j < ntiles; ++j) {
        cp_async_wait<0>();
        // Tile j (and, the first time, Q) visible to every warp; every warp is done with stage
        // (j+1)&1, which holds tile j-1.
        __syncthreads();
        if (j + 1 < ntiles) load_kv(j + 1, (j + 1) & 1);
        cp_async_commit();
        const int n0 = j * BN;
        if (!warp_live || n0 > warp_last_pos) continue;  // uniform per warp
        const bf16* ks = kvs + 2 * (j & 1) * T::KV_ELEMS;
        const bf16* vs = ks + T::KV_ELEMS;

        // ---- S = Q·Kᵀ ----
        float s[WM][NT][4];
#pragma unroll
        for (int i = 0; i < WM; ++i)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) s[i][nt][0] = s[i][nt][1] = s[i][nt][2] = s[i][nt][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            unsigned qa[WM][4];
#pragma unroll
            for (int i = 0; i < WM; ++i)
                ldmatrix_x4(qa[i], qs + (i * 64 + warp * 16 + (lane & 15)) * S + kk * 16 + (lane >> 4) * 8);
#pragma unroll
            for (int p = 0; p < NT / 2; ++p) {
                unsigned kb[4];
                ldmatrix_x4(kb, ks + (p * 16 + (lane >> 4) * 8 + (lane & 7)) * S + kk * 16 +
                                    ((lane >> 3) & 1) * 8);
#pragma unroll
                for (int i = 0; i < WM; ++i) {
                    mma_bf16_16816(s[i][2 * p], qa[i], kb);
                    mma_bf16_16816(s[i][2 * p + 1], qa[i], kb + 2);
                }
            }
        }

        // ---- Causal mask (tiles crossing a row's limit only) and online softmax ----
        const bool masked = n0 + BN - 1 > warp_first_pos;  // uniform per warp
#pragma unroll
        for (int i = 0; i < WM; ++i) {
            float alpha[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float m_tile = NEG_INF;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        float v = s[i][nt][2 * h + c];
                        // Also masks the zero-filled keys past kv_end (past every row's position).
                        if (masked && n0 + nt * 8 + 2 * t4 + c > qpos[i][h]) v = NEG_INF;
                        s[i][nt][2 * h + c] = v;
                        m_tile = fmaxf(m_tile, v);
                    }
                }
                m_tile = fmaxf(m_tile, __shfl_xor_sync(FULL_MASK, m_tile, 1));
                m_tile = fmaxf(m_tile, __shfl_xor_sync(FULL_MASK, m_tile, 2));
                // Finite: every row sees key 0, in tile 0, which no warp skips.
                const float m_new = fmaxf(m_run[i][h], m_tile);
                alpha[h] = exp2f(m_run[i][h] - m_new);
                float psum = 0.0f;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const float p = exp2f(s[i][nt][2 * h + c] - m_new);
                        s[i][nt][2 * h + c] = p;
                        psum += p;
                    }
                }
                l_run[i][h] = l_run[i][h] * alpha[h] + psum;
                m_run[i][h] = m_new;
            }
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                o[i][dt][0] *= alpha[0];
                o[i][dt][1] *= alpha[0];
                o[i][dt][2] *= alpha[1];
                o[i][dt][3] *= alpha[1];
            }
        }

        // ---- O += P·V, P (one bf16 term) straight from S's accumulators ----
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            unsigned pa[WM][4];
#pragma unroll
            for (int i = 0; i < WM; ++i) {
                pa[i][0] = fa_bf16x2(s[i][2 * kk][0], s[i][2 * kk][1]);
                pa[i][1] = fa_bf16x2(s[i][2 * kk][2], s[i][2 * kk][3]);
                pa[i][2] = fa_bf16x2(s[i][2 * kk + 1][0], s[i][2 * kk + 1][1]);
                pa[i][3] = fa_bf16x2(s[i][2 * kk + 1][2], s[i][2 * kk + 1][3]);
            }
#pragma unroll
            for (int p = 0; p < DT / 2; ++p) {
                unsigned vb[4];
                ldmatrix_x4_trans(vb, vs + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * S +
                                          p * 16 + (lane >> 4) * 8);
#pragma unroll
                for (int i = 0; i < WM; ++i) {
                    mma_bf16_16816(o[i][2 * p], pa[i], vb);
                    mma_bf16_16816(o[i][2 * p + 1], pa[i], vb + 2);
                }
            }
        }
    }
    if (!warp_live) return;

    // ---- Normalise and store ----
#pragma unroll
    for (int i = 0; i < WM; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l = l_run[i][h];
            l += __shfl_xor_sync(FULL_MASK, l, 1);
            l += __shfl_xor_sync(FULL_MASK, l, 2);
            if (!row_ok[i][h]) continue;
            const float inv = v_scale / l;
            float* orow = out + (unsigned long long)(row_start + m0 + i * 64 + warp * 16 + g + 8 * h) * row_stride +
                          (unsigned long long)qh * hd;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                const int d = dt * 8 + 2 * t4;
                if (d < head_dim)
                    *reinterpret_cast<float2*>(orow + d) =
                        make_float2(o[i][dt][2 * h] * inv, o[i][dt][2 * h + 1] * inv);
            }
        }
    }
}

// The block's head, sequence and query tile, then the tile itself.
template <class T, class KV>
__device__ __forceinline__ void fa_block(const float* q, const typename KV::Elem* store,
                                         const unsigned* seq_row_start, const unsigned* seq_len,
                                         const unsigned* seq_start_pos, const unsigned* block_tables,
                                         const unsigned* table_offsets, int layer, int num_blocks,
                                         int num_heads, int num_kv_heads, int block_size,
                                         int head_dim, float scale, float* out, float k_scale,
                                         float v_scale) {
    DYNAMIC_SHARED(bf16, smem);
    const int qh = blockIdx.x;
    const unsigned s = blockIdx.z;
    const int m0 = (gridDim.y - 1 - blockIdx.y) * T::BM;
    const int len = (int)seq_len[s];
    if (qh >= num_heads || m0 >= len) return;  // uniform per block
    fa_tile<T, KV>(q, store, block_tables + table_offsets[s], layer, num_blocks, num_heads,
                   num_kv_heads, block_size, head_dim, scale, k_scale, v_scale, out, smem,
                   seq_row_start[s], len, (int)seq_start_pos[s], m0, qh);
}

// One entry point per padded head size and cache type, each with the registers it needs.
extern "C" __global__ void __launch_bounds__(FA_THREADS) prefill_attention_fa_hd64(
    const float* q, const bf16* store, const unsigned* seq_row_start, const unsigned* seq_len,
    const unsigned* seq_start_pos, const unsigned* block_tables, const unsigned* table_offsets,
    int layer, int num_blocks, int num_heads, int num_kv_heads, int block_size, int head_dim,
    float scale, float* out) {
    fa_block<FaHd64, KvBf16>(q, store, seq_row_start, seq_len, seq_start_pos, block_tables,
                         table_offsets, layer, num_blocks, num_heads, num_kv_heads, block_size,
                         head_dim, scale, out, 1.0f, 1.0f);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS) prefill_attention_fa_hd128(
    const float* q, const bf16* store, const unsigned* seq_row_start, const unsigned* seq_len,
    const unsigned* seq_start_pos, const unsigned* block_tables, const unsigned* table_offsets,
    int layer, int num_blocks, int num_heads, int num_kv_heads, int block_size, int head_dim,
    float scale, float* out) {
    fa_block<FaHd128, KvBf16>(q, store, seq_row_start, seq_len, seq_start_pos, block_tables,
                         table_offsets, layer, num_blocks, num_heads, num_kv_heads, block_size,
                         head_dim, scale, out, 1.0f, 1.0f);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS) prefill_attention_fa_hd256(
    const float* q, const bf16* store, const unsigned* seq_row_start, const unsigned* seq_len,
    const unsigned* seq_start_pos, const unsigned* block_tables, const unsigned* table_offsets,
    int layer, int num_blocks, int num_heads, int num_kv_heads, int block_size, int head_dim,
    float scale, float* out) {
    fa_block<FaHd256, KvBf16>(q, store, seq_row_start, seq_len, seq_start_pos, block_tables,
                         table_offsets, layer, num_blocks, num_heads, num_kv_heads, block_size,
                         head_dim, scale, out, 1.0f, 1.0f);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS) prefill_attention_fa_fp8_hd64(
    const float* q, const unsigned char* store, const unsigned* seq_row_start,
    const unsigned* seq_len, const unsigned* seq_start_pos, const unsigned* block_tables,
    const unsigned* table_offsets, int layer, int num_blocks, int num_heads, int num_kv_heads,
    int block_size, int head_dim, float scale, float* out, float k_scale, float v_scale) {
    fa_block<FaHd64, KvE4m3>(q, store, seq_row_start, seq_len, seq_start_pos, block_tables,
                         table_offsets, layer, num_blocks, num_heads, num_kv_heads, block_size,
                         head_dim, scale, out, k_scale, v_scale);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS) prefill_attention_fa_fp8_hd128(
    const float* q, const unsigned char* store, const unsigned* seq_row_start,
    const unsigned* seq_len, const unsigned* seq_start_pos, const unsigned* block_tables,
    const unsigned* table_offsets, int layer, int num_blocks, int num_heads, int num_kv_heads,
    int block_size, int head_dim, float scale, float* out, float k_scale, float v_scale) {
    fa_block<FaHd128, KvE4m3>(q, store, seq_row_start, seq_len, seq_start_pos, block_tables,
                         table_offsets, layer, num_blocks, num_heads, num_kv_heads, block_size,
                         head_dim, scale, out, k_scale, v_scale);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS) prefill_attention_fa_fp8_hd256(
    const float* q, const unsigned char* store, const unsigned* seq_row_start,
    const unsigned* seq_len, const unsigned* seq_start_pos, const unsigned* block_tables,
    const unsigned* table_offsets, int layer, int num_blocks, int num_heads, int num_kv_heads,
    int block_size, int head_dim, float scale, float* out, float k_scale, float v_scale) {
    fa_block<FaHd256, KvE4m3>(q, store, seq_row_start, seq_len, seq_start_pos, block_tables,
                         table_offsets, layer, num_blocks, num_heads, num_kv_heads, block_size,
                         head_dim, scale, out, k_scale, v_scale);
}
