"""The paper's experiments, the training loop they share, and the report drawn from their data.

Adding an experiment
--------------------
Write one module here that builds an :class:`~layernorm.experiments.registry.Experiment` and
passes it to :func:`~layernorm.experiments.registry.register`, then add one import line at the
bottom of this file. The experiment provides:

``name``, ``title``, ``section``
    command-line name (``layernorm reproduce NAME``), one-line title, place in the paper.
``claims``
    :class:`Claim` values: an id, the paper's own words, and what is computed to test them.
``config(quick: bool) -> dataclass``
    the full (paper) or quick (a few minutes on a 2-core CPU) setting; every field can be
    overridden from the command line with ``--set KEY=VALUE``. A ``__post_init__`` calling
    :func:`~layernorm.experiments.registry.check_config` rejects bad values before any work.
``run(config, ctx: RunContext) -> list[Record]``
    does the work and returns tidy records (flat dicts, one row per measurement, e.g.
    ``{"model": "layer", "batch_size": 4, "seed": 0, "epoch": 3, "test_err": 0.031}``). It must be
    deterministic for a given ``ctx.seed`` and honour ``ctx.resume``; training experiments get
    both for free from :func:`layernorm.experiments.training.train_classifier` (per-epoch atomic
    checkpoints under ``ctx.out_dir``), or can follow its pattern for other losses.
``verdicts(records, config) -> list[Verdict]``
    one :class:`Verdict` per claim, computed from the records only, with the statistic and the
    explicit threshold (see :func:`layernorm.experiments.stats.compare_lower`).
``plot(records, config, fig_dir) -> list[Path]``
    PNG figures (matplotlib, Agg backend; see :mod:`layernorm.experiments.plots`).
``tables(records, config) -> str`` (optional)
    Markdown shown in the report before the claims.
``quick_budget_s``, ``order``
    the intended quick run time and the position in ``layernorm reproduce``'s run order.

The runner (:func:`layernorm.experiments.runner.reproduce`) saves ``records.json``/``.csv``,
``config.json`` and ``meta.json`` under ``<out>/<name>/``; the report
(:func:`layernorm.experiments.report.write_report`) reads them back, so it never trains.

``layernorm reproduce --list`` prints the registered experiments.
"""

from __future__ import annotations

# One import per experiment module: importing it registers it (run order: Experiment.order).
from . import (  # noqa: F401
    adanorm_study,
    char_lm,
    convnet,
    draw,
    gain_init,
    geometry,
    invariances,
    longer_than_train,
    mnist_ff,
    seq_mnist,
    spoken_digits,
)
from .registry import Claim, Experiment, Record, RunContext, Verdict, get, names, register
from .runner import reproduce

__all__ = [
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
