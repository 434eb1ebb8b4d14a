"""Permutation-invariant MNIST (Ba et al. 2016, §6.6, Fig. 6): baseline vs batch norm vs layer
norm in a 784-1000-1000-10 ReLU network trained with Adam at batch sizes 128 and 4.

Normalization sits on the hidden layers only (``Linear → norm → ReLU``); the logits are left
alone, as the paper does for layer norm. Batch norm uses the unbiased batch variance at batch
sizes below 128, as the paper does at batch size 4, and its running averages at test time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..analysis.compare import Side, lower
from ..analysis.epochs import auc, final_epoch_table, late
from ..analysis.plots import classifier_panels, curves_figure
from ..analysis.stats import compare_lower, verdict
from ..data import mnist_subsets
from ..engine.registry import (
    Claim,
    Experiment,
    Record,
    RunContext,
    Verdict,
    check_choices,
    check_config,
    register,
)
from ..engine.training import TrainSpec, torch_threads, train_classifier
from ..models.mlp import NORMS, build_mlp


def _sides(bs: int) -> tuple[Side, Side]:
    """Layer norm's and batch norm's records at batch size ``bs``."""
    ln: Side = ("LN", {"model": "layer", "batch_size": bs})
    return ln, ("BN", {"model": "batch", "batch_size": bs})


@dataclass(frozen=True)
class MnistFFConfig:
    """Settings; ``quick`` trades data, width and epochs for time, never the comparison itself.

    Attributes:
        n_train: training images (the paper: 55,000; the rest of the 60,000 is validation).
        n_test: test images used (10,000 = all).
        hidden: width of both hidden layers (paper: 1000).
        epochs: passes over the training set.
        batch_sizes: mini-batch sizes compared (paper: 128 and 4).
        norms: models compared: ``none``, ``batch``, ``layer``.
        seeds: independent runs per model and batch size.
        lr: Adam learning rate (Adam's default, 1e-3).
        threads: torch intra-op threads (0: torch's default; quick: 1, see ``torch_threads``).
        bn_logits: batch norm on the logits too ("applied to all layers", Fig. 6); off by
            default so that both normalizations sit on the same (hidden) layers.
    """

    n_train: int = 55_000
    n_test: int = 10_000
    hidden: int = 1000
    epochs: int = 20
    batch_sizes: tuple[int, ...] = (128, 4)
    norms: tuple[str, ...] = NORMS
    seeds: int = 3
    lr: float = 1e-3
    threads: int = 0
    bn_logits: bool = False

    def __post_init__(self) -> None:
        check_config(self, ("n_train", "n_test", "hidden", "epochs", "batch_sizes", "seeds", "lr"),
                     ("threads",), {"norms": NORMS})  # fmt: skip


def config(quick: bool) -> MnistFFConfig:
    if quick:
        return MnistFFConfig(n_train=2500, hidden=256, epochs=5, seeds=5, threads=1)
    return MnistFFConfig()


def run(cfg: MnistFFConfig, ctx: RunContext) -> list[Record]:
    check_choices("mnist-ff", "norms", cfg.norms, NORMS)
    train, test = mnist_subsets(cfg.n_train, cfg.n_test)
    records: list[Record] = []
    with torch_threads(cfg.threads):
        for bs in cfg.batch_sizes:
            for s in range(cfg.seeds):
                for norm in cfg.norms:
                    seed = ctx.run_seed(s)
                    spec = TrainSpec(epochs=cfg.epochs, batch_size=bs, lr=cfg.lr, seed=seed)
                    records += train_classifier(
                        f"{norm}-bs{bs}-s{seed}",
                        lambda norm=norm, bs=bs: build_mlp(
                            norm, cfg.hidden, bs, bn_logits=cfg.bn_logits
                        ),
                        train,
                        {"train": train, "test": test},
                        spec,
                        ctx,
                        {"model": norm, "batch_size": bs, "seed": seed},
                    )
    return records


def _missing(
    cfg: MnistFFConfig, need_bs: Sequence[int], need: Sequence[str], cid: str
) -> Verdict | None:
    if not set(need_bs) <= set(cfg.batch_sizes) or not set(need) <= set(cfg.norms):
        return Verdict(
            cid,
            "inconclusive",
            "not run with the models / batch sizes this needs",
            f"needs batch sizes {list(need_bs)} and models {list(need)}",
        )
    return None


def verdicts(records: Sequence[Record], cfg: MnistFFConfig) -> list[Verdict]:
    big, small = max(cfg.batch_sizes), min(cfg.batch_sizes)
    need = ["batch", "layer"]

    def degradation(m: str) -> list[float]:
        """Per seed: the late test error at the small batch minus that at the big one."""
        at_small = late(records, "test_err", model=m, batch_size=small)
        at_big = late(records, "test_err", model=m, batch_size=big)
        return [a - b for a, b in zip(at_small, at_big, strict=True)]

    def robust() -> Verdict:
        if big == small:
            return Verdict("ff-robust", "inconclusive", "only one batch size", "needs two")
        return verdict("ff-robust", compare_lower(
            "LN", degradation("layer"), "BN", degradation("batch"),
            quantity=f"rise of the late test error from batch {big} to batch {small}",
            margin=0.002, scale=100, unit=" pp", paired=True))  # fmt: skip

    def small_batch() -> Verdict:
        if big == small:  # the one batch size is the larger one, where ff-faster looks
            why = f"needs a batch size below {big}"
            return Verdict("ff-small-batch", "inconclusive", "only one batch size", why)
        return verdict("ff-small-batch", lower(
            records, late, "test_err", *_sides(small),
            quantity=f"late test error at batch {small}",
            margin=0.002, scale=100, unit="%"))  # fmt: skip

    # `missing or verdict(...)`: the comparison is computed only when nothing is missing
    return [
        _missing(cfg, [big], need, "ff-faster") or verdict("ff-faster", lower(
            records, auc, "train_nll", *_sides(big),
            quantity=f"training NLL averaged over the epochs (batch {big})", margin=0.002)),
        _missing(cfg, [big, small], need, "ff-robust") or robust(),
        _missing(cfg, [small], need, "ff-small-batch") or small_batch(),
    ]  # fmt: skip


def tables(records: Sequence[Record], cfg: MnistFFConfig) -> str:
    rows = [((str(bs), m), {"model": m, "batch_size": bs}) for bs in cfg.batch_sizes
            for m in cfg.norms]  # fmt: skip
    return final_epoch_table(records, rows, ("batch", "model"))


def plot(records: Sequence[Record], cfg: MnistFFConfig, fig_dir: Path) -> list[Path]:
    panels = [
        p for bs in cfg.batch_sizes for p in classifier_panels({"batch_size": bs}, f", batch {bs}")
    ]
    title = (
        f"Permutation-invariant MNIST: 784-{cfg.hidden}-{cfg.hidden}-10, Adam, "
        f"{cfg.n_train} training images, {cfg.seeds} seed(s)"
    )
    return [
        curves_figure(
            records, fig_dir / "mnist_ff.png", panels=panels, models=cfg.norms, title=title
        )
    ]


EXPERIMENT = register(
    Experiment(
        name="mnist-ff",
        title="Permutation-invariant MNIST: batch norm vs layer norm at batch 128 and 4",
        section="Ba et al. 2016, §6.6 and Figure 6",
        claims=(
            Claim(
                "ff-faster",
                "“layer normalization […] exhibits a faster training convergence comparing to "
                "batch normalization” (§6.6)",
                "At the larger batch size, the training NLL averaged over the epochs (the area "
                "under the training curve) is lower with layer norm than with batch norm.",
            ),
            Claim(
                "ff-robust",
                "“layer normalization is robust to the batch-sizes” (§6.6)",
                "Going from the larger to the smaller batch size raises the late test error (the "
                "mean over the second half of the epochs) less for layer norm than for batch "
                "norm (per seed: late error at the small batch minus late error at the large).",
            ),
            Claim(
                "ff-small-batch",
                "“the effect of batch normalization is dependent on the mini-batch size” "
                "(abstract), shown at batch size 4 in Figure 6",
                "At the small batch size, the late test error (the mean over the second half of "
                "the epochs) is lower with layer norm than with batch norm.",
            ),
        ),
        config=config,
        run=run,
        verdicts=verdicts,
        plot=plot,
        tables=tables,
        quick_budget_s=120.0,
        independent_runs=True,
        order=20,
    )
)
