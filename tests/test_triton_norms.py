"""The Triton norm kernels against the float64 reference.

Without a GPU the kernels run on CPU tensors under the Triton interpreter. Triton decides when a
``@triton.jit`` function is *decorated* whether it is interpreted (``TRITON_INTERPRET=1``) or
compiled, so this module sets the variable before it imports the kernel modules (pytest imports it
while collecting); the kernels use only Triton builtins plus their own jit helpers, so it does not
matter whether ``triton`` itself was imported earlier (``torch._dynamo`` imports it). Should the
kernel modules have been imported before without the variable, they are reloaded. The subprocess
test at the end is the last resort if the kernels still are not interpreted.

With a CUDA device the same tests run compiled on the GPU (and the ``gpu``-marked ones too).
Shapes are small (the interpreter executes every program in Python) but chosen to hurt: N = 1,
non-powers of two, rows longer than the forced ``block_n`` (looped kernels, last chunk partial),
several programs writing weight-gradient partials.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

_HAS_CUDA = torch.cuda.is_available()
if not _HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported

import importlib  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402

import layernorm  # noqa: E402
from conftest import make_param, make_x  # noqa: E402
from layernorm.backend import force_backend, triton_available  # noqa: E402
from layernorm.reference import (  # noqa: E402
    ada_norm_reference,
    layer_norm_reference,
    rms_norm_reference,
)

if not triton_available():  # pragma: no cover - triton is a dev dependency
    pytest.skip("triton is not installed", allow_module_level=True)

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from layernorm.kernels.triton import _norm_core  # noqa: E402
from layernorm.kernels.triton import ada_norm as tada  # noqa: E402
from layernorm.kernels.triton import layer_norm as tln  # noqa: E402
from layernorm.kernels.triton import rms_norm as trms  # noqa: E402

if not _HAS_CUDA and not isinstance(_norm_core._norm_fwd_fused_kernel, InterpretedFunction):
    importlib.reload(_norm_core)  # imported earlier without TRITON_INTERPRET: decorate again
INTERPRETED = isinstance(_norm_core._norm_fwd_fused_kernel, InterpretedFunction)
# Where the kernels can run in this process: CPU tensors under the interpreter, else the GPU.
DEVICE = "cpu" if INTERPRETED else ("cuda" if _HAS_CUDA else None)
in_process = pytest.mark.skipif(
    DEVICE is None,
    reason="the Triton kernels are not interpreted in this process and there is no GPU; "
    "test_rerun_under_interpreter runs this file in a fresh process",
)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not _HAS_CUDA, reason="needs a CUDA device")

HALF = (torch.float16, torch.bfloat16)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# (atol, rtol) of outputs against the float64 reference on the same rounded inputs. The kernels
# keep statistics and arithmetic in float32 and round once at the store.
TOLERANCES_FWD = {
    # a few float32 ulps (6e-8 relative) from the μ/σ² sums, times |y| ≲ 5 after gain and bias
    torch.float32: (1e-5, 1e-5),
    # one rounding to float16: half an ulp is 2⁻¹¹ ≈ 4.9e-4 relative; atol for outputs near 0
    torch.float16: (1e-3, 1e-3),
    # one rounding to bfloat16: half an ulp is 2⁻⁸ ≈ 3.9e-3 relative
    torch.bfloat16: (8e-3, 8e-3),
}
# dx = rstd·(g − mean(g) − x̂·mean(g⊙x̂)) cancels terms of size |g| ≈ 2, so float32 gets a looser
# atol than the forward; half types are dominated by the final rounding, as in the forward.
# "dparam" sums M rows in float32 in a different order than the reference: atol is scaled by √M.
TOLERANCES_BWD = {
    torch.float32: {"dx": (2e-5, 1e-4), "dparam": (1e-5, 1e-5)},
    torch.float16: {"dx": (2e-3, 2e-3), "dparam": (1e-3, 1e-3)},
    torch.bfloat16: {"dx": (1.6e-2, 1.6e-2), "dparam": (8e-3, 8e-3)},
}

# (M, N, block_n): block_n=None lets the heuristic pick (fused here); a block_n below N forces the
# looped kernels with a partial last chunk. The looped kernels run one program per row, so their
# M stays small for the interpreter.
SHAPES = [
    (7, 1, None),  # one-element rows: x̂ = 0 everywhere
    (37, 37, None),  # non-power-of-two N and M, several row tiles
    (5, 300, 64),  # looped: 5 chunks, the last one 44 wide
    (3, 1000, 256),  # looped: 4 chunks, the last one 232 wide
    (2, 10_000, None),  # the heuristics' own split: fused forward (≤ 16384), looped backward
    (2, 20_000, None),  # both looped with the default 4096-element chunks
]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float], what: str):
    torch.testing.assert_close(
        actual.double().cpu(),
        expected.double().cpu(),
        atol=tol[0],
        rtol=tol[1],
        msg=lambda m: f"{what}: {m}",
    )


def _ref_grads(
    fn, inputs: list[torch.Tensor | None], dy: torch.Tensor
) -> list[torch.Tensor | None]:
    """Output and gradients of ``fn`` in float64 on the same rounded inputs."""
    leaves = [None if t is None else t.detach().cpu().double().requires_grad_() for t in inputs]
    out = fn(*leaves)
    wanted = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(out, wanted, dy.detach().cpu().double()))
    return [out.detach(), *[None if t is None else next(grads) for t in leaves]]


def _dparam_tol(dtype: torch.dtype, m: int) -> tuple[float, float]:
    atol, rtol = TOLERANCES_BWD[dtype]["dparam"]
    return atol * math.sqrt(m), rtol


@in_process
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "block_n"), SHAPES)
def test_layer_norm_matches_reference(m: int, n: int, block_n: int | None, dtype: torch.dtype):
    x = make_x((m, n), dtype).to(DEVICE)
    # half inputs with float32 parameters (mixed precision), float32 with float32
    w = make_param((n,), torch.float32, center=1.0).to(DEVICE)
    b = make_param((n,), torch.float32, center=0.0).to(DEVICE)
    dy = make_x((m, n), dtype, offset=0.5, scale=1.0).to(DEVICE)
    y, mean, rstd = tln.layer_norm_fwd(x, w, b, 1e-5, block_n=block_n)
    assert y.dtype == dtype and mean.dtype == torch.float32 and rstd.dtype == torch.float32
    dx, dw, db = tln.layer_norm_bwd(
        dy, x, mean, rstd, w, False, False, True, True, True, block_n=block_n, num_programs=3
    )
    yr, dxr, dwr, dbr = _ref_grads(
        lambda a, g, c: layer_norm_reference(a, (n,), g, c), [x, w, b], dy
    )
    assert_close(y, yr, TOLERANCES_FWD[dtype], "y")
    x64 = x.double().cpu()
    assert_close(mean, x64.mean(1), (1e-5, 1e-6), "mean")
    assert_close(rstd, (x64.var(1, unbiased=False) + 1e-5).rsqrt(), (1e-5, 1e-5), "rstd")
    assert dx is not None and dw is not None and db is not None
    assert dw.dtype == torch.float32 and db.dtype == torch.float32
    assert_close(dx, dxr, TOLERANCES_BWD[dtype]["dx"], "dx")
    # dw/db are float32 sums (weights are float32), so the float32 table applies
    assert_close(dw, dwr, _dparam_tol(torch.float32, m), "dweight")
    assert_close(db, dbr, _dparam_tol(torch.float32, m), "dbias")


@in_process
@pytest.mark.parametrize("block_n", [None, 32])
@pytest.mark.parametrize(
    ("detach_mean", "detach_std"), [(True, False), (False, True), (True, True)]
)
def test_detach_norm_matches_reference(detach_mean: bool, detach_std: bool, block_n: int | None):
    m, n = 6, 77
    x = make_x((m, n)).to(DEVICE)
    w = make_param((n,), torch.float32, center=1.0).to(DEVICE)
    dy = make_x((m, n), offset=0.5, scale=1.0).to(DEVICE)
    _, mean, rstd = tln.layer_norm_fwd(x, w, None, 1e-5, block_n=block_n)
    dx, dw, db = tln.layer_norm_bwd(
        dy, x, mean, rstd, w, detach_mean, detach_std, True, True, False, block_n=block_n
    )
    _, dxr, dwr = _ref_grads(
        lambda a, g: layer_norm_reference(a, (n,), g, None, 1e-5, detach_mean, detach_std),
        [x, w],
        dy,
    )
    assert db is None
    assert_close(dx, dxr, TOLERANCES_BWD[torch.float32]["dx"], "dx")
    assert_close(dw, dwr, _dparam_tol(torch.float32, m), "dweight")


@in_process
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize(("m", "n", "block_n"), [SHAPES[1], SHAPES[2]])
def test_rms_norm_matches_reference(m, n, block_n, with_weight: bool, dtype: torch.dtype):
    x = make_x((m, n), dtype).to(DEVICE)
    # same-dtype weights here (the other tests use float32 weights with half inputs)
    w = make_param((n,), dtype, center=1.0).to(DEVICE) if with_weight else None
    dy = make_x((m, n), dtype, offset=0.5, scale=1.0).to(DEVICE)
    y, rstd = trms.rms_norm_fwd(x, w, 1e-6, block_n=block_n)
    dx, dw = trms.rms_norm_bwd(dy, x, rstd, w, True, True, block_n=block_n, num_programs=2)
    yr, dxr, dwr = _ref_grads(lambda a, g: rms_norm_reference(a, (n,), g, 1e-6), [x, w], dy)
    assert_close(y, yr, TOLERANCES_FWD[dtype], "y")
    assert_close(dx, dxr, TOLERANCES_BWD[dtype]["dx"], "dx")
    if with_weight:
        assert dw is not None and dw.dtype == dtype
        assert_close(dw, dwr, _dparam_tol(dtype, m), "dweight")
    else:
        assert dw is None


@in_process
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "block_n"), [SHAPES[1], SHAPES[3]])
def test_ada_norm_matches_reference(m, n, block_n, dtype: torch.dtype):
    k, scale = 0.1, 2.0
    x = make_x((m, n), dtype).to(DEVICE)
    dz = make_x((m, n), dtype, offset=0.5, scale=1.0).to(DEVICE)
    z, mean, rstd = tada.ada_norm_fwd(x, k, scale, 1e-5, block_n=block_n)
    dx = tada.ada_norm_bwd(dz, x, mean, rstd, k, scale, block_n=block_n)
    zr, dxr = _ref_grads(lambda a: ada_norm_reference(a, (n,), k, scale, 1e-5), [x], dz)
    # z = C·y·(1 − k·y) reaches ≈ 2·|y| ≲ 10: the relative tolerances carry over
    assert_close(z, zr, TOLERANCES_FWD[dtype], "z")
    assert_close(dx, dxr, TOLERANCES_BWD[dtype]["dx"], "dx")


@in_process
@pytest.mark.parametrize("block_n", [None, 16])
def test_eps_matters_for_rows_of_small_spread(block_n: int | None):
    """Rows with σ ≈ 1e-3 and eps = 1e-5: eps changes rstd by ~20 %, so a kernel that adds it
    wrongly (or twice) fails here, while the O(1)-spread inputs above would not notice."""
    m, n, eps = 5, 40, 1e-5
    x = make_x((m, n), offset=7.0, scale=1e-3).to(DEVICE)
    dy = make_x((m, n), offset=0.5).to(DEVICE)
    y, mean, rstd = tln.layer_norm_fwd(x, None, None, eps, block_n=block_n)
    dx, _, _ = tln.layer_norm_bwd(dy, x, mean, rstd, None, False, False, True, False, False,
                                  block_n=block_n)  # fmt: skip
    yr, dxr = _ref_grads(lambda a: layer_norm_reference(a, (n,), eps=eps), [x], dy)
    # |y| ≲ 3 and dx ~ rstd·|dy| ≈ 1e3: relative tolerances of float32 centring at offset 7,
    # scale 1e-3 (7·6e-8 / 1e-3 ≈ 4e-4 relative error in x − μ)
    assert_close(y, yr, (2e-3, 2e-3), "y")
    assert_close(dx, dxr, (1.0, 2e-3), "dx")
    yr_rms = rms_norm_reference(x.double().cpu() - 7.0, (n,), None, eps)
    y_rms, _ = trms.rms_norm_fwd(x - 7.0, None, eps, block_n=block_n)
    assert_close(y_rms, yr_rms, (2e-3, 2e-3), "rms y")


@in_process
@pytest.mark.parametrize("block_n", [None, 16])
def test_gradients_are_bitwise_deterministic(block_n: int | None):
    """Weight gradients are per-program partials plus a fixed-order sum: no run-to-run noise."""
    m, n = 23, 45
    x = make_x((m, n), torch.bfloat16).to(DEVICE)
    w = make_param((n,), torch.float32, center=1.0).to(DEVICE)
    dy = make_x((m, n), torch.bfloat16, offset=0.5, scale=1.0).to(DEVICE)
    _, mean, rstd = tln.layer_norm_fwd(x, w, None, 1e-5, block_n=block_n)
    runs = [
        tln.layer_norm_bwd(
            dy, x, mean, rstd, w, False, False, True, True, True, block_n=block_n, num_programs=4
        )
        for _ in range(2)
    ]
    for a, b in zip(runs[0], runs[1], strict=True):
        assert torch.equal(a, b)
    # a different number of partial rows changes only the summation order
    dx1, dw1, db1 = tln.layer_norm_bwd(
        dy, x, mean, rstd, w, False, False, True, True, True, block_n=block_n, num_programs=1
    )
    assert torch.equal(dx1, runs[0][0])  # dx does not depend on the grid
    assert_close(dw1, runs[0][1], _dparam_tol(torch.float32, m), "dweight, 1 vs 4 programs")
    assert_close(db1, runs[0][2], _dparam_tol(torch.float32, m), "dbias, 1 vs 4 programs")


@in_process
@pytest.mark.parametrize(
    ("need_dx", "need_dw", "need_db"),
    [(False, True, False), (False, False, True), (True, False, False)],
)
def test_only_requested_gradients(need_dx: bool, need_dw: bool, need_db: bool):
    m, n = 9, 20
    x, dy = make_x((m, n)).to(DEVICE), make_x((m, n), offset=0.5).to(DEVICE)
    w = make_param((n,), torch.float32, center=1.0).to(DEVICE)
    _, mean, rstd = tln.layer_norm_fwd(x, w, None, 1e-5)
    full = tln.layer_norm_bwd(dy, x, mean, rstd, w, False, False, True, True, True)
    part = tln.layer_norm_bwd(dy, x, mean, rstd, w, False, False, need_dx, need_dw, need_db)
    for got, ref, need in zip(part, full, (need_dx, need_dw, need_db), strict=True):
        if need:
            assert torch.equal(got, ref)
        else:
            assert got is None


@in_process
def test_empty_batch_and_float64_fallback():
    x = torch.empty(0, 8, device=DEVICE)
    y, mean, rstd = tln.layer_norm_fwd(x, None, None, 1e-5)
    assert y.shape == (0, 8) and mean.shape == (0,) and rstd.shape == (0,)
    x64 = make_x((4, 8), torch.float64).to(DEVICE)
    y64, _, _ = tln.layer_norm_fwd(x64, None, None, 1e-5)
    assert y64.dtype == torch.float64
    assert_close(y64, layer_norm_reference(x64, (8,)), (1e-12, 1e-12), "float64")


def test_launch_config_heuristics():
    assert not _norm_core.launch_config(1).looped
    for backward, limit in ((False, _norm_core.MAX_FUSED_BLOCK_N_FWD),
                            (True, _norm_core.MAX_FUSED_BLOCK_N_BWD)):  # fmt: skip
        fused = _norm_core.launch_config(limit, backward=backward)
        assert not fused.looped and fused.block_m == 1 and fused.block_n == limit
        for n in (limit + 1, 262_144):
            cfg = _norm_core.launch_config(n, backward=backward)
            assert cfg.looped and cfg.block_n == _norm_core.LOOPED_BLOCK_N
    small = _norm_core.launch_config(100)
    assert small.block_n == 128 and small.block_m * small.block_n == _norm_core.FUSED_TILE_ELEMS
    small_bwd = _norm_core.launch_config(100, backward=True)
    assert small_bwd.block_m * small_bwd.block_n == _norm_core.FUSED_TILE_ELEMS_BWD
    # the backward's own tile and looped warps; the forward's are unchanged. Short rows (a tile of
    # several rows) take the short-row launch's elements per thread and programs per SM
    short_per_thread = _norm_core.SHORT_ROWS_ELEMS_PER_THREAD_BWD
    assert small_bwd.num_warps == _norm_core._num_warps(
        _norm_core.FUSED_TILE_ELEMS_BWD, short_per_thread
    )
    assert small.num_warps == _norm_core._num_warps(_norm_core.FUSED_TILE_ELEMS)
    longer = _norm_core.SHORT_ROWS_BWD_MAX_N * 2
    longer_bwd = _norm_core.launch_config(longer, backward=True)
    assert not longer_bwd.looped and longer_bwd.num_warps == _norm_core._num_warps(
        longer_bwd.block_m * longer
    )
    # long rows: the forward's long-row launch from LONG_ROWS_FWD_MIN_N, the backward's as before
    long_n = _norm_core.LONG_ROWS_FWD_MIN_N
    long_fwd = _norm_core.launch_config(long_n)
    assert not long_fwd.looped and long_fwd.block_m == 1
    assert long_fwd.num_warps == _norm_core._num_warps(
        long_n, _norm_core.LONG_ROWS_ELEMS_PER_THREAD_FWD
    )
    below = _norm_core.launch_config(long_n // 2)
    assert below.num_warps == _norm_core._num_warps(below.block_m * (long_n // 2))
    with _norm_core.launch_settings(short_rows_bwd_max_n=longer):
        assert _norm_core.launch_config(longer, backward=True).num_warps == _norm_core._num_warps(
            longer_bwd.block_m * longer, short_per_thread
        )
    per_thread = {False: _norm_core.ELEMS_PER_THREAD, True: _norm_core.LOOPED_ELEMS_PER_THREAD_BWD}
    for backward, elems in per_thread.items():
        looped = _norm_core.launch_config(262_144, backward=backward)
        assert looped.num_warps == _norm_core.LOOPED_BLOCK_N // (32 * elems)
        forced = _norm_core.launch_config(8192, block_n=2048, backward=backward)
        assert forced.looped and forced.num_warps == max(2, 2048 // (32 * elems))
    assert _norm_core.launch_config(100, block_n=32).looped
    assert not _norm_core.launch_config(100, block_n=128).looped  # chunk ≥ row: fused
    with pytest.raises(ValueError, match="power of two"):
        _norm_core.launch_config(100, block_n=48)
    # about 16 elements per thread and operand, within Triton's 1..32 warps
    assert _norm_core._num_warps(16384) == 32 and _norm_core._num_warps(8192) == 16
    assert _norm_core._num_warps(64) == 2 and _norm_core._num_warps(1 << 20) == 32


def test_backward_grid_takes_the_short_row_programs_per_sm(monkeypatch: pytest.MonkeyPatch):
    """The persistent backward's grid: ``programs_per_sm`` per SM for rows longer than
    ``short_rows_bwd_max_n``, ``short_rows_programs_per_sm`` up to it; the interpreter's fixed
    count off CUDA; never more programs than tiles."""
    sms = 132
    props = type("Props", (), {"multi_processor_count": sms})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    cuda = torch.device("cuda")
    st = _norm_core.current_launch_settings()
    m = 1 << 20
    short = _norm_core.launch_config(st.short_rows_bwd_max_n, backward=True)
    assert _norm_core.backward_groups(short, m, short.block_n, cuda) == (
        sms * st.short_rows_programs_per_sm
    )
    n_long = 2 * st.short_rows_bwd_max_n
    long = _norm_core.launch_config(n_long, backward=True)
    assert not long.looped
    assert _norm_core.backward_groups(long, m, n_long, cuda) == sms * st.programs_per_sm
    with _norm_core.launch_settings(short_rows_programs_per_sm=3):
        assert _norm_core.backward_groups(short, m, short.block_n, cuda) == sms * 3
    assert _norm_core.backward_groups(short, short.block_m, short.block_n, cuda) == 1  # one tile
    cpu = _norm_core.backward_groups(short, m, short.block_n, torch.device("cpu"))
    assert cpu == _norm_core.INTERPRETER_PROGRAMS


def test_launch_settings_swap_in_and_restore():
    defaults = _norm_core.current_launch_settings()
    assert defaults == _norm_core.LaunchSettings()  # no LAYERNORM_TRITON_LAUNCH in the tests
    assert defaults.max_fused_block_n_bwd == _norm_core.MAX_FUSED_BLOCK_N_BWD
    with _norm_core.launch_settings(max_fused_block_n_bwd=4096, elems_per_thread=8) as inner:
        assert _norm_core.current_launch_settings() is inner
        assert inner.max_fused_block_n_bwd == 4096
        assert inner.looped_block_n == defaults.looped_block_n
        assert _norm_core.launch_config(8192, backward=True).looped  # over the lowered limit
        assert not _norm_core.launch_config(8192).looped  # the forward's limit is unchanged
        assert _norm_core._num_warps(8192) == 32  # 8192 / (32 threads · 8 elements)
        with _norm_core.launch_settings(looped_block_n=1024):  # nests on the current settings
            assert _norm_core.current_launch_settings().elems_per_thread == 8
            assert _norm_core.launch_config(8192, backward=True).block_n == 1024
        assert _norm_core.current_launch_settings() is inner
    assert _norm_core.current_launch_settings() is defaults
    with (
        pytest.raises(RuntimeError, match="boom"),
        _norm_core.launch_settings(fused_tile_elems=1024),
    ):
        raise RuntimeError("boom")
    assert _norm_core.current_launch_settings() is defaults
    explicit = _norm_core.LaunchSettings(programs_per_sm=3)  # any positive count, not only 2^k
    with _norm_core.launch_settings(explicit, max_fused_block_m=4) as st:
        assert st.programs_per_sm == 3 and st.max_fused_block_m == 4
        assert _norm_core.launch_config(64).block_m == 4
    assert _norm_core.current_launch_settings() is defaults


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_fused_block_n_bwd": 12288}, r"power of two, got 12288 \(nearest: 8192 or 16384\)"),
        ({"looped_block_n": 0}, "looped_block_n must be a positive int, got 0"),
        ({"elems_per_thread": 12}, "elems_per_thread must be a power of two"),
        ({"programs_per_sm": -1}, "programs_per_sm must be a positive int, got -1"),
        ({"fused_tile_elems": 2.0}, "must be a positive int, got 2.0"),
        ({"max_fused_block_m": True}, "must be a positive int, got True"),
        ({"max_fused_block_n_fwd": 1 << 21}, "at most 1048576"),
    ],
)
def test_launch_settings_reject_bad_values(overrides: dict, message: str):
    before = _norm_core.current_launch_settings()
    with pytest.raises(ValueError, match=message), _norm_core.launch_settings(**overrides):
        pass
    assert _norm_core.current_launch_settings() is before
    unknown = r"unknown launch setting\(s\) \['block_n'\]; expected some of \['max_fused"
    with pytest.raises(TypeError, match=unknown), _norm_core.launch_settings(block_n=64):
        pass
    not_settings = {"looped_block_n": 64}
    with (
        pytest.raises(TypeError, match="LaunchSettings or None, got dict"),
        _norm_core.launch_settings(not_settings),  # type: ignore[arg-type]
    ):
        pass
    assert _norm_core.current_launch_settings() is before


def test_launch_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch):
    var = _norm_core.LAUNCH_ENV_VAR
    monkeypatch.setenv(var, " max_fused_block_n_bwd=16384, elems_per_thread=8 ")
    st = _norm_core._settings_from_env()
    assert st == _norm_core.LaunchSettings(max_fused_block_n_bwd=16384, elems_per_thread=8)
    monkeypatch.setenv(var, "")
    assert _norm_core._settings_from_env() == _norm_core.LaunchSettings()
    for bad, message in (("looped_block_n", "name=integer pairs"),
                         ("looped_block_n=big", "got item 'looped_block_n=big'"),
                         ("looped_block_n=1000", "power of two, got 1000"),
                         ("warps=4", "unknown launch setting")):  # fmt: skip
        monkeypatch.setenv(var, bad)
        with pytest.raises(ValueError, match=message):
            _norm_core._settings_from_env()


# Non-default settings at sizes the interpreter runs quickly (rows of N = 40), each with the
# (forward looped, backward looped) route it must give; every route must match the reference.
NON_DEFAULT_SETTINGS = [
    # both directions looped in 16-element chunks: 3 chunks, the last one 8 wide
    (dict(max_fused_block_n_fwd=32, max_fused_block_n_bwd=16, looped_block_n=16), (True, True)),
    # fused forward, looped backward (the default split, moved down to N = 40)
    (dict(max_fused_block_n_bwd=32, looped_block_n=32, elems_per_thread=8), (False, True)),
    # fused both ways with 2-row tiles: several tiles per persistent program
    (dict(fused_tile_elems=128, max_fused_block_m=2, programs_per_sm=2, elems_per_thread=32),
     (False, False)),
    # the backward's own row tiles (4 rows) and looped warps
    (dict(fused_tile_elems_bwd=256, looped_elems_per_thread_bwd=4), (False, False)),
    (dict(max_fused_block_n_bwd=16, looped_block_n=16, looped_elems_per_thread_bwd=4),
     (False, True)),
]  # fmt: skip


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("settings", "looped"), NON_DEFAULT_SETTINGS)
def test_norms_match_reference_under_non_default_settings(
    settings: dict, looped: tuple[bool, bool], dtype: torch.dtype
):
    m, n = 9, 40
    x = make_x((m, n), dtype).to(DEVICE).requires_grad_()
    w = make_param((n,), torch.float32, center=1.0).to(DEVICE).requires_grad_()
    b = make_param((n,), torch.float32, center=0.0).to(DEVICE).requires_grad_()
    dy = make_x((m, n), dtype, offset=0.5, scale=1.0).to(DEVICE)
    with _norm_core.launch_settings(**settings) as st:
        fwd_cfg = _norm_core.launch_config(n)
        bwd_cfg = _norm_core.launch_config(n, backward=True)
        with force_backend("triton"):
            y = layernorm.layer_norm(x, n, w, b)
            dx, dw, db = torch.autograd.grad(y, (x, w, b), dy)
            y_rms = layernorm.rms_norm(x, n, w, 1e-6)
            dx_rms, dw_rms = torch.autograd.grad(y_rms, (x, w), dy)
    assert (fwd_cfg.looped, bwd_cfg.looped) == looped
    if not fwd_cfg.looped:
        assert fwd_cfg.block_m == min(st.max_fused_block_m, st.fused_tile_elems // 64)
    if not bwd_cfg.looped:
        assert bwd_cfg.block_m == min(st.max_fused_block_m, st.fused_tile_elems_bwd // 64)
    yr, dxr, dwr, dbr = _ref_grads(
        lambda a, g, c: layer_norm_reference(a, (n,), g, c), [x, w, b], dy
    )
    assert_close(y, yr, TOLERANCES_FWD[dtype], "y")
    assert_close(dx, dxr, TOLERANCES_BWD[dtype]["dx"], "dx")
    assert_close(dw, dwr, _dparam_tol(torch.float32, m), "dweight")
    assert_close(db, dbr, _dparam_tol(torch.float32, m), "dbias")
    yr, dxr, dwr = _ref_grads(lambda a, g: rms_norm_reference(a, (n,), g, 1e-6), [x, w], dy)
    assert_close(y_rms, yr, TOLERANCES_FWD[dtype], "rms y")
    assert_close(dx_rms, dxr, TOLERANCES_BWD[dtype]["dx"], "rms dx")
    assert_close(dw_rms, dwr, _dparam_tol(torch.float32, m), "rms dweight")


# ----------------------------------------------------------------------------------------------
# Through the custom ops: functional API, autograd, torch.compile
# ----------------------------------------------------------------------------------------------


def _spy(monkeypatch: pytest.MonkeyPatch, module, name: str) -> list[int]:
    calls: list[int] = []
    original = getattr(module, name)

    def wrapped(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)
    return calls


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_functional_ops_use_triton_backend(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype):
    fwd_calls = _spy(monkeypatch, tln, "norm_fwd")
    bwd_calls = _spy(monkeypatch, tln, "norm_bwd")
    x = make_x((3, 5, 24), dtype).to(DEVICE)
    w = make_param((24,), torch.float32, center=1.0).to(DEVICE)
    b = make_param((24,), torch.float32, center=0.0).to(DEVICE)
    results = {}
    for name in ("triton", "cpu"):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        with force_backend(name):  # type: ignore[arg-type]
            y = layernorm.layer_norm(xs, 24, ws, bs)
            y.backward(torch.ones_like(y) + torch.arange(24, device=DEVICE) / 24)
        results[name] = (y, xs.grad, ws.grad, bs.grad)
    assert fwd_calls and bwd_calls
    tol_y, tol_dx = TOLERANCES_FWD[dtype], TOLERANCES_BWD[dtype]["dx"]
    for i, (a, c) in enumerate(zip(results["triton"], results["cpu"], strict=True)):
        assert a.dtype == c.dtype
        assert_close(a, c, tol_y if i == 0 else tol_dx if i == 1 else (1e-4, 1e-4), f"output {i}")


@in_process
def test_rms_and_ada_functional_on_triton_backend(monkeypatch: pytest.MonkeyPatch):
    rms_calls = _spy(monkeypatch, trms, "norm_fwd")
    ada_calls = _spy(monkeypatch, tada, "norm_bwd")
    x = make_x((4, 33)).to(DEVICE).requires_grad_()
    w = make_param((33,), torch.float32, center=1.0).to(DEVICE).requires_grad_()
    with force_backend("triton"):
        y = layernorm.rms_norm(x, 33, w, 1e-6)
        z = layernorm.ada_norm(x, 33, k=0.1, scale=2.0)
        (y.sum() + (z * z).sum()).backward()
    assert rms_calls and ada_calls
    x64, w64 = (
        x.detach().double().cpu().requires_grad_(),
        w.detach().double().cpu().requires_grad_(),
    )
    ref = (
        rms_norm_reference(x64, (33,), w64, 1e-6).sum()
        + (ada_norm_reference(x64, (33,), 0.1, 2.0) ** 2).sum()
    )
    ref.backward()
    assert_close(x.grad, x64.grad, (1e-4, 1e-4), "dx")
    assert_close(w.grad, w64.grad, (1e-4, 1e-4), "dweight")


@in_process
def test_torch_compile_fullgraph_keeps_triton_kernels(monkeypatch: pytest.MonkeyPatch):
    calls = _spy(monkeypatch, tln, "norm_fwd")
    mod = layernorm.LayerNorm(16).to(DEVICE)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(mod(x * 2.0))

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    x = make_x((5, 16)).to(DEVICE).requires_grad_()
    with force_backend("triton"):
        y = compiled(x)
        y.sum().backward()
    assert calls
    x2 = x.detach().clone().requires_grad_()
    with force_backend("cpu"):
        y2 = f(x2)
        y2.sum().backward()
    assert_close(y, y2, TOLERANCES_FWD[torch.float32], "compiled output")
    assert_close(x.grad, x2.grad, TOLERANCES_BWD[torch.float32]["dx"], "compiled dx")


@in_process
def test_autocast_mixed_dtypes_reach_the_kernels(monkeypatch: pytest.MonkeyPatch):
    """Under autocast a norm after a Linear gets bfloat16 activations and float32 gain/bias: the
    kernels take both, return bfloat16, and give float32 parameter gradients."""
    calls = _spy(monkeypatch, tln, "norm_bwd")
    lin = torch.nn.Linear(24, 24).to(DEVICE)
    norm = layernorm.LayerNorm(24).to(DEVICE)
    x = make_x((6, 24)).to(DEVICE)
    autocast_device = "cuda" if DEVICE == "cuda" else "cpu"
    with force_backend("triton"), torch.autocast(autocast_device, dtype=torch.bfloat16):
        h = lin(x)
        y = norm(h)
    assert h.dtype == torch.bfloat16 and y.dtype == torch.bfloat16
    with force_backend("triton"):
        y.float().square().sum().backward()
    assert calls
    assert norm.weight.grad is not None and norm.weight.grad.dtype == torch.float32
    assert norm.bias.grad is not None and norm.bias.grad.dtype == torch.float32
    h64 = h.detach().double().cpu()
    w64 = norm.weight.detach().double().cpu().requires_grad_()
    b64 = norm.bias.detach().double().cpu().requires_grad_()
    ref = layer_norm_reference(h64, (24,), w64, b64)
    assert_close(y, ref, TOLERANCES_FWD[torch.bfloat16], "y under autocast")
    # the kernels see the bfloat16-rounded upstream gradient 2·y; with it replicated, only float32
    # arithmetic separates the float32 sums over 6 rows from the reference
    dy = (2 * y.detach().float()).to(torch.bfloat16).double().cpu()
    gw, gb = torch.autograd.grad(ref, (w64, b64), dy)
    assert_close(norm.weight.grad, gw, (1e-4, 1e-4), "dweight under autocast")
    assert_close(norm.bias.grad, gb, (1e-4, 1e-4), "dbias under autocast")


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_longest_rows_with_the_default_launch(dtype: torch.dtype):
    # N = 262,144 with the launch the heuristics pick (looped, 4096-element chunks): the longest
    # rows the kernels promise, run here as well as on the GPU
    n = 262_144
    x = make_x((2, n), dtype).to(DEVICE)
    w = make_param((n,), torch.float32, center=1.0).to(DEVICE)
    b = make_param((n,), torch.float32, center=0.0).to(DEVICE)
    dy = make_x((2, n), dtype, offset=0.5, scale=1.0).to(DEVICE)
    assert _norm_core.launch_config(n).looped and _norm_core.launch_config(n, backward=True).looped
    y, mean, rstd = tln.layer_norm_fwd(x, w, b, 1e-5)
    dx, dw, db = tln.layer_norm_bwd(dy, x, mean, rstd, w, False, False, True, True, True)
    yr, dxr, dwr, dbr = _ref_grads(
        lambda a, g, c: layer_norm_reference(a, (n,), g, c), [x, w, b], dy
    )
    assert_close(y, yr, TOLERANCES_FWD[dtype], "y")
    assert_close(dx, dxr, TOLERANCES_BWD[dtype]["dx"], "dx")
    assert_close(dw, dwr, _dparam_tol(torch.float32, 2), "dweight")
    assert_close(db, dbr, _dparam_tol(torch.float32, 2), "dbias")


# ----------------------------------------------------------------------------------------------
# GPU only: long rows, bitwise determinism and native-torch parity at realistic sizes
# ----------------------------------------------------------------------------------------------


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 1000, 4096, 8192, 8193, 16384, 16385, 65536, 262_144])
def test_gpu_layer_norm_against_torch(n: int, dtype: torch.dtype):
    if INTERPRETED:
        pytest.skip("kernels are interpreted in this process")
    m = max(2, min(2048, (1 << 22) // n))
    x = make_x((m, n), dtype).cuda()
    w = make_param((n,), torch.float32, center=1.0).cuda()
    b = make_param((n,), torch.float32, center=0.0).cuda()
    dy = make_x((m, n), dtype, offset=0.5, scale=1.0).cuda()
    y, mean, rstd = tln.layer_norm_fwd(x, w, b, 1e-5)
    dx, dw, db = tln.layer_norm_bwd(dy, x, mean, rstd, w, False, False, True, True, True)
    # the float64 reference on the GPU, same rounded inputs
    yr, dxr, dwr, dbr = _ref_grads(
        lambda a, g, c: layer_norm_reference(a, (n,), g, c), [x, w, b], dy
    )
    assert_close(y, yr, TOLERANCES_FWD[dtype], "y")
    assert_close(dx, dxr, TOLERANCES_BWD[dtype]["dx"], "dx")
    assert_close(dw, dwr, _dparam_tol(torch.float32, m), "dweight")
    assert_close(db, dbr, _dparam_tol(torch.float32, m), "dbias")
    again = tln.layer_norm_bwd(dy, x, mean, rstd, w, False, False, True, True, True)
    assert all(torch.equal(a, c) for a, c in zip((dx, dw, db), again, strict=True))


@gpu
@needs_cuda
def test_gpu_autocast_dtypes():
    """Under autocast the ops see the dtype autocast produced (bf16 activations, fp32 params)."""
    if INTERPRETED:
        pytest.skip("kernels are interpreted in this process")
    lin = torch.nn.Linear(64, 64).cuda()
    norm = layernorm.LayerNorm(64).cuda()
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = norm(lin(x))
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert norm.weight.grad is not None and norm.weight.grad.dtype == torch.float32
    assert norm.bias.grad is not None and norm.bias.grad.dtype == torch.float32


# ----------------------------------------------------------------------------------------------
# Where the kernels cannot run: a clear error, not a failure deep inside Triton
# ----------------------------------------------------------------------------------------------


def test_cpu_tensor_without_interpreter_is_a_clear_error():
    code = (
        "import torch, layernorm.functional as F\n"
        "from layernorm.backend import force_backend\n"
        "with force_backend('triton'):\n"
        "    F.layer_norm(torch.randn(2, 8) + 1, (8,))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "RuntimeError: the Triton kernels got a cpu tensor" in proc.stderr, proc.stderr[-2000:]
    assert "TRITON_INTERPRET=1" in proc.stderr


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter check runs on CPU tensors")
def test_broken_interpreter_is_reported_with_the_versions(monkeypatch):
    class Failing:
        def __getitem__(self, grid):
            def launch(*args):
                raise TypeError("only 0-dimensional arrays can be converted to Python scalars")

            return launch

    assert _norm_core._interpreter_problem() is None  # this environment's interpreter works
    monkeypatch.setattr(_norm_core, "_range_probe_kernel", Failing())
    monkeypatch.setattr(_norm_core, "InterpretedFunction", Failing)
    _norm_core._interpreter_problem.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"Triton interpreter \(Triton 3\.\d+.*NumPy \d"):
            _norm_core.norm_fwd(make_x((2, 8), torch.float32), None, None, 1e-5, 0)
    finally:
        _norm_core._interpreter_problem.cache_clear()


# ----------------------------------------------------------------------------------------------
# Fallback when this process cannot interpret: run the file again in a fresh interpreter
# ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(DEVICE is not None, reason="the tests ran in this process")
def test_rerun_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout
