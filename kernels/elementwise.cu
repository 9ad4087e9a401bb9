// elementwise.cu — small f32 elementwise kernels.
//
// Launch, unless stated otherwise: any grid (grid-stride loops; e.g.
// grid.x = min(ceil(n / 256), 65535)), block = 256 threads (any size works),
// no shared memory. Element counts are 64-bit where the signature says so.
//
// silu_mul(gate, up, n)                 gate[i] = silu(gate[i]) * up[i]
// silu_mul_stacked(gate_up, out, out_bf16, rows, inter)
//                                       gate_up is [rows][2*inter] = [gate | up];
//                                       out[r][i] = silu(gate[r][i]) * up[r][i], and
//                                       out_bf16 the same rounded to bf16 (the next
//                                       matmul's operand, so that it skips a cast)
// add_inplace(x, y, n)                  x[i] += y[i]
// add_bias_rows(x, bias, rows, cols)    x[r][c] += bias[c]
// f32_to_bf16_n(x, out, n)              out[i] = bf16(x[i]) (round to nearest even)
// copy_cols(x, rows, cols, col_start, width, out)
//                                       out[r][j] = x[r][col_start + j], j < width
//                                       (out is [rows][width])
// gather_rows(x, rows, out, cols)       out[i][c] = x[rows[i]][c]
//                                       Launch: grid.x = number of output rows
//                                       (exact), block = 256 (any).
// scatter_add_rows(out, y, rows, weights, cols)
//                                       out[rows[i]][c] += weights[i] * y[i][c]; the rows
//                                       are distinct (no two blocks write one row).
//                                       Launch: grid.x = number of rows of y (exact),
//                                       block = 256 (any).
//
// silu(v) = v / (1 + expf(-v)).

__device__ __forceinline__ float silu_f(float v) {
    return v / (1.0f + expf(-v));
}

// q = i / w, r = i % w, with a cheap 32-bit path when i fits in 32 bits.
__device__ __forceinline__ void divmod64(unsigned long long i, unsigned long long w,
                                         unsigned long long& q, unsigned long long& r) {
    if ((i >> 32) == 0 && (w >> 32) == 0) {
        const unsigned q32 = (unsigned)i / (unsigned)w;
        q = q32;
        r = (unsigned)i - q32 * (unsigned)w;
    } else {
        q = i / w;
        r = i - q * w;
    }
}

__device__ __forceinline__ unsigned long long gtid() {
    return (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ unsigned long long gstride() {
    return (unsigned long long)gridDim.x * blockDim.x;
}

extern "C" __global__ void silu_mul(float* gate, const float* up, unsigned long long n) {
    for (unsigned long long i = gtid(); i < n; i += gstride()) gate[i] = silu_f(gate[i]) * up[i];
}

extern "C" __global__ void silu_mul_stacked(const float* gate_up, float* out, bf16* out_bf16,
                                            int rows, int inter) {
    const unsigned long long w = (unsigned long long)inter;
    const unsigned long long n = (unsigned long long)rows * w;
    for (unsigned long long i = gtid(); i < n; i += gstride()) {
        unsigned long long r, c;
        divmod64(i, w, r, c);
        const float* row = gate_up + r * 2ull * w;
        const float v = silu_f(row[c]) * row[w + c];
        out[i] = v;
        out_bf16[i] = f32_to_bf16(v);
    }
}

extern "C" __global__ void add_inplace(float* x, const float* y, unsigned long long n) {
    for (unsigned long long i = gtid(); i < n; i += gstride()) x[i] += y[i];
}

extern "C" __global__ void add_bias_rows(float* x, const float* bias, int rows, int cols) {
    const unsigned long long w = (unsigned long long)cols;
    const unsigned long long n = (unsigned long long)rows * w;
    for (unsigned long long i = gtid(); i < n; i += gstride()) {
        unsigned long long r, c;
        divmod64(i, w, r, c);
        x[i] += bias[c];
    }
}

extern "C" __global__ void f32_to_bf16_n(const float* x, bf16* out, unsigned long long n) {
    for (unsigned long long i = gtid(); i < n; i += gstride()) out[i] = f32_to_bf16(x[i]);
}

extern "C" __global__ void copy_cols(const float* x, int rows, int cols, int col_start, int width,
                                     float* out) {
    const unsigned long long w = (unsigned long long)width;
    const unsigned long long n = (unsigned long long)rows * w;
    for (unsigned long long i = gtid(); i < n; i += gstride()) {
        unsigned long long r, j;
        divmod64(i, w, r, j);
        out[i] = x[r * (unsigned long long)cols + (unsigned long long)col_start + j];
    }
}

extern "C" __global__ void gather_rows(const float* x, const unsigned* rows, float* out,
                                       int cols) {
    const unsigned long long i = blockIdx.x;
    const float* src = x + (unsigned long long)rows[i] * (unsigned long long)cols;
    float* dst = out + i * (unsigned long long)cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = src[c];
}

extern "C" __global__ void scatter_add_rows(float* out, const float* y, const unsigned* rows,
                                            const float* weights, int cols) {
    const unsigned long long i = blockIdx.x;
    float* dst = out + (unsigned long long)rows[i] * (unsigned long long)cols;
    const float* src = y + i * (unsigned long long)cols;
    const float w = weights[i];
    for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] += w * src[c];
}
