"""The experiment interface: what an experiment declares and how the runner finds it.

An experiment is an :class:`Experiment` value registered under a unique name with
:func:`register`. The runner (:mod:`layernorm.experiments.engine.runner`) calls ``run`` to
produce tidy records and saves them; the report (:mod:`layernorm.experiments.analysis.report`)
later reads the saved records back and calls ``verdicts`` and ``plot`` on them, so a report never
needs training.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

__all__ = [
    "Claim",
    "Experiment",
    "Record",
    "RunContext",
    "RunIdentity",
    "Verdict",
    "apply_overrides",
    "check_choices",
    "check_config",
    "config_from_json",
    "config_to_json",
    "get",
    "names",
    "register",
]

#: One tidy row: a flat mapping of column name to a str, int, float or bool value.
Record = dict[str, Any]

Status = Literal["holds", "does not hold", "inconclusive"]
STATUSES: tuple[Status, ...] = ("holds", "does not hold", "inconclusive")


@dataclass(frozen=True)
class Claim:
    """A claim of the paper that an experiment tests.

    Attributes:
        id: short unique id, e.g. ``"ff-faster"``.
        quote: the paper's own words (with the section), shown verbatim in the report.
        test: what we compute and compare, in one or two sentences.
    """

    id: str
    quote: str
    test: str


@dataclass(frozen=True)
class Verdict:
    """The outcome of testing one claim on saved records.

    Attributes:
        claim_id: the :attr:`Claim.id` it answers.
        status: ``"holds"``, ``"does not hold"`` or ``"inconclusive"``.
        statistic: the numbers behind the status, in words (means, spreads, seeds).
        rule: the explicit threshold that turned the numbers into the status.
    """

    claim_id: str
    status: Status
    statistic: str
    rule: str

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"Verdict.status must be one of {STATUSES}, got {self.status!r}")


@dataclass(frozen=True)
class RunIdentity:
    """What a run's saved files must have been made with for ``--resume`` to trust them.

    Attributes:
        settings: canonical JSON of everything that determines the records: the experiment, the
            full configuration, quick or not, the seed and the code's version (see
            :func:`~layernorm.experiments.engine.runner.run_identity`).
        id: a hash of ``settings``, stored in every checkpoint and run file.
    """

    settings: str
    id: str

    @classmethod
    def of(cls, settings: Mapping[str, Any]) -> RunIdentity:
        """The identity of ``settings`` (JSON values)."""
        text = json.dumps(settings, sort_keys=True, separators=(",", ":"))
        return cls(text, hashlib.sha256(text.encode()).hexdigest()[:16])

    def difference(self, other: Mapping[str, Any] | None) -> str:
        """``"lr: 0.001 there, 0.01 now; seed: …"``: how saved ``other`` settings differ from
        these, key by key (nested keys joined with dots)."""
        if other is None:
            return "the saved files record no settings (made by an older version)"
        now, then = _flatten(json.loads(self.settings)), _flatten(other)
        keys = sorted(set(now) | set(then))
        diffs = [f"{k}: {then.get(k, '(absent)')!r} there, {now.get(k, '(absent)')!r} now"
                 for k in keys if now.get(k) != then.get(k)]  # fmt: skip
        return "; ".join(diffs) or "the same settings"


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out |= _flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


@dataclass(frozen=True)
class RunContext:
    """Everything a run needs besides its configuration.

    Attributes:
        out_dir: the experiment's own directory (``<out>/<name>/``); checkpoints go under it.
        device: where to train.
        seed: base seed; experiments derive per-run seeds from it deterministically.
        quick: the reduced setting (minutes on a 2-core CPU) instead of the paper's.
        resume: continue from checkpoints found in ``out_dir`` instead of starting over.
        progress: show progress bars.
        identity: the settings the run's files are made with and checked against on resume
            (``None``: not checked; the runner always sets it).
        ckpt_dir: where the checkpoints and finished-run files go (``None``: ``out_dir``).
        claims: how this process shares the experiment's runs with others (``--workers``):
            ``"off"`` alone; ``"skip"`` each run is trained by the process that claims it first,
            and a run another process holds is skipped here (no records for it); ``"wait"`` a run
            another process holds is waited for, then read back (the runner's last pass).
    """

    out_dir: Path
    device: torch.device
    seed: int = 0
    quick: bool = False
    resume: bool = False
    progress: bool = True
    identity: RunIdentity | None = None
    ckpt_dir: Path | None = None
    claims: Literal["off", "skip", "wait"] = "off"

    def run_seed(self, index: int) -> int:
        """The seed of run ``index`` of an experiment's seed loop: ``seed · 1000 + index``, so the
        runs of different base seeds never share a seed (up to 1000 runs per loop). The seed is
        part of the run's name, hence of its checkpoint files."""
        return self.seed * 1000 + index


@dataclass(frozen=True)
class Experiment:
    """A registered experiment.

    Attributes:
        name: command-line name, e.g. ``"mnist-ff"``.
        title: one-line title for listings and the report, e.g. ``"Permutation-invariant MNIST"``.
        section: where in the paper, e.g. ``"Ba et al. 2016, §6.6, Fig. 6"``.
        claims: the claims it tests.
        config: ``config(quick) -> dataclass instance``; fields can be overridden with ``--set``.
        run: ``run(config, ctx) -> records``; trains/computes and returns tidy records. Must be
            deterministic given ``ctx.seed`` and honour ``ctx.resume``.
        verdicts: ``verdicts(records, config) -> [Verdict]``, computed only from the records.
        plot: ``plot(records, config, fig_dir) -> [png paths]`` (matplotlib, Agg backend).
        tables: optional ``tables(records, config) -> markdown`` shown before the claims.
        quick_budget_s: the time the quick setting is meant to take on a 2-core CPU.
        independent_runs: ``run`` is a loop over training runs none of which depends on
            another's results, so that several processes may share them (``--workers``).
    """

    name: str
    title: str
    section: str
    claims: tuple[Claim, ...]
    config: Callable[[bool], Any]
    run: Callable[[Any, RunContext], list[Record]]
    verdicts: Callable[[Sequence[Record], Any], list[Verdict]]
    plot: Callable[[Sequence[Record], Any, Path], list[Path]]
    tables: Callable[[Sequence[Record], Any], str] | None = None
    quick_budget_s: float = 60.0
    independent_runs: bool = False
    order: int = field(default=100, compare=False)


_REGISTRY: dict[str, Experiment] = {}


def register(exp: Experiment) -> Experiment:
    """Add ``exp`` to the registry (module level, at import); returns it unchanged."""
    if not isinstance(exp, Experiment):
        raise TypeError(f"register expects an Experiment, got {type(exp).__name__}")
    if exp.name in _REGISTRY and _REGISTRY[exp.name] is not exp:
        raise ValueError(f"an experiment named {exp.name!r} is already registered")
    ids = [c.id for c in exp.claims]
    if len(set(ids)) != len(ids):
        raise ValueError(f"experiment {exp.name!r} has duplicate claim ids: {ids}")
    _REGISTRY[exp.name] = exp
    return exp


def names() -> list[str]:
    """Registered experiment names in run order."""
    return [e.name for e in sorted(_REGISTRY.values(), key=lambda e: (e.order, e.name))]


def get(name: str) -> Experiment:
    """The experiment called ``name``; a ``KeyError`` listing the valid names otherwise."""
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise KeyError(f"unknown experiment {name!r}.{hint} Valid names: {', '.join(names())}")
    return _REGISTRY[name]


def apply_overrides(config: Any, overrides: Mapping[str, str]) -> Any:
    """A copy of the dataclass ``config`` with fields set from ``"key" -> "text"`` pairs.

    The text is converted to the type of the field's current value (int, float, bool, str, or a
    tuple of those, written comma-separated). Unknown keys raise a ``ValueError`` listing the
    valid ones.
    """
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"config must be a dataclass instance, got {type(config).__name__}")
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    changes: dict[str, Any] = {}
    for key, text in overrides.items():
        if key not in fields:
            raise ValueError(
                f"unknown setting {key!r} for {type(config).__name__}; valid settings: "
                f"{', '.join(sorted(fields))}"
            )
        changes[key] = _parse_like(fields[key], text, key)
    return dataclasses.replace(config, **changes)


def _parse_like(current: Any, text: str, key: str) -> Any:
    try:
        if isinstance(current, bool):
            low = text.strip().lower()
            if low not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(text)
            return low in ("1", "true", "yes")
        if isinstance(current, int):
            return int(text)
        if isinstance(current, float):
            return float(text)
        if isinstance(current, tuple):
            elem = current[0] if current else ""
            return tuple(_parse_like(elem, t, key) for t in text.split(",") if t.strip())
        return text
    except ValueError:
        raise ValueError(
            f"setting {key}={text!r}: expected a value like {current!r} ({type(current).__name__})"
        ) from None


def check_choices(
    experiment: str, field: str, values: Sequence[str], allowed: Sequence[str]
) -> None:
    """``ValueError`` naming the first of ``values`` that is not in ``allowed`` (a run's own check
    of a selection, e.g. the models it trains)."""
    for v in values:
        if v not in allowed:
            raise ValueError(f"{experiment}: {field} must be among {tuple(allowed)}, got {v!r}")


def check_config(
    cfg: Any,
    positive: Sequence[str] = (),
    non_negative: Sequence[str] = (),
    choices: Mapping[str, Sequence[str]] | None = None,
) -> None:
    """Validate a configuration in its ``__post_init__``: the named fields (numbers or tuples of
    numbers) must be > 0 / >= 0, and tuple fields in ``choices`` must be non-empty subsets."""
    name = type(cfg).__name__
    for key in positive:
        vals = getattr(cfg, key)
        for v in vals if isinstance(vals, tuple) else (vals,):
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                raise ValueError(f"{name}.{key} must be positive, got {vals!r}")
        if isinstance(vals, tuple) and not vals:
            raise ValueError(f"{name}.{key} must not be empty")
    for key in non_negative:
        v = getattr(cfg, key)
        if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
            raise ValueError(f"{name}.{key} must be >= 0, got {v!r}")
    for key, allowed in (choices or {}).items():
        vals = getattr(cfg, key)
        bad = [v for v in vals if v not in allowed]
        if bad or not vals:
            raise ValueError(
                f"{name}.{key} must be a non-empty selection of {tuple(allowed)}, got {vals!r}"
            )


def config_to_json(cfg: Any) -> dict[str, Any]:
    """A configuration dataclass as plain JSON-ready values (the inverse of
    :func:`config_from_json`)."""
    return dataclasses.asdict(cfg)


def config_from_json(exp: Experiment, quick: bool, saved: Mapping[str, Any]) -> Any:
    """Rebuild a saved configuration (JSON turns tuples into lists; turn them back)."""
    base = exp.config(quick)
    kinds = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    values = {
        k: (tuple(v) if isinstance(kinds.get(k), tuple) else v)
        for k, v in saved.items()
        if k in kinds
    }
    return dataclasses.replace(base, **values)
