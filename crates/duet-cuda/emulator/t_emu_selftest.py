"""The emulator's ldmatrix and cp.async (emu.cpp) against the PTX ISA's description of them, so that
a kernel checked in the emulator loads what the GPU loads.

ldmatrix.sync.aligned.m8n8.x4.b16 (PTX ISA, "Warp-level matrix load instruction: ldmatrix"): lanes
8j..8j+7 give the row addresses of matrix j; each lane receives one 32-bit register per matrix,
holding the elements of row lane/4 at columns 2(lane%4) and 2(lane%4)+1, the lower column in the
lower half; with .trans the matrix is read column-major: column lane/4, rows 2(lane%4), +1.
cp.async: a copy is complete for its thread once a cp.async.wait_group leaves fewer of its
committed groups in flight than the copy's group is from the newest; src-size 0 fills zeros."""
from harness import *

rng = np.random.default_rng(3)
LIB = 'emu_selftest'

m = rng.integers(0, 0xffff, (32, 8)).astype(np.uint16)  # 32 rows of 8 b16
rows = rng.permutation(32).astype(np.uint32)  # lane l points at row rows[l]
for trans in (0, 1):
    out = np.zeros(128, np.uint32)
    launch(LIB, 'emu_selftest_ldmatrix', (1,), 32, m, rows, c_int(trans), out, smem=32 * 16)
    want = np.zeros((32, 4), np.uint32)
    for lane in range(32):
        for j in range(4):
            mat = m[rows[8 * j:8 * j + 8]]  # matrix j: row r is the row lane 8j + r points at
            g, t = lane // 4, lane % 4
            lo, hi = (mat[g, 2 * t], mat[g, 2 * t + 1]) if not trans else (mat[2 * t, g], mat[2 * t + 1, g])
            want[lane, j] = int(lo) | (int(hi) << 16)
    check(f'ldmatrix.x4{".trans" if trans else ""} as the PTX ISA lays it out',
          np.array_equal(out.reshape(32, 4), want))

src = rng.integers(0, 0x7f00, 24).astype(np.uint16)
snap = np.zeros(48, np.uint16)
launch(LIB, 'emu_selftest_cp_async', (1,), 32, src, snap, smem=64)
first, second = snap[:24], snap[24:]
check('cp.async: wait_group 1 lands the older group only',
      np.array_equal(first[:16], src[:16]) and np.all(first[16:] == 0xffff))
check('cp.async: wait_group 0 lands every group, src-size 0 zero-fills',
      np.array_equal(second[:16], src[:16]) and np.all(second[16:] == 0))
finish()
