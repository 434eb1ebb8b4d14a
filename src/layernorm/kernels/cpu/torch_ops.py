"""The norm kernels as PyTorch operators with C++ autograd nodes (``csrc_torch/norm_ops.cpp``):
``torch.ops.layernorm_cpu.layer_norm``, ``.rms_norm`` and ``.ada_norm`` on the rows of a contiguous
tensor (its last dimension), for the calls whose time is the Python around the kernels. The same
library holds the LN-LSTM's planned training call (``csrc_torch/rnn_ops.cpp``,
``layernorm_cpu::lstm_planned`` with its plan class ``layernorm_cpu.LstmPlan``: see
:mod:`layernorm.recurrent._planned`, which builds the plans; :func:`recurrent_nodes`) and the
cells' training step (``layernorm_cpu::lstm_cell_step`` and ``::gru_cell_step`` with their plan
class ``layernorm_cpu.CellPlan``, ``::elman_cell_step``: see :mod:`layernorm.recurrent._cellstep`).

A layer norm's forward and backward at (1, 768) took 64 µs through the autograd.Function of
:mod:`layernorm.ops` where torch's native layer norm, a C++ node, takes 24; the kernels themselves
take a few. These operators check their arguments, allocate the outputs, fill the kernels' argument
structs and call the kernels of the selected instruction-set target (:mod:`.targets`) from C++, so
the results are the kernels' bits. The ops take them (:func:`takes`) for a CPU input of fewer than
:data:`TRAINING_MAX_BYTES` where a backward follows, and below the buffer cache's output size
(:data:`.buffers.OUTPUT_MIN_BYTES`, 32 MiB) where none does (a forward alone frees its output
itself, which malloc's heap keeps); the larger ones keep the Python path, whose outputs reuse the
buffer cache's memory.

The library is compiled against this process's PyTorch by the C++ compiler on first use (about
40 s; :func:`.cbuild.build_torch_library`, cached with the C kernels: ``make install`` builds it),
kept only once an error raised in it has reached Python in a child process (a build whose
exceptions kill the process is thrown away and the next compiler on ``PATH`` tried), and loaded
with the cache's checks (:mod:`.cache`). Where it cannot be built or loaded, a warning says why,
once, and the ops keep their Python path. ``LAYERNORM_CPU_TORCH_OPS=0`` keeps the ops
on their Python path (read once, at import; :func:`switched` changes it in-process), as does
``LAYERNORM_CPU_COMPILE=0`` (read on every call), which leaves no C kernel to call.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import _native, abi, buffers, cache, cbuild, rnn_abi, targets
from ._env import compile_switched_off

ENV_SWITCH = "LAYERNORM_CPU_TORCH_OPS"
SOURCES = tuple(
    Path(__file__).resolve().parent / "csrc_torch" / name
    for name in ("norm_ops.cpp", "rnn_ops.cpp")
)
#: The kernels the operators call, by the names of abi.py (cvt is the tests' alone).
KERNELS = ("ln_fwd", "ln_bwd", "rms_fwd", "rms_bwd", "ada_fwd", "ada_bwd")

#: Below this many bytes of ``x`` a call that a backward follows runs the C++ node, whose outputs
#: come from malloc, from there the Python path with outputs from the buffer cache. Forward and
#: backward of float32 and bfloat16 layer norm, the node against the Python path, alternated
#: (``benchmarks/ab_norm_node.py``), AMD EPYC Zen 5, one and two threads: 0.52-0.61 of its time
#: at (64, 1024), 0.57-0.75 at (128 | 256, 1024), 0.77-0.96 at (512, 1024) (2 MiB float32); from
#: 4 to 16 MiB 0.79-0.93 where three calls alternated, but among `make bench`'s dozen the node's
#: 16 MiB bfloat16 outputs took fresh pages on some rounds (1.42 of torch's time by the median,
#: where the Python path took 0.68): malloc hands the top of its heap back once that much is free
#: at once.
TRAINING_MAX_BYTES = 2 << 20

# "loaded": bool once tried; "target": the kernels' target; "config": (grain, streaming bytes)
_state: dict[str, object] = {}
#: LAYERNORM_CPU_TORCH_OPS, read once at import (an environment read costs half a microsecond, a
#: tenth of a small call's Python); :func:`switched` changes it in-process.
_switch = {"on": os.environ.get(ENV_SWITCH, "1") != "0"}
# the operators' overloads' callables, once loaded (an attribute chain of torch.ops costs a
# call's µs)
_ops: dict[str, Callable[..., Tensor]] = {}
_OPERATORS = ("layer_norm", "rms_norm", "ada_norm", "lstm_planned", "lstm_cell_step",
              "gru_cell_step", "elman_cell_step")  # fmt: skip


#: A call that makes the library raise an error: a fresh build must return it to Python as a
#: ``RuntimeError`` in a child process before it is cached (:func:`.cbuild.errors_reach_python`).
ERROR_PROBE = "torch.ops.layernorm_cpu.configure(0, 0)"


def build() -> Path:
    """Compile the operators' library (or find it cached); return its path."""
    return cbuild.build_torch_library(
        SOURCES, "layernorm_torch_ops", (abi.CSRC_DIR,), error_probe=ERROR_PROBE
    )


def _load() -> bool:
    """Build and load the library once; False after a warning when it cannot be."""
    loaded = _state.get("loaded")
    if loaded is None:
        try:
            cache.load_library(build)
            namespace = torch.ops.layernorm_cpu
            for name in _OPERATORS:
                # the overload's C++ callable: OpOverload.__call__ is a Python frame around it
                overload = getattr(namespace, name).default
                _ops[name] = getattr(overload, "_op", overload)
            loaded = True
        except Exception as err:  # the Python path is always there
            warnings.warn(
                f"layernorm: C++ operators unavailable, the ops keep their Python path ({err})",
                RuntimeWarning,
                stacklevel=4,
            )
            loaded = False
        _state["loaded"] = loaded
    return bool(loaded)


def _set_kernels(target: targets.Target) -> bool:
    """Hand the operators the kernels of ``target``'s library (built on first use)."""
    table = _native._library_for(target.name)
    if table is None:
        return False
    for (name, dtype), fn in table.items():
        if name in KERNELS:
            address = ctypes.cast(fn, ctypes.c_void_p).value
            torch.ops.layernorm_cpu.set_kernel(f"{name}_{abi.INSTANCES[dtype].suffix}", address)
    _state["target"] = target
    return True


def enabled() -> bool:
    """Whether the operators are switched on, built and loaded, with the selected target's
    kernels and the Python path's thread grain and ``STREAM_MIN_BYTES`` (handed over again where
    :func:`.targets.use` switched the target or a threshold changed)."""
    if not _switch["on"] or compile_switched_off():
        return False
    target = targets.selected()
    config = (_native._GRAIN, _native.STREAM_MIN_BYTES)  # the Python path's, which tests change
    if _state.get("target") is target and _state.get("config") == config:
        return True  # handed over before: built and loaded (what _native.enabled asks first)
    if not _native.enabled() or not _load():
        return False
    if _state.get("config") != config:
        torch.ops.layernorm_cpu.configure(*config)
        _state["config"] = config
    return _state.get("target") is target or _set_kernels(target)


def takes(x: Tensor, grad: bool, *params: Tensor | None) -> bool:
    """Whether the operators run this call on ``x``'s last dimension: ``x`` (of at least one
    dimension, the caller has checked its shape) and the ``params`` as the kernels take them
    (:func:`._native.kernel_inputs`), ``x`` below :data:`TRAINING_MAX_BYTES` where a backward
    follows (``grad``), below the buffer cache's output size (:data:`.buffers.OUTPUT_MIN_BYTES`)
    otherwise, the operators loaded. A few attribute reads where they are."""
    limit = TRAINING_MAX_BYTES if grad else buffers.OUTPUT_MIN_BYTES
    return x.nbytes < limit and _native.kernel_inputs(x, *params) and enabled()


def recurrent_nodes() -> bool:
    """Whether the recurrent layers' C++ nodes (``csrc_torch/rnn_ops.cpp``) can run: the
    operators switched on, compiled code not switched off (``LAYERNORM_CPU_COMPILE=0``), the
    library built and loaded (the C kernels a plan's node calls are the caller's to have: it
    hands their addresses over in the plan)."""
    return _switch["on"] and not compile_switched_off() and _load()


def templates(
    bound: Sequence[rnn_abi.BoundStruct | None],
) -> tuple[list[Tensor], list[str], list[int]]:
    """The argument structs of a C++ node's plan as it takes them: each struct's bytes with its
    fixed fields packed (an empty tensor for ``None``: a struct the plan does not use), and the
    fields a call fills, their names and for each ``(struct index, byte offset, add, required)``
    (:meth:`.rnn_abi.BoundStruct.template`)."""
    structs, names, where = [], [], []
    for index, struct in enumerate(bound):
        if struct is None:
            structs.append(torch.empty(0, dtype=torch.uint8))
            continue
        packed, slots = struct.template()
        structs.append(torch.frombuffer(bytearray(packed), dtype=torch.uint8))
        for name, offset, add, required in slots:
            names.append(name)
            where += [index, offset, add, int(required)]
    return structs, names, where


def lstm_plan(
    structs: list[Tensor],
    names: list[str],
    where: list[int],
    kernels: list[int],
    config: dict[str, int],
    defaults: list[Tensor],
    refusals: dict[str, str],
) -> Any:
    """A ``layernorm_cpu.LstmPlan`` (``csrc_torch/rnn_ops.cpp``): the LN-LSTM training call's
    argument structs, fields, kernels, settings (by name), default gains and the messages its
    backward refuses with (see :mod:`layernorm.recurrent._planned`, which builds them)."""
    return torch.classes.layernorm_cpu.LstmPlan(
        structs, names, where, kernels, config, defaults, refusals
    )


def lstm_planned(*args: Any) -> tuple[Tensor, Tensor, Tensor]:
    """The LN-LSTM's planned training call by the C++ operator, where :func:`recurrent_nodes`
    said yes: ``(x, h0, c0, w_hh, w1, b1, w3, b3, w0, b0, w_ih, b_ih, b_hh, plan)``."""
    return _ops["lstm_planned"](*args)  # type: ignore[return-value]


def cell_plan(
    cell: str,
    bound: tuple[rnn_abi.BoundStruct, rnn_abi.BoundStruct],
    kernels: list[int],
    sizes: list[int],
    eps: float,
    dtype: torch.dtype,
) -> Any:
    """A ``layernorm_cpu.CellPlan`` (``csrc_torch/rnn_ops.cpp``): a cell's (``"lstm"`` or
    ``"gru"``) training step of one signature, its forward's and backward's structs and kernel
    addresses, ``sizes`` = ``[rows, inputs, hidden, gates, statistics a row]`` and ``eps``.
    Raises ``RuntimeError`` where the operators are switched off or not loaded
    (:func:`recurrent_nodes`)."""
    if not recurrent_nodes():
        raise RuntimeError("layernorm: the C++ operators are switched off or not loaded")
    structs, names, where = templates(bound)
    return torch.classes.layernorm_cpu.CellPlan(
        cell, structs, names, where, kernels, sizes, eps, torch.empty(0, dtype=dtype)
    )


def lstm_cell_step(*args: Any) -> tuple[Tensor, Tensor]:
    """An LN-LSTM cell's training step by the C++ operator, where :func:`recurrent_nodes` said
    yes: ``(x, h, c, w_ih, w_hh, b_ih, b_hh, lw_ih, lb_ih, lw_hh, lb_hh, lw_c, lb_c, plan)``."""
    return _ops["lstm_cell_step"](*args)  # type: ignore[return-value]


def gru_cell_step(*args: Any) -> Tensor:
    """An LN-GRU cell's training step by the C++ operator, where :func:`recurrent_nodes` said
    yes: ``(x, h, w_ih, w_hh, b_ih, b_hh, lw_ih, lb_ih, lw_hh, lb_hh, plan)``."""
    return _ops["gru_cell_step"](*args)


def elman_cell_step(*args: Any) -> Tensor:
    """An LN-RNN (Elman) cell's training step by the C++ operator (torch's ops of the step in one
    node), where :func:`recurrent_nodes` said yes: ``(x, h, w_ih, w_hh, b_ih, b_hh, lw, lb, eps,
    relu)``."""
    return _ops["elman_cell_step"](*args)


@contextlib.contextmanager
def switched(on: bool) -> Iterator[None]:
    """The operators switched on or off inside the ``with`` block (``LAYERNORM_CPU_TORCH_OPS``
    is read once, at import). Not thread-safe: other threads see the switch too."""
    before = _switch["on"]
    _switch["on"] = bool(on)
    try:
        yield
    finally:
        _switch["on"] = before


def layer_norm(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    detach_mean: bool = False,
    detach_std: bool = False,
) -> Tensor:
    """Layer norm (DetachNorm with the flags) of the rows of ``x`` by the C++ operator, where
    :func:`takes` said yes."""
    return _ops["layer_norm"](x, weight, bias, eps, detach_mean, detach_std)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm of the rows of ``x`` by the C++ operator, where :func:`takes` said yes."""
    return _ops["rms_norm"](x, weight, eps)


def ada_norm(x: Tensor, k: float, scale: float, eps: float) -> Tensor:
    """AdaNorm of the rows of ``x`` by the C++ operator, where :func:`takes` said yes."""
    return _ops["ada_norm"](x, k, scale, eps)


if __name__ == "__main__":  # `python -m layernorm.kernels.cpu.torch_ops`: build it now (install)
    try:
        print(f"layernorm: C++ operators built: {build()}")
    except RuntimeError as err:  # optional: the ops keep their Python path
        print(f"layernorm: C++ operators not built, the ops keep their Python path ({err})")
