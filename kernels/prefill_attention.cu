// prefill_attention.cu — causal prefill attention over the paged KV store,
// tiled in the FlashAttention manner: a block keeps a tile of PREFILL_BLOCK_M
// queries of one head in registers, streams the K/V of the sequence (cached
// prefix + the new tokens, all already in the store) through shared memory in
// tiles of up to PF_MAX_BLOCK_N keys, and keeps an online softmax. f32 math (CUDA cores).
//
// prefill_attention(q, store, seq_row_start, seq_len, seq_start_pos,
//     block_tables, table_offsets, layer, num_blocks, num_heads, num_kv_heads,
//     block_size, head_dim, scale, out)
//   Sequence s has seq_len[s] query rows starting at row seq_row_start[s];
//   query j of s sits at position seq_start_pos[s] + j and attends to
//   positions 0 ..= seq_start_pos[s] + j, read through s's block table
//   (block = table[t / block_size], slot = t % block_size).
//   q and out are f32 [rows][num_heads*head_dim]; query head qh reads kv head
//   qh / (num_heads / num_kv_heads).
//   Launch: grid = (ceil(max_s seq_len[s] / PREFILL_BLOCK_M), num_heads, num_seqs),
//           block = PF_THREADS (128) threads exactly,
//           static shared memory 32 KB, no dynamic shared memory.
//   Block (mt, qh, s) handles queries [mt*PREFILL_BLOCK_M, (mt+1)*PREFILL_BLOCK_M)
//   of sequence s (exits if that start is >= seq_len[s]); key tiles past the
//   causal limit of the tile's last query are skipped.
//
// Thread layout: TPR threads per query row (TPR = 4, or 8 when head_dim > 128);
// each thread owns head_dim/TPR of the dimensions (float4 groups
// 4*TPR*k + 4*j .. +3 for slice j) of q (pre-scaled by scale*log2(e), kept in
// registers) and of the output accumulator; scores are completed with xor
// shuffles over the TPR threads. 128/TPR rows are processed per pass (one pass
// of 32 rows, or two passes of 16 rows when head_dim > 128).
// head_dim is padded to HDP in {64, 128, 256} (padding dims are zero); K/V
// tiles are converted to f32 in shared memory, min(32, 4096/HDP) keys a tile.
//
// Host guarantees: head_dim % 8 == 0, 8 <= head_dim <= 256;
// num_heads % num_kv_heads == 0; q/out/store 16-byte aligned; all block table
// entries the sequence needs are valid.

#define PREFILL_BLOCK_M 32
#define PF_THREADS 128
#define PF_TILE_FLOATS 4096       // floats per K (or V) tile in shared memory
#define PF_MAX_BLOCK_N 32         // at most this many keys per tile
#define PF_LOG2E 1.4426950408889634f

template <int HDP>
__device__ __forceinline__ void prefill_tile(const float* q, const bf16* store,
                                             const unsigned* table, int layer, int num_blocks,
                                             int num_heads, int num_kv_heads, int block_size,
                                             int head_dim, float scale, float* out, float* ks,
                                             float* vs, unsigned row_start, int len,
                                             int start_pos, int m0, int qh) {
    constexpr int TPR = HDP >= 256 ? 8 : 4;        // threads per query row
    constexpr int RP = PF_THREADS / TPR;           // query rows per pass: 32, 32, 16
    constexpr int PASSES = PREFILL_BLOCK_M / RP;   // 1, 1, 2
    constexpr int BN = PF_TILE_FLOATS / HDP < PF_MAX_BLOCK_N ? PF_TILE_FLOATS / HDP
                                                             : PF_MAX_BLOCK_N;  // keys per tile
    constexpr int KG = HDP / (4 * TPR);            // float4 groups per thread: 4, 8, 8
    constexpr int CPK = HDP / 8;                   // 16-byte bf16 chunks per key row (padded)
    const int tid = threadIdx.x;
    const int j = tid % TPR;    // dimension slice
    const int group = num_heads / num_kv_heads;
    const int kvh = qh / group;
    const unsigned long long hd = (unsigned long long)head_dim;
    const unsigned long long row_stride = (unsigned long long)num_heads * hd;
    const unsigned long long layer_base = (unsigned long long)layer * (unsigned long long)num_blocks;
    const unsigned long long nkv = (unsigned long long)num_kv_heads;
    const unsigned long long bs = (unsigned long long)block_size;
    const int hchunks = head_dim >> 3;  // real 16-byte chunks per key row
    const float qscale = scale * PF_LOG2E;

    for (int pass = 0; pass < PASSES; ++pass) {
        const int pm0 = m0 + pass * RP;  // first query of this pass
        if (pm0 >= len) break;           // uniform per block
        const int mi = pm0 + tid / TPR;  // this thread's query index within the sequence
        const bool row_ok = mi < len;
        const int last_m = min(pm0 + RP, len);  // exclusive
        const int kv_end = start_pos + last_m;  // keys [0, kv_end) are needed
        const int qpos = row_ok ? start_pos + mi : kv_end - 1;

        // ---- Q slice into registers, pre-scaled so that scores are in log2 units ----
        float qr[KG * 4];
        {
            const float* qrow = q + (unsigned long long)(row_start + (row_ok ? mi : 0)) * row_stride +
                                (unsigned long long)qh * hd;
#pragma unroll
            for (int k = 0; k < KG; ++k) {
                const int d = 4 * TPR * k + 4 * j;
                float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
                if (row_ok && d < head_dim) v = *reinterpret_cast<const float4*>(qrow + d);
                qr[4 * k + 0] = v.x * qscale;
                qr[4 * k + 1] = v.y * qscale;
                qr[4 * k + 2] = v.z * qscale;
                qr[4 * k + 3] = v.w * qscale;
            }
        }

        float acc[KG * 4];
#pragma unroll
        for (int x = 0; x < KG * 4; ++x) acc[x] = 0.0f;
        float m_run = NEG_INF;
        float l_run = 0.0f;

        for (int n0 = 0; n0 < kv_end; n0 += BN) {
            __syncthreads();  // previous tile fully consumed
            // ---- Stage K/V tile [n0, n0+BN) into shared memory as f32 ----
            for (int c = tid; c < BN * CPK; c += PF_THREADS) {
                const int n = c / CPK;
                const int ch = c - n * CPK;
                const int t = n0 + n;
                uint4 kraw = make_uint4(0u, 0u, 0u, 0u), vraw = kraw;
                if (t < kv_end && ch < hchunks) {
                    const unsigned blk = table[(unsigned)t / (unsigned)block_size];
                    const unsigned slot = (unsigned)t % (unsigned)block_size;
                    const unsigned long long kidx =
                        ((((layer_base + blk) * 2ull) * nkv + (unsigned long long)kvh) * bs + slot) * hd +
                        (unsigned long long)(ch * 8);
                    const unsigned long long vidx = kidx + nkv * bs * hd;  // kv = 1
                    kraw = *reinterpret_cast<const uint4*>(store + kidx);
                    vraw = *reinterpret_cast<const uint4*>(store + vidx);
                }
                float f[8];
                float4* kd = reinterpret_cast<float4*>(ks + n * HDP + ch * 8);
                float4* vd = reinterpret_cast<float4*>(vs + n * HDP + ch * 8);
                bf16x8_to_f32(kraw, f);
                kd[0] = make_float4(f[0], f[1], f[2], f[3]);
                kd[1] = make_float4(f[4], f[5], f[6], f[7]);
                bf16x8_to_f32(vraw, f);
                vd[0] = make_float4(f[0], f[1], f[2], f[3]);
                vd[1] = make_float4(f[4], f[5], f[6], f[7]);
            }
            __syncthreads();

            // ---- Scores for this row against the BN keys ----
            float s[BN];
#pragma unroll
            for (int n = 0; n < BN; ++n) {
                const float4* kr = reinterpret_cast<const float4*>(ks + n * HDP);
                float dot = 0.0f;
#pragma unroll
                for (int k = 0; k < KG; ++k) {
                    const float4 kv = kr[TPR * k + j];
                    dot = fmaf(qr[4 * k + 0], kv.x, dot);
                    dot = fmaf(qr[4 * k + 1], kv.y, dot);
                    dot = fmaf(qr[4 * k + 2], kv.z, dot);
                    dot = fmaf(qr[4 * k + 3], kv.w, dot);
                }
                s[n] = dot;
            }
            float m_tile = NEG_INF;
#pragma unroll
            for (int n = 0; n < BN; ++n) {
                float v = s[n];
#pragma unroll
                for (int o = 1; o < TPR; o <<= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
                v = (n0 + n <= qpos) ? v : NEG_INF;  // causal mask (also masks padding keys)
                s[n] = v;
                m_tile = fmaxf(m_tile, v);
            }

            // ---- Online softmax (m_new is finite: key 0 is in the first tile) ----
            const float m_new = fmaxf(m_run, m_tile);
            const float alpha = exp2f(m_run - m_new);
            float psum = 0.0f;
#pragma unroll
            for (int n = 0; n < BN; ++n) {
                const float pn = exp2f(s[n] - m_new);
                s[n] = pn;
                psum += pn;
            }
            l_run = l_run * alpha + psum;
            m_run = m_new;
#pragma unroll
            for (int x = 0; x < KG * 4; ++x) acc[x] *= alpha;

            // ---- acc += P V ----
#pragma unroll
            for (int n = 0; n < BN; ++n) {
                const float4* vr = reinterpret_cast<const float4*>(vs + n * HDP);
                const float pn = s[n];
#pragma unroll
                for (int k = 0; k < KG; ++k) {
                    const float4 vv = vr[TPR * k + j];
                    acc[4 * k + 0] = fmaf(pn, vv.x, acc[4 * k + 0]);
                    acc[4 * k + 1] = fmaf(pn, vv.y, acc[4 * k + 1]);
                    acc[4 * k + 2] = fmaf(pn, vv.z, acc[4 * k + 2]);
                    acc[4 * k + 3] = fmaf(pn, vv.w, acc[4 * k + 3]);
                }
            }
        }

        // ---- Normalise and store ----
        if (row_ok) {
            const float inv = 1.0f / l_run;
            float* orow = out + (unsigned long long)(row_start + mi) * row_stride +
                          (unsigned long long)qh * hd;
#pragma unroll
            for (int k = 0; k < KG; ++k) {
                const int d = 4 * TPR * k + 4 * j;
                if (d < head_dim)
                    *reinterpret_cast<float4*>(orow + d) =
                        make_float4(acc[4 * k + 0] * inv, acc[4 * k + 1] * inv,
                                    acc[4 * k + 2] * inv, acc[4 * k + 3] * inv);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(PF_THREADS) prefill_attention(
    const float* q, const bf16* store, const unsigned* seq_row_start, const unsigned* seq_len,
    const unsigned* seq_start_pos, const unsigned* block_tables, const unsigned* table_offsets,
    int layer, int num_blocks, int num_heads, int num_kv_heads, int block_size, int head_dim,
    float scale, float* out) {
    __shared__ __align__(16) float kv_smem[2 * PF_TILE_FLOATS];  // K tile | V tile (32 KB)

    const int qh = blockIdx.y;
    const unsigned s = blockIdx.z;
    const int m0 = blockIdx.x * PREFILL_BLOCK_M;
    const int len = (int)seq_len[s];
    if (qh >= num_heads || m0 >= len) return;  // uniform per block
    const unsigned row_start = seq_row_start[s];
    const int start_pos = (int)seq_start_pos[s];
    const unsigned* table = block_tables + table_offsets[s];
    float* ks = kv_smem;
    float* vs = kv_smem + PF_TILE_FLOATS;

    if (head_dim <= 64)
        prefill_tile<64>(q, store, table, layer, num_blocks, num_heads, num_kv_heads, block_size,
                         head_dim, scale, out, ks, vs, row_start, len, start_pos, m0, qh);
    else if (head_dim <= 128)
        prefill_tile<128>(q, store, table, layer, num_blocks, num_heads, num_kv_heads, block_size,
                          head_dim, scale, out, ks, vs, row_start, len, start_pos, m0, qh);
    else
        prefill_tile<256>(q, store, table, layer, num_blocks, num_heads, num_kv_heads, block_size,
                          head_dim, scale, out, ks, vs, row_start, len, start_pos, m0, qh);
}
