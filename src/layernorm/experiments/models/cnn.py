"""The small MNIST ConvNet of ``convnet`` (Ba et al. 2016, §6.7): two 5×5 convolutions with
normalization, ReLU and 2×2 max pooling, then a linear read-out."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ... import BatchNorm, LayerNorm
from .mlp import NORMS

__all__ = ["build_cnn"]


class _Image(nn.Module):
    def forward(self, x):  # (n, 784) → (n, 1, 28, 28)
        return x.view(-1, 1, 28, 28)


def build_cnn(norm: str, channels: Sequence[int]) -> nn.Sequential:
    c1, c2 = channels
    layers: list[nn.Module] = [_Image()]
    size, cin = 28, 1
    for c in (c1, c2):
        size = size - 4  # 5×5 convolution, no padding
        layers.append(nn.Conv2d(cin, c, 5))
        if norm == "batch":
            layers.append(BatchNorm(c))
        elif norm == "layer":
            layers.append(LayerNorm((c, size, size)))
        elif norm != "none":
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        layers += [nn.ReLU(), nn.MaxPool2d(2)]
        size //= 2
        cin = c
    layers += [nn.Flatten(), nn.Linear(c2 * size * size, 10)]
    return nn.Sequential(*layers)
