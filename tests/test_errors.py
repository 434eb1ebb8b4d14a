"""Bad input gets a ValueError/TypeError that names what was expected and what came."""

from __future__ import annotations

import math

import pytest
import torch

import layernorm

X = torch.randn(8, 256)

OPS = {
    "layer_norm": lambda x, shape, **kw: layernorm.layer_norm(x, shape, **kw),
    "rms_norm": lambda x, shape, **kw: layernorm.rms_norm(x, shape, **kw),
    "ada_norm": lambda x, shape, **kw: layernorm.ada_norm(x, shape, **kw),
}


@pytest.mark.parametrize("op", list(OPS))
def test_wrong_normalized_shape(op):
    with pytest.raises(ValueError, match=rf"{op}\(normalized_shape=\(512,\)\) got input of shape "
                       r"\(8, 256\): its last 1 dimension\(s\) must be \(512,\)"):  # fmt: skip
        OPS[op](X, 512)
    with pytest.raises(ValueError, match=r"last 2 dimension\(s\) must be \(8, 128\)"):
        OPS[op](X, (8, 128))
    with pytest.raises(ValueError, match=r"shape \(\): its last 1 dimension"):
        OPS[op](torch.tensor(1.0), 1)
    with pytest.raises(ValueError, match=r"last 3 dimension\(s\) must be \(1, 8, 256\)"):
        OPS[op](X, (1, 8, 256))


@pytest.mark.parametrize(
    ("shape", "exc", "pattern"),
    [
        ((), ValueError, r"at least one dimension, got \(\)"),
        ((0,), ValueError, r"positive sizes, got \(0,\)"),
        ((-256,), ValueError, r"positive sizes, got \(-256,\)"),
        (256.0, TypeError, r"int or a sequence of ints, got float"),
        ("256", TypeError, r"int or a sequence of ints, got str '256'"),
        (True, TypeError, r"int or a sequence of ints, got bool True"),
        ((256.0,), TypeError, r"must contain ints, got \(256\.0,\)"),
        (None, TypeError, r"int or a sequence of ints, got NoneType"),
    ],
    ids=repr,
)
def test_invalid_normalized_shape(shape, exc, pattern):
    for op in OPS.values():
        with pytest.raises(exc, match=pattern):
            op(X, shape)
    with pytest.raises(exc, match=pattern):
        layernorm.LayerNorm(shape)


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64], ids=str
)
@pytest.mark.parametrize("op", list(OPS))
def test_non_float_input(op, dtype):
    x = torch.ones(4, 6, dtype=dtype)
    with pytest.raises(TypeError, match=rf"{op}: input must be a floating-point tensor "
                       rf".*got dtype {dtype}"):  # fmt: skip
        OPS[op](x, 6)


@pytest.mark.parametrize("op", list(OPS))
def test_input_not_a_tensor(op):
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor, got list"):
        OPS[op]([[1.0, 2.0]], 2)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda p: layernorm.layer_norm(X, 256, weight=p), "weight"),
        (lambda p: layernorm.layer_norm(X, 256, bias=p), "bias"),
        (lambda p: layernorm.rms_norm(X, 256, weight=p), "weight"),
    ],
    ids=["ln-weight", "ln-bias", "rms-weight"],
)
def test_bad_parameter(call, name):
    with pytest.raises(ValueError, match=rf"{name} must have shape normalized_shape=\(256,\), "
                       r"got \(255,\)"):  # fmt: skip
        call(torch.ones(255))
    with pytest.raises(ValueError, match=r"got \(1, 256\)"):
        call(torch.ones(1, 256))  # broadcastable is not enough: torch requires the exact shape
    # another device, simulated with the meta device
    with pytest.raises(ValueError, match=rf"{name} is on meta but input is on cpu"):
        call(torch.ones(256, device="meta"))
    with pytest.raises(TypeError, match=rf"{name} must be a floating-point tensor.*torch\.int64"):
        call(torch.ones(256, dtype=torch.long))
    with pytest.raises(TypeError, match=rf"{name} must be a torch\.Tensor, got list"):
        call([1.0] * 256)


def test_module_parameters_on_another_device():
    x = torch.randn(3, 16)
    for m in (layernorm.LayerNorm(16, device="meta"), layernorm.RMSNorm(16, device="meta")):
        with pytest.raises(ValueError, match="weight is on meta but input is on cpu"):
            m(x)


@pytest.mark.parametrize("eps", [0, 0.0, -1e-5, math.nan, math.inf])
def test_eps_must_be_positive_finite(eps):
    pattern = rf"eps must be a positive finite float, got {eps!r}".replace("(", r"\(")
    for op in OPS.values():
        with pytest.raises(ValueError, match=pattern):
            op(X, 256, eps=eps)
    for module in (layernorm.LayerNorm, layernorm.RMSNorm, layernorm.AdaNorm, layernorm.BatchNorm):
        with pytest.raises(ValueError, match=rf"{module.__name__}: eps must be a positive"):
            module(4, eps=eps)


@pytest.mark.parametrize("eps", ["1e-5", torch.tensor(1e-5), True])
def test_eps_wrong_type(eps):
    for op in OPS.values():
        pattern = rf"eps must be a positive float, got {type(eps).__name__}"
        with pytest.raises(TypeError, match=pattern):
            op(X, 256, eps=eps)


@pytest.mark.parametrize("name", ["k", "scale"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_ada_norm_k_and_scale_finite(name, value):
    with pytest.raises(ValueError, match=rf"ada_norm: {name} must be a finite float, got {value}"):
        layernorm.ada_norm(X, 256, **{name: value})
    with pytest.raises(ValueError, match=rf"AdaNorm: {name} must be a finite float, got {value}"):
        layernorm.AdaNorm(256, **{name: value})


@pytest.mark.parametrize("name", ["k", "scale"])
def test_ada_norm_k_and_scale_type(name):
    with pytest.raises(TypeError, match=rf"{name} must be a finite float, got NoneType None"):
        layernorm.ada_norm(X, 256, **{name: None})
    with pytest.raises(TypeError, match=rf"{name} must be a finite float, got str '0.1'"):
        layernorm.AdaNorm(256, **{name: "0.1"})


def test_batchnorm_constructor_errors():
    with pytest.raises(ValueError, match=r"num_features must be a positive int, got 0"):
        layernorm.BatchNorm(0)
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\], got 1\.5"):
        layernorm.BatchNorm(4, momentum=1.5)
    with pytest.raises(TypeError, match=r"momentum must be a float in \[0, 1\], got NoneType None"):
        layernorm.BatchNorm(4, momentum=None)  # type: ignore[arg-type]


def test_module_input_shape_error():
    with pytest.raises(ValueError, match=r"\(512,\)\) got input of shape \(8, 256\)"):
        layernorm.LayerNorm(512)(X)
    with pytest.raises(ValueError, match=r"got input of shape \(8, 256\)"):
        layernorm.RMSNorm((4, 256))(X)


def test_integer_like_sizes_are_accepted():
    # NumPy integers (np.prod of a shape, a config array) and 0-d integer tensors (x.shape[-1]
    # under torch.jit.trace) are ints to torch.nn.LayerNorm too.
    np = pytest.importorskip("numpy")
    ref = layernorm.layer_norm(X, (256,))
    for shape in (np.int64(256), (np.int32(256),), torch.tensor(256), [torch.tensor(256)]):
        assert torch.equal(layernorm.layer_norm(X, shape), ref)
        assert torch.equal(layernorm.rms_norm(X, shape), layernorm.rms_norm(X, 256))
    m = layernorm.LayerNorm(np.int64(256))
    assert m.normalized_shape == (256,) and type(m.normalized_shape[0]) is int
    assert repr(m) == repr(layernorm.LayerNorm(256))
    with pytest.raises(TypeError, match=r"int or a sequence of ints, got Tensor"):
        layernorm.LayerNorm(torch.tensor(256.0))
    with pytest.raises(TypeError, match=r"must contain ints, got \(np.float64\(256.0\),\)"):
        layernorm.LayerNorm((np.float64(256),))


def test_numpy_float_scalars_are_accepted():
    np = pytest.importorskip("numpy")
    eps = np.float32(1e-3)
    assert torch.equal(
        layernorm.layer_norm(X, 256, eps=eps), layernorm.layer_norm(X, 256, eps=float(eps))
    )
    assert layernorm.LayerNorm(256, eps=np.float64(1e-3)).eps == 1e-3
    assert type(layernorm.RMSNorm(256, eps=np.float64(1e-3)).eps) is float
    ada = layernorm.AdaNorm(256, k=np.float32(0.25), scale=np.float64(2.0))
    assert (ada.k, ada.scale) == (0.25, 2.0)
    with pytest.raises(TypeError, match=r"eps must be a positive float, got bool"):
        layernorm.layer_norm(X, 256, eps=np.bool_(True))
    with pytest.raises(
        ValueError, match=r"eps must be a positive finite float, got np.float32\(nan\)"
    ):
        layernorm.layer_norm(X, 256, eps=np.float32("nan"))


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda v: layernorm.LayerNorm(256, elementwise_affine=v), "elementwise_affine"),
        (lambda v: layernorm.LayerNorm(256, bias=v), "bias"),
        (lambda v: layernorm.LayerNorm(256, detach_mean=v), "detach_mean"),
        (lambda v: layernorm.LayerNorm(256, detach_std=v), "detach_std"),
        (lambda v: layernorm.RMSNorm(256, elementwise_affine=v), "elementwise_affine"),
        (lambda v: layernorm.AdaNorm(256, elementwise_affine=v), "elementwise_affine"),
        (lambda v: layernorm.BatchNorm(256, unbiased=v), "unbiased"),
        (lambda v: layernorm.BatchNorm(256, affine=v), "affine"),
        (lambda v: layernorm.layer_norm(X, 256, detach_mean=v), "detach_mean"),
        (lambda v: layernorm.layer_norm(X, 256, detach_std=v), "detach_std"),
        (lambda v: layernorm.LayerNormLSTM(3, 4, batch_first=v), "batch_first"),
        (lambda v: layernorm.LayerNormGRU(3, 4, bidirectional=v), "bidirectional"),
        (lambda v: layernorm.LayerNormRNN(3, 4, bias=v), "bias"),
        (
            lambda v: layernorm.LayerNormLSTMCell(3, 4, normalize_cell_state=v),
            "normalize_cell_state",
        ),
    ],
)
def test_flags_must_be_bools(make, name):
    # read by truth value, detach_std="no" would switch DetachNorm on without a word
    for bad in ("no", None, 2, 0.0):
        with pytest.raises(TypeError, match=rf"{name} must be a bool, got {type(bad).__name__}"):
            make(bad)
    np = pytest.importorskip("numpy")
    for good in (False, True, 0, 1, np.bool_(True)):
        make(good)


def test_flags_are_stored_as_bools():
    np = pytest.importorskip("numpy")
    m = layernorm.LayerNorm(256, elementwise_affine=np.bool_(True), bias=0, detach_std=1)
    assert (m.elementwise_affine, m.bias, m.detach_std) == (True, None, True)
    assert repr(m) == repr(layernorm.LayerNorm(256, bias=False, detach_std=True))
