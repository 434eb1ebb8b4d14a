"""The files of one training run: per-run checkpoints and finished-run records, which both
training loops (:func:`~layernorm.experiments.engine.training.train_classifier` and
:func:`~layernorm.experiments.engine.steps.train_steps`) write and ``--resume`` reads back.

For tests of exact resumption, the environment variable ``LAYERNORM_KILL_AFTER_EPOCHS=N`` makes the
process kill itself with SIGKILL right after the N-th checkpoint it writes (counted over all runs
of the process), which is what a crash or a scheduler's kill looks like.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .io import read_json, torch_load, torch_save, write_json
from .registry import Record, RunContext

__all__ = ["KILL_ENV", "RunFiles", "checkpoint_written"]

KILL_ENV = "LAYERNORM_KILL_AFTER_EPOCHS"
_written = 0  # checkpoints written by this process (for the kill hook)


@dataclass(frozen=True)
class RunFiles:
    """The files of one training run, shared by both training loops (:func:`train_classifier`
    and :func:`~layernorm.experiments.engine.steps.train_steps`).

    Attributes:
        done: ``runs/{run_id}.json``, the records of the finished run.
        ckpt: ``ckpt/{run_id}.pt``, the states of the last checkpoint; the history up to it is
            beside it in ``ckpt/{run_id}.json``.
        resume: whether to read them back (``ctx.resume``).
    """

    done: Path
    ckpt: Path
    resume: bool

    @classmethod
    def of(cls, ctx: RunContext, run_id: str) -> RunFiles:
        """The files of run ``run_id`` under ``ctx.out_dir``."""
        out = ctx.out_dir
        return cls(out / "runs" / f"{run_id}.json", out / "ckpt" / f"{run_id}.pt", ctx.resume)

    @property
    def history(self) -> Path:
        """``ckpt/{run_id}.json``: the history written with the last checkpoint."""
        return self.ckpt.with_suffix(".json")

    def finished(self) -> list[Record] | None:
        """When resuming a run that already finished, its records (it is not trained again)."""
        if self.resume and self.done.exists():
            return list(read_json(self.done))
        return None

    def restore(
        self, model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator, gen_key: str
    ) -> tuple[dict[str, Any], list[Record]]:
        """When resuming from a checkpoint: load the model, the optimizer, the data generator
        (saved under ``gen_key``) and torch's global RNG from it, and return the saved state (the
        loop's counters) and history, which may run past the state (see :meth:`save`). Otherwise
        ``({}, [])``: nothing to restore."""
        if not (self.resume and self.ckpt.exists()):
            return {}, []
        state = torch_load(self.ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state[gen_key])
        torch.set_rng_state(state["torch_rng"])
        return state, [dict(r) for r in read_json(self.history)]

    def save(
        self,
        history: list[Record],
        counters: Mapping[str, Any],
        model: nn.Module,
        opt: torch.optim.Optimizer,
        gen: torch.Generator,
        gen_key: str,
    ) -> None:
        """Write a checkpoint: ``counters`` (where the loop stands) with the model, optimizer,
        data-generator (``gen_key``) and torch RNG states.

        The history goes first: a kill between the two writes leaves an older ``.pt`` beside a
        longer history, and the loop keeps only the part of the history its counters reach."""
        write_json(self.history, history)
        torch_save(self.ckpt, {**counters, "model": model.state_dict(),
                               "optimizer": opt.state_dict(), gen_key: gen.get_state(),
                               "torch_rng": torch.get_rng_state()})  # fmt: skip

    def finish(self, history: list[Record]) -> None:
        """Write the records of the finished run."""
        write_json(self.done, history)


def checkpoint_written() -> None:
    """Count one checkpoint written by this process; past ``LAYERNORM_KILL_AFTER_EPOCHS`` of
    them, SIGKILL the process (the crash the resumption tests simulate). Both training loops
    call it after each checkpoint."""
    global _written
    _written += 1
    limit = os.environ.get(KILL_ENV)
    if limit and _written >= int(limit):
        os.kill(os.getpid(), signal.SIGKILL)
