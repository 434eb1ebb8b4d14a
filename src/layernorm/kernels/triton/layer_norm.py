"""Layer norm, LN-simple and DetachNorm on the Triton backend (kernels in :mod:`._norm_core`).

``y = w ⊙ (x − μ)·rstd + b`` per row, ``rstd = 1/sqrt(mean((x − μ)²) + eps)`` (Ba et al. 2016,
Eq. 3). The DetachNorm flags (Xu et al. 2019) drop the ``mean(g)`` term (μ detached) and/or the
``x̂·mean(g ⊙ x̂)`` term (σ detached) of ``dx``; ``dw``/``db`` do not depend on them.

float64 inputs run on the ATen backend (the kernels accumulate in float32).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cpu import layer_norm as _aten
from ._norm_core import MODE_LN, norm_bwd, norm_fwd


def layer_norm_fwd(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    *,
    block_n: int | None = None,
    for_backward: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, mean, rstd)``; ``block_n`` forces the looped kernel's chunk (tests);
    ``for_backward`` changes nothing here (see :mod:`layernorm.kernels`)."""
    if x.dtype == torch.float64:
        return _aten.layer_norm_fwd(x, weight, bias, eps)
    return norm_fwd(x, weight, bias, eps, MODE_LN, block_n=block_n)


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
    *,
    block_n: int | None = None,
    num_programs: int | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(dx, dweight, dbias)``: ``dweight`` in the weight's dtype, ``dbias`` in float32 for half
    inputs (the caller casts it to the bias dtype), ``None`` for what is not asked for."""
    if x.dtype == torch.float64:
        return _aten.layer_norm_bwd(
            dy, x, mean, rstd, weight, detach_mean, detach_std, need_dx, need_dw, need_db
        )
    return norm_bwd(
        dy, x, mean, rstd, weight, MODE_LN,
        detach_mean=detach_mean, detach_std=detach_std,
        need_dx=need_dx, need_dw=need_dw, need_db=need_db,
        block_n=block_n, num_programs=num_programs,
    )  # fmt: skip
