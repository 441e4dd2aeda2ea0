"""Data frames as training data: dask (or pandas) DataFrames and Parquet files, by column name.

:func:`frame_columns` names the feature and label columns of a frame and checks
them against its schema (no data is read): a column that is missing, not
numeric, or holds arrays of varying length is refused naming the column and
what is allowed. The registered :class:`FrameSource` turns the result into
minibatches where each partition lives: every partition becomes one DataSet in
a task on a worker, and the dask-bag path cuts it into minibatches there
(written as minibatch files, or kept in worker memory with the ``direct``
approach), so the frame never passes through the client.
:func:`parquet_columns` reads Parquet files at any fsspec URL the same way: the
workers read the row groups (``dask.dataframe.read_parquet``).

Shuffling: rows stay in their partition, in their order, and are cut into
minibatches once per fit (an epoch trains every minibatch once); which worker
trains which minibatches in which round follows the master's plan, as for
every other source. Shuffle the rows across partitions before the fit
(``ddf.shuffle(on=...)``) where partitions are sorted by label.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._dataset import DataSet
from ._registry import Source, evaluation_parts, fit_minibatches, register_source

__all__ = ["FrameColumns", "frame_columns", "parquet_columns", "keyed_rows", "FrameSource"]

_ALLOWED = ("numeric columns (bool, integer, float), pyarrow fixed-size lists of numbers "
            "(pd.ArrowDtype(pa.list_(pa.float32(), n))) for array columns, and for labels categorical columns")


@dataclass(frozen=True)
class _Column:
    name: str
    width: int  # 0: a scalar column; n > 0: a fixed-size list column of n numbers
    categorical: bool = False
    integer: bool = False


@dataclass(frozen=True)
class FrameColumns:
    """A frame with its feature and label columns named; what ``fit`` and evaluation take.

    Build it with :func:`frame_columns` (or ``trainer.fit(frame, features=..., labels=...)``).
    """

    frame: Any
    features: tuple
    labels: tuple | None
    weight: _Column | None = None

    def to_bag(self, weighted: bool = True):
        """A dask bag of one DataSet per partition, each built in a task on the worker that holds it
        (with the weight column as its labels mask, unless ``weighted`` is false: evaluation)."""
        import dask
        import dask.bag as db

        spec = (self.features, self.labels, self.weight if weighted else None)
        return db.from_delayed([dask.delayed(_partition_datasets)(p, spec) for p in self.frame.to_delayed()])


def _describe(dtype) -> str:
    return getattr(dtype, "name", str(dtype))


def _column(frame, name, role):
    import pandas as pd

    if name not in frame.columns:
        cols = list(frame.columns)
        raise ValueError(f"{role} column {name!r} is not in the frame; its columns are "
                         f"{cols[:20]}{' ...' if len(cols) > 20 else ''}")
    dtype = frame.dtypes[name]
    if isinstance(dtype, pd.CategoricalDtype):
        if role != "label":
            raise TypeError(f"feature column {name!r} is categorical: features must be {_ALLOWED.split(', and')[0]}; "
                            "encode it first (its .cat.codes, or one column per category)")
        return _Column(name, 0, categorical=True, integer=True)
    if isinstance(dtype, pd.ArrowDtype):
        import pyarrow as pa

        t = dtype.pyarrow_dtype
        if pa.types.is_fixed_size_list(t):
            if not (pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type)):
                raise TypeError(f"{role} column {name!r} holds lists of {t.value_type}, not numbers; allowed are "
                                f"{_ALLOWED}")
            return _Column(name, t.list_size)
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            raise ValueError(f"{role} column {name!r} holds lists of varying length ({t}): a ragged array column "
                             "cannot be stacked into examples; allowed are fixed-size lists, e.g. "
                             f"ddf[{name!r}].astype(pd.ArrowDtype(pa.list_(pa.float32(), n))) when every row holds n")
        if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
            return _Column(name, 0, integer=pa.types.is_integer(t))
    elif isinstance(dtype, np.dtype) and dtype.kind in "biuf":
        return _Column(name, 0, integer=dtype.kind in "iu")
    raise TypeError(f"{role} column {name!r} has dtype {_describe(dtype)}, which is not numeric; allowed are "
                    f"{_ALLOWED}")


def _names(value, what):
    if value is None:
        return None
    names = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (list, tuple)) else None
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{what} must be a column name or a non-empty list of column names, got {value!r}")
    return names


def frame_columns(frame, features, labels=None, weight=None) -> FrameColumns:
    """Name the feature and label columns of ``frame`` (a dask or pandas DataFrame).

    Parameters
    ----------
    frame : dask.dataframe.DataFrame or pandas.DataFrame
    features : str or list of str
        Feature columns, concatenated in this order into each example's
        feature vector; a fixed-size list column gives as many features as it
        holds.
    labels : str or list of str, optional
        Label columns. One integer or categorical column gives integer class ids
        (what ``softmax_cross_entropy`` takes, as one-hot labels); anything else
        gives float labels, one column each (a fixed-size list column, several).
        Without labels, the frame serves inference only.
    weight : str, optional
        A numeric column of non-negative per-example (sample) weights: training
        minimises ``sum(w * loss) / sum(w)`` over each minibatch, so that a row of
        weight 0 has no effect on the fit. It enters each minibatch as its labels
        mask; evaluation counts every row alike.

    Raises
    ------
    ValueError
        A column that is not in the frame, a list column of varying length, or a
        frame with no rows (a dask frame's partition lengths come from its metadata
        where dask has them, else its first partition is counted on the cluster).
    TypeError
        A column that is not numeric.

    Examples
    --------
    >>> import pandas as pd
    >>> cols = frame_columns(pd.DataFrame({"a": [0.5], "b": [1.5], "y": [1]}), ["a", "b"], "y")
    >>> cols.features
    ('a', 'b')
    """
    import pandas as pd

    kind = type(frame).__module__.split(".")[0]
    if not (isinstance(frame, pd.DataFrame) or (kind == "dask" and hasattr(frame, "to_delayed")
                                                 and hasattr(frame, "dtypes"))):
        raise TypeError(f"frame must be a dask or pandas DataFrame, got {type(frame).__name__}")
    feats = _names(features, "features")
    if feats is None:
        raise TypeError("features must name the feature columns, e.g. features=['x0', 'x1']")
    labs = _names(labels, "labels")
    feature_cols = tuple(_column(frame, n, "feature") for n in feats)
    label_cols = None if labs is None else tuple(_column(frame, n, "label") for n in labs)
    weight_col = None
    if weight is not None:
        if not isinstance(weight, str):
            raise TypeError(f"weight must be a column name, got {weight!r}")
        weight_col = _column(frame, weight, "weight")
        if weight_col.width or weight_col.categorical:
            raise TypeError(f"weight column {weight!r} must hold one number a row (a non-negative sample "
                            f"weight), got {_describe(frame.dtypes[weight])}")
    if isinstance(frame, pd.DataFrame) and len(frame) == 0:
        raise ValueError(f"the frame has no rows (columns {list(frame.columns)[:20]}): training and evaluation "
                         "need at least one example")
    if not isinstance(frame, pd.DataFrame) and not _has_rows(frame):
        raise ValueError(f"the dask DataFrame {getattr(frame, '_name', '')!r} has no rows in any of its "
                         f"{frame.npartitions} partitions (columns {list(frame.columns)[:20]}): training and "
                         "evaluation need at least one example")
    return FrameColumns(frame, feature_cols, label_cols, weight_col)


def _has_rows(frame) -> bool:
    """Whether a dask frame has a row, known before any training work: from dask's own metadata
    where it has the partition lengths (pandas partitions, Parquet footers), else by counting the
    first partition's rows and, only where it has none, every partition's (on the cluster; only
    the counts come back)."""
    try:
        from dask.dataframe.dask_expr._expr import Lengths, Literal

        lengths = Lengths(frame.expr).optimize()
        if isinstance(lengths, Literal):
            return sum(lengths.value) > 0
    except (ImportError, AttributeError):  # another dask: count
        pass
    if len(frame.partitions[0]):
        return True
    return frame.npartitions > 1 and int(frame.map_partitions(len).sum().compute()) > 0


def parquet_columns(urls, features, labels=None, storage_options: dict | None = None, *, weight: str | None = None,
                    **read_options) -> FrameColumns:
    """Parquet files at any fsspec URL (a glob, a directory or a list), by column name.

    A dask DataFrame over the files (``dask.dataframe.read_parquet``, reading only
    the named columns): the workers read the row groups themselves, and each
    partition is cut into minibatches where it was read. ``read_options`` go to
    ``read_parquet`` (``split_row_groups``, ``filters``, ...); ``weight`` names a column
    of sample weights (:func:`frame_columns`).
    """
    import dask.dataframe as dd

    feats, labs = _names(features, "features"), _names(labels, "labels")
    if feats is None:
        raise TypeError("features must name the feature columns, e.g. features=['x0', 'x1']")
    wanted = list(dict.fromkeys(feats + (labs or ()) + ((weight,) if isinstance(weight, str) else ())))
    frame = dd.read_parquet(urls, storage_options=storage_options or {}, **read_options)
    for names, role in ((feats, "feature"), (labs or (), "label"), ((weight,) if isinstance(weight, str) else (),
                                                                     "weight")):
        for name in names:  # the whole file's columns in the message, not the selection's
            _column(frame, name, role)
    return frame_columns(frame[wanted], feats, labs, weight)


def _values(part, col: _Column, dtype):
    s = part[col.name]
    if col.width:
        import pyarrow as pa

        arr = pa.array(s.array)
        arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
        if arr.null_count:
            raise ValueError(f"column {col.name!r} has missing rows; fill or drop them before the fit")
        return arr.flatten().to_numpy(zero_copy_only=False).astype(dtype).reshape(len(s), col.width)
    if col.categorical:
        return s.cat.codes.to_numpy().astype(dtype)[:, None]
    if s.hasnans and np.dtype(dtype).kind != "f":
        raise ValueError(f"column {col.name!r} has missing rows; fill or drop them before the fit")
    return (s.to_numpy(dtype=dtype, na_value=np.nan) if s.hasnans else s.to_numpy(dtype=dtype))[:, None]


def frame_arrays(part, features, labels):
    """``(x, y)`` numpy arrays of the rows of the pandas frame ``part`` (``y`` None without labels)."""
    x = np.concatenate([_values(part, c, np.float32) for c in features], axis=1)
    if not labels:
        return x, None
    if len(labels) == 1 and labels[0].width == 0 and labels[0].integer:
        return x, _values(part, labels[0], np.int32)[:, 0]
    return x, np.concatenate([_values(part, c, np.float32) for c in labels], axis=1)


def frame_weights(part, weight):
    """The per-example weights of the rows of ``part`` (float32), or None without a weight column."""
    if weight is None:
        return None
    w = _values(part, weight, np.float32)[:, 0]
    if not np.all(w >= 0):  # NaN included
        bad = w[~(w >= 0)][0]
        raise ValueError(f"weight column {weight.name!r} holds {bad}: sample weights must be non-negative numbers")
    return w


def frame_dataset(part, features, labels, weight=None) -> DataSet:
    """The rows of the pandas frame ``part`` as one DataSet (the weights as its labels mask)."""
    x, y = frame_arrays(part, features, labels)
    return DataSet(x, y, labels_mask=frame_weights(part, weight))


def _partition_datasets(part, spec):
    """Runs on a worker: one partition (a pandas frame) as ``[DataSet]``, or ``[]`` when empty."""
    features, labels, weight = spec
    if len(part) == 0:
        return []
    return [frame_dataset(part, features, labels, weight)]


def _keyed_partition(part, features):
    if len(part) == 0:
        return []
    x, _ = frame_arrays(part, features, None)
    return list(zip(part.index.tolist(), x))


def keyed_rows(frame, features):
    """A dask bag of ``(index, features)`` pairs, one per row, built where each partition lives:
    what ``trainer.predict_with_keys`` takes, so that the frame's index keys the outputs."""
    import dask
    import dask.bag as db

    cols = frame_columns(frame, features, None)
    if not _is_dask(cols.frame):
        import dask.dataframe as dd

        cols = FrameColumns(dd.from_pandas(cols.frame, npartitions=1), cols.features, None)
    return db.from_delayed([dask.delayed(_keyed_partition)(p, cols.features) for p in cols.frame.to_delayed()])


def _is_dask(frame) -> bool:
    return type(frame).__module__.split(".")[0] == "dask"


class FrameSource(Source):
    """Frames with named columns (:func:`frame_columns`), and bare dask DataFrames, which it refuses
    with the call that names their columns (the dask-bag source would take them, and fail later)."""

    description = "a DataFrame with its columns named (fit(frame, features=[...], labels=[...]))"

    def accepts(self, data):
        if isinstance(data, FrameColumns):
            return True
        if _is_dask(data) and hasattr(data, "dtypes") and hasattr(data, "to_delayed"):
            raise TypeError("a dask DataFrame needs its columns named: fit(ddf, features=['x0', 'x1'], "
                            "labels=['y']), or dlspark.data.frame_columns(ddf, features=..., labels=...)")
        return False

    @staticmethod
    def _labelled(data, what):
        if data.labels is None:
            raise ValueError(f"{what} needs label columns: name them with labels=[...]")

    def fit_refs(self, data, ctx):
        self._labelled(data, "fit")
        if not _is_dask(data.frame):
            return fit_minibatches(frame_dataset(data.frame, data.features, data.labels, data.weight), ctx)
        m = fit_minibatches(data.to_bag(), ctx)
        if not m.refs:
            raise ValueError(f"the frame has no rows (columns {list(data.frame.columns)[:20]}): training needs at "
                             "least one example")
        return m

    def eval_parts(self, data, ctx, n_parts):
        self._labelled(data, "evaluation")
        if not _is_dask(data.frame):
            x, y = frame_arrays(data.frame, data.features, data.labels)
            return evaluation_parts(DataSet(x, y), ctx, n_parts)
        return evaluation_parts(data.to_bag(weighted=False), ctx, n_parts)

    def local_batches(self, data, batch_size, epochs):
        self._labelled(data, "fit")
        parts = [data.frame] if not _is_dask(data.frame) else data.frame.to_delayed()
        batches = []
        for p in parts:  # one partition in memory at a time
            part = p if not _is_dask(data.frame) else p.compute()
            if len(part):
                batches.extend(frame_dataset(part, data.features, data.labels, data.weight).batches(batch_size))
        if not batches:
            raise ValueError("the frame has no rows: training needs at least one example")
        return batches, False

    def examples(self, data):
        self._labelled(data, "score_examples")
        frame = data.frame.compute() if _is_dask(data.frame) else data.frame
        return DataSet(*frame_arrays(frame, data.features, data.labels))


register_source(FrameSource())
