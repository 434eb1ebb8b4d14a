"""Running registered experiments: configuration, output layout and metadata.

Layout of ``--out`` (default ``results/``)::

    results/
      report.md, report.html      drawn from the saved records (``layernorm report``)
      figures/*.png
      <experiment>/
        config.json               the configuration the records belong to
        meta.json                 seed, quick, device, versions, date, seconds
        records.json, records.csv tidy results, one row per measurement
        ckpt/, runs/              per-run checkpoints and finished-run records (for --resume)
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from . import distributed
from .io import read_json, save_records, write_json
from .registry import RunContext, apply_overrides, config_to_json, get, names

__all__ = ["parse_overrides", "resolve_device", "run_experiments"]


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


def run_experiments(
    selected: Sequence[str] | None = None,
    *,
    out: Path = Path("results"),
    device: str | None = None,
    seed: int = 0,
    quick: bool = False,
    resume: bool = False,
    overrides: Sequence[str] = (),
    progress: bool = True,
) -> None:
    """Run the experiments ``selected`` (all registered ones when empty) and save their records,
    configurations and metadata under ``out/<name>/`` (on rank 0 only)."""
    chosen = list(selected) if selected else names()
    exps = [get(n) for n in chosen]
    per_exp = parse_overrides(overrides, chosen)
    dev = resolve_device(device)
    distributed.init_from_env(dev)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    for exp in exps:
        cfg = apply_overrides(exp.config(quick), per_exp[exp.name])
        exp_dir = out / exp.name
        # through JSON once, so that it compares equal to what was saved (tuples become lists)
        cfg_json = json.loads(
            json.dumps({"quick": quick, "seed": seed, "config": config_to_json(cfg)})
        )
        if resume and (exp_dir / "config.json").exists():
            saved = read_json(exp_dir / "config.json")
            if saved != cfg_json:
                raise ValueError(
                    f"--resume: {exp_dir / 'config.json'} holds a run with different settings "
                    f"({saved}) than asked for now ({cfg_json}); run without --resume to start over"
                )
        if distributed.is_main():
            write_json(exp_dir / "config.json", cfg_json)
        ctx = RunContext(exp_dir, dev, seed=seed, quick=quick, resume=resume, progress=progress)
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
    distributed.barrier()
