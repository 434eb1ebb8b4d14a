"""Layer norm (and DetachNorm) on the CPU: fused C kernels (:mod:`._native`) for float32, float64,
bfloat16 and float16 (gains/biases in x's dtype or, for half x, float32); otherwise PyTorch's
native layer-norm kernels plus an eager composition for the DetachNorm ``dx``.

DetachNorm's backward differs only in which terms of the layer-norm gradient survive; with
``x̂ = (x − μ)·rstd`` and ``g = dy ⊙ w``:

    full LN        dx = rstd · (g − mean(g) − x̂ · mean(g ⊙ x̂))
    detach μ       dx = rstd · (g            − x̂ · mean(g ⊙ x̂))
    detach σ       dx = rstd · (g − mean(g))
    detach both    dx = rstd · g

(μ's own gradient path is the ``mean(g)`` term; σ's is the ``x̂ · mean(g ⊙ x̂)`` term, because
d var/d μ = 0.) ``dw = Σ_rows dy ⊙ x̂`` and ``db = Σ_rows dy`` do not depend on the flags.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _native
from ._common import compute_dtype, to_compute


def layer_norm_fwd(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, *, for_backward: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    if _native.supports(x, weight, bias):
        return _native.ln_fwd(x, weight, bias, eps, for_backward=for_backward)
    cdt = compute_dtype(x)
    n = x.shape[-1]
    y, mean, rstd = torch.native_layer_norm(
        x.to(cdt), (n,), to_compute(weight, cdt), to_compute(bias, cdt), eps
    )
    return y.to(x.dtype), mean.view(-1).to(cdt), rstd.view(-1).to(cdt)


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
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    if _native.supports(x, weight, same=(dy,)):
        return _native.ln_bwd(
            dy, x, mean, rstd, weight, detach_mean, detach_std,
            need_dx, need_dw and weight is not None, need_db,
        )  # fmt: skip
    cdt = compute_dtype(x)
    n = x.shape[-1]
    xc, dyc = x.to(cdt), dy.to(cdt)
    w = to_compute(weight, cdt)
    mean2, rstd2 = mean.view(-1, 1), rstd.view(-1, 1)
    plain = not detach_mean and not detach_std
    # The native kernel only needs a bias tensor to know db is wanted; its values are unused.
    bias_placeholder = xc.new_empty(n) if need_db else None
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        dyc, xc, (n,), mean2, rstd2, w, bias_placeholder, [need_dx and plain, need_dw, need_db]
    )
    if need_dx and not plain:
        g = dyc if w is None else dyc * w
        if detach_mean and detach_std:
            dx = g * rstd2
        elif detach_std:
            # rstd·g − rstd·mean(g), in one pass over the row
            dx = torch.addcmul(-(g.mean(-1, keepdim=True) * rstd2), g, rstd2)
        else:  # detach_mean only
            xhat = (xc - mean2) * rstd2
            proj = (g * xhat).mean(-1, keepdim=True)
            dx = (g - xhat * proj) * rstd2
    out_dx = None if dx is None or not need_dx else dx.to(x.dtype)
    out_dw = None if dw is None or not need_dw else dw.to(weight.dtype)  # type: ignore[union-attr]
    out_db = None if db is None or not need_db else db
    return out_dx, out_dw, out_db
