"""Fused sequence path: one autograd node per (layer, direction) with an analytic backward in time.

What makes an eager LN-LSTM slow is not arithmetic (layer norm adds ~1% FLOPs) but the hundreds of
small autograd nodes per step. The split used here:

* The input half ``LN(W_ih x_t)`` does not depend on the recurrence, so the sequence layer computes
  it for **all** time steps with one GEMM and one layer norm (ordinary autograd, big tensors);
  in inference the C sequence kernels compute it step by step inside the time loop instead
  (:class:`InputProjection`), where it stays in cache.
* The recurrence is a single :class:`torch.autograd.Function` per direction. Forward runs the steps
  without recording a graph, writing what backward needs into preallocated ``(N, ·)`` buffers
  (N = rows of the packed sequence); backward walks the steps in reverse, per step one GEMM for
  ``dh_{t−1}`` plus the step's pointwise backward (:mod:`._pointwise`), and then gets the weight
  and gain gradients with **one** GEMM / reduction over all steps. Where the step kernels have
  whole-sequence functions (the CPU C kernels), each direction's time loop is one call of those,
  recurrent GEMMs included, instead of a Python loop of ``torch.mm`` + step calls.

Sequences are handled in packed form: a padded ``(T, B, ·)`` input is the special case of ``T``
steps of ``B`` rows. A step of ``bs`` rows updates rows ``[:bs]`` of the ``(B, H)`` state buffer, so
sequences that ended (forward direction) or have not yet begun (reverse) keep their state and
padded positions never enter any statistic.

The layers' usual LSTM training call (layer norms, full-batch steps, no mask or projection) runs
:class:`LSTMSequence`'s kernels on the same arguments by a plan kept per signature
(:mod:`._planned`), which makes this module's per-call decisions once.

The reference for these functions is the step-by-step loop over :mod:`._steps`; the tests compare
both in float64, forward and every gradient. The hand-written backward is not itself differentiable
(double backward and a batched backward raise, see :func:`_check_plain_backward`); ``impl="loop"``
supports both.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..functional import layer_norm as _layer_norm
from ..kernels.cpu import _native
from ..kernels.cpu import buffers as _buffers
from ..kernels.cpu import layer_norm as cpu_layer_norm
from ..ops._dispatch import TORCH_BACKWARD_DTYPES, batched, transformed
from . import _cstep
from ._pointwise import (
    C_KERNELS,
    C_STEPS,
    EAGER,
    SeqFn,
    StepFn,
    StepKernels,
    ln_kernels,
    needs_eager_steps,
    step_kernels,
)

# Up to this many elements of the projection, (rows, gates x hidden), a training call's input
# projection takes torch's layer norm (see layernorm.ops._dispatch.TORCH_KERNEL_NUMEL, the
# modules' limit, for why torch's kernel can be the faster). The modules' 2^20 was no faster here:
# LSTM training at (T, B, I, H) = (50, 16, 128, 256), (100, 16, 64, 128) and (200, 4, 32, 256),
# whose projections have 0.8-0.9 M elements, 1.07-1.12 / 0.88-1.11 x torch.nn.LSTM (one / two
# threads) with this limit and 1.08-1.12 / 0.90-1.13 with 2^20 (AMD EPYC, AVX2, ab_rnn.py).
TORCH_PROJECTION_NUMEL = 1 << 18

Schedule = tuple[tuple[int, int, int], ...]  # (time index, first row, rows) in processing order


def make_schedule(batch_sizes: list[int], reverse: bool) -> Schedule:
    """Steps of a packed sequence, in the order a direction processes them."""
    offsets, off = [], 0
    for t, bs in enumerate(batch_sizes):
        offsets.append((t, off, bs))
        off += bs
    return tuple(reversed(offsets)) if reverse else tuple(offsets)


#: The refusals of a fused node's backward (:func:`_check_plain_backward`; the C++ node's plan
#: carries them too: ``_planned._node_plan``).
DOUBLE_BACKWARD_REFUSAL = (
    "the fused recurrent path has no double backward (create_graph=True); build the layer with "
    "impl='loop' to differentiate its gradients"
)
BATCHED_BACKWARD_REFUSAL = (
    "the fused recurrent path has no batched backward (is_grads_batched=True, jacobian(..., "
    "vectorize=True)); build the layer with impl='loop' for it"
)


def _check_plain_backward(dout: Tensor) -> None:
    """Called first in every backward, with the output's gradient: with ``create_graph=True``
    grad mode is on, and the result would silently miss the second-order terms through this
    node, so refuse instead; in a batched backward (``is_grads_batched=True``, ``jacobian(...,
    vectorize=True)``) the gradients are batched tensors, whose memory the kernels cannot read."""
    if torch.is_grad_enabled():
        raise RuntimeError(DOUBLE_BACKWARD_REFUSAL)
    if batched(dout):
        raise RuntimeError(BATCHED_BACKWARD_REFUSAL)


def _check_untraced(name: str) -> None:
    """The fused nodes hand raw data pointers to C kernels: ``torch.jit.trace`` would record them
    as constants and replay them on freed memory, so tracing through one is refused here (the
    sequence layers run their step-by-step loop under tracing instead)."""
    if torch.jit.is_tracing():
        raise RuntimeError(
            f"{name} cannot be recorded by torch.jit.trace; run the layer with impl='loop'"
        )


def _kernels(gx: Tensor, st: dict[str, Any]) -> StepKernels:
    """:func:`._pointwise.step_kernels` for ``gx``, unless ``st`` carries what those cannot take
    (:func:`._pointwise.needs_eager_steps`): then the eager steps, whatever the device."""
    kernels = step_kernels(gx)
    if needs_eager_steps(st, kernels):
        return EAGER
    if kernels is C_KERNELS and st.get("w_hr") is not None:
        return C_STEPS  # the projection is a torch GEMM between the per-step C kernels
    return kernels


def _grad_or_none(needed: bool, fn: Any) -> Tensor | None:
    return fn() if needed else None


def _ln_param_grads(
    ln: Any,
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    w: Tensor | None,
    need_w: bool,
    need_b: bool,
) -> tuple[Tensor | None, Tensor | None]:
    """Gain / bias gradients of a layer norm over all steps at once (one reduction)."""
    if not (need_w or need_b):
        return None, None
    _, dw, db = ln.layer_norm_bwd(
        dy.contiguous(),
        x.contiguous(),
        mean,
        rstd,
        w,
        False,
        False,
        False,
        need_w and w is not None,
        need_b,
    )
    return (dw if need_w else None), (db.to(x.dtype) if need_b and db is not None else None)


def _sum_ln_grads_in_kernel(
    st: dict[str, Any],
    seq: SeqFn | None,
    normalize: bool,
    needed: bool,
    cell_cols: int | None,
    input_norm: bool = False,
) -> None:
    """Where a sequence kernel runs backward through layer norms whose gains or biases need
    gradients, buffers for it to sum them into as it goes (``st["ln_grads"]``, ``rnn_abi``'s
    ``hp_grads``: LN(hp)'s gain then bias gradient; with ``cell_cols`` ``c_grads``, the LSTM's
    LN(c_t)'s; with ``input_norm`` ``x_grads``, its LN(gx)'s), instead of
    :func:`_ln_param_grads`' passes over the saved rows after it."""
    if seq is None or not normalize or not needed:
        return
    like, gates = st["gx"], st["hp"].shape[1]
    st["ln_grads"] = {
        "hp_grads": like.new_empty(2 * gates),
        "c_grads": None if cell_cols is None else like.new_empty(2 * cell_cols),
        "x_grads": like.new_empty(2 * gates) if input_norm else None,
    }


def _split_grads(sums: Tensor, need_w: bool, need_b: bool) -> tuple[Tensor | None, Tensor | None]:
    """A kernel's ``(2 C)`` sums as the gain's and the bias's gradient (``None`` where unneeded)."""
    dw, db = sums.chunk(2)
    return (dw if need_w else None), (db if need_b else None)


def _contiguous(t: Tensor) -> Tensor:
    """``t`` contiguous, a copy in a buffer of the cache where it is not (the output gradient of
    a ``sum()``, expanded from one value)."""
    if t.is_contiguous():
        return t
    return _buffers.empty(t, tuple(t.shape)).copy_(t)


def _new_bufs(like: Tensor, n_rows: int, spec: dict[str, int]) -> dict[str, Tensor]:
    """``(N, cols)`` buffers in ``like``'s dtype, and ``(N,)`` row-statistics buffers (mean,
    1/σ) where cols is 0.

    The statistics are kept in at least float32: a half-precision 1/σ (up to 1/√eps ≈ 316) would
    round every normalized value of its row. The layers send only float32/float64 here (half
    inputs are computed in float32, see ``_HALF_DTYPES`` in :mod:`.layers`), so this matters only
    to a caller driving the sequence functions directly.
    """
    names = [k for k, c in spec.items() if not c]
    stats: dict[str, Tensor] = {}
    if names:  # the rows of one buffer: one allocation where each vector took its own
        dtype = torch.promote_types(like.dtype, torch.float32)
        rows = _buffers.empty(like, (len(names), n_rows), dtype).unbind(0)
        stats = dict(zip(names, rows, strict=True))
    return {k: _buffers.empty(like, (n_rows, c)) if c else stats[k] for k, c in spec.items()}


def _forward_in_time(
    st: dict[str, Any], w_hh: Tensor, sched: Schedule, step: StepFn, seq: SeqFn | None
) -> None:
    """Per step, the recurrent GEMM ``hp = h_{t−1} W_hhᵀ`` into ``st["hp"]``, then ``step``; or
    all of that in ``seq`` where the kernels have it."""
    if seq is not None:
        return seq(st, w_hh, sched)
    h, hp, w_t = st["h"], st["hp"], w_hh.t()
    for _, off, bs in sched:
        torch.mm(h if bs == h.shape[0] else h[:bs], w_t, out=hp[off : off + bs])
        step(st, off, bs)


def _backward_in_time(
    st: dict[str, Any],
    w_hh: Tensor,
    sched: Schedule,
    step: StepFn,
    seq: SeqFn | None,
    accumulate: bool,
    h0_grad: bool = True,
) -> None:
    """Per step in reverse, ``step`` (which leaves ``st["dhp"]``), then ``dh_{t−1} = dhp · W_hh``:
    added to ``st["dh"]`` where ``step`` already wrote the direct path of ``h_{t−1}`` there
    (``accumulate``), written over it otherwise; or all of that in ``seq``. Without ``h0_grad``
    the first step's product, the gradient of h0 alone, is left out (``st["dh"]`` then holds no
    gradient): one GEMM by W_hh in a step's count, which is a one-step call's largest but for the
    input side's (the sequence kernels compute it whatever ``h0_grad``)."""
    if seq is not None:
        return seq(st, w_hh, sched)
    dh, dhp = st["dh"], st["dhp"]
    for k, (_, off, bs) in enumerate(reversed(sched)):
        step(st, off, bs)
        if not h0_grad and k == len(sched) - 1:
            break
        dh_rows = dh if bs == dh.shape[0] else dh[:bs]
        if accumulate:
            dh_rows.addmm_(dhp[off : off + bs], w_hh)
        else:
            torch.mm(dhp[off : off + bs], w_hh, out=dh_rows)


# Up to this many multiply-adds (and a gradient under the buffer cache's smallest size) the
# recurrent weight's gradient is one torch.mm: there a call's fixed cost decides, and the C
# GEMM's (a checked argument struct) is the larger. One thread, AMD EPYC, µs of C / torch.mm:
# (N, G, H) = (2, 32, 8) 14.7 / 3.7, (20, 128, 32) 16.7 / 5.7; at 2.6 M (40, 512, 128) 98 / 97,
# (160, 256, 64) 104 / 72.
_WEIGHT_GRAD_MM_MACS = 1 << 20


def weight_grad_by_mm(dhp: Tensor, hprev: Tensor) -> bool:
    """Whether :func:`_weight_grad` runs ``dhp.t().mm(hprev)`` as it is: a result smaller than
    the buffer cache takes and at most :data:`_WEIGHT_GRAD_MM_MACS` multiply-adds."""
    n_rows, gates = dhp.shape
    hs = hprev.shape[1]
    small = gates * hs * dhp.element_size() < _buffers.MIN_BYTES
    return small and n_rows * gates * hs <= _WEIGHT_GRAD_MM_MACS


def _weight_grad(kernels: StepKernels, dhp: Tensor, hprev: Tensor, rounded: bool = False) -> Tensor:
    """``dhpᵀ · hprev`` (the recurrent weight's gradient, one GEMM over all rows); ``rounded``:
    by :func:`._cstep.rounded_product` (a backward inside the rounded recurrent products)."""
    if rounded:
        out = _buffers.empty(dhp, (dhp.shape[1], hprev.shape[1]))
        return _cstep.rounded_product(dhp.t(), hprev, out)
    if weight_grad_by_mm(dhp, hprev):
        return dhp.t().mm(hprev)
    if kernels.weight_grad is not None:
        return kernels.weight_grad(dhp, hprev)
    if dhp.is_cpu:
        # into a buffer of the cache: a weight's gradient is megabytes, handed to the parameter
        # and freed by zero_grad(), so a fresh one faults its pages on every step
        return _cstep.transposed_product(dhp, hprev)
    return dhp.t().mm(hprev)


def _previous_from_later_rows(seq: SeqFn | None, sched: Schedule, batch: int) -> bool:
    """Whether a direction run by the sequence kernel ``seq`` keeps no copies of its previous
    states (``h_{t−1}``; the LSTM's ``c_{t−1}`` too).

    Where the whole-sequence kernels run every step over the whole batch (a padded sequence; no
    projection, which runs the per-step path), a step's previous state is the state of the step
    before it, whose rows are B earlier (B later in reverse): ``h_{t−1}`` is that step's output
    (zoneout included: the output is the carried state), read shifted by
    :func:`_recurrent_weight_grad` and, for the GRU's update gate, by its C backward; the LSTM's
    ``c_{t−1}`` is its ``cn`` when the carried state is ``c_t`` itself (no zoneout of c, no
    normalized carry), which the C backward reads there. ``h0, c0`` stand for the first step's.
    Each copy would be ``(N, H)``, a sixteenth (LSTM) or a tenth (GRU) of what a step keeps."""
    return seq is not None and all(bs == batch for _, _, bs in sched)


def _output_and_previous(like: Tensor, h0: Tensor, reverse: bool) -> tuple[Tensor, Tensor]:
    """The output buffer ``out (N, P)`` of a direction whose backward takes ``h_{t−1}`` from the
    step before's output (:func:`_previous_from_later_rows`), and ``previous``, every row's
    ``h_{t−1}`` as one ``(N, P)`` slice of the same memory: the output's buffer has B more
    rows, a copy of ``h0``, before its rows (after them in ``reverse``, where the first step's
    rows are the last). The recurrent weight's gradient is then one GEMM over N rows, where it took
    one over N − B rows and another of B rows for h0's term. ``out`` is a tensor of its own, not
    a view (the caller may write an output in place where nothing needs it)."""
    (batch, cols), n_rows = h0.shape, like.shape[0]
    full = _buffers.empty(like, (n_rows + batch, cols))
    offset = full.storage_offset() + (0 if reverse else batch * cols)
    out = like.new_empty((0,)).set_(full.untyped_storage(), offset, (n_rows, cols))
    (full[n_rows:] if reverse else full[:batch]).copy_(h0)
    return out, (full[batch:] if reverse else full[:n_rows])


def _previous_from_output(
    st: dict[str, Any], sched: Schedule, h0: Tensor, previous: Tensor
) -> None:
    """Point a direction's backward at the step before's output for ``h_{t−1}``
    (:func:`_previous_from_later_rows`, :func:`_output_and_previous`): ``y``, ``h0`` for the
    first step's rows, ``previous``, and whether the steps run backward in time (the first
    step's rows then start at N − B, not 0)."""
    st.update(y=st["out"], h0=h0.contiguous(), previous=previous, reverse=int(sched[0][1] != 0))


def _recurrent_weight_grad(kernels: StepKernels, st: dict[str, Any]) -> Tensor:
    """``Σ_t dhp_tᵀ h_{t−1}``: from the kept ``hprev``, or (:func:`_previous_from_later_rows`)
    from ``previous``, the output shifted by a step with ``h0`` for the first step's rows."""
    previous = st["hprev"] if st["hprev"] is not None else st["previous"]
    return _weight_grad(kernels, st["dhp"], previous, _rounds_gradient_products(st))


def _rounds_gradient_products(st: dict[str, Any]) -> bool:
    """Whether a direction's backward takes its weights' and input's gradients by
    :func:`._cstep.rounded_product`: its forward ran inside the rounded recurrent products
    (the sequence kernels recorded their ``half_gemm``)."""
    return _cstep.rounds_gradient_products(st.get("half_gemm", 0))


def _lstm_state(
    gx: Tensor,
    h0: Tensor,
    c0: Tensor,
    w1: Tensor | None,
    b1: Tensor | None,
    w3: Tensor | None,
    b3: Tensor | None,
    eps: float,
    normalize: bool,
    carry_normalized: bool,
    zh: Tensor | None,
    zc: Tensor | None,
    cm: Tensor | None,
    w_hr: Tensor | None,
    kept_rows: int,
    n_rows: int | None = None,
    out: Tensor | None = None,
) -> dict[str, Any]:
    """An LSTM direction's ``st``: the state copied from ``h0, c0``, the output buffer (``n_rows``
    rows, default gx's; ``out`` where given) and the kept buffers with ``kept_rows`` rows (N: for
    backward; B: inference, see :func:`lstm_sequence`), but not yet the previous states' copies
    ``hprev``, ``cprev`` (``None``: :func:`_keep_previous` adds those backward will read)."""
    n_rows = gx.shape[0] if n_rows is None else n_rows
    hs, ps = c0.shape[1], h0.shape[1]
    return {
        "N": n_rows, "H": hs, "eps": eps, "normalize": normalize,
        "carry_normalized": carry_normalized, "gx": gx, "w1": w1, "b1": b1, "w3": w3,
        "b3": b3, "zh": zh, "zc": zc, "cm": cm,
        "w_hr": w_hr, "h": h0.contiguous().clone(), "c": c0.contiguous().clone(),
        "out": _buffers.empty(gx, (n_rows, ps)) if out is None else out,
        **_new_bufs(gx, kept_rows, {"hp": 4 * hs, "acts": 4 * hs, "cn": hs, "tc": hs, "mh": 0,
                                    "rh": 0, "mc": 0, "rc": 0}),
        "hprev": None, "cprev": None,
        "hu": None if w_hr is None else gx.new_empty(n_rows, hs), "y": None, "h0": None,
        "previous": None,
        "c0": None, "reverse": 0,
    }  # fmt: skip


def _keep_previous(
    st: dict[str, Any],
    from_output: tuple[Tensor, Tensor] | None,
    sched: Schedule,
    h0: Tensor,
    c0: Tensor,
) -> None:
    """The copies of ``h_{t−1}``, ``c_{t−1}`` a training direction keeps for backward: none where
    the step before holds them (``from_output``: the output and ``previous`` of
    :func:`_output_and_previous`, which ``st`` has as its output), else ``(N, ·)`` buffers."""
    n_rows, hs = st["gx"].shape[0], st["H"]
    if from_output is None:
        st.update(_new_bufs(st["gx"], n_rows, {"hprev": h0.shape[1], "cprev": hs}))
        return
    _previous_from_output(st, sched, h0, from_output[1])
    if st["zc"] is None and not st["carry_normalized"]:  # the carried c_t is cn, kept anyway
        st["c0"] = c0.contiguous()
    else:
        st["cprev"] = _new_bufs(st["gx"], n_rows, {"cprev": hs})["cprev"]


def _gru_state(
    gx: Tensor,
    h0: Tensor,
    w_rz: Tensor | None,
    b_rz: Tensor | None,
    w_n: Tensor | None,
    b_n: Tensor | None,
    b_hn: Tensor | None,
    eps: float,
    normalize: bool,
    zh: Tensor | None,
    cm: Tensor | None,
    kept_rows: int,
    n_rows: int | None = None,
    out: Tensor | None = None,
) -> dict[str, Any]:
    """A GRU direction's ``st``, as :func:`_lstm_state`."""
    n_rows = gx.shape[0] if n_rows is None else n_rows
    hs = h0.shape[1]
    return {
        "N": n_rows, "H": hs, "eps": eps, "normalize": normalize, "gx": gx, "w_rz": w_rz,
        "b_rz": b_rz, "w_n": w_n, "b_n": b_n, "b_hn": b_hn, "h": h0.contiguous().clone(),
        "zh": zh, "cm": cm, "out": _buffers.empty(gx, (n_rows, hs)) if out is None else out,
        **_new_bufs(gx, kept_rows, {"hp": 3 * hs, "rz": 2 * hs, "n": hs, "mh": 0, "rh": 0,
                                    "mn": 0, "rn": 0}),
        # the C kernels keep no h_{t−1} or LN(hp_n) + b_hn where they can do without (see
        # GRUSequence.forward); the step functions in Python need both
        "hprev": None, "ghn": None, "y": None, "h0": None, "previous": None, "reverse": 0,
    }  # fmt: skip


def differentiated(*tensors: Tensor | None) -> bool:
    """Whether autograd will record a sequence function called on ``tensors`` now."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# The input projection in inference is computed a chunk of rows at a time (normalized_projection),
# each chunk's GEMM into a buffer of the cache, so that inference holds one (N, G) result and a
# chunk instead of two (N, G) buffers: about 8 MiB a chunk, at least 128 rows. Smaller chunks cost
# GEMM efficiency and per-call overhead: at (4000 rows, 32 inputs, 512 columns) 128-row chunks took
# 3.4 ms, 512-row chunks 2.2 ms, as F.linear then layer_norm on all rows (AMD EPYC, one thread);
# LN-LSTM inference at (35, 20, 650, 650), two threads, 1 MiB chunks (128 rows) 1.09-1.20x
# torch.nn.LSTM's time, 8 MiB (all 700 rows) 0.94-1.00x; at (200, 32, 650, 650) 1.21 -> 1.05x.
# The GRU's blocks (each copied out of the chunk, normalized, copied into the result) keep 1 MiB
# chunks: 8 MiB gained nothing there ((35, 20, 650, 650): 0.71 / 0.73x torch.nn.GRU's time, two
# threads) and raised the call's peak memory from 9.3 to 19.2 MB (torch.nn.GRU's: 8.7).
_PROJECTION_BYTES = 8 << 20
_PROJECTION_BLOCKS_BYTES = 1 << 20
_PROJECTION_MIN_ROWS = 128
# Up to this size of the (rows, G) projection inference computes it whole with F.linear and
# normalizes it with torch's own layer_norm, the same formula: the chunks' extra GEMM dispatches,
# checked C calls and (the GRU's blocks) copies cost more than the cache they save, and the
# projection comes from malloc's heap without page faults. AMD EPYC (AVX2), one thread, chunked
# C / torch's time, interleaved: (rows, I, G) = (32, 512, 1536) 1.30 (the GRU's decoder step of
# a batch), (256, 256, 768) 1.30, (512, 256, 768) 1.18, (1024, 64, 512) 1.35, (2048, 64, 512)
# 1.12, (1024, 128, 1024) 1.06; beyond it the chunks win where a fresh (N, G) result faults
# its pages: (4000, 32, 512) 0.76-0.95 (two runs).
_NATIVE_BYTES = 4 << 20


def _torch_layer_norm(
    x: Tensor, n: int, weight: Tensor | None, bias: Tensor | None, eps: float
) -> Tensor:
    """:func:`layernorm.functional.layer_norm`'s arguments, torch's kernel."""
    return F.layer_norm(x, (n,), weight, bias, eps)


class BlockNormalized(torch.autograd.Function):
    """``LN`` of each row's column blocks ``[0, split)`` and ``[split, G)`` of the raw projection
    ``(N, G)``, each with its own statistics, gain and bias over all ``G`` columns (``None``:
    ones, zeros): the LN-GRU's input side ``(r, z)`` and ``n`` blocks where autograd records it,
    by the C block norm (``rnn_abi.BLOCK_NORM_FWD`` / ``_BWD``), one pass each way over the
    projection. Composed of torch's layer norms, each block was a contiguous copy (one GEMM of
    its own), the results concatenated and the gradient split apart again: one thread, Intel Xeon
    (AVX-512), µs of the projection's GEMM, norm and backward at (N, I, H) = (1280, 64, 64) 2220
    (min) where the GEMM alone (F.linear) took 1580 (``benchmarks/RESULTS.md``).

    The statistics and normalized values are the inference path's (``input_rows``) to the bit;
    the gain's and bias's gradients are summed 16 rows at a time in the scalar type and those
    sums in float64 (as the norm kernels sum a row), each thread's rows apart and the threads'
    sums added in order: the same sums on every call with the same threads."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, xp: Tensor, weight: Tensor | None, bias: Tensor | None, split: int, eps: float
    ) -> Tensor:
        g = xp.new_ones(xp.shape[1]) if weight is None else weight.contiguous()
        b = xp.new_zeros(xp.shape[1]) if bias is None else bias.contiguous()
        y, stats = _cstep.block_norm_fwd(xp, g, b, split, eps)
        ctx.save_for_backward(xp, g, stats)
        ctx.split = split
        return y

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, dy: Tensor
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None, None, None]:
        _check_plain_backward(dy)
        xp, g, stats = ctx.saved_tensors
        dx, dparams = _cstep.block_norm_bwd(dy.contiguous(), xp, g, stats, ctx.split)
        need = ctx.needs_input_grad
        return (dx if need[0] else None, dparams[0] if need[1] else None,
                dparams[1] if need[2] else None, None, None)  # fmt: skip


def _blocks_by_c(data: Tensor, n_blocks: int) -> bool:
    """Whether :func:`normalized_projection` normalizes two blocks with :class:`BlockNormalized`:
    CPU float32/float64 data with the C kernels, outside ``torch.jit.trace`` (which would keep
    the kernels' pointers) and the tracers and transforms that record ATen ops."""
    return (
        n_blocks == 2
        and _cstep.available(data)
        and not torch.jit.is_tracing()
        and not transformed()
    )


def normalized_projection(
    data: Tensor,
    w_ih: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    blocks: tuple[int, ...] | None = None,
) -> Tensor:
    """``LN(data W_ihᵀ; weight, bias)`` for all rows, the input side of an LN-LSTM (Eq. 20); with
    ``blocks`` (column counts summing to ``W_ih``'s rows) each block of columns is normalized on
    its own, as the LN-GRU's ``(r, z)`` and ``n`` blocks.

    Where autograd records it, two blocks (the LN-GRU's) on the CPU with the C kernels: one GEMM
    and :class:`BlockNormalized`, one pass over the projection each way. In inference, a
    projection of at most ``_NATIVE_BYTES``: ``F.linear`` and torch's ``layer_norm``.

    When autograd will not differentiate it (on the CPU), a chunk of rows at a time into the
    result, without an autograd node: the projection of a chunk is normalized while in cache and
    never exists whole, so inference holds one ``(N, G)`` buffer instead of two. The layer norm
    is the same kernel row by row; the GEMM may round a chunk differently from all rows at once
    (its blocking depends on the rows), so float32 results agree with the training path's to
    rounding."""
    blocks = blocks or (w_ih.shape[0],)
    cols, c0 = [], 0
    for n in blocks:
        cols.append(slice(c0, c0 + n))
        c0 += n

    def part(t: Tensor | None, c: slice) -> Tensor | None:
        return None if t is None or len(cols) == 1 else t[c]

    if differentiated(data, w_ih, weight, bias) or not data.is_cpu or torch.jit.is_tracing():
        # small float32 / float64 CPU projections: torch's layer norm, the same formula, where
        # its native backward costs less than our autograd.Function (TORCH_PROJECTION_NUMEL). Its
        # statistics lose more to a row's offset than the fused kernels' (float32, offset / spread
        # 1e3 to 1e7: about twice one rounding of the offset, relative to the spread), but a
        # projection's rows come out of a GEMM in that dtype, which rounds them that much already
        small = (
            data.is_cpu
            and data.dtype in TORCH_BACKWARD_DTYPES
            and data.shape[0] * w_ih.shape[0] <= TORCH_PROJECTION_NUMEL
        )
        layer_norm = _torch_layer_norm if small else _layer_norm
        if len(cols) == 1:
            return layer_norm(raw_projection(data, w_ih), w_ih.shape[0], weight, bias, eps)
        if _blocks_by_c(data, len(cols)):
            normalized = BlockNormalized.apply(raw_projection(data, w_ih), weight, bias,
                                               blocks[0], eps)  # fmt: skip
            return normalized  # type: ignore[no-any-return]
        # the parameters' blocks by split, not indexing: an indexed block's backward fills a
        # zero tensor of the whole parameter to put its gradient into, one per block, where
        # split's concatenates the blocks' gradients
        sizes = list(blocks)
        g_parts = (None,) * len(sizes) if weight is None else weight.split(sizes)
        b_parts = (None,) * len(sizes) if bias is None else bias.split(sizes)
        if data.shape[0] <= data.shape[1]:
            # fewer rows than inputs (a step of a batch): one GEMM, the blocks split from its
            # result, whose copies (a layer norm reads its block contiguous) and gradient
            # concatenation are smaller than W_ih's gradient concatenated from its blocks; on the
            # CPU into buffers of the cache where it pays (raw_projection)
            xp = raw_projection(data, w_ih)
            return torch.cat([
                layer_norm(xb, n, g, b, eps)
                for n, xb, g, b in zip(sizes, xp.split(sizes, dim=1), g_parts, b_parts,
                                       strict=True)
            ], dim=1)  # fmt: skip
        w_parts = w_ih.split(sizes)  # each block's GEMM as raw_projection's (the buffer cache)
        return torch.cat([
            layer_norm(raw_projection(data, w), n, g, b, eps)
            for n, w, g, b in zip(sizes, w_parts, g_parts, b_parts, strict=True)
        ], dim=1)  # fmt: skip
    if data.shape[0] * w_ih.shape[0] * data.element_size() <= _NATIVE_BYTES:
        xp = _cstep.input_product(data, w_ih, True, data.new_empty(data.shape[0], w_ih.shape[0]))
        if len(cols) == 1:
            return F.layer_norm(xp, (xp.shape[1],), weight, bias, eps)
        return torch.cat([
            F.layer_norm(xp[:, c], (c.stop - c.start,), part(weight, c), part(bias, c), eps)
            for c in cols
        ], dim=1)  # fmt: skip
    ln = ln_kernels(data)
    native = ln is cpu_layer_norm
    out = data.new_empty(data.shape[0], w_ih.shape[0])
    chunk_bytes = _PROJECTION_BYTES if len(cols) == 1 else _PROJECTION_BLOCKS_BYTES
    chunk = max(_PROJECTION_MIN_ROWS, chunk_bytes // (w_ih.shape[0] * data.element_size()))
    # per block: its columns, gain, bias, and whether the native kernel takes them, asked once of
    # `out` (contiguous, in data's dtype and device, as every chunk's projection is)
    params = [(weight, bias) if len(cols) == 1 else (part(weight, c), part(bias, c)) for c in cols]
    blocks = [(c, wc, bc, native and _native.supports(out, wc, bc))
              for c, (wc, bc) in zip(cols, params, strict=True)]  # fmt: skip
    for r0 in range(0, data.shape[0], chunk):
        rows = slice(r0, r0 + chunk)
        # one GEMM for every block: the GRU's two GEMMs of a 32-row step took 1.44 ms where one
        # took 1.05, the GEMMs alone (B = 32, I = H = 512, two threads, AMD EPYC)
        part_rows = data[rows]
        # from the buffer cache: a fresh chunk of a few MiB faults its pages on every call
        shape = (part_rows.shape[0], w_ih.shape[0])
        xp = _cstep.input_product(part_rows, w_ih, True, _buffers.empty(data, shape))
        for c, wc, bc, whole in blocks:
            xc = xp if len(cols) == 1 else xp[:, c].contiguous()
            if whole:
                if len(cols) == 1:
                    _native.ln_fwd(xc, wc, bc, eps, out=out[rows])  # the rows, written in place
                else:
                    out[rows, c] = _native.ln_fwd(xc, wc, bc, eps)[0]
            else:
                out[rows, c] = ln.layer_norm_fwd(xc, wc, bc, eps)[0]
    return out


def fold_input_bias(
    bias: Tensor | None, torch_biases: tuple[Tensor, Tensor] | None, out: Tensor | None = None
) -> Tensor | None:
    """The input side's bias with torch's ``(b_ih, b_hh)`` folded in: ``(b_ih + b_hh) + bias``
    (differentiable; ``bias`` itself where there is nothing to fold), written into ``out`` where
    given (an inference plan's buffer: no allocation, no copy after)."""
    if torch_biases is None:
        return bias
    folded = torch.add(*torch_biases, out=out) if out is not None else torch.add(*torch_biases)
    return folded if bias is None else folded.add_(bias)


class InputProjection(NamedTuple):
    """The input side of a direction's gates, ``gx``, not yet computed: ``LN(data W_ihᵀ)`` with
    gain ``weight`` and bias :meth:`input_bias`, each block of ``blocks`` columns on its own
    (:func:`normalized_projection`), or without ``layer_norm`` ``data W_ihᵀ + input_bias()``.
    The sequence functions take it in place of ``gx``: in inference the C sequence kernels
    compute each step's rows inside the time loop, where they stay in cache (no ``(N, G)``
    buffer, no pass over it), else :meth:`compute` makes ``gx`` first.

    ``torch_biases``: torch's ``(b_ih, b_hh)``, still to be added to ``bias``
    (:func:`fold_input_bias`), kept apart so that the LSTM's training node can add them itself
    and hand each its gradient, where a fold before the call costs two autograd nodes."""

    data: Tensor
    w_ih: Tensor
    weight: Tensor | None
    bias: Tensor | None
    eps: float
    layer_norm: bool
    blocks: tuple[int, ...] | None = None
    torch_biases: tuple[Tensor, Tensor] | None = None

    def tensors(self) -> tuple[Tensor | None, ...]:
        return (self.data, self.w_ih, self.weight, self.bias, *(self.torch_biases or ()))

    def input_bias(self) -> Tensor | None:
        """The bias added to the input side, torch's biases folded in."""
        return fold_input_bias(self.bias, self.torch_biases)

    def compute(self) -> Tensor:
        """``gx`` for every row (differentiable); without layer norm and where nothing will be
        differentiated, the C GEMM's product where :func:`._cstep.input_product_by_c` says so,
        the bias added in place (elsewhere ``F.linear``, one op)."""
        if self.layer_norm:
            return normalized_projection(
                self.data, self.w_ih, self.weight, self.input_bias(), self.eps, self.blocks
            )
        bias = self.input_bias()
        if (  # the rule first: a one-row call's few rows end it at its first test
            self.data.dim() == 2
            and _cstep.input_product_by_c(self.data, self.w_ih, True)
            and self.data.is_cpu
            and not differentiated(self.data, self.w_ih, bias)
            and not torch.jit.is_tracing()
        ):
            shape = (self.data.shape[0], self.w_ih.shape[0])
            gx = _cstep.input_product(self.data, self.w_ih, True, self.data.new_empty(shape))
            return gx if bias is None else gx.add_(bias)
        return F.linear(self.data, self.w_ih, bias)

    def kernel_args(self) -> dict[str, Any]:
        """The C sequence kernels' projection arguments (``rnn_abi.SEQ_FWD``)."""
        bias = self.input_bias()
        return {
            "x": self.data.contiguous(), "w_ih": self.w_ih.contiguous(),
            "w0": None if self.weight is None or not self.layer_norm else self.weight.contiguous(),
            "b0": None if bias is None else bias.contiguous(),
            "split": (self.blocks or (self.w_ih.shape[0],))[0],
        }  # fmt: skip


GatesInput = Tensor | InputProjection


def _gx(source: GatesInput) -> Tensor:
    return source.compute() if isinstance(source, InputProjection) else source


def _projects_in_sequence_kernel(zh: Tensor | None) -> bool:
    """Whether the LSTM's sequence kernel computes torch.nn.LSTM's projection itself (inference,
    C kernels available): where the target has the sequence kernels and no zoneout acts on the
    projected h (C refuses it with zh, rnn_abi's _RECURRENT_PROJECTION)."""
    return zh is None and _cstep.sequence_gemm()


def _inference_kernels(gx: Tensor, st: dict[str, Any], seq: str) -> StepKernels | None:
    """The kernels that run a whole direction with kept buffers of B rows (each step overwrites
    the last's): those with whole-sequence functions (the C kernels; with torch.nn.LSTM's
    projection too, which the LSTM's sequence kernel computes in its time loop, unless zoneout
    acts on the projected h), or with the projection the per-step C kernels (the projection runs
    between their calls, :func:`._cstep.projected_by_steps`); ``None`` otherwise."""
    kernels = _kernels(gx, st)
    if st.get("w_hr") is not None:
        if kernels is C_STEPS and _projects_in_sequence_kernel(st.get("zh")):
            return C_KERNELS
        return kernels if kernels is C_STEPS else None
    return kernels if getattr(kernels, seq) is not None else None


def _inference(
    args: tuple[Any, ...],
    seq: str,
    w_hh: Tensor,
    sched: Schedule,
    state: Callable[[Tensor, int], dict[str, Any]],
    results: tuple[str, ...],
    in_loop_ok: bool = True,
    kernel_bias: str | None = None,
) -> tuple[Tensor, ...] | None:
    """A direction on the inference path, or ``None`` where it does not run: when autograd will
    not differentiate it (``torch.no_grad()``, or no input requires grad) and the kernels run
    whole directions (:func:`_inference_kernels`). No autograd node then, nothing kept for
    backward, and the per-row buffers (pre-activations, gates, statistics) have only the batch's
    rows (``state`` builds them from ``gx`` and the rows N), overwritten each step, so they stay
    in cache. Given an :class:`InputProjection` (and float32 / float64 CPU data), ``gx`` is one
    of those buffers too, which the kernel fills each step from that step's inputs: the only
    passes over the sequence are reading its inputs and writing its output (unless
    ``in_loop_ok`` is false). ``kernel_bias``: the entry of ``st`` holding the bias folded from
    parameters, where it is not the input side's (:class:`InferencePlan`)."""
    source = args[0]
    projected = isinstance(source, InputProjection)
    tensors = [a for a in args if isinstance(a, Tensor)]
    if differentiated(*tensors, *(source.tensors() if projected else ())):
        return None
    if torch.jit.is_tracing():
        return None
    # in_loop_ok: whether the kernels may project the inputs (not between per-step calls)
    in_loop = projected and in_loop_ok and _projects_in_loop(source, args[1].shape[0], seq)
    if in_loop:
        n_rows, n_batch = source.data.shape[0], args[1].shape[0]
        gx = source.data.new_empty(n_batch, source.w_ih.shape[0])
    else:
        gx = _gx(source).contiguous()
        n_rows = gx.shape[0]
    st = state(gx, n_rows)
    kernels = _inference_kernels(gx, st, seq)
    if kernels is None or (in_loop and getattr(kernels, seq) is None):
        return None
    if in_loop:
        st["projection"] = source.kernel_args()
        if seq == "lstm_fwd_seq" and source.layer_norm and _STEP_NORMALIZES_INPUT:
            _input_norm_in_step(st, n_batch)
    if st.get("w_hr") is not None and kernels is C_STEPS:
        _cstep.projected_by_steps(st, w_hh, sched)
    elif kernels is C_KERNELS and not in_loop and _one_step_by_gemm(sched, gx.dtype):
        _cstep.by_steps(seq, st, w_hh, sched)
    else:
        getattr(kernels, seq)(st, w_hh, sched)
    result = tuple(st[k] for k in results)
    kept = _KEPT_PLANS.get()
    # (a plan re-points the step struct's output and state; with the recurrent projection the
    # sequence struct holds those)
    if kept is not None and projected and "_call" in st and st.get("w_hr") is None:
        kept.append(InferencePlan(st, source, in_loop, results, kernel_bias))
    return result


# The LN-LSTM's inference loop normalizes each step's projected rows inside the step kernel (as
# training does), where input_rows wrote a normalized copy for the step to read back: the step's
# rows in cache, one thread, AMD EPYC Zen 5, ns a row (bench_rnn_step.py --input-norm /
# --input-rows) H = 32 119 / 166, 64 162 / 215, 128 267 / 344, 256 572 / 921.
_STEP_NORMALIZES_INPUT = True


def _input_norm_in_step(st: dict[str, Any], n_batch: int) -> None:
    """Move the LSTM's input-side layer norm (gain ``w0``, bias ``b0``) from the sequence
    kernel's projection to its step kernel, with the step's statistics buffers of ``n_batch``
    rows: the projection then writes raw rows. ``st["input_bias_in_step"]``: whether ``b0`` is
    the folded input bias (an :class:`InferencePlan` folds into it) or zeros standing in."""
    projection = st["projection"]
    st.update(_input_norm_fields(st["gx"], projection["w0"], projection["b0"], n_batch),
              input_bias_in_step=projection["b0"] is not None)  # fmt: skip
    st["projection"] = {**projection, "w0": None, "b0": None}


def _input_norm_fields(
    like: Tensor, w0: Tensor | None, b0: Tensor | None, rows: int
) -> dict[str, Tensor]:
    """The LSTM step's input-side layer norm (``rnn_abi``'s ``_INPUT_NORM_FWD``): its gain and
    bias, ones and zeros where the layer has none (the kernel reads both), and its statistics
    buffers of ``rows`` rows."""
    g = like.shape[1]
    return {"w0": like.new_ones(g) if w0 is None else w0.contiguous(),
            "b0": like.new_zeros(g) if b0 is None else b0.contiguous(),
            **_new_bufs(like, rows, {"mx": 0, "rx": 0})}  # fmt: skip


# Where a caller asked for it (keeping_plans), the inference path's plans of this call.
_KEPT_PLANS: contextvars.ContextVar[list[InferencePlan] | None] = contextvars.ContextVar(
    "layernorm_kept_inference_plans", default=None
)


@contextlib.contextmanager
def keeping_plans() -> Iterator[list[InferencePlan]]:
    """Collect the :class:`InferencePlan` of every direction the inference path runs inside the
    block (one per :func:`lstm_sequence` / :func:`gru_sequence` call that took it)."""
    kept: list[InferencePlan] = []
    token = _KEPT_PLANS.set(kept)
    try:
        yield kept
    finally:
        _KEPT_PLANS.reset(token)


class InferencePlan:
    """A direction's inference call kept for the next call with the same arguments but for the
    input's and the initial state's values: the per-step buffers of B rows, the checked kernel
    structs, the folded gains and biases they point at. :meth:`run` copies the initial state in,
    points the structs at the new input and a new output, and runs the sequence kernel: what a
    call of a few rows (a decoder's step) costs is then the kernel and a few tensor operations,
    not the packing of two structs and a dozen buffers.

    Valid only while everything it was built from holds (the caller's key: shapes, dtype,
    steps, which parameters at which addresses, threads, kernel target); the structs read the
    parameters where they are, and the one value folded from them, the input side's bias, is
    folded again on every call (by the caller's function, into the buffer the kernel reads where
    there is one). One call at a time: a call that finds it busy (another thread) gets ``None``
    and takes the ordinary path."""

    def __init__(
        self,
        st: dict[str, Any],
        source: InputProjection,
        in_loop: bool,
        results: tuple[str, ...],
        kernel_bias: str | None = None,
    ) -> None:
        # kernel_bias: the entry of st where the folded bias goes (the Elman RNN's layer-norm
        # bias), instead of the input side's
        self.st, self.call, self.in_loop = st, st["_call"], in_loop
        # whether it projects its input in the kernel's loop and multiplies by a bfloat16 layer's
        # W_ih and W_hh as stored (_cstep.half_weights): it then reads neither float32 copy (the
        # structs are fixed once built; a step kernel's call has no sequence struct)
        seq_args = getattr(self.call, "seq_args", None)
        self.weights_as_stored = bool(
            in_loop and seq_args is not None and seq_args.w_half and seq_args.w_ih_half
        )
        self.kernel_bias = kernel_bias
        # the input side's bias as a function of the buffer it goes to (see run): set by the
        # plan's owner, which knows the parameters it is folded from
        self.fold_bias: Callable[[Tensor | None], Tensor | None] = _fold_unset
        self.source = source._replace(data=None)  # type: ignore[arg-type]
        self.results = results
        self.out_cols = st["out"].shape[1]
        # an output under the buffer cache's minimum: torch's allocator directly (a cell's step)
        self.small_out = st["out"].numel() * st["out"].element_size() < _buffers.MIN_BYTES
        self.lock = threading.Lock()
        # what belonged to the call that built it: its output, input, projection, and the final
        # states it returned (the plan's state buffers must not be those)
        st["out"] = None
        for name in results[1:]:
            st[name] = st[name].clone()
            setattr(self.call.args, name, st[name].data_ptr())
        if in_loop:
            st["projection"] = {**st["projection"], "x": None}
        else:
            st["gx"] = None

    def run(
        self,
        data: Tensor,
        h0: Tensor,
        c0: Tensor | None,
        fold_bias: Callable[[Tensor | None], Tensor | None],
        final_hidden: bool = True,
    ) -> tuple[Tensor | None, ...] | None:
        """``(out, h_n[, c_n])`` for ``data`` (N rows, as when built) from ``h0`` (``c0``), with
        the input side's bias as ``fold_bias(buffer)`` folds it now from the parameters (which
        may have changed in place): written into ``buffer``, the one the kernel reads, where it
        can, else returned (``None`` where the plan was built without one; ``buffer`` is
        ``None`` where the bias goes to the projection before the loop). Without
        ``final_hidden``, ``h_n`` comes back as ``None`` instead of a copy of the plan's state
        (a cell's step: its output is ``h_n``)."""
        if not self.lock.acquire(blocking=False):
            return None
        _cstep.note_half_weights(self.weights_as_stored)
        try:
            st, call = self.st, self.call
            data = data.contiguous()
            st["h"].copy_(h0)
            if c0 is not None:
                st["c"].copy_(c0)
            shape = (data.shape[0], self.out_cols)
            out = data.new_empty(shape) if self.small_out else _buffers.empty(data, shape)
            call.args.out = out.data_ptr()
            if self.in_loop:
                in_step = st.get("input_bias_in_step", False)
                _fold_into(st["b0"] if in_step else st["projection"]["b0"], fold_bias)
                call.seq_args.x = data.data_ptr()
                call.run()
                call.seq_args.x = None
            else:
                if self.kernel_bias is not None:
                    _fold_into(st[self.kernel_bias], fold_bias)
                    bias = None
                else:
                    bias = fold_bias(None)
                gx = self.source._replace(data=data, bias=bias, torch_biases=None).compute()
                gx = gx.contiguous()
                call.args.gx = gx.data_ptr()
                call.run()
                call.args.gx = None
            call.args.out = None  # no address of this call's tensors stays in the structs
            return (out, *(st[k].clone() if final_hidden or k != "h" else None
                           for k in self.results[1:]))  # fmt: skip
        finally:
            self.lock.release()


def _fold_unset(out: Tensor | None) -> Tensor | None:
    raise RuntimeError("an InferencePlan's owner sets its fold_bias before running it")


def _fold_into(kept: Tensor | None, fold_bias: Callable[[Tensor | None], Tensor | None]) -> None:
    """The input side's bias folded into ``kept``, the buffer a kept kernel struct reads it from
    (no bias where ``kept`` is ``None``). A layer without biases folds none (``None``): its
    kernel reads the zeros it was given for the bias (``_cstep``'s defaults), which stay."""
    if kept is not None:
        folded = fold_bias(kept)
        if folded is not None and folded is not kept:
            kept.copy_(folded)


# The dtypes whose inference projection the C sequence kernels compute (their instances).
_LOOP_PROJECTION_DTYPES = (torch.float32, torch.float64)
# The C time loop packs W_ih for its GEMM on every call, a pass over W_ih and another over the
# packed copy: that pays from about 128 rows, or with a small W_ih, where the projection before
# the loop (torch's GEMM, then a layer-norm pass) costs its own per-call overhead. LN-LSTM, one
# thread, AMD EPYC, in-loop / before-loop time: (T, B, I, H) = (1, 16, 512, 512) 1.46,
# (4, 16, 512, 512) 1.04, (8, 16, 512, 512) 1.03, (2, 64, 650, 650) 1.00; (1, 32, 256, 256)
# 0.98, (2, 8, 64, 128) 0.91, (16, 8, 64, 128) 0.91; at the bench shapes 0.85-0.92. And every
# step reads all of the packed W_ih for its few rows: past a few MiB (out of the per-core
# caches) that is a pass over memory per step, where one GEMM over all rows reads W_ih once per
# block of rows: at (35, 20, 650, 650) (6.8 MB) in the loop took 1.10-1.31x torch's time, before
# it 0.91-0.97x; at (100, 64, 256, 512) (2 MiB) in the loop 0.98-1.06x, before it 1.22-1.24x.
# The limit is on the packed copy's bytes: a bfloat16 layer's products pack W_ih as bfloat16
# pairs, half of float32's, and its (35, 20, 650, 650) (3.4 MB packed) took 1.47-1.49x torch's
# bfloat16 LSTM in the loop, 1.98-2.06x before it (one and two threads, AMD EPYC, AVX512-BF16).
_LOOP_PROJECTION_ROWS = 128
# Training (LN-LSTM: the forward kernel projects each step's rows into gx, kept raw; the backward
# kernel multiplies each step's dgx rows by W_ih for x's gradient) follows the same rule from this
# many rows: the loop's two GEMMs against three of torch's over all rows before and after the
# calls (W_ih's gradient stays one GEMM over all rows). LN-LSTM training, AMD EPYC (Zen 4), time
# x torch.nn.LSTM's, before / in the loop, one process, 25 interleaved rounds (ab_rnn.py), one
# thread: (T, B, I, H) = (50, 8, 64, 128) 1.29 / 1.27, (100, 4, 64, 128) 1.27 / 1.24,
# (60, 8, 32, 64) 1.27 / 1.24, (50, 16, 128, 256) 1.21 / 1.18, (30, 16, 256, 256) 1.17 / 1.15,
# (20, 8, 64, 128) 1.23 / 1.18, (10, 16, 64, 128) 1.26 / 1.23, (20, 16, 64, 128) 1.33 / 1.35,
# (35, 20, 650, 650) 0.97 / 0.98 (past _LOOP_PROJECTION_MAX_BYTES: before the loop either way);
# two threads 1.27 / 1.23, 1.04 / 1.02, 1.27 / 1.29, 1.22 / 1.18, 1.16 / 1.13, (20, 16, 64, 128)
# 1.30 / 1.24. From 1024 rows it was in the loop before: (1000, 4, 32, 128) 1.28 / 1.20.
_LOOP_PROJECTION_TRAINING_ROWS = 0
_LOOP_PROJECTION_WEIGHT = 1 << 18
_LOOP_PROJECTION_MAX_BYTES = 4 << 20
# Where the C GEMM outpaces torch.mm (rnn.tile_outpaces_torch_gemm) the loop pays for this many
# times the limit: AMD EPYC family 26, one thread, before / in the loop, ms: inference (T, B, I, H)
# = (35, 20, 650, 650) 34.2 / 22.8, (100, 4, 650, 650) 21.4 / 16.7, (100, 12, 650, 650) 58.1 /
# 36.6, (200, 32, 650, 650) 322 / 193; training (35, 20, 650, 650) 1.27 / 1.03x torch.nn.LSTM's
# time. Not at 16 MiB (a W_ih of 1024 x 4096), whose packed copy and W_hh's fill the shared cache:
# (50, 8, 1024, 1024) 49.7 / 56.4, (50, 12, 1024, 1024) 74.5 / 78.7 (at 20 rows 84.3 / 71.3).
_LOOP_PROJECTION_OUTPACED_SCALE = 2
# Steps of one or two rows: each step's projection reads all of the packed W_ih for them, a
# matrix-vector product bound by loading W_ih, where one GEMM over all rows before the loop runs
# at the core's peak. For the LSTM (kernel: (fewer rows than this, W_ih elements up to this · B²
# in the loop)) that lost from 32 K elements with one row and past 64 K with two. LN-LSTM
# inference, one thread, AMD EPYC (Zen 4), in the loop / before it, x torch.nn.LSTM's time
# (training too: (1100, 1, 128, 256) 1.31 / 1.08, (1000, 1, 64, 128) 1.11 / 1.11):
# (T, B, I, H) = (1000, 1, 32, 128) 0.82 / 0.92, (100, 1, 32, 64) 0.93 / 0.95, (100, 1, 64, 128)
# 1.05-1.08 / 1.01-1.02, (500, 1, 64, 128) 0.95 / 0.88, (300, 1, 128, 128) 1.19 / 1.00,
# (200, 1, 128, 256) 1.05 / 0.89, (50, 1, 256, 256) 0.81 / 0.63; two rows (100, 2, 64, 128)
# 0.97 / 1.04, (200, 2, 128, 256) 0.93 / 0.91; three and four rows (200, 3, 128, 256) 0.93 /
# 1.13, (200, 4, 128, 256) 0.99 / 1.10. The LN-GRU's won in the loop at one row too:
# (200, 1, 128, 256) 0.48 / 0.54, (500, 1, 64, 128) 0.24 / 0.24, (200, 2, 128, 256) 0.34 / 0.37.
_LOOP_PROJECTION_FEW_ROWS = {"lstm_fwd_seq": (3, 1 << 14)}


def _one_step_by_gemm(sched: Schedule, dtype: torch.dtype | None = None) -> bool:
    """Whether an inference direction runs torch's GEMM ``h W_hhᵀ`` and the C step kernel instead
    of the sequence kernel: for one step of more rows than :func:`._cstep.direct_rows` (a
    decoder's step of a batch), whose GEMM the sequence kernel runs on a packed copy of W_hh made
    on every call (a pass over W_hh, one over the copy) where torch's reads W_hh once as stored.
    LN-GRU, one thread, AMD EPYC (AVX2), ours / torch.nn.GRU with the sequence kernel and with
    this: (B, I, H) = (16, 1024, 1024) 1.45 / 1.08, (32, 512, 512) 1.30 / 1.17, (12, 512, 512)
    1.33 / 1.13, (16, 256, 256) 1.03 / 1.01; LN-LSTM (16, 512, 1024) 1.43 / 0.98,
    (32, 512, 512) 1.13 / 0.99; none slower (benchmarks/RESULTS.md). From two steps on the
    packing pays: (T, B, I, H) = (4, 16, 1024, 1024) GRU 0.90 / 1.00, (16, 16, 1024, 1024) LSTM
    0.97 / 1.32 with torch's GEMM per step. Not from :data:`_ONE_STEP_TILE_MIN_ROWS` rows where
    the C GEMM outpaces torch's (:func:`._cstep.tile_outpaces_torch_gemm`): there the packing
    costs less than the product saves. Nor, in inference (``dtype`` given), where MKL's sgemm
    serves one step inside the sequence kernel (:func:`._cstep.one_step_sgemm`), reading W_hh as
    stored as torch's GEMM would, in the same call as the step."""
    if len(sched) != 1:
        return False
    if dtype is not None and _cstep.one_step_sgemm(dtype):
        return False
    rows = sched[0][2]
    if rows >= _ONE_STEP_TILE_MIN_ROWS and _cstep.tile_outpaces_torch_gemm():
        return False
    return rows > _cstep.direct_rows()


# One step of this many rows or more runs the sequence kernel (its tile GEMM on a packed W_hh)
# where the C GEMM outpaces torch's. AMD EPYC Zen 5, inference, ours / torch.nn's layer, torch's
# GEMM and the step kernel / the sequence kernel, one thread: (B, I, H) = (256, 256, 256) LSTM
# 1.37 / 1.00, GRU 0.52 / 0.52, Elman 0.72 / 0.50; (64, 512, 512) 0.49 / 0.42, 0.84 / 0.67,
# 0.77 / 0.57; (32, 256, 256) 1.05 / 0.91, 0.58 / 0.59, 0.97 / 0.80; (48, 128, 256) LSTM 0.53 /
# 0.41; two threads (64, 512, 512) 0.46 / 0.37, 0.85 / 0.58, 0.88 / 0.56, (32, 128, 128) Elman
# 1.41 / 1.17. Fewer rows, one thread: (12, 512, 512) 0.57 / 0.63, 1.07 / 1.13, 1.01 / 0.90;
# (16, 1024, 1024) level (RESULTS.md, 2026-11-28).
_ONE_STEP_TILE_MIN_ROWS = 32


def _one_step_kernels(kernels: StepKernels, sched: Schedule) -> StepKernels:
    """The GRU's training kernels: for one step of a batch (:func:`_one_step_by_gemm`) the C step
    kernels around torch's GEMMs, where the sequence kernels would pack ``W_hh`` forward and
    backward for that one step; ``kernels`` otherwise."""
    return C_STEPS if kernels is C_KERNELS and _one_step_by_gemm(sched) else kernels


# One LSTM step of a batch past the direct GEMM's rows (a decoder's token for a batch of 9 or
# more, a cell's call), where MKL's sgemm does not serve it (rnn.use_one_step_gemm("packed"), no
# MKL, float64), packs W_ih and W_hh inside the kernel for a single use of each; on one
# thread, from this many W_ih elements, torch's GEMMs and the step kernel take less
# (_one_step_by_gemm). LSTM cell inference by its kept plan, AMD EPYC (Zen 4), x
# torch.nn.LSTMCell's time, in the loop / before it, one thread: (B, I, H) = (9, 128, 256)
# 1.42 / 1.24, (16, 128, 256) 1.36 / 1.17, (32, 128, 256) 1.19 / 1.10, (9, 256, 256) 1.42 /
# 1.28, (16, 256, 256) 1.42 / 1.10, (32, 256, 256) 1.31 / 1.05; below it the loop wins:
# (9, 64, 128) 1.28 / 1.55, (16, 128, 128) 1.23 / 1.44, (32, 128, 128) 1.11 / 1.28. Two threads
# (the kernel's packing shared by both) keep the loop: (9, 128, 256) 1.19-1.20 / 1.34-1.38,
# (32, 128, 256) 1.03-1.06 / 1.20-1.27, (32, 256, 256) 1.10 / 1.20. The GRU's step before the
# loop (a GEMM and a layer norm per block) lost or tied at these shapes on one thread, and keeps
# the loop.
_ONE_STEP_LOOP_PROJECTION_WEIGHT = {"lstm_fwd_seq": 1 << 17}


def _projects_in_loop(source: InputProjection, n_batch: int, seq: str = "") -> bool:
    """Whether the C time loop of sequence kernel ``seq`` computes ``source`` in inference (see
    the measures above): always for one step of at most ``direct_rows`` rows (a decoder's token),
    where the kernel reads W_ih as stored, once, as a GEMM before the loop would (W_ih 12 MiB,
    one row: the GRU's call took 2.6 ms with the projection before the loop, against
    torch.nn.GRU's 2.1), and for one float32 step of more rows where MKL's sgemm serves it
    (:func:`._cstep.one_step_sgemm`: W_ih read as stored too; LN-GRU (1, 16, 512, 512) 1.15 →
    1.00x torch.nn.GRU, LN-LSTM (1, 64, 256, 256) 1.01 → 0.89x, one thread, Intel Xeon);
    elsewhere not for one LSTM step of more rows on one thread with a W_ih of
    :data:`_ONE_STEP_LOOP_PROJECTION_WEIGHT` elements or more; for steps of fewer rows than
    :data:`_LOOP_PROJECTION_FEW_ROWS` names, up to its W_ih size."""
    data, w_ih = source.data, source.w_ih
    one_step_of_a_batch = _cstep.direct_rows() < data.shape[0] <= n_batch
    if one_step_of_a_batch and data.is_cpu and _cstep.one_step_sgemm(data.dtype):
        return True
    if (
        one_step_of_a_batch
        and torch.get_num_threads() == 1
        and w_ih.numel() >= _ONE_STEP_LOOP_PROJECTION_WEIGHT.get(seq, math.inf)
    ):
        return False
    return _loop_projection_pays(data, w_ih, n_batch, seq)


def _loop_projection_pays(data: Tensor, w_ih: Tensor, n_batch: int, seq: str) -> bool:
    """Whether the time loop of sequence kernel ``seq`` projecting ``data`` itself (one GEMM of a
    step's rows per step, ``n_batch`` rows at most) beats one GEMM over all rows before it, by the
    rules measured above: one step of at most ``direct_rows`` rows always (see
    :func:`_projects_in_loop`); else its packed W_ih within :func:`loop_projection_max_bytes`, a
    W_ih of :data:`_LOOP_PROJECTION_FEW_ROWS`' size at most for steps of few rows, and enough
    rows or a small W_ih."""
    if not data.is_cpu or data.dtype not in _LOOP_PROJECTION_DTYPES:
        return False
    if data.shape[0] <= min(n_batch, _cstep.direct_rows()):
        return True
    rows, weight = _LOOP_PROJECTION_FEW_ROWS.get(seq, (0, 0))
    if n_batch < rows and w_ih.numel() > weight * n_batch * n_batch:
        return False
    # the packed W_ih's bytes: bfloat16 pairs for a bfloat16 layer's products
    packed = w_ih.numel() * (2 if _cstep.bfloat16_projection() else w_ih.element_size())
    if packed > loop_projection_max_bytes():
        return False
    return data.shape[0] >= _LOOP_PROJECTION_ROWS or w_ih.numel() <= _LOOP_PROJECTION_WEIGHT


def loop_projection_max_bytes() -> int:
    """The most bytes of packed W_ih the time loop projects with:
    :data:`_LOOP_PROJECTION_MAX_BYTES`, :data:`_LOOP_PROJECTION_OUTPACED_SCALE` times it where the
    C GEMM outpaces torch.mm (:func:`._cstep.tile_outpaces_torch_gemm`)."""
    scale = _LOOP_PROJECTION_OUTPACED_SCALE if _cstep.tile_outpaces_torch_gemm() else 1
    return _LOOP_PROJECTION_MAX_BYTES * scale


def projects_in_training_loop(x: Tensor, w_ih: Tensor, n_batch: int) -> bool:
    """Whether an LSTM training direction has the C time loop project its inputs ``x``
    (:class:`LSTMSequence`'s ``w_ih``): from :data:`_LOOP_PROJECTION_TRAINING_ROWS` rows, where
    :func:`_loop_projection_pays`."""
    return x.shape[0] >= _LOOP_PROJECTION_TRAINING_ROWS and _loop_projection_pays(
        x, w_ih, n_batch, "lstm_fwd_seq"
    )


def lstm_sequence(*args: Any) -> tuple[Tensor, Tensor, Tensor]:
    """One LSTM direction with :class:`LSTMSequence`'s arguments and results (``gx`` may be an
    :class:`InputProjection`): the inference path where it runs (:func:`_inference`), else
    :meth:`LSTMSequence.apply`."""
    (_, h0, c0, w_hh, w1, b1, w3, b3, sched, eps, normalize, carry, *masks) = args

    def state(gx: Tensor, n_rows: int) -> dict[str, Any]:
        return _lstm_state(gx, h0, c0, w1, b1, w3, b3, eps, normalize, carry,
                           *_padded(masks, 4), kept_rows=h0.shape[0], n_rows=n_rows)  # fmt: skip

    zh, _, _, w_hr = _padded(masks, 4)
    # with torch.nn.LSTM's projection the inputs are projected in the time loop only by the
    # sequence kernel, where it computes the projection
    in_loop_ok = w_hr is None or _projects_in_sequence_kernel(zh)
    out = _inference(
        args, "lstm_fwd_seq", w_hh, sched, state, ("out", "h", "c"), in_loop_ok=in_loop_ok
    )
    if out is not None:
        return out  # type: ignore[return-value]
    source = args[0]
    if _normalizes_in_kernel(source, w_hr) or _projects_in_node(source, w_hr, normalize):
        # the node projects the inputs (with a layer norm the kernels add it, without one the
        # time loop projects), torch's biases folded into its bias there: one autograd node for
        # the layer's direction
        b_ih, b_hh = source.torch_biases or (None, None)
        return LSTMSequence.apply(  # type: ignore[no-any-return]
            source.data, *args[1:12], *_padded(masks, 4), source.layer_norm, source.weight,
            source.bias, source.w_ih, b_ih, b_hh,
        )  # fmt: skip
    return LSTMSequence.apply(_gx(source), *args[1:])  # type: ignore[no-any-return]


# From this size of the projection or of W_ih on, raw_projection takes _Projection: below it the
# Python node costs more than the page faults of fresh memory it saves. LN-LSTM training, one
# thread, F.linear / _Projection, x torch.nn.LSTM's time: (5, 4, 32, 32) 1.56 / 1.70,
# (20, 32, 16, 32) 1.58 / 1.65, (1, 4, 128, 128) 1.35 / 1.51, (50, 8, 64, 128) 1.16 / 1.21; LN-GRU
# (1, 32, 512, 512) (W_ih 3 MB) 1.17 / 1.02.
_PROJECTION_NODE_BYTES = 1 << 20


def raw_projection(data: Tensor, w_ih: Tensor) -> Tensor:
    """``data W_ihᵀ`` for all rows, differentiable: :class:`_Projection` (result and gradients in
    buffers of the cache) on the CPU from :data:`_PROJECTION_NODE_BYTES` of result or weight, else
    ``F.linear``; ``F.linear`` under a trace too, which would keep a buffer as a constant."""
    size = _projection_bytes(data, w_ih)
    if data.is_cpu and size >= _PROJECTION_NODE_BYTES and not torch.jit.is_tracing():
        return _Projection.apply(data, w_ih)  # type: ignore[no-any-return]
    return F.linear(data, w_ih)


def _projected(data: Tensor, w_ih: Tensor) -> Tensor:
    """``data W_ihᵀ``, into a buffer of the cache from :data:`_PROJECTION_NODE_BYTES` of result
    or weight (see :func:`raw_projection`)."""
    shape = (data.shape[0], w_ih.shape[0])
    if _projection_bytes(data, w_ih) < _PROJECTION_NODE_BYTES:
        return _cstep.input_product(data, w_ih, True, data.new_empty(shape))
    return _cstep.input_product(data, w_ih, True, _buffers.empty(data, shape))


def _projection_grads(
    kernels: StepKernels,
    grad: Tensor,
    data: Tensor,
    w_ih: Tensor,
    need_data: bool,
    need_w: bool,
    rounded: bool = False,
) -> tuple[Tensor | None, Tensor | None]:
    """The gradients of ``data`` and ``W_ih`` from that of ``data W_ihᵀ``: data's into a buffer
    of the cache where :func:`_projected` took one; W_ih's as the recurrent weight's
    (:func:`_weight_grad`: the C GEMM where ``kernels`` have it and it is the faster). Both by
    :func:`._cstep.rounded_product` with ``rounded`` (a projection inside the rounded recurrent
    products).

    One thread, AMD EPYC (AVX-512), µs of ``gradᵀ.mm(data)`` / the C GEMM, (N, G, I) =
    (400, 512, 64) 359 / 266, (240, 512, 64) 223 / 160, (800, 512, 64) 713 / 529."""
    d_data = None
    if need_data:
        shape = (grad.shape[0], w_ih.shape[1])
        small = _projection_bytes(data, w_ih) < _PROJECTION_NODE_BYTES
        out = grad.new_empty(shape) if small else _buffers.empty(grad, shape)
        if rounded:
            d_data = _cstep.rounded_product(grad, w_ih, out)
        else:
            d_data = _cstep.input_product(grad.contiguous(), w_ih, False, out)
    return d_data, (_weight_grad(kernels, grad, data, rounded) if need_w else None)


def _projection_bytes(data: Tensor, w_ih: Tensor) -> int:
    """The larger of ``data W_ihᵀ``'s and ``W_ih``'s sizes in bytes."""
    return max(data.shape[0], w_ih.shape[1]) * w_ih.shape[0] * data.element_size()


class _Projection(torch.autograd.Function):
    """``data W_ihᵀ`` for all rows (``F.linear`` without bias) into a buffer of the cache
    (:mod:`layernorm.kernels.cpu.buffers`: a fresh ``(N, G)`` result costs its page faults on
    every call), with
    ``W_ih``'s gradient from :func:`._cstep.transposed_product`."""

    @staticmethod
    def forward(ctx: Any, data: Tensor, w_ih: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(data, w_ih)
        # the forward records the choice, as the sequence kernels do: backward may run elsewhere
        ctx.rounded = _cstep.rounds_gradient_products(_cstep.half_gemm_of(data.dtype))
        return _projected(data, w_ih)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:  # type: ignore[override]
        data, w_ih = ctx.saved_tensors
        need = ctx.needs_input_grad
        return _projection_grads(
            step_kernels(grad), grad, data, w_ih, need[0], need[1], ctx.rounded
        )


def _normalizes_in_kernel(source: GatesInput, w_hr: Tensor | None) -> bool:
    """Whether the LSTM's training path passes the raw projection and lets the C sequence
    kernels add its layer norm (:class:`LSTMSequence`'s ``input_norm``): one pass over the
    ``(N, G)`` projection forward and one backward, where a layer norm before the call writes
    a normalized copy and one after it reads the gates' gradient and the projection back."""
    return (
        isinstance(source, InputProjection)
        and source.layer_norm
        and source.blocks is None
        and w_hr is None
        and not torch.jit.is_tracing()
        and step_kernels(source.data) is C_KERNELS
    )


def _projects_in_node(source: GatesInput, w_hr: Tensor | None, normalize: bool) -> bool:
    """Whether the LSTM's training path without layer norms passes the raw inputs to its node
    (:class:`LSTMSequence`'s ``w_ih`` without ``input_norm``), as with them: where
    :func:`projects_in_training_loop` says the loop pays, its C time loop projects each step's
    rows and its backward loop multiplies each step's gradient rows by W_ih for x's; elsewhere
    the node's own GEMMs over all rows (the bias added in place, W_ih's gradient by
    :func:`_weight_grad`), one autograd node where ``F.linear`` made one more. ``F.linear``'s
    GEMMs run at torch.mm's rate, half the C GEMM's where that outpaces it
    (:func:`._cstep.tile_outpaces_torch_gemm`)."""
    return (
        isinstance(source, InputProjection)
        and not source.layer_norm
        and not normalize
        and source.blocks is None
        and w_hr is None
        and not torch.jit.is_tracing()
        and step_kernels(source.data) is C_KERNELS
    )


def gru_sequence(*args: Any) -> tuple[Tensor, Tensor]:
    """One GRU direction with :class:`GRUSequence`'s arguments and results (``gx`` may be an
    :class:`InputProjection`): the inference path where it runs (:func:`_inference`), else
    :meth:`GRUSequence.apply`."""
    (_, h0, w_hh, w_rz, b_rz, w_n, b_n, b_hn, sched, eps, normalize, *masks) = args

    def state(gx: Tensor, n_rows: int) -> dict[str, Any]:
        return _gru_state(gx, h0, w_rz, b_rz, w_n, b_n, b_hn, eps, normalize, *_padded(masks, 2),
                          kept_rows=h0.shape[0], n_rows=n_rows)  # fmt: skip

    out = _inference(args, "gru_fwd_seq", w_hh, sched, state, ("out", "h"))
    if out is None:
        return GRUSequence.apply(_gx(args[0]), *args[1:])  # type: ignore[no-any-return]
    return out  # type: ignore[return-value]


def _padded(values: list[Any], n: int) -> list[Any]:
    """The optional trailing arguments, ``None`` where not given."""
    return [*values, *(None,) * (n - len(values))]


def _save(
    ctx: Any, st: dict[str, Any], w_hh: Tensor, sched: Schedule, names: tuple[str, ...]
) -> None:
    """Save ``w_hh`` and the entries ``names`` of ``st`` (tensors or ``None``) for backward, and
    its non-tensor entries (sizes, flags)."""
    ctx.save_for_backward(w_hh, *(st[k] for k in names))
    ctx.names, ctx.sched = names, sched
    ctx.consts = {k: v for k, v in st.items() if not isinstance(v, Tensor) and v is not None}


def _restore(ctx: Any) -> tuple[Tensor, dict[str, Any]]:
    """``(w_hh, st)`` with what :func:`_save` kept.

    ``gx`` is not kept unless named (backward reads its values only when the kernels normalize
    it, and keeping it would hold an ``(N, G)`` buffer that nothing else keeps, an eighth of an
    LN-LSTM's training memory): ``st["gx"]`` is then ``hp``, which has gx's shape, dtype and
    device, all that backward asks of it."""
    w_hh, *saved = ctx.saved_tensors
    st = {**ctx.consts, **dict(zip(ctx.names, saved, strict=True))}
    if "gx" not in st:  # kept only where backward reads it (LSTMSequence's input_norm)
        st["gx"] = st["hp"]
    return w_hh, st


class LSTMSequence(torch.autograd.Function):
    """Recurrence of one LSTM direction given ``gx = LN(W_ih x) + b`` for all rows.

    Inputs: ``gx (N, 4H)``, ``h0, c0 (B, H)``, ``w_hh (4H, H)``, LN(hp) gain/bias ``(4H)``, LN(c)
    gain/bias ``(H)`` (``None`` when absent), the schedule, eps, whether to normalize, whether the
    carried state is LN(c), the optional masks (:class:`._options.Masks`): zoneout ``zh (N, P)``,
    ``zc (N, H)``, recurrent dropout ``cm (B, H)`` (not differentiated), and torch.nn.LSTM's
    projection ``w_hr (P, H)`` (then ``h0`` and ``w_hh`` have P columns; without it P = H).
    Outputs: ``out (N, P)`` (h at every row), ``h_n (B, P)``, ``c_n (B, H)``. Buffer names are
    those of :mod:`._pointwise`.

    With ``input_norm`` (the C sequence kernels only, see :func:`_normalizes_in_kernel`), ``gx``
    is the raw projection ``W_ih x`` and the kernels add ``LN(gx; w0, b0)`` inside each step
    (``w0``, ``b0`` ``(4H)``; ``None``: ones, zeros), keeping its row statistics; backward turns
    the gates' gradient into gx's in place and sums ``w0``'s and ``b0``'s gradients as it goes.
    With ``w_ih`` (``(4H, I)``, input_norm only) the first argument is the layer's input
    ``x (N, I)`` and the node computes ``gx = x W_ihᵀ`` itself (backward: x's and W_ih's
    gradients from gx's), or, where :func:`_loop_projection_pays` (from
    :data:`_LOOP_PROJECTION_TRAINING_ROWS` rows), has the kernels compute each step's rows of gx
    in the time loop and backward's each step's rows of x's gradient; ``b_ih``, ``b_hh``
    (``(4H)``) are torch's biases, added to b0 as ``(b_ih + b_hh) + b0``, each getting b0's
    gradient. The layers pass all of that, so that a direction is one autograd node, not four
    more for the projection and the folded bias. Without layer norms (``normalize`` false) ``w_ih``
    comes without ``input_norm`` (:func:`_projects_in_node`): ``gx = x W_ihᵀ + b0``, projected
    in the time loop or before it by the same rule, b0 added by the kernels or in place.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        gx: Tensor,
        h0: Tensor,
        c0: Tensor,
        w_hh: Tensor,
        w1: Tensor | None,
        b1: Tensor | None,
        w3: Tensor | None,
        b3: Tensor | None,
        sched: Schedule,
        eps: float,
        normalize: bool,
        carry_normalized: bool,
        zh: Tensor | None = None,
        zc: Tensor | None = None,
        cm: Tensor | None = None,
        w_hr: Tensor | None = None,
        input_norm: bool = False,
        w0: Tensor | None = None,
        b0: Tensor | None = None,
        w_ih: Tensor | None = None,
        b_ih: Tensor | None = None,
        b_hh: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        _check_untraced("LSTMSequence")
        plain = w_ih is not None and not input_norm  # x W_ihᵀ + b0, no layer norm on either side
        if plain and normalize:
            raise ValueError("LSTMSequence: w_ih without input_norm needs normalize=False")
        if not input_norm and not plain and (b_ih is not None or b_hh is not None):
            raise ValueError("LSTMSequence: b_ih and b_hh need input_norm or w_ih")
        if plain and w0 is not None:
            raise ValueError("LSTMSequence: w0 (a gain of LN(gx)) needs input_norm")
        if (b_ih is None) != (b_hh is None):
            raise ValueError("LSTMSequence: b_ih and b_hh come together or not at all")
        # backward runs what forward chose: the kept buffers' layout depends on it
        kernels = ctx.kernels = _kernels(gx, {"zh": zh, "zc": zc, "cm": cm, "w_hr": w_hr})
        b0 = fold_input_bias(b0, None if b_ih is None else (b_ih, b_hh))
        x, in_loop = None, False
        if w_ih is not None:  # gx is the input: its projection, here or in the time loop
            x = gx.contiguous()
            # the kernels write each step's rows of gx (kept raw for backward) in the time loop,
            # and backward's kernel each step's rows of x's gradient: the projection's GEMMs on
            # rows in cache, not over (N, G) rows in memory before and after the calls
            in_loop = (
                kernels is C_KERNELS
                and input_norm == normalize
                and projects_in_training_loop(x, w_ih, h0.shape[0])
            )
            shape = (x.shape[0], w_ih.shape[0])
            gx = _buffers.empty(x, shape) if in_loop else _projected(x, w_ih)
            if plain and not in_loop and b0 is not None:
                gx.add_(b0)  # in the loop the kernels add it to each step's rows
        gx = gx.contiguous()
        from_output = None
        if _previous_from_later_rows(kernels.lstm_fwd_seq, sched, h0.shape[0]):
            from_output = _output_and_previous(gx, h0, sched[0][1] != 0)
        st = _lstm_state(
            gx, h0, c0, w1, b1, w3, b3, eps, normalize, carry_normalized, zh, zc, cm, w_hr,
            kept_rows=gx.shape[0], out=None if from_output is None else from_output[0],
        )  # fmt: skip
        if input_norm:
            if kernels is not C_KERNELS or not normalize:
                raise ValueError(
                    "LSTMSequence: input_norm needs layer norms and the C sequence kernels, got "
                    f"normalize={normalize} and {kernels}"
                )
            st.update(_input_norm_fields(gx, w0, b0, gx.shape[0]))
        if in_loop:
            st["projection"] = {"x": x, "w_ih": w_ih.contiguous()}
            if plain and b0 is not None:
                st["projection"]["b0"] = b0.contiguous()
        _keep_previous(st, from_output, sched, h0, c0)
        _forward_in_time(st, w_hh, sched, kernels.lstm_fwd, kernels.lstm_fwd_seq)
        st.pop("projection", None)
        st["projected_in_loop"] = in_loop
        kept = ("gx", "w0", "mx", "rx") if input_norm else ()  # what backward's LN(gx) reads
        if x is not None:
            st.update(x=x, w_ih=w_ih)
            kept += ("x", "w_ih")  # the projection's backward
        _save(ctx, st, w_hh, sched, ("w1", "b1", "w3", "b3", "hp", "hprev", "cprev", "acts",
                                     "cn", "tc", "mh", "rh", "mc", "rc", "zh", "zc", "cm",
                                     "w_hr", "hu", "y", "h0", "c0", "previous",
                                     *kept))  # fmt: skip
        return st["out"], st["h"], st["c"]

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dh_n: Tensor, dc_n: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        _check_plain_backward(dout)
        w_hh, st = _restore(ctx)
        gx, hs, normalize, w1, w3 = st["gx"], st["H"], st["normalize"], st["w1"], st["w3"]
        n_rows = gx.shape[0]
        st.update(dout=_contiguous(dout), dh=dh_n.contiguous().clone(),
                  dc=dc_n.contiguous().clone(),
                  **_new_bufs(gx, n_rows, {"dgates": 4 * hs, "dlc": hs}))  # fmt: skip
        st["dhp"] = _buffers.empty(gx, (n_rows, 4 * hs)) if normalize else st["dgates"]
        w_hr = st["w_hr"]
        st["dhr"] = None if w_hr is None else gx.new_empty(n_rows, w_hr.shape[0])
        # the optional arguments a call left out need no gradient (forward takes 22 in all)
        need = ctx.needs_input_grad + (False,) * (22 - len(ctx.needs_input_grad))
        kernels, input_norm = ctx.kernels, st.get("w0") is not None
        need_b0 = need[18] or any(need[20:22])  # b0's gradient is also b_ih's and b_hh's
        _sum_ln_grads_in_kernel(
            st, kernels.lstm_bwd_seq, normalize, any(need[4:8]) or need[17] or need_b0, hs,
            input_norm,
        )  # fmt: skip
        x_in_loop = st["projected_in_loop"] and need[0]
        if x_in_loop:  # x's gradient from the time loop's own GEMM (see forward)
            x = st["x"]
            st["projection_grad"] = {"w_ih": st["w_ih"].contiguous(),
                                     "dx": _buffers.empty(x, (n_rows, x.shape[1]))}  # fmt: skip
        # with zoneout of h the step leaves the direct path zh ⊙ dh_t in dh for the GEMM to add to
        _backward_in_time(
            st, w_hh, ctx.sched, kernels.lstm_bwd, kernels.lstm_bwd_seq,
            accumulate=st["zh"] is not None, h0_grad=need[1],
        )  # fmt: skip
        dh = st["dh"] if need[1] else None
        d_w_hh = _grad_or_none(need[3], lambda: _recurrent_weight_grad(kernels, st))
        dw1 = db1 = dw3 = db3 = None
        if "ln_grads" in st:
            dw1, db1 = _split_grads(st["ln_grads"]["hp_grads"], need[4], need[5])
            dw3, db3 = _split_grads(st["ln_grads"]["c_grads"], need[6], need[7])
        elif normalize:
            ln = ln_kernels(gx)
            dw1, db1 = _ln_param_grads(
                ln, st["dgates"], st["hp"], st["mh"], st["rh"], w1, need[4], need[5]
            )
            dw3, db3 = _ln_param_grads(
                ln, st["dlc"], st["cn"], st["mc"], st["rc"], w3, need[6], need[7]
            )
        d_w_hr = None
        if w_hr is not None and need[15]:
            d_w_hr = st["dhr"].t().mm(st["hu"])
        dw0 = db0 = None
        if input_norm and "ln_grads" in st:
            dw0, db0 = _split_grads(st["ln_grads"]["x_grads"], need[17], need_b0)
        elif "x" in st and not input_norm and need_b0:  # b0 added to x W_ihᵀ: dgates summed
            db0 = st["dgates"].sum(0)
        # dgates: with input_norm the kernels turned it into the raw gx's gradient
        d_gx, d_w_ih = st["dgates"], None
        if "x" in st:  # gx = x W_ihᵀ was projected here
            d_gx, d_w_ih = _projection_grads(
                kernels, d_gx, st["x"], st["w_ih"], need[0] and not x_in_loop, need[19],
                _rounds_gradient_products(st),
            )  # fmt: skip
            if x_in_loop:
                d_gx = st["projection_grad"]["dx"]
        d_b_ih, d_b_hh = (db0 if n else None for n in need[20:22])  # b0's, as they add to it
        return (d_gx, dh, st["dc"], d_w_hh, dw1, db1, dw3, db3, *(None,) * 7, d_w_hr, None, dw0,
                db0 if need[18] else None, d_w_ih, d_b_ih, d_b_hh)  # fmt: skip


class GRUSequence(torch.autograd.Function):
    """Recurrence of one GRU direction given ``gx = LN(W_ih x) + b_ih + [b_hr, b_hz, 0]``.

    Inputs: ``gx (N, 3H)``, ``h0 (B, H)``, ``w_hh (3H, H)``, the ``(r, z)`` LN's gain/bias (2H), the
    candidate LN's gain/bias (H), ``b_hn (H)`` (``None`` when absent), schedule, eps, normalize,
    and the optional masks: zoneout ``zh (N, H)``, recurrent dropout ``cm (B, H)``.
    Outputs: ``out (N, H)``, ``h_n (B, H)``. Buffer names are those of :mod:`._pointwise`.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        gx: Tensor,
        h0: Tensor,
        w_hh: Tensor,
        w_rz: Tensor | None,
        b_rz: Tensor | None,
        w_n: Tensor | None,
        b_n: Tensor | None,
        b_hn: Tensor | None,
        sched: Schedule,
        eps: float,
        normalize: bool,
        zh: Tensor | None = None,
        cm: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        _check_untraced("GRUSequence")
        gx = gx.contiguous()
        # backward runs what forward chose: the kept buffers' layout depends on it
        kernels = ctx.kernels = _one_step_kernels(_kernels(gx, {"zh": zh, "cm": cm}), sched)
        from_output = None
        if _previous_from_later_rows(kernels.gru_fwd_seq, sched, h0.shape[0]):
            from_output = _output_and_previous(gx, h0, sched[0][1] != 0)
        st = _gru_state(
            gx,
            h0,
            w_rz,
            b_rz,
            w_n,
            b_n,
            b_hn,
            eps,
            normalize,
            zh,
            cm,
            kept_rows=gx.shape[0],
            out=None if from_output is None else from_output[0],
        )
        if from_output is not None:
            _previous_from_output(st, sched, h0, from_output[1])
        else:
            st["hprev"] = _buffers.empty(gx, (gx.shape[0], h0.shape[1]))
        if kernels.gru_fwd_seq is None:  # the C backward recomputes LN(hp_n) + b_hn from hp
            st["ghn"] = _buffers.empty(gx, (gx.shape[0], h0.shape[1]))
        _forward_in_time(st, w_hh, sched, kernels.gru_fwd, kernels.gru_fwd_seq)
        _save(ctx, st, w_hh, sched, ("w_rz", "b_rz", "w_n", "b_n", "b_hn", "hp", "hprev",
                                     "rz", "n", "ghn", "mh", "rh", "mn", "rn",
                                     "zh", "cm", "y", "h0", "previous"))  # fmt: skip
        return st["out"], st["h"]

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dh_n: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        _check_plain_backward(dout)
        w_hh, st = _restore(ctx)
        gx, hs, normalize, w_rz, w_n = st["gx"], st["H"], st["normalize"], st["w_rz"], st["w_n"]
        n_rows = gx.shape[0]
        st.update(dout=_contiguous(dout), dh=dh_n.contiguous().clone(),
                  dgx=_buffers.empty(gx, (n_rows, 3 * hs)))  # fmt: skip
        kernels, need = ctx.kernels, ctx.needs_input_grad
        # torch's b_hn adds to LN(hp_n) as the LN's bias does: their gradients are the same sum
        _sum_ln_grads_in_kernel(st, kernels.gru_bwd_seq, normalize, any(need[3:8]), None)
        # dgh (the layer norms' output gradient) outlives the loop only where its gains' and
        # biases' gradients are summed after it (the per-step paths), or without layer norms (dgh
        # is then dhp); the sequence kernel sums them itself (ln_grads, where any is needed) and
        # takes dgh as a step's scratch of B rows (rnn_abi's D)
        scratch = normalize and kernels.gru_bwd_seq is not None
        st["dgh"] = _buffers.empty(gx, (st["dh"].shape[0] if scratch else n_rows, 3 * hs))
        st["dhp"] = _buffers.empty(gx, (n_rows, 3 * hs)) if normalize else st["dgh"]
        _backward_in_time(
            st, w_hh, ctx.sched, kernels.gru_bwd, kernels.gru_bwd_seq, accumulate=True,
            h0_grad=need[1],
        )  # fmt: skip
        dh = st["dh"] if need[1] else None
        d_w_hh = _grad_or_none(need[2], lambda: _recurrent_weight_grad(kernels, st))
        dgh, hp = st["dgh"], st["hp"]
        dw_rz = db_rz = dw_n = db_n = None
        d_b_hn = None
        if "ln_grads" in st:
            dw, db = st["ln_grads"]["hp_grads"].chunk(2)
            dw_rz, db_rz = dw[: 2 * hs] if need[3] else None, db[: 2 * hs] if need[4] else None
            dw_n, db_n = dw[2 * hs :] if need[5] else None, db[2 * hs :] if need[6] else None
            if need[7]:  # b_hn's gradient is db_n's sum: a copy, not memory of two parameters
                d_b_hn = db[2 * hs :].clone()
        elif normalize:
            ln = ln_kernels(gx)
            dw_rz, db_rz = _ln_param_grads(
                ln, dgh[:, : 2 * hs], hp[:, : 2 * hs], st["mh"], st["rh"], w_rz, need[3], need[4]
            )
            dw_n, db_n = _ln_param_grads(
                ln, dgh[:, 2 * hs :], hp[:, 2 * hs :], st["mn"], st["rn"], w_n, need[5], need[6]
            )
        if need[7] and d_b_hn is None:
            d_b_hn = dgh[:, 2 * hs :].sum(0)
        return (st["dgx"], dh, d_w_hh, dw_rz, db_rz, dw_n, db_n, d_b_hn, *(None,) * 5)


def _elman_state(
    xp: Tensor,
    h0: Tensor,
    g: Tensor | None,
    b: Tensor | None,
    eps: float,
    normalize: bool,
    relu: bool,
    zh: Tensor | None,
    kept_rows: int,
    out: Tensor | None = None,
) -> dict[str, Any]:
    """An Elman direction's ``st`` for the C kernels (``rnn_abi.ELMAN_FWD``): the state copied
    from ``h0``, the output of every row (``out`` where given), and the kept buffers of
    ``kept_rows`` rows (N for backward, B in inference): ``hp`` (the GEMM's product, then the
    pre-activation), its row statistics, and with zoneout the cell's own ``h̃_t`` (else the
    output is it)."""
    n_rows, hs = xp.shape[0], h0.shape[1]
    return {
        "N": n_rows, "H": hs, "eps": eps, "normalize": normalize, "relu": relu, "gx": xp,
        "w": g, "b": b, "zh": zh, "h": h0.contiguous().clone(),
        "out": _buffers.empty(xp, (n_rows, hs)) if out is None else out,
        **_new_bufs(xp, kept_rows, {"hp": hs, "mh": 0, "rh": 0}),
        "own": None if zh is None else _buffers.empty(xp, (kept_rows, hs)),
        "hprev": None, "y": None, "h0": None, "previous": None, "reverse": 0,
    }  # fmt: skip


def rnn_sequence(*args: Any) -> tuple[Tensor, Tensor]:
    """One Elman direction with :class:`RNNSequence`'s arguments and results (``xp`` may be an
    :class:`InputProjection` without layer norm): the inference path where it runs
    (:func:`_inference`; the projection computed before the loop, since the kernel normalizes
    it with the recurrent side, and torch's biases folded into the layer norm's bias, which a
    kept plan refreshes), else :meth:`RNNSequence.apply`."""
    (_, h0, w_hh, g, b, sched, eps, normalize, relu, *rest) = args
    zh = rest[0] if rest else None

    def state(xp: Tensor, n_rows: int) -> dict[str, Any]:
        return _elman_state(xp, h0, g, b, eps, normalize, relu, zh, kept_rows=h0.shape[0])

    out = _inference(
        args, "elman_fwd_seq", w_hh, sched, state, ("out", "h"), in_loop_ok=False,
        kernel_bias="b" if normalize else None,
    )  # fmt: skip
    if out is None:
        return RNNSequence.apply(_gx(args[0]), *args[1:])  # type: ignore[no-any-return]
    return out  # type: ignore[return-value]


class RNNSequence(torch.autograd.Function):
    """Recurrence of one Elman-RNN direction (Eq. 4) given ``xp = W_ih x`` for all rows.

    ``h_t = f(LN(xp_t + W_hh h_{t−1}; g, b))`` with ``b`` the LN bias plus both torch biases;
    without normalization ``xp`` already holds the biases and ``h_t = f(xp_t + W_hh h_{t−1})``.
    With zoneout coefficients ``zh (N, H)`` the output and carried state is
    ``zh ⊙ h_{t−1} + (1 − zh) ⊙ h_t``.

    On kernels with Elman sequence functions (the C kernels) a direction is one call forward and one
    backward, the layer norm's gain and bias gradients summed inside it; elsewhere a loop over
    the steps.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        xp: Tensor,
        h0: Tensor,
        w_hh: Tensor,
        g: Tensor | None,
        b: Tensor | None,
        sched: Schedule,
        eps: float,
        normalize: bool,
        relu: bool,
        zh: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        _check_untraced("RNNSequence")
        # backward runs what forward chose: the kept buffers' layout depends on it
        kernels = ctx.kernels = step_kernels(xp)
        if kernels.elman_fwd_seq is not None:
            xp = xp.contiguous()
            from_output = None
            if _previous_from_later_rows(kernels.elman_fwd_seq, sched, h0.shape[0]):
                from_output = _output_and_previous(xp, h0, sched[0][1] != 0)
            st = _elman_state(
                xp, h0, g, b, eps, normalize, relu, zh, kept_rows=xp.shape[0],
                out=None if from_output is None else from_output[0],
            )  # fmt: skip
            if from_output is not None:
                _previous_from_output(st, sched, h0, from_output[1])
            else:
                st["hprev"] = _buffers.empty(xp, (xp.shape[0], h0.shape[1]))
            kernels.elman_fwd_seq(st, w_hh, sched)
            if st["own"] is None:  # without zoneout the output is the cell's own h̃_t
                st["own"] = st["out"]
            _save(
                ctx,
                st,
                w_hh,
                sched,
                ("w", "hp", "mh", "rh", "own", "zh", "hprev", "y", "h0", "previous"),
            )
            return st["out"], st["h"]
        n_rows, hs = xp.shape[0], h0.shape[1]
        ln = ln_kernels(xp)
        h = h0.contiguous().clone()
        bufs = _new_bufs(xp, n_rows, {"out": hs, "hprev": hs, "a": hs, "mean": 0, "rstd": 0})
        out, hprev_all, a_all, mean_all, rstd_all = bufs.values()
        # the cell's own h̃_t, which backward differentiates f at; the output itself without zoneout
        own = out if zh is None else torch.empty_like(out)
        w_t = w_hh.t()
        for _, off, bs in sched:
            sl = slice(off, off + bs)
            hprev = hprev_all[sl]
            hprev.copy_(h[:bs])
            a = torch.addmm(xp[sl], hprev, w_t, out=a_all[sl])
            if normalize:
                y, m, r = ln.layer_norm_fwd(a, g, b, eps)
                mean_all[sl] = m
                rstd_all[sl] = r
            else:
                y = a
            if relu:
                torch.clamp_min(y, 0.0, out=own[sl])
            else:
                torch.tanh(y, out=own[sl])
            if zh is not None:
                torch.lerp(own[sl], hprev, zh[sl], out=out[sl])  # zh·h_{t−1} + (1 − zh)·h̃_t
            h[:bs] = out[sl]
        ctx.save_for_backward(w_hh, g, own, hprev_all, a_all, mean_all, rstd_all, zh)
        ctx.sched, ctx.normalize, ctx.relu, ctx.ln = sched, normalize, relu, ln
        return out, h

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dh_n: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        _check_plain_backward(dout)
        if ctx.kernels.elman_bwd_seq is not None:
            return RNNSequence._backward_in_c(ctx, dout, dh_n)
        w_hh, g, own, hprev_all, a_all, mean_all, rstd_all, zh = ctx.saved_tensors
        ln = ctx.ln
        dh = dh_n.contiguous().clone()
        dy_all, da_all = torch.empty_like(a_all), torch.empty_like(a_all)
        for _, off, bs in reversed(ctx.sched):
            sl = slice(off, off + bs)
            dy = dy_all[sl]
            torch.add(dh[:bs], dout[sl], out=dy)
            direct = None if zh is None else zh[sl] * dy  # zoneout's path to h_{t−1}
            if zh is not None:
                dy.mul_(1.0 - zh[sl])
            h = own[sl]
            if ctx.relu:
                dy.mul_(h > 0)
            else:
                dy.mul_(1.0 - h * h)
            if ctx.normalize:
                da, _, _ = ln.layer_norm_bwd(
                    dy, a_all[sl], mean_all[sl], rstd_all[sl], g, False, False, True, False, False
                )
                da_all[sl] = da
            else:
                da_all[sl] = dy
            torch.mm(da_all[sl], w_hh, out=dh[:bs])
            if direct is not None:
                dh[:bs] += direct
        need = ctx.needs_input_grad
        d_w_hh = _grad_or_none(need[2], lambda: da_all.t().mm(hprev_all))
        dg = db = None
        if ctx.normalize:
            dg, db = _ln_param_grads(ln, dy_all, a_all, mean_all, rstd_all, g, need[3], need[4])
        return (da_all, dh, d_w_hh, dg, db, None, None, None, None, None)

    @staticmethod
    def _backward_in_c(ctx: Any, dout: Tensor, dh_n: Tensor) -> tuple[Any, ...]:
        """Backward of a direction the C sequence kernels ran: one call back through every step
        (``dhp``: the gradient of the pre-activation, which is xp's), then the recurrent
        weight's gradient in one GEMM."""
        w_hh, st = _restore(ctx)
        n_rows, hs = st["hp"].shape
        st.update(dout=_contiguous(dout), dh=dh_n.contiguous().clone(),
                  dhp=_buffers.empty(st["hp"], (n_rows, hs)))  # fmt: skip
        need, kernels = ctx.needs_input_grad, ctx.kernels
        _sum_ln_grads_in_kernel(
            st, kernels.elman_bwd_seq, st["normalize"], need[3] or need[4], None
        )
        kernels.elman_bwd_seq(st, w_hh, ctx.sched)
        d_w_hh = _grad_or_none(need[2], lambda: _recurrent_weight_grad(kernels, st))
        dg = db = None
        if "ln_grads" in st:
            dg, db = _split_grads(st["ln_grads"]["hp_grads"], need[3], need[4])
        return (st["dhp"], st["dh"], d_w_hh, dg, db, None, None, None, None, None)
