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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data import load_shakespeare
from ..recurrent import LayerNormLSTM
from .plots import COLORS, LABELS
from .registry import Claim, Experiment, Record, RunContext, Verdict, register
from .seq_common import (
    StepSettings,
    check_choices,
    claim,
    lines,
    lower,
    lower_per_second,
    rows,
    train_grid,
)
from .seq_training import final, final_table, mean_curve, step_time_figure

NORMS = ("none", "layer", "batch")
LN2 = math.log(2.0)


# -- data ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CharCorpus:
    """Shakespeare as int64 character ids: ``train`` (first 90%) and ``valid`` (last 10%)."""

    train: Tensor
    valid: Tensor
    vocab: int


@lru_cache(maxsize=1)
def load_corpus() -> CharCorpus:
    raw = torch.frombuffer(bytearray(load_shakespeare().encode("latin-1")), dtype=torch.uint8)
    present = torch.bincount(raw.long(), minlength=256) > 0
    ids = torch.cumsum(present.long(), 0) - 1  # byte value → dense id in byte order
    data = ids[raw.long()]
    cut = int(0.9 * data.numel())
    return CharCorpus(data[:cut].clone(), data[cut:].clone(), int(present.sum()))


def sample_windows(data: Tensor, length: int, batch: int, gen: torch.Generator) -> Tensor:
    """``batch`` random windows of ``length + 1`` ids, shape ``(batch, length + 1)``."""
    start = torch.randint(0, data.numel() - length - 1, (batch,), generator=gen)
    return data[start[:, None] + torch.arange(length + 1)]


def fixed_windows(data: Tensor, length: int, n: int) -> Tensor:
    """``n`` evenly spaced windows of ``length + 1`` ids (the validation set)."""
    if n * (length + 1) > data.numel():
        raise ValueError(f"{n} windows of {length + 1} characters do not fit in {data.numel()}")
    start = torch.linspace(0, data.numel() - length - 2, n).long()
    return data[start[:, None] + torch.arange(length + 1)]


# -- model ---------------------------------------------------------------------------------------


class CharLSTM(nn.Module):
    """Embedding → LSTM (``norm``) → linear; ``forward(ids (B, T)) → logits (B, T, vocab)``."""

    def __init__(self, vocab: int, embed: int, hidden: int, norm: str, *, gain_init: float = 1.0,
                 bn_gain_init: float = 0.1, max_steps: int = 100) -> None:  # fmt: skip
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.rnn = LayerNormLSTM(embed, hidden, batch_first=True, norm=norm, gain_init=gain_init,
                                 bn_gain_init=bn_gain_init, max_steps=max_steps)  # fmt: skip
        self.out = nn.Linear(hidden, vocab)

    def forward(self, ids: Tensor) -> Tensor:
        h, _ = self.rnn(self.embed(ids))
        return self.out(h)


def lm_loss(model: nn.Module, windows: Tensor, device: torch.device) -> Tensor:
    """Mean next-character cross-entropy (nats) of ``(B, T + 1)`` windows."""
    w = windows.to(device)
    logits = model(w[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))


def position_nll(
    model: nn.Module, windows: Tensor, device: torch.device, batch: int = 256
) -> Tensor:
    """Cross-entropy (nats) per position, averaged over windows: shape ``(T,)``."""
    total = torch.zeros(windows.shape[1] - 1, dtype=torch.float64)
    for i in range(0, windows.shape[0], batch):
        w = windows[i : i + batch].to(device)
        logits = model(w[:, :-1])
        nll = F.cross_entropy(logits.transpose(1, 2), w[:, 1:], reduction="none")
        total += nll.double().sum(0).cpu()
    return total / windows.shape[0]


def valid_bpc(model: nn.Module, windows: Tensor, device: torch.device) -> float:
    return float(position_nll(model, windows, device).mean()) / LN2


def bpc_evaluator(
    length: int, n: int, device: torch.device
) -> Callable[[nn.Module], dict[str, float]]:
    """The ``evaluate`` of a character LM's training run: ``{"valid_bpc": BPC}`` over ``n`` fixed
    validation windows of ``length`` characters (:func:`fixed_windows` of the last 10%)."""
    valid = fixed_windows(load_corpus().valid, length, n)
    return lambda m: {"valid_bpc": valid_bpc(m, valid, device)}


class LMSettings(StepSettings, Protocol):
    """The settings :func:`train_lms` reads: :class:`~layernorm.experiments.seq_common.
    StepSettings` and the batch size."""

    batch_size: int


def train_lms(
    cfg: LMSettings,
    ctx: RunContext,
    names: Sequence[str],
    build: Callable[[str], nn.Module],
    train_len: int,
    evaluate: Callable[[nn.Module], Mapping[str, float]],
    tags: Callable[[str, int], Mapping[str, Any]] | None = None,
) -> list[Record]:
    """The seeds × models grid of a character LM experiment: ``build(name)`` trained on random
    windows of ``train_len`` characters of the training text (see
    :func:`~layernorm.experiments.seq_common.train_grid`)."""
    corpus = load_corpus()
    return train_grid(
        cfg, ctx, names, build,
        lambda g: sample_windows(corpus.train, train_len, cfg.batch_size, g),
        lambda m, b: lm_loss(m, b, ctx.device), evaluate, tags,
    )  # fmt: skip


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
