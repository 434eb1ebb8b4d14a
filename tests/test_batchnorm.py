"""The batch-norm baseline: torch.nn.BatchNorm1d's behaviour, plus the unbiased-variance option."""

from __future__ import annotations

import pytest
import torch

import layernorm
from conftest import make_x

# Outputs and gradients in float64: only summation order differs from torch's kernel.
ATOL = RTOL = 1e-10


def _pair(c, **kwargs):
    ours = layernorm.BatchNorm(c, dtype=torch.float64, **kwargs)
    theirs = torch.nn.BatchNorm1d(c, dtype=torch.float64, **kwargs)
    if ours.affine:
        with torch.no_grad():
            w, b = torch.randn(c, dtype=torch.float64) + 1, torch.randn(c, dtype=torch.float64)
            ours.weight.copy_(w)
            ours.bias.copy_(b)
            theirs.weight.copy_(w)
            theirs.bias.copy_(b)
    return ours, theirs


@pytest.mark.parametrize("shape", [(4, 6), (8, 5), (3, 6, 7), (2, 4, 1)], ids=str)
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("momentum", [0.1, 0.5])
def test_matches_batchnorm1d(shape, affine, momentum):
    """Training steps (outputs, gradients, running statistics), then eval on running statistics."""
    c = shape[1]
    ours, theirs = _pair(c, affine=affine, momentum=momentum)
    for step in range(3):
        x = make_x(shape, torch.float64, offset=2.0 + step, requires_grad=True)
        xt = x.detach().clone().requires_grad_()
        y, yt = ours(x), theirs(xt)
        torch.testing.assert_close(y, yt, atol=ATOL, rtol=RTOL)
        dy = torch.randn_like(y)
        y.backward(dy)
        yt.backward(dy)
        torch.testing.assert_close(x.grad, xt.grad, atol=ATOL, rtol=RTOL)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), msg=name)
    if affine:
        torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(ours.bias.grad, theirs.bias.grad, atol=ATOL, rtol=RTOL)
    ours.eval()
    theirs.eval()
    x = make_x(shape, torch.float64, offset=-1.0)
    torch.testing.assert_close(ours(x), theirs(x), atol=ATOL, rtol=RTOL)
    # eval must use the running statistics, not the batch: one example alone gives the same rows
    torch.testing.assert_close(ours(x[:1]), ours(x)[:1], atol=ATOL, rtol=RTOL)


def test_unbiased_variance_in_training():
    """unbiased=True normalizes with Σ(a − μ)²/(n − 1), the LN paper's batch-of-4 MNIST setting."""
    bn = layernorm.BatchNorm(5, unbiased=True, affine=False, dtype=torch.float64)
    x = make_x((4, 5), torch.float64, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y = bn(x)
    mu = xr.mean(0)
    var = ((xr - mu) ** 2).sum(0) / (4 - 1)
    expected = (xr - mu) / torch.sqrt(var + 1e-5)
    torch.testing.assert_close(y, expected, atol=ATOL, rtol=RTOL)
    dy = torch.randn_like(y)
    y.backward(dy)
    expected.backward(dy)
    torch.testing.assert_close(x.grad, xr.grad, atol=ATOL, rtol=RTOL)
    # Each unit's batch variance becomes (n−1)/n, not 1 as with the biased estimator.
    batch_var = y.detach().var(0, unbiased=False)
    torch.testing.assert_close(batch_var, torch.full_like(batch_var, 3 / 4), atol=1e-4, rtol=0)
    # running statistics are those of torch (always the unbiased estimate)
    theirs = torch.nn.BatchNorm1d(5, affine=False, dtype=torch.float64)
    theirs(x.detach())
    torch.testing.assert_close(bn.running_var, theirs.running_var)
    torch.testing.assert_close(bn.running_mean, theirs.running_mean)


def test_unbiased_over_sequence_counts_all_positions():
    """For (N, C, L) the statistics pool N·L values per channel, so n − 1 = N·L − 1."""
    bn = layernorm.BatchNorm(3, unbiased=True, affine=False, dtype=torch.float64)
    x = make_x((2, 3, 5), torch.float64)
    xc = x.transpose(0, 1).reshape(3, -1)
    var = xc.var(1, unbiased=True).view(1, 3, 1)
    expected = (x - xc.mean(1).view(1, 3, 1)) / torch.sqrt(var + 1e-5)
    torch.testing.assert_close(bn(x), expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("shape", [(1, 6), (1, 6, 4)], ids=str)
def test_one_example_batch_in_training_is_an_error(shape):
    bn = layernorm.BatchNorm(6)
    with pytest.raises(ValueError, match=r"at least 2 examples.*got a batch of 1"):
        bn(torch.randn(shape))
    assert int(bn.num_batches_tracked) == 0, "a rejected batch must not update running statistics"
    bn.eval()
    assert bn(torch.randn(shape)).shape == shape


def test_state_dict_interchangeable_with_batchnorm1d():
    ours, theirs = _pair(6)
    ours(make_x((4, 6), torch.float64))
    fresh = torch.nn.BatchNorm1d(6, dtype=torch.float64)
    fresh.load_state_dict(ours.state_dict(), strict=True)
    back = layernorm.BatchNorm(6, dtype=torch.float64)
    back.load_state_dict(theirs.state_dict(), strict=True)
    assert set(ours.state_dict()) == set(theirs.state_dict())
    x = make_x((4, 6), torch.float64)
    torch.testing.assert_close(fresh.eval()(x), ours.eval()(x), atol=ATOL, rtol=RTOL)


def test_reset_parameters_and_repr():
    bn = layernorm.BatchNorm(4, unbiased=True)
    bn(make_x((3, 4)))
    with torch.no_grad():
        bn.weight.mul_(3)
    bn.reset_parameters()
    assert torch.equal(bn.running_mean, torch.zeros(4))
    assert torch.equal(bn.running_var, torch.ones(4))
    assert int(bn.num_batches_tracked) == 0 and torch.equal(bn.weight, torch.ones(4))
    assert "unbiased=True" in repr(bn) and "4" in repr(bn)


def test_wrong_channel_count_message():
    bn = layernorm.BatchNorm(6)
    with pytest.raises(ValueError, match=r"num_features=6.*\(N, 6\).*got \(4, 5\)"):
        bn(torch.randn(4, 5))
    with pytest.raises(ValueError, match=r"got \(6,\)"):
        bn(torch.randn(6))
    with pytest.raises(TypeError, match=r"floating-point.*torch\.int64"):
        bn(torch.ones(4, 6, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_input_float32_parameters(dtype):
    """Mixed precision as in torch.nn.BatchNorm1d: half activations, float32 parameters and
    buffers; the output keeps the input's dtype and the statistics are float32-accurate."""
    ours, theirs = layernorm.BatchNorm(6), torch.nn.BatchNorm1d(6)
    x = make_x((8, 6, 3), dtype)
    ref = torch.nn.BatchNorm1d(6, dtype=torch.float64)(x.double())
    y, yt = ours(x), theirs(x)
    assert y.dtype == yt.dtype == dtype
    # one rounding of the output to the half type: 2⁻¹¹ (float16) or 2⁻⁸ (bfloat16) of |y| ≲ 3
    atol = 3 * (2**-11 if dtype == torch.float16 else 2**-8)
    torch.testing.assert_close(y.double(), ref, atol=atol, rtol=0)
    torch.testing.assert_close(ours.running_mean, theirs.running_mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.running_var, theirs.running_var, atol=1e-5, rtol=1e-5)
    ours.eval()
    assert ours(x).dtype == dtype


def test_num_features_kind() -> None:
    # as torch.nn.BatchNorm1d(3.0): a TypeError; NumPy integers are ints
    with pytest.raises(TypeError, match=r"num_features must be a positive int, got float 3.0"):
        layernorm.BatchNorm(3.0)
    with pytest.raises(TypeError, match=r"num_features must be a positive int, got bool True"):
        layernorm.BatchNorm(True)
    np = pytest.importorskip("numpy")
    bn = layernorm.BatchNorm(np.int64(3))
    assert type(bn.num_features) is int and bn.weight.shape == (3,)
    assert repr(bn) == repr(layernorm.BatchNorm(3))


def test_numpy_momentum_and_eps() -> None:
    np = pytest.importorskip("numpy")
    # np.float32 is no Python float (np.float64 is one)
    bn = layernorm.BatchNorm(3, eps=np.float32(1e-3), momentum=np.float32(0.25))
    assert (type(bn.momentum), bn.momentum) == (float, 0.25)
    assert type(bn.eps) is float


def test_unbiased_is_keyword_only() -> None:
    # torch.nn.BatchNorm1d(4, 1e-5, 0.1, True, False) means track_running_stats=False there
    with pytest.raises(TypeError, match="positional argument"):
        layernorm.BatchNorm(4, 1e-5, 0.1, True, True)  # type: ignore[misc]
    assert layernorm.BatchNorm(4, 1e-5, 0.1, True, unbiased=True).unbiased
