"""Update-counted training for the sequence experiments, with curves per update and per second.

:func:`~layernorm.experiments.engine.training.train_classifier` counts epochs over a fixed tensor of
examples. Language models and sequence classifiers here instead draw a fresh mini-batch per update
(random text windows, packed variable-length recordings), and their claims are about speed, so
:func:`train_steps` counts updates, evaluates every ``eval_every`` updates and records both the
update count and the training wall-clock time (evaluation excluded): layer norm costs time per
step, and the report shows the curves both ways.

Checkpoints are ``train_classifier``'s
(:class:`~layernorm.experiments.engine.checkpoints.RunFiles`): after every evaluation, the history
(JSON) and then the model, optimizer, sampling-generator and torch RNG states (``.pt``) are written
atomically under ``ctx.out_dir/ckpt/``; ``ctx.resume`` continues from there and performs the same
floating-point operations as an uninterrupted run, so every number except the wall-clock seconds
comes out bitwise the same. ``LAYERNORM_KILL_AFTER_EPOCHS=N`` kills the process after the N-th
checkpoint written (each evaluation counts as one).

:func:`train_grid` trains the seeds × models grid of a sequence experiment. The summaries of
the records and the figures are in :mod:`layernorm.experiments.analysis.curves`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from .checkpoints import RunFiles, checkpoint_written, claimed_run
from .registry import Record, RunContext
from .training import make_adam, torch_threads

__all__ = ["StepSettings", "StepSpec", "train_grid", "train_steps"]


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


@claimed_run
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
    opt = make_adam(model, spec.lr)
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


class StepSettings(Protocol):
    """The fields of a sequence experiment's settings that :func:`train_grid` reads."""

    steps: int
    eval_every: int
    seeds: int
    lr: float
    clip: float
    threads: int


def train_grid(
    cfg: StepSettings,
    ctx: RunContext,
    names: Sequence[str],
    build: Callable[[str], nn.Module],
    sample: Callable[[Any], Any],
    loss_fn: Callable[[nn.Module, Any], Tensor],
    evaluate: Callable[[nn.Module], Mapping[str, float]],
    tags: Callable[[str, int], Mapping[str, Any]] | None = None,
) -> list[Record]:
    """Train ``build(name)`` for every seed and every name in ``names`` (seed-major order), with
    ``cfg.threads`` torch threads; the records of all runs.

    Seed ``s`` of the grid is ``ctx.run_seed(s)`` (``ctx.seed · 1000 + s``); a run is named
    ``{name}-s{seed}`` and its records are tagged ``tags(name, seed)`` (default: ``model`` and
    ``seed``).
    """
    records: list[Record] = []
    with torch_threads(cfg.threads):
        for s in range(cfg.seeds):
            seed = ctx.run_seed(s)
            for name in names:
                records += train_steps(
                    f"{name}-s{seed}", lambda name=name: build(name), sample, loss_fn, evaluate,
                    StepSpec(cfg.steps, cfg.eval_every, cfg.lr, seed, cfg.clip), ctx,
                    tags(name, seed) if tags else {"model": name, "seed": seed},
                )  # fmt: skip
    return records
