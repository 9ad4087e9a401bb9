// emu.cpp — scheduler of the CPU emulator for the duet CUDA kernels (see emu.h, README.md).
//
// Blocks run one after another. Within a block, each thread is a fiber that runs
// until it reaches a __syncthreads or a warp shuffle (or exits), then yields to a
// round-robin scheduler. __syncthreads releases when every live thread of the block
// has arrived (exited threads count as arrived, as on current hardware); a shuffle
// exchanges values once all 32 lanes of the warp have deposited theirs. A full round
// in which no thread arrives anywhere or exits is a deadlock and aborts. The warp-wide PTX
// operations (mma, ldmatrix) are one exchange of every lane's operands, then each lane computes
// its own result from them.
#include "emu.h"

Fiber* g_cur;
dim3 blockIdx, blockDim, gridDim;

// Switches: a fiber starts through its ucontext (setcontext, once a block), and every later
// switch is _setjmp/_longjmp, which unlike swapcontext keeps the signal mask alone (no system call
// a switch; this file is built without _FORTIFY_SOURCE, whose longjmp check rejects a jump to
// another stack).
static jmp_buf g_sched;
static int g_alive;                        // live threads of the running block
static unsigned long long g_bar_gen;       // __syncthreads generation
static int g_bar_arrived;
static unsigned long long g_events;        // arrivals + exits, for deadlock detection
static const int kExchangeWords = 8;
// A warp's exchange slots. Exchange number n (its generation) uses slot n & 1: a lane writes the
// slot of exchange n + 2 only after every lane has arrived at exchange n + 1, which each does after
// reading exchange n's, so one barrier an exchange suffices.
struct WarpX {
    unsigned val[2][32];
    unsigned long long words[2][32][kExchangeWords];
    unsigned long long gen = 0;
    int arrived = 0;
};
static std::vector<WarpX> g_warps;
static std::function<void()>* g_body;
static const size_t kStackBytes = 256 * 1024;
static std::vector<unsigned char> g_dynamic_smem;
static unsigned g_dynamic_smem_bytes;

static void emu_yield() {
    if (!_setjmp(g_cur->jb)) _longjmp(g_sched, 1);
}

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
    unsigned* val = w.val[w.gen & 1];
    val[lane] = v;
    warp_barrier(w);  // all lanes have written
    if (mode == 0) return val[(lane ^ arg) & 31];
    if (mode == 1) return (lane >= arg) ? val[lane - arg] : v;
    return val[arg & 31];
}

static float bf16_half(unsigned w, int hi) {
    unsigned u = (hi ? w >> 16 : w & 0xffffu) << 16; float f; memcpy(&f, &u, 4); return f;
}

// Every lane deposits n (<= kExchangeWords) words; all[lane * n + k] is lane's word k.
static void warp_exchange(const unsigned long long* mine, int n, unsigned long long* all) {
    int t = lin_tid(); int lane = t & 31; WarpX& w = g_warps[t >> 5];
    auto& words = w.words[w.gen & 1];
    memcpy(words[lane], mine, n * sizeof(unsigned long long));
    warp_barrier(w);  // all lanes have written
    for (int l = 0; l < 32; l++) memcpy(all + l * n, words[l], n * sizeof(unsigned long long));
}

void mma_bf16_16816(float* d, const unsigned* a, const unsigned* b) {
    const int lane = lin_tid() & 31, g = lane >> 2, t = lane & 3;
    unsigned long long mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]}, all[32 * 6];
    warp_exchange(mine, 6, all);
    // Lane 4g' + s holds A rows g', g'+8 at k = 2s, 2s+1 (a0, a1) and 2s+8, 2s+9 (a2, a3), and
    // B column g' at the same k (b0, b1).
    for (int s = 0; s < 4; s++) {
        unsigned A[4], B[2][2];
        for (int i = 0; i < 4; i++) A[i] = (unsigned)all[(4 * g + s) * 6 + i];
        for (int c = 0; c < 2; c++)
            for (int i = 0; i < 2; i++) B[c][i] = (unsigned)all[(4 * (2 * t + c) + s) * 6 + 4 + i];
        for (int h = 0; h < 2; h++)      // output row g + 8h
            for (int c = 0; c < 2; c++)  // output column 2t + c
                for (int half = 0; half < 2; half++)  // k = 2s + 8*half + {0, 1}
                    for (int e = 0; e < 2; e++)
                        d[2 * h + c] += bf16_half(A[h + 2 * half], e) * bf16_half(B[c][half], e);
    }
}

unsigned char* emu_dynamic_smem() { return g_dynamic_smem.data(); }

extern "C" void emu_set_dynamic_smem(unsigned bytes) { g_dynamic_smem_bytes = bytes; }

// Aborts unless [p, p + bytes) is 16-byte aligned and inside the dynamic shared memory.
static void check_shared(const char* what, const void* p, size_t bytes) {
    const unsigned char* u = static_cast<const unsigned char*>(p);
    const unsigned char* base = g_dynamic_smem.data();
    if (u < base || u + bytes > base + g_dynamic_smem_bytes || ((uintptr_t)u & 15)) {
        fprintf(stderr, "emu: %s at %p: not 16-byte aligned inside the %u bytes of dynamic shared memory "
                "(block (%u,%u,%u), thread %u)\n", what, p, g_dynamic_smem_bytes, blockIdx.x, blockIdx.y,
                blockIdx.z, threadIdx.x);
        abort();
    }
}

static void ldmatrix(unsigned* r, const void* row, bool trans) {
    const int lane = lin_tid() & 31;
    unsigned long long mine = (uintptr_t)row, rows[32];
    warp_exchange(&mine, 1, rows);
    for (int l = 0; l < 32; l++) check_shared("ldmatrix row", (const void*)rows[l], 16);
    const int q = lane >> 2, p = lane & 3;
    for (int j = 0; j < 4; j++) {
        unsigned lo, hi;
        if (!trans) {  // row q, columns 2p, 2p+1
            unsigned short e[2];
            memcpy(e, (const unsigned char*)rows[8 * j + q] + 4 * p, 4);
            lo = e[0]; hi = e[1];
        } else {  // column q, rows 2p, 2p+1
            unsigned short e0, e1;
            memcpy(&e0, (const unsigned char*)rows[8 * j + 2 * p] + 2 * q, 2);
            memcpy(&e1, (const unsigned char*)rows[8 * j + 2 * p + 1] + 2 * q, 2);
            lo = e0; hi = e1;
        }
        r[j] = lo | (hi << 16);
    }
}

void ldmatrix_x4(unsigned* r, const void* row) { ldmatrix(r, row, false); }
void ldmatrix_x4_trans(unsigned* r, const void* row) { ldmatrix(r, row, true); }

void cp_async_16(void* dst, const void* src, bool valid) {
    check_shared("cp.async destination", dst, 16);
    if (valid && ((uintptr_t)src & 15)) {
        fprintf(stderr, "emu: cp.async source %p is not 16-byte aligned\n", src);
        abort();
    }
    memset(dst, 0xff, 16);
    g_cur->copies.push_back({dst, src, valid});
}

void cp_async_commit() { g_cur->group_ends.push_back(g_cur->copies.size()); }

void emu_cp_async_wait(int pending) {
    Fiber& f = *g_cur;
    const int groups = (int)f.group_ends.size();
    if (groups <= pending) return;
    const size_t landed = f.group_ends[groups - pending - 1];
    for (size_t i = 0; i < landed; i++) {
        const AsyncCopy& c = f.copies[i];
        if (c.valid) memcpy(c.dst, c.src, 16);
        else memset(c.dst, 0, 16);
    }
    f.copies.erase(f.copies.begin(), f.copies.begin() + landed);
    f.group_ends.erase(f.group_ends.begin(), f.group_ends.begin() + (groups - pending));
    for (size_t& e : f.group_ends) e -= landed;
}

static void fiber_main() {
    (*g_body)();
    g_cur->done = true; g_alive--; g_events++;
    // An exiting thread may complete a __syncthreads the others are waiting on.
    if (g_bar_arrived > 0 && g_bar_arrived == g_alive) { g_bar_arrived = 0; g_bar_gen++; }
    _longjmp(g_sched, 1);  // the fiber's stack is left as it is: the fiber never resumes
}

void emu_launch(dim3 grid, dim3 block, std::function<void()> body) {
    g_body = &body; gridDim = grid; blockDim = block;
    int n = block.x * block.y * block.z;
    if (n % 32) { fprintf(stderr, "emu: block of %d threads is not whole warps\n", n); abort(); }
    std::vector<Fiber> fibers(n);
    for (auto& f : fibers) f.stack.reset(new char[kStackBytes]);
    g_dynamic_smem.assign(g_dynamic_smem_bytes, 0xff);
    for (unsigned bz = 0; bz < grid.z; bz++)
    for (unsigned by = 0; by < grid.y; by++)
    for (unsigned bx = 0; bx < grid.x; bx++) {
        blockIdx = {bx, by, bz};
        g_warps.assign(n / 32, WarpX());
        g_alive = n; g_bar_gen = 0; g_bar_arrived = 0;
        std::fill(g_dynamic_smem.begin(), g_dynamic_smem.end(), 0xff);
        for (int i = 0; i < n; i++) {
            Fiber& f = fibers[i]; f.done = false; f.started = false;
            f.copies.clear(); f.group_ends.clear();
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
                g_cur = &f;
                if (!_setjmp(g_sched)) {
                    if (f.started) _longjmp(f.jb, 1);
                    f.started = true;
                    setcontext(&f.ctx);
                }
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
