"""Load and call the fused C kernels of :mod:`._csrc` (built and cached by :mod:`.cbuild`).

The functions are called through :mod:`ctypes` on raw data pointers. Set
``LAYERNORM_CPU_COMPILE=0`` to use the eager ATen compositions instead. If the compiler is missing
or the build fails, the eager path is used and a warning says why, once.
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings
from pathlib import Path

import torch
from torch import Tensor

from . import _csrc, cache, cbuild

ENV_SWITCH = "LAYERNORM_CPU_COMPILE"
ENV_CACHE = cbuild.ENV_CACHE
# Below this many elements one thread does the whole op: waking the pool costs more than it saves
# (the same grain PyTorch uses for its own parallel loops).
_GRAIN = 32768

_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
_DBL = ctypes.c_double
_SIGNATURES: dict[str, tuple[object, tuple]] = {
    "ln_fwd": (None, (_P, _P, _P, _P, _P, _P, _I64, _I64, _DBL, _INT)),
    "ln_bwd": (_INT, (_P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _INT, _INT, _INT)),
    "rms_fwd": (None, (_P, _P, _P, _P, _I64, _I64, _DBL, _INT)),
    "rms_bwd": (_INT, (_P, _P, _P, _P, _P, _P, _I64, _I64, _INT)),
    "ada_fwd": (None, (_P, _P, _P, _P, _I64, _I64, _DBL, _DBL, _DBL, _INT)),
    "ada_bwd": (None, (_P, _P, _P, _P, _P, _I64, _I64, _DBL, _DBL, _INT)),
}


def _build() -> Path:
    """Compile the kernels if no cached build matches; return the library's path."""
    return cbuild.build_shared_library(_csrc.source(), "layernorm_cpu")


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = cache.load_library(_build)  # checked, and rebuilt once if damaged
        for base, (restype, argtypes) in _SIGNATURES.items():
            for dtype, suffix in _SUFFIX.items():
                fn = getattr(lib, f"{base}_{suffix}")
                fn.restype = restype
                fn.argtypes = argtypes
                _FNS[base, dtype] = fn
        return lib
    except Exception as err:  # any failure falls back to the always-correct eager path
        warnings.warn(
            f"layernorm: fused CPU kernels unavailable, using eager ATen ops ({err})",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


_FNS: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}


def enabled() -> bool:
    """True when the fused kernels are switched on (``LAYERNORM_CPU_COMPILE`` != 0) and built."""
    return os.environ.get(ENV_SWITCH, "1") != "0" and _library() is not None


def supports(x: Tensor, *params: Tensor | None) -> bool:
    """Whether the fused kernels take these tensors: contiguous float32/float64 on the CPU, the
    params (``None`` allowed) in x's dtype. Called on every op, so only cheap attribute checks.
    """
    dt = x.dtype
    if dt not in _SUFFIX or not x.is_cpu or not x.is_contiguous():
        return False
    for p in params:
        if p is not None and (p.dtype is not dt or not p.is_cpu or not p.is_contiguous()):
            return False
    return enabled()


def _threads(m: int, n: int) -> int:
    return max(1, min(torch.get_num_threads(), m, (m * n) // _GRAIN))


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check(status: int) -> None:
    if status != 0:
        raise MemoryError("layernorm: the fused CPU backward could not allocate its buffers")


def ln_fwd(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    m, n = x.shape
    y = torch.empty_like(x)
    mean, rstd = x.new_empty(m), x.new_empty(m)
    fn = _FNS["ln_fwd", x.dtype]
    yp, mp, rp = y.data_ptr(), mean.data_ptr(), rstd.data_ptr()
    fn(x.data_ptr(), _ptr(weight), _ptr(bias), yp, mp, rp, m, n, eps, _threads(m, n))
    return y, mean, rstd


def ln_bwd(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    keep_mean: bool,
    keep_std: bool,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    m, n = x.shape
    dx = torch.empty_like(x) if need_dx else None
    dw = x.new_empty(n) if need_dw else None
    db = x.new_empty(n) if need_db else None
    fn = _FNS["ln_bwd", x.dtype]
    inputs = (dy.data_ptr(), x.data_ptr(), mean.data_ptr(), rstd.data_ptr(), _ptr(weight))
    outputs = (_ptr(dx), _ptr(dw), _ptr(db))
    _check(fn(*inputs, *outputs, m, n, keep_mean, keep_std, _threads(m, n)))
    return dx, dw, db


def rms_fwd(x: Tensor, weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    m, n = x.shape
    y, rstd = torch.empty_like(x), x.new_empty(m)
    fn = _FNS["rms_fwd", x.dtype]
    fn(x.data_ptr(), _ptr(weight), y.data_ptr(), rstd.data_ptr(), m, n, eps, _threads(m, n))
    return y, rstd


def rms_bwd(
    dy: Tensor, x: Tensor, rstd: Tensor, weight: Tensor | None, need_dx: bool, need_dw: bool
) -> tuple[Tensor | None, Tensor | None]:
    m, n = x.shape
    dx = torch.empty_like(x) if need_dx else None
    dw = x.new_empty(n) if need_dw else None
    fn = _FNS["rms_bwd", x.dtype]
    inputs = (dy.data_ptr(), x.data_ptr(), rstd.data_ptr(), _ptr(weight))
    _check(fn(*inputs, _ptr(dx), _ptr(dw), m, n, _threads(m, n)))
    return dx, dw


def ada_fwd(x: Tensor, k: float, scale: float, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    m, n = x.shape
    z = torch.empty_like(x)
    mean, rstd = x.new_empty(m), x.new_empty(m)
    fn = _FNS["ada_fwd", x.dtype]
    outputs = (z.data_ptr(), mean.data_ptr(), rstd.data_ptr())
    fn(x.data_ptr(), *outputs, m, n, eps, k, scale, _threads(m, n))
    return z, mean, rstd


def ada_bwd(dz: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, k: float, scale: float) -> Tensor:
    m, n = x.shape
    dx = torch.empty_like(x)
    fn = _FNS["ada_bwd", x.dtype]
    inputs = (dz.data_ptr(), x.data_ptr(), mean.data_ptr(), rstd.data_ptr())
    fn(*inputs, dx.data_ptr(), m, n, k, scale, _threads(m, n))
    return dx
