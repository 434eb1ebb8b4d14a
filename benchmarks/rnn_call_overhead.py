"""What an LN-LSTM training call costs besides its kernels: Python, autograd, buffers, structs.

At small shapes the kernels of a training call take about as long as all of ``torch.nn.LSTM``'s
call, so what decides the ratio is the rest. Timing the rest beside the kernels is noisy (a few
percent of a call that varies by as much); here the kernels are taken out instead: the C
sequence kernels' calls and the weight-gradient GEMMs become no-ops (their outputs a buffer of
zeros or left as they are), and what is timed is everything else a call of the layer does,
forward and ``backward()`` of ``output.sum()``, with the gradients set to ``None`` after it:

* ``planned``  — the layer as it runs (its training calls by their plans, ``_planned``);
* ``fused``    — the same with the plans off (``_fused.LSTMSequence`` on every call);
* ``floor``    — an ``autograd.Function`` with the same inputs (the input, the states, ten
  parameters) that computes nothing, behind the same reshapes: what any one-node layer of this
  signature costs.

The results are not those of a layer (the zeros flow on); only the times mean something. The
C++ node of the planned calls (``csrc_torch/rnn_ops.cpp``) calls its kernels from C++, where they
cannot be taken out, so here the C++ operators are switched off and ``planned`` is the Python
node; ``ab_rnn.py --cpp-node --a yes --b no`` times the two nodes with their kernels.

    python benchmarks/rnn_call_overhead.py --shape 50x8x64x128 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import cpu_model, median_ms, torch_isa
from layernorm import LayerNormLSTM
from layernorm.kernels.cpu import rnn, targets, torch_ops
from layernorm.recurrent import _cstep, _fused, _planned


def _without_kernels() -> None:
    """The kernels' calls as no-ops, for the rest of the process."""
    rnn.run_sequence = lambda *args: None  # type: ignore[assignment]

    def zeros(d: torch.Tensor, x: torch.Tensor, *_: object) -> torch.Tensor:
        return torch.zeros(d.shape[1], x.shape[1], dtype=d.dtype)

    rnn.weight_grad = zeros  # type: ignore[assignment]
    _cstep.transposed_product = zeros  # type: ignore[assignment]

    def projection_grads(kernels, grad, data, w_ih, need_data, need_w, rounded=False):  # type: ignore[no-untyped-def]
        return None, (torch.zeros_like(w_ih) if need_w else None)

    _fused._projection_grads = projection_grads  # type: ignore[assignment]


class _Nothing(torch.autograd.Function):
    """A node with the layer's inputs that computes nothing (the floor)."""

    @staticmethod
    def forward(ctx, x, h0, c0, *params):  # type: ignore[no-untyped-def, override]
        ctx.save_for_backward(x, *params)
        return x.new_empty(x.shape[0], h0.shape[1]), h0.clone(), c0.clone()

    @staticmethod
    def backward(ctx, dout, dh, dc):  # type: ignore[no-untyped-def, override]
        x, *params = ctx.saved_tensors
        return (torch.zeros_like(x), dh, dc, *(torch.zeros_like(p) for p in params))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", default="50x8x64x128", help="T x B x I x H")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=200, help="calls per timed block")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t, b, i, h = (int(v) for v in args.shape.split("x"))
    print(
        f"device: {cpu_model()} | kernels {targets.selected().name} | torch {torch.__version__}, "
        f"{torch_isa()} | threads {args.threads} | shape (T, B, I, H) = ({t}, {b}, {i}, {h})"
    )
    _without_kernels()
    torch_ops._switch["on"] = False  # the Python node (see above)
    torch.manual_seed(0)
    model = LayerNormLSTM(i, h)
    x = (torch.randn(t, b, i) + 0.5).requires_grad_()
    params = list(model.parameters())
    states = torch.zeros(1, b, h)

    def layer() -> None:
        y, _ = model(x)
        y.sum().backward()
        for p in params:
            p.grad = None
        x.grad = None

    def floor() -> None:
        y, hn, cn = _Nothing.apply(x.reshape(t * b, i), states[0], states[0], *params)
        y.view(t, b, h).sum().backward()
        hn.unsqueeze(0), cn.unsqueeze(0)
        for p in params:
            p.grad = None
        x.grad = None

    planned = _planned.lstm_training

    def without_plans() -> None:
        _planned.lstm_training = lambda *a: None  # type: ignore[assignment]
        try:
            layer()
        finally:
            _planned.lstm_training = planned

    fns = {"planned": layer, "fused": without_plans, "floor": floor}
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(args.rounds):
        for name in fns if r % 2 == 0 else list(fns)[::-1]:
            samples[name].append(1e3 * median_ms(fns[name], warmup=20, reps=args.calls))
    print("| provider | µs a call (median of rounds) | fastest round |")
    print("|---|---|---|")
    for name, s in samples.items():
        print(f"| {name} | {statistics.median(s):.0f} | {min(s):.0f} |")


if __name__ == "__main__":
    main()
