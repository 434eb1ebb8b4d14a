"""Functional normalization ops: layer norm (and LN-simple, DetachNorm), RMSNorm and AdaNorm.

Each op normalizes every example over its trailing ``normalized_shape`` dimensions. Inputs of any
rank and layout are flattened to ``(M, N)`` rows and handed to a custom op with an analytic backward
(:mod:`layernorm.ops`), which runs on fused C kernels on CPU (float32, float64, and bfloat16/float16
computed in float32; PyTorch's ATen ops for other dtype mixes or without a C compiler) and on
Triton kernels for CUDA tensors. Under
``torch.func`` derivative transforms and forward-mode AD the differentiable reference
(:mod:`layernorm.reference`) runs instead. The modules in :mod:`layernorm.modules` wrap these
functions.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._validation import (
    FLOAT_DTYPES,
    ShapeLike,
    as_shape,
    check_eps,
    check_finite_scalar,
    check_flag,
    check_input,
    check_param,
    stats_dtype,
)
from .kernels.cpu import abi, buffers, torch_ops
from .ops._dispatch import cpu_kernels, lean_input, needs_grad
from .ops.ada_norm import ada_norm_rows, ada_norm_rows_eager
from .ops.layer_norm import layer_norm_rows, layer_norm_rows_eager
from .ops.rms_norm import rms_norm_rows, rms_norm_rows_eager

__all__ = ["ada_norm", "layer_norm", "rms_norm"]

# rms_norm's eps=None per input dtype: the machine epsilon of the statistics' dtype, as torch takes
# the epsilon of its accumulation type, not of a half input (9.8e-4 for float16 would dwarf
# mean(x²) of small activations)
_RMS_DEFAULT_EPS = {dt: float(torch.finfo(stats_dtype(dt)).eps) for dt in FLOAT_DTYPES}


def _rows(x: Tensor, normalized_shape: tuple[int, ...]) -> Tensor:
    """View ``x`` as contiguous ``(M, N)`` rows, N = prod(normalized_shape)."""
    n = math.prod(normalized_shape)
    if torch._C._get_tracing_state() is not None:  # torch.jit.is_tracing(), at half the cost
        # A traced module replays these ops on later inputs, which nothing else checks: a reshape
        # to x's own leading sizes (recorded as sizes of the input) and N fails where the trailing
        # sizes do not multiply to N; to (-1, N) an input of (2, 3, 8) for N = 4 would pass.
        return x.reshape(*x.shape[: x.dim() - len(normalized_shape)], n).reshape(-1, n).contiguous()
    if len(normalized_shape) == 1 and x.dim() == 2 and x.is_contiguous():
        return x  # already rows; skipping reshape saves microseconds on small inputs
    return x.reshape(-1, n).contiguous()


def _flat(p: Tensor | None) -> Tensor | None:
    if p is None or (p.dim() == 1 and p.is_contiguous()):
        return p
    return p.reshape(-1).contiguous()


def _unrows(y: Tensor, x: Tensor, normalized_shape: tuple[int, ...]) -> Tensor:
    """``y`` in ``x``'s shape; no view (nor its autograd node) when the shapes already agree."""
    if len(normalized_shape) == 1 and x.dim() == 2:
        return y
    return y.view(x.shape)


def layer_norm(
    x: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    detach_mean: bool = False,
    detach_std: bool = False,
) -> Tensor:
    r"""Layer normalization (Ba, Kiros & Hinton 2016, Eq. 3) over the trailing dims of each example.

    .. math::
        \mu = \frac{1}{N}\sum_i x_i,\qquad
        \sigma = \sqrt{\frac{1}{N}\sum_i (x_i-\mu)^2 + \epsilon},\qquad
        y = g \odot \frac{x-\mu}{\sigma} + b

    The variance is biased (like ``torch.var(x, unbiased=False)``) and ``eps`` sits inside the
    square root, exactly as :func:`torch.nn.functional.layer_norm`. Without ``weight`` and ``bias``
    this is *LN-simple* (Xu et al. 2019).

    Args:
        x: input of shape ``(*, *normalized_shape)``; float64/32/16 or bfloat16.
        normalized_shape: the trailing dimensions normalized together (an int or a tuple).
        weight: the gain ``g`` of shape ``normalized_shape``, or ``None``.
        bias: the bias ``b`` of shape ``normalized_shape``, or ``None``.
        eps: added to the variance; must be positive.
        detach_mean: *DetachNorm* — treat μ as a constant in backward (same forward).
        detach_std: *DetachNorm* — treat σ as a constant in backward (same forward).

    Returns:
        A tensor of ``x``'s shape and dtype. See :class:`layernorm.LayerNorm`.
    """
    flags = type(detach_mean) is bool and type(detach_std) is bool
    if flags and _takes_node(x, normalized_shape, eps, weight, bias):
        return torch_ops.layer_norm(x, weight, bias, eps, detach_mean, detach_std)  # type: ignore[arg-type]
    lean = _lean_shape(x, normalized_shape, eps, weight, bias)
    if lean is not None and flags:
        rows = _rows(x, lean)  # type: ignore[arg-type]
        w, b, kernels = _flat(weight), _flat(bias), cpu_kernels("layer_norm")
        y = layer_norm_rows_eager(rows, w, b, eps, detach_mean, detach_std, kernels)  # type: ignore[arg-type]
        return _unrows(y, x, lean)  # type: ignore[arg-type]
    x, shape = check_input(x, normalized_shape, "layer_norm")
    weight = check_param(weight, "weight", shape, x, "layer_norm")
    bias = check_param(bias, "bias", shape, x, "layer_norm")
    eps_ = check_eps(eps, "layer_norm")
    assert eps_ is not None
    dm = check_flag(detach_mean, "detach_mean", "layer_norm")
    ds = check_flag(detach_std, "detach_std", "layer_norm")
    y = layer_norm_rows(_rows(x, shape), _flat(weight), _flat(bias), eps_, dm, ds)
    return _unrows(y, x, shape)


def rms_norm(
    x: Tensor,
    normalized_shape: ShapeLike,
    weight: Tensor | None = None,
    eps: float | None = None,
) -> Tensor:
    r"""Root-mean-square normalization (Zhang & Sennrich 2019).

    .. math:: y = g \odot \frac{x}{\sqrt{\frac{1}{N}\sum_i x_i^2 + \epsilon}}

    Same contract and result as :func:`torch.nn.functional.rms_norm`: ``eps=None`` means the
    machine epsilon of the dtype the statistics are computed in: ``torch.finfo(x.dtype).eps`` for
    float32/float64 and float32's (1.19e-7) for float16/bfloat16, as torch's kernel does. No
    re-centering, so it is not invariant to shifting the input.
    See :class:`layernorm.RMSNorm`.
    """
    return _rms_norm(x, normalized_shape, weight, eps)


def _rms_norm(
    x: Tensor, normalized_shape: ShapeLike, weight: Tensor | None, eps: float | None
) -> Tensor:
    """:func:`rms_norm`, by the lean path (:func:`_rms_norm_lean`) where it can."""
    if type(x) is Tensor:  # x.dtype for eps=None; _lean_shape checks the rest
        y = _rms_norm_lean(
            x, normalized_shape, weight, _RMS_DEFAULT_EPS.get(x.dtype, eps) if eps is None else eps
        )
        if y is not None:
            return y
    x, shape = check_input(x, normalized_shape, "rms_norm")
    weight = check_param(weight, "weight", shape, x, "rms_norm")
    eps_ = check_eps(eps, "rms_norm", allow_none=True)
    if eps_ is None:
        eps_ = _RMS_DEFAULT_EPS[x.dtype]
    y = rms_norm_rows(_rows(x, shape), _flat(weight), eps_)
    return _unrows(y, x, shape)


def _rms_norm_lean(
    x: Tensor, normalized_shape: ShapeLike, weight: Tensor | None, eps: object
) -> Tensor | None:
    """RMSNorm by :func:`_lean_shape`'s path (the full checks skipped, the kernels or the
    autograd.Function called directly), ``None`` where it cannot take ``x`` (the full path checks,
    and names what is wrong). (The :class:`layernorm.RMSNorm` module runs torch's own
    ``rms_norm`` before this where it can: see its ``forward``.)"""
    if _takes_node(x, normalized_shape, eps, weight):
        return torch_ops.rms_norm(x, weight, eps)  # type: ignore[arg-type]
    shape = _lean_shape(x, normalized_shape, eps, weight)
    if shape is None:
        return None
    y = rms_norm_rows_eager(_rows(x, shape), _flat(weight), eps, cpu_kernels("rms_norm"))  # type: ignore[arg-type]
    return _unrows(y, x, shape)


def _lean_shape(
    x: object, normalized_shape: ShapeLike, eps: object, *params: object
) -> tuple[int, ...] | None:
    """``normalized_shape`` as a tuple where an op on ``x`` and ``params`` may skip the full checks
    and go straight to its rows' plain-eager path (:func:`layernorm.ops.layer_norm.
    layer_norm_rows_eager` and its siblings): a :func:`lean_input` ``x`` (a plain CPU float tensor,
    a valid ``eps``, no tracer) whose trailing sizes are that shape, each param ``None`` or a CPU
    float tensor of that shape (a plain tensor or a Parameter). ``None`` otherwise: the full path
    checks, and names what is wrong. A few attribute reads on every call, where the full checks
    and the dispatch to the plain-eager path took 3-7 µs more of a (1, 8) call's 60-75 µs with
    gradients (AMD EPYC, one thread; the rest is the autograd.Function and the kernel calls)."""
    if not lean_input(x, eps):
        return None
    shape = as_shape(normalized_shape)  # the full path's first check: the same error if it raises
    if len(shape) == 1:  # the common case, without slicing a torch.Size
        if x.dim() == 0 or x.shape[-1] != shape[0]:  # type: ignore[union-attr]
            return None
    elif x.dim() < len(shape) or x.shape[x.dim() - len(shape) :] != shape:  # type: ignore[union-attr]
        return None
    for p in params:
        if p is not None and not (
            type(p) in _PLAIN_TENSORS
            and p.is_cpu  # type: ignore[union-attr]
            and p.dtype in FLOAT_DTYPES  # type: ignore[union-attr]
            and p.shape == shape  # type: ignore[union-attr]
        ):
            return None
    return shape


def _takes_node(
    x: object, normalized_shape: ShapeLike, eps: object, *params: object, grad: bool | None = None
) -> bool:
    """Whether a call runs the C++ operator of :mod:`layernorm.kernels.cpu.torch_ops` on ``x`` as
    it is (its autograd node is C++, where the lean path's rows run an autograd.Function), checked
    in one pass, the first thing a lean call does: a :func:`lean_input` ``x`` whose last
    dimension is the one normalized size (an int, or a tuple, list or ``torch.Size`` of one),
    each param ``None`` or a plain tensor (or Parameter) of that size, and the operators' own
    :func:`~layernorm.kernels.cpu.torch_ops.takes` (the params' device, dtype and layout, x's
    size and layout). ``grad``: whether autograd records the call, where the caller has found it
    (:func:`needs_grad` of ``x`` and the params otherwise).

    ``takes`` (and the kernels' dtype rules it asks, ``_native.kernel_inputs``) is written out
    here rather than called: a per-token call's code is cold when it comes round again, and
    there each frame costs about a microsecond (module calls at (1, 768) among the other modules'
    calls, ``bench_norms_cpu.py``). ``tests/test_torch_ops.py`` holds it to that composition."""
    n = normalized_shape
    if type(n) in _ONE_SIZE_SEQUENCES and len(n) == 1:  # type: ignore[arg-type]
        n = n[0]  # type: ignore[index]
    if type(n) is not int or n < 1 or not lean_input(x, eps):
        return False
    if x.dim() == 0 or x.shape[-1] != n or not x.is_contiguous():  # type: ignore[union-attr]
        return False
    dtype = x.dtype  # type: ignore[union-attr]
    inst = abi.INSTANCES.get(dtype)
    if inst is None:
        return False
    compute = inst.compute_dtype
    for p in params:
        if p is not None and (
            type(p) not in _PLAIN_TENSORS
            or p.shape != (n,)  # type: ignore[attr-defined]
            or (p.dtype is not dtype and p.dtype is not compute)  # type: ignore[attr-defined]
            or not p.is_cpu  # type: ignore[attr-defined]
            or not p.is_contiguous()  # type: ignore[attr-defined]
        ):
            return False
    if grad is None:
        grad = needs_grad(x, *params)  # type: ignore[arg-type]
    limit = torch_ops.TRAINING_MAX_BYTES if grad else buffers.OUTPUT_MIN_BYTES
    return x.nbytes < limit and torch_ops.enabled()  # type: ignore[union-attr]


# The sequence types a one-size normalized shape comes in (anything else takes as_shape's path).
_ONE_SIZE_SEQUENCES = (tuple, list, torch.Size)


# What a lean call takes as a gain or bias: a tensor subclass of another kind (one that overrides
# torch functions) takes the full path, which calls torch's ops on it.
_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)


def _finite_numbers(a: object, b: object) -> bool:
    """Both plain ints or floats that the full path's :func:`check_finite_scalar` takes as they
    are (one frame for the two: see :func:`_takes_node`)."""
    return (
        (type(a) is float or type(a) is int)
        and -math.inf < a < math.inf  # type: ignore[operator]
        and (type(b) is float or type(b) is int)
        and -math.inf < b < math.inf  # type: ignore[operator]
    )


def ada_norm(
    x: Tensor,
    normalized_shape: ShapeLike,
    k: float = 0.1,
    scale: float = 1.0,
    eps: float = 1e-5,
) -> Tensor:
    r"""AdaNorm (Xu et al. 2019, "Understanding and Improving Layer Normalization", Eq. 9–10).

    .. math::
        y = \frac{x-\mu}{\sigma},\qquad z = \varphi(y) \odot y,\qquad \varphi(y) = C\,(1 - k\,y)

    with :math:`\varphi(y)` detached in backward, so :math:`\partial z/\partial y = \varphi(y)`.
    ``scale`` is :math:`C`. There is no gain or bias: AdaNorm replaces them.

    Convention: ``y`` is this library's LN-simple (biased variance, ``eps`` inside the square root),
    so AdaNorm shares the layer-norm kernels. The authors' code uses the unbiased standard deviation
    with ``eps`` added to it; for ``N`` in the hundreds the two differ by a factor
    ``sqrt((N-1)/N)`` in ``y``, well below training noise.

    See :class:`layernorm.AdaNorm`.
    """
    numbers = _finite_numbers(k, scale)
    if numbers and _takes_node(x, normalized_shape, eps):
        return torch_ops.ada_norm(x, float(k), float(scale), eps)  # type: ignore[arg-type]
    lean = _lean_shape(x, normalized_shape, eps)
    if lean is not None and numbers:
        kernels = cpu_kernels("ada_norm")
        z = ada_norm_rows_eager(_rows(x, lean), float(k), float(scale), eps, kernels)  # type: ignore[arg-type]
        return _unrows(z, x, lean)  # type: ignore[arg-type]
    x, shape = check_input(x, normalized_shape, "ada_norm")
    k_ = check_finite_scalar(k, "k", "ada_norm")
    scale_ = check_finite_scalar(scale, "scale", "ada_norm")
    eps_ = check_eps(eps, "ada_norm")
    assert eps_ is not None
    z = ada_norm_rows(_rows(x, shape), k_, scale_, eps_)
    return _unrows(z, x, shape)
