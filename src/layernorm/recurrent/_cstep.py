"""Build, cache and call the C time-step kernels of :mod:`._csrc` (CPU, float32/float64).

The library is compiled once per machine with the system C compiler (about a second) into the
cache directory the CPU norm kernels use, keyed by a hash of the source, flags, compiler, the loaded
``libgomp`` and the CPU's flags; the build helpers are shared with
:mod:`layernorm.kernels.cpu._native`. Kernels are called through :mod:`ctypes` with an int64 array
of the buffers' base addresses (built once per sequence) and the step's first row, so a step slices
no tensors and a call passes 6–8 arguments. The sequence layers call the ``*_seq`` entry points
instead: one foreign call per direction runs every step, recurrent GEMM included (a small GEMM of
:mod:`._csrc`), which removes the per-step ``torch.mm`` dispatch and Python loop.

``LAYERNORM_CPU_COMPILE=0`` or a failed build selects the eager step functions of
:mod:`._pointwise` instead (a warning says why, once).
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import _csrc

ENV_SWITCH = "LAYERNORM_CPU_COMPILE"
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
# Below this many elements per step one thread does the rows: waking the pool costs more.
_GRAIN = 32768
_P, _I64, _INT, _DBL = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
# Argument order of each kernel's buffers (the unpacked C signature); the packed ``*_at``
# entry points take their base addresses in an int64 array plus the step's first row.
_BUFFERS = {
    "lstm_fwd": ("hp", "gx", "w1", "b1", "w3", "b3", "h", "c", "out", "hprev", "cprev", "acts",
                 "mh", "rh", "cn", "mc", "rc", "tc"),
    "lstm_bwd": ("dout", "dh", "dc", "hp", "mh", "rh", "w1", "acts", "cprev", "cn", "mc", "rc",
                 "w3", "tc", "dgates", "dhp", "dlc"),
    "gru_fwd": ("hp", "gx", "w_rz", "b_rz", "w_n", "b_n", "b_hn", "h", "out", "hprev", "rz", "n",
                "ghn", "mh", "rh", "mn", "rn"),
    "gru_bwd": ("dout", "dh", "hprev", "hp", "rz", "n", "ghn", "mh", "rh", "mn", "rn", "w_rz",
                "w_n", "dgx", "dgh", "dhp"),
}  # fmt: skip
_SIGNATURES = {
    "lstm_fwd": (_P, _I64, _I64, _I64, _DBL, _INT, _INT, _INT),
    "lstm_bwd": (_P, _I64, _I64, _I64, _INT, _INT, _INT),
    "gru_fwd": (_P, _I64, _I64, _I64, _DBL, _INT, _INT),
    "gru_bwd": (_P, _I64, _I64, _I64, _INT, _INT),
}
# The whole-sequence entry points: buffer addresses, the (first row, rows) pairs of the steps, the
# recurrent weight (W_hhᵀ forward, W_hh backward), H, [eps,] flags, threads, step grain, GEMM grain.
_SEQ_SIGNATURES = {
    "lstm_fwd_seq": (_P, _P, _I64, _P, _I64, _DBL, _INT, _INT, _INT, _I64, _I64),
    "lstm_bwd_seq": (_P, _P, _I64, _P, _I64, _INT, _INT, _INT, _I64, _I64),
    "gru_fwd_seq": (_P, _P, _I64, _P, _I64, _DBL, _INT, _INT, _I64, _I64),
    "gru_bwd_seq": (_P, _P, _I64, _P, _I64, _INT, _INT, _I64, _I64),
    "weight_grad": (_P, _P, _I64, _I64, _I64, _P, _INT, _I64),
}
# Below this many multiply-adds per thread a step's recurrent GEMM runs on one thread.
_GEMM_GRAIN = 1 << 21
# Up to this many multiply-adds the weight gradient uses the C GEMM (measured 0.8x torch.mm's time
# at (N, G, H) = (400, 512, 128)); beyond, MKL's cache blocking wins (1.5x at (6400, 2048, 512)).
_WEIGHT_GRAD_MAX = 1 << 26
_FNS: dict[tuple[str, torch.dtype], Any] = {}
# Bytes per vector of the sequence GEMM as built (64 with AVX-512, 32 with AVX, else 16).
_VECTOR_BYTES = [0]
# On top of the norm kernels' flags: no errno and no FP traps, which changes no result but lets the
# gate loops (exp, tanh) vectorize; there is no -ffast-math, so NaN and rounding behave as written.
_EXTRA_FLAGS = ("-fno-math-errno", "-fno-trapping-math")


def _build() -> Path:
    from ..kernels.cpu import cbuild  # the build step shared with the norm kernels

    return cbuild.build_shared_library(_csrc.source(), "layernorm_rnn", _EXTRA_FLAGS)


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        from ..kernels.cpu import cache

        lib = cache.load_library(_build)  # checked, and rebuilt once if damaged
        entries = {f"{k}_at": (k, v) for k, v in _SIGNATURES.items()}
        entries.update({k: (k, v) for k, v in _SEQ_SIGNATURES.items()})
        for symbol, (base, argtypes) in entries.items():
            for dtype, suffix in _SUFFIX.items():
                fn = getattr(lib, f"{symbol}_{suffix}")
                fn.restype = None
                fn.argtypes = argtypes
                _FNS[base, dtype] = fn
        lib.seq_gemm_vector_bytes.restype = ctypes.c_int
        _VECTOR_BYTES[0] = lib.seq_gemm_vector_bytes()
        return lib
    except Exception as err:  # any failure falls back to the eager step functions
        warnings.warn(
            f"layernorm: C recurrent step kernels unavailable, using eager ops ({err})",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def available(x: Tensor) -> bool:
    """Whether the C kernels run steps on ``x``: a CPU float32/float64 tensor, switch on, built."""
    if x.dtype not in _SUFFIX or not x.is_cpu:
        return False
    return os.environ.get(ENV_SWITCH, "1") != "0" and _library() is not None


def sequence_gemm() -> bool:
    """Whether the whole-sequence functions are used: only where the build has AVX-512 (64-byte
    vectors), where their GEMM was measured faster than ``torch.mm``. Built without AVX-512 on the
    same CPU, its 32-byte tile reached 63 GFLOP/s and the layers were no faster than with the time
    loop in Python, which therefore stays there on such targets."""
    return _library() is not None and _VECTOR_BYTES[0] >= 64


def _threads(rows: int, cols: int) -> int:
    return max(1, min(torch.get_num_threads(), rows, (rows * cols) // _GRAIN))


def _filled(st: dict[str, Any], names: tuple[str, ...], sizes: tuple[int, ...]) -> None:
    """Absent gains become ones and absent biases zeros (the kernels load them unconditionally)."""
    like = st["gx"]
    for name, size in zip(names, sizes, strict=True):
        if st.get(name) is None:
            fill = 1.0 if name.startswith("w") else 0.0
            st[name] = like.new_full((size,), fill)


def _addresses(st: dict[str, Any], kernel: str) -> Any:
    """The int64 array of ``kernel``'s buffer addresses for this sequence (built once, cached)."""
    key = "_addr_" + kernel
    arr = st.get(key)
    if arr is None:
        hs = st["H"]
        if kernel.startswith("gru"):
            _filled(st, ("w_rz", "b_rz", "w_n", "b_n", "b_hn"), (2 * hs, 2 * hs, hs, hs, hs))
        else:
            _filled(st, ("w1", "b1", "w3", "b3"), (4 * hs, 4 * hs, hs, hs))
        names = _BUFFERS[kernel]
        if not st["normalize"] and kernel.endswith("bwd"):
            names = tuple("" if n == "dhp" else n for n in names)  # dhp aliases dgates / dgh
        for n in names:
            t = st.get(n)
            if isinstance(t, Tensor) and not t.is_contiguous():
                raise ValueError(f"C step kernel {kernel}: buffer {n} must be contiguous")
        ptrs = [st[n].data_ptr() if isinstance(st.get(n), Tensor) else 0 for n in names]
        arr = st[key] = (ctypes.c_int64 * len(ptrs))(*ptrs)
    return arr


def lstm_fwd(st: dict[str, Any], off: int, bs: int) -> None:
    hs = st["H"]
    _FNS["lstm_fwd", st["gx"].dtype](
        _addresses(st, "lstm_fwd"), off, bs, hs, st["eps"], st["normalize"],
        st["carry_normalized"], _threads(bs, 4 * hs),
    )  # fmt: skip


def lstm_bwd(st: dict[str, Any], off: int, bs: int) -> None:
    hs = st["H"]
    _FNS["lstm_bwd", st["gx"].dtype](
        _addresses(st, "lstm_bwd"), off, bs, hs, st["normalize"], st["carry_normalized"],
        _threads(bs, 4 * hs),
    )  # fmt: skip


def gru_fwd(st: dict[str, Any], off: int, bs: int) -> None:
    hs = st["H"]
    _FNS["gru_fwd", st["gx"].dtype](
        _addresses(st, "gru_fwd"), off, bs, hs, st["eps"], st["normalize"], _threads(bs, 3 * hs)
    )


def gru_bwd(st: dict[str, Any], off: int, bs: int) -> None:
    hs = st["H"]
    _FNS["gru_bwd", st["gx"].dtype](
        _addresses(st, "gru_bwd"), off, bs, hs, st["normalize"], _threads(bs, 3 * hs)
    )


# ---------------------------------------------------------------------------------------------
# Whole sequences: the time loop, recurrent GEMM included, in one foreign call per direction.
# ---------------------------------------------------------------------------------------------


def _steps(sched: tuple[tuple[int, int, int], ...]) -> Any:
    """The (first row, rows) pairs of ``sched`` (in its processing order) as an int64 array."""
    flat = [v for _, off, bs in sched for v in (off, bs)]
    return (ctypes.c_int64 * len(flat))(*flat)


def _weight(st: dict[str, Any], w: Tensor) -> Tensor:
    """``w`` contiguous in the buffers' dtype on the CPU (the C GEMM reads it raw)."""
    like = st["gx"]
    if w.dtype != like.dtype or not w.is_cpu:
        raise TypeError(f"C step kernels: W_hh must be a CPU {like.dtype} tensor, got {w.dtype} "
                        f"on {w.device}")  # fmt: skip
    return w.contiguous()


def lstm_fwd_seq(st: dict[str, Any], w_hh: Tensor, sched: tuple[tuple[int, int, int], ...]) -> None:
    wt = _weight(st, w_hh.t())
    _FNS["lstm_fwd_seq", wt.dtype](
        _addresses(st, "lstm_fwd"), _steps(sched), len(sched), wt.data_ptr(), st["H"], st["eps"],
        st["normalize"], st["carry_normalized"], torch.get_num_threads(), _GRAIN, _GEMM_GRAIN,
    )  # fmt: skip


def lstm_bwd_seq(st: dict[str, Any], w_hh: Tensor, sched: tuple[tuple[int, int, int], ...]) -> None:
    w = _weight(st, w_hh)
    _FNS["lstm_bwd_seq", w.dtype](
        _addresses(st, "lstm_bwd"), _steps(sched), len(sched), w.data_ptr(), st["H"],
        st["normalize"], st["carry_normalized"], torch.get_num_threads(), _GRAIN, _GEMM_GRAIN,
    )  # fmt: skip


def gru_fwd_seq(st: dict[str, Any], w_hh: Tensor, sched: tuple[tuple[int, int, int], ...]) -> None:
    wt = _weight(st, w_hh.t())
    _FNS["gru_fwd_seq", wt.dtype](
        _addresses(st, "gru_fwd"), _steps(sched), len(sched), wt.data_ptr(), st["H"], st["eps"],
        st["normalize"], torch.get_num_threads(), _GRAIN, _GEMM_GRAIN,
    )  # fmt: skip


def gru_bwd_seq(st: dict[str, Any], w_hh: Tensor, sched: tuple[tuple[int, int, int], ...]) -> None:
    w = _weight(st, w_hh)
    _FNS["gru_bwd_seq", w.dtype](
        _addresses(st, "gru_bwd"), _steps(sched), len(sched), w.data_ptr(), st["H"],
        st["normalize"], torch.get_num_threads(), _GRAIN, _GEMM_GRAIN,
    )  # fmt: skip


def weight_grad(dhp: Tensor, hprev: Tensor) -> Tensor:
    """``dhpᵀ · hprev``, the recurrent weight's gradient summed over all rows: with the C GEMM for
    small sequences (where it beats ``torch.mm``), else ``torch.mm``."""
    n_rows, gates = dhp.shape
    hs = hprev.shape[1]
    if (
        n_rows * gates * hs > _WEIGHT_GRAD_MAX
        or hprev.dtype != dhp.dtype
        or not (dhp.is_contiguous() and hprev.is_contiguous())
    ):
        return dhp.t().mm(hprev)
    dw = dhp.new_empty((gates, hs))
    _FNS["weight_grad", dhp.dtype](
        dhp.data_ptr(), hprev.data_ptr(), n_rows, gates, hs, dw.data_ptr(),
        torch.get_num_threads(), _GEMM_GRAIN,
    )  # fmt: skip
    return dw
