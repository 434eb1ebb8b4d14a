"""benchmarks/bench_norms_gpu.py parses its arguments, counts bytes as documented, and without a
GPU stops with a clear message (the measurements themselves need a CUDA device)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_norms_gpu.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_norms_gpu", _PATH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _skip_if_interpreter_broken(proc) -> None:
    """The dry runs need a working Triton interpreter; the library names the reason when the
    installed Triton and NumPy cannot interpret its kernels (Triton 3.6 with NumPy >= 2.4)."""
    marker = re.search(r"the Triton interpreter \(.*?\) cannot run [^:]*", proc.stdout)
    if marker is not None:
        pytest.skip(marker.group(0))


def test_default_sweep_and_options():
    bench = _load()
    args = bench.parse_args([])
    assert args.ns == [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 262144]
    assert args.log2_elems == 27 and args.dtypes == ["bf16", "fp32"]
    assert args.lstm_shape == [100, 64, 1024, 1024] and not args.no_lstm
    quick = bench.parse_args(["--quick", "--ops", "rms_norm", "--providers", "ours", "torch"])
    assert quick.ns == [256, 4096, 65536] and quick.no_lstm and quick.ops == ["rms_norm"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--ns", "0"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--dtypes", "fp64"])


def test_byte_counts():
    bench = _load()
    m, n = 1 << 17, 1024
    # fwd: read x + write y, + weight and bias, + mean and rstd in float32
    assert bench._bytes("layer_norm", "fwd", m, n, 2, 4) == 2 * m * n * 2 + 2 * n * 4 + 2 * m * 4
    # bwd: read x, dy + write dx, + read weight and the stats, + write dweight and dbias (fp32)
    assert (
        bench._bytes("layer_norm", "bwd", m, n, 2, 4)
        == 3 * m * n * 2 + n * 4 + 2 * m * 4 + 2 * n * 4
    )
    assert bench._bytes("rms_norm", "bwd", m, n, 4, 4) == 3 * m * n * 4 + n * 4 + m * 4 + n * 4
    assert bench._bytes("copy", "fwd", m, n, 2, 2) == 2 * m * n * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_exits_with_a_clear_message_without_cuda(capsys: pytest.CaptureFixture[str]):
    bench = _load()
    assert bench.main(["--quick"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA device" in err and "--dry-run" in err


@pytest.mark.slow
def test_dry_run_exercises_every_table(tmp_path: Path):
    """The whole script on CPU under the Triton interpreter with tiny shapes: the sweep, latency and
    LSTM tables, CSV and plot (the numbers mean nothing; the code paths are the GPU run's)."""
    import csv
    import subprocess
    import sys

    out_csv, out_png = tmp_path / "rows.csv", tmp_path / "plot.png"
    proc = subprocess.run(
        [sys.executable, str(_PATH), "--dry-run", "--ops", "layer_norm", "--dtypes", "bf16",
         "--csv", str(out_csv), "--plot", str(out_png)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    _skip_if_interpreter_broken(proc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader(out_csv.open()))
    tables = {r["table"] for r in rows}
    assert {"bandwidth", "latency"} <= tables
    providers = {r["provider"] for r in rows if r["table"] == "bandwidth"}
    assert {"copy", "ours", "torch"} <= providers
    assert all(r["ms"] not in ("", "nan") for r in rows if r["provider"] in ("ours", "torch"))
    if "lstm" in tables:  # layernorm.recurrent importable
        assert any("Triton step" in r["provider"] for r in rows if r["table"] == "lstm")
    assert out_png.stat().st_size > 0


def test_tune_grid_and_options():
    bench = _load()
    args = bench.parse_args(["--tune"])
    assert args.tune and args.tune_factors == list(bench.TUNE_GRID)
    grid = bench.TUNE_GRID
    assert grid["max_fused_block_n_bwd"] == [4096, 8192, 16384, 32768]
    assert grid["max_fused_block_n_fwd"] == [8192, 16384, 32768, 65536]
    assert grid["elems_per_thread"] == [8, 16, 32] and grid["programs_per_sm"] == [2, 4, 8]
    assert grid["looped_block_n"] == [2048, 4096, 8192]
    assert grid["fused_tile_elems"] == [2048, 4096, 8192]
    assert grid["fused_tile_elems_bwd"] == [1024, 2048, 4096]
    assert grid["looped_elems_per_thread_bwd"] == [4, 8, 16]
    assert set(bench.DRY_RUN_TUNE_GRID) == set(grid)
    narrow = bench.parse_args(["--tune", "--tune-factors", "looped_block_n"])
    assert narrow.tune_factors == ["looped_block_n"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--tune", "--tune-factors", "num_warps"])


def test_tune_candidates_vary_one_factor_and_skip_equivalent_launches():
    """One factor at a time around the defaults; at each N only candidates that change the launch
    are timed (kernels are not run here: the plan is launch configurations only)."""
    bench = _load()
    from layernorm.kernels.triton import _norm_core

    candidates = bench.tune_candidates(bench.TUNE_GRID, list(bench.TUNE_GRID))
    assert candidates[0] == ("default", {})
    assert all(len(overrides) == 1 for _, overrides in candidates[1:])
    defaults = _norm_core.current_launch_settings()
    # every grid value except the default one, once
    expected = sum(
        len([v for v in values if v != getattr(defaults, f)])
        for f, values in bench.TUNE_GRID.items()
    )
    assert len(candidates) == 1 + expected
    assert ("max_fused_block_n_bwd=16384", {"max_fused_block_n_bwd": 16384}) in candidates

    def labels(m: int, n: int, direction: str) -> list[str]:
        return [label for label, _ in bench.tune_plan(candidates, m, n, "cpu")[direction]]

    short = labels(1 << 19, 256, "fwd")
    assert short[0] == "default" and "fused_tile_elems=2048" in short
    assert not any(label.startswith(("max_fused", "looped")) for label in short)  # no effect
    assert "max_fused_block_n_bwd=4096" in labels(1 << 14, 8192, "bwd")  # 8192 looped instead
    assert "max_fused_block_n_fwd=8192" not in labels(1 << 14, 8192, "fwd")
    long_rows = labels(512, 262_144, "bwd")
    assert {"looped_block_n=2048", "looped_block_n=8192"} <= set(long_rows)
    assert "fused_tile_elems=8192" not in long_rows  # the looped kernels have no row tiles
    args = bench.parse_args(["--tune", "--ns", "256", "8192", "--ops", "rms_norm"])
    timings, variants, seconds = bench.tune_estimate(args, candidates, "cpu")
    per_dtype = sum(
        len(labels(m, n, d)) for m, n in bench._tune_shapes(args) for d in ("fwd", "bwd")
    )
    assert timings == per_dtype * len(args.dtypes) and variants > 0 and seconds > 0


def test_tune_settings_combine_factors_and_repeats_count_rounds():
    """--tune-settings: given combinations beside the defaults, checked by the settings' own parser
    (a bad name or value is a usage error naming it); --tune-repeats multiplies the timings."""
    bench = _load()
    specs = ["programs_per_sm=8,elems_per_thread=32", "fused_tile_elems_bwd=1024"]
    args = bench.parse_args(["--tune", "--tune-settings", *specs, "--tune-repeats", "3",
                             "--ns", "256", "--ops", "layer_norm"])  # fmt: skip
    candidates = bench.spec_candidates(args.tune_settings)
    assert candidates == [
        ("default", {}),
        (specs[0], {"programs_per_sm": 8, "elems_per_thread": 32}),
        (specs[1], {"fused_tile_elems_bwd": 1024}),
    ]
    once = bench.parse_args(["--tune", "--tune-settings", *specs, "--ns", "256",
                             "--ops", "layer_norm"])  # fmt: skip
    assert (
        bench.tune_estimate(args, candidates, "cpu")[0]
        == 3 * bench.tune_estimate(once, candidates, "cpu")[0]
    )
    for bad in (["--tune-settings", "warps=4"], ["--tune-settings", "elems_per_thread=24"],
                ["--tune-settings", "elems_per_thread"], ["--tune-repeats", "0"]):  # fmt: skip
        with pytest.raises(SystemExit):
            bench.parse_args(["--tune", *bad])


@pytest.mark.slow
def test_tune_dry_run_prints_tables_and_appends_rows(tmp_path: Path):
    """--tune --dry-run: the tuning path on CPU under the interpreter, with the grid scaled to the
    tiny rows, so both kernel routes run; one table per (op, dtype), CSV rows per candidate."""
    import csv
    import subprocess
    import sys

    out_csv = tmp_path / "tune.csv"
    proc = subprocess.run(
        [sys.executable, str(_PATH), "--tune", "--dry-run", "--dtypes", "bf16", "fp32",
         "--csv", str(out_csv)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    out = proc.stdout
    _skip_if_interpreter_broken(proc)
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    announced = re.search(r"candidate settings .*?; (\d+) timings", out)
    assert announced is not None, out[-3000:]
    rows = list(csv.DictReader(out_csv.open()))
    assert len(rows) == int(announced.group(1))
    assert {r["table"] for r in rows} == {"tune"}
    assert {(r["op"], r["dtype"]) for r in rows} == {
        (op, d) for op in ("layer_norm", "rms_norm") for d in ("bf16", "fp32")
    }
    for op in ("layer_norm", "rms_norm"):
        for dname in ("bf16", "fp32"):
            assert f"{op}, {dname}, M·N = 2^12: best launch setting per N" in out
    cells = {(r["op"], r["dtype"], r["N"], r["direction"]) for r in rows}
    defaults = {
        (r["op"], r["dtype"], r["N"], r["direction"])
        for r in rows
        if r["provider"] == "ours[default]"
    }
    assert cells == defaults  # every timed cell has its baseline
    providers = {r["provider"] for r in rows}
    # the scaled thresholds send N = 512 down the looped kernels in both directions
    assert {"ours[max_fused_block_n_fwd=256]", "ours[max_fused_block_n_bwd=256]"} <= providers
    assert all(float(r["ms"]) > 0 and float(r["GB/s"]) > 0 for r in rows)
    assert "gain over the defaults per candidate" in out
