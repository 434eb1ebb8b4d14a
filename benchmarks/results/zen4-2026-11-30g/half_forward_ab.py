"""The half types' norm forwards against torch's in one process: ours / torch's layer norm (and
our RMSNorm against ``torch.nn.functional.rms_norm``), median of 30 calls, the faster of two
rounds, per dtype and shape. Run once per tree, alternating (each tree's ``src`` on PYTHONPATH):

    PYTHONPATH=<tree>/src .venv/bin/python half_forward_ab.py <threads>
"""

import statistics
import sys
import time
from collections.abc import Callable

import torch

import layernorm.functional as LF

SHAPES = ((8192, 1024), (2048, 4096), (1024, 8192), (16384, 256), (4096, 768))


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
    for dt in (torch.bfloat16, torch.float16):
        for m, n in SHAPES:
            x = torch.randn(m, n, dtype=dt) * 2 + 1
            w, b = torch.randn(n, dtype=dt), torch.randn(n, dtype=dt)
            tl = best_of_two(lambda: torch.nn.functional.layer_norm(x, (n,), w, b))  # noqa: B023
            tr = best_of_two(lambda: torch.nn.functional.rms_norm(x, (n,), w))  # noqa: B023
            ln = best_of_two(lambda: LF.layer_norm(x, (n,), w, b))  # noqa: B023
            ada = best_of_two(lambda: LF.ada_norm(x, (n,), 0.1, 2.0))  # noqa: B023
            rms = best_of_two(lambda: LF.rms_norm(x, (n,), w))  # noqa: B023
            print(f"{str(dt)[6:]:9s} ({m}, {n}) torch LN {tl:.2f} ms | ln {ln / tl:.2f} "
                  f"ada {ada / tl:.2f} rms {rms / tl:.2f} (vs torch rms_norm {rms / tr:.2f})",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
