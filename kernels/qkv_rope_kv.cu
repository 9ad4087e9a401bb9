// qkv_rope_kv.cu — the QKV projection's output to attention's inputs in one pass: Q turned by
// RoPE into its own buffer, K turned and V as is stored into the paged KV cache (bf16, or E4M3
// with qkv_rope_write_kv_fp8). What copy_cols (three times), rope_rotate_half (twice) and
// write_kv (write_kv_fp8) do, in one launch.
//
// qkv_rope_write_kv(qkv, q, store, positions, slots, inv_freq, layer, num_blocks, num_heads,
//     num_kv_heads, block_size, head_dim, scale)
//   qkv: f32 [rows][(num_heads + 2*num_kv_heads) * head_dim], each row [q | k | v];
//   q:   f32 [rows][num_heads * head_dim], written;
//   store: the paged KV cache, layout as in kv_cache.cu (num_blocks blocks per layer);
//   row r is at positions[r] and goes to cache slot slots[r] (rows whose slot is past
//   num_blocks * block_size are not stored).
//   Rotation: rope_pair (common.cuh) of pairs (i, i + head_dim/2), exactly as rope_rotate_half.
//   Launch: grid = (rows, num_heads + 2*num_kv_heads), block = head_dim / 2 threads (rounding
//   up to a multiple of 32 is fine), no shared memory. head_dim must be even.
// qkv_rope_write_kv_fp8(..., scale, k_scale, v_scale)
//   The same into an FP8 cache, K and V quantized as write_kv_fp8 quantizes them.

template <class KV>
__device__ __forceinline__ void qkv_rope_store(const float* qkv, float* q, typename KV::Elem* store,
                                               const unsigned* positions, const unsigned* slots,
                                               const float* inv_freq, int layer, int num_blocks,
                                               int num_heads, int num_kv_heads, int block_size,
                                               int head_dim, float scale, float k_scale,
                                               float v_scale) {
    const int half = head_dim >> 1;
    const int i = threadIdx.x;
    const int j = blockIdx.y;
    const int heads = num_heads + 2 * num_kv_heads;
    if (i >= half || j >= heads) return;
    const unsigned r = blockIdx.x;
    const unsigned long long hd = (unsigned long long)head_dim;
    const float* src = qkv + ((unsigned long long)r * heads + j) * hd;
    float y1 = src[i], y2 = src[i + half];
    if (j < num_heads + num_kv_heads)
        rope_pair(src[i], src[i + half], positions[r], inv_freq[i], scale, y1, y2);
    if (j < num_heads) {
        float* dst = q + ((unsigned long long)r * num_heads + j) * hd;
        dst[i] = y1;
        dst[i + half] = y2;
        return;
    }
    const unsigned g = slots[r];
    if ((unsigned long long)g >= (unsigned long long)num_blocks * (unsigned long long)block_size)
        return;
    const unsigned blk = g / (unsigned)block_size;
    const unsigned s = g - blk * (unsigned)block_size;
    const int kv = j < num_heads + num_kv_heads ? 0 : 1;
    const int h = j - num_heads - kv * num_kv_heads;
    const unsigned long long chunk = (unsigned long long)layer * (unsigned long long)num_blocks + blk;
    const unsigned long long idx =
        (((chunk * 2ull + (unsigned long long)kv) * (unsigned long long)num_kv_heads + h) *
             (unsigned long long)block_size +
         s) *
            hd +
        i;
    const float kv_scale = kv == 0 ? k_scale : v_scale;
    store[idx] = KV::from_f32(y1, kv_scale);
    store[idx + half] = KV::from_f32(y2, kv_scale);
}

extern "C" __global__ void qkv_rope_write_kv(const float* qkv, float* q, bf16* store, const unsigned* positions, const unsigned* slots, const float* inv_freq, int layer, int num_blocks, int num_heads, int num_kv_heads, int block_size, int head_dim, float scale) {
    qkv_rope_store<KvBf16>(qkv, q, store, positions, slots, inv_freq, layer, num_blocks, num_heads,
                           num_kv_heads, block_size, head_dim, scale, 1.0f, 1.0f);
}

extern "C" __global__ void qkv_rope_write_kv_fp8(const float* qkv, float* q, unsigned char* store, const unsigned* positions, const unsigned* slots, const float* inv_freq, int layer, int num_blocks, int num_heads, int num_kv_heads, int block_size, int head_dim, float scale, float k_scale, float v_scale) {
    qkv_rope_store<KvE4m3>(qkv, q, store, positions, slots, inv_freq, layer, num_blocks, num_heads,
                           num_kv_heads, block_size, head_dim, scale, k_scale, v_scale);
}
