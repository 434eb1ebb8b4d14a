"""The LN-LSTM's training call with its decisions made once per signature.

The fused path (:class:`._fused.LSTMSequence`) works out on every call which kernels run, which
buffers a direction keeps for backward and where its input projection is computed, gathers a
dozen buffers into a dict and packs the kernels' argument structs from it, forward and backward:
a few hundred microseconds of Python, a tenth of a small training call ((T, B, I, H) =
(50, 8, 64, 128), one thread: the kernels take about 3 ms, as long as all of ``torch.nn.LSTM``'s
call). In the layers' usual configuration (layer norms, every step a full batch, no mask or
projection, the C sequence kernels) all of that depends only on the call's signature, so
:class:`TrainingPlan` keeps it per signature: the four argument structs with their fixed fields
packed and checked once (:class:`.rnn_abi.BoundStruct`), the kept buffers (and the backward's)
as blocks of one buffer of the cache that the structs point into without a view of each, and
one straight path for the backward. The kernels, their arguments and so the results are the
fused path's, bit for bit (``tests/test_recurrent_planned.py`` compares them).

Where the C++ operators are built (:mod:`layernorm.kernels.cpu.torch_ops`) and the kept buffers
fit in one buffer, a plan also holds the plan of a C++ node (``csrc_torch/rnn_ops.cpp``,
:func:`_node_plan`) that runs the same call from C++: the structs' fixed bytes and the offsets of
the fields a call fills (:meth:`.rnn_abi.BoundStruct.template`), each product's route as the
Python node would take it (:func:`_weight_grad_route`), the kernels' addresses. Every decision
stays here; the node allocates, fills the structs and calls, in the Python node's order, so its
results are the same bits. ``LAYERNORM_CPU_TORCH_OPS=0`` (or ``torch_ops.switched(False)``) keeps
the Python node. Layers without layer norms (``norm="none"``) have plans on the C++ node alone:
the Python node takes the layer norms' input side only, and their calls otherwise run the fused
path.

A plan holds no tensor of a call (the schedule's steps and the default gains aside): each call
allocates its own buffers, so calls whose graphs are alive together (two forwards before one
backward) never share memory.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..kernels.cpu import buffers as _buffers
from ..kernels.cpu import rnn, rnn_abi, torch_ops
from . import _cstep, _fused
from ._options import Masks
from ._pointwise import C_KERNELS, step_kernels

# (name, columns: the size G or H, "" for a row statistic) of the (N, ·) buffers a planned call
# keeps for backward, in the order they sit in one buffer: what rnn_abi.LSTM_FWD writes and
# LSTM_BWD reads (the LSTM's _fused._lstm_state, with the input-side layer norm's statistics;
# the raw projection gx after them where the time loop computes it).
_KEPT = (("hp", "G"), ("acts", "G"), ("cn", "H"), ("tc", "H"),
         ("mh", ""), ("rh", ""), ("mc", ""), ("rc", ""), ("mx", ""), ("rx", ""))  # fmt: skip
# ... and those its backward writes and reads back (dgates: the raw projection's gradient).
_SCRATCH = (("dgates", "G"), ("dhp", "G"), ("dlc", "H"))
# Without layer norms (``norm="none"``: _fused's plain input side, gx = x W_ihᵀ + b0) no row
# statistics of gx are kept, and hp's gradient is dgates itself (the backward's dhp points there).
_KEPT_PLAIN = tuple(k for k in _KEPT if k[0] not in ("mx", "rx"))
_SCRATCH_PLAIN = (("dgates", "G"), ("dlc", "H"))
# Most signatures kept (a plan is a few dicts; sequences of many lengths make many).
_MAX_PLANS = 256
# Up to this size a call's kept buffers (and its backward's) are views of one buffer, which is what
# the C++ node takes (:func:`_node_plan`; the Python node: one lookup of the cache where there were
# ten, some 4 µs each). The node allocates its buffers with torch's allocator, so the size stays
# under glibc's largest mmap threshold (:data:`.buffers.OUTPUT_MIN_BYTES`, 32 MiB), from which every
# allocation is a fresh mapping whose pages fault on first write: at (100, 32, 128, 256) and (200,
# 16, 64, 256), 59 MB kept, the node took 1.06-1.11x torch.nn.LSTM's time against 0.78-0.90x with
# the cache's buffers (11 000 page faults a call). Under it the heap serves them, a few hundred
# faults a call, and the node's calls beat the Python node's: LN-LSTM training, one | two threads,
# ours / torch.nn.LSTM with 8 MiB (the Python node) against 31 MiB (the node), (10, 512, 32, 32), 9
# MB kept, 1.36 / 1.25 | 1.48 / 1.32; (30, 128, 64, 64) 1.26 / 1.24 | 1.38 / 1.27; (1000, 4, 32,
# 128), 27 MB, 1.17 / 1.13 | 0.80 / 0.80 (ab_rnn.py, AMD EPYC Zen 4, 2026-11-30); the Python node
# itself level with one buffer or ten at these sizes. Past it each buffer is one of the cache's own,
# which other layers' calls can take in turn (the cache hands a buffer to any request of about its
# size); one buffer of the sum would be of use to calls of this signature only. LN-LSTM training at
# (100, 64, 256, 512), 180 MB kept, one thread, alternating with the layer without layer norms (the
# fused path, buffers of their own): 1.18-1.19x torch.nn.LSTM's median time with one buffer (page
# faults in the rounds where the cache, 512 MiB, had evicted it; the fastest rounds 1.00), 1.00
# (0.98) with buffers of their own (AMD EPYC).
_ONE_BUFFER_BYTES = _buffers.OUTPUT_MIN_BYTES - (1 << 20)


class TrainingPlan(NamedTuple):
    """What a training call of one signature decides: where the input projection runs, the
    buffers' layout, the kernels' argument structs with their fixed fields packed and checked
    (:class:`.rnn_abi.BoundStruct`), the default gains."""

    in_loop: bool  # the forward kernel projects the inputs in its time loop (see _fused)
    reverse: bool  # the direction runs backward in time
    layer_norm: bool  # the layer's layer norms (False: norm="none", the C++ node's alone)
    rounded: bool  # gradients' products by _cstep.rounded_product (rounded recurrent products)
    kept: tuple[tuple[str, int, tuple[int, ...]], ...]  # (name, offset, shape) in one buffer
    kept_numel: int
    kept_whole: bool  # the kept buffers are blocks of one buffer (see _ONE_BUFFER_BYTES)
    scratch: tuple[tuple[str, int, tuple[int, ...]], ...]
    scratch_numel: int
    scratch_whole: bool
    forward: rnn_abi.BoundStruct  # LSTM_FWD
    forward_sequence: rnn_abi.BoundStruct  # SEQ_FWD
    backward: rnn_abi.BoundStruct  # LSTM_BWD
    backward_sequence: rnn_abi.BoundStruct  # SEQ_BWD
    defaults: dict[str, Tensor]  # ones and zeros for the gains and biases a layer lacks
    node: Any  # the C++ node's plan (:func:`_node_plan`), or None: PlannedLSTMSequence runs it


_PLANS: dict[tuple[Any, ...], TrainingPlan] = {}
_PLANS_LOCK = threading.Lock()


def _layout(
    spec: tuple[tuple[str, str], ...], sizes: dict[str, int]
) -> tuple[tuple[tuple[str, int, tuple[int, ...]], ...], int]:
    """Offsets and shapes of ``spec``'s buffers side by side in one buffer of N-row blocks."""
    n_rows, out, offset = sizes["N"], [], 0
    for name, cols in spec:
        shape = (n_rows, sizes[cols]) if cols else (n_rows,)
        out.append((name, offset, shape))
        offset += n_rows * (sizes[cols] if cols else 1)
    return tuple(out), offset


def _region(
    layout: tuple[tuple[str, int, tuple[int, ...]], ...], numel: int, aliases: dict[str, str]
) -> rnn_abi.Region:
    """The blocks of ``layout`` in one buffer, and each of ``aliases`` (a field pointing at
    another's block) at its block."""
    blocks = {name: (offset, shape) for name, offset, shape in layout}
    return rnn_abi.Region(numel, {**blocks, **{a: blocks[b] for a, b in aliases.items()}})


def _buffers_of(
    like: Tensor, name: str, layout: tuple[tuple[str, int, tuple[int, ...]], ...], numel: int,
    whole: bool,
) -> dict[str, Tensor]:  # fmt: skip
    """A call's buffers of ``layout``: one buffer of the cache under ``name`` where ``whole``
    (the structs point at its blocks, no view is made), else each a buffer of its own (see
    :data:`_ONE_BUFFER_BYTES`)."""
    if whole:
        return {name: _buffers.empty(like, (numel,))}
    return {block: _buffers.empty(like, shape) for block, _, shape in layout}


def _block(
    buffers: dict[str, Tensor],
    whole: str,
    layout: tuple[tuple[str, int, tuple[int, ...]], ...],
    name: str,
) -> Tensor:
    """Block ``name`` of a call's buffers (:func:`_buffers_of`, ``whole`` the one buffer's
    name) as a tensor."""
    buffer = buffers.get(whole)
    if buffer is None:
        return buffers[name]
    offset, shape = next((o, s) for block, o, s in layout if block == name)
    return buffer.as_strided(shape, (shape[1], 1) if len(shape) == 2 else (1,), offset)


def _build(
    x: Tensor, h0: Tensor, w_hh: Tensor, w_ih: Tensor, n_steps: int, reverse: bool, eps: float,
    in_loop: bool, half: int, layer_norm: bool = True,
) -> TrainingPlan:  # fmt: skip
    """The plan of a signature (see :func:`lstm_training` for what it is keyed on); without
    ``layer_norm`` that of a layer with ``norm="none"`` (the C++ node's alone)."""
    (n_rows, inputs), (batch, hs), gates = x.shape, h0.shape, w_hh.shape[0]
    dtype, itemsize = x.dtype, x.element_size()
    sizes = {"N": n_rows, "B": batch, "H": hs, "G": gates, "R": n_rows, "X": n_rows, "D": n_rows}
    sched = _fused.make_schedule([batch] * n_steps, reverse)
    kept_spec = (_KEPT if layer_norm else _KEPT_PLAIN) + ((("gx", "G"),) if in_loop else ())
    kept, kept_numel = _layout(kept_spec, sizes)
    scratch, scratch_numel = _layout(_SCRATCH if layer_norm else _SCRATCH_PLAIN, sizes)
    kept_whole = kept_numel * itemsize <= _ONE_BUFFER_BYTES
    scratch_whole = scratch_numel * itemsize <= _ONE_BUFFER_BYTES
    step = {**_cstep.UNSET_STEP, "layer_norm": int(layer_norm), "normalize_cell_state": 0,
            "zh": None, "zc": None, "cm": None}  # fmt: skip
    # without layer norms: no LN(gx), so neither its gain and bias nor its statistics (_fused's
    # plain input side; the other gains and biases are the defaults, which the kernels skip)
    plain = {} if layer_norm else {"w0": None, "b0": None, "mx": None, "rx": None}
    kept_region = {"kept": _region(kept, kept_numel, {})} if kept_whole else {}
    aliases = {} if layer_norm else {"dhp": "dgates"}
    scratch_region = {"scratch": _region(scratch, scratch_numel, aliases)} if scratch_whole else {}
    # the C backward takes c_{t−1} from cn of the step before, c0 for the first (every step a
    # full batch, the carried state c_t itself: _fused._keep_previous)
    forward = rnn_abi.BoundStruct(
        rnn_abi.LSTM_FWD,
        dtype,
        sizes,
        {**step, **plain, "eps": eps, "hprev": None, "cprev": None},
        kept_region,
    )
    backward = rnn_abi.BoundStruct(
        rnn_abi.LSTM_BWD, dtype, sizes,
        {**step, **{k: v for k, v in plain.items() if k != "b0"}, "cprev": None,
         "reverse": int(reverse)},
        {**kept_region, **scratch_region},
    )  # fmt: skip
    # the sequence structs as :func:`._cstep._sequence` packs them (rnn.pack_sequence), with
    # this call's threads and, in the loop, the input projection's operands (without layer
    # norms, its bias b0 too: a call's)
    seq_sizes = {**sizes, "S": n_steps, "I": inputs if in_loop else 0, "P": sizes["H"]}
    seq = {"steps": _cstep._steps(sched), "grain": _cstep._SEQ_GRAIN,
           "gemm_grain": _cstep._SEQ_GEMM_GRAIN, "half_gemm": half}  # fmt: skip
    projection = {} if in_loop else {"x": None, "w_ih": None}
    bias = {} if in_loop and not layer_norm else {"b0": None}
    forward_sequence = rnn_abi.BoundStruct(
        rnn_abi.SEQ_FWD, dtype, seq_sizes,
        {**seq, **projection, **bias, "split": gates, "w0": None},
    )  # fmt: skip
    backward_sequence = rnn_abi.BoundStruct(rnn_abi.SEQ_BWD, dtype, seq_sizes, seq)
    # the step kernels' (w1, b1, w3, b3) and, as LSTMSequence has them, LN(gx)'s
    defaults = {**_cstep.default_params("lstm", x, hs), "w0": x.new_ones(gates),
                "b0": x.new_zeros(gates)}  # fmt: skip
    rounded = _cstep.rounds_gradient_products(half)
    plan = TrainingPlan(in_loop, reverse, layer_norm, rounded, kept, kept_numel, kept_whole,
                        scratch, scratch_numel, scratch_whole, forward, forward_sequence,
                        backward, backward_sequence, defaults, None)  # fmt: skip
    return plan._replace(node=_node_plan(plan, x, h0, w_hh, w_ih))


# The C++ node runs signatures whose weights' gradients (which it allocates itself, where the
# Python node takes a buffer of the cache from buffers.MIN_BYTES) are at most this size. LN-LSTM
# training, ours / torch.nn.LSTM with the C++ node / the Python node, Intel Xeon (Emerald Rapids),
# one | two threads: (T, B, I, H) = (10, 8, 256, 256) (1 MiB) 0.94 / 1.13 | 1.00 / 1.13,
# (5, 4, 512, 512) (4 MiB) 0.47 / 0.50 | 0.50 / 0.51, (2, 16, 1024, 1024) (16 MiB, a fresh
# mapping each: page faults) 0.41 / 0.42 | 0.37 / 0.27 (benchmarks/RESULTS.md, 2026-11-29).
_NODE_MAX_WEIGHT_BYTES = 4 << 20

# How the C++ node runs a product (csrc_torch/rnn_ops.cpp's Route): torch's GEMM, the C GEMM, a
# weight's gradient by _cstep.transposed_product as dᵀ·x or as (xᵀ·d)ᵀ, a gradient's product by
# _cstep.rounded_product.
_TORCH, _C_GEMM, _TRANSPOSED, _TRANSPOSED_SWAPPED, _ROUNDED = range(5)


def _weight_grad_route(d: Tensor, x: Tensor, rounded: bool) -> int:
    """How :func:`._fused._weight_grad` (with the C kernels) computes ``dᵀ · x`` for tensors of
    these shapes, dtype and layout, on this many threads."""
    if rounded:
        return _ROUNDED
    if _fused.weight_grad_by_mm(d, x):
        return _TORCH
    if _cstep.weight_grad_by_c(d, x):
        return _C_GEMM
    return _TRANSPOSED_SWAPPED if _cstep.transposed_product_swaps(d, x) else _TRANSPOSED


def _dx_route(grad: Tensor, w_ih: Tensor, rounded: bool) -> int:
    """How :func:`._fused._projection_grads` computes the input's gradient ``grad · W_ih``."""
    if rounded:
        return _ROUNDED
    return _C_GEMM if _cstep.input_product_by_c(grad, w_ih, False) else _TORCH


def _node_plan(plan: TrainingPlan, x: Tensor, h0: Tensor, w_hh: Tensor, w_ih: Tensor) -> Any:
    """The plan of the C++ training node (``csrc_torch/rnn_ops.cpp``, which runs what
    :class:`PlannedLSTMSequence` runs, from C++: its Python took 380 µs of a (50, 8, 64, 128)
    training call, one thread, over a node that computes nothing), or ``None`` where that node
    does not run the call: the C++ operators unavailable, kept buffers past
    :data:`_ONE_BUFFER_BYTES` or weights past :data:`_NODE_MAX_WEIGHT_BYTES` (those reuse the
    buffer cache's memory, which the node's own allocations would not). Each product's route is
    the one the Python node takes for this signature (the key holds the threads and the kernels'
    configuration it depends on)."""
    (n_rows, inputs), hs, gates, dtype = x.shape, h0.shape[1], w_hh.shape[0], x.dtype
    weight_bytes = gates * max(hs, inputs) * x.element_size()
    if not (
        plan.kept_whole
        and plan.scratch_whole
        and weight_bytes <= _NODE_MAX_WEIGHT_BYTES
        and torch_ops.recurrent_nodes()
    ):
        return None
    grad = torch.empty((n_rows, gates), dtype=dtype)  # dhp and dgates: (N, G), contiguous
    previous = torch.empty((n_rows, hs), dtype=dtype)
    routes = {
        "proj": _TORCH if plan.in_loop or not _cstep.input_product_by_c(x, w_ih, True) else _C_GEMM,
        "dx": _dx_route(grad, w_ih, plan.rounded),
        "dw_hh": _weight_grad_route(grad, previous, plan.rounded),
        "dw_ih": _weight_grad_route(grad, x, plan.rounded),
    }
    grain = {"gemm_grain": _cstep._GEMM_GRAIN}
    matmul_sizes = {"M": n_rows, "R": gates, "C": inputs}
    # a bfloat16 layer's projection by bfloat16 dot products as _cstep.input_product takes it
    # (the plan's key holds the context: its half_gemm); its input gradient never
    half = int(_cstep._bfloat16_input_product(x, True))
    products = {
        "proj": rnn_abi.BoundStruct(rnn_abi.MATMUL, dtype, {**matmul_sizes, "K": inputs,
                                    "N": gates}, {**grain, "transposed": 1, "half_gemm": half}),
        "dx": rnn_abi.BoundStruct(rnn_abi.MATMUL, dtype, {**matmul_sizes, "K": gates,
                                  "N": inputs}, {**grain, "transposed": 0, "half_gemm": 0}),
        "dw_hh": rnn_abi.BoundStruct(rnn_abi.WEIGHT_GRAD, dtype, {"N": n_rows, "G": gates,
                                     "H": hs}, grain),
        "dw_ih": rnn_abi.BoundStruct(rnn_abi.WEIGHT_GRAD, dtype, {"N": n_rows, "G": gates,
                                     "H": inputs}, grain),
    }  # fmt: skip
    # the structs in the node's order (TemplateId): those of products off the C GEMM unused
    bound = [plan.forward, plan.forward_sequence, plan.backward, plan.backward_sequence] + [
        products[name] if routes[name] == _C_GEMM else None for name in products
    ]
    structs, names, where = torch_ops.templates(bound)
    uses = {"matmul": ("proj", "dx"), "weight_grad": ("dw_hh", "dw_ih")}
    kernels = [rnn.kernel_address("lstm_fwd_seq", dtype), rnn.kernel_address("lstm_bwd_seq", dtype)]
    for kernel, products_of in uses.items():
        used = any(routes[name] == _C_GEMM for name in products_of)
        kernels.append(rnn.kernel_address(kernel, dtype) if used else 0)
    scratch = {name: offset for name, offset, _ in plan.scratch}
    # the node's settings, by the names rnn_ops.cpp gives them (kConfigNames)
    config = {"in_loop": int(plan.in_loop), "reverse": int(plan.reverse), "rows": n_rows,
              "batch": h0.shape[0], "hidden": hs, "gates": gates, "inputs": inputs,
              "kept_numel": plan.kept_numel, "scratch_numel": plan.scratch_numel,
              # without layer norms hp's gradient is dgates itself (aliased: _build)
              "dhp_offset": scratch["dhp"] if plan.layer_norm else scratch["dgates"],
              "dgates_offset": scratch["dgates"], "proj_route": routes["proj"],
              "dx_route": routes["dx"], "dw_hh_route": routes["dw_hh"],
              "dw_ih_route": routes["dw_ih"], "layer_norm": int(plan.layer_norm)}  # fmt: skip
    defaults = [plan.defaults[name] for name in ("w1", "b1", "w3", "b3", "w0", "b0")]
    refusals = {"double_backward": _fused.DOUBLE_BACKWARD_REFUSAL,
                "batched_backward": _fused.BATCHED_BACKWARD_REFUSAL}  # fmt: skip
    return torch_ops.lstm_plan(structs, names, where, kernels, config, defaults, refusals)


def lstm_training(
    data: Tensor,
    sizes: list[int],
    reverse: bool,
    h0: Tensor,
    c0: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None,
    b_hh: Tensor | None,
    params: tuple[Tensor | None, ...],
    eps: float,
    layer_norm: bool,
    normalize_cell_state: bool,
    masks: Masks,
    w_hr: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor] | None:
    """One LSTM direction's training call by its plan, or ``None`` where the call is not of the
    planned kind (then :func:`._fused.lstm_sequence` runs it): autograd records it, layer norms
    without normalized carry, no mask or projection, every step a full batch (``sizes``, the
    steps' rows, all equal), float32 / float64 on the C sequence kernels, both or none of
    torch's biases. Without ``layer_norm`` (``norm="none"``) only by the C++ node (the Python
    node takes the layer norms' input side alone). ``params``: the layer norms' gains and biases
    ``(w1, b1, w3, b3, w0, b0)`` (LN(hp), LN(c_t), LN(gx)), each ``None`` where the layer has
    none; the caller passes them in the data's dtype, contiguous."""
    if (
        normalize_cell_state
        or w_hr is not None
        or any(m is not None for m in masks)
        or sizes[0] != sizes[-1]
        or (b_ih is None) != (b_hh is None)
        or not _fused.differentiated(data, h0, c0, w_ih, w_hh, b_ih, b_hh, *params)
        or step_kernels(data) is not C_KERNELS
        or not (layer_norm or torch_ops.recurrent_nodes())
        or not (layer_norm or all(p is None for p in params))
    ):
        return None
    n_batch = h0.shape[0]
    in_loop = _fused.projects_in_training_loop(data, w_ih, n_batch)
    half = _cstep.half_gemm_of(data.dtype)
    # the C++ node's product routes depend on the threads and the kernels' configuration
    key = (data.shape, data.dtype, h0.shape, w_hh.shape, len(sizes), reverse, eps, in_loop, half,
           _ONE_BUFFER_BYTES, torch.get_num_threads(), _cstep.configuration(),
           torch_ops.recurrent_nodes(), layer_norm)  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        plan = _build(data, h0, w_hh, w_ih, len(sizes), reverse, eps, in_loop, half, layer_norm)
        with _PLANS_LOCK:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
    if plan.node is not None:
        _fused._check_untraced("PlannedLSTMSequence")
        return torch_ops.lstm_planned(data, h0, c0, w_hh, *params, w_ih, b_ih, b_hh, plan.node)
    if not layer_norm:  # past the node's limits: the fused path
        return None
    return PlannedLSTMSequence.apply(  # type: ignore[no-any-return]
        data, h0, c0, w_hh, *params, w_ih, b_ih, b_hh, plan
    )


class PlannedLSTMSequence(torch.autograd.Function):
    """:class:`._fused.LSTMSequence` with ``input_norm`` and ``w_ih`` (the layers' call) by a
    :class:`TrainingPlan`. Inputs: ``x (N, I)``, ``h0, c0 (B, H)``, ``w_hh (4H, H)``, the layer
    norms' ``w1, b1 (4H)``, ``w3, b3 (H)``, ``w0, b0 (4H)`` (``None``: ones, zeros), ``w_ih
    (4H, I)``, torch's ``b_ih, b_hh (4H)`` (or ``None``), the plan. Outputs ``out (N, H)``,
    ``h_n, c_n (B, H)``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        h0: Tensor,
        c0: Tensor,
        w_hh: Tensor,
        w1: Tensor | None,
        b1: Tensor | None,
        w3: Tensor | None,
        b3: Tensor | None,
        w0: Tensor | None,
        b0: Tensor | None,
        w_ih: Tensor,
        b_ih: Tensor | None,
        b_hh: Tensor | None,
        plan: TrainingPlan,
    ) -> tuple[Tensor, Tensor, Tensor]:
        _fused._check_untraced("PlannedLSTMSequence")
        x, w_hh, w_ih = x.contiguous(), w_hh.contiguous(), w_ih.contiguous()
        defaults = plan.defaults
        kept = _buffers_of(x, "kept", plan.kept, plan.kept_numel, plan.kept_whole)
        # gx: the raw projection, kept for backward (a block of the kept buffers in the loop)
        gx = None if plan.in_loop else _fused._projected(x, w_ih).contiguous()
        if plan.in_loop and not plan.kept_whole:
            gx = kept["gx"]
        b0 = _fused.fold_input_bias(b0, None if b_ih is None else (b_ih, b_hh))
        h0, c0 = h0.contiguous(), c0.contiguous()
        out, previous = _fused._output_and_previous(x, h0, plan.reverse)
        h, c = h0.clone(), c0.clone()
        given = {"w1": w1, "b1": b1, "w3": w3, "b3": b3, "w0": w0, "b0": b0}
        params = {name: defaults[name] if t is None else t for name, t in given.items()}
        args = plan.forward.pack({**kept, **params, "gx": gx, "h": h, "c": c, "out": out})
        seq = {"w": w_hh, "threads": max(1, torch.get_num_threads())}
        if plan.in_loop:
            seq.update(x=x, w_ih=w_ih)
        seq_args = plan.forward_sequence.pack(seq)
        rnn.run_sequence("lstm_fwd_seq", x.dtype, args, seq_args)
        ctx.plan = plan
        ctx.save_for_backward(
            x, c0, w_hh, w_ih, params["w1"], params["w3"], params["w0"], out, previous, gx,
            *kept.values(),
        )  # fmt: skip
        return out, h, c

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dh_n: Tensor, dc_n: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        _fused._check_plain_backward(dout)
        plan: TrainingPlan = ctx.plan
        # the output is saved for autograd's check that nothing wrote it since (previous is its
        # memory, read here)
        x, c0, w_hh, w_ih, w1, w3, w0, _out, previous, gx, *kept_list = ctx.saved_tensors
        names = ("kept",) if plan.kept_whole else (name for name, _, _ in plan.kept)
        kept = dict(zip(names, kept_list, strict=True))
        need = ctx.needs_input_grad
        dtype, (n_rows, inputs), gates, hs = x.dtype, x.shape, w_hh.shape[0], w_hh.shape[1]
        scratch = _buffers_of(x, "scratch", plan.scratch, plan.scratch_numel, plan.scratch_whole)
        # every tensor the structs point at is held by a local until the kernel returns
        dout, dh, dc = (
            _fused._contiguous(dout),
            dh_n.contiguous().clone(),
            dc_n.contiguous().clone(),
        )
        need_b0 = need[9] or need[11] or need[12]  # b0's gradient is also b_ih's and b_hh's
        sums = None
        if any(need[4:9]) or need_b0:  # the layer norms' gains and biases, summed by the kernel
            sums = x.new_empty(4 * gates + 2 * hs).split((2 * gates, 2 * hs, 2 * gates))
        x_in_loop = plan.in_loop and need[0]
        dx = _buffers.empty(x, (n_rows, inputs)) if x_in_loop else None
        values = {**kept, **scratch, "dout": dout, "dh": dh, "dc": dc, "w1": w1, "w3": w3,
                  "c0": c0, "w0": w0}  # fmt: skip
        if gx is not None:
            values["gx"] = gx
        args = plan.backward.pack(values)
        seq: dict[str, Any] = {"w": w_hh, "threads": max(1, torch.get_num_threads())}
        if x_in_loop:
            seq.update(w_ih=w_ih, dx=dx)
        if sums is not None:
            seq.update(hp_grads=sums[0], c_grads=sums[1], x_grads=sums[2])
        seq_args = plan.backward_sequence.pack(seq)
        rnn.run_sequence("lstm_bwd_seq", dtype, args, seq_args)
        dhp = _block(scratch, "scratch", plan.scratch, "dhp")
        d_w_hh = _fused._weight_grad(C_KERNELS, dhp, previous, plan.rounded) if need[3] else None
        dw1 = db1 = dw3 = db3 = dw0 = db0 = None
        if sums is not None:
            dw1, db1 = _fused._split_grads(sums[0], need[4], need[5])
            dw3, db3 = _fused._split_grads(sums[1], need[6], need[7])
            dw0, db0 = _fused._split_grads(sums[2], need[8], need_b0)
        # dgates: the kernel turned it into the raw projection's gradient
        dgates = _block(scratch, "scratch", plan.scratch, "dgates")
        d_x, d_w_ih = _fused._projection_grads(
            C_KERNELS, dgates, x, w_ih, need[0] and not x_in_loop, need[10], plan.rounded
        )
        if x_in_loop:
            d_x = dx
        return (d_x, dh, dc, d_w_hh, dw1, db1, dw3, db3, dw0, db0 if need[9] else None, d_w_ih,
                db0 if need[11] else None, db0 if need[12] else None, None)  # fmt: skip
