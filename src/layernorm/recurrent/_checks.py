"""Argument and input checks for the recurrent cells and layers.

Errors name the module, what was expected and what came, so the call can be fixed from the message.
"""

from __future__ import annotations

import itertools
import math
import numbers

import torch
from torch import Tensor

from .._validation import as_int, check_float_tensor, sizes_of

NORMS = ("layer", "none", "batch")


def check_size(value: object, name: str, owner: str) -> int:
    """A positive int (NumPy integers too); ``TypeError`` for another kind, as torch's RNNs."""
    size = as_int(value)
    if size is None:
        raise TypeError(
            f"{owner}: {name} must be a positive int, got {type(value).__name__} {value!r}"
        )
    if size <= 0:
        raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")
    return size


def check_gain(value: object, name: str, owner: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | numbers.Real):
        raise TypeError(
            f"{owner}: {name} must be a finite float, got {type(value).__name__} {value!r}"
        )
    if not math.isfinite(value):
        raise ValueError(f"{owner}: {name} must be a finite float, got {value!r}")
    return float(value)


def check_eps(value: object, owner: str) -> float:
    eps = check_gain(value, "eps", owner)
    if eps <= 0:
        raise ValueError(f"{owner}: eps must be positive, got {value!r}")
    return eps


def check_norm(norm: object, owner: str, allowed: tuple[str, ...] = NORMS) -> str:
    if norm not in allowed:
        raise ValueError(f"{owner}: norm must be one of {allowed}, got {norm!r}")
    return norm  # type: ignore[return-value]


def check_like(t: object, name: str, like: Tensor, owner: str) -> Tensor:
    """``t`` is a float tensor with ``like``'s dtype and device."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{owner}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != like.dtype and not torch.is_autocast_enabled(like.device.type):
        raise TypeError(f"{owner}: {name} has dtype {t.dtype} but the input has dtype {like.dtype}")
    if t.device != like.device:
        raise ValueError(f"{owner}: {name} is on {t.device} but the input is on {like.device}")
    return t


def check_params_match(x: Tensor, weight: Tensor, owner: str) -> None:
    """Input and weights share dtype and device; under autocast the dtypes may differ (a bfloat16
    activation from an autocast Linear meets float32 weights, and autocast casts the GEMMs)."""
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(
            f"{owner}: input has dtype {x.dtype} but the weights are {weight.dtype}; "
            f"convert one (e.g. module.to({x.dtype}))"
        )
    if x.device != weight.device:
        raise ValueError(f"{owner}: input is on {x.device} but the weights are on {weight.device}")


def check_state(
    t: object, name: str, expected: tuple[int, ...], like: Tensor, owner: str
) -> Tensor:
    t = check_like(t, name, like, owner)
    if sizes_of(t) != expected:
        raise ValueError(f"{owner}: {name} must have shape {expected}, got {sizes_of(t)}")
    return t


def describe(value: object) -> str:
    """How an error names what came: the type, and the length of a tuple or list (a 3-tuple given
    where ``(h, c)`` was expected is "a tuple of 3 items", not just "tuple")."""
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)} items"
    return type(value).__name__


def check_cell_input(x: object, input_size: int, owner: str) -> tuple[Tensor, bool]:
    """A cell takes ``(B, input_size)`` or unbatched ``(input_size,)``; returns (x, batched)."""
    x = check_float_tensor(x)
    if x.dim() not in (1, 2) or sizes_of(x)[-1] != input_size:
        raise ValueError(
            f"{owner}(input_size={input_size}) expects input of shape (batch, {input_size}) or "
            f"({input_size},), got {tuple(x.shape)}"
        )
    return x, x.dim() == 2


def check_batch_sizes(batch_sizes: Tensor, n_rows: int, owner: str) -> list[int]:
    """``PackedSequence.batch_sizes``: 1-D, positive, non-increasing, summing to the data rows."""
    if batch_sizes.dim() != 1 or batch_sizes.numel() == 0:
        raise ValueError(
            f"{owner}: PackedSequence.batch_sizes must be a non-empty 1-D tensor, "
            f"got shape {tuple(batch_sizes.shape)}"
        )
    sizes = [int(b) for b in batch_sizes.tolist()]
    if any(b <= 0 for b in sizes) or any(a < b for a, b in itertools.pairwise(sizes)):
        raise ValueError(
            f"{owner}: PackedSequence.batch_sizes must be positive and non-increasing (sequences "
            f"sorted by decreasing length; pack with torch.nn.utils.rnn.pack_padded_sequence("
            f"..., enforce_sorted=False) for unsorted batches), got {sizes}"
        )
    if sum(sizes) != n_rows:
        raise ValueError(
            f"{owner}: PackedSequence.batch_sizes sum to {sum(sizes)} but data has {n_rows} rows"
        )
    return sizes


def check_permutation(idx: Tensor | None, n: int, name: str, owner: str) -> None:
    if idx is None:
        return
    ok = idx.dim() == 1 and idx.numel() == n
    if ok:
        ok = bool(torch.equal(torch.sort(idx.cpu()).values, torch.arange(n, device="cpu")))
    if not ok:
        raise ValueError(
            f"{owner}: PackedSequence.{name} must be a permutation of range({n}) "
            f"(one index per sequence), got "
            f"{idx.tolist() if idx.numel() <= 16 else tuple(idx.shape)}"
        )


def check_parameter(
    p: object, name: str, shape: tuple[int, ...], like: Tensor, same_dtype: bool, owner: str
) -> None:
    """A registered parameter as the module built it: a float tensor of ``shape`` on the input's
    device, in the input's dtype where ``same_dtype`` (outside autocast).

    ``load_state_dict(..., assign=True)`` and attribute assignment can put any tensor in a
    parameter's place; the fused path hands parameters to C as raw pointers, so a wrong one is
    refused here, for both paths, rather than read out of bounds."""
    if not isinstance(p, Tensor):
        raise TypeError(f"{owner}: parameter {name} must be a tensor, got {type(p).__name__}")
    if not p.is_floating_point():
        raise TypeError(f"{owner}: parameter {name} must be floating point, got dtype {p.dtype}")
    if sizes_of(p) != shape:
        raise ValueError(f"{owner}: parameter {name} must have shape {shape}, got {sizes_of(p)}")
    if p.device != like.device:
        raise ValueError(
            f"{owner}: parameter {name} is on {p.device} but the input is on {like.device}"
        )
    if same_dtype and p.dtype != like.dtype and not torch.is_autocast_enabled(like.device.type):
        raise TypeError(
            f"{owner}: parameter {name} has dtype {p.dtype} but the input has dtype {like.dtype}; "
            f"convert it (e.g. module.to({like.dtype}))"
        )


def check_probability(value: object, name: str, owner: str, *, allow_one: bool = False) -> float:
    """A probability in ``[0, 1)`` (``[0, 1]`` with ``allow_one``): dropout rates exclude 1 (the
    kept values are scaled by ``1/(1 − p)``), a zoneout rate may be 1 (the state never updates)."""
    interval = "[0, 1]" if allow_one else "[0, 1)"
    if isinstance(value, bool) or not isinstance(value, int | float | numbers.Real):
        raise TypeError(
            f"{owner}: {name} must be a number in {interval}, got {type(value).__name__} {value!r}"
        )
    p = float(value)
    if not (0.0 <= p < 1.0 or (allow_one and p == 1.0)):
        raise ValueError(f"{owner}: {name} must be a number in {interval}, got {value!r}")
    return p
