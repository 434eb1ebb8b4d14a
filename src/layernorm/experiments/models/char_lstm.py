"""The character-level LSTM language model shared by ``char-lm``, ``gain-init`` and
``longer-than-train``: embedding → one :class:`~layernorm.recurrent.LayerNormLSTM` layer
(``norm`` = ``"none"``, ``"layer"`` or ``"batch"``) → linear read-out; its loss, its validation
score in bits per character (BPC = cross-entropy / ln 2) and the seeds × models training grid.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...recurrent import LayerNormLSTM
from ..data import fixed_windows, load_corpus, sample_windows
from ..engine.registry import Record, RunContext
from ..engine.steps import StepSettings, train_grid

__all__ = ["LN2", "CharLSTM", "LMSettings", "bpc_evaluator", "lm_loss", "position_nll",
           "train_lms", "valid_bpc"]  # fmt: skip

LN2 = math.log(2.0)


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
    """The settings :func:`train_lms` reads: :class:`~layernorm.experiments.engine.steps.
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
    :func:`~layernorm.experiments.engine.steps.train_grid`)."""
    corpus = load_corpus()
    return train_grid(
        cfg, ctx, names, build,
        lambda g: sample_windows(corpus.train, train_len, cfg.batch_size, g),
        lambda m, b: lm_loss(m, b, ctx.device), evaluate, tags,
    )  # fmt: skip
