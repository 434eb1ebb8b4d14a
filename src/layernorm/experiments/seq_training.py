"""Update-counted training for the sequence experiments, with curves per update and per second.

:func:`layernorm.experiments.training.train_classifier` counts epochs over a fixed tensor of
examples. Language models and sequence classifiers here instead draw a fresh mini-batch per update
(random text windows, packed variable-length recordings), and their claims are about speed, so
:func:`train_steps` counts updates, evaluates every ``eval_every`` updates and records both the
update count and the training wall-clock time (evaluation excluded): layer norm costs time per
step, and the report shows the curves both ways.

Checkpoints are ``train_classifier``'s (:class:`~layernorm.experiments.training.RunFiles`): after
every evaluation, the history (JSON) and then the model, optimizer, sampling-generator and torch
RNG states (``.pt``) are written atomically under ``ctx.out_dir/ckpt/``; ``ctx.resume`` continues
from there and performs the same floating-point operations as an uninterrupted run, so every
number except the wall-clock seconds comes out bitwise the same. ``LAYERNORM_KILL_AFTER_EPOCHS=N``
kills the process after the N-th checkpoint written (each evaluation counts as one).

Also here: per-seed summaries of the records (final value, mean over the curve, value after a
given training time) and the figure with one panel per update and one per second.
``torch_threads`` is re-exported from :mod:`~layernorm.experiments.training`.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from .plots import plt, save_figure
from .registry import Record, RunContext, Verdict
from .stats import mean_sd
from .training import RunFiles, checkpoint_written, torch_threads

__all__ = [
    "StepSpec",
    "at_time",
    "common_time",
    "final",
    "final_table",
    "mean_curve",
    "missing",
    "step_time_figure",
    "torch_threads",
    "train_steps",
]


@dataclass(frozen=True)
class StepSpec:
    """How to train one sequence model.

    Attributes:
        steps: parameter updates.
        eval_every: updates between evaluations (and checkpoints); the last update always
            evaluates.
        lr: Adam learning rate.
        seed: seeds model initialisation and the batch-sampling generator.
        clip: gradient-norm clipping threshold, the usual guard for recurrent nets (0 = off).
    """

    steps: int
    eval_every: int
    lr: float = 1e-3
    seed: int = 0
    clip: float = 1.0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.eval_every < 1:
            raise ValueError(
                f"StepSpec: steps and eval_every must be >= 1, got {self.steps}, {self.eval_every}"
            )


def train_steps(
    run_id: str,
    build: Callable[[], nn.Module],
    sample: Callable[[torch.Generator], Any],
    loss_fn: Callable[[nn.Module, Any], Tensor],
    evaluate: Callable[[nn.Module], Mapping[str, float]],
    spec: StepSpec,
    ctx: RunContext,
    tags: Mapping[str, Any],
) -> list[Record]:
    """Train ``build()`` with Adam for ``spec.steps`` updates; one record per evaluation.

    Args:
        run_id: unique name of the run inside ``ctx.out_dir`` (checkpoint file names).
        build: makes the model (called right after ``torch.manual_seed(spec.seed)``).
        sample: draws one mini-batch using only the given CPU generator (so resumption replays
            the same batches).
        loss_fn: ``loss_fn(model, batch)``, the mean training loss of a batch (in training mode).
        evaluate: ``evaluate(model)`` in eval mode without gradients: a dict of metrics.
        spec: steps, evaluation interval, learning rate, seed, clipping.
        ctx: output directory, device, resume flag.
        tags: columns copied into every record (model name, seed, ...).

    Each record holds ``tags``, ``step``, ``seconds`` (training wall-clock time so far, without
    evaluation), ``train_loss`` (mean over the updates since the previous evaluation),
    ``diverged`` and the metrics of ``evaluate``. A non-finite loss ends the run early with
    ``diverged=True`` and the metrics of that point (a result, not an error: a model without
    normalization may diverge).
    """
    files = RunFiles.of(ctx, run_id)
    finished = files.finished()
    if finished is not None:
        return finished

    torch.manual_seed(spec.seed)
    model = build().to(ctx.device)
    opt = torch.optim.Adam(model.parameters(), lr=spec.lr)
    gen = torch.Generator().manual_seed(spec.seed)
    state, history = files.restore(model, opt, gen, "sample_rng")
    step, seconds = int(state.get("step", 0)), float(state.get("seconds", 0.0))
    history = [r for r in history if r["step"] <= step]

    bar = tqdm(total=spec.steps, initial=step, desc=run_id, unit="step",
               disable=not ctx.progress, leave=False, dynamic_ncols=True)  # fmt: skip
    diverged = False
    while step < spec.steps and not diverged:
        model.train()
        chunk = min(spec.eval_every, spec.steps - step)
        total, done = 0.0, 0
        t0 = time.perf_counter()
        for _ in range(chunk):
            loss = loss_fn(model, sample(gen))
            value = float(loss.detach())
            if not math.isfinite(value):
                diverged = True
                break
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if spec.clip > 0:
                nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
            opt.step()
            total += value
            done += 1
        seconds += time.perf_counter() - t0
        step += done
        bar.update(done)
        model.eval()
        with torch.no_grad():
            metrics = dict(evaluate(model))
        rec: Record = {**tags, "step": step, "seconds": seconds,
                       "train_loss": total / done if done else math.nan,
                       "diverged": diverged, **metrics}  # fmt: skip
        history.append(rec)
        bar.set_postfix({k: f"{v:.3f}" for k, v in metrics.items()})
        files.save(history, {"step": step, "seconds": seconds}, model, opt, gen, "sample_rng")
        checkpoint_written()
    bar.close()
    files.finish(history)
    return history


# -- summaries of the records --------------------------------------------------------------------


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


def missing(claim_id: str, have: Sequence[str], need: Sequence[str]) -> Verdict | None:
    """An inconclusive verdict when a configuration left out models the claim needs."""
    lack = [m for m in need if m not in have]
    if lack:
        return Verdict(claim_id, "inconclusive", f"not run with model(s) {lack}",
                       f"needs models {list(need)}")  # fmt: skip
    return None


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
