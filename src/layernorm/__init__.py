"""layernorm: layer normalization and its family for PyTorch.

Implements *Layer Normalization* (Ba, Kiros & Hinton 2016) and the variants of *Understanding and
Improving Layer Normalization* (Xu et al. 2019): functional ops, ``torch.nn``-style modules,
layer-normalized recurrent networks and the baselines the papers compare against.
"""

from __future__ import annotations

from .functional import ada_norm, layer_norm, rms_norm
from .modules import AdaNorm, BatchNorm, LayerNorm, RMSNorm, register_norm, replace_norms
from .recurrent import (
    LayerNormGRU,
    LayerNormGRUCell,
    LayerNormLSTM,
    LayerNormLSTMCell,
    LayerNormRNN,
    LayerNormRNNCell,
)

__version__ = "0.1.0"

__all__ = [
    "AdaNorm",
    "BatchNorm",
    "LayerNorm",
    "LayerNormGRU",
    "LayerNormGRUCell",
    "LayerNormLSTM",
    "LayerNormLSTMCell",
    "LayerNormRNN",
    "LayerNormRNNCell",
    "RMSNorm",
    "__version__",
    "ada_norm",
    "layer_norm",
    "register_norm",
    "replace_norms",
    "rms_norm",
]
