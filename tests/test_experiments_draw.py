"""DRAW (Ba et al. 2016, §6.4): the model's parts against their definitions, the binarized data,
the claims' summaries, a tiny end-to-end run, and a killed run resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import layernorm
from layernorm.experiments import reproduce
from layernorm.experiments.definitions import draw
from layernorm.experiments.engine.checkpoints import KILL_ENV
from layernorm.experiments.engine.registry import get
from layernorm.experiments.models.draw import DRAW, DrawLSTMCell, filterbank

TINY = ["glimpses=2", "hidden=8", "z_size=3", "n_train=64", "n_test=32", "epochs=2",
        "batch_size=32", "seeds=2"]  # fmt: skip


def test_plain_cell_is_torch_lstm_cell_and_cell_norm_follows_its_equation():
    torch.manual_seed(0)
    x, h, c = torch.randn(5, 7), torch.randn(5, 6), torch.randn(5, 6)
    plain = DrawLSTMCell(7, 6, cell_norm=False)
    ref = nn.LSTMCell(7, 6)
    with torch.no_grad():  # [W_ih | W_hh] and one bias = b_ih + b_hh
        ref.weight_ih.copy_(plain.gates.weight[:, :7])
        ref.weight_hh.copy_(plain.gates.weight[:, 7:])
        ref.bias_ih.copy_(plain.gates.bias)
        ref.bias_hh.zero_()
    h1, c1 = plain(x, (h, c))
    h2, c2 = ref(x, (h, c))
    torch.testing.assert_close(h1, h2)
    torch.testing.assert_close(c1, c2)

    normed = DrawLSTMCell(7, 6, cell_norm=True)
    normed.load_state_dict(plain.state_dict(), strict=False)
    h3, c3 = normed(x, (h, c))
    torch.testing.assert_close(c3, c1)  # the carried state is the un-normalized c_t
    o = torch.sigmoid(plain.gates(torch.cat([x, h], 1)).chunk(4, 1)[3])
    cn = (c1 - c1.mean(1, keepdim=True)) / torch.sqrt(c1.var(1, unbiased=False, keepdim=True)
                                                      + 1e-5)  # fmt: skip
    torch.testing.assert_close(h3, o * torch.tanh(cn))


def test_filterbank_rows_sum_to_one_and_the_centred_grid_is_symmetric():
    fx, fy, gamma = filterbank(torch.zeros(3, 5), 5)  # g̃ = 0, σ² = δ̃ = γ = 1
    assert fx.shape == (3, 5, 28) and gamma.shape == (3, 1)
    torch.testing.assert_close(fx.sum(2), torch.ones(3, 5))
    torch.testing.assert_close(fx, fy)
    # centred on pixel (28 + 1)/2 in 1-based coordinates: mirror image of itself
    torch.testing.assert_close(fx, fx.flip(1).flip(2))
    # stride δ = 27/4 between filter centres; the middle filter peaks in the middle
    peaks = fx[0].argmax(1).tolist()
    assert peaks[2] in (13, 14) and peaks[0] < peaks[1] < peaks[2] < peaks[3] < peaks[4]


def test_bound_is_reconstruction_plus_kl_of_each_glimpse():
    """With one glimpse the bound can be recomputed from the model's parts."""
    torch.manual_seed(1)
    model = DRAW(1, 8, 3, norm="cell")
    x = torch.bernoulli(torch.rand(4, 784))
    loss = model(x, generator=torch.Generator().manual_seed(5))
    zeros = torch.zeros(4, 8)
    r = model.read(x, x - 0.5, zeros)
    h_enc, _ = model.encoder(torch.cat([r, zeros], 1), (zeros, zeros))
    mu, log_sigma = model.q(h_enc).chunk(2, 1)
    eps = torch.randn(mu.shape, generator=torch.Generator().manual_seed(5))
    q = torch.distributions.Normal(mu, log_sigma.exp())
    kl = torch.distributions.kl_divergence(q, torch.distributions.Normal(0.0, 1.0)).sum(1)
    h_dec, _ = model.decoder(mu + log_sigma.exp() * eps, (zeros, zeros))
    canvas = model.write(h_dec)
    bce = F.binary_cross_entropy_with_logits(canvas, x, reduction="none").sum(1)
    torch.testing.assert_close(loss, bce + kl)


@pytest.mark.parametrize("norm", ["none", "cell", "full"])
def test_draw_trains_on_a_fixed_batch(norm):
    torch.manual_seed(0)
    model = DRAW(2, 8, 3, norm=norm)
    if norm == "full":
        assert isinstance(model.encoder, layernorm.LayerNormLSTMCell)
    x = torch.bernoulli(torch.rand(8, 784) * 0.3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = float(model(x).mean().detach())
    for _ in range(20):
        loss = model(x).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < first - 5  # nats, from ≈ 784·ln 2 at the start


def test_binarized_mnist_is_fixed_and_binary():
    train, test = draw.binarized_mnist()
    assert train.shape == (50_000, 784) and test.shape == (10_000, 784)
    assert set(torch.unique(train[:100]).tolist()) == {0.0, 1.0}
    draw.binarized_mnist.cache_clear()
    again, _ = draw.binarized_mnist()
    assert torch.equal(train, again)
    grey = layernorm.data.load_mnist(50_000).train_x
    assert abs(float(train.mean()) - float(grey.mean())) < 2e-3  # a Bernoulli draw of the grey


def _records(curves: dict[str, list[list[float]]]) -> list[dict]:
    return [{"model": m, "seed": s, "epoch": e + 1, "step": 10 * (e + 1),
             "seconds": 2.0 * (e + 1), "test_nats": v, "diverged": False}
            for m, runs in curves.items() for s, run in enumerate(runs)
            for e, v in enumerate(run)]  # fmt: skip


def test_speedup_and_verdicts_from_records():
    recs = _records({"none": [[120, 110, 100, 95], [121, 111, 101, 96]],
                     "cell": [[110, 96, 90, 88], [111, 97, 91, 89]]})  # fmt: skip
    cfg = draw.DrawConfig(epochs=4, seeds=2)
    # the baseline reaches 96 (its worst final) at epochs 3.8 and 4 → 3.9; LN at 2 + 1/6 and 2.25
    ratios, target = draw.speedup(recs)
    assert target == 96
    assert ratios == pytest.approx([3.9 / 2.0, 3.9 / (2 + 1 / 6)])
    status = {v.claim_id: v.status for v in draw.verdicts(recs, cfg)}
    assert status == {"draw-faster-epoch": "holds", "draw-faster-second": "holds",
                      "draw-final": "holds"}  # fmt: skip
    worse = _records({"none": [[120, 110, 100, 95], [121, 111, 101, 96]],
                      "cell": [[130, 120, 110, 105], [131, 121, 111, 106]]})  # fmt: skip
    status = {v.claim_id: v.status for v in draw.verdicts(worse, cfg)}
    assert set(status.values()) == {"does not hold"}
    assert draw.speedup(worse)[0] == [0.0, 0.0]  # LN never reaches the baseline's bound


def test_draw_tiny_end_to_end_and_resume(tmp_path: Path):
    out = tmp_path / "res"
    md = reproduce(["draw"], out=out, quick=True, overrides=TINY, progress=False)
    assert md is not None and "82.36" in md.read_text() and "82.09" in md.read_text()
    recs = json.loads((out / "draw" / "records.json").read_text())
    assert len(recs) == 2 * 2 * 2  # models × seeds × epochs
    assert {r["epoch"] for r in recs} == {1, 2} and {r["step"] for r in recs} == {2, 4}
    assert all(100 < r["test_nats"] < 800 for r in recs)
    assert (out / "figures" / "draw.png").stat().st_size > 0
    cfg = get("draw").config(True)
    assert [v.claim_id for v in get("draw").verdicts(recs, cfg)] == [c.id for c in
                                                                    get("draw").claims]  # fmt: skip


def _cli(out: Path, *extra: str, kill_after: int | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != KILL_ENV}
    if kill_after is not None:
        env[KILL_ENV] = str(kill_after)
    sets = [a for s in TINY for a in ("--set", s)]
    cmd = [sys.executable, "-m", "layernorm", "reproduce", "draw", "--quick", "--device", "cpu",
           "--out", str(out), "--no-progress", *sets]  # fmt: skip
    return subprocess.run([*cmd, *extra], env=env, capture_output=True, text=True, timeout=300)


def test_draw_killed_after_an_epoch_resumes_to_the_same_numbers(tmp_path: Path):
    full = _cli(tmp_path / "full")
    assert full.returncode == 0, full.stderr
    killed = _cli(tmp_path / "cut", kill_after=1)  # after the first epoch of the first run
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = _cli(tmp_path / "cut", "--resume")
    assert resumed.returncode == 0, resumed.stderr

    def nats(out: Path) -> list[float]:
        return [r["test_nats"] for r in json.loads((out / "draw" / "records.json").read_text())]

    a = nats(tmp_path / "full")
    assert a == nats(tmp_path / "cut")  # bitwise: the posterior noise is replayed too
    assert len(set(a)) == len(a)


def test_attention_starts_centred_wide_and_with_unit_gain():
    model = DRAW(1, 8, 2)
    h = torch.zeros(1, 8)
    fx, _, gamma = filterbank(model.read_attn(h), 2)
    assert float(gamma) == 1.0
    assert fx[0].argmax(1).tolist() == [7, 20]  # centres 14.5 ∓ 6.75 (1-based), i.e. on the digit
    with torch.no_grad():
        model.write_patch.weight.zero_()
        model.write_patch.bias.fill_(1.0)
    canvas = model.write(h).view(28, 28)
    assert 0.8 < float(canvas[8:20, 8:20].mean()) < 1.25  # a constant patch adds about itself
