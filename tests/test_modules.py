"""The modules follow torch.nn's contract: parameters, state_dict, factory kwargs, repr."""

from __future__ import annotations

import copy

import pytest
import torch

import layernorm
from conftest import make_param, make_x
from layernorm.reference import ada_norm_reference, layer_norm_reference

LN_CONFIGS = [
    pytest.param({}, id="affine"),
    pytest.param({"bias": False}, id="no-bias"),
    pytest.param({"elementwise_affine": False}, id="simple"),
    pytest.param({"eps": 1e-3}, id="eps"),
]


def _randomize(module: torch.nn.Module) -> None:
    """Move parameters off their identity init so that a swapped gain/bias would show."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(make_param(tuple(p.shape), p.dtype, center=1.0 if "weight" in name else 0.0))


@pytest.mark.parametrize("shape", [16, (4, 6)], ids=str)
@pytest.mark.parametrize("kwargs", LN_CONFIGS)
def test_layer_norm_matches_torch_module(kwargs, shape):
    ours = layernorm.LayerNorm(shape, **kwargs)
    theirs = torch.nn.LayerNorm(shape, **kwargs)
    assert ours.normalized_shape == theirs.normalized_shape
    assert ours.eps == theirs.eps and ours.elementwise_affine == theirs.elementwise_affine
    assert ours.extra_repr() == theirs.extra_repr()
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    _randomize(theirs)
    ours.load_state_dict(theirs.state_dict())
    nshape = theirs.normalized_shape
    x = make_x((3, 5, *nshape), requires_grad=True)
    xt = x.detach().clone().requires_grad_()
    y, yt = ours(x), theirs(xt)
    torch.testing.assert_close(y, yt, atol=1e-5, rtol=1e-5)
    dy = torch.randn_like(y)
    y.backward(dy)
    yt.backward(dy)
    torch.testing.assert_close(x.grad, xt.grad, atol=2e-5, rtol=2e-5)
    for (name, p), (_, pt) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, pt.grad, atol=1e-4, rtol=2e-5, msg=name)


@pytest.mark.parametrize("kwargs", LN_CONFIGS)
def test_layer_norm_state_dict_both_directions(kwargs):
    """Checkpoints load either way with strict=True: same keys, same shapes, same values."""
    ours = layernorm.LayerNorm((3, 8), **kwargs)
    theirs = torch.nn.LayerNorm((3, 8), **kwargs)
    sd_ours, sd_theirs = ours.state_dict(), theirs.state_dict()
    assert {k: v.shape for k, v in sd_ours.items()} == {k: v.shape for k, v in sd_theirs.items()}

    _randomize(theirs)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    for k, v in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v), k

    _randomize(ours)
    fresh = torch.nn.LayerNorm((3, 8), **kwargs)
    fresh.load_state_dict(ours.state_dict(), strict=True)
    x = make_x((4, 3, 8))
    torch.testing.assert_close(fresh(x), ours(x), atol=1e-5, rtol=1e-5)


def test_layer_norm_checkpoint_inside_a_model():
    """A model saved with torch.nn.LayerNorm loads into the same model built with ours."""

    def build(norm):
        return torch.nn.Sequential(torch.nn.Linear(8, 12), norm(12), torch.nn.ReLU())

    theirs = build(torch.nn.LayerNorm)
    _randomize(theirs[1])
    ours = build(layernorm.LayerNorm)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = make_x((5, 8))
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("eps", [None, 1e-6])
@pytest.mark.parametrize("affine", [True, False])
def test_rms_norm_matches_torch_module(eps, affine):
    ours = layernorm.RMSNorm((2, 10), eps=eps, elementwise_affine=affine)
    theirs = torch.nn.RMSNorm((2, 10), eps=eps, elementwise_affine=affine)
    assert ours.normalized_shape == theirs.normalized_shape and ours.eps == theirs.eps
    assert {k: v.shape for k, v in ours.state_dict().items()} == {
        k: v.shape for k, v in theirs.state_dict().items()
    }
    _randomize(theirs)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = make_x((6, 2, 10))
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
    _randomize(ours)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
    assert ours.extra_repr() == theirs.extra_repr()


def test_layer_norm_defaults_and_init():
    ln = layernorm.LayerNorm(7)
    assert ln.normalized_shape == (7,) and ln.eps == 1e-5 and ln.elementwise_affine
    assert torch.equal(ln.weight, torch.ones(7)) and torch.equal(ln.bias, torch.zeros(7))
    assert ln.weight.requires_grad and ln.bias.requires_grad
    assert ln.extra_repr() == torch.nn.LayerNorm(7).extra_repr()


def test_no_affine_has_no_parameters():
    for m in (
        layernorm.LayerNorm(7, elementwise_affine=False),
        layernorm.LayerNorm(7, elementwise_affine=False, bias=True),
        layernorm.RMSNorm(7, elementwise_affine=False),
        layernorm.AdaNorm(7),
    ):
        assert m.weight is None and m.bias is None
        assert list(m.parameters()) == [] and list(m.state_dict()) == []


def test_bias_false_creates_no_bias():
    ln = layernorm.LayerNorm(7, bias=False)
    assert ln.bias is None and [n for n, _ in ln.named_parameters()] == ["weight"]
    assert "bias=False" in repr(ln)


def test_reset_parameters():
    ada = layernorm.AdaNorm(5, elementwise_affine=True)
    for m in (layernorm.LayerNorm(5), layernorm.RMSNorm(5), ada):
        _randomize(m)
        m.reset_parameters()
        assert torch.equal(m.weight, torch.ones(5))
        if getattr(m, "bias", None) is not None:
            assert torch.equal(m.bias, torch.zeros(5))


@pytest.mark.parametrize(
    "make",
    [
        lambda **f: layernorm.LayerNorm(6, **f),
        lambda **f: layernorm.RMSNorm(6, **f),
        lambda **f: layernorm.AdaNorm(6, elementwise_affine=True, **f),
    ],
    ids=["LayerNorm", "RMSNorm", "AdaNorm"],
)
def test_factory_kwargs(make):
    m = make(dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in m.parameters())
    y = m(make_x((3, 6), torch.float64))
    assert y.dtype == torch.float64
    meta = make(device="meta")
    assert all(p.device.type == "meta" for p in meta.parameters())
    # meta tensors carry shapes through the whole op (useful to size models without memory)
    assert meta(torch.empty(3, 6, device="meta")).shape == (3, 6)
    m16 = make().to(torch.bfloat16)
    assert m16(make_x((3, 6), torch.bfloat16)).dtype == torch.bfloat16


def test_detach_norm_module():
    """Same forward as LN-simple; gradients of the detach()-based reference."""
    dn = layernorm.LayerNorm(9, elementwise_affine=False, detach_mean=True, detach_std=True)
    assert "detach_mean=True" in repr(dn) and "detach_std=True" in repr(dn)
    x = make_x((4, 9), torch.float64, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y = dn(x)
    yr = layer_norm_reference(xr, (9,), detach_mean=True, detach_std=True)
    torch.testing.assert_close(y, layernorm.layer_norm(x, 9))
    dy = torch.randn_like(y)
    y.backward(dy)
    yr.backward(dy)
    torch.testing.assert_close(x.grad, xr.grad)
    # With both statistics detached the gradient is just dy/σ.
    sigma = torch.sqrt(x.detach().var(-1, unbiased=False, keepdim=True) + 1e-5)
    torch.testing.assert_close(x.grad, dy / sigma)


def test_ada_norm_module():
    m = layernorm.AdaNorm(9, k=0.2, scale=1.5)
    assert m.k == 0.2 and m.scale == 1.5 and m.eps == 1e-5
    assert "k=0.2" in repr(m) and "scale=1.5" in repr(m)
    x = make_x((4, 9), torch.float64, requires_grad=True)
    torch.testing.assert_close(m(x), ada_norm_reference(x, (9,), 0.2, 1.5))
    affine = layernorm.AdaNorm(9, k=0.2, scale=1.5, elementwise_affine=True, dtype=torch.float64)
    _randomize(affine)
    expected = ada_norm_reference(x, (9,), 0.2, 1.5) * affine.weight + affine.bias
    torch.testing.assert_close(affine(x), expected)


def test_modules_deepcopy_and_train_eval_same_output():
    """Layer norm uses the same computation at training and test time (no running statistics)."""
    for m in (layernorm.LayerNorm(8), layernorm.RMSNorm(8), layernorm.AdaNorm(8)):
        x = make_x((2, 8))
        y_train = m.train()(x)
        y_eval = m.eval()(x)
        assert torch.equal(y_train, y_eval)
        assert torch.equal(copy.deepcopy(m)(x), y_eval)
        assert list(m.buffers()) == []


def test_layer_norm_module_trains():
    """Gains and biases receive gradients and an optimizer step changes the output."""
    ln = layernorm.LayerNorm(8)
    opt = torch.optim.SGD(ln.parameters(), lr=0.1)
    x = make_x((16, 8))
    target = torch.randn(16, 8) * 3 + 1
    losses = []
    for _ in range(20):
        loss = (ln(x) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.parametrize(
    "make",
    [
        lambda: layernorm.LayerNorm(6),
        lambda: layernorm.RMSNorm(6),
        lambda: layernorm.AdaNorm(6, elementwise_affine=True),
        lambda: layernorm.LayerNorm(6, detach_mean=True),
    ],
    ids=["LayerNorm", "RMSNorm", "AdaNorm-affine", "DetachNorm"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_input_float32_parameters(make, dtype):
    """Mixed precision: the output keeps the activations' dtype, gradients the parameters'."""
    m = make()
    x = make_x((3, 6), dtype, requires_grad=True)
    y = m(x)
    assert y.dtype == dtype
    y.float().sum().backward()
    assert x.grad.dtype == dtype
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in m.parameters())


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.parametrize(
    "module",
    ["layernorm.modules.normalization", "layernorm.modules.replace", "layernorm.recurrent.layers"],
)
def test_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
