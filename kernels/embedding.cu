// embedding.cu — token embedding lookup (bf16 table -> f32 activations).
//
// embed_rows(table, tokens, out, hidden)
//   out[r][c] = table[tokens[r]][c] for c < hidden.
//   Launch: grid.x = number of rows, block = 256 threads (any multiple of 32
//   works), no dynamic shared memory.
//   When hidden % 8 == 0 (and the pointers are 16-byte aligned) it uses 16-byte
//   table loads and 16-byte stores; otherwise a scalar path.
//   The host guarantees tokens[r] < vocabulary size.

extern "C" __global__ void embed_rows(const bf16* table, const unsigned* tokens,
                                      float* out, int hidden) {
    const unsigned r = blockIdx.x;
    const unsigned long long tok = tokens[r];
    const bf16* src = table + tok * (unsigned long long)hidden;
    float* dst = out + (unsigned long long)r * (unsigned long long)hidden;

    const bool vec = (hidden & 7) == 0 &&
                     ((((unsigned long long)src) | ((unsigned long long)dst)) & 15ull) == 0;
    if (vec) {
        const int n8 = hidden >> 3;
        const uint4* s8 = reinterpret_cast<const uint4*>(src);
        float4* d4 = reinterpret_cast<float4*>(dst);
        for (int i = threadIdx.x; i < n8; i += blockDim.x) {
            float f[8];
            bf16x8_to_f32(s8[i], f);
            d4[2 * i] = make_float4(f[0], f[1], f[2], f[3]);
            d4[2 * i + 1] = make_float4(f[4], f[5], f[6], f[7]);
        }
    } else {
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) dst[c] = bf16_to_f32(src[c]);
    }
}
