"""The processor's multiply-add rate by AVX-512 float FMAs and by AVX512-BF16 dot products.

``vdpbf16ps`` does 32 multiply-adds an instruction (products of bfloat16 pairs summed into float32
lanes) where ``vfmadd231ps`` does 16; whether that doubles the rate depends on how many of each the
processor issues a cycle. The recurrent kernels' bfloat16 input projection is chosen per processor
on that (``layernorm.kernels.cpu.rnn.bfloat16_projection_by_default``): this prints both
instructions' time each (twelve independent accumulators, ``csrc/dot_rate.c``) and the
multiply-add rate of the dot products against the FMAs'. On a processor without AVX512-BF16 it
says so and exits.

    python benchmarks/bf16_dot_rate.py
"""

from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

from _timing import cpu_model
from layernorm.kernels.cpu import cbuild, targets

SOURCE = Path(__file__).resolve().parent / "csrc" / "dot_rate.c"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20_000_000, help="rounds of twelve instructions")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if "avx512_bf16" not in targets.cpu_features():
        print(f"{cpu_model()}: no AVX512-BF16, nothing to measure")
        return
    (target,) = (t for t in targets.TARGETS if t.name == "avx512bf16")
    lib = ctypes.CDLL(str(cbuild.build_shared_library((SOURCE,), "layernorm_dot_rate",
                                                      isa_flags=target.flags)))  # fmt: skip
    for name in ("fma_rounds", "dot_rounds"):
        getattr(lib, name).argtypes = (ctypes.c_int64,)
        getattr(lib, name).restype = ctypes.c_float
    ns: dict[str, list[float]] = {"fma_rounds": [], "dot_rounds": []}
    for _ in range(args.repeats):  # alternated, so that both see the same machine
        for name in ns:
            start = time.perf_counter()
            getattr(lib, name)(args.rounds)
            ns[name].append((time.perf_counter() - start) / (12 * args.rounds) * 1e9)
    fma, dot = min(ns["fma_rounds"]), min(ns["dot_rounds"])
    print(f"{cpu_model()} | one thread | fastest of {args.repeats}")
    print(f"vfmadd231ps {fma:.3f} ns an instruction, vdpbf16ps {dot:.3f} ns")
    print(f"dot products' multiply-adds a second / the FMAs': {2 * fma / dot:.2f}")


if __name__ == "__main__":
    main()
