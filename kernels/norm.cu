// norm.cu — RMSNorm in f32: out = x * rsqrt(mean(x^2) + eps) * w.
//
// Launch (both kernels): grid.x = number of rows, block = 256 threads
// (any multiple of 32 up to 1024 works), no dynamic shared memory.
// One block normalises one row of `cols` f32 values. `w` has `cols` entries.
//
// When cols % 4 == 0 (and the pointers are 16-byte aligned) the kernels use
// 16-byte accesses and keep up to NORM_CACHE_VEC float4 per thread in
// registers (cols <= 8192 at block 256), so every input is read once; larger
// rows re-read the part that did not fit. Other widths take a scalar path.
//
// rms_norm(x, w, out, out_bf16, cols, eps)
// add_rms_norm(residual, delta, w, out, out_bf16, cols, eps)
//   residual += delta (written back), then out = rms_norm(residual) * w.
//   `out` may not alias `residual` or `delta`.
// out_bf16, unless null, gets `out` rounded to bf16 as well: the next matrix product's operand,
// which then needs no cast of its own.

#define NORM_CACHE_VEC 8

__device__ __forceinline__ float sq4(float4 v) {
    return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
}

__device__ __forceinline__ float4 scale4(float4 v, float s, float4 w) {
    return make_float4(v.x * s * w.x, v.y * s * w.y, v.z * s * w.z, v.w * s * w.w);
}

__device__ __forceinline__ bool aligned16(const void* p) {
    return (((unsigned long long)p) & 15ull) == 0;
}

// Shared body. If `delta` is non-null, x is the residual stream: x += delta is
// stored back before normalising.
__device__ __forceinline__ void store4(float4* o4, bf16* ob, int i, float4 v) {
    o4[i] = v;
    if (ob) {
        uint2 packed;
        packed.x = pack_bf16x2(v.x, v.y);
        packed.y = pack_bf16x2(v.z, v.w);
        reinterpret_cast<uint2*>(ob)[i] = packed;
    }
}

__device__ __forceinline__ void rms_norm_row(float* x_mut, const float* x, const float* delta,
                                             const float* w, float* out, bf16* out_bf16,
                                             int cols, float eps) {
    const unsigned long long base = (unsigned long long)blockIdx.x * (unsigned long long)cols;
    const float* xr = x + base;
    float* orow = out + base;
    bf16* obrow = out_bf16 ? out_bf16 + base : nullptr;
    float* xw = x_mut ? x_mut + base : nullptr;
    const float* dr = delta ? delta + base : nullptr;

    const bool vec = (cols & 3) == 0 && aligned16(xr) && aligned16(orow) && aligned16(w) &&
                     (dr == nullptr || aligned16(dr));
    float ss = 0.0f;
    if (vec) {
        const int n4 = cols >> 2;
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        const float4* d4 = reinterpret_cast<const float4*>(dr);
        float4* xw4 = reinterpret_cast<float4*>(xw);
        const float4* w4 = reinterpret_cast<const float4*>(w);
        float4* o4 = reinterpret_cast<float4*>(orow);
        const int stride = blockDim.x;
        float4 cache[NORM_CACHE_VEC];
#pragma unroll
        for (int k = 0; k < NORM_CACHE_VEC; ++k) {
            const int i = threadIdx.x + k * stride;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (i < n4) {
                v = x4[i];
                if (d4) {
                    const float4 d = d4[i];
                    v.x += d.x; v.y += d.y; v.z += d.z; v.w += d.w;
                    xw4[i] = v;
                }
            }
            cache[k] = v;
            ss += sq4(v);
        }
        // Tail beyond the register cache (very wide rows only).
        for (int i = threadIdx.x + NORM_CACHE_VEC * stride; i < n4; i += stride) {
            float4 v = x4[i];
            if (d4) {
                const float4 d = d4[i];
                v.x += d.x; v.y += d.y; v.z += d.z; v.w += d.w;
                xw4[i] = v;
            }
            ss += sq4(v);
        }
        ss = block_sum(ss);
        const float inv = rsqrtf(ss / (float)cols + eps);
#pragma unroll
        for (int k = 0; k < NORM_CACHE_VEC; ++k) {
            const int i = threadIdx.x + k * stride;
            if (i < n4) store4(o4, obrow, i, scale4(cache[k], inv, w4[i]));
        }
        for (int i = threadIdx.x + NORM_CACHE_VEC * stride; i < n4; i += stride) {
            // Written by this same thread above (when fused), so it is visible.
            const float4 v = d4 ? reinterpret_cast<const float4*>(xw)[i] : x4[i];
            store4(o4, obrow, i, scale4(v, inv, w4[i]));
        }
    } else {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            float v = xr[c];
            if (dr) {
                v += dr[c];
                xw[c] = v;
            }
            ss += v * v;
        }
        ss = block_sum(ss);
        const float inv = rsqrtf(ss / (float)cols + eps);
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            const float v = dr ? xw[c] : xr[c];
            orow[c] = v * inv * w[c];
            if (obrow) obrow[c] = f32_to_bf16(orow[c]);
        }
    }
}

extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, bf16* out_bf16,
                                    int cols, float eps) {
    rms_norm_row(nullptr, x, nullptr, w, out, out_bf16, cols, eps);
}

extern "C" __global__ void add_rms_norm(float* residual, const float* delta, const float* w,
                                        float* out, bf16* out_bf16, int cols, float eps) {
    rms_norm_row(residual, residual, delta, w, out, out_bf16, cols, eps);
}
