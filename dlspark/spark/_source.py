"""Training input from Spark: :class:`SparkRDDSource`, registered in the data-source registry.

``DistributedTrainer.fit(rdd)`` trains on the Dask cluster from an RDD of
DataSets, MultiDataSets or minibatch file paths. With the export approach the
Spark executors cut their partitions into minibatch files (DL4J's Export:
``mapPartitions`` writing ``batch_size`` examples a file); an RDD of paths is
read on the driver as strings only. The direct approach collects the
minibatches to the driver and scatters them to the Dask workers, and is refused
above a size limit (:func:`direct_limit`).
"""

from __future__ import annotations

import re
from functools import partial

import numpy as np

from ..data import fit_minibatches, register_source, save_dataset
from ..data._registry import Minibatches, Source
from ..data._sources import _export_directory
from ..io import url_join
from ._environment import check_executors
from ._common import _DATASETS, _FIT_KINDS, BadElementError, _bad, _guarded, _raise_failures, is_rdd

__all__ = ["SparkRDDSource", "collect_paths", "export_minibatches", "direct_minibatches", "direct_limit",
           "DIRECT_MAX_BYTES"]

#: Default of the ``dlspark.spark.direct-max-bytes`` setting: the most data (raw array
#: bytes) the direct approach collects to the driver. The limit applied is the smaller of
#: it and ``spark.driver.maxResultSize``.
DIRECT_MAX_BYTES = "128MiB"


# -- training input ------------------------------------------------------------------------
def _path_items(what, iterator):
    for x in iterator:
        if not isinstance(x, str):
            raise _bad(what, "minibatch file paths (str)", x)
        yield x


def _paths_partition(what, iterator):
    """Runs on an executor: a partition's path strings (an element of another kind fails)."""
    return _guarded(_path_items(what, iterator))


def collect_paths(rdd, what: str = "fitPaths") -> list:
    """The path strings of an RDD of minibatch file paths, collected to the driver (only the
    strings: no file is read here). ``what`` names the call in the error for other elements.

    The partitions are coalesced to one task per core first: a Python task costs about
    0.1 s here whatever it holds, and a list of paths is light. A persisted RDD
    (``cache()``/``persist()``, as for an RDD that every epoch's ``fitPaths`` reads)
    is collected once: Spark keeps its contents, so the strings are kept with it
    until it is unpersisted.
    """
    check_executors(rdd.context)
    kept = rdd.__dict__.get("_dlspark_paths") if rdd.is_cached else None
    if kept is not None:
        return list(kept)
    tasks = max(1, min(rdd.getNumPartitions(), rdd.context.defaultParallelism))
    paths = _raise_failures(rdd.coalesce(tasks).mapPartitions(partial(_paths_partition, what)).collect())
    if rdd.is_cached:
        rdd._dlspark_paths = tuple(paths)
    return paths


def _export_items(directory, batch_size, index, iterator):
    """Cut one partition into minibatch files of ``batch_size`` examples, across its DataSets.

    Yields ``(kind, partition, url)``: kind ``"str"`` passes a path element through
    unchanged, ``"DataSet"``/``"MultiDataSet"`` names a file written here.
    """
    pending, held, kind, n = [], 0, None, 0

    def write(ds):
        nonlocal n
        url = save_dataset(ds, url_join(directory, f"p{index:05d}_{n:06d}.npz"))
        n += 1
        return (kind, index, url)

    for x in iterator:
        if isinstance(x, str):
            yield ("str", index, x)
            continue
        if not isinstance(x, _DATASETS):
            raise _bad("fit", _FIT_KINDS, x)
        if kind is not None and type(x).__name__ != kind:
            raise BadElementError(f"fit takes an RDD of one kind of element; found both {kind} and "
                                  f"{type(x).__name__} in partition {index}")
        kind = type(x).__name__
        pending.append(x)
        held += len(x)
        if held >= batch_size:
            merged = type(x).merge(pending)
            full = held - held % batch_size
            for b in merged[:full].batches(batch_size):
                yield write(b)
            pending = [merged[full:]] if full < held else []
            held -= full
    if pending and held:
        yield write(type(pending[0]).merge(pending))


def _export_partition(directory, batch_size, index, iterator):
    """Runs on a Spark executor: DL4J's Export, one partition's minibatch files."""
    return _guarded(_export_items(directory, batch_size, index, iterator))


def _minibatches_of(tagged, what):
    kinds = {k for k, _, _ in tagged}
    if not tagged:
        raise ValueError(f"{what}: the RDD holds no examples")
    if len(kinds) > 1:
        raise TypeError(f"{what} takes an RDD of one kind of element ({_FIT_KINDS}); found {sorted(kinds)}")
    return Minibatches([u for _, _, u in tagged], [p for _, p, _ in tagged])


def export_minibatches(rdd, directory: str, batch_size: int) -> Minibatches:
    """Have the executors write the RDD's examples as minibatch files of ``batch_size``
    examples under ``directory`` (DL4J's Export); only the files' URLs reach the driver.

    An RDD of paths is returned as it is (its strings collected; nothing is written).
    Each minibatch keeps the RDD partition it came from.
    """
    check_executors(rdd.context)
    f = partial(_export_partition, directory, batch_size)
    return _minibatches_of(_raise_failures(rdd.mapPartitionsWithIndex(f).collect()), "fit")


def _spark_bytes(text) -> int:
    """Bytes of a Spark size setting (``"1g"``, ``"512m"``; binary units); 0 means unlimited."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmgtp]?)i?b?\s*", str(text).lower())
    if not m:
        return 0
    return int(m.group(1)) * 1024 ** " kmgtp".index(m.group(2) or " ")


def direct_limit(sc) -> int:
    """The most array bytes the direct approach collects to the driver: the smaller of the
    ``dlspark.spark.direct-max-bytes`` setting (default :data:`DIRECT_MAX_BYTES`) and the
    context's ``spark.driver.maxResultSize`` (Spark refuses larger collects anyway)."""
    import dask.config
    from dask.utils import parse_bytes

    setting = dask.config.get("dlspark.spark.direct-max-bytes", DIRECT_MAX_BYTES)
    limit = parse_bytes(setting) if isinstance(setting, str) else int(setting)
    spark = _spark_bytes(sc.getConf().get("spark.driver.maxResultSize", "1g"))
    return min(limit, spark) if spark > 0 else limit


def _nbytes(ds) -> int:
    return int(sum(np.asarray(a).nbytes for a in ds.to_arrays().values()))


def _describe_partition(iterator):
    """Runs on an executor: ``(kinds, array bytes)`` of one partition."""
    return _guarded(_describe_items(iterator))


def _describe_items(iterator):
    kinds, size = set(), 0
    for x in iterator:
        if isinstance(x, str):
            kinds.add("str")
        elif isinstance(x, _DATASETS):
            kinds.add(type(x).__name__)
            size += _nbytes(x)
        else:
            raise _bad("fit", _FIT_KINDS, x)
    yield (sorted(kinds), size)


def _rebatch_partition(batch_size, iterator):
    """Runs on an executor: one partition's DataSets as minibatches of ``batch_size``."""
    items = list(iterator)
    return type(items[0]).merge(items).batches(batch_size) if items else []


def direct_minibatches(rdd, ctx) -> Minibatches:
    """The direct approach: collect the RDD's minibatches to the driver and scatter them to
    the Dask workers (``ctx``, a SourceContext, gives the client and batch size).

    Refused with a ``ValueError`` when the RDD holds more than :func:`direct_limit` bytes of
    arrays: use the export approach for those. An RDD of paths trains from the paths.
    """
    check_executors(rdd.context)
    described = _raise_failures(rdd.mapPartitions(_describe_partition).collect())
    kinds = {k for ks, _ in described for k in ks}
    if kinds == {"str"}:
        paths = collect_paths(rdd, "fit")
        return Minibatches(paths, [0] * len(paths))
    if len(kinds) > 1:
        raise TypeError(f"fit takes an RDD of one kind of element ({_FIT_KINDS}); found {sorted(kinds)}")
    total, limit = sum(s for _, s in described), direct_limit(rdd.context)
    if total > limit:
        raise ValueError(
            f"the direct training approach collects the RDD to the driver and scatters it to the Dask "
            f"workers; this RDD holds {total / 2**20:.1f} MiB of arrays, above the limit of "
            f"{limit / 2**20:.1f} MiB (the smaller of dlspark.spark.direct-max-bytes and "
            "spark.driver.maxResultSize). Use the export approach (RDDTrainingApproach.Export, the "
            "default), where the executors write minibatch files, or raise dlspark.spark.direct-max-bytes")
    batches = rdd.mapPartitions(partial(_rebatch_partition, ctx.batch_size)).collect()
    if not batches:
        raise ValueError("fit: the RDD holds no examples")
    return fit_minibatches(batches, ctx)


class SparkRDDSource(Source):
    """A pyspark RDD of DataSets, MultiDataSets or minibatch file paths.

    Fit: the export approach has the executors write minibatch files (one
    Spark job; only URLs reach the driver); the direct approach collects and
    scatters, up to :func:`direct_limit`. Evaluation on the Dask cluster takes
    an RDD of paths; an RDD of DataSets is evaluated on the executors
    (:func:`do_evaluation`, or ``dlspark.compat``'s ``doEvaluation``).
    """

    description = "a pyspark RDD of DataSets or minibatch file paths"

    def accepts(self, data):
        return is_rdd(data)

    def fit_refs(self, data, ctx):
        if ctx.training_approach == "direct":
            return direct_minibatches(data, ctx)
        return export_minibatches(data, _export_directory(ctx), ctx.batch_size)

    def eval_parts(self, data, ctx, n_parts):
        what = ("evaluation on the Dask cluster (an RDD of DataSets is evaluated on the Spark executors: "
                "dlspark.compat.SparkDl4jMultiLayer(sc, network, None).doEvaluation(rdd, 64, ...))")
        paths = collect_paths(data, what)
        return "refs", [paths[i::n_parts] for i in range(min(n_parts, len(paths)))]


register_source(SparkRDDSource())
