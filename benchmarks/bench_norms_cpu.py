"""Forward+backward time of every normalization variant on the CPU vs torch's native layer norm.

Each variant runs ``y = op(x); y.backward(dy)`` with gradients for x (and the gain/bias it has),
float32. All providers of a shape are timed round-robin in the same run (medians), and every
variant is reported as a ratio to ``torch.nn.functional.layer_norm`` with weight and bias, which on
CPU is PyTorch's fused native kernel; RMSNorm is also compared with ``F.rms_norm``.
Absolute times on a shared machine move from run to run; the ratios are what to read.

Memory traffic of one forward+backward, the floor for every variant: read x, write y (forward),
read dy and x, write dx (backward) = 5·M·N·4 bytes, plus O(N) for the gain/bias gradients.

    python benchmarks/bench_norms_cpu.py                  # the three default shapes
    python benchmarks/bench_norms_cpu.py --shapes 4096x768 --reps 30 --csv out.csv
    LAYERNORM_CPU_COMPILE=0 python benchmarks/bench_norms_cpu.py   # eager ATen fallback
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import layernorm.functional as LF
from _timing import cpu_model, interleaved_ms
from layernorm.kernels.cpu import _native, targets
from layernorm.kernels.cpu import isa as kernel_isa
from layernorm.reference import layer_norm_reference

DEFAULT_SHAPES = ((8192, 1024), (32768, 256), (64, 4096))
ANCHOR = "torch layer_norm"
RMS_ANCHOR = "torch rms_norm"
COMPOSITE = "eager composite LN"


def providers(m: int, n: int, composite: bool) -> dict[str, Callable[[], None]]:
    """One closure per provider, each a full forward+backward on fresh-gradient leaves."""
    g = torch.Generator().manual_seed(0)
    # Non-zero mean: the centring matters, as it does for real activations.
    x = (torch.randn(m, n, generator=g) + 0.5).requires_grad_()
    w = (torch.rand(n, generator=g) + 0.5).requires_grad_()
    b = torch.randn(n, generator=g).requires_grad_()
    dy = torch.randn(m, n, generator=g)

    def fwd_bwd(op: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            x.grad = w.grad = b.grad = None
            op().backward(dy)

        return run

    fns = {
        ANCHOR: fwd_bwd(lambda: F.layer_norm(x, (n,), w, b)),
        RMS_ANCHOR: fwd_bwd(lambda: F.rms_norm(x, (n,), w)),
        "layer_norm (w, b)": fwd_bwd(lambda: LF.layer_norm(x, (n,), w, b)),
        "LN-simple": fwd_bwd(lambda: LF.layer_norm(x, (n,))),
        "detach_mean": fwd_bwd(lambda: LF.layer_norm(x, (n,), w, b, detach_mean=True)),
        "detach_std": fwd_bwd(lambda: LF.layer_norm(x, (n,), w, b, detach_std=True)),
        "detach both": fwd_bwd(
            lambda: LF.layer_norm(x, (n,), w, b, detach_mean=True, detach_std=True)
        ),
        "AdaNorm": fwd_bwd(lambda: LF.ada_norm(x, (n,))),
        "RMSNorm (w)": fwd_bwd(lambda: LF.rms_norm(x, (n,), w)),
    }
    if composite:  # the pure-PyTorch reference: what an eager composition of ATen ops costs
        fns[COMPOSITE] = fwd_bwd(lambda: layer_norm_reference(x, (n,), w, b))
    return fns


def parse_shape(text: str) -> tuple[int, int]:
    try:
        m, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must look like 8192x1024, got {text!r}") from None
    if m <= 0 or n <= 0:
        raise argparse.ArgumentTypeError(f"shape sizes must be positive, got {text!r}")
    return m, n


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=list(DEFAULT_SHAPES))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=0, help="0: 15 for big shapes, 1000 for small")
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--composite", action="store_true", help="also time the eager reference")
    parser.add_argument("--csv", type=Path, default=None, help="append tidy rows to this CSV")
    isa_help = "the C kernels of this instruction set (default: the CPU's)"
    parser.add_argument("--isa", choices=targets.NAMES, default=None, help=isa_help)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with targets.use(args.isa or kernel_isa()):
        run(args)


def run(args: argparse.Namespace) -> None:
    """Time every variant at every shape and print (and optionally save) the table."""

    fused = _native.enabled()  # builds the kernels now, outside the timed region
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"device: {cpu_model()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
    print(f"torch {torch.__version__}, python {platform.python_version()}, {stamp}")
    print(f"fused C kernels: {f'on, {kernel_isa()} build' if fused else 'off (eager ATen ops)'}")
    print("forward+backward, float32, median ms; ratio = ours / torch layer_norm (w, b)\n")

    header = f"{'variant':<20} {'M x N':>12} {'ours ms':>9} {'torch LN ms':>12} {'ratio':>6}"
    rows: list[dict[str, object]] = []
    for m, n in args.shapes:
        reps = args.reps or (15 if m * n >= 1 << 20 else 1000)
        times = interleaved_ms(providers(m, n, args.composite), warmup=args.warmup, reps=reps)
        base, rms_base = times[ANCHOR], times[RMS_ANCHOR]
        print(header)
        print(f"{ANCHOR:<20} {f'{m}x{n}':>12} {base:9.3f} {base:12.3f} {1.0:6.2f}")
        for name, ms in times.items():
            if name == ANCHOR:
                continue
            note = ""
            if name == "RMSNorm (w)":
                note = f"   vs torch rms_norm: {ms / rms_base:.2f}"
            print(f"{name:<20} {f'{m}x{n}':>12} {ms:9.3f} {base:12.3f} {ms / base:6.2f}{note}")
            rows.append(
                dict(variant=name, m=m, n=n, ms=round(ms, 4), torch_ln_ms=round(base, 4),
                     ratio=round(ms / base, 3), reps=reps, threads=torch.get_num_threads(),
                     fused=int(fused), isa=kernel_isa(), device=cpu_model(),
                     torch=torch.__version__, date=stamp)
            )  # fmt: skip
        print()

    if args.csv is not None:
        new = not args.csv.exists()
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with args.csv.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            if new:
                writer.writeheader()
            writer.writerows(rows)
        print(f"appended {len(rows)} rows to {args.csv}")


if __name__ == "__main__":
    main()
