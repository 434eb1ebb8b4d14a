"""The recurrent layers' step functions on the C kernels of :mod:`layernorm.kernels.cpu.rnn`.

The fused sequence functions keep a sequence's tensors in a dict ``st`` (see :mod:`._pointwise`);
the kernels' argument structs name their fields after those entries. Here each struct is packed
(and every tensor in it checked against :mod:`layernorm.kernels.cpu.rnn_abi`) once per sequence
and direction, then a step call sets only the step's rows and threads. The ``*_seq`` functions run
a whole direction, recurrent GEMMs included, in one call. Thread counts and the choice between the
C GEMM and ``torch.mm`` are made here.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..kernels.cpu import buffers as _buffers
from ..kernels.cpu import rnn, rnn_abi, targets
from ..kernels.cpu._env import compile_switched_off

# Below this many elements per step one thread does the rows: waking the pool costs more.
_GRAIN = 32768
# Below this many multiply-adds per thread a step's recurrent GEMM runs on one thread.
_GEMM_GRAIN = 1 << 21
# The same two grains for the whole-sequence kernels, whose threads stay together for the whole
# time loop and meet at a spinning barrier (rnn_common.h) instead of a fork-join per step: a
# share of a step is worth a thread at far less work. Two threads, AMD EPYC, LN-LSTM at
# (1000, 4, 32, 128): inference 10.8 -> 8.0 ms, training 35.5 -> 30.4 ms against the grains above;
# inference at (100, 32, 128, 256) 31.7 -> 19.2 ms.
_SEQ_GRAIN = 4096
_SEQ_GEMM_GRAIN = 1 << 17
# Up to this many multiply-adds the weight gradient uses the C GEMM, per vector width of the
# selected target (rnn.vector_bytes); beyond, MKL's cache blocking wins. AVX-512: 0.8x torch.mm's
# time at (N, G, H) = (400, 512, 128), 1.5x at (6400, 2048, 512). AVX2 (AMD EPYC without AVX-512,
# one thread): 0.97-1.01x up to 12.5 M, 1.04-1.15x beyond ((800, 256, 64), (50, 1024, 256),
# (400, 512, 128)). Other targets: torch.mm.
_WEIGHT_GRAD_MAX = {64: 1 << 26, 32: 1 << 23}
# Nor past this size of the (N, G) gradient, which the C GEMM reads G apart: AVX-512, one thread,
# its time / transposed_product's at (N, G, J) = (3000, 512, 32) 0.83, (1250, 1024, 64) 0.89,
# (8000, 256, 32) 0.87, then (4000, 512, 32) 1.59, (1600, 1024, 64) 1.25 (AMD EPYC).
_WEIGHT_GRAD_MAX_BYTES = 6 << 20
# These limits (and a panel of columns per thread) were measured where MKL and the C GEMM run at
# the rate of 256-bit units (Zen 4). Where the C GEMM outpaces torch.mm
# (rnn.tile_outpaces_torch_gemm) it takes every size with at least a panel for every other thread:
# AMD EPYC family 26, its time / transposed_product's, one thread, (N, G, H) = (400, 512, 128)
# 0.45, (4000, 512, 32) 0.40, (1600, 1024, 64) 0.43, (700, 2600, 650) 0.51, (6400, 2048, 512)
# 0.51; two threads 0.41-0.55, (4000, 512, 32) (one panel for both) 0.55, (8000, 256, 32) 0.68.
# The argument struct of each step kernel, and the gains / biases (with their sizes in units of
# H) that become ones / zeros when the layer has none: the kernels load them unconditionally.
_STRUCTS = {
    "lstm_fwd_step": rnn_abi.LSTM_FWD,
    "lstm_bwd_step": rnn_abi.LSTM_BWD,
    "gru_fwd_step": rnn_abi.GRU_FWD,
    "gru_bwd_step": rnn_abi.GRU_BWD,
    "elman_fwd_step": rnn_abi.ELMAN_FWD,
    "elman_bwd_step": rnn_abi.ELMAN_BWD,
}
_GATES = {"lstm": 4, "gru": 3, "elman": 1}
# A step struct's step fields as packed, before a step call (or the sequence kernel) sets them.
UNSET_STEP = {"off": 0, "rows": 0, "threads": 1}
# The optional masks each kernel takes (None = off; see layernorm.recurrent._options).
_MASKS = {"lstm": ("zh", "zc", "cm"), "gru": ("zh", "cm"), "elman": ("zh",)}
_DEFAULTS = {
    "lstm": (("w1", 4, 1.0), ("b1", 4, 0.0), ("w3", 1, 1.0), ("b3", 1, 0.0)),
    "gru": (("w_rz", 2, 1.0), ("b_rz", 2, 0.0), ("w_n", 1, 1.0), ("b_n", 1, 0.0),
            ("b_hn", 1, 0.0)),
    "elman": (("w", 1, 1.0), ("b", 1, 0.0)),
}  # fmt: skip


def available(x: Tensor) -> bool:
    """Whether the C kernels run steps on ``x``: a CPU float32/float64 tensor, switch on, built."""
    return rnn.available(x)


def direct_rows() -> int:
    """Rows in all steps up to which the forward sequence kernels read their weights as stored
    (:func:`layernorm.kernels.cpu.rnn.direct_rows`)."""
    return rnn.direct_rows()


def one_step_sgemm(dtype: torch.dtype) -> bool:
    """Whether a forward sequence kernel's call of one step of more than :func:`direct_rows` rows
    in ``dtype``, in this context, multiplies by MKL's sgemm, reading W_ih and W_hh as stored
    (:func:`layernorm.kernels.cpu.rnn.one_step_gemm_in_use`): float32, products not rounded to
    bfloat16 (:func:`bfloat16_projection`)."""
    return (
        dtype is torch.float32 and not bfloat16_projection() and rnn.one_step_gemm_in_use() == "mkl"
    )


def tile_outpaces_torch_gemm() -> bool:
    """Whether the selected target's C GEMM outpaces ``torch.mm`` on this processor
    (:func:`layernorm.kernels.cpu.rnn.tile_outpaces_torch_gemm`)."""
    return rnn.tile_outpaces_torch_gemm(targets.selected().name)


def sequence_gemm() -> bool:
    """Whether the whole-sequence functions are used: on the targets whose C GEMM was measured
    faster than the per-step loop around ``torch.mm`` (see :mod:`layernorm.kernels.cpu.targets`
    and ``benchmarks/RESULTS.md``)."""
    return rnn.sequence_enabled()


def _threads(rows: int, cols: int) -> int:
    return max(1, min(torch.get_num_threads(), rows, (rows * cols) // _GRAIN))


def _sizes(st: dict[str, Any], kernel: str) -> dict[str, int]:
    """N, B, H, G, R, X and D of a sequence: B from the state the kernel updates (h forward, dh
    backward), R from the kept buffers (N rows when backward will read them, B for inference),
    X from gx (N rows, or B where the sequence kernel projects the inputs, ``st["projection"]``),
    D from the GRU backward's dgh (N rows, or B where it is a step's scratch)."""
    hs, cell = st["H"], kernel.split("_", 1)[0]
    state = st["dh"] if "_bwd" in kernel else st["h"]
    gx_rows = st["gx"].shape[0]
    dgh = st.get("dgh")
    return {"N": st.get("N", gx_rows), "B": state.shape[0], "H": hs, "G": _GATES[cell] * hs,
            "R": st["hp"].shape[0], "X": gx_rows,
            "D": dgh.shape[0] if dgh is not None else gx_rows}  # fmt: skip


def default_params(cell: str, like: Tensor, hs: int) -> dict[str, Tensor]:
    """The ones and zeros that stand in for the gains and biases a layer of ``cell`` lacks
    (``_DEFAULTS``), in ``like``'s dtype and device."""
    return {name: like.new_full((units * hs,), fill) for name, units, fill in _DEFAULTS[cell]}


def _args(st: dict[str, Any], kernel: str) -> Any:
    """The checked argument struct of ``kernel`` for this sequence (packed once, kept in st)."""
    key = "_args_" + kernel
    args = st.get(key)
    if args is None:
        cell = kernel.split("_", 1)[0]
        like, hs = st["gx"], st["H"]
        for name, units, fill in _DEFAULTS[cell]:
            if st.get(name) is None:
                st[name] = like.new_full((units * hs,), fill)
        # A mask's C field is a dense array: eval's zoneout coefficient, one value broadcast
        # (stride 0), becomes a buffer once here; st keeps it, so it outlives the struct.
        for name in _MASKS[cell]:
            mask = st.get(name)
            if mask is not None and not mask.is_contiguous():
                st[name] = mask.contiguous()
        values = {**st, "layer_norm": int(st["normalize"]), **UNSET_STEP}
        if st.get("w_hr") is not None:
            values.update(_projection_buffers(st, kernel))
        if cell == "lstm":
            values["normalize_cell_state"] = int(st["carry_normalized"])
        if cell == "elman":
            values["relu"] = int(st["relu"])
        args = st[key] = rnn.prepare(_STRUCTS[kernel], like.dtype, values, _sizes(st, kernel))
    return args


def _projection_buffers(st: dict[str, Any], kernel: str) -> dict[str, Any]:
    """With torch.nn.LSTM's projection the kernel runs the cell up to the unprojected h̃ (H
    units) and Python does the projection and the zoneout of h (both on the P units of h): the
    kernel's h fields point at scratch buffers of H columns and it gets no zoneout of h.
    Forward: its output is ``hu``, its state scratch, and it keeps no h̃_{t−1}. Backward: its
    output gradient is ``du`` (the projection's backward, written by :func:`_lstm_bwd_projected`)
    and its dh a zero buffer (read, never written without zoneout of h)."""
    like, hs = st["gx"], st["H"]
    n_rows, n_batch = like.shape[0], st["h" if "_fwd" in kernel else "dh"].shape[0]
    # kept in st: the struct holds their addresses for as long as st lives
    if "_fwd" in kernel:
        st["_hu_state"] = like.new_zeros(n_batch, hs)
        return {"h": st["_hu_state"], "out": st["hu"], "hprev": None, "zh": None}
    st["du"], st["_du_state"] = like.new_empty(n_rows, hs), like.new_zeros(n_batch, hs)
    return {"dout": st["du"], "dh": st["_du_state"], "zh": None}


def _step(kernel: str, st: dict[str, Any], off: int, bs: int) -> None:
    gates = _GATES[kernel.split("_", 1)[0]]
    rnn.step(kernel, st["gx"].dtype, _args(st, kernel), off, bs, _threads(bs, gates * st["H"]))


def lstm_fwd(st: dict[str, Any], off: int, bs: int) -> None:
    if st.get("w_hr") is not None:
        return _lstm_fwd_projected(st, off, bs)
    _step("lstm_fwd_step", st, off, bs)


def lstm_bwd(st: dict[str, Any], off: int, bs: int) -> None:
    if st.get("w_hr") is not None:
        return _lstm_bwd_projected(st, off, bs)
    _step("lstm_bwd_step", st, off, bs)


def _lstm_fwd_projected(st: dict[str, Any], off: int, bs: int) -> None:
    """h_{t−1} kept for backward (``hprev``), then :func:`_projected_step`."""
    st["hprev"][off : off + bs].copy_(st["h"][:bs])
    _projected_step(st, off, bs)


def _projected_step(st: dict[str, Any], off: int, bs: int) -> None:
    """The C step up to the unprojected h̃ (into ``hu``), then ``h_t = W_hr h̃`` straight into
    the step's output rows (zoneout mixing in h_{t−1}, still in ``h``), the carried state."""
    sl, h = slice(off, off + bs), st["h"][:bs]
    _step("lstm_fwd_step", st, off, bs)
    out, zh = st["out"][sl], st.get("zh")
    if zh is None:
        torch.mm(st["hu"][sl], st["w_hr"].t(), out=out)
    else:
        out.copy_(zh[sl] * h + (1.0 - zh[sl]) * torch.mm(st["hu"][sl], st["w_hr"].t()))
    h.copy_(out)


def projected_by_steps(
    st: dict[str, Any], w_hh: Tensor, sched: tuple[tuple[int, int, int], ...]
) -> None:
    """An LSTM direction with torch.nn.LSTM's projection in inference where the sequence kernel
    does not take it (zoneout of h, or a target without sequence kernels; kept buffers of B rows,
    each step's overwriting the last's): per step torch's GEMM ``hp = h W_hhᵀ`` into hp's first
    rows, then :func:`_projected_step`. No copy of h_{t−1} is kept."""
    h, hp, w_t = st["h"], st["hp"], w_hh.t()
    for _, off, bs in sched:
        torch.mm(h[:bs], w_t, out=hp[:bs])
        _projected_step(st, off, bs)


def _lstm_bwd_projected(st: dict[str, Any], off: int, bs: int) -> None:
    """Back through zoneout and the projection (``du = dh̃ W_hr``, ``dhr`` for W_hr's gradient),
    then the C step; with zoneout of h, dh := its direct path zh ⊙ dh_t (the caller's GEMM adds)."""
    sl = slice(off, off + bs)
    _args(st, "lstm_bwd_step")  # allocates du
    d_zoned = st["dh"][:bs] + st["dout"][sl]
    zh = st.get("zh")
    d_own = d_zoned if zh is None else (1.0 - zh[sl]) * d_zoned
    st["dhr"][sl] = d_own
    torch.mm(d_own, st["w_hr"], out=st["du"][sl])
    _step("lstm_bwd_step", st, off, bs)
    if zh is not None:
        st["dh"][:bs] = zh[sl] * d_zoned


def gru_fwd(st: dict[str, Any], off: int, bs: int) -> None:
    _step("gru_fwd_step", st, off, bs)


def gru_bwd(st: dict[str, Any], off: int, bs: int) -> None:
    _step("gru_bwd_step", st, off, bs)


# ---------------------------------------------------------------------------------------------
# Whole sequences: the time loop, recurrent GEMM included, in one foreign call per direction.
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _steps(sched: tuple[tuple[int, int, int], ...]) -> Tensor:
    """The (first row, rows) pairs of ``sched`` as an ``(S, 2)`` int64 tensor (cached: a layer's
    schedule is the same on every call with the same lengths, and C only reads it)."""
    steps = [(off, bs) for _, off, bs in sched]
    return torch.tensor(steps, dtype=torch.int64, device="cpu").reshape(-1, 2)


# The bfloat16 products of the sequence kernels (rnn.pack_sequence's half_gemm) for the calls in
# this context: set by the layers for a bfloat16 call computed in float32 (bfloat16_layer), and by
# the user's opt-in to rounded recurrent products (rounded_recurrent_products).
_BFLOAT16_LAYER: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "layernorm_bfloat16_layer", default=False
)
_ROUNDED_RECURRENT: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "layernorm_rounded_recurrent_products", default=False
)


@contextlib.contextmanager
def _set(var: contextvars.ContextVar[bool]) -> Iterator[None]:
    token = var.set(True)
    try:
        yield
    finally:
        var.reset(token)


def bfloat16_layer() -> contextlib.AbstractContextManager[None]:
    """Within it, the layers' sequence kernels run a bfloat16 layer computed in float32: its
    weights and inputs are bfloat16 values, so the input projection can take them as bfloat16
    products, exact, summed in float32, where the build has them and the processor gains by them
    (:func:`.rnn.bfloat16_projection`: twice the float FMA's multiply-adds an instruction, half
    its rate a cycle on some processors); the recurrent GEMMs too where the user opted in
    (:func:`rounded_recurrent_products`)."""
    return _set(_BFLOAT16_LAYER)


# A bfloat16 layer's weights as it stores them, by the address of the float32 copy its twin
# (layers._HalfTwin) passes in their place, for the one-step calls in this context: their
# sequence structs read these (w_half, w_ih_half) instead of the copies (_half_weights).
_HALF_WEIGHTS: contextvars.ContextVar[HalfWeights | None] = contextvars.ContextVar(
    "layernorm_half_weights", default=None
)


class HalfWeights(NamedTuple):
    """A :func:`half_weights` context: the weights by their copies' addresses, and what its
    forward sequence calls (and kept plans' runs, :func:`note_half_weights`) took: ``[both,
    other]``, the count of calls given both bfloat16 weights (W_ih's with the projection in the
    loop, W_hh's) and of any other."""

    by_copy: Mapping[int, Tensor]
    taken: list[int]


@contextlib.contextmanager
def half_weights(by_copy: Mapping[int, Tensor]) -> Iterator[HalfWeights]:
    """Within it, where MKL's bfloat16 GEMM serves one-step calls
    (:func:`layernorm.kernels.cpu.rnn.one_step_half_gemm_in_use`), a forward sequence kernel's
    call of one step whose W_hh (and W_ih, with the projection in its loop) is a float32 copy at
    an address in ``by_copy`` multiplies by the bfloat16 weight there instead, as stored (the
    struct's ``w_half``, ``w_ih_half``): the copy need not be made for it. The operands it
    multiplies (x, h_0) must be bfloat16 values, as a bfloat16 layer's float32 twin passes them:
    the products are then exact, as with the copy. (Elsewhere the kernels would widen the
    weights for the call, as costly as the copy, and read them by the dot kernel where packing
    them was chosen: the copy stays.) Yields the context, whose ``taken`` counts what the
    forward sequence calls and kept plans' runs made in it took."""
    context = HalfWeights(by_copy, [0, 0])
    token = _HALF_WEIGHTS.set(context)
    try:
        yield context
    finally:
        _HALF_WEIGHTS.reset(token)


def half_weights_served() -> bool:
    """Whether a :func:`half_weights` context's one-step calls take the weights as stored in this
    configuration (:func:`layernorm.kernels.cpu.rnn.one_step_half_gemm_in_use`)."""
    return rnn.one_step_half_gemm_in_use()


def _half_weights(w: Tensor, options: Mapping[str, Any] | None, n_steps: int) -> dict[str, Any]:
    """The struct's bfloat16 weights for a forward call of ``n_steps`` on ``w`` with ``options``
    in this context (:func:`half_weights`): both or none where the call projects its input, W_hh's
    alone where it does not; none for more steps, torch.nn.LSTM's projection, or a weight not
    copied from one, or not contiguous (the kernels read it row by row)."""
    context = _HALF_WEIGHTS.get()
    if context is None:
        return {}
    found = _found_half_weights(context.by_copy, w, options, n_steps)
    context.taken[0 if len(found) == 2 else 1] += 1
    return found


def note_half_weights(both: bool) -> None:
    """Count a kept plan's run in this :func:`half_weights` context (if any): ``both``, whether
    its kernel takes W_ih and W_hh as stored."""
    context = _HALF_WEIGHTS.get()
    if context is not None:
        context.taken[0 if both else 1] += 1


def _found_half_weights(
    by_copy: Mapping[int, Tensor], w: Tensor, options: Mapping[str, Any] | None, n_steps: int
) -> dict[str, Any]:
    if n_steps != 1 or (options or {}).get("w_hr") is not None:
        return {}
    if not half_weights_served():
        return {}
    w_half = by_copy.get(w.data_ptr())
    if w_half is None or w_half.shape != w.shape or not w_half.is_contiguous():
        return {}
    w_ih = (options or {}).get("w_ih")
    if w_ih is None:
        return {"w_half": w_half}
    w_ih_half = by_copy.get(w_ih.data_ptr())
    if w_ih_half is None or w_ih_half.shape != w_ih.shape or not w_ih_half.is_contiguous():
        return {}
    return {"w_half": w_half, "w_ih_half": w_ih_half}


def rounded_recurrent_products() -> contextlib.AbstractContextManager[None]:
    """Within it, a bfloat16 layer's recurrent GEMMs take ``h_{t−1}`` (forward) and the gates'
    gradient (backward) rounded to bfloat16, products summed in float32, as ``torch.nn.LSTM`` in
    bfloat16 does, where the build has the processor's bfloat16 dot products
    (:func:`.rnn.half_gemm`). See :func:`layernorm.recurrent.bfloat16_recurrent_products`."""
    return _set(_ROUNDED_RECURRENT)


def rounded_products_asked() -> bool:
    """Whether the caller is inside :func:`rounded_recurrent_products`."""
    return _ROUNDED_RECURRENT.get()


#: The sequence structs' ``half_gemm`` inside :func:`rounded_recurrent_products` (see
#: :func:`_half_gemm`): a forward that ran with it rounds its backward's products too.
ROUNDED_PRODUCTS = 2


def rounds_gradient_products(half_gemm: int) -> bool:
    """Whether the backward of a forward run with this ``half_gemm`` computes the weights' and
    the input's gradients by :func:`rounded_product`: inside :func:`rounded_recurrent_products`,
    where ``torch.nn.LSTM`` in bfloat16 computes them from the gates' gradient rounded to
    bfloat16 as it does the recurrent product's."""
    return half_gemm == ROUNDED_PRODUCTS


def _rounded(t: Tensor) -> Tensor:
    """A 2-D ``t`` rounded to bfloat16 in the same layout (a transposed view stays one), into a
    buffer of the cache: a gradient's rows are megabytes, freed after the product."""
    if t.is_contiguous():
        return _buffers.empty(t, tuple(t.shape), torch.bfloat16).copy_(t)
    rows = t.t()
    if rows.is_contiguous():
        return _buffers.empty(rows, tuple(rows.shape), torch.bfloat16).copy_(rows).t()
    return t.to(torch.bfloat16)


def rounded_product(a: Tensor, b: Tensor, out: Tensor) -> Tensor:
    """``a · b`` into ``out`` (float32) as ``torch.nn.LSTM`` in bfloat16 computes its gradients'
    products: both operands rounded to bfloat16, their products summed in float32 by torch's
    bfloat16 GEMM (oneDNN's: the processor's bfloat16 dot products, or AMX tiles), the result
    rounded to bfloat16 once (then exact in ``out``). Twice the float GEMM's multiply-adds a
    cycle; the backward of a layer inside :func:`rounded_recurrent_products` takes it for the
    weights' gradients (``dᵀ · x``) and the input's (``dgx · W_ih``), whose rounded operands are
    its gates' gradient (rounded for the recurrent product already), ``h_{t−1}`` (rounded for
    the forward's) and the bfloat16 values of x and W_ih (exact)."""
    return out.copy_(torch.mm(_rounded(a), _rounded(b)))


def bfloat16_projection() -> bool:
    """Whether the sequence kernels called in this context compute an input projection with the
    processor's bfloat16 dot products (a bfloat16 layer, :func:`bfloat16_layer`, on a build that
    has them, where the processor's default or the user's choice asks for them,
    :func:`.rnn.bfloat16_projection`, or inside :func:`rounded_recurrent_products`): its packed
    W_ih then takes half the bytes of float32's."""
    return _half_gemm() > 0


def _half_gemm() -> int:
    """The sequence struct's ``half_gemm`` for a call in this context (:func:`bfloat16_layer`):
    2 inside :func:`rounded_recurrent_products`, 1 where only the input projection takes the
    dot products (:func:`.rnn.bfloat16_projection`), else 0."""
    if not _BFLOAT16_LAYER.get() or not rnn.half_gemm():
        return 0
    if _ROUNDED_RECURRENT.get():
        return ROUNDED_PRODUCTS
    return 1 if rnn.bfloat16_projection() else 0


def half_gemm_of(dtype: torch.dtype) -> int:
    """The ``half_gemm`` of a call computing in ``dtype`` in this context: :func:`_half_gemm` for
    float32 (a bfloat16 layer computes in float32), else 0. A forward records it, so that its
    backward, run later and elsewhere, makes the same choice."""
    return _half_gemm() if dtype is torch.float32 else 0


def _sequence(
    kernel: str, st: dict[str, Any], w: Tensor, sched: tuple[tuple[int, int, int], ...]
) -> None:
    # st["projection"]: the input projection a forward kernel computes itself; st["ln_grads"]:
    # the buffers a backward kernel sums the layer norms' parameter gradients into, and
    # st["projection_grad"]: W_ih and x's gradient, which it computes where the forward projected
    # in its time loop. st keeps both structs and W_hh (st["_call"]): an inference plan (see
    # _fused.InferencePlan) runs them again with new input and output addresses
    if "_fwd" in kernel:
        options = st.get("projection")
        if st.get("w_hr") is not None:  # torch.nn.LSTM's projection: h (P units) is its state
            options = {**(options or {}), "w_hr": st["w_hr"].contiguous(), "hr": st["h"],
                       "out_r": st["out"]}  # fmt: skip
    else:
        options = {**(st.get("ln_grads") or {}), **(st.get("projection_grad") or {})}
    dtype, args, w = st["gx"].dtype, _args(st, kernel.replace("_seq", "_step")), w.contiguous()
    steps = _steps(sched)
    if "_fwd" in kernel and dtype is torch.float32:
        as_stored = _half_weights(w, options, len(sched))
        if as_stored:
            options = {**(options or {}), **as_stored}
    # the forward records the choice: its backward, run later, makes the same one
    half = st.setdefault("half_gemm", half_gemm_of(dtype))
    seq_args = rnn.pack_sequence(
        kernel, dtype, w, steps, _sizes(st, kernel), torch.get_num_threads(), _SEQ_GRAIN,
        _SEQ_GEMM_GRAIN, options, half_gemm=half,
    )  # fmt: skip
    st["_call"] = SequenceCall(kernel, dtype, args, seq_args, w, steps)
    rnn.run_sequence(kernel, dtype, args, seq_args)


def configuration() -> tuple[str, bool]:
    """What decides which kernels run, besides the arguments: the selected target and whether
    the switch turns the C kernels off (an inference plan is kept only while both hold). Read
    by every planned call, the switch from the environment's own store
    (:mod:`layernorm.kernels.cpu._env`): by ``os.environ.get`` this took 0.83 µs of a cell's
    6.8 µs signature, now 0.15 (AMD EPYC Zen 4, one thread)."""
    return targets.selected().name, compile_switched_off()


class SequenceCall(NamedTuple):
    """A sequence kernel's checked structs, with the recurrent weight they point at."""

    kernel: str
    dtype: torch.dtype
    args: Any
    seq_args: Any
    w: Tensor
    steps: Tensor  # the schedule the sequence struct points at (_steps' cache may drop it)

    def run(self) -> None:
        rnn.run_sequence(self.kernel, self.dtype, self.args, self.seq_args)


class StepCall(NamedTuple):
    """A forward direction run step by step as torch's GEMM ``hp = h W_hhᵀ`` then the C step
    kernel (:func:`by_steps`), with what a later call needs to run it again: the step struct,
    which points at ``st``'s buffers, and ``st``, where the GEMM finds ``h`` and ``hp`` then
    (kept buffers of the batch's rows: every step's GEMM writes hp's first rows)."""

    kernel: str
    dtype: torch.dtype
    args: Any
    st: dict[str, Any]
    w_t: Tensor  # W_hhᵀ, a view of the parameter
    steps: tuple[tuple[int, int, int], ...]  # (first row, rows, threads) per step

    def run(self) -> None:
        h, hp = self.st["h"], self.st["hp"]
        for off, rows, threads in self.steps:
            torch.mm(h[:rows], self.w_t, out=hp[:rows])
            rnn.step(self.kernel, self.dtype, self.args, off, rows, threads)


def by_steps(
    seq: str, st: dict[str, Any], w_hh: Tensor, sched: tuple[tuple[int, int, int], ...]
) -> None:
    """The forward direction of sequence kernel ``seq`` over the steps of ``sched`` (inference:
    kept buffers of the batch's rows) as a :class:`StepCall`, kept in ``st["_call"]`` (see
    :func:`_sequence`)."""
    kernel = seq.replace("_seq", "_step")
    gates = _GATES[kernel.split("_", 1)[0]] * st["H"]
    steps = tuple((off, bs, _threads(bs, gates)) for _, off, bs in sched)
    call = StepCall(kernel, st["gx"].dtype, _args(st, kernel), st, w_hh.t(), steps)
    st["_call"] = call
    call.run()


def lstm_fwd_seq(st: dict[str, Any], w_hh: Tensor, sched: tuple[tuple[int, int, int], ...]) -> None:
    _sequence("lstm_fwd_seq", st, w_hh, sched)


def lstm_bwd_seq(st: dict[str, Any], w_hh: Tensor, sched: tuple[tuple[int, int, int], ...]) -> None:
    _sequence("lstm_bwd_seq", st, w_hh, sched)


def gru_fwd_seq(st: dict[str, Any], w_hh: Tensor, sched: tuple[tuple[int, int, int], ...]) -> None:
    _sequence("gru_fwd_seq", st, w_hh, sched)


def gru_bwd_seq(st: dict[str, Any], w_hh: Tensor, sched: tuple[tuple[int, int, int], ...]) -> None:
    _sequence("gru_bwd_seq", st, w_hh, sched)


def elman_fwd_seq(
    st: dict[str, Any], w_hh: Tensor, sched: tuple[tuple[int, int, int], ...]
) -> None:
    _sequence("elman_fwd_seq", st, w_hh, sched)


def elman_bwd_seq(
    st: dict[str, Any], w_hh: Tensor, sched: tuple[tuple[int, int, int], ...]
) -> None:
    _sequence("elman_bwd_seq", st, w_hh, sched)


def _column_panels(cols: int, like: Tensor) -> int:
    """The C GEMM's panels of output columns (two vectors of ``like``'s dtype wide) for ``cols``
    columns: the unit its threads share out."""
    return -(-cols // max(1, 2 * rnn.vector_bytes() // like.element_size()))


def block_norm_fwd(
    x: Tensor, weight: Tensor, bias: Tensor, split: int, eps: float
) -> tuple[Tensor, Tensor]:
    """:func:`.rnn.block_norm_fwd` (``LN`` of each row's two column blocks) on enough threads."""
    return rnn.block_norm_fwd(x, weight, bias, split, eps, _threads(*x.shape))


def block_norm_bwd(
    dy: Tensor, x: Tensor, weight: Tensor, stats: Tensor, split: int
) -> tuple[Tensor, Tensor]:
    """:func:`.rnn.block_norm_bwd`, its gradients, on enough threads."""
    return rnn.block_norm_bwd(dy, x, weight, stats, split, _threads(*x.shape))


def weight_grad(dhp: Tensor, hprev: Tensor) -> Tensor:
    """``dhpᵀ · hprev``, a weight's gradient summed over all rows (W_hh's; W_ih's with the
    inputs for ``hprev``): with the C GEMM for small sequences (where it beats ``torch.mm``), else
    :func:`transposed_product`.

    The C GEMM shares hprev's panels of columns (two vectors wide) among its threads, or with
    fewer panels than threads the rows of the gradient (tiles of at most 16 rows), so with few
    of either it runs on fewer threads than ``torch.mm`` would: two threads, AMD EPYC
    (AVX-512), its time / transposed_product's at (N, G, J) = (1000, 512, 32) 1.24 when it
    shared out panels only, one panel; (400, 512, 64) 0.77, two."""
    if not weight_grad_by_c(dhp, hprev):
        return transposed_product(dhp, hprev)
    return rnn.weight_grad(dhp, hprev, torch.get_num_threads(), _GEMM_GRAIN)


def weight_grad_by_c(dhp: Tensor, hprev: Tensor) -> bool:
    """Whether :func:`weight_grad` takes the C GEMM (else :func:`transposed_product`)."""
    n_rows, gates = dhp.shape
    hs = hprev.shape[1]
    vector = rnn.vector_bytes()
    threads = torch.get_num_threads()
    panels = _column_panels(hs, dhp)
    if hprev.dtype != dhp.dtype or not (dhp.is_contiguous() and hprev.is_contiguous()):
        return False
    if tile_outpaces_torch_gemm():
        # at twice torch.mm's rate a thread, as long as it runs on half as many threads: its
        # panels, or its row tiles (GEMM_MR <= 16 rows each: at least G / 16 of them)
        return 2 * max(panels, gates // 16) >= threads
    return not (
        n_rows * gates * hs > _WEIGHT_GRAD_MAX.get(vector, 0)
        or dhp.numel() * dhp.element_size() > _WEIGHT_GRAD_MAX_BYTES
        or panels < threads
    )


# From this many multiply-adds an input product (:func:`input_product`) takes the C GEMM where it
# outpaces torch.mm, W packed on every call (a pass over W and its copy): below, the call and the
# packing cost more than the products save. One thread, AMD EPYC family 26, µs of the C GEMM
# (x · W_ihᵀ) / torch.mm (benchmarks/bench_rnn_gemm.py --products): (M, K, N) = (32, 32, 128)
# 6.2 / 3.3, (64, 64, 256) 14.0 / 19.3, (128, 64, 256) 22.0 / 37.1, (512, 64, 256) 72 / 145,
# (160, 128, 512) 89 / 180; GFLOP/s at (2048, 128, 512) 252 / 114, (640, 1024, 4096) 231 / 113,
# (20000, 64, 256) 237 / 102; two threads (2048, 128, 512) 483 / 224.
_INPUT_PRODUCT_MIN = 1 << 19
# Nor below this many rows, which must repay the packing of W: C / torch.mm's time at M = 8, 16,
# 24, 32 rows (the same command): (M, 1024, 3072) 1.16, 0.90, 0.94, 0.75; (M, 128, 512) 1.06,
# 0.79; (16, 512, 1536) 0.62; (16, 256, 1024) 0.71. In a one-step LN-GRU inference call at
# (1024, 1024) (W_ih 12 MiB, its packed copy beside it) 16 rows took 1.09x torch.nn.GRU's time
# with the C GEMM, 0.98 with torch.mm; 32 rows at (512, 512) 0.75 against 0.93 (ab_rnn.py, one
# thread). With the packing one element at a time (before transpose_block) the 16-row call took
# 1.54x.
_INPUT_PRODUCT_MIN_ROWS = 32


def input_product_by_c(a: Tensor, w: Tensor, transposed: bool) -> bool:
    """Whether :func:`input_product` takes the C GEMM for ``a · wᵀ`` (``transposed``) or
    ``a · w``: where it outpaces ``torch.mm`` (:func:`tile_outpaces_torch_gemm`: MKL runs its
    AVX2 code there, at half the rate of the processor's AVX-512 units) or takes a bfloat16
    layer's projection by bfloat16 dot products (:func:`_bfloat16_input_product`), from
    :data:`_INPUT_PRODUCT_MIN` multiply-adds and :data:`_INPUT_PRODUCT_MIN_ROWS` rows, with a
    panel of output columns for every other thread (as :func:`weight_grad`)."""
    rows, inner = a.shape
    cols = w.shape[0] if transposed else w.shape[1]
    if not (
        rows >= _INPUT_PRODUCT_MIN_ROWS
        and rows * inner * cols >= _INPUT_PRODUCT_MIN
        and a.dtype is w.dtype
        and a.is_contiguous()
        and w.is_contiguous()
        and available(a)
        and (tile_outpaces_torch_gemm() or _bfloat16_input_product(a, transposed))
    ):
        return False
    return 2 * _column_panels(cols, a) >= torch.get_num_threads()


def _bfloat16_input_product(a: Tensor, transposed: bool) -> bool:
    """Whether ``a · wᵀ`` is a bfloat16 layer's input projection that its sequence kernels would
    compute by bfloat16 dot products (:func:`bfloat16_projection`): inside
    :func:`bfloat16_layer` every ``a · wᵀ`` of :func:`input_product` is the layer's float32 copy
    of its input times that of W_ih, bfloat16 values both (its input gradient, ``a · w``, is
    not). Exact products either way, so only the order of the float32 sums changes: the
    projection of all rows by the dot products, as inside the loop."""
    return transposed and a.dtype is torch.float32 and bfloat16_projection()


def input_product(a: Tensor, w: Tensor, transposed: bool, out: Tensor) -> Tensor:
    """``a · wᵀ`` (``transposed``: ``w`` as a layer stores W_ih, ``(N, K)``) or ``a · w`` into
    ``out``: the input projection of all rows before a time loop, and its input gradient after
    one. The C GEMM where :func:`input_product_by_c` says so, ``torch.mm`` elsewhere."""
    if out.is_contiguous() and input_product_by_c(a, w, transposed):
        half = _bfloat16_input_product(a, transposed)
        return rnn.matmul(a, w, transposed, out, torch.get_num_threads(), _GEMM_GRAIN, half)
    return torch.mm(a, w.t() if transposed else w, out=out)


def transposed_product(d: Tensor, x: Tensor) -> Tensor:
    """``dᵀ · x`` (``(N, G)``, ``(N, J)`` → ``(G, J)``, a weight's gradient over N rows) with
    ``torch.mm``, in the operand order MKL runs faster for the shape: ``(xᵀ · d)ᵀ`` copied to
    row-major, unless N < 256 or J >= 256 and G a multiple of 512. One thread, AMD EPYC, ms of
    ``dᵀ.mm(x)`` against ``(xᵀ.mm(d))ᵀ``: (N, G, J) = (700, 2600, 650) 43.3 / 28.7,
    (4000, 512, 32) 2.46 / 1.91, (3200, 1024, 64) 6.58 / 5.84, (3200, 1024, 128) 10.9 / 9.9,
    (512, 1024, 128) 2.01 / 1.74; (3200, 1024, 256) 18.7 / 21.5, (6400, 2048, 512) 149 / 168;
    few rows (a step of a batch): (64, 768, 256) 0.31 / 0.50, (128, 512, 64) 0.15 / 0.20,
    (256, 1024, 128) 0.97 / 0.97. The result is a buffer of the cache (see
    :func:`._fused._weight_grad`)."""
    out = _buffers.empty(d, (d.shape[1], x.shape[1]))
    if not transposed_product_swaps(d, x):
        return torch.mm(d.t(), x, out=out)
    return out.copy_(torch.mm(x.t(), d, out=_buffers.empty(d, (x.shape[1], d.shape[1]))).t())


def transposed_product_swaps(d: Tensor, x: Tensor) -> bool:
    """Whether :func:`transposed_product` computes ``(xᵀ · d)ᵀ`` (else ``dᵀ · x``)."""
    return not (d.shape[0] < 256 or (x.shape[1] >= 256 and d.shape[1] % 512 == 0))
