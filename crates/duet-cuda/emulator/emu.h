// emu.h — CPU emulator for the duet CUDA kernels (test-only; see README.md).
//
// Just enough of the CUDA device dialect for the kernel sources to compile as
// plain C++: dim3/vector types, the bit-cast and math intrinsics they use,
// __syncthreads, full-warp __shfl_xor_sync / __shfl_up_sync, and common.cuh's PTX
// wrappers: the bf16 tensor-core product mma_bf16_16816, ldmatrix (x4, plain and
// transposed) and cp.async (16 bytes, commit/wait groups), each a warp exchange that
// moves the data as the PTX ISA specifies. Every CUDA thread of a block is a ucontext
// fiber; blocks of a grid run one at a time. __shared__ variables become
// function-local statics, shared by every fiber of the running block; dynamic shared
// memory (DYNAMIC_SHARED) is one buffer per launch, of the size the test asks for.
#pragma once
#define DUET_EMULATOR 1  // common.cuh takes the emulator's mma_bf16_16816 instead of PTX
#include <ucontext.h>
#include <csetjmp>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <memory>
#include <functional>
#include <algorithm>

struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct uint4 { unsigned x, y, z, w; } __attribute__((aligned(16)));
struct float4 { float x, y, z, w; } __attribute__((aligned(16)));
struct float2 { float x, y; } __attribute__((aligned(8)));
struct uint2 { unsigned x, y; } __attribute__((aligned(8)));
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
// A product rounded on its own (the host compiler contracts nothing: ISO C++17, no -mfma).
inline float __fmul_rn(float a, float b) { return a * b; }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }

// A cp.async copy not landed yet.
struct AsyncCopy {
    void* dst;
    const void* src;
    bool valid;
};

// One emulated CUDA thread.
struct Fiber {
    ucontext_t ctx;                 // its start
    jmp_buf jb;                     // where it waits, once started
    dim3 tid;
    bool started = false, done = false;
    std::unique_ptr<char[]> stack;  // left uninitialised: untouched pages cost nothing
    std::vector<AsyncCopy> copies;  // issued, not landed, in issue order
    std::vector<size_t> group_ends; // committed groups: their end index in `copies`
};
extern Fiber* g_cur;
extern dim3 blockIdx, blockDim, gridDim;
#define threadIdx (g_cur->tid)

void emu_syncthreads();
// mode 0: xor (lane ^ arg), mode 1: up (lane - arg, own value below arg), mode 2: from lane arg.
unsigned emu_shfl(unsigned v, int arg, int mode);
#define __syncthreads() emu_syncthreads()

// The mask is ignored: every lane of the warp must take part (the kernels only
// use FULL_MASK). A shuffle that some lane never reaches is reported as a deadlock.
template <class T> inline T __shfl_xor_sync(unsigned, T v, int o) {
    static_assert(sizeof(T) == 4, "emulated shuffles are 32-bit");
    unsigned u; memcpy(&u, &v, 4); u = emu_shfl(u, o, 0); T r; memcpy(&r, &u, 4); return r;
}
template <class T> inline T __shfl_up_sync(unsigned, T v, int o) {
    static_assert(sizeof(T) == 4, "emulated shuffles are 32-bit");
    unsigned u; memcpy(&u, &v, 4); u = emu_shfl(u, o, 1); T r; memcpy(&r, &u, 4); return r;
}

// mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32 of one warp, d += a·b, with the PTX ISA's
// fragment layout (see prefill_attention.cu): each lane gathers the A rows and B columns of its
// four outputs from the lanes that hold them. Every lane of the warp must call it.
void mma_bf16_16816(float* d, const unsigned* a, const unsigned* b);

// Dynamic shared memory (`extern __shared__` on the GPU): one buffer per launch of the size set by
// emu_set_dynamic_smem, filled with 0xff bytes (bf16 and f32 NaN) before each block.
unsigned char* emu_dynamic_smem();
#define DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(emu_dynamic_smem())
extern "C" void emu_set_dynamic_smem(unsigned bytes);

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8j..8j+7 give the rows of matrix j
// (16 bytes each, 16-byte aligned, inside the dynamic shared memory); lane i receives in r[j]
// row i/4, columns 2(i%4) and 2(i%4)+1 of matrix j, or with .trans column i/4, rows 2(i%4) and
// 2(i%4)+1 (the low half first). Every lane of the warp must call it.
void ldmatrix_x4(unsigned* r, const void* row);
void ldmatrix_x4_trans(unsigned* r, const void* row);

// cp.async.cg.shared.global of 16 bytes (zero-filled when !valid, reading nothing), and its
// commit_group / wait_group. A copy lands when its thread waits for its group: until then the
// destination holds 0xff bytes (NaN), written at the issue, so that reading before the wait, or
// refilling a buffer other warps still read, shows in the results.
void cp_async_16(void* dst, const void* src, bool valid);
void cp_async_commit();
void emu_cp_async_wait(int pending);
template <int N> inline void cp_async_wait() { emu_cp_async_wait(N); }

// Runs body once per thread of every block of the grid (1-D or 3-D blocks).
void emu_launch(dim3 grid, dim3 block, std::function<void()> body);
