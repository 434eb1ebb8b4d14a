"""Shared fixtures and helpers for the core tests.

Inputs are drawn with a non-zero mean and a non-unit scale, since a zero-mean unit-variance input
hides centering and scaling bugs (LN of such rows is nearly the identity).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings

# Property tests: few examples, no per-example deadline (the shared machine has noisy timings).
settings.register_profile("core", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("core")

ALL_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def python_training_node():
    """The LN-LSTM's planned training calls on their Python node: for tests that watch the
    Python functions a call goes through (spies on the kernels' wrappers, the buffer cache),
    which the C++ node (``csrc_torch/rnn_ops.cpp``) calls from C++ instead. That node is
    checked against the Python paths bit for bit in ``test_recurrent_planned.py``."""
    from layernorm.kernels.cpu import torch_ops

    with torch_ops.switched(False):
        yield


def make_x(
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    *,
    offset: float = 3.0,
    scale: float = 2.0,
    requires_grad: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Random input rounded to ``dtype``: ``offset + scale·N(0, 1)`` plus a per-row shift.

    The per-row shift makes rows differ in mean, so a kernel mixing rows up would be caught.
    """
    x = torch.randn(shape, dtype=torch.float64, generator=generator) * scale + offset
    if len(shape) >= 2:
        row_shift = torch.linspace(-1.0, 1.0, shape[0], dtype=torch.float64)
        x = x + row_shift.view(-1, *[1] * (len(shape) - 1))
    return x.to(dtype).requires_grad_(requires_grad)


def make_param(
    n: tuple[int, ...], dtype: torch.dtype, *, center: float, requires_grad: bool = False
) -> torch.Tensor:
    """A gain (center 1) or bias (center 0) with spread, so the identity init hides nothing."""
    p = center + 0.5 * torch.randn(n, dtype=torch.float64)
    return p.to(dtype).requires_grad_(requires_grad)


def upcast(t: torch.Tensor | None) -> torch.Tensor | None:
    """The float64 copy of an already rounded tensor: the reference sees the same inputs."""
    return None if t is None else t.detach().double().requires_grad_(t.requires_grad)
