// kv_cache.cu — paged KV store writes and whole-chunk pack/unpack.
//
// Store layout (bf16, or E4M3 bytes in an FP8 cache), for layer L, physical block B, kv (0 = K, 1 = V),
// kv head h, slot s, dim d:
//   ((((L*num_blocks + B)*2 + kv)*num_kv_heads + h)*block_size + s)*head_dim + d
// One (layer, block) chunk is contiguous: chunk_elems = 2*num_kv_heads*block_size*head_dim,
// chunk index = L*num_blocks + B. All index math is 64-bit.
//
// write_kv(store, k, v, slots, layer, num_blocks, num_kv_heads, block_size, head_dim)
//   k, v: f32 [rows][num_kv_heads*head_dim]; row r goes to global slot
//   g = slots[r] (block g / block_size, slot g % block_size), converted to bf16
//   (round to nearest even). Rows whose slot is >= num_blocks*block_size
//   (e.g. a 0xffffffff padding sentinel) are skipped.
//   Launch: grid.x = rows, block = 128 threads (any), no shared memory.
//   head_dim must be even; k/v/store 8-byte aligned (cudaMalloc is).
// write_kv_fp8(..., head_dim, k_scale, v_scale)
//   The same into an FP8 cache: K stored as E4M3 of k / k_scale, V of v / v_scale (f32_to_e4m3:
//   round to nearest even, saturating at ±448).
//
// pack_kv_chunks(store, chunks, chunk_elems, out)
//   out[i*chunk_elems + e] = store[chunks[i]*chunk_elems + e]
// unpack_kv_chunks(store, chunks, chunk_elems, in)
//   store[chunks[i]*chunk_elems + e] = in[i*chunk_elems + e]
//   Launch: grid.y = number of chunks i (<= 65535; for more, launch again with
//   `chunks` and `out`/`in` offset), grid.x = any (grid-stride; e.g.
//   min(ceil(chunk_elems / 8 / 256), 1024)), block = 256 threads (any).
//   chunk_elems must be a multiple of 8; store/out/in 16-byte aligned
//   (copies use 16-byte loads and stores). They move bits: an FP8 cache's chunk of B bytes is
//   copied as B / 2 bf16 elements.

template <class KV>
__device__ __forceinline__ void write_kv_rows(typename KV::Elem* store, const float* k,
                                              const float* v, const unsigned* slots, int layer,
                                              int num_blocks, int num_kv_heads, int block_size,
                                              int head_dim, float k_scale, float v_scale) {
    const unsigned r = blockIdx.x;
    const unsigned g = slots[r];
    if ((unsigned long long)g >= (unsigned long long)num_blocks * (unsigned long long)block_size)
        return;
    const unsigned blk = g / (unsigned)block_size;
    const unsigned s = g - blk * (unsigned)block_size;
    const int width = num_kv_heads * head_dim;
    const int half_hd = head_dim >> 1;
    const unsigned long long nkv = (unsigned long long)num_kv_heads;
    const unsigned long long bs = (unsigned long long)block_size;
    const unsigned long long hd = (unsigned long long)head_dim;
    const unsigned long long chunk = (unsigned long long)layer * (unsigned long long)num_blocks + blk;
    const float2* k2 = reinterpret_cast<const float2*>(k + (unsigned long long)r * width);
    const float2* v2 = reinterpret_cast<const float2*>(v + (unsigned long long)r * width);
    const int npairs = width >> 1;
    for (int p = threadIdx.x; p < npairs; p += blockDim.x) {
        const int h = p / half_hd;
        const int d = (p - h * half_hd) * 2;
        const unsigned long long kidx = (((chunk * 2ull + 0ull) * nkv + h) * bs + s) * hd + d;
        const unsigned long long vidx = (((chunk * 2ull + 1ull) * nkv + h) * bs + s) * hd + d;
        const float2 kk = k2[p];
        const float2 vv = v2[p];
        KV::store_pair(store + kidx, kk.x, kk.y, k_scale);
        KV::store_pair(store + vidx, vv.x, vv.y, v_scale);
    }
}

extern "C" __global__ void write_kv(bf16* store, const float* k, const float* v,
                                    const unsigned* slots, int layer, int num_blocks,
                                    int num_kv_heads, int block_size, int head_dim) {
    write_kv_rows<KvBf16>(store, k, v, slots, layer, num_blocks, num_kv_heads, block_size,
                          head_dim, 1.0f, 1.0f);
}

extern "C" __global__ void write_kv_fp8(unsigned char* store, const float* k, const float* v,
                                        const unsigned* slots, int layer, int num_blocks,
                                        int num_kv_heads, int block_size, int head_dim,
                                        float k_scale, float v_scale) {
    write_kv_rows<KvE4m3>(store, k, v, slots, layer, num_blocks, num_kv_heads, block_size,
                          head_dim, k_scale, v_scale);
}

extern "C" __global__ void pack_kv_chunks(const bf16* store, const unsigned* chunks,
                                          unsigned long long chunk_elems, bf16* out) {
    const unsigned long long i = blockIdx.y;
    const unsigned long long n16 = chunk_elems >> 3;
    const uint4* src = reinterpret_cast<const uint4*>(store + (unsigned long long)chunks[i] * chunk_elems);
    uint4* dst = reinterpret_cast<uint4*>(out + i * chunk_elems);
    for (unsigned long long e = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; e < n16;
         e += (unsigned long long)gridDim.x * blockDim.x)
        dst[e] = src[e];
}

extern "C" __global__ void unpack_kv_chunks(bf16* store, const unsigned* chunks,
                                            unsigned long long chunk_elems, const bf16* in) {
    const unsigned long long i = blockIdx.y;
    const unsigned long long n16 = chunk_elems >> 3;
    uint4* dst = reinterpret_cast<uint4*>(store + (unsigned long long)chunks[i] * chunk_elems);
    const uint4* src = reinterpret_cast<const uint4*>(in + i * chunk_elems);
    for (unsigned long long e = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; e < n16;
         e += (unsigned long long)gridDim.x * blockDim.x)
        dst[e] = src[e];
}
