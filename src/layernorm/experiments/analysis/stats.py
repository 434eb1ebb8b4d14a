"""Turning numbers into verdicts with explicit, printed thresholds.

:func:`compare_lower` decides whether quantity A is lower than quantity B from their values over
seeds. Let ``d = mean(B) − mean(A)`` and ``se = sqrt(sd_A²/n_A + sd_B²/n_B)`` (sample standard
deviations; ``se = 0`` with a single seed), or, for runs **paired by seed** (the same seed gives
both models the same data order and evaluation batches), ``se = sd(B_i − A_i)/sqrt(n)``: what
the seeds share cancels, so a consistent difference is told apart from noise with few seeds.
Then

* **holds** when ``d > z·se`` *and* ``d > margin`` (the effect is both outside the seed-to-seed
  noise and larger than a minimum size that matters);
* **does not hold** when ``d < −z·se`` and ``−d > margin`` (clearly the other way round), or when
  ``|d| ≤ margin`` and ``z·se ≤ margin`` (the effect is measurably too small);
* **inconclusive** otherwise (the noise is too large to tell).

:func:`compare_not_worse` is the non-inferiority counterpart (A at most ``margin`` worse than B),
for claims that a change costs nothing. :func:`verdict` turns either result into the
:class:`~layernorm.experiments.engine.registry.Verdict` of a claim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..engine.registry import Verdict

__all__ = ["Comparison", "compare_lower", "compare_not_worse", "mean_sd", "verdict"]


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_sd: no values")
    m = math.fsum(values) / n
    sd = math.sqrt(math.fsum((v - m) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return m, sd


@dataclass(frozen=True)
class Comparison:
    status: str
    statistic: str
    rule: str
    difference: float


def _standard_error(a: Sequence[float], b: Sequence[float], paired: bool = False) -> float:
    """Standard error of ``mean(B) − mean(A)``: from the per-seed differences when ``paired``
    (and there are as many values on both sides, at least two), otherwise from the two
    samples' standard deviations."""
    if paired and len(a) == len(b) >= 2:
        _, sd = mean_sd([y - x for x, y in zip(a, b, strict=True)])
        return sd / math.sqrt(len(a))
    _, sa = mean_sd(a)
    _, sb = mean_sd(b)
    return math.sqrt(sa**2 / len(a) + sb**2 / len(b))


def _fmt(v: float, scale: float, unit: str) -> str:
    return f"{v * scale:.4g}{unit}"


def compare_lower(
    label_a: str,
    a: Sequence[float],
    label_b: str,
    b: Sequence[float],
    *,
    quantity: str,
    margin: float,
    z: float = 2.0,
    scale: float = 1.0,
    unit: str = "",
    paired: bool = False,
) -> Comparison:
    """Is ``quantity`` lower for A than for B? See the module docstring for the rule.

    Args:
        label_a, label_b: names for the statistic text (e.g. ``"LN"``, ``"BN"``).
        a, b: per-seed values.
        quantity: what the values are, for the text (e.g. ``"final test error"``).
        margin: the smallest difference that counts, in the values' units.
        z: how many standard errors the difference must clear.
        scale, unit: display only (e.g. ``100`` and ``"%"`` for error rates).
        paired: ``a[i]`` and ``b[i]`` come from runs with the same seed (see the module
            docstring); the standard error is then that of the per-seed differences.
    """
    if not a or not b:
        raise ValueError(f"compare_lower: no values for {label_a if not a else label_b}")
    if any(not math.isfinite(v) for v in (*a, *b)):
        return Comparison(
            "inconclusive",
            f"{quantity}: a run produced a non-finite value",
            "non-finite values cannot be compared",
            math.nan,
        )
    ma, sa = mean_sd(a)
    mb, sb = mean_sd(b)
    d = mb - ma
    pairs = paired and len(a) == len(b) >= 2
    se = _standard_error(a, b, pairs)
    if d > z * se and d > margin:
        status = "holds"
    elif (d < -z * se and -d > margin) or (abs(d) <= margin and z * se <= margin):
        status = "does not hold"
    else:
        status = "inconclusive"
    n = (
        f"{len(a)} seed{'s' if len(a) > 1 else ''}"
        if len(a) == len(b)
        else f"{len(a)}/{len(b)} seeds"
    )
    statistic = (
        f"{quantity}: {label_a} {_fmt(ma, scale, unit)} ± {_fmt(sa, scale, unit)} vs "
        f"{label_b} {_fmt(mb, scale, unit)} ± {_fmt(sb, scale, unit)} (mean ± sd over {n}); "
        f"{label_b} − {label_a} = {_fmt(d, scale, unit)}, {z:g}·SE = {_fmt(z * se, scale, unit)}"
        + (" (SE of the per-seed differences, runs paired by seed)" if pairs else "")
    )
    rule = (
        f"holds if {label_b} − {label_a} > {z:g}·SE and > {_fmt(margin, scale, unit)}; does not "
        f"hold if it is < −{z:g}·SE and < −{_fmt(margin, scale, unit)}, or if both it and "
        f"{z:g}·SE are within ±{_fmt(margin, scale, unit)}; inconclusive otherwise"
    )
    return Comparison(status, statistic, rule, d)


def compare_not_worse(
    label_a: str,
    a: Sequence[float],
    label_b: str,
    b: Sequence[float],
    *,
    quantity: str,
    margin: float,
    z: float = 2.0,
    scale: float = 1.0,
    unit: str = "",
    paired: bool = False,
) -> Comparison:
    """Is A **not worse** (not higher) than B, within ``margin``? A non-inferiority test.

    With ``d = mean(B) − mean(A)`` and ``se`` as in :func:`compare_lower`: **holds** when
    ``d − z·se > −margin`` (even the pessimistic end of the interval leaves A at most ``margin``
    above B); **does not hold** when ``d + z·se < −margin`` (A is clearly more than ``margin``
    worse); **inconclusive** otherwise. The statistic text is :func:`compare_lower`'s.
    """
    base = compare_lower(label_a, a, label_b, b, quantity=quantity, margin=margin, z=z,
                         scale=scale, unit=unit, paired=paired)  # fmt: skip
    if not math.isfinite(base.difference):
        return base
    d, se = base.difference, _standard_error(a, b, paired and len(a) == len(b) >= 2)
    if d - z * se > -margin:
        status = "holds"
    elif d + z * se < -margin:
        status = "does not hold"
    else:
        status = "inconclusive"
    m = _fmt(margin, scale, unit)
    rule = (f"holds if {label_b} − {label_a} − {z:g}·SE > −{m} ({label_a} at most {m} worse even "
            f"at the pessimistic end); does not hold if {label_b} − {label_a} + {z:g}·SE < −{m}; "
            "inconclusive otherwise")  # fmt: skip
    return Comparison(status, base.statistic, rule, d)


def verdict(claim_id: str, c: Comparison) -> Verdict:
    """The verdict of claim ``claim_id`` from a comparison's status, statistic and rule."""
    return Verdict(claim_id, c.status, c.statistic, c.rule)  # type: ignore[arg-type]
