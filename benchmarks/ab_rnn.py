"""A/B of one dispatch setting of the recurrent layers, in one process, against torch.nn.

A threshold of :mod:`layernorm.recurrent._fused` (a module attribute: a byte or element limit, a
chunk size, a function choosing kernels) is set to value A before one provider's calls and to
value B before the other's; both run the same layer (each setting its own copy of it: a layer
keeps the plans its calls build, under the setting of the call that built them) on the same
input, round after round in shuffled order with ``torch.nn.LSTM`` / ``GRU`` beside them
(:func:`_timing.interleaved_samples`),
so the two settings see the same machine. Printed: each setting's time as a ratio to torch's, of
the medians (of the fastest rounds). One timed call is that of ``bench_rnn.py``: forward and
``backward()`` of ``output.sum()`` with the gradients set to ``None`` after it (``train``), or the
forward under ``no_grad`` (``infer``).

    python benchmarks/ab_rnn.py --kind lstm --shape 35x20x650x650 --mode infer --threads 2 \\
        --attr _PROJECTION_BYTES --a "1 << 20" --b "8 << 20"

``--norm none`` times the layers without layer norms (``--norm layer``, the default, with them).
``--a`` and ``--b`` are Python expressions, evaluated with ``_fused`` in scope (``--b
_fused._one_step_kernels`` keeps a function as it is, ``--a "lambda k, s: k"`` replaces it).
``--attr MODULE.NAME`` sets an attribute of another module of :mod:`layernorm.recurrent` (in
scope under its name); the LN-LSTM's training calls without and with their plans:

    python benchmarks/ab_rnn.py --shape 50x8x64x128 --attr _planned.lstm_training \
        --a "lambda *args: None" --b _planned.lstm_training

With ``--cflags`` instead of ``--attr`` they are compiler flags: the C kernels of the selected
target are built once more with each set added, and each provider's calls run its own library
(e.g. a build setting of ``csrc/rnn_seq_impl.h``):

    python benchmarks/ab_rnn.py --shape 1000x4x32x128 --mode infer --cflags \
        --a="" --b="-DGEMM_PREFETCH=8"

With ``--gemm`` they name the sequence kernels' float32 recurrent GEMM (``rnn.use_gemm``: ``mkl``,
MKL's packed GEMM, or ``tile``, the library's own). ``--shape`` takes several shapes separated by
commas, each timed on its own in turn:

    python benchmarks/ab_rnn.py --gemm --a tile --b mkl --mode infer \
        --shape 100x32x128x256,1000x4x32x128

With ``--one-step-gemm`` they name the GEMMs of a float32 forward call of one step
(``rnn.use_one_step_gemm``: ``mkl``, MKL's sgemm reading the weights as stored, or ``packed``):

    python benchmarks/ab_rnn.py --kind gru --one-step-gemm --a packed --b mkl --mode infer \
        --shape 1x32x256x256

``--dtype bfloat16`` (or ``float16``) runs both layers, their input and state in that dtype.
With ``--group`` they are the LN-LSTM forward step's rows a group (``rnn.use_forward_group``):

    python benchmarks/ab_rnn.py --group --a 4 --b 8 --mode infer --shape 20x256x32x32

With ``--batch-split`` they are the batch-row split's limit in bytes of packed weights
(``rnn.use_batch_split_bytes``; 0: two threads always share each step's GEMMs by panels):

    python benchmarks/ab_rnn.py --batch-split --a 0 --b "16 << 20" --threads 2 --mode infer \
        --shape 30x128x64x256

With ``--projection`` they say whether a bfloat16 layer's input projection takes the processor's
bfloat16 dot products (``rnn.use_bfloat16_projection``: ``yes`` or ``no``):

    python benchmarks/ab_rnn.py --projection --a yes --b no --dtype bfloat16 --mode infer

With ``--amx`` they say whether those products run on the processor's AMX tiles
(``rnn.use_amx``: ``yes`` or ``no``, the AVX512-BF16 dot products).

With ``--cpp-node`` they say whether the C++ operators run (``torch_ops.switched``: ``yes`` or
``no``): the LN-LSTM's planned training calls by the C++ node or the Python one:

    python benchmarks/ab_rnn.py --cpp-node --a yes --b no --shape 50x8x64x128
"""

from __future__ import annotations

import argparse
import copy
import importlib
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import CLOCKS, cpu_model, interleaved_samples, torch_isa, use_clock
from bench_rnn import KINDS, step
from layernorm.kernels.cpu import rnn, targets, torch_ops
from layernorm.recurrent import _fused


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kind", choices=sorted(KINDS), default="lstm")
    ap.add_argument("--shape", default="50x8x64x128", help="T x B x I x H")
    ap.add_argument("--mode", choices=("train", "infer"), default="train")
    ap.add_argument("--norm", choices=("layer", "none"), default="layer",
                    help="the layers' norm (none: the recurrence without layer norms)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                    help="both layers', their input's and state's dtype")  # fmt: skip
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--attr",
        help="an attribute of layernorm.recurrent._fused, or MODULE.NAME of another module there",
    )
    what.add_argument("--cflags", action="store_true", help="--a and --b are compiler flags")
    what.add_argument("--gemm", action="store_true", help="--a and --b name rnn.use_gemm choices")
    what.add_argument("--one-step-gemm", action="store_true",
                      help="--a and --b name rnn.use_one_step_gemm choices")  # fmt: skip
    what.add_argument("--group", action="store_true",
                      help="--a and --b are rnn.use_forward_group rows")  # fmt: skip
    what.add_argument("--batch-split", action="store_true",
                      help="--a and --b: rnn.use_batch_split_bytes limits (ints)")  # fmt: skip
    what.add_argument("--projection", action="store_true",
                      help="--a and --b (yes / no): rnn.use_bfloat16_projection")  # fmt: skip
    what.add_argument("--amx", action="store_true",
                      help="--a and --b (yes / no): rnn.use_amx")  # fmt: skip
    what.add_argument("--cpp-node", action="store_true",
                      help="--a and --b (yes / no): the C++ operators on or off")  # fmt: skip
    ap.add_argument("--a", required=True, help="its value for provider A (a Python expression)")
    ap.add_argument("--b", required=True, help="its value for provider B")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    args = ap.parse_args()
    if args.cflags:
        isa = targets.selected().name
        libs = {
            k: rnn._library_for(isa, tuple(v.split())) for k, v in (("A", args.a), ("B", args.b))
        }
        if None in libs.values():
            ap.error("a variant's C kernels did not build (see the warning)")
        setters = {
            k: (lambda lib=lib: setattr(rnn, "_library", lambda: lib)) for k, lib in libs.items()
        }
    elif args.gemm:
        for v in (args.a, args.b):
            if v not in rnn.GEMM_CHOICES:
                ap.error(f"--gemm: --a and --b must be among {rnn.GEMM_CHOICES}, got {v!r}")
        setters = {k: (lambda v=v: rnn.use_gemm(v)) for k, v in (("A", args.a), ("B", args.b))}
    elif args.one_step_gemm:
        for v in (args.a, args.b):
            if v not in rnn.ONE_STEP_GEMM_CHOICES:
                ap.error(f"--one-step-gemm: --a and --b must be among "
                         f"{rnn.ONE_STEP_GEMM_CHOICES}, got {v!r}")  # fmt: skip
        setters = {
            k: (lambda v=v: rnn.use_one_step_gemm(v)) for k, v in (("A", args.a), ("B", args.b))
        }
    elif args.group:
        rows = {}
        for k, v in (("A", args.a), ("B", args.b)):
            if not v.isdigit() or int(v) not in rnn.FORWARD_GROUPS:
                ap.error(f"--group: --a and --b must be rows in {rnn.FORWARD_GROUPS}, got {v!r}")
            rows[k] = int(v)
        setters = {k: (lambda v=v: rnn.use_forward_group(v)) for k, v in rows.items()}
    elif args.batch_split:
        limits = {}
        for k, v in (("A", args.a), ("B", args.b)):
            limit = eval(v, {})  # the command line's own integer expression, e.g. "16 << 20"
            if type(limit) is not int or limit < 0:
                ap.error(f"--batch-split: --a and --b must be ints >= 0, got {v!r}")
            limits[k] = limit
        setters = {k: (lambda v=v: rnn.use_batch_split_bytes(v)) for k, v in limits.items()}
    elif args.projection or args.amx or args.cpp_node:
        flag = "--projection" if args.projection else "--amx" if args.amx else "--cpp-node"
        use = (
            rnn.use_bfloat16_projection
            if args.projection
            else rnn.use_amx
            if args.amx
            else lambda on: torch_ops._switch.update(on=on)
        )
        choices = {}
        for k, v in (("A", args.a), ("B", args.b)):
            if v not in ("yes", "no"):
                ap.error(f"{flag}: --a and --b must be yes or no, got {v!r}")
            choices[k] = v == "yes"
        setters = {k: (lambda v=v: use(v)) for k, v in choices.items()}
    else:
        module_name, _, name = args.attr.rpartition(".")
        try:
            owner = importlib.import_module(f"layernorm.recurrent.{module_name or '_fused'}")
        except ImportError:
            ap.error(f"--attr {args.attr!r}: no module layernorm.recurrent.{module_name}")
        if not hasattr(owner, name):
            ap.error(f"{owner.__name__} has no attribute {name!r}")
        scope = {"_fused": _fused, owner.__name__.rpartition(".")[2]: owner}
        # the command line's own expressions, evaluated as the user typed them
        values = {"A": eval(args.a, scope), "B": eval(args.b, scope)}
        setters = {k: (lambda v=v: setattr(owner, name, v)) for k, v in values.items()}
    torch.set_num_threads(args.threads)
    use_clock(args.clock)
    print(
        f"device: {cpu_model()} | kernels {targets.selected().name} | torch "
        f"{torch.__version__}, {torch_isa()} | threads {args.threads} | clock {args.clock}"
    )
    setting = args.attr or next(
        name
        for name in (
            "cflags",
            "gemm",
            "one_step_gemm",
            "group",
            "batch_split",
            "projection",
            "amx",
            "cpp_node",
        )
        if getattr(args, name)
    )
    for shape in args.shape.split(","):
        t, b, i, h = (int(v) for v in shape.split("x"))
        torch.manual_seed(0)
        tcls, ocls = KINDS[args.kind]
        dtype = getattr(torch, args.dtype)
        ref = tcls(i, h)
        ours = ocls.from_torch(ref, norm=args.norm).to(dtype)
        ref = ref.to(dtype)
        x = (torch.randn(t, b, i) + 0.5).to(dtype).requires_grad_(args.mode == "train")
        # a layer for each setting: a layer keeps the plans of its calls (inference, training),
        # built under the setting of the call that built them, which one layer would then run
        # under both settings
        layers = {"A": ours, "B": copy.deepcopy(ours)}

        def with_setting(key, layers=layers, x=x):
            apply, run = setters[key], step(layers[key], x, args.mode)

            def fn() -> None:
                apply()
                run()

            return fn

        fns = {"torch": step(ref, x, args.mode), "A": with_setting("A"), "B": with_setting("B")}
        samples = interleaved_samples(fns, warmup=3, reps=args.reps)
        med = {k: statistics.median(v) for k, v in samples.items()}
        low = {k: min(v) for k, v in samples.items()}
        print(f"{args.kind} {(t, b, i, h)} {args.dtype} {args.mode}: torch {med['torch']:.2f} ms; "
              f"{setting} "
              f"A = {args.a}: {med['A'] / med['torch']:.2f} ({low['A'] / low['torch']:.2f}), "
              f"B = {args.b}: {med['B'] / med['torch']:.2f} ({low['B'] / low['torch']:.2f}) "
              f"x torch, medians (fastest rounds) of {args.reps} rounds")  # fmt: skip


if __name__ == "__main__":
    main()
