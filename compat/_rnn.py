"""DL4J's recurrent data layout (``RNNFormat``) over dlspark's.

DL4J's recurrent layers take ``[examples, features, time]`` (NCW) by default;
dlspark's models, as flax's and JAX's recurrent layers, take
``[examples, time, features]`` (NWC). A compat network built with
``rnnDataFormat=RNNFormat.NCW`` (the default, as in DL4J) swaps the last two
axes of every 3-D features and labels array on the way in (on the executors for
RDDs, as they export or evaluate; in the workers' loader for minibatch files)
and of every 3-D output on the way out, so that ported code keeps DL4J's layout
and drops no ``permute``. Masks are ``[examples, time]`` in both layouts and
stay as they are; arrays of other ranks (dense or image data) pass unchanged.
"""

from __future__ import annotations

import numpy as np

from dlspark.data import DataSet, MultiDataSet

from ._names import DL4JEnum, as_enum

__all__ = ["RNNFormat", "rnn_format", "DatasetsToNWC", "LoadNWC", "PairsToNWC", "value_to_ncw", "swap_time"]


class RNNFormat(DL4JEnum):
    """DL4J's ``RNNFormat``: ``NCW`` is ``[examples, features, time]``, ``NWC``
    ``[examples, time, features]`` (dlspark's own)."""

    NCW = "NCW"
    NWC = "NWC"


def rnn_format(value) -> RNNFormat:
    """``value`` (an :class:`RNNFormat` or its name) as an :class:`RNNFormat`."""
    return as_enum(RNNFormat, value, "rnnDataFormat")


def swap_time(x, rank: int = 3):
    """``x`` with its last two axes swapped if it has ``rank`` axes (a tuple: each of it)."""
    if isinstance(x, (tuple, list)):
        return type(x)(swap_time(v, rank) for v in x)
    if getattr(x, "ndim", None) != rank:  # not an array of that rank (None, a DataSet, ...): as it is
        return x
    return np.swapaxes(np.asarray(x), -1, -2)


def _dataset_to_nwc(ds):
    arrays = (ds.features, ds.labels) if isinstance(ds, DataSet) else (*ds.features, *ds.labels)
    if all(getattr(a, "ndim", None) != 3 for a in arrays):  # nothing recurrent: the same DataSet
        return ds
    if isinstance(ds, DataSet):
        return DataSet(swap_time(ds.features), swap_time(ds.labels), ds.features_mask, ds.labels_mask)
    return MultiDataSet(swap_time(tuple(ds.features)), swap_time(tuple(ds.labels)), ds.features_masks,
                        ds.labels_masks)


class DatasetsToNWC:
    """``rdd.map(DatasetsToNWC())``: each DataSet or MultiDataSet (alone, or the value of a
    ``(key, DataSet)`` pair) in NWC; paths and other elements pass unchanged (runs on the
    executors)."""

    def __call__(self, x):
        if isinstance(x, (DataSet, MultiDataSet)):
            return _dataset_to_nwc(x)
        if isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], (DataSet, MultiDataSet)):
            return x[0], _dataset_to_nwc(x[1])
        return x


class LoadNWC:
    """A minibatch loader (``path -> DataSet``) whose DataSets come in NWC: ``loader``'s, or
    the ``.npz`` minibatch format's when None."""

    def __init__(self, loader=None):
        self.loader = loader

    def __call__(self, path):
        from dlspark.data import as_dataset, load_minibatch

        ds = load_minibatch(path) if self.loader is None else as_dataset(self.loader(path),
                                                                         f"the loader's result for {path!r}")
        return _dataset_to_nwc(ds)


class PairsToNWC:
    """``pairs.map(PairsToNWC(with_mask), preservesPartitioning=True)``: the value of each
    ``(key, features)`` pair (``(key, (features, mask))`` with ``with_mask``), one example's NCW
    features ``[features, time]`` or a tuple of them, as ``[time, features]``. Anything else
    passes unchanged, for keyed inference to refuse by what it is."""

    def __init__(self, with_mask: bool):
        self.with_mask = with_mask

    def __call__(self, x):
        if not (isinstance(x, tuple) and len(x) == 2):
            return x
        key, v = x
        if not self.with_mask:
            return key, swap_time(v, 2)
        if isinstance(v, (tuple, list)) and len(v) == 2:
            return key, (swap_time(v[0], 2), v[1])
        return x


def value_to_ncw(out):
    """One example's sequence output ``[time, classes]`` (or a tuple of outputs) as DL4J's
    ``[classes, time]`` (for ``pairs.mapValues``)."""
    return swap_time(out, 2)
