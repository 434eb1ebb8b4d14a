"""replace_norms swaps every layer norm of a model: torch's Transformer and arbitrary models."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import layernorm
from conftest import make_param, make_x
from layernorm.reference import ada_norm_reference, layer_norm_reference, rms_norm_reference

KINDS = ["layer", "simple", "detach", "ada", "rms"]
EXPECTED_TYPE = {
    "layer": layernorm.LayerNorm,
    "simple": layernorm.LayerNorm,
    "detach": layernorm.LayerNorm,
    "ada": layernorm.AdaNorm,
    "rms": layernorm.RMSNorm,
}
D_MODEL = 16
# what each kind drops from a source with a gain and a bias
DROPS = {"layer": (), "simple": ("weight", "bias"), "detach": ("weight", "bias"),
         "ada": ("weight", "bias"), "rms": ("bias",)}  # fmt: skip


def _replace(model: nn.Module, kind: str, drops: tuple[str, ...] | None = None) -> nn.Module:
    """replace_norms, checking it warns about exactly the parameters ``kind`` drops (the models
    here all have norms with gains and biases unless ``drops`` says otherwise)."""
    drops = DROPS[kind] if drops is None else drops
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = layernorm.replace_norms(model, kind)
    messages = " ".join(str(w.message) for w in caught)
    for name in ("weight", "bias"):
        assert (f"dropped the {name} of" in messages) == (name in drops), messages
    return out


def _randomize_norms(model: nn.Module) -> None:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm | nn.RMSNorm):
                if m.weight is not None:
                    m.weight.copy_(make_param(tuple(m.weight.shape), m.weight.dtype, center=1.0))
                if getattr(m, "bias", None) is not None:
                    m.bias.copy_(make_param(tuple(m.bias.shape), m.bias.dtype, center=0.0))


def _encoder(batch_first: bool, norm_first: bool = False) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(
        D_MODEL, 2, 32, dropout=0.0, batch_first=batch_first, norm_first=norm_first
    )
    enc = nn.TransformerEncoder(
        layer, 2, norm=nn.LayerNorm(D_MODEL), enable_nested_tensor=batch_first and not norm_first
    )
    _randomize_norms(enc)
    return enc.double()


def _norm_fn(kind: str, src: nn.Module):
    """The replacement norm written from the reference formulas, with src's gain and bias."""
    w, b, eps, shape = src.weight, src.bias, src.eps, tuple(src.normalized_shape)
    if kind == "layer":
        return lambda h: layer_norm_reference(h, shape, w, b, eps)
    if kind in ("simple", "detach"):  # DetachNorm has LN-simple's forward
        return lambda h: layer_norm_reference(h, shape, eps=eps)
    if kind == "ada":
        return lambda h: ada_norm_reference(h, shape, 0.1, 1.0, eps)
    return lambda h: rms_norm_reference(h, shape, w, eps)


def _manual_encoder(enc: nn.TransformerEncoder, kind: str, x, mask=None):
    """TransformerEncoder's forward spelled out, with the norms computed by ``_norm_fn``."""
    for layer in enc.layers:
        n1, n2 = _norm_fn(kind, layer.norm1), _norm_fn(kind, layer.norm2)

        def sa(h, layer=layer):
            return layer.self_attn(h, h, h, key_padding_mask=mask, need_weights=False)[0]

        def ff(h, layer=layer):
            return layer.linear2(layer.activation(layer.linear1(h)))

        if layer.norm_first:
            x = x + sa(n1(x))
            x = x + ff(n2(x))
        else:
            x = n1(x + sa(x))
            x = n2(x + ff(x))
    return _norm_fn(kind, enc.norm)(x)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_eval_runs_new_norm(kind, batch_first, norm_first):
    """In eval under no_grad torch would take its fused fast path, which hard-codes layer norm;
    the replaced model's output must equal the forward written out with the new norm."""
    enc = _encoder(batch_first, norm_first)
    manual_model = _encoder(batch_first, norm_first)
    manual_model.load_state_dict(enc.state_dict())
    x = make_x((3, 5, D_MODEL), torch.float64)
    enc.eval()
    with torch.no_grad():
        before = enc(x)
        out = _replace(enc, kind)
        assert out is enc
        after = enc(x)
        expected = _manual_encoder(manual_model.eval(), kind, x)
    assert not any(type(m) is nn.LayerNorm for m in enc.modules())
    assert sum(type(m) is EXPECTED_TYPE[kind] for m in enc.modules()) == 5
    torch.testing.assert_close(after, expected, atol=1e-10, rtol=1e-10)
    if kind == "layer":
        torch.testing.assert_close(after, before, atol=1e-10, rtol=1e-10)
    else:
        assert not torch.allclose(after, before, atol=1e-3), f"{kind} gave layer norm's output"


@pytest.mark.parametrize("kind", ["rms", "ada"])
def test_transformer_encoder_eval_with_padding_mask(kind):
    """With a padding mask in eval, torch packs the batch into a nested tensor for its fused
    kernel; after replacement the dense path must run, and match the manual forward."""
    enc = _encoder(batch_first=True)
    manual_model = _encoder(batch_first=True)
    manual_model.load_state_dict(enc.state_dict())
    _replace(enc, kind).eval()
    x = make_x((3, 6, D_MODEL), torch.float64)
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[0, 4:] = True
    mask[2, 2:] = True
    with torch.no_grad():
        out = enc(x, src_key_padding_mask=mask)
        expected = _manual_encoder(manual_model.eval(), kind, x, mask)
    keep = ~mask
    torch.testing.assert_close(out[keep], expected[keep], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_encoder_train(kind, batch_first):
    enc = _encoder(batch_first)
    manual_model = _encoder(batch_first)
    manual_model.load_state_dict(enc.state_dict())
    _replace(enc, kind)
    assert enc.training and all(m.training for m in enc.modules())
    x = make_x((3, 5, D_MODEL), torch.float64, requires_grad=True)
    y = enc(x)
    torch.testing.assert_close(y, _manual_encoder(manual_model, kind, x), atol=1e-10, rtol=1e-10)
    y.pow(2).mean().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for name, p in enc.named_parameters():
        assert p.grad is not None, name


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8, eps=1e-3)

    def forward(self, x):
        return self.ln(self.proj(x))


def _zoo() -> nn.Module:
    """Norms at every depth and in every container kind, torch's and ours, with and without
    affine parameters."""
    return nn.Sequential(
        nn.Linear(8, 8),
        nn.LayerNorm(8),
        nn.ModuleList([_Block(), nn.Sequential(nn.LayerNorm(8, bias=False), nn.Tanh())]),
        nn.ModuleDict(
            {
                "a": nn.LayerNorm(8, elementwise_affine=False),
                "b": nn.RMSNorm(8),
                "c": layernorm.LayerNorm(8),
                "d": layernorm.AdaNorm(8, k=0.2, scale=2.0),
                "e": layernorm.RMSNorm(8, eps=1e-4),
            }
        ),
    )


_NORM_TYPES = (nn.LayerNorm, nn.RMSNorm, layernorm.AdaNorm)


def _norms(model):
    return [m for m in model.modules() if isinstance(m, _NORM_TYPES)]


@pytest.mark.parametrize("kind", KINDS)
def test_arbitrary_nested_model(kind):
    model = _zoo()
    _randomize_norms(model)
    old = _norms(model)
    assert len(old) == 8
    out = _replace(model, kind)
    assert out is model
    new = _norms(model)
    assert len(new) == 8 and all(type(m) is EXPECTED_TYPE[kind] for m in new)
    assert not any(m in old for m in new)
    for o, n in zip(old, new, strict=True):
        assert tuple(n.normalized_shape) == tuple(o.normalized_shape)
        if kind != "rms" and o.eps is not None:
            assert n.eps == o.eps
        # gains (and biases) carried where the new layer has them
        if getattr(n, "weight", None) is not None and getattr(o, "weight", None) is not None:
            assert torch.equal(n.weight, o.weight)
        if getattr(n, "bias", None) is not None and getattr(o, "bias", None) is not None:
            assert torch.equal(n.bias, o.bias)
        assert n.weight is None or n.weight is not o.weight, "parameters must be copies"
    if kind in ("simple", "detach", "ada"):
        assert all(n.weight is None and n.bias is None for n in new)
    if kind == "detach":
        assert all(n.detach_mean and n.detach_std for n in new)
    if kind == "ada":
        assert (new[-2].k, new[-2].scale) == (0.2, 2.0), "an AdaNorm keeps its k and C"
        assert (new[0].k, new[0].scale) == (0.1, 1.0)
    if kind == "layer":
        assert new[2].bias is None, "a bias-free layer norm stays bias-free"
    # the block's forward now runs the new norm
    block = model[2][0]
    x = make_x((4, 8))
    torch.testing.assert_close(block(x), block.ln(block.proj(x)))
    assert model[0](x).shape == (4, 8)


def test_layer_kind_preserves_outputs():
    model = _zoo()[:3]  # Linear, LayerNorm, ModuleList
    _randomize_norms(model)
    x = make_x((4, 8))
    before = model[1](model[0](x))
    block_before = model[2][0](x)
    _replace(model, "layer")
    torch.testing.assert_close(model[1](model[0](x)), before, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(model[2][0](x), block_before, atol=1e-6, rtol=1e-6)


def test_shared_norm_stays_shared():
    """A norm used twice (tied parameters) must become one module used twice, not two copies."""
    shared = nn.LayerNorm(8)
    model = nn.Sequential(nn.Linear(8, 8), shared, nn.Linear(8, 8), shared)
    _replace(model, "rms")
    assert model[1] is model[3]
    assert len(list(model.parameters())) == 4 + 1


def test_dtype_device_and_mode_kept():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)).double().eval()
    _replace(model, "rms")
    assert model[1].weight.dtype == torch.float64 and not model[1].training
    meta = nn.Sequential(nn.Linear(8, 8, device="meta"), nn.LayerNorm(8, device="meta"))
    _replace(meta, "layer")
    assert meta[1].weight.device.type == "meta"


def test_norm_module_itself_returns_replacement():
    ln = nn.LayerNorm(8)
    new = _replace(ln, "ada")
    assert isinstance(new, layernorm.AdaNorm) and new.normalized_shape == (8,)


def test_model_without_norms_unchanged():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    before = [type(m) for m in model.modules()]
    with pytest.warns(UserWarning, match=r"kind='rms'\) found no normalization layer .*Sequential"):
        assert layernorm.replace_norms(model, "rms") is model
    assert [type(m) for m in model.modules()] == before
    with pytest.raises(ValueError, match=r"(?s)found no normalization layer.*strict=True"):
        layernorm.replace_norms(model, "rms", strict=True)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"kind must be one of .*'rms'.*got 'batch'"):
        layernorm.replace_norms(nn.Linear(2, 2), "batch")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"must be a torch\.nn\.Module, got dict"):
        layernorm.replace_norms({}, "layer")  # type: ignore[arg-type]


def test_full_transformer_eval_with_padding_masks():
    """nn.Transformer: encoder (with its nested-tensor path) and decoder norms all replaced; eval
    with padding masks runs and no torch.nn.LayerNorm is left."""
    model = nn.Transformer(D_MODEL, 2, 1, 1, 32, dropout=0.0, batch_first=True).double()
    _replace(model, "rms").eval()
    assert not any(type(m) is nn.LayerNorm for m in model.modules())
    assert sum(type(m) is layernorm.RMSNorm for m in model.modules()) == 2 + 3 + 2
    src, tgt = make_x((2, 5, D_MODEL), torch.float64), make_x((2, 4, D_MODEL), torch.float64)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[1, 3:] = True
    with torch.no_grad():
        out = model(src, tgt, src_key_padding_mask=mask, memory_key_padding_mask=mask)
    assert out.shape == (2, 4, D_MODEL) and torch.isfinite(out).all()


@pytest.mark.parametrize("kind", ["layer", "rms", "ada"])
def test_frozen_norms_stay_frozen(kind):
    # fine-tuning with the norms fixed: swapping them must not make them trainable again
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.LayerNorm(8))
    model[1].requires_grad_(False)
    model[3].bias.requires_grad_(False)
    _replace(model, kind)
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    expected = {"0.weight": True, "0.bias": True, "2.weight": True, "2.bias": True}
    if kind == "layer":
        expected |= {"1.weight": False, "1.bias": False, "3.weight": True, "3.bias": False}
    elif kind == "rms":
        expected |= {"1.weight": False, "3.weight": True}
    assert flags == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gain_offset_carried_between_kinds(dtype):
    """A norm storing gain − 1 (gain_offset=1) keeps storing it through replacements: the
    stored weight is unchanged and the gain the new norm applies is the old one."""
    src = layernorm.RMSNorm(8, eps=1e-6, gain_offset=1.0, dtype=dtype)
    with torch.no_grad():
        src.weight.copy_(torch.linspace(-0.5, 0.5, 8))
    x = make_x((3, 8), dtype)
    layer = layernorm.replace_norms(src, "layer")
    assert layer.gain_offset == 1.0 and torch.equal(layer.weight, src.weight)
    assert layer.bias is None and layer.weight.dtype == dtype
    gain = src.weight.float() + 1.0
    expected = torch.nn.functional.layer_norm(x.float(), (8,), gain, None, 1e-6).to(dtype)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(layer(x), expected, **tol)
    back = layernorm.replace_norms(layer, "rms")
    assert back.gain_offset == 1.0 and torch.equal(back.weight, src.weight)
    torch.testing.assert_close(back(x), src(x), **tol)
