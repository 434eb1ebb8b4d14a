"""Per-seed summaries and the final-epoch table of per-epoch records: those of
:func:`~layernorm.experiments.engine.training.train_classifier` (one record per epoch, tagged
with ``seed`` and the run's other columns, e.g. ``model`` and ``batch_size``), shared by
``mnist-ff`` and ``convnet``.

Every summary has the signature ``summary(records, metric, **where)`` of
:func:`~layernorm.experiments.analysis.compare.lower`: ``where`` selects the records of one side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..engine.registry import Record
from .stats import mean_sd

__all__ = ["auc", "final_epoch", "final_epoch_table", "late"]


def _per_seed(
    records: Sequence[Record], metric: str, where: Mapping[str, Any], first: int = 1
) -> list[float]:
    """Per seed (in seed order), the mean of ``metric`` over the matching records of epochs
    ``>= first``."""
    per_seed: dict[int, list[float]] = {}
    for r in records:
        if int(r["epoch"]) >= first and all(r.get(k) == v for k, v in where.items()):
            per_seed.setdefault(int(r["seed"]), []).append(float(r[metric]))
    return [sum(v) / len(v) for _, v in sorted(per_seed.items())]


def final_epoch(records: Sequence[Record], metric: str, **where: Any) -> list[float]:
    """Per seed, the metric at the last epoch."""
    return _per_seed(records, metric, where, first=max(int(r["epoch"]) for r in records))


def late(records: Sequence[Record], metric: str, **where: Any) -> list[float]:
    """Per seed, the metric averaged over the second half of the epochs (the last ⌈E/2⌉): the
    end of training, less noisy than the last epoch alone at small batch sizes."""
    last = max(int(r["epoch"]) for r in records)
    return _per_seed(records, metric, where, first=last - (last + 1) // 2 + 1)


def auc(records: Sequence[Record], metric: str, **where: Any) -> list[float]:
    """Per seed, the metric averaged over all epochs: the area under the learning curve."""
    return _per_seed(records, metric, where)


def final_epoch_table(
    records: Sequence[Record],
    rows: Sequence[tuple[Sequence[str], Mapping[str, Any]]],
    keys: Sequence[str],
) -> str:
    """Markdown table of train NLL, test NLL and test error at the last epoch (mean ± sd over
    seeds). Each row is ``(leading cells, where)``; ``keys`` names the leading columns."""
    last = max(int(r["epoch"]) for r in records)
    lines = [
        f"Final epoch ({last}), mean ± sd over seeds:",
        "",
        "| " + " | ".join(keys) + " | train NLL | test NLL | test error |",
        "|" + " --- |" * (len(keys) + 3),
    ]
    for lead, where in rows:
        cells = []
        for metric, sc, unit in (("train_nll", 1, ""), ("test_nll", 1, ""), ("test_err", 100, "%")):
            mu, sd = mean_sd(final_epoch(records, metric, **where))
            cells.append(f"{mu * sc:.4f}{unit} ± {sd * sc:.4f}{unit}")
        lines.append("| " + " | ".join([*lead, *cells]) + " |")
    return "\n".join(lines)
