"""replace_norms with Hugging Face models built from tiny configs (never downloaded): every kind,
the outputs of exact kinds, the registry against the classes' real forward, Trainer's weight-decay
split, and a save_pretrained / from_pretrained round trip.

``transformers`` is a pinned test dependency (the ``dev`` extra, which CI installs): imported, not
skipped, so a missing install fails here rather than passing unnoticed.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable

import pytest
import torch
import transformers
from torch import nn

import layernorm
from layernorm.modules import replace as replace_mod

KINDS = ["layer", "simple", "detach", "ada", "rms"]
NEW_TYPE = {
    "layer": layernorm.LayerNorm,
    "simple": layernorm.LayerNorm,
    "detach": layernorm.LayerNorm,
    "ada": layernorm.AdaNorm,
    "rms": layernorm.RMSNorm,
}
VOCAB = 64


def _bert():
    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.BertModel(cfg, add_pooling_layer=False)


def _gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def _gemma():
    cfg = transformers.GemmaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.GemmaForCausalLM(cfg)


def _t5():
    cfg = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(cfg)


def _vit():
    cfg = transformers.ViTConfig(
        image_size=16, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64,
    )  # fmt: skip
    return transformers.ViTModel(cfg, add_pooling_layer=False)


# name: (builder, the family's own stats, its norm class name)
MODELS: dict[str, tuple[Callable[[], nn.Module], str, str]] = {
    "bert": (_bert, "layer", "LayerNorm"),
    "gpt2": (_gpt2, "layer", "LayerNorm"),
    "vit": (_vit, "layer", "LayerNorm"),
    "llama": (_llama, "rms", "LlamaRMSNorm"),
    "gemma": (_gemma, "rms", "GemmaRMSNorm"),
    "t5": (_t5, "rms", "T5LayerNorm"),
}


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[name][0]().eval()
    # move every gain and bias off its init, so that a lost or shifted parameter shows
    with torch.no_grad():
        for m in model.modules():
            for p in m.parameters(recurse=False):
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.2)
    return model


def _inputs(name: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if name == "vit":
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g)}
    ids = torch.randint(0, VOCAB, (2, 7), generator=g)
    if name == "t5":
        return {"input_ids": ids, "decoder_input_ids": ids[:, :5]}
    return {"input_ids": ids}


def _output(model: nn.Module, name: str) -> torch.Tensor:
    with torch.no_grad():
        out = model(**_inputs(name))
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _count(model: nn.Module, cls_name: str) -> int:
    return sum(type(m).__name__ == cls_name for m in model.modules())


def _replace(model: nn.Module, kind: str) -> tuple[nn.Module, str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = layernorm.replace_norms(model, kind)
    return out, " ".join(str(w.message) for w in caught)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_every_kind_on_hf_models(name, kind):
    model = _build(name)
    _, stats, norm_cls = MODELS[name]
    sources = [m for m in model.modules() if type(m).__name__ == norm_cls]
    n_norms = len({id(m) for m in sources})
    assert n_norms > 0
    had_bias = any(getattr(m, "bias", None) is not None for m in sources)
    before = _output(model, name)

    out, messages = _replace(model, kind)
    assert out is model
    assert _count(model, norm_cls) == 0 or norm_cls == "LayerNorm"
    assert not any(type(m) is nn.LayerNorm for m in model.modules())
    assert sum(type(m) is NEW_TYPE[kind] for m in model.modules()) == n_norms
    after = _output(model, name)
    assert torch.isfinite(after).all()
    if kind == stats:  # the family's own kind: the same function with the same parameters
        torch.testing.assert_close(after, before, atol=2e-5, rtol=2e-5)
    else:
        assert not torch.allclose(after, before, atol=1e-3)
    # what is dropped is said; nothing else is
    drops_gain = kind in ("simple", "detach", "ada")
    drops_bias = had_bias and kind != "layer"
    assert ("dropped the weight" in messages) == drops_gain, messages
    assert ("dropped the bias" in messages) == drops_bias, messages
    assert "found no normalization layer" not in messages


@pytest.mark.parametrize("name", list(MODELS))
def test_parameters_carried_in_dtype(name):
    """bfloat16 models keep bfloat16 norms with the same values (Gemma's stored gain − 1
    included), and the same state_dict keys."""
    model = _build(name).to(torch.bfloat16)
    stats = MODELS[name][1]
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an exact kind drops nothing
        layernorm.replace_norms(model, stats, strict=True)
    new = model.state_dict()
    assert list(new) == list(keys)
    for k, v in keys.items():
        assert new[k].dtype == v.dtype and torch.equal(new[k], v), k
    assert torch.isfinite(_output(model, name).float()).all()


def test_strict_raises_on_dropped_parameters_and_on_nothing_replaced():
    model = _build("gpt2")
    before = _output(model, "gpt2")
    with pytest.raises(ValueError, match=r"kind='rms'\) dropped the bias of 5 source norm"):
        layernorm.replace_norms(model, "rms", strict=True)
    # strict checks before it changes anything
    assert sum(type(m) is nn.LayerNorm for m in model.modules()) == 5
    torch.testing.assert_close(_output(model, "gpt2"), before, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"kind='ada'\) dropped the weight of 5"):
        layernorm.replace_norms(_build("llama"), "ada", strict=True)
    with pytest.raises(ValueError, match=r"found no normalization layer to replace in Embedding"):
        layernorm.replace_norms(nn.Embedding(4, 4), "layer", strict=True)


# -- the registry against each class's own forward -------------------------------------------


def _registered_hf_classes() -> list[str]:
    return [k for k in replace_mod._REGISTRY if isinstance(k, str) and k.startswith("transform")]


@pytest.mark.parametrize("qualname", _registered_hf_classes())
def test_registered_classes_match_their_forward(qualname):
    """Each registered Hugging Face class, with random parameters, gives the output of its
    replacement by its own kind, float32 and bfloat16; the gain offset survives the "layer"
    kind too (its gain is the source's)."""
    module_name, cls_name = qualname.rsplit(".", 1)
    cls = getattr(importlib.import_module(module_name), cls_name)
    spec = replace_mod._REGISTRY[qualname]
    src = cls(24, eps=1e-5)
    with torch.no_grad():
        src.weight.copy_(torch.rand(24) + 0.5 - spec.gain_offset)
    x = torch.randn(3, 5, 24) + 1.0
    new = layernorm.replace_norms(src, spec.stats, strict=True)
    torch.testing.assert_close(new(x), src(x), atol=1e-6, rtol=1e-6)
    assert new.state_dict().keys() == src.state_dict().keys()
    gain = src.weight.detach() + spec.gain_offset
    layer = layernorm.replace_norms(src, "layer", strict=True)
    expected = torch.nn.functional.layer_norm(x, (24,), gain, None, 1e-5)
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    src16, x16 = src.to(torch.bfloat16), x.to(torch.bfloat16)
    new16 = layernorm.replace_norms(src16, spec.stats, strict=True)
    assert new16.weight.dtype == torch.bfloat16
    torch.testing.assert_close(new16(x16), src16(x16), atol=2e-2, rtol=2e-2)


# -- duck typing and register_norm ----------------------------------------------------------


class _PlainRMS(nn.Module):
    def __init__(self, d: int, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.variance_epsilon = 1e-6
        self.offset = offset

    def forward(self, x):
        ms = x.pow(2).mean(-1, keepdim=True)
        return (self.offset + self.weight) * x * torch.rsqrt(ms + self.variance_epsilon)


class _CustomLN(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.bias = nn.Parameter(torch.randn(d))
        self.eps = 1e-5

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + self.eps) * self.weight + self.bias


class _Scale(nn.Module):
    """Has a weight and an eps but normalizes nothing."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = 1e-6

    def forward(self, x):
        return x * self.weight + self.eps


@pytest.mark.parametrize(
    ("make", "kind"),
    [(lambda: _PlainRMS(12), "rms"), (lambda: _PlainRMS(12, 1.0), "rms"), (_CustomLN, "layer")],
    ids=["rms", "rms-offset", "layer"],
)
def test_duck_typed_norms_are_probed_and_carried_exactly(make, kind):
    src = make(12) if make is _CustomLN else make()
    model = nn.Sequential(nn.Linear(12, 12), src)
    x = torch.randn(4, 12) + 1.0
    before = model(x)
    layernorm.replace_norms(model, kind, strict=True)
    assert type(model[1]) is NEW_TYPE[kind]
    torch.testing.assert_close(model(x), before, atol=1e-5, rtol=1e-5)
    offset = getattr(src, "offset", 0.0)
    assert model[1].gain_offset == offset and torch.equal(model[1].weight, src.weight)


def test_not_a_norm_is_left_in_place_and_named():
    model = nn.Sequential(nn.Linear(6, 6), _Scale(6), nn.LayerNorm(6))
    with pytest.warns(UserWarning, match=r"left these norm-like modules in place: _Scale: its"):
        layernorm.replace_norms(model, "layer")
    assert type(model[1]) is _Scale and type(model[2]) is layernorm.LayerNorm
    # group and batch norms normalize over other axes: neither replaced nor reported
    conv = nn.Sequential(
        nn.GroupNorm(2, 6), nn.BatchNorm1d(6), layernorm.BatchNorm(6), nn.LayerNorm(6)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layernorm.replace_norms(conv, "layer")
    assert [type(m) for m in conv] == [
        nn.GroupNorm, nn.BatchNorm1d, layernorm.BatchNorm, layernorm.LayerNorm
    ]  # fmt: skip


def test_register_norm_for_meta_models_and_bad_arguments(monkeypatch):
    """A duck-typed class cannot be probed on the meta device; registering it makes it work."""
    monkeypatch.setattr(replace_mod, "_REGISTRY", dict(replace_mod._REGISTRY))
    model = nn.Sequential(_PlainRMS(8)).to("meta")
    with pytest.warns(UserWarning, match=r"_PlainRMS: on the meta device.*register_norm"):
        layernorm.replace_norms(model, "rms")
    assert type(model[0]) is _PlainRMS
    layernorm.register_norm(_PlainRMS, "rms", eps_attr="variance_epsilon")
    layernorm.replace_norms(model, "rms", strict=True)
    assert type(model[0]) is layernorm.RMSNorm and model[0].weight.device.type == "meta"
    assert model[0].eps == 1e-6
    with pytest.raises(ValueError, match=r"stats must be one of \('layer', 'rms', 'ada'\)"):
        layernorm.register_norm(_PlainRMS, "batch")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"cls must be a torch\.nn\.Module subclass.*got int"):
        layernorm.register_norm(3, "rms")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"gain_offset must be a finite float"):
        layernorm.register_norm(_PlainRMS, "rms", gain_offset=None)  # type: ignore[arg-type]


# -- Trainer's weight-decay split and save / load --------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_trainer_decay_split_unchanged(name):
    """HF Trainer decays every parameter outside an nn.LayerNorm whose name has no norm/bias
    pattern. After replacement the split is the same, except where HF's own rule differs for
    torch.nn.RMSNorm itself: GPT-2's norms (ln_1, ln_2, ln_f) match no name pattern."""
    from transformers import Trainer

    def split(model):
        # the names Trainer.create_optimizer puts in its decay group: it keeps the parameters
        # whose name is listed (the list also names unset ones, e.g. AdaNorm's weight=None)
        decay = set(Trainer.get_decay_parameter_names(None, model))  # self is unused
        return {n for n, _ in model.named_parameters() if n in decay}

    model = _build(name)
    before = split(model)
    for kind in KINDS:
        model = _build(name)
        _replace(model, kind)
        after = split(model)
        if name == "gpt2" and kind == "rms":
            torch_rms = _build(name)
            for parent in list(torch_rms.modules()):
                for child_name, child in list(parent.named_children()):
                    if type(child) is nn.LayerNorm:
                        setattr(parent, child_name, nn.RMSNorm(child.normalized_shape))
            assert after == split(torch_rms) and after > before
        else:
            assert after == before, kind


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["gpt2", "gemma", "t5"])
def test_save_pretrained_round_trip(tmp_path, name, kind):
    """Save a replaced model, load it with from_pretrained and replace again: the same model.
    Exact kinds save every key the original architecture expects (Gemma's gain − 1 included)."""
    model = _build(name)
    _replace(model, kind)
    expected = _output(model, name)
    model.save_pretrained(tmp_path)
    loaded, info = type(model).from_pretrained(tmp_path, output_loading_info=True)
    if kind == MODELS[name][1]:
        assert not info["missing_keys"] and not info["unexpected_keys"], info
    _replace(loaded.eval(), kind)
    torch.testing.assert_close(_output(loaded, name), expected, atol=0, rtol=0)
    saved, reloaded = model.state_dict(), loaded.state_dict()
    assert saved.keys() == reloaded.keys()
    for k in saved:
        assert torch.equal(saved[k], reloaded[k]), k
