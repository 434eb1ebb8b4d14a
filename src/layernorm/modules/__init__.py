"""``torch.nn``-style modules: the normalization layers and the baselines."""

from .batchnorm import BatchNorm
from .normalization import AdaNorm, LayerNorm, RMSNorm
from .replace import NormKind, replace_norms

__all__ = ["AdaNorm", "BatchNorm", "LayerNorm", "NormKind", "RMSNorm", "replace_norms"]
