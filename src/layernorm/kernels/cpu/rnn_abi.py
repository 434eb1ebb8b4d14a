"""One typed description of every recurrent C kernel's arguments, and what follows from it.

The recurrent kernels (``csrc/rnn_step.c``, ``csrc/rnn_seq.c``) take pointers to argument structs
of named fields. :data:`STRUCTS` describes each field once: name, kind (which fixes its C type),
shape rule over the sizes ``N`` (rows of the packed sequence), ``B`` (rows of the state), ``H``,
``G`` (gate rows of ``W_hh``) and ``S`` (steps), and a doc line. From that come

* the C header ``csrc/layernorm_rnn_abi.h`` (struct typedefs, prototypes, and ``_Static_assert``
  s on every field offset, so the compiler checks the layout ctypes assumes); :func:`c_header`
  generates it and a test checks the checked-in file equals it;
* the :class:`ctypes.Structure` of each struct and dtype (:func:`structure`);
* the checks run before C sees a pointer (:func:`check`): dtype, device, contiguity and shape of
  every tensor, kind and range of every number.

This follows :mod:`.abi` (the norm kernels' description) with what the recurrence needs beyond
it: state buffers a kernel reads and updates, an ``int64`` array (the steps), several sizes.
Run ``python -m layernorm.kernels.cpu.rnn_abi`` to rewrite the header after changing it.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .abi import CSRC_DIR, INSTANCES

HEADER_NAME = "layernorm_rnn_abi.h"
#: The recurrent kernels' instances, torch dtype -> (C scalar type, symbol suffix): float32 and
#: float64 only (the norm kernels' half instances have no recurrent counterpart).
RNN_INSTANCES: dict[torch.dtype, tuple[str, str]] = {
    dt: (INSTANCES[dt].c_type, INSTANCES[dt].suffix) for dt in (torch.float32, torch.float64)
}
#: What a kernel returns when a step's rows lie outside the buffers (it then touches nothing).
ERR_ROWS = 1
#: What a kernel returns when it cannot allocate its buffers (it then touches nothing).
ERR_NOMEM = 2
#: What an LSTM kernel returns when its input-side layer norm is half given (rnn_abi's
#: ``_INPUT_NORM``: w0 without its bias, statistics or gx rows, or without layer_norm).
ERR_INPUT_NORM = 4
#: The rows a group of the LN-LSTM forward step unless set, and the most
#: (``rnn_set_forward_group``).
FORWARD_GROUP_DEFAULT = 4
FORWARD_GROUP_MAX = 8
#: The most bytes of packed weights for which a sequence call's team splits the batch's rows
#: among its threads instead of sharing every step, unless set (``rnn_set_batch_split_bytes``).
BATCH_SPLIT_BYTES_DEFAULT = 4 << 20
#: What a sequence kernel returns when its optional input projection is half given (x without
#: w_ih or the reverse), its split is outside (0, G], or gx has the wrong rows for it; the Elman
#: kernels, which normalize hp + gx as one, when it is given at all; ``matmul`` when its W's
#: shape is not that of its ``transposed`` flag; a forward sequence kernel when its recurrent
#: projection (``w_hr``) is half given, P differs from H without it, or it comes to a kernel
#: other than the LSTM's, with kept buffers of N rows or with zoneout of h; when its bfloat16
#: weights (``w_half``, ``w_ih_half``) do not agree with it (see ``_HALF_WEIGHTS``); a block
#: norm (``block_norm_fwd``, ``block_norm_bwd``) when its split exceeds G.
ERR_PROJECTION = 3


class Kind(enum.Enum):
    """A field's kind; it fixes the C type (``scalar_t`` is the instantiated float type)."""

    IN = "input"  # const scalar_t*: read
    HALF_IN = "bfloat16 input"  # const uint16_t*: read, bfloat16 values whatever the scalar type
    OUT = "output"  # scalar_t*: written
    INOUT = "in/out"  # scalar_t*: read and updated (the state)
    STEPS = "steps"  # const int64_t*: (first row, rows) of each step
    SIZE = "size"  # int64_t: a size the caller binds (N, B, H, G, S)
    INDEX = "index"  # int64_t: a count or grain, >= minimum
    FLOAT = "float"  # double: finite, >= minimum
    FLAG = "flag"  # int32_t: 0 or 1
    COUNT = "count"  # int32_t: >= 1


_C_TYPES = {Kind.IN: "const {s}*", Kind.HALF_IN: "const uint16_t*", Kind.OUT: "{s}*",
            Kind.INOUT: "{s}*", Kind.STEPS: "const int64_t*", Kind.SIZE: "int64_t",
            Kind.INDEX: "int64_t", Kind.FLOAT: "double", Kind.FLAG: "int32_t",
            Kind.COUNT: "int32_t"}  # fmt: skip
_CTYPES = {"int64_t": ctypes.c_int64, "double": ctypes.c_double, "int32_t": ctypes.c_int32}
_POINTERS = (Kind.IN, Kind.HALF_IN, Kind.OUT, Kind.INOUT, Kind.STEPS)
# The dtype of a pointer field's tensor where it is not the instance's scalar type.
_FIXED_DTYPES = {Kind.STEPS: torch.int64, Kind.HALF_IN: torch.bfloat16}
# Struct order: pointers, then 8-byte numbers, then 4-byte ones (no padding inside).
_RANK = {Kind.SIZE: 1, Kind.INDEX: 1, Kind.FLOAT: 1, Kind.FLAG: 2, Kind.COUNT: 2}


@dataclass(frozen=True)
class Field:
    """One field of an argument struct. ``shape`` is a tuple of size terms such as ``"N"`` or
    ``"4H"`` (a coefficient times a size); ``minimum`` bounds an INDEX or FLOAT field."""

    name: str
    kind: Kind
    shape: tuple[str, ...] = ()
    doc: str = ""
    minimum: float = 0
    symbol: str = ""  # a SIZE field's size symbol, when not its name
    optional: bool = False  # a pointer that may be NULL (None from Python): the option is off

    def c_type(self, scalar: str = "scalar_t") -> str:
        return _C_TYPES[self.kind].format(s=scalar)

    @property
    def is_pointer(self) -> bool:
        return self.kind in _POINTERS

    def tensor_dtype(self, scalar: torch.dtype) -> torch.dtype:
        """The dtype of this pointer field's tensor in the ``scalar`` instance."""
        return _FIXED_DTYPES.get(self.kind, scalar)


@dataclass(frozen=True, eq=False)  # hashed by identity: a cache key on every kernel call
class Struct:
    """An argument struct ``<name>_<suffix>``: its fields in declaration order."""

    name: str
    doc: str
    fields: tuple[Field, ...]

    def field(self, name: str) -> Field:
        return next(f for f in self.fields if f.name == name)

    def layout(self) -> tuple[Field, ...]:
        """The fields in struct order (pointers, 8-byte numbers, 4-byte numbers)."""
        return tuple(sorted(self.fields, key=lambda f: _RANK.get(f.kind, 0)))


@dataclass(frozen=True)
class Kernel:
    """A kernel ``int <name>_<suffix>(const <struct>_<suffix>* ...)``: 0 on success, else
    :data:`ERR_ROWS`."""

    name: str
    doc: str
    structs: tuple[Struct, ...]


def _t(name: str, kind: Kind, shape: str, doc: str = "") -> Field:
    return Field(name, kind, tuple(shape.split()), doc)


def _mask(name: str, shape: str, doc: str) -> Field:
    """An optional input (a regularizer's mask): NULL where the layer does not use it."""
    return Field(name, Kind.IN, tuple(shape.split()), doc, optional=True)


_IN, _OUT, _INOUT = Kind.IN, Kind.OUT, Kind.INOUT
# Sizes, the step's rows and threads, and the normalization switches of the step structs.
_SIZES = (
    Field("N", Kind.SIZE, doc="rows of the packed sequence"),
    Field("B", Kind.SIZE, doc="rows of the state (the batch)"),
    Field("H", Kind.SIZE, doc="hidden units"),
)
# The forward structs' per-row buffers (everything but gx, out and the masks) have R rows: R = N
# keeps every step's rows for backward; R = B is inference, where each step's rows [0, rows)
# overwrite the last step's, so that they stay in cache and nothing is kept (the kernels read
# R == N to tell the two apart, and refuse any other R).
_KEPT = Field("R", Kind.SIZE, doc="rows of the kept buffers: N (training) or B (inference)")
# gx, the input side of the gates, has X rows: N (computed by the caller for every row; row `row`
# of the sequence) or B (inference: the sequence kernel projects each step's inputs into it and
# row i of a step is row i, as with R = B).
_GX_ROWS = Field("X", Kind.SIZE, doc="rows of gx: N (given) or B (the kernel's projection)")
# The LN-GRU backward's dgh (the gradient of the gates' layer-norm outputs) has D rows: N (kept for
# the caller: its layer norms' gain and bias gradients, or hp's gradient itself without layer
# norms) or B (with layer_norm, where the sequence kernel sums those gradients as it goes: a
# step's scratch, row i of a step is row i, as with R = B).
_DGH_ROWS = Field("D", Kind.SIZE, doc="rows of dgh: N (kept) or B (with layer_norm: scratch)")
_STEP = (
    Field("off", Kind.INDEX, doc="the step's first row in the (N, ·) buffers"),
    Field("rows", Kind.INDEX, doc="the step's rows: rows [off, off + rows), state rows [0, rows)"),
    Field("threads", Kind.COUNT, doc="OpenMP threads to split the rows over"),
)
_LAYER_NORM = Field("layer_norm", Kind.FLAG, doc="1: layer-normalize hp (and c_t) with the gains")
_EPS = Field("eps", Kind.FLOAT, doc="added to the variance", minimum=0.0)
_CELL = Field("normalize_cell_state", Kind.FLAG, doc="1: carry LN(c_t) as the state, 0: c_t")
# The regularizers acting inside the time loop (layernorm.recurrent._options), NULL = off.
_ZH = _mask("zh", "N H", "zoneout of h: h_t = zh h_{t-1} + (1 - zh) h~_t (0/1, or p at eval)")
_CM = _mask("cm", "B H", "recurrent dropout on the candidate, one row per sequence (scaled)")
_LSTM_MASKS = (_ZH, _mask("zc", "N H", "zoneout of the carried c, as zh"), _CM)
_GRU_MASKS = (_ZH, _CM)

# The LN-LSTM's input-side layer norm inside the step: with w0 given, gx holds the raw
# projection W_ih x of every row (training), or of a step's rows where the sequence kernel
# projects them (inference), and the step adds LN(gx; w0, b0) to the gates, keeping its row
# statistics mx, rx, where a layer-norm pass before (or in inference inside) the call would
# write a normalized copy of gx for the step to read back. Backward then turns the gates'
# gradient into gx's in place (dgates), where a pass after the call would read both back.
# NULL: gx already holds the input side (normalized before the call, or without layer norms).
_INPUT_NORM_FWD = (
    Field("w0", _IN, ("4H",), "gain of LN(gx), normalized here (NULL: gx is the input side)",
          optional=True),
    Field("b0", _IN, ("4H",), "bias of LN(gx), torch's biases folded in (with w0)",
          optional=True),
    Field("mx", _OUT, ("R",), "mean of gx (with w0)", optional=True),
    Field("rx", _OUT, ("R",), "1/std of gx (with w0)", optional=True),
)  # fmt: skip
_INPUT_NORM_BWD = (
    Field("gx", _IN, ("N", "4H"), "the raw projection the forward normalized (with w0)",
          optional=True),
    Field("w0", _IN, ("4H",), "gain of LN(gx) (NULL: gx was the input side)", optional=True),
    Field("mx", _IN, ("N",), "mean of gx (with w0)", optional=True),
    Field("rx", _IN, ("N",), "1/std of gx (with w0)", optional=True),
)  # fmt: skip

LSTM_FWD = Struct(
    "lstm_fwd_step_args",
    "One LN-LSTM step forward (gates i, f, g, o): rows [off, off + rows) of the sequence.",
    (
        _t("hp", _INOUT, "R 4H", "W_hh h_{t-1} (the sequence kernel's GEMM writes it)"),
        _t("gx", _INOUT, "X 4H", "LN(W_ih x) + biases (written by a sequence kernel given x)"),
        _t("w1", _IN, "4H", "gain of LN(hp)"),
        _t("b1", _IN, "4H", "bias of LN(hp)"),
        _t("w3", _IN, "H", "gain of LN(c_t)"),
        _t("b3", _IN, "H", "bias of LN(c_t)"),
        _t("h", _INOUT, "B H", "h_{t-1} in, h_t out"),
        _t("c", _INOUT, "B H", "carried cell state in and out"),
        _t("out", _OUT, "N H", "h_t"),
        # NULL: not kept (the caller takes h_{t-1} from out shifted by a step, see _fused)
        Field("hprev", _OUT, ("R", "H"), "h_{t-1}", optional=True),
        Field("cprev", _OUT, ("R", "H"), "carried c_{t-1}", optional=True),
        _t("acts", _OUT, "R 4H", "gate activations"),
        _t("mh", _OUT, "R", "mean of hp"),
        _t("rh", _OUT, "R", "1/std of hp"),
        _t("cn", _OUT, "R H", "c_t un-normalized"),
        _t("mc", _OUT, "R", "mean of c_t"),
        _t("rc", _OUT, "R", "1/std of c_t"),
        _t("tc", _OUT, "R H", "tanh(LN(c_t))"),
        *_INPUT_NORM_FWD,
        *_LSTM_MASKS,
        *_SIZES, _KEPT, _GX_ROWS, _EPS, *_STEP, _LAYER_NORM, _CELL,
    ),
)  # fmt: skip
LSTM_BWD = Struct(
    "lstm_bwd_step_args",
    "One LN-LSTM step backward; dhp equals dgates without layer_norm (pass dgates).",
    (
        _t("dout", _IN, "N H", "gradient of this step's output"),
        _t("dh", _INOUT, "B H", "gradient of h_t from later steps"),
        _t("dc", _INOUT, "B H", "gradient of the carried c_t in, of c_{t-1} out"),
        _t("hp", _IN, "N 4H"),
        _t("mh", _IN, "N"),
        _t("rh", _IN, "N"),
        _t("w1", _IN, "4H"),
        _t("acts", _IN, "N 4H"),
        Field("cprev", _IN, ("N", "H"), "carried c_{t-1}; NULL: c0 for the first step's rows, "
              "else cn of the step before (steps of all B rows, carried c = c_t)", optional=True),
        Field("c0", _IN, ("B", "H"), "carried c before the first step (with cprev NULL)",
              optional=True),
        _t("cn", _IN, "N H"),
        _t("mc", _IN, "N"),
        _t("rc", _IN, "N"),
        _t("w3", _IN, "H"),
        _t("tc", _IN, "N H"),
        _t("dgates", _OUT, "N 4H", "gradient of the gate pre-activations (with w0: of gx)"),
        _t("dhp", _OUT, "N 4H", "gradient of hp"),
        _t("dlc", _OUT, "N H", "gradient of LN(c_t)"),
        *_INPUT_NORM_BWD,
        *_LSTM_MASKS,
        *_SIZES, *_STEP, _LAYER_NORM, _CELL,
        Field("reverse", Kind.FLAG, doc="with cprev NULL: 1 if the steps run backward in time"),
    ),
)  # fmt: skip
GRU_FWD = Struct(
    "gru_fwd_step_args",
    "One LN-GRU step forward (gates r, z, n): rows [off, off + rows) of the sequence.",
    (
        _t("hp", _INOUT, "R 3H", "W_hh h_{t-1} (the sequence kernel's GEMM writes it)"),
        _t("gx", _INOUT, "X 3H", "LN(W_ih x) + b_ih + [b_hr, b_hz, 0] (as the LSTM's)"),
        _t("w_rz", _IN, "2H", "gain of LN(hp_rz)"),
        _t("b_rz", _IN, "2H", "bias of LN(hp_rz)"),
        _t("w_n", _IN, "H", "gain of LN(hp_n)"),
        _t("b_n", _IN, "H", "bias of LN(hp_n)"),
        _t("b_hn", _IN, "H", "torch's b_hn"),
        _t("h", _INOUT, "B H", "h_{t-1} in, h_t out"),
        _t("out", _OUT, "N H", "h_t"),
        # NULL: not kept (backward reads h_{t-1} from out shifted by a step, see _fused)
        Field("hprev", _OUT, ("R", "H"), "h_{t-1}", optional=True),
        _t("rz", _OUT, "R 2H", "r and z"),
        _t("n", _OUT, "R H", "candidate"),
        # NULL: not kept (backward recomputes it from hp and its row statistics)
        Field("ghn", _OUT, ("R", "H"), "LN(hp_n) + b_hn", optional=True),
        _t("mh", _OUT, "R", "mean of hp_rz"),
        _t("rh", _OUT, "R", "1/std of hp_rz"),
        _t("mn", _OUT, "R", "mean of hp_n"),
        _t("rn", _OUT, "R", "1/std of hp_n"),
        *_GRU_MASKS,
        *_SIZES, _KEPT, _GX_ROWS, _EPS, *_STEP, _LAYER_NORM,
    ),
)  # fmt: skip
GRU_BWD = Struct(
    "gru_bwd_step_args",
    "One LN-GRU step backward; dhp equals dgh without layer_norm (pass dgh).",
    (
        _t("dout", _IN, "N H", "gradient of this step's output"),
        _t("dh", _INOUT, "B H", "gradient of h_t in, its direct part for h_{t-1} out"),
        Field("hprev", _IN, ("N", "H"), "h_{t-1}; NULL: h0 for the first step's rows, else y of "
              "the step before (steps of all B rows)", optional=True),
        Field("h0", _IN, ("B", "H"), "h before the first step (with hprev NULL)", optional=True),
        Field("y", _IN, ("N", "H"), "the forward's output h_t (with hprev NULL)", optional=True),
        _t("hp", _IN, "N 3H"),
        _t("rz", _IN, "N 2H"),
        _t("n", _IN, "N H"),
        Field("ghn", _IN, ("N", "H"), "LN(hp_n) + b_hn; NULL: recomputed from hp (its row "
              "statistics found again as the forward found them), w_n, b_n and b_hn",
              optional=True),
        _t("mh", _IN, "N"),
        _t("rh", _IN, "N"),
        _t("mn", _IN, "N"),
        _t("rn", _IN, "N"),
        _t("w_rz", _IN, "2H"),
        _t("w_n", _IN, "H"),
        _t("b_n", _IN, "H", "bias of LN(hp_n)"),
        _t("b_hn", _IN, "H", "torch's b_hn"),
        _t("dgx", _OUT, "N 3H", "gradient of gx"),
        _t("dgh", _OUT, "D 3H", "gradient of LN(hp_rz) and of LN(hp_n) + b_hn"),
        _t("dhp", _OUT, "N 3H", "gradient of hp"),
        *_GRU_MASKS,
        *_SIZES, _DGH_ROWS, _EPS, *_STEP, _LAYER_NORM,
        Field("reverse", Kind.FLAG, doc="with hprev NULL: 1 if the steps run backward in time"),
    ),
)  # fmt: skip


# The Elman RNN's activation switch (torch.nn.RNN's nonlinearity).
_RELU = Field("relu", Kind.FLAG, doc="1: f = relu, 0: f = tanh")
ELMAN_FWD = Struct(
    "elman_fwd_step_args",
    "One LN-RNN (Elman) step forward: h~ = f(LN(hp + gx)), rows [off, off + rows) of the sequence.",
    (
        _t("hp", _INOUT, "R H", "W_hh h_{t-1} in (the sequence kernel's GEMM writes it); the "
           "pre-activation a = hp + gx out, backward's layer-norm input"),
        # in-out as the other cells' gx: the shared time loop writes it given a projection x,
        # which the Elman kernel refuses
        _t("gx", _INOUT, "X H", "W_ih x (torch's biases added without layer_norm)"),
        _t("w", _IN, "H", "gain of LN(a)"),
        _t("b", _IN, "H", "bias of LN(a), torch's biases folded in"),
        _t("h", _INOUT, "B H", "h_{t-1} in, h_t out"),
        _t("out", _OUT, "N H", "h_t"),
        # NULL: not kept (the caller takes h_{t-1} from out shifted by a step, see _fused)
        Field("hprev", _OUT, ("R", "H"), "h_{t-1}", optional=True),
        Field("own", _OUT, ("R", "H"), "the cell's own h~_t (with zoneout of h; NULL: out holds "
              "it)", optional=True),
        _t("mh", _OUT, "R", "mean of a"),
        _t("rh", _OUT, "R", "1/std of a"),
        _ZH,
        *_SIZES, _KEPT, _GX_ROWS, _EPS, *_STEP, _LAYER_NORM, _RELU,
    ),
)  # fmt: skip
ELMAN_BWD = Struct(
    "elman_bwd_step_args",
    "One LN-RNN (Elman) step backward; dhp is the gradient of gx too (the two add).",
    (
        _t("dout", _IN, "N H", "gradient of this step's output"),
        _t("dh", _INOUT, "B H", "gradient of h_t from later steps in; with zoneout of h its "
           "direct part for h_{t-1} out (else left for the GEMM to overwrite)"),
        _t("hp", _IN, "N H", "the pre-activation a the forward normalized"),
        _t("mh", _IN, "N"),
        _t("rh", _IN, "N"),
        _t("w", _IN, "H"),
        _t("own", _IN, "N H", "the cell's own h~_t (the forward's own, or out without zoneout)"),
        _t("dhp", _OUT, "N H", "gradient of a (of hp and of gx)"),
        _ZH,
        *_SIZES, *_STEP, _LAYER_NORM, _RELU,
    ),
)  # fmt: skip


def _seq(name: str, w_shape: str, w_doc: str, options: tuple[Field, ...] = ()) -> Struct:
    return Struct(
        name,
        "The time loop of a sequence kernel: its steps in order, the recurrent weight, threads.",
        (
            _t("w", _IN, w_shape, w_doc),
            _t("steps", Kind.STEPS, "S 2", "(first row, rows) of each step, in forward order"),
            *options,
            Field("n_steps", Kind.SIZE, doc="steps", symbol="S"),
            Field("grain", Kind.INDEX, doc="step kernel: elements per thread at least", minimum=1),
            Field("gemm_grain", Kind.INDEX, doc="GEMM: multiply-adds per thread at least",
                  minimum=1),
            Field("threads", Kind.COUNT, doc="OpenMP threads at most"),
            Field("half_gemm", Kind.INDEX, doc="bfloat16 products, summed in float, where the "
                  "build has them (rnn_half_gemm; else ignored): 1, the input projection's (x and "
                  "W_ih bfloat16 values: exact products); 2, the recurrent GEMMs' too (h_{t-1}, "
                  "dhp rounded to bfloat16)"),
        ),
    )  # fmt: skip


# The forward sequence kernels' input projection: with x and w_ih given, each step's gx rows are
# x W_ihᵀ computed inside the time loop, where they stay in cache, instead of a (N, G) projection
# computed before the call and read back from memory. In inference gx has B rows (X = B), which
# the kernel finishes in place as LN(x W_ihᵀ): the columns [0, split) and [split, G) normalized
# separately (the GRU's (r, z) and n blocks; split = G for one), with gain w0 and bias b0; without
# layer_norm only b0 is added. In training gx keeps every row (X = N) raw, for the step's own
# LN(gx) (the LSTM's step struct w0) and for backward; w0 and b0 here are then NULL.
_PROJECTION = (
    Field("x", _IN, ("N", "I"), "the direction's input rows", optional=True),
    Field("w_ih", _IN, ("G", "I"), "W_ih (the kernel multiplies by its transpose)", optional=True),
    Field("w0", _IN, ("G",), "gain of LN(x W_ihᵀ) (NULL: ones)", optional=True),
    Field("b0", _IN, ("G",), "bias after it, torch's input biases folded in (NULL: zeros)",
          optional=True),
    Field("I", Kind.SIZE, doc="input features (0 without x)"),
    Field("split", Kind.INDEX, doc="first normalized block's columns (with x: 0 < split <= G)"),
)  # fmt: skip
# torch.nn.LSTM's projection (proj_size = P) in inference: with w_hr given, the step struct's h
# and out hold the cell's unprojected h~ (H units) and the state the recurrence carries is the
# projection h_t = W_hr h~_t (P units) in hr, each step's rows of it copied to out_r; the
# recurrent GEMM multiplies hr by W_hh (G, P). The LSTM kernel only, with kept buffers of B rows
# (R = B) and no zoneout of h (which acts on the P units: the caller's per-step path); without
# w_hr, P = H and hr, out_r are NULL.
_RECURRENT_PROJECTION = (
    Field("w_hr", _IN, ("P", "H"), "torch.nn.LSTM's projection W_hr (the kernel multiplies by "
          "its transpose)", optional=True),
    Field("hr", _INOUT, ("B", "P"), "the projected state h_{t-1} in, h_t out (with w_hr)",
          optional=True),
    Field("out_r", _OUT, ("N", "P"), "the projected output h_t (with w_hr)", optional=True),
    Field("P", Kind.SIZE, doc="columns of the recurrent state: the projection's with w_hr, else "
          "H"),
)  # fmt: skip
# A bfloat16 layer's one step computed in float32 (its float32 twin in inference,
# layers._HalfTwin), x and h_{t-1} exactly bfloat16 values: with w_half, the step's GEMMs read
# W_hh and W_ih as the layer stores them, bfloat16, and never w nor w_ih (the twin need not copy
# them into float32 for the call): by MKL's gemm_bf16bf16f32 (rnn_set_one_step_half_gemm), else
# widened for the call. One step (S = 1) of a float kernel, no w_hr; w_ih_half exactly with x.
_HALF_WEIGHTS = (
    Field("w_half", Kind.HALF_IN, ("G", "P"), "W_hh's bfloat16 values, read in place of w",
          optional=True),
    Field("w_ih_half", Kind.HALF_IN, ("G", "I"), "W_ih's bfloat16 values, read in place of "
          "w_ih (with w_half and x)", optional=True),
)  # fmt: skip
SEQ_FWD = _seq(
    "rnn_seq_fwd_args",
    "G P",
    "W_hh (the kernel multiplies by its transpose)",
    (*_PROJECTION, *_RECURRENT_PROJECTION, *_HALF_WEIGHTS),
)
# The backward sequence kernels' sums of the gains' and biases' gradients of the layer norms
# inside the step (with layer_norm): each row's terms are added where the row's backward has them
# in cache (in scalar_t for BLOCK_TERMS rows, then in float64, as the norm kernels sum dw and db),
# instead of two more passes over (N, G) and (N, H) buffers after the call. NULL: not summed.
_LN_GRADS = (
    Field("hp_grads", _OUT, ("2G",), "LN(hp)'s gain then bias gradient: Σ dy⊙x̂, Σ dy over rows "
          "(the GRU's (r, z) and n blocks side by side, as w_rz and w_n)", optional=True),
    Field("c_grads", _OUT, ("2H",), "LN(c_t)'s gain then bias gradient (the LSTM's; NULL for "
          "the GRU)", optional=True),
    Field("x_grads", _OUT, ("2G",), "LN(gx)'s gain then bias gradient (the LSTM's, with w0; "
          "NULL for the GRU)", optional=True),
)  # fmt: skip
# The backward sequence kernels' input-projection gradient (training, where the forward kernel
# projected the inputs in its time loop): with w_ih and dx given, each step's dx rows are
# dgx · W_ih, computed by the time loop's GEMM while the step's dgx rows are in cache, instead of
# a GEMM over all (N, G) rows after the call that reads them back from memory (the LSTM's
# kernels only; the GRU's and the Elman's refuse them).
_PROJECTION_GRAD = (
    Field("w_ih", _IN, ("G", "I"), "W_ih", optional=True),
    Field("dx", _OUT, ("N", "I"), "gradient of the direction's input rows: dgx · W_ih",
          optional=True),
    Field("I", Kind.SIZE, doc="input features (0 without dx)"),
)  # fmt: skip
SEQ_BWD = _seq("rnn_seq_bwd_args", "G H", "W_hh", (*_LN_GRADS, *_PROJECTION_GRAD))
WEIGHT_GRAD = Struct(
    "weight_grad_args",
    "dw = dhpᵀ · hprev: the recurrent weight's gradient summed over all rows.",
    (
        _t("dhp", _IN, "N G"),
        _t("hprev", _IN, "N H"),
        _t("dw", _OUT, "G H"),
        Field("N", Kind.SIZE, doc="rows"),
        Field("G", Kind.SIZE, doc="gate rows"),
        Field("H", Kind.SIZE, doc="hidden units"),
        Field("gemm_grain", Kind.INDEX, doc="multiply-adds per thread at least", minimum=1),
        Field("threads", Kind.COUNT, doc="OpenMP threads at most"),
    ),
)

# A cell's call (layernorm.LayerNormGRUCell, LayerNormLSTMCell, with gradients): one step of B
# rows whose two raw projections both get their layer norms here, and whose backward returns
# the projections' gradients and sums the gains' and biases' over the rows, so that one autograd
# node (two products and one kernel each way) replaces the dozens of ops a step takes otherwise.
# Written for the few rows of a per-token call: one thread.
_CELL_SIZES = (Field("B", Kind.SIZE, doc="rows"), Field("H", Kind.SIZE, doc="hidden units"))
#: The row statistics a GRU cell call keeps: mean and 1/std of gx's (r, z) block, gx's n block,
#: hp's (r, z) block and hp's n block, in that order.
GRU_CELL_STATS = 8
GRU_CELL_FWD = Struct(
    "gru_cell_fwd_args",
    "One LN-GRU cell call forward on B rows: the layer norms of both projections and the gates.",
    (
        _t("gx", _IN, "B 3H", "W_ih x, raw"),
        _t("hp", _IN, "B 3H", "W_hh h_{t-1}, raw"),
        _t("h", _IN, "B H", "h_{t-1}"),
        _t("w_ih", _IN, "3H", "gains of LN(gx): the (r, z) block's, then the n block's"),
        _t("b_ih", _IN, "3H", "biases of LN(gx), torch's b_ih added"),
        _t("w_hh", _IN, "3H", "gains of LN(hp)"),
        _t("b_hh", _IN, "3H", "biases of LN(hp), torch's b_hh added"),
        _t("out", _OUT, "B H", "h_t"),
        _t("rz", _OUT, "B 2H", "r and z"),
        _t("n", _OUT, "B H", "candidate"),
        _t("ghn", _OUT, "B H", "LN(hp_n) + b_hh's n block"),
        _t("stats", _OUT, f"B {GRU_CELL_STATS}", "each row's means and 1/std (GRU_CELL_STATS)"),
        *_CELL_SIZES, _EPS,
    ),
)  # fmt: skip
GRU_CELL_BWD = Struct(
    "gru_cell_bwd_args",
    "One LN-GRU cell call backward on B rows (the forward's kept buffers).",
    (
        _t("dout", _IN, "B H", "gradient of h_t"),
        _t("gx", _IN, "B 3H"),
        _t("hp", _IN, "B 3H"),
        _t("h", _IN, "B H"),
        _t("w_ih", _IN, "3H"),
        _t("w_hh", _IN, "3H"),
        _t("rz", _IN, "B 2H"),
        _t("n", _IN, "B H"),
        _t("ghn", _IN, "B H"),
        _t("stats", _IN, f"B {GRU_CELL_STATS}"),
        _t("dgx", _OUT, "B 3H", "gradient of the raw gx"),
        _t("dhp", _OUT, "B 3H", "gradient of the raw hp"),
        _t("dh", _OUT, "B H", "the part of h_{t-1}'s gradient that bypasses W_hh"),
        _t("dparams", _OUT, "4 3H", "gradients of w_ih, b_ih, w_hh, b_hh, summed over the rows"),
        *_CELL_SIZES, _EPS,
    ),
)  # fmt: skip
#: The row statistics an LSTM cell call keeps: mean and 1/std of gx, of hp and of c_t.
LSTM_CELL_STATS = 6
LSTM_CELL_FWD = Struct(
    "lstm_cell_fwd_args",
    "One LN-LSTM cell call forward on B rows: the layer norms of both projections and of c_t, "
    "the gates, c_t and h_t (c_t carried).",
    (
        _t("gx", _IN, "B 4H", "W_ih x, raw"),
        _t("hp", _IN, "B 4H", "W_hh h_{t-1}, raw"),
        _t("c", _IN, "B H", "c_{t-1}"),
        _t("w_ih", _IN, "4H", "gain of LN(gx)"),
        _t("b_ih", _IN, "4H", "bias of LN(gx), torch's b_ih added"),
        _t("w_hh", _IN, "4H", "gain of LN(hp)"),
        _t("b_hh", _IN, "4H", "bias of LN(hp), torch's b_hh added"),
        _t("w_c", _IN, "H", "gain of LN(c_t)"),
        _t("b_c", _IN, "H", "bias of LN(c_t)"),
        _t("h_out", _OUT, "B H", "h_t"),
        _t("c_out", _OUT, "B H", "c_t"),
        _t("gates", _OUT, "B 4H", "σ(i), σ(f), tanh(g), σ(o)"),
        _t("tc", _OUT, "B H", "tanh(LN(c_t))"),
        _t("stats", _OUT, f"B {LSTM_CELL_STATS}", "each row's means and 1/std (LSTM_CELL_STATS)"),
        *_CELL_SIZES, _EPS,
    ),
)  # fmt: skip
LSTM_CELL_BWD = Struct(
    "lstm_cell_bwd_args",
    "One LN-LSTM cell call backward on B rows (the forward's kept buffers).",
    (
        _t("dh", _IN, "B H", "gradient of h_t"),
        _t("dc", _IN, "B H", "gradient of the carried c_t"),
        _t("gx", _IN, "B 4H"),
        _t("hp", _IN, "B 4H"),
        _t("c", _IN, "B H"),
        _t("c_out", _IN, "B H"),
        _t("w_ih", _IN, "4H"),
        _t("w_hh", _IN, "4H"),
        _t("w_c", _IN, "H"),
        _t("gates", _IN, "B 4H"),
        _t("tc", _IN, "B H"),
        _t("stats", _IN, f"B {LSTM_CELL_STATS}"),
        _t("dgx", _OUT, "B 4H", "gradient of the raw gx"),
        _t("dhp", _OUT, "B 4H", "gradient of the raw hp"),
        _t("dc_prev", _OUT, "B H", "gradient of c_{t-1}"),
        _t("dparams", _OUT, "4 4H", "gradients of w_ih, b_ih, w_hh, b_hh, summed over the rows"),
        _t("dcparams", _OUT, "2 H", "gradients of w_c, b_c, summed over the rows"),
        *_CELL_SIZES, _EPS,
    ),
)  # fmt: skip
# The input projection over all rows, where it runs before the time loop (or its input gradient
# after it), by the sequence kernels' GEMM: W packed once, as a time loop packs W_ih.
MATMUL = Struct(
    "matmul_args",
    "y = x · Wᵀ (transposed: W as a layer stores it, (N, K)) or y = x · W (W (K, N)).",
    (
        _t("x", _IN, "M K"),
        _t("w", _IN, "R C", "(N, K) with transposed, else (K, N)"),
        _t("y", _OUT, "M N"),
        Field("M", Kind.SIZE, doc="rows"),
        Field("K", Kind.SIZE, doc="inner size"),
        Field("N", Kind.SIZE, doc="output columns"),
        Field("R", Kind.SIZE, doc="rows of w"),
        Field("C", Kind.SIZE, doc="columns of w"),
        Field("gemm_grain", Kind.INDEX, doc="multiply-adds per thread at least", minimum=1),
        Field("threads", Kind.COUNT, doc="OpenMP threads at most"),
        Field("transposed", Kind.FLAG, doc="1: y = x · Wᵀ"),
        Field(
            "half_gemm",
            Kind.FLAG,
            doc="1: x and W hold bfloat16 values (a bfloat16 layer's, "
            "widened): their products by bfloat16 dot products, exact, summed in float, where "
            "the build has them (rnn_half_gemm; else ignored)",
        ),
    ),
)

# The LN-GRU's input side over all rows where autograd records it (training): LN(x W_ihᵀ) with
# the (r, z) block and the n block of each row normalized on their own, one pass each way over
# the (N, G) projection, where torch's layer norm would take each block as a contiguous copy and
# concatenate the results. stats keeps each row's mean (scalar_t, as the step kernels keep it)
# and 1/std of each block.
#: The row statistics a block norm keeps: mean and 1/std of the first block, then the second's.
BLOCK_NORM_STATS = 4
_BLOCK_SIZES = (
    Field("N", Kind.SIZE, doc="rows"),
    Field("G", Kind.SIZE, doc="columns of a row"),
    Field("split", Kind.INDEX, doc="the first block's columns: [0, split), then [split, G)",
          minimum=1),
    Field("threads", Kind.COUNT, doc="OpenMP threads to split the rows over"),
)  # fmt: skip
BLOCK_NORM_FWD = Struct(
    "block_norm_fwd_args",
    "y = LN(x) of each row's two column blocks, each with its own statistics; gain w, bias b.",
    (
        _t("x", _IN, "N G", "the raw projection"),
        _t("w", _IN, "G", "gain (ones where the layer has none)"),
        _t("b", _IN, "G", "bias (zeros where the layer has none)"),
        _t("y", _OUT, "N G", "LN(x) of each block, w ⊙ · + b"),
        _t("stats", _OUT, f"N {BLOCK_NORM_STATS}", "each row's means and 1/std (BLOCK_NORM_STATS)"),
        *_BLOCK_SIZES, _EPS,
    ),
)  # fmt: skip
BLOCK_NORM_BWD = Struct(
    "block_norm_bwd_args",
    "The block norm's backward: x's gradient, and the gain's and bias's summed over the rows.",
    (
        _t("dy", _IN, "N G", "gradient of y"),
        _t("x", _IN, "N G", "the forward's raw projection"),
        _t("w", _IN, "G", "gain"),
        _t("stats", _IN, f"N {BLOCK_NORM_STATS}", "the forward's statistics"),
        _t("dx", _OUT, "N G", "gradient of x"),
        _t("dparams", _OUT, "2 G", "gradients of w and b, summed over the rows"),
        *_BLOCK_SIZES,
    ),
)  # fmt: skip

STRUCTS: tuple[Struct, ...] = (
    LSTM_FWD, LSTM_BWD, GRU_FWD, GRU_BWD, ELMAN_FWD, ELMAN_BWD, SEQ_FWD, SEQ_BWD, WEIGHT_GRAD,
    MATMUL, GRU_CELL_FWD, GRU_CELL_BWD, LSTM_CELL_FWD, LSTM_CELL_BWD, BLOCK_NORM_FWD,
    BLOCK_NORM_BWD,
)  # fmt: skip
KERNELS: tuple[Kernel, ...] = (
    Kernel("lstm_fwd_step", "LN-LSTM step forward.", (LSTM_FWD,)),
    Kernel("lstm_bwd_step", "LN-LSTM step backward.", (LSTM_BWD,)),
    Kernel("gru_fwd_step", "LN-GRU step forward.", (GRU_FWD,)),
    Kernel("gru_bwd_step", "LN-GRU step backward.", (GRU_BWD,)),
    Kernel("lstm_fwd_seq", "LN-LSTM direction forward: GEMM + step per step.", (LSTM_FWD, SEQ_FWD)),
    Kernel("lstm_bwd_seq", "LN-LSTM direction backward, steps in reverse.", (LSTM_BWD, SEQ_BWD)),
    Kernel("gru_fwd_seq", "LN-GRU direction forward: GEMM + step per step.", (GRU_FWD, SEQ_FWD)),
    Kernel("gru_bwd_seq", "LN-GRU direction backward, steps in reverse.", (GRU_BWD, SEQ_BWD)),
    Kernel("elman_fwd_step", "LN-RNN (Elman) step forward.", (ELMAN_FWD,)),
    Kernel("elman_bwd_step", "LN-RNN (Elman) step backward.", (ELMAN_BWD,)),
    Kernel("elman_fwd_seq", "LN-RNN direction forward: GEMM + step per step (gx given).",
           (ELMAN_FWD, SEQ_FWD)),
    Kernel("elman_bwd_seq", "LN-RNN direction backward, steps in reverse.", (ELMAN_BWD, SEQ_BWD)),
    Kernel("weight_grad", "The recurrent weight's gradient.", (WEIGHT_GRAD,)),
    Kernel("matmul", "The input projection (or its input gradient) over all rows.", (MATMUL,)),
    Kernel("gru_cell_fwd", "LN-GRU cell call forward.", (GRU_CELL_FWD,)),
    Kernel("gru_cell_bwd", "LN-GRU cell call backward.", (GRU_CELL_BWD,)),
    Kernel("lstm_cell_fwd", "LN-LSTM cell call forward.", (LSTM_CELL_FWD,)),
    Kernel("lstm_cell_bwd", "LN-LSTM cell call backward.", (LSTM_CELL_BWD,)),
    Kernel("block_norm_fwd", "The LN-GRU's input-side layer norm over all rows, forward.",
           (BLOCK_NORM_FWD,)),
    Kernel("block_norm_bwd", "Its backward.", (BLOCK_NORM_BWD,)),
)  # fmt: skip
BY_NAME: dict[str, Kernel] = {k.name: k for k in KERNELS}


# ------------------------------------------------------------------------------ ctypes side

_STRUCT_TYPES: dict[tuple[str, torch.dtype], type[ctypes.Structure]] = {}


def structure(struct: Struct, dtype: torch.dtype) -> type[ctypes.Structure]:
    """The ctypes mirror of ``<struct>_<suffix>`` (pointer fields are ``void*``)."""
    key = (struct.name, dtype)
    if key not in _STRUCT_TYPES:
        fields = [
            (f.name, ctypes.c_void_p if f.is_pointer else _CTYPES[f.c_type()])
            for f in struct.layout()
        ]
        name = f"{struct.name}_{RNN_INSTANCES[dtype][1]}"
        _STRUCT_TYPES[key] = type(name, (ctypes.Structure,), {"_fields_": fields})
    return _STRUCT_TYPES[key]


# ------------------------------------------------------------------------------ checks

_TERM = re.compile(r"(\d*)([A-Z]?)")


@functools.cache
def _terms(shape: tuple[str, ...]) -> tuple[tuple[int, str], ...]:
    """``shape``'s terms as (coefficient, size symbol or "") pairs, parsed once."""
    out = []
    for term in shape:
        m = _TERM.fullmatch(term)
        if m is None or not term:
            raise ValueError(f"bad shape term {term!r}")
        coef, sym = m.groups()
        out.append((int(coef) if coef else 1, sym))
    return tuple(out)


def size_of(term: str, sizes: Mapping[str, int]) -> int:
    """The value of a shape term: ``"4H"`` is 4·H, ``"N"`` is N, ``"2"`` is 2."""
    ((coef, sym),) = _terms((term,))
    return coef * (sizes[sym] if sym else 1)


def check(
    struct: Struct, dtype: torch.dtype, values: Mapping[str, object], sizes: Mapping[str, int]
) -> None:
    """Check every field of ``struct`` (the ``dtype`` instance) against its description.

    ``values`` holds a tensor for every pointer field (``None`` or absent for an optional one:
    NULL) and a number for every other field except the sizes, which come from ``sizes``.
    Raises ``TypeError`` for a wrong kind or dtype, ``ValueError`` for a wrong shape, device,
    layout or value, each naming the struct, the field, what was expected and what came.
    """
    _checked(struct, dtype, values, sizes, None)


def _checked(
    struct: Struct,
    dtype: torch.dtype,
    values: Mapping[str, object],
    sizes: Mapping[str, int],
    out: ctypes.Structure | None,
) -> None:
    """:func:`check`, storing each checked value into ``out`` when given (one pass: a struct is
    packed once per sequence and direction, so this stays cheap next to a short sequence)."""
    if dtype not in RNN_INSTANCES:
        raise TypeError(f"{_op(struct)}: the kernels take float32 or float64, got {dtype}")
    sized, numbers = _plan(struct)
    for f in sized:
        v = sizes.get(f.symbol or f.name)
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"{_op(struct)}: size {f.name} must be an int >= 0, got {v!r}")
        if out is not None:
            setattr(out, f.name, v)
    for f, shape in _shapes(struct, tuple(sorted(sizes.items()))):
        v = values.get(f.name)
        if v is None and f.optional:
            if out is not None:
                setattr(out, f.name, None)  # NULL: the option is off
            continue
        address = _checked_tensor(struct, dtype, f, shape, v, sizes)
        if out is not None:
            setattr(out, f.name, address)
    for f in numbers:
        v = values.get(f.name)
        _check_number(struct, f, v)
        if out is not None:
            setattr(out, f.name, v)


def _checked_tensor(
    struct: Struct,
    dtype: torch.dtype,
    f: Field,
    shape: tuple[int, ...],
    v: object,
    sizes: Mapping[str, int],
) -> int:
    """The address of tensor field ``f``'s value ``v`` (of ``shape`` under ``sizes``), or the
    error that names what is wrong with it."""
    want = f.tensor_dtype(dtype)
    if (
        not isinstance(v, Tensor)
        or v.dtype != want
        or not v.is_cpu
        or v.shape != shape
        or not v.is_contiguous()
    ):
        _tensor_error(_op(struct), f, v, want, sizes)
    return v.data_ptr()  # type: ignore[union-attr]


@functools.cache
def _plan(struct: Struct) -> tuple[tuple[Field, ...], tuple[Field, ...]]:
    """``struct``'s size fields and its other number fields."""
    sized = tuple(f for f in struct.fields if f.kind is Kind.SIZE)
    numbers = tuple(f for f in struct.fields if f.kind not in _POINTERS and f not in sized)
    return sized, numbers


@functools.lru_cache(maxsize=256)
def _shapes(
    struct: Struct, sizes: tuple[tuple[str, int], ...]
) -> tuple[tuple[Field, tuple[int, ...]], ...]:
    """Each pointer field of ``struct`` with the shape it must have under ``sizes``."""
    bound = dict(sizes)
    missing = {s for f in struct.fields for _, s in _terms(f.shape) if s and s not in bound}
    if missing:
        raise ValueError(f"{_op(struct)}: sizes {sorted(missing)} not given (got {sorted(bound)})")
    return tuple(
        (f, tuple(c * (bound[s] if s else 1) for c, s in _terms(f.shape)))
        for f in struct.fields
        if f.kind in _POINTERS
    )


def _op(struct: Struct) -> str:
    return f"layernorm recurrent CPU kernel ({struct.name})"


def _tensor_error(
    op: str, f: Field, v: object, dtype: torch.dtype, sizes: Mapping[str, int]
) -> None:
    """Raise the error that names what is wrong with tensor field ``f`` (``v`` failed a check)."""
    if not isinstance(v, Tensor):
        raise TypeError(f"{op}: {f.name} must be a torch.Tensor, got {type(v).__name__}")
    if v.dtype != dtype:
        raise TypeError(f"{op}: {f.name} must have dtype {dtype}, got {v.dtype}")
    if not v.is_cpu:
        raise ValueError(f"{op}: {f.name} must be on the CPU, got {v.device}")
    shape = tuple(size_of(t, sizes) for t in f.shape)
    if v.shape != shape:
        rule = ", ".join(f.shape)
        raise ValueError(f"{op}: {f.name} must have shape ({rule}) = {shape}, "
                         f"got {tuple(v.shape)}")  # fmt: skip
    raise ValueError(f"{op}: {f.name} must be contiguous, got strides {v.stride()}")


def _check_number(struct: Struct, f: Field, v: object) -> None:
    if f.kind is Kind.FLOAT:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise TypeError(f"{_op(struct)}: {f.name} must be a float, got {type(v).__name__}")
        ok, rule = -math.inf < v < math.inf and v >= f.minimum, f"finite and >= {f.minimum}"
    else:
        if not isinstance(v, int):  # bool is an int: flags take True/False
            raise TypeError(f"{_op(struct)}: {f.name} must be an int, got {type(v).__name__}")
        if f.kind is Kind.FLAG:
            ok, rule = v in (0, 1), "0 or 1"
        elif f.kind is Kind.COUNT:
            ok, rule = v >= 1, ">= 1"
        else:
            ok, rule = v >= f.minimum, f">= {f.minimum:g}"
    if not ok:
        raise ValueError(f"{_op(struct)}: {f.name} must be {rule}, got {v!r}")


def pack(
    struct: Struct, dtype: torch.dtype, values: Mapping[str, object], sizes: Mapping[str, int]
) -> ctypes.Structure:
    """The argument struct of ``values``, each field checked as :func:`check` does.

    Well-formed arguments take :func:`_fast_fields` (a plan per struct, dtype and sizes, built
    once); anything it refuses goes through :func:`_checked`, which raises the error naming what
    is wrong (or packs what the fast test was too strict for)."""
    packer = _fast_packer(struct, dtype, sizes)
    if packer is not None:
        fields = _fast_fields(packer[1], values, [None] * len(packer[1]))
        if fields is not None:
            return packer[0](*fields)
    out = structure(struct, dtype)()
    _checked(struct, dtype, values, sizes, out)
    return out


# (struct, dtype, *sizes.items()) -> the struct's class and fast plan (None: the slow path packs):
# one lookup per call where a cached function of sorted sizes took several
_Packer = tuple[type[ctypes.Structure], tuple[tuple[Any, ...], ...]]
_PACKERS: dict[tuple[Any, ...], _Packer | None] = {}
_PACKERS_MAX = 1024


def _fast_packer(struct: Struct, dtype: torch.dtype, sizes: Mapping[str, int]) -> _Packer | None:
    """``struct``'s class and :func:`_fast_plan` for ``dtype`` and ``sizes``, or ``None`` where
    the fast path does not apply (a dtype without kernels, a size that is not a plain int >= 0,
    a missing size). Keyed by the sizes in the caller's order and each size's type: 2.0 equals
    2 as a key, and must still meet the checks."""
    key = (struct, dtype, *sizes.items(), *map(type, sizes.values()))
    try:
        return _PACKERS[key]
    except KeyError:
        pass
    plan = None
    if dtype in RNN_INSTANCES:
        plan = _fast_plan(struct, dtype, _sizes_key(sizes))
    packer = None if plan is None else (structure(struct, dtype), plan)
    if len(_PACKERS) >= _PACKERS_MAX:
        _PACKERS.clear()
    _PACKERS[key] = packer
    return packer


def _sizes_key(sizes: Mapping[str, int]) -> tuple[tuple[str, object], ...] | None:
    """``sizes`` as a cache key, or ``None`` where one is not a plain int >= 0 (the slow path
    then names it)."""
    items = tuple(sorted(sizes.items()))
    for _, v in items:
        if type(v) is not int or v < 0:
            return None
    return items


# A fast plan's entry kinds: a tensor, a size bound in the plan, a float, a flag, an integer
# with a minimum (counts: 1, indices: their field's).
_P_TENSOR, _P_SIZE, _P_FLOAT, _P_FLAG, _P_INT = range(5)


@functools.lru_cache(maxsize=256)
def _fast_plan(
    struct: Struct, dtype: torch.dtype, sizes: tuple[tuple[str, object], ...] | None
) -> tuple[tuple[Any, ...], ...] | None:
    """``struct``'s fields in layout order as ``(index, kind, name, a, b, c)`` entries that
    :func:`_fast_fields` checks in a few attribute reads each: a tensor's dtype, shape and
    whether it may be ``None``; a size's bound value; a number's minimum. ``None`` where a size
    is missing (the slow path names it)."""
    if sizes is None:
        return None
    bound = dict(sizes)
    try:
        shapes = dict(_shapes(struct, sizes))
    except ValueError:
        return None
    plan: list[tuple[Any, ...]] = []
    for i, f in enumerate(struct.layout()):
        if f.kind is Kind.SIZE:
            v = bound.get(f.symbol or f.name)
            if v is None:
                return None
            plan.append((i, _P_SIZE, f.name, v, None, None))
        elif f.is_pointer:
            want = f.tensor_dtype(dtype)
            plan.append((i, _P_TENSOR, f.name, want, torch.Size(shapes[f]), f.optional))
        elif f.kind is Kind.FLOAT:
            plan.append((i, _P_FLOAT, f.name, f.minimum, None, None))
        elif f.kind is Kind.FLAG:
            plan.append((i, _P_FLAG, f.name, None, None, None))
        else:
            plan.append((i, _P_INT, f.name, 1 if f.kind is Kind.COUNT else f.minimum, None, None))
    return tuple(plan)


def _fast_fields(
    plan: tuple[tuple[Any, ...], ...], values: Mapping[str, object], fields: list[object]
) -> list[object] | None:
    """``fields`` (the struct's values in layout order) with ``plan``'s entries stored at their
    indices, or ``None`` at the first one that breaks its rule (the same rules as
    :func:`_checked`, stated as tests that pass for good arguments)."""
    get = values.get
    try:
        for i, kind, name, a, b, c in plan:
            if kind == _P_TENSOR:
                v = get(name)
                if v is None:
                    if not c:
                        return None
                    fields[i] = None
                elif (
                    isinstance(v, Tensor)
                    and v.dtype is a
                    and v.is_cpu
                    and v.shape == b
                    and v.is_contiguous()
                ):
                    fields[i] = v.data_ptr()
                else:
                    return None
            elif kind == _P_SIZE:
                fields[i] = a
            else:
                v = get(name)
                if kind == _P_FLOAT:
                    if type(v) is not float and type(v) is not int:
                        return None
                    if not (a <= v < math.inf):  # NaN fails
                        return None
                elif type(v) is not int and type(v) is not bool:
                    return None
                elif kind == _P_FLAG:
                    if v not in (0, 1):
                        return None
                elif v < a:
                    return None
                fields[i] = v
    except (AttributeError, TypeError):
        return None
    return fields


class Region(NamedTuple):
    """Fields of a struct that point at blocks of one buffer: the buffer's element count and
    each field's ``(offset, shape)`` in it, in elements (row-major blocks)."""

    numel: int
    blocks: Mapping[str, tuple[int, tuple[int, ...]]]


class BoundStruct:
    """An argument struct of one call signature whose fixed part is checked once.

    A call of a kept plan (the LN-LSTM's training call, ``layernorm.recurrent._planned``) packs
    the same struct on every call with most fields unchanged: the sizes, the numbers, the
    tensors the plan holds (``fixed``), and buffers at fixed offsets of one buffer it allocates
    (``regions``: the buffer under the region's name in the call's values, each block checked
    against its field's shape here). :meth:`pack` then checks the region buffers (dtype, device,
    layout, element count) and the call's other fields as :func:`pack` does, and never makes a
    view of a block: the block's address is the buffer's plus its offset.

    Raises ``ValueError`` / ``TypeError`` as :func:`check` for a fixed value or a size that
    breaks its rule, ``ValueError`` for a block outside its buffer or of the wrong shape."""

    def __init__(
        self,
        struct: Struct,
        dtype: torch.dtype,
        sizes: Mapping[str, int],
        fixed: Mapping[str, object],
        regions: Mapping[str, Region] | None = None,
    ) -> None:
        regions = dict(regions or {})
        op = _op(struct)
        if dtype not in RNN_INSTANCES:
            raise TypeError(f"{op}: the kernels take float32 or float64, got {dtype}")
        key = _sizes_key(sizes)
        plan = _fast_plan(struct, dtype, key)
        if plan is None or key is None:  # a size missing or not an int >= 0: the slow path names it
            _checked(struct, dtype, fixed, sizes, None)
            raise ValueError(f"{op}: sizes {dict(sizes)} do not bind every field")
        names = {f.name for f in struct.fields}
        placed: dict[str, tuple[str, int]] = {}  # field -> (region, offset in bytes)
        shapes = {f.name: shape for f, shape in _shapes(struct, key)}
        for region_name, region in regions.items():
            for name, (offset, shape) in region.blocks.items():
                if name not in shapes or struct.field(name).tensor_dtype(dtype) is not dtype:
                    raise ValueError(f"{op}: {name} is not a tensor field of {dtype}")
                numel = math.prod(shape)
                if tuple(shape) != shapes[name] or offset < 0 or offset + numel > region.numel:
                    raise ValueError(
                        f"{op}: {name} must have shape {shapes[name]} inside {region_name}'s "
                        f"{region.numel} elements, got shape {tuple(shape)} at offset {offset}"
                    )
                placed[name] = (region_name, offset * dtype.itemsize)
        unknown = set(fixed) - names
        if unknown:
            raise ValueError(f"{op}: no fields {sorted(unknown)}")
        fields: list[object] = [None] * len(plan)
        calls: list[tuple[Any, ...]] = []
        blocks: dict[str, list[tuple[int, int]]] = {name: [] for name in regions}
        for entry in plan:
            i, kind, name = entry[:3]
            if name in placed:
                region_name, offset = placed[name]
                blocks[region_name].append((i, offset))
            elif name in fixed or kind == _P_SIZE:
                if _fast_fields((entry,), fixed, fields) is None:
                    fields[i] = _checked_field(struct, dtype, name, fixed.get(name), sizes)
            else:
                calls.append(entry)
        self.struct, self.dtype, self.sizes = struct, dtype, dict(sizes)
        self._fixed, self._region_defs = dict(fixed), regions
        self._template, self._calls = fields, tuple(calls)
        self._cls = structure(struct, dtype)
        # (region, its element count, (field index, byte offset) of each block)
        self._bases = tuple(
            (name, region.numel, tuple(blocks[name])) for name, region in regions.items()
        )

    def pack(self, values: Mapping[str, object]) -> ctypes.Structure:
        """The struct of one call: ``values`` holds each region's buffer under its name and the
        fields that are neither fixed nor in a region."""
        fields = self._template.copy()
        for name, numel, blocks in self._bases:
            base = values.get(name)
            if not (
                type(base) is Tensor
                and base.dtype is self.dtype
                and base.is_cpu
                and base.numel() == numel
                and base.is_contiguous()
            ):
                self._refuse_base(name, base, numel)
            address = base.data_ptr()  # type: ignore[union-attr]
            for i, offset in blocks:
                fields[i] = address + offset
        if _fast_fields(self._calls, values, fields) is None:
            return self._slow(values)
        return self._cls(*fields)

    def template(self) -> tuple[bytes, tuple[tuple[str, int, int, bool], ...]]:
        """The struct with its fixed fields packed, as bytes, and the fields a call fills, each
        ``(name, byte offset, add, required)``: a pointer to the tensor of that name (a region's
        blocks: to the region's buffer plus ``add`` bytes; ``required``: not ``None``), or with
        ``add == -1`` a 4-byte count (``threads``). What a C++ caller needs to pack the struct
        as :meth:`pack` does (``csrc_torch/rnn_ops.cpp``). Raises ``ValueError`` for a call
        field of another kind (a float, an 8-byte number), which that caller cannot fill."""
        cls, slots = self._cls, []
        for name, _, blocks in self._bases:
            for i, offset in blocks:
                field = cls._fields_[i][0]
                slots.append((name, getattr(cls, field).offset, offset, True))
        for i, kind, name, _, _, optional in self._calls:
            offset, ctype = getattr(cls, name).offset, cls._fields_[i][1]
            if kind == _P_TENSOR:
                slots.append((name, offset, 0, not optional))
            elif kind == _P_INT and ctype is ctypes.c_int32:
                slots.append((name, offset, -1, True))
            else:
                raise ValueError(f"{_op(self.struct)}: {name} is not a field a C++ call fills")
        fields = [
            0 if v is None and ctype is not ctypes.c_void_p else v
            for v, (_, ctype) in zip(self._template, cls._fields_, strict=True)
        ]
        packed = cls(*fields)
        return ctypes.string_at(ctypes.addressof(packed), ctypes.sizeof(packed)), tuple(slots)

    def _refuse_base(self, name: str, base: object, numel: int) -> None:
        op = _op(self.struct)
        if not isinstance(base, Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(base).__name__}")
        if base.dtype != self.dtype:
            raise TypeError(f"{op}: {name} must have dtype {self.dtype}, got {base.dtype}")
        if not base.is_cpu:
            raise ValueError(f"{op}: {name} must be on the CPU, got {base.device}")
        if base.numel() != numel or not base.is_contiguous():
            raise ValueError(
                f"{op}: {name} must be a contiguous buffer of {numel} elements, got shape "
                f"{tuple(base.shape)} with strides {base.stride()}"
            )

    def _slow(self, values: Mapping[str, object]) -> ctypes.Structure:
        """The call's struct by :func:`_checked` (which names what is wrong, or packs what the
        fast test was too strict for), the region blocks as views of their buffers."""
        full: dict[str, object] = {**self._fixed, **values}
        for name, region in self._region_defs.items():
            base = full.pop(name)
            assert isinstance(base, Tensor)  # checked in pack
            for field, (offset, shape) in region.blocks.items():
                strides = tuple(math.prod(shape[k + 1 :]) for k in range(len(shape)))
                full[field] = base.as_strided(shape, strides, base.storage_offset() + offset)
        out = self._cls()
        _checked(self.struct, self.dtype, full, self.sizes, out)
        return out


def _checked_field(
    struct: Struct, dtype: torch.dtype, name: str, v: object, sizes: Mapping[str, int]
) -> object:
    """Field ``name``'s value ``v`` as the struct stores it, checked as :func:`_checked` does
    (the fast test refused it: this raises the error that names why, or stores what the fast
    test was too strict for)."""
    f = struct.field(name)
    if f.is_pointer:
        shape = dict(_shapes(struct, tuple(sorted(sizes.items()))))[f]
        return _checked_tensor(struct, dtype, f, shape, v, sizes)
    _check_number(struct, f, v)
    out = structure(struct, dtype)()
    setattr(out, name, v)  # as the struct stores it (a bool flag as 0 / 1, say)
    return getattr(out, name)


# ------------------------------------------------------------------------------ C side


def _describe(f: Field) -> str:
    shape = f" ({', '.join(f.shape)})" if f.shape else ""
    shape += ", optional: NULL = off" if f.optional else ""
    bound = f", >= {f.minimum:g}" if f.kind in (Kind.INDEX, Kind.FLOAT) else ""
    return f"{f.kind.value}{shape}{bound}" + (f": {f.doc}" if f.doc else "")


def c_header() -> str:
    """The C header of the recurrent kernels: argument structs, prototypes and layout assertions
    whose offsets come from the ctypes structures (so C and Python agree on every field)."""
    lines = [
        "/* Generated by `python -m layernorm.kernels.cpu.rnn_abi` from",
        "   layernorm/kernels/cpu/rnn_abi.py: edit that file, not this one (a test checks the two",
        "   agree). */",
        "#ifndef LAYERNORM_RNN_ABI_H",
        "#define LAYERNORM_RNN_ABI_H",
        "",
        "#include <stddef.h>",
        "#include <stdint.h>",
        "",
        "/* Returned by a kernel whose step rows lie outside its buffers (nothing is touched). */",
        f"#define RNN_ERR_ROWS {ERR_ROWS}",
        "/* Returned by a kernel that cannot allocate its buffers (nothing is touched). */",
        f"#define RNN_ERR_NOMEM {ERR_NOMEM}",
        "/* Returned by a sequence kernel whose input projection is inconsistent (nothing is",
        "   touched): x without w_ih or the reverse, split outside (0, G], gx not of B rows. */",
        f"#define RNN_ERR_PROJECTION {ERR_PROJECTION}",
        "",
        "/* Returned by an LSTM kernel whose input-side layer norm is half given (nothing is",
        "   touched): w0 without b0, mx, rx (forward) or gx, mx, rx (backward), or without",
        "   layer_norm. */",
        f"#define RNN_ERR_INPUT_NORM {ERR_INPUT_NORM}",
        "",
        "/* Bytes per vector of the sequence GEMM: 64 with AVX-512, 32 with AVX, else 16. */",
        "int rnn_vector_bytes(void);",
        "/* Rows (all steps) up to which a forward sequence kernel reads its weights as stored. */",
        "int rnn_direct_rows(void);",
        "/* The sequence kernels' float GEMMs by MKL's packed GEMM where the caller runs each on",
        "   one thread (cblas_sgemm_pack_get_size, cblas_sgemm_pack, cblas_sgemm_compute of the",
        "   running PyTorch; rnn.py decides), by the library's own tile where all three are NULL.",
        "   0, or -1 (nothing set) unless all three or none are given. Set before the kernels run,",
        "   not while they do. */",
        "int rnn_set_packed_gemm(void* pack_size, void* pack, void* compute);",
        "/* The float forward kernels' GEMMs of a one-step call of more than rnn_direct_rows()",
        "   rows by MKL's sgemm (the running PyTorch's Fortran-interface sgemm_, LP64), reading",
        "   the weights as stored, where not NULL; packed where NULL (or where the products are",
        "   rounded to bfloat16). 0. Set before the kernels run, not while they do. */",
        "int rnn_set_one_step_sgemm(void* sgemm);",
        "/* The float forward kernels' GEMMs of a call given bfloat16 weights (w_half, w_ih_half)",
        "   by MKL's gemm_bf16bf16f32 (the running PyTorch's Fortran-interface",
        "   gemm_bf16bf16f32_, LP64) where not NULL; the weights widened to float where NULL.",
        "   0. Set before the kernels run, not while they do. */",
        "int rnn_set_one_step_half_gemm(void* gemm);",
        "/* 1 where the float sequence kernels honour half_gemm (AVX512-BF16 dot products), else",
        "   0: a sequence struct's half_gemm is then ignored. */",
        "int rnn_half_gemm(void);",
        "/* The LN-LSTM forward step's rows a group (1 to RNN_FORWARD_GROUP_MAX,",
        "   RNN_FORWARD_GROUP_DEFAULT unless set): rows whose statistics run together, the same",
        "   results at any size. 0, or -1 (nothing set) outside that range. Set before the",
        "   kernels run, not while they do. */",
        f"#define RNN_FORWARD_GROUP_DEFAULT {FORWARD_GROUP_DEFAULT}",
        f"#define RNN_FORWARD_GROUP_MAX {FORWARD_GROUP_MAX}",
        "int rnn_set_forward_group(int rows);",
        "/* The most bytes of packed weights (those a call's step GEMMs read) for which a",
        "   sequence call's team of threads splits the batch's rows among them, each carrying",
        "   its rows through every step, instead of sharing each step: the same outputs either",
        "   way, the layer norms' parameter gradients summed by other threads' rows",
        "   (RNN_BATCH_SPLIT_BYTES_DEFAULT unless set). 0, or -1 (nothing set) for a negative",
        "   count. Set before the kernels run, not while they do. */",
        f"#define RNN_BATCH_SPLIT_BYTES_DEFAULT {BATCH_SPLIT_BYTES_DEFAULT}LL",
        "int rnn_set_batch_split_bytes(int64_t bytes);",
        "/* The row statistics a GRU cell call keeps (gru_cell_fwd_args.stats). */",
        f"#define RNN_GRU_CELL_STATS {GRU_CELL_STATS}",
        "/* The row statistics an LSTM cell call keeps (lstm_cell_fwd_args.stats). */",
        f"#define RNN_LSTM_CELL_STATS {LSTM_CELL_STATS}",
        "/* The row statistics a block norm keeps (block_norm_fwd_args.stats). */",
        f"#define RNN_BLOCK_NORM_STATS {BLOCK_NORM_STATS}",
        "",
    ]
    for dtype, (scalar, suffix) in RNN_INSTANCES.items():
        for struct in STRUCTS:
            tname = f"{struct.name}_{suffix}"
            lines.append(f"/* {struct.doc} */")
            lines.append("typedef struct {")
            for f in struct.layout():
                lines.append(f"    {f.c_type(scalar)} {f.name}; /* {_describe(f)} */")
            lines.append(f"}} {tname};")
            ct = structure(struct, dtype)
            for f in struct.layout():
                off = getattr(ct, f.name).offset
                lines.append(f'_Static_assert(offsetof({tname}, {f.name}) == {off}, '
                             f'"{tname}.{f.name}");')  # fmt: skip
            lines.append(f'_Static_assert(sizeof({tname}) == {ctypes.sizeof(ct)}, '
                         f'"{tname} size");')  # fmt: skip
            lines.append("")
        for kernel in KERNELS:
            params = ", ".join(f"const {s.name}_{suffix}* {'as'[i]}"
                               for i, s in enumerate(kernel.structs))  # fmt: skip
            lines.append(f"/* {kernel.doc} */")
            lines.append(f"int {kernel.name}_{suffix}({params});")
        lines.append("")
    lines.append("#endif")
    return "\n".join(lines) + "\n"


def header_path() -> Path:
    return CSRC_DIR / HEADER_NAME


if __name__ == "__main__":
    header_path().write_text(c_header())
    print(f"wrote {header_path()}")
