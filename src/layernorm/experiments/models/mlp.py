"""The feed-forward classifier of ``mnist-ff`` (Ba et al. 2016, §6.6): 784-hidden-…-10 ReLU
network, normalization on the hidden layers."""

from __future__ import annotations

from torch import nn

from ... import BatchNorm, LayerNorm

__all__ = ["NORMS", "build_mlp"]

#: The classifiers' normalizations: the baseline, batch norm and layer norm.
NORMS = ("none", "batch", "layer")


def build_mlp(
    norm: str, hidden: int, batch_size: int, depth: int = 2, bn_logits: bool = False
) -> nn.Sequential:
    """784-hidden-…-hidden-10; ``norm`` in ``none``/``batch``/``layer`` on the hidden layers.

    ``bn_logits`` also batch-normalizes the logits when ``norm == "batch"`` (the paper's Fig. 6
    batch-norm model is "applied to all layers"); layer norm never touches the logits, whose
    scale carries the prediction's confidence (§6.6).
    """
    layers: list[nn.Module] = []
    width = 784
    for _ in range(depth):
        layers.append(nn.Linear(width, hidden))
        if norm == "batch":
            layers.append(BatchNorm(hidden, unbiased=batch_size < 128))
        elif norm == "layer":
            layers.append(LayerNorm(hidden))
        elif norm != "none":
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        layers.append(nn.ReLU())
        width = hidden
    layers.append(nn.Linear(width, 10))
    if bn_logits and norm == "batch":
        layers.append(BatchNorm(10, unbiased=batch_size < 128))
    return nn.Sequential(*layers)
