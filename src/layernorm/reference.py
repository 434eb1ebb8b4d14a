"""Pure-PyTorch reference implementations: the oracle for tests and the double-backward fallback.

Written to be read, not to be fast: every op is a few differentiable tensor expressions whose
autograd graph *is* the definition of its gradient (``detach()`` marks exactly what the papers treat
as constant). Feed them float64 inputs to get the reference the fast paths are tested against.

Notation, for one row ``x`` of ``N`` elements (the trailing ``normalized_shape`` dims flattened):

    μ = (1/N) Σ x_i                    # B,1
    σ = sqrt((1/N) Σ (x_i − μ)² + eps)  # B,1  biased variance, eps inside the root (as torch)
    y = (x − μ) / σ                     # B,N  "LN-simple" (Xu et al. 2019)
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._validation import stats_dtype


def _row_dims(x: Tensor, normalized_shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(range(x.dim() - len(normalized_shape), x.dim()))


def layer_norm_reference(
    x: Tensor,
    normalized_shape: tuple[int, ...],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    detach_mean: bool = False,
    detach_std: bool = False,
) -> Tensor:
    """Layer norm, Ba et al. 2016, Eq. 3: ``g ⊙ (x − μ)/σ + b``; DetachNorm when flags are set."""
    dims = _row_dims(x, normalized_shape)
    mu = x.mean(dim=dims, keepdim=True)
    if detach_mean:
        mu = mu.detach()  # DetachNorm: μ is a constant in backward
    centered = x - mu
    var = (centered * centered).mean(dim=dims, keepdim=True)
    # Note: d var / d μ = −2·mean(x − μ) = 0, so detaching μ here or not gives the same σ gradient.
    sigma = torch.sqrt(var + eps)
    if detach_std:
        sigma = sigma.detach()  # DetachNorm: σ is a constant in backward
    y = centered / sigma
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def rms_norm_reference(
    x: Tensor,
    normalized_shape: tuple[int, ...],
    weight: Tensor | None = None,
    eps: float | None = None,
) -> Tensor:
    """RMSNorm, Zhang & Sennrich 2019: ``g ⊙ x / sqrt(mean(x²) + eps)``.

    ``eps=None`` means the machine epsilon of the statistics' dtype (float32 for half inputs), as in
    ``torch.nn.functional.rms_norm``.
    """
    dims = _row_dims(x, normalized_shape)
    if eps is None:
        eps = torch.finfo(stats_dtype(x.dtype)).eps
    y = x * torch.rsqrt((x * x).mean(dim=dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    return y


def ada_norm_reference(
    x: Tensor,
    normalized_shape: tuple[int, ...],
    k: float = 0.1,
    scale: float = 1.0,
    eps: float = 1e-5,
) -> Tensor:
    """AdaNorm, Xu et al. 2019: ``z = φ(y) ⊙ y`` with ``φ(y) = C·(1 − k·y)`` detached in backward.

    ``y`` is LN-simple with this library's convention (biased variance, eps inside the root).
    """
    y = layer_norm_reference(x, normalized_shape, eps=eps)
    phi = (scale * (1.0 - k * y)).detach()  # φ(y) is a constant in backward (their Eq. 10)
    return phi * y
