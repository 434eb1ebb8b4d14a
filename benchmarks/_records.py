"""Tidy CSV records of the benchmark scripts: rows appended to a file, its header written once.

A file written by an earlier version of a script (other columns) is refused with the two
headers named: appending would put values under the wrong columns.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path


def append_csv(path: Path, rows: Sequence[Mapping[str, object]]) -> int:
    """Append ``rows`` (dicts with the same keys, in order) to the CSV at ``path``, writing the
    header when the file is new or empty; the number of rows written. SystemExit where the file
    has another header."""
    if not rows:
        return 0
    fields = list(rows[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with path.open(newline="") as f:
            header = next(csv.reader(f), [])
        if header != fields:
            raise SystemExit(
                f"{path}: its columns are {header}, these rows have {fields}: "
                "append to a new file instead"
            )
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        if new:
            writer.writeheader()
        writer.writerows(rows)
    return len(rows)
