"""Argument checks shared by the functional ops, modules and recurrent layers.

Every check raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, wrong value)
with a message that names what was expected and what came, so a user can fix the call.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
HALF_DTYPES = (torch.float16, torch.bfloat16)

ShapeLike = int | Sequence[int] | torch.Size


def sizes_of(t: Tensor) -> tuple[int, ...]:
    """``t``'s sizes as ints. Under ``torch.jit.trace`` ``t.shape`` holds 0-d tensors that record
    how each size is used, and comparing one with an int prints a TracerWarning. A check needs only
    the example's sizes (the graph it leads to is recorded for them), so they are read with the
    tracer set aside; everywhere else this is ``tuple(t.shape)``."""
    state = torch._C._get_tracing_state()
    if state is None:
        return tuple(t.shape)
    torch._C._set_tracing_state(None)
    try:
        return tuple(t.shape)
    finally:
        torch._C._set_tracing_state(state)


def as_int(value: object) -> int | None:
    """``value`` as an int if it is one: Python and NumPy integers, 0-d integer tensors (what
    ``x.shape[-1]`` is under ``torch.jit.trace``), anything with ``__index__``; bools are not.
    ``None`` otherwise."""
    if type(value) is int:
        return value
    if isinstance(value, bool | float):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def as_shape(normalized_shape: ShapeLike, name: str = "normalized_shape") -> tuple[int, ...]:
    """Turn an int or a sequence of ints into a tuple, rejecting anything else."""
    shape = normalized_shape
    if type(shape) is tuple and (
        # the modules' case, on every call: nothing to convert (one size: no generator's cost)
        (len(shape) == 1 and type(shape[0]) is int and shape[0] > 0)
        or (shape and all(type(d) is int and d > 0 for d in shape))
    ):
        return shape
    if isinstance(normalized_shape, bool | str | bytes):
        # a str is a Sequence too: reject it here rather than complain about its characters
        raise TypeError(
            f"{name} must be an int or a sequence of ints, "
            f"got {type(normalized_shape).__name__} {normalized_shape!r}"
        )
    single = as_int(normalized_shape)
    if single is not None:
        given: tuple[object, ...] = (single,)
    elif isinstance(normalized_shape, Sequence | torch.Size):
        given = tuple(normalized_shape)
    else:
        raise TypeError(
            f"{name} must be an int or a sequence of ints, got {type(normalized_shape).__name__}"
        )
    if len(given) == 0:
        raise ValueError(f"{name} must name at least one dimension, got ()")
    sizes = [as_int(d) for d in given]
    if any(d is None for d in sizes):
        raise TypeError(f"{name} must contain ints, got {given!r}")
    shape = tuple(d for d in sizes if d is not None)
    if any(d <= 0 for d in shape):
        raise ValueError(f"{name} must contain positive sizes, got {shape!r}")
    return shape


def check_flag(value: object, name: str, owner: str) -> bool:
    """A bool (NumPy's too, and the ints 0 and 1). Anything else is refused rather than read by its
    truth value: ``detach_std="no"`` would otherwise switch DetachNorm on."""
    if type(value) is bool:
        return value
    kind = type(value)
    numpy_bool = kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")
    integral = numpy_bool or isinstance(value, numbers.Integral)
    if integral and value in (0, 1):
        return bool(value)
    raise TypeError(f"{owner}: {name} must be a bool, got {type(value).__name__} {value!r}")


def check_float_tensor(x: object, name: str = "input") -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a floating-point tensor (float64, float32, float16 or bfloat16), "
            f"got dtype {x.dtype}"
        )
    return x


def check_input(x: object, normalized_shape: ShapeLike, op: str) -> tuple[Tensor, tuple[int, ...]]:
    """Check ``x`` ends with ``normalized_shape``; return both in canonical form."""
    shape = as_shape(normalized_shape)
    x = check_float_tensor(x, f"{op}: input")
    k = len(shape)
    given = sizes_of(x)
    if len(given) < k or given[len(given) - k :] != shape:
        raise ValueError(
            f"{op}(normalized_shape={shape}) got input of shape {given}: "
            f"its last {k} dimension(s) must be {shape}"
        )
    return x, shape


def check_param(
    p: Tensor | None, name: str, shape: tuple[int, ...], x: Tensor, op: str
) -> Tensor | None:
    """Check an elementwise weight or bias: shape ``normalized_shape``, float, on ``x``'s device."""
    if p is None:
        return None
    check_float_tensor(p, f"{op}: {name}")
    if sizes_of(p) != shape:
        raise ValueError(
            f"{op}: {name} must have shape normalized_shape={shape}, got {sizes_of(p)}"
        )
    if p.device != x.device:
        raise ValueError(f"{op}: {name} is on {p.device} but input is on {x.device}")
    return p


def _finite(v: float) -> bool:
    # Plain comparisons rather than math.isfinite: under torch.compile(dynamic=True) a float
    # argument's default can arrive as a symbolic float, which math.isfinite cannot trace.
    # NaN fails both comparisons.
    return -math.inf < v < math.inf


def _is_real(v: object) -> bool:
    """A real number that is not a bool: Python's int/float and NumPy's scalars (``np.float32``
    from a config array, say), which :class:`numbers.Real` covers."""
    return not isinstance(v, bool) and isinstance(v, int | float | numbers.Real)


def check_eps(eps: object, op: str, allow_none: bool = False) -> float | None:
    if eps is None and allow_none:
        return None
    if not _is_real(eps):
        raise TypeError(f"{op}: eps must be a positive float, got {type(eps).__name__} {eps!r}")
    if not _finite(eps) or eps <= 0:  # type: ignore[operator]
        raise ValueError(f"{op}: eps must be a positive finite float, got {eps!r}")
    return float(eps)  # type: ignore[arg-type]


def check_finite_scalar(v: object, name: str, op: str) -> float:
    if not _is_real(v):
        raise TypeError(f"{op}: {name} must be a finite float, got {type(v).__name__} {v!r}")
    if not _finite(v):  # type: ignore[arg-type]
        raise ValueError(f"{op}: {name} must be a finite float, got {v!r}")
    return float(v)  # type: ignore[arg-type]


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics are kept in float32 for half types, in the input's precision otherwise."""
    return torch.float32 if dtype in HALF_DTYPES else dtype
