"""Character-level language modelling on Shakespeare: LSTM vs LN-LSTM vs recurrent-BN LSTM.

The LN paper's recurrent claims come from tasks whose data is not available here (attentive reader,
skip-thoughts, handwriting); a character-level LSTM language model is the standard substitute with
published LN-LSTM numbers (HyperNetworks, char-PTB: 1.312 vs 1.267 BPC). Model: embedding →
one :class:`~layernorm.recurrent.LayerNormLSTM` layer (``norm`` = ``"none"``, ``"layer"`` or
``"batch"``) → linear read-out. Training draws random windows of ``seq_len + 1`` characters from
the first 90% of the text (every window starts from a zero state); validation is a fixed set of
evenly spaced windows from the last 10%, scored in bits per character (BPC = cross-entropy / ln 2).

The corpus, sampler and model here are shared with ``gain-init``, ``longer-than-train`` and the
Transformer half of ``adanorm``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..analysis.compare import claim, lower, lower_per_second
from ..analysis.curves import final, final_table, lines, mean_curve, rows, step_time_figure
from ..analysis.plots import COLORS, LABELS
from ..data import load_corpus
from ..engine.registry import (
    Claim,
    Experiment,
    Record,
    RunContext,
    Verdict,
    check_choices,
    register,
)
from ..models.char_lstm import CharLSTM, bpc_evaluator, train_lms

NORMS = ("none", "layer", "batch")
LN2 = math.log(2.0)


# -- the experiment ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CharLMConfig:
    """Settings of ``char-lm``.

    Attributes:
        seq_len: characters per training window (back-propagation through time length).
        batch_size: windows per update.
        hidden: LSTM units.
        embed: character embedding size.
        steps: updates per run.
        eval_every: updates between validation passes.
        n_valid: validation windows (of ``seq_len`` characters, from the held-out 10%).
        norms: models compared: ``none``, ``layer``, ``batch`` (recurrent BN, γ init 0.1).
        seeds: independent runs per model.
        lr: Adam learning rate.
        clip: gradient-norm clipping.
        threads: torch intra-op threads during the run (0 = leave as is).
    """

    seq_len: int = 100
    batch_size: int = 32
    hidden: int = 512
    embed: int = 64
    steps: int = 4000
    eval_every: int = 200
    n_valid: int = 1000
    norms: tuple[str, ...] = NORMS
    seeds: int = 3
    lr: float = 2e-3
    clip: float = 1.0
    threads: int = 0


def config(quick: bool) -> CharLMConfig:
    if quick:
        return CharLMConfig(seq_len=32, batch_size=16, hidden=96, embed=16, steps=1000,
                            eval_every=50, n_valid=64, seeds=3, threads=1)  # fmt: skip
    return CharLMConfig()


def run(cfg: CharLMConfig, ctx: RunContext) -> list[Record]:
    check_choices("char-lm", "norms", cfg.norms, NORMS)
    corpus = load_corpus()
    return train_lms(
        cfg, ctx, cfg.norms,
        lambda norm: CharLSTM(corpus.vocab, cfg.embed, cfg.hidden, norm, max_steps=cfg.seq_len),
        cfg.seq_len, bpc_evaluator(cfg.seq_len, cfg.n_valid, ctx.device),
    )  # fmt: skip


LN, LSTM, BN = ("LN", {"model": "layer"}), ("LSTM", {"model": "none"}), ("BN", {"model": "batch"})


def verdicts(records: Sequence[Record], cfg: CharLMConfig) -> list[Verdict]:
    kw = {"margin": 0.01}  # BPC: differences below this are not worth a claim
    final_bpc = {"quantity": "final validation BPC", **kw}
    return [
        claim("lm-faster", cfg.norms, ["none", "layer"], lambda: lower(
            records, mean_curve, "valid_bpc", LN, LSTM, quantity="validation BPC averaged over "
            "the evaluations (area under the per-update curve)", **kw)),
        claim("lm-lower", cfg.norms, ["none", "layer"],
              lambda: lower(records, final, "valid_bpc", LN, LSTM, **final_bpc)),
        claim("lm-vs-bn", cfg.norms, ["batch", "layer"],
              lambda: lower(records, final, "valid_bpc", LN, BN, **final_bpc)),
        claim("lm-per-second", cfg.norms, ["none", "layer"], lambda: lower_per_second(
            records, "valid_bpc", LN, LSTM,
            quantity="validation BPC after {t:.1f} s of training (the shorter run's total)",
            **kw)),
    ]  # fmt: skip


def tables(records: Sequence[Record], cfg: CharLMConfig) -> str:
    return final_table(records, rows(cfg.norms, LABELS),
                       [("valid_bpc", "validation BPC", 1.0, ""),
                        ("train_loss", "train loss (nats)", 1.0, "")])  # fmt: skip


def plot(records: Sequence[Record], cfg: CharLMConfig, fig_dir: Path) -> list[Path]:
    title = (f"Shakespeare char-LM: LSTM-{cfg.hidden}, windows of {cfg.seq_len}, batch "
             f"{cfg.batch_size}, {cfg.seeds} seed(s)")  # fmt: skip
    return [step_time_figure(records, fig_dir / "char_lm.png", metric="valid_bpc",
                             ylabel="validation BPC", models=lines(cfg.norms, LABELS, COLORS),
                             title=title)]  # fmt: skip


QUOTE_6_2 = ("“layer normalization not only trains faster but converges to a better validation "
             "result over both the baseline and BN variants” (§6.2)")  # fmt: skip

EXPERIMENT = register(Experiment(
    name="char-lm",
    title="Character-level LM on Shakespeare: LSTM vs LN-LSTM vs recurrent BN",
    section="Ba et al. 2016, §6.2 (substitute task: character-level language modelling)",
    claims=(
        Claim("lm-faster", QUOTE_6_2,
              "Per update, LN-LSTM's validation BPC averaged over the evaluations (area under the "
              "curve) is lower than the plain LSTM's."),
        Claim("lm-lower", QUOTE_6_2,
              "LN-LSTM's final validation BPC is lower than the plain LSTM's."),
        Claim("lm-vs-bn", QUOTE_6_2,
              "LN-LSTM's final validation BPC is lower than recurrent batch norm's (γ init 0.1, "
              "statistics per time step)."),
        Claim("lm-per-second",
              "“Empirically, we show that layer normalization can substantially reduce the "
              "training time” (abstract)",
              "Per second rather than per update (LN costs time per step): after the same "
              "training wall-clock time, LN-LSTM's validation BPC is lower than the plain "
              "LSTM's."),
    ),
    config=config,
    run=run,
    verdicts=verdicts,
    plot=plot,
    tables=tables,
    quick_budget_s=90.0,
    order=40,
))  # fmt: skip
