r"""Sequence layers ``LayerNormRNN``, ``LayerNormLSTM``, ``LayerNormGRU``: torch.nn.LSTM's contract.

Same constructor, call, shapes, parameter names and gate order as :class:`torch.nn.LSTM` (and
``RNN``/``GRU``):
``weight_ih_l{k}[_reverse]``, ``weight_hh_l{k}``, ``bias_ih_l{k}``, ``bias_hh_l{k}``;
batched ``(T, B, I)`` (or ``(B, T, I)`` with ``batch_first``), unbatched ``(T, I)`` and
:class:`~torch.nn.utils.rnn.PackedSequence` inputs (``enforce_sorted=False`` ones too).

``norm`` picks the recurrence:

* ``"layer"`` (default): the layer-normalized recurrences of Ba et al. 2016 (see
  :mod:`layernorm.recurrent.cells` for the equations), with gains ``ln_weight_*_l{k}`` (init
  ``gain_init``) and biases ``ln_bias_*_l{k}`` (init 0); torch's biases start at 0 too.
* ``"none"``: the plain recurrence; with the same weights the outputs equal torch's, and a
  ``torch.nn.LSTM`` state_dict loads with ``strict=True``.
* ``"batch"`` (LSTM only): recurrent batch norm (Cooijmans et al. 2016), statistics per time step.

A trained ``torch.nn.LSTM`` loads into ``norm="layer"`` with ``load_state_dict(sd, strict=False)``
(the LN gains and biases keep their init) or with :meth:`LayerNormLSTM.from_torch`.

Options of the LN-LSTM libraries (see each class's arguments, :mod:`._options` for the equations):
``forget_bias`` (LSTM, at init), ``weight_dropout`` (DropConnect on ``W_hh``, Wan et al. 2013),
``zoneout_hidden`` / ``zoneout_cell`` (Krueger et al. 2016), ``recurrent_dropout`` (LSTM, GRU:
Semeniuta et al. 2016) and torch.nn.LSTM's ``proj_size`` (with ``weight_hr_l{k}``).

Speed: by default (``impl="auto"``) float32/float64 layer-norm and plain recurrences run on the
fused path of :mod:`layernorm.recurrent._fused` (one GEMM + one LN for all input projections, one
autograd node per direction with an analytic backward in time). When nothing will be
differentiated (``torch.no_grad()``, or no input or parameter requires grad) the CPU C kernels run
each direction as inference: no autograd node, nothing kept for backward, the per-row buffers
only as large as the batch, and the input projection computed step by step inside the time loop
(:func:`._fused.lstm_sequence`, :class:`._fused.InputProjection`). A training call of one time
step on the CPU (two without layer norms: ``_LEAN_TRAINING_STEPS``; no mask or projection) runs
the step's ops instead, the layer norms by torch's kernel where :class:`layernorm.LayerNorm` takes
it, or for LN-LSTM and LN-GRU the cells' node of C cell kernels (:mod:`._cellstep`): one step has
no recurrence to fuse, and the sequence node costs more than the ops, except an LN-LSTM step of
many rows, which the planned node of one step runs (:func:`._cellstep.planned_step_pays`), and
without layer norms a large step (``_LEAN_NONE_STEP_MACS``), which the sequence node runs.
bfloat16 / float16 CPU inputs take the fused path computed in float32, their results rounded
once; a small such call under ``no_grad`` runs a float32 twin of the layer that keeps its plans
(:class:`_HalfTwin`).
``impl="loop"`` runs the readable per-step reference (:mod:`layernorm.recurrent._steps`), which
the tests compare against; batch norm, torch.compile, torch.jit.trace, ``torch.func`` transforms,
forward-mode AD and autocast always use it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import numbers
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, Self

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from .._torchscript import NotScriptable
from .._validation import as_int, check_flag, check_float_tensor, sizes_of
from ..ops._dispatch import plain_eager
from . import _cellstep, _cstep, _fused, _options, _planned, _steps
from ._batchnorm import make_step_bn
from ._checks import (
    check_batch_sizes,
    check_eps,
    check_gain,
    check_norm,
    check_parameter,
    check_params_match,
    check_permutation,
    check_probability,
    check_size,
    check_state,
    describe,
)
from ._from_torch import build_from_torch, require_torch_kind

__all__ = ["LayerNormGRU", "LayerNormLSTM", "LayerNormRNN"]

Impl = Literal["auto", "fused", "loop"]


@functools.lru_cache(maxsize=64)
def _gru_fold_mask_of(hidden: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.cat([torch.ones(2 * hidden, dtype=dtype, device=device),
                      torch.zeros(hidden, dtype=dtype, device=device)])  # fmt: skip


def _gru_fold_mask(hidden: int, like: Tensor) -> Tensor:
    """Ones over the GRU's ``(r, z)`` gates and zeros over ``n``, in ``like``'s dtype and device:
    which of torch's ``b_hh`` folds into the input side (``b_hn`` stays inside the reset gate's
    product)."""
    return _gru_fold_mask_of(hidden, like.dtype, like.device)


def _fold_input_bias(
    mode: str,
    hidden: int,
    ln_bias: Tensor | None,
    b_ih: Tensor | None,
    b_hh: Tensor | None,
    out: Tensor | None,
) -> Tensor | None:
    """The input side's bias of a ``mode`` layer (:meth:`_LNRNNBase._input_bias`): the layer
    norm's bias ``ln_bias`` with torch's two folded in, written into ``out`` where given."""
    if b_ih is None or b_hh is None:
        return ln_bias
    if mode != "GRU":
        return _fused.fold_input_bias(ln_bias, (b_ih, b_hh), out)
    # b_ih + b_hh ⊙ (1 on r, z; 0 on n): one op where a clone and a sliced add took three
    # (a decoder step's call pays it every time)
    mask = _gru_fold_mask(hidden, b_hh)
    folded = torch.addcmul(b_ih, b_hh, mask, out=out) if out is not None else (
        torch.addcmul(b_ih, b_hh, mask)
    )  # fmt: skip
    return folded if ln_bias is None else folded.add_(ln_bias)


_FUSED_DTYPES = (torch.float32, torch.float64)
# An LN-RNN's one-step inference call runs the cell's ops (LayerNormRNN._inference_step) up to
# this many elements of W_hh; past it the kept plan's kernel, which reads the weights as stored,
# took less. One thread, AMD EPYC Zen 4, x torch.nn.RNN's time, given a state, plan / ops:
# (T, B, I, H) = (1, 1, 256, 256) 1.32-1.36 / 0.95-0.98, (1, 8, 64, 128) 1.36-1.37 / 0.99-1.00,
# (1, 32, 512, 512) 0.85-0.90 / 0.87-0.89, (1, 16, 1024, 1024) 0.98 / 0.95, (1, 1, 1024, 1024)
# 0.67-0.68 / 0.76-0.77 (benchmarks/RESULTS.md, 2026-11-30).
_ELMAN_STEP_OPS_NUMEL = 512 * 512
# On the CPU, half inputs take the fused path too, computed in float32 (as the norm kernels do)
# and returned in their own dtype: the step-by-step loop is many times slower.
_HALF_DTYPES = (torch.bfloat16, torch.float16)
# A training call of at most this many time steps (per norm) runs each step's ops with torch's
# layer-norm kernel (the cells' lean ops), not the fused node: one step has no recurrence to fuse,
# and the node's fixed cost (argument structs, buffers, a Python backward) exceeds the step's
# ops. Training, one thread, AMD EPYC, x torch.nn's time, node / ops (ab_rnn.py, RESULTS.md
# 2026-11-27): one step LN-GRU (B, I, H) = (4, 128, 128) 2.22 / 1.61, (1, 64, 128) 2.27 / 1.68,
# (32, 256, 256) 1.52 / 1.19; LN-LSTM 1.39 / 1.06, 1.39 / 1.05, 0.54 / 0.53; from two steps on
# the node: (2, 8, 64, 128) GRU 1.61 / 1.93, LSTM 1.42 / 1.58. norm="none" too: one step at
# (1, 64, 128), (8, 64, 128), (1, 256, 256) LSTM 1.44, 1.43, 0.32 / 0.87, 0.93, 0.25; GRU 1.94,
# 1.85, 1.48 / 1.17, 1.18, 1.09; Elman 2.26, 2.16, 2.21 / 1.26, 1.24, 1.25; and two steps of 8
# rows (64, 128) LSTM 1.31 / 1.24, GRU 1.39 / 1.30, Elman 1.75 / 1.35; three LSTM 1.43 / 1.42,
# GRU 1.21 / 1.34, Elman 1.54 / 1.45. Per norm; other norms never.
_LEAN_TRAINING_STEPS: dict[str, int] = {"layer": 1, "none": 2}
# Without layer norms the ops pay only while a step is small: from this many multiply-adds of a
# step's products (rows · G·H · (I + H), G the gate count), per number of steps of the call, the
# fused node runs it (a step of many rows is GEMMs, where the node's fixed cost is small and the
# ops' backward makes more passes). Training, one thread, AMD EPYC Zen 5, x torch.nn's time, ops /
# node (ab_rnn.py, RESULTS.md 2026-11-28): two steps, LSTM (T, B, I, H) = (2, 8, 64, 128) 1.38 /
# 1.35, (2, 16, 128, 128) 1.45 / 1.31, (2, 32, 128, 128) 1.45 / 1.02, (2, 128, 256, 256) 1.37 /
# 0.73; GRU (2, 32, 64, 128) 1.17 / 1.12, (2, 16, 256, 256) 1.58 / 1.07; Elman (2, 32, 128, 128)
# 1.29 / 1.49, (2, 64, 128, 128) 1.21 / 1.23, (2, 32, 256, 256) 1.17 / 1.13; one step, LSTM
# (1, 32, 128, 128) 1.11 / 1.26, (1, 64, 128, 128) 1.01 / 0.92, (1, 128, 256, 256) 0.85 / 0.58;
# GRU (1, 32, 128, 128) 1.14 / 1.59, (1, 256, 256, 256) 1.06 / 0.96; Elman (1, 32, 128, 128)
# 1.24 / 1.97, (1, 256, 256, 256) 1.05 / 0.97. A step alone only where the C GEMM outpaces
# torch.mm (_cstep.tile_outpaces_torch_gemm): the AVX2 build on the same processor, before /
# with the rule, LSTM (1, 64, 128, 128) 1.04 / 1.16, GRU (1, 256, 256, 256) 1.10 / 1.25, Elman
# 1.01 / 1.19; two steps there LSTM (2, 128, 256, 256) 1.32 / 1.17, GRU (2, 16, 256, 256) 1.09 /
# 0.79, Elman (2, 64, 256, 256) 1.12 / 1.13.
_LEAN_NONE_STEP_MACS: dict[int, int] = {1: 1 << 23, 2: 1 << 21}
# A half-precision inference call of at most this many rows (steps · batch) runs the layer's
# float32 twin (_HalfTwin), for layers of at most _HALF_TWIN_MAX_BYTES of float32 parameters
# (the twin keeps them; past it, a bfloat16 LSTM's or GRU's one-step calls run a lean twin):
# the per-call casts and struct building of the half path are most of a decoder step's time,
# where a longer call's input products are bfloat16 dot products (twice float32's multiply-adds
# per instruction) the twin would not take.
_HALF_TWIN_MAX_ROWS = 256
_HALF_TWIN_MAX_BYTES = 16 << 20
# A bfloat16 twin's one-step calls run first without copying W_ih and W_hh until this many in a
# row were not served so (_HalfTwin.speculate): a call in a context whose kernels read the copies
# (the C kernels switched off, say) then costs one run more, not one on every later call.
_SPECULATION_TRIES = 3
# Each layer's inference plans, per direction (suffix) with their keys (see _plan_key): outside
# the module, so that copying or pickling a layer never copies C structs holding addresses.
_INFERENCE_PLANS: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[Any, Any]]] = (
    weakref.WeakKeyDictionary()
)
# Each layer's planned call (_CallPlan): the last inference call that ran every direction by a
# kept plan, for the next call with the same signature (_call_signature).
_CALL_PLANS: weakref.WeakKeyDictionary[nn.Module, _CallPlan] = weakref.WeakKeyDictionary()
# Each layer's float32 twin for its small half-precision inference calls (_HalfTwin).
_HALF_TWINS: weakref.WeakKeyDictionary[nn.Module, _HalfTwin] = weakref.WeakKeyDictionary()
# The torch layer whose weights each recurrence takes, for ``from_torch``.
_TORCH_LAYERS: dict[str, type[nn.RNNBase]] = {"RNN": nn.RNN, "LSTM": nn.LSTM, "GRU": nn.GRU}


def _state_signature(hx: Any) -> Any:
    """The shapes, dtypes and devices of ``hx`` (``None``; a tensor; a tuple of tensors) for a
    call's signature, or ``False`` for anything else (a list, a tensor subclass), whose calls
    are not planned."""
    if hx is None:
        return None
    states = hx if type(hx) is tuple else (hx,)
    if any(type(t) is not Tensor for t in states):
        return False
    return tuple((t.shape, t.dtype, t.is_cpu) for t in states)


def _stacked(states: list[Tensor]) -> Tensor:
    """The directions' final states as one ``(L·D, ...)`` tensor: one state as a view, where
    stack would copy it (a decoder's step pays for every op)."""
    return states[0].unsqueeze(0) if len(states) == 1 else torch.stack(states)


def bfloat16_recurrent_products() -> contextlib.AbstractContextManager[None]:
    """Within this ``with`` block, the bfloat16 layers' recurrent GEMMs on the CPU take
    ``h_{t−1}`` (forward) and the gates' gradient (backward) rounded to bfloat16, as
    ``torch.nn.LSTM`` does in bfloat16, where the processor has bfloat16 dot products
    (AVX512-BF16; :func:`layernorm.kernels.cpu.rnn.half_gemm`): twice the multiply-adds per
    instruction, products summed in float32. The backward's other products take the same rounded
    gates' gradient, as torch's do: the weights' gradients (with h_{t−1} rounded, and x) and the
    input's (with W_ih) by torch's bfloat16 GEMM, each result rounded to bfloat16 once (the
    LN-RNN's input projection, without a layer norm of its own, keeps autograd's float32
    products). Elsewhere, and outside the block, a bfloat16 layer computes in float32 and rounds
    only its results (the products of its bfloat16 inputs and weights are exact either way). A
    forward records the choice, so its backward makes the same.

    This trades accuracy for speed, and how much it costs depends on the recurrence: a rounding of
    h_{t−1} is a perturbation of the state, which later steps shrink or grow. Against float64 on
    the same bfloat16 inputs and parameters, 50 steps of a batch of 8 at (I, H) = (64, 128),
    default initialization, four seeds, in bfloat16 roundings (2⁻⁸ relative to the largest
    value): ``LayerNormGRU`` and ``LayerNormRNN`` outputs 0.5 by default and 1.6–1.8 with the
    rounded products, gradients 0.8–0.9 and 1.3; ``LayerNormLSTM`` 0.5 and 0.9 by default but
    106 and 116 rounded: its state there grew a perturbation about 1.1x a step
    (``torch.nn.LSTM``'s shrank it, and its bfloat16 results stay within 1–2 roundings). Time
    with the rounded products (AMD EPYC with AVX512-BF16, 1 and 2 threads, five shapes from
    (50, 8, 64, 128) to (35, 20, 650, 650)): inference 0.68–0.90 of the default's; training
    (six shapes to (100, 64, 256, 512)) LN-LSTM 0.68–1.29x ``torch.nn.LSTM``'s bfloat16 time
    with one thread against 1.02–1.65x by default, LN-GRU 0.09–0.92x against 0.11–1.54x
    (``benchmarks/RESULTS.md``). Where the processor has AMX the products run on its
    tiles (:func:`layernorm.kernels.cpu.rnn.amx`): on an Intel Xeon (Emerald Rapids), one
    thread, LN-LSTM inference took 1.12–1.71x ``torch.nn.LSTM``'s bfloat16 time (itself on the
    tiles) with the rounded products against 1.23–3.13x by default, training 0.91–1.36x against
    1.12–1.79x. Without AMX the same processor's ``vdpbf16ps`` runs at half its float FMAs'
    multiply-add rate (``benchmarks/bf16_dot_rate.py``), and the rounded products were slower
    than the default.

    Example::

        with layernorm.recurrent.bfloat16_recurrent_products():
            out, state = lstm(x.bfloat16())
    """
    return _cstep.rounded_recurrent_products()


def _cast_states(states: Any, dtype: torch.dtype) -> Any:
    """A layer's state (a tensor, or the LSTM's ``(h, c)``) in ``dtype``."""
    if type(states) is tuple:
        return tuple(t.to(dtype) for t in states)
    return states.to(dtype)


class _HalfTwin(NamedTuple):
    """A float32 copy of a half-precision layer for its small inference calls: a shallow copy of
    the module (its settings as they were when it was made: a setting written since, or a
    parameter replaced, makes a new one) whose parameters are float32 tensors of its own, into
    which each call copies the layer's parameters (one ``torch._foreach_copy_``, exact), then
    runs on the input and state converted exactly and rounds the results once to their dtypes:
    the half path's arithmetic (float32 products of half values, exact; float32 sums; one
    rounding of each result, each layer's output too before the next layer takes it), but with
    parameters at fixed addresses, so that the twin's calls keep inference plans
    (:class:`_CallPlan`), where the half path builds its structs and casts each parameter on
    every call. Kept (``_HALF_TWINS``) for layers of at most ``_HALF_TWIN_MAX_BYTES`` of float32
    parameters (and as a lean twin past it, below); ``lock`` keeps one call at a time on the
    twin's parameters (a call that finds it taken runs the half path).

    A bfloat16 layer's one-step calls (a decoder's token) skip the copy of W_ih and W_hh, most of
    the bytes: the twin's calls run with the layer's own bfloat16 weights at hand
    (:func:`._cstep.half_weights`), whose one-step sequence structs multiply by them as stored
    (MKL's ``gemm_bf16bf16f32`` on the input and state, bfloat16 values: the same exact
    products). Once the twin's planned call is one whose every direction does
    (:func:`_reads_weights_as_stored`), the calls it serves copy only the other parameters.
    Before that (an LSTM's or GRU's one-step call), a call runs first without copying the
    weights and keeps its result where every direction's kernel took them as stored (the
    context counts what each took, :class:`._cstep.HalfWeights`); where one did not, the result
    is dropped and the call runs again with every parameter copied (the twin stops trying after
    ``_SPECULATION_TRIES`` such calls in a row, ``speculate``). LN-GRU at (T, B, I, H) =
    (1, 16, 256, 256), one thread, Intel Xeon (Emerald Rapids, AMX): 1.25x ``torch.nn.GRU``'s
    bfloat16 time before, 0.81x after (``benchmarks/RESULTS.md``). The key holds each
    parameter's address: the kept structs read the weights there.

    A layer past ``_HALF_TWIN_MAX_BYTES`` keeps a lean twin for its one-step calls alone: its
    copies of W_ih and W_hh are allocated but never written (memory the process is not given
    until written), and a call it cannot serve by the weights as stored takes the half path."""

    key: tuple[Any, ...]
    module: nn.Module
    lock: threading.Lock
    # W_ih and W_hh of every layer and direction (``weights``), their copies, and the layer's
    # other parameters with theirs: every call copies the others, and the weights unless its
    # kernels read them as stored
    weights: list[Tensor]
    weight_shadows: list[Tensor]
    others: list[Tensor]
    other_shadows: list[Tensor]
    # the layer's W_ih and W_hh by their copies' addresses (_cstep.half_weights; bfloat16)
    by_copy: dict[int, Tensor]
    # [the planned call (_CallPlan) of the twin whose every direction's struct reads W_ih and
    # W_hh as the layer stores them (_reads_weights_as_stored), or None]
    as_stored: list[_CallPlan | None]
    # [how many more times running a one-step call it does not plan first without copying W_ih
    # and W_hh may fail (its result kept where every direction's kernel took them as stored)]:
    # _SPECULATION_TRIES again after a call served as stored, one fewer after a failure
    speculate: list[int]
    # made past _HALF_TWIN_MAX_BYTES: serves only the one-step calls whose kernels read W_ih and
    # W_hh as stored, whose float32 copies it never writes (untouched pages of memory)
    lean: bool


def _reads_weights_as_stored(planned: _CallPlan) -> bool:
    """Whether every direction of a planned call of a half layer's twin projects its input in
    the kernel's loop and multiplies by the layer's bfloat16 W_ih and W_hh as stored
    (:func:`._cstep.half_weights`): none of its kernels then reads their float32 copies."""
    return all(plan.weights_as_stored for plan in planned.plans)


class _CallPlan(NamedTuple):
    """An inference call of a layer whose every direction ran a kept inference plan
    (:class:`._fused.InferencePlan`), kept for the next call with the same signature
    (:meth:`_LNRNNBase._call_signature`): that call runs the plans straight away, without the
    checks, state handling and per-direction choices whose outcome the signature fixes. A
    decoder's step of ``LayerNormGRU`` at (B, I, H) = (1, 128, 128) went from 1.24-1.30x
    ``torch.nn.GRU``'s time to 0.94-0.96x, at (1, 256, 256) from 0.91-1.20x to 0.73-0.80x (AMD
    EPYC, one thread; benchmarks/RESULTS.md).

    Taken only where nothing can be recorded or differentiated (gradients off, no tracer,
    transform or autocast, all asked on every call) and each parameter is the tensor it was, at
    the address, shape, dtype and layout it had (values may change in place: the plans read the
    parameters where they are, and the input side's bias is folded again on every call). Any
    setting written since (``eps``, ``batch_first``, ``train()``, a parameter replaced) changes
    the signature."""

    signature: tuple[Any, ...]
    plans: list[_fused.InferencePlan]  # per layer and direction, in the call's order
    states: tuple[Tensor, Tensor | None] | None  # the zero initial states of a call without hx

    def run(self, layer: _LNRNNBase, input: Any, hx: Any) -> Any:
        """The layer's ``forward(input, hx)`` by the plans, or ``None`` where this call is not
        the planned one (or a plan is busy in another thread): the layer then runs it itself."""
        if torch.is_grad_enabled() or type(input) is not Tensor:
            return None
        if not plain_eager() or torch.is_autocast_enabled(input.device.type):
            return None
        if layer._call_signature(input, hx) != self.signature:
            return None
        batched = input.dim() == 3
        x = input if batched else input.unsqueeze(1)
        if batched and layer.batch_first:
            x = x.transpose(0, 1)
        seq_len, n_batch = x.shape[0], x.shape[1]
        layer_in = x.reshape(seq_len * n_batch, layer.input_size)
        if self.states is not None:
            h0, c0 = self.states
        else:
            given = hx if type(hx) is tuple else (hx,)
            if not batched:
                given = tuple(t.unsqueeze(1) for t in given)
            h0, c0 = given[0], (given[1] if len(given) == 2 else None)

        def kept(j: int, sfx: str, _: bool, rows: Tensor, h: Tensor, c: Tensor | None) -> Any:
            return layer._run_kept(self.plans[j], rows, h, c)

        ran = layer._run_layers(layer_in, h0, c0, kept)
        return None if ran is None else layer._outputs(*ran, seq_len, n_batch, batched)


class _LNRNNBase(NotScriptable, nn.Module):
    """Parameters, input handling and the layer/direction loop shared by the three layers.

    The public classes only spell out their constructors, in torch's argument order (``RNN``'s
    ``nonlinearity`` is positional, the LSTM has the recurrent-batch-norm options), so that their
    signatures are exact; everything else lives here.
    """

    mode = "RNN"  # "RNN", "LSTM" or "GRU"
    gate_count = 1

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        # every setting a call reads is an attribute, and train() / eval() set one too: a new
        # value ends the planned call (_CallPlan), whose signature holds this count
        self.__dict__["_settings_version"] = self.__dict__.get("_settings_version", 0) + 1

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        *,
        norm: str = "layer",
        gain_init: float = 1.0,
        eps: float = 1e-5,
        impl: Impl = "auto",
        nonlinearity: str = "tanh",
        normalize_cell_state: bool = False,
        bn_gain_init: float = 0.1,
        max_steps: int = 100,
        momentum: float = 0.1,
        proj_size: int = 0,
        forget_bias: float | None = None,
        weight_dropout: float = 0.0,
        zoneout_hidden: float = 0.0,
        zoneout_cell: float = 0.0,
        recurrent_dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        self.input_size = check_size(input_size, "input_size", owner)
        self.hidden_size = check_size(hidden_size, "hidden_size", owner)
        self.num_layers = check_size(num_layers, "num_layers", owner)
        if isinstance(dropout, bool) or not isinstance(dropout, int | float | numbers.Real):
            raise TypeError(
                f"{owner}: dropout must be a number in [0, 1], got {type(dropout).__name__} "
                f"{dropout!r}"
            )
        if not 0 <= dropout <= 1:
            raise ValueError(f"{owner}: dropout must be a number in [0, 1], got {dropout!r}")
        if dropout > 0 and self.num_layers == 1:
            # as torch.nn.LSTM: dropout acts between layers only, so here it would do nothing
            warnings.warn(
                f"{owner}: dropout={dropout} has no effect with num_layers=1 (it is applied to "
                "each layer's output except the last)",
                UserWarning,
                stacklevel=3,
            )
        allowed = ("layer", "none", "batch") if self.mode == "LSTM" else ("layer", "none")
        self.norm = check_norm(norm, owner, allowed)
        if impl not in ("auto", "fused", "loop"):
            raise ValueError(f"{owner}: impl must be 'auto', 'fused' or 'loop', got {impl!r}")
        if impl == "fused" and self.norm == "batch":
            raise ValueError(f"{owner}: norm='batch' has no fused path; use impl='auto' or 'loop'")
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(
                f"{owner}: nonlinearity must be 'tanh' or 'relu', got {nonlinearity!r}"
            )
        self.bias = check_flag(bias, "bias", owner)
        self.batch_first = check_flag(batch_first, "batch_first", owner)
        self.dropout = float(dropout)
        self.bidirectional = check_flag(bidirectional, "bidirectional", owner)
        self.gain_init = check_gain(gain_init, "gain_init", owner)
        self.bn_gain_init = check_gain(bn_gain_init, "bn_gain_init", owner)
        self.eps = check_eps(eps, owner)
        self.momentum = check_gain(momentum, "momentum", owner)
        if not 0.0 <= self.momentum <= 1.0:
            raise ValueError(f"{owner}: momentum must be in [0, 1], got {momentum!r}")
        self.max_steps = check_size(max_steps, "max_steps", owner)
        self.impl: Impl = impl
        self.nonlinearity = nonlinearity
        self.normalize_cell_state = check_flag(normalize_cell_state, "normalize_cell_state", owner)
        self.proj_size = self._check_proj_size(proj_size, owner)
        self.forget_bias = (
            None if forget_bias is None else check_gain(forget_bias, "forget_bias", owner)
        )
        if self.forget_bias is not None and not self.bias:
            raise ValueError(f"{owner}: forget_bias={forget_bias!r} needs bias=True")
        self.weight_dropout = check_probability(weight_dropout, "weight_dropout", owner)
        self.zoneout_hidden = check_probability(
            zoneout_hidden, "zoneout_hidden", owner, allow_one=True
        )
        self.zoneout_cell = check_probability(zoneout_cell, "zoneout_cell", owner, allow_one=True)
        self.recurrent_dropout = check_probability(recurrent_dropout, "recurrent_dropout", owner)
        factory = {"device": device, "dtype": dtype}
        hs, gh = self.hidden_size, self.gate_count * self.hidden_size
        hout = self.output_size
        self._norm_params: list[tuple[str, float]] = []  # (name, init value)
        self._param_shapes: dict[str, tuple[int, ...]] = {}  # checked on every call
        for k in range(self.num_layers):
            in_k = self.input_size if k == 0 else hout * self.num_directions
            for sfx in self._suffixes(k):
                self._param(f"weight_ih{sfx}", (gh, in_k), factory)
                self._param(f"weight_hh{sfx}", (gh, hout), factory)
                if self.bias:
                    self._param(f"bias_ih{sfx}", (gh,), factory)
                    self._param(f"bias_hh{sfx}", (gh,), factory)
                if self.proj_size:
                    self._param(f"weight_hr{sfx}", (self.proj_size, hs), factory)
                self._make_norm_params(sfx, factory)
        self.reset_parameters()

    # -- options ----------------------------------------------------------------------------

    def _check_proj_size(self, proj_size: object, owner: str) -> int:
        """torch.nn.LSTM's rule: an int in ``[0, hidden_size)``; only the LSTM has projections."""
        if isinstance(proj_size, bool) or as_int(proj_size) is None:
            raise TypeError(
                f"{owner}: proj_size must be an int, got {type(proj_size).__name__} {proj_size!r}"
            )
        size = as_int(proj_size)
        assert size is not None
        if size and self.mode != "LSTM":
            raise ValueError(f"{owner}: proj_size is an LSTM option, got proj_size={proj_size!r}")
        if not 0 <= size < self.hidden_size:
            raise ValueError(
                f"{owner}: proj_size must be in [0, hidden_size={self.hidden_size}), got "
                f"{proj_size!r}"
            )
        return size

    def _draw_masks(self, sfx: str, n_rows: int, n_batch: int, like: Tensor) -> _options.Masks:
        """The masks of layer-direction ``sfx`` for one call over ``n_rows`` packed rows of
        ``n_batch`` sequences (see :class:`._options.Masks`; ``None`` where an option is off or,
        for the dropouts, at eval). Drawn from torch's global generator, in the order DropConnect,
        zoneout of h, zoneout of c, recurrent dropout."""
        training = self.training
        hs, masks = self.hidden_size, _options.Masks()
        if training and self.weight_dropout > 0:
            shape = tuple(getattr(self, f"weight_hh{sfx}").shape)
            masks = masks._replace(w_hh=_options.dropout_mask(shape, self.weight_dropout, like))
        if self.zoneout_hidden > 0:
            d = _options.zoneout_coefficients(
                (n_rows, self.output_size), self.zoneout_hidden, training, like
            )
            masks = masks._replace(zoneout_h=d)
        if self.zoneout_cell > 0:
            d = _options.zoneout_coefficients((n_rows, hs), self.zoneout_cell, training, like)
            masks = masks._replace(zoneout_c=d)
        if training and self.recurrent_dropout > 0:
            m = _options.dropout_mask((n_batch, hs), self.recurrent_dropout, like)
            masks = masks._replace(candidate=m)
        return masks

    # -- parameters -------------------------------------------------------------------------

    @property
    def num_directions(self) -> int:
        return 2 if self.bidirectional else 1

    @property
    def output_size(self) -> int:
        """The size of ``h``: ``proj_size`` when set, else ``hidden_size``."""
        return self.proj_size or self.hidden_size

    def _suffixes(self, k: int) -> list[str]:
        return [f"_l{k}"] + ([f"_l{k}_reverse"] if self.bidirectional else [])

    def _param(self, name: str, shape: tuple[int, ...], factory: dict[str, Any]) -> None:
        self.register_parameter(name, nn.Parameter(torch.empty(shape, **factory)))
        self._param_shapes[name] = shape

    def _check_parameters(self, data: Tensor, owner: str) -> None:
        """Every parameter still as registered (shape, floating, the input's device), torch's
        weights and biases in the input's dtype. Normalization gains and biases may have another
        floating dtype: both paths then compute with them in the input's dtype."""
        params, device, dtype = self._parameters, data.device, data.dtype
        cpu, plain = data.is_cpu, torch._C._get_tracing_state() is None
        for name, shape in self._param_shapes.items():
            p = params.get(name)
            if p is None:  # a parametrization's output (weight_norm, say) in the parameter's place
                p = getattr(self, name, None)
            # the usual case in few attribute reads (a call of a small layer is microseconds);
            # anything else gets the full check, which names what is wrong
            if (
                isinstance(p, Tensor)
                and p.dtype is dtype
                and (p.shape if plain else sizes_of(p)) == shape
                and (p.is_cpu if cpu else p.device == device)
                and p.is_floating_point()
            ):
                continue
            check_parameter(p, name, shape, data, not name.startswith(("ln_", "bn_")), owner)

    def _norm_param(self, name: str, size: int, init: float, factory: dict[str, Any]) -> None:
        self._param(name, (size,), factory)
        self._norm_params.append((name, init))

    def _make_norm_params(self, sfx: str, factory: dict[str, Any]) -> None:
        hs, gh = self.hidden_size, self.gate_count * self.hidden_size
        if self.norm == "layer":
            for part, units in _steps.LN_PARTS[self.mode]:
                size = units * hs
                self._norm_param(f"ln_weight{part}{sfx}", size, self.gain_init, factory)
                if self.bias:
                    self._norm_param(f"ln_bias{part}{sfx}", size, 0.0, factory)
        elif self.norm == "batch":
            for part, size in (("_ih", gh), ("_hh", gh), ("_c", hs)):
                self._norm_param(f"bn_weight{part}{sfx}", size, self.bn_gain_init, factory)
                self.register_buffer(
                    f"bn_running_mean{part}{sfx}", torch.zeros(self.max_steps, size, **factory)
                )
                self.register_buffer(
                    f"bn_running_var{part}{sfx}", torch.ones(self.max_steps, size, **factory)
                )
            if self.bias:
                self._norm_param(f"bn_bias_c{sfx}", hs, 0.0, factory)

    def reset_parameters(self) -> None:
        """torch's ``uniform(±1/√H)`` for weights (and biases when ``norm="none"``, so the layer
        starts as torch's would). With a normalization the biases start at 0 and the gains at
        ``gain_init`` / ``bn_gain_init`` (Ba et al. Section 6; Cooijmans et al.)."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        norm_names = dict(self._norm_params)
        for name, p in self.named_parameters(recurse=False):
            if name in norm_names:
                nn.init.constant_(p, norm_names[name])
            elif name.startswith("bias") and self.norm != "none":
                nn.init.zeros_(p)
            else:
                nn.init.uniform_(p, -bound, bound)
        if self.forget_bias is not None:
            # the forget gate's summed bias (torch's order i, f, g, o; the LN biases are 0)
            hs = self.hidden_size
            with torch.no_grad():
                for k in range(self.num_layers):
                    for sfx in self._suffixes(k):
                        getattr(self, f"bias_ih{sfx}")[hs : 2 * hs] = self.forget_bias
                        getattr(self, f"bias_hh{sfx}")[hs : 2 * hs] = 0.0
        for name, b in self.named_buffers(recurse=False):
            if name.startswith("bn_running_mean"):
                b.zero_()
            elif name.startswith("bn_running_var"):
                b.fill_(1.0)

    def _get(self, name: str) -> Tensor | None:
        # a registered parameter straight from the dict (nn.Module.__getattr__ is the slow path of
        # every attribute lookup); anything else (buffers, or what a parametrization or a hook put
        # in a parameter's place) as an attribute
        p = self._parameters.get(name)
        return p if p is not None else getattr(self, name, None)

    def _weights(self, sfx: str) -> _steps.Weights:
        """torch's four parameters of one layer and direction: ``w_ih, w_hh, b_ih, b_hh``."""
        w_ih, w_hh = getattr(self, f"weight_ih{sfx}"), getattr(self, f"weight_hh{sfx}")
        return _steps.Weights(w_ih, w_hh, self._get(f"bias_ih{sfx}"), self._get(f"bias_hh{sfx}"))

    def flatten_parameters(self) -> None:
        """No-op, for code written against ``torch.nn.LSTM`` (there is no cuDNN weight buffer to
        compact: each parameter is its own tensor)."""

    @property
    def all_weights(self) -> list[list[nn.Parameter]]:
        """torch's ``all_weights``: per layer and direction ``[weight_ih, weight_hh, bias_ih,
        bias_hh]`` (without the biases when ``bias=False``). The normalization parameters are not
        included; they are in :meth:`named_parameters` as ``ln_*`` / ``bn_*``. With
        ``proj_size`` each list ends with ``weight_hr``, as torch's."""
        names = ("weight_ih", "weight_hh") + (("bias_ih", "bias_hh") if self.bias else ())
        names += ("weight_hr",) if self.proj_size else ()
        return [
            [getattr(self, f"{n}{sfx}") for n in names]
            for k in range(self.num_layers)
            for sfx in self._suffixes(k)
        ]

    @classmethod
    def from_torch(cls, module: nn.RNNBase, **kwargs: Any) -> Self:
        """Build this layer with ``module``'s configuration and copy its weights and biases.

        ``kwargs`` go to the constructor (e.g. ``norm="layer"``, ``gain_init``); the normalization
        parameters keep their initial values. Everything of ``module``'s state_dict must be used.
        """
        require_torch_kind(cls, module, _TORCH_LAYERS[cls.mode])
        cfg: dict[str, Any] = {
            "num_layers": module.num_layers, "bias": module.bias, "batch_first": module.batch_first,
            "dropout": module.dropout, "bidirectional": module.bidirectional,
        }  # fmt: skip
        if cls.mode == "RNN":
            cfg["nonlinearity"] = module.nonlinearity
        if cls.mode == "LSTM":
            cfg["proj_size"] = module.proj_size
        p0 = module.weight_ih_l0
        cfg.update(device=p0.device, dtype=p0.dtype)
        return build_from_torch(cls, module, cfg, kwargs)

    # -- forward -----------------------------------------------------------------------------

    def forward(
        self, input: Tensor | PackedSequence, hx: Tensor | tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor | PackedSequence, Tensor | tuple[Tensor, Tensor]]:
        """``output, h_n = layer(input, h_0)``; for the LSTM ``output, (h_n, c_n)``.

        ``input``: ``(T, B, input_size)`` (``(B, T, input_size)`` with ``batch_first``), unbatched
        ``(T, input_size)``, or a ``PackedSequence`` (then ``output`` is one too). ``hx``: ``h_0``
        (LSTM: a tuple ``(h_0, c_0)``) of shape ``(num_layers·D, B, H)``, ``(num_layers·D, H)``
        unbatched, zeros when ``None``; for a packed input in the callers' batch order, as torch's.
        Returned states have the same shapes.

        An empty batch gives empty outputs, as torch's. Raises ``ValueError`` for a wrong shape,
        no time steps, or a device other than the weights'; ``TypeError`` for a non-floating
        input, an ``hx`` of the wrong structure, or a dtype other than the weights' (outside
        autocast).
        """
        planned = _CALL_PLANS.get(self)
        if planned is not None:
            result = planned.run(self, input, hx)
            if result is not None:
                return result
        if type(input) is Tensor and input.dtype in _HALF_DTYPES:
            through_twin = self._through_half_twin(input, hx)
            if through_twin is not None:
                return through_twin
        owner = type(self).__name__
        if isinstance(input, PackedSequence):
            data, batch_sizes, sorted_idx, unsorted_idx = input
            check_float_tensor(data, "PackedSequence.data")
            if data.dim() != 2 or data.shape[1] != self.input_size:
                raise ValueError(
                    f"{owner}(input_size={self.input_size}) expects PackedSequence.data of shape "
                    f"(total_steps, {self.input_size}), got {tuple(data.shape)}"
                )
            sizes = check_batch_sizes(batch_sizes, data.shape[0], owner)
            n_batch = sizes[0]
            check_permutation(sorted_idx, n_batch, "sorted_indices", owner)
            check_permutation(unsorted_idx, n_batch, "unsorted_indices", owner)
            batched, seq_len = True, len(sizes)
        else:
            x = check_float_tensor(input)
            if x.dim() not in (2, 3) or sizes_of(x)[-1] != self.input_size:
                layout = "(batch, seq, features)" if self.batch_first else "(seq, batch, features)"
                raise ValueError(
                    f"{owner}(input_size={self.input_size}) expects a 3-D batched input {layout} "
                    f"or a 2-D unbatched input (seq, features), with features = "
                    f"{self.input_size}; got shape {tuple(x.shape)}"
                )
            batched = x.dim() == 3
            if not batched:
                x = x.unsqueeze(1)
            elif self.batch_first:
                x = x.transpose(0, 1)
            seq_len, n_batch = x.shape[0], x.shape[1]
            if torch.jit.is_tracing():
                # ints, not the 0-d tensors jit.trace makes of sizes (its time loop is unrolled);
                # elsewhere sizes stay as they are: torch.export keeps a dynamic batch symbolic
                seq_len, n_batch = sizes_of(x)[:2]
            if seq_len == 0:
                # torch.nn.LSTM refuses it too; an empty batch (n_batch == 0) is fine, as in torch
                raise ValueError(
                    f"{owner}: got an empty input of shape {tuple(input.shape)} (no time steps)"
                )
            data = x.reshape(seq_len * n_batch, self.input_size)
            sizes = [n_batch] * seq_len
            sorted_idx = unsorted_idx = None
        check_params_match(data, self.weight_ih_l0, owner)
        self._check_parameters(data, owner)
        h0, c0 = self._initial_state(hx, data, n_batch, batched, sorted_idx)
        # an inference call whose every direction runs a kept plan is kept as a whole
        planning = (
            not torch.is_grad_enabled()
            and type(input) is Tensor
            and _state_signature(hx) is not False
            and not (self.dropout > 0 and self.training and self.num_layers > 1)
        )
        used: list[_fused.InferencePlan] | None = [] if planning else None

        def direction(
            _: int, sfx: str, reverse: bool, rows: Tensor, h: Tensor, c: Tensor | None
        ) -> tuple[Tensor, Tensor, Tensor | None]:
            return self._direction(rows, sizes, sfx, reverse, h, c, used)

        ran = self._run_layers(data, h0, c0, direction)
        assert ran is not None  # _direction always gives a result
        layer_in, h_n, c_n = ran
        if used is not None and len(used) == self.num_layers * self.num_directions:
            states = (h0, c0) if hx is None else None
            _CALL_PLANS[self] = _CallPlan(self._call_signature(input, hx), used, states)
        if isinstance(input, PackedSequence):
            hs_out = _stacked(h_n)
            cs_out = _stacked(c_n) if c_n else None
            output: Any = PackedSequence(layer_in, input.batch_sizes, sorted_idx, unsorted_idx)
            if unsorted_idx is not None:
                hs_out = hs_out.index_select(1, unsorted_idx)
                cs_out = None if cs_out is None else cs_out.index_select(1, unsorted_idx)
            return output, (hs_out if cs_out is None else (hs_out, cs_out))
        return self._outputs(layer_in, h_n, c_n, seq_len, n_batch, batched)

    def _outputs(
        self,
        layer_in: Tensor,
        h_n: list[Tensor],
        c_n: list[Tensor],
        seq_len: int,
        n_batch: int,
        batched: bool,
    ) -> tuple[Tensor, Tensor | tuple[Tensor, Tensor]]:
        """``output, h_n`` (LSTM: ``output, (h_n, c_n)``) in the input's layout from the last
        layer's rows and each direction's final states (a tensor input's)."""
        hs_out = _stacked(h_n)
        cs_out = _stacked(c_n) if c_n else None
        output = layer_in.view(seq_len, n_batch, self.num_directions * self.output_size)
        if not batched:
            output = output.squeeze(1)
            hs_out = hs_out.squeeze(1)
            cs_out = None if cs_out is None else cs_out.squeeze(1)
        elif self.batch_first:
            output = output.transpose(0, 1)
        return output, (hs_out if cs_out is None else (hs_out, cs_out))

    def _run_layers(
        self,
        layer_in: Tensor,
        h0: Tensor,
        c0: Tensor | None,
        direction: Callable[
            [int, str, bool, Tensor, Tensor, Tensor | None],
            tuple[Tensor, Tensor, Tensor | None] | None,
        ],
    ) -> tuple[Tensor, list[Tensor], list[Tensor]] | None:
        """Every layer and direction over the packed rows ``layer_in``, each by
        ``direction(j, sfx, reverse, rows, h0[j], c0[j])`` (``j`` the state's index): the last
        layer's rows (the directions' outputs side by side) and each direction's final ``h`` and
        ``c``, or ``None`` where ``direction`` gave none. Dropout between layers in training."""
        h_n: list[Tensor] = []
        c_n: list[Tensor] = []
        for k in range(self.num_layers):
            outs = []
            for d, sfx in enumerate(self._suffixes(k)):
                j = k * self.num_directions + d
                result = direction(j, sfx, d == 1, layer_in, h0[j], None if c0 is None else c0[j])
                if result is None:
                    return None
                out, hk, ck = result
                outs.append(out)
                h_n.append(hk)
                if ck is not None:
                    c_n.append(ck)
            layer_in = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
            rounded = self.__dict__.get("_layer_output_dtype")  # a half layer's twin (_HalfTwin)
            if rounded is not None and k < self.num_layers - 1:
                layer_in = layer_in.to(rounded).to(layer_in.dtype)  # as the half path hands it on
            if self.dropout > 0 and self.training and k < self.num_layers - 1:
                layer_in = F.dropout(layer_in, self.dropout, training=True)
        return layer_in, h_n, c_n

    def _call_signature(self, input: Tensor, hx: Any) -> tuple[Any, ...]:
        """What a planned call (:class:`_CallPlan`) holds for besides the values of the input,
        the initial state and the parameters: the settings (their version, see
        :meth:`__setattr__`), the input's and the states' shapes, dtypes and device, the threads,
        inference mode and kernel target the inference plans are keyed on, and each parameter's
        identity, address, shape, dtype and layout (what the checks of a call and the plans'
        keys read of it; an update in place changes none of them, and the plans read the
        parameters where they are)."""

        return (
            self.__dict__.get("_settings_version"), input.shape, input.dtype, input.is_cpu,
            _state_signature(hx), torch.get_num_threads(), torch.is_inference_mode_enabled(),
            _cstep.configuration(),
            *[(id(p), p.data_ptr(), p.shape, p.dtype, p.is_contiguous())
              for p in self._parameters.values() if p is not None],
        )  # fmt: skip

    def _through_half_twin(self, input: Tensor, hx: Any) -> Any:
        """A small half-precision inference call by the layer's float32 twin (:class:`_HalfTwin`):
        ``input`` a plain CPU tensor of at most ``_HALF_TWIN_MAX_ROWS`` rows, nothing recorded
        (gradients off, plain eager, no autocast, no rounded recurrent products asked for), ``hx``
        ``None`` or tensors of the input's dtype, every parameter registered in the input's
        dtype. ``None`` elsewhere (and where another thread holds the twin): the half path runs
        the call, and names what is wrong with it."""
        if torch.is_grad_enabled() or not input.is_cpu or input.dim() not in (2, 3):
            return None
        if input.numel() > _HALF_TWIN_MAX_ROWS * self.input_size:
            return None
        if self.norm == "batch" or self.impl == "loop" or not plain_eager():
            return None
        if torch.is_autocast_enabled("cpu") or _cstep.rounded_products_asked():
            return None
        dtype = input.dtype
        states = () if hx is None else hx if type(hx) is tuple else (hx,)
        if any(type(t) is not Tensor or t.dtype is not dtype for t in states):
            return None
        steps = input.shape[1] if input.dim() == 3 and self.batch_first else input.shape[0]
        one_step = steps == 1
        twin = self._half_twin(dtype, one_step)
        if twin is None or not twin.lock.acquire(blocking=False):
            return None
        try:
            result = self._run_half_twin(twin, input, hx, one_step)
        finally:
            twin.lock.release()
        if result is None:
            return None
        out, state = result
        return out.to(dtype), _cast_states(state, dtype)

    def _run_half_twin(self, twin: _HalfTwin, input: Tensor, hx: Any, one_step: bool) -> Any:
        """:meth:`_through_half_twin`'s call by ``twin`` (its lock held), in float32: the twin's
        planned call where it reads W_ih and W_hh as stored (the other parameters copied), else
        a one-step call run first without copying them where the twin speculates (its result
        kept where every direction's kernel took them as stored), else with every parameter
        copied; ``None`` where a lean twin cannot serve the call."""
        f32 = torch.float32
        x32, hx32 = input.to(f32), (None if hx is None else _cast_states(hx, f32))
        torch._foreach_copy_(twin.other_shadows, twin.others)
        with _cstep.half_weights(twin.by_copy) as taken:
            planned = _CALL_PLANS.get(twin.module)
            result = None
            if planned is not None and planned is twin.as_stored[0]:
                result = planned.run(twin.module, x32, hx32)  # None: not its call
            if (
                result is None
                and one_step
                and twin.speculate[0] > 0
                and _cstep.half_weights_served()
            ):
                taken.taken[:] = [0, 0]  # (a planned call that ran part of the way counted)
                result = _LNRNNBase.forward(twin.module, x32, hx32)  # type: ignore[arg-type]
                if taken.taken != [self.num_layers * self.num_directions, 0]:
                    result = None  # a kernel read a copy not made
                    twin.speculate[0] -= 1
            if result is not None:  # served by the weights as stored
                twin.speculate[0] = _SPECULATION_TRIES
            else:
                if twin.lean:
                    return None
                torch._foreach_copy_(twin.weight_shadows, twin.weights)
                result = _LNRNNBase.forward(twin.module, x32, hx32)  # type: ignore[arg-type]
            planned = _CALL_PLANS.get(twin.module)
            if planned is not None and planned is not twin.as_stored[0]:
                twin.as_stored[0] = planned if _reads_weights_as_stored(planned) else None
        return result

    def _half_twin(self, dtype: torch.dtype, one_step: bool) -> _HalfTwin | None:
        """The layer's float32 twin for inputs of half ``dtype`` (made on the first call, again
        after a setting or a parameter's shape changes), or ``None`` where the layer keeps none:
        a parametrization, a parameter of another dtype or device, more than
        ``_HALF_TWIN_MAX_BYTES`` of float32 parameters but for a lean twin (``one_step``: the
        call is of one step, and the layer's kernels can read its weights as stored)."""
        if self._modules.get("parametrizations") is not None:
            return None
        named = [(n, p) for n, p in self._parameters.items() if p is not None]
        if any(p.dtype is not dtype or not p.is_cpu for _, p in named):
            return None
        # (train() / eval() are settings too: __setattr__ counts them)
        # (the address too: a kept plan of the twin reads W_ih and W_hh there, _HalfTwin)
        key = (self.__dict__.get("_settings_version"), dtype,
               *((n, id(p), p.data_ptr(), p.shape) for n, p in named))  # fmt: skip
        kept = _HALF_TWINS.get(self)
        if kept is not None and kept.key == key:
            return kept
        # W_ih and W_hh as stored: bfloat16 (MKL's bfloat16 GEMM; not float16), and only the
        # LSTM's and GRU's kernels project their input in the loop
        speculate = (dtype is torch.bfloat16 and self.mode in ("LSTM", "GRU")
                     and not self.proj_size and _cstep.half_weights_served())  # fmt: skip
        lean = 4 * sum(p.numel() for _, p in named) > _HALF_TWIN_MAX_BYTES
        if lean and not (one_step and speculate):
            return None
        module = copy.copy(self)
        with torch.inference_mode(False):  # tensors every later call may write, in either mode
            shadows = {n: torch.empty(p.shape, dtype=torch.float32, device="cpu") for n, p in named}
        module.__dict__["_parameters"] = {
            n: (None if p is None else shadows[n]) for n, p in self._parameters.items()
        }
        module.__dict__["_layer_output_dtype"] = dtype
        weights = [n for n, _ in named if n.startswith(("weight_ih_l", "weight_hh_l"))]
        others = [n for n, _ in named if n not in weights]
        params = dict(named)
        twin = _HalfTwin(
            key, module, threading.Lock(),
            [params[n] for n in weights], [shadows[n] for n in weights],
            [params[n] for n in others], [shadows[n] for n in others],
            # (bfloat16 only: the kernels take MKL's bfloat16 GEMM, not a float16 one)
            {shadows[n].data_ptr(): params[n] for n in weights if dtype is torch.bfloat16},
            [None], [_SPECULATION_TRIES if speculate else 0], lean,
        )  # fmt: skip
        _HALF_TWINS[self] = twin
        return twin

    @staticmethod
    def _run_kept(
        plan: _fused.InferencePlan,
        data: Tensor,
        h0: Tensor,
        c0: Tensor | None,
        final_hidden: bool = True,
    ) -> tuple[Tensor, Tensor | None, Tensor | None] | None:
        """A direction by its kept inference plan, with the input side's bias folded from the
        parameters as they are now (:meth:`_bias_folder`); ``None`` where the plan is busy
        (another thread). ``final_hidden``: as :meth:`._fused.InferencePlan.run`'s."""
        result = plan.run(data, h0, c0, plan.fold_bias, final_hidden)
        if result is None:
            return None
        return result if len(result) == 3 else (result[0], result[1], None)

    def _initial_state(
        self, hx: Any, data: Tensor, n_batch: int, batched: bool, sorted_idx: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        owner = type(self).__name__
        n_states = self.num_layers * self.num_directions

        def expected(size: int) -> tuple[int, ...]:
            return (n_states, n_batch, size) if batched else (n_states, size)

        is_lstm = self.mode == "LSTM"
        if hx is None:
            z = data.new_zeros(n_states, n_batch, self.output_size)
            zc = data.new_zeros(n_states, n_batch, self.hidden_size) if self.proj_size else z
            return z, (zc if is_lstm else None)
        if is_lstm:
            if not isinstance(hx, tuple | list) or len(hx) != 2:
                raise TypeError(f"{owner}: hx must be a tuple (h_0, c_0), got {describe(hx)}")
            sizes = (self.output_size, self.hidden_size)  # h_0 has proj_size units when set
            states = [
                check_state(t, f"hx[{i}]", expected(size), data, owner)
                for i, (t, size) in enumerate(zip(hx, sizes, strict=True))
            ]
        else:
            if isinstance(hx, tuple | list):
                raise TypeError(f"{owner}: hx must be a tensor h_0, got a {type(hx).__name__}")
            states = [check_state(hx, "hx", expected(self.hidden_size), data, owner)]
        if not batched:
            states = [s.unsqueeze(1) for s in states]
        if sorted_idx is not None:
            # hx is in the caller's batch order; the packed data is sorted by length.
            states = [s.index_select(1, sorted_idx) for s in states]
        return states[0], (states[1] if is_lstm else None)

    def _use_fused(self, data: Tensor) -> bool:
        if self.impl == "loop" or self.norm == "batch":
            return False
        if not plain_eager():
            # torch.compile traces the loop into plain ops (not the fused node's Python loop);
            # jit.trace would record the fused node's raw pointers (and crash); torch.func,
            # forward-mode AD and dispatch modes (fake tensors) need ops they can differentiate,
            # batch or trace, which the loop's are
            return False
        if torch.is_autocast_enabled(data.device.type):
            return False  # the fused node's preallocated buffers take one dtype, autocast mixes
        if data.shape[0] == 0:
            return False  # an empty batch: nothing for the fused kernels to do
        if data.dtype in _FUSED_DTYPES:
            return True
        if data.dtype in _HALF_DTYPES and data.device.type == "cpu":
            return True
        if self.impl == "fused":
            raise TypeError(
                f"{type(self).__name__}: impl='fused' runs float32 and float64 (and half types on "
                f"the CPU), got {data.dtype} on {data.device.type}; use impl='auto' (the "
                "step-by-step path for other dtypes)"
            )
        return False

    def _direction(
        self,
        data: Tensor,
        sizes: list[int],
        sfx: str,
        reverse: bool,
        h0: Tensor,
        c0: Tensor | None,
        used: list[_fused.InferencePlan] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Run one layer in one direction over packed rows ``data``: ``(out, h_n, c_n)``.

        ``used``: where given, the direction's inference plan is added to it when a kept plan
        ran it (see :class:`_CallPlan`).

        The masks are drawn first, whatever the path, and both paths take them: DropConnect acts
        on the weights before either sees them; the fused path runs zoneout and recurrent dropout
        in the C kernels where they run (else on its eager step functions, as the Triton steps
        take no masks), and projections between the per-step C kernels or, in inference without
        zoneout of h, inside the C sequence kernel (else on the eager steps)."""
        masks = self._draw_masks(sfx, data.shape[0], h0.shape[0], data)
        fused = self._use_fused(data)
        # inference of the same shapes with the same parameters: the plan the last call kept
        key = self._plan_key(sfx, data, sizes, h0, c0, masks) if fused else None
        if key is not None:
            kept = _INFERENCE_PLANS.get(self, {}).get(sfx)
            if kept is not None and kept[0] == key:
                result = self._run_kept(kept[1], data, h0, c0)
                if result is not None:
                    if used is not None:
                        used.append(kept[1])
                    return result
        weights = self._weights(sfx)
        if masks.w_hh is not None:
            weights = weights._replace(w_hh=weights.w_hh * masks.w_hh)
        if fused and self._lean_training(data, sizes, sfx, h0, c0, weights, masks):
            stepped = self._node_step(data, sizes, sfx, h0, c0)
            if stepped is not None:
                return stepped
            return self._loop(data, sizes, sfx, reverse, h0, c0, weights, masks, lean=True)
        if fused:
            if data.dtype in _HALF_DTYPES:
                # computed in float32: the parameters are cast (differentiably) inside _fused
                f32 = torch.float32
                masks = _options.Masks(*(None if m is None else m.to(f32) for m in masks))
                products = (
                    _cstep.bfloat16_layer()
                    if data.dtype is torch.bfloat16
                    else contextlib.nullcontext()
                )
                with products:
                    out, h_n, c_n = self._fused(
                        data.to(f32), sizes, sfx, reverse, h0.to(f32),
                        None if c0 is None else c0.to(f32), weights, masks,
                    )  # fmt: skip
                c_dtype = data.dtype if c0 is None else c0.dtype
                return (out.to(data.dtype), h_n.to(h0.dtype),
                        None if c_n is None else c_n.to(c_dtype))  # fmt: skip
            if key is None:
                return self._fused(data, sizes, sfx, reverse, h0, c0, weights, masks)
            with _fused.keeping_plans() as new:
                result = self._fused(data, sizes, sfx, reverse, h0, c0, weights, masks)
            if len(new) == 1:
                new[0].fold_bias = self._bias_folder(sfx)
                _INFERENCE_PLANS.setdefault(self, {})[sfx] = (key, new[0])
            return result
        return self._loop(data, sizes, sfx, reverse, h0, c0, weights, masks)

    def _lean_training(
        self,
        data: Tensor,
        sizes: list[int],
        sfx: str,
        h0: Tensor,
        c0: Tensor | None,
        weights: _steps.Weights,
        masks: _options.Masks,
    ) -> bool:
        """Whether a direction runs the step loop with torch's layer-norm kernel instead of the
        fused node (:data:`_LEAN_TRAINING_STEPS`): a training call (something to differentiate)
        of few steps, float32 / float64 on the CPU, layer norms or none, no mask or projection,
        where the fused path would run and was not asked for by name (``impl="fused"``); not
        an LN-LSTM's step of many rows, which the planned node takes
        (:func:`._cellstep.planned_step_pays`), nor without layer norms a step of
        :data:`_LEAN_NONE_STEP_MACS` multiply-adds or more (one step: where the C GEMM outpaces
        torch's), which the fused node takes."""
        if len(sizes) > _LEAN_TRAINING_STEPS.get(self.norm, 0) or self.proj_size:
            return False
        if self.impl != "auto" or data.dtype not in _FUSED_DTYPES or not data.is_cpu:
            return False
        if any(m is not None for m in masks):
            return False
        # (the LN-LSTM the planned node takes: its normalized carry is the step ops')
        lstm = self.mode == "LSTM" and self.norm == "layer" and not self.normalize_cell_state
        if lstm and len(sizes) == 1 and _cellstep.planned_step_pays(data, self.hidden_size):
            return False
        if self.norm == "none" and (len(sizes) > 1 or _cstep.tile_outpaces_torch_gemm()):
            hidden = self.hidden_size
            macs = sizes[0] * self.gate_count * hidden * (data.shape[-1] + hidden)
            if macs >= _LEAN_NONE_STEP_MACS.get(len(sizes), 0):
                return False
        return _fused.differentiated(data, h0, c0, *weights, *self._direction_params(sfx))

    def _node_step(
        self, data: Tensor, sizes: list[int], sfx: str, h0: Tensor, c0: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None] | None:
        """A lean training call's one step (:meth:`_lean_training`) of an LN-LSTM or LN-GRU
        direction by the cells' node of the C cell kernels (:mod:`._cellstep`: the two products,
        one kernel forward and one backward), where the ops take some 20 to 27 autograd nodes,
        and of an LN-RNN direction by the Elman cell's C++ node of the step's ops; ``None`` where
        :func:`._cellstep.node_params` (:func:`._cellstep.elman_params`) refuses it, for no
        layer norm or the LSTM's normalized carry (the step's ops run it)."""
        if len(sizes) != 1 or self.norm != "layer":
            return None
        if self.mode == "RNN":
            params = _cellstep.elman_params(self, sfx, data, self.hidden_size)
            if params is None:
                return None
            h = _cellstep.elman_node(data, h0, params, self.eps, self.nonlinearity)
            return h, h, None
        lstm = self.mode == "LSTM"
        if lstm and self.normalize_cell_state:
            return None
        names = _cellstep.LSTM_PARAMS if lstm else _cellstep.GRU_PARAMS
        params = _cellstep.node_params(self, names, sfx, data, self.hidden_size)
        if params is None:
            return None
        if lstm:
            h, c = _cellstep.lstm_node(data, h0, c0, params, self.eps)
            return h, h, c
        h = _cellstep.gru_node(data, h0, params, self.eps)
        return h, h, None

    # -- fused path --------------------------------------------------------------------------

    def _direction_params(self, sfx: str) -> list[Tensor | None]:
        """The parameters of direction ``sfx`` (``None`` where one is a parametrization's
        output, not a parameter); their names found once per direction."""
        by_sfx = self.__dict__.setdefault("_plan_names", {})  # names of sfx's parameters
        names = by_sfx.get(sfx)
        if names is None:
            names = by_sfx[sfx] = tuple(n for n in self._param_shapes if n.endswith(sfx))
        return [self._parameters.get(n) for n in names]

    def _plan_key(
        self,
        sfx: str,
        data: Tensor,
        sizes: list[int],
        h0: Tensor,
        c0: Tensor | None,
        masks: _options.Masks,
    ) -> tuple[Any, ...] | None:
        """What an inference call of direction ``sfx`` depends on besides the values of its input
        and initial state (the steps' batch sizes included), or ``None`` where it keeps no plan
        (see :class:`._fused.InferencePlan`: a layer without masks or projection, float32 /
        float64 on the CPU, nothing to differentiate, every parameter contiguous in the input's
        dtype). Each parameter enters by identity and address: the plan's kernel structs point
        at the parameters themselves, so an update in place (an optimizer's step,
        ``load_state_dict``, a write through ``.data``, none of which need change the version
        counter) is seen; the folded bias, the one value computed from them, is passed again on
        every call (:meth:`._fused.InferencePlan.run`). The settings enter by their version (see
        :meth:`__setattr__`): the structs hold the layer norm's and the nonlinearity's switches."""
        if self.proj_size or any(m is not None for m in masks):
            return None
        if data.dtype not in _FUSED_DTYPES or not data.is_cpu:
            return None
        params = self._direction_params(sfx)
        # first what a training call fails on, so that it pays for one test
        if torch.is_grad_enabled() and (
            data.requires_grad
            or h0.requires_grad
            or (c0 is not None and c0.requires_grad)
            or any(p is not None and p.requires_grad for p in params)
        ):
            return None
        dtype = data.dtype
        if any(p is None or p.dtype is not dtype or not p.is_contiguous() for p in params):
            return None  # a parametrization in a parameter's place, or a copy the kernels read
        return (
            data.dtype, data.shape, tuple(sizes), h0.shape, self.eps,
            self.__dict__.get("_settings_version"),
            torch.get_num_threads(), torch.is_inference_mode_enabled(), _cstep.configuration(),
            *((id(p), p.data_ptr()) for p in params),  # type: ignore[union-attr]
        )  # fmt: skip

    def _fused(
        self,
        data: Tensor,
        sizes: list[int],
        sfx: str,
        reverse: bool,
        h0: Tensor,
        c0: Tensor | None,
        weights: _steps.Weights,
        masks: _options.Masks,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        def g(name: str) -> Tensor | None:
            # A normalization parameter in the compute dtype and contiguous, as the C kernels
            # read it (a no-op when it already is; autograd takes the gradient back through it).
            p = self._get(name)
            if p is None or (p.dtype is data.dtype and p.is_contiguous()):
                return p
            return p.to(data.dtype).contiguous()

        # in the compute dtype (float32 for half inputs; a no-op otherwise)
        w_ih, w_hh, b_ih, b_hh = (
            t if t is None or t.dtype is data.dtype else t.to(data.dtype) for t in weights
        )
        ln = self.norm == "layer"
        if self.mode == "GRU":
            sched = _fused.make_schedule(sizes, reverse)
            return self._fused_gru(data, sched, sfx, h0, w_ih, w_hh, b_ih, b_hh, masks, g)
        if self.mode == "LSTM":
            w2 = g(f"ln_weight_ih{sfx}") if ln else None
            b2 = g(f"ln_bias_ih{sfx}") if ln else None
            w1, b1 = g(f"ln_weight_hh{sfx}"), g(f"ln_bias_hh{sfx}")
            w3, b3 = g(f"ln_weight_c{sfx}"), g(f"ln_bias_c{sfx}")
            w_hr = g(f"weight_hr{sfx}")
            # a training call of the usual kind: by the plan of its signature
            planned = _planned.lstm_training(
                data, sizes, reverse, h0, c0, w_ih, w_hh, b_ih, b_hh, (w1, b1, w3, b3, w2, b2),
                self.eps, ln, self.normalize_cell_state and ln, masks, w_hr,
            )  # fmt: skip
            if planned is not None:
                return planned
            # all time steps in one GEMM, or in inference step by step inside the C time loop
            # (_fused.InputProjection); torch's biases folded into the input side's there
            sched = _fused.make_schedule(sizes, reverse)
            both = b_ih is not None and b_hh is not None
            gx = _fused.InputProjection(
                data, w_ih, w2, b2, self.eps, ln, torch_biases=(b_ih, b_hh) if both else None
            )
            out, h_n, c_n = _fused.lstm_sequence(
                gx, h0, c0, w_hh, w1, b1, w3, b3, sched, self.eps, ln,
                self.normalize_cell_state and ln, masks.zoneout_h, masks.zoneout_c,
                masks.candidate, w_hr,
            )  # fmt: skip
            return out, h_n, c_n
        # all time steps in one GEMM; torch's biases folded into the layer norm's bias, or
        # without it added to the projection
        sched = _fused.make_schedule(sizes, reverse)
        folded = self._input_bias(sfx, b_ih, b_hh, g)
        xp = _fused.InputProjection(data, w_ih, None, None if ln else folded, self.eps, False)
        w, b = (g(f"ln_weight{sfx}"), folded) if ln else (None, None)
        out, h_n = _fused.rnn_sequence(
            xp, h0, w_hh, w, b, sched, self.eps, ln, self.nonlinearity == "relu", masks.zoneout_h
        )
        return out, h_n, None

    def _input_bias(
        self,
        sfx: str,
        b_ih: Tensor | None,
        b_hh: Tensor | None,
        g: Any,
        out: Tensor | None = None,
    ) -> Tensor | None:
        """The bias added to the input side of the LSTM's and the GRU's gates, the layer norm's
        bias when it has one, with torch's biases folded in: ``b_ih + b_hh`` (the GRU: without
        ``b_hn``, which the reset gate multiplies); the Elman RNN's: its one layer norm's bias
        with them, or without it torch's two. ``g`` reads a normalization parameter. A fold is
        written into ``out`` where given (an inference plan's buffer; not a parameter)."""
        ln_bias = g(self._input_ln_bias_name(sfx)) if self.norm == "layer" else None
        return _fold_input_bias(self.mode, self.hidden_size, ln_bias, b_ih, b_hh, out)

    def _input_ln_bias_name(self, sfx: str) -> str:
        """The layer norm's bias on the input side of direction ``sfx`` (the Elman RNN's one)."""
        return f"ln_bias{sfx}" if self.mode == "RNN" else f"ln_bias_ih{sfx}"

    def _bias_folder(self, sfx: str) -> Callable[[Tensor | None], Tensor | None]:
        """:meth:`_input_bias` of direction ``sfx`` as a function of ``out`` alone, its
        parameters looked up now: for an inference plan, whose key holds their identities (each
        call folds their values as they are then). It holds the parameters, not the layer: the
        plans are kept by a weak reference to the layer, which a reference back would defeat."""
        ln_bias = self._get(self._input_ln_bias_name(sfx)) if self.norm == "layer" else None
        b_ih, b_hh = self._get(f"bias_ih{sfx}"), self._get(f"bias_hh{sfx}")
        return functools.partial(_fold_input_bias, self.mode, self.hidden_size, ln_bias, b_ih, b_hh)

    def _fused_gru(
        self,
        data: Tensor,
        sched: _fused.Schedule,
        sfx: str,
        h0: Tensor,
        w_ih: Tensor,
        w_hh: Tensor,
        b_ih: Tensor | None,
        b_hh: Tensor | None,
        masks: _options.Masks,
        g: Any,
    ) -> tuple[Tensor, Tensor, None]:
        """The GRU's fused path: ``gx = LN(W_ih x) + b_ih + [b_hr, b_hz, 0]`` for all steps, the
        ``(r, z)`` and ``n`` blocks normalized separately, then :func:`._fused.gru_sequence`.

        The input-side biases are one ``(3H)`` vector folded into the layer norms' biases. Where
        ``gx`` is computed for all steps, each block has its own GEMM, so each layer norm reads a
        contiguous input, or for fewer rows than inputs one GEMM whose result is split
        (:func:`._fused.normalized_projection`); in inference the C time loop computes each
        step's rows (:class:`._fused.InputProjection`)."""
        hs, h2 = self.hidden_size, 2 * self.hidden_size
        ln = self.norm == "layer"
        w = g(f"ln_weight_ih{sfx}") if ln else None
        b = self._input_bias(sfx, b_ih, b_hh, g)
        gx = _fused.InputProjection(data, w_ih, w, b, self.eps, ln, blocks=(h2, hs))
        # blocks by split, not indexing (see _fused.normalized_projection): an indexed block's
        # backward fills a zero tensor of the whole parameter, one per block
        w1, b1 = g(f"ln_weight_hh{sfx}"), g(f"ln_bias_hh{sfx}")
        w_rz, w_n = (None, None) if w1 is None else w1.split([h2, hs])
        b_rz, b_n = (None, None) if b1 is None else b1.split([h2, hs])
        out, h_n = _fused.gru_sequence(
            gx, h0, w_hh, w_rz, b_rz, w_n, b_n,
            None if b_hh is None else b_hh.split([h2, hs])[1].contiguous(), sched, self.eps,
            self.norm == "layer", masks.zoneout_h, masks.candidate,
        )  # fmt: skip
        return out, h_n, None

    # -- reference loop ----------------------------------------------------------------------

    def _step_norms(self, sfx: str, t: int, lean: bool = False) -> tuple[Any, ...]:
        """The normalization callables of time step ``t`` (``None`` = identity); ``lean``: the
        layer norms take torch's kernel where :class:`layernorm.LayerNorm` does (see
        :func:`._steps.make_ln`)."""
        g, eps, hs = self._get, self.eps, self.hidden_size
        if self.norm == "none":
            return (None, None, None)
        if self.norm == "batch":

            def bn(part: str, with_bias: bool) -> _steps.Norm:
                return make_step_bn(
                    g(f"bn_running_mean{part}{sfx}"), g(f"bn_running_var{part}{sfx}"),  # type: ignore[arg-type]
                    g(f"bn_weight{part}{sfx}"), g(f"bn_bias_c{sfx}") if with_bias else None,  # type: ignore[arg-type]
                    t, self.training, self.momentum, eps,
                )  # fmt: skip

            return (bn("_ih", False), bn("_hh", False), bn("_c", True))
        if self.mode == "RNN":
            ln = _steps.make_ln(g(f"ln_weight{sfx}"), g(f"ln_bias{sfx}"), eps, lean)
            return (ln, None, None)
        if self.mode == "GRU":
            return (
                _steps.make_grouped_ln(
                    g(f"ln_weight_ih{sfx}"), g(f"ln_bias_ih{sfx}"), eps, hs, lean
                ),
                _steps.make_grouped_ln(
                    g(f"ln_weight_hh{sfx}"), g(f"ln_bias_hh{sfx}"), eps, hs, lean
                ),
                None,
            )
        return tuple(
            _steps.make_ln(g(f"ln_weight{part}{sfx}"), g(f"ln_bias{part}{sfx}"), eps, lean)
            for part in ("_ih", "_hh", "_c")
        )

    def _loop(
        self,
        data: Tensor,
        sizes: list[int],
        sfx: str,
        reverse: bool,
        h0: Tensor,
        c0: Tensor | None,
        weights: _steps.Weights,
        masks: _options.Masks,
        lean: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        h, c = h0, c0
        n_rows = sizes_of(h0)[0]  # every sequence's row, the ended ones included
        w_hr = self._get(f"weight_hr{sfx}")
        outs: list[Tensor] = [data] * len(sizes)
        carry_norm = self.normalize_cell_state and self.norm == "layer"
        for t, off, bs in _fused.make_schedule(sizes, reverse):
            rows = slice(off, off + bs)
            x_t = data[rows]
            n_ih, n_hh, n_c = self._step_norms(sfx, t, lean)
            cand = None if masks.candidate is None else masks.candidate[:bs]
            if self.mode == "LSTM":
                assert c is not None
                h_t, c_t = _steps.lstm_step(
                    x_t, h[:bs], c[:bs], weights, n_ih, n_hh, n_c, carry_norm, cand, w_hr
                )
                if masks.zoneout_c is not None:
                    c_t = _options.zoneout(masks.zoneout_c[rows], c[:bs], c_t)
                c = c_t if bs == n_rows else torch.cat((c_t, c[bs:]))
            elif self.mode == "GRU":
                h_t = _steps.gru_step(x_t, h[:bs], weights, n_ih, n_hh, cand)
            else:
                h_t = _steps.rnn_step(x_t, h[:bs], weights, n_ih, self.nonlinearity)
            if masks.zoneout_h is not None:
                h_t = _options.zoneout(masks.zoneout_h[rows], h[:bs], h_t)
            # rows past bs belong to sequences that ended (or, in reverse, have not begun)
            h = h_t if bs == n_rows else torch.cat((h_t, h[bs:]))
            outs[t] = h_t
        return torch.cat(outs), h, c

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        if not self.bias:
            s += ", bias=False"
        if self.batch_first:
            s += ", batch_first=True"
        if self.dropout:
            s += f", dropout={self.dropout}"
        if self.bidirectional:
            s += ", bidirectional=True"
        if self.mode == "RNN" and self.nonlinearity != "tanh":
            s += f", nonlinearity={self.nonlinearity!r}"
        s += f", norm={self.norm!r}"
        if self.norm == "layer" and self.gain_init != 1.0:
            s += f", gain_init={self.gain_init}"
        if self.norm == "layer" and self.normalize_cell_state:
            s += ", normalize_cell_state=True"
        if self.proj_size:
            s += f", proj_size={self.proj_size}"
        if self.forget_bias is not None:
            s += f", forget_bias={self.forget_bias}"
        for name in ("weight_dropout", "zoneout_hidden", "zoneout_cell", "recurrent_dropout"):
            if getattr(self, name):
                s += f", {name}={getattr(self, name)}"
        if self.norm == "batch":
            s += f", bn_gain_init={self.bn_gain_init}, max_steps={self.max_steps}"
            if self.momentum != 0.1:
                s += f", momentum={self.momentum}"
        if self.eps != 1e-5:
            s += f", eps={self.eps}"
        if self.impl != "auto":
            s += f", impl={self.impl!r}"
        return s


# The regularizers (see :mod:`._options` for the equations), as each layer's docstring lists them.
_WEIGHT_DROPOUT_DOC = """\
        weight_dropout: DropConnect on ``W_hh`` (Wan et al. 2013; haste's ``dropout``, renamed
            as torch's ``dropout`` is the dropout between layers): in training each call, layer
            and direction uses ``W_hh ⊙ M / (1 − p)``, ``M ~ Bernoulli(1 − p)`` shared by all
            steps; the gradient reaches the kept weights only; identity at eval. Every path.
"""
_ZONEOUT_DOC = """\
        zoneout_hidden: zoneout of ``h`` (Krueger et al. 2016): ``h_t = d ⊙ h_{t−1} + (1 − d)
            ⊙ h̃_t``, ``d ~ Bernoulli(p)`` per unit, example and step in training; at eval the
            expectation ``p h_{t−1} + (1 − p) h̃_t``. The output at ``t`` is the zoned ``h_t``.
"""
_ZONEOUT_CELL_DOC = """\
        zoneout_cell: the same for the carried cell state ``c`` (its own rate).
"""
_RECURRENT_DROPOUT_DOC = """\
        recurrent_dropout: dropout on the candidate, not on the state (Semeniuta et al. 2016, as
            TF-Addons): {candidate},
            ``m = Bernoulli(1 − p)/(1 − p)`` per unit, one mask per sequence for all its steps,
            in training; identity at eval.
"""
_PATHS_DOC = """
        Paths: the masks are drawn before a direction runs and both paths take them, so the
        fused path and the loop agree given the same masks (or seed). DropConnect runs on every
        path (C, Triton, eager steps).
        {names}
"""
# What the LSTM and GRU say of their masks on the fused node ({proj}: the LSTM's projection).
_C_MASKS_DOC = """Zoneout and recurrent dropout run in the C kernels (CPU float32/float64,
        per-step and whole-sequence), elsewhere on the fused node's eager step functions (the
        Triton steps take no masks).{proj}"""

_SHAPES_DOC = """
    Args:
        input_size: features of ``x_t``.
        hidden_size: units ``H``.
        num_layers: stacked layers (each takes the previous one's output).
        bias: ``False`` drops every additive bias (torch's and the normalizations').
        batch_first: inputs and outputs are ``(B, T, ·)`` (the states stay ``(L·D, B, H)``).
        dropout: dropout on each layer's output except the last, in training.
        bidirectional: a second direction per layer, outputs concatenated.
        norm: ``"layer"`` (Ba et al.), ``"none"`` (torch's plain recurrence){batch}.
        gain_init: initial LN gain (1.0 in the paper; 0.1 for the comparison with recurrent BN).
        eps: added to the variance.
        impl: ``"auto"`` (fused path when it applies), ``"fused"`` or ``"loop"`` (reference).
{options}
    Shape:
        input: ``(T, B, input_size)``, ``(B, T, input_size)`` with ``batch_first``, unbatched
        ``(T, input_size)``, or a ``PackedSequence``. Output: ``(T, B, D·H)`` likewise (a
        ``PackedSequence`` for a packed input); states ``(num_layers·D, B, H)`` (``(L·D, H)``
        unbatched), D = 2 if bidirectional else 1.
"""


class LayerNormRNN(_LNRNNBase):
    __doc__ = r"""Multi-layer Elman RNN with layer normalization, Eq. 4 of Ba et al. (2016).

    .. math::
        a_t = W_{hh} h_{t-1} + W_{ih} x_t,\qquad
        h_t = f\Big(\frac{g}{\sigma_t} \odot (a_t - \mu_t) + b\Big)

    ``g`` = ``ln_weight_l{k}``, ``b`` = ``ln_bias_l{k} + bias_ih_l{k} + bias_hh_l{k}``;
    ``f`` = ``nonlinearity``. Call: ``output, h_n = rnn(input, h_0=None)``.
""" + _SHAPES_DOC.replace("{batch}", "").replace(
        "{options}",
        _WEIGHT_DROPOUT_DOC
        + _ZONEOUT_DOC
        + _PATHS_DOC.replace(
            "{names}",
            "Zoneout runs in the C sequence kernels (CPU float32/float64), elsewhere in the "
            "fused node's own time loop of torch ops.",
        ),
    )

    mode = "RNN"
    gate_count = 1

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        nonlinearity: str = "tanh",
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        *,
        norm: str = "layer",
        gain_init: float = 1.0,
        eps: float = 1e-5,
        impl: Impl = "auto",
        weight_dropout: float = 0.0,
        zoneout_hidden: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
            norm=norm, gain_init=gain_init, eps=eps, impl=impl, nonlinearity=nonlinearity,
            weight_dropout=weight_dropout, zoneout_hidden=zoneout_hidden,
            device=device, dtype=dtype,
        )  # fmt: skip

    def forward(
        self, input: Tensor | PackedSequence, hx: Tensor | tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor | PackedSequence, Tensor | tuple[Tensor, Tensor]]:
        if type(input) is Tensor and (hx is None or type(hx) is Tensor):
            stepped = None if torch.is_grad_enabled() else self._inference_step(input, hx)
            if stepped is not None:
                return stepped
        return super().forward(input, hx)

    forward.__doc__ = _LNRNNBase.forward.__doc__

    def _inference_step(self, input: Tensor, hx: Tensor | None) -> tuple[Tensor, Tensor] | None:
        """A call of one step of a one-layer, one-direction LN-RNN where nothing is recorded
        (a decoder's token) as the cell's step (:func:`._steps.elman_inference_step`: the
        fewest of torch's ops, whose checks are all the call needs), before the layer's own
        checks and plans; ``None`` for any other call (more steps or layers, both directions,
        ``norm`` or ``impl`` other than the defaults, zoneout, weight dropout in training, a
        wrong shape or dtype, which the full path names). ``hx`` ``None``: the zero state.
        ``h_n`` is a copy of the output's step, as torch's layer returns it."""
        if not plain_eager():
            return None  # first: under a tracer a size is a traced value
        if self.num_layers != 1 or self.bidirectional or self.norm != "layer":
            return None
        if self.impl != "auto" or self.zoneout_hidden or (self.training and self.weight_dropout):
            return None
        dims = input.dim()
        if dims == 3:  # (1, B, I), or (B, 1, I) batch-first; h_0 (1, B, H)
            if input.shape[1 if self.batch_first else 0] != 1:
                return None
            x, h = input.select(1 if self.batch_first else 0, 0), hx
        elif dims == 2:  # unbatched: (1, I); h_0 (1, H)
            if input.shape[0] != 1:
                return None
            x, h = input, hx
        else:
            return None
        if h is not None:
            if h.dim() != dims or h.shape[0] != 1:
                return None  # (num_layers · directions, ...): the full path names a wrong one
            h = h[0] if dims == 3 else h
        g = self._get
        w_ih, w_hh = g("weight_ih_l0"), g("weight_hh_l0")
        if w_ih is None or w_hh is None or w_hh.numel() > _ELMAN_STEP_OPS_NUMEL:
            return None
        y = _steps.elman_inference_step(
            x, h, w_ih, w_hh, g("bias_ih_l0"), g("bias_hh_l0"), g("ln_weight_l0"),
            g("ln_bias_l0"), self.eps, self.nonlinearity,
        )  # fmt: skip
        if y is None:
            return None
        if dims == 2:
            return y, y.clone()
        return y.unsqueeze(1 if self.batch_first else 0), y.unsqueeze(0).clone()


class LayerNormLSTM(_LNRNNBase):
    __doc__ = r"""Multi-layer LSTM with layer normalization (Ba et al. 2016, supplementary).

    .. math::
        (i, f, g, o) = LN(W_{hh} h_{t-1}; α_1, β_1) + LN(W_{ih} x_t; α_2, β_2) + b \\
        c_t = σ(f) ⊙ c_{t-1} + σ(i) ⊙ \tanh(g),\qquad h_t = σ(o) ⊙ \tanh(LN(c_t; α_3, β_3))

    (α_1, β_1) = ``ln_weight_hh_l{k}, ln_bias_hh_l{k}``, (α_2, β_2) = ``ln_*_ih_l{k}``,
    (α_3, β_3) = ``ln_*_c_l{k}``, ``b = bias_ih + bias_hh``; the carried state is the
    un-normalized ``c_t`` (``normalize_cell_state=True`` carries ``LN(c_t)``). With
    ``norm="batch"`` the recurrent batch norm of Cooijmans et al. (2016) replaces the LNs
    (statistics per time step up to ``max_steps``, gains init ``bn_gain_init`` = 0.1, see
    :mod:`layernorm.recurrent._batchnorm`). Call: ``output, (h_n, c_n) = lstm(input, (h_0, c_0))``.

    Blank inputs: at an all-zero ``x_t`` (MNIST's empty rows, say) ``W_{ih} x_t`` has no variance
    and LN divides by ``√eps``: its Jacobian is of order ``α/√eps`` (≈ 316 at ``eps=1e-5``), and
    gradients can explode over long blank stretches. Standardize the inputs (per-feature zero
    mean, unit variance) or use a larger ``eps`` (e.g. ``1e-3``); see
    :class:`~layernorm.recurrent.cells.LayerNormLSTMCell`.

    Example::

        >>> ref = torch.nn.LSTM(8, 16, num_layers=2)
        >>> plain = LayerNormLSTM(8, 16, num_layers=2, norm="none")
        >>> plain.load_state_dict(ref.state_dict())            # strict: identical outputs
        <All keys matched successfully>
        >>> lnlstm = LayerNormLSTM.from_torch(ref)              # LN gains 1, LN biases 0
        >>> out, (h, c) = lnlstm(torch.randn(5, 3, 8))
""" + _SHAPES_DOC.replace("{batch}", ' or ``"batch"`` (recurrent batch norm)').replace(
        "{options}",
        """        proj_size: torch.nn.LSTM's projection: ``h_t = W_hr (σ(o) ⊙ tanh(LN(c_t)))`` with
            ``weight_hr_l{k}`` of shape ``(proj_size, H)``; ``h``, the output and the next layer's
            input have ``proj_size`` units, ``c`` keeps ``H``; names, shapes and init as torch's,
            so a ``torch.nn.LSTM(proj_size=…)`` loads (``from_torch``, ``load_state_dict``) and
            ``norm="none"`` computes what it does.
        forget_bias: the forget gate's initial bias (haste's ``forget_bias``, default 1.0 there):
            ``reset_parameters`` sets the forget rows of ``bias_ih`` to it and those of
            ``bias_hh`` to 0 (the LN biases start at 0), so the gate's summed bias starts at
            ``forget_bias``. ``None`` (default) leaves the usual init, which is 0 with a
            normalization and torch's uniform init with ``norm="none"``, so the layer starts as
            torch's; weights loaded afterwards replace it.
"""
        + _WEIGHT_DROPOUT_DOC
        + _ZONEOUT_DOC
        + _ZONEOUT_CELL_DOC
        + _RECURRENT_DROPOUT_DOC.replace(
            "{candidate}", "``c_t = σ(f) ⊙ c_{t−1} + σ(i) ⊙ m ⊙ tanh(g)``"
        )
        + _PATHS_DOC.replace(
            "{names}",
            _C_MASKS_DOC.replace(
                "{proj}",
                "\n        ``proj_size`` runs on the per-step C kernels with the projection (a "
                "GEMM) and\n        the zoneout of the projected h in torch between them; in "
                "inference without\n        zoneout of h the C sequence kernel computes the "
                "projection in its time loop;\n        elsewhere it runs on the eager step "
                "functions.",
            ),
        ),
    )

    mode = "LSTM"
    gate_count = 4

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        *,
        proj_size: int = 0,
        norm: str = "layer",
        gain_init: float = 1.0,
        normalize_cell_state: bool = False,
        bn_gain_init: float = 0.1,
        max_steps: int = 100,
        momentum: float = 0.1,
        eps: float = 1e-5,
        impl: Impl = "auto",
        forget_bias: float | None = None,
        weight_dropout: float = 0.0,
        zoneout_hidden: float = 0.0,
        zoneout_cell: float = 0.0,
        recurrent_dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
            norm=norm, gain_init=gain_init, eps=eps, impl=impl,
            normalize_cell_state=normalize_cell_state, bn_gain_init=bn_gain_init,
            max_steps=max_steps, momentum=momentum, proj_size=proj_size, forget_bias=forget_bias,
            weight_dropout=weight_dropout, zoneout_hidden=zoneout_hidden,
            zoneout_cell=zoneout_cell, recurrent_dropout=recurrent_dropout,
            device=device, dtype=dtype,
        )  # fmt: skip


class LayerNormGRU(_LNRNNBase):
    __doc__ = r"""Multi-layer GRU with layer normalization (Ba et al. 2016, supplementary).

    .. math::
        (r, z) = σ(LN(W_{h} h_{t-1}) + LN(W_{x} x_t) + b_{rz}) \\
        n_t = \tanh(LN(W_{in} x_t) + b_{in} + r ⊙ (LN(W_{hn} h_{t-1}) + b_{hn})) \\
        h_t = (1 - z) ⊙ n_t + z ⊙ h_{t-1}

    The ``(r, z)`` rows (2H units) and the candidate rows (H units) of each projection get separate
    LNs, as the paper's ``(z, r) = LN(W_h h) + LN(W_x x)`` and ``tanh(LN(W x) + σ(r) ⊙ LN(U h))``;
    ``ln_weight_ih_l{k}`` / ``ln_weight_hh_l{k}`` (3H each) hold both LNs' gains in torch's row
    order.
    torch's ``b_hn`` stays inside the reset product, and torch's ``z`` is the paper's ``1 − z``.
    Call: ``output, h_n = gru(input, h_0=None)``.
""" + _SHAPES_DOC.replace("{batch}", "").replace(
        "{options}",
        _WEIGHT_DROPOUT_DOC
        + _ZONEOUT_DOC
        + _RECURRENT_DROPOUT_DOC.replace(
            "{candidate}", "``h_t = (1 − z) ⊙ (m ⊙ n_t) + z ⊙ h_{t−1}``"
        )
        + _PATHS_DOC.replace("{names}", _C_MASKS_DOC.replace("{proj}", "")),
    )

    mode = "GRU"
    gate_count = 3

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        *,
        norm: str = "layer",
        gain_init: float = 1.0,
        eps: float = 1e-5,
        impl: Impl = "auto",
        weight_dropout: float = 0.0,
        zoneout_hidden: float = 0.0,
        recurrent_dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
            norm=norm, gain_init=gain_init, eps=eps, impl=impl, weight_dropout=weight_dropout,
            zoneout_hidden=zoneout_hidden, recurrent_dropout=recurrent_dropout,
            device=device, dtype=dtype,
        )  # fmt: skip
