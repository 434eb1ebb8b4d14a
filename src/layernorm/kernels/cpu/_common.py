"""Dtype handling shared by the ATen backend."""

from __future__ import annotations

import torch
from torch import Tensor

from ..._validation import stats_dtype


def compute_dtype(x: Tensor) -> torch.dtype:
    """Half types are computed in float32 here; float32/float64 in their own precision."""
    return stats_dtype(x.dtype)


def to_compute(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if t is None else t.to(dtype)
