"""Which kernel backend runs an op: ``"cpu"`` (ATen compositions, any device) or ``"triton"``.

CUDA tensors use Triton when it is installed; everything else uses the ATen path. Tests force the
Triton kernels onto CPU tensors under ``TRITON_INTERPRET=1`` with :func:`force_backend`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
from collections.abc import Iterator
from typing import Literal

from torch import Tensor

Backend = Literal["cpu", "triton"]
_BACKENDS = ("cpu", "triton")
_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "layernorm_backend", default=None
)


@functools.cache
def triton_available() -> bool:
    """True when Triton imports and can run here (a GPU, or the interpreter)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install must not break the CPU path
        return False
    return True


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@contextlib.contextmanager
def force_backend(name: Backend | None) -> Iterator[None]:
    """Run the ops in this block on backend ``name`` (``None`` restores automatic selection)."""
    if name is not None and name not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS} or None, got {name!r}")
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


def select_backend(x: Tensor) -> Backend:
    forced = _forced.get() or os.environ.get("LAYERNORM_BACKEND") or None
    if forced is not None:
        if forced not in _BACKENDS:
            raise ValueError(f"LAYERNORM_BACKEND must be one of {_BACKENDS}, got {forced!r}")
        if forced == "triton" and not triton_available():
            raise RuntimeError("backend 'triton' was requested but Triton is not installed")
        return forced  # type: ignore[return-value]
    if x.is_cuda and triton_available():
        return "triton"
    return "cpu"
