"""How far bfloat16 recurrent layers land from float64, with and without
:func:`layernorm.recurrent.bfloat16_recurrent_products`, and ``torch.nn.LSTM`` in bfloat16 beside
them.

Each layer (default initialization, seeds 0..3) in bfloat16 runs a sequence of bfloat16 inputs
forward and backward (a bfloat16 output gradient); its float64 copy runs the same rounded inputs
and parameters (ours through the step-by-step reference, ``impl="loop"``). Printed: the largest
error of the outputs, and of every gradient (inputs and parameters), each relative to the largest
reference value and in bfloat16 roundings (2⁻⁸).

    python benchmarks/bf16_rnn_error.py --shape 50x8x64x128
"""

from __future__ import annotations

import argparse
import contextlib
import copy

import torch

import layernorm
from layernorm.recurrent import bfloat16_recurrent_products

UNIT = 2.0**-8


def errors(make, shape: tuple[int, int, int, int], seed: int, rounded: bool) -> tuple[float, float]:
    """(output error, largest gradient error) in bfloat16 roundings for one seed."""
    steps, batch, features, hidden = shape
    torch.manual_seed(seed)
    model = make(features, hidden).bfloat16()
    x = torch.randn(steps, batch, features, dtype=torch.float64).bfloat16().requires_grad_()
    ref = copy.deepcopy(model).double()
    if hasattr(ref, "impl"):
        ref.impl = "loop"
    with bfloat16_recurrent_products() if rounded else contextlib.nullcontext():
        out, _ = model(x)
    dy = torch.randn(out.shape, dtype=torch.float64).bfloat16()
    grads = torch.autograd.grad(out, [x, *model.parameters()], dy)
    xr = x.detach().double().requires_grad_()
    out_r, _ = ref(xr)
    grads_r = torch.autograd.grad(out_r, [xr, *ref.parameters()], dy.double())

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.double() - b).abs().max() / b.abs().max()).item() / UNIT

    return rel(out, out_r), max(rel(g, r) for g, r in zip(grads, grads_r, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", default="50x8x64x128", help="T x B x I x H")
    ap.add_argument("--seeds", type=int, default=4)
    args = ap.parse_args()
    shape = tuple(int(v) for v in args.shape.split("x"))
    torch.set_num_threads(1)
    print(f"(T, B, I, H) = {shape}, seeds 0..{args.seeds - 1}, in bfloat16 roundings (2^-8)")
    print("| layer | products | output | gradients |\n| --- | --- | ---: | ---: |")
    layers = {"LayerNormLSTM": layernorm.LayerNormLSTM, "LayerNormGRU": layernorm.LayerNormGRU,
              "LayerNormRNN": layernorm.LayerNormRNN, "torch.nn.LSTM": torch.nn.LSTM}  # fmt: skip
    for name, make in layers.items():
        for rounded in (False, True) if name.startswith("LayerNorm") else (False,):
            res = [errors(make, shape, s, rounded) for s in range(args.seeds)]  # type: ignore[arg-type]
            label = "rounded" if rounded else "default"
            print(f"| {name} | {label} | {max(r[0] for r in res):.2f} | "
                  f"{max(r[1] for r in res):.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
