"""DetachNorm as the ``adanorm`` experiment builds it (``replace_norms(..., "detach")`` on its CNN):
the forward is LN-simple's, the backward treats μ and σ as constants (Xu et al. 2019, §3)."""

from __future__ import annotations

import torch
from torch import nn

import layernorm
from layernorm.experiments.definitions.adanorm_study import build_cnn


def test_detach_norm_in_the_cnn_is_ln_simple_forward_with_constant_statistics():
    detach = [m for m in build_cnn("detach", (4, 6), 16) if isinstance(m, layernorm.LayerNorm)]
    simple = [m for m in build_cnn("simple", (4, 6), 16) if isinstance(m, layernorm.LayerNorm)]
    assert len(detach) == 3 and all(m.detach_mean and m.detach_std for m in detach)
    for d, s in zip(detach, simple, strict=True):
        shape = (5, *d.normalized_shape)  # (C, H, W) for the convolutions, (fc,) for the last
        x = (torch.randn(shape) * 3 + 2).requires_grad_()
        dy = torch.randn(shape)
        y = d(x)
        torch.testing.assert_close(y, s(x))
        (dx,) = torch.autograd.grad(y, x, dy)
        dims = tuple(range(1, x.dim()))
        sigma = torch.sqrt(x.detach().var(dims, unbiased=False, keepdim=True) + d.eps)
        torch.testing.assert_close(dx, dy / sigma)  # ∂y/∂x = 1/σ with μ, σ constant
        # and the same as detaching them by hand in the plain formula
        xr = x.detach().clone().requires_grad_()
        mu = xr.mean(dims, keepdim=True).detach()
        yr = (xr - mu) / torch.sqrt(xr.var(dims, unbiased=False, keepdim=True) + d.eps).detach()
        (dxr,) = torch.autograd.grad(yr, xr, dy)
        torch.testing.assert_close(dx, dxr)
        # LN-simple's backward differs: it projects out the mean and the radial direction
        (dxs,) = torch.autograd.grad(s(x), x, dy)
        assert not torch.allclose(dxs, dx, atol=1e-3)


def test_detach_norm_gradient_has_a_radial_part_ln_simple_has_not():
    """⟨∂L/∂W, W⟩ = 0 for a linear layer in front of LN-simple (its output does not change when
    W is scaled), but not in front of DetachNorm: the part that only grows ‖W‖."""
    torch.manual_seed(0)
    x, target = torch.randn(32, 10), torch.randn(32, 8)
    for kind, radial_zero in (("simple", True), ("detach", False)):
        lin = nn.Linear(10, 8, bias=False)
        norm = layernorm.replace_norms(nn.LayerNorm(8), kind)
        loss = ((norm(lin(x)) - target) ** 2).sum()
        (g,) = torch.autograd.grad(loss, lin.weight)
        radial = float((g * lin.weight).sum()) / float(g.norm() * lin.weight.norm())
        # eps = 1e-5 inside the square root breaks the invariance by about eps/σ², hence 1e-3
        assert (abs(radial) < 1e-3) == radial_zero and (radial_zero or abs(radial) > 0.05), radial
