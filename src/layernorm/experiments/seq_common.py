"""What the sequence experiments (``char-lm``, ``gain-init``, ``longer-than-train``,
``seq-mnist``, ``spoken-digits``) share beyond the training loop: the grid of runs (seeds ×
models, one :func:`~layernorm.experiments.seq_training.train_steps` each), the claims that
compare two models' per-seed summaries, and the rows and lines of their tables and figures.

Each experiment module keeps only its data, its model, its settings and its claims.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from torch import Tensor, nn

from .registry import Record, RunContext, Verdict, check_choices
from .seq_training import StepSpec, at_time, common_time, missing, torch_threads, train_steps
from .stats import Comparison, compare_lower, verdict

__all__ = [
    "Side",
    "StepSettings",
    "check_choices",
    "claim",
    "lines",
    "lower",
    "lower_per_second",
    "rows",
    "train_grid",
]

#: One side of a comparison: its label in the statistic text and the records it selects.
Side = tuple[str, Mapping[str, Any]]


class StepSettings(Protocol):
    """The fields of a sequence experiment's settings that :func:`train_grid` reads."""

    steps: int
    eval_every: int
    seeds: int
    lr: float
    clip: float
    threads: int


def train_grid(
    cfg: StepSettings,
    ctx: RunContext,
    names: Sequence[str],
    build: Callable[[str], nn.Module],
    sample: Callable[[Any], Any],
    loss_fn: Callable[[nn.Module, Any], Tensor],
    evaluate: Callable[[nn.Module], Mapping[str, float]],
    tags: Callable[[str, int], Mapping[str, Any]] | None = None,
) -> list[Record]:
    """Train ``build(name)`` for every seed and every name in ``names`` (seed-major order), with
    ``cfg.threads`` torch threads; the records of all runs.

    Seed ``s`` of the grid is ``ctx.run_seed(s)`` (``ctx.seed · 1000 + s``); a run is named
    ``{name}-s{seed}`` and its records are tagged ``tags(name, seed)`` (default: ``model`` and
    ``seed``).
    """
    records: list[Record] = []
    with torch_threads(cfg.threads):
        for s in range(cfg.seeds):
            seed = ctx.run_seed(s)
            for name in names:
                records += train_steps(
                    f"{name}-s{seed}", lambda name=name: build(name), sample, loss_fn, evaluate,
                    StepSpec(cfg.steps, cfg.eval_every, cfg.lr, seed, cfg.clip), ctx,
                    tags(name, seed) if tags else {"model": name, "seed": seed},
                )  # fmt: skip
    return records


def lower(
    records: Sequence[Record],
    summary: Callable[..., list[float]],
    metric: str,
    a: Side,
    b: Side,
    **kw: Any,
) -> Comparison:
    """:func:`~layernorm.experiments.stats.compare_lower` of ``summary(records, metric, **where)``
    (e.g. :func:`~layernorm.experiments.seq_training.final`) for side A against side B; ``kw``
    (``quantity``, ``margin``, ``scale``, ``unit``) goes to ``compare_lower``."""
    return compare_lower(a[0], summary(records, metric, **a[1]),
                         b[0], summary(records, metric, **b[1]), **kw)  # fmt: skip


def lower_per_second(
    records: Sequence[Record], metric: str, a: Side, b: Side, *, quantity: str, **kw: Any
) -> Comparison:
    """A against B after the same training wall-clock time ``t``: the shortest total of all their
    runs (see :func:`~layernorm.experiments.seq_training.common_time`). ``quantity`` may hold
    ``{t}``, filled with ``t`` in seconds."""
    t = common_time(records, [a[1], b[1]])
    return compare_lower(a[0], at_time(records, metric, t, **a[1]),
                         b[0], at_time(records, metric, t, **b[1]),
                         quantity=quantity.format(t=t), **kw)  # fmt: skip


def claim(
    claim_id: str, have: Sequence[str], need: Sequence[str], compare: Callable[[], Comparison]
) -> Verdict:
    """The verdict of ``compare()``, or an inconclusive one when the configuration left out a
    model of ``need`` (then ``compare`` is not called)."""
    return missing(claim_id, have, need) or verdict(claim_id, compare())


def rows(names: Sequence[str], labels: Mapping[str, str]) -> list[tuple[str, dict[str, Any]]]:
    """Table rows ``(label, {"model": name})`` for :func:`~layernorm.experiments.seq_training.
    final_table`."""
    return [(labels.get(n, n), {"model": n}) for n in names]


def lines(
    names: Sequence[str], labels: Mapping[str, str], colors: Mapping[str, str]
) -> list[tuple[str, dict[str, Any], str]]:
    """Figure lines ``(label, {"model": name}, color)`` for :func:`~layernorm.experiments.
    seq_training.step_time_figure`."""
    return [(labels.get(n, n), {"model": n}, colors.get(n, "k")) for n in names]
