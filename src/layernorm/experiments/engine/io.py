"""Atomic file writes and tidy record files (CSV for people, JSON for the report).

Every file is written to a temporary file in the same directory and moved into place with
:func:`os.replace`, which is atomic on POSIX: a run killed mid-write leaves the previous version,
never a truncated one.
"""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "atomic_write_bytes",
    "read_json",
    "save_records",
    "torch_load",
    "torch_save",
    "write_json",
]


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode())


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def torch_save(path: Path, obj: Any) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())


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
