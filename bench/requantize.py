#!/usr/bin/env python3
"""Writes a GGUF file in another llama.cpp quantization (llama-cpp-python's
`llama_model_quantize`, requantizing allowed), to run `duet bench engine` on types other than
the default model's. Usage: requantize.py SRC.gguf DST.gguf FTYPE, FTYPE a `LLAMA_FTYPE_MOSTLY_*`
name without the prefix (e.g. Q6_K). llama.cpp falls back to another type for tensors whose rows
do not divide into its blocks: SmolLM2-135M's 576-wide rows do not divide into the 256-value
K-quant super-blocks, so its "Q6_K" file has Q6_K only where the rows are 1536 wide (ffn_down)
and Q8_0 elsewhere.
"""
import sys

import llama_cpp


def main() -> int:
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    src, dst, name = sys.argv[1:]
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name.upper()}", None)
    if ftype is None:
        print(f"unknown quantization {name!r} (llama_cpp has no LLAMA_FTYPE_MOSTLY_{name.upper()})",
              file=sys.stderr)
        return 2
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        print(f"llama_model_quantize failed ({rc})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
