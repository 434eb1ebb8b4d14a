"""Per-seed summaries and the final-epoch table of the records of
:func:`~layernorm.experiments.training.train_classifier` (one record per epoch, tagged with
``model``, ``batch_size`` and ``seed``), shared by ``mnist-ff`` and ``convnet``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .registry import Record
from .stats import Comparison, compare_lower, mean_sd

__all__ = ["Side", "auc", "final_epoch", "final_epoch_table", "late", "lower"]

#: One side of a comparison: its label in the statistic text and the model whose records it takes.
Side = tuple[str, str]


def final_epoch(records: Sequence[Record], model: str, bs: int, metric: str) -> list[float]:
    """Per seed, the metric at the last epoch."""
    last = max(int(r["epoch"]) for r in records)
    return [
        float(r[metric])
        for r in records
        if r["model"] == model and r["batch_size"] == bs and int(r["epoch"]) == last
    ]


def late(records: Sequence[Record], model: str, bs: int, metric: str) -> list[float]:
    """Per seed, the metric averaged over the second half of the epochs (the last ⌈E/2⌉): the
    end of training, less noisy than the last epoch alone at small batch sizes."""
    last = max(int(r["epoch"]) for r in records)
    first = last - (last + 1) // 2 + 1
    per_seed: dict[int, list[float]] = {}
    for r in records:
        if r["model"] == model and r["batch_size"] == bs and int(r["epoch"]) >= first:
            per_seed.setdefault(int(r["seed"]), []).append(float(r[metric]))
    return [sum(v) / len(v) for _, v in sorted(per_seed.items())]


def auc(records: Sequence[Record], model: str, bs: int, metric: str) -> list[float]:
    """Per seed, the metric averaged over all epochs: the area under the learning curve."""
    per_seed: dict[int, list[float]] = {}
    for r in records:
        if r["model"] == model and r["batch_size"] == bs:
            per_seed.setdefault(int(r["seed"]), []).append(float(r[metric]))
    return [sum(v) / len(v) for _, v in sorted(per_seed.items())]


def lower(
    records: Sequence[Record],
    summary: Callable[[Sequence[Record], str, int, str], list[float]],
    metric: str,
    bs: int,
    a: Side,
    b: Side,
    **kw: Any,
) -> Comparison:
    """:func:`~layernorm.experiments.stats.compare_lower` of ``summary(records, model, bs,
    metric)`` (:func:`auc`, :func:`late` or :func:`final_epoch`) for side A against side B at
    batch size ``bs``; ``kw`` (``quantity``, ``margin``, ``scale``, ``unit``) goes to
    ``compare_lower``."""
    return compare_lower(a[0], summary(records, a[1], bs, metric),
                         b[0], summary(records, b[1], bs, metric), **kw)  # fmt: skip


def final_epoch_table(
    records: Sequence[Record], rows: Sequence[tuple[Sequence[str], str, int]], keys: Sequence[str]
) -> str:
    """Markdown table of train NLL, test NLL and test error at the last epoch (mean ± sd over
    seeds). Each row is ``(leading cells, model, batch size)``; ``keys`` names the leading
    columns."""
    last = max(int(r["epoch"]) for r in records)
    lines = [
        f"Final epoch ({last}), mean ± sd over seeds:",
        "",
        "| " + " | ".join(keys) + " | train NLL | test NLL | test error |",
        "|" + " --- |" * (len(keys) + 3),
    ]
    for lead, model, bs in rows:
        cells = []
        for metric, sc, unit in (("train_nll", 1, ""), ("test_nll", 1, ""), ("test_err", 100, "%")):
            mu, sd = mean_sd(final_epoch(records, model, bs, metric))
            cells.append(f"{mu * sc:.4f}{unit} ± {sd * sc:.4f}{unit}")
        lines.append("| " + " | ".join([*lead, *cells]) + " |")
    return "\n".join(lines)
