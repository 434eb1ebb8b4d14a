"""``torch.nn``-style modules: the normalization layers and the baselines."""

from .batchnorm import BatchNorm
from .normalization import AdaNorm, LayerNorm, RMSNorm
from .replace import NormKind, NormSpec, register_norm, replace_norms

__all__ = [
    "AdaNorm",
    "BatchNorm",
    "LayerNorm",
    "NormKind",
    "NormSpec",
    "RMSNorm",
    "register_norm",
    "replace_norms",
]
