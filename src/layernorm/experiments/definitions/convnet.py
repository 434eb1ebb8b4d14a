"""Convolutional networks (Ba et al. 2016, §6.7): no normalization vs batch norm vs layer norm in
a small CNN on MNIST.

``conv5x5(c1) → norm → ReLU → maxpool2 → conv5x5(c2) → norm → ReLU → maxpool2 → linear(10)``.
Layer norm normalizes each case over all of a layer's hidden units (channels × height × width,
with a gain and bias per unit), the direct transposition of Eq. 3 that the paper discusses; batch
norm normalizes each channel over the batch and the spatial positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..analysis.compare import Side, lower
from ..analysis.epochs import auc, final_epoch_table, late
from ..analysis.plots import classifier_panels, curves_figure
from ..analysis.stats import verdict
from ..data import mnist_subsets
from ..engine.registry import Claim, Experiment, Record, RunContext, Verdict, check_config, register
from ..engine.training import TrainSpec, torch_threads, train_classifier
from ..models.cnn import build_cnn
from ..models.mlp import NORMS


@dataclass(frozen=True)
class ConvnetConfig:
    """Attributes: ``n_train``/``n_test`` images, ``channels`` of the two conv layers, ``epochs``,
    ``batch_size``, ``seeds`` runs per model, Adam ``lr``, ``norms`` compared, ``threads`` torch
    intra-op threads (0: torch's default)."""

    n_train: int = 55_000
    n_test: int = 10_000
    channels: tuple[int, ...] = (32, 64)
    epochs: int = 10
    batch_size: int = 128
    seeds: int = 3
    lr: float = 1e-3
    threads: int = 0

    def __post_init__(self) -> None:
        check_config(self, ("n_train", "n_test", "channels", "epochs", "batch_size", "seeds", "lr"),
                     ("threads",), {"norms": NORMS})  # fmt: skip
        if len(self.channels) != 2:
            raise ValueError(f"ConvnetConfig.channels must hold two sizes, got {self.channels!r}")

    norms: tuple[str, ...] = NORMS


def config(quick: bool) -> ConvnetConfig:
    if quick:
        return ConvnetConfig(
            n_train=4000,
            n_test=5000,
            channels=(8, 16),
            epochs=5,
            batch_size=64,
            seeds=4,
            threads=1,
        )
    return ConvnetConfig()


def run(cfg: ConvnetConfig, ctx: RunContext) -> list[Record]:
    if len(cfg.channels) != 2:
        raise ValueError(f"convnet: channels must hold two sizes, got {cfg.channels!r}")
    train, test = mnist_subsets(cfg.n_train, cfg.n_test)
    records: list[Record] = []
    with torch_threads(cfg.threads):
        for s in range(cfg.seeds):
            for norm in cfg.norms:
                seed = ctx.run_seed(s)
                spec = TrainSpec(
                    epochs=cfg.epochs,
                    batch_size=cfg.batch_size,
                    lr=cfg.lr,
                    seed=seed,
                    eval_batch_size=500,
                )
                records += train_classifier(
                    f"cnn-{norm}-s{seed}",
                    lambda norm=norm: build_cnn(norm, cfg.channels),
                    train,
                    {"train": train, "test": test},
                    spec,
                    ctx,
                    {"model": norm, "batch_size": cfg.batch_size, "seed": seed},
                )
    return records


def _missing(cfg: ConvnetConfig, need: tuple[str, str], cid: str) -> Verdict | None:
    if set(need) <= set(cfg.norms):
        return None
    return Verdict(cid, "inconclusive", "models not run", f"needs {need[0]} and {need[1]}")


def verdicts(records: Sequence[Record], cfg: ConvnetConfig) -> list[Verdict]:
    def side(label: str, model: str) -> Side:
        return label, {"model": model, "batch_size": cfg.batch_size}

    # `missing or verdict(...)`: the comparison is computed only when nothing is missing
    return [
        _missing(cfg, ("none", "layer"), "cnn-ln-speedup") or verdict("cnn-ln-speedup", lower(
            records, auc, "train_nll", side("LN", "layer"), side("none", "none"),
            quantity="training NLL averaged over the epochs", margin=0.002)),
        _missing(cfg, ("batch", "layer"), "cnn-bn-best") or verdict("cnn-bn-best", lower(
            records, late, "test_err", side("BN", "batch"), side("LN", "layer"),
            quantity="late test error (mean over the second half of the epochs)", margin=0.001,
            scale=100, unit="%")),
    ]  # fmt: skip


def tables(records: Sequence[Record], cfg: ConvnetConfig) -> str:
    rows = [((m,), {"model": m, "batch_size": cfg.batch_size}) for m in cfg.norms]
    return final_epoch_table(records, rows, ("model",))


def plot(records: Sequence[Record], cfg: ConvnetConfig, fig_dir: Path) -> list[Path]:
    panels = classifier_panels({})
    title = (
        f"MNIST ConvNet (channels {cfg.channels[0]}, {cfg.channels[1]}), batch "
        f"{cfg.batch_size}, {cfg.n_train} training images, {cfg.seeds} seed(s)"
    )
    return [
        curves_figure(
            records, fig_dir / "convnet.png", panels=panels, models=cfg.norms, title=title
        )
    ]


EXPERIMENT = register(
    Experiment(
        name="convnet",
        title="Convolutional network on MNIST: none vs batch norm vs layer norm",
        section="Ba et al. 2016, §6.7",
        claims=(
            Claim(
                "cnn-ln-speedup",
                "“we observed that layer normalization offers a speedup over the baseline model "
                "without normalization” (§6.7)",
                "The training NLL averaged over the epochs is lower with layer norm than without "
                "normalization.",
            ),
            Claim(
                "cnn-bn-best",
                "“but batch normalization outperforms the other methods” (§6.7)",
                "The late test error (the mean over the second half of the epochs) is lower with "
                "batch norm than with layer norm.",
            ),
        ),
        config=config,
        run=run,
        verdicts=verdicts,
        plot=plot,
        tables=tables,
        quick_budget_s=65.0,
        independent_runs=True,
        order=30,
    )
)
