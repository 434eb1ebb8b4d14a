"""The functional ops against a float64 reference, torch's own ops, and gradcheck.

Every comparison feeds the reference the *same rounded inputs* as the op under test (round to the
dtype first, then upcast), so the tolerances below measure the op's own error, not input rounding.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as TF
from torch.autograd import gradcheck, gradgradcheck

import layernorm
from conftest import ALL_DTYPES, make_param, make_x, upcast
from layernorm.ops import ada_norm as ada_ops
from layernorm.ops import layer_norm as ln_ops
from layernorm.ops import rms_norm as rms_ops
from layernorm.reference import ada_norm_reference, layer_norm_reference, rms_norm_reference

# (atol, rtol) of the output against the float64 reference on the same rounded inputs.
TOLERANCES_FWD = {
    # Both sides in float64; only the summation order of μ and σ² differs (~N·2⁻⁵³ relative).
    torch.float64: (1e-10, 1e-10),
    # Statistics in float32: a few ulps (2⁻²⁴ ≈ 6e-8) from μ/σ² summation, times |y| ≤ ~5 after
    # gain and bias; 1e-5 leaves ~30× headroom for N up to 1023 while still catching a wrong eps.
    torch.float32: (1e-5, 1e-5),
    # Computed in float32 and rounded once to float16: half an ulp is 2⁻¹¹ ≈ 4.9e-4 relative; the
    # atol covers outputs near zero, where the relative bound says nothing.
    torch.float16: (1e-3, 1e-3),
    # Same argument with bfloat16's 8-bit mantissa: half an ulp is 2⁻⁸ ≈ 3.9e-3 relative.
    torch.bfloat16: (8e-3, 8e-3),
}

# (atol, rtol) of the gradients. "dx" is per element; "dparam" (dweight, dbias) is a sum over the
# M rows, whose rounding error grows like √M (different summation orders), so its atol is scaled
# by √M in the tests below.
TOLERANCES_BWD = {
    # float64 throughout; the analytic formula and the reference's autograd differ in rounding only.
    torch.float64: {"dx": (1e-9, 1e-9), "dparam": (1e-10, 1e-9)},
    # dx = rstd·(g − mean(g) − x̂·mean(g⊙x̂)) cancels terms of size |g|, so a few float32 ulps of
    # |g|·rstd; dparam sums M products of float32 values.
    torch.float32: {"dx": (2e-5, 2e-5), "dparam": (2e-5, 2e-5)},
    # float32 arithmetic, one final rounding to float16 (2⁻¹¹ relative) for dx; the parameters here
    # are float16 too, so dparam is rounded once to float16.
    torch.float16: {"dx": (2e-3, 2e-3), "dparam": (2e-3, 2e-3)},
    # As float16 with bfloat16's 2⁻⁸ half-ulp, plus one ulp of slack for |dx| near a binade edge.
    torch.bfloat16: {"dx": (1.6e-2, 1.6e-2), "dparam": (1.6e-2, 1.6e-2)},
}

# (M, N): one row, a prime row count, and a large M; N from 1 through non-powers of two past the
# usual block sizes. The largest (4096 × 1023) case has its own single-op test to stay fast.
SHAPES = [(1, 1), (1, 1023), (37, 7), (37, 760), (4096, 7)]

# name → (op, uses weight, uses bias, keyword options)
VARIANTS = {
    "ln_simple": ("layer", False, False, {}),
    "ln_affine": ("layer", True, True, {}),
    "ln_weight_only": ("layer", True, False, {}),
    "ln_bias_only": ("layer", False, True, {}),
    "detach_mean": ("layer", True, True, {"detach_mean": True}),
    "detach_std": ("layer", True, True, {"detach_std": True}),
    "detach_both": ("layer", False, False, {"detach_mean": True, "detach_std": True}),
    "rms": ("rms", False, False, {"eps": 1e-6}),
    "rms_weight": ("rms", True, False, {"eps": 1e-6}),
    "ada": ("ada", False, False, {"k": 0.1, "scale": 2.0}),
}


def run_ours(kind, x, shape, w, b, opts):
    if kind == "layer":
        return layernorm.layer_norm(x, shape, w, b, **opts)
    if kind == "rms":
        return layernorm.rms_norm(x, shape, w, **opts)
    return layernorm.ada_norm(x, shape, **opts)


def run_reference(kind, x, shape, w, b, opts):
    shape = tuple(shape) if not isinstance(shape, int) else (shape,)
    if kind == "layer":
        return layer_norm_reference(x, shape, w, b, **opts)
    if kind == "rms":
        return rms_norm_reference(x, shape, w, **opts)
    return ada_norm_reference(x, shape, **opts)


def assert_close(actual, expected, tol, what):
    atol, rtol = tol
    torch.testing.assert_close(
        actual.double(), expected.double(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


def check_against_reference(kind, m, n, dtype, use_w, use_b, opts, wdtype=None):
    """Forward and all gradients of one op vs autograd of the float64 reference."""
    wdtype = wdtype or dtype
    x = make_x((m, n), dtype, requires_grad=True)
    w = make_param((n,), wdtype, center=1.0, requires_grad=True) if use_w else None
    b = make_param((n,), wdtype, center=0.0, requires_grad=True) if use_b else None
    y = run_ours(kind, x, n, w, b, opts)
    assert y.dtype == dtype and y.shape == x.shape

    xr, wr, br = upcast(x), upcast(w), upcast(b)
    yr = run_reference(kind, xr, n, wr, br, opts)
    assert_close(y, yr, TOLERANCES_FWD[dtype], "output")

    dy = make_x((m, n), dtype, offset=0.5, scale=1.0)
    y.backward(dy)
    yr.backward(dy.double())
    tol = TOLERANCES_BWD[dtype]
    assert x.grad is not None and x.grad.dtype == dtype
    assert_close(x.grad, xr.grad, tol["dx"], "dx")
    # Parameter gradients are accumulated in the compute dtype (float32 for half x) and rounded to
    # the parameter's dtype: the looser of the two tolerances applies.
    compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    atol, rtol = max(TOLERANCES_BWD[compute]["dparam"], TOLERANCES_BWD[wdtype]["dparam"])
    atol *= math.sqrt(m) * _centering_condition(xr, kind)
    for name, p, pr in (("dweight", w, wr), ("dbias", b, br)):
        if p is not None:
            assert p.grad is not None and p.grad.dtype == p.dtype, name
            assert_close(p.grad, pr.grad, (atol, rtol), name)


def _centering_condition(xr, kind):
    """max(1, |μ|/σ) over rows: the native backward forms x̂ = x·rstd − μ·rstd, whose rounding error
    is |μ|·rstd ulps, large when σ ≪ |μ| (N = 1, where x̂ is 0 but rstd = 1/√eps ≈ 316)."""
    if kind == "rms":
        return 1.0
    xd = xr.detach()
    mu = xd.mean(-1).abs()
    rstd = torch.rsqrt(xd.var(-1, unbiased=False) + 1e-5)
    return max(1.0, (mu * rstd).max().item()) if xd.numel() else 1.0


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize(("m", "n"), SHAPES, ids=lambda s: str(s))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_reference(variant, m, n, dtype):
    kind, use_w, use_b, opts = VARIANTS[variant]
    if kind == "rms" and dtype in (torch.float16, torch.bfloat16):
        opts = {**opts, "eps": 1e-5}  # 1e-6 is below float16's smallest normal spacing near 1
    check_against_reference(kind, m, n, dtype, use_w, use_b, opts)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_aten_fallback_matches_reference(variant, dtype, monkeypatch):
    """float32/float64 normally run the CPU backend's compiled kernels; a machine without a C
    compiler (or LAYERNORM_CPU_COMPILE=0) runs the ATen compositions instead: test those too."""
    monkeypatch.setenv("LAYERNORM_CPU_COMPILE", "0")
    kind, use_w, use_b, opts = VARIANTS[variant]
    check_against_reference(kind, 37, 760, dtype, use_w, use_b, opts)
    check_against_reference(kind, 1, 7, dtype, use_w, use_b, opts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_large_rows_layer_norm(dtype):
    """The largest shape once per precision class: M = 4096 rows of N = 1023 (just under a power
    of two), where the parameter gradients sum 4096 rows."""
    check_against_reference("layer", 4096, 1023, dtype, True, True, {})


@pytest.mark.parametrize(
    ("variant", "dtype", "wdtype"),
    [
        ("ln_affine", torch.bfloat16, torch.float32),
        ("ln_affine", torch.float16, torch.float32),
        ("ln_affine", torch.float32, torch.float64),
        ("rms_weight", torch.bfloat16, torch.float32),
        ("detach_mean", torch.bfloat16, torch.float32),
    ],
)
def test_weight_dtype_differs_from_input(variant, dtype, wdtype):
    """Half activations with float32 parameters (mixed-precision training): output in x's dtype,
    parameter gradients in the parameter's dtype."""
    kind, use_w, use_b, opts = VARIANTS[variant]
    check_against_reference(kind, 37, 760, dtype, use_w, use_b, opts, wdtype=wdtype)


# ---------------------------------------------------------------------------------------------
# Same contract and result as torch's own ops


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("affine", [False, True])
def test_layer_norm_equals_torch(dtype, affine):
    x = make_x((6, 5, 24), dtype, requires_grad=True)
    xt = x.detach().clone().requires_grad_()
    w = make_param((5, 24), dtype, center=1.0, requires_grad=True) if affine else None
    b = make_param((5, 24), dtype, center=0.0, requires_grad=True) if affine else None
    wt = None if w is None else w.detach().clone().requires_grad_()
    bt = None if b is None else b.detach().clone().requires_grad_()
    y = layernorm.layer_norm(x, (5, 24), w, b, eps=1e-3)
    yt = TF.layer_norm(xt, (5, 24), wt, bt, eps=1e-3)
    tol = TOLERANCES_FWD[dtype]
    assert y.dtype == yt.dtype
    assert_close(y, yt, tol, "output vs torch")
    dy = torch.randn_like(y)
    y.backward(dy)
    yt.backward(dy)
    assert_close(x.grad, xt.grad, TOLERANCES_BWD[dtype]["dx"], "dx vs torch")
    if affine:
        atol, rtol = TOLERANCES_BWD[dtype]["dparam"]
        assert_close(w.grad, wt.grad, (atol * math.sqrt(6), rtol), "dweight vs torch")
        assert_close(b.grad, bt.grad, (atol * math.sqrt(6), rtol), "dbias vs torch")


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("eps", [None, 1e-3])
@pytest.mark.parametrize("affine", [False, True])
def test_rms_norm_equals_torch(dtype, eps, affine):
    """eps=None must pick torch's default, which for half inputs is float32's machine epsilon (the
    statistics are computed in float32), not the half type's much larger one."""
    # Small inputs make eps matter: mean(x²) ~ 1e-4 is comparable to float16's eps (9.8e-4).
    x = (torch.randn(6, 5, 24, dtype=torch.float64) * 1e-2 + 5e-3).to(dtype).requires_grad_()
    xt = x.detach().clone().requires_grad_()
    w = make_param((24,), dtype, center=1.0, requires_grad=True) if affine else None
    wt = None if w is None else w.detach().clone().requires_grad_()
    y = layernorm.rms_norm(x, 24, w, eps)
    yt = TF.rms_norm(xt, (24,), wt, eps)
    assert y.dtype == yt.dtype
    # torch rounds x/rms to the input dtype before multiplying by the gain, we round once at the
    # end: up to one more half-ulp each way, hence twice the forward tolerance.
    atol, rtol = TOLERANCES_FWD[dtype]
    assert_close(y, yt, (2 * atol, 2 * rtol), "output vs torch")
    dy = torch.randn_like(y)
    y.backward(dy)
    yt.backward(dy)
    # Gradients scale with rstd ~ 1/|x| ~ 1e2 here, so compare relative to the gradient's size.
    scale = xt.grad.double().abs().max().item()
    atol, rtol = TOLERANCES_BWD[dtype]["dx"]
    assert_close(x.grad, xt.grad, (2 * atol * scale, 2 * rtol), "dx vs torch")
    if affine:
        atol, rtol = TOLERANCES_BWD[dtype]["dparam"]
        gscale = wt.grad.double().abs().max().item()
        assert_close(w.grad, wt.grad, (2 * atol * gscale, 2 * rtol), "dweight vs torch")


def test_rms_norm_default_eps_is_float32_eps_for_half():
    """Pinned directly: eps=None on float16 equals eps=finfo(float32).eps, and differs from
    finfo(float16).eps on inputs small enough for eps to matter."""
    x = (torch.randn(4, 16) * 1e-2).half()
    y = layernorm.rms_norm(x, 16)
    assert torch.equal(y, layernorm.rms_norm(x, 16, eps=torch.finfo(torch.float32).eps))
    assert not torch.allclose(y, layernorm.rms_norm(x, 16, eps=torch.finfo(torch.float16).eps))


# ---------------------------------------------------------------------------------------------
# Layouts, ranks and sizes


@pytest.mark.parametrize("kind", ["layer", "rms", "ada"])
@pytest.mark.parametrize(
    "make_view",
    [
        pytest.param(lambda t: t.transpose(0, 1), id="transposed"),
        pytest.param(lambda t: t[:, ::2], id="strided-rows"),
        pytest.param(lambda t: t[1:, :, 3:], id="sliced"),
        pytest.param(lambda t: t.permute(2, 0, 1)[..., :8].permute(1, 2, 0), id="permuted"),
    ],
)
def test_non_contiguous_input(kind, make_view):
    base = make_x((6, 10, 16), torch.float64)
    view = make_view(base).requires_grad_()
    assert not view.is_contiguous()
    n = view.shape[-1]
    dense = view.detach().contiguous().requires_grad_()
    y = run_ours(kind, view, n, None, None, {})
    yd = run_reference(kind, dense, n, None, None, {})
    assert y.shape == view.shape
    assert_close(y, yd, TOLERANCES_FWD[torch.float64], "output")
    dy = torch.randn(y.shape, dtype=torch.float64).transpose(0, 1).contiguous().transpose(0, 1)
    y.backward(dy)
    yd.backward(dy)
    assert_close(view.grad, dense.grad, TOLERANCES_BWD[torch.float64]["dx"], "dx")


def test_non_contiguous_parameters():
    """Gains and biases given as strided views (e.g. slices of a larger tensor) are read right."""
    x = make_x((3, 4, 5), torch.float64, requires_grad=True)
    w_view = make_param((5, 4), torch.float64, center=1.0).t().requires_grad_()
    big_b = make_param((4, 10), torch.float64, center=0.0)
    b_view = big_b[:, ::2].requires_grad_()
    assert not w_view.is_contiguous() and not b_view.is_contiguous()
    xr, wr, br = upcast(x), upcast(w_view.contiguous()), upcast(b_view.contiguous())
    y = layernorm.layer_norm(x, (4, 5), w_view, b_view)
    yr = layer_norm_reference(xr, (4, 5), wr, br)
    assert_close(y, yr, TOLERANCES_FWD[torch.float64], "output")
    dy = torch.randn_like(y)
    y.backward(dy)
    yr.backward(dy)
    assert_close(w_view.grad, wr.grad, TOLERANCES_BWD[torch.float64]["dparam"], "dweight")
    assert_close(b_view.grad, br.grad, TOLERANCES_BWD[torch.float64]["dparam"], "dbias")
    r = layernorm.rms_norm(x, (4, 5), w_view)
    assert_close(r, rms_norm_reference(xr, (4, 5), wr), TOLERANCES_FWD[torch.float64], "rms")


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["layer", "rms", "ada"])
@pytest.mark.parametrize("shape", [(0, 7), (2, 0, 7), (0, 3, 5)], ids=str)
def test_empty_batch(kind, shape, dtype):
    """M = 0 rows: an empty output of the same shape, empty input gradient, zero parameter grads."""
    n = shape[-1]
    x = torch.empty(shape, dtype=dtype, requires_grad=True)
    w = torch.ones(n, dtype=dtype, requires_grad=True) if kind != "ada" else None
    y = run_ours(kind, x, n, w, None, {})
    assert y.shape == shape and y.dtype == dtype
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == shape
    if w is not None:
        assert w.grad is not None and torch.count_nonzero(w.grad) == 0


@pytest.mark.parametrize("kind", ["layer", "rms", "ada"])
@pytest.mark.parametrize(
    ("x_shape", "normalized_shape"),
    [((5,), (5,)), ((3, 4, 5), (4, 5)), ((2, 3, 4, 5), (3, 4, 5)), ((2, 1, 3, 2, 5), (2, 5))],
    ids=str,
)
def test_any_rank_and_multi_dim_normalized_shape(kind, x_shape, normalized_shape):
    """Statistics cover all trailing normalized dims at once (not the last dim only)."""
    x = make_x(x_shape, torch.float64, requires_grad=True)
    xr = upcast(x)
    w = make_param(normalized_shape, torch.float64, center=1.0, requires_grad=True)
    wr = upcast(w)
    use_w = kind != "ada"
    y = run_ours(kind, x, normalized_shape, w if use_w else None, None, {})
    yr = run_reference(kind, xr, normalized_shape, wr if use_w else None, None, {})
    assert y.shape == x.shape
    assert_close(y, yr, TOLERANCES_FWD[torch.float64], "output")
    dy = torch.randn_like(y)
    y.backward(dy)
    yr.backward(dy)
    assert_close(x.grad, xr.grad, TOLERANCES_BWD[torch.float64]["dx"], "dx")
    if use_w:
        assert w.grad.shape == normalized_shape
        assert_close(w.grad, wr.grad, TOLERANCES_BWD[torch.float64]["dparam"], "dweight")


@pytest.mark.parametrize("normalized_shape", [7, (7,), [7], torch.Size([7])], ids=repr)
def test_normalized_shape_forms(normalized_shape):
    x = make_x((3, 7))
    expected = layernorm.layer_norm(x, (7,))
    torch.testing.assert_close(layernorm.layer_norm(x, normalized_shape), expected)
    torch.testing.assert_close(layernorm.rms_norm(x, normalized_shape), layernorm.rms_norm(x, 7))


def test_batch_size_one_is_per_example():
    """One example normalized alone gives the same result as inside a batch (no batch coupling)."""
    x = make_x((5, 33))
    full = layernorm.layer_norm(x, 33)
    for i in range(5):
        torch.testing.assert_close(layernorm.layer_norm(x[i : i + 1], 33), full[i : i + 1])
        torch.testing.assert_close(layernorm.layer_norm(x[i], 33), full[i])


# ---------------------------------------------------------------------------------------------
# Non-finite values and degenerate rows


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["layer", "rms", "ada"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_stays_in_its_row(kind, bad, dtype):
    x = make_x((4, 9), dtype).requires_grad_()
    with torch.no_grad():
        x[2, 3] = bad
    y = run_ours(kind, x, 9, None, None, {})
    assert not torch.isfinite(y[2]).all(), "a NaN/Inf row must not come out finite"
    rows = [0, 1, 3]
    assert torch.isfinite(y[rows]).all()
    clean = run_ours(kind, x.detach()[rows], 9, None, None, {})
    torch.testing.assert_close(y[rows], clean)
    y.backward(torch.ones_like(y))
    assert torch.isfinite(x.grad[rows]).all()


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("value", [0.0, 1.5, -300.0])
def test_constant_row_gives_bias(dtype, value):
    """σ = 0: the centered row is 0, so the output is exactly the bias, finite, no NaN from 0/0."""
    x = torch.full((3, 19), value, dtype=dtype, requires_grad=True)
    w = make_param((19,), dtype, center=1.0)
    b = make_param((19,), dtype, center=0.0)
    y = layernorm.layer_norm(x, 19, w, b)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, b.expand_as(y), atol=TOLERANCES_FWD[dtype][0], rtol=0)
    y.backward(torch.randn_like(y))
    assert torch.isfinite(x.grad).all()
    # Without a bias LN-simple and AdaNorm give zeros.
    assert torch.count_nonzero(layernorm.layer_norm(x, 19)) == 0
    assert torch.count_nonzero(layernorm.ada_norm(x, 19)) == 0


# ---------------------------------------------------------------------------------------------
# Gradients: gradcheck in float64


def _gc_inputs(shape=(2, 2, 4), nshape=(2, 4)):
    x = make_x(shape, torch.float64, requires_grad=True)
    w = make_param(nshape, torch.float64, center=1.0, requires_grad=True)
    b = make_param(nshape, torch.float64, center=0.0, requires_grad=True)
    return x, w, b, nshape


@pytest.mark.parametrize(
    ("use_w", "use_b"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_gradcheck_layer_norm(use_w, use_b):
    x, w, b, ns = _gc_inputs()
    args = [x] + ([w] if use_w else []) + ([b] if use_b else [])

    def f(x, *p):
        it = iter(p)
        return layernorm.layer_norm(x, ns, next(it) if use_w else None, next(it) if use_b else None)

    assert gradcheck(f, tuple(args))
    assert gradgradcheck(f, tuple(args))


@pytest.mark.parametrize("use_w", [False, True])
def test_gradcheck_rms_norm(use_w):
    x, w, _, ns = _gc_inputs()
    args = (x, w) if use_w else (x,)

    def f(x, *p):
        return layernorm.rms_norm(x, ns, p[0] if p else None, eps=1e-6)

    assert gradcheck(f, args)
    assert gradgradcheck(f, args)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_double_backward_of_two_norms_sharing_their_parameters(kind):
    """The second norm's input was made with the same gain (and bias). Under
    ``create_graph=True`` the backward differentiates the reference at aliases of its inputs, so
    the first norm's share of the gain's gradient is counted once (taken at the inputs
    themselves, it was counted twice): first and second derivatives are torch's."""
    x, w, b, ns = _gc_inputs((4, 6), (6,))  # a row's parameters taken as they are, unflattened
    F = torch.nn.functional

    def ours(x, w, b):
        if kind == "rms_norm":
            return layernorm.rms_norm(layernorm.rms_norm(x, ns, w) + b, ns, w)
        return layernorm.layer_norm(layernorm.layer_norm(x, ns, w, b), ns, w, b)

    def torchs(x, w, b):
        if kind == "rms_norm":
            return F.rms_norm(F.rms_norm(x, ns, w) + b, ns, w)
        return F.layer_norm(F.layer_norm(x, ns, w, b), ns, w, b)

    def derivatives(f):
        y = f(x, w, b)
        weights = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)
        first = torch.autograd.grad((y * weights).sum(), (x, w, b), create_graph=True)
        mix = sum((g * torch.cos(torch.arange(g.numel(), dtype=g.dtype)).view_as(g)).sum()
                  for g in first)  # fmt: skip
        return [*first, *torch.autograd.grad(mix, (x, w, b))]

    for a, e in zip(derivatives(ours), derivatives(torchs), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", ["layer_norm", "detach_mean", "rms_norm", "ada_norm"], ids=str)
def test_batched_backward_is_the_one_by_one_jacobian(kind):
    """``jacobian(..., vectorize=True)`` runs the backward once on batched output gradients,
    which have no memory of their own for a kernel to read (it raised "Cannot access data
    pointer"): the backward then differentiates the reference, and the jacobian is the one
    taken row by row."""
    x, w, b, ns = _gc_inputs((4, 6), (6,))
    x = x.detach()

    def f(x):
        if kind == "rms_norm":
            return layernorm.rms_norm(x, ns, w.detach())
        if kind == "ada_norm":
            return layernorm.ada_norm(x, ns)
        return layernorm.layer_norm(
            x, ns, w.detach(), b.detach(), detach_mean=kind == "detach_mean"
        )

    batched = torch.autograd.functional.jacobian(f, x, vectorize=True)
    one_by_one = torch.autograd.functional.jacobian(f, x)
    torch.testing.assert_close(batched, one_by_one, rtol=1e-12, atol=1e-12)


def test_gradcheck_ada_norm_frozen_phi():
    """AdaNorm's gradient is, by design, not the derivative of its forward: φ(y) is a constant.

    Honest check: at x0 the op's gradient equals the true derivative of x ↦ φ(y(x0)) ⊙ y(x). The
    function below has the *value* of that frozen formulation (ours − ours.detach() is exactly 0)
    and the *autograd graph* of our op, so gradcheck compares our analytic backward with finite
    differences of the frozen formulation.
    """
    x0, _, _, ns = _gc_inputs()
    phi0 = (2.0 * (1 - 0.3 * layer_norm_reference(x0.detach(), ns))).detach()

    def f(x):
        ours = layernorm.ada_norm(x, ns, k=0.3, scale=2.0)
        frozen = phi0 * layer_norm_reference(x, ns)
        return ours - ours.detach() + frozen.detach()

    assert gradcheck(f, (x0,))
    # And plain gradcheck of the op must fail: otherwise φ(y) was not detached at all.
    assert not gradcheck(
        lambda x: layernorm.ada_norm(x, ns, k=0.3, scale=2.0), (x0,), raise_exception=False
    )


@pytest.mark.parametrize(
    ("detach_mean", "detach_std"), [(True, False), (False, True), (True, True)]
)
@pytest.mark.parametrize("affine", [False, True])
def test_gradcheck_detach_norm_frozen_statistics(detach_mean, detach_std, affine):
    """DetachNorm: the op's gradient at x0 is the true derivative of LN with the detached
    statistics frozen at their x0 values, e.g. x ↦ (x − μ(x0)) / σ(x) for detach_mean."""
    x0, w0, b0, ns = _gc_inputs()
    dims = (-2, -1)
    mu0 = x0.detach().mean(dims, keepdim=True)
    sigma0 = torch.sqrt(x0.detach().var(dims, unbiased=False, keepdim=True) + 1e-5)

    def frozen(x, w, b):
        mu = mu0 if detach_mean else x.mean(dims, keepdim=True)
        var = x.var(dims, unbiased=False, keepdim=True)
        sigma = sigma0 if detach_std else torch.sqrt(var + 1e-5)
        y = (x - mu) / sigma
        return y * w + b if affine else y

    def f(x, w, b):
        ours = layernorm.layer_norm(
            x, ns, w if affine else None, b if affine else None,
            detach_mean=detach_mean, detach_std=detach_std,
        )  # fmt: skip
        return ours - ours.detach() + frozen(x, w, b).detach()

    args = (x0, w0, b0) if affine else (x0, w0.detach(), b0.detach())
    assert gradcheck(f, args)
    plain = lambda x: layernorm.layer_norm(  # noqa: E731
        x, ns, detach_mean=detach_mean, detach_std=detach_std
    )
    assert not gradcheck(plain, (x0,), raise_exception=False), "detach flags changed nothing"


@pytest.mark.parametrize(
    ("detach_mean", "detach_std"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_detach_flags_keep_forward(detach_mean, detach_std):
    x = make_x((4, 31))
    w = make_param((31,), torch.float32, center=1.0)
    b = make_param((31,), torch.float32, center=0.0)
    y = layernorm.layer_norm(x, 31, w, b, detach_mean=detach_mean, detach_std=detach_std)
    assert torch.equal(y, layernorm.layer_norm(x, 31, w, b))


@pytest.mark.parametrize("variant", ["detach_mean", "detach_std", "detach_both", "ada"])
def test_double_backward_of_detached_ops_follows_reference(variant):
    """create_graph=True uses the reference composite: second derivatives match autograd of the
    detach()-based definitions (gradgradcheck cannot apply, the first derivative is not exact)."""
    kind, use_w, use_b, opts = VARIANTS[variant]
    x = make_x((3, 6), torch.float64, requires_grad=True)
    xr = upcast(x)
    w = make_param((6,), torch.float64, center=1.0) if use_w else None
    b = make_param((6,), torch.float64, center=0.0) if use_b else None
    v = torch.randn(3, 6, dtype=torch.float64)
    (g,) = torch.autograd.grad(run_ours(kind, x, 6, w, b, opts), x, v, create_graph=True)
    (gr,) = torch.autograd.grad(run_reference(kind, xr, 6, w, b, opts), xr, v, create_graph=True)
    assert_close(g, gr, (1e-10, 1e-10), "first derivative")
    # With σ detached the first derivative does not depend on x at all; then neither may ours.
    assert g.requires_grad == gr.requires_grad
    if gr.requires_grad:
        (gg,) = torch.autograd.grad(g.pow(2).sum(), x)
        (ggr,) = torch.autograd.grad(gr.pow(2).sum(), xr)
        assert_close(gg, ggr, (1e-9, 1e-9), "second derivative")


def test_ada_norm_formula():
    """z = C·(1 − k·y) ⊙ y with y the LN-simple output, written out by hand."""
    x = make_x((5, 12), torch.float64)
    mu = x.mean(-1, keepdim=True)
    y = (x - mu) / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + 1e-5)
    z = layernorm.ada_norm(x, 12, k=0.25, scale=1.5)
    torch.testing.assert_close(z, 1.5 * (1 - 0.25 * y) * y, atol=1e-12, rtol=1e-12)
    # dz/dx with φ detached is LN-simple's backward of dz ⊙ φ(y)
    xg = x.clone().requires_grad_()
    dz = torch.randn_like(x)
    layernorm.ada_norm(xg, 12, k=0.25, scale=1.5).backward(dz)
    xl = x.clone().requires_grad_()
    layernorm.layer_norm(xl, 12).backward(dz * 1.5 * (1 - 0.25 * y))
    torch.testing.assert_close(xg.grad, xl.grad, atol=1e-12, rtol=1e-12)


def test_layer_norm_formula_biased_variance_eps_inside_root():
    x = make_x((4, 9), torch.float64)
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)  # biased, 1/N
    for eps in (1e-5, 0.5):
        expected = (x - mu) / torch.sqrt(var + eps)
        torch.testing.assert_close(layernorm.layer_norm(x, 9, eps=eps), expected)


@pytest.mark.parametrize(
    "needs",
    [(True, False, False), (False, True, False), (False, False, True), (False, True, True)],
    ids=lambda t: "".join("xwb"[i] for i, n in enumerate(t) if n),
)
@pytest.mark.parametrize(
    ("detach_mean", "detach_std"), [(False, False), (True, False), (True, True)]
)
def test_partial_requires_grad(needs, detach_mean, detach_std):
    """Only the gradients asked for are computed, and they are right (the others may be skipped)."""
    x = make_x((5, 7), torch.float64).requires_grad_(needs[0])
    w = make_param((7,), torch.float64, center=1.0).requires_grad_(needs[1])
    b = make_param((7,), torch.float64, center=0.0).requires_grad_(needs[2])
    leaves = [t for t in (x, w, b) if t.requires_grad]
    dy = torch.randn(5, 7, dtype=torch.float64)
    opts = {"detach_mean": detach_mean, "detach_std": detach_std}
    grads = torch.autograd.grad(layernorm.layer_norm(x, 7, w, b, **opts), leaves, dy)
    ref = torch.autograd.grad(layer_norm_reference(x, (7,), w, b, **opts), leaves, dy)
    for g, r in zip(grads, ref, strict=True):
        assert_close(g, r, TOLERANCES_BWD[torch.float64]["dx"], "gradient")
    if not needs[0]:  # RMSNorm too: weight gradient alone
        (gw,) = torch.autograd.grad(layernorm.rms_norm(x, 7, w.requires_grad_()), [w], dy)
        (rw,) = torch.autograd.grad(rms_norm_reference(x, (7,), w), [w], dy)
        assert_close(gw, rw, TOLERANCES_BWD[torch.float64]["dx"], "rms dweight")


# torch.func transforms: grad/vjp/jacrev reject the custom ops' generated autograd.Function,
# jvp/jacfwd would get zero tangents from it and vmap would loop over the examples, so the ops run
# their reference there. Each transform must give the derivatives autograd gives on the kernels.
FUNC_OPS = {
    "layer_norm": lambda x, w, b: layernorm.layer_norm(x, (3, 5), w, b),
    "detach_mean": lambda x, w, b: layernorm.layer_norm(x, (3, 5), w, b, detach_mean=True),
    "detach_std": lambda x, w, b: layernorm.layer_norm(x, (3, 5), w, b, detach_std=True),
    "rms_norm": lambda x, w, b: layernorm.rms_norm(x, (3, 5), w, eps=1e-5) + b,
    "ada_norm": lambda x, w, b: layernorm.ada_norm(x, (3, 5), k=0.2, scale=1.5) * w + b,
}


@pytest.mark.parametrize("op", list(FUNC_OPS))
def test_torch_func_grad_jacrev_vmap(op):
    fn = FUNC_OPS[op]
    x = make_x((4, 3, 5), torch.float64)
    w = make_param((3, 5), torch.float64, center=1.0)
    b = make_param((3, 5), torch.float64, center=0.0)

    def loss(x, w, b):
        return (fn(x, w, b) ** 3).sum()

    xs, ws, bs = (t.detach().requires_grad_() for t in (x, w, b))
    expected = torch.autograd.grad(loss(xs, ws, bs), (xs, ws, bs))
    got = torch.func.grad(loss, argnums=(0, 1, 2))(x, w, b)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-10, rtol=1e-10)
    # per-example gradients: vmap over grad
    per_ex = torch.func.vmap(torch.func.grad(loss, argnums=1), in_dims=(0, None, None))(x, w, b)
    torch.testing.assert_close(per_ex.sum(0), expected[1], atol=1e-10, rtol=1e-10)
    # jacrev and jacfwd (forward mode: it used to give zeros without a word) agree with the
    # jacobian of torch.autograd on the kernels' analytic backward (detached terms included)
    ja = torch.autograd.functional.jacobian(lambda x: fn(x, w, b), x[0])
    assert ja.abs().max() > 0.1
    for jac in (torch.func.jacrev, torch.func.jacfwd):
        torch.testing.assert_close(jac(lambda x: fn(x, w, b))(x[0]), ja, atol=1e-10, rtol=1e-10)
    # forward-mode AD with dual tensors: the tangent is the jacobian-vector product
    t = torch.randn_like(x[0])
    with torch.autograd.forward_ad.dual_level():
        y = fn(torch.autograd.forward_ad.make_dual(x[0], t), w, b)
        tangent = torch.autograd.forward_ad.unpack_dual(y).tangent
    expected_t = (ja.reshape(15, 15) @ t.reshape(15)).reshape(3, 5)
    torch.testing.assert_close(tangent, expected_t, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_torch_func_grad_half_inputs(dtype):
    # the reference path keeps the kernels' dtype contract: float32 statistics, output in x's dtype
    m = layernorm.LayerNorm(16)
    x = make_x((6, 16), dtype)
    y_eager = m(x)
    params = dict(m.named_parameters())

    def f(p, x):
        y = torch.func.functional_call(m, p, (x,))
        assert y.dtype == dtype
        return y.float().pow(2).sum()

    grads = torch.func.grad(f)(params, x)
    xs = x.detach()
    m.zero_grad()
    f(params, xs).backward()
    for name, p in params.items():
        assert grads[name].dtype == torch.float32
        tol = TOLERANCES_FWD[dtype][0] * 16 * x.shape[0]
        torch.testing.assert_close(grads[name], p.grad, atol=tol, rtol=TOLERANCES_FWD[dtype][1])
    assert y_eager.dtype == dtype


@pytest.mark.parametrize("op", list(FUNC_OPS))
def test_vmap_batches_without_a_per_example_fallback(op, monkeypatch):
    # ensembles (torch.func.stack_module_state + vmap) give each model its own gain and bias
    fn = FUNC_OPS[op]
    x = make_x((4, 2, 3, 5), torch.float64)
    calls = []
    for mod in (ln_ops, rms_ops, ada_ops):
        real = mod.backend_module
        monkeypatch.setattr(
            mod, "backend_module", lambda t, fam, real=real: calls.append(fam) or real(t, fam)
        )
    w = torch.stack([make_param((3, 5), torch.float64, center=1.0) for _ in range(4)])
    b = torch.stack([make_param((3, 5), torch.float64, center=0.0) for _ in range(4)])
    got = torch.func.vmap(fn)(x, w, b)
    shared = torch.func.vmap(fn, in_dims=(0, None, None))(x, w[0], b[0])
    # no batching rule for the custom ops: they would run once per example
    assert calls == []
    expected = torch.stack([fn(x[i], w[i], b[i]) for i in range(4)])
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(shared, fn(x, w[0], b[0]), atol=1e-12, rtol=1e-12)


class _Wrapped(torch.Tensor):
    """A tensor subclass that overrides torch functions (as tensor-parallel and tracing wrappers
    do): the lean path must not call a kernel on it directly."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


_LEAN_OPS = {
    "layer_norm": lambda x, w, b: layernorm.layer_norm(x, (x.shape[-1],), w, b),
    "detach_norm": lambda x, w, b: layernorm.layer_norm(x, (x.shape[-1],), w, b, detach_std=True),
    "rms_norm": lambda x, w, b: layernorm.rms_norm(x, (x.shape[-1],), w),
    "ada_norm": lambda x, w, b: layernorm.ada_norm(x, (x.shape[-1],), 0.1, 2),
}


@pytest.mark.parametrize("op", list(_LEAN_OPS))
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_plain_calls_skip_the_full_checks(monkeypatch, op, grad):
    """A plain CPU tensor with parameters of the right shape goes straight to the rows' eager path
    (no full checks), with or without gradients, and gives the full path's values and gradients;
    an input or a gain of a tensor subclass takes the full path."""
    from layernorm import functional

    x = make_x((3, 2, 8), torch.float32, requires_grad=grad)
    w = make_param((8,), torch.float32, center=1.0, requires_grad=grad)
    b = make_param((8,), torch.float32, center=0.0, requires_grad=grad)
    calls = []
    check_input = functional.check_input
    monkeypatch.setattr(functional, "check_input", lambda *a: calls.append(a[2]) or check_input(*a))
    y = _LEAN_OPS[op](x, w, b)
    assert calls == []
    lean_grads = torch.autograd.grad(y.sum(), (x, w, b), allow_unused=True) if grad else ()
    full = _LEAN_OPS[op](x.as_subclass(_Wrapped), w, b)
    assert len(calls) == 1
    torch.testing.assert_close(full.as_subclass(torch.Tensor), y, rtol=0, atol=0)
    if grad:
        xs = x.detach().as_subclass(_Wrapped).requires_grad_()
        full_grads = torch.autograd.grad(
            _LEAN_OPS[op](xs, w, b).sum(), (xs, w, b), allow_unused=True
        )
        for lean, ref in zip(lean_grads, full_grads, strict=True):
            if lean is None or ref is None:
                assert lean is None and ref is None
            else:
                torch.testing.assert_close(ref.as_subclass(torch.Tensor), lean, rtol=0, atol=0)
    if op != "ada_norm":
        calls.clear()
        _LEAN_OPS[op](x, w.as_subclass(_Wrapped), b)
        assert calls == [op.replace("detach_norm", "layer_norm")]
