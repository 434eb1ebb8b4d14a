"""Sequential MNIST: an LSTM reads an image one row (28 steps) or one pixel (784 steps) at a time
and classifies it from its last hidden state; plain LSTM vs LN-LSTM (and recurrent BN).

A substitute for the LN paper's long-sequence, small-batch handwriting experiment (§6.5, batch 8,
~700 steps), with published LSTM numbers (Cooijmans et al. 2016: 98.9% for the pixel-by-pixel
task). The quick setting reads rows (28 steps) at batch 16; the full one reads pixels (784 steps)
at batch 16.

Pixels are standardized (the training set's mean and standard deviation) for every model. This
matters for layer norm: the leading rows/pixels of an MNIST image are exactly 0, so from a zero
initial state ``W_ih x_t``, ``W_hh h_{t−1}`` and ``c_t`` stay exactly 0, and LN's Jacobian at a
constant input is ``1/√eps ≈ 316`` (eps = 1e-5). Chained over those steps in back-propagation
through time it sends the bias gradients past 1e29 (then to inf/NaN in the norm clipping), and LN-
LSTM training stalls or diverges. ``standardize=False`` shows this.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...recurrent import LayerNormLSTM
from ..analysis.compare import claim, lower, lower_per_second
from ..analysis.curves import final, final_table, lines, mean_curve, rows, step_time_figure
from ..analysis.plots import COLORS, LABELS
from ..data import mnist_subsets
from ..engine.registry import (
    Claim,
    Experiment,
    Record,
    RunContext,
    Verdict,
    check_choices,
    register,
)
from ..engine.steps import train_grid
from ..engine.training import evaluate

NORMS = ("none", "layer", "batch")
MODES = {"rows": (28, 28), "pixels": (784, 1)}  # mode → (time steps, features per step)


@dataclass(frozen=True)
class SeqMnistConfig:
    """Settings of ``seq-mnist``.

    Attributes:
        mode: ``"rows"`` (28 steps of 28 pixels) or ``"pixels"`` (784 steps of 1 pixel).
        hidden: LSTM units.
        batch_size: images per update (small on purpose: the paper's point).
        steps: updates per run.
        eval_every: updates between test passes.
        n_train: training images sampled from (the first of the 55,000).
        n_test: test images scored.
        norms: ``none``, ``layer``, ``batch`` (recurrent BN, γ init 0.1).
        seeds: runs per model.
        lr: Adam learning rate.
        clip: gradient-norm clipping.
        threads: torch intra-op threads (0 = leave as is).
        standardize: subtract the training pixels' mean and divide by their standard deviation
            (see the module docstring for why LN needs non-constant inputs).
    """

    mode: str = "pixels"
    hidden: int = 128
    batch_size: int = 16
    steps: int = 3000
    eval_every: int = 250
    n_train: int = 55_000
    n_test: int = 2000
    norms: tuple[str, ...] = NORMS
    seeds: int = 2
    lr: float = 1e-3
    clip: float = 1.0
    threads: int = 0
    standardize: bool = True


def config(quick: bool) -> SeqMnistConfig:
    if quick:
        return SeqMnistConfig(mode="rows", hidden=64, batch_size=16, steps=1200, eval_every=100,
                              n_train=10_000, n_test=1000, norms=("none", "layer"), seeds=4,
                              lr=2e-3, threads=1)  # fmt: skip
    return SeqMnistConfig()


class SeqClassifier(nn.Module):
    """LSTM (``norm``) over ``(B, T, I)`` sequences → linear read-out of the last hidden state."""

    def __init__(self, inputs: int, hidden: int, classes: int, norm: str, max_steps: int) -> None:
        super().__init__()
        self.rnn = LayerNormLSTM(inputs, hidden, batch_first=True, norm=norm, max_steps=max_steps)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        _, (h, _) = self.rnn(x)
        return self.out(h[-1])


def classify(model: nn.Module, x: Tensor, y: Tensor, device: torch.device, batch: int = 500
             ) -> dict[str, float]:  # fmt: skip
    """Test NLL (nats) and error rate (:func:`~layernorm.experiments.engine.training.evaluate`)."""
    nll, err = evaluate(model, x, y, device, batch)
    return {"test_nll": nll, "test_err": err}


def run(cfg: SeqMnistConfig, ctx: RunContext) -> list[Record]:
    if cfg.mode not in MODES:
        raise ValueError(f"seq-mnist: mode must be one of {tuple(MODES)}, got {cfg.mode!r}")
    check_choices("seq-mnist", "norms", cfg.norms, NORMS)
    steps_t, feats = MODES[cfg.mode]
    (tx, ty), (sx, sy) = mnist_subsets(cfg.n_train, cfg.n_test)
    tx, sx = tx.reshape(-1, steps_t, feats), sx.reshape(-1, steps_t, feats)
    if cfg.standardize:
        mu, sd = float(tx.mean()), float(tx.std())
        tx, sx = (tx - mu) / sd, (sx - mu) / sd

    def sample(g: torch.Generator) -> tuple[Tensor, Tensor]:
        idx = torch.randint(0, tx.shape[0], (cfg.batch_size,), generator=g)
        return tx[idx], ty[idx]

    def loss(m: nn.Module, b: tuple[Tensor, Tensor]) -> Tensor:
        return F.cross_entropy(m(b[0].to(ctx.device)), b[1].to(ctx.device))

    return train_grid(
        cfg, ctx, cfg.norms,
        lambda norm: SeqClassifier(feats, cfg.hidden, 10, norm, steps_t),
        sample, loss, lambda m: classify(m, sx, sy, ctx.device),
    )  # fmt: skip


LN, LSTM = ("LN", {"model": "layer"}), ("LSTM", {"model": "none"})


def verdicts(records: Sequence[Record], cfg: SeqMnistConfig) -> list[Verdict]:
    pct = {"margin": 0.005, "scale": 100.0, "unit": "%"}  # half a percentage point of test error
    need = ["none", "layer"]
    return [
        claim("smnist-faster", cfg.norms, need, lambda: lower(
            records, mean_curve, "test_err", LN, LSTM, quantity="test error averaged over the "
            "evaluations (area under the per-update curve)", **pct)),
        claim("smnist-final", cfg.norms, need, lambda: lower(
            records, final, "test_err", LN, LSTM, quantity="final test error", **pct)),
        claim("smnist-per-second", cfg.norms, need, lambda: lower_per_second(
            records, "test_err", LN, LSTM,
            quantity="test error after {t:.1f} s of training (the shorter run's total)", **pct)),
    ]  # fmt: skip


def tables(records: Sequence[Record], cfg: SeqMnistConfig) -> str:
    return final_table(records, rows(cfg.norms, LABELS),
                       [("test_err", "test error", 100.0, "%"),
                        ("test_nll", "test NLL", 1.0, "")])  # fmt: skip


def plot(records: Sequence[Record], cfg: SeqMnistConfig, fig_dir: Path) -> list[Path]:
    steps_t = MODES.get(cfg.mode, (0, 0))[0]
    title = (f"Sequential MNIST ({cfg.mode}: {steps_t} steps), LSTM-{cfg.hidden}, batch "
             f"{cfg.batch_size}, {cfg.seeds} seed(s)")  # fmt: skip
    return [step_time_figure(records, fig_dir / "seq_mnist.png", metric="test_err",
                             ylabel="test error (%)", models=lines(cfg.norms, LABELS, COLORS),
                             title=title, scale=100.0)]  # fmt: skip


EXPERIMENT = register(Experiment(
    name="seq-mnist",
    title="Sequential MNIST with small batches: LSTM vs LN-LSTM",
    section="Ba et al. 2016, §6.5 and §7 (substitute task: sequential MNIST)",
    claims=(
        Claim("smnist-faster",
              "“The combination of small mini-batch size and very long sequences makes it "
              "important to have very stable hidden dynamics. […] layer normalization converges "
              "to a comparable log likelihood as the baseline model but is much faster” (§6.5)",
              "Per update, LN-LSTM's test error averaged over the evaluations (area under the "
              "curve) is lower than the plain LSTM's."),
        Claim("smnist-final",
              "“recurrent neural networks benefit the most from the proposed method especially "
              "for long sequences and small mini-batches” (§7)",
              "LN-LSTM's final test error is lower than the plain LSTM's."),
        Claim("smnist-per-second",
              "“layer normalization can substantially reduce the training time” (abstract)",
              "After the same training wall-clock time, LN-LSTM's test error is lower than the "
              "plain LSTM's."),
    ),
    config=config,
    run=run,
    verdicts=verdicts,
    plot=plot,
    tables=tables,
    quick_budget_s=35.0,
    order=41,
))  # fmt: skip
