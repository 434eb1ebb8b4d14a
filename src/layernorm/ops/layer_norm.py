"""``layernorm::layer_norm_fwd`` / ``layer_norm_bwd``: layer norm and DetachNorm as custom ops.

The forward saves only ``x`` and the per-row ``mean``/``rstd`` (float32 for half inputs); the
backward is analytic. Both are opaque to ``torch.compile`` (fake implementations give shapes), so
compiled graphs keep the fused kernels and never break. Double backward (``create_graph=True``)
differentiates the pure-PyTorch reference instead, since the fused backward is not differentiable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from .._validation import stats_dtype
from ..kernels.cpu import layer_norm as cpu_layer_norm
from ..kernels.cpu import torch_ops
from ..reference import layer_norm_reference
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


@torch.library.custom_op("layernorm::layer_norm_fwd", mutates_args=())
def layer_norm_fwd(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    detach_mean: bool = False,
    detach_std: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of 2-D ``x`` → ``(y, mean, rstd)``. The detach flags only change the backward."""
    op = "layernorm::layer_norm_fwd"
    _checks.rows(op, x)
    _checks.vector(op, "weight", weight, x)
    _checks.vector(op, "bias", bias, x)
    _checks.eps(op, eps)
    return backend_module(x, "layer_norm").layer_norm_fwd(x, weight, bias, eps)


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps, detach_mean=False, detach_std=False):
    m = x.shape[0]
    sdt = stats_dtype(x.dtype)
    return torch.empty_like(x), x.new_empty((m,), dtype=sdt), x.new_empty((m,), dtype=sdt)


@torch.library.custom_op("layernorm::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    detach_mean: bool,
    detach_std: bool,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dweight, dbias)``; a gradient not asked for comes back as an empty tensor."""
    op = "layernorm::layer_norm_bwd"
    _checks.rows(op, x)
    _checks.grad(op, "dy", dy, x)
    _checks.stats(op, "mean", mean, x)
    _checks.stats(op, "rstd", rstd, x)
    _checks.vector(op, "weight", weight, x)
    dx, dw, db = _backend_bwd(
        dy, x, mean, rstd, weight, detach_mean, detach_std, need_dx, need_dw, need_db
    )
    return empty_like_none(dx, x), empty_like_none(dw, x), empty_like_none(db, x)


@layer_norm_bwd.register_fake
def _(dy, x, mean, rstd, weight, detach_mean, detach_std, need_dx, need_dw, need_db):
    n = x.shape[1]
    dx = torch.empty_like(x) if need_dx else x.new_empty(0)
    wdt = weight.dtype if weight is not None else x.dtype
    dw = x.new_empty((n,), dtype=wdt) if need_dw else x.new_empty(0)
    db = x.new_empty((n,), dtype=stats_dtype(x.dtype)) if need_db else x.new_empty(0)
    return dx, dw, db


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, weight, bias, eps, detach_mean, detach_std = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.eps, ctx.detach_mean, ctx.detach_std = eps, detach_mean, detach_std
    ctx.mark_non_differentiable(mean, rstd)


def _fused_backward(ctx: Any, dy: Tensor, bwd: Callable[..., tuple]) -> tuple:
    """Gradients of ``(x, weight, bias, eps, detach_mean, detach_std)`` from ``bwd`` (the custom op
    or the backend's ``layer_norm_bwd``: same arguments, ``None`` for what is not asked for)."""
    x, weight, bias, mean, rstd = ctx.saved_tensors
    if reference_backward(dy):
        # create_graph=True: differentiate the reference so the result is itself differentiable;
        # a batched backward (is_grads_batched, jacobian(vectorize=True)): dy has no memory of
        # its own for the kernels to read, the reference's ops batch.
        return (*_reference_backward(ctx, dy, x, weight, bias), None, None, None)
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    dx, dw, db = bwd(
        dy.contiguous(), x, mean, rstd, weight, ctx.detach_mean, ctx.detach_std,
        need_dx, need_dw and weight is not None, need_db and bias is not None,
    )  # fmt: skip
    if db is not None and bias is not None and db.dtype is not bias.dtype:
        db = db.to(bias.dtype)
    return dx, dw, db, None, None, None


def _op_bwd(*args: Any) -> tuple[Tensor | None, ...]:
    # the custom op returns an empty tensor for a gradient not asked for
    return tuple(none_if_empty(t) for t in layer_norm_bwd(*args))


def _backend_bwd(dy: Tensor, x: Tensor, *args: Any) -> tuple[Tensor | None, ...]:
    return backend_module(x, "layer_norm").layer_norm_bwd(dy.contiguous(), x, *args)


def _backward(ctx: Any, dy: Tensor, _dmean: Tensor, _drstd: Tensor):
    return _fused_backward(ctx, dy, _op_bwd)


def _reference_backward(ctx: Any, dy: Tensor, x: Tensor, weight, bias) -> tuple:
    eps, dm, ds = ctx.eps, ctx.detach_mean, ctx.detach_std
    return reference_grads(dy, x, weight, bias, eps, dm, ds, ctx.needs_input_grad[:3])


def reference_grads(
    dy: Tensor,
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    detach_mean: bool,
    detach_std: bool,
    needs: Sequence[bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The gradients of ``(x, weight, bias)`` that ``needs`` asks for, by differentiating the
    reference (:func:`layernorm.reference.layer_norm_reference`) with ``create_graph=True``: a
    backward whose result must itself be differentiable, or whose ``dy`` has no memory of its
    own for the kernels."""
    with torch.enable_grad():
        x, weight, bias = aliases(x, weight, bias)
        wanted = [t for t, need in zip((x, weight, bias), needs, strict=True) if need]
        y = layer_norm_reference(x, (x.shape[-1],), weight, bias, eps, detach_mean, detach_std)
        grads = iter(torch.autograd.grad(y, wanted, dy, create_graph=True, allow_unused=True))
    dx, dw, db = (next(grads) if need else None for need in needs)
    return dx, dw, db


torch.library.register_autograd(
    "layernorm::layer_norm_fwd", _backward, setup_context=_setup_context
)


class _LayerNormEager(torch.autograd.Function):
    """The same backend kernels and backward as the custom op, minus its dispatch cost (eager)."""

    @staticmethod
    def forward(ctx: Any, x, weight, bias, eps, detach_mean, detach_std, kernels):  # type: ignore[override]
        y, mean, rstd = kernels.layer_norm_fwd(x, weight, bias, eps, for_backward=True)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.eps, ctx.detach_mean, ctx.detach_std = eps, detach_mean, detach_std
        ctx.kernels = kernels  # the backward's, without choosing them again
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor):  # type: ignore[override]
        return (*_fused_backward(ctx, dy, ctx.kernels.layer_norm_bwd), None)


def layer_norm_rows(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    detach_mean: bool = False,
    detach_std: bool = False,
) -> Tensor:
    """Layer norm of the rows of contiguous 2-D ``x``: the custom op when a tracer (compile, export,
    vmap, fake tensors) is active, the identical kernels behind a plain autograd.Function otherwise,
    and where nothing needs a gradient the forward kernel alone (nothing saved, no graph node).
    """
    if plain_eager():
        return layer_norm_rows_eager(x, weight, bias, eps, detach_mean, detach_std)
    if needs_reference():
        shape = (x.shape[1],)
        return in_stats_dtype(
            lambda x_, w, b: layer_norm_reference(x_, shape, w, b, eps, detach_mean, detach_std),
            x, weight, bias,
        )  # fmt: skip
    return layer_norm_fwd(x, weight, bias, eps, detach_mean, detach_std)[0]


def layer_norm_rows_eager(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    detach_mean: bool = False,
    detach_std: bool = False,
    kernels: ModuleType | None = None,
) -> Tensor:
    """:func:`layer_norm_rows` where no tracer watches (:func:`._dispatch.plain_eager`, which the
    caller has made sure of): the C++ operator of :mod:`layernorm.kernels.cpu.torch_ops` where it
    takes the call (a small CPU one), else the forward kernel alone where nothing needs a gradient,
    else the autograd.Function. ``kernels``: the backend's module, where the caller knows it."""
    if kernels is None:
        kernels = backend_module(x, "layer_norm")
    grad = needs_grad(x, weight, bias)
    if kernels is cpu_layer_norm and torch_ops.takes(x, grad, weight, bias):
        return torch_ops.layer_norm(x, weight, bias, eps, detach_mean, detach_std)
    if not grad:
        return kernels.layer_norm_fwd(x, weight, bias, eps)[0]
    return _LayerNormEager.apply(x, weight, bias, eps, detach_mean, detach_std, kernels)
