"""Real and synthetic data that ship with the installation (nothing downloads)."""

from __future__ import annotations

import functools
import gzip
import importlib.util
import os

import numpy as np

from .data import DataSet

__all__ = ["digits", "synthetic_classification"]


@functools.lru_cache(maxsize=1)
def _digits_table() -> np.ndarray:
    """scikit-learn's digits as ``load_digits`` reads them (64 pixel columns, then the class),
    read from the file scikit-learn installs without importing ``sklearn.datasets``: that import
    (SciPy and more) costs about 2 CPU-seconds, reading the file a quarter of one, and every
    process that calls :func:`digits` paid it. Kept for the process, read-only."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None:  # pragma: no cover
        raise ImportError("dlspark.datasets.digits needs scikit-learn: pip install scikit-learn")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    if os.path.exists(path):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            table = np.loadtxt(f, delimiter=",")
    else:  # a scikit-learn that keeps its data elsewhere: its own loader
        from sklearn.datasets import load_digits

        d = load_digits()
        table = np.column_stack([d.data, d.target])
    table.setflags(write=False)
    return table


def digits(test_fraction: float = 0.2, seed: int = 0, one_hot: bool = True):
    """scikit-learn's 8x8 handwritten digits (1,797 real images), split into train and test.

    Features are float32 in [0, 1], shape ``[n, 64]``; labels are one-hot
    float32 ``[n, 10]`` (or int32 class ids with ``one_hot=False``). The split
    is stratified and reproducible from ``seed``.

    Returns
    -------
    (DataSet, DataSet)
        ``(train, test)``.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    table = _digits_table()
    x = (table[:, :-1] / 16.0).astype(np.float32)
    y = table[:, -1].astype(np.int32)
    rng = np.random.default_rng(seed)
    test_idx = []
    for c in range(10):
        idx = np.flatnonzero(y == c)
        rng.shuffle(idx)
        test_idx.extend(idx[: int(round(len(idx) * test_fraction))])
    test_mask = np.zeros(len(y), bool)
    test_mask[test_idx] = True
    train_idx = rng.permutation(np.flatnonzero(~test_mask))
    test_idx = np.flatnonzero(test_mask)
    lab = (lambda t: np.eye(10, dtype=np.float32)[t]) if one_hot else (lambda t: t)
    return DataSet(x[train_idx], lab(y[train_idx])), DataSet(x[test_idx], lab(y[test_idx]))


def synthetic_classification(n: int, n_features: int = 64, n_classes: int = 10, seed: int = 0,
                             noise: float = 1.0, one_hot: bool = True) -> DataSet:
    """A learnable classification set of any size: Gaussian clusters around random class centres.

    Generated in chunks, so ``n`` in the millions costs only the output's memory.
    """
    if n < 1 or n_features < 1 or n_classes < 2:
        raise ValueError(f"need n >= 1, n_features >= 1 and n_classes >= 2; got {n}, {n_features}, {n_classes}")
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, 1.0, (n_classes, n_features)).astype(np.float32) * 2.0
    y = rng.integers(0, n_classes, n).astype(np.int32)
    x = np.empty((n, n_features), np.float32)
    chunk = 65536
    for i in range(0, n, chunk):
        j = min(n, i + chunk)
        x[i:j] = centres[y[i:j]] + rng.normal(0.0, noise, (j - i, n_features)).astype(np.float32)
    return DataSet(x, np.eye(n_classes, dtype=np.float32)[y] if one_hot else y)
