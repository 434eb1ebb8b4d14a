"""Swap the normalization layers of an existing model for another member of the family.

Which modules count as norms (the rule :func:`replace_norms` documents):

1. **Registered classes.** ``torch.nn.LayerNorm``, ``torch.nn.RMSNorm``, this library's norms and
   the norm classes of the major Hugging Face families (Llama, Mistral, Mixtral, Qwen2, Qwen3,
   Gemma 1–3, T5/mT5), named by ``module.QualName`` so that ``transformers`` need not be installed.
   A class matches when it or one of its bases is registered; :func:`register_norm` adds more.
2. **Duck typing.** A module of another class is taken as a norm when it has no submodules and no
   buffers, a ``weight`` parameter (and optionally a ``bias`` of the same shape) and nothing else,
   a real ``eps`` or ``variance_epsilon``, and its forward, run on a copy with random parameters,
   matches one registered form over the last ``weight.dim()`` dims: layer norm with gain
   ``weight`` and bias ``bias``, RMS with gain ``weight``, or RMS with gain ``1 + weight``. Nothing
   is guessed from names, and a module that fails the probe is left in place and named in the
   warning.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn

from .._validation import as_shape, check_eps, check_finite_scalar, check_flag
from .batchnorm import BatchNorm
from .normalization import AdaNorm, LayerNorm, RMSNorm

NormKind = Literal["layer", "simple", "detach", "ada", "rms"]
Stats = Literal["layer", "rms", "ada"]
_KINDS: tuple[str, ...] = get_args(NormKind)
_STATS: tuple[str, ...] = get_args(Stats)


@dataclass(frozen=True)
class NormSpec:
    """How to read a source norm.

    Attributes:
        stats: ``"layer"`` (centred: μ and σ), ``"rms"`` (root mean square, no centring) or
            ``"ada"`` (:class:`AdaNorm`).
        eps_attr: the attribute holding ε (``"eps"``; Hugging Face's RMS norms use
            ``"variance_epsilon"``).
        gain_offset: the gain is ``gain_offset + weight`` (1 for Gemma's norms, else 0).
    """

    stats: Stats
    eps_attr: str = "eps"
    gain_offset: float = 0.0


_LLAMA_LIKE = NormSpec("rms", "variance_epsilon")
_GEMMA_LIKE = NormSpec("rms", "eps", gain_offset=1.0)
_REGISTRY: dict[type | str, NormSpec] = {
    nn.LayerNorm: NormSpec("layer"),
    nn.RMSNorm: NormSpec("rms"),
    AdaNorm: NormSpec("ada"),
    # Hugging Face transformers (checked against their forward in tests/test_hf_models.py)
    "transformers.models.llama.modeling_llama.LlamaRMSNorm": _LLAMA_LIKE,
    "transformers.models.mistral.modeling_mistral.MistralRMSNorm": _LLAMA_LIKE,
    "transformers.models.mixtral.modeling_mixtral.MixtralRMSNorm": _LLAMA_LIKE,
    "transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm": _LLAMA_LIKE,
    "transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm": _LLAMA_LIKE,
    "transformers.models.t5.modeling_t5.T5LayerNorm": _LLAMA_LIKE,
    "transformers.models.mt5.modeling_mt5.MT5LayerNorm": _LLAMA_LIKE,
    "transformers.models.gemma.modeling_gemma.GemmaRMSNorm": _GEMMA_LIKE,
    "transformers.models.gemma2.modeling_gemma2.Gemma2RMSNorm": _GEMMA_LIKE,
    "transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm": _GEMMA_LIKE,
}


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_norm(
    cls: type[nn.Module] | str,
    stats: Stats,
    *,
    eps_attr: str = "eps",
    gain_offset: float = 0.0,
) -> None:
    """Teach :func:`replace_norms` a normalization class (and its subclasses).

    The class must keep its gain in ``weight`` (or have none) and any bias in ``bias``; its
    normalized shape is ``normalized_shape`` if it has one, else ``weight.shape``.

    Args:
        cls: the class, or its ``"module.QualName"`` (to register without importing it).
        stats: ``"layer"`` for :math:`g\\odot(x-\\mu)/\\sqrt{\\sigma^2+\\epsilon}+b`, ``"rms"`` for
            :math:`g\\odot x/\\sqrt{\\overline{x^2}+\\epsilon}`, ``"ada"`` for :class:`AdaNorm`.
        eps_attr: the attribute holding ε.
        gain_offset: the gain is ``gain_offset + weight``.

    Example::

        >>> import torch, layernorm
        >>> class ScaleNorm(torch.nn.Module):  # RMS with its ε under another name
        ...     def __init__(self, d): super().__init__(); self.weight = torch.nn.Parameter(
        ...         torch.ones(d)); self.epsilon = 1e-6
        ...     def forward(self, x): return self.weight * x * (x.pow(2).mean(-1, keepdim=True)
        ...                                                      + self.epsilon).rsqrt()
        >>> layernorm.modules.register_norm(ScaleNorm, "rms", eps_attr="epsilon")
        >>> model = layernorm.replace_norms(torch.nn.Sequential(ScaleNorm(8)), "rms")
        >>> type(model[0]).__name__
        'RMSNorm'
    """
    if not (isinstance(cls, str) or (isinstance(cls, type) and issubclass(cls, nn.Module))):
        raise TypeError(
            "register_norm: cls must be a torch.nn.Module subclass or its 'module.QualName', "
            f"got {type(cls).__name__} {cls!r}"
        )
    if stats not in _STATS:
        raise ValueError(f"register_norm: stats must be one of {_STATS}, got {stats!r}")
    if not isinstance(eps_attr, str) or not eps_attr.isidentifier():
        raise TypeError(f"register_norm: eps_attr must be an attribute name, got {eps_attr!r}")
    offset = check_finite_scalar(gain_offset, "gain_offset", "register_norm")
    _REGISTRY[cls] = NormSpec(stats, eps_attr, offset)


def _registered(module: nn.Module) -> NormSpec | None:
    for cls in type(module).__mro__:
        spec = _REGISTRY.get(cls) or _REGISTRY.get(_qualname(cls))
        if spec is not None:
            if isinstance(module, LayerNorm | RMSNorm) and module.gain_offset:
                return NormSpec(spec.stats, spec.eps_attr, module.gain_offset)
            return spec
    return None


def _eps_attr(module: nn.Module) -> str | None:
    for name in ("eps", "variance_epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return name
    return None


# Norms over other axes than the trailing ones: never layer norms, never probed.
_OTHER_AXES = (
    nn.modules.batchnorm._NormBase,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.CrossMapLRN2d,
    BatchNorm,
)


def _duck_spec(module: nn.Module) -> tuple[NormSpec | None, str]:
    """The spec of an unregistered module that looks like a norm, or ``None`` and why not
    (``""`` when it does not look like a norm at all)."""
    if isinstance(module, _OTHER_AXES):
        return None, ""
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    eps_attr = _eps_attr(module)
    if (
        weight is None
        or eps_attr is None
        or next(module.children(), None) is not None
        or next(module.buffers(), None) is not None
        or set(params) - {"weight", "bias"}
    ):
        return None, ""
    if "bias" in params and params["bias"].shape != weight.shape:
        return None, ""
    if weight.device.type == "meta":
        return None, "on the meta device, its form cannot be probed: register it with register_norm"
    try:
        form = _probe(module, eps_attr)
    except Exception as err:  # an arbitrary forward may fail in any way: then it is not a norm
        return None, f"its forward failed on a probe ({type(err).__name__}: {err})"
    if form is None:
        return None, "its output matches no known norm form: register it with register_norm"
    return form, ""


def _forms(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float):
    dims = tuple(range(-w.dim(), 0))
    yield NormSpec("layer"), torch.nn.functional.layer_norm(x, tuple(w.shape), w, b, eps)
    if b is None:
        ms = x.pow(2).mean(dims, keepdim=True).add(eps).rsqrt()
        yield NormSpec("rms"), x * ms * w
        yield NormSpec("rms", gain_offset=1.0), x * ms * (1.0 + w)


def _probe(module: nn.Module, eps_attr: str) -> NormSpec | None:
    """Run a float32 CPU copy of ``module`` with random parameters on an input with a non-zero
    mean, where the forms differ by O(1), and return the form it matches."""
    probe = copy.deepcopy(module).to(device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    w = probe.weight
    b = getattr(probe, "bias", None)
    with torch.no_grad():
        cpu = {"device": "cpu", "dtype": torch.float32}  # whatever the defaults are set to
        w.copy_(torch.rand(w.shape, generator=gen, **cpu) + 0.5)
        if b is not None:
            b.copy_(torch.randn(b.shape, generator=gen, **cpu))
        x = torch.randn((2, 3, *w.shape), generator=gen, **cpu) + 1.0
        out = probe(x)
        eps = float(getattr(probe, eps_attr))
        if not isinstance(out, torch.Tensor) or out.shape != x.shape:
            return None
        for spec, expected in _forms(x, w, b, eps):
            if torch.allclose(out.float(), expected, rtol=1e-4, atol=1e-5):
                return NormSpec(spec.stats, eps_attr, spec.gain_offset)
    return None


@dataclass
class _Source:
    """What a replacement needs from a source norm."""

    shape: tuple[int, ...]
    eps: float | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    offset: float
    factory: dict[str, object]


def _read(module: nn.Module, spec: NormSpec) -> _Source:
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    weight = weight if isinstance(weight, torch.Tensor) else None
    bias = bias if isinstance(bias, torch.Tensor) else None
    shape_attr = getattr(module, "normalized_shape", None)
    if shape_attr is not None:
        shape = as_shape(shape_attr)
    elif weight is not None:
        shape = tuple(weight.shape)
    else:
        raise ValueError(
            f"replace_norms: {type(module).__name__} has neither normalized_shape nor a weight, "
            "so its normalized shape is unknown"
        )
    eps = getattr(module, spec.eps_attr, None)
    eps = check_eps(eps, f"replace_norms: {type(module).__name__}.{spec.eps_attr}", True)
    ref = weight if weight is not None else next(iter(module.buffers()), None)
    factory = {} if ref is None else {"device": ref.device, "dtype": ref.dtype}
    offset = spec.gain_offset if weight is not None else 0.0
    return _Source(shape, eps, weight, bias, offset, factory)


# The source parameters each kind has no place for.
_DROPS = {"layer": (), "simple": ("weight", "bias"), "detach": ("weight", "bias"),
          "ada": ("weight", "bias"), "rms": ("bias",)}  # fmt: skip


def _dropped(src: nn.Module, kind: str) -> list[str]:
    return [n for n in _DROPS[kind] if isinstance(getattr(src, n, None), torch.Tensor)]


def _build(src: nn.Module, spec: NormSpec, kind: str) -> nn.Module:
    """The replacement of ``src``."""
    s = _read(src, spec)
    eps_ln = 1e-5 if s.eps is None else s.eps
    new: nn.Module
    if kind == "layer":
        # keep bias-free norms (RMS ones included) bias-free; otherwise a full gain and bias
        has_bias = not (s.weight is not None and s.bias is None)
        new = LayerNorm(s.shape, eps_ln, bias=has_bias, gain_offset=s.offset, **s.factory)
    elif kind == "simple":
        new = LayerNorm(s.shape, eps_ln, elementwise_affine=False, **s.factory)
    elif kind == "detach":
        new = LayerNorm(
            s.shape, eps_ln, elementwise_affine=False, detach_mean=True, detach_std=True,
            **s.factory,
        )  # fmt: skip
    elif kind == "ada":
        # an AdaNorm keeps its own k and C; anything else gets the paper's defaults
        k, scale = (src.k, src.scale) if isinstance(src, AdaNorm) else (0.1, 1.0)
        new = AdaNorm(s.shape, k=k, scale=scale, eps=eps_ln, **s.factory)
    else:  # "rms"
        new = RMSNorm(s.shape, eps=s.eps, gain_offset=s.offset, **s.factory)

    with torch.no_grad():
        for name, old in (("weight", s.weight), ("bias", s.bias)):
            p = getattr(new, name, None)
            if old is None or p is None:
                continue
            p.copy_(old)
            # a frozen norm (fine-tuning with norms fixed) stays frozen
            p.requires_grad_(old.requires_grad)
    new.train(src.training)
    return new


def _classify(module: nn.Module, unrecognized: dict[str, str]) -> NormSpec | None:
    spec = _registered(module)
    if spec is not None:
        return spec
    spec, why = _duck_spec(module)
    if spec is None and why:
        unrecognized.setdefault(type(module).__name__, why)
    return spec


def _report(
    module: nn.Module,
    kind: str,
    strict: bool,
    replaced: int,
    dropped: dict[str, list[str]],
    unrecognized: dict[str, str],
) -> None:
    problems = []
    if replaced == 0:
        msg = (
            f"replace_norms(kind={kind!r}) found no normalization layer to replace in "
            f"{type(module).__name__} (it replaces torch.nn.LayerNorm/RMSNorm, this library's "
            "norms, registered classes and modules with a weight and eps/variance_epsilon that "
            "compute a layer or RMS norm)"
        )
        problems.append(msg)
    for name, where in dropped.items():
        problems.append(
            f"replace_norms(kind={kind!r}) dropped the {name} of {len(where)} source norm(s), "
            f"e.g. {where[0]!r}: the new layers have none"
        )
    if unrecognized:
        left = "; ".join(f"{cls}: {why}" for cls, why in unrecognized.items())
        problems.append(f"replace_norms left these norm-like modules in place: {left}")
    if not problems:
        return
    text = "\n".join(problems)
    if strict:
        raise ValueError(text + "\n(strict=True; pass strict=False to only warn)")
    warnings.warn(text, UserWarning, stacklevel=3)


def replace_norms(module: nn.Module, kind: NormKind, *, strict: bool = False) -> nn.Module:
    """Replace every normalization layer inside ``module`` with the normalization ``kind``, in
    place, and return the module.

    Kinds: ``"layer"`` (:class:`LayerNorm`), ``"simple"`` (LN-simple: no gain or bias),
    ``"detach"`` (DetachNorm: LN-simple with μ and σ detached), ``"ada"`` (:class:`AdaNorm`),
    ``"rms"`` (:class:`RMSNorm`). Which modules are norms is the rule of
    :mod:`layernorm.modules.replace` (registered classes, :func:`register_norm`, then duck typing).

    Parameters are carried exactly: the gain and bias are copied in the source's dtype, device and
    ``requires_grad``, a gain offset (Gemma's ``1 + weight``) is kept as ``gain_offset`` so the
    weights mean what they meant and ``state_dict`` keys and values are unchanged, ``eps`` and
    train/eval mode are kept. Replacing a norm by its own kind (``"layer"`` for a layer norm,
    ``"rms"`` for an RMS norm such as ``LlamaRMSNorm`` or ``T5LayerNorm``) gives the same outputs
    to rounding. ``"simple"``, ``"detach"`` and ``"ada"`` have no gain or bias and ``"rms"`` no
    bias: dropping a parameter the source had, replacing nothing, or leaving a norm-like module
    that fails the duck-typing probe is reported by a ``UserWarning``, or a ``ValueError`` with
    ``strict=True``.

    If ``module`` is itself a norm the replacement is returned (the caller must keep it). A norm
    used in several places is replaced by one shared module. ``torch.nn.TransformerEncoderLayer``
    has an inference fast path that hard-codes torch's layer norm; it is switched off for layers
    whose norms were replaced (and ``TransformerEncoder``'s nested-tensor packing with it), so the
    new norm is what runs.

    Example::

        >>> import torch, layernorm
        >>> enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(64, 4), 2)
        >>> enc = layernorm.replace_norms(enc, "layer")
        >>> type(enc.layers[0].norm1).__module__
        'layernorm.modules.normalization'
        >>> import transformers  # doctest: +SKIP
        >>> llama = transformers.LlamaForCausalLM(config)  # doctest: +SKIP
        >>> llama = layernorm.replace_norms(llama, "rms", strict=True)  # doctest: +SKIP
    """
    if kind not in _KINDS:
        raise ValueError(f"replace_norms: kind must be one of {_KINDS}, got {kind!r}")
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"replace_norms: module must be a torch.nn.Module, got {type(module).__name__}"
        )
    strict = check_flag(strict, "strict", "replace_norms")
    unrecognized: dict[str, str] = {}
    dropped: dict[str, list[str]] = {}

    def note_dropped(src: nn.Module, where: str) -> None:
        for name in _dropped(src, kind):
            dropped.setdefault(name, []).append(f"{where}.{name}" if where else name)

    spec = _classify(module, unrecognized)
    if spec is not None:
        note_dropped(module, "")
        _report(module, kind, strict, 1, dropped, unrecognized)
        return _build(module, spec, kind)

    # Plan first, so that strict=True raises before anything is changed.
    plan: list[tuple[nn.Module, str, nn.Module, NormSpec]] = []
    specs: dict[int, NormSpec | None] = {}
    for parent_name, parent in module.named_modules(remove_duplicate=False):
        if specs.get(id(parent)) is not None:
            continue  # a norm to be replaced is not a parent
        # _modules, not named_children(): the latter yields a module used twice only once
        for name, child in parent._modules.items():
            if child is None:
                continue
            if id(child) not in specs:
                specs[id(child)] = _classify(child, unrecognized)
                if specs[id(child)] is not None:
                    note_dropped(child, f"{parent_name}.{name}" if parent_name else name)
            child_spec = specs[id(child)]
            if child_spec is not None:
                plan.append((parent, name, child, child_spec))
    n_norms = sum(s is not None for s in specs.values())
    _report(module, kind, strict, n_norms, dropped, unrecognized)

    # A norm shared by several parents (tied weights) gets one shared replacement.
    built: dict[int, nn.Module] = {}
    touched: dict[int, nn.Module] = {}
    for parent, name, child, child_spec in plan:
        if id(child) not in built:
            built[id(child)] = _build(child, child_spec, kind)
        setattr(parent, name, built[id(child)])
        touched[id(parent)] = parent
    for parent in touched.values():
        if isinstance(parent, nn.TransformerEncoderLayer):
            # The fused inference kernel (torch._transformer_encoder_layer_fwd) would silently
            # run a plain LayerNorm with our parameters; this flag is one of its preconditions.
            parent.activation_relu_or_gelu = 0
    for enc in module.modules():
        if isinstance(enc, nn.TransformerEncoder) and any(id(m) in touched for m in enc.layers):
            # In eval with a padding mask the encoder packs the batch into a nested tensor for
            # that kernel; our norms take dense tensors, so keep the batch padded.
            enc.use_nested_tensor = False
    return module
