"""One time step of each recurrence, written as the papers' equations: the reference.

Every function here is plain differentiable PyTorch on top of the library's layer norm. The cells
call them once per step, the sequence layers' reference loop calls them over time, and the tests use
them as the oracle for the fused sequence path in :mod:`layernorm.recurrent._fused`.

A normalization is passed in as a callable ``norm(z) -> z'`` (``None`` = identity), so the same step
serves layer norm, recurrent batch norm (statistics per time step) and the plain recurrence.

Parameter layout follows ``torch.nn.RNN/LSTM/GRU``: ``w_ih`` is ``(G·H, I)``, ``w_hh`` is
``(G·H, H)`` with gates stacked in torch's order (LSTM ``i, f, g, o``; GRU ``r, z, n``). The four
travel together as :class:`Weights`, what a cell's or a layer direction's ``_weights()`` returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..functional import layer_norm
from ..ops._dispatch import TORCH_INFERENCE_BYTES, lean_input, plain_eager, torch_layer_norm

Norm = Callable[[Tensor], Tensor]

#: The layer norms of each recurrence (``"RNN"``, ``"LSTM"``, ``"GRU"``), in parameter order: the
#: name suffix of ``ln_weight*`` / ``ln_bias*`` and the units in multiples of H. The LN-RNN
#: normalizes the summed pre-activation once; the LN-LSTM each projection (four gates together) and
#: the cell state; the LN-GRU each projection, as two groups (:func:`make_grouped_ln`). Cells and
#: sequence layers both register their gains and biases from this table.
LN_PARTS: dict[str, tuple[tuple[str, int], ...]] = {
    "RNN": (("", 1),),
    "LSTM": (("_ih", 4), ("_hh", 4), ("_c", 1)),
    "GRU": (("_ih", 3), ("_hh", 3)),
}


class Weights(NamedTuple):
    """torch's four parameters of one cell, or of one layer in one direction.

    ``w_ih`` ``(G·H, I)``, ``w_hh`` ``(G·H, H)``, ``b_ih`` and ``b_hh`` ``(G·H,)`` (``None`` when
    the module has ``bias=False``), with the ``G`` gates stacked in torch's order.
    """

    w_ih: Tensor
    w_hh: Tensor
    b_ih: Tensor | None
    b_hh: Tensor | None


def _ln(z: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, lean: bool) -> Tensor:
    """``LN(z; weight, bias)`` over the last dimension; with ``lean`` torch's kernel first where
    it computes the same (:func:`..ops._dispatch.torch_layer_norm`), else the fused kernels."""
    if lean:
        y = torch_layer_norm(z, (z.shape[-1],), weight, bias, eps)
        if y is not None:
            return y
    return layer_norm(z, z.shape[-1], weight, bias, eps)


def make_ln(weight: Tensor | None, bias: Tensor | None, eps: float, lean: bool = False) -> Norm:
    """``LN(z; weight, bias)`` over the last dimension of ``z``. ``lean``: torch's kernel where
    :class:`layernorm.LayerNorm` takes it (the cells: a step's call is mostly Python, and a
    custom op's costs more than torch's C++ node); the sequence layers' reference loop, the
    fused path's oracle in the tests, runs the fused kernels."""
    return lambda z: _ln(z, weight, bias, eps, lean)


def make_grouped_ln(
    weight: Tensor | None, bias: Tensor | None, eps: float, hidden_size: int, lean: bool = False
) -> Norm:
    """GRU layer norm on a ``(*, 3H)`` pre-activation: the ``(r, z)`` block (2H units) and the
    candidate block ``n`` (H units) are normalized separately, as in the paper's LN-GRU.
    ``lean`` as :func:`make_ln`'s."""
    sizes = (2 * hidden_size, hidden_size)

    def norm(z: Tensor) -> Tensor:
        # by split, one op (and one backward node) for both blocks where slices took two
        w_rz, w_n = (None, None) if weight is None else weight.split(sizes)
        b_rz, b_n = (None, None) if bias is None else bias.split(sizes)
        z_rz, z_n = z.split(sizes, dim=-1)
        return torch.cat((_ln(z_rz, w_rz, b_rz, eps, lean), _ln(z_n, w_n, b_n, eps, lean)), dim=-1)

    return norm


def _apply(norm: Norm | None, z: Tensor) -> Tensor:
    return z if norm is None else norm(z)


def _add_bias(z: Tensor, b_ih: Tensor | None, b_hh: Tensor | None) -> Tensor:
    if b_ih is not None:
        z = z + b_ih
    if b_hh is not None:
        z = z + b_hh
    return z


def rnn_step(
    x: Tensor, h: Tensor, weights: Weights, norm: Norm | None, nonlinearity: str
) -> Tensor:
    r"""Eq. 4 of Ba et al.: :math:`a_t = W_{hh}h_{t-1} + W_{xh}x_t`,
    :math:`h_t = f(\frac{g}{\sigma_t}\odot(a_t-\mu_t) + b)` with ``b = β + b_ih + b_hh``."""
    w_ih, w_hh, b_ih, b_hh = weights
    a = _apply(norm, F.linear(x, w_ih) + F.linear(h, w_hh))
    if a.requires_grad or not plain_eager():
        a = _add_bias(a, b_ih, b_hh)
        return torch.tanh(a) if nonlinearity == "tanh" else torch.relu(a)
    # nothing recorded (no gradient, no tracer or transform: a trace's graph may not depend on
    # whether gradients are on): a is this step's own tensor, updated in place (no allocation)
    return _biased_nonlinearity_(a, b_ih, b_hh, nonlinearity)


def _biased_nonlinearity_(
    a: Tensor, b_ih: Tensor | None, b_hh: Tensor | None, nonlinearity: str
) -> Tensor:
    """``f(a + b_ih + b_hh)`` in place in ``a`` (a step's own tensor, where nothing is recorded)."""
    if b_ih is not None:
        a.add_(b_ih)
    if b_hh is not None:
        a.add_(b_hh)
    return a.tanh_() if nonlinearity == "tanh" else a.relu_()


def elman_inference_step(
    x: Tensor,
    h: Tensor | None,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None,
    b_hh: Tensor | None,
    ln_weight: Tensor | None,
    ln_bias: Tensor | None,
    eps: object,
    nonlinearity: str,
) -> Tensor | None:
    r""":func:`rnn_step` where nothing is recorded, in the fewest calls of torch's ops: ``x W_ihᵀ``,
    then ``h W_hhᵀ`` added in place (one ``addmm_``), ``torch.layer_norm`` (the same forward
    formula; below :data:`..ops._dispatch.TORCH_INFERENCE_BYTES` of output), the biases and
    the nonlinearity in place. ``None`` for anything else, which the caller's own path checks
    and names what is wrong with: a tracer, transform, autocast (which casts the products, where
    the in-place ops would not follow) or forced backend, rows ``x`` and ``h`` that are not
    ``(B, I)`` and ``(B, H)`` float32 / float64 CPU tensors of the weights' dtype (B > 0; I and
    H the weights' ``(H, I)`` and ``(H, H)``), an ``eps`` that is not a positive float. A half
    step keeps the ops, which round each product, as torch's cell does. ``h`` ``None``: the zero
    state, whose product is left out.

    Its checks are a few attribute reads, all the call needs, so the Elman cell and layer take
    it before their own checks (a decoder's token pays for every frame of Python)."""
    # first what no shape is read without (under a tracer a size is a traced value): x a plain
    # CPU float tensor, eps a positive float, no tracer, transform or forced backend
    if not lean_input(x, eps) or torch.is_autocast_enabled("cpu"):
        return None
    dtype = x.dtype
    if (
        (dtype is not torch.float32 and dtype is not torch.float64)
        or w_ih.dtype is not dtype or w_hh.dtype is not dtype
        or x.dim() != 2 or w_ih.dim() != 2 or w_hh.dim() != 2
        or x.shape[1] != w_ih.shape[1] or x.shape[0] == 0
        or w_hh.shape[0] != w_ih.shape[0] or w_hh.shape[0] != w_hh.shape[1]
        or not (w_ih.is_cpu and w_hh.is_cpu)
        or x.shape[0] * w_hh.shape[0] * x.element_size() >= TORCH_INFERENCE_BYTES
    ):  # fmt: skip
        return None
    if h is not None and (
        h.dtype is not dtype or h.dim() != 2 or h.shape != (x.shape[0], w_hh.shape[1])
        or not h.is_cpu
    ):  # fmt: skip
        return None
    a = F.linear(x, w_ih)
    if h is not None:
        a.addmm_(h, w_hh.t())
    y = torch.layer_norm(a, (a.shape[1],), ln_weight, ln_bias, eps)  # type: ignore[arg-type]
    return _biased_nonlinearity_(y, b_ih, b_hh, nonlinearity)


def lstm_step(
    x: Tensor,
    h: Tensor,
    c: Tensor,
    weights: Weights,
    norm_ih: Norm | None,
    norm_hh: Norm | None,
    norm_c: Norm | None,
    carry_normalized: bool = False,
    candidate_mask: Tensor | None = None,
    w_hr: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    r"""LN-LSTM (Ba et al., supplementary), in torch's gate order ``i, f, g, o``:

    .. math::
        (i, f, g, o) = LN(W_{hh}h_{t-1}; α_1, β_1) + LN(W_{ih}x_t; α_2, β_2) + b \\
        c_t = σ(f)⊙c_{t-1} + σ(i)⊙\tanh(g),\qquad h_t = σ(o)⊙\tanh(LN(c_t; α_3, β_3))

    Returns ``(h_t, c_carried)``: the un-normalized ``c_t`` (the paper), or ``LN(c_t)`` when
    ``carry_normalized`` (TF-Addons / PyTorch fastrnns variant).

    ``candidate_mask`` ``m`` is recurrent dropout (Semeniuta et al. 2016):
    ``c_t = σ(f)⊙c_{t−1} + σ(i)⊙m⊙tanh(g)``. ``w_hr`` ``(P, H)`` is torch.nn.LSTM's projection:
    ``h_t = W_{hr}(σ(o)⊙tanh(LN(c_t)))`` of size P.
    """
    w_ih, w_hh, b_ih, b_hh = weights
    gates = _apply(norm_ih, F.linear(x, w_ih)) + _apply(norm_hh, F.linear(h, w_hh))
    gates = _add_bias(gates, b_ih, b_hh)
    i, f, g, o = gates.chunk(4, dim=-1)
    candidate = torch.tanh(g)
    if candidate_mask is not None:
        candidate = candidate * candidate_mask
    c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * candidate
    c_norm = _apply(norm_c, c_new)
    h_new = torch.sigmoid(o) * torch.tanh(c_norm)
    if w_hr is not None:
        h_new = F.linear(h_new, w_hr)
    return h_new, (c_norm if carry_normalized else c_new)


def gru_step(
    x: Tensor,
    h: Tensor,
    weights: Weights,
    norm_ih: Norm | None,
    norm_hh: Norm | None,
    candidate_mask: Tensor | None = None,
) -> Tensor:
    r"""LN-GRU (Ba et al., supplementary) on torch's GRU layout (gates ``r, z, n``):

    .. math::
        (r, z) = σ(LN(W_{h}h_{t-1}) + LN(W_x x_t) + b_{ir,iz} + b_{hr,hz}) \\
        n_t = \tanh(LN(W_{in}x_t) + b_{in} + r ⊙ (LN(W_{hn}h_{t-1}) + b_{hn})) \\
        h_t = (1 - z) ⊙ n_t + z ⊙ h_{t-1}

    This is the paper's ``ĥ_t = tanh(LN(W x_t) + σ(r) ⊙ LN(U h_{t−1}))`` with torch's extra bias
    ``b_hn`` inside the reset product (the LN bias β of ``U h`` plays the same role). torch's ``z``
    is the paper's ``1 − z`` (``h_t = (1 − z)⊙h_{t−1} + z⊙ĥ_t``): the same model with the update
    gate's pre-activation negated, kept so that ``norm="none"`` reproduces ``torch.nn.GRU``.

    ``candidate_mask`` ``m`` is recurrent dropout (Semeniuta et al. 2016) on the candidate:
    ``h_t = (1 − z)⊙(m⊙n_t) + z⊙h_{t−1}``.
    """
    w_ih, w_hh, b_ih, b_hh = weights
    hs = h.shape[-1]
    gx = _apply(norm_ih, F.linear(x, w_ih))
    gh = _apply(norm_hh, F.linear(h, w_hh))
    if b_ih is not None:
        gx = gx + b_ih
    if b_hh is not None:
        gh = gh + b_hh
    # blocks by split and chunk, the update as one lerp: fewer ops, each of which a cell's call
    # pays for in dispatch (and in an autograd node with gradients)
    gx_rz, gx_n = gx.split((2 * hs, hs), dim=-1)
    gh_rz, gh_n = gh.split((2 * hs, hs), dim=-1)
    r, z = torch.sigmoid(gx_rz + gh_rz).chunk(2, dim=-1)
    n = torch.tanh(gx_n + r * gh_n)
    if candidate_mask is not None:
        n = n * candidate_mask
    if n.dtype is not h.dtype or z.dtype is not h.dtype:
        return n + z * (h - n)  # dtypes mixed by autocast, which lerp does not promote
    return torch.lerp(n, h, z)  # n + z ⊙ (h − n) = (1 − z) ⊙ n + z ⊙ h_{t−1}
