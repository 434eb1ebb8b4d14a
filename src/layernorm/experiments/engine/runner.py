"""Running registered experiments: configuration, output layout and metadata.

Layout of ``--out`` (default ``results/``)::

    results/
      report.md, report.html      drawn from the saved records (``layernorm report``)
      figures/*.png
      .lock                       held shared by every run writing here (exclusively by a
                                  process that needs the folder to itself)
      .locks/<experiment>/.lock   held by the run of that experiment (its pid and command)
      <experiment>/
        config.json               the settings the records belong to and their id (hash)
        meta.json                 seed, setting, device, versions, date, seconds
        provenance.json           command, commit, versions, processor and ISA, threads, wall
                                  time, load average at the start and the end
        figures/*.png             the experiment's figures, drawn from its records
        records.json, records.csv tidy results, one row per measurement
        ckpt/, runs/              per-run checkpoints and finished-run records (for --resume);
                                  with ``checkpoints`` set, under ``<checkpoints>/<experiment>/
                                  <settings id>/`` instead, so that ``out`` holds only results
      <experiment>.<id>/          an earlier run with other settings, moved aside by a new one
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime as _dt
import json
import multiprocessing
import os
import platform
import signal
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ... import __version__
from . import distributed
from .checkpoints import SettingsMismatchError
from .io import lock_folder, read_json, remove_partial_writes, save_records, write_json
from .provenance import load_average, provenance
from .registry import (
    Experiment,
    Record,
    RunContext,
    RunIdentity,
    apply_overrides,
    config_to_json,
    get,
    names,
)

_PR_SET_PDEATHSIG = 1  # prctl(2)

__all__ = [
    "RUN_FORMAT",
    "parse_overrides",
    "prepare_folder",
    "resolve_device",
    "run_experiments",
    "run_identity",
]

#: Version of the run files' layout and contents; part of every run's identity.
RUN_FORMAT = 2


def resolve_device(name: str | None) -> torch.device:
    """``None``/``"auto"``: CUDA when available, else CPU. ``"cuda"`` without a GPU is an error."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not str(name).startswith("cuda:"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {name!r}")
    if str(name).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"device {name!r} was asked for but no CUDA GPU is available; use --device cpu"
        )
    return torch.device(name)


def parse_overrides(items: Sequence[str], selected: Sequence[str]) -> dict[str, dict[str, str]]:
    """``["epochs=3", "mnist-ff.hidden=64"]`` → per-experiment ``{key: text}``.

    A plain ``key=value`` applies to every selected experiment whose configuration has ``key``
    (an error if none has); ``name.key=value`` to that experiment only.
    """
    out: dict[str, dict[str, str]] = {n: {} for n in selected}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--set expects KEY=VALUE or EXPERIMENT.KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        if "." in key:
            name, key = key.split(".", 1)
            get(name)  # unknown name → KeyError listing the valid ones
            if name not in out:
                raise ValueError(f"--set {item!r}: experiment {name!r} is not among those selected")
            out[name][key] = value
            continue
        hit = False
        for n in selected:
            fields = {f.name for f in dataclasses.fields(get(n).config(True))}
            if key in fields:
                out[n][key] = value
                hit = True
        if not hit:
            raise ValueError(f"--set {item!r}: no selected experiment has a setting {key!r}")
    return out


def _log(msg: str) -> None:
    if distributed.is_main():
        print(msg, file=sys.stderr, flush=True)


def run_identity(name: str, quick: bool, seed: int, cfg: Any) -> RunIdentity:
    """The identity of a run: the experiment, its full configuration, quick or not, the seed, and
    the versions of the code and of the run-file format. Records from two runs are mixed only
    when their identities are equal."""
    config = json.loads(json.dumps(config_to_json(cfg)))  # tuples → lists, as saved
    return RunIdentity.of({"experiment": name, "quick": quick, "seed": seed, "config": config,
                           "version": __version__, "format": RUN_FORMAT})  # fmt: skip


def _saved_identity(exp_dir: Path) -> tuple[str | None, dict[str, Any] | None]:
    """``(settings id, settings)`` recorded in ``exp_dir/config.json`` (``None`` for a file
    written before identities were recorded, or one that cannot be read)."""
    try:
        saved = read_json(exp_dir / "config.json")
    except (OSError, ValueError):
        return None, None
    if not isinstance(saved, dict) or "settings_id" not in saved:
        return None, saved if isinstance(saved, dict) else None
    settings = {k: v for k, v in saved.items() if k != "settings_id"}
    return saved["settings_id"], settings


def _set_aside(exp_dir: Path, tag: str) -> Path:
    """Move ``exp_dir`` to a new sibling ``<name>.<tag>`` (``-2``, ``-3``… if taken)."""
    dest = exp_dir.with_name(f"{exp_dir.name}.{tag}")
    n = 2
    while dest.exists():
        dest = exp_dir.with_name(f"{exp_dir.name}.{tag}-{n}")
        n += 1
    exp_dir.rename(dest)
    return dest


def prepare_folder(
    exp_dir: Path, identity: RunIdentity, resume: bool, restart_changed: bool
) -> None:
    """Make ``exp_dir`` ready for a run of ``identity`` (rank 0, holding the folder's lock).

    Files of a run with other settings are never mixed with this one's: with ``resume`` they are
    refused with an error that names both settings (unless ``restart_changed``); otherwise the
    old folder is moved aside to ``<name>.<its settings id>`` (nothing is deleted) and the run
    starts in a fresh one. Temporary files of writes that a kill interrupted are deleted."""
    if exp_dir.is_dir() and any(exp_dir.iterdir()):
        saved_id, saved = _saved_identity(exp_dir)
        if saved_id != identity.id:
            diff = identity.difference(saved)
            if resume and not restart_changed:
                raise SettingsMismatchError(
                    f"--resume: {exp_dir} holds a run with other settings than asked for now "
                    f"({diff}); its records are not mixed with this run's. Run with the same "
                    f"settings to resume it, or add --restart-changed (or leave out --resume) to "
                    f"start over in a fresh folder (the old one is kept as {exp_dir.name}.<id>)"
                )
            tag = saved_id if isinstance(saved_id, str) and saved_id.isalnum() else "old"
            aside = _set_aside(exp_dir, tag)
            _log(f"[{exp_dir.name}] {exp_dir} held a run with other settings ({diff}); "
                 f"moved it to {aside}")  # fmt: skip
    for p in remove_partial_writes(exp_dir):
        _log(f"[{exp_dir.name}] deleted {p}, left by a write that was interrupted")
    write_json(
        exp_dir / "config.json", {**json.loads(identity.settings), "settings_id": identity.id}
    )


def _figures(exp: Experiment, cfg: Any, records: list[Record], fig_dir: Path) -> None:
    """The experiment's figures beside its records (the report draws its own copy too), so that
    a published experiment folder is complete on its own. A figure that fails to draw is
    reported, not fatal: the records are already saved."""
    try:
        exp.plot(records, cfg, fig_dir)
    except Exception as e:  # plotting is never worth losing a finished run over
        warnings.warn(f"[{exp.name}] figures not drawn: {type(e).__name__}: {e}", stacklevel=2)


def _earlier_sessions(path: Path, settings_id: str) -> list[dict[str, Any]]:
    """The sessions of the same run recorded in ``path`` before this one (a resumed run keeps the
    command, machine and wall time of every session that produced its records)."""
    try:
        old = read_json(path)
    except (OSError, ValueError):
        return []
    if not isinstance(old, dict) or old.get("settings_id") != settings_id:
        return []
    earlier = old.pop("earlier_sessions", [])
    return [*earlier, old] if isinstance(earlier, list) else [old]


def run_experiments(
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
    setting: str | None = None,
    checkpoints: Path | None = None,
    command: str | None = None,
    workers: int = 1,
) -> None:
    """Run the experiments ``selected`` (all registered ones when empty) and save their records,
    configurations and metadata under ``out/<name>/`` (on rank 0 only).

    ``resume`` continues from the checkpoints of an earlier run with the same settings (see
    :func:`prepare_folder` for other settings and ``restart_changed``). Each experiment's folder
    is locked for the duration: a second run of the same experiment into ``out`` fails at once,
    naming the first, while runs of different experiments may share ``out``.

    ``setting`` names the configuration in the saved metadata (default ``"quick"`` or
    ``"full"``; ``"paper"`` for :data:`~layernorm.experiments.papers.PAPER_SETTINGS`).
    ``checkpoints``: a folder for the checkpoints and finished-run files instead of ``out``
    (keeps a published results folder free of them). ``command``: the command line recorded in
    ``provenance.json`` (default: this process's arguments).

    ``workers``: processes that train the runs of an experiment made of independent runs
    (``Experiment.independent_runs``) side by side, each claiming the next run no other holds
    (this process and ``workers - 1`` started for it, each with this process's torch threads);
    needs ``resume``. The records, files and numbers are those of one process running alone."""
    chosen = list(selected) if selected else names()
    exps = [get(n) for n in chosen]
    per_exp = parse_overrides(overrides, chosen)
    dev = resolve_device(device)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    if workers > 1 and not resume:
        raise ValueError(f"{workers} workers share an experiment's runs by reading back the runs "
                         f"the others finished: add --resume")  # fmt: skip
    configs = [apply_overrides(exp.config(quick), per_exp[exp.name]) for exp in exps]
    distributed.init_from_env(dev)
    label = setting or ("quick" if quick else "full")
    main = distributed.is_main()
    with lock_folder(out, shared=True) if main else contextlib.nullcontext():
        for exp, cfg in zip(exps, configs, strict=True):
            with lock_folder(out / ".locks" / exp.name) if main else contextlib.nullcontext():
                _run_one(exp, cfg, out / exp.name, dev, seed, quick, resume, restart_changed,
                         progress, label, checkpoints, command, workers)  # fmt: skip
    distributed.close()  # after a barrier: every process has finished


def _claim_and_train(name: str, cfg: Any, ctx: RunContext, threads: int, parent: int) -> None:
    """The body of a worker process (:func:`_train_side_by_side`). It ends with the process that
    started it (Linux: SIGTERM on the parent's death), so that no orphan goes on training beside
    a later ``--resume``."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent ended before the signal was armed
        return
    torch.set_num_threads(threads)
    get(name).run(cfg, ctx)


def _train_side_by_side(exp: Experiment, cfg: Any, ctx: RunContext, workers: int) -> None:
    """Train the runs of ``exp`` in ``workers`` processes at once (this one included), each
    taking the next run whose claim no other process holds (``RunContext.claims``). A worker
    that fails is reported; the runs it left are trained in the pass that follows, which waits
    for any run still claimed (a worker of an earlier, killed command)."""
    shared = dataclasses.replace(ctx, claims="skip", progress=False)
    spawn = multiprocessing.get_context("spawn")  # a fork of a process with torch threads may hang
    procs = [spawn.Process(target=_claim_and_train, name=f"{exp.name} worker {i}",
                           args=(exp.name, cfg, shared, torch.get_num_threads(), os.getpid()))
             for i in range(1, workers)]  # fmt: skip
    for p in procs:
        p.start()
    _log(
        f"[{exp.name}] {workers} processes share the runs (pids {os.getpid()}, "
        f"{', '.join(str(p.pid) for p in procs)})"
    )
    try:
        exp.run(cfg, shared)
    finally:
        for p in procs:
            p.join()
    for p in procs:
        if p.exitcode != 0:
            warnings.warn(f"[{exp.name}] {p.name} ended with exit code {p.exitcode}; the runs it "
                          f"left are trained now", stacklevel=2)  # fmt: skip


def _run_one(
    exp: Experiment,
    cfg: Any,
    exp_dir: Path,
    dev: torch.device,
    seed: int,
    quick: bool,
    resume: bool,
    restart_changed: bool,
    progress: bool,
    setting: str,
    checkpoints: Path | None,
    command: str | None,
    workers: int = 1,
) -> None:
    identity = run_identity(exp.name, quick, seed, cfg)
    # one folder per settings id: checkpoints of other settings are kept, never mixed in
    ckpt_dir = checkpoints / exp.name / identity.id if checkpoints is not None else None
    if distributed.is_main():
        prepare_folder(exp_dir, identity, resume, restart_changed)
    distributed.barrier()
    ctx = RunContext(exp_dir, dev, seed=seed, quick=quick, resume=resume, progress=progress,
                     identity=identity, ckpt_dir=ckpt_dir)  # fmt: skip
    _log(f"[{exp.name}] {exp.title} ({setting} setting, device {dev})")
    threads = getattr(cfg, "threads", 0) or torch.get_num_threads()
    prov = provenance(threads, command)
    t0 = time.perf_counter()
    if workers > 1 and exp.independent_runs:
        if distributed.rank_world()[1] > 1:
            raise ValueError("--workers shares runs between processes of one machine; it does "
                             "not combine with a data-parallel (torchrun) launch")  # fmt: skip
        _train_side_by_side(exp, cfg, ctx, workers)
        ctx = dataclasses.replace(ctx, claims="wait")
    elif workers > 1:
        _log(f"[{exp.name}] one process: its runs depend on each other's results")
    records = exp.run(cfg, ctx)  # with workers: every run is finished and read back
    seconds = time.perf_counter() - t0
    if distributed.is_main():
        save_records(exp_dir, records)
        prov |= {"wall_seconds": round(seconds, 2), "load_average_end": load_average(),
                 "resumed": resume, "setting": setting, "settings_id": identity.id}  # fmt: skip
        # a resumed run's records come from every session; a fresh one's from this one alone
        earlier = _earlier_sessions(exp_dir / "provenance.json", identity.id) if resume else []
        prov["earlier_sessions"] = earlier
        write_json(exp_dir / "provenance.json", prov)
        _figures(exp, cfg, records, exp_dir / "figures")
        write_json(
            exp_dir / "meta.json",
            {
                "experiment": exp.name,
                "quick": quick,
                "setting": setting,
                "seed": seed,
                "settings_id": identity.id,
                "device": str(dev),
                "world_size": distributed.rank_world()[1],
                "seconds": round(seconds, 2),
                "resumed": resume,
                "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                "torch": torch.__version__,
                "python": platform.python_version(),
                "machine": f"{platform.system()} {platform.machine()}, "
                f"{os.cpu_count()} CPUs, {threads} torch thread(s)",
            },
        )
    _log(f"[{exp.name}] done in {seconds:.1f} s, records in {exp_dir}")
