"""The LN-LSTM forward step kernel's rows in cache: ns a row, per build of two source trees.

One timed call runs ``--inner`` calls of ``lstm_fwd_step`` (float32) over a step of ``--rows``
rows whose buffers stay in cache: the layer norms' statistics of hp (and, with ``--input-norm``,
of the raw gx in the step), the gates, c_t, LN(c_t) and the outputs; or, with ``--input-rows``,
``input_rows`` first (gx's layer norms by the sequence kernels' inference pass) and then the step.
The kernels run through their checked argument struct (``rnn_abi.LSTM_FWD``), one ctypes call per
step, whose cost (about a microsecond) is in the figures.

Each build is the step and sequence kernels of a source tree's ``csrc`` folder (this package's,
and with ``--other DIR`` another one, e.g. an older commit's ``git archive`` of
``src/layernorm/kernels/cpu/csrc``: the argument structs must be the same), for each chosen
target; all are timed round-robin in one process, so the ratios hold on a shared machine.
Every build's outputs are compared with the first one's first (the same bits expected where the
statistics' order of operations is unchanged).

    python benchmarks/bench_rnn_step.py --hidden 32,128,256 --targets avx512bf16,avx2 \\
        --other /tmp/old/src/layernorm/kernels/cpu/csrc
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import cpu_model, interleaved_ms
from layernorm.kernels.cpu import cbuild, rnn, rnn_abi, targets


def load(target: targets.Target, csrc: Path, tag: str) -> ctypes.CDLL:
    """The step and sequence kernels of folder ``csrc`` for ``target``."""
    path = cbuild.build_shared_library(
        (csrc / "rnn_step.c", csrc / "rnn_seq.c"), f"layernorm_step_bench_{target.name}_{tag}",
        rnn.EXTRA_FLAGS, isa_flags=target.flags,
    )  # fmt: skip
    lib = ctypes.CDLL(str(path))
    lib.lstm_fwd_step_f32.argtypes = (ctypes.c_void_p,)
    lib.lstm_fwd_step_f32.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.input_rows_f32.argtypes = (ptr, i64, i64, ptr, ptr, ctypes.c_double, ctypes.c_int, i64, i64)
    lib.input_rows_f32.restype = None
    return lib


def buffers(hs: int, rows: int, input_norm: bool) -> dict[str, torch.Tensor]:
    """A step's float32 buffers: hp and gx rows around offsets far from zero, random states and
    gains, zeroed outputs (a fixed seed: every build gets the same)."""
    gen = torch.Generator().manual_seed(hs)
    g = 4 * hs

    def rand(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return shift + scale * torch.randn(*shape, generator=gen)

    t = {"hp": rand(rows, g, scale=2.0, shift=30.0), "gx": rand(rows, g, shift=-7.0),
         "h": rand(rows, hs), "c": rand(rows, hs), "w1": rand(g, scale=0.3, shift=1.0),
         "b1": rand(g, scale=0.3), "w3": rand(hs, scale=0.3, shift=1.0), "b3": rand(hs, scale=0.3),
         "w0": rand(g, scale=0.3, shift=1.0), "b0": rand(g, scale=0.3)}  # fmt: skip
    outputs = (("out", hs), ("hprev", hs), ("cprev", hs), ("acts", g), ("cn", hs), ("tc", hs))
    t.update({k: torch.zeros(rows, c) for k, c in outputs})
    t.update({k: torch.zeros(rows) for k in ("mh", "rh", "mc", "rc", "mx", "rx")})
    if not input_norm:  # the step takes gx as given (normalized before, or by input_rows)
        for k in ("mx", "rx"):
            del t[k]
    return t


def step_struct(t: dict[str, torch.Tensor], hs: int, rows: int, input_norm: bool) -> object:
    values = {**t, "eps": 1e-5, "off": 0, "rows": rows, "threads": 1, "layer_norm": 1,
              "normalize_cell_state": 0}  # fmt: skip
    if not input_norm:
        values.pop("w0")
        values.pop("b0")
    sizes = {"N": rows, "B": rows, "H": hs, "G": 4 * hs, "R": rows, "X": rows}
    return rnn.prepare(rnn_abi.LSTM_FWD, torch.float32, values, sizes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", default="32,64,128,256")
    ap.add_argument("--rows", type=int, default=64, help="rows of the step")
    ap.add_argument("--reps", type=int, default=9, help="timed rounds per build")
    ap.add_argument("--inner", type=int, default=200, help="steps per timed call")
    ap.add_argument("--targets", default="", help="comma-separated; default: the selected one")
    ap.add_argument("--other", type=Path, help="another source tree's csrc folder to time beside")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--input-norm", action="store_true", help="raw gx normalized in the step")
    mode.add_argument("--input-rows", action="store_true", help="input_rows, then the step")
    args = ap.parse_args()
    names = [n for n in args.targets.split(",") if n] or [targets.selected().name]
    trees = {"this": rnn_abi.CSRC_DIR, **({"other": args.other.resolve()} if args.other else {})}
    libs = {f"{n}/{tag}": load(targets.target(n), csrc, tag)
            for n in names for tag, csrc in trees.items()}  # fmt: skip
    what = "lstm_fwd_step"
    if args.input_norm:
        what += ", raw gx normalized in it"
    elif args.input_rows:
        what = "input_rows, then " + what
    print(f"processor: {cpu_model()} | torch {torch.__version__} | one thread | {args.rows} rows "
          f"a step | float32 {what}")  # fmt: skip
    print("| H | " + " | ".join(f"{k} ns/row" for k in libs) + " |")
    print("|" + " --- |" * (len(libs) + 1))
    for hs in (int(h) for h in args.hidden.split(",")):
        ns = time_hidden(libs, hs, args)
        print(f"| {hs} | " + " | ".join(f"{ns[k]:.1f}" for k in libs) + " |")


def time_hidden(
    libs: dict[str, ctypes.CDLL], hs: int, args: argparse.Namespace
) -> dict[str, float]:
    """ns a row of each build at hidden size ``hs``, after checking its outputs."""
    runs = {k: buffers(hs, args.rows, args.input_norm) for k in libs}
    structs = {k: step_struct(t, hs, args.rows, args.input_norm) for k, t in runs.items()}
    gx0 = next(iter(runs.values()))["gx"].clone()

    def call(k: str, inner: int) -> None:
        lib, t, st = libs[k], runs[k], ctypes.byref(structs[k])  # type: ignore[arg-type]
        for _ in range(inner):
            if args.input_rows:
                t["gx"].copy_(gx0)
                lib.input_rows_f32(t["gx"].data_ptr(), 4 * hs, 4 * hs, t["w0"].data_ptr(),
                                   t["b0"].data_ptr(), 1e-5, 1, 0, args.rows)  # fmt: skip
            assert lib.lstm_fwd_step_f32(st) == 0

    for k in libs:  # against the same target's build of this tree
        call(k, 1)
        first = k.split("/")[0] + "/this"
        for name, v in runs[k].items():
            if not torch.equal(v, runs[first][name]):
                print(f"  note: H = {hs}, {k}: {name} differs from {first}'s")
    fns = {k: functools.partial(call, k, args.inner) for k in libs}
    ms = interleaved_ms(fns, warmup=2, reps=args.reps)
    return {k: v * 1e6 / (args.inner * args.rows) for k, v in ms.items()}


if __name__ == "__main__":
    main()
