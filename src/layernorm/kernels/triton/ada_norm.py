"""AdaNorm on the Triton backend (kernels in :mod:`._norm_core`).

``z = φ(y) ⊙ y`` with ``y`` the LN-simple row and ``φ(y) = C·(1 − k·y)`` detached in backward
(Xu et al. 2019, Eq. 9-10): the forward writes ``C·y − C·k·y²``, the backward feeds
``g = dz ⊙ φ(y)`` through the LN-simple gradient.

float64 inputs run on the ATen backend (the kernels accumulate in float32).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cpu import ada_norm as _aten
from ._norm_core import MODE_ADA, norm_bwd, norm_fwd


def ada_norm_fwd(
    x: Tensor,
    k: float,
    scale: float,
    eps: float,
    *,
    block_n: int | None = None,
    for_backward: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(z, mean, rstd)``; ``block_n`` forces the looped kernel's chunk (tests);
    ``for_backward`` changes nothing here (see :mod:`layernorm.kernels`)."""
    if x.dtype == torch.float64:
        return _aten.ada_norm_fwd(x, k, scale, eps)
    return norm_fwd(x, None, None, eps, MODE_ADA, k=k, scale=scale, block_n=block_n)


def ada_norm_bwd(
    dz: Tensor,
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    k: float,
    scale: float,
    *,
    block_n: int | None = None,
) -> Tensor:
    """``dx`` in ``x``'s dtype."""
    if x.dtype == torch.float64:
        return _aten.ada_norm_bwd(dz, x, mean, rstd, k, scale)
    dx, _, _ = norm_bwd(dz, x, mean, rstd, None, MODE_ADA, k=k, scale=scale, block_n=block_n)
    assert dx is not None
    return dx
