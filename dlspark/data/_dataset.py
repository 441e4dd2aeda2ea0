"""DataSet and MultiDataSet: features, labels and their optional masks."""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["DataSet", "MultiDataSet", "as_dataset"]


def _arr(x, what):
    if x is None:
        return None
    try:
        a = np.asarray(x)
    except Exception as e:  # ragged lists and the like
        raise TypeError(f"{what} must be array-like, got {type(x).__name__}: {e}") from None
    if a.dtype == object:
        raise TypeError(f"{what} must be a numeric array, got an array of Python objects")
    if a.ndim == 0:
        raise ValueError(f"{what} must have a leading example axis, got a scalar")
    return a


class _Base:
    """Shared storage: tuples of features, labels and masks (``None`` where absent)."""

    __slots__ = ("_f", "_l", "_fm", "_lm")

    def _init(self, features, labels, fmasks, lmasks):
        f = tuple(_arr(a, f"features[{i}]") for i, a in enumerate(features))
        l_ = tuple(_arr(a, f"labels[{i}]") for i, a in enumerate(labels))
        fm = tuple(_arr(a, f"features_mask[{i}]") for i, a in enumerate(fmasks or (None,) * len(f)))
        lm = tuple(_arr(a, f"labels_mask[{i}]") for i, a in enumerate(lmasks or (None,) * len(l_)))
        if not f:
            raise ValueError("a data set needs at least one features array")
        if len(fm) != len(f) or len(lm) != len(l_):
            raise ValueError(
                f"got {len(fm)} features masks for {len(f)} features arrays and {len(lm)} "
                f"labels masks for {len(l_)} labels arrays; give one per array (None for no mask)"
            )
        n = f[0].shape[0]
        for kind, arrs in (("features", f), ("labels", l_), ("features_mask", fm), ("labels_mask", lm)):
            for i, a in enumerate(arrs):
                if a is not None and a.shape[0] != n:
                    raise ValueError(
                        f"features and {kind} have different numbers of examples: "
                        f"features[0] has {n}, {kind}[{i}] has {a.shape[0]} (shape {a.shape})"
                    )
        self._f, self._l, self._fm, self._lm = f, l_, fm, lm

    def __len__(self):
        return int(self._f[0].shape[0])

    @property
    def num_examples(self) -> int:
        """Number of examples (the length of the leading axis)."""
        return len(self)

    # DL4J's accessor names, so that programs ported with dlspark.compat run as written
    def numExamples(self) -> int:
        """DL4J's ``numExamples()``: :attr:`num_examples`."""
        return len(self)

    def getFeatures(self, index=None):
        """DL4J's ``getFeatures()`` (a MultiDataSet's tuple, or ``getFeatures(i)`` its i-th array)."""
        return self.features if index is None else self._f[index]

    def getLabels(self, index=None):
        """DL4J's ``getLabels()`` (a MultiDataSet's tuple, or ``getLabels(i)`` its i-th array)."""
        return self.labels if index is None else self._l[index]

    def getFeaturesMaskArray(self, index=0):
        """DL4J's ``getFeaturesMaskArray()``: the (first) features mask, or None."""
        return self._fm[index]

    def getLabelsMaskArray(self, index=0):
        """DL4J's ``getLabelsMaskArray()``: the (first) labels mask, or None."""
        return self._lm[index]

    def _take(self, index):
        pick = lambda arrs: tuple(None if a is None else a[index] for a in arrs)  # noqa: E731
        # slices of arrays this data set already checked: nothing to check again (a local
        # fit cuts an epoch into minibatches this way, so it costs no validation per batch)
        out = object.__new__(type(self))
        out._f, out._l, out._fm, out._lm = pick(self._f), pick(self._l), pick(self._fm), pick(self._lm)
        return out

    def __getitem__(self, index):
        """A slice, an index array or mask, or one example (as a data set of one)."""
        if isinstance(index, (int, np.integer)) and not isinstance(index, (bool, np.bool_)):
            n, i = len(self), int(index)
            if not -n <= i < n:
                raise IndexError(f"example {i} is out of range for a data set of {n} examples")
            i %= n
            index = slice(i, i + 1)
        return self._take(index)

    def batches(self, batch_size: int) -> list:
        """Split into consecutive minibatches of ``batch_size`` (the last may be smaller)."""
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        return [self._take(slice(i, i + batch_size)) for i in range(0, len(self), batch_size)]

    def to_arrays(self) -> dict:
        """The named arrays of the minibatch file format (see the README)."""
        raise NotImplementedError

    @classmethod
    def merge(cls, parts: Sequence):
        """Concatenate data sets of the same kind along the example axis."""
        parts = list(parts)
        if not parts:
            raise ValueError("merge needs at least one data set")

        def cat(getter):
            cols = list(zip(*[getter(p) for p in parts]))
            out = []
            for col in cols:
                if all(a is None for a in col):
                    out.append(None)
                elif any(a is None for a in col):
                    raise ValueError("cannot merge data sets where only some have a mask")
                else:
                    out.append(np.concatenate(col, axis=0))
            return tuple(out)

        return type(parts[0])._from_tuples(
            cat(lambda p: p._f), cat(lambda p: p._l), cat(lambda p: p._fm), cat(lambda p: p._lm)
        )

    def jit_batch(self):
        """``(inputs, labels, features_mask, labels_mask)`` as the network's step takes them."""
        raise NotImplementedError

    def __repr__(self):
        shapes = lambda arrs: [None if a is None else a.shape for a in arrs]  # noqa: E731
        return f"{type(self).__name__}(n={len(self)}, features={shapes(self._f)}, labels={shapes(self._l)})"


class DataSet(_Base):
    """One features array and one labels array, with optional masks (DL4J's ``DataSet``).

    Parameters
    ----------
    features, labels : array-like
        Leading axis is the example axis; both must have the same length.
    features_mask, labels_mask : array-like, optional
        Per example ``[n]`` or per time step ``[n, time]`` masks (1 = counts).

    Examples
    --------
    >>> import numpy as np
    >>> ds = DataSet(np.zeros((10, 3)), np.ones((10, 2)))
    >>> [len(b) for b in ds.batches(4)]
    [4, 4, 2]
    """

    __slots__ = ()

    def __init__(self, features, labels, features_mask=None, labels_mask=None):
        self._init((features,), (labels,), (features_mask,), (labels_mask,))

    @classmethod
    def _from_tuples(cls, f, l_, fm, lm):
        return cls(f[0], l_[0], fm[0], lm[0])

    features = property(lambda self: self._f[0], doc="The features array.")
    labels = property(lambda self: self._l[0], doc="The labels array.")
    features_mask = property(lambda self: self._fm[0], doc="The features mask, or None.")
    labels_mask = property(lambda self: self._lm[0], doc="The labels mask, or None.")

    def to_arrays(self):
        out = {"features": self.features, "labels": self.labels}
        if self.features_mask is not None:
            out["features_mask"] = self.features_mask
        if self.labels_mask is not None:
            out["labels_mask"] = self.labels_mask
        return out

    def jit_batch(self):
        return (self.features, self.labels, self.features_mask, self.labels_mask)


class MultiDataSet(_Base):
    """Several features and labels arrays (DL4J's ``MultiDataSet``, for multi-input/output models).

    The model receives the features as a tuple; one loss term per labels array is summed.

    Parameters
    ----------
    features, labels : sequence of array-like
    features_masks, labels_masks : sequence of (array-like or None), optional
    """

    __slots__ = ()

    def __init__(self, features, labels, features_masks=None, labels_masks=None):
        if not isinstance(features, (list, tuple)) or not isinstance(labels, (list, tuple)):
            raise TypeError(
                "MultiDataSet takes sequences of arrays, e.g. MultiDataSet([x1, x2], [y]); "
                f"got features of type {type(features).__name__} and labels of type {type(labels).__name__}"
            )
        self._init(tuple(features), tuple(labels), features_masks, labels_masks)

    @classmethod
    def _from_tuples(cls, f, l_, fm, lm):
        return cls(f, l_, fm, lm)

    features = property(lambda self: self._f, doc="Tuple of features arrays.")
    labels = property(lambda self: self._l, doc="Tuple of labels arrays.")
    features_masks = property(lambda self: self._fm, doc="Tuple of features masks (None where absent).")
    labels_masks = property(lambda self: self._lm, doc="Tuple of labels masks (None where absent).")

    def to_arrays(self):
        out = {}
        for kind, arrs in (("features", self._f), ("labels", self._l), ("features_mask", self._fm), ("labels_mask", self._lm)):
            for i, a in enumerate(arrs):
                if a is not None:
                    out[f"{kind}_{i}"] = a
        return out

    def jit_batch(self):
        return (self._f, self._l, self._fm, self._lm)


def as_dataset(data, what="data"):
    """Accept a DataSet/MultiDataSet or a ``(features, labels)`` pair."""
    if isinstance(data, (DataSet, MultiDataSet)):
        return data
    if isinstance(data, tuple) and len(data) in (2, 3, 4):
        return DataSet(*data)
    raise TypeError(
        f"{what} must be a DataSet, a MultiDataSet or a (features, labels) tuple, got {type(data).__name__}"
    )
