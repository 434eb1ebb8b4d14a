"""``layernorm::norm_reference_grads``: the reference's gradients as an operator, for the C++
autograd nodes of :mod:`layernorm.kernels.cpu.torch_ops`.

Their backward calls it where the kernels' analytic backward cannot serve: under grad mode
(``create_graph=True``: the gradients must themselves be differentiable) and for an incoming
gradient with no memory of its own (vmap's batched tensors, tensor subclasses). It is a
``CompositeImplicitAutograd`` operator, so autograd records the reference's ops inside it and
functorch's transforms see through it; each norm's ``reference_grads`` (in its module of
:mod:`layernorm.ops`) is the one definition.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

_LIB = torch.library.Library("layernorm", "FRAGMENT")
_LIB.define(
    "norm_reference_grads(str norm, Tensor dy, Tensor x, Tensor? weight, Tensor? bias, "
    "float[] scalars, bool[] flags, bool[] needs) -> Tensor?[]"
)


def norm_reference_grads(
    norm: str,
    dy: Tensor,
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    scalars: Sequence[float],
    flags: Sequence[bool],
    needs: Sequence[bool],
) -> list[Tensor | None]:
    """The gradients that ``needs`` asks for of norm ``norm`` (``"layer_norm"``: x, weight, bias;
    scalars ``[eps]``, flags ``[detach_mean, detach_std]``; ``"rms_norm"``: x, weight; ``[eps]``;
    ``"ada_norm"``: x; ``[k, scale, eps]``)."""
    from . import ada_norm, layer_norm, rms_norm  # they import this module

    if norm == "layer_norm":
        (eps,), (detach_mean, detach_std) = scalars, flags
        return list(
            layer_norm.reference_grads(dy, x, weight, bias, eps, detach_mean, detach_std, needs)
        )
    if norm == "rms_norm":
        (eps,) = scalars
        return list(rms_norm.reference_grads(dy, x, weight, eps, needs))
    if norm == "ada_norm":
        k, scale, eps = scalars
        return [ada_norm.reference_grads(dy, x, k, scale, eps)]
    raise ValueError(f"layernorm::norm_reference_grads: no norm named {norm!r}")


_LIB.impl("norm_reference_grads", norm_reference_grads, "CompositeImplicitAutograd")
# Batched tensors (functorch's vmap; the legacy vmap of a batched backward, is_grads_batched=True):
# the reference's ops batch, so the same function serves as the batching rule (the generic one
# cannot loop over a list of optionals).
for _key in ("FuncTorchBatched", "Batched"):
    _LIB.impl("norm_reference_grads", norm_reference_grads, _key)
