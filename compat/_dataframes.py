"""Spark DataFrames for the compat networks: dlspark's own extension (DL4J on Spark takes RDDs).

``SparkDl4jMultiLayer.fit(dataframe, featuresCol, labelCol)`` trains from a Spark
DataFrame. Its columns are checked against the schema on the driver; each
partition's rows become DataSets on the executors, which then write the
minibatch files as they do for an RDD of DataSets, so no feature array reaches
the driver. A column is a number, an array of numbers (``ArrayType``) or a Spark
ML vector (``VectorUDT``, dense or sparse).
"""

from __future__ import annotations

import numpy as np

__all__ = ["is_spark_dataframe", "dataframe_datasets", "keyed_dataframe"]

#: rows an executor gathers into one DataSet before handing it on (the export re-cuts them)
_ROWS_PER_DATASET = 1024
_NUMERIC = ("byte", "short", "integer", "long", "float", "double", "decimal", "boolean")
_ALLOWED = "numbers, arrays of numbers (ArrayType) or Spark ML vectors (VectorUDT, dense or sparse)"


def is_spark_dataframe(x) -> bool:
    """Whether ``x`` is a pyspark.sql DataFrame (without importing pyspark)."""
    return type(x).__module__.startswith("pyspark.sql") and hasattr(x, "schema") and hasattr(x, "rdd")


def _kind(df, name, role):
    """``"scalar"``, ``"array"`` or ``"vector"`` for column ``name``, from the schema alone."""
    fields = {f.name: f.dataType for f in df.schema.fields}
    if name not in fields:
        raise ValueError(f"{role} {name!r} is not a column of the DataFrame; its columns are {list(fields)[:20]}")
    t = fields[name]
    type_name = t.typeName()
    if type_name in _NUMERIC:
        return "scalar", type_name in ("byte", "short", "integer", "long")
    if type_name == "array" and t.elementType.typeName() in _NUMERIC:
        return "array", False
    if type_name == "vector" or type(t).__name__ == "VectorUDT":
        return "vector", False
    raise TypeError(f"{role} {name!r} has type {t.simpleString()}, not numeric; allowed are {_ALLOWED}")


def _row_values(value, kind, name):
    if kind == "scalar":
        return np.asarray([value], np.float64)
    if kind == "vector":
        return value.toArray()  # dense and sparse vectors alike
    return np.asarray(value, np.float64)


def _stack(rows, name):
    widths = {len(r) for r in rows}
    if len(widths) > 1:
        raise ValueError(f"column {name!r} holds arrays of different lengths {sorted(widths)[:5]}: a ragged column "
                         "cannot be stacked into examples; give every row the same length")
    return np.stack(rows)


def _weight(value, name):
    w = float(value) if value is not None else float("nan")
    if not w >= 0:
        raise ValueError(f"weightCol {name!r} holds {value}: sample weights must be non-negative numbers")
    return w


def _datasets(rows, features_col, label_col, fkind, lkind, class_ids, weight_col=None):
    """Runs on an executor: the partition's rows as DataSets of up to ``_ROWS_PER_DATASET`` examples
    (the weights, where a weight column is named, as each DataSet's labels mask)."""
    from dlspark import DataSet

    xs, ys, ws = [], [], []

    def flush():
        x = _stack(xs, features_col).astype(np.float32)
        y = _stack(ys, label_col)
        y = y[:, 0].astype(np.int32) if class_ids else y.astype(np.float32)
        w = np.asarray(ws, np.float32) if weight_col is not None else None
        xs.clear()
        ys.clear()
        ws.clear()
        return DataSet(x, y, labels_mask=w)

    for row in rows:
        xs.append(_row_values(row[features_col], fkind, features_col))
        ys.append(_row_values(row[label_col], lkind, label_col))
        if weight_col is not None:
            ws.append(_weight(row[weight_col], weight_col))
        if len(xs) == _ROWS_PER_DATASET:
            yield flush()
    if xs:
        yield flush()


def dataframe_datasets(df, features_col, label_col, class_ids=None, softmax=False, weight_col=None):
    """An RDD of DataSets from the columns ``features_col`` and ``label_col`` of the Spark DataFrame ``df``.

    Parameters
    ----------
    df : pyspark.sql.DataFrame
    features_col, label_col : str
        Column names (Spark ML's ``featuresCol`` and ``labelCol``).
    class_ids : bool, optional
        Labels as integer class ids (a label column of class indices, as Spark ML
        writes them, for ``softmax_cross_entropy``); by default, where the label
        column is a number and of an integer type or ``softmax`` is true.
    softmax : bool
        The network's loss takes class ids (a softmax loss).
    weight_col : str, optional
        A numeric column of non-negative per-example weights (Spark ML's ``weightCol``):
        each minibatch's loss is ``sum(w * loss) / sum(w)``, so that a row of weight 0
        has no effect on the fit.

    Raises
    ------
    ValueError
        A column that is not in the DataFrame (checked on the driver, from the schema).
    TypeError
        A column that is not numeric.
    """
    if not is_spark_dataframe(df):
        raise TypeError(f"df must be a pyspark.sql DataFrame, got {type(df).__name__}")
    for name, what in ((features_col, "featuresCol"), (label_col, "labelCol")):
        if not isinstance(name, str):
            raise TypeError(f"{what} must be a column name, got {name!r}")
    fkind, _ = _kind(df, features_col, "featuresCol")
    lkind, integer = _kind(df, label_col, "labelCol")
    if weight_col is not None:
        if not isinstance(weight_col, str):
            raise TypeError(f"weightCol must be a column name, got {weight_col!r}")
        if _kind(df, weight_col, "weightCol")[0] != "scalar":
            raise TypeError(f"weightCol {weight_col!r} must hold one number a row (a sample weight)")
    ids = lkind == "scalar" and (integer or softmax) if class_ids is None else bool(class_ids)
    if ids and lkind != "scalar":
        raise ValueError(f"class_ids=True needs a label column of numbers, got {lkind}s in {label_col!r}")
    cols = tuple(dict.fromkeys((features_col, label_col) + ((weight_col,) if weight_col is not None else ())))
    return df.select(*cols).rdd.mapPartitions(
        lambda rows: _datasets(rows, features_col, label_col, fkind, lkind, ids, weight_col))


def keyed_dataframe(df, key_col, features_col):
    """A pair RDD of ``(key, features of one example)`` from a DataFrame's key and feature columns:
    what ``feedForwardWithKey`` takes."""
    if not is_spark_dataframe(df):
        raise TypeError(f"df must be a pyspark.sql DataFrame, got {type(df).__name__}")
    fields = [f.name for f in df.schema.fields]
    if key_col not in fields:
        raise ValueError(f"keyCol {key_col!r} is not a column of the DataFrame; its columns are {fields[:20]}")
    fkind, _ = _kind(df, features_col, "featuresCol")
    return df.select(key_col, features_col).rdd.map(
        lambda row: (row[key_col], _row_values(row[features_col], fkind, features_col).astype(np.float32)))
