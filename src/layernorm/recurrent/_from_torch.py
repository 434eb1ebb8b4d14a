"""What the cells' and the sequence layers' ``from_torch`` share: the check of the module's kind
and the build with its weights loaded."""

from __future__ import annotations

from typing import Any, TypeVar

from torch import nn

_M = TypeVar("_M", bound=nn.Module)


def require_torch_kind(cls: type, module: object, expected: type[nn.Module]) -> None:
    """``TypeError`` naming both classes unless ``module`` is a ``expected`` (before any of its
    attributes is read: an ``nn.GRU`` given to the LSTM's ``from_torch`` is named as such, not
    reported as a weight-shape mismatch)."""
    if not isinstance(module, expected):
        raise TypeError(
            f"{cls.__name__}.from_torch expects a torch.nn.{expected.__name__}, "
            f"got {type(module).__name__}"
        )


def build_from_torch(
    cls: type[_M], module: nn.Module, config: dict[str, Any], overrides: dict[str, Any]
) -> _M:
    """``cls(module.input_size, module.hidden_size, **config)`` with ``module``'s weights loaded.

    ``overrides`` (the caller's keyword arguments) take precedence over ``config`` (what was read
    off ``module``). The load is by name with ``strict=False``: our normalization parameters, which
    torch's modules lack, keep their initial values, but every entry of ``module``'s state_dict must
    find its place, else ``ValueError`` (e.g. ``bias=False`` asked of a module with biases; a shape
    that differs, as an ``LSTMCell``'s weights in a GRU cell, is torch's ``RuntimeError``). The
    cells' and the sequence layers' ``from_torch`` both end here.
    """
    new = cls(module.input_size, module.hidden_size, **(config | overrides))
    result = new.load_state_dict(module.state_dict(), strict=False)
    if result.unexpected_keys:
        raise ValueError(f"{cls.__name__}.from_torch: unexpected keys {result.unexpected_keys}")
    return new
