// common.cuh — shared definitions for every duet CUDA kernel file.
//
// The host does NOT #include this file: it compiles each kernel file with
// NVRTC as the text of this file followed by the text of the kernel file.
// NVRTC runs without any CUDA headers, so nothing here may include one
// (no cuda_bf16.h, no <cstdint>, no <cfloat>).
//
// Contents:
//   * bf16 as raw `unsigned short` bits, with f32 conversions
//     (bf16_to_f32 is exact; f32_to_bf16 rounds to nearest even, NaN stays NaN).
//   * NEG_INF, FULL_MASK.
//   * Warp reductions (warp_sum, warp_max) via __shfl_xor_sync. The xor
//     butterfly leaves the bitwise identical result in every lane.
//   * Block reductions (block_sum, block_max) for blockDim.x a multiple of 32,
//     up to 1024 (1-D blocks). Every thread of the block must call them (they
//     contain __syncthreads) and every thread gets the same, bitwise identical,
//     result, so it may drive uniform control flow. Back-to-back calls are safe.
//   * Helpers for 16-byte loads of 8 bf16 values.
//   * mma_bf16_16816: one warp's bf16 tensor-core product (sm_80 and later).
//   * DYNAMIC_SHARED, ldmatrix_x4[_trans], cp_async_16 / cp_async_commit / cp_async_wait: dynamic
//     shared memory and the sm_80 shared-memory instructions of the tiled attention kernels.
//   * rope_pair: one rotary pair turned (rope.cu and qkv_rope_kv.cu share it, so the fused
//     and the separate kernels compute the same bits).
//   * E4M3 (FP8) conversions and the KV cache's element types, KvBf16 and KvE4m3: what the KV
//     write and the attention kernels are written over, once for both caches.

typedef unsigned short bf16;

#define NEG_INF __int_as_float(0xff800000)
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float bf16_to_f32(bf16 b) {
    return __uint_as_float(((unsigned)b) << 16);
}

__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        // NaN: keep the sign and the top mantissa bits, force a quiet NaN.
        return (bf16)((u >> 16) | 0x0040u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    return (bf16)(u >> 16);
}

// Two bf16 packed in one 32-bit word (low half = first element).
__device__ __forceinline__ float bf16lo_to_f32(unsigned w) {
    return __uint_as_float(w << 16);
}
__device__ __forceinline__ float bf16hi_to_f32(unsigned w) {
    return __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ unsigned pack_bf16x2(float a, float b) {
    return (unsigned)f32_to_bf16(a) | ((unsigned)f32_to_bf16(b) << 16);
}

// Unpack 8 bf16 held in a uint4 (as loaded by a 16-byte load) into f32.
__device__ __forceinline__ void bf16x8_to_f32(uint4 v, float* o) {
    o[0] = bf16lo_to_f32(v.x); o[1] = bf16hi_to_f32(v.x);
    o[2] = bf16lo_to_f32(v.y); o[3] = bf16hi_to_f32(v.y);
    o[4] = bf16lo_to_f32(v.z); o[5] = bf16hi_to_f32(v.z);
    o[6] = bf16lo_to_f32(v.w); o[7] = bf16hi_to_f32(v.w);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sum over the whole (1-D) block. blockDim.x must be a multiple of 32, <= 1024.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float block_sum_scratch[32];
    const int lane = threadIdx.x & 31;
    const int wid = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // a previous call may still be reading the scratch
    if (lane == 0) block_sum_scratch[wid] = v;
    __syncthreads();
    float r = (lane < nwarps) ? block_sum_scratch[lane] : 0.0f;
    return warp_sum(r);
}

// Max over the whole (1-D) block. blockDim.x must be a multiple of 32, <= 1024.
__device__ __forceinline__ float block_max(float v) {
    __shared__ float block_max_scratch[32];
    const int lane = threadIdx.x & 31;
    const int wid = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) block_max_scratch[wid] = v;
    __syncthreads();
    float r = (lane < nwarps) ? block_max_scratch[lane] : NEG_INF;
    return warp_max(r);
}

// Pair i of a head at position `pos`, rotate-half convention: the angle pos * inv_freq (f32, as
// HF computes it), cos and sin scaled by `scale` (YaRN's attention factor; 1 otherwise).
__device__ __forceinline__ void rope_pair(float x1, float x2, unsigned pos, float inv_freq,
                                          float scale, float& y1, float& y2) {
    const float angle = (float)pos * inv_freq;
    float s, c;
    sincosf(angle, &s, &c);
    c *= scale;
    s *= scale;
    y1 = x1 * c - x2 * s;
    y2 = x2 * c + x1 * s;
}

// ---- E4M3 (float8_e4m3fn): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no
// infinities, S.1111.111 is NaN; largest finite 448, smallest subnormal 2^-9. Every E4M3 value is
// exact in f16, bf16 and f32. ----

// f32 -> E4M3, round to nearest even; finite values past 448 and infinities saturate to ±448 (as
// PTX's cvt.rn.satfinite), NaN -> S.1111.111. Integer arithmetic only, so the emulator and every
// GPU compute the same bits.
__device__ __forceinline__ unsigned f32_to_e4m3(float f) {
    const unsigned u = __float_as_uint(f);
    const unsigned sign = (u >> 24) & 0x80u;
    const unsigned a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7fu;  // NaN
    if (a >= 0x43e00000u) return sign | 0x7eu;  // >= 448
    if (a >= 0x3c800000u) {                     // >= 2^-6: a normal E4M3, 3 of 23 mantissa bits kept
        const unsigned r = a + 0x7ffffu + ((a >> 20) & 1u);
        return sign | ((r >> 20) - (120u << 3));  // exponent rebiased from 127 to 7 (a carry is fine)
    }
    // Below 2^-6: a multiple of 2^-9 (8 of them is the smallest normal, 0x08).
    const unsigned e = a >> 23;
    if (e < 117u) return sign;  // below 2^-10: rounds to zero
    const unsigned mant = 0x800000u | (a & 0x7fffffu);  // the value is mant · 2^(e - 150)
    const unsigned shift = 141u - e;                     // to units of 2^-9: 21..24
    const unsigned q = mant >> shift;
    const unsigned rest = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    return sign | (q + ((rest > half || (rest == half && (q & 1u))) ? 1u : 0u));
}

// E4M3 -> f32, exactly.
__device__ __forceinline__ float e4m3_to_f32(unsigned b) {
    const unsigned e = (b >> 3) & 15u, m = b & 7u;
    float mag = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;
    if ((b & 0x7fu) == 0x7fu) mag = __uint_as_float(0x7fc00000u);
    return (b & 0x80u) ? -mag : mag;
}

// Two E4M3 (the low byte first) -> f32. On sm_89 and later the hardware conversion to f16, which
// is exact, as e4m3_to_f32 is: the same numbers.
__device__ __forceinline__ void e4m3x2_to_f32(unsigned two, float& lo, float& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h2) : "h"((unsigned short)two));
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}\n"
        : "=f"(lo), "=f"(hi)
        : "r"(h2));
#else
    lo = e4m3_to_f32(two & 0xffu);
    hi = e4m3_to_f32((two >> 8) & 0xffu);
#endif
}

// ---- The KV cache's element types. A bf16 cache stores values as they round; an E4M3 cache
// stores x / scale (one scale per layer for K, one for V) and is read back as e4m3 · scale, the
// scale applied outside the products: the attention kernels fold K's into the logits' scale and
// V's into the output, so the values they multiply are the stored ones, exact in bf16. ----
struct KvBf16 {
    typedef bf16 Elem;
    typedef uint4 Chunk8;  // 8 values, one 16-byte load
    __device__ __forceinline__ static Elem from_f32(float x, float) { return f32_to_bf16(x); }
    // Two neighbouring values, one 4-byte store.
    __device__ __forceinline__ static void store_pair(Elem* p, float a, float b, float) {
        *reinterpret_cast<unsigned*>(p) = pack_bf16x2(a, b);
    }
    __device__ __forceinline__ static Chunk8 zero8() { return make_uint4(0u, 0u, 0u, 0u); }
    __device__ __forceinline__ static void to_f32x8(Chunk8 c, float* o) { bf16x8_to_f32(c, o); }
    __device__ __forceinline__ static uint4 to_bf16x8(Chunk8 c) { return c; }
};

struct KvE4m3 {
    typedef unsigned char Elem;
    typedef uint2 Chunk8;  // 8 values, one 8-byte load
    __device__ __forceinline__ static Elem from_f32(float x, float scale) {
        return (Elem)f32_to_e4m3(x / scale);
    }
    // Two neighbouring values, one 2-byte store.
    __device__ __forceinline__ static void store_pair(Elem* p, float a, float b, float scale) {
        *reinterpret_cast<unsigned short*>(p) =
            (unsigned short)(f32_to_e4m3(a / scale) | (f32_to_e4m3(b / scale) << 8));
    }
    __device__ __forceinline__ static Chunk8 zero8() { return make_uint2(0u, 0u); }
    __device__ __forceinline__ static void to_f32x8(Chunk8 c, float* o) {
        e4m3x2_to_f32(c.x, o[0], o[1]);
        e4m3x2_to_f32(c.x >> 16, o[2], o[3]);
        e4m3x2_to_f32(c.y, o[4], o[5]);
        e4m3x2_to_f32(c.y >> 16, o[6], o[7]);
    }
    // Exact: an E4M3 value's f32 bits end in 16 zeros.
    __device__ __forceinline__ static uint4 to_bf16x8(Chunk8 c) {
        float f[8];
        to_f32x8(c, f);
        unsigned w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
            w[i] = (__float_as_uint(f[2 * i]) >> 16) | (__float_as_uint(f[2 * i + 1]) & 0xffff0000u);
        return make_uint4(w[0], w[1], w[2], w[3]);
    }
};

// d += a·b for one warp: mma.sync m16n8k16, bf16 operands, f32 accumulators (fragment layout in
// prefill_attention.cu). Every lane of the warp must call it. The CPU emulator defines its own.
#ifndef DUET_EMULATOR
__device__ __forceinline__ void mma_bf16_16816(float* d, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// The block's dynamic shared memory (sized at launch), as `type* name`.
// ldmatrix.sync.aligned.m8n8.x4: lanes 8j..8j+7 give the 16-byte rows of 8x8 b16 matrix j; lane i
// gets in r[j] row i/4, columns 2(i%4), 2(i%4)+1 of matrix j (with _trans: column i/4, rows 2(i%4)
// and 2(i%4)+1), the lower column (row) in the low half. Rows must be 16-byte aligned.
// cp_async_16: a 16-byte global-to-shared copy that bypasses L1 (.cg), zero-filled when !valid
// (nothing is read then); cp_async_commit closes the thread's group of copies, and
// cp_async_wait<N> waits until at most N of its committed groups are still in flight. Other
// threads see the data after a __syncthreads that follows the wait.
// The CPU emulator defines all of these itself (emu.h).
#ifndef DUET_EMULATOR
#define DYNAMIC_SHARED(type, name) \
    extern __shared__ __align__(16) unsigned char name##_bytes[]; \
    type* name = reinterpret_cast<type*>(name##_bytes)

__device__ __forceinline__ unsigned shared_address(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void ldmatrix_x4(unsigned* r, const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
}

__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(shared_address(dst)), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
#endif
