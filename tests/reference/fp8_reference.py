"""FP8 (E4M3) weight quantization as vLLM and llm-compressor do it, in numpy with ml_dtypes'
float8_e4m3fn as the encoder (independent of duet): a scale per output row, amax / 448 (1 for a
row of zeros), each value rounded to nearest even as float8_e4m3fn(w / scale).

As a program it is the reference of duet's quantizer test (crates/duet-model/src/fp8.rs):

    python3 tests/reference/fp8_reference.py ROWS COLS IN OUT

reads ROWS x COLS little-endian float32 from IN and writes to OUT the ROWS x COLS E4M3 bytes,
then the ROWS float32 scales.
"""

import sys

import ml_dtypes
import numpy as np

E4M3_MAX = np.float32(448.0)


def quantize_rows(w):
    """float32 [rows, cols] -> (uint8 E4M3 bits [rows, cols], float32 scales [rows])."""
    w = np.asarray(w, dtype=np.float32)
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / E4M3_MAX, np.float32(1.0)).astype(np.float32)
    # amax / scale may land a rounding step above 448; float8_e4m3fn rounds it to 448.
    q = (w / scale[:, None]).astype(ml_dtypes.float8_e4m3fn)
    return q.view(np.uint8), scale


def dequantize_rows(q, scale):
    """E4M3 bits [rows, cols] and scales [rows] -> float64 values."""
    values = np.asarray(q, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return values * np.asarray(scale, dtype=np.float64)[:, None]


def main():
    rows, cols, src, dst = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    w = np.fromfile(src, dtype="<f4").reshape(rows, cols)
    q, scale = quantize_rows(w)
    with open(dst, "wb") as f:
        f.write(q.tobytes())
        f.write(scale.astype("<f4").tobytes())


if __name__ == "__main__":
    main()
