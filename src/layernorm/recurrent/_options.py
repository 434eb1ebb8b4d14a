r"""The recurrent layers' regularizers: their masks, drawn before a direction runs, and rules.

The sequence layers draw every mask before a direction runs and hand the masks to the step
functions as tensors, so every path computes the same thing from the same masks (the tests
replace the layers' ``_draw_masks`` by given masks and compare with the published formulas).

* **DropConnect on the recurrent weights** (Wan et al. 2013; haste's ``dropout``): in training
  ``W̃_hh = M ⊙ W_hh / (1 − p)`` with ``M ~ Bernoulli(1 − p)`` of ``W_hh``'s shape, one ``M`` per
  forward call, layer and direction, shared by all time steps; at eval ``W̃_hh = W_hh``. The
  ``1/(1 − p)`` scaling (as haste and AWD-LSTM's weight drop) makes eval the identity. The gradient
  reaches the kept weights only (``∂L/∂W_hh = M ⊙ ∂L/∂W̃_hh / (1 − p)``).
* **Zoneout** (Krueger et al. 2016): ``h_t = d_t ⊙ h_{t−1} + (1 − d_t) ⊙ h̃_t`` with
  ``d_t ~ Bernoulli(p)`` per unit, example and step in training, and the expectation
  ``p h_{t−1} + (1 − p) h̃_t`` at eval; the same for ``c`` with its own rate. ``h̃_t``, ``c̃_t`` are
  the states the cell would produce without zoneout; the layer's output at ``t`` is the zoned
  ``h_t``. The coefficient tensor ``d`` (``{0, 1}`` in training, ``p`` at eval) is what the step
  takes.
* **Recurrent dropout** (Semeniuta et al. 2016, as TF-Addons' ``LayerNormLSTMCell``): dropout on
  the candidate, not on the state: LSTM ``c_t = σ(f) ⊙ c_{t−1} + σ(i) ⊙ m ⊙ tanh(g)``, GRU
  ``h_t = (1 − z) ⊙ (m ⊙ n_t) + z ⊙ h_{t−1}``, with ``m = Bernoulli(1 − p)/(1 − p)`` per unit and
  example, one mask per sequence (the same at every step); identity at eval.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class Masks(NamedTuple):
    """The masks of one layer in one direction for one forward call (``None`` = option off).

    ``w_hh``: ``(G·H, P)`` scaled DropConnect mask (``{0, 1/(1 − p)}``), multiplied into ``W_hh``.
    ``zoneout_h`` / ``zoneout_c``: ``(N, P)`` / ``(N, H)`` zoneout coefficients ``d`` per packed
    row (``N`` rows of the packed sequence, a step's rows ``[off, off + bs)``, time-major for a
    padded input), ``P`` the size of ``h`` (``proj_size`` or ``H``).
    ``candidate``: ``(B, H)`` scaled recurrent-dropout mask, one row per sequence (a step of
    ``bs`` rows uses rows ``[:bs]``, as the state buffers).
    """

    w_hh: Tensor | None = None
    zoneout_h: Tensor | None = None
    zoneout_c: Tensor | None = None
    candidate: Tensor | None = None


def dropout_mask(shape: tuple[int, ...], p: float, like: Tensor) -> Tensor:
    """``Bernoulli(1 − p) / (1 − p)`` of ``shape`` in ``like``'s dtype and device."""
    keep = 1.0 - p
    return torch.empty(shape, dtype=like.dtype, device=like.device).bernoulli_(keep).div_(keep)


def zoneout_coefficients(shape: tuple[int, ...], p: float, training: bool, like: Tensor) -> Tensor:
    """The zoneout ``d``: ``Bernoulli(p)`` in training, the constant ``p`` at eval (one value
    broadcast to ``shape``, not a buffer of it)."""
    if training:
        return torch.empty(shape, dtype=like.dtype, device=like.device).bernoulli_(p)
    return torch.full((1,) * len(shape), p, dtype=like.dtype, device=like.device).expand(shape)


def zoneout(d: Tensor | None, previous: Tensor, new: Tensor) -> Tensor:
    """``d ⊙ previous + (1 − d) ⊙ new`` (``new`` where ``d`` is ``None``)."""
    if d is None:
        return new
    return d * previous + (1.0 - d) * new
