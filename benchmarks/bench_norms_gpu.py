"""GPU benchmark of the Triton norm kernels and the fused LN-LSTM step, next to the baselines.

One command prints the tables and appends tidy CSV rows (device, versions, date with every row)::

    python benchmarks/bench_norms_gpu.py                    # full sweep, CSV in benchmarks/results/
    python benchmarks/bench_norms_gpu.py --quick            # fewer N, no LSTM
    python benchmarks/bench_norms_gpu.py --plot norms.png   # also a GB/s-vs-N plot from this run

What is measured (``triton.testing.do_bench``: median, L2 flushed between repetitions):

* bandwidth sweep: forward and backward GB/s of layer norm and RMSNorm at ``M·N = 2^27`` elements
  (``--log2-elems``), N from 256 to 65536 and 262144, bfloat16 and float32; providers side by side:
  ``copy`` (``x.clone()``, the device's practical copy bandwidth), ``ours`` (this library, Triton
  backend), ``torch`` (native ``F.layer_norm`` / ``F.rms_norm``), ``compile``
  (``torch.compile`` of the native op) and ``liger`` (Liger-Kernel, when installed).
  Byte counts are the minimum traffic of the op, the same for every provider (see ``_bytes``).
* small-M latency: ``M = 64, N = 4096`` bfloat16, forward and forward+backward in microseconds.
* LN-LSTM: a layer of ``layernorm.recurrent.LayerNormLSTM`` (eager step and, when it can be
  installed, the fused Triton step) vs cuDNN ``nn.LSTM`` at
  ``(T, B, I, H) = (100, 64, 1024, 1024)``, forward+backward milliseconds. Skipped when
  ``layernorm.recurrent`` is not importable.

``--tune`` times our kernels instead, under candidate launch settings (``layernorm.kernels.triton.
_norm_core.LaunchSettings``) varied one factor at a time around the current ones (``TUNE_GRID``):
for each op, dtype and N, forward and backward GB/s (the sweep's byte counts) of every candidate
that changes the launch at that N, a table of the best setting per N with its gain over the
defaults, a summary per candidate, and CSV rows with ``table = tune`` and the setting in
``provider`` (``ours[default]``, ``ours[looped_block_n=8192]``). ``--tune-factors`` narrows the
grid. It prints the number of timings and an estimate of the time first (the default grid ran in
84 s on an H200)::

    python benchmarks/bench_norms_gpu.py --tune
    python benchmarks/bench_norms_gpu.py --tune --tune-factors max_fused_block_n_bwd looped_block_n

``--dry-run`` runs every code path on CPU tensors under the Triton interpreter with tiny shapes and
wall-clock timing (numbers meaningless), to check the script itself without a GPU (with ``--tune``
the candidate grid is scaled down to the tiny rows, ``DRY_RUN_TUNE_GRID``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_NS = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 262144]
QUICK_NS = [256, 4096, 65536]
PROVIDERS = ["copy", "ours", "torch", "compile", "liger"]
DEFAULT_CSV = Path(__file__).resolve().parent / "results" / "bench_norms_gpu.csv"
# --tune: candidate values of each LaunchSettings field, tried one at a time (the others at their
# current values); at each N, a candidate launching the same kernels as an earlier one is skipped.
TUNE_GRID: dict[str, list[int]] = {
    "max_fused_block_n_fwd": [8192, 16384, 32768, 65536],
    "max_fused_block_n_bwd": [4096, 8192, 16384, 32768],
    "elems_per_thread": [8, 16, 32],
    "looped_block_n": [2048, 4096, 8192],
    "programs_per_sm": [2, 4, 8],
    "fused_tile_elems": [2048, 4096, 8192],
    "fused_tile_elems_bwd": [1024, 2048, 4096],
    "looped_elems_per_thread_bwd": [4, 8, 16],
    "short_rows_bwd_max_n": [256, 512, 1024],
    "short_rows_elems_per_thread_bwd": [16, 32],
    "short_rows_programs_per_sm": [4, 8],
    "long_rows_fwd_min_n": [8192, 16384, 32768],
    "long_rows_elems_per_thread_fwd": [16, 32],
}
# --tune --dry-run: the same factors at the tiny rows' scale (N = 256, 512), so that both kernel
# routes and several tile shapes run under the interpreter
DRY_RUN_TUNE_GRID: dict[str, list[int]] = {
    "max_fused_block_n_fwd": [256],
    "max_fused_block_n_bwd": [256],
    "elems_per_thread": [8],
    "looped_block_n": [128],
    "programs_per_sm": [2],
    "fused_tile_elems": [1024],
    "fused_tile_elems_bwd": [1024],
    "looped_elems_per_thread_bwd": [16],
    "short_rows_bwd_max_n": [128],
    "short_rows_elems_per_thread_bwd": [16],
    "short_rows_programs_per_sm": [4],
    "long_rows_fwd_min_n": [256],
    "long_rows_elems_per_thread_fwd": [16],
}
TUNE_REP_MS = 50  # do_bench's measuring time per candidate; the sweep's 100 ms is not needed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ops", nargs="+", default=["layer_norm", "rms_norm"],
                   choices=["layer_norm", "rms_norm"])  # fmt: skip
    p.add_argument(
        "--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp16", "fp32"]
    )
    p.add_argument("--ns", nargs="+", type=int, default=None, help="row lengths N (default: sweep)")
    p.add_argument("--log2-elems", type=int, default=27, help="M·N = 2^this (default 27)")
    p.add_argument("--providers", nargs="+", default=PROVIDERS, choices=PROVIDERS)
    p.add_argument("--param-dtype", choices=["same", "fp32"], default="same",
                   help="gain/bias dtype: the input's (default; torch's fused kernels need it) "
                   "or float32 (mixed precision)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="N in {256, 4096, 65536}, no LSTM")
    p.add_argument("--no-latency", action="store_true", help="skip the small-M latency table")
    p.add_argument("--no-lstm", action="store_true", help="skip the LN-LSTM comparison")
    p.add_argument("--lstm-shape", nargs=4, type=int, default=[100, 64, 1024, 1024],
                   metavar=("T", "B", "I", "H"))  # fmt: skip
    p.add_argument("--csv", type=Path, default=DEFAULT_CSV, help="CSV file rows are appended to")
    p.add_argument("--plot", type=Path, default=None, help="write a GB/s-vs-N plot of this run")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, Triton interpreter, tiny shapes: checks the script only")  # fmt: skip
    p.add_argument("--tune", action="store_true",
                   help="time our kernels under candidate launch settings (TUNE_GRID) instead of "
                   "the provider sweep")  # fmt: skip
    p.add_argument("--tune-factors", nargs="+", default=list(TUNE_GRID), choices=list(TUNE_GRID),
                   metavar="FACTOR", help=f"settings --tune varies (default: all of "
                   f"{', '.join(TUNE_GRID)})")  # fmt: skip
    p.add_argument("--tune-settings", nargs="+", default=None, metavar="SPEC",
                   help="--tune times these settings beside the defaults instead of the one-factor "
                   "grid; each SPEC is 'name=value,name=value' (LaunchSettings fields), so "
                   "factors can be combined")  # fmt: skip
    p.add_argument("--tune-repeats", type=int, default=1, metavar="R",
                   help="--tune times every candidate R times, in R rounds over the candidates, "
                   "and tables the median (default 1)")  # fmt: skip
    args = p.parse_args(argv)
    if args.tune_repeats < 1:
        p.error(f"--tune-repeats must be at least 1, got {args.tune_repeats}")
    if args.tune_settings is not None:
        from layernorm.kernels.triton._norm_core import parse_launch_spec

        try:
            for spec in args.tune_settings:
                parse_launch_spec(spec, "--tune-settings")
        except ValueError as err:
            p.error(str(err))
    if args.ns is None:
        args.ns = QUICK_NS if args.quick else DEFAULT_NS
    if any(n <= 0 for n in args.ns):
        p.error(f"--ns must be positive, got {args.ns}")
    if args.quick:
        args.no_lstm = True
    if args.dry_run:
        args.log2_elems = min(args.log2_elems, 12)
        args.ns = [n for n in args.ns if n <= 1 << args.log2_elems][:2] or [256]
        args.lstm_shape = [3, 2, 8, 8]
    return args


# ----------------------------------------------------------------------------------------------
# Timing and byte counts
# ----------------------------------------------------------------------------------------------


def make_timer(dry_run: bool) -> Callable[..., float]:
    """Milliseconds per call: ``do_bench`` on the GPU, a wall-clock median in a dry run."""
    if dry_run:

        def wall(fn: Callable[[], Any], grad_to_none: list | None = None, rep: int = 0) -> float:
            fn()
            samples = []
            for _ in range(2):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
            return 1e3 * statistics.median(samples)

        return wall
    from triton.testing import do_bench

    def bench(fn: Callable[[], Any], grad_to_none: list | None = None, rep: int = 100) -> float:
        return float(do_bench(fn, rep=rep, grad_to_none=grad_to_none, return_mode="median"))

    return bench


def _bytes(op: str, direction: str, m: int, n: int, elem: int, welem: int) -> int:
    """Minimum bytes moved by one call; partial-sum buffers etc. count against the provider.

    fwd: read x + write y = 2·M·N·elem, + read weight (and bias) + write mean/rstd (4 B each).
    bwd: read x, dy + write dx = 3·M·N·elem, + read weight + read mean/rstd + write dweight
    (and dbias) in float32. RMSNorm has no bias and no mean. copy: read + write = 2·M·N·elem.
    """
    if op == "copy":
        return 2 * m * n * elem
    n_params = 2 if op == "layer_norm" else 1
    n_stats = 2 if op == "layer_norm" else 1
    if direction == "fwd":
        return 2 * m * n * elem + n_params * n * welem + n_stats * m * 4
    return 3 * m * n * elem + n * welem + n_stats * m * 4 + n_params * n * 4


# ----------------------------------------------------------------------------------------------
# Providers: each returns (forward closure, backward closure) or raises to be skipped
# ----------------------------------------------------------------------------------------------


def make_inputs(m: int, n: int, dtype, param_dtype: str, device: str):
    """Seeded ``(x, w, b, dy)``: ``x`` with non-zero mean, gain and bias in ``dtype`` or float32
    (``param_dtype`` "same" or "fp32"); ``x``, ``w``, ``b`` require grad."""
    import torch

    torch.manual_seed(0)
    x = (torch.randn(m, n, device=device) * 2 + 1).to(dtype).requires_grad_()
    pdt = dtype if param_dtype == "same" else torch.float32
    w = (1 + 0.1 * torch.randn(n, device=device)).to(pdt).requires_grad_()
    b = (0.1 * torch.randn(n, device=device)).to(pdt).requires_grad_()
    dy = torch.randn(m, n, device=device).to(dtype)
    return x, w, b, dy


def _native(op: str, n: int, x, w, b, eps: float):
    import torch.nn.functional as F

    if op == "layer_norm":
        return lambda: F.layer_norm(x, (n,), w, b, eps)
    return lambda: F.rms_norm(x, (n,), w, eps)


def make_provider(name: str, op: str, x, w, b, dy, eps: float):
    """``(fwd, bwd)`` closures; ``bwd`` replays the backward of one recorded forward."""
    import torch

    import layernorm

    n = x.shape[-1]
    if name == "copy":
        return (lambda: x.clone()), None
    if name == "ours":
        if op == "layer_norm":
            fwd = lambda: layernorm.layer_norm(x, (n,), w, b, eps)  # noqa: E731
        else:
            fwd = lambda: layernorm.rms_norm(x, (n,), w, eps)  # noqa: E731
    elif name == "torch":
        fwd = _native(op, n, x, w, b, eps)
    elif name == "compile":
        # a fresh cache per shape: dynamo's recompile limit (8 per code object) would otherwise
        # make the later rows of the sweep run the eager op under the "compile" label
        torch._dynamo.reset()
        compiled = torch.compile(
            (lambda a, g, c: _native(op, n, a, g, c, eps)()), fullgraph=True, dynamic=False
        )
        fwd = lambda: compiled(x, w, b)  # noqa: E731
    elif name == "liger":
        fwd = _liger(op, n, x, w, b, eps)
    else:
        raise ValueError(f"unknown provider {name!r}")
    params = [t for t in (x, w, b if op == "layer_norm" else None) if t is not None]
    with torch.enable_grad():
        y = fwd()

    def bwd():
        return torch.autograd.grad(y, params, dy, retain_graph=True)

    return fwd, bwd


def _liger(op: str, n: int, x, w, b, eps: float):
    """Liger-Kernel's norms (optional dependency); ImportError skips the column. RMSNorm with
    ``in_place=False``: its default writes dx over dy, which the timed backward replays."""
    if op == "layer_norm":
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction

        return lambda: LigerLayerNormFunction.apply(x, w, b, eps)
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    # (X, W, eps, offset, casting_mode, in_place): the module LigerRMSNorm's defaults otherwise
    return lambda: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)


# ----------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------


def _meta(device: str) -> dict[str, str]:
    import torch
    import triton

    name = (
        torch.cuda.get_device_name()
        if device == "cuda"
        else f"cpu-interpreter ({platform.machine()})"
    )
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": str(torch.version.cuda),
    }


def sweep(args: argparse.Namespace, device: str, timer, meta: dict[str, str]) -> list[dict]:
    import torch

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    rows: list[dict] = []
    total = 1 << args.log2_elems
    for op in args.ops:
        for dname in args.dtypes:
            dtype = dtypes[dname]
            print(f"\n{op}, {dname}, M·N = 2^{args.log2_elems}: GB/s (fwd | bwd)")
            header = f"{'N':>7} {'M':>8} | " + " ".join(f"{p:>15}" for p in args.providers)
            print(header)
            print("-" * len(header))
            for n in args.ns:
                m = max(1, total // n)
                x, w, b, dy = make_inputs(m, n, dtype, args.param_dtype, device)
                cells = []
                for prov in args.providers:
                    res = {"fwd": math.nan, "bwd": math.nan}
                    try:
                        fwd, bwd = make_provider(prov, op, x, w, b, dy, 1e-5)
                        res["fwd"] = timer(fwd)
                        if bwd is not None:
                            res["bwd"] = timer(bwd, grad_to_none=[x, w, b])
                    except Exception as err:  # a missing optional provider, or an OOM
                        print(f"  [{prov} skipped at N={n}: {type(err).__name__}: {err}]"[:200])
                    for direction, ms in res.items():
                        kind = "copy" if prov == "copy" else op
                        nbytes = _bytes(kind, direction, m, n, x.element_size(), w.element_size())
                        gbps = nbytes / (ms * 1e-3) / 1e9 if ms == ms else math.nan
                        if prov == "copy" and direction == "bwd":
                            continue
                        rows.append({**meta, "table": "bandwidth", "op": op, "dtype": dname,
                                     "M": m, "N": n, "provider": prov, "direction": direction,
                                     "ms": ms, "bytes": nbytes, "GB/s": gbps})  # fmt: skip
                    f = _gbps(rows, op, dname, n, prov, "fwd")
                    bw = _gbps(rows, op, dname, n, prov, "bwd")
                    cells.append(f"{f:>7.0f} | {bw:<5.0f}" if bw == bw else f"{f:>7.0f} |  -   ")
                print(f"{n:>7} {m:>8} | " + " ".join(f"{c:>15}" for c in cells))
                del x, w, b, dy
    return rows


def _gbps(rows: list[dict], op, dname, n, prov, direction) -> float:
    for r in reversed(rows):
        key = (r["op"], r["dtype"], r["N"], r["provider"], r["direction"])
        if key == (op, dname, n, prov, direction):
            return r["GB/s"]
    return math.nan


def latency(args: argparse.Namespace, device: str, timer, meta: dict[str, str]) -> list[dict]:
    """M = 64, N = 4096, bfloat16: launch-bound regime, microseconds."""
    import torch

    m, n = (64, 4096) if not args.dry_run else (4, 256)
    rows: list[dict] = []
    print(f"\nsmall-M latency, M={m}, N={n}, bf16: microseconds (fwd | fwd+bwd)")
    for op in args.ops:
        x = torch.randn(m, n, device=device).to(torch.bfloat16).requires_grad_()
        pdt = torch.bfloat16 if args.param_dtype == "same" else torch.float32
        w = torch.ones(n, device=device, dtype=pdt, requires_grad=True)
        b = torch.zeros(n, device=device, dtype=pdt, requires_grad=True)
        dy = torch.randn(m, n, device=device).to(torch.bfloat16)
        line = []
        for prov in [p for p in args.providers if p != "copy"]:
            try:
                fwd, _ = make_provider(prov, op, x, w, b, dy, 1e-5)
                params = [x, w, b] if op == "layer_norm" else [x, w]

                def step(fwd=fwd, params=params, dy=dy):
                    return torch.autograd.grad(fwd(), params, dy)

                t_f, t_fb = timer(fwd), timer(step, grad_to_none=params)
            except Exception as err:
                print(f"  [{prov} skipped: {type(err).__name__}: {err}]"[:200])
                continue
            line.append(f"{prov} {1e3 * t_f:.1f} | {1e3 * t_fb:.1f}")
            for direction, ms in (("fwd", t_f), ("fwd+bwd", t_fb)):
                rows.append({**meta, "table": "latency", "op": op, "dtype": "bf16", "M": m,
                             "N": n, "provider": prov, "direction": direction, "ms": ms,
                             "bytes": "", "GB/s": ""})  # fmt: skip
        print(f"  {op}: " + "; ".join(line))
    return rows


def lstm(args: argparse.Namespace, device: str, timer, meta: dict[str, str]) -> list[dict]:
    """LN-LSTM layer (eager step, fused Triton step) vs cuDNN nn.LSTM, forward+backward ms."""
    import torch

    try:
        from layernorm.recurrent import LayerNormLSTM
    except Exception as err:
        print(f"\nLN-LSTM comparison skipped: layernorm.recurrent not importable ({err})")
        return []
    t, bsz, i, h = args.lstm_shape
    print(f"\nLSTM layer, (T, B, I, H) = ({t}, {bsz}, {i}, {h}), float32: ms (fwd+bwd)")
    x = torch.randn(t, bsz, i, device=device, requires_grad=True)
    models: dict[str, Callable[[], Any]] = {}
    cudnn = torch.nn.LSTM(i, h).to(device)
    models["cudnn nn.LSTM"] = lambda: cudnn(x)[0]
    ln_lstm = LayerNormLSTM(i, h).to(device)
    models["LayerNormLSTM (default step)"] = lambda: ln_lstm(x)[0]
    install, uninstall = _triton_step_installer(device)
    rows: list[dict] = []
    results: dict[str, float] = {}
    for name, fn in models.items():
        results[name] = _time_fwd_bwd(fn, x, timer)
    if install is not None:
        install()
        try:
            results["LayerNormLSTM (Triton step)"] = _time_fwd_bwd(lambda: ln_lstm(x)[0], x, timer)
        finally:
            uninstall()
    base = results["cudnn nn.LSTM"]
    for name, ms in results.items():
        print(f"  {name:<32} {ms:9.2f} ms   ({ms / base:.2f}× cuDNN)")
        rows.append({**meta, "table": "lstm", "op": "lstm", "dtype": "fp32", "M": t * bsz,
                     "N": h, "provider": name, "direction": "fwd+bwd", "ms": ms, "bytes": "",
                     "GB/s": ""})  # fmt: skip
    return rows


def _time_fwd_bwd(fn: Callable[[], Any], x, timer) -> float:
    import torch

    def step():
        out = fn()
        torch.autograd.grad(out, [x], torch.ones_like(out))

    return timer(step, grad_to_none=[x], rep=1000)


def _triton_step_installer(device: str):
    """Register the fused Triton step for the device, if the recurrent seam is as expected."""
    try:
        from layernorm.kernels.triton import rnn_step
        from layernorm.recurrent import StepKernels, register_step_kernels
        from layernorm.recurrent._pointwise import EAGER
    except Exception as err:
        print(f"  [fused Triton step not installable: {err}]")
        return None, None
    kernels = StepKernels(**rnn_step.seam_functions(EAGER))
    dev_type = "cuda" if device == "cuda" else "cpu"
    return (lambda: register_step_kernels(dev_type, kernels)), (
        lambda: register_step_kernels(dev_type, None)
    )


# ----------------------------------------------------------------------------------------------
# --tune: our kernels under candidate launch settings
# ----------------------------------------------------------------------------------------------


def tune_candidates(grid: dict[str, list[int]], factors: list[str]) -> list[tuple[str, dict]]:
    """``("default", {})``, then ``(label, {factor: value})`` for each value of each factor that
    differs from the current setting: one factor at a time, not the product."""
    from layernorm.kernels.triton._norm_core import current_launch_settings

    current = current_launch_settings()
    out: list[tuple[str, dict]] = [("default", {})]
    for factor in factors:
        for value in grid[factor]:
            if value != getattr(current, factor):
                out.append((f"{factor}={value}", {factor: value}))
    return out


def spec_candidates(specs: list[str]) -> list[tuple[str, dict]]:
    """``("default", {})``, then each ``--tune-settings`` spec as ``(spec, overrides)``."""
    from layernorm.kernels.triton._norm_core import parse_launch_spec

    return [("default", {})] + [(s, parse_launch_spec(s, "--tune-settings")) for s in specs]


def tune_plan(
    candidates: list[tuple[str, dict]], m: int, n: int, device: str
) -> dict[str, list[tuple[str, dict]]]:
    """The candidates worth timing per direction at ``(m, n)``: those whose launch (kernel, tile,
    warps and, backward, grid) differs from every earlier one's, the defaults first."""
    import torch

    from layernorm.kernels.triton._norm_core import (
        backward_groups,
        launch_config,
        launch_settings,
    )

    plan: dict[str, list[tuple[str, dict]]] = {"fwd": [], "bwd": []}
    seen: dict[str, set] = {"fwd": set(), "bwd": set()}
    for label, overrides in candidates:
        with launch_settings(**overrides):
            bwd_cfg = launch_config(n, backward=True)
            keys = {
                "fwd": launch_config(n),
                "bwd": (bwd_cfg, backward_groups(bwd_cfg, m, n, torch.device(device))),
            }
        for direction, key in keys.items():
            if key not in seen[direction]:
                seen[direction].add(key)
                plan[direction].append((label, overrides))
    return plan


def _tune_shapes(args: argparse.Namespace) -> list[tuple[int, int]]:
    total = 1 << args.log2_elems
    return [(max(1, total // n), n) for n in args.ns]


def tune_estimate(args: argparse.Namespace, candidates, device: str) -> tuple[int, int, float]:
    """``(timings, kernel variants to compile, estimated seconds)`` of a --tune run."""
    from layernorm.kernels.triton._norm_core import launch_config, launch_settings

    timings, variants = 0, set()
    for m, n in _tune_shapes(args):
        plan = tune_plan(candidates, m, n, device)
        timings += len(plan["fwd"]) + len(plan["bwd"])
        for direction, entries in plan.items():
            for _, overrides in entries:
                with launch_settings(**overrides):
                    variants.add((direction, launch_config(n, backward=direction == "bwd")))
    timings *= len(args.ops) * len(args.dtypes) * args.tune_repeats
    n_variants = len(variants) * len(args.ops) * len(args.dtypes)
    # Fitted to two runs on an H200 (2026-11-26): 468 timings and 280 variants in 84 s, 92 and 60
    # in 20 s: about 3 x TUNE_REP_MS per timing (do_bench's warm-up, its estimate runs, the
    # backward's recorded forward) and 50 ms per compiled variant
    return timings, n_variants, timings * 3.0 * TUNE_REP_MS / 1e3 + n_variants * 0.05


def tune(args: argparse.Namespace, device: str, timer, meta: dict[str, str]) -> list[dict]:
    import torch

    grid = DRY_RUN_TUNE_GRID if args.dry_run else TUNE_GRID
    if args.tune_settings is not None:
        candidates, kind = spec_candidates(args.tune_settings), "as given"
    else:
        candidates, kind = tune_candidates(grid, args.tune_factors), "one factor at a time"
    timings, n_variants, seconds = tune_estimate(args, candidates, device)
    rounds = f", {args.tune_repeats} rounds" if args.tune_repeats > 1 else ""
    print(
        f"\ntune: {len(candidates)} candidate settings ({kind}{rounds}); {timings} "
        "timings, leaving out candidates that launch the same kernels as an earlier one; "
        f"{n_variants} kernel variants to compile: about {seconds / 60:.1f} min on a GPU"
    )
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    rows: list[dict] = []
    start = time.perf_counter()
    for op in args.ops:
        for dname in args.dtypes:
            dtype = dtypes[dname]
            print(f"\n{op}, {dname}, M·N = 2^{args.log2_elems}: best launch setting per N, GB/s "
                  "(gain over the defaults)")  # fmt: skip
            header = (f"{'N':>7} {'M':>8} | {'fwd default':>11}  {'best fwd setting':<40} "
                      f"{'GB/s':>7} {'gain':>7} | {'bwd default':>11}  {'best bwd setting':<40} "
                      f"{'GB/s':>7} {'gain':>7}")  # fmt: skip
            print(header)
            print("-" * len(header))
            for m, n in _tune_shapes(args):
                rows += _tune_one(args, op, dname, dtype, m, n, candidates, device, timer, meta)
    elapsed = time.perf_counter() - start
    print(f"\ntune: {timings} timings in {elapsed:.0f} s")
    _tune_summary(rows)
    return rows


def _tune_one(args, op, dname, dtype, m, n, candidates, device, timer, meta) -> list[dict]:
    """Time the planned candidates at one (op, dtype, N); print its table line; the CSV rows."""
    from layernorm.kernels.triton._norm_core import launch_settings

    x, w, b, dy = make_inputs(m, n, dtype, args.param_dtype, device)
    plan = tune_plan(candidates, m, n, device)
    rows: list[dict] = []
    # per direction and candidate, the GB/s of each round; the rounds interleave the candidates,
    # so that a drift of the device's clocks or a neighbour's load reaches each of them alike
    rates: dict[str, dict[str, list[float]]] = {"fwd": {}, "bwd": {}}
    for _ in range(args.tune_repeats):
        for label, overrides in candidates:
            wanted = [d for d in ("fwd", "bwd") if (label, overrides) in plan[d]]
            if not wanted:
                continue
            with launch_settings(**overrides):
                for direction in wanted:
                    ms = math.nan
                    try:
                        fwd, bwd = make_provider("ours", op, x, w, b, dy, 1e-5)
                        if direction == "fwd":
                            ms = timer(fwd, rep=TUNE_REP_MS)
                        else:
                            ms = timer(bwd, grad_to_none=[x, w, b], rep=TUNE_REP_MS)
                    except Exception as err:  # e.g. out of shared memory for a large tile
                        print(f"  [{label} {direction} skipped at N={n}: {type(err).__name__}: "
                              f"{err}]"[:200])  # fmt: skip
                    nbytes = _bytes(op, direction, m, n, x.element_size(), w.element_size())
                    rate = nbytes / (ms * 1e-3) / 1e9 if ms == ms else math.nan
                    rates[direction].setdefault(label, []).append(rate)
                    rows.append({**meta, "table": "tune", "op": op, "dtype": dname, "M": m,
                                 "N": n, "provider": f"ours[{label}]", "direction": direction,
                                 "ms": ms, "bytes": nbytes, "GB/s": rate})  # fmt: skip
    gbps = {d: {label: _median_or_nan(r) for label, r in per.items()} for d, per in rates.items()}
    cells = []
    for direction in ("fwd", "bwd"):
        base = gbps[direction].get("default", math.nan)
        timed = {k: v for k, v in gbps[direction].items() if v == v}
        best = max(timed, key=timed.__getitem__) if timed else "default"
        rate = timed.get(best, math.nan)
        gain = 100.0 * (rate / base - 1.0) if base == base and base > 0 else math.nan
        cells.append(f"{base:>11.0f}  {best:<40} {rate:>7.0f} {gain:>+6.1f}%")
    print(f"{n:>7} {m:>8} | " + " | ".join(cells))
    del x, w, b, dy
    return rows


def _median_or_nan(values: list[float]) -> float:
    """The median of a cell's rounds, NaN where any round failed."""
    return statistics.median(values) if all(v == v for v in values) else math.nan


def _tune_summary(rows: list[dict]) -> None:
    """Per candidate and direction: at how many (op, dtype, N) it was timed, and its median and
    best gain over the defaults there (each cell's median over the rounds)."""
    rounds: dict[tuple, list[float]] = {}
    for r in rows:
        key = (r["op"], r["dtype"], r["N"], r["direction"], r["provider"])
        rounds.setdefault(key, []).append(r["GB/s"])
    cell = {k: _median_or_nan(v) for k, v in rounds.items()}
    gains: dict[tuple[str, str], list[float]] = {}
    for (op, dname, n, direction, provider), rate in cell.items():
        ref = cell.get((op, dname, n, direction, "ours[default]"), math.nan)
        if provider == "ours[default]" or not (ref == ref and rate == rate):
            continue
        gains.setdefault((provider[5:-1], direction), []).append(rate / ref - 1)
    if not gains:
        return
    print("\ngain over the defaults per candidate: cells timed, median, best")
    for (label, direction), g in sorted(gains.items()):
        print(f"  {label:<40} {direction}  {len(g):>3}  {100 * statistics.median(g):>+6.1f}%  "
              f"{100 * max(g):>+6.1f}%")  # fmt: skip


def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    from _records import append_csv  # the scripts' folder: on sys.path when run as a script

    print(f"\n{append_csv(path, rows)} rows appended to {path}")


def plot(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bw = [r for r in rows if r["table"] == "bandwidth"]
    panels = sorted({(r["op"], r["dtype"], r["direction"]) for r in bw if r["provider"] != "copy"})
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, (op, dname, direction) in zip(axes[0], panels, strict=True):
        for prov in sorted({r["provider"] for r in bw}):
            d = "fwd" if prov == "copy" else direction
            pts = [(r["N"], r["GB/s"]) for r in bw if (r["op"], r["dtype"], r["provider"],
                   r["direction"]) == (op, dname, prov, d) and r["GB/s"] == r["GB/s"]]  # fmt: skip
            if pts:
                ax.plot(*zip(*sorted(pts), strict=True), marker="o", label=prov)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{op} {dname} {direction}")
        ax.set_xlabel("N")
        ax.set_ylabel("GB/s")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        # must precede the first import of triton: @triton.jit picks interpreter or compiler then
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(
            "bench_norms_gpu.py needs a CUDA device, and torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}). Run it on a GPU machine, or pass --dry-run to exercise "
            "the script on CPU under the Triton interpreter.",
            file=sys.stderr,
        )
        return 2
    device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        args.providers = [p for p in args.providers if p != "compile"]  # minutes on CPU
    if "liger" in args.providers and importlib.util.find_spec("liger_kernel") is None:
        print("Liger-Kernel is not installed: no liger column (pip install liger-kernel)")
        args.providers = [p for p in args.providers if p != "liger"]
    timer = make_timer(args.dry_run)
    meta = _meta(device)
    print(" ".join(f"{k}={v}" for k, v in meta.items()))
    ctx = None
    if args.dry_run:
        from layernorm.backend import force_backend

        ctx = force_backend("triton")
        ctx.__enter__()
    try:
        if args.tune:
            rows = tune(args, device, timer, meta)
        else:
            rows = sweep(args, device, timer, meta)
            if not args.no_latency:
                rows += latency(args, device, timer, meta)
            if not args.no_lstm:
                rows += lstm(args, device, timer, meta)
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    write_csv(args.csv, rows)
    if args.plot is not None:
        plot(args.plot, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
