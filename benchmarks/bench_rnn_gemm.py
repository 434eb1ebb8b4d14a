"""The recurrent kernels' register-tiled GEMM per instruction-set target, against ``torch.mm``.

The shapes of a recurrent step: ``C[M, N] = A[M, K] · B[K, N]`` with M = the batch rows (4–64),
forward ``K = H, N = 4H`` (``h_{t−1} W_hhᵀ``), backward ``K = 4H, N = H`` (``dhp · W_hh``). B is
packed once, as the sequence kernels do once per direction (the packing is not timed), and each
timed call runs ``--inner`` products. Every target this CPU can run is built (AVX2 and portable
emulated on an AVX-512 processor) and timed round-robin with ``torch.mm`` in one process, so the
ratios hold on a shared machine. Results are checked against ``torch.mm`` first.

    python benchmarks/bench_rnn_gemm.py --threads 1
    python benchmarks/bench_rnn_gemm.py --targets avx512 --variant mr12=-DGEMM_MR=12

``--variant NAME=FLAGS`` adds a build of each chosen target with extra compiler flags (e.g. another
row tile, ``-DGEMM_MR=12``, see rnn_seq_impl.h), timed beside the others as ``TARGET+NAME``.

``--products MxKxN,...`` times instead the input products over all rows (``rnn.matmul`` on the
selected target, W packed in every call as the layers do: ``x · Wᵀ`` with W as stored, and
``x · W``) against ``torch.mm``, µs and GFLOP/s (what ``_cstep.input_product`` chooses between):

    python benchmarks/bench_rnn_gemm.py --products 8x1024x3072,64x1024x3072,2048x128x512
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import cpu_model, interleaved_ms
from layernorm.kernels.cpu import cbuild, rnn, rnn_abi, targets

BENCH_C = Path(__file__).resolve().parent / "csrc" / "rnn_gemm_bench.c"


def load(target: targets.Target, variant: str = "", flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """This target's GEMM harness (the recurrent kernels' sources plus one entry point), built with
    ``flags`` added under the name ``variant``."""
    name = f"layernorm_gemm_bench_{target.name}" + (f"_{variant}" if variant else "")
    path = cbuild.build_shared_library(
        (BENCH_C, rnn_abi.CSRC_DIR / "rnn_step.c"), name, (*rnn.EXTRA_FLAGS, *flags),
        isa_flags=target.flags,
    )  # fmt: skip
    lib = ctypes.CDLL(str(path))
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.bench_gemm_f32.argtypes = (i64, i64, i64, ptr, ptr, ptr, i32, i32, i32)
    lib.bench_gemm_f32.restype = i32
    return lib


def bench_shape(libs: dict[str, ctypes.CDLL], m: int, k: int, n: int, args) -> dict[str, float]:
    """GFLOP/s of ``torch.mm`` and of each target's GEMM at ``(m, k) · (k, n)``, interleaved."""
    a, b = torch.randn(m, k), torch.randn(k, n) / k**0.5
    ref = a @ b
    outs = {t: torch.empty(m, n) for t in libs}

    def ours(t: str, reps: int = args.inner) -> None:
        status = libs[t].bench_gemm_f32(m, n, k, a.data_ptr(), b.data_ptr(), outs[t].data_ptr(),
                                        0, reps, args.threads)  # fmt: skip
        assert status == 0

    for t, c in outs.items():
        ours(t, 1)
        torch.testing.assert_close(c, ref, rtol=1e-4, atol=1e-4)
    out = torch.empty(m, n)

    def mm() -> None:
        for _ in range(args.inner):
            torch.mm(a, b, out=out)

    fns = {"mm": mm, **{t: functools.partial(ours, t) for t in libs}}
    ms = interleaved_ms(fns, warmup=2, reps=args.reps)
    return {p: 2 * m * k * n * args.inner / (v * 1e-3) / 1e9 for p, v in ms.items()}


def bench_products(shapes: list[tuple[int, int, int]], args) -> None:
    """µs and GFLOP/s of ``rnn.matmul`` (``x · Wᵀ``, ``x · W``) and ``torch.mm`` per shape."""
    print(f"device: {cpu_model()} | target {targets.selected().name} | torch {torch.__version__} "
          f"| threads {args.threads} | float32 | median of {args.reps} rounds\n")  # fmt: skip
    print("| (M, K, N) | x·Wᵀ µs | x·W µs | torch.mm µs | x·Wᵀ GFLOP/s | x·W GFLOP/s | "
          "torch.mm GFLOP/s | x·Wᵀ / mm time |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    grain = 1 << 17

    def repeat(fn, *fn_args, **fn_kwargs):
        def run() -> None:
            for _ in range(args.inner):
                fn(*fn_args, **fn_kwargs)

        return run

    for m, k, n in shapes:
        x, w = torch.randn(m, k), torch.randn(n, k) / k**0.5
        wt = w.t().contiguous()
        out = torch.empty(m, n)
        ref = x @ w.t()
        for got in (rnn.matmul(x, w, True, torch.empty(m, n), args.threads, grain),
                    rnn.matmul(x, wt, False, torch.empty(m, n), args.threads, grain)):  # fmt: skip
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5 * k)

        fns = {
            "t": repeat(rnn.matmul, x, w, True, out, args.threads, grain),
            "n": repeat(rnn.matmul, x, wt, False, out, args.threads, grain),
            "mm": repeat(torch.mm, x, w.t(), out=out),
        }
        us = {p: 1e3 * v / args.inner for p, v in interleaved_ms(fns, 2, args.reps).items()}
        flops = 2 * m * k * n / 1e3
        print(f"| ({m}, {k}, {n}) | {us['t']:.1f} | {us['n']:.1f} | {us['mm']:.1f} | "
              f"{flops / us['t']:.0f} | {flops / us['n']:.0f} | {flops / us['mm']:.0f} | "
              f"{us['t'] / us['mm']:.2f} |", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=9, help="timed rounds per provider")
    ap.add_argument("--inner", type=int, default=20, help="products per timed call")
    ap.add_argument("--rows", default="4,8,16,32,64")
    ap.add_argument("--hidden", default="128,256,650")
    ap.add_argument("--targets", default="", help="comma-separated (default: all this CPU runs)")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="also build each target with these compiler flags (repeatable)",
    )
    ap.add_argument("--products", default="", metavar="MxKxN,...",
                    help="time rnn.matmul's input products against torch.mm instead")  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.products:
        try:
            shapes = [tuple(int(v) for v in s.split("x")) for s in args.products.split(",")]
        except ValueError:
            ap.error(f"--products takes MxKxN,..., got {args.products!r}")
        if any(len(s) != 3 or min(s) < 1 for s in shapes):
            ap.error(f"--products takes positive MxKxN,..., got {args.products!r}")
        bench_products(shapes, args)  # type: ignore[arg-type]
        return
    names = args.targets.split(",") if args.targets else list(targets.available())
    libs = {t: load(targets.target(t)) for t in names}
    for spec in args.variant:
        variant, sep, flags = spec.partition("=")
        if not sep or not variant.isidentifier():
            ap.error(f"--variant takes NAME=FLAGS with NAME a word, got {spec!r}")
        for t in names:
            libs[f"{t}+{variant}"] = load(targets.target(t), variant, tuple(flags.split()))
    print(f"device: {cpu_model()} | targets {', '.join(libs)} | torch {torch.__version__} | "
          f"threads {args.threads} | float32 | GFLOP/s, median of {args.reps}\n")  # fmt: skip
    print("| pass | M | K | N | torch.mm | " + " | ".join(libs) + " | "
          + " | ".join(f"{t} / mm time" for t in libs) + " |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: |" + " ---: |" * (2 * len(libs)))
    for h in (int(v) for v in args.hidden.split(",")):
        for direction, (k, n) in (("fwd", (h, 4 * h)), ("bwd", (4 * h, h))):
            for m in (int(v) for v in args.rows.split(",")):
                g = bench_shape(libs, m, k, n, args)
                cells = [direction, str(m), str(k), str(n), f"{g['mm']:.0f}",
                         *(f"{g[t]:.0f}" for t in libs),
                         *(f"{g['mm'] / g[t]:.2f}" for t in libs)]  # fmt: skip
                print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
