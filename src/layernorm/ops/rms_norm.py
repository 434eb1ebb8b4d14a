"""``layernorm::rms_norm_fwd`` / ``rms_norm_bwd``: RMSNorm as custom ops with an analytic backward.

Saves ``x`` and the per-row ``rstd``; double backward differentiates the reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from .._validation import stats_dtype
from ..kernels.cpu import rms_norm as cpu_rms_norm
from ..kernels.cpu import torch_ops
from ..reference import rms_norm_reference
from . import _checks, _reference_grads  # noqa: F401 (the C++ nodes' double backward)
from ._dispatch import (
    aliases,
    backend_module,
    empty_like_none,
    in_stats_dtype,
    needs_grad,
    needs_reference,
    none_if_empty,
    plain_eager,
    reference_backward,
)


@torch.library.custom_op("layernorm::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: Tensor, weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    """Rows of 2-D ``x`` → ``(y, rstd)``."""
    op = "layernorm::rms_norm_fwd"
    _checks.rows(op, x)
    _checks.vector(op, "weight", weight, x)
    _checks.eps(op, eps)
    return backend_module(x, "rms_norm").rms_norm_fwd(x, weight, eps)


@rms_norm_fwd.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty((x.shape[0],), dtype=stats_dtype(x.dtype))


@torch.library.custom_op("layernorm::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(
    dy: Tensor, x: Tensor, rstd: Tensor, weight: Tensor | None, need_dx: bool, need_dw: bool
) -> tuple[Tensor, Tensor]:
    """``(dx, dweight)``; a gradient not asked for comes back as an empty tensor."""
    op = "layernorm::rms_norm_bwd"
    _checks.rows(op, x)
    _checks.grad(op, "dy", dy, x)
    _checks.stats(op, "rstd", rstd, x)
    _checks.vector(op, "weight", weight, x)
    dx, dw = backend_module(x, "rms_norm").rms_norm_bwd(
        dy.contiguous(), x, rstd, weight, need_dx, need_dw
    )
    return empty_like_none(dx, x), empty_like_none(dw, x)


@rms_norm_bwd.register_fake
def _(dy, x, rstd, weight, need_dx, need_dw):
    dx = torch.empty_like(x) if need_dx else x.new_empty(0)
    has_dw = need_dw and weight is not None
    dw = x.new_empty((x.shape[1],), dtype=weight.dtype) if has_dw else x.new_empty(0)
    return dx, dw


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, weight, eps = inputs
    _, rstd = output
    ctx.save_for_backward(x, weight, rstd)
    ctx.eps = eps
    ctx.mark_non_differentiable(rstd)


def _backward(ctx: Any, dy: Tensor, _drstd: Tensor):
    x, weight, rstd = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[:2]
    if reference_backward(dy):  # create_graph=True, or batched: a composite
        return (*reference_grads(dy, x, weight, ctx.eps, (need_dx, need_dw)), None)
    dx, dw = rms_norm_bwd(dy, x, rstd, weight, need_dx, need_dw and weight is not None)
    return none_if_empty(dx), none_if_empty(dw), None


def reference_grads(
    dy: Tensor, x: Tensor, weight: Tensor | None, eps: float, needs: Sequence[bool]
) -> tuple[Tensor | None, Tensor | None]:
    """The gradients of ``(x, weight)`` that ``needs`` asks for, by differentiating the reference
    with ``create_graph=True`` (see :func:`layernorm.ops.layer_norm.reference_grads`)."""
    with torch.enable_grad():
        x, weight = aliases(x, weight)
        wanted = [t for t, need in zip((x, weight), needs, strict=True) if need]
        y = rms_norm_reference(x, (x.shape[-1],), weight, eps)
        grads = iter(torch.autograd.grad(y, wanted, dy, create_graph=True, allow_unused=True))
    dx, dw = (next(grads) if need else None for need in needs)
    return dx, dw


torch.library.register_autograd("layernorm::rms_norm_fwd", _backward, setup_context=_setup_context)


class _RMSNormEager(torch.autograd.Function):
    """The same backend kernels and backward as the custom op, minus its dispatch cost (eager)."""

    @staticmethod
    def forward(ctx: Any, x, weight, eps, kernels):  # type: ignore[override]
        y, rstd = kernels.rms_norm_fwd(x, weight, eps, for_backward=True)
        ctx.save_for_backward(x, weight, rstd)
        ctx.eps = eps
        ctx.kernels = kernels  # the backward's, without choosing them again
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor):  # type: ignore[override]
        if reference_backward(dy):
            return (*_backward(ctx, dy, None), None)  # type: ignore[arg-type]
        x, weight, rstd = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]
        dx, dw = ctx.kernels.rms_norm_bwd(
            dy.contiguous(), x, rstd, weight, need_dx, need_dw and weight is not None
        )
        return dx, dw, None, None


def rms_norm_rows(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm of the rows of contiguous 2-D ``x``: the custom op when a tracer is active, the
    identical kernels behind a plain autograd.Function otherwise (see ``layer_norm_rows``)."""
    if plain_eager():
        return rms_norm_rows_eager(x, weight, eps)
    if needs_reference():
        shape = (x.shape[1],)
        return in_stats_dtype(lambda x_, w: rms_norm_reference(x_, shape, w, eps), x, weight)
    return rms_norm_fwd(x, weight, eps)[0]


def rms_norm_rows_eager(
    x: Tensor, weight: Tensor | None, eps: float, kernels: ModuleType | None = None
) -> Tensor:
    """:func:`rms_norm_rows` where no tracer watches (the caller has made sure of it): the forward
    kernel alone where nothing needs a gradient, else the autograd.Function, unless the C++
    operator takes the call (see :func:`layernorm.ops.layer_norm.layer_norm_rows_eager`).
    ``kernels``: the backend's module, where the caller knows it."""
    if kernels is None:
        kernels = backend_module(x, "rms_norm")
    grad = needs_grad(x, weight)
    if kernels is cpu_rms_norm and torch_ops.takes(x, grad, weight):
        return torch_ops.rms_norm(x, weight, eps)
    if not grad:
        return kernels.rms_norm_fwd(x, weight, eps)[0]
    return _RMSNormEager.apply(x, weight, eps, kernels)
