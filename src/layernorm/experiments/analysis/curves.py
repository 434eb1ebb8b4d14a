"""Summaries, tables and figures of per-evaluation records: those of
:func:`~layernorm.experiments.engine.steps.train_steps` (tagged with ``seed``, ``step``,
``seconds``, ``diverged`` and the metrics), shared by the sequence experiments.

Per seed: the final value, the mean over the curve, the value after a given training time; the
table of last evaluations and the figure with one panel per update and one per second.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..engine.registry import Record
from .plots import plt, save_figure
from .stats import mean_sd

__all__ = [
    "at_time",
    "common_time",
    "final",
    "final_table",
    "lines",
    "mean_curve",
    "rows",
    "step_time_figure",
]


def _runs(records: Sequence[Record], where: Mapping[str, Any]) -> dict[int, list[Record]]:
    """Records matching ``where``, grouped by seed, each group in update order."""
    out: dict[int, list[Record]] = defaultdict(list)
    for r in records:
        if all(r.get(k) == v for k, v in where.items()):
            out[int(r["seed"])].append(r)
    return {s: sorted(v, key=lambda r: int(r["step"])) for s, v in sorted(out.items())}


def final(records: Sequence[Record], metric: str, **where: Any) -> list[float]:
    """Per seed, ``metric`` at the last evaluation (NaN when that run diverged)."""
    out = []
    for run in _runs(records, where).values():
        last = run[-1]
        out.append(math.nan if last.get("diverged") else float(last[metric]))
    return out


def mean_curve(records: Sequence[Record], metric: str, **where: Any) -> list[float]:
    """Per seed, ``metric`` averaged over the evaluations: the area under the curve per update."""
    out = []
    for run in _runs(records, where).values():
        vals = [float(r[metric]) for r in run]
        out.append(math.nan if run[-1].get("diverged") else math.fsum(vals) / len(vals))
    return out


def at_time(records: Sequence[Record], metric: str, t: float, **where: Any) -> list[float]:
    """Per seed, ``metric`` after ``t`` training seconds, interpolated linearly between the two
    evaluations around ``t`` (the first evaluation's value before it, the last one's after)."""
    out = []
    for run in _runs(records, where).values():
        pts = [(float(r["seconds"]), float(r[metric])) for r in run]
        if t <= pts[0][0]:
            out.append(pts[0][1])
            continue
        value = pts[-1][1]
        for (t0, v0), (t1, v1) in itertools.pairwise(pts):
            if t0 <= t <= t1:
                value = v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
                break
        out.append(value)
    return out


def common_time(records: Sequence[Record], groups: Sequence[Mapping[str, Any]]) -> float:
    """The shortest total training time among all runs of ``groups``: every run got that far."""
    ends = [float(run[-1]["seconds"]) for g in groups for run in _runs(records, g).values()]
    return min(ends) if ends else math.nan


# -- figures -------------------------------------------------------------------------------------


def step_time_figure(
    records: Sequence[Record],
    path: Path,
    *,
    metric: str,
    ylabel: str,
    models: Sequence[tuple[str, Mapping[str, Any], str]],
    title: str,
    log_y: bool = False,
    scale: float = 1.0,
    step_label: str = "updates",
) -> Path:
    """Two panels: ``metric`` against updates and against training seconds. ``models`` lists
    ``(label, where, color)``; each line is the mean over seeds (x in seconds: the mean over
    seeds of the time at which each evaluation was reached), the band spans the seeds."""
    fig, axes = plt.subplots(1, 2, figsize=(10.4, 3.6), squeeze=False)
    for label, where, color in models:
        runs = list(_runs(records, where).values())
        if not runs:
            continue
        n = min(len(r) for r in runs)
        ys = [[float(r[i][metric]) * scale for r in runs] for i in range(n)]
        mean = [math.fsum(v) / len(v) for v in ys]
        lo, hi = [min(v) for v in ys], [max(v) for v in ys]
        steps = [int(runs[0][i]["step"]) for i in range(n)]
        secs = [math.fsum(float(r[i]["seconds"]) for r in runs) / len(runs) for i in range(n)]
        for ax, xs in zip(axes[0], (steps, secs), strict=True):
            ax.plot(xs, mean, color=color, label=label, marker="o", ms=2.5)
            ax.fill_between(xs, lo, hi, color=color, alpha=0.18, lw=0)
    for ax, xlabel in zip(axes[0], (step_label, "training wall-clock seconds"), strict=True):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if log_y:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def final_table(
    records: Sequence[Record],
    rows: Sequence[tuple[str, Mapping[str, Any]]],
    columns: Sequence[tuple[str, str, float, str]],
) -> str:
    """Markdown: one row per ``(label, where)``, one column per ``(metric, header, scale, unit)``
    at the last evaluation (mean ± sd over seeds), plus updates and training seconds."""
    head = "| model | " + " | ".join(h for _, h, _, _ in columns) + " | updates | train s |"
    lines = [head, "|" + " --- |" * (len(columns) + 3)]
    for label, where in rows:
        runs = list(_runs(records, where).values())
        if not runs:
            continue
        cells = []
        for metric, _, sc, unit in columns:
            vals = final(records, metric, **where)
            if any(not math.isfinite(v) for v in vals):
                bad = sum(not math.isfinite(v) for v in vals)
                cells.append(f"diverged in {bad} run(s)")
                continue
            mu, sd = mean_sd(vals)
            cells.append(f"{mu * sc:.4f}{unit} ± {sd * sc:.4f}{unit}")
        secs, _ = mean_sd([float(r[-1]["seconds"]) for r in runs])
        lines.append(f"| {label} | " + " | ".join(cells)
                     + f" | {int(runs[0][-1]['step'])} | {secs:.1f} |")  # fmt: skip
    n = len({int(r["seed"]) for r in records})
    return f"Last evaluation, mean ± sd over {n} seed(s):\n\n" + "\n".join(lines)


def rows(names: Sequence[str], labels: Mapping[str, str]) -> list[tuple[str, dict[str, Any]]]:
    """Table rows ``(label, {"model": name})`` for :func:`final_table`."""
    return [(labels.get(n, n), {"model": n}) for n in names]


def lines(
    names: Sequence[str], labels: Mapping[str, str], colors: Mapping[str, str]
) -> list[tuple[str, dict[str, Any], str]]:
    """Figure lines ``(label, {"model": name}, color)`` for :func:`step_time_figure`."""
    return [(labels.get(n, n), {"model": n}, colors.get(n, "k")) for n in names]
