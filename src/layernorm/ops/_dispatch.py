"""Route an op to the backend module that runs it (see :mod:`layernorm.backend`)."""

from __future__ import annotations

import importlib
from types import ModuleType

from torch import Tensor

from ..backend import select_backend


def backend_module(x: Tensor, family: str) -> ModuleType:
    """The module ``layernorm.kernels.<backend>.<family>`` for tensor ``x``."""
    return importlib.import_module(f"layernorm.kernels.{select_backend(x)}.{family}")


def empty_like_none(t: Tensor | None, like: Tensor) -> Tensor:
    """custom ops cannot return None: an empty tensor stands for 'no gradient'."""
    return like.new_empty(0) if t is None else t


def none_if_empty(t: Tensor) -> Tensor | None:
    return None if t.numel() == 0 and t.dim() == 1 and t.shape[0] == 0 else t
