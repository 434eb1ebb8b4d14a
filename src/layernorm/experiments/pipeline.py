"""``layernorm reproduce``: run the selected experiments, then write the report from their
saved records. The one place where the engine and the analysis meet."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from . import definitions  # noqa: F401  (registers the experiments)
from .analysis.report import write_report
from .engine import distributed
from .engine.runner import run_experiments

__all__ = ["reproduce"]


def reproduce(
    selected: Sequence[str] | None = None,
    *,
    out: Path = Path("results"),
    device: str | None = None,
    seed: int = 0,
    quick: bool = False,
    resume: bool = False,
    overrides: Sequence[str] = (),
    progress: bool = True,
    report: bool = True,
) -> Path | None:
    """Run the experiments ``selected`` (all registered ones when empty), save their records and
    write the report; returns the path of ``report.md`` (``None`` on non-zero ranks). See
    :func:`~layernorm.experiments.engine.runner.run_experiments` for the arguments."""
    run_experiments(selected, out=out, device=device, seed=seed, quick=quick, resume=resume,
                    overrides=overrides, progress=progress)  # fmt: skip
    if not distributed.is_main():
        return None
    if not report:
        return out / "report.md"
    md, _ = write_report(out)
    return md
