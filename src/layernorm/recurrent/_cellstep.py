"""A cell's training step as one autograd node on the C cell kernels (``gru_cell_fwd`` /
``gru_cell_bwd``, ``lstm_cell_fwd`` / ``lstm_cell_bwd`` of :mod:`layernorm.kernels.cpu.rnn_abi`).

A cell's call with gradients is one step of a few rows: by the ops of :mod:`._steps` the LN-GRU's
takes some 27 autograd nodes (the two products, four layer norms with the splits and joins of
their groups, the biases and the gates), the LN-LSTM's some 20, each of which costs microseconds
of dispatch forward and backward, more than its arithmetic. Here the two products run inside the
node, one kernel normalizes them and computes the gates (and the LSTM's ``LN(c_t)``), and the
backward is one kernel (the projections' gradients and the gains' and biases' sums) and the
products' gradients.

Where the C++ operators are loaded (:func:`..kernels.cpu.torch_ops.recurrent_nodes`), a float32
or float64 step runs the same node from C++ (``layernorm_cpu::lstm_cell_step`` and
``::gru_cell_step`` of ``csrc_torch/rnn_ops.cpp``, by a :func:`cell_plan` of the step's
signature): the same products, buffers and kernels in the same order, so the same bits, without
the autograd.Function's Python (:func:`lstm_node`, :func:`gru_node` choose). The Elman cell's
step, a few ops, has no C kernel: its node (``layernorm_cpu::elman_cell_step``,
:func:`elman_node`) runs torch's ops of the step from C++, and their derivatives.

Numerics: the kernels compute in the input's dtype with each row's statistics as the sequence
kernels find them (float64 sums), the same formulas as :func:`._steps.gru_step` and
:func:`._steps.lstm_step` (the tests hold them together). With ``create_graph=True`` the backward
differentiates those step functions themselves, so second derivatives stay available.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..kernels.cpu import rnn, rnn_abi, torch_ops
from ..ops._dispatch import (
    TORCH_KERNEL_NUMEL,
    aliases,
    backend_forced,
    plain_eager,
    reference_backward,
)
from . import _cstep, _steps

#: A GRU cell's parameters in its node's order (after ``x`` and ``h``): torch's weights and
#: biases, then the layer norms' gains and biases of W_ih x and of W_hh h.
GRU_PARAMS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh",
              "ln_weight_ih", "ln_bias_ih", "ln_weight_hh", "ln_bias_hh")  # fmt: skip
#: An LSTM cell's (after ``x``, ``h`` and ``c``): the GRU's, then LN(c_t)'s gain and bias.
LSTM_PARAMS = (*GRU_PARAMS, "ln_weight_c", "ln_bias_c")
#: An Elman cell's (after ``x`` and ``h``): torch's weights and biases, then the layer norm's.
ELMAN_PARAMS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "ln_weight", "ln_bias")


# A cell's training step (and a layer's training call of one step) runs the C cell kernels' node
# up to this many elements of a projection (B·GH), the range measured: the kernels run on one
# thread, and a step's ops thread their pointwise work. AMD EPYC Zen 5, ten GRU steps with
# backward(), µs a step, torch.nn.GRUCell / the ops / the node, one thread: (B, I, H) =
# (1, 64, 128) 103 / 201 / 108, (1, 256, 256) 207 / 304 / 224, (64, 128, 128) 460 / 661 / 468,
# (128, 256, 256) 2682 / 3159 / 2675, (256, 128, 512) 14008 / 15823 / 14220; two threads
# (64, 128, 128) 401 / 661 / 396, (256, 128, 512) 7451 / 8754 / 7816 (RESULTS.md, 2026-11-28).
KERNEL_STEP_MAX_NUMEL = 1 << 19


# A bfloat16 / float16 step runs the node in float32 while its two weights have fewer elements
# than this (G·(I + H)): each step converts them to float32 twice and rounds their gradients
# once, which torch does at about a nanosecond an element, so past a few hundred KiB the
# conversions cost more than the ops' bfloat16 GEMMs save. AMD EPYC Zen 5, one thread, ten
# steps with backward(), µs a step, torch.nn's bfloat16 cell / the node / the ops: GRU
# (B, I, H) = (1, 64, 128) 182 / 194 / 366, (8, 64, 128) 192 / 235 / 387, (16, 128, 128)
# 214 / 299 / 427, (4, 128, 256) 275 / 571 / 477; LSTM (1, 64, 128) 188 / 235 / 305,
# (8, 64, 128) 210 / 298 / 334, (16, 128, 128) (2^17) 241 / 463 / 375, (1, 512, 512) 966 / 4738
# / 1048 (RESULTS.md, 2026-11-28).
HALF_MAX_WEIGHTS = 1 << 17


# An LSTM step of many rows with gradients (a cell's call, or a layer's training call of one
# step) runs the layers' planned node of one step instead (:func:`._planned.lstm_training`: the
# C sequence kernels forward and backward, one autograd node), where the processor's C GEMM
# outpaces torch.mm (_cstep.tile_outpaces_torch_gemm) and the step has at least this many rows
# and multiply-adds in its two products (B·4H·(I + H)). Below either, that node's fixed cost and
# its packing of the weights on every call exceed what its kernels save. AMD EPYC Zen 5, µs a
# cell's step with backward(), the ops / the planned node, one thread (two): (B, I, H) =
# (64, 128, 128) 676 / 526 (653 / 582), (32, 128, 256) 904 / 706 (620 / 531), (32, 256, 256)
# 1231 / 848 (1040 / 959), (32, 512, 512) 4677 / 3714 (3673 / 2148), (128, 256, 256) 3734 / 2192
# (2176 / 1766); not (32, 128, 128) (4 M) 433 / 408 (346 / 373), (32, 64, 64) 237 / 262,
# (16, 512, 512) 2583 / 3034, (1, 64, 128) 160 / 230. A layer's one-step training call, ours /
# torch.nn.LSTM, by the node of C cell kernels (LSTMCellStep) / by the planned node, one
# thread (two): (B, I, H) = (64, 128, 128) 0.82 / 0.68 (0.69 / 0.68), (32, 128, 256) 0.56 / 0.47
# (0.50 / 0.44), (128, 256, 256) 1.07 / 0.82 (0.80 / 0.55), (64, 512, 512) 0.69 / 0.43
# (0.60 / 0.38); (32, 128, 128), below the rule, 1.09 (1.03) (RESULTS.md, 2026-11-28).
PLANNED_STEP_MIN_ROWS = 32
PLANNED_STEP_MIN_MACS = 1 << 23


def planned_step_pays(x: Tensor, hidden: int) -> bool:
    """Whether an LSTM training step of ``x`` (``(B, I)``, ``hidden`` units) runs the layers'
    planned node of one step rather than :class:`LSTMCellStep` or the ops (see above)."""
    rows, inputs = x.shape
    if rows < PLANNED_STEP_MIN_ROWS:
        return False
    if rows * 4 * hidden * (inputs + hidden) < PLANNED_STEP_MIN_MACS:
        return False
    return x.dtype in rnn_abi.RNN_INSTANCES and x.is_cpu and _cstep.tile_outpaces_torch_gemm()


def node_context() -> bool:
    """Whether a step may run as one node of the C kernels: gradients on, plain eager (no tracer
    or transform, which would not see inside the node), no autocast (whose casts the ops make),
    no forced backend (which the ops' layer norms honour)."""
    return (
        torch.is_grad_enabled()
        and plain_eager()
        and not torch.is_autocast_enabled("cpu")
        and not backend_forced()
    )


def registered_params(
    module: Any, names: tuple[str, ...], suffix: str, dtype: torch.dtype
) -> list[Any] | None:
    """``module``'s parameters ``names`` (each with ``suffix``; the two weights first) for a node
    of the C kernels, or ``None`` where the step's ops must run: a parametrization, a plain
    tensor in a parameter's place (the ops read it), a parameter not of ``dtype`` or not
    contiguous, a missing weight (the ops name it)."""
    if module._modules.get("parametrizations") is not None:
        return None
    params = [module._parameters.get(n + suffix) for n in names]
    for name, p in zip(names, params, strict=True):
        if p is None and module._get(name + suffix) is not None:
            return None
        if p is not None and (p.dtype is not dtype or not p.is_contiguous()):
            return None
    return None if params[0] is None or params[1] is None else params


def node_params(
    module: Any, names: tuple[str, ...], suffix: str, x: Tensor, hidden: int
) -> list[Any] | None:
    """The parameters ``names`` (:data:`GRU_PARAMS` or :data:`LSTM_PARAMS`, each with
    ``suffix``) for a step of ``x`` by this module's node, or ``None`` where the step's ops run
    it: outside :func:`node_context`, past :data:`KERNEL_STEP_MAX_NUMEL`, an input the kernels
    do not take (float32 / float64 on the CPU, kernels built; bfloat16 / float16 below
    :data:`HALF_MAX_WEIGHTS`), or :func:`registered_params`."""
    if not node_context():
        return None  # (a tracer's sizes are tensors: the arithmetic comes after)
    gates = 4 if names is LSTM_PARAMS else 3
    if x.shape[0] * gates * hidden > KERNEL_STEP_MAX_NUMEL:
        return None
    if x.dtype in _HALF_DTYPES:  # computed in float32 (see GRUCellStep), small weights only
        inputs = module._get("weight_ih" + suffix)
        if inputs is None or gates * hidden * (inputs.shape[1] + hidden) >= HALF_MAX_WEIGHTS:
            return None
        if not rnn.available(x.new_empty(0, dtype=torch.float32)):
            return None
    elif x.dtype not in rnn_abi.RNN_INSTANCES or not rnn.available(x):
        return None
    return registered_params(module, names, suffix, x.dtype)


_HALF_DTYPES = (torch.bfloat16, torch.float16)

# The cells' plans of the C++ node, by signature (cell, dtype, rows, inputs, hidden, eps, the
# kernels' configuration); cleared when full.
_CELL_PLANS: dict[tuple[Any, ...], Any] = {}
_CELL_PLANS_MAX = 256
_CELL_PLANS_LOCK = threading.Lock()
_CELL_STRUCTS = {
    "lstm": (rnn_abi.LSTM_CELL_FWD, rnn_abi.LSTM_CELL_BWD, 4, rnn_abi.LSTM_CELL_STATS),
    "gru": (rnn_abi.GRU_CELL_FWD, rnn_abi.GRU_CELL_BWD, 3, rnn_abi.GRU_CELL_STATS),
}


def cell_plan(cell: str, x: Tensor, hidden: int, eps: float) -> Any:
    """The C++ node's plan (``layernorm_cpu.CellPlan``) for a ``cell`` (``"lstm"`` or ``"gru"``)
    step of ``x`` (``(B, I)``, float32 or float64) with ``hidden`` units: the cell kernels'
    structs with the sizes and ``eps`` packed (checked here, once), their addresses on the
    selected target. Made once per signature."""
    key = (cell, x.dtype, *x.shape, hidden, eps, _cstep.configuration())
    plan = _CELL_PLANS.get(key)
    if plan is None:
        fwd, bwd, gates, stats = _CELL_STRUCTS[cell]
        rows, inputs = x.shape
        sizes, fixed = {"B": rows, "H": hidden}, {"eps": eps}
        bound = (
            rnn_abi.BoundStruct(fwd, x.dtype, sizes, fixed),
            rnn_abi.BoundStruct(bwd, x.dtype, sizes, fixed),
        )
        kernels = [rnn.kernel_address(f"{cell}_cell_{way}", x.dtype) for way in ("fwd", "bwd")]
        plan = torch_ops.cell_plan(
            cell, bound, kernels, [rows, inputs, hidden, gates, stats], eps, x.dtype
        )
        with _CELL_PLANS_LOCK:
            if len(_CELL_PLANS) >= _CELL_PLANS_MAX:
                _CELL_PLANS.clear()
            _CELL_PLANS[key] = plan
    return plan


def _by_operator(x: Tensor, gains: Sequence[Tensor | None]) -> bool:
    """Whether a step of :func:`node_params`' parameters runs the C++ node: float32 / float64
    (a half step computes in float32 in the Function), every layer norm's gain there, the
    operators loaded."""
    return (
        x.dtype not in _HALF_DTYPES
        and all(g is not None for g in gains)
        and torch_ops.recurrent_nodes()
    )


def lstm_node(x: Tensor, h: Tensor, c: Tensor, params: Sequence[Any], eps: float) -> Any:
    """``(h_t, c_t)`` of an LSTM step of :func:`node_params`' ``params`` (:data:`LSTM_PARAMS`'
    order) by the C++ node where :func:`_by_operator`, else by :class:`LSTMCellStep`."""
    if _by_operator(x, params[4::2]):
        plan = cell_plan("lstm", x, h.shape[1], eps)
        return torch_ops.lstm_cell_step(x, h, c, *params, plan)
    return LSTMCellStep.apply(x, h, c, *params, eps)


def gru_node(x: Tensor, h: Tensor, params: Sequence[Any], eps: float) -> Any:
    """``h_t`` of a GRU step of :func:`node_params`' ``params`` (:data:`GRU_PARAMS`' order) by
    the C++ node where :func:`_by_operator`, else by :class:`GRUCellStep`."""
    if _by_operator(x, params[4::2]):
        plan = cell_plan("gru", x, h.shape[1], eps)
        return torch_ops.gru_cell_step(x, h, *params, plan)
    return GRUCellStep.apply(x, h, *params, eps)


def elman_params(module: Any, suffix: str, x: Tensor, hidden: int) -> list[Any] | None:
    """The parameters :data:`ELMAN_PARAMS` (each with ``suffix``) for an Elman training step of
    ``x`` by the C++ node (``layernorm_cpu::elman_cell_step``: torch's ops of the step in one
    node, see ``csrc_torch/rnn_ops.cpp``), or ``None`` where the step's ops run it: outside
    :func:`node_context`, a step past torch's layer-norm kernel's size in the ops
    (:data:`..ops._dispatch.TORCH_KERNEL_NUMEL`: past it the ops take the fused kernels), an
    input not float32 / float64 on the CPU, the operators off or not loaded
    (:func:`..kernels.cpu.torch_ops.recurrent_nodes`), or :func:`registered_params`."""
    if not node_context():
        return None  # (a tracer's sizes are tensors: the arithmetic comes after)
    if x.dtype not in _ELMAN_DTYPES or not x.is_cpu or x.shape[0] * hidden > TORCH_KERNEL_NUMEL:
        return None
    if not torch_ops.recurrent_nodes():
        return None
    return registered_params(module, ELMAN_PARAMS, suffix, x.dtype)


_ELMAN_DTYPES = (torch.float32, torch.float64)


def elman_node(
    x: Tensor, h: Tensor, params: Sequence[Any], eps: float, nonlinearity: str
) -> Tensor:
    """``h_t`` of an Elman step of :func:`elman_params`' ``params`` by the C++ node."""
    return torch_ops.elman_cell_step(x, h, *params, eps, nonlinearity == "relu")


def _float32(tensors: tuple[Tensor | None, ...]) -> list[Any]:
    """Each tensor converted to float32 (exactly: half values are float32 values)."""
    return [None if t is None else t.float() for t in tensors]


def _product_grads(
    need: tuple[bool, bool, bool, bool],
    dgx: Tensor,
    dhp: Tensor,
    x: Tensor,
    h: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    dh_direct: Tensor | None = None,
) -> tuple[Tensor | None, ...]:
    """The gradients of ``x``, ``h``, ``w_ih`` and ``w_hh`` (those ``need`` asks for) through the
    node's two products ``gx = x W_ihᵀ`` and ``hp = h W_hhᵀ`` from the kernel's ``dgx`` and
    ``dhp``; ``dh_direct``: the part of ``h``'s gradient that bypasses ``W_hh``, added."""
    dh = None
    if need[1]:
        dh = torch.mm(dhp, w_hh) if dh_direct is None else torch.addmm(dh_direct, dhp, w_hh)
    return (
        torch.mm(dgx, w_ih) if need[0] else None,
        dh,
        torch.mm(dgx.t(), x) if need[2] else None,
        torch.mm(dhp.t(), h) if need[3] else None,
    )


def _bias_sum(ln_bias: Tensor | None, bias: Tensor | None, like: Tensor) -> Tensor:
    """The layer norm's bias with torch's bias added (they meet in every gate), or zeros."""
    if ln_bias is None:
        return like.new_zeros(like.shape) if bias is None else bias
    return ln_bias if bias is None else ln_bias + bias


class GRUCellStep(torch.autograd.Function):
    """``h_t`` of :func:`._steps.gru_step` with grouped layer norms on both projections, for
    ``x (B, I)``, ``h (B, H)`` and the parameters of :data:`GRU_PARAMS` (biases may be
    ``None``), in one node. The caller checks shapes, dtypes and devices (a struct's check
    refuses anything else before C sees it). bfloat16 / float16 inputs are computed in float32,
    the output and each gradient rounded once to its input's dtype; the inputs, not float32
    copies, are kept for backward (a weight's copy per step would add up over a sequence)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        h: Tensor,
        w_ih: Tensor,
        w_hh: Tensor,
        b_ih: Tensor | None,
        b_hh: Tensor | None,
        lw_ih: Tensor,
        lb_ih: Tensor | None,
        lw_hh: Tensor,
        lb_hh: Tensor | None,
        eps: float,
    ) -> Tensor:
        originals = (x, h, w_ih, w_hh, b_ih, b_hh, lw_ih, lb_ih, lw_hh, lb_hh)
        half = x.dtype in _HALF_DTYPES
        if half:
            x, h, w_ih, w_hh, b_ih, b_hh, lw_ih, lb_ih, lw_hh, lb_hh = _float32(originals)
        rows, hs = h.shape
        h = h.contiguous()
        gx, hp = torch.mm(x, w_ih.t()), torch.mm(h, w_hh.t())
        out, n, ghn = (h.new_empty(rows, hs) for _ in range(3))
        rz, stats = h.new_empty(rows, 2 * hs), h.new_empty(rows, rnn_abi.GRU_CELL_STATS)
        values = {
            "gx": gx, "hp": hp, "h": h, "w_ih": lw_ih, "b_ih": _bias_sum(lb_ih, b_ih, lw_ih),
            "w_hh": lw_hh, "b_hh": _bias_sum(lb_hh, b_hh, lw_hh), "out": out, "rz": rz, "n": n,
            "ghn": ghn, "stats": stats, "eps": eps,
        }  # fmt: skip
        args = rnn.prepare(rnn_abi.GRU_CELL_FWD, h.dtype, values, {"B": rows, "H": hs})
        rnn.call("gru_cell_fwd", h.dtype, args)
        ctx.eps, ctx.half = eps, half
        kept = originals if half else (x, h, w_ih, w_hh, b_ih, b_hh, lw_ih, lb_ih, lw_hh, lb_hh)
        ctx.save_for_backward(*kept, gx, hp, rz, n, ghn, stats)
        return out.to(originals[0].dtype) if half else out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        saved = ctx.saved_tensors
        if reference_backward(dout):  # the ops' derivative: _reference_grads
            return (*_reference_grads(ctx, (dout,), saved[:10], _gru_reference), None)
        inputs, (gx, hp, rz, n, ghn, stats) = saved[:10], saved[10:]
        x, h, w_ih, w_hh, *_, lw_ih, _, lw_hh, _ = _float32(inputs) if ctx.half else inputs
        dout = dout.float() if ctx.half else dout
        rows, hs = h.shape
        dgx, dhp = gx.new_empty(rows, 3 * hs), gx.new_empty(rows, 3 * hs)
        dh, dparams = h.new_empty(rows, hs), h.new_empty(4, 3 * hs)
        values = {
            "dout": dout.contiguous(), "gx": gx, "hp": hp, "h": h, "w_ih": lw_ih, "w_hh": lw_hh,
            "rz": rz, "n": n, "ghn": ghn, "stats": stats, "dgx": dgx, "dhp": dhp, "dh": dh,
            "dparams": dparams, "eps": ctx.eps,
        }  # fmt: skip
        args = rnn.prepare(rnn_abi.GRU_CELL_BWD, h.dtype, values, {"B": rows, "H": hs})
        rnn.call("gru_cell_bwd", h.dtype, args)
        need = ctx.needs_input_grad
        d_lw_ih, d_lb_ih, d_lw_hh, d_lb_hh = dparams.unbind(0)
        grads = (
            *_product_grads(need[:4], dgx, dhp, x, h, w_ih, w_hh, dh),
            d_lb_ih.clone() if need[4] else None,  # the same sums as the LN biases', apart
            d_lb_hh.clone() if need[5] else None,
            d_lw_ih if need[6] else None,
            d_lb_ih if need[7] else None,
            d_lw_hh if need[8] else None,
            d_lb_hh if need[9] else None,
        )
        return (*grads, None)  # (autograd rounds each to its input's dtype)


class LSTMCellStep(torch.autograd.Function):
    """``(h_t, c_t)`` of :func:`._steps.lstm_step` (layer norms on both projections and on
    ``c_t``, ``c_t`` carried) for ``x (B, I)``, ``h, c (B, H)`` and the parameters of
    :data:`LSTM_PARAMS` (biases may be ``None``), in one node. The caller checks shapes, dtypes
    and devices (a struct's check refuses anything else before C sees it). Half inputs as
    :class:`GRUCellStep`'s."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        h: Tensor,
        c: Tensor,
        w_ih: Tensor,
        w_hh: Tensor,
        b_ih: Tensor | None,
        b_hh: Tensor | None,
        lw_ih: Tensor,
        lb_ih: Tensor | None,
        lw_hh: Tensor,
        lb_hh: Tensor | None,
        lw_c: Tensor,
        lb_c: Tensor | None,
        eps: float,
    ) -> tuple[Tensor, Tensor]:
        originals = (x, h, c, w_ih, w_hh, b_ih, b_hh, lw_ih, lb_ih, lw_hh, lb_hh, lw_c, lb_c)
        half = x.dtype in _HALF_DTYPES
        if half:
            x, h, c, w_ih, w_hh, b_ih, b_hh, lw_ih, lb_ih, lw_hh, lb_hh, lw_c, lb_c = _float32(
                originals
            )
        rows, hs = h.shape
        c = c.contiguous()
        gx, hp = torch.mm(x, w_ih.t()), torch.mm(h, w_hh.t())
        h_out, c_out, tc = (c.new_empty(rows, hs) for _ in range(3))
        gates, stats = c.new_empty(rows, 4 * hs), c.new_empty(rows, rnn_abi.LSTM_CELL_STATS)
        values = {
            "gx": gx, "hp": hp, "c": c, "w_ih": lw_ih, "b_ih": _bias_sum(lb_ih, b_ih, lw_ih),
            "w_hh": lw_hh, "b_hh": _bias_sum(lb_hh, b_hh, lw_hh), "w_c": lw_c,
            "b_c": _bias_sum(lb_c, None, lw_c), "h_out": h_out, "c_out": c_out, "gates": gates,
            "tc": tc, "stats": stats, "eps": eps,
        }  # fmt: skip
        args = rnn.prepare(rnn_abi.LSTM_CELL_FWD, c.dtype, values, {"B": rows, "H": hs})
        rnn.call("lstm_cell_fwd", c.dtype, args)
        ctx.eps, ctx.half = eps, half
        kept = originals if half else (x, h, c, w_ih, w_hh, b_ih, b_hh, lw_ih, lb_ih, lw_hh,
                                       lb_hh, lw_c, lb_c)  # fmt: skip
        ctx.save_for_backward(*kept, gx, hp, c_out, gates, tc, stats)
        if half:
            return h_out.to(originals[1].dtype), c_out.to(originals[2].dtype)
        return h_out, c_out

    @staticmethod
    def backward(ctx: Any, dh: Tensor, dc: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        saved = ctx.saved_tensors
        if reference_backward(dh, dc):  # the ops' derivative
            return (*_reference_grads(ctx, (dh, dc), saved[:13], _lstm_reference), None)
        inputs, (gx, hp, c_out, gates, tc, stats) = saved[:13], saved[13:]
        x, h, c, w_ih, w_hh, *_, lw_ih, _, lw_hh, _, lw_c, _ = (
            _float32(inputs) if ctx.half else inputs
        )
        if ctx.half:
            dh, dc = dh.float(), dc.float()
        rows, hs = c.shape
        dgx, dhp = gx.new_empty(rows, 4 * hs), gx.new_empty(rows, 4 * hs)
        dc_prev, dparams, dcparams = (
            c.new_empty(rows, hs),
            c.new_empty(4, 4 * hs),
            c.new_empty(2, hs),
        )
        values = {
            "dh": dh.contiguous(), "dc": dc.contiguous(), "gx": gx, "hp": hp, "c": c,
            "c_out": c_out, "w_ih": lw_ih, "w_hh": lw_hh, "w_c": lw_c, "gates": gates, "tc": tc,
            "stats": stats, "dgx": dgx, "dhp": dhp, "dc_prev": dc_prev, "dparams": dparams,
            "dcparams": dcparams, "eps": ctx.eps,
        }  # fmt: skip
        args = rnn.prepare(rnn_abi.LSTM_CELL_BWD, c.dtype, values, {"B": rows, "H": hs})
        rnn.call("lstm_cell_bwd", c.dtype, args)
        need = ctx.needs_input_grad
        d_lw_ih, d_lb_ih, d_lw_hh, d_lb_hh = dparams.unbind(0)
        d_lw_c, d_lb_c = dcparams.unbind(0)
        dx, dh_prev, dw_ih, dw_hh = _product_grads(
            (need[0], need[1], need[3], need[4]), dgx, dhp, x, h, w_ih, w_hh
        )
        grads = (
            dx,
            dh_prev,
            dc_prev if need[2] else None,
            dw_ih,
            dw_hh,
            d_lb_ih.clone() if need[5] else None,  # the same sums as the LN biases', apart
            d_lb_hh.clone() if need[6] else None,
            d_lw_ih if need[7] else None,
            d_lb_ih if need[8] else None,
            d_lw_hh if need[9] else None,
            d_lb_hh if need[10] else None,
            d_lw_c if need[11] else None,
            d_lb_c if need[12] else None,
        )
        return (*grads, None)  # (autograd rounds each to its input's dtype)


def _gru_reference(eps: float, x, h, w_ih, w_hh, b_ih, b_hh, lw_ih, lb_ih, lw_hh, lb_hh):
    hs = h.shape[1]
    return _steps.gru_step(
        x, h, _steps.Weights(w_ih, w_hh, b_ih, b_hh),
        _steps.make_grouped_ln(lw_ih, lb_ih, eps, hs, lean=True),
        _steps.make_grouped_ln(lw_hh, lb_hh, eps, hs, lean=True),
    )  # fmt: skip


def _lstm_reference(
    eps: float, x, h, c, w_ih, w_hh, b_ih, b_hh, lw_ih, lb_ih, lw_hh, lb_hh, lw_c, lb_c
):
    return _steps.lstm_step(
        x, h, c, _steps.Weights(w_ih, w_hh, b_ih, b_hh),
        _steps.make_ln(lw_ih, lb_ih, eps, lean=True), _steps.make_ln(lw_hh, lb_hh, eps, lean=True),
        _steps.make_ln(lw_c, lb_c, eps, lean=True),
    )  # fmt: skip


def _reference_grads(
    ctx: Any, douts: tuple[Tensor, ...], inputs: tuple[Tensor | None, ...], step: Any
) -> tuple:
    """The gradients of ``step`` (the step function of :mod:`._steps` the node computes) on the
    saved inputs, with a graph of their own, taken at aliases of the inputs (a weight also made
    ``h``, the step before's output: :func:`..ops._dispatch.aliases`). What a backward runs
    where the kernels cannot: with ``create_graph=True`` (the gradients must be differentiable)
    and in a batched backward (``is_grads_batched=True``, ``jacobian(..., vectorize=True)``:
    batched tensors, whose memory no kernel can read)."""
    return _step_grads(step, ctx.eps, douts, inputs, ctx.needs_input_grad[: len(inputs)])


def _step_grads(
    step: Any,
    eps: float,
    douts: Sequence[Tensor],
    inputs: Sequence[Tensor | None],
    need: Sequence[bool],
) -> tuple[Tensor | None, ...]:
    """The gradients of ``step`` at ``inputs`` that ``need`` asks for, with a graph (see
    :func:`_reference_grads`)."""
    with torch.enable_grad():
        viewed = aliases(*inputs)
        wanted = [t for t, want in zip(viewed, need, strict=True) if want]
        out = step(eps, *viewed)
        outs = out if isinstance(out, tuple) else (out,)
        grads = iter(torch.autograd.grad(outs, wanted, douts, create_graph=True, allow_unused=True))
    return tuple(next(grads) if want else None for want in need)


# layernorm::cell_reference_grads: what the C++ node's backward runs where the kernels cannot
# (create_graph=True, batched gradients; csrc_torch/rnn_ops.cpp), as the norms' C++ nodes call
# layernorm::norm_reference_grads (..ops._reference_grads). CompositeImplicitAutograd: autograd
# records the step's ops inside it, and functorch's transforms see through it.
_LIB = torch.library.Library("layernorm", "FRAGMENT")
_LIB.define(
    "cell_reference_grads(str cell, Tensor[] douts, Tensor?[] inputs, float eps, bool[] needs) "
    "-> Tensor?[]"
)


def _elman_reference(nonlinearity: str) -> Any:
    def step(eps: float, x, h, w_ih, w_hh, b_ih, b_hh, lw, lb):
        norm = _steps.make_ln(lw, lb, eps, lean=True)
        return _steps.rnn_step(x, h, _steps.Weights(w_ih, w_hh, b_ih, b_hh), norm, nonlinearity)

    return step


_REFERENCES = {
    "lstm": _lstm_reference,
    "gru": _gru_reference,
    "rnn_tanh": _elman_reference("tanh"),
    "rnn_relu": _elman_reference("relu"),
}


def cell_reference_grads(
    cell: str,
    douts: Sequence[Tensor],
    inputs: Sequence[Tensor | None],
    eps: float,
    needs: Sequence[bool],
) -> list[Tensor | None]:
    """The gradients ``needs`` asks for of the ``cell`` (``"lstm"``, ``"gru"``, ``"rnn_tanh"``
    or ``"rnn_relu"``) step's reference at ``inputs`` (:data:`LSTM_PARAMS`, :data:`GRU_PARAMS`
    or :data:`ELMAN_PARAMS` after ``x``, ``h`` (and ``c``)) for the outputs' gradients
    ``douts``."""
    step = _REFERENCES.get(cell)
    if step is None:
        raise ValueError(f"layernorm::cell_reference_grads: no cell named {cell!r}")
    return list(_step_grads(step, eps, douts, inputs, needs))


_LIB.impl("cell_reference_grads", cell_reference_grads, "CompositeImplicitAutograd")
for _key in ("FuncTorchBatched", "Batched"):  # the step's ops batch (see ..ops._reference_grads)
    _LIB.impl("cell_reference_grads", cell_reference_grads, _key)
