"""The modules follow torch.nn's contract: parameters, state_dict, factory kwargs, repr."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import layernorm
from conftest import make_param, make_x
from layernorm.kernels.cpu import torch_ops
from layernorm.reference import ada_norm_reference, layer_norm_reference, rms_norm_reference

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
    # a parametrized gain (moved out of _parameters) and a gain set after construction count
    parametrize = torch.nn.utils.parametrize
    parametrize.register_parametrization(affine, "weight", _Doubled())
    expected = ada_norm_reference(x, (9,), 0.2, 1.5) * (2 * affine.parametrizations.weight.original)
    torch.testing.assert_close(affine(x), expected + affine.bias)
    plain = layernorm.AdaNorm(9, k=0.2, scale=1.5, dtype=torch.float64)
    plain.bias = torch.nn.Parameter(torch.full((9,), 0.5, dtype=torch.float64))
    torch.testing.assert_close(plain(x), ada_norm_reference(x, (9,), 0.2, 1.5) + 0.5)


class _Doubled(torch.nn.Module):
    def forward(self, w):
        return 2 * w


@pytest.mark.parametrize("cls", [layernorm.LayerNorm, layernorm.RMSNorm, layernorm.AdaNorm])
def test_modules_read_gains_however_they_are_held(cls):
    """The modules read their gain and bias from _parameters where registered (the fast read),
    and otherwise as attributes: a parametrized gain, one swapped in by
    ``torch.func.functional_call``, one replaced after construction, and one removed."""
    kw = {"elementwise_affine": True} if cls is layernorm.AdaNorm else {}
    m = cls(9, dtype=torch.float64, **kw)
    _randomize(m)
    x = make_x((4, 9), torch.float64)

    def twin(weight, bias):  # the same module with these tensors as plain parameters
        t = cls(9, dtype=torch.float64, **kw)
        with torch.no_grad():
            t.weight.copy_(weight)
            if bias is not None:
                t.bias.copy_(bias)
        return t(x)

    bias = getattr(m, "bias", None)
    gain = torch.linspace(0.5, 2.0, 9, dtype=torch.float64)
    swapped = {"weight": gain} if bias is None else {"weight": gain, "bias": bias + 1}
    got = torch.func.functional_call(m, swapped, (x,))
    torch.testing.assert_close(got, twin(gain, None if bias is None else bias + 1))
    m.weight = torch.nn.Parameter(gain.clone())
    torch.testing.assert_close(m(x), twin(gain, bias))
    torch.nn.utils.parametrize.register_parametrization(m, "weight", _Doubled())
    torch.testing.assert_close(m(x), twin(2 * gain, bias))
    plain = cls(9, dtype=torch.float64, **kw)
    del plain.weight  # a gain removed: the attribute error torch gives, not None
    with pytest.raises(AttributeError, match="weight"):
        plain(x)


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


# -- torch subclasses ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (lambda **k: layernorm.LayerNorm((4, 6), 1e-3, True, False, **k),
         lambda **k: torch.nn.LayerNorm((4, 6), 1e-3, True, False, **k)),
        (lambda **k: layernorm.LayerNorm(6, elementwise_affine=False, **k),
         lambda **k: torch.nn.LayerNorm(6, elementwise_affine=False, **k)),
        (lambda **k: layernorm.RMSNorm((4, 6), 1e-6, **k),
         lambda **k: torch.nn.RMSNorm((4, 6), 1e-6, **k)),
        (lambda **k: layernorm.RMSNorm(6, None, False, **k),
         lambda **k: torch.nn.RMSNorm(6, None, False, **k)),
    ],
    ids=["layer", "layer-simple", "rms", "rms-no-affine"],
)  # fmt: skip
def test_subclass_of_torch_norm_with_the_same_attributes(ours, theirs):
    """Type checks treat ours as torch's norm; every attribute torch sets has the same value."""
    m, t = ours(dtype=torch.float64), theirs(dtype=torch.float64)
    assert isinstance(m, type(t))
    torch_attrs = {k: v for k, v in vars(t).items() if not k.startswith("_") and k != "training"}
    assert torch_attrs, "torch's module keeps its options as attributes"
    for name, value in torch_attrs.items():
        assert getattr(m, name) == value and type(getattr(m, name)) is type(value), name
    assert list(m.state_dict()) == list(t.state_dict())
    assert repr(m) == repr(t)


def test_rms_norm_keeps_a_none_bias():
    """torch.nn.RMSNorm has no bias; ours answers ``None`` as before, without a state_dict key."""
    m = layernorm.RMSNorm(6)
    assert m.bias is None and "bias" not in m.state_dict()


@pytest.mark.parametrize("cls", [layernorm.LayerNorm, layernorm.RMSNorm])
def test_gain_offset(cls):
    """gain_offset=1 stores gain − 1 (Gemma's convention): init 0, output (1 + w)·x̂."""
    m = cls(8, eps=1e-6, gain_offset=1.0, dtype=torch.float64)
    assert torch.equal(m.weight, torch.zeros(8, dtype=torch.float64))
    assert "gain_offset=1.0" in repr(m)
    plain = cls(8, eps=1e-6, dtype=torch.float64)
    _randomize(m)
    with torch.no_grad():
        plain.weight.copy_(m.weight + 1.0)
        if getattr(m, "bias", None) is not None:
            plain.bias.copy_(m.bias)
    x = make_x((3, 8), torch.float64, requires_grad=True)
    torch.testing.assert_close(m(x), plain(x))
    with torch.no_grad():
        torch.testing.assert_close(m(x), plain(x))
    m(x).sum().backward()
    assert m.weight.grad is not None
    m.reset_parameters()
    assert torch.equal(m.weight, torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"gain_offset=1\.0 needs elementwise_affine=True"):
        cls(8, elementwise_affine=False, gain_offset=1.0)
    with pytest.raises(TypeError, match=r"gain_offset must be a finite float, got str"):
        cls(8, gain_offset="1")


def test_transformer_encoder_layer_with_our_norms_inside():
    """TransformerEncoderLayer's fused inference kernel reads norm.weight/bias/eps and runs
    torch's layer norm. Our LayerNorm (a subclass) computes that same function, so the kernel may
    run; with a gain offset torch's kernel would be wrong, and the module keeps it off."""
    torch.manual_seed(0)

    def layer(**norm_kwargs):
        enc = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        enc.norm1 = layernorm.LayerNorm(16, **norm_kwargs)
        enc.norm2 = layernorm.LayerNorm(16, **norm_kwargs)
        _randomize(enc.norm1)
        _randomize(enc.norm2)
        return enc.eval()

    def manual(enc, x):
        h = enc.norm1(x + enc.self_attn(x, x, x, need_weights=False)[0])
        return enc.norm2(h + enc.linear2(enc.activation(enc.linear1(h))))

    x = make_x((2, 5, 16))
    for kwargs in ({}, {"detach_mean": True, "detach_std": True}, {"gain_offset": 1.0}):
        enc = layer(**kwargs)
        with torch.no_grad():
            torch.testing.assert_close(enc(x), manual(enc, x), atol=1e-5, rtol=1e-5)


# -- the lean path for small and inference calls ------------------------------------------------


def _spy_full_path(monkeypatch):
    """Record the op of every call that takes the functional ops' full path (their checks, which
    the lean paths skip)."""
    from layernorm import functional

    calls = []
    check_input = functional.check_input

    def spy(x, normalized_shape, op):
        calls.append(op)
        return check_input(x, normalized_shape, op)

    monkeypatch.setattr(functional, "check_input", spy)
    return calls


def _spy_fused_path(monkeypatch):
    """Record the op of every call that goes to the fused kernels (the functional ops' row
    functions, by their full path or their lean one, and the C++ operators) rather than to one
    of torch's kernels."""
    from layernorm import functional

    calls = []
    for op in ("layer_norm", "rms_norm"):
        for name in (f"{op}_rows", f"{op}_rows_eager"):
            real = getattr(functional, name)

            def spy(*args, _real=real, _op=op):
                calls.append(_op)
                return _real(*args)

            monkeypatch.setattr(functional, name, spy)
        real_node = getattr(torch_ops, op)  # the C++ operators' calls, from the lean paths

        def node_spy(*args, _real=real_node, _op=op):
            calls.append(_op)
            return _real(*args)

        monkeypatch.setattr(torch_ops, op, node_spy)
    return calls


@pytest.mark.parametrize("shape", [(1, 768), (8, 768), (2, 3, 4, 6)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_lean_path_matches_full_path(monkeypatch, shape, dtype):
    """Inference and small calls skip the custom ops; the results are the full path's, NaN and
    infinite rows included, and no full-path call happens."""
    nshape = shape[-1:] if len(shape) == 2 else shape[-2:]
    x = make_x(shape, dtype)
    x.view(-1, x.shape[-1])[0, 1] = float("nan")
    x.view(-1, x.shape[-1])[-1, 0] = float("inf")
    for m in (
        layernorm.LayerNorm(nshape),
        layernorm.RMSNorm(nshape),
        layernorm.RMSNorm(nshape, 1e-3),
    ):
        m = m.to(dtype)
        _randomize(m)
        expected_fn = (
            layernorm.layer_norm
            if isinstance(m, torch.nn.LayerNorm)
            else lambda x, s, w, b, e: layernorm.rms_norm(x, s, w, e)
        )
        expected = expected_fn(x, nshape, m.weight, getattr(m, "bias", None), m.eps)
        calls = _spy_full_path(monkeypatch)
        with torch.no_grad():
            y = m(x)
        assert calls == [], "no_grad took the full path"
        assert y.dtype == dtype and y.shape == x.shape
        tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
        torch.testing.assert_close(y, expected.detach(), equal_nan=True, **tol)
        monkeypatch.undo()


def test_small_layer_norm_with_grad_uses_torch_kernel_detach_norm_does_not(monkeypatch):
    """With gradients, a small plain LayerNorm runs torch's kernel (same formula, same gradients);
    DetachNorm keeps the fused path, whose backward differs, and large inputs do too."""
    # the routes LayerNorm takes with gradients where the C++ operators are off
    monkeypatch.setitem(torch_ops._switch, "on", False)
    from layernorm.modules.normalization import SMALL_NUMEL

    calls = _spy_fused_path(monkeypatch)
    ln, dn = layernorm.LayerNorm(16), layernorm.LayerNorm(16, detach_mean=True)
    x = make_x((4, 16), requires_grad=True)
    ln(x).sum().backward()
    assert calls == []
    dn(x).sum().backward()
    assert calls == ["layer_norm"]
    big = make_x((SMALL_NUMEL // 16 + 1, 16), requires_grad=True)
    ln(big)
    assert calls == ["layer_norm", "layer_norm"]


@pytest.mark.parametrize("pdt", ["x's", torch.float32], ids=["params in x's dtype", "float32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("m", "n", "offset"), [(37, 7, 1.0), (8, 768, 3.0), (2, 4099, -20.0)])
def test_small_half_layer_norm_with_grad_in_float32_within_the_fused_error_model(
    monkeypatch, dtype, pdt, m, n, offset
):
    """With gradients, a small bfloat16 / float16 LayerNorm runs torch's float32 kernel on the
    exactly converted input (not the fused kernels, not torch's half backward, whose dx at 37
    rows of 7 was 1.6x the bound): output, dx, dγ and dβ within the fused kernels' error model
    against float64, in the dtypes the fused path gives."""
    # the route LayerNorm takes with gradients where the C++ operators are off
    monkeypatch.setitem(torch_ops._switch, "on", False)
    from layernorm.reference import layer_norm_reference
    from tolerances import assert_within, row_stats

    pdt = dtype if pdt == "x's" else pdt
    calls = _spy_fused_path(monkeypatch)
    g = torch.Generator().manual_seed(m + n)
    ln = layernorm.LayerNorm(n).to(pdt)
    with torch.no_grad():
        ln.weight.copy_(1 + 0.5 * torch.randn(n, generator=g))
        ln.bias.copy_(0.5 * torch.randn(n, generator=g))
    x = (torch.randn(m, n, generator=g, dtype=torch.float64) * 2 + offset).to(dtype)
    x.requires_grad_()
    dy = torch.randn(m, n, generator=g, dtype=torch.float64).to(dtype)
    y = ln(x)
    dx, dw, db = torch.autograd.grad(y, (x, ln.weight, ln.bias), dy)
    assert calls == [], "the fused kernels ran"
    assert (y.dtype, dx.dtype, dw.dtype, db.dtype) == (dtype, dtype, pdt, pdt)
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, ln.weight, ln.bias))
    yr = layer_norm_reference(xr, (n,), wr, br, ln.eps)
    dxr, dwr, dbr = torch.autograd.grad(yr, (xr, wr, br), dy.double())
    xhat, rs, kappa = row_stats(x.detach().double(), ln.eps)
    xmax = xhat.abs().amax(-1, keepdim=True)
    w64, dy64 = wr.detach(), dy.double()
    what = f"{dtype} params {pdt} ({m}, {n})"
    y_scale = w64.abs().max() * (xmax + kappa) + br.detach().abs().max()
    assert_within(y, yr, "y", dtype, y_scale, what, fused=True)
    dx_scale = rs * (dy64 * w64).abs().amax(-1, keepdim=True) * (1 + xmax) * kappa
    assert_within(dx, dxr, "dx", dtype, dx_scale, what + " dx", fused=True)
    dw_scale = (dy64.abs() * (xhat.abs() + kappa)).sum(0)
    assert_within(dw, dwr, "dparam", dtype, dw_scale, what + " dweight", fused=True)
    assert_within(db, dbr, "dparam", dtype, dy64.abs().sum(0), what + " dbias", fused=True)


def test_half_layer_norm_routes(monkeypatch):
    """bfloat16 with gradients: torch's float32 kernel up to TORCH_FLOAT32_NUMEL elements, the
    fused kernels past it, with a DetachNorm flag, or with parameters in another dtype."""
    # the routes LayerNorm takes with gradients where the C++ operators are off
    monkeypatch.setitem(torch_ops._switch, "on", False)
    from layernorm.ops._dispatch import TORCH_FLOAT32_NUMEL

    calls = _spy_fused_path(monkeypatch)
    ln = layernorm.LayerNorm(16).to(torch.bfloat16)
    x = make_x((4, 16), torch.bfloat16, requires_grad=True)
    ln(x).sum().backward()
    assert calls == []
    big = make_x((TORCH_FLOAT32_NUMEL // 16 + 1, 16), torch.bfloat16, requires_grad=True)
    ln(big)
    assert calls == ["layer_norm"]
    layernorm.LayerNorm(16, detach_std=True).to(torch.bfloat16)(x)
    assert calls == ["layer_norm"] * 2
    ln.double()(x)  # float64 parameters: not a float32 route (the full path handles the mix)
    assert calls == ["layer_norm"] * 3


def test_large_layer_norm_under_no_grad_runs_the_fused_kernels(monkeypatch):
    """From ``TORCH_INFERENCE_BYTES`` on (the buffer cache's output size, where the fused
    kernels' output memory is reused; here made 64 rows of 16) the fused kernels run where
    nothing needs a gradient; below it torch's kernel does."""
    from layernorm.ops import _dispatch

    monkeypatch.setattr(_dispatch, "TORCH_INFERENCE_BYTES", 64 * 16 * 4)
    calls = _spy_fused_path(monkeypatch)
    ln = layernorm.LayerNorm(16)
    with torch.no_grad():
        ln(make_x((63, 16)))
        assert calls == []
        ln(make_x((64, 16)))
    assert calls == ["layer_norm"]


def test_small_rms_norm_under_no_grad_runs_torch_s_kernel(monkeypatch):
    """Where nothing needs a gradient a small float32 / float64 RMSNorm runs ``torch.rms_norm``
    (the same formula, within the fused kernels' tolerance); with a gradient past
    ``_TORCH_RMS_GRAD_NUMEL`` elements (here made 1000), in bfloat16 where torch's kernel would
    round twice, from ``_TORCH_RMS_NUMEL`` elements on (here made 64 rows of 16), or with a
    shape torch would refuse, the fused path runs."""
    # the route RMSNorm takes where the C++ operators are off (their node beats torch's)
    monkeypatch.setitem(torch_ops._switch, "on", False)
    from layernorm.modules import normalization

    monkeypatch.setattr(normalization, "_torch_rms_norm_rounds_once", lambda dtype: False)
    monkeypatch.setattr(normalization, "_TORCH_RMS_GRAD_NUMEL", 1000)

    real = torch.rms_norm
    torch_calls: list[tuple[int, ...]] = []

    def spy(x, *args, **kwargs):
        torch_calls.append(tuple(x.shape))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(torch, "rms_norm", spy)
    monkeypatch.setattr(normalization, "_TORCH_RMS_NUMEL", {torch.float32: 64 * 16})
    m = layernorm.RMSNorm(16)
    _randomize(m)
    x = make_x((63, 16))
    with torch.no_grad():
        y = m(x)
        assert torch_calls == [(63, 16)]
        torch.testing.assert_close(y, layernorm.rms_norm(x, 16, m.weight, m.eps))
        m(make_x((64, 16)))  # _TORCH_RMS_NUMEL: the fused kernels
        m.to(torch.bfloat16)(x.to(torch.bfloat16))
        m.float()
        with pytest.raises(ValueError, match=r"got input of shape \(63, 15\)"):
            m(make_x((63, 15)))
    m(x.requires_grad_()).sum().backward()
    assert torch_calls == [(63, 16)]
    assert m.weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(
    ("m", "n", "scale", "offset", "eps", "kind"),
    [(1, 768, 1.0, 0.0, 1e-6, "random"), (8, 768, 1e4, 1e4, 1e-12, "random"),
     (37, 7, 1e-3, -3.0, 1e-3, "random"), (2, 4096, 1.0, 1e4, 1e-5, "constant"),
     (3, 1, 1.0, 1.0, 1e-5, "random"), (5, 768, 1.0, 1.0, 1e-5, "nearly constant")],
)  # fmt: skip
def test_small_rms_norm_with_grad_runs_torch_s_kernel_within_the_fused_error_model(
    monkeypatch, dtype, m, n, scale, offset, eps, kind
):
    """With gradients, a float32 / float64 RMSNorm of up to ``_TORCH_RMS_GRAD_NUMEL`` elements
    runs ``torch.rms_norm`` (not the fused kernels): output, dx and dγ within the fused kernels'
    error model against float64 on hostile rows (large offsets, tiny eps, constant and nearly
    constant rows, rows of one element); one element more takes the fused path."""
    # the route RMSNorm takes where the C++ operators are off (their node beats torch's)
    monkeypatch.setitem(torch_ops._switch, "on", False)
    from layernorm.modules import normalization
    from layernorm.reference import rms_norm_reference
    from tolerances import assert_within, row_stats

    calls = _spy_fused_path(monkeypatch)
    g = torch.Generator().manual_seed(m * n)
    x64 = torch.randn(m, n, generator=g, dtype=torch.float64) * scale + offset
    if kind == "constant":
        x64[:] = x64[:, :1]
    elif kind == "nearly constant":
        x64 = x64[:, :1].expand(m, n).to(dtype).double().clone()
        up = torch.nextafter(x64.to(dtype), torch.tensor(math.inf, dtype=dtype)).double()
        x64 = torch.where(torch.rand(m, n, generator=g) < 0.1, up, x64)
    rms = layernorm.RMSNorm(n, eps=eps, dtype=dtype)
    with torch.no_grad():
        rms.weight.copy_(1 + 0.5 * torch.randn(n, generator=g, dtype=torch.float64))
    x = x64.to(dtype).requires_grad_()
    dy = torch.randn(m, n, generator=g, dtype=torch.float64).to(dtype)
    y = rms(x)
    dx, dw = torch.autograd.grad(y, (x, rms.weight), dy)
    assert calls == [], "the fused kernels ran"
    xr, wr = x.detach().double().requires_grad_(), rms.weight.detach().double().requires_grad_()
    yr = rms_norm_reference(xr, (n,), wr, eps)
    dxr, dwr = torch.autograd.grad(yr, (xr, wr), dy.double())
    xhat, rs, kappa = row_stats(x.detach().double(), eps, centred=False)
    xmax, w64, dy64 = xhat.abs().amax(-1, keepdim=True), wr.detach(), dy.double()
    what = f"{dtype} ({m}, {n}) {kind}"
    assert_within(y, yr, "y", dtype, w64.abs().max() * (xmax + kappa), what, fused=True)
    dx_scale = rs * (dy64 * w64).abs().amax(-1, keepdim=True) * (1 + xmax) * kappa
    assert_within(dx, dxr, "dx", dtype, dx_scale, what + " dx", fused=True)
    dw_scale = (dy64.abs() * (xhat.abs() + kappa)).sum(0)
    assert_within(dw, dwr, "dparam", dtype, dw_scale, what + " dweight", fused=True)
    monkeypatch.setattr(normalization, "_TORCH_RMS_GRAD_NUMEL", m * n - 1)
    rms(x)
    assert calls == ["rms_norm"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_rms_norm_under_no_grad_runs_torch_s_kernel_where_it_rounds_once(monkeypatch, dtype):
    """A half RMSNorm needing no gradient runs ``torch.rms_norm`` where the probe found torch's
    kernel rounding once, and its result then keeps the fused kernels' error model (within one
    rounding of float64 on the same inputs); with a gradient the fused path runs."""
    # the route RMSNorm takes where the C++ operators are off (their node beats torch's)
    monkeypatch.setitem(torch_ops._switch, "on", False)
    from layernorm.modules import normalization

    real = torch.rms_norm
    calls: list[torch.dtype] = []

    def spy(x, *args, **kwargs):
        calls.append(x.dtype)
        return real(x, *args, **kwargs)

    monkeypatch.setattr(normalization, "_torch_rms_norm_rounds_once", lambda dt: True)
    monkeypatch.setattr(torch, "rms_norm", spy)
    m = layernorm.RMSNorm(96, dtype=dtype)
    _randomize(m)
    x = make_x((5, 96)).to(dtype)
    with torch.no_grad():
        y = m(x)
    assert calls == [dtype]
    xd, wd = x.double(), m.weight.double()
    ref = xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + m_eps(m, dtype)) * wd
    unit = torch.finfo(dtype).eps / 2
    assert ((y.double() - ref).abs() <= 1.001 * unit * ref.abs() + 1e-30).all()
    m(x.requires_grad_()).sum().backward()
    assert calls == [dtype]


def m_eps(m, dtype) -> float:
    return m.eps if m.eps is not None else layernorm.functional._RMS_DEFAULT_EPS[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_probe_refuses_a_kernel_that_rounds_twice(monkeypatch, dtype):
    """The probe behind the half route: a kernel that rounds x·rstd to the half type before the
    gain's product (as a composition in x's dtype does) is refused, one that rounds once (the
    fused kernels') accepted, one that raises refused."""
    from layernorm.modules import normalization

    probe = normalization._torch_rms_norm_rounds_once.__wrapped__

    def twice(x, shape, weight, eps):
        xf = x.float()
        xhat = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
        return xhat * weight

    def refuses(*args):
        raise RuntimeError("not here")

    monkeypatch.setattr(torch, "rms_norm", twice)
    assert not probe(dtype)
    monkeypatch.setattr(torch, "rms_norm", lambda x, s, w, e: layernorm.rms_norm(x, s, w, e))
    assert probe(dtype)
    monkeypatch.setattr(torch, "rms_norm", refuses)
    assert not probe(dtype)


@pytest.mark.parametrize("cls", [layernorm.LayerNorm, layernorm.RMSNorm])
def test_lean_path_keeps_the_errors(cls):
    """Under no_grad the same clear errors as with gradients."""
    m = cls(16)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"\(16,\)\) got input of shape \(3, 15\)"):
            m(torch.randn(3, 15))
        with pytest.raises(ValueError, match=r"got input of shape \(\)"):
            m(torch.tensor(1.0))
        with pytest.raises(TypeError, match=r"input must be a floating-point tensor.*int64"):
            m(torch.ones(3, 16, dtype=torch.long))
        with pytest.raises(TypeError, match=r"input must be a torch\.Tensor, got list"):
            m([1.0] * 16)
        m.eps = -1.0
        with pytest.raises(ValueError, match=r"eps must be a positive finite float, got -1\.0"):
            m(torch.randn(3, 16))
        m.eps = 1e-5
        m.weight = torch.nn.Parameter(torch.ones(15))
        with pytest.raises(ValueError, match=r"weight must have shape normalized_shape=\(16,\)"):
            m(torch.randn(3, 16))
        m.weight = torch.nn.Parameter(torch.ones(16, device="meta"))
        with pytest.raises(ValueError, match=r"weight is on meta but input is on cpu"):
            m(torch.randn(3, 16))


def test_lean_path_mixed_dtypes_run_like_the_full_path():
    """float64 gains on float32 activations: torch's kernel refuses them, the full path runs."""
    m = layernorm.LayerNorm(8, dtype=torch.float64)
    _randomize(m)
    x = make_x((3, 8))
    with torch.no_grad():
        y = m(x)
    torch.testing.assert_close(y, layernorm.layer_norm(x, 8, m.weight, m.bias).detach())


def _under_transform(transform: str, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module``'s output on ``x`` (a batch of rows) computed under one of torch's tracers or
    transforms; for ``jvp``, the tangent along x itself (the output's directional derivative)."""
    from torch.func import functional_call, grad, jvp, vmap
    from torch.fx.experimental.proxy_tensor import make_fx

    if transform == "vmap":
        return vmap(module)(x)
    if transform == "jvp":
        return jvp(module, (x,), (x * 0.5 - 0.25,))[1]
    if transform == "make_fx":
        return make_fx(module)(x)(x)
    params = dict(module.named_parameters())

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return (functional_call(module, p, (x,)) * x.flip(-1)).sum()

    return grad(loss)(params)["weight"]  # the gain's gradient, through the layer's backward


@pytest.mark.parametrize("frozen", [False, True], ids=["params", "frozen"])
@pytest.mark.parametrize("transform", ["vmap", "jvp", "make_fx", "grad"])
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: layernorm.LayerNorm(8), id="LayerNorm"),
        pytest.param(lambda: layernorm.LayerNorm(8, detach_mean=True, detach_std=True),
                     id="DetachNorm"),
        pytest.param(lambda: layernorm.RMSNorm(8), id="RMSNorm"),
    ],
)  # fmt: skip
def test_module_under_transforms_matches_the_reference(transform, make, frozen):
    """The modules' routes to ``torch.layer_norm`` / ``torch.rms_norm`` are open under make_fx,
    the functorch transforms and forward-mode AD (each records or transforms that ATen op): the
    results are those of the reference, DetachNorm's derivatives too (torch's op would give plain
    layer norm's), also where no parameter requires a gradient (then only the transform takes a
    derivative)."""
    if frozen and transform == "grad":
        pytest.skip("the gain's gradient needs a gain that requires it")
    m = make().double()
    _randomize(m)
    m.requires_grad_(not frozen)
    x = make_x((3, 8), torch.float64)
    got = _under_transform(transform, m, x)
    want = _under_transform(transform, _Reference(m), x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


class _Reference(torch.nn.Module):
    """``layer_norm_reference`` or ``rms_norm_reference`` (plain tensor ops) with a module's
    parameters and options."""

    def __init__(self, m: torch.nn.Module) -> None:
        super().__init__()
        self.weight, self.bias, self.m = m.weight, m.bias, m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.m
        if isinstance(m, layernorm.RMSNorm):
            return rms_norm_reference(x, m.normalized_shape, self.weight, m.eps)
        return layer_norm_reference(x, m.normalized_shape, self.weight, self.bias, m.eps,
                                    m.detach_mean, m.detach_std)  # fmt: skip


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.parametrize("cls", [layernorm.LayerNorm, layernorm.RMSNorm])
def test_jit_trace_under_no_grad_replays_on_new_inputs(cls):
    """An inference trace records the op that computes the output, not an empty buffer that a
    kernel filled behind the tracer's back."""
    m = cls(8)
    _randomize(m)
    with torch.no_grad():
        traced = torch.jit.trace(m, make_x((2, 8)), check_trace=False)
        x = make_x((3, 8), offset=-1.0)
        torch.testing.assert_close(traced(x), m(x))


def test_rms_norm_probe_ignores_default_device_and_dtype():
    """The half route's probe makes its CPU float32 tensors itself: under another default device
    (a meta-device context, as model-initialization helpers set) and default dtype it answers as
    without them."""
    from layernorm.modules import normalization

    probe = normalization._torch_rms_norm_rounds_once.__wrapped__
    plain = probe(torch.bfloat16)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("meta"):
            assert probe(torch.bfloat16) == plain
    finally:
        torch.set_default_dtype(saved)


def test_norms_on_cpu_tensors_under_another_default_device():
    """The norms, their functional forms and replace_norms' probe on CPU tensors give the same
    results under ``torch.device("meta")`` (another default device) and a float64 default dtype:
    nothing they make for the kernels takes the defaults."""
    torch.manual_seed(0)
    x = make_x((4, 8))
    mods = [layernorm.LayerNorm(8), layernorm.RMSNorm(8), layernorm.AdaNorm(8),
            layernorm.LayerNorm(8, detach_mean=True)]  # fmt: skip

    def run() -> list[torch.Tensor]:
        out = []
        for m in mods:
            xg = x.clone().requires_grad_()
            y = m(xg)
            y.sum().backward()
            out += [y.detach(), xg.grad]
        out.append(layernorm.rms_norm(x.bfloat16(), 8).float())
        out.append(layernorm.layer_norm(x, 8))
        return out

    class RMSLike(torch.nn.Module):  # unregistered: replace_norms probes its form
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))
            self.variance_epsilon = 1e-6

        def forward(self, h):
            return (
                h
                * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
                * self.weight
            )

    plain = run()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), RMSLike())
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("meta"):
            moved = run()
            replaced = layernorm.replace_norms(model, "rms", strict=True)
    finally:
        torch.set_default_dtype(saved)
    for a, b in zip(plain, moved, strict=True):
        assert b.device.type == "cpu"
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert isinstance(replaced[1], layernorm.RMSNorm)
