"""A run killed with SIGKILL mid-way and resumed ends with bitwise the same numbers as an
uninterrupted run of the same seed (real subprocesses, real kills, some inside a write); resume
never mixes in files of other settings, a damaged checkpoint is named or skipped, and a results
folder takes one run at a time."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from layernorm.experiments import reproduce
from layernorm.experiments.engine import training
from layernorm.experiments.engine.checkpoints import (
    KILL_ENV,
    RunFileError,
    RunFiles,
    SettingsMismatchError,
)
from layernorm.experiments.engine.io import (
    WRITE_DELAY_ENV,
    FolderInUseError,
    claim,
    lock_folder,
    torch_load,
    torch_save,
)
from layernorm.experiments.engine.registry import RunContext, RunIdentity

# 2 runs (batch 32 and 8, one seed) × 3 models × 2 epochs = 12 epoch checkpoints in all
TINY = ["n_train=128", "n_test=100", "hidden=16", "epochs=2", "seeds=1", "batch_sizes=32,8"]


def _command(out: Path, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "layernorm", "reproduce", "mnist-ff", "--quick", "--device",
           "cpu", "--out", str(out), "--no-progress", "--seed", "3"]  # fmt: skip
    for s in TINY:
        cmd += ["--set", s]
    return [*cmd, *extra]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (KILL_ENV, WRITE_DELAY_ENV)}
    return env | extra


def _cli(out: Path, *extra: str, kill_after: int | None = None) -> subprocess.CompletedProcess:
    env = _env(**({KILL_ENV: str(kill_after)} if kill_after is not None else {}))
    return subprocess.run(_command(out, *extra), env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


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

    # that run's only checkpoint, truncated: a clear error naming it, not a traceback
    ckpt = cut / "mnist-ff" / "ckpt" / "layer-bs32-s3000.pt"
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 3])
    damaged = _cli(cut, "--resume")
    assert damaged.returncode == 2, damaged.stderr
    assert f"cannot read the checkpoint {ckpt}" in damaged.stderr
    assert "Traceback" not in damaged.stderr and "without --resume" in damaged.stderr
    ckpt.write_bytes(data)  # as it was (deleting it instead would retrain that run from scratch)

    resumed = _cli(cut, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    a, b = _metrics(tmp_path / "full"), _metrics(cut)
    assert len(a) == 12
    assert a == b  # bitwise: floats compared exactly
    # the runs differ from one another, so the equality above is not between constants
    assert len({r["test_nll"] for r in a}) == len(a)


def test_workers_share_the_runs_and_give_one_process_s_numbers(tmp_path):
    alone = _cli(tmp_path / "alone")
    assert alone.returncode == 0, alone.stderr
    shared = _cli(tmp_path / "shared", "--resume", "--workers", "2")
    assert shared.returncode == 0, shared.stderr
    assert "2 processes share the runs" in shared.stdout + shared.stderr
    assert _metrics(tmp_path / "alone") == _metrics(tmp_path / "shared")  # bitwise
    # every run finished exactly once, its claim released with its process
    runs = sorted(p.stem for p in (tmp_path / "shared" / "mnist-ff" / "runs").glob("*.json"))
    assert runs == sorted(p.stem for p in (tmp_path / "alone" / "mnist-ff" / "runs").glob("*.json"))
    assert len(runs) == 6
    no_resume = _cli(tmp_path / "fresh", "--workers", "2")
    assert no_resume.returncode == 2 and "add --resume" in no_resume.stderr


def _state(pid: int) -> str:
    """A process's state letter from /proc ("Z" a zombie), "" when it no longer exists."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return ""
    return next(line.split()[1] for line in status.splitlines() if line.startswith("State:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG)")
def test_a_worker_ends_with_the_command_that_started_it(tmp_path):
    # runs far longer than the test: only the parent's end can stop the worker in time
    cmd = [*_command(tmp_path / "out", "--resume", "--workers", "2"), "--set", "epochs=100000"]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        line = ""
        while "processes share the runs" not in line:
            line = proc.stdout.readline()
            assert line, "the command ended without starting its worker"
        worker = int(line.rsplit("pids ", 1)[1].split(",")[1].strip(" )\n"))
        # until the worker trains: a run's claim file names the process holding it
        claims = tmp_path / "out" / "mnist-ff" / "ckpt"
        deadline = time.monotonic() + 120
        while not any(f"pid {worker}" in p.read_text() for p in claims.glob("*.claim")):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        assert _state(worker) not in ("", "Z")
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 30
    while _state(worker) not in ("", "Z") and time.monotonic() < deadline:
        time.sleep(0.1)
    orphan = _state(worker) not in ("", "Z")
    if orphan:
        os.kill(worker, signal.SIGKILL)
    assert not orphan  # gone (or only waiting to be reaped)


def _tiny_run(ctx: RunContext) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 5, generator=g), torch.randint(0, 3, (64,), generator=g)
    return training.train_classifier(
        "tiny", lambda: torch.nn.Linear(5, 3), (x, y), {"test": (x, y)},
        training.TrainSpec(epochs=2, batch_size=16), ctx, {"model": "linear"},
    )  # fmt: skip


def test_a_run_claimed_by_another_process_is_left_to_it(tmp_path):
    ident = RunIdentity.of({"experiment": "t", "config": {}})
    ctx = RunContext(tmp_path, torch.device("cpu"), resume=True, identity=ident, progress=False,
                     claims="skip")  # fmt: skip
    files = RunFiles.of(ctx, "tiny")
    with claim(files.claim) as mine:  # held here as by another process (a second open file)
        assert mine
        assert _tiny_run(ctx) == []
        assert not files.ckpt.exists() and not files.done.exists()
    trained = _tiny_run(ctx)
    assert [r["epoch"] for r in trained] == [1, 2] and files.done.exists()
    with claim(files.claim) as mine:
        assert mine  # released when the run ended
    assert _tiny_run(ctx) == trained  # finished: read back, not trained again
    with pytest.raises(ValueError, match="need resume=True"):
        _tiny_run(RunContext(tmp_path, torch.device("cpu"), identity=ident, claims="skip"))


def test_the_last_pass_waits_for_a_run_another_process_holds(tmp_path):
    ident = RunIdentity.of({"experiment": "t", "config": {}})
    waiting = RunContext(tmp_path, torch.device("cpu"), resume=True, identity=ident,
                         progress=False, claims="wait")  # fmt: skip
    files = RunFiles.of(waiting, "tiny")
    got: list[list[dict]] = []
    with claim(files.claim) as mine:  # as a worker of an earlier command still training it
        assert mine
        waiter = threading.Thread(target=lambda: got.append(_tiny_run(waiting)))
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and not files.ckpt.exists()  # waits, touches nothing
    waiter.join(timeout=60)
    assert not waiter.is_alive() and [r["epoch"] for r in got[0]] == [1, 2]


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


def _partial_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.tmp"))


def _wait_for(proc: subprocess.Popen, ready, deadline_s: float = 120.0) -> bool:
    """Poll until ``ready()``; False when the process ended first."""
    end = time.monotonic() + deadline_s
    while proc.poll() is None and time.monotonic() < end:
        if ready():
            return True
        time.sleep(0.002)
    return False


def _kill(proc: subprocess.Popen) -> bool:
    """SIGKILL the process; True when it was still running."""
    alive = proc.poll() is None
    proc.kill()
    proc.wait()
    return alive


def test_kills_at_random_instants_mid_write_included_resume_bitwise(tmp_path):
    """SIGKILL at seeded random instants, and once as soon as a write is seen under way (every
    write is slowed down so that kills land inside writes), then ``--resume``: the final records
    equal an uninterrupted run's bitwise, and no partial file is left or read."""
    full = _cli(tmp_path / "full")
    assert full.returncode == 0, full.stderr
    cut = tmp_path / "cut"
    exp = cut / "mnist-ff"
    slow = _env(**{WRITE_DELAY_ENV: "0.08"})  # each write takes >= 80 ms, in 8 pieces
    rng = random.Random(20261123)
    kills, mid_write = 0, 0
    # first a kill timed to land inside a write, then four at random instants after the start
    plan = [None] + [rng.uniform(0.0, 1.5) for _ in range(4)]
    for i, delay in enumerate(plan):
        extra = ("--resume",) if i else ()
        proc = subprocess.Popen(_command(cut, *extra), env=slow, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # fmt: skip
        # the run writes config.json before training; wait for it (fresh on each start)
        start = time.time()

        def started(start: float = start) -> bool:
            p = exp / "config.json"
            return p.exists() and p.stat().st_mtime >= start

        assert _wait_for(proc, started), "the run ended before training started"
        if delay is None:
            _wait_for(proc, lambda: bool(_partial_files(exp)))
        else:
            until = time.monotonic() + delay
            _wait_for(proc, lambda until=until: time.monotonic() >= until)
        kills += _kill(proc)
        left = _partial_files(exp)
        if delay is None:
            assert left, "the timed kill did not land inside a write"
        mid_write += bool(left)
    assert kills >= 3, "too few kills landed while the run was alive"

    resumed = _cli(cut, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert not _partial_files(cut)  # the interrupted writes were cleared, never read
    a, b = _metrics(tmp_path / "full"), _metrics(cut)
    assert len(a) == 12 and a == b  # bitwise: floats compared exactly
    assert len({r["test_nll"] for r in a}) == len(a)


def test_resume_never_mixes_in_runs_of_other_settings(tmp_path, monkeypatch):
    """Issue scenario: a finished run with lr 0.001, then a run with lr 0.01 into the same folder,
    killed, then resumed. Every record of the result is lr 0.01's; the old run is kept aside."""
    tiny = [*TINY, "seeds=1", "batch_sizes=32"]  # 3 runs × 2 epochs
    kw = {"device": "cpu", "quick": True, "progress": False, "report": False, "seed": 3}
    reproduce(["mnist-ff"], out=tmp_path / "clean", overrides=[*tiny, "lr=0.01"], **kw)
    reproduce(["mnist-ff"], out=tmp_path / "mixed", overrides=[*tiny, "lr=0.001"], **kw)
    old = (tmp_path / "mixed" / "mnist-ff" / "records.json").read_text()

    class Killed(Exception):
        pass

    calls = {"n": 0}

    def killed_on_third_checkpoint() -> None:
        calls["n"] += 1
        if calls["n"] == 3:  # inside the second of three runs
            raise Killed

    monkeypatch.setattr(training, "checkpoint_written", killed_on_third_checkpoint)
    with pytest.raises(Killed):
        reproduce(["mnist-ff"], out=tmp_path / "mixed", overrides=[*tiny, "lr=0.01"], **kw)
    monkeypatch.setattr(training, "checkpoint_written", lambda: None)
    reproduce(["mnist-ff"], out=tmp_path / "mixed", resume=True, overrides=[*tiny, "lr=0.01"],
              **kw)  # fmt: skip

    def metrics(path: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "seconds"}
                for r in json.loads(path.read_text())]  # fmt: skip

    clean = metrics(tmp_path / "clean" / "mnist-ff" / "records.json")
    assert metrics(tmp_path / "mixed" / "mnist-ff" / "records.json") == clean
    kept = list((tmp_path / "mixed").glob("mnist-ff.*"))
    assert len(kept) == 1 and (kept[0] / "records.json").read_text() == old
    assert clean != metrics(kept[0] / "records.json")  # the two settings do differ

    # a finished run's file copied in from the other settings is refused, naming both lrs
    for name in ("runs", "ckpt"):
        for f in (kept[0] / name).iterdir():
            f.replace(tmp_path / "mixed" / "mnist-ff" / name / f.name)
    with pytest.raises(SettingsMismatchError, match=r"config\.lr: 0\.001 there, 0\.01 now"):
        reproduce(["mnist-ff"], out=tmp_path / "mixed", resume=True,
                  overrides=[*tiny, "lr=0.01"], **kw)  # fmt: skip


def _saved_run(tmp_path: Path, epochs: int) -> tuple[RunFiles, torch.nn.Module]:
    ident = RunIdentity.of({"experiment": "t", "config": {"lr": 0.1}})
    ctx = RunContext(tmp_path, torch.device("cpu"), resume=True, identity=ident)
    files = RunFiles.of(ctx, "r")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    history = []
    for e in range(1, epochs + 1):
        model.weight.data += 1.0
        history.append({"epoch": e})
        files.save(history, {"epoch": e}, model, opt, gen, "g")
    return files, model


def _restore(files: RunFiles) -> dict:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state, _ = files.restore(model, opt, torch.Generator(), "g")
    return state


def test_damaged_checkpoint_falls_back_to_the_previous_or_names_the_file(tmp_path):
    files, _ = _saved_run(tmp_path, epochs=3)
    assert torch_load(files.previous)["epoch"] == 2  # the one before the last is kept
    data = files.ckpt.read_bytes()
    files.ckpt.write_bytes(data[: len(data) // 2])  # truncated, as a full disk leaves it
    with pytest.warns(UserWarning, match=r"r\.pt .*cannot be read; resuming from .*r\.prev\.pt"):
        assert _restore(files)["epoch"] == 2
    files.previous.write_bytes(b"")
    with pytest.raises(RunFileError) as e:
        _restore(files)
    msg = str(e.value)
    assert str(files.ckpt) in msg and "Delete r.pt" in msg and "without --resume" in msg
    assert "Traceback" not in msg

    files.finish([{"epoch": 3}])
    files.done.write_text('{"settings_id": "x", "rec')  # a damaged finished-run file
    with pytest.raises(RunFileError, match=f"cannot read {files.done}"):
        files.finished()


def test_checkpoint_of_other_settings_is_refused(tmp_path):
    files, _ = _saved_run(tmp_path, epochs=1)
    other = RunIdentity.of({"experiment": "t", "config": {"lr": 0.2}})
    with pytest.raises(SettingsMismatchError, match=r"config\.lr: 0\.1 there, 0\.2 now"):
        _restore(RunFiles(files.done, files.ckpt, True, other))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _restore(files)["epoch"] == 1  # its own settings: restored, no warning


def test_second_run_into_a_locked_folder_fails_fast(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from layernorm.experiments.engine.io import lock_folder\n"
         "with lock_folder(sys.argv[1]):\n    print('locked', flush=True)\n    time.sleep(120)",
         str(tmp_path)],
        stdout=subprocess.PIPE, text=True, env=_env(),
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        with pytest.raises(FolderInUseError, match=f"in use by another run \\(pid {holder.pid}:"):
            reproduce(["invariances"], out=tmp_path, device="cpu", quick=True, progress=False)
        assert time.monotonic() - t0 < 30  # fails at once, does not wait for the holder
        assert not (tmp_path / "invariances").exists()
    finally:
        holder.kill()
        holder.wait()
    # the holder's death (even by SIGKILL) releases the lock
    reproduce(["invariances"], out=tmp_path, device="cpu", quick=True, progress=False)
    with lock_folder(tmp_path), lock_folder(tmp_path):  # re-entrant within one process
        assert (tmp_path / ".lock").read_text().startswith(f"pid {os.getpid()}:")
