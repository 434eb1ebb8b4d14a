"""Learning-curve figures shared by the training experiments (matplotlib, Agg backend)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..engine.registry import Record

__all__ = ["COLORS", "LABELS", "Panel", "classifier_panels", "curves_figure", "plt", "save_figure"]

LABELS = {"none": "baseline", "batch": "batch norm", "layer": "layer norm"}
COLORS = {"none": "0.45", "batch": "tab:blue", "layer": "tab:red"}


#: One panel of :func:`curves_figure`: ``(metric, where, panel_title, y_label, log_y)``.
Panel = tuple[str, dict[str, object], str, str, bool]


def classifier_panels(where: dict[str, object], suffix: str = "") -> list[Panel]:
    """The two panels of a classifier's learning curves over the records matching ``where``:
    training NLL (log scale) and test error, ``suffix`` appended to both titles."""
    return [
        ("train_nll", where, f"train NLL{suffix}", "NLL (nats)", True),
        ("test_err", where, f"test error{suffix}", "error (%)", False),
    ]


def save_figure(fig: Figure, path: Path) -> Path:
    """Lay out ``fig``, write it to ``path`` as a PNG (90 dpi, parent directories created) and
    close it (pyplot keeps every open figure alive otherwise); returns ``path``."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _series(records: Sequence[Record], model: str, metric: str, **where: object):
    by_epoch: dict[int, list[float]] = defaultdict(list)
    for r in records:
        if r.get("model") == model and all(r.get(k) == v for k, v in where.items()):
            by_epoch[int(r["epoch"])].append(float(r[metric]))
    xs = sorted(by_epoch)
    vals = [by_epoch[e] for e in xs]
    mean = [sum(v) / len(v) for v in vals]
    return xs, mean, [min(v) for v in vals], [max(v) for v in vals]


def curves_figure(
    records: Sequence[Record],
    path: Path,
    *,
    panels: Sequence[Panel],
    models: Sequence[str],
    title: str,
    ncols: int = 2,
) -> Path:
    """One panel per ``(metric, where, panel_title, y_label, log_y)``; one line per model: the
    mean over seeds with a band from the lowest to the highest seed."""
    nrows = (len(panels) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.4 * nrows), squeeze=False)
    for ax, (metric, where, ptitle, ylabel, log_y) in zip(axes.flat, panels, strict=False):
        for m in models:
            xs, mean, lo, hi = _series(records, m, metric, **where)
            if not xs:
                continue
            scale = 100.0 if metric.endswith("_err") else 1.0
            ax.plot(
                xs,
                [v * scale for v in mean],
                color=COLORS.get(m),
                label=LABELS.get(m, m),
                marker="o",
                ms=3,
            )
            ax.fill_between(
                xs,
                [v * scale for v in lo],
                [v * scale for v in hi],
                color=COLORS.get(m),
                alpha=0.18,
                lw=0,
            )
        ax.set_title(ptitle, fontsize=10)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        if log_y:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=11)
    return save_figure(fig, path)
