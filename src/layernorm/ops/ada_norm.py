"""``layernorm::ada_norm_fwd`` / ``ada_norm_bwd``: AdaNorm (Xu et al. 2019) as custom ops.

Saves ``x`` and the per-row ``mean``/``rstd``; double backward differentiates the reference.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from .._validation import stats_dtype
from ..kernels.cpu import ada_norm as cpu_ada_norm
from ..kernels.cpu import torch_ops
from ..reference import ada_norm_reference
from . import _checks, _reference_grads  # noqa: F401 (the C++ nodes' double backward)
from ._dispatch import (
    backend_module,
    in_stats_dtype,
    needs_grad,
    needs_reference,
    plain_eager,
    reference_backward,
)


@torch.library.custom_op("layernorm::ada_norm_fwd", mutates_args=())
def ada_norm_fwd(x: Tensor, k: float, scale: float, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of 2-D ``x`` → ``(z, mean, rstd)``."""
    op = "layernorm::ada_norm_fwd"
    _checks.rows(op, x)
    _checks.finite(op, "k", k)
    _checks.finite(op, "scale", scale)
    _checks.eps(op, eps)
    return backend_module(x, "ada_norm").ada_norm_fwd(x, k, scale, eps)


@ada_norm_fwd.register_fake
def _(x, k, scale, eps):
    m, sdt = x.shape[0], stats_dtype(x.dtype)
    return torch.empty_like(x), x.new_empty((m,), dtype=sdt), x.new_empty((m,), dtype=sdt)


@torch.library.custom_op("layernorm::ada_norm_bwd", mutates_args=())
def ada_norm_bwd(
    dz: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, k: float, scale: float
) -> Tensor:
    """``dx`` of AdaNorm with φ(y) held constant."""
    op = "layernorm::ada_norm_bwd"
    _checks.rows(op, x)
    _checks.grad(op, "dz", dz, x)
    _checks.stats(op, "mean", mean, x)
    _checks.stats(op, "rstd", rstd, x)
    _checks.finite(op, "k", k)
    _checks.finite(op, "scale", scale)
    return backend_module(x, "ada_norm").ada_norm_bwd(dz.contiguous(), x, mean, rstd, k, scale)


@ada_norm_bwd.register_fake
def _(dz, x, mean, rstd, k, scale):
    return torch.empty_like(x)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, k, scale, eps = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, mean, rstd)
    ctx.k, ctx.scale, ctx.eps = k, scale, eps
    ctx.mark_non_differentiable(mean, rstd)


def _backward(ctx: Any, dz: Tensor, _dmean: Tensor, _drstd: Tensor):
    x, mean, rstd = ctx.saved_tensors
    if reference_backward(dz):  # create_graph=True, or batched: a composite
        return reference_grads(dz, x, ctx.k, ctx.scale, ctx.eps), None, None, None
    return ada_norm_bwd(dz, x, mean, rstd, ctx.k, ctx.scale), None, None, None


def reference_grads(dz: Tensor, x: Tensor, k: float, scale: float, eps: float) -> Tensor:
    """The gradient of ``x``, by differentiating the reference with ``create_graph=True`` (see
    :func:`layernorm.ops.layer_norm.reference_grads`)."""
    with torch.enable_grad():
        z = ada_norm_reference(x, (x.shape[-1],), k, scale, eps)
        (dx,) = torch.autograd.grad(z, x, dz, create_graph=True)
    return dx


torch.library.register_autograd("layernorm::ada_norm_fwd", _backward, setup_context=_setup_context)


class _AdaNormEager(torch.autograd.Function):
    """The same backend kernels and backward as the custom op, minus its dispatch cost (eager)."""

    @staticmethod
    def forward(ctx: Any, x, k, scale, eps, kernels):  # type: ignore[override]
        z, mean, rstd = kernels.ada_norm_fwd(x, k, scale, eps, for_backward=True)
        ctx.save_for_backward(x, mean, rstd)
        ctx.k, ctx.scale, ctx.eps = k, scale, eps
        ctx.kernels = kernels  # the backward's, without choosing them again
        return z

    @staticmethod
    def backward(ctx: Any, dz: Tensor):  # type: ignore[override]
        x, mean, rstd = ctx.saved_tensors
        if reference_backward(dz):
            return (*_backward(ctx, dz, None, None), None)  # type: ignore[arg-type]
        dx = ctx.kernels.ada_norm_bwd(dz.contiguous(), x, mean, rstd, ctx.k, ctx.scale)
        return dx, None, None, None, None


def ada_norm_rows(x: Tensor, k: float, scale: float, eps: float) -> Tensor:
    """AdaNorm of the rows of contiguous 2-D ``x``: the custom op when a tracer is active, the
    identical kernels behind a plain autograd.Function otherwise (see ``layer_norm_rows``)."""
    if plain_eager():
        return ada_norm_rows_eager(x, k, scale, eps)
    if needs_reference():
        shape = (x.shape[1],)
        return in_stats_dtype(lambda x_: ada_norm_reference(x_, shape, k, scale, eps), x)
    return ada_norm_fwd(x, k, scale, eps)[0]


def ada_norm_rows_eager(
    x: Tensor, k: float, scale: float, eps: float, kernels: ModuleType | None = None
) -> Tensor:
    """:func:`ada_norm_rows` where no tracer watches (the caller has made sure of it): the forward
    kernel alone where nothing needs a gradient, else the autograd.Function, unless the C++
    operator takes the call (see :func:`layernorm.ops.layer_norm.layer_norm_rows_eager`).
    ``kernels``: the backend's module, where the caller knows it."""
    if kernels is None:
        kernels = backend_module(x, "ada_norm")
    grad = needs_grad(x)
    if kernels is cpu_ada_norm and torch_ops.takes(x, grad):
        return torch_ops.ada_norm(x, k, scale, eps)
    if not grad:
        return kernels.ada_norm_fwd(x, k, scale, eps)[0]
    return _AdaNormEager.apply(x, k, scale, eps, kernels)
