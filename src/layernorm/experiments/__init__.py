"""The paper's experiments, the training loops they share, and the report drawn from their data.

Layout
------
``engine/``
    what runs experiments: :mod:`~.engine.registry` (the interface below),
    :mod:`~.engine.runner` (settings, output folders, metadata), the two training loops
    (:mod:`~.engine.training` per epoch, :mod:`~.engine.steps` per update), their checkpoint and
    run files (:mod:`~.engine.checkpoints`), atomic writes (:mod:`~.engine.io`) and data
    parallelism (:mod:`~.engine.distributed`).
``analysis/``
    what is drawn from saved records: statistics and verdict rules (:mod:`~.analysis.stats`,
    :mod:`~.analysis.compare`), per-seed summaries and tables (:mod:`~.analysis.epochs` for
    per-epoch records, :mod:`~.analysis.curves` for per-evaluation ones), figures
    (:mod:`~.analysis.plots`) and the report (:mod:`~.analysis.report`).
``models/``, ``data.py``
    models and data used by more than one experiment.
``definitions/``
    one module per experiment.
``papers.py``
    the papers' side, as data: each experiment's paper-scale setting (``--paper``: what it
    reduces and its estimated CPU time) and the published numbers the report prints beside ours.
``pipeline.py``
    :func:`reproduce`: run, then report.

Imports flow one way: ``pipeline → definitions → models, data → analysis → engine → layernorm``
(the engine never imports the analysis, and nothing below ``definitions`` imports an experiment);
``papers`` imports nothing of the package, and the analysis and the pipeline read it.

Adding an experiment
--------------------
Write one module in ``definitions/`` that builds an
:class:`~layernorm.experiments.engine.registry.Experiment` and passes it to
:func:`~layernorm.experiments.engine.registry.register`, then add its name to the import in
``definitions/__init__.py``. Take shared models from ``models/`` and data from ``data.py``
(move a model there when a second experiment needs it, rather than importing another
experiment). The experiment provides:

``name``, ``title``, ``section``
    command-line name (``layernorm reproduce NAME``), one-line title, place in the paper.
``claims``
    :class:`Claim` values: an id, the paper's own words, and what is computed to test them.
``config(quick: bool) -> dataclass``
    the full (paper) or quick (a few minutes on a 2-core CPU) setting; every field can be
    overridden from the command line with ``--set KEY=VALUE``. A ``__post_init__`` calling
    :func:`~layernorm.experiments.engine.registry.check_config` rejects bad values before any
    work.
``run(config, ctx: RunContext) -> list[Record]``
    does the work and returns tidy records (flat dicts, one row per measurement, e.g.
    ``{"model": "layer", "batch_size": 4, "seed": 0, "epoch": 3, "test_err": 0.031}``). It must be
    deterministic for a given ``ctx.seed`` and honour ``ctx.resume``; training experiments get
    both for free from :func:`~layernorm.experiments.engine.training.train_classifier` (per-epoch
    atomic checkpoints under ``ctx.out_dir``) or
    :func:`~layernorm.experiments.engine.steps.train_steps` (per-evaluation checkpoints; the
    seeds × models grid with :func:`~layernorm.experiments.engine.steps.train_grid`).
``verdicts(records, config) -> list[Verdict]``
    one :class:`Verdict` per claim, computed from the records only, with the statistic and the
    explicit threshold (:func:`~layernorm.experiments.analysis.compare.lower` of two sides'
    per-seed summaries, or :mod:`~layernorm.experiments.analysis.stats` directly).
``plot(records, config, fig_dir) -> list[Path]``
    PNG figures (matplotlib, Agg backend; see :mod:`~layernorm.experiments.analysis.plots`).
``tables(records, config) -> str`` (optional)
    Markdown shown in the report before the claims.
``quick_budget_s``, ``order``
    the intended quick run time and the position in ``layernorm reproduce``'s run order.

and an entry in :data:`~layernorm.experiments.papers.PAPER_SETTINGS`: the paper's setting, what
ours reduces, the ``--set`` values that make ``config(False)`` fit the paper-scale budget, and the
estimated CPU-hours (``benchmarks/paper_budget.py`` times it; regenerate the table in
``docs/results/README.md`` with :func:`~layernorm.experiments.papers.budget_table`).

The runner saves ``records.json``/``.csv``, ``config.json`` and ``meta.json`` under
``<out>/<name>/``; the report (:func:`~layernorm.experiments.analysis.report.write_report`) reads
them back, so it never trains.

``layernorm reproduce --list`` prints the registered experiments.
"""

from __future__ import annotations

from . import definitions  # noqa: F401  (importing it registers every experiment)
from .engine.registry import Claim, Experiment, Record, RunContext, Verdict, get, names, register
from .pipeline import DEMO, DEMO_SETTINGS, reproduce

__all__ = [
    "DEMO",
    "DEMO_SETTINGS",
    "Claim",
    "Experiment",
    "Record",
    "RunContext",
    "Verdict",
    "get",
    "names",
    "register",
    "reproduce",
]
