"""Test sequences longer than any seen in training (Ba et al. 2016, §3.1).

Recurrent batch norm keeps statistics per time step, so it has none for steps past the longest
training sequence and must reuse those of its last step (``max_steps`` = training length here);
layer norm computes its statistics from the current step alone and needs nothing. Models: plain
LSTM, LN-LSTM and recurrent-BN LSTM on the Shakespeare character LM of ``char-lm``, trained on
windows of ``train_len`` characters and scored on validation windows ``eval_factor`` times longer.
The cross-entropy is reported per range of positions, ``[0, T/2)``, ``[T/2, T)``, ``[T, 2T)``,
``[2T, 4T)``, …: positions ``≥ T`` were never trained on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..analysis.compare import claim
from ..analysis.curves import final, final_table, lines, rows, step_time_figure
from ..analysis.plots import COLORS, LABELS, plt, save_figure
from ..analysis.stats import compare_lower, compare_not_worse
from ..data import fixed_windows, load_corpus
from ..engine.registry import (
    Claim,
    Experiment,
    Record,
    RunContext,
    Verdict,
    check_choices,
    register,
)
from ..models.char_lstm import LN2, CharLSTM, position_nll, train_lms

NORMS = ("none", "layer", "batch")


@dataclass(frozen=True)
class LongerConfig:
    """Settings of ``longer-than-train``.

    Attributes:
        train_len: characters per training window (= recurrent BN's ``max_steps``).
        eval_factor: validation windows are ``eval_factor · train_len`` long (a power of 2).
        batch_size, hidden, embed, steps, eval_every, seeds, lr, clip, threads: as in ``char-lm``.
        n_valid: long validation windows.
        norms: ``none``, ``layer``, ``batch``.
    """

    train_len: int = 50
    eval_factor: int = 8
    batch_size: int = 32
    hidden: int = 512
    embed: int = 64
    steps: int = 3000
    eval_every: int = 300
    n_valid: int = 500
    norms: tuple[str, ...] = NORMS
    seeds: int = 3
    lr: float = 2e-3
    clip: float = 1.0
    threads: int = 0


def config(quick: bool) -> LongerConfig:
    if quick:
        return LongerConfig(train_len=16, eval_factor=8, batch_size=16, hidden=96, embed=16,
                            steps=400, eval_every=50, n_valid=64, seeds=3, threads=1)  # fmt: skip
    return LongerConfig()


def buckets(train_len: int, factor: int) -> list[tuple[str, int, int]]:
    """``(name, start, end)`` position ranges: ``[0, T/2)``, ``[T/2, T)``, then doubling."""
    half = max(1, train_len // 2)
    out = [("bpc_0_half", 0, half), ("bpc_half_1", half, train_len)]
    k = 1
    while k < factor:
        out.append((f"bpc_{k}_{2 * k}", k * train_len, 2 * k * train_len))
        k *= 2
    return out


def _bucket_label(name: str, train_len: int) -> str:
    lo, hi = name.split("_")[1:]
    f = {"0": "0", "half": "T/2", "1": "T"}
    return f"[{f.get(lo, lo + 'T')}, {f.get(hi, hi + 'T')})"


def _beyond(cfg: LongerConfig) -> list[str]:
    return [n for n, s, _ in buckets(cfg.train_len, cfg.eval_factor) if s >= cfg.train_len]


def run(cfg: LongerConfig, ctx: RunContext) -> list[Record]:
    check_choices("longer-than-train", "norms", cfg.norms, NORMS)
    if cfg.eval_factor < 2 or cfg.eval_factor & (cfg.eval_factor - 1):
        raise ValueError(f"longer-than-train: eval_factor must be a power of 2 >= 2, got "
                         f"{cfg.eval_factor}")  # fmt: skip
    corpus = load_corpus()
    long_valid = fixed_windows(corpus.valid, cfg.train_len * cfg.eval_factor, cfg.n_valid)
    bks = buckets(cfg.train_len, cfg.eval_factor)

    def evaluate(m: torch.nn.Module) -> dict[str, float]:
        nll = position_nll(m, long_valid, ctx.device)
        out = {name: float(nll[a:b].mean()) / LN2 for name, a, b in bks}
        out["valid_bpc"] = float(nll[: cfg.train_len].mean()) / LN2  # the trained range
        beyond = nll[cfg.train_len :]
        out["bpc_beyond"] = float(beyond.mean()) / LN2
        return out

    return train_lms(
        cfg, ctx, cfg.norms,
        lambda norm: CharLSTM(corpus.vocab, cfg.embed, cfg.hidden, norm, max_steps=cfg.train_len),
        cfg.train_len, evaluate,
    )  # fmt: skip


def _degradation(records: Sequence[Record], model: str) -> list[float]:
    """Per seed: BPC on the positions past the training length minus BPC on ``[T/2, T)``."""
    beyond = final(records, "bpc_beyond", model=model)
    inside = final(records, "bpc_half_1", model=model)
    return [b - i for b, i in zip(beyond, inside, strict=True)]


def verdicts(records: Sequence[Record], cfg: LongerConfig) -> list[Verdict]:
    margin = 0.02
    return [
        claim("longer-ln", cfg.norms, ["layer"], lambda: compare_not_worse(
            "LN past T", final(records, "bpc_beyond", model="layer"),
            "LN on [T/2, T)", final(records, "bpc_half_1", model="layer"),
            quantity=f"final BPC on positions ≥ T = {cfg.train_len} vs on [T/2, T)",
            margin=margin, paired=True)),
        claim("longer-vs-bn", cfg.norms, ["layer", "batch"], lambda: compare_lower(
            "LN", _degradation(records, "layer"), "BN", _degradation(records, "batch"),
            quantity="rise of the BPC from positions [T/2, T) to positions ≥ T (final models)",
            margin=margin, paired=True)),
    ]  # fmt: skip


def tables(records: Sequence[Record], cfg: LongerConfig) -> str:
    cols = [(name, f"BPC {_bucket_label(name, cfg.train_len)}", 1.0, "")
            for name, _, _ in buckets(cfg.train_len, cfg.eval_factor)]  # fmt: skip
    text = final_table(records, rows(cfg.norms, LABELS), cols)
    return (
        f"Trained on windows of T = {cfg.train_len} characters; scored on windows of "
        f"{cfg.train_len * cfg.eval_factor}. Positions ≥ T were never trained on.\n\n" + text
    )


def plot(records: Sequence[Record], cfg: LongerConfig, fig_dir: Path) -> list[Path]:
    bks = buckets(cfg.train_len, cfg.eval_factor)
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    for n in cfg.norms:
        xs, ys, lo, hi = [], [], [], []
        for name, a, b in bks:
            vals = [v for v in final(records, name, model=n) if math.isfinite(v)]
            if not vals:
                continue
            xs.append((a + b) / 2)
            ys.append(sum(vals) / len(vals))
            lo.append(min(vals))
            hi.append(max(vals))
        if xs:
            ax.plot(xs, ys, marker="o", color=COLORS.get(n), label=LABELS.get(n, n))
            ax.fill_between(xs, lo, hi, color=COLORS.get(n), alpha=0.18, lw=0)
    ax.axvline(cfg.train_len, color="k", ls="--", lw=1, label="training length T")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position in the validation window (range midpoint)")
    ax.set_ylabel("validation BPC")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"Longer than trained: T = {cfg.train_len}, scored to "
                 f"{cfg.train_len * cfg.eval_factor} (final models)", fontsize=10)  # fmt: skip
    path = save_figure(fig, fig_dir / "longer_than_train.png")
    curves = step_time_figure(
        records, fig_dir / "longer_than_train_curves.png", metric="bpc_beyond",
        ylabel="BPC on positions ≥ T", models=lines(cfg.norms, LABELS, COLORS),
        title="Longer than trained: BPC past the training length during training")  # fmt: skip
    return [path, curves]


EXPERIMENT = register(Experiment(
    name="longer-than-train",
    title="Sequences longer than any seen in training: LN vs recurrent BN",
    section="Ba et al. 2016, §3.1 (on the char-LM task of `char-lm`)",
    claims=(
        Claim("longer-ln",
              "“This is problematic if a test sequence is longer than any of the training "
              "sequences. Layer normalization does not have such problem because its "
              "normalization terms depend only on the summed inputs to a layer at the current "
              "time-step.” (§3.1)",
              "LN-LSTM's BPC on positions past the training length is not worse (within the "
              "margin) than on the second half of the trained range."),
        Claim("longer-vs-bn",
              "“we need to to compute and store separate statistics for each time step in a "
              "sequence. This is problematic if a test sequence is longer than any of the "
              "training sequences.” (§3.1)",
              "Going past the training length raises the BPC less for LN-LSTM than for "
              "recurrent BN, which reuses its last step's statistics there."),
    ),
    config=config,
    run=run,
    verdicts=verdicts,
    plot=plot,
    tables=tables,
    quick_budget_s=25.0,
    order=44,
))  # fmt: skip
