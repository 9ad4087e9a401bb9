#!/usr/bin/env python3
"""gen.py — turns one duet kernel file into a C++ translation unit for the CPU emulator.

Usage: gen.py [--kernels DIR] KERNEL.cu OUT.cpp

Writes emu.h's include, then common.cuh and the kernel file (prepended exactly as the
host does for NVRTC), then one extern "C" launcher per kernel:
    L_<kernel>(grid_x, grid_y, grid_z, block_x, <the kernel's own parameters>)
which harness.py calls through ctypes. common.cuh is read from DIR, by default the
repository's kernels/.
"""
import os
import re
import sys

KERNELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', '..', 'kernels')
SIG = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(([^)]*)\)')


def main():
    args = sys.argv[1:]
    kernels = KERNELS
    if args[:1] == ['--kernels'] and len(args) > 1:
        kernels, args = args[1], args[2:]
    if len(args) != 2:
        sys.exit(__doc__)
    kernel_file, out = args
    with open(os.path.join(kernels, 'common.cuh')) as f:
        body = f.read()
    with open(kernel_file) as f:
        body += '\n' + f.read()
    sigs = SIG.findall(body)
    if not sigs:
        sys.exit(f'gen.py: no extern "C" __global__ kernels found in {kernel_file}')
    parts = ['#include "emu.h"', body]
    for name, params in sigs:
        names = [re.split(r'[\s*]+', p.strip())[-1] for p in params.split(',')]
        parts.append(
            f'extern "C" void L_{name}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, {params}) '
            f'{{ emu_launch(dim3{{gx,gy,gz}}, dim3{{bx,1,1}}, [&]{{ {name}({", ".join(names)}); }}); }}')
    with open(out, 'w') as f:
        f.write('\n'.join(parts) + '\n')


if __name__ == '__main__':
    main()
