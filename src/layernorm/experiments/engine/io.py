"""Atomic file writes, tidy record files (CSV for people, JSON for the report) and the lock
that keeps two runs out of one results folder.

Every file is written to a temporary file ``.<name>.<random>.tmp`` in the same directory and
moved into place with :func:`os.replace`, which is atomic on POSIX: a run killed mid-write leaves
the previous version, never a truncated one, plus the temporary file, which nothing reads and
:func:`remove_partial_writes` deletes.

For tests that kill a run inside a write, ``LAYERNORM_WRITE_DELAY_S=S`` spreads every write over
about ``S`` seconds (in eight pieces), so that a kill at a random instant often lands in one.
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import io
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "LOCK_NAME",
    "WRITE_DELAY_ENV",
    "FolderInUseError",
    "atomic_write_bytes",
    "claim",
    "lock_folder",
    "read_json",
    "remove_partial_writes",
    "save_records",
    "torch_load",
    "torch_save",
    "write_json",
]

WRITE_DELAY_ENV = "LAYERNORM_WRITE_DELAY_S"
LOCK_NAME = ".lock"
_PIECES = 8


def atomic_write_bytes(path: Path, data: bytes, keep_previous: Path | None = None) -> None:
    """Write ``data`` to ``path`` atomically. With ``keep_previous``, the file that ``path``
    held is kept there (hard-linked before the replacement, so ``path`` exists throughout)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    delay = float(os.environ.get(WRITE_DELAY_ENV) or 0)
    try:
        with os.fdopen(fd, "wb") as f:
            if delay > 0:
                step = -(-len(data) // _PIECES) or 1
                for i in range(0, len(data), step):
                    f.write(data[i : i + step])
                    f.flush()
                    time.sleep(delay / _PIECES)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous is not None and path.exists():
            link = keep_previous.with_name(f".{keep_previous.name}.link.tmp")
            link.unlink(missing_ok=True)
            os.link(path, link)
            os.replace(link, keep_previous)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remove_partial_writes(folder: Path) -> list[Path]:
    """Delete the temporary files that writes killed mid-way left under ``folder`` (call it only
    while holding :func:`lock_folder`, when no write can be under way); returns them."""
    found = sorted(p for p in folder.rglob(".*.tmp") if p.is_file()) if folder.is_dir() else []
    for p in found:
        p.unlink(missing_ok=True)
    return found


class FolderInUseError(RuntimeError):
    """Another process holds the lock of a results folder."""


_held: dict[Path, tuple[int, int]] = {}  # folder → (lock file descriptor, nesting depth)


@contextlib.contextmanager
def lock_folder(folder: Path, shared: bool = False) -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` (``fcntl.flock`` on ``folder/.lock``, which records
    the holder's pid and command) for the duration; re-entrant within a process. The operating
    system drops the lock when the holder exits, however it exits, so a killed run never leaves
    a stale lock. A second process fails at once with :class:`FolderInUseError` naming the
    holder. ``shared``: a shared lock instead, which any number of processes can hold together
    but not beside an exclusive one (runs of different experiments into one results folder each
    hold it shared, and their own experiment's folder exclusively)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = folder.resolve()
    if key in _held:
        fd, depth = _held[key]
        _held[key] = (fd, depth + 1)
        try:
            yield
        finally:
            _held[key] = (fd, _held[key][1] - 1)
        return
    fd = os.open(key / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown process"
        os.close(fd)
        raise FolderInUseError(
            f"results folder {folder} is in use by another run ({holder}); wait for it to "
            f"finish or choose another --out"
        ) from None
    if not shared:  # shared holders leave the file alone: it names the exclusive one
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}: {' '.join(sys.argv)}\n".encode(), 0)
    _held[key] = (fd, 1)
    try:
        yield
    finally:
        del _held[key]
        if not shared:
            os.ftruncate(fd, 0)
        os.close(fd)  # closing the descriptor releases the lock


@contextlib.contextmanager
def claim(path: Path, wait: bool = False) -> Iterator[bool]:
    """Take the exclusive lock ``path`` (``fcntl.flock``) and yield whether this process holds
    it; the lock is held for the duration. Without ``wait`` it is tried once: processes sharing
    work claim each piece this way, and a piece whose lock another process holds is left to that
    process. With ``wait``, until the holder lets it go. The operating system drops the lock when
    its holder exits, however it exits."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
        yield True
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode())


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def torch_save(path: Path, obj: Any, keep_previous: Path | None = None) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue(), keep_previous)


def torch_load(path: Path) -> Any:
    # Our own checkpoints hold RNG states (tensors) and plain containers only.
    return torch.load(path, map_location="cpu", weights_only=True)


def save_records(out_dir: Path, records: Sequence[dict[str, Any]]) -> None:
    """Write ``records.json`` (read by the report) and ``records.csv`` (the union of columns)."""
    write_json(out_dir / "records.json", list(records))
    columns: list[str] = []
    for r in records:
        columns += [k for k in r if k not in columns]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    w.writeheader()
    for r in records:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in columns})
    atomic_write_bytes(out_dir / "records.csv", buf.getvalue().encode())
