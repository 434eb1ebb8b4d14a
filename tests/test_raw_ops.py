"""The registered ops ``torch.ops.layernorm.*`` check every argument before a backend sees it.

They are public (every compiled or exported graph calls them), so a short weight, short saved
statistics, a wrong dtype or device, a non-contiguous input or a bad eps must raise a clear error,
not crash the process or return garbage. The same checks guard the C kernels' entry points
(:func:`layernorm.kernels.cpu.abi.check_call`) for the eager path.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

import layernorm  # noqa: F401  (registers the ops)
from layernorm.kernels.cpu import _native

L = torch.ops.layernorm
M, N = 4, 64


def _x(dtype=torch.float32):
    return torch.randn(M, N, dtype=dtype) + 3


def _v(n=N, dtype=torch.float32):
    return torch.randn(n, dtype=dtype)


def _s(m=M, dtype=torch.float32):
    return torch.rand(m, dtype=dtype) + 0.5


# (id, call, exception, words the message must contain)
CASES: list[tuple[str, Callable[[], object], type[Exception], tuple[str, ...]]] = [
    ("ln_fwd short weight", lambda: L.layer_norm_fwd(_x(), _v(3), None, 1e-5),
     ValueError, ("weight", "(64,)", "(3,)")),
    ("ln_fwd long bias", lambda: L.layer_norm_fwd(_x(), None, _v(N + 1), 1e-5),
     ValueError, ("bias", "(65,)")),
    ("ln_fwd 2-D weight", lambda: L.layer_norm_fwd(_x(), _v().view(1, N), None, 1e-5),
     ValueError, ("weight", "(1, 64)")),
    ("ln_fwd eps -1", lambda: L.layer_norm_fwd(_x(), None, None, -1.0),
     ValueError, ("eps", ">= 0", "-1")),
    ("ln_fwd eps nan", lambda: L.layer_norm_fwd(_x(), None, None, float("nan")),
     ValueError, ("eps", "finite")),
    ("ln_fwd eps inf", lambda: L.layer_norm_fwd(_x(), None, None, float("inf")),
     ValueError, ("eps", "finite")),
    ("ln_fwd 1-D x", lambda: L.layer_norm_fwd(_v(), None, None, 1e-5),
     ValueError, ("2-D", "(64,)")),
    ("ln_fwd 3-D x", lambda: L.layer_norm_fwd(torch.randn(2, 3, 4), None, None, 1e-5),
     ValueError, ("2-D", "(2, 3, 4)")),
    ("ln_fwd zero columns", lambda: L.layer_norm_fwd(torch.randn(3, 0), None, None, 1e-5),
     ValueError, ("column", "(3, 0)")),
    ("ln_fwd strided x", lambda: L.layer_norm_fwd(torch.randn(N, M).t(), None, None, 1e-5),
     ValueError, ("contiguous",)),
    ("ln_fwd strided weight", lambda: L.layer_norm_fwd(_x(), _v(2 * N)[::2], None, 1e-5),
     ValueError, ("weight", "contiguous")),
    ("ln_fwd integer x", lambda: L.layer_norm_fwd(torch.ones(M, N, dtype=torch.int64), None,
                                                   None, 1e-5),
     TypeError, ("x", "int64")),
    ("ln_bwd short mean", lambda: L.layer_norm_bwd(_x(), _x(), _s(2), _s(), None, False, False,
                                                   True, False, False),
     ValueError, ("mean", "(M,)", "(4,)", "(2,)")),
    ("ln_bwd short rstd", lambda: L.layer_norm_bwd(_x(), _x(), _s(), _s(1), None, False, False,
                                                   True, False, False),
     ValueError, ("rstd", "(1,)")),
    ("ln_bwd short dy", lambda: L.layer_norm_bwd(_x()[:2], _x(), _s(), _s(), None, False, False,
                                                 True, False, False),
     ValueError, ("dy", "(4, 64)", "(2, 64)")),
    ("ln_bwd short weight", lambda: L.layer_norm_bwd(_x(), _x(), _s(), _s(), _v(8), False, False,
                                                     True, True, False),
     ValueError, ("weight", "(8,)")),
    ("ln_bwd float64 stats", lambda: L.layer_norm_bwd(_x(), _x(), _s(dtype=torch.float64),
                                                      _s(), None, False, False, True, False,
                                                      False),
     TypeError, ("mean", "torch.float32", "torch.float64")),
    ("rms_fwd short weight", lambda: L.rms_norm_fwd(_x(), _v(5), 1e-5),
     ValueError, ("weight", "(5,)")),
    ("rms_fwd eps -1", lambda: L.rms_norm_fwd(_x(), None, -1.0), ValueError, ("eps",)),
    ("rms_bwd short rstd", lambda: L.rms_norm_bwd(_x(), _x(), _s(3), None, True, False),
     ValueError, ("rstd", "(3,)")),
    ("rms_bwd short dy", lambda: L.rms_norm_bwd(_x()[:, :5], _x(), _s(), None, True, False),
     ValueError, ("dy", "(4, 5)")),
    ("rms_bwd short weight", lambda: L.rms_norm_bwd(_x(), _x(), _s(), _v(7), True, True),
     ValueError, ("weight", "(7,)")),
    ("ada_fwd eps -1", lambda: L.ada_norm_fwd(_x(), 0.1, 1.0, -1.0), ValueError, ("eps",)),
    ("ada_fwd k nan", lambda: L.ada_norm_fwd(_x(), float("nan"), 1.0, 1e-5),
     ValueError, ("k", "finite")),
    ("ada_fwd scale inf", lambda: L.ada_norm_fwd(_x(), 0.1, float("inf"), 1e-5),
     ValueError, ("scale", "finite")),
    ("ada_bwd short dz", lambda: L.ada_norm_bwd(_x()[:1], _x(), _s(), _s(), 0.1, 1.0),
     ValueError, ("dz", "(1, 64)")),
    ("ada_bwd short mean", lambda: L.ada_norm_bwd(_x(), _x(), _s(1), _s(), 0.1, 1.0),
     ValueError, ("mean", "(1,)")),
    ("ada_bwd short rstd", lambda: L.ada_norm_bwd(_x(), _x(), _s(), _s(2), 0.1, 1.0),
     ValueError, ("rstd", "(2,)")),
    ("ada_bwd half stats", lambda: L.ada_norm_bwd(_x(), _x(), _s(dtype=torch.float16), _s(),
                                                  0.1, 1.0),
     TypeError, ("mean", "float16")),
]  # fmt: skip


@pytest.mark.parametrize(
    ("call", "exc", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_raw_op_rejects_bad_arguments(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    assert "layernorm::" in message
    for word in words:
        assert word in message, (word, message)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_raw_ops_accept_good_arguments(dtype):
    """The checks refuse only what is wrong: every op runs on well-formed arguments."""
    sdt = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    x, dy = _x(dtype), _x(dtype)
    w, b = _v(dtype=dtype), _v(dtype=dtype)
    y, mean, rstd = L.layer_norm_fwd(x, w, b, 0.0)
    assert mean.dtype == rstd.dtype == sdt and bool(y.isfinite().all())
    L.layer_norm_bwd(dy.t().contiguous().t(), x, mean, rstd, w, True, False, True, True, True)
    _, r = L.rms_norm_fwd(x, w, 1e-6)
    L.rms_norm_bwd(dy, x, r, w, True, True)
    _, mean, rstd = L.ada_norm_fwd(x, 0.1, 2.0, 1e-5)
    L.ada_norm_bwd(dy, x, mean, rstd, 0.1, 2.0)


_CRASH = """
import torch, layernorm
x = torch.randn(8, 1 << 20)
try:
    torch.ops.layernorm.layer_norm_fwd(x, torch.ones(1), None, 1e-5)
except ValueError as e:
    print("refused:", e)
"""


def test_short_weight_is_refused_in_a_subprocess():
    """A weight far shorter than the row once let C read past it (SIGSEGV): run where a crash
    cannot take the test process down."""
    proc = subprocess.run([sys.executable, "-c", _CRASH], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "refused:" in proc.stdout and "weight" in proc.stdout


# The C entry points check the same things, whoever calls them.
NATIVE_CASES: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    ("ln_fwd short weight", lambda: _native.ln_fwd(_x(), _v(3), None, 1e-5), ValueError,
     "weight"),
    ("ln_fwd eps -1", lambda: _native.ln_fwd(_x(), None, None, -1.0), ValueError, "eps"),
    ("ln_fwd weight on meta", lambda: _native.ln_fwd(_x(), _v().to("meta"), None, 1e-5),
     ValueError, "weight must be on the CPU, got meta"),
    ("ln_fwd float64 weight", lambda: _native.ln_fwd(_x(), _v(dtype=torch.float64), None, 1e-5),
     TypeError, "weight"),
    ("ln_bwd short mean", lambda: _native.ln_bwd(_x(), _x(), _s(1), _s(), None, False, False,
                                                 True, False, False), ValueError, "mean"),
    ("rms_bwd short dy", lambda: _native.rms_bwd(_x()[:, :3].contiguous(), _x(), _s(), None,
                                                 True, False), ValueError, "dy"),
    ("ada_bwd short rstd", lambda: _native.ada_bwd(_x(), _x(), _s(), _s(1), 0.1, 1.0),
     ValueError, "rstd"),
    ("ada_fwd int x", lambda: _native.ada_fwd(_x().to(torch.int32), 0.1, 1.0, 1e-5),
     TypeError, "x"),
    ("ln_fwd float16 weight, bfloat16 x",
     lambda: _native.ln_fwd(_x(torch.bfloat16), _v(dtype=torch.float16), None, 1e-5), TypeError,
     "weight"),
    ("ln_bwd float64 mean, float16 x",
     lambda: _native.ln_bwd(_x(torch.float16), _x(torch.float16), _s(dtype=torch.float64), _s(),
                            None, False, False, True, False, False), TypeError, "mean"),
]  # fmt: skip


@pytest.mark.skipif(not _native.enabled(), reason="fused CPU kernels unavailable")
@pytest.mark.parametrize(
    ("call", "exc", "word"), [c[1:] for c in NATIVE_CASES], ids=[c[0] for c in NATIVE_CASES]
)
def test_native_entry_points_check_their_arguments(call, exc, word):
    with pytest.raises(exc, match=word):
        call()
