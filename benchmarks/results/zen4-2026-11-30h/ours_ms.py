"""Our layer norm's forward + backward and backward alone, ms (median and fastest of 40 calls),
in the dtype DT names (float32 by default), to compare two trees' processes run alternately:

    DT=<dtype> PYTHONPATH=<tree>/src .venv/bin/python ours_ms.py <threads> <MxN,...>
"""

import os
import statistics
import sys
import time

import torch

import layernorm.functional as LF


def one_shape(m: int, n: int) -> str:
    dt = getattr(torch, os.environ.get("DT", "float32"))
    x = torch.randn(m, n, dtype=dt, requires_grad=True)
    w = torch.randn(n, dtype=dt, requires_grad=True)
    b = torch.randn(n, dtype=dt, requires_grad=True)
    dy = torch.randn(m, n, dtype=dt)

    def forward_backward() -> float:
        x.grad = w.grad = b.grad = None
        start = time.perf_counter()
        LF.layer_norm(x, (n,), w, b).backward(dy)
        return time.perf_counter() - start

    def backward() -> float:
        x.grad = w.grad = b.grad = None
        y = LF.layer_norm(x, (n,), w, b)
        start = time.perf_counter()
        y.backward(dy)
        return time.perf_counter() - start

    for _ in range(5):
        forward_backward()
    fb = [forward_backward() for _ in range(40)]
    bw = [backward() for _ in range(40)]
    return (f"{m}x{n}: fwd+bwd {statistics.median(fb) * 1e3:.3f} (min {min(fb) * 1e3:.3f}) "
            f"bwd {statistics.median(bw) * 1e3:.3f} (min {min(bw) * 1e3:.3f})")  # fmt: skip


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]))
    for shape in sys.argv[2].split(","):
        m, n = (int(v) for v in shape.split("x"))
        print(one_shape(m, n), flush=True)


if __name__ == "__main__":
    main()
