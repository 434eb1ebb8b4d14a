"""``layernorm reproduce``: run the selected experiments, then write the report from their
saved records. The one place where the engine and the analysis meet."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from . import definitions  # noqa: F401  (registers the experiments)
from .analysis.report import write_report
from .engine import distributed
from .engine.registry import names
from .engine.runner import run_experiments
from .papers import paper_overrides

__all__ = ["DEMO", "DEMO_SETTINGS", "reproduce"]

#: What ``layernorm reproduce --demo`` (``make demo``) runs, in its quick setting: a smoke test of
#: the whole pipeline (real data, training, checkpoints, verdicts, figures, report) meant to end
#: in under 5 minutes on 2 CPU cores: Table 1 and the geometry (seconds), the feed-forward MNIST
#: of Fig. 6 and two recurrent ones (LN-LSTM on MNIST read row by row, longer sequences than
#: trained on). The quick run of everything takes about three times as long; the evidence is the
#: published report of the paper settings, not either quick run.
DEMO: tuple[str, ...] = ("invariances", "geometry", "mnist-ff", "seq-mnist", "longer-than-train")
#: ``--set`` values the demo applies before the user's: mnist-ff's 15 runs at batch 4 are most of
#: the demo's time, and 3 seeds instead of 5 keep it well inside its budget.
DEMO_SETTINGS: tuple[str, ...] = ("mnist-ff.seeds=3",)


def reproduce(
    selected: Sequence[str] | None = None,
    *,
    out: Path = Path("results"),
    device: str | None = None,
    seed: int = 0,
    quick: bool = False,
    resume: bool = False,
    restart_changed: bool = False,
    overrides: Sequence[str] = (),
    progress: bool = True,
    report: bool = True,
    paper: bool = False,
    checkpoints: Path | None = None,
    command: str | None = None,
    workers: int = 1,
) -> Path | None:
    """Run the experiments ``selected`` (all registered ones when empty), save their records and
    write the report; returns the path of ``report.md`` (``None`` on non-zero ranks). ``paper``:
    the paper settings of :data:`~layernorm.experiments.papers.PAPER_SETTINGS` (``overrides``
    still win). See :func:`~layernorm.experiments.engine.runner.run_experiments` for the other
    arguments."""
    if paper:
        if quick:
            raise ValueError("choose --quick or --paper, not both")
        overrides = [*paper_overrides(list(selected) if selected else names()), *overrides]
    run_experiments(
        selected,
        out=out,
        device=device,
        seed=seed,
        quick=quick,
        resume=resume,
        restart_changed=restart_changed,
        overrides=overrides,
        progress=progress,
        setting="paper" if paper else None,
        checkpoints=checkpoints,
        command=command,
        workers=workers,
    )
    if not distributed.is_main():
        return None
    if not report:
        return out / "report.md"
    md, _ = write_report(out)
    return md
