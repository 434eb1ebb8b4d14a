"""Argument checks of the registered ops ``torch.ops.layernorm.*``.

The ops are public: they appear in every compiled or exported graph and can be called directly,
so each one checks what it is given before any backend (and, on the CPU, C code reading raw
pointers) sees it. Every check raises ``TypeError`` (wrong kind or dtype) or ``ValueError``
(wrong shape, device, layout or value) naming the op, the argument, what was expected and what
came. Rows are ``x`` of shape ``(M, N)``; statistics are ``(M,)`` in ``stats_dtype(x.dtype)``.
"""

from __future__ import annotations

import math

from torch import Tensor

from .._validation import FLOAT_DTYPES, stats_dtype


def _tensor(op: str, name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must be a floating-point tensor, got dtype {t.dtype}")
    return t


def _layout(op: str, name: str, t: Tensor, shape: tuple[int, ...], dims: str, x: Tensor) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{op}: {name} must have shape {dims} = {shape}, got {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"{op}: {name} is on {t.device} but x is on {x.device}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous, got strides {t.stride()}")


def rows(op: str, x: object) -> tuple[int, int]:
    """``x``: a contiguous 2-D floating-point tensor with at least one column; returns (M, N)."""
    x = _tensor(op, "x", x)
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D (rows M, columns N), got shape {tuple(x.shape)}")
    if x.shape[1] < 1:
        raise ValueError(f"{op}: x must have at least one column, got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{op}: x must be contiguous, got strides {x.stride()}")
    return int(x.shape[0]), int(x.shape[1])


def grad(op: str, name: str, g: object, x: Tensor) -> None:
    """An incoming gradient: x's shape and device (any layout: the op makes it contiguous)."""
    g = _tensor(op, name, g)
    if tuple(g.shape) != tuple(x.shape):
        raise ValueError(f"{op}: {name} must have x's shape {tuple(x.shape)}, got {tuple(g.shape)}")
    if g.device != x.device:
        raise ValueError(f"{op}: {name} is on {g.device} but x is on {x.device}")


def vector(op: str, name: str, p: object, x: Tensor) -> None:
    """An optional per-column gain or bias: ``None`` or a contiguous ``(N,)`` float tensor."""
    if p is None:
        return
    _layout(op, name, _tensor(op, name, p), (int(x.shape[1]),), "(N,)", x)


def stats(op: str, name: str, s: object, x: Tensor) -> None:
    """A per-row statistic saved by the forward: contiguous ``(M,)`` in ``stats_dtype(x.dtype)``."""
    s = _tensor(op, name, s)
    want = stats_dtype(x.dtype)
    if s.dtype != want:
        raise TypeError(f"{op}: {name} must have dtype {want} (for x of {x.dtype}), got {s.dtype}")
    _layout(op, name, s, (int(x.shape[0]),), "(M,)", x)


def _real(op: str, name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TypeError(f"{op}: {name} must be a float, got {type(v).__name__} {v!r}")
    if not math.isfinite(v):
        raise ValueError(f"{op}: {name} must be finite, got {v!r}")
    return float(v)


def eps(op: str, v: object) -> None:
    """``eps``: finite and >= 0 (a negative eps makes the variance of a near-constant row
    negative: NaN)."""
    if _real(op, "eps", v) < 0:
        raise ValueError(f"{op}: eps must be >= 0, got {v!r}")


def finite(op: str, name: str, v: object) -> None:
    _real(op, name, v)
