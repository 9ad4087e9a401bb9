// fp8_weights.cu — the kernels around an FP8 weight matrix's product (cuBLASLt's FP8 GEMM
// multiplies E4M3 values alone, in f32; the scales are ours):
//   * quantize_rows_e4m3: the product's f32 input to E4M3 a row (token) at a time, with the
//     row's scale amax/448 (1 for a row of zeros), or one static scale for every row (a
//     checkpoint's input_scale); values round to nearest even and saturate at ±448.
//   * fp8_scale_output: the product's f32 output times its input row's scale and its weight
//     row's (output column's) scale.
// The rounding is common.cuh's f32_to_e4m3 (the KV cache's too), the same as
// duet_model::fp8::e4m3_from_f32's (the CPU quantizer of --quantization fp8), checked in the
// emulator against ml_dtypes' float8_e4m3fn; divisions are IEEE (NVRTC's default
// -prec-div=true), as numpy's.

#define E4M3_MAX 448.0f

// One block per row of x [rows][cols]; blockDim.x a multiple of 32. static_scale > 0 quantizes
// every row with it; otherwise each row with its own amax/448.
extern "C" __global__ void quantize_rows_e4m3(const float* __restrict__ x,
                                              unsigned char* __restrict__ xq,
                                              float* __restrict__ scales, int rows, int cols,
                                              float static_scale) {
    const int row = blockIdx.x;
    if (row >= rows) return;
    const float* xr = x + (size_t)row * cols;
    float scale = static_scale;
    if (!(static_scale > 0.0f)) {
        float amax = 0.0f;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) amax = fmaxf(amax, fabsf(xr[c]));
        amax = block_max(amax);
        scale = amax > 0.0f ? amax / E4M3_MAX : 1.0f;
    }
    if (threadIdx.x == 0) scales[row] = scale;
    unsigned char* qr = xq + (size_t)row * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) qr[c] = (unsigned char)f32_to_e4m3(xr[c] / scale);
}

// out[r][c] *= row_scales[r] * col_scales[c] over out [rows][cols] (grid-stride).
extern "C" __global__ void fp8_scale_output(float* __restrict__ out,
                                            const float* __restrict__ row_scales,
                                            const float* __restrict__ col_scales, int rows,
                                            int cols) {
    const unsigned long long n = (unsigned long long)rows * cols;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const int r = (int)(i / cols), c = (int)(i % cols);
        out[i] = out[i] * (row_scales[r] * col_scales[c]);
    }
}
