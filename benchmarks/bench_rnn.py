"""CPU benchmark: layer-normalized LSTM/GRU/RNN layers against torch.nn's, forward + backward.

Providers, timed round-robin in one run (see ``_timing.interleaved_ms``) so their ratios hold on a
shared machine:

* ``torch``      — ``torch.nn.LSTM`` / ``GRU`` / ``RNN`` (ATen's fused CPU RNN, oneDNN where
  available)
* ``ln``         — ``LayerNormLSTM`` / ``LayerNormGRU`` / ``LayerNormRNN`` (fused path: one GEMM +
  one LN for all input projections, one C call per direction for the time loop, its recurrent
  GEMMs and pointwise work, analytic backward in time)
* ``none``       — our fused path with ``norm="none"`` (what the LN costs on top of our recurrence)
* ``ln-loop``    — the readable step-by-step reference (eager autograd), with ``--loop``
* ``ln-eager``   — the fused path with the eager (PyTorch-op) step functions instead of the C
  kernels, i.e. what runs without a C compiler, with ``--eager-steps``
* ``ln-steps``   — the fused path with the C step kernels but the time loop in Python (per step
  ``torch.mm`` for the recurrent GEMM, then one C call; ``torch.mm`` for the weight gradient),
  i.e. the C kernels without their whole-sequence functions, with ``--per-step`` (adds a column)
* ``ln-node``    — with ``--mode infer``: inference through the training node (per-row buffers
  over every row, what ran before the inference path), to show what that path gains
* ``ln-rounded`` — with ``--dtype bfloat16``: the LN layer inside
  ``layernorm.recurrent.bfloat16_recurrent_products()`` (recurrent GEMMs on h_{t−1} rounded to
  bfloat16, and the backward's products on the rounded gates' gradient, as torch's bfloat16
  layers run them; where the build has AVX512-BF16)

One timed call = forward over the whole sequence + ``backward()`` of ``output.sum()``, float32
unless ``--dtype`` says otherwise (both layers, input and parameters in that dtype).
``--memory`` adds each provider's peak memory during one call: the highest sum of the bytes
torch's CPU allocator handed out and not yet freed, from the profiler's allocation events, so
the parameters and the input held before the call do not count and outputs do. (Buffers that a
library allocates itself are not in it: our sequence kernels' packed weight, K·G floats per
thread, and oneDNN's own scratch.)
Work per call (LSTM, G = 4): forward ``2·T·B·G·H·(I + H)`` FLOPs in the GEMMs, backward twice that;
the layer norms add ``O(T·B·G·H)``, about 1% at these shapes.

    python benchmarks/bench_rnn.py                 # the three shapes of RESULTS.md
    python benchmarks/bench_rnn.py --threads 1 --loop --csv rnn.csv
    python benchmarks/bench_rnn.py --isa avx2 --mode infer   # the AVX2 kernels, inference
    python benchmarks/bench_rnn.py --consecutive 20   # blocks of 20 calls per provider (a loop)

``--isa`` runs the kernels built for another instruction set this CPU can run (e.g. AVX2 on an
AVX-512 processor); torch's own kernels are unaffected and keep the CPU's widest vectors, unless
the environment restricts them (``_timing.TORCH_ISA_ENV``; the device line says which ran):

    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
        python benchmarks/bench_rnn.py --isa avx2    # both sides as on an AVX2 processor
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
from pathlib import Path

# The profiler of --memory (kineto) logs two lines to stderr at each start and stop by default;
# level 6 keeps the tables readable. Read when the profiler starts, so before it is enough.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _records import append_csv
from _timing import (
    CLOCKS,
    consecutive_samples,
    cpu_model,
    interleaved_samples,
    torch_isa,
    use_clock,
)
from layernorm import LayerNormGRU, LayerNormLSTM, LayerNormRNN
from layernorm.kernels.cpu import isa as kernel_isa
from layernorm.kernels.cpu import rnn, targets
from layernorm.recurrent import (
    StepKernels,
    _cstep,
    _fused,
    _pointwise,
    bfloat16_recurrent_products,
    clear_buffer_cache,
    register_step_kernels,
)

SHAPES = ((100, 32, 128, 256), (100, 64, 256, 512), (50, 8, 64, 128))  # (T, B, I, H)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KINDS = {
    "lstm": (torch.nn.LSTM, LayerNormLSTM),
    "gru": (torch.nn.GRU, LayerNormGRU),
    "rnn": (torch.nn.RNN, LayerNormRNN),
}


def step(model: torch.nn.Module, x: torch.Tensor, mode: str = "train", hx: object = None):
    """One timed call of ``model`` on ``x`` from the initial state ``hx`` (``None``: zeros)."""
    if mode == "infer":

        def infer() -> None:
            with torch.no_grad():
                model(x, hx)

        return infer

    def fn() -> None:
        out, _ = model(x, hx)
        out.sum().backward()
        for p in model.parameters():
            p.grad = None
        x.grad = None

    return fn


def via_training_node(fn):
    """Run ``fn`` with the inference path off (and the plans a layer kept from it, and the
    Elman layer's one step by the cell's ops): under ``no_grad`` the direction then runs the
    training node, its per-row buffers over every row (what inference ran before that path)."""

    def wrapped() -> None:
        saved, run = _fused._inference_kernels, _fused.InferencePlan.run
        # (absent from older trees, which an A/B by PYTHONPATH may run)
        elman_step = LayerNormRNN.__dict__.get("_inference_step")
        _fused._inference_kernels = lambda *args: None
        _fused.InferencePlan.run = lambda *args: None  # type: ignore[method-assign]
        if elman_step is not None:
            LayerNormRNN._inference_step = lambda *args: None  # type: ignore[method-assign]
        try:
            fn()
        finally:
            _fused._inference_kernels = saved
            _fused.InferencePlan.run = run  # type: ignore[method-assign]
            if elman_step is not None:
                LayerNormRNN._inference_step = elman_step  # type: ignore[method-assign]

    return wrapped


def with_rounded_products(fn):
    """Run ``fn`` inside :func:`layernorm.recurrent.bfloat16_recurrent_products`."""

    def wrapped() -> None:
        with bfloat16_recurrent_products():
            fn()

    return wrapped


def with_steps(fn, kernels: StepKernels):
    """Run ``fn`` with ``kernels`` registered as the step functions for CPU tensors."""

    def wrapped() -> None:
        register_step_kernels("cpu", kernels)
        try:
            fn()
        finally:
            register_step_kernels("cpu", None)

    return wrapped


def bench_shape(
    kind: str,
    shape: tuple[int, int, int, int],
    loop: bool,
    eager: bool,
    reps: int,
    per_step: bool = False,
    mode: str = "train",
    memory: bool = False,
    dtype: torch.dtype = torch.float32,
    block_calls: int = 0,
    state: bool = False,
) -> dict:
    t, b, i, h = shape
    torch.manual_seed(0)
    tcls, ocls = KINDS[kind]
    ref = tcls(i, h)
    models = {"torch": ref, "ln": ocls.from_torch(ref), "none": ocls.from_torch(ref, norm="none")}
    if loop:
        models["ln-loop"] = ocls.from_torch(ref, impl="loop")
    models = {k: m.to(dtype) for k, m in models.items()}
    x = (torch.randn(t, b, i) + 0.5).to(dtype).requires_grad_(mode == "train")
    hx: object = None  # the zero state; with `state` a given one (a decoder's later tokens)
    if state:
        h0 = (0.5 * torch.randn(1, b, h)).to(dtype)
        hx = (h0, h0.clone()) if kind == "lstm" else h0
    fns = {k: step(m, x, mode, hx) for k, m in models.items()}
    if dtype is torch.bfloat16:
        fns["ln-rounded"] = with_rounded_products(step(models["ln"], x, mode, hx))
    if eager:
        fns["ln-eager"] = with_steps(step(models["ln"], x, mode, hx), _pointwise.EAGER)
    if per_step:
        fns["ln-steps"] = with_steps(step(models["ln"], x, mode, hx), _pointwise.C_STEPS)
    if mode == "infer":
        fns["ln-node"] = via_training_node(fns["ln"])
    if block_calls:  # each provider in blocks of consecutive calls: its samples the blocks' medians
        samples = consecutive_samples(fns, blocks=reps, calls=block_calls, warmup=2)
    else:
        samples = interleaved_samples(fns, warmup=2, reps=reps)
    times = {name: statistics.median(s) for name, s in samples.items()}
    # the fastest round (block) of each provider: on a loaded machine the median carries the
    # neighbours' share of the processor, the minimum little of it
    times.update({f"{name}-min": min(s) for name, s in samples.items()})
    if memory:
        for name in ("torch", "ln"):
            times[f"{name}-peak-mb"] = peak_bytes(fns[name]) / 2**20
    return times


def peak_bytes(fn) -> int:
    """The peak of live bytes allocated by torch on the CPU during ``fn()`` (see the docstring)."""
    fn()  # warm: caches and lazily built kernels are not the step's memory
    # but the step's buffers are: emptied, the recurrent layers' buffer cache allocates them again
    # inside the profiled call (and keeps them, so they count as live to its end)
    clear_buffer_cache()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--reps", type=int, default=7, help="timed rounds (blocks) per provider")
    ap.add_argument("--consecutive", type=int, default=0, metavar="CALLS",
                    help="time each provider in blocks of CALLS consecutive calls, the blocks "
                         "alternated (as a training loop calls one layer after another), "
                         "instead of one call of each in turn")  # fmt: skip
    ap.add_argument("--loop", action="store_true", help="also time the eager reference loop")
    ap.add_argument("--eager-steps", action="store_true", help="also time eager step functions")
    ap.add_argument("--per-step", action="store_true", help="also time the per-step C loop")
    ap.add_argument("--state", action="store_true",
                    help="every call given a random initial state (a decoder's tokens after the "
                         "first); without it, hx=None (zeros)")  # fmt: skip
    ap.add_argument("--kinds", default="lstm,gru,rnn")
    ap.add_argument("--shapes", default=None, help="e.g. 50x8x64x128,100x32x128x256")
    ap.add_argument("--csv", type=Path, default=None, help="append tidy rows to this CSV")
    ap.add_argument("--mode", choices=("train", "infer"), default="train",
                    help="train: forward + backward; infer: forward under no_grad")  # fmt: skip
    ap.add_argument("--memory", action="store_true",
                    help="also the peak memory of a call of torch and LN")  # fmt: skip
    ap.add_argument("--isa", choices=targets.NAMES, default=None,
                    help="the C kernels of this instruction set (default: the CPU's)")  # fmt: skip
    ap.add_argument("--gemm", choices=rnn.GEMM_CHOICES, default=None,
                    help="the sequence kernels' float32 recurrent GEMM (default: the processor's,"
                         " rnn.mkl_by_default)")  # fmt: skip
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                    help="the layers', input's and parameters' dtype")  # fmt: skip
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                    help="thread: CPU time of the calling thread (one thread only), for a "
                         "machine shared with other jobs")  # fmt: skip
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "thread" and torch.get_num_threads() != 1:
        ap.error("--clock thread counts the calling thread only: use it with --threads 1")
    use_clock(args.clock)
    rnn.use_gemm(args.gemm)
    with targets.use(args.isa or kernel_isa()):
        run(args)


def run(args: argparse.Namespace) -> None:
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    products = "no, rounded = LN"
    if rnn.half_gemm():
        products = "AMX tiles" if rnn.amx() else "AVX512-BF16"
        products += ", input projection" + ("" if rnn.bfloat16_projection() else " not")
    half = f", bfloat16 products: {products}" if args.dtype == "bfloat16" else ""
    outpaced = ", also torch.mm's products" if _cstep.tile_outpaces_torch_gemm() else ""
    print(f"device: {cpu_model()} | kernels {kernel_isa()} (recurrent GEMM: "
          f"{rnn.gemm_in_use()}{outpaced}{half}; one step: {rnn.one_step_gemm_in_use()}) "
          f"| torch {torch.__version__}, {torch_isa()} "
          f"| threads {torch.get_num_threads()} | mkldnn {torch.backends.mkldnn.is_available()} "
          f"| {date}")  # fmt: skip
    what = "forward + backward" if args.mode == "train" else "forward under no_grad"
    clock = "thread CPU time" if args.clock == "thread" else "wall time"
    order = (f"blocks of {args.consecutive} consecutive calls per provider, alternated"
             if args.consecutive else "one call of each provider in turn")  # fmt: skip
    start = "a given initial state" if args.state else "the zero initial state (hx=None)"
    print(
        f"{what}, {args.dtype}, from {start}, median ms of {clock} ({order}); ratio = ours / "
        "torch in the same run, of the medians (of the fastest rounds)\n"
    )
    extra = " LN per-step C loop / torch |" if args.per_step else ""
    if args.mode == "infer":
        extra += " LN via training node / torch |"
    if args.dtype == "bfloat16":
        extra += " LN rounded products / torch |"
    if args.memory:
        extra += " peak MB torch | peak MB LN | peak LN / torch |"
    print("| kind | (T, B, I, H) | torch ms | LN ms | LN / torch | none / torch | loop / torch "
          "| LN eager steps / torch |" + extra)  # fmt: skip
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |" + " ---: |" * extra.count("|"))
    shapes = SHAPES
    if args.shapes:
        shapes = tuple(tuple(int(v) for v in s.split("x")) for s in args.shapes.split(","))
    rows = []
    for kind in args.kinds.split(","):
        for shape in shapes:
            r = bench_shape(kind, shape, args.loop, args.eager_steps, args.reps, args.per_step,  # type: ignore[arg-type]
                            args.mode, args.memory, DTYPES[args.dtype],
                            args.consecutive, args.state)  # fmt: skip
            peak = {k: r.pop(k) for k in [k for k in r if k.endswith("-peak-mb")]}
            fastest = {k[: -len("-min")]: r.pop(k) for k in [k for k in r if k.endswith("-min")]}

            def ratio(name: str, r: dict = r, fastest: dict = fastest) -> str:
                if name not in r:
                    return "-"
                return f"{r[name] / r['torch']:.2f} ({fastest[name] / fastest['torch']:.2f})"

            cells = [kind, str(shape), f"{r['torch']:.1f}", f"{r['ln']:.1f}", ratio("ln"),
                     ratio("none"), ratio("ln-loop"), ratio("ln-eager")]  # fmt: skip
            if args.per_step:
                cells.append(ratio("ln-steps"))
            if args.mode == "infer":
                cells.append(ratio("ln-node"))
            if args.dtype == "bfloat16":
                cells.append(ratio("ln-rounded"))
            if peak:
                mb_torch, mb_ln = peak["torch-peak-mb"], peak["ln-peak-mb"]
                cells += [f"{mb_torch:.1f}", f"{mb_ln:.1f}", f"{mb_ln / mb_torch:.2f}"]
            print("| " + " | ".join(cells) + " |", flush=True)
            for provider, ms in r.items():
                rows.append({"date": date, "device": cpu_model(), "isa": kernel_isa(),
                             "mode": args.mode, "dtype": args.dtype, "torch": torch.__version__,
                             "threads": torch.get_num_threads(), "kind": kind,
                             "T": shape[0], "B": shape[1], "I": shape[2], "H": shape[3],
                             "provider": provider, "ms": f"{ms:.3f}",
                             "ratio_vs_torch": f"{ms / r['torch']:.3f}",
                             "peak_mb": f"{peak[provider + '-peak-mb']:.2f}"
                             if provider + "-peak-mb" in peak else ""})  # fmt: skip
    if args.csv is not None:
        append_csv(args.csv, rows)


if __name__ == "__main__":
    main()
