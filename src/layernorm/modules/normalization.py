"""``torch.nn``-style modules for layer norm, LN-simple, DetachNorm, RMSNorm and AdaNorm.

:class:`LayerNorm` and :class:`RMSNorm` subclass :class:`torch.nn.LayerNorm` and
:class:`torch.nn.RMSNorm`, so code that finds norms by type (weight-decay splits, mixed-precision
and FSDP policies) treats them as norms. Each ``forward`` takes a lean path when it can:
``LayerNorm`` calls ``torch.layer_norm`` for a plain CPU tensor (see
:func:`layernorm.ops._dispatch.aten_input`) where the formula is the same, ``RMSNorm`` its forward
kernel where no tracer watches either (:func:`layernorm.ops._dispatch.lean_input`). The checks are
a few attribute reads, so a (1, 768) call costs about what ``torch.nn.LayerNorm``'s does.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

from .. import functional as F
from .._torchscript import NotScriptable
from .._validation import (
    HALF_DTYPES,
    ShapeLike,
    as_shape,
    check_eps,
    check_finite_scalar,
    check_flag,
)
from ..kernels.cpu import torch_ops
from ..ops._dispatch import TORCH_KERNEL_NUMEL, aten_input, needs_grad, torch_layer_norm

# Up to this many elements a float32 / float64 LayerNorm that needs gradients runs torch's native
# kernel (see layernorm.ops._dispatch.torch_layer_norm and the measures at TORCH_KERNEL_NUMEL
# there); half inputs and DetachNorm take the fused kernels' C++ node first.
SMALL_NUMEL = TORCH_KERNEL_NUMEL


# The dtypes in which RMSNorm's calls that need no gradient may run torch's rms_norm: it computes
# in x's dtype there, within the fused kernels' tolerance (float32 rows of 768 to 2^20 elements:
# 2.6-3.0e-7 from float64, ours 1.8-2.1e-7); a call of per-token size is mostly its Python.
# bfloat16 and float16 where torch's kernel rounds once (_torch_rms_norm_rounds_once).
_TORCH_RMS_DTYPES = (torch.float32, torch.float64)
# Up to this many elements a float32 / float64 RMSNorm that needs gradients takes torch.rms_norm
# too: torch's composition of ATen ops, whose autograd costs less than the fused path's
# autograd.Function there and more from here on. Forward + backward, module call, one thread,
# AMD EPYC Zen 5, fused / torch.rms_norm µs: (1, 768) 60.1 / 47.8, (8, 768) 60.6 / 56.8,
# (2, 4096) 64.0 / 60.5, (64, 128) 60.8 / 60.2, (12, 768) 61.7 / 63.0, (16, 768) 62.9 / 68.0,
# (32, 768) 67.5 / 85.7 (at (512, 768) 191 / 1964). Its outputs and gradients were within the
# fused kernels' bounds against float64 on 1188 float32 cases of up to 16384 elements (rows of
# 1 to 4096, scales 1e-3 to 1e4, offsets to 1e4, eps 1e-12 to 1e-3, constant and nearly
# constant rows; tests/test_modules.py checks a set of them).
_TORCH_RMS_GRAD_NUMEL = 1 << 13
# Below this many elements (per dtype) an RMSNorm call that needs no gradient takes
# torch.rms_norm, from there the fused forward kernel: torch's CPU rms_norm is a composition of
# ATen ops (a pass each, temporaries as large as x, half inputs converted), which the one-pass
# kernel outruns once the rows outweigh the call. Module calls under no_grad, x torch.nn.RMSNorm's
# time, torch's kernel / the fused one, in turn in one process, AMD EPYC Zen 5
# (benchmarks/ab_norm_routes.py, RESULTS.md 2026-11-28): one thread, float32 (32, 768) 1.12 /
# 1.32, (64, 768) 1.11 / 1.08, (96, 768) 1.11 / 0.92, (8, 4096) 1.17 / 1.28, (512, 768) 0.96 /
# 0.12; bfloat16 (16, 768) 1.13 / 1.28, (32, 768) 1.10 / 1.10, (8, 4096) 1.10 / 1.02, (64, 768)
# 1.11 / 0.90, (512, 768) 1.01 / 0.06; float64 (32, 768) 1.15 / 1.13, (64, 768) 1.09 / 0.81; two
# threads, float32 (64, 768) 1.11 / 1.15, (96, 768) 1.09 / 1.01; bfloat16 (32, 768) 1.10 / 1.07,
# (8, 4096) 1.11 / 0.89; float64 (64, 768) 1.13 / 1.09.
_TORCH_RMS_NUMEL: dict[torch.dtype, int] = {
    torch.float32: 1 << 16, torch.float64: 1 << 15, torch.bfloat16: 1 << 15, torch.float16: 1 << 15,
}  # fmt: skip


@functools.cache
def _torch_rms_norm_rounds_once(dtype: torch.dtype) -> bool:
    """Whether ``torch.rms_norm`` on CPU tensors of half ``dtype`` computes as the fused kernels
    do, float32 statistics and one rounding of ``x·rstd·g`` to ``dtype``, so that
    :class:`RMSNorm` may run it where nothing needs a gradient (PyTorch versions differ: a
    composition that rounds ``x·rstd`` before the gain's product rounds twice). Asked once per
    dtype of a probe, 8 rows of 512 with |x| in [0.25, 4] and |g| in [0.5, 2] (no result near the
    subnormals): every output within the dtype's unit roundoff (2^-8 bfloat16, 2^-11 float16,
    relative, with 1/1000 of it for float32's own rounding) of float64 on the same inputs. Twice
    rounded, a few per cent of such outputs land past it (a test checks the probe refuses that).
    torch 2.13 on an AMD EPYC: bfloat16 bit for bit the fused kernels' results."""
    # CPU float32 whatever the default device and dtype are set to
    cpu = {"device": "cpu", "dtype": torch.float32}
    gen = torch.Generator().manual_seed(0)
    sign = torch.randint(0, 2, (8, 512), generator=gen, device="cpu") * 2 - 1
    x = (sign * torch.empty(8, 512, **cpu).uniform_(0.25, 4.0, generator=gen)).to(dtype)
    g = torch.empty(512, **cpu).uniform_(0.5, 2.0, generator=gen).to(dtype)
    eps = F._RMS_DEFAULT_EPS[dtype]
    with torch.no_grad():
        try:
            y = torch.rms_norm(x, (512,), g, eps).double()
        except RuntimeError:
            return False
    xd = x.double()
    ref = xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + eps) * g.double()
    unit = torch.finfo(dtype).eps / 2
    return bool(((y - ref).abs() <= unit * 1.001 * ref.abs()).all())


def _takes_torch_rms_norm(x: Tensor, shape: tuple[int, ...], weight: Tensor | None) -> bool:
    """Whether :class:`RMSNorm` runs ``torch.rms_norm`` on an :func:`aten_input` ``x``: where
    nothing needs a gradient, in float32 or float64, or in bfloat16 / float16 where torch's kernel
    rounds once (:func:`_torch_rms_norm_rounds_once`), with a gain of x's dtype (torch's kernel
    then computes as the fused kernels do), x's trailing sizes ``shape``, below
    :data:`_TORCH_RMS_NUMEL` elements; with gradients, in float32 or float64 up to
    :data:`_TORCH_RMS_GRAD_NUMEL` elements."""
    dtype = x.dtype
    if weight is not None and weight.dtype is not dtype:
        return False
    if dtype not in _TORCH_RMS_DTYPES and not (
        dtype in HALF_DTYPES and _torch_rms_norm_rounds_once(dtype)
    ):
        return False
    k = len(shape)  # x's trailing sizes (one: no slice of x.shape made, a per-token call's µs)
    if not (x.dim() >= 1 and x.shape[-1] == shape[0] if k == 1 else
            x.dim() >= k and x.shape[x.dim() - k :] == shape):  # fmt: skip
        return False  # the full path names the mismatch
    if not needs_grad(x, weight):
        return x.numel() < _TORCH_RMS_NUMEL[dtype]
    return dtype in _TORCH_RMS_DTYPES and x.numel() <= _TORCH_RMS_GRAD_NUMEL


def _gain(weight: Tensor | None, offset: float) -> Tensor | None:
    """The gain ``offset + weight``; in float32 for half weights, as Gemma computes it."""
    if weight is None or not offset:
        return weight
    return (weight.float() if weight.dtype in HALF_DTYPES else weight) + offset


def _keep_off_fused_paths(module: nn.Module, args: tuple[Any, ...]) -> None:
    """No-op forward pre-hook of a :class:`LayerNorm` with a gain offset.

    ``torch.nn.TransformerEncoderLayer``'s fused inference kernel reads ``norm.weight`` and runs
    torch's own layer norm, which knows no offset; it steps aside when a submodule has hooks."""
    return None


def _check_offset(offset: object, affine: bool, owner: str) -> float:
    value = check_finite_scalar(offset, "gain_offset", owner)
    if value and not affine:
        raise ValueError(
            f"{owner}: gain_offset={value!r} needs elementwise_affine=True (there is no gain to "
            "offset), got elementwise_affine=False"
        )
    return value


# what _parameters.get gives for a name not registered there (see _affine)
_ABSENT = object()


def _affine(module: nn.Module) -> tuple[Any, Any]:
    """``(module.weight, module.bias)``, read from ``module._parameters`` where they are
    registered there: ``nn.Module.__getattr__`` costs 0.3-1 µs an attribute, a tenth of a
    per-token norm's Python (Intel Xeon, 2026-11-28). A parametrization (or the old
    ``weight_norm`` hook) moves the tensor out of ``_parameters``, and a module without a bias
    (``RMSNorm``) has it as a class attribute: those are read as attributes, as torch reads them."""
    params = module._parameters
    weight, bias = params.get("weight", _ABSENT), params.get("bias", _ABSENT)
    if weight is _ABSENT:
        weight = module.weight
    if bias is _ABSENT:
        bias = module.bias
    return weight, bias


class LayerNorm(NotScriptable, nn.LayerNorm):
    r"""Layer normalization (Ba, Kiros & Hinton 2016), a subclass of :class:`torch.nn.LayerNorm`.

    .. math:: y = (c + g) \odot \frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}} + b

    with the gain offset :math:`c` 0 unless set. μ and σ² (biased) are computed per example over
    the last ``len(normalized_shape)`` dims, the same at training and test time, so it works with
    batch size 1. Constructor arguments, attributes and state_dict keys are
    ``torch.nn.LayerNorm``'s, so checkpoints load either way and ``isinstance(m, nn.LayerNorm)``
    holds.

    Which kernel runs: in plain eager mode on the CPU, a call with gradients in bfloat16 or
    float16, or with a DetachNorm flag, of under 2 MiB runs the fused kernels through their C++
    operator (:mod:`layernorm.kernels.cpu.torch_ops`). Otherwise, when nothing needs a gradient
    (``no_grad``,
    inference; inputs under 32 MiB, see :data:`layernorm.ops._dispatch.TORCH_INFERENCE_BYTES`)
    or, in float32 and float64, the input has at most :data:`SMALL_NUMEL` elements and no
    DetachNorm flag is set, torch's native ``layer_norm`` runs — the same formula (DetachNorm
    changes only the backward), and at these sizes the call overhead is the cost; in bfloat16
    and float16 with gradients, up to :data:`layernorm.ops._dispatch.TORCH_FLOAT32_NUMEL`
    elements, torch's float32 kernel on the input converted exactly, rounded once back (the fused
    kernels' error model). Otherwise the
    fused kernels of :mod:`layernorm.ops` do, with their analytic backward. The two differ on
    rows whose mean is far above their spread: float32 rows of 10⁴ plus noise of 10⁻³ come out of
    torch's kernel 0.04 off, of the fused kernels 10⁻⁷ off (their statistics are shifted by the
    row's first element, see the kernels' error model); :func:`layernorm.layer_norm` always runs
    the fused kernels.

    Args:
        normalized_shape: trailing shape normalized together.
        eps: added to the variance inside the square root. Default ``1e-5``.
        elementwise_affine: learn a gain ``g`` (init 1) and bias ``b`` (init 0). ``False`` gives
            *LN-simple* (Xu et al. 2019).
        bias: learn ``b`` too (only with ``elementwise_affine``).
        device, dtype: of the gain and bias, as in ``torch.nn`` modules.
        detach_mean, detach_std: *DetachNorm* (Xu et al. 2019): no gradient through μ / σ.
        gain_offset: the stored ``weight`` is the gain minus this (init ``1 - gain_offset``), as
            Gemma's norms store it (``1 + weight``); keeps such checkpoints loadable as they are.
            Fixed at construction.

    Shape:
        input ``(*, *normalized_shape)``, output the same.

    Example::

        >>> import torch, layernorm
        >>> ln = layernorm.LayerNorm(512)
        >>> y = ln(torch.randn(8, 20, 512))
        >>> isinstance(ln, torch.nn.LayerNorm)
        True
        >>> detach_norm = layernorm.LayerNorm(512, elementwise_affine=False,
        ...                                   detach_mean=True, detach_std=True)
    """

    def __init__(
        self,
        normalized_shape: ShapeLike,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        detach_mean: bool = False,
        detach_std: bool = False,
        gain_offset: float = 0.0,
    ) -> None:
        shape = as_shape(normalized_shape)
        eps_ = check_eps(eps, "LayerNorm")
        affine = check_flag(elementwise_affine, "elementwise_affine", "LayerNorm")
        bias = check_flag(bias, "bias", "LayerNorm")
        offset = _check_offset(gain_offset, affine, "LayerNorm")
        detach_mean = check_flag(detach_mean, "detach_mean", "LayerNorm")
        detach_std = check_flag(detach_std, "detach_std", "LayerNorm")
        # torch's __init__ ends in reset_parameters, which reads the offset
        self.__dict__["gain_offset"] = offset
        super().__init__(shape, eps_, affine, bias, device=device, dtype=dtype)  # type: ignore[arg-type]
        self.detach_mean = detach_mean
        self.detach_std = detach_std
        if offset:
            self.register_forward_pre_hook(_keep_off_fused_paths)

    def reset_parameters(self) -> None:
        """Gain 1 and bias 0, as in the paper (Section 6)."""
        if self.weight is not None:
            nn.init.constant_(self.weight, 1.0 - self.gain_offset)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        shape, eps = self.normalized_shape, self.eps
        weight, bias = _affine(self)
        if self.gain_offset:
            weight = _gain(weight, self.gain_offset)
        # with gradients, the C++ node first for DetachNorm (torch has no route for its
        # backward) and for half x (torch's route is its float32 kernel on converted rows, five
        # autograd nodes, 1.5-1.7x torch.nn.LayerNorm's time at (1 | 8, 768) where the node took
        # 1.2-1.3); float32 keeps torch's kernel, whose call costs less from here
        dm, ds = self.detach_mean, self.detach_std
        if (
            type(x) is Tensor
            and needs_grad(x, weight, bias)  # first: a forward without gradients pays no more
            and (dm or ds or x.dtype in HALF_DTYPES)
            and F._takes_node(x, shape, eps, weight, bias, grad=True)
        ):
            return torch_ops.layer_norm(x, weight, bias, eps, dm, ds)  # type: ignore[arg-type]
        y = torch_layer_norm(x, shape, weight, bias, eps, dm or ds)
        if y is not None:
            return y
        return F.layer_norm(
            x, shape, weight, bias, eps, detach_mean=dm, detach_std=ds,  # type: ignore[arg-type]
        )  # fmt: skip

    def extra_repr(self) -> str:
        # torch.nn.LayerNorm's repr word for word, then our options when set
        s = super().extra_repr()
        if self.detach_mean:
            s += ", detach_mean=True"
        if self.detach_std:
            s += ", detach_std=True"
        if self.gain_offset:
            s += f", gain_offset={self.gain_offset}"
        return s


class RMSNorm(NotScriptable, nn.RMSNorm):
    r"""RMSNorm (Zhang & Sennrich 2019), a subclass of :class:`torch.nn.RMSNorm`.

    .. math:: y = (c + g) \odot \frac{x}{\sqrt{\frac{1}{N}\sum_i x_i^2 + \epsilon}}

    with the gain offset :math:`c` 0 unless set. ``eps=None`` uses the machine epsilon of the
    statistics' dtype like torch (float32's for half inputs). Constructor arguments, attributes and
    the state_dict (``weight`` only, shape ``normalized_shape``) are ``torch.nn.RMSNorm``'s.

    Which kernel runs: the fused kernels of :mod:`layernorm.ops`; on the CPU a small call
    through their C++ operator (:mod:`layernorm.kernels.cpu.torch_ops`), whose autograd node
    costs less than torch's own ``rms_norm`` (a composition of ATen ops). Where that operator
    cannot be built (no C++ compiler), a small input that needs no gradient (below 2^16 elements
    in float32, 2^15 in float64, bfloat16 and float16) with a gain of its dtype takes torch's
    ``rms_norm`` (the same formula, within the same tolerance), and with gradients a float32 or
    float64 input of at most 8192 elements too (its autograd costs less than the Python path's
    there; outputs and gradients within the fused kernels' tolerance).

    Args:
        normalized_shape: trailing shape normalized together.
        eps: added to the mean square inside the square root; ``None`` as above.
        elementwise_affine: learn a gain ``g`` (init 1).
        device, dtype: of the gain, as in ``torch.nn`` modules.
        gain_offset: the stored ``weight`` is the gain minus this (init ``1 - gain_offset``):
            Gemma's ``GemmaRMSNorm`` computes ``(1 + weight) * x̂``, i.e. ``gain_offset=1``.
            Fixed at construction.

    Example::

        >>> import torch, layernorm
        >>> rms = layernorm.RMSNorm(64, eps=1e-6)
        >>> isinstance(rms, torch.nn.RMSNorm)
        True
        >>> y = rms(torch.randn(2, 5, 64))
    """

    # No bias, as torch's; kept as ``None`` for code that reads ``.bias`` of every norm.
    bias: None = None

    def __init__(
        self,
        normalized_shape: ShapeLike,
        eps: float | None = None,
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        gain_offset: float = 0.0,
    ) -> None:
        shape = as_shape(normalized_shape)
        eps_ = check_eps(eps, "RMSNorm", allow_none=True)
        affine = check_flag(elementwise_affine, "elementwise_affine", "RMSNorm")
        offset = _check_offset(gain_offset, affine, "RMSNorm")
        self.__dict__["gain_offset"] = offset
        super().__init__(shape, eps_, affine, device=device, dtype=dtype)  # type: ignore[arg-type]

    def reset_parameters(self) -> None:
        """Gain 1."""
        if self.weight is not None:
            nn.init.constant_(self.weight, 1.0 - self.gain_offset)

    def forward(self, x: Tensor) -> Tensor:
        shape, eps = self.normalized_shape, self.eps
        weight, _ = _affine(self)
        if self.gain_offset:
            weight = _gain(weight, self.gain_offset)
        if eps is None and type(x) is Tensor:
            eps = F._RMS_DEFAULT_EPS.get(x.dtype)
        # torch's rms_norm only where the fused kernels have no C++ operator to beat it
        if (
            aten_input(x, eps)
            and not torch_ops.enabled()
            and _takes_torch_rms_norm(x, shape, weight)
        ):
            try:
                return torch.rms_norm(x, shape, weight, eps)
            except RuntimeError:
                pass  # a shape torch refuses: the full path names it
        return F._rms_norm(x, shape, weight, eps)

    def extra_repr(self) -> str:
        s = super().extra_repr()
        if self.gain_offset:
            s += f", gain_offset={self.gain_offset}"
        return s


class _Norm(NotScriptable, nn.Module):
    """AdaNorm's normalized_shape, elementwise_affine and bias handling (torch's contract)."""

    normalized_shape: tuple[int, ...]
    weight: nn.Parameter | None
    bias: nn.Parameter | None

    def _init_affine(self, elementwise_affine: bool, bias: bool, factory: dict[str, Any]) -> None:
        owner = type(self).__name__
        elementwise_affine = check_flag(elementwise_affine, "elementwise_affine", owner)
        bias = check_flag(bias, "bias", owner)
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, **factory))
            if bias:
                self.bias = nn.Parameter(torch.empty(self.normalized_shape, **factory))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Gain 1 and bias 0."""
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class AdaNorm(_Norm):
    r"""AdaNorm (Xu et al. 2019): LN-simple rescaled by a detached, input-adaptive factor.

    .. math:: z = C\,(1 - k\,y) \odot y, \qquad y = \frac{x - \mu}{\sigma}

    with :math:`C(1-ky)` a constant in backward. The paper's AdaNorm has no gain or bias
    (``elementwise_affine=False``, the default); ``elementwise_affine=True`` adds ``g ⊙ z + b`` on
    top for experiments.

    Args:
        normalized_shape: trailing shape normalized together.
        k: the slope of φ; the paper uses 1/10.
        scale: ``C``.
        eps: added to the variance inside the square root.
        elementwise_affine: add a learned gain ``g`` (init 1) and bias ``b`` (init 0) after φ;
            not in the paper.
        bias: learn ``b`` too (only with ``elementwise_affine``).
        device, dtype: of the gain and bias, as in ``torch.nn`` modules.
    """

    def __init__(
        self,
        normalized_shape: ShapeLike,
        k: float = 0.1,
        scale: float = 1.0,
        eps: float = 1e-5,
        elementwise_affine: bool = False,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = as_shape(normalized_shape)
        self.k = check_finite_scalar(k, "k", "AdaNorm")
        self.scale = check_finite_scalar(scale, "scale", "AdaNorm")
        self.eps = check_eps(eps, "AdaNorm")
        self._init_affine(elementwise_affine, bias, {"device": device, "dtype": dtype})

    def forward(self, x: Tensor) -> Tensor:
        k, scale, eps = self.k, self.scale, self.eps
        params = self._parameters
        if (
            params.get("weight", _ABSENT) is None  # the paper's module: gain and bias registered
            and params.get("bias", _ABSENT) is None  # as None (see _affine)
            and F._finite_numbers(k, scale)
            and F._takes_node(x, self.normalized_shape, eps)
        ):
            # the C++ operator, as F.ada_norm would call it, without F.ada_norm's frame (a
            # per-token call's Python is most of its time)
            return torch_ops.ada_norm(x, float(k), float(scale), eps)  # type: ignore[arg-type]
        z = F.ada_norm(x, self.normalized_shape, k, scale, eps)  # type: ignore[arg-type]
        # the paper's module, whose gain and bias are registered as None, returns z as it is
        weight, bias = _affine(self)
        if weight is None and bias is None:
            return z
        out = z
        if weight is not None:
            out = out * weight
        if bias is not None:
            out = out + bias
        # like LayerNorm, the output keeps the input's dtype (float32 gains on half activations)
        return out.to(z.dtype)

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, k={self.k}, scale={self.scale}, eps={self.eps}, "
            f"elementwise_affine={self.elementwise_affine}"
        )
