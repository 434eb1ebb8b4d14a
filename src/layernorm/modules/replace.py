"""Swap the normalization layers of an existing model for another member of the family."""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import nn

from .normalization import AdaNorm, LayerNorm, RMSNorm

NormKind = Literal["layer", "simple", "detach", "ada", "rms"]
_KINDS: tuple[str, ...] = get_args(NormKind)
# Everything replace_norms recognises as a normalization layer to swap.
_SOURCES = (nn.LayerNorm, nn.RMSNorm, LayerNorm, RMSNorm, AdaNorm)


def _build(src: nn.Module, kind: str) -> nn.Module:
    shape = tuple(src.normalized_shape)  # type: ignore[arg-type]
    eps = getattr(src, "eps", None)
    eps_ln = 1e-5 if eps is None else float(eps)
    weight: torch.Tensor | None = getattr(src, "weight", None)
    bias: torch.Tensor | None = getattr(src, "bias", None)
    ref = weight if weight is not None else next(iter(src.buffers()), None)
    factory = {
        "device": None if ref is None else ref.device,
        "dtype": None if ref is None else ref.dtype,
    }

    new: nn.Module
    if kind == "layer":
        # keep bias=False models bias-free; otherwise a full gain and bias
        has_bias = not (weight is not None and bias is None)
        new = LayerNorm(shape, eps_ln, elementwise_affine=True, bias=has_bias, **factory)
    elif kind == "simple":
        new = LayerNorm(shape, eps_ln, elementwise_affine=False, **factory)
    elif kind == "detach":
        new = LayerNorm(
            shape, eps_ln, elementwise_affine=False, detach_mean=True, detach_std=True, **factory
        )
    elif kind == "ada":
        # an AdaNorm keeps its own k and C; anything else gets the paper's defaults
        k, scale = (src.k, src.scale) if isinstance(src, AdaNorm) else (0.1, 1.0)
        new = AdaNorm(shape, k=k, scale=scale, eps=eps_ln, **factory)
    else:  # "rms"
        new = RMSNorm(shape, eps=eps, elementwise_affine=True, **factory)

    with torch.no_grad():
        for name, old in (("weight", weight), ("bias", bias)):
            p = getattr(new, name, None)
            if p is not None and old is not None:
                p.copy_(old)
                # a frozen norm (fine-tuning with norms fixed) stays frozen
                p.requires_grad_(old.requires_grad)
    new.train(src.training)
    return new


def replace_norms(module: nn.Module, kind: NormKind) -> nn.Module:
    """Replace every layer norm (``torch.nn.LayerNorm``/``RMSNorm`` and this library's norms)
    inside ``module`` with the normalization ``kind``, in place, and return the module.

    Kinds: ``"layer"`` (:class:`LayerNorm`), ``"simple"`` (LN-simple: no gain or bias),
    ``"detach"`` (DetachNorm: LN-simple with μ and σ detached), ``"ada"`` (:class:`AdaNorm`),
    ``"rms"`` (:class:`RMSNorm`). Gains and biases are carried over where the new layer has them,
    frozen ones (``requires_grad=False``) stay frozen; ``eps``, device, dtype and train/eval mode
    are kept. If ``module`` is itself a norm layer the
    replacement is returned (the caller must keep it).

    ``torch.nn.TransformerEncoderLayer`` has an inference fast path that hard-codes layer norm;
    it is switched off for layers whose norms were replaced (and ``TransformerEncoder``'s
    nested-tensor packing with it), so the new norm is what runs. A norm module used in several
    places is replaced by one shared module.

    Example::

        >>> import torch, layernorm
        >>> enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(64, 4), 2)
        >>> enc = layernorm.replace_norms(enc, "ada")
    """
    if kind not in _KINDS:
        raise ValueError(f"replace_norms: kind must be one of {_KINDS}, got {kind!r}")
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"replace_norms: module must be a torch.nn.Module, got {type(module).__name__}"
        )
    if isinstance(module, _SOURCES):
        return _build(module, kind)
    # A norm shared by several parents (tied weights) gets one shared replacement.
    built: dict[int, nn.Module] = {}
    touched: set[int] = set()
    for parent in list(module.modules()):
        # _modules, not named_children(): the latter yields a module used twice only once
        for name, child in list(parent._modules.items()):
            if isinstance(child, _SOURCES):
                if id(child) not in built:
                    built[id(child)] = _build(child, kind)
                setattr(parent, name, built[id(child)])
                touched.add(id(parent))
        if id(parent) in touched and isinstance(parent, nn.TransformerEncoderLayer):
            # The fused inference kernel (torch._transformer_encoder_layer_fwd) would silently
            # run a plain LayerNorm with our parameters; this flag is one of its preconditions.
            parent.activation_relu_or_gelu = 0
    for enc in module.modules():
        if isinstance(enc, nn.TransformerEncoder) and any(id(m) in touched for m in enc.layers):
            # In eval with a padding mask the encoder packs the batch into a nested tensor for
            # that kernel; our norms take dense tensors, so keep the batch padded.
            enc.use_nested_tensor = False
    return module
