"""The LN-GRU's input-side layer norm over all rows where autograd records it: the C block norm
(``rnn_abi.BLOCK_NORM_FWD`` / ``_BWD``, ``_fused.BlockNormalized``), each row's ``(r, z)`` and
``n`` blocks normalized on their own.

Held to the float64 reference of each block's layer norm on the same rounded inputs, on the error
model of ``tolerances.py`` (the fused kernels' K: statistics as the step kernels find them, the
gain's and bias's gradients summed a chunk of rows in the scalar type, the chunks in float64);
across thread counts; at the C boundary; and inside ``LayerNormGRU``, against the same layer
composed of torch's layer norms.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from layernorm import LayerNormGRU
from layernorm.kernels.cpu import rnn, rnn_abi
from layernorm.recurrent import _fused
from tolerances import assert_within, row_stats

pytestmark = pytest.mark.skipif(
    not rnn.available(torch.zeros(1)), reason="needs the C recurrent kernels (a C compiler)"
)
EPS = 1e-5
# (rows, columns, split): one row; rows not a multiple of a statistics group (8); the GRU's
# blocks at H = 32, 64, 512; a split at G (the second block empty); short blocks; blocks whose
# last elements are not a whole pair of vectors (their masked tail, rnn_step_impl.h sld_tail):
# within one block of sums (60, 40, 17, 16 + 1) and after several (600: 18 pairs of 32, or 37 of
# 16, and a tail of 24 or 8)
SHAPES = [(1, 3, 2), (13, 96, 64), (300, 192, 128), (9, 1536, 1024), (37, 5, 5), (20, 7, 1),
          (11, 100, 60), (3, 33, 16), (7, 1100, 600)]  # fmt: skip


def _inputs(rows: int, cols: int, dtype: torch.dtype, kind: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    if kind == "offset":  # far from zero for its spread: the statistics' hard case
        x = x + 1e4
    elif kind == "constant":  # every other row constant: variance 0, y the bias exactly
        x[::2] = torch.linspace(-3, 3, x[::2].shape[0], dtype=torch.float64)[:, None]
    w = 1 + 0.5 * torch.randn(cols, generator=gen, dtype=torch.float64)
    b = 0.5 * torch.randn(cols, generator=gen, dtype=torch.float64)
    dy = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (x, w, b, dy)]


def _blocks(split: int, cols: int) -> list[slice]:
    return [slice(0, split)] + ([slice(split, cols)] if split < cols else [])


def _check_block(got, ref, x64, w64, b64, dy64, c: slice, dtype, what: str) -> None:
    """assert_within for one block's y, dx, dw, db (the scales of test_fuzz_kernels)."""
    y, dx, dw, db = got
    yr, dxr, dwr, dbr = ref
    xhat, rstd, kappa = row_stats(x64[:, c], EPS)
    w, b, dy = w64[c], b64[c], dy64[:, c]
    xmax = xhat.abs().amax(-1, keepdim=True)
    y_scale = w.abs().max() * (xmax + kappa) + b.abs().max()
    dx_scale = rstd * (dy * w).abs().amax(-1, keepdim=True) * (1 + xmax) * kappa
    assert_within(y[:, c], yr[:, c], "y", dtype, y_scale, what + " y", fused=True)
    assert_within(dx[:, c], dxr[:, c], "dx", dtype, dx_scale, what + " dx", fused=True)
    dw_scale = (dy.abs() * (xhat.abs() + kappa)).sum(0)
    assert_within(dw[c], dwr[c], "dparam", dtype, dw_scale, what + " dweight", fused=True)
    assert_within(db[c], dbr[c], "dparam", dtype, dy.abs().sum(0), what + " dbias", fused=True)


def _reference(x, w, b, dy, split: int):
    """Each block's torch layer norm in float64 on the same rounded inputs, with gradients."""
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    xr, wr, br = leaves
    cols = x.shape[1]
    y = torch.cat([F.layer_norm(xr[:, c], (c.stop - c.start,), wr[c], br[c], EPS)
                   for c in _blocks(split, cols)], dim=1)  # fmt: skip
    grads = torch.autograd.grad(y, leaves, dy.double())
    return (y.detach(), *grads)


@pytest.mark.parametrize("kind", ["normal", "offset", "constant"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_block_norm_is_each_block_s_layer_norm(dtype, shape, kind) -> None:
    rows, cols, split = shape
    x, w, b, dy = _inputs(rows, cols, dtype, kind)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    y = _fused.BlockNormalized.apply(*leaves, split, EPS)
    got = (y.detach(), *torch.autograd.grad(y, leaves, dy))
    ref = _reference(x, w, b, dy, split)
    what = f"{dtype} {shape} {kind}"
    for c in _blocks(split, cols):
        _check_block(got, ref, x.double(), w.double(), b.double(), dy.double(), c, dtype, what)
    if kind == "constant":  # x − μ is 0 exactly on a constant row: y is the bias
        assert torch.equal(y.detach()[::2], b.expand(y[::2].shape)), what


def test_block_norm_without_gain_or_bias_is_ones_and_zeros() -> None:
    x, _, _, dy = _inputs(11, 12, torch.float64, "normal")
    xr = x.clone().requires_grad_()
    y = _fused.BlockNormalized.apply(xr, None, None, 8, EPS)
    (dx,) = torch.autograd.grad(y, xr, dy)
    ref = _reference(x, torch.ones(12, dtype=x.dtype), torch.zeros(12, dtype=x.dtype), dy, 8)
    torch.testing.assert_close(y, ref[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, ref[1], rtol=1e-12, atol=1e-12)


def test_block_norm_gradcheck() -> None:
    x, w, b, _ = _inputs(6, 7, torch.float64, "normal")
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    assert torch.autograd.gradcheck(
        lambda *a: _fused.BlockNormalized.apply(*a, 4, EPS), leaves, eps=1e-6, atol=1e-7
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_block_norm_threads_share_rows_not_results(dtype) -> None:
    """y, the statistics and dx do not depend on the threads; the parameter sums only on their
    order (each thread's rows apart), within the error model, and are the same on every call
    with the same threads."""
    rows, cols, split = 203, 96, 64
    x, w, b, dy = _inputs(rows, cols, dtype, "offset", seed=3)
    y1, st1 = rnn.block_norm_fwd(x, w, b, split, EPS, 1)
    dx1, dp1 = rnn.block_norm_bwd(dy, x, w, st1, split, 1)
    ref = _reference(x, w, b, dy, split)
    for threads in (2, 3, 8):
        y, st = rnn.block_norm_fwd(x, w, b, split, EPS, threads)
        dx, dp = rnn.block_norm_bwd(dy, x, w, st, split, threads)
        assert torch.equal(y, y1) and torch.equal(st, st1) and torch.equal(dx, dx1), threads
        for c in _blocks(split, cols):
            _check_block((y, dx, dp[0], dp[1]), ref, x.double(), w.double(), b.double(),
                         dy.double(), c, dtype, f"{threads} threads")  # fmt: skip
        assert torch.equal(rnn.block_norm_bwd(dy, x, w, st, split, threads)[1], dp), threads
    assert torch.equal(rnn.block_norm_bwd(dy, x, w, st1, split, 1)[1], dp1)


def _fwd_values(x, w, b, y, stats, split):
    return {"x": x, "w": w, "b": b, "y": y, "stats": stats, "split": split, "eps": EPS,
            "threads": 1}  # fmt: skip


def test_c_refuses_a_split_past_the_row_and_writes_nothing() -> None:
    x, w, b, dy = _inputs(5, 6, torch.float32, "normal")
    y = torch.full_like(x, float("nan"))
    stats = torch.full((5, rnn_abi.BLOCK_NORM_STATS), float("nan"))
    args = rnn_abi.pack(rnn_abi.BLOCK_NORM_FWD, torch.float32,
                        _fwd_values(x, w, b, y, stats, 7), {"N": 5, "G": 6})  # fmt: skip
    with pytest.raises(ValueError, match="split must be at most G"):
        rnn.call("block_norm_fwd", torch.float32, args)
    assert y.isnan().all() and stats.isnan().all()
    dx = torch.full_like(x, float("nan"))
    dparams = torch.full((2, 6), float("nan"))
    values = {"dy": dy, "x": x, "w": w, "stats": stats, "dx": dx, "dparams": dparams,
              "split": 7, "threads": 2}  # fmt: skip
    args = rnn_abi.pack(rnn_abi.BLOCK_NORM_BWD, torch.float32, values, {"N": 5, "G": 6})
    with pytest.raises(ValueError, match="split must be at most G"):
        rnn.call("block_norm_bwd", torch.float32, args)
    assert dx.isnan().all() and dparams.isnan().all()


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"split": 0}, ValueError, "split"),
        ({"stats": torch.zeros(5, 2)}, ValueError, "stats"),
        ({"w": torch.ones(5)}, ValueError, "w"),
        ({"y": torch.zeros(6, 5)[:, :5].t()}, ValueError, "y"),
        ({"x": torch.zeros(5, 6, dtype=torch.float16)}, TypeError, "float16"),
    ],
    ids=["split 0", "stats shape", "gain shape", "y layout", "x dtype"],
)
def test_block_norm_arguments_are_checked_by_name(change, error, message) -> None:
    x, w, b, _ = _inputs(5, 6, torch.float32, "normal")
    values = {**_fwd_values(x, w, b, torch.empty(5, 6), torch.empty(5, 4), 4), **change}
    with pytest.raises(error, match=message):
        rnn_abi.pack(rnn_abi.BLOCK_NORM_FWD, torch.float32, values, {"N": 5, "G": 6})


def _gru_call(layer: LayerNormGRU, x: torch.Tensor):
    out, h = layer(x)
    loss = out.square().sum() + h.sum()
    return (out.detach(), *torch.autograd.grad(loss, [x, *layer.parameters()]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("options", [{}, {"bidirectional": True, "num_layers": 2}],
                         ids=["one layer", "two layers bidirectional"])  # fmt: skip
def test_gru_training_normalizes_its_input_side_with_the_block_norm(
    dtype, options, monkeypatch
) -> None:
    """Training an LN-GRU runs the block norm once per direction and layer, and gives the values
    and gradients of the same layer with torch's layer norms on each block."""
    torch.manual_seed(0)
    layer = LayerNormGRU(24, 32, dtype=dtype, **options)
    with torch.no_grad():
        for p in layer.parameters():  # gains away from one, biases away from zero
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(6, 5, 24, dtype=dtype, requires_grad=True)
    calls = []
    apply = _fused.BlockNormalized.apply

    def counted(*args):
        calls.append(args[0].shape)
        return apply(*args)

    monkeypatch.setattr(_fused.BlockNormalized, "apply", counted)
    got = _gru_call(layer, x)
    directions = (2 if options.get("bidirectional") else 1) * options.get("num_layers", 1)
    assert len(calls) == directions and all(s == (30, 96) for s in calls)
    monkeypatch.setattr(_fused, "_blocks_by_c", lambda data, n: False)
    ref = _gru_call(layer, x)
    assert len(calls) == directions  # the composition of torch's layer norms this time
    tol = {"rtol": 1e-10, "atol": 1e-11} if dtype == torch.float64 else {"rtol": 2e-4, "atol": 2e-5}
    for a, r in zip(got, ref, strict=True):
        torch.testing.assert_close(a, r, **tol)
