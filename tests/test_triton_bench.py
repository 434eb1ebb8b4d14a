"""benchmarks/bench_norms_gpu.py parses its arguments, counts bytes as documented, and without a
GPU stops with a clear message (the measurements themselves need a CUDA device)."""

from __future__ import annotations

import importlib.util
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
