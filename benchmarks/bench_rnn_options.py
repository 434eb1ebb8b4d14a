"""CPU benchmark: the recurrent layers with torch.nn's options, against torch.nn.LSTM / GRU / RNN.

``bench_rnn.py`` times the target shapes with one layer, one direction, time-major inputs. Users
also run several layers, both directions, ``batch_first``, packed sequences of unequal lengths
and torch's LSTM projection (``proj_size``), at other sizes; this script times each such case
for training (forward + ``backward()`` of the output's sum, gradients set to ``None`` after) and
inference (forward under ``no_grad``), ours and torch's in turn within every round
(``_timing.interleaved_ms``), float32; or with ``--consecutive``, each in blocks of consecutive
calls (as a training loop runs one layer call after another), the providers' blocks alternated
(``_timing.consecutive_samples``: the median of the blocks' medians). Packed inputs get lengths
drawn in [T/2, T] (the first sequence T), unsorted (``enforce_sorted=False``). Printed: the
medians in ms and their ratio.

    python benchmarks/bench_rnn_options.py --threads 1
    python benchmarks/bench_rnn_options.py --threads 2 --only "lstm 50x8"
    python benchmarks/bench_rnn_options.py --consecutive --only "{}"   # one layer, one direction
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import CLOCKS, consecutive_samples, cpu_model, interleaved_ms, torch_isa, use_clock
from layernorm import LayerNormGRU, LayerNormLSTM, LayerNormRNN
from layernorm.kernels.cpu import targets

KINDS = {
    "lstm": (torch.nn.LSTM, LayerNormLSTM),
    "gru": (torch.nn.GRU, LayerNormGRU),
    "rnn": (torch.nn.RNN, LayerNormRNN),
}
# (kind, (T, B, I, H), constructor options; "packed": a PackedSequence input)
CASES: tuple[tuple[str, tuple[int, int, int, int], dict[str, Any]], ...] = (
    ("lstm", (50, 8, 64, 128), {}),
    ("lstm", (50, 8, 64, 128), {"bidirectional": True}),
    ("lstm", (50, 8, 64, 128), {"num_layers": 2}),
    ("lstm", (50, 8, 64, 128), {"batch_first": True}),
    ("lstm", (50, 8, 64, 128), {"packed": True}),
    ("lstm", (50, 8, 64, 128), {"num_layers": 2, "dropout": 0.2}),
    ("lstm", (50, 8, 64, 128), {"bias": False}),
    ("lstm", (50, 8, 64, 128), {"proj_size": 64}),
    ("lstm", (100, 32, 128, 256), {"proj_size": 128}),
    ("lstm", (200, 16, 64, 256), {"proj_size": 64, "packed": True}),
    ("lstm", (1, 8, 512, 1024), {"proj_size": 256}),
    ("lstm", (100, 32, 128, 256), {"bidirectional": True}),
    ("lstm", (100, 32, 128, 256), {"num_layers": 2}),
    ("lstm", (100, 32, 128, 256), {"packed": True}),
    ("lstm", (20, 64, 256, 256), {}),
    ("lstm", (100, 16, 300, 100), {}),
    ("lstm", (30, 1, 512, 512), {}),
    ("gru", (50, 8, 64, 128), {"bidirectional": True}),
    ("gru", (100, 32, 128, 256), {"packed": True}),
    ("gru", (50, 8, 64, 128), {"num_layers": 2, "dropout": 0.2}),
    ("rnn", (100, 32, 128, 256), {}),
    ("rnn", (50, 8, 64, 128), {"nonlinearity": "relu"}),
)


def _input_maker(
    x: torch.Tensor, lengths: torch.Tensor | None, batch_first: bool
) -> Callable[[], Any]:
    """Each call's input: ``x``, or packed anew from it (the packing is part of a call)."""
    if lengths is None:
        return lambda: x
    return lambda: pack_padded_sequence(x, lengths, batch_first=batch_first, enforce_sorted=False)


def _calls(
    model: torch.nn.Module, make_input: Callable[[], Any], x: torch.Tensor
) -> dict[str, Callable[[], None]]:
    def train() -> None:
        out, _ = model(make_input())
        (out.data if isinstance(out, PackedSequence) else out).sum().backward()
        for p in model.parameters():
            p.grad = None
        x.grad = None

    def infer() -> None:
        with torch.no_grad():
            model(make_input())

    return {"train": train, "infer": infer}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=15, help="timed rounds per provider")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    ap.add_argument("--only", default="", help="run the cases whose label contains this")
    ap.add_argument("--consecutive", action="store_true",
                    help="time blocks of consecutive calls per provider")  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    use_clock(args.clock)
    print(
        f"device: {cpu_model()} | kernels {targets.selected().name} | torch "
        f"{torch.__version__}, {torch_isa()} | threads {args.threads} | clock {args.clock}"
    )
    for kind, (t, b, i, h), options in CASES:
        label = f"{kind} {t}x{b}x{i}x{h} {options}"
        if args.only not in label:
            continue
        opts = dict(options)
        packed = opts.pop("packed", False)
        torch.manual_seed(0)
        torch_cls, ours_cls = KINDS[kind]
        models = {"torch": torch_cls(i, h, **opts), "ours": ours_cls(i, h, **opts)}
        batch_first = bool(opts.get("batch_first", False))
        x = torch.randn(*((b, t, i) if batch_first else (t, b, i)), requires_grad=True)
        lengths = torch.randint(t // 2, t + 1, (b,))
        lengths[0] = t
        make_input = _input_maker(x, lengths if packed else None, batch_first)
        calls = {name: _calls(m, make_input, x) for name, m in models.items()}
        for mode in ("train", "infer"):
            fns = {name: c[mode] for name, c in calls.items()}
            if args.consecutive:
                ms = {k: statistics.median(v) for k, v in consecutive_samples(fns).items()}
            else:
                ms = interleaved_ms(fns, 3, args.reps)
            print(f"{label:58s} {mode:5s} torch {ms['torch']:8.2f} ms  ours {ms['ours']:8.2f} ms"
                  f"  ratio {ms['ours'] / ms['torch']:.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
