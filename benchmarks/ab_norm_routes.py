"""A / B of the norm modules' two routes where nothing needs a gradient: torch's own kernel
(``torch.layer_norm`` / ``torch.rms_norm``) against the fused forward kernel, with torch.nn's
module beside them.

``layernorm.LayerNorm`` and ``layernorm.RMSNorm`` under ``no_grad`` take torch's kernel below a
size (``ops._dispatch.TORCH_INFERENCE_BYTES``; ``modules.normalization._TORCH_RMS_NUMEL``, in
elements per dtype) and the fused kernel from there. Here the limit is set before each
provider's calls so that the same module runs each route, the three providers timed in shuffled
order every round in one process (timings of one call differ between processes with where the
allocator put the outputs). Printed: torch.nn's median µs and each route's median as a ratio to
it. What runs beside a call matters too: ``bench_norms_cpu.py`` times the modules among each
other's calls, forward and backward, as a model runs them.

    python benchmarks/ab_norm_routes.py --module rms --dtype bfloat16 --threads 2 \\
        --shapes 32x768 64x768 8x4096
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import layernorm
from _timing import cpu_model, torch_isa
from layernorm.kernels.cpu import targets
from layernorm.modules import normalization
from layernorm.ops import _dispatch

_ALWAYS, _NEVER = 1 << 62, 0


def _set_route(module: str, dtype: torch.dtype, torch_kernel: bool) -> None:
    """Make every size (``torch_kernel``) or none take torch's kernel."""
    limit = _ALWAYS if torch_kernel else _NEVER
    if module == "layer":
        _dispatch.TORCH_INFERENCE_BYTES = limit
    else:
        normalization._TORCH_RMS_NUMEL = {**normalization._TORCH_RMS_NUMEL, dtype: limit}


def _providers(
    module: str, shape: tuple[int, ...], dtype: torch.dtype
) -> dict[str, Callable[[], object]]:
    n = shape[-1]
    x = torch.randn(*shape, dtype=dtype)
    if module == "layer":
        ours: torch.nn.Module = layernorm.LayerNorm(n, dtype=dtype)
        ref: torch.nn.Module = torch.nn.LayerNorm(n, dtype=dtype)
    else:
        ours, ref = layernorm.RMSNorm(n, dtype=dtype), torch.nn.RMSNorm(n, dtype=dtype)

    def route(torch_kernel: bool) -> Callable[[], object]:
        def call() -> object:
            _set_route(module, dtype, torch_kernel)
            return ours(x)

        return call

    return {"torch.nn": lambda: ref(x), "torch kernel": route(True), "fused": route(False)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--module", choices=("layer", "rms"), default="rms")
    ap.add_argument("--dtype", choices=("float32", "float64", "bfloat16", "float16"),
                    default="float32")  # fmt: skip
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--shapes", nargs="+", default=["1x768", "32x768", "64x768", "512x768"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(
        f"device: {cpu_model()} | kernels {targets.selected().name} | torch {torch.__version__}, "
        f"{torch_isa()} | threads {args.threads} | {args.module} norm, {args.dtype}, no_grad"
    )
    saved = _dispatch.TORCH_INFERENCE_BYTES, normalization._TORCH_RMS_NUMEL
    for text in args.shapes:
        shape = tuple(int(s) for s in text.split("x"))
        fns = _providers(args.module, shape, dtype)
        number = max(5, min(2000, 3_000_000 // (shape[0] * shape[-1])))
        times: dict[str, list[float]] = {k: [] for k in fns}
        with torch.no_grad():
            for fn in fns.values():
                for _ in range(10):
                    fn()
            for _ in range(args.rounds):
                order = list(fns)
                random.shuffle(order)
                for k in order:
                    times[k].append(timeit.timeit(fns[k], number=number) / number * 1e6)
        _dispatch.TORCH_INFERENCE_BYTES, normalization._TORCH_RMS_NUMEL = saved
        med = {k: statistics.median(v) for k, v in times.items()}
        base = med["torch.nn"]
        print(
            f"{text:>12s}  torch.nn {base:9.1f} µs  torch kernel {med['torch kernel'] / base:5.2f}"
            f"  fused {med['fused'] / base:5.2f}  (x torch.nn, medians of {args.rounds} rounds)",
            flush=True,
        )


if __name__ == "__main__":
    main()
