"""Load and call the fused C kernels of ``csrc/norms.c`` (built and cached by :mod:`.cbuild`, one
library per instruction-set target of :mod:`.targets`, only for the one selected).

Each kernel takes one pointer to its argument struct (:mod:`.abi` describes every field), for
float32, float64, bfloat16 and float16 ``x``; the half types compute in float32, with float32
statistics, and take their gains and biases in float32 or in x's own dtype (converted in C,
``half_params``; the gain's gradient comes in the gain's dtype). Every
call first checks each tensor's dtype, device, layout and shape and each scalar's range against
that description (:func:`.abi.check_call`), so C never sees a pointer to too little memory. Set
``LAYERNORM_CPU_COMPILE=0`` to use the eager ATen compositions instead. If the compiler is missing
or the build fails, the eager path is used and a warning says why, once.
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from pathlib import Path

import torch
from torch import Tensor

from . import abi, buffers, cache, cbuild, targets
from ._env import COMPILE_SWITCH, compile_switched_off

ENV_SWITCH = COMPILE_SWITCH
ENV_CACHE = cbuild.ENV_CACHE
# Below this many elements one thread does the whole op: waking the pool costs more than it saves.
# Forward + backward of float32 and bfloat16 layer norm with two threads, grains alternated in one
# process (benchmarks/ab_norm_node.py --grains), AMD EPYC Zen 5: 8192 took 0.88-0.94 of 32768's
# time at (48 | 64, 768), 0.94-0.96 at (32, 768), (16, 2048) and (8, 4096), 0.98-0.99 at (2, 4096)
# and (16, 768); 4096 took 1.03-1.10 of 8192's at (2, 4096) and (16, 768), 1.01 elsewhere.
_GRAIN = 8192

_CSRC = abi.CSRC_DIR
#: The translation units of the norm kernels (headers are found next to them).
SOURCES = (_CSRC / "norms.c",)
#: On top of the shared flags: no multiply-add contraction. The compiler would otherwise fuse
#: ``dy·w − mean(dy·w)`` into one multiply-add, rounding the product in the mean but not in the
#: difference, so a row whose gradient ``dy ⊙ w`` is constant (a row of one element) would get
#: ``rstd · (rounding of dy·w)``, up to 1/√eps times it, instead of an exact 0. The kernels are
#: bound by memory; explicit multiply-adds (none in these sources) would still be fused.
EXTRA_FLAGS = ("-ffp-contract=off",)


def _build(target: targets.Target | None = None) -> Path:
    """Compile the kernels for ``target`` (default: the selected one, see :mod:`.targets`) if no
    cached build matches; return the library's path."""
    target = targets.selected() if target is None else target
    return cbuild.build_shared_library(
        SOURCES, f"layernorm_cpu_{target.name}", EXTRA_FLAGS, isa_flags=target.flags
    )


KernelTable = dict[tuple[str, torch.dtype], "ctypes._CFuncPtr"]


def kernel_table(lib: ctypes.CDLL) -> KernelTable:
    """Every kernel of a loaded norm-kernel library, by (name, dtype), its argument struct
    declared."""
    fns: KernelTable = {}
    for kernel in abi.KERNELS:
        for dtype, inst in abi.INSTANCES.items():
            fn = getattr(lib, f"{kernel.name}_{inst.suffix}")
            fn.restype = ctypes.c_int
            fn.argtypes = (ctypes.POINTER(abi.structure(kernel, dtype)),)
            fns[kernel.name, dtype] = fn
    return fns


@functools.cache
def _library_for(isa: str) -> KernelTable | None:
    """The kernels of target ``isa``'s library (built on first use), or ``None`` after a warning
    when it cannot be built or loaded."""
    try:
        # checked, and rebuilt once if damaged
        return kernel_table(cache.load_library(lambda: _build(targets.target(isa))))
    except Exception as err:  # any failure falls back to the always-correct eager path
        warnings.warn(
            f"layernorm: fused CPU kernels unavailable, using eager ATen ops ({err})",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def _library() -> KernelTable | None:
    """The kernels of the selected target (see :mod:`.targets`)."""
    return _library_for(targets.selected().name)


def enabled() -> bool:
    """True when the fused kernels are switched on (``LAYERNORM_CPU_COMPILE`` != 0) and built."""
    return not compile_switched_off() and _library() is not None


def supports(x: Tensor, *params: Tensor | None, same: tuple[Tensor, ...] = ()) -> bool:
    """Whether the fused kernels take these tensors (:func:`kernel_inputs`) and are switched on
    and built (:func:`enabled`). Called on every op, so only cheap attribute checks."""
    return kernel_inputs(x, *params, same=same) and enabled()


def kernel_inputs(x: Tensor, *params: Tensor | None, same: tuple[Tensor, ...] = ()) -> bool:
    """Whether the kernels' dtype and layout rules take these tensors: contiguous CPU tensors,
    ``x`` float32, float64, bfloat16 or float16, the ``same`` tensors (incoming gradients) in x's
    dtype, the params (gains, biases; ``None`` allowed) in x's dtype or in its compute dtype
    (float32 gains with half activations, as under autocast)."""
    dt = x.dtype
    inst = abi.INSTANCES.get(dt)
    if inst is None or not x.is_cpu or not x.is_contiguous():
        return False
    for t in same:
        if t.dtype is not dt or not t.is_cpu or not t.is_contiguous():
            return False
    cdt = inst.compute_dtype
    for p in params:
        if p is not None and (
            (p.dtype is not dt and p.dtype is not cdt) or not p.is_cpu or not p.is_contiguous()
        ):
            return False
    return True


def _half_params(x: Tensor, *params: Tensor | None) -> int:
    """The kernels' ``half_params`` flag: 1 where ``x`` is of a half type and every parameter
    given is in x's dtype (the kernels convert them, once a call, in C), else 0: parameters in
    the compute dtype, as float32 and float64 ``x`` always have them (a half gain beside a
    float32 bias goes through :func:`_compute`)."""
    dt = x.dtype
    if dt is torch.float32 or dt is torch.float64:
        return 0
    given = [p for p in params if p is not None]
    return int(bool(given) and all(p.dtype is dt for p in given))


def _compute(p: Tensor | None, x: Tensor) -> Tensor | None:
    """A half gain or bias of half ``x`` in float32, the kernels' compute dtype, for a call with
    ``half_params`` 0; anything else as it is (the argument checks refuse a dtype the kernels do
    not take)."""
    if p is None or p.dtype is not x.dtype:
        return p
    cdt = abi.INSTANCES[x.dtype].compute_dtype
    return p if p.dtype is cdt else p.to(cdt)


def _param_grad(x: Tensor, n: int, half: int) -> Tensor:
    """The gain's gradient, in the dtype the call's ``half_params`` flag gives the gains: x's half
    type with 1, else the compute dtype."""
    return x.new_empty(n, dtype=x.dtype) if half else _stats(x, n)


def _stats(x: Tensor, m: int) -> Tensor:
    """m elements in x's compute dtype (x's own where x has no instance: the checks refuse it)."""
    inst = abi.INSTANCES.get(x.dtype)
    return x.new_empty(m, dtype=x.dtype if inst is None else inst.compute_dtype)


def _threads(m: int, n: int) -> int:
    return max(1, min(torch.get_num_threads(), m, (m * n) // _GRAIN))


_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _last_level_cache_bytes(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The size of the processor's last-level cache, as Linux describes it (the highest ``level``
    under ``root``); 32 MiB where it says nothing."""
    best = (0, 32 << 20)
    for index in sorted(root.glob("index*")):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        unit = size[-1:].upper()
        scale = _SIZE_UNITS.get(unit, 1)
        digits = size[:-1] if unit in _SIZE_UNITS else size
        if digits.isdigit() and level > best[0]:
            best = (level, int(digits) * scale)
    return best[1]


#: A kernel writes its (M, N) output past the caches (the ABI's ``stream``) when the (M, N)
#: tensors it reads and writes take at least this many bytes together: half the last-level cache,
#: which every core (and, in a virtual machine, every tenant) shares, so such an output would not
#: stay in cache for the next op, while a plain store first reads each of its lines from memory.
#: Measured on an AMD EPYC (AVX2, 32 MiB L3), float32 layer norm forward + backward against the
#: same kernels with plain stores: (4096, 768) 0.71 of the time with one thread, 0.82 with two;
#: at (1024, 768), 9 MiB a backward, streaming gained with one thread and lost with two.
STREAM_MIN_BYTES = _last_level_cache_bytes() // 2


def _stream(x: Tensor, tensors: int) -> int:
    """The ``stream`` flag of a kernel moving ``tensors`` (M, N) tensors (inputs and output)."""
    return int(tensors * x.numel() * x.element_size() >= STREAM_MIN_BYTES)


def _stream_forward(x: Tensor, threads: int, for_backward: bool) -> int:
    """The ``stream`` flag of a forward (x read, y written) on ``threads`` threads. The half
    types' forwards keep plain stores: streaming their output measured 3–12% slower (bfloat16 at
    (8192, 1024) and (32768, 256), 1 and 2 threads, AMD EPYC with AVX512-BF16, AVX-512 and AVX2
    builds), where their backwards gained 5–38% (benchmarks/RESULTS.md). A forward that no
    backward follows, on two threads or more, streams only where x alone takes
    :data:`STREAM_MIN_BYTES` (x and y together the whole last-level cache): below that its
    output stays in the cache for the op that reads it next, written there by both cores, where
    streamed stores went out at a rate that varied by a third from run to run. AMD EPYC Zen 4
    (32 MiB), float32 forward, two threads, ms streamed / plain in one process: layer norm with x
    and y 16 MiB 0.25-0.31 / 0.23-0.24, 20 MiB 0.33 / 0.32, 24 MiB 0.37-0.48 / 0.38-0.48, 32 MiB
    0.50 / 0.53 ((8192, 512) 0.61 / 0.84), RMSNorm at 16 MiB 0.17-0.31 / 0.15-0.17; one thread
    streamed gained from 16 MiB up. With a backward to follow, streaming gained there too (two
    threads, forward and backward at (2048, 1024) 0.97-1.06 against 1.05-1.22 ms)."""
    if x.element_size() == 2:
        return 0
    return _stream(x, 1 if threads >= 2 and not for_backward else 2)


_BINDERS = {k.name: abi.Binder(k) for k in abi.KERNELS}


def _call(name: str, *, outputs_made: bool = True, **values: object) -> None:
    """Check ``values`` against kernel ``name``'s description, then run it. ``outputs_made``:
    the output tensors were allocated here, to the kernel's shapes from ``x`` (the default:
    every kernel's outputs but a caller's ``out``), and only the inputs are checked."""
    args = _BINDERS[name](values, outputs_made)
    x = values["x"]
    assert isinstance(x, Tensor)
    fns = _library()
    assert fns is not None  # callers check supports() first
    status = fns[name, x.dtype](ctypes.byref(args))
    if status != 0:
        raise MemoryError(f"layernorm: the fused CPU kernel {name} could not allocate its buffers")


def ln_fwd(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    out: Tensor | None = None,
    *,
    for_backward: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, mean, rstd)``; ``y`` written into ``out`` when given (checked as y: x's shape and
    dtype, contiguous; it must not overlap x), else into :func:`.buffers.output` (a backward
    follows with ``for_backward``)."""
    m, n = x.shape
    y = buffers.output(x, for_backward) if out is None else out
    mean, rstd = _stats(x, m), _stats(x, m)
    threads = _threads(m, n)
    half = _half_params(x, weight, bias)
    if not half:
        weight, bias = _compute(weight, x), _compute(bias, x)
    _call("ln_fwd", x=x, weight=weight, bias=bias, y=y, mean=mean, rstd=rstd, eps=eps,
          threads=threads, stream=_stream_forward(x, threads, for_backward), half_params=half,
          outputs_made=out is None)  # fmt: skip
    return y, mean, rstd


def ln_bwd(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    detach_mean: bool,
    detach_std: bool,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(dx, dweight, dbias)``: ``dweight`` in the weight's dtype, ``dbias`` in the compute
    dtype (the caller casts it to the bias's)."""
    m, n = x.shape
    half = _half_params(x, weight)
    dx = buffers.output(x, for_backward=True) if need_dx else None
    dw = _param_grad(x, n, half) if need_dw else None
    db = _stats(x, n) if need_db else None
    _call("ln_bwd", dy=dy, x=x, mean=mean, rstd=rstd, weight=weight, dx=dx, dweight=dw,
          dbias=db, detach_mean=int(detach_mean), detach_std=int(detach_std),
          threads=_threads(m, n), stream=_stream(x, 3 if need_dx else 2),
          half_params=half)  # fmt: skip
    return dx, dw, db


def rms_fwd(
    x: Tensor, weight: Tensor | None, eps: float, *, for_backward: bool = False
) -> tuple[Tensor, Tensor]:
    m, n = x.shape
    y, rstd, threads = buffers.output(x, for_backward), _stats(x, m), _threads(m, n)
    stream = _stream_forward(x, threads, for_backward)
    _call("rms_fwd", x=x, weight=weight, y=y, rstd=rstd, eps=eps, threads=threads,
          stream=stream, half_params=_half_params(x, weight))  # fmt: skip
    return y, rstd


def rms_bwd(
    dy: Tensor, x: Tensor, rstd: Tensor, weight: Tensor | None, need_dx: bool, need_dw: bool
) -> tuple[Tensor | None, Tensor | None]:
    m, n = x.shape
    half = _half_params(x, weight)
    dx = buffers.output(x, for_backward=True) if need_dx else None
    dw = _param_grad(x, n, half) if need_dw else None
    _call("rms_bwd", dy=dy, x=x, rstd=rstd, weight=weight, dx=dx, dweight=dw,
          threads=_threads(m, n), stream=_stream(x, 3 if need_dx else 2),
          half_params=half)  # fmt: skip
    return dx, dw


def ada_fwd(
    x: Tensor, k: float, scale: float, eps: float, *, for_backward: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    m, n = x.shape
    z, threads = buffers.output(x, for_backward), _threads(m, n)
    mean, rstd = _stats(x, m), _stats(x, m)
    _call("ada_fwd", x=x, z=z, mean=mean, rstd=rstd, eps=eps, k=k, scale=scale,
          threads=threads, stream=_stream_forward(x, threads, for_backward))  # fmt: skip
    return z, mean, rstd


def ada_bwd(dz: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, k: float, scale: float) -> Tensor:
    m, n = x.shape
    dx = buffers.output(x, for_backward=True)
    _call("ada_bwd", dz=dz, x=x, mean=mean, rstd=rstd, dx=dx, k=k, scale=scale,
          threads=_threads(m, n), stream=_stream(x, 3))  # fmt: skip
    return dx


def cvt(x: Tensor, yf: Tensor) -> tuple[Tensor, Tensor]:
    """``(x in the compute dtype, yf rounded to x's dtype)`` by the kernels' own conversions
    (tests check them against torch's casts)."""
    xf = _stats(x, x.numel()).view(x.shape)
    y = torch.empty_like(x)
    _call("cvt", x=x, xf=xf, yf=yf, y=y)
    return xf, y
