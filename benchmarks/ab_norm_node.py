"""The norms' C++ operators (layernorm.kernels.cpu.torch_ops) against the ops' Python path and
torch's kernel, and the kernels' thread grain, alternated in one process.

Each shape and dtype times, round-robin (``_timing.interleaved_samples``), a forward + backward of
``layernorm.functional.layer_norm`` with gain and bias (gradients for x, w and b):

- ``node``: the C++ operator's node, whatever the size (``torch_ops.TRAINING_MAX_BYTES`` raised
  for the call);
- ``python``: the same call with the operators switched off (the autograd.Function, outputs from
  the buffer cache from its training size on);
- ``node g=G``: the node with the kernels' thread grain ``G`` elements (``--grains``; the grain
  in force is ``_native._GRAIN``);
- ``torch``: ``torch.nn.functional.layer_norm``, the anchor of every ratio.

    python benchmarks/ab_norm_node.py --threads 2 --shapes 64x1024 1024x1024
    python benchmarks/ab_norm_node.py --threads 2 --grains 32768 8192 4096 --shapes 64x768
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import layernorm.functional as LF
from _timing import cpu_model, interleaved_samples, torch_isa
from bench_norms_cpu import DTYPES, leaves, parse_shape
from layernorm.kernels.cpu import _native, torch_ops
from layernorm.kernels.cpu import isa as kernel_isa


@contextlib.contextmanager
def grain(elements: int) -> Iterator[None]:
    """The kernels' thread grain set to ``elements`` (the operators take it on their next call,
    as they do the Python path's other thresholds)."""
    before = _native._GRAIN
    _native._GRAIN = elements
    try:
        yield
    finally:
        _native._GRAIN = before


def providers(
    m: int, n: int, dtype: torch.dtype, grains: list[int]
) -> dict[str, Callable[[], None]]:
    x, w, b, dy = leaves(m, n, dtype)

    def ours() -> None:
        x.grad = w.grad = b.grad = None
        before = torch_ops.TRAINING_MAX_BYTES
        torch_ops.TRAINING_MAX_BYTES = 1 << 62
        try:
            LF.layer_norm(x, (n,), w, b).backward(dy)
        finally:
            torch_ops.TRAINING_MAX_BYTES = before

    def python() -> None:
        x.grad = w.grad = b.grad = None
        with torch_ops.switched(False):
            LF.layer_norm(x, (n,), w, b).backward(dy)

    def torch_ln() -> None:
        x.grad = w.grad = b.grad = None
        torch.nn.functional.layer_norm(x, (n,), w, b).backward(dy)

    fns = {"torch": torch_ln, "node": ours, "python": python}
    for elements in grains:

        def with_grain(elements: int = elements) -> None:
            with grain(elements):
                ours()

        fns[f"node g={elements}"] = with_grain
    return fns


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=[(64, 1024)])
    parser.add_argument("--dtypes", choices=list(DTYPES), nargs="+", default=list(DTYPES)[:2])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--grains", type=int, nargs="*", default=[])
    parser.add_argument("--reps", type=int, default=0, help="0: by size, 40 to 400")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    assert torch_ops.enabled(), "the C++ operators must build and load"
    print(f"device: {cpu_model()}, torch threads {torch.get_num_threads()}, torch "
          f"{torch.__version__} ({torch_isa()}), kernels {kernel_isa()}, "
          f"grain {_native._GRAIN}")  # fmt: skip
    print("forward + backward, median µs; ratio = / torch")
    for m, n in args.shapes:
        reps = args.reps or max(40, min(400, (1 << 24) // (m * n)))
        for name in args.dtypes:
            samples = interleaved_samples(providers(m, n, DTYPES[name], args.grains), reps=reps)
            us = {k: 1e3 * statistics.median(v) for k, v in samples.items()}
            cells = " ".join(f"{k} {v:.1f} ({v / us['torch']:.2f})" for k, v in us.items())
            print(f"{m}x{n} {name}: {cells}", flush=True)


if __name__ == "__main__":
    main()
