"""RMSNorm on the CPU. With ``rstd = 1/sqrt(mean(x²) + eps)``, ``x̂ = x·rstd``, ``g = dy ⊙ w``:

y  = x̂ ⊙ w
dx = rstd · (g − x̂ · mean(g ⊙ x̂))
dw = Σ_rows dy ⊙ x̂
"""

from __future__ import annotations

from torch import Tensor

from . import _native
from ._common import compute_dtype, to_compute


def rms_norm_fwd(
    x: Tensor, weight: Tensor | None, eps: float, *, for_backward: bool = False
) -> tuple[Tensor, Tensor]:
    if _native.supports(x, weight):
        return _native.rms_fwd(x, weight, eps, for_backward=for_backward)
    cdt = compute_dtype(x)
    xc = x.to(cdt)
    rstd = (xc * xc).mean(-1, keepdim=True).add_(eps).rsqrt_()
    y = xc * rstd
    if weight is not None:
        y = y * to_compute(weight, cdt)
    return y.to(x.dtype), rstd.view(-1)


def rms_norm_bwd(
    dy: Tensor, x: Tensor, rstd: Tensor, weight: Tensor | None, need_dx: bool, need_dw: bool
) -> tuple[Tensor | None, Tensor | None]:
    if _native.supports(x, weight, same=(dy,)):
        return _native.rms_bwd(dy, x, rstd, weight, need_dx, need_dw and weight is not None)
    cdt = compute_dtype(x)
    xc, dyc = x.to(cdt), dy.to(cdt)
    rstd2 = rstd.view(-1, 1)
    xhat = xc * rstd2
    dx = dw = None
    if need_dx:
        g = dyc if weight is None else dyc * to_compute(weight, cdt)
        proj = (g * xhat).mean(-1, keepdim=True)
        dx = ((g - xhat * proj) * rstd2).to(x.dtype)
    if need_dw and weight is not None:
        dw = (dyc * xhat).sum(0).to(weight.dtype)
    return dx, dw
