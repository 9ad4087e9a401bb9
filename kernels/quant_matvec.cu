// quant_matvec.cu — GGUF weights kept packed on the GPU (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K): the
// matrix products of decode read the packed blocks and dequantize them in registers; prefill
// dequantizes a tile of rows to bf16 for cuBLAS; the embedding gathers rows of a packed table.
//
// A weight matrix w is [n][k] as the GGUF file stores it: each of the n rows is k / BL blocks of
// BB bytes (BL, BB below), rows back to back, no padding (the file's bytes, uploaded as they
// are). Every format is read as units of 32 values: unit u of a row is sub-block u % (BL / 32)
// of block u / (BL / 32). Each value is dequantized as duet's CPU reference
// (crates/duet-model/src/dequant.rs) computes it, every product and sum rounded on its own
// (__fmul_rn: never contracted into an fma), so a value here has the CPU's bits.
//
// quant_matvec_<t>(w, x, out, rows, n, k)
//   out[r][j] = sum_c x[r][c] * w[j][c], x and out f32 [rows][k] / [rows][n], f32 accumulation.
//   One warp per output column j (QMV_WARPS a block), QMV_ROWS rows of x a block.
//   Launch: grid = (ceil(n / QMV_WARPS), ceil(rows / QMV_ROWS)), block = 32 * QMV_WARPS.
//   k is a multiple of BL; x 16-byte aligned.
// quant_to_bf16_<t>(w, out, n, k)
//   out[j][c] = bf16(w[j][c]) (round to nearest even) for the n × k values of w.
//   Launch: any grid (grid-stride over the n * k / 32 units), block = 256 (any).
// quant_embed_rows_<t>(w, tokens, out, k)
//   out[r][c] = w[tokens[r]][c] in f32. Launch: grid.x = rows (exact), block = 256 (any).
//   The host guarantees tokens[r] < n.

#define QMV_WARPS 4
#define QMV_ROWS 8

// GGML type ids, as the template parameter.
#define Q4_0 2
#define Q4_1 3
#define Q8_0 8
#define Q4_K 12
#define Q6_K 14

template <int T> struct QFormat;
template <> struct QFormat<Q4_0> { static const int BL = 32, BB = 18; };
template <> struct QFormat<Q4_1> { static const int BL = 32, BB = 20; };
template <> struct QFormat<Q8_0> { static const int BL = 32, BB = 34; };
template <> struct QFormat<Q4_K> { static const int BL = 256, BB = 144; };
template <> struct QFormat<Q6_K> { static const int BL = 256, BB = 210; };

// IEEE half bits to f32, exactly (subnormals included). Blocks are 2-byte aligned: every block
// size is even and rows start at even offsets.
__device__ __forceinline__ float f16_at(const unsigned char* b) {
    const unsigned h = *reinterpret_cast<const unsigned short*>(b);
    const unsigned sign = (h & 0x8000u) << 16;
    const unsigned e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        // Zero or subnormal: m * 2^-24, exact in f32.
        return __uint_as_float(__float_as_uint((float)m * 5.9604644775390625e-8f) | sign);
    }
    if (e == 31) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}

// GGML's get_scale_min_k4: the 6-bit scale and min of sub-block j (0..8) of a Q4_K block.
__device__ __forceinline__ void scale_min_k4(int j, const unsigned char* q, float& sc, float& mn) {
    if (j < 4) {
        sc = (float)(q[j] & 63);
        mn = (float)(q[j + 4] & 63);
    } else {
        sc = (float)((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4));
        mn = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

// The 32 values of sub-block `sub` of the block at `b`.
template <int T> __device__ __forceinline__ void dequant32(const unsigned char* b, int sub, float* v);

template <> __device__ __forceinline__ void dequant32<Q4_0>(const unsigned char* b, int, float* v) {
    const float d = f16_at(b);
    const unsigned char* qs = b + 2;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        v[j] = __fmul_rn((float)((int)(qs[j] & 0x0f) - 8), d);
        v[j + 16] = __fmul_rn((float)((int)(qs[j] >> 4) - 8), d);
    }
}

template <> __device__ __forceinline__ void dequant32<Q4_1>(const unsigned char* b, int, float* v) {
    const float d = f16_at(b), m = f16_at(b + 2);
    const unsigned char* qs = b + 4;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        v[j] = __fmul_rn((float)(qs[j] & 0x0f), d) + m;
        v[j + 16] = __fmul_rn((float)(qs[j] >> 4), d) + m;
    }
}

template <> __device__ __forceinline__ void dequant32<Q8_0>(const unsigned char* b, int, float* v) {
    const float d = f16_at(b);
#pragma unroll
    for (int j = 0; j < 32; ++j) v[j] = __fmul_rn((float)(signed char)b[2 + j], d);
}

// Q4_K: d, dmin (f16), scales[12], qs[128]; sub-blocks 2i and 2i+1 are the low and high nibbles
// of qs[32i .. 32i + 32].
template <> __device__ __forceinline__ void dequant32<Q4_K>(const unsigned char* b, int sub, float* v) {
    float sc, mn;
    scale_min_k4(sub, b + 4, sc, mn);
    const float d = f16_at(b) * sc, m = f16_at(b + 2) * mn;
    const unsigned char* q = b + 16 + 32 * (sub >> 1);
    const int shift = (sub & 1) * 4;
#pragma unroll
    for (int l = 0; l < 32; ++l) v[l] = __fmul_rn(d, (float)((q[l] >> shift) & 0x0f)) - m;
}

// Q6_K: ql[128], qh[64], scales[16] (i8), d (f16). Sub-block s is part p = s % 4 of half
// h = s / 4: low 4 bits from ql[64h + 32(p & 1) + l] (high nibble for p >= 2), top 2 bits
// from qh[32h + l] >> 2p, scale scales[8h + 2p + l / 16].
template <> __device__ __forceinline__ void dequant32<Q6_K>(const unsigned char* b, int sub, float* v) {
    const int h = sub >> 2, p = sub & 3;
    const unsigned char* ql = b + 64 * h + 32 * (p & 1);
    const unsigned char* qh = b + 128 + 32 * h;
    const signed char* sc = reinterpret_cast<const signed char*>(b + 192 + 8 * h + 2 * p);
    const float d = f16_at(b + 208);
    const int lshift = (p >> 1) * 4;
    const float d0 = d * (float)sc[0], d1 = d * (float)sc[1];
#pragma unroll
    for (int l = 0; l < 32; ++l) {
        const int q = (int)(((ql[l] >> lshift) & 0x0f) | (((qh[l] >> (2 * p)) & 3) << 4)) - 32;
        v[l] = __fmul_rn(l < 16 ? d0 : d1, (float)q);
    }
}

// The 32 values of unit u of a row starting at `row`.
template <int T> __device__ __forceinline__ void unit_values(const unsigned char* row, unsigned long long u, float* v) {
    const int subs = QFormat<T>::BL / 32;
    dequant32<T>(row + (u / subs) * QFormat<T>::BB, (int)(u % subs), v);
}

template <int T>
__device__ __forceinline__ void quant_matvec(const unsigned char* w, const float* x, float* out,
                                             int rows, int n, int k) {
    const int lane = threadIdx.x & 31;
    const int col = blockIdx.x * QMV_WARPS + (threadIdx.x >> 5);
    const int r0 = blockIdx.y * QMV_ROWS;
    if (col >= n) return;  // the whole warp: no lane of it shuffles below
    const unsigned long long row_bytes = (unsigned long long)(k / QFormat<T>::BL) * QFormat<T>::BB;
    const unsigned char* wr = w + (unsigned long long)col * row_bytes;
    const int units = k / 32;
    float acc[QMV_ROWS];
#pragma unroll
    for (int r = 0; r < QMV_ROWS; ++r) acc[r] = 0.0f;
    for (int u = lane; u < units; u += 32) {
        float v[32];
        unit_values<T>(wr, u, v);
#pragma unroll
        for (int r = 0; r < QMV_ROWS; ++r) {
            if (r0 + r >= rows) break;
            const float4* xr = reinterpret_cast<const float4*>(x + (unsigned long long)(r0 + r) * k + 32 * u);
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float4 xv = xr[i];
                s += v[4 * i] * xv.x + v[4 * i + 1] * xv.y + v[4 * i + 2] * xv.z + v[4 * i + 3] * xv.w;
            }
            acc[r] += s;
        }
    }
#pragma unroll
    for (int r = 0; r < QMV_ROWS; ++r) acc[r] = warp_sum(acc[r]);
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < QMV_ROWS; ++r) {
            if (r0 + r < rows) out[(unsigned long long)(r0 + r) * n + col] = acc[r];
        }
    }
}

template <int T>
__device__ __forceinline__ void quant_to_bf16(const unsigned char* w, bf16* out, int n, int k) {
    const unsigned long long units_per_row = k / 32;
    const unsigned long long row_bytes = (unsigned long long)(k / QFormat<T>::BL) * QFormat<T>::BB;
    const unsigned long long total = (unsigned long long)n * units_per_row;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned long long row = i / units_per_row, u = i % units_per_row;
        float v[32];
        unit_values<T>(w + row * row_bytes, u, v);
        unsigned* o = reinterpret_cast<unsigned*>(out + row * k + 32 * u);
#pragma unroll
        for (int j = 0; j < 16; ++j) o[j] = pack_bf16x2(v[2 * j], v[2 * j + 1]);
    }
}

template <int T>
__device__ __forceinline__ void quant_embed_rows(const unsigned char* w, const unsigned* tokens,
                                                 float* out, int k) {
    const unsigned long long row_bytes = (unsigned long long)(k / QFormat<T>::BL) * QFormat<T>::BB;
    const unsigned char* wr = w + tokens[blockIdx.x] * row_bytes;
    float* dst = out + (unsigned long long)blockIdx.x * k;
    for (int u = threadIdx.x; u < k / 32; u += blockDim.x) {
        float v[32];
        unit_values<T>(wr, u, v);
#pragma unroll
        for (int j = 0; j < 32; ++j) dst[32 * u + j] = v[j];
    }
}

// One entry point per format and kernel (each with its own registers), spelled out: the host,
// the emulator and the tests read the signatures off these lines.

extern "C" __global__ void quant_matvec_q4_0(const unsigned char* w, const float* x, float* out, int rows, int n, int k) {
    quant_matvec<Q4_0>(w, x, out, rows, n, k);
}
extern "C" __global__ void quant_to_bf16_q4_0(const unsigned char* w, bf16* out, int n, int k) {
    quant_to_bf16<Q4_0>(w, out, n, k);
}
extern "C" __global__ void quant_embed_rows_q4_0(const unsigned char* w, const unsigned* tokens, float* out, int k) {
    quant_embed_rows<Q4_0>(w, tokens, out, k);
}

extern "C" __global__ void quant_matvec_q4_1(const unsigned char* w, const float* x, float* out, int rows, int n, int k) {
    quant_matvec<Q4_1>(w, x, out, rows, n, k);
}
extern "C" __global__ void quant_to_bf16_q4_1(const unsigned char* w, bf16* out, int n, int k) {
    quant_to_bf16<Q4_1>(w, out, n, k);
}
extern "C" __global__ void quant_embed_rows_q4_1(const unsigned char* w, const unsigned* tokens, float* out, int k) {
    quant_embed_rows<Q4_1>(w, tokens, out, k);
}

extern "C" __global__ void quant_matvec_q8_0(const unsigned char* w, const float* x, float* out, int rows, int n, int k) {
    quant_matvec<Q8_0>(w, x, out, rows, n, k);
}
extern "C" __global__ void quant_to_bf16_q8_0(const unsigned char* w, bf16* out, int n, int k) {
    quant_to_bf16<Q8_0>(w, out, n, k);
}
extern "C" __global__ void quant_embed_rows_q8_0(const unsigned char* w, const unsigned* tokens, float* out, int k) {
    quant_embed_rows<Q8_0>(w, tokens, out, k);
}

extern "C" __global__ void quant_matvec_q4_k(const unsigned char* w, const float* x, float* out, int rows, int n, int k) {
    quant_matvec<Q4_K>(w, x, out, rows, n, k);
}
extern "C" __global__ void quant_to_bf16_q4_k(const unsigned char* w, bf16* out, int n, int k) {
    quant_to_bf16<Q4_K>(w, out, n, k);
}
extern "C" __global__ void quant_embed_rows_q4_k(const unsigned char* w, const unsigned* tokens, float* out, int k) {
    quant_embed_rows<Q4_K>(w, tokens, out, k);
}

extern "C" __global__ void quant_matvec_q6_k(const unsigned char* w, const float* x, float* out, int rows, int n, int k) {
    quant_matvec<Q6_K>(w, x, out, rows, n, k);
}
extern "C" __global__ void quant_to_bf16_q6_k(const unsigned char* w, bf16* out, int n, int k) {
    quant_to_bf16<Q6_K>(w, out, n, k);
}
extern "C" __global__ void quant_embed_rows_q6_k(const unsigned char* w, const unsigned* tokens, float* out, int k) {
    quant_embed_rows<Q6_K>(w, tokens, out, k);
}
