// emu.cpp — scheduler of the CPU emulator for the duet CUDA kernels (see emu.h, README.md).
//
// Blocks run one after another. Within a block, each thread is a fiber that runs
// until it reaches a __syncthreads or a warp shuffle (or exits), then yields to a
// round-robin scheduler. __syncthreads releases when every live thread of the block
// has arrived (exited threads count as arrived, as on current hardware); a shuffle
// exchanges values once all 32 lanes of the warp have deposited theirs. A full round
// in which no thread arrives anywhere or exits is a deadlock and aborts.
#include "emu.h"

Fiber* g_cur;
dim3 blockIdx, blockDim, gridDim;

static ucontext_t g_sched;
static int g_alive;                        // live threads of the running block
static unsigned long long g_bar_gen;       // __syncthreads generation
static int g_bar_arrived;
static unsigned long long g_events;        // arrivals + exits, for deadlock detection
struct WarpX { unsigned val[32]; unsigned long long gen = 0; int arrived = 0; };
static std::vector<WarpX> g_warps;
static std::function<void()>* g_body;
static const size_t kStackBytes = 256 * 1024;

static void emu_yield() { swapcontext(&g_cur->ctx, &g_sched); }

void emu_syncthreads() {
    g_events++;
    unsigned long long gen = g_bar_gen;
    if (++g_bar_arrived == g_alive) { g_bar_arrived = 0; g_bar_gen++; return; }
    while (g_bar_gen == gen) emu_yield();
}

static int lin_tid() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }

static void warp_barrier(WarpX& w) {
    g_events++;
    unsigned long long gen = w.gen;
    if (++w.arrived == 32) { w.arrived = 0; w.gen++; return; }
    while (w.gen == gen) emu_yield();
}

unsigned emu_shfl(unsigned v, int arg, int mode) {
    int t = lin_tid(); int lane = t & 31; WarpX& w = g_warps[t >> 5];
    w.val[lane] = v;
    warp_barrier(w);  // all lanes have written
    unsigned r;
    if (mode == 0) r = w.val[(lane ^ arg) & 31];
    else if (mode == 1) r = (lane >= arg) ? w.val[lane - arg] : v;
    else r = w.val[arg & 31];
    warp_barrier(w);  // all lanes have read before anyone writes again
    return r;
}

static float bf16_half(unsigned w, int hi) {
    unsigned u = (hi ? w >> 16 : w & 0xffffu) << 16; float f; memcpy(&f, &u, 4); return f;
}

void mma_bf16_16816(float* d, const unsigned* a, const unsigned* b) {
    const int lane = lin_tid() & 31, g = lane >> 2, t = lane & 3;
    // Lane 4g' + s holds A rows g', g'+8 at k = 2s, 2s+1 (a0, a1) and 2s+8, 2s+9 (a2, a3), and
    // B column g' at the same k (b0, b1).
    for (int s = 0; s < 4; s++) {
        unsigned A[4], B[2][2];
        for (int i = 0; i < 4; i++) A[i] = emu_shfl(a[i], 4 * g + s, 2);
        for (int c = 0; c < 2; c++)
            for (int i = 0; i < 2; i++) B[c][i] = emu_shfl(b[i], 4 * (2 * t + c) + s, 2);
        for (int h = 0; h < 2; h++)      // output row g + 8h
            for (int c = 0; c < 2; c++)  // output column 2t + c
                for (int half = 0; half < 2; half++)  // k = 2s + 8*half + {0, 1}
                    for (int e = 0; e < 2; e++)
                        d[2 * h + c] += bf16_half(A[h + 2 * half], e) * bf16_half(B[c][half], e);
    }
}

static void fiber_main() {
    (*g_body)();
    g_cur->done = true; g_alive--; g_events++;
    // An exiting thread may complete a __syncthreads the others are waiting on.
    if (g_bar_arrived > 0 && g_bar_arrived == g_alive) { g_bar_arrived = 0; g_bar_gen++; }
    swapcontext(&g_cur->ctx, &g_sched);
}

void emu_launch(dim3 grid, dim3 block, std::function<void()> body) {
    g_body = &body; gridDim = grid; blockDim = block;
    int n = block.x * block.y * block.z;
    if (n % 32) { fprintf(stderr, "emu: block of %d threads is not whole warps\n", n); abort(); }
    std::vector<Fiber> fibers(n);
    for (auto& f : fibers) f.stack.reset(new char[kStackBytes]);
    for (unsigned bz = 0; bz < grid.z; bz++)
    for (unsigned by = 0; by < grid.y; by++)
    for (unsigned bx = 0; bx < grid.x; bx++) {
        blockIdx = {bx, by, bz};
        g_warps.assign(n / 32, WarpX());
        g_alive = n; g_bar_gen = 0; g_bar_arrived = 0;
        for (int i = 0; i < n; i++) {
            Fiber& f = fibers[i]; f.done = false;
            f.tid = {(unsigned)(i % block.x), (unsigned)((i / block.x) % block.y), (unsigned)(i / (block.x * block.y))};
            getcontext(&f.ctx);
            f.ctx.uc_stack.ss_sp = f.stack.get(); f.ctx.uc_stack.ss_size = kStackBytes;
            f.ctx.uc_link = nullptr;
            makecontext(&f.ctx, fiber_main, 0);
        }
        int remaining = n;
        while (remaining > 0) {
            unsigned long long before = g_events;
            for (int i = 0; i < n; i++) {
                Fiber& f = fibers[i]; if (f.done) continue;
                g_cur = &f; swapcontext(&g_sched, &f.ctx);
                if (f.done) remaining--;
            }
            if (remaining > 0 && g_events == before) {
                fprintf(stderr, "emu: deadlock in block (%u,%u,%u): %d threads wait on a barrier or shuffle "
                        "that the rest of the block never reaches (or exited before)\n", bx, by, bz, remaining);
                abort();
            }
        }
    }
}
