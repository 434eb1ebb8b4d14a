"""Route an op to the backend module that runs it (see :mod:`layernorm.backend`)."""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Callable
from types import ModuleType

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import Tensor

from .._validation import FLOAT_DTYPES, HALF_DTYPES, stats_dtype
from ..backend import _forced as _forced_backend
from ..backend import select_backend
from ..kernels.cpu import buffers

_MODULES: dict[tuple[str, str], ModuleType] = {}

# torch's tracer-state queries, bound once: the checks below run on every call of a small op, where
# each attribute chain (torch._C._get_tracing_state) costs as much as the query. Dynamo knows
# is_compiling by the function itself, so the bound name answers True under it as well.
_is_compiling = torch.compiler.is_compiling
_tracing_state = torch._C._get_tracing_state
_functorch_active = torch._C._are_functorch_transforms_active
_dispatch_modes = torch._C._len_torch_dispatch_stack


def kernels_module(backend: str, family: str) -> ModuleType:
    """The module ``layernorm.kernels.<backend>.<family>``, imported once (import_module costs
    microseconds on every op otherwise)."""
    key = (backend, family)
    module = _MODULES.get(key)
    if module is None:
        module = _MODULES[key] = importlib.import_module(f"layernorm.kernels.{backend}.{family}")
    return module


def backend_module(x: Tensor, family: str) -> ModuleType:
    """The module ``layernorm.kernels.<backend>.<family>`` for tensor ``x``."""
    return kernels_module(select_backend(x), family)


def cpu_kernels(family: str) -> ModuleType:
    """``layernorm.kernels.cpu.<family>``: what :func:`backend_module` gives a CPU tensor where no
    backend is forced, for the lean paths, which have made sure of both (:func:`lean_input`),
    without choosing the backend again (which reads the environment)."""
    return kernels_module("cpu", family)


def plain_eager() -> bool:
    """True when no tracer watches: not torch.jit.trace, torch.compile/export, a functorch
    transform (vmap, grad), a dispatch mode (fake tensors, make_fx) or forward-mode AD (dual
    tensors may flow). Only then may an op skip its custom-op wrapper, whose Python dispatch costs
    tens of microseconds a call, as much as a small op's whole kernel.
    """
    return not (
        # torch.jit.trace must record the ops (an autograd.Function cannot be saved). This is
        # torch.jit.is_tracing() at half its cost on every op, and torch.compile knows it too.
        _tracing_state() is not None or _is_compiling() or transformed()
    )


def transformed() -> bool:
    """True inside a functorch transform (vmap, grad), a dispatch mode (fake tensors, make_fx) or
    forward-mode AD: the tracers that record or transform ATen ops but not a kernel called
    directly."""
    return _functorch_active() or _dispatch_modes() > 0 or _forward_ad._current_level >= 0


def batched(t: Tensor) -> bool:
    """True for a batched tensor of ``vmap`` (functorch's, or the one ``torch.autograd.grad``'s
    ``is_grads_batched=True`` and ``jacobian(..., vectorize=True)`` run a backward with): it has
    no memory of its own for a kernel to read."""
    return torch._C._functorch.is_batchedtensor(t) or torch._C._functorch.is_legacy_batchedtensor(t)


def reference_backward(*grads: Tensor) -> bool:
    """Whether a backward of the fused kernels differentiates the reference's ops instead: with
    ``create_graph=True`` (grad mode is on in the backward, and its result must itself be
    differentiable) or in a batched backward (a :func:`batched` gradient, whose memory no kernel
    can read)."""
    return torch.is_grad_enabled() or any(batched(g) for g in grads)


def forward_ad_on() -> bool:
    """True inside ``torch.autograd.forward_ad.dual_level()`` (dual tensors may flow)."""
    return _forward_ad._current_level >= 0


def needs_reference() -> bool:
    """True where the ops run their differentiable reference (:mod:`layernorm.reference`), the
    definition the kernels are tested against, instead of the kernels: inside any ``torch.func``
    transform (under ``torch.compile`` too, which traces the reference into its graph) and under
    forward-mode AD outside ``torch.compile``.

    * ``grad``/``vjp``/``jacrev``/``hessian`` reject the autograd.Function that
      ``torch.library.register_autograd`` generates for a custom op (no ``setup_context``);
    * ``jvp``/``jacfwd`` and forward-mode AD: the ops have no forward derivative (the custom op
      would give zero tangents without a word, the eager Function raises);
    * ``vmap`` has no batching rule for the custom ops: it would call them once per example, with
      a performance warning, where the reference's tensor ops batch.
    """
    if torch._C._are_functorch_transforms_active():
        return True
    return not torch.compiler.is_compiling() and forward_ad_on()


def in_stats_dtype(fn: Callable[..., Tensor], x: Tensor, *params: Tensor | None) -> Tensor:
    """``fn(x, *params)`` computed in the statistics' dtype (float32 for half inputs,
    params cast to it), returned in ``x``'s dtype: the kernels' dtype contract, for the
    reference path."""
    cdt = stats_dtype(x.dtype)
    cast = [None if p is None else p.to(cdt) for p in params]
    return fn(x.to(cdt), *cast).to(x.dtype)


def aliases(*tensors: Tensor | None) -> list[Tensor | None]:
    """A view of each tensor (``None`` stays ``None``), made under grad mode. A node whose backward
    differentiates its reference (``create_graph=True``) runs the reference on these and takes the
    gradients at them: taken at the inputs themselves, a path from one input to another (``x``
    made by an earlier op from the same weight) would add that path's share there as well as
    where autograd sends it."""
    return [None if t is None else t.view_as(t) for t in tensors]


def empty_like_none(t: Tensor | None, like: Tensor) -> Tensor:
    """custom ops cannot return None: an empty tensor stands for 'no gradient'."""
    return like.new_empty(0) if t is None else t


def none_if_empty(t: Tensor) -> Tensor | None:
    return None if t.numel() == 0 and t.dim() == 1 and t.shape[0] == 0 else t


# LAYERNORM_BACKEND, read once at import for lean_input (the full path reads it on every call)
_ENV_BACKEND = bool(os.environ.get("LAYERNORM_BACKEND"))


def backend_forced() -> bool:
    """True where a backend is forced (``LAYERNORM_BACKEND``, read once at import, or
    :func:`layernorm.backend.force_backend`): then the ops' full path runs, which honours it."""
    return _ENV_BACKEND or _forced_backend.get() is not None


def aten_input(x: object, eps: object) -> bool:
    """True when ``x`` may go to one of torch's own ATen ops in place of ours where the formula is
    the same (the modules' ``torch.layer_norm`` / ``torch.rms_norm`` routes): a plain CPU tensor
    of a float dtype, a valid ``eps``, no forced backend, not under Dynamo (which cannot trace the
    ContextVar) nor ``torch.jit.trace`` (the route depends on the input's size, which a trace
    would freeze). Anything else takes the full path, which names what is wrong.

    Unlike :func:`lean_input` no other tracer is asked about: ``make_fx``, the functorch
    transforms and forward-mode AD record or transform an ATen op as they do the ops of the full
    path, where a direct kernel call would be invisible to them. ``LAYERNORM_BACKEND`` is read
    once, at import, for this check (the full path reads it on every call)."""
    return (
        type(x) is Tensor
        and type(eps) is float
        and 0.0 < eps < math.inf
        and x.is_cpu
        and x.dtype in FLOAT_DTYPES
        and not _is_compiling()  # before the ContextVar: False under Dynamo
        and _tracing_state() is None
        and not (_ENV_BACKEND or _forced_backend.get() is not None)  # backend_forced()
    )


def lean_input(x: object, eps: object) -> bool:
    """True when ``x`` may skip the full checks and go to a kernel called directly: an
    :func:`aten_input` and no other tracer either (vmap, fake tensors, make_fx, forward AD: a
    direct call would be invisible to them: :func:`transformed`). The caller checks the shapes
    (or lets torch's kernel refuse them and falls back to the full path for the message). Under
    1 µs: every call pays it. (:func:`transformed`'s checks written out: a per-token call's code
    is out of the caches when it comes round again, and there each frame of its Python costs
    about as much as the checks in it.)"""
    return aten_input(x, eps) and not (
        _functorch_active() or _dispatch_modes() > 0 or _forward_ad._current_level >= 0
    )


# Up to this many elements (4 MiB of float32) a plain layer norm that needs gradients runs torch's
# native kernel in the modules (layernorm.modules.normalization; the recurrent layers' input
# projection has a limit of its own, recurrent._fused.TORCH_PROJECTION_NUMEL): the same formula,
# and there our autograd.Function's Python (about 0.1 ms a forward and backward more than
# torch's C++ node) costs more than the fused kernels save. Forward + backward, fused / torch,
# timed in turn in one process, AMD EPYC (AVX2), one and two threads, rows of 128, 768 and 4096:
# 2^18 elements 1.28-1.41 and 1.52-1.61, 2^19 1.14-1.27 and 1.28-1.50, 2^20 1.00-1.29 and
# 1.17-1.50, 2^21 0.78-1.00 and 0.90-1.00 (rows of 128 with two threads: 0.60 by the median,
# 1.54 by the first quartile), 2^22 0.69-0.98 and 0.76-1.15. Timed alone, each without the other
# between its calls, the two were even at 2^20 (and the fused kernels took no page faults where
# torch took 40-100 a call): the gap there is the other work's effect on the caches as much as
# the Python. From 8 MiB on torch's outputs take fresh pages on every call where the fused
# kernels reuse theirs.
TORCH_KERNEL_NUMEL = 1 << 20
#: Below this many bytes a layer norm that needs no gradient runs torch's kernel (the same
#: forward formula; on a per-token call the cost is the Python around it): the buffer cache's
#: output size, from which the fused kernels write into reused memory where torch's output takes
#: fresh pages on every call (3x torch's time at 32 MiB). Below it the fused forward kernel took
#: 0.73-0.88 of torch.nn.LayerNorm's time from 2^19 elements on when the two alternated
#: (``benchmarks/ab_norm_routes.py``: float32 (1024, 768) 0.79, (256, 4096) 0.73), but 1.18-1.20
#: at (1024, 768) among the modules' other calls (``bench_norms_cpu.py``; AMD EPYC Zen 5, one
#: thread, RESULTS.md 2026-11-28): no size below it where it wins either way.
TORCH_INFERENCE_BYTES = buffers.OUTPUT_MIN_BYTES
#: The dtypes whose gradients torch's CPU layer norm gives within the fused kernels' tolerances
#: (torch's bfloat16 and float16 backward gave dx errors 1.6x the fused kernels' bfloat16
#: tolerance at 37 rows of 7, where the fused kernels compute in float32).
TORCH_BACKWARD_DTYPES = (torch.float32, torch.float64)
#: Up to this many elements a bfloat16 / float16 layer norm that needs gradients runs torch's
#: float32 kernel on the input converted exactly, its output rounded once to the input's dtype:
#: the fused kernels' error model (float32 arithmetic, one rounding; dx rounded once from float32
#: by the cast's backward), at torch's C++ cost. Forward + backward against torch.nn.LayerNorm in
#: bfloat16, timed in turn, rows of 768, one thread, AMD EPYC (AVX-512): (1, 768) 1.21x, (8, 768)
#: 1.16, (64, 768) 1.05, (128, 768) 1.01, (300, 768) 1.08, where the fused kernels took 2.52,
#: 2.28, 1.54, 1.27, 1.21; from (341, 768) (the float32 copies 1 MiB each) 2.47-3.11, the fused
#: kernels 0.91-1.24.
TORCH_FLOAT32_NUMEL = 1 << 17


def torch_layer_norm(
    x: Tensor,
    shape: tuple[int, ...],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: object,
    detaching: bool = False,
) -> Tensor | None:
    """Layer norm by torch's own kernel where it computes the fused kernels' formula (to their
    tolerance, but for rows whose mean is far above their spread: see
    :class:`layernorm.LayerNorm`), or ``None`` where the caller runs the fused path (which also
    names what is wrong with a shape or parameter torch refuses). What
    :class:`layernorm.LayerNorm` and the recurrent cells' layer norms do first on a per-token
    call, where torch's C++ node costs less than a custom op's Python.

    On an :func:`aten_input` ``x``: where nothing needs a gradient, ``torch.layer_norm`` itself
    (the same forward formula) below :data:`TORCH_INFERENCE_BYTES`; with gradients, up to
    :data:`TORCH_KERNEL_NUMEL` elements in
    :data:`TORCH_BACKWARD_DTYPES`, and in bfloat16 / float16 up to :data:`TORCH_FLOAT32_NUMEL`
    with parameters in x's dtype or float32, torch's float32 kernel on x converted exactly, the
    result rounded once back (the casts' backward rounds dx once from float32 and dγ/dβ, summed
    in float32, to the parameters' dtype). ``detaching`` (a DetachNorm flag, which changes the
    backward) leaves gradients to the fused path, and under a transform that may take a
    derivative without autograd's graph the forward too."""
    if not aten_input(x, eps):
        return None
    if detaching and transformed():
        return None  # a derivative may be taken without autograd's graph: DetachNorm's own
    in_float32 = False
    if not needs_grad(x, weight, bias):
        if x.nbytes >= TORCH_INFERENCE_BYTES:
            return None
    elif detaching:
        return None
    elif x.dtype in TORCH_BACKWARD_DTYPES:
        if x.numel() > TORCH_KERNEL_NUMEL:
            return None
    elif x.dtype in HALF_DTYPES and x.numel() <= TORCH_FLOAT32_NUMEL:
        params = [p.dtype for p in (weight, bias) if p is not None]
        if not all(dt is x.dtype or dt is torch.float32 for dt in params):
            return None
        in_float32 = True
    else:
        return None
    try:
        if in_float32:
            f32 = torch.float32
            w = None if weight is None else weight.to(f32)
            b = None if bias is None else bias.to(f32)
            return torch.layer_norm(x.to(f32), shape, w, b, eps).to(x.dtype)  # type: ignore[arg-type]
        return torch.layer_norm(x, shape, weight, bias, eps)  # type: ignore[arg-type]
    except RuntimeError:
        return None  # a shape or parameter torch refuses: the full path names it (or runs it)


def needs_grad(x: Tensor, *params: Tensor | None) -> bool:
    """Whether autograd records an op on ``x`` and ``params`` now."""
    if not torch.is_grad_enabled():
        return False
    return x.requires_grad or any(p is not None and p.requires_grad for p in params)
