r"""Recurrent batch normalization (Cooijmans et al. 2016), the baseline of the LN paper's QA task.

.. math::
    (i, f, g, o) = BN(W_{hh} h_{t-1}; γ_h, 0) + BN(W_{ih} x_t; γ_x, 0) + b \\
    c_t = σ(f)⊙c_{t-1} + σ(i)⊙\tanh(g),\qquad h_t = σ(o)⊙\tanh(BN(c_t; γ_c, β_c))

Each BN normalizes every unit over the batch (biased variance in training, like
:class:`torch.nn.BatchNorm1d`) and keeps **separate running statistics per time step**
``t < max_steps``; steps ``t ≥ max_steps`` share the statistics of step ``max_steps − 1`` (in
training they keep updating that last slot). The γ are shared across time and initialized to 0.1
(``bn_gain_init``), as Cooijmans et al. recommend; the shift of the two gate BNs is fixed at 0 (the
LSTM bias ``b`` does its job). In a packed batch, step ``t`` normalizes over the sequences still
running at ``t`` only, so padding never enters the statistics; a step with a single running sequence
cannot be batch-normalized in training and raises.

@article{cooijmans2016recurrent, title={Recurrent Batch Normalization},
  author={Cooijmans, Tim and Ballas, Nicolas and Laurent, C{\'e}sar and G{\"u}l{\c{c}}ehre,
  {\c{C}}a{\u{g}}lar and Courville, Aaron}, journal={arXiv:1603.09025}, year={2016}}
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from .._validation import sizes_of
from ._steps import Norm


def make_step_bn(
    running_mean: Tensor,
    running_var: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    t: int,
    training: bool,
    momentum: float,
    eps: float,
) -> Norm:
    """BN of time step ``t`` over the batch rows: statistics slot ``min(t, max_steps − 1)``.

    ``running_mean``/``running_var`` are ``(max_steps, units)`` buffers; the row views are updated
    in place by :func:`torch.nn.functional.batch_norm` in training.
    """
    slot = min(t, sizes_of(running_mean)[0] - 1)

    def norm(z: Tensor) -> Tensor:
        if training and z.shape[0] < 2:
            raise ValueError(
                f"recurrent batch norm at time step {t} got {z.shape[0]} example(s): batch "
                "statistics need at least 2 in training (use norm='layer', which does not depend "
                "on the batch)"
            )
        return F.batch_norm(
            z, running_mean[slot], running_var[slot], weight, bias, training, momentum, eps
        )

    return norm
