"""Where a recurrent layer's training call goes against torch.nn's: its forward with gradients,
its backward, and its forward without them (inference), timed apart.

Three providers run in turn in one process, round after round (``torch.nn.LSTM`` / ``GRU``, ours
with layer norms, ours with ``norm="none"``), each call on the same input; printed are the
medians, ms. A training forward that costs much more than the same layer's inference forward
pays for what it keeps for backward (the kept rows' writes), which torch's own layer, whose
inference writes every intermediate as well, hardly does.

    python benchmarks/rnn_train_split.py --kind lstm --shapes 30x128x64x64,30x64x128x128 \\
        --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import cpu_model, torch_isa
from bench_rnn import KINDS
from layernorm.kernels.cpu import targets


def _split(module: torch.nn.Module, x: torch.Tensor) -> tuple[float, float, float]:
    """Seconds of one training forward, its backward and one inference forward."""
    t0 = time.perf_counter()
    out, _ = module(x)
    loss = out.sum()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    for p in module.parameters():
        p.grad = None
    del out, loss
    with torch.no_grad():
        t3 = time.perf_counter()
        module(x)
        t4 = time.perf_counter()
    return t1 - t0, t2 - t1, t4 - t3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kind", choices=sorted(KINDS), default="lstm")
    ap.add_argument("--shapes", default="30x128x64x64", help="T x B x I x H, comma-separated")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    theirs_cls, ours_cls = KINDS[args.kind]
    print(f"device: {cpu_model()} | kernels {targets.selected().name} | torch {torch.__version__}, "
          f"{torch_isa()} | threads {args.threads} | {args.kind}, float32, median ms of "
          f"{args.rounds} rounds")  # fmt: skip
    print("| (T, B, I, H) | provider | forward (grad) | backward | forward (no grad) | "
          "forward (grad) / (no grad) |")  # fmt: skip
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for text in args.shapes.split(","):
        t, b, i, h = (int(v) for v in text.split("x"))
        torch.manual_seed(0)
        providers = {
            "torch": theirs_cls(i, h),
            "LN": ours_cls(i, h),
            "none": ours_cls(i, h, norm="none"),
        }
        x = torch.randn(t, b, i)
        samples: dict[str, list[tuple[float, float, float]]] = {k: [] for k in providers}
        for r in range(args.warmup + args.rounds):
            for name, module in providers.items():
                split = _split(module, x)
                if r >= args.warmup:
                    samples[name].append(split)
        for name, got in samples.items():
            fwd, bwd, inf = (1e3 * statistics.median(col) for col in zip(*got, strict=True))
            print(f"| {(t, b, i, h)} | {name} | {fwd:.2f} | {bwd:.2f} | {inf:.2f} | "
                  f"{fwd / inf:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
