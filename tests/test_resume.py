"""A run killed with SIGKILL mid-way and resumed ends with bitwise the same numbers as an
uninterrupted run of the same seed (real subprocesses, real kill)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from layernorm.experiments.engine.checkpoints import KILL_ENV
from layernorm.experiments.engine.io import torch_load, torch_save

# 2 runs (batch 32 and 8, one seed) × 3 models × 2 epochs = 12 epoch checkpoints in all
TINY = ["n_train=128", "n_test=100", "hidden=16", "epochs=2", "seeds=1", "batch_sizes=32,8"]


def _cli(out: Path, *extra: str, kill_after: int | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop(KILL_ENV, None)
    if kill_after is not None:
        env[KILL_ENV] = str(kill_after)
    cmd = [sys.executable, "-m", "layernorm", "reproduce", "mnist-ff", "--quick", "--device",
           "cpu", "--out", str(out), "--no-progress", "--seed", "3"]  # fmt: skip
    for s in TINY:
        cmd += ["--set", s]
    return subprocess.run([*cmd, *extra], env=env, capture_output=True, text=True, timeout=300)


def _metrics(out: Path) -> list[dict]:
    recs = json.loads((out / "mnist-ff" / "records.json").read_text())
    return [{k: v for k, v in r.items() if k != "seconds"} for r in recs]


def test_kill_then_resume_matches_uninterrupted(tmp_path):
    full = _cli(tmp_path / "full")
    assert full.returncode == 0, full.stderr

    cut = tmp_path / "cut"
    killed = _cli(cut, kill_after=5)  # dies inside the third model's training
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (cut / "mnist-ff" / "records.json").exists()
    assert len(list((cut / "mnist-ff" / "runs").glob("*.json"))) == 2  # two runs finished
    half = torch_load(cut / "mnist-ff" / "ckpt" / "layer-bs32-s3000.pt")
    assert half["epoch"] == 1  # the third run was stopped after its first epoch
    assert not list((cut / "mnist-ff").rglob("*.tmp"))  # no half-written files

    resumed = _cli(cut, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    a, b = _metrics(tmp_path / "full"), _metrics(cut)
    assert len(a) == 12
    assert a == b  # bitwise: floats compared exactly
    # the runs differ from one another, so the equality above is not between constants
    assert len({r["test_nll"] for r in a}) == len(a)


def test_atomic_write_keeps_previous_file_on_failure(tmp_path):
    path = tmp_path / "state.pt"
    torch_save(path, {"epoch": 1, "w": torch.ones(3)})

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError):
        torch_save(path, {"epoch": 2, "bad": Unpicklable()})
    assert torch_load(path)["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]
