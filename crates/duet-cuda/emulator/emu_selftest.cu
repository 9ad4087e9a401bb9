// emu_selftest.cu — kernels that check the emulator's own models of ldmatrix and cp.async
// (emu.cpp) against the PTX ISA, through t_emu_selftest.py. Not a duet kernel: the backend never
// loads it; scripts/test-kernels-emulated.sh runs it with the kernel files.

// Lane l gives row `rows[l]` of a 32x8 bf16 matrix in shared memory (copied there by cp.async);
// out[4l + j] is the lane's register j of ldmatrix.x4 (trans != 0: .trans).
extern "C" __global__ void emu_selftest_ldmatrix(const bf16* src, const unsigned* rows, int trans,
                                                 unsigned* out) {
    DYNAMIC_SHARED(bf16, tile);
    const int lane = threadIdx.x;
    cp_async_16(tile + lane * 8, src + lane * 8, true);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    unsigned r[4];
    if (trans) ldmatrix_x4_trans(r, tile + rows[lane] * 8);
    else ldmatrix_x4(r, tile + rows[lane] * 8);
    for (int j = 0; j < 4; ++j) out[4 * lane + j] = r[j];
}

// Thread 0 issues three 16-byte copies in two groups (the second zero-filled), and records the
// shared memory after each wait: snapshot 0 after wait_group 1 (the first group landed, the
// second not yet), snapshot 1 after wait_group 0 (both).
extern "C" __global__ void emu_selftest_cp_async(const bf16* src, bf16* snapshots) {
    DYNAMIC_SHARED(bf16, buf);
    if (threadIdx.x != 0) return;
    cp_async_16(buf, src, true);
    cp_async_16(buf + 8, src + 8, true);
    cp_async_commit();
    cp_async_16(buf + 16, src + 16, false);
    cp_async_commit();
    cp_async_wait<1>();
    for (int i = 0; i < 24; ++i) snapshots[i] = buf[i];
    cp_async_wait<0>();
    for (int i = 0; i < 24; ++i) snapshots[24 + i] = buf[i];
}
