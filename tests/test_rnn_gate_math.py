"""The float64 gate functions of the recurrent step kernels (``csrc/rnn_common.h``: ``fast_exp``,
``fast_tanh``, the sigmoid built from ``fast_exp``), vectorizable stand-ins for libm's, against
libm over their ranges: the error model the float64 layers' results carry (a few units in the
last place of each gate, against the float32 kernels' approximations of about 1e-7)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from layernorm.kernels.cpu import cbuild, rnn_abi, targets

SOURCE = Path(__file__).parent / "csrc" / "gate_math_accuracy.c"


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, float]:
    """The check program's results, built with the selected target's instruction-set flags (the
    kernels' contraction of multiply-adds is then the same)."""
    cc = cbuild.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    exe = tmp_path_factory.mktemp("gate_math") / "gate_math_accuracy"
    flags = ["-O3", "-std=gnu11", "-fopenmp", *targets.selected().flags]
    subprocess.run([cc, *flags, f"-I{rnn_abi.CSRC_DIR}", str(SOURCE), "-o", str(exe), "-lm"],
                   check=True, capture_output=True, text=True)  # fmt: skip
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {name: float(value) for name, value in (line.split() for line in out.splitlines())}


def test_the_float64_gate_functions_are_within_a_few_ulp_of_libm(measured) -> None:
    assert measured["exp_ulp"] <= 2
    assert measured["tanh_ulp"] <= 6
    assert measured["sigmoid_ulp"] <= 6
    assert measured["tanh_small_ulp"] <= 2  # tanh(x) ≈ x keeps its relative accuracy near 0


def test_the_float64_gate_functions_special_values(measured) -> None:
    """tanh keeps the sign of zero, NaN passes through both, tanh saturates at ±1, and exp of a
    large negative argument is the clamp's tiny value (not an infinity or a NaN), of a large
    positive one finite."""
    assert measured["tanh_zero_sign"] == 0 and measured["tanh_minus_zero_sign"] == 1
    assert measured["exp_nan"] == 1 and measured["tanh_nan"] == 1
    assert measured["tanh_huge"] == 1.0 and measured["tanh_minus_huge"] == -1.0
    assert 0 < measured["exp_low"] < 1e-300
    assert measured["exp_high_finite"] == 1
