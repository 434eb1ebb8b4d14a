"""Claims that compare two sides' per-seed summaries of the records.

A side is ``(label, where)``: its label in the statistic text and the record columns that select
its runs (e.g. ``("LN", {"model": "layer", "batch_size": 4})``). A summary turns the records of
one side into one number per seed: :func:`~layernorm.experiments.analysis.epochs.late` or
:func:`~layernorm.experiments.analysis.epochs.auc` for per-epoch records,
:func:`~layernorm.experiments.analysis.curves.final` or
:func:`~layernorm.experiments.analysis.curves.mean_curve` for per-evaluation ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..engine.registry import Record, Verdict
from .curves import at_time, common_time
from .stats import Comparison, compare_lower, verdict

__all__ = ["Side", "Summary", "claim", "lower", "lower_per_second", "missing"]

#: One side of a comparison: its label in the statistic text and the records it selects.
Side = tuple[str, Mapping[str, Any]]
#: ``summary(records, metric, **where)``: one value per seed.
Summary = Callable[..., list[float]]


def lower(
    records: Sequence[Record], summary: Summary, metric: str, a: Side, b: Side, **kw: Any
) -> Comparison:
    """:func:`~layernorm.experiments.analysis.stats.compare_lower` of ``summary(records, metric,
    **where)`` for side A against side B; ``kw`` (``quantity``, ``margin``, ``scale``, ``unit``)
    goes to ``compare_lower``. Both sides' runs use the same seeds, so they are compared paired
    by seed (``paired=False`` in ``kw`` turns that off)."""
    kw.setdefault("paired", True)
    return compare_lower(a[0], summary(records, metric, **a[1]),
                         b[0], summary(records, metric, **b[1]), **kw)  # fmt: skip


def lower_per_second(
    records: Sequence[Record], metric: str, a: Side, b: Side, *, quantity: str, **kw: Any
) -> Comparison:
    """A against B after the same training wall-clock time ``t``: the shortest total of all their
    runs (see :func:`~layernorm.experiments.analysis.curves.common_time`). ``quantity`` may hold
    ``{t}``, filled with ``t`` in seconds."""
    t = common_time(records, [a[1], b[1]])
    kw.setdefault("paired", True)
    return compare_lower(a[0], at_time(records, metric, t, **a[1]),
                         b[0], at_time(records, metric, t, **b[1]),
                         quantity=quantity.format(t=t), **kw)  # fmt: skip


def missing(claim_id: str, have: Sequence[str], need: Sequence[str]) -> Verdict | None:
    """An inconclusive verdict when a configuration left out models the claim needs."""
    lack = [m for m in need if m not in have]
    if lack:
        return Verdict(claim_id, "inconclusive", f"not run with model(s) {lack}",
                       f"needs models {list(need)}")  # fmt: skip
    return None


def claim(
    claim_id: str, have: Sequence[str], need: Sequence[str], compare: Callable[[], Comparison]
) -> Verdict:
    """The verdict of ``compare()``, or an inconclusive one when the configuration left out a
    model of ``need`` (then ``compare`` is not called)."""
    return missing(claim_id, have, need) or verdict(claim_id, compare())
