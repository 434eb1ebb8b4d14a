"""Forward+backward time of every normalization variant on the CPU vs torch's native layer norm.

Each variant runs ``y = op(x); y.backward(dy)`` with gradients for x (and the gain/bias it has),
or with ``--forward`` ``y = op(x)`` under ``torch.no_grad()`` (inference: nothing saved),
in float32 or, with ``--dtype``, bfloat16/float16 (x, dy, gain and bias all in that dtype). All
providers of a shape are timed round-robin in the same run (medians), and every
variant is reported as a ratio to ``torch.nn.functional.layer_norm`` with weight and bias, which on
CPU is PyTorch's fused native kernel; RMSNorm is also compared with ``F.rms_norm``.
Absolute times on a shared machine move from run to run; the ratios are what to read. Each row
gives the ratio of medians and the ratio of minima (the fastest of the reps: on a loaded machine
the median carries the neighbours' share of the processor, the minimum little of it).

Memory traffic of one forward+backward, the floor for every variant: read x, write y (forward),
read dy and x, write dx (backward) = 5·M·N·s bytes (s = 4 for float32, 2 for the half types),
plus O(N) for the gain/bias gradients.

A second table times the modules on small inputs, the per-token calls of a decoder on a CPU, and
on (512, 768), the middle of the modules' route to torch's kernel in training:
``layernorm.LayerNorm(N)`` against ``torch.nn.LayerNorm(N)``, ``layernorm.RMSNorm(N)`` against
``torch.nn.RMSNorm(N)``, and the paper's DetachNorm (``LayerNorm(N, detach_mean=True,
detach_std=True)``) and ``AdaNorm(N)`` against ``torch.nn.LayerNorm(N)``, forward only under
``no_grad`` and forward+backward, at 1 and 2 threads, input and parameters in ``--dtype``.
At the small ones the Python between the module call and the kernel is most of the time.

    python benchmarks/bench_norms_cpu.py                  # the three default shapes
    python benchmarks/bench_norms_cpu.py --shapes 4096x768 --reps 30 --csv out.csv
    python benchmarks/bench_norms_cpu.py --shapes --small-shapes 1x768 8x768   # modules only
    python benchmarks/bench_norms_cpu.py --dtype bfloat16 --threads 1
    python benchmarks/bench_norms_cpu.py --dtype bfloat16 --forward --small-shapes  # inference
    LAYERNORM_CPU_COMPILE=0 python benchmarks/bench_norms_cpu.py   # eager ATen fallback
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import layernorm
import layernorm.functional as LF
from _records import append_csv
from _timing import cpu_model, interleaved_ms, interleaved_samples, torch_isa
from layernorm.kernels.cpu import _native, targets
from layernorm.kernels.cpu import isa as kernel_isa
from layernorm.reference import layer_norm_reference

try:
    from layernorm.kernels.cpu import torch_ops
except ImportError:  # a checkout from before the C++ operators (a before/after run)
    torch_ops = None  # type: ignore[assignment]

DEFAULT_SHAPES = ((8192, 1024), (32768, 256), (64, 4096))
# per-token calls of a decoder, and one in the middle of the modules' route to torch's kernel
# when gradients are needed (layernorm.modules.normalization.SMALL_NUMEL, 2^20 elements)
SMALL_SHAPES = ((1, 768), (8, 768), (512, 768))
SMALL_THREADS = (1, 2)
ANCHOR = "torch layer_norm"
RMS_ANCHOR = "torch rms_norm"
COMPOSITE = "eager composite LN"


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ISA_FLAGS = ("avx2", "f16c", "avx512f", "avx512_bf16", "avx512fp16")


def isa_flags() -> list[str]:
    """The vector instruction sets of this processor that the kernels' builds may use."""
    features = targets.cpu_features()
    return [f for f in ISA_FLAGS if f in features]


def leaves(
    m: int, n: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, w, b, dy)`` of one forward+backward (seeded): x, the gain and the bias require
    gradients, all in ``dtype``."""
    g = torch.Generator().manual_seed(0)
    # Non-zero mean: the centring matters, as it does for real activations.
    x = (torch.randn(m, n, generator=g) + 0.5).to(dtype).requires_grad_()
    w = (torch.rand(n, generator=g) + 0.5).to(dtype).requires_grad_()
    b = torch.randn(n, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(m, n, generator=g).to(dtype)
    return x, w, b, dy


def providers(
    m: int,
    n: int,
    composite: bool,
    dtype: torch.dtype = torch.float32,
    rms_anchor: bool = True,
    forward: bool = False,
) -> dict[str, Callable[[], None]]:
    """One closure per provider, each a full forward+backward on fresh-gradient leaves, or with
    ``forward`` the forward alone under ``torch.no_grad()``."""
    x, w, b, dy = leaves(m, n, dtype)

    def fwd_bwd(op: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            x.grad = w.grad = b.grad = None
            op().backward(dy)

        def run_forward() -> None:
            with torch.no_grad():
                op()

        return run_forward if forward else run

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
    if not rms_anchor:  # torch's rms_norm is an eager composition: 5-15x the others' time
        del fns[RMS_ANCHOR]
    if composite:  # the pure-PyTorch reference: what an eager composition of ATen ops costs
        fns[COMPOSITE] = fwd_bwd(lambda: layer_norm_reference(x, (n,), w, b))
    return fns


#: The modules timed on small inputs: ours, each against torch's module of the same kind.
MODULES = ("LayerNorm", "RMSNorm", "DetachNorm", "AdaNorm")


def module_providers(
    m: int, n: int, dtype: torch.dtype = torch.float32
) -> dict[str, Callable[[], None]]:
    """Module calls on one small input (input and parameters in ``dtype``): forward under no_grad,
    and forward+backward."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(m, n, generator=g) + 0.5).to(dtype)
    xg = x.clone().requires_grad_()
    dy = torch.randn(m, n, generator=g).to(dtype)
    modules = {
        "LayerNorm": (layernorm.LayerNorm(n, dtype=dtype), torch.nn.LayerNorm(n, dtype=dtype)),
        "RMSNorm": (layernorm.RMSNorm(n, dtype=dtype), torch.nn.RMSNorm(n, dtype=dtype)),
        # the paper's variants, against torch's layer norm (torch has neither)
        "DetachNorm": (
            layernorm.LayerNorm(n, dtype=dtype, detach_mean=True, detach_std=True),
            torch.nn.LayerNorm(n, dtype=dtype),
        ),
        "AdaNorm": (layernorm.AdaNorm(n, dtype=dtype), torch.nn.LayerNorm(n, dtype=dtype)),
    }
    fns: dict[str, Callable[[], None]] = {}
    for name, pair in modules.items():
        for who, mod in zip(("ours", "torch"), pair, strict=True):

            def fwd(mod: torch.nn.Module = mod) -> None:
                with torch.no_grad():
                    mod(x)

            def fwd_bwd(mod: torch.nn.Module = mod) -> None:
                xg.grad = None
                mod.zero_grad(set_to_none=True)
                mod(xg).backward(dy)

            fns[f"{name} fwd {who}"] = fwd
            fns[f"{name} fwd+bwd {who}"] = fwd_bwd
    return fns


def small_module_table(
    shapes: list[tuple[int, int]], reps: int, threads: list[int], dtype: str = "float32"
) -> None:
    """Ours / torch for the modules at small and medium shapes, each thread count in its own
    round."""
    before = torch.get_num_threads()
    print(f"modules on small and medium inputs, {dtype}, median µs; ratio = ours / torch's module"
          " (torch.nn.RMSNorm for RMSNorm, torch.nn.LayerNorm for the others)")  # fmt: skip
    cols = ("module", "mode", "M x N", "threads", "ours", "torch", "ratio")
    print("{:<10} {:<8} {:>8} {:>7} {:>8} {:>8} {:>6}".format(*cols))
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        for m, n in shapes:
            # fewer reps for larger calls (the work of `reps` calls at (8, 768)), at least 200
            shape_reps = max(200, reps * 8 * 768 // max(m * n, 8 * 768))
            providers = module_providers(m, n, DTYPES[dtype])
            times = interleaved_ms(providers, warmup=50, reps=shape_reps)
            for name in MODULES:
                for mode in ("fwd", "fwd+bwd"):
                    ours, theirs = times[f"{name} {mode} ours"], times[f"{name} {mode} torch"]
                    print(
                        f"{name:<10} {mode:<8} {f'{m}x{n}':>8} {n_threads:>7} {1e3 * ours:8.1f} "
                        f"{1e3 * theirs:8.1f} {ours / theirs:6.2f}"
                    )
    torch.set_num_threads(before)
    print()


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
    parser.add_argument("--shapes", type=parse_shape, nargs="*", default=list(DEFAULT_SHAPES))
    parser.add_argument(
        "--small-shapes", type=parse_shape, nargs="*", default=list(SMALL_SHAPES),
        help="module calls on small inputs (none: skip that table)",
    )  # fmt: skip
    parser.add_argument("--small-reps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=0, help="0: 15 for big shapes, 1000 for small")
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--composite", action="store_true", help="also time the eager reference")
    parser.add_argument(
        "--forward", action="store_true", help="the forward alone, under no_grad (inference)"
    )
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--rms-anchor", action=argparse.BooleanOptionalAction, default=True,
                        help="also time torch's F.rms_norm (an eager composition)")  # fmt: skip
    parser.add_argument("--csv", type=Path, default=None, help="append tidy rows to this CSV")
    isa_help = "the C kernels of this instruction set (default: the CPU's)"
    parser.add_argument("--isa", choices=targets.NAMES, default=None, help=isa_help)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with targets.use(args.isa or kernel_isa()):
        run(args)


def cxx_ops() -> str:
    """Whether the norms' C++ operators run (``layernorm.kernels.cpu.torch_ops``)."""
    if torch_ops is None:
        return "absent from this checkout"
    return "on" if torch_ops.enabled() else "off (Python path)"


def run(args: argparse.Namespace) -> None:
    """Time every variant at every shape and print (and optionally save) the table."""

    fused = _native.enabled()  # builds the kernels now, outside the timed region
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"device: {cpu_model()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
    print(f"torch {torch.__version__}, {torch_isa()}, python {platform.python_version()}, {stamp}")
    print(f"fused C kernels: {f'on, {kernel_isa()} build' if fused else 'off (eager ATen ops)'}"
          f"; C++ operators: {cxx_ops()}")  # fmt: skip
    flags = " ".join(isa_flags()) or "none of " + " ".join(ISA_FLAGS)
    load = " ".join(f"{v:.1f}" for v in os.getloadavg())
    runs = ", ".join(targets.available())
    print(f"ISA targets this CPU runs: {runs}; vector flags: {flags}; load average {load}\n")
    if args.small_shapes:
        threads = [args.threads] if args.threads else list(SMALL_THREADS)
        small_module_table(args.small_shapes, args.small_reps, threads, args.dtype)
    if not args.shapes:
        return
    mode = "forward (no_grad)" if args.forward else "forward+backward"
    print(f"{mode}, {args.dtype}, median ms; ratio = ours / torch layer_norm (w, b)\n")

    header = (f"{'variant':<20} {'M x N':>12} {'ours ms':>9} {'torch LN ms':>12} {'ratio':>6}"
              f" {'min ms':>8} {'min ratio':>9}")  # fmt: skip
    rows: list[dict[str, object]] = []
    for m, n in args.shapes:
        reps = args.reps or (15 if m * n >= 1 << 20 else 1000)
        fns = providers(
            m, n, args.composite, DTYPES[args.dtype], args.rms_anchor, forward=args.forward
        )
        samples = interleaved_samples(fns, warmup=args.warmup, reps=reps)
        times = {k: statistics.median(v) for k, v in samples.items()}
        fastest = {k: min(v) for k, v in samples.items()}
        base, rms_base = times[ANCHOR], times.get(RMS_ANCHOR)
        base_min = fastest[ANCHOR]
        print(header)
        for name, ms in times.items():
            note = ""
            if name == "RMSNorm (w)" and rms_base is not None:
                note = (f"   vs torch rms_norm: {ms / rms_base:.2f}"
                        f" (min {fastest[name] / fastest[RMS_ANCHOR]:.2f})")  # fmt: skip
            lo = fastest[name]
            print(f"{name:<20} {f'{m}x{n}':>12} {ms:9.3f} {base:12.3f} {ms / base:6.2f}"
                  f" {lo:8.3f} {lo / base_min:9.2f}{note}")  # fmt: skip
            if name == ANCHOR:
                continue
            rows.append(
                dict(variant=name, mode=mode, dtype=args.dtype, m=m, n=n, ms=round(ms, 4),
                     torch_ln_ms=round(base, 4), ratio=round(ms / base, 3),
                     min_ms=round(lo, 4), ratio_min=round(lo / base_min, 3), reps=reps,
                     threads=torch.get_num_threads(), fused=int(fused), isa=kernel_isa(),
                     device=cpu_model(),
                     torch=torch.__version__, date=stamp)
            )  # fmt: skip
        print()

    if args.csv is not None:
        print(f"appended {append_csv(args.csv, rows)} rows to {args.csv}")


if __name__ == "__main__":
    main()
