"""A / B of builds of the norm kernels: the same sources built with different ``-D`` flags, each
its own library, their layer-norm forward and backward called in turn in one process.

Timings of one kernel differ between processes by up to 2x on a shared machine (where the
allocator put the buffers, whether torch's outputs fault); calls in turn within one process
compare the builds and nothing else. The first variant is the baseline of the ratios.

    python benchmarks/ab_norm_kernels.py --variant base= --variant b1024=-DHALF_BLOCK_ELEMS=1024 \
        --dtype bfloat16 --threads 2 --shapes 8192x1024 32768x256
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from layernorm.kernels.cpu import _native, abi, cbuild, targets


def _kernels(name: str, flags: tuple[str, ...], target: targets.Target) -> _native.KernelTable:
    path = cbuild.build_shared_library(
        _native.SOURCES, f"layernorm_cpu_ab_{name}", (*_native.EXTRA_FLAGS, *flags),
        isa_flags=target.flags,
    )  # fmt: skip
    return _native.kernel_table(ctypes.CDLL(str(path)))


def _timed(fns: _native.KernelTable, kernel_name: str, values: dict[str, object]) -> float:
    """Seconds one call of ``kernel_name`` takes on ``values`` (checked and bound outside the
    timed call)."""
    x = values["x"]
    assert isinstance(x, torch.Tensor)
    args = abi.Binder(abi.BY_NAME[kernel_name])(values)
    fn = fns[kernel_name, x.dtype]
    start = time.perf_counter()
    status = fn(ctypes.byref(args))
    elapsed = time.perf_counter() - start
    if status:
        raise RuntimeError(f"{kernel_name} returned {status}")
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", required=True, help="name=flags (may be empty)")
    p.add_argument("--isa", choices=targets.NAMES, default=None, help="default: the CPU's best")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--shapes", nargs="+", default=["8192x1024", "32768x256", "4096x768"])
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--stream", type=int, default=1, help="the backward's stream flag")
    p.add_argument("--fwd-stream", type=int, default=0, help="the forward's stream flag")
    a = p.parse_args()
    target = targets.target(a.isa) if a.isa else targets.best()
    libs = {}
    for spec in a.variant:
        name, _, flags = spec.partition("=")
        libs[name] = _kernels(name, tuple(flags.split()), target)
    dtype = getattr(torch, a.dtype)
    print(f"target {target.name}, {a.dtype}, threads {a.threads}, median ms (ratio to the first)")
    for shape in a.shapes:
        m, n = map(int, shape.split("x"))
        x, dy = torch.randn(m, n).to(dtype), torch.randn(m, n).to(dtype)
        w, b, mean, rstd = torch.ones(n), torch.zeros(n), torch.empty(m), torch.empty(m)
        y, dx, dw, db = torch.empty_like(x), torch.empty_like(x), torch.empty(n), torch.empty(n)
        fwd = {"x": x, "weight": w, "bias": b, "y": y, "mean": mean, "rstd": rstd, "eps": 1e-5,
               "threads": a.threads, "stream": a.fwd_stream, "half_params": 0}  # fmt: skip
        bwd = {"dy": dy, "x": x, "mean": mean, "rstd": rstd, "weight": w, "dx": dx,
               "dweight": dw, "dbias": db, "detach_mean": 0, "detach_std": 0,
               "threads": a.threads, "stream": a.stream, "half_params": 0}  # fmt: skip
        times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in libs}
        for _ in range(a.reps):
            for name, lib in libs.items():
                times[name][0].append(_timed(lib, "ln_fwd", fwd))
                times[name][1].append(_timed(lib, "ln_bwd", bwd))
        medians = {k: [statistics.median(t) * 1e3 for t in v] for k, v in times.items()}
        first = next(iter(medians.values()))
        cells = [f"{k}: fwd {f:.3f} ({f / first[0]:.2f}) bwd {bw:.3f} ({bw / first[1]:.2f})"
                 for k, (f, bw) in medians.items()]  # fmt: skip
        print(f"({m}, {n})  " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
