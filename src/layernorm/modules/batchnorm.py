"""Batch normalization baseline (Ioffe & Szegedy 2015, Eq. 2 of the LN paper) with an option for
the unbiased batch variance that the LN paper uses at batch size 4."""

from __future__ import annotations

import numbers

import torch
from torch import Tensor, nn

from .._torchscript import NotScriptable
from .._validation import (
    as_int,
    check_eps,
    check_flag,
    check_float_tensor,
    sizes_of,
    stats_dtype,
)


class BatchNorm(NotScriptable, nn.Module):
    r"""Batch norm over ``(N, C)`` or ``(N, C, *)`` inputs, statistics per channel ``C``.

    .. math:: y = \gamma \odot \frac{a - \mu_B}{\sqrt{\sigma_B^2 + \epsilon}} + \beta

    In training μ_B and σ²_B come from the batch (and over the trailing dims); at eval the running
    estimates are used. ``unbiased=False`` normalizes with the biased batch variance, like
    ``torch.nn.BatchNorm1d``; ``unbiased=True`` uses ``σ²·n/(n−1)``, the setting of the LN paper's
    batch-size-4 MNIST run. Running variance is always updated with the unbiased estimate.
    ``unbiased`` is keyword-only: ``torch.nn.BatchNorm1d``'s fifth positional argument is
    ``track_running_stats``, which a positional call must not turn into this switch.

    A batch of one example cannot be normalized by its own batch statistics: in training that is an
    error (use :class:`layernorm.LayerNorm`, which does not depend on the batch).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float = 0.1,
        affine: bool = True,
        *,
        unbiased: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        size = as_int(num_features)
        if size is None:
            raise TypeError(
                f"BatchNorm: num_features must be a positive int, got "
                f"{type(num_features).__name__} {num_features!r}"
            )
        if size <= 0:
            raise ValueError(f"BatchNorm: num_features must be a positive int, got {size!r}")
        num_features = size
        if isinstance(momentum, bool) or not isinstance(momentum, int | float | numbers.Real):
            raise TypeError(
                f"BatchNorm: momentum must be a float in [0, 1], got {type(momentum).__name__} "
                f"{momentum!r}"
            )
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"BatchNorm: momentum must be in [0, 1], got {momentum!r}")
        factory = {"device": device, "dtype": dtype}
        self.num_features = num_features
        self.eps = check_eps(eps, "BatchNorm")
        self.momentum = float(momentum)
        self.affine = check_flag(affine, "affine", "BatchNorm")
        self.unbiased = check_flag(unbiased, "unbiased", "BatchNorm")
        if self.affine:
            self.weight = nn.Parameter(torch.ones(num_features, **factory))
            self.bias = nn.Parameter(torch.zeros(num_features, **factory))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.register_buffer("running_mean", torch.zeros(num_features, **factory))
        self.register_buffer("running_var", torch.ones(num_features, **factory))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def reset_parameters(self) -> None:
        self.running_mean.zero_()  # type: ignore[operator]
        self.running_var.fill_(1.0)  # type: ignore[operator]
        self.num_batches_tracked.zero_()  # type: ignore[operator]
        if self.affine:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        check_float_tensor(x, "BatchNorm: input")
        if x.dim() < 2 or sizes_of(x)[1] != self.num_features:
            raise ValueError(
                f"BatchNorm(num_features={self.num_features}) expects input of shape (N, "
                f"{self.num_features}) or (N, {self.num_features}, *), got {tuple(x.shape)}"
            )
        dims = [0, *range(2, x.dim())]
        shape = [1, self.num_features] + [1] * (x.dim() - 2)
        # Statistics in float32 for half inputs (as torch does); the output keeps x's dtype.
        cdt = stats_dtype(x.dtype)
        xc = x.to(cdt)
        if self.training:
            if x.shape[0] < 2:
                raise ValueError(
                    f"BatchNorm in training needs at least 2 examples per batch to compute batch "
                    f"statistics, got a batch of {x.shape[0]} (input shape {tuple(x.shape)}); "
                    "use LayerNorm, which normalizes each example on its own"
                )
            n = x.numel() // self.num_features
            mean = xc.mean(dim=dims)
            var_biased = xc.var(dim=dims, unbiased=False)
            var_unbiased = var_biased * (n / (n - 1))
            with torch.no_grad():
                self.num_batches_tracked.add_(1)  # type: ignore[operator]
                new_mean = mean.detach().to(self.running_mean.dtype)  # type: ignore[union-attr]
                new_var = var_unbiased.detach().to(self.running_var.dtype)  # type: ignore[union-attr]
                self.running_mean.lerp_(new_mean, self.momentum)  # type: ignore[operator]
                self.running_var.lerp_(new_var, self.momentum)  # type: ignore[operator]
            var = var_unbiased if self.unbiased else var_biased
        else:
            mean = self.running_mean.to(cdt)  # type: ignore[union-attr]
            var = self.running_var.to(cdt)  # type: ignore[union-attr]
        y = (xc - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.to(cdt).view(shape) + self.bias.to(cdt).view(shape)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
            f"affine={self.affine}, unbiased={self.unbiased}"
        )
