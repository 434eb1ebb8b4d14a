"""Which of the recurrent layers' C paths the selected target runs, as skip markers, stated once;
a record of which sequence kernels a call ran with torch.nn.LSTM's projection; a counter of
the calls a C library makes through an entry point it was given; and a call's outcome (result or
error), to hold a fast path's to the full path's.

The portable target (other architectures, or a compiler without the x86 targets' flags) has the
C step kernels but no whole-sequence kernels: there the layers run their steps one by one and
keep no plans, so a test of a sequence kernel, a plan or a planned node skips."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from layernorm.kernels.cpu import rnn
from layernorm.recurrent import _cstep

#: The C kernels built and the selected target's whole-sequence kernels with them.
HAS_SEQUENCE_KERNELS = bool(_cstep.available(torch.zeros(1)) and _cstep.sequence_gemm())

needs_sequence_kernels = pytest.mark.skipif(
    not HAS_SEQUENCE_KERNELS,
    reason="needs the C kernels (a C compiler) on a target with the whole-sequence path",
)


#: In the names of the LN-LSTM's planned training nodes: the Python node's, and the C++ node's
#: (``torch::autograd::CppNode<...LstmPlannedFn>``, ``csrc_torch/rnn_ops.cpp``).
PLANNED_NODE_NAMES = ("PlannedLSTMSequenceBackward", "LstmPlannedFn")
#: In the names of the cells' training nodes: of C cell kernels, the Python nodes' and the C++
#: nodes' (``torch::autograd::CppNode<...LstmCellFn>``, ``...GruCellFn>``), and the Elman
#: cell's C++ node of its ops (``...ElmanCellFn>``).
CELL_NODE_NAMES = ("LSTMCellStepBackward", "GRUCellStepBackward", "LstmCellFn", "GruCellFn",
                   "ElmanCellFn")  # fmt: skip


def planned_nodes(nodes: list[str]) -> int:
    """How many of the autograd nodes named ``nodes`` are planned training nodes."""
    return sum(any(name in n for name in PLANNED_NODE_NAMES) for n in nodes)


def cell_nodes(nodes: list[str], kind: str = "") -> int:
    """How many of the autograd nodes named ``nodes`` are the cells' training nodes (``kind``:
    ``"lstm"``, ``"gru"`` or ``"elman"``'s alone)."""
    names = [n for n in CELL_NODE_NAMES if n.lower().startswith(kind)]
    return sum(any(name in n for name in names) for n in nodes)


def spy_projected_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the sequence kernels called with torch.nn.LSTM's projection (``w_hr``), in
    the order they run, from now until ``monkeypatch`` undoes it."""
    calls: list[str] = []
    run_sequence = rnn.run_sequence

    def spy(kernel: str, dtype: torch.dtype, args: object, seq_args: object) -> None:
        if getattr(seq_args, "w_hr", None):
            calls.append(kernel)
        run_sequence(kernel, dtype, args, seq_args)

    monkeypatch.setattr(rnn, "run_sequence", spy)
    return calls


def counting(prototype: Any, address: int) -> tuple[list[int], Any]:
    """A forwarder to the C function at ``address`` (of ctypes type ``prototype``) that counts
    its calls: ``(calls, forwarder)``, ``calls`` a list whose one item counts."""
    real = prototype(address)
    calls = [0]

    def forward(*args: Any) -> None:
        calls[0] += 1
        real(*args)

    return calls, prototype(forward)


#: The Fortran-interface GEMMs' C signature (every argument but the two transposition flags by
#: address): MKL's sgemm_ and gemm_bf16bf16f32_ as the sequence kernels call them.
FORTRAN_GEMM = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, *(ctypes.c_void_p,) * 11)


@contextlib.contextmanager
def one_step_gemm_calls(which: str) -> Iterator[list[int]]:
    """Choose MKL's GEMMs for one-step calls and count the selected library's calls of one of
    them (``which``: ``"sgemm"``, MKL's sgemm_; ``"half"``, its gemm_bf16bf16f32_): a list whose
    one item counts. Afterwards the processor's default again, set from PyTorch's own entry
    points (not from anything the test made). Skips where PyTorch exports no such GEMM."""
    from layernorm.kernels.cpu import targets

    real = rnn.torch_sgemm() if which == "sgemm" else rnn.torch_half_gemm()
    if real is None:
        pytest.skip(f"this PyTorch exports no MKL {which} GEMM")
    assert rnn._library() is not None
    calls, forwarder = counting(FORTRAN_GEMM, real)
    try:
        rnn.use_one_step_gemm("mkl")
        setter = getattr(rnn._ONE_STEP_GEMM.setters[targets.selected().name, ()], which)
        assert setter(ctypes.cast(forwarder, ctypes.c_void_p)) == 0
        yield calls
    finally:
        rnn.use_one_step_gemm(None)


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """``("ok", result)`` of ``call()`` under ``no_grad``, or the name and message of the
    ``TypeError``, ``ValueError`` or ``RuntimeError`` it raised: what a fast path that checks
    little gives a call, side by side with what the full path, which names what is wrong, gives."""
    try:
        with torch.no_grad():
            return "ok", call()
    except (TypeError, ValueError, RuntimeError) as err:
        return type(err).__name__, str(err)
