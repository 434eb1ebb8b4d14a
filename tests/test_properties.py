"""Property tests: random shapes, scales up to 1e4 and offsets, plus the invariances of Table 1 of
the LN paper (and the RMSNorm row, from Zhang & Sennrich 2019)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import layernorm
from layernorm.reference import ada_norm_reference, layer_norm_reference, rms_norm_reference

# Statistics in float32 lose |μ|/σ · 2⁻²⁴ relative precision to cancellation in x − μ; this atol
# is per unit of that condition number (a few ulps, ~30× headroom).
F32_ATOL_PER_COND = 2e-6


@st.composite
def rows(draw, max_m=6, max_n=96):
    """A random (M, N) input: log-uniform scale in [1e-2, 1e4], offset up to 100× the scale."""
    m = draw(st.integers(1, max_m))
    n = draw(st.integers(1, max_n))
    log_scale = draw(st.floats(-2.0, 4.0))
    rel_offset = draw(st.floats(-100.0, 100.0))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    scale = 10.0**log_scale
    x = torch.randn(m, n, generator=g, dtype=torch.float64) * scale + rel_offset * scale
    return x


def _cond(x64: torch.Tensor, eps: float) -> float:
    """max over rows of max(1, |μ|/σ): how much the float32 centering can lose."""
    mu = x64.mean(-1).abs()
    sigma = torch.sqrt(x64.var(-1, unbiased=False) + eps)
    return max(1.0, (mu / sigma).max().item())


@given(
    x=rows(),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    affine=st.booleans(),
)
def test_layer_norm_random_inputs_match_reference(x, dtype, affine):
    xd = x.to(dtype)
    n = x.shape[-1]
    w = torch.linspace(0.5, 1.5, n, dtype=dtype) if affine else None
    b = torch.linspace(-1.0, 1.0, n, dtype=dtype) if affine else None
    y = layernorm.layer_norm(xd, n, w, b)
    ref = layer_norm_reference(xd.double(), (n,), None if w is None else w.double(),
                               None if b is None else b.double())  # fmt: skip
    if dtype == torch.float64:
        atol, rtol = 1e-10, 1e-10
    else:  # float32 statistics (also for bfloat16), then bfloat16's half-ulp 2⁻⁸ output rounding
        atol = F32_ATOL_PER_COND * _cond(xd.double(), 1e-5)
        rtol = 1e-5
        if dtype == torch.bfloat16:
            atol, rtol = atol + 8e-3, 8e-3
    torch.testing.assert_close(y.double(), ref, atol=atol, rtol=rtol)
    assert torch.isfinite(y).all()


@given(x=rows(), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_rms_and_ada_random_inputs_match_reference(x, dtype):
    xd = x.to(dtype)
    n = x.shape[-1]
    y = layernorm.rms_norm(xd, n, eps=1e-6)
    ref = rms_norm_reference(xd.double(), (n,), eps=1e-6)
    # no centering, so no cancellation: a few ulps of |y| ≤ √N
    atol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(y.double(), ref, atol=atol, rtol=1e-5)
    z = layernorm.ada_norm(xd, n, k=0.1, scale=2.0)
    zref = ada_norm_reference(xd.double(), (n,), 0.1, 2.0)
    # |z| ≤ C(|y| + k·y²) and y carries the LN error above; y² doubles its relative error
    atol = 1e-10 if dtype == torch.float64 else 4 * F32_ATOL_PER_COND * _cond(xd.double(), 1e-5)
    torch.testing.assert_close(z.double(), zref, atol=atol * math.sqrt(n), rtol=1e-5)


@given(x=rows(max_n=64))
def test_layer_norm_output_statistics(x):
    """Each LN-simple row has mean 0 and biased variance σ²/(σ² + eps) (1 unless σ² ≲ eps)."""
    n = x.shape[-1]
    y = layernorm.layer_norm(x, n)
    var = x.var(-1, unbiased=False)
    torch.testing.assert_close(y.mean(-1), torch.zeros_like(var), atol=1e-9, rtol=0)
    torch.testing.assert_close(y.var(-1, unbiased=False), var / (var + 1e-5), atol=1e-9, rtol=1e-9)
    r = layernorm.rms_norm(x, n, eps=1e-12)
    ms = (x * x).mean(-1)
    torch.testing.assert_close((r * r).mean(-1), ms / (ms + 1e-12), atol=1e-9, rtol=1e-9)


@given(x=rows(max_n=48), log_delta=st.floats(-3.0, 3.0), shift=st.floats(-1e4, 1e4))
def test_layer_norm_invariant_to_rescaling_and_recentering_a_case(x, log_delta, shift):
    """Table 1: LN is invariant to re-scaling a single case, x ↦ δx, and to adding the same
    constant to all of its units (what weight-matrix re-centering does). eps breaks exactness by
    a relative eps/σ², so it is taken tiny here."""
    n = x.shape[-1]
    if n < 2:
        return
    eps = 1e-30
    delta = 10.0**log_delta
    y = layernorm.layer_norm(x, n, eps=eps)
    # float64 cancellation in x − μ: relative 2⁻⁵³·(|μ| + |shift|)/σ, with 100× headroom
    spread = x.std(-1, unbiased=False).min().item()
    atol = 1e-13 * (x.abs().max().item() + abs(shift)) / spread + 1e-12
    torch.testing.assert_close(layernorm.layer_norm(delta * x, n, eps=eps), y, atol=atol, rtol=0)
    torch.testing.assert_close(layernorm.layer_norm(x + shift, n, eps=eps), y, atol=atol, rtol=0)
    # RMSNorm is invariant to the re-scaling as well
    r = layernorm.rms_norm(x, n, eps=eps)
    torch.testing.assert_close(layernorm.rms_norm(delta * x, n, eps=eps), r, atol=1e-12, rtol=0)


@given(x=rows(max_n=48), k=st.floats(1.0, 1e4))
def test_rms_norm_not_invariant_to_recentering(x, k):
    """Shifting a zero-mean row by c with |c| ≥ σ moves RMSNorm's row mean from 0 to
    c/√(σ² + c²), at least 1/√2 in size; LN's output does not move at all."""
    n = x.shape[-1]
    if n < 2:
        return
    centered = x - x.mean(-1, keepdim=True)
    sigma = centered.std(-1, unbiased=False, keepdim=True)
    if (sigma == 0).any():
        return
    shifted = centered + k * sigma
    moved = layernorm.rms_norm(shifted, n, eps=1e-30).mean(-1)
    assert (moved.abs() >= 1 / math.sqrt(2) - 1e-9).all()
    assert layernorm.rms_norm(centered, n, eps=1e-30).mean(-1).abs().max() < 1e-9
    torch.testing.assert_close(
        layernorm.layer_norm(shifted, n, eps=1e-30), layernorm.layer_norm(centered, n, eps=1e-30)
    )


@given(x=rows(max_n=40))
def test_layer_norm_gradient_orthogonal_to_invariances(x):
    """Invariance to x ↦ x + c·1 and x ↦ δx makes the input gradient orthogonal to 1 and to x
    (up to eps); DetachNorm's detached μ breaks the first."""
    n = x.shape[-1]
    if n < 3 or (x.std(-1) < 1e-3 * x.abs().max(-1).values).any():
        return
    x = x.clone().requires_grad_()
    dy = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    layernorm.layer_norm(x, n, eps=1e-30).backward(dy)
    g = x.grad
    # Rounding error of g is relative to the terms that cancel in it, rstd·|dy|, not to g itself
    # (g can be ~1e-16 when dy is nearly parallel to the invariant directions).
    rstd = 1.0 / x.detach().std(-1, unbiased=False, keepdim=True)
    floor = 1e-12 * (rstd * dy.abs()).sum(-1, keepdim=True)
    assert (g.sum(-1, keepdim=True).abs() <= 1e-9 * g.abs().sum(-1, keepdim=True) + floor).all()
    proj_floor = floor * x.detach().abs().amax(-1, keepdim=True)
    proj = (g * x.detach()).sum(-1, keepdim=True).abs()
    assert (proj <= 1e-9 * (g.abs() * x.detach().abs()).sum(-1, keepdim=True) + proj_floor).all()
    x.grad = None
    layernorm.layer_norm(x, n, eps=1e-30, detach_mean=True).backward(dy)
    assert x.grad.sum(-1).abs().max() > 1e-6 * x.grad.abs().sum(-1).max()


# ---------------------------------------------------------------------------------------------
# Table 1 of the LN paper, for one summed-input layer a = W h, normalized per training case.


def _unit_scaling(W, h, gamma):
    W2 = W.clone()
    W2[0] *= 3.0  # w_i' = δ_i·w_i for one unit
    return W2, h


def _one_case_scaling(W, h, gamma):
    h2 = h.clone()
    h2[1] *= 7.0  # x_n' = δ_n·x_n for one training case
    return W, h2


# name: (transform (W, h, γ) -> (W', h'), LN invariant?, RMSNorm invariant?)
INVARIANCES = {
    "weight matrix re-scaling": (lambda W, h, g: (2.5 * W, h), True, True),
    # W' = W + 1γᵀ: every unit's incoming weights shifted by the same γ, so a' = a + (γᵀh)·1
    "weight matrix re-centering": (lambda W, h, g: (W + g.view(1, -1), h), True, False),
    "weight vector re-scaling": (_unit_scaling, False, False),
    "dataset re-scaling": (lambda W, h, g: (W, 2.5 * h), True, True),
    # x' = x + γ for all cases: a' = a + Wγ, not a constant across units
    "dataset re-centering": (lambda W, h, g: (W, h + g.view(1, -1)), False, False),
    "single case re-scaling": (_one_case_scaling, True, True),
}


@pytest.mark.parametrize("name", list(INVARIANCES))
def test_invariance_table(name):
    """Table 1 of the LN paper for one layer a = W h normalized per case, with the RMSNorm row."""
    g = torch.Generator().manual_seed(3)
    hidden, inputs = 12, 9
    W = torch.randn(hidden, inputs, dtype=torch.float64, generator=g)
    h = torch.randn(4, inputs, dtype=torch.float64, generator=g) + 0.5
    gamma = torch.randn(inputs, dtype=torch.float64, generator=g) * 2 + 1
    transform, ln_invariant, rms_invariant = INVARIANCES[name]
    W2, h2 = transform(W, h, gamma)
    a, a2 = h @ W.T, h2 @ W2.T
    for fn, invariant in (
        (lambda t: layernorm.layer_norm(t, hidden, eps=1e-30), ln_invariant),
        (lambda t: layernorm.rms_norm(t, hidden, eps=1e-30), rms_invariant),
    ):
        diff = (fn(a) - fn(a2)).abs().max().item()
        if invariant:
            assert diff < 1e-12, f"{name}: should be invariant, changed by {diff}"
        else:
            assert diff > 1e-2, f"{name}: should not be invariant, changed by only {diff}"
