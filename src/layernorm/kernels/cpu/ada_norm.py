"""AdaNorm on the CPU. ``y`` is LN-simple and ``φ(y) = C·(1 − k·y)`` is a constant in backward:

z  = φ(y) ⊙ y
dy = dz ⊙ φ(y)           (φ detached, Xu et al. 2019 Eq. 10)
dx = LN-simple backward of dy
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _native
from ._common import compute_dtype


def ada_norm_fwd(
    x: Tensor, k: float, scale: float, eps: float, *, for_backward: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    if _native.supports(x):
        return _native.ada_fwd(x, k, scale, eps, for_backward=for_backward)
    cdt = compute_dtype(x)
    n = x.shape[-1]
    y, mean, rstd = torch.native_layer_norm(x.to(cdt), (n,), None, None, eps)
    # z = C·y − C·k·y², written to touch y twice instead of building φ(y) first
    z = torch.addcmul(y * scale, y, y, value=-scale * k)
    return z.to(x.dtype), mean.view(-1).to(cdt), rstd.view(-1).to(cdt)


def ada_norm_bwd(
    dz: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, k: float, scale: float
) -> Tensor:
    if _native.supports(x, same=(dz,)):
        return _native.ada_bwd(dz, x, mean, rstd, k, scale)
    cdt = compute_dtype(x)
    n = x.shape[-1]
    xc, dzc = x.to(cdt), dz.to(cdt)
    mean2, rstd2 = mean.view(-1, 1), rstd.view(-1, 1)
    y = (xc - mean2) * rstd2
    dy = torch.addcmul(dzc * scale, dzc, y, value=-scale * k)  # dz ⊙ C·(1 − k·y)
    dx, _, _ = torch.ops.aten.native_layer_norm_backward(
        dy, xc, (n,), mean2, rstd2, None, None, [True, False, False]
    )
    return dx.to(x.dtype)
