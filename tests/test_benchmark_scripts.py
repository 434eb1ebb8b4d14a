"""The CPU benchmark scripts that patch the library run end to end (in their own processes: they
replace module functions for the rest of the process), on tiny settings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kernel_paths import needs_sequence_kernels

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
pytestmark = needs_sequence_kernels


def _run(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_call_overhead_prints_the_three_providers() -> None:
    out = _run(str(BENCH / "rnn_call_overhead.py"), "--shape", "3x2x4x8", "--rounds", "1",
               "--calls", "2")  # fmt: skip
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["planned", "fused", "floor"]


def test_ab_rnn_sets_an_attribute_of_another_module() -> None:
    out = _run(str(BENCH / "ab_rnn.py"), "--shape", "3x2x4x8", "--reps", "1", "--attr",
               "_planned.lstm_training", "--a", "lambda *args: None", "--b",
               "_planned.lstm_training")  # fmt: skip
    assert "_planned.lstm_training A = lambda *args: None" in out
    bad = subprocess.run(
        [sys.executable, str(BENCH / "ab_rnn.py"), "--attr", "_nowhere.x", "--a", "1", "--b", "2"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert bad.returncode != 0 and "no module layernorm.recurrent._nowhere" in bad.stderr


def test_ab_rnn_compares_the_bfloat16_projection_choices() -> None:
    out = _run(str(BENCH / "ab_rnn.py"), "--shape", "3x2x4x8", "--reps", "1", "--projection",
               "--a", "yes", "--b", "no", "--dtype", "bfloat16", "--mode", "infer")  # fmt: skip
    assert "projection A = yes" in out and "B = no" in out
    bad = subprocess.run(
        [sys.executable, str(BENCH / "ab_rnn.py"), "--projection", "--a", "1", "--b", "no"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert bad.returncode != 0 and "--a and --b must be yes or no" in bad.stderr


def test_bench_cells_prints_each_cell_and_mode() -> None:
    out = _run(str(BENCH / "bench_cells.py"), "--shapes", "2x4x8", "--reps", "1", "--calls", "2",
               "--steps", "2")  # fmt: skip
    rows = [[c.strip() for c in line.split("|")[1:4]] for line in out.splitlines()
            if line.startswith("| ") and "(2, 4, 8)" in line]  # fmt: skip
    assert rows == [[k, "(2, 4, 8)", m] for k in ("lstm", "gru", "rnn") for m in ("infer", "train")]


@pytest.mark.parametrize("forward", [False, True], ids=["forward+backward", "forward"])
def test_bench_norms_cpu_prints_every_variant_in_its_mode(forward: bool) -> None:
    """Forward + backward by default, the forward alone under no_grad with ``--forward``: the
    table says which, and has a row for every variant against torch's layer norm."""
    args = ["--forward"] if forward else []
    out = _run(str(BENCH / "bench_norms_cpu.py"), "--shapes", "8x128", "--small-shapes",
               "--reps", "2", "--warmup", "1", "--no-rms-anchor", "--dtype", "bfloat16",
               *args)  # fmt: skip
    mode = "forward (no_grad)" if forward else "forward+backward"
    assert f"{mode}, bfloat16, median ms" in out
    variants = [line.split("  ")[0] for line in out.splitlines() if " 8x128 " in line]
    assert variants == ["torch layer_norm", "layer_norm (w, b)", "LN-simple", "detach_mean",
                        "detach_std", "detach both", "AdaNorm", "RMSNorm (w)"]  # fmt: skip


def test_bench_rnn_step_times_two_trees_and_compares_their_outputs() -> None:
    """The package's own csrc as the other tree: two builds of the same sources, so every
    output agrees to the bit and no difference is noted."""
    from layernorm.kernels.cpu import rnn_abi

    out = _run(str(BENCH / "bench_rnn_step.py"), "--hidden", "5,37", "--reps", "1", "--inner",
               "1", "--input-rows", "--other", str(rnn_abi.CSRC_DIR))  # fmt: skip
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]
    assert rows[2:] == ["5", "37"] and "differs" not in out, out


def test_bench_rnn_gemm_times_the_input_products_after_checking_them() -> None:
    """``--products``: the input products (``rnn.matmul``, both orientations of W) checked
    against ``torch.mm`` and timed beside it, one table row per shape; a malformed shape is
    refused by name."""
    out = _run(str(BENCH / "bench_rnn_gemm.py"), "--products", "3x5x7,40x33x20", "--reps", "1",
               "--inner", "1")  # fmt: skip
    rows = [line for line in out.splitlines() if line.startswith("| (") and "M, K, N" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["(3, 5, 7)", "(40, 33, 20)"], out
    bad = subprocess.run(
        [sys.executable, str(BENCH / "bench_rnn_gemm.py"), "--products", "3x5"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert bad.returncode == 2 and "--products takes positive MxKxN" in bad.stderr


def test_bench_rnn_gemm_checks_a_build_setting_against_torch_mm() -> None:
    """The recurrent GEMM built with A copied k-major per row tile (``-DGEMM_PACK_A=1``, a build
    setting of rnn_seq_impl.h) beside the default build: the script checks every build's product
    against ``torch.mm`` before timing it, at row counts of the two-panel tile (1, 3), of one
    row tile (5), of balanced and of full-first tiles (15, 29), and at column counts with a
    partial last panel (N = 20, 132)."""
    from layernorm.kernels.cpu import targets

    target = targets.selected().name
    out = _run(str(BENCH / "bench_rnn_gemm.py"), "--targets", target, "--variant",
               "packa=-DGEMM_PACK_A=1", "--rows", "1,3,5,15,29", "--hidden", "5,33", "--reps",
               "1", "--inner", "1")  # fmt: skip
    rows = [line.split("|")[1:4] for line in out.splitlines() if line.startswith("| f")
            or line.startswith("| b")]  # fmt: skip
    assert len(rows) == 2 * 2 * 5 and f"{target}+packa" in out, out


@pytest.mark.parametrize("module", ["layer", "rms"])
def test_ab_norm_routes_times_both_routes(module: str) -> None:
    """The script sets the limits it names (a renamed one fails here) and prints torch.nn's time
    and both routes' ratios for each shape."""
    out = _run(str(BENCH / "ab_norm_routes.py"), "--module", module, "--rounds", "1",
               "--shapes", "2x16", "3x8")  # fmt: skip
    rows = [line.split() for line in out.splitlines() if "torch kernel" in line]
    assert [r[0] for r in rows] == ["2x16", "3x8"]
    assert all(float(r[6]) > 0 and float(r[8]) > 0 for r in rows)


def test_ab_norm_node_times_node_python_path_and_grains() -> None:
    """Every provider of each shape and dtype prints a time and a ratio to torch's; the grains'
    settings are undone after each call (the script asserts the operators load)."""
    from layernorm.kernels.cpu import cbuild

    if cbuild.cxx_compiler() is None:
        pytest.skip("no C++ compiler: no C++ operators")
    out = _run(str(BENCH / "ab_norm_node.py"), "--shapes", "3x8", "2x16", "--reps", "2",
               "--grains", "4", "8192")  # fmt: skip
    rows = [line for line in out.splitlines() if line.startswith(("3x8", "2x16"))]
    assert len(rows) == 2 * 2
    for row in rows:
        for name in ("torch", "node", "python", "node g=4", "node g=8192"):
            assert f" {name} " in row, row


def test_bf16_dot_rate_measures_or_says_why_not() -> None:
    out = _run(str(BENCH / "bf16_dot_rate.py"), "--rounds", "1000", "--repeats", "1")
    assert "no AVX512-BF16, nothing to measure" in out or "vdpbf16ps" in out


def test_records_append_under_one_header_and_refuse_other_columns(tmp_path) -> None:
    """The scripts' ``--csv`` rows: the header once, rows appended under it, and a file of other
    columns (an earlier version of a script's) refused with both headers named."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_records", BENCH / "_records.py")
    assert spec is not None and spec.loader is not None
    records = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(records)
    path = tmp_path / "rows.csv"
    assert records.append_csv(path, [{"a": 1, "b": 2}]) == 1
    assert records.append_csv(path, [{"a": 3, "b": 4}, {"a": 5, "b": 6}]) == 2
    assert path.read_text().splitlines() == ["a,b", "1,2", "3,4", "5,6"]
    with pytest.raises(SystemExit, match=r"columns are \['a', 'b'\], these rows have \['a', 'm'"):
        records.append_csv(path, [{"a": 1, "m": "x", "b": 2}])
    assert path.read_text().splitlines()[-1] == "5,6"  # nothing written
