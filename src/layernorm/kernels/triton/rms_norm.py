"""RMSNorm on the Triton backend (kernels in :mod:`._norm_core`).

``y = w ⊙ x·rstd`` with ``rstd = 1/sqrt(mean(x²) + eps)`` (Zhang & Sennrich 2019);
``dx = rstd·(g − x̂·mean(g ⊙ x̂))`` with ``g = dy ⊙ w``; ``dw = Σ_rows dy ⊙ x̂``.

float64 inputs run on the ATen backend (the kernels accumulate in float32).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cpu import rms_norm as _aten
from ._norm_core import MODE_RMS, norm_bwd, norm_fwd


def rms_norm_fwd(
    x: Tensor,
    weight: Tensor | None,
    eps: float,
    *,
    block_n: int | None = None,
    for_backward: bool = False,
) -> tuple[Tensor, Tensor]:
    """``(y, rstd)``; ``block_n`` forces the looped kernel's chunk (tests);
    ``for_backward`` changes nothing here (see :mod:`layernorm.kernels`)."""
    if x.dtype == torch.float64:
        return _aten.rms_norm_fwd(x, weight, eps)
    y, _, rstd = norm_fwd(x, weight, None, eps, MODE_RMS, block_n=block_n)
    return y, rstd


def rms_norm_bwd(
    dy: Tensor,
    x: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    need_dx: bool,
    need_dw: bool,
    *,
    block_n: int | None = None,
    num_programs: int | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """``(dx, dweight)``, ``dweight`` in the weight's dtype; ``None`` for what is not asked for."""
    if x.dtype == torch.float64:
        return _aten.rms_norm_bwd(dy, x, rstd, weight, need_dx, need_dw)
    dx, dw, _ = norm_bwd(
        dy, x, rstd, rstd, weight, MODE_RMS,  # the mean argument is never read for RMSNorm
        need_dx=need_dx, need_dw=need_dw, block_n=block_n, num_programs=num_programs,
    )  # fmt: skip
    return dx, dw
