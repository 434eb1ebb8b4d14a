"""Running registered experiments: configuration, output layout and metadata.

Layout of ``--out`` (default ``results/``)::

    results/
      report.md, report.html      drawn from the saved records (``layernorm report``)
      figures/*.png
      .lock                       held by the run writing here (its pid and command inside)
      <experiment>/
        config.json               the settings the records belong to and their id (hash)
        meta.json                 seed, quick, device, versions, date, seconds
        records.json, records.csv tidy results, one row per measurement
        ckpt/, runs/              per-run checkpoints and finished-run records (for --resume)
      <experiment>.<id>/          an earlier run with other settings, moved aside by a new one
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ... import __version__
from . import distributed
from .checkpoints import SettingsMismatchError
from .io import lock_folder, read_json, remove_partial_writes, save_records, write_json
from .registry import (
    Experiment,
    RunContext,
    RunIdentity,
    apply_overrides,
    config_to_json,
    get,
    names,
)

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
) -> None:
    """Run the experiments ``selected`` (all registered ones when empty) and save their records,
    configurations and metadata under ``out/<name>/`` (on rank 0 only).

    ``resume`` continues from the checkpoints of an earlier run with the same settings (see
    :func:`prepare_folder` for other settings and ``restart_changed``). The results folder is
    locked for the duration: a second run into it fails at once, naming the first."""
    chosen = list(selected) if selected else names()
    exps = [get(n) for n in chosen]
    per_exp = parse_overrides(overrides, chosen)
    dev = resolve_device(device)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    configs = [apply_overrides(exp.config(quick), per_exp[exp.name]) for exp in exps]
    distributed.init_from_env(dev)
    with lock_folder(out) if distributed.is_main() else contextlib.nullcontext():
        for exp, cfg in zip(exps, configs, strict=True):
            _run_one(exp, cfg, out / exp.name, dev, seed, quick, resume, restart_changed, progress)
    distributed.barrier()


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
) -> None:
    identity = run_identity(exp.name, quick, seed, cfg)
    if distributed.is_main():
        prepare_folder(exp_dir, identity, resume, restart_changed)
    distributed.barrier()
    ctx = RunContext(exp_dir, dev, seed=seed, quick=quick, resume=resume, progress=progress,
                     identity=identity)  # fmt: skip
    _log(f"[{exp.name}] {exp.title} ({'quick' if quick else 'full'} setting, device {dev})")
    t0 = time.perf_counter()
    records = exp.run(cfg, ctx)
    seconds = time.perf_counter() - t0
    threads = getattr(cfg, "threads", 0) or torch.get_num_threads()
    if distributed.is_main():
        save_records(exp_dir, records)
        write_json(
            exp_dir / "meta.json",
            {
                "experiment": exp.name,
                "quick": quick,
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
