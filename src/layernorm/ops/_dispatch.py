"""Route an op to the backend module that runs it (see :mod:`layernorm.backend`)."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
from torch import Tensor

from ..backend import select_backend

_MODULES: dict[tuple[str, str], ModuleType] = {}


def backend_module(x: Tensor, family: str) -> ModuleType:
    """The module ``layernorm.kernels.<backend>.<family>`` for tensor ``x``."""
    key = (select_backend(x), family)
    module = _MODULES.get(key)
    if module is None:  # import once: import_module costs microseconds on every op otherwise
        module = _MODULES[key] = importlib.import_module(f"layernorm.kernels.{key[0]}.{family}")
    return module


def plain_eager() -> bool:
    """True when no tracer watches: not torch.compile/export, a functorch transform (vmap, grad)
    or a dispatch mode (fake tensors, make_fx). Only then may an op skip its custom-op wrapper,
    whose Python dispatch costs tens of microseconds a call, as much as a small op's whole kernel.
    """
    return not (
        torch.compiler.is_compiling()
        or torch._C._are_functorch_transforms_active()
        or torch._C._len_torch_dispatch_stack() > 0
    )


def empty_like_none(t: Tensor | None, like: Tensor) -> Tensor:
    """custom ops cannot return None: an empty tensor stands for 'no gradient'."""
    return like.new_empty(0) if t is None else t


def none_if_empty(t: Tensor) -> Tensor | None:
    return None if t.numel() == 0 and t.dim() == 1 and t.shape[0] == 0 else t
