"""Layer norm, DetachNorm's detach-both, AdaNorm and RMSNorm against torch's layer norm, in the
dtype DT names (float32 by default), forward alone under no_grad and forward + backward, ours /
torch's, median of 30 calls, the faster of two rounds. Run once per tree, alternating (each
tree's src on PYTHONPATH):

    DT=<dtype> PYTHONPATH=<tree>/src .venv/bin/python norm_rows_ab.py <threads> [MxN,...]
"""

import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

import layernorm.functional as LF

SHAPES = ((32768, 128), (16384, 256), (12500, 256), (16384, 320), (8192, 384), (8192, 512),
          (4096, 256), (65536, 256))  # fmt: skip


def median_ms(fn: Callable[[], object], reps: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def best_of_two(fn: Callable[[], object]) -> float:
    return min(median_ms(fn) for _ in range(2))


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]))
    shapes = SHAPES
    if len(sys.argv) > 2:
        shapes = tuple(tuple(int(v) for v in s.split("x")) for s in sys.argv[2].split(","))
    for m, n in shapes:
        dt = getattr(torch, os.environ.get("DT", "float32"))
        x = (torch.randn(m, n) * 2 + 1).to(dt).requires_grad_()
        w, b = (
            torch.randn(n, dtype=dt, requires_grad=True),
            torch.randn(n, dtype=dt, requires_grad=True),
        )
        dy = torch.randn(m, n, dtype=dt)

        def fwd(f: Callable[..., torch.Tensor]) -> Callable[[], object]:
            def run() -> object:
                with torch.no_grad():
                    return f()

            return run

        def fb(f: Callable[..., torch.Tensor]) -> Callable[[], object]:
            def run() -> object:
                x.grad = w.grad = b.grad = None  # noqa: B023
                f().backward(dy)  # noqa: B023

            return run

        tl = lambda: torch.nn.functional.layer_norm(x, (n,), w, b)  # noqa: E731, B023
        ln = lambda: LF.layer_norm(x, (n,), w, b)  # noqa: E731, B023
        dn = lambda: LF.layer_norm(x, (n,), w, b, detach_mean=True, detach_std=True)  # noqa: E731, B023
        ada = lambda: LF.ada_norm(x, (n,), 0.1, 2.0)  # noqa: E731, B023
        rms = lambda: LF.rms_norm(x, (n,), w)  # noqa: E731, B023
        out = []
        for mode in (fwd, fb):
            t = best_of_two(mode(tl))
            ops = (("ln", ln), ("dn", dn), ("ada", ada), ("rms", rms))
            r = {k: best_of_two(mode(f)) / t for k, f in ops}
            out.append(f"{t:.2f} ms | " + " ".join(f"{k} {v:.2f}" for k, v in r.items()))
        print(f"({m}, {n}) fwd torch {out[0]} || fwd+bwd torch {out[1]}", flush=True)


if __name__ == "__main__":
    main()
