"""CPU benchmark: the layer-normalized cells against torch.nn's, one step per call.

A cell is what a decoder or an attention model calls once per token, so what a call costs is
mostly its Python and the calls of its ops, not arithmetic. Two modes, each provider timed in
turn (order shuffled every round, :func:`_timing.interleaved_samples`) in one process:

* ``infer`` — a call under ``torch.no_grad()`` with a given state, timed over a block of
  ``--calls`` calls (the cells' kept step plans: ``layernorm.recurrent.cells._StepPlan``);
* ``train`` — ``--steps`` calls of the cell from a zero state, each output summed into a loss,
  then ``backward()``; the time of the whole loop.

``LayerNorm*Cell.from_torch`` copies torch's weights, so both compute from the same parameters
(ours adds the layer norms). Ratio = ours / torch, of the medians (and of the fastest rounds).
``--ops`` adds a third provider in training: ours with the cells' node of C cell kernels off
(``layernorm.recurrent._cellstep.KERNEL_STEP_MAX_NUMEL = 0``), i.e. the step's ops.

Large steps (weight gradients of MiBs) are sensitive to glibc's dynamic mmap threshold: whether
those buffers come back from the heap or as fresh pages depends on the order of earlier
allocations, and it can change a provider's time by 2x from one process to the next. Fix it for
comparisons (``MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=1073741824``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import cpu_model, interleaved_samples, torch_isa
from layernorm import LayerNormGRUCell, LayerNormLSTMCell, LayerNormRNNCell
from layernorm.kernels.cpu import targets
from layernorm.recurrent import _cellstep

CELLS = {
    "lstm": (torch.nn.LSTMCell, LayerNormLSTMCell),
    "gru": (torch.nn.GRUCell, LayerNormGRUCell),
    "rnn": (torch.nn.RNNCell, LayerNormRNNCell),
}
DEFAULT_SHAPES = "1x64x128,8x64x128,1x256x256,32x128x256,16x512x512"


def _inference(
    cell: torch.nn.Module, x: torch.Tensor, state: object, calls: int
) -> Callable[[], None]:
    def run() -> None:
        with torch.no_grad():
            for _ in range(calls):
                cell(x, state)

    return run


def _training(
    cell: torch.nn.Module, xs: torch.Tensor, lstm: bool, node: bool = True
) -> Callable[[], None]:
    params = list(cell.parameters())
    limit = _cellstep.KERNEL_STEP_MAX_NUMEL

    def run() -> None:
        _cellstep.KERNEL_STEP_MAX_NUMEL = limit if node else 0
        state, loss = None, xs.new_zeros((), dtype=torch.float32)
        for x in xs:
            state = cell(x, state)
            loss = loss + (state[0] if lstm else state).float().sum()
        loss.backward()
        _cellstep.KERNEL_STEP_MAX_NUMEL = limit
        for p in params:
            p.grad = None
        xs.grad = None

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kinds", default="lstm,gru,rnn")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="B x I x H, comma-separated")
    ap.add_argument("--modes", default="infer,train")
    ap.add_argument("--reps", type=int, default=15, help="rounds")
    ap.add_argument("--calls", type=int, default=50, help="inference calls per timed block")
    ap.add_argument("--steps", type=int, default=10, help="training steps per timed loop")
    ap.add_argument("--ops", action="store_true", help="also ours by the step's ops (training)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    print(
        f"device: {cpu_model()} | kernels {targets.selected().name} | torch {torch.__version__}, "
        f"{torch_isa()} | threads {args.threads} | {args.dtype}"
    )
    print(
        "µs per call (infer) or per step (train, forward and backward), median of rounds; "
        "ratio = ours / torch of the medians (of the fastest rounds)\n"
    )
    ops_cols = (" ops µs | ops / torch |", " ---: | ---: |") if args.ops else ("", "")
    print(f"| cell | (B, I, H) | mode | torch µs | ours µs | ours / torch |{ops_cols[0]}")
    print(f"| --- | --- | --- | ---: | ---: | ---: |{ops_cols[1]}")
    torch.manual_seed(0)
    for kind in args.kinds.split(","):
        theirs_cls, ours_cls = CELLS[kind]
        lstm = kind == "lstm"
        for shape in args.shapes.split(","):
            b, i, h = (int(v) for v in shape.split("x"))
            theirs = theirs_cls(i, h).to(dtype)
            ours = ours_cls.from_torch(theirs)
            x = torch.randn(b, i, dtype=dtype)
            hx = torch.randn(b, h, dtype=dtype)
            state = (hx, torch.randn(b, h, dtype=dtype)) if lstm else hx
            for mode in args.modes.split(","):
                if mode == "infer":
                    per, fns = (
                        args.calls,
                        {
                            "torch": _inference(theirs, x, state, args.calls),
                            "ours": _inference(ours, x, state, args.calls),
                        },
                    )
                else:
                    xs = torch.randn(args.steps, b, i, dtype=dtype, requires_grad=True)
                    per, fns = (
                        args.steps,
                        {
                            "torch": _training(theirs, xs, lstm),
                            "ours": _training(ours, xs, lstm),
                        },
                    )
                    if args.ops:
                        fns["ops"] = _training(ours, xs, lstm, node=False)
                samples = interleaved_samples(fns, warmup=3, reps=args.reps)
                med = {k: 1e3 * statistics.median(s) / per for k, s in samples.items()}
                fast = {k: min(s) for k, s in samples.items()}
                ops = ""
                if args.ops:
                    ops = " - | - |"
                    if "ops" in med:
                        ops = (f" {med['ops']:.1f} | {med['ops'] / med['torch']:.2f} "
                               f"({fast['ops'] / fast['torch']:.2f}) |")  # fmt: skip
                print(
                    f"| {kind} | ({b}, {i}, {h}) | {mode} | {med['torch']:.1f} | "
                    f"{med['ours']:.1f} | {med['ours'] / med['torch']:.2f} "
                    f"({fast['ours'] / fast['torch']:.2f}) |{ops}"
                )


if __name__ == "__main__":
    main()
