"""The driver of the bfloat16 GEMM rates in ``half_wide_tile_ab.txt``'s section of RESULTS.md:
``rnn.matmul`` with ``half`` (x · Wᵀ, W packed in every call, as the layers call it) at a few
shapes, one thread, the median of nine timed blocks; the outputs saved to compare two trees'
bits. Run with a tree's ``src`` on ``PYTHONPATH`` (``TAG`` names the saved outputs)."""

import os
import statistics
import time

import torch

from layernorm.kernels.cpu import rnn

torch.set_num_threads(1)


def median_s(fn, calls=8):
    for _ in range(3):
        fn()
    times = []
    for _ in range(9):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


outputs = []
shapes = [(3200, 128, 1024), (3200, 256, 1024), (1280, 2048, 2048), (512, 256, 1024),
          (128, 512, 2048), (64, 256, 1024)]  # fmt: skip
for M, K, N in shapes:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=gen).bfloat16().float()
    w = torch.randn(N, K, generator=gen).bfloat16().float()
    out = torch.empty(M, N)
    seconds = median_s(lambda x=x, w=w, out=out: rnn.matmul(x, w, True, out, 1, 1 << 20, True))
    outputs.append(out.clone())
    print(f"({M},{K},{N}) half {2 * M * K * N / 1e9 / seconds:.0f} GFLOP/s", flush=True)
torch.save(outputs, f"/tmp/half_out_{os.environ.get('TAG', 'x')}.pt")
