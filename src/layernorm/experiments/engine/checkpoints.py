"""The files of one training run: per-run checkpoints and finished-run records, which both
training loops (:func:`~layernorm.experiments.engine.training.train_classifier` and
:func:`~layernorm.experiments.engine.steps.train_steps`) write and ``--resume`` reads back.

For tests of exact resumption, the environment variable ``LAYERNORM_KILL_AFTER_EPOCHS=N`` makes the
process kill itself with SIGKILL right after the N-th checkpoint it writes (counted over all runs
of the process), which is what a crash or a scheduler's kill looks like.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import signal
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from .io import claim, read_json, torch_load, torch_save, write_json
from .registry import Record, RunContext, RunIdentity

__all__ = [
    "KILL_ENV",
    "RunFileError",
    "RunFiles",
    "SettingsMismatchError",
    "checkpoint_written",
    "claimed_run",
]

KILL_ENV = "LAYERNORM_KILL_AFTER_EPOCHS"
_written = 0  # checkpoints written by this process (for the kill hook)


class RunFileError(RuntimeError):
    """A run's saved file cannot be read (truncated, damaged)."""


class SettingsMismatchError(ValueError):
    """A run's saved file was made with other settings than the run resuming from it."""


@dataclass(frozen=True)
class RunFiles:
    """The files of one training run, shared by both training loops
    (:func:`~layernorm.experiments.engine.training.train_classifier` and
    :func:`~layernorm.experiments.engine.steps.train_steps`).

    Every file records the run's settings (:class:`~layernorm.experiments.engine.registry.
    RunIdentity`); on resume, a file made with other settings is refused, never mixed in, and a
    damaged one is named in the error.

    Attributes:
        done: ``runs/{run_id}.json``, the records of the finished run.
        ckpt: ``ckpt/{run_id}.pt``, the states of the last checkpoint; the history up to it is
            beside it in ``ckpt/{run_id}.json``, the checkpoint before it in
            ``ckpt/{run_id}.prev.pt`` (the fallback when the last one is damaged).
        resume: whether to read them back (``ctx.resume``).
        identity: the settings the files are made with and must match (``None``: unchecked).
    """

    done: Path
    ckpt: Path
    resume: bool
    identity: RunIdentity | None = None

    @classmethod
    def of(cls, ctx: RunContext, run_id: str) -> RunFiles:
        """The files of run ``run_id`` under ``ctx.ckpt_dir`` (default ``ctx.out_dir``)."""
        out = ctx.ckpt_dir if ctx.ckpt_dir is not None else ctx.out_dir
        return cls(out / "runs" / f"{run_id}.json", out / "ckpt" / f"{run_id}.pt", ctx.resume,
                   ctx.identity)  # fmt: skip

    @property
    def history(self) -> Path:
        """``ckpt/{run_id}.json``: the history written with the last checkpoint."""
        return self.ckpt.with_suffix(".json")

    @property
    def claim(self) -> Path:
        """``ckpt/{run_id}.claim``: locked by the process training the run when several share an
        experiment's runs (:func:`claimed_run`)."""
        return self.ckpt.with_suffix(".claim")

    @property
    def previous(self) -> Path:
        """``ckpt/{run_id}.prev.pt``: the checkpoint before the last one."""
        return self.ckpt.with_suffix(".prev.pt")

    def finished(self) -> list[Record] | None:
        """When resuming a run that already finished, its records (it is not trained again)."""
        if self.resume and self.done.exists():
            return self._records(self.done)
        return None

    def restore(
        self, model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator, gen_key: str
    ) -> tuple[dict[str, Any], list[Record]]:
        """When resuming from a checkpoint: load the model, the optimizer, the data generator
        (saved under ``gen_key``) and torch's global RNG from it, and return the saved state (the
        loop's counters) and history, which may run past the state (see :meth:`save`). Otherwise
        ``({}, [])``: nothing to restore (without resume, the run's old checkpoints are deleted).

        A damaged last checkpoint falls back to the one before it, with a warning; when neither
        can be read, a :class:`RunFileError` names the file."""
        if not self.resume:
            # starting over: an older checkpoint of this run must not become the fallback of
            # the new one's (see :meth:`save`)
            for p in (self.ckpt, self.previous, self.history):
                p.unlink(missing_ok=True)
            return {}, []
        found = [p for p in (self.ckpt, self.previous) if p.exists()]
        if not found:
            return {}, []
        damaged: list[str] = []
        for path in found:
            try:
                state = torch_load(path)
            except Exception as e:  # torch raises RuntimeError, EOFError, UnpicklingError, ...
                why = (str(e).strip().splitlines() or ["empty or truncated file"])[0][:160]
                damaged.append(f"{path} ({type(e).__name__}: {why})")
                continue
            self._check(path, state.get("settings_id"), state.get("settings"))
            if damaged:
                warnings.warn(f"--resume: checkpoint {damaged[0]} cannot be read; resuming from "
                              f"the one before it, {path}", stacklevel=2)  # fmt: skip
            history = self._records(self.history)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            gen.set_state(state[gen_key])
            torch.set_rng_state(state["torch_rng"])
            return state, history
        raise RunFileError(
            f"--resume: cannot read the checkpoint {' nor '.join(damaged)}. Delete "
            f"{self.ckpt.name} (and {self.previous.name}) in {self.ckpt.parent} to train this run "
            f"again from its start, or run without --resume to start every run over"
        )

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
        data-generator (``gen_key``) and torch RNG states; the previous one is kept.

        The history goes first: a kill between the two writes leaves an older ``.pt`` beside a
        longer history, and the loop keeps only the part of the history its counters reach."""
        write_json(self.history, self._tagged(history))
        ident = self.identity
        torch_save(self.ckpt, {**counters, "model": model.state_dict(),
                               "optimizer": opt.state_dict(), gen_key: gen.get_state(),
                               "torch_rng": torch.get_rng_state(),
                               "settings_id": ident.id if ident else None,
                               "settings": ident.settings if ident else None},
                   keep_previous=self.previous)  # fmt: skip

    def finish(self, history: list[Record]) -> None:
        """Write the records of the finished run."""
        write_json(self.done, self._tagged(history))

    def _tagged(self, records: list[Record]) -> dict[str, Any]:
        ident = self.identity
        return {"settings_id": ident.id if ident else None,
                "settings": json.loads(ident.settings) if ident else None,
                "records": records}  # fmt: skip

    def _records(self, path: Path) -> list[Record]:
        """The records of a run file, after checking that it can be read and that its settings
        are this run's."""
        try:
            saved = read_json(path)
        except (OSError, ValueError) as e:
            raise RunFileError(
                f"--resume: cannot read {path} ({type(e).__name__}: {e}). Delete it to train this "
                f"run again, or run without --resume to start every run over"
            ) from None
        if not (isinstance(saved, dict) and isinstance(saved.get("records"), list)):
            saved = {"settings_id": None, "settings": None, "records": saved}
        settings = saved["settings"]
        self._check(path, saved["settings_id"], json.dumps(settings) if settings else None)
        return [dict(r) for r in saved["records"]]

    def _check(self, path: Path, settings_id: str | None, settings: str | None) -> None:
        if self.identity is None or settings_id == self.identity.id:
            return
        then = json.loads(settings) if settings else None
        raise SettingsMismatchError(
            f"--resume: {path} was made with other settings than this run "
            f"({self.identity.difference(then)}); its records are not mixed in. Delete it to "
            f"train this run again with the settings asked for, or run without --resume"
        )


def checkpoint_written() -> None:
    """Count one checkpoint written by this process; past ``LAYERNORM_KILL_AFTER_EPOCHS`` of
    them, SIGKILL the process (the crash the resumption tests simulate). Both training loops
    call it after each checkpoint."""
    global _written
    _written += 1
    limit = os.environ.get(KILL_ENV)
    if limit and _written >= int(limit):
        os.kill(os.getpid(), signal.SIGKILL)


_Loop = TypeVar("_Loop", bound=Callable[..., list[Record]])


def claimed_run(train: _Loop) -> _Loop:
    """Make a training loop ``train(run_id, ..., ctx, ...)`` share its runs between processes
    (``ctx.claims``): with ``"skip"`` the run is trained only by the process that takes its claim
    lock (:attr:`RunFiles.claim`), and in any other process the loop returns no records at once;
    with ``"wait"`` a process waits for the holder to let the lock go, then goes on as alone
    (reading the finished run back). The lock is taken before the finished-run file is read, so
    a run finished by another process is read back, never trained twice (sharing needs
    ``ctx.resume``)."""
    signature = inspect.signature(train)

    @functools.wraps(train)
    def run(*args: Any, **kwargs: Any) -> list[Record]:
        given = signature.bind(*args, **kwargs).arguments
        ctx: RunContext = given["ctx"]
        if ctx.claims == "off":
            return train(*args, **kwargs)
        if not ctx.resume:
            raise ValueError("runs shared between processes need resume=True (each process "
                             "reads back the runs the others finished)")  # fmt: skip
        claim_file = RunFiles.of(ctx, given["run_id"]).claim
        with claim(claim_file, wait=ctx.claims == "wait") as mine:
            return train(*args, **kwargs) if mine else []

    return run  # type: ignore[return-value]
