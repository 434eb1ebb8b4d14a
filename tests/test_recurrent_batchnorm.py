"""Recurrent batch norm (Cooijmans et al. 2016) on the LSTM: equations, per-step statistics."""

from __future__ import annotations

import torch

from layernorm import LayerNormLSTM

DT = torch.float64
EPS = 1e-5


def bn_train(z: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor | None) -> torch.Tensor:
    """Batch statistics per unit, biased variance (training mode)."""
    mu = z.mean(0, keepdim=True)
    var = ((z - mu) ** 2).mean(0, keepdim=True)
    out = gamma * (z - mu) / (var + EPS).sqrt()
    return out if beta is None else out + beta


def test_init_and_buffers() -> None:
    model = LayerNormLSTM(3, 4, norm="batch", max_steps=7)
    for part, size in (("ih", 16), ("hh", 16), ("c", 4)):
        assert torch.all(getattr(model, f"bn_weight_{part}_l0") == 0.1)
        assert getattr(model, f"bn_running_mean_{part}_l0").shape == (7, size)
        assert torch.all(getattr(model, f"bn_running_var_{part}_l0") == 1)
    assert torch.all(model.bn_bias_c_l0 == 0) and torch.all(model.bias_ih_l0 == 0)
    assert not any(n.startswith("ln_") for n, _ in model.named_parameters())
    assert torch.all(LayerNormLSTM(3, 4, norm="batch", bn_gain_init=0.5).bn_weight_c_l0 == 0.5)


def test_one_step_by_hand_and_running_stats_per_step() -> None:
    torch.manual_seed(0)
    hs = 4
    model = LayerNormLSTM(3, hs, norm="batch", max_steps=2, dtype=DT)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = 1.0 + torch.randn(3, 5, 3, dtype=DT)
    out, _ = model(x)
    # step 0 by hand: h0 = c0 = 0, so BN(W_hh h0) = 0 (zero-variance rows normalize to 0)
    w = dict(model.named_parameters())
    pre = (
        bn_train(x[0] @ w["weight_ih_l0"].T, w["bn_weight_ih_l0"], None)
        + w["bias_ih_l0"]
        + w["bias_hh_l0"]
    )
    i, _f, g, o = pre.split(hs, dim=1)
    c1 = torch.sigmoid(i) * torch.tanh(g)
    h1 = torch.sigmoid(o) * torch.tanh(bn_train(c1, w["bn_weight_c_l0"], w["bn_bias_c_l0"]))
    torch.testing.assert_close(out[0], h1, rtol=1e-10, atol=1e-10)
    # running mean of step 0's input-side BN = momentum · batch mean; steps ≥ max_steps share slot 1
    batch_mean = (x[0] @ w["weight_ih_l0"].T).mean(0)
    torch.testing.assert_close(model.bn_running_mean_ih_l0[0], 0.1 * batch_mean)
    # slot 1 was updated by steps 1 and 2 (two updates), so it differs from a single update
    xp1 = (x[1] @ w["weight_ih_l0"].T).mean(0)
    assert not torch.allclose(model.bn_running_mean_ih_l0[1], 0.1 * xp1)


def test_eval_uses_running_statistics_and_batch_independence() -> None:
    torch.manual_seed(0)
    model = LayerNormLSTM(3, 4, norm="batch", max_steps=4, dtype=DT)
    x = torch.randn(6, 5, 3, dtype=DT)
    for _ in range(3):
        model(x)
    model.eval()
    out, _ = model(x)
    alone, _ = model(x[:, 2:3])
    torch.testing.assert_close(out[:, 2:3], alone)  # no batch dependence at test time
    model.train()
    out_train, _ = model(x)
    train_alone, _ = model(x[:, :2])
    assert not torch.allclose(out_train[:, :2], train_alone)  # batch statistics in training


def test_batchnorm_backward_runs_and_needs_two_examples() -> None:
    model = LayerNormLSTM(3, 4, norm="batch", bidirectional=True)
    x = torch.randn(4, 3, 3, requires_grad=True)
    out, _ = model(x)
    out.sum().backward()
    assert x.grad is not None and model.bn_weight_hh_l0_reverse.grad is not None
    try:
        model(torch.randn(4, 1, 3))
    except ValueError as err:
        assert "at least 2" in str(err) and "norm='layer'" in str(err)
    else:
        raise AssertionError("batch norm on one example in training must fail")
