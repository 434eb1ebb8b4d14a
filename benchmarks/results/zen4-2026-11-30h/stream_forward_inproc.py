"""Streamed against plain stores for the float32 forwards under no_grad, in one process: the
flag toggled through ``STREAM_MIN_BYTES`` (0: always, 2**60: never), median of 30 calls, the
best of three rounds, ms; torch's layer norm beside them.

    .venv/bin/python stream_forward_inproc.py <threads> <MxN,...>
"""

import statistics
import sys
import time
from collections.abc import Callable

import torch

import layernorm.functional as LF
from layernorm.kernels.cpu import _native


def median_ms(fn: Callable[[], object], reps: int = 30) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def one_shape(m: int, n: int) -> str:
    x, w, b = torch.randn(m, n), torch.randn(n), torch.randn(n)
    ops: dict[str, Callable[[], object]] = {
        "ln": lambda: LF.layer_norm(x, (n,), w, b),
        "rms": lambda: LF.rms_norm(x, (n,), w),
        "ada": lambda: LF.ada_norm(x, (n,), 0.1, 2.0),
        "torch LN": lambda: torch.nn.functional.layer_norm(x, (n,), w, b),
    }
    best: dict[tuple[str, str], float] = {}
    with torch.no_grad():
        for _ in range(3):
            for op, fn in ops.items():
                for how, threshold in (("stream", 0), ("plain", 1 << 60)):
                    if op == "torch LN" and how == "plain":
                        continue
                    _native.STREAM_MIN_BYTES = threshold
                    t = median_ms(fn)
                    best[op, how] = min(best.get((op, how), t), t)
    parts = [
        f"{op} {best[op, 'stream']:.3f}/{best[op, 'plain']:.3f}" for op in ("ln", "rms", "ada")
    ]
    mib = 2 * x.nbytes / 2**20
    return (
        f"({m}, {n}) x+y {mib:.0f} MiB: "
        + "; ".join(parts)
        + f"; torch LN {best['torch LN', 'stream']:.3f}"
    )


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]))
    for shape in sys.argv[2].split(","):
        m, n = (int(v) for v in shape.split("x"))
        print(one_shape(m, n), flush=True)


if __name__ == "__main__":
    main()
