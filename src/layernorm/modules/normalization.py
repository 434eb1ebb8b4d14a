"""``torch.nn``-style modules for layer norm, LN-simple, DetachNorm, RMSNorm and AdaNorm."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .. import functional as F
from .._torchscript import NotScriptable
from .._validation import ShapeLike, as_shape, check_eps, check_finite_scalar, check_flag


class _Norm(NotScriptable, nn.Module):
    """Shared ``normalized_shape``/``elementwise_affine``/``bias`` handling (torch's contract)."""

    normalized_shape: tuple[int, ...]
    weight: nn.Parameter | None
    bias: nn.Parameter | None

    def _init_affine(self, elementwise_affine: bool, bias: bool, factory: dict[str, Any]) -> None:
        owner = type(self).__name__
        elementwise_affine = check_flag(elementwise_affine, "elementwise_affine", owner)
        bias = check_flag(bias, "bias", owner)
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, **factory))
            if bias:
                self.bias = nn.Parameter(torch.empty(self.normalized_shape, **factory))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Gain 1 and bias 0, as in the paper (Section 6)."""
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class LayerNorm(_Norm):
    r"""Layer normalization (Ba, Kiros & Hinton 2016), a drop-in for :class:`torch.nn.LayerNorm`.

    .. math:: y = g \odot \frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}} + b

    μ and σ² (biased) are computed per example over the last ``len(normalized_shape)`` dims, the
    same at training and test time, so it works with batch size 1. The state_dict has the same keys
    and shapes as ``torch.nn.LayerNorm``'s, so checkpoints load either way.

    Args:
        normalized_shape: trailing shape normalized together.
        eps: added to the variance inside the square root. Default ``1e-5``.
        elementwise_affine: learn a gain ``g`` (init 1) and bias ``b`` (init 0). ``False`` gives
            *LN-simple* (Xu et al. 2019).
        bias: learn ``b`` too (only with ``elementwise_affine``).
        detach_mean, detach_std: *DetachNorm* (Xu et al. 2019): no gradient through μ / σ.

    Shape:
        input ``(*, *normalized_shape)``, output the same.

    Example::

        >>> import torch, layernorm
        >>> ln = layernorm.LayerNorm(512)
        >>> y = ln(torch.randn(8, 20, 512))
        >>> detach_norm = layernorm.LayerNorm(512, elementwise_affine=False,
        ...                                   detach_mean=True, detach_std=True)
    """

    def __init__(
        self,
        normalized_shape: ShapeLike,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        detach_mean: bool = False,
        detach_std: bool = False,
    ) -> None:
        super().__init__()
        self.normalized_shape = as_shape(normalized_shape)
        self.eps = check_eps(eps, "LayerNorm")
        self.detach_mean = check_flag(detach_mean, "detach_mean", "LayerNorm")
        self.detach_std = check_flag(detach_std, "detach_std", "LayerNorm")
        self._init_affine(elementwise_affine, bias, {"device": device, "dtype": dtype})

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(
            x, self.normalized_shape, self.weight, self.bias, self.eps,  # type: ignore[arg-type]
            detach_mean=self.detach_mean, detach_std=self.detach_std,
        )  # fmt: skip

    def extra_repr(self) -> str:
        # torch.nn.LayerNorm's repr word for word, then the DetachNorm flags when set
        s = (
            f"{self.normalized_shape}, eps={self.eps}, "
            f"elementwise_affine={self.elementwise_affine}, bias={self.bias is not None}"
        )
        if self.detach_mean:
            s += ", detach_mean=True"
        if self.detach_std:
            s += ", detach_std=True"
        return s


class RMSNorm(_Norm):
    r"""RMSNorm (Zhang & Sennrich 2019), a drop-in for :class:`torch.nn.RMSNorm`.

    .. math:: y = g \odot \frac{x}{\sqrt{\frac{1}{N}\sum_i x_i^2 + \epsilon}}

    ``eps=None`` uses the machine epsilon of the statistics' dtype like torch (float32's for half
    inputs). Keys ``weight`` only, shape ``normalized_shape``.

    Args:
        normalized_shape: trailing shape normalized together.
        eps: added to the mean square inside the square root; ``None`` as above.
        elementwise_affine: learn a gain ``g`` (init 1).
        device, dtype: of the gain, as in ``torch.nn`` modules.
    """

    def __init__(
        self,
        normalized_shape: ShapeLike,
        eps: float | None = None,
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = as_shape(normalized_shape)
        self.eps = check_eps(eps, "RMSNorm", allow_none=True)
        self._init_affine(elementwise_affine, False, {"device": device, "dtype": dtype})

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
        )


class AdaNorm(_Norm):
    r"""AdaNorm (Xu et al. 2019): LN-simple rescaled by a detached, input-adaptive factor.

    .. math:: z = C\,(1 - k\,y) \odot y, \qquad y = \frac{x - \mu}{\sigma}

    with :math:`C(1-ky)` a constant in backward. The paper's AdaNorm has no gain or bias
    (``elementwise_affine=False``, the default); ``elementwise_affine=True`` adds ``g ⊙ z + b`` on
    top for experiments.

    Args:
        normalized_shape: trailing shape normalized together.
        k: the slope of φ; the paper uses 1/10.
        scale: ``C``.
        eps: added to the variance inside the square root.
        elementwise_affine: add a learned gain ``g`` (init 1) and bias ``b`` (init 0) after φ;
            not in the paper.
        bias: learn ``b`` too (only with ``elementwise_affine``).
        device, dtype: of the gain and bias, as in ``torch.nn`` modules.
    """

    def __init__(
        self,
        normalized_shape: ShapeLike,
        k: float = 0.1,
        scale: float = 1.0,
        eps: float = 1e-5,
        elementwise_affine: bool = False,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = as_shape(normalized_shape)
        self.k = check_finite_scalar(k, "k", "AdaNorm")
        self.scale = check_finite_scalar(scale, "scale", "AdaNorm")
        self.eps = check_eps(eps, "AdaNorm")
        self._init_affine(elementwise_affine, bias, {"device": device, "dtype": dtype})

    def forward(self, x: Tensor) -> Tensor:
        z = F.ada_norm(x, self.normalized_shape, self.k, self.scale, self.eps)  # type: ignore[arg-type]
        if self.weight is None and self.bias is None:
            return z
        out = z
        if self.weight is not None:
            out = out * self.weight
        if self.bias is not None:
            out = out + self.bias
        # like LayerNorm, the output keeps the input's dtype (float32 gains on half activations)
        return out.to(z.dtype)

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, k={self.k}, scale={self.scale}, eps={self.eps}, "
            f"elementwise_affine={self.elementwise_affine}"
        )
