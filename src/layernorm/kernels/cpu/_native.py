"""Build, cache and call the fused C kernels of :mod:`._csrc`.

The source is compiled once per machine with the system C compiler (``cc``/``gcc``, about a second:
it includes no PyTorch headers) into a shared library cached under ``$LAYERNORM_CACHE_DIR`` (default
``~/.cache/layernorm``), keyed by a hash of the source, the flags and the CPU's instruction sets, so
a changed kernel or a different machine never picks up a stale binary. The library links the same
``libgomp`` that PyTorch has loaded, so both share one OpenMP thread pool instead of two pools
spinning against each other. The functions are called through :mod:`ctypes` on raw data pointers.

Set ``LAYERNORM_CPU_COMPILE=0`` to use the eager ATen compositions instead. If the compiler is
missing or the build fails, the eager path is used and a warning says why, once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch import Tensor

from . import _csrc

ENV_SWITCH = "LAYERNORM_CPU_COMPILE"
ENV_CACHE = "LAYERNORM_CACHE_DIR"
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")
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


def _cpu_flags() -> str:
    """The CPU's feature flags: part of the cache key because the build uses -march=native."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _loaded_libgomp() -> str | None:
    """Path of the libgomp PyTorch already mapped into this process (Linux), if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                if os.path.basename(path).startswith("libgomp") and ".so" in path:
                    return path
    except OSError:
        pass
    return None


def _cache_dir() -> Path:
    root = os.environ.get(ENV_CACHE) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "layernorm"
    )
    path = Path(root)
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    path = Path(tempfile.gettempdir()) / f"layernorm-{os.getuid() if hasattr(os, 'getuid') else 0}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def _build() -> Path:
    """Compile the kernels if no cached build matches; return the library's path."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"the fused CPU kernels are built on Linux only, not {sys.platform}")
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (tried $CC, cc, gcc)")
    src = _csrc.source()
    gomp = _loaded_libgomp()
    key = hashlib.sha256(
        "\n".join([src, " ".join(_FLAGS), cc, gomp or "", _cpu_flags()]).encode()
    ).hexdigest()[:16]
    out = _cache_dir() / f"layernorm_cpu_{key}.so"
    if out.exists():
        return out
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        c_file = Path(tmp) / "kernels.c"
        c_file.write_text(src)
        tmp_so = Path(tmp) / out.name
        # Link PyTorch's own libgomp when it has one (same soname, so the loader maps it once).
        link = [gomp, f"-Wl,-rpath,{os.path.dirname(gomp)}"] if gomp else []
        cmd = [cc, *_FLAGS, str(c_file), "-o", str(tmp_so), *link, "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp_so, out)  # atomic: concurrent builders never see a half-written library
    return out


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(_build()))
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
