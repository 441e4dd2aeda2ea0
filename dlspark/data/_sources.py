"""The built-in data sources, and the helpers that cut input into minibatch files or
scatter it into worker memory (shared by sources that live elsewhere, such as the
pyspark adapter in :mod:`dlspark.spark`).

The registry and the :class:`Source` contract are :mod:`dlspark.data._registry`;
its names are re-exported here, where they were first defined. A new kind of input
is a new module beside this one that subclasses :class:`Source` and calls
:func:`register_source` (see ``docs/design/architecture.md``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from ..io import url_join
from ._dataset import DataSet, MultiDataSet, as_dataset
from ._files import list_minibatches, save_dataset
from ._refs import load_ref
from ._registry import (Minibatches, Source, SourceContext, check_unique, evaluation_parts, fit_minibatches,
                        in_memory_examples, is_dask_collection, keyed_features, keyed_items, local_batches,
                        path_minibatches, register_source, reject_memory, unregister_source)

__all__ = ["Source", "SourceContext", "Minibatches", "register_source", "unregister_source", "fit_minibatches",
           "path_minibatches", "evaluation_parts", "local_batches", "in_memory_examples", "keyed_items", "keyed_features",
           "load_ref", "reject_memory", "check_unique", "is_dask_collection", "DaskArraySource", "DaskBagSource",
           "UrlSource", "DataSetListSource", "InMemorySource", "IteratorSource"]

_DATASETS = (DataSet, MultiDataSet)


# -- built-in sources ---------------------------------------------------------------------
def _export_directory(ctx):
    if ctx.export_dir is None:
        raise ValueError("training_approach='export' needs SourceContext(export_dir=...), "
                         "a callable that returns a fresh directory URL")
    return ctx.export_dir()


#: files an export writes at once: each write ends with an fsync and a rename on a local
#: disk, or is a PUT on an object store, and waits rather than computes (400 minibatch files
#: of 160 KB took 0.50-0.63 s one at a time here, 0.35 s four at a time)
_EXPORT_THREADS = 4


def _save_all(batches, directory, prefix, storage_options=None) -> list:
    """Write ``batches`` as ``{prefix}_{i:06d}.npz`` under ``directory``, a few at a time;
    their URLs in order. The first write that fails raises."""
    opts = storage_options or {}

    def save(item):
        i, b = item
        return save_dataset(b, url_join(directory, f"{prefix}_{i:06d}.npz"), **opts)

    batches = list(batches)
    if len(batches) < 2:
        return [save(x) for x in enumerate(batches)]
    with ThreadPoolExecutor(min(_EXPORT_THREADS, len(batches)), thread_name_prefix="dlspark-export") as pool:
        return list(pool.map(save, enumerate(batches)))


def _export_partition(parts, directory, batch_size, prefix, storage_options=None):
    """Runs on a worker: cut one partition's examples into minibatch files."""
    parts = [as_dataset(p) for p in parts]
    if not parts:
        return []
    merged = type(parts[0]).merge(parts)
    return _save_all(merged.batches(batch_size), directory, prefix, storage_options)


def _export_arrays(x, y, directory, batch_size, prefix, storage_options=None):
    return _export_partition([DataSet(x, y)], directory, batch_size, prefix, storage_options)


def _batch_arrays(x, y, batch_size):
    return DataSet(x, y).batches(batch_size)


def _rebatch(parts, batch_size):
    parts = [as_dataset(p) for p in parts]
    return type(parts[0]).merge(parts).batches(batch_size) if parts else []


def _from_batches(batches, ctx):
    """Minibatches cut on the client: written to files (export) or scattered (direct)."""
    if ctx.training_approach == "export":
        refs = _save_all(batches, _export_directory(ctx), "batch", ctx.storage_options)
        return Minibatches(refs, [0] * len(refs))
    futures = ctx.client.scatter(list(batches), hash=False)
    return _direct(ctx, [(f, None) for f in futures], [0] * len(futures), futures)


def _direct(ctx, pairs, partitions, keep):
    # A second copy on another worker: a worker lost mid-fit leaves its minibatches readable.
    if len(ctx.client.scheduler_info()["workers"]) > 1:
        from ._replicas import keep_replicas

        futures = list({id(f): f for f, _ in pairs}.values())
        keep_replicas(ctx.client, [f.key for f in futures])  # before Dask's memory manager drops them
        ctx.client.replicate(futures, n=2)
    return Minibatches([(f.key, i) for f, i in pairs], partitions, keep)


def _gather_exports(ctx, tasks):
    per_part = ctx.client.gather(ctx.client.compute(tasks))
    refs = [u for urls in per_part for u in urls]
    parts = [i for i, urls in enumerate(per_part) for _ in urls]
    return Minibatches(refs, parts)


def _persist_direct(ctx, tasks):
    futures = ctx.client.compute(tasks)
    counts = ctx.client.gather(ctx.client.map(len, futures, pure=False))
    pairs = [(f, j) for f, c in zip(futures, counts) for j in range(c)]
    parts = [i for i, c in enumerate(counts) for _ in range(c)]
    return _direct(ctx, pairs, parts, futures)


def _scattered_parts(ctx, items, n_parts):
    parts = [items[i::n_parts] for i in range(min(n_parts, len(items)))]
    return "refs", [ctx.client.scatter(p, hash=False) for p in parts]


def _check_datasets(data, what, allow_empty=False):
    bad = [type(d).__name__ for d in data if not isinstance(d, _DATASETS)]
    if bad or not (data or allow_empty):
        raise TypeError(f"{what}, found {bad[0] if bad else 'nothing'}")


def _aligned_blocks(x, y):
    """Delayed row blocks of ``x`` and ``y``: each block holds whole examples (an array chunked
    along another axis is rechunked to one chunk there; its blocks would pair part of a row
    with another block's labels), and ``y`` is cut at ``x``'s rows where they differ."""
    def whole_rows(a):
        return a.rechunk({i: -1 for i in range(1, a.ndim)}) if any(len(c) > 1 for c in a.chunks[1:]) else a

    x, y = whole_rows(x), whole_rows(y)
    if x.chunks[0] != y.chunks[0]:
        y = y.rechunk({0: x.chunks[0]})
    return x.to_delayed().ravel(), y.to_delayed().ravel()


class DaskArraySource(Source):
    """A ``(features, labels)`` pair of dask arrays: one partition per row block."""

    description = "a pair of dask arrays"

    def accepts(self, data):
        return isinstance(data, tuple) and len(data) == 2 and all(is_dask_collection(d) for d in data)

    def fit_refs(self, data, ctx):
        import dask

        xs, ys = _aligned_blocks(*data)
        bs = ctx.batch_size
        if ctx.training_approach == "export":
            d = _export_directory(ctx)
            return _gather_exports(ctx, [dask.delayed(_export_arrays)(a, b, d, bs, f"p{i:05d}", ctx.storage_options)
                                         for i, (a, b) in enumerate(zip(xs, ys))])
        return _persist_direct(ctx, [dask.delayed(_batch_arrays)(a, b, bs) for a, b in zip(xs, ys)])

    def eval_parts(self, data, ctx, n_parts):
        import dask

        xs, ys = _aligned_blocks(*data)
        return "delayed", [[dask.delayed(DataSet)(a, b)] for a, b in zip(xs, ys)]


class DaskBagSource(Source):
    """A dask bag of DataSets (or pairs): one partition per bag partition, cut on the workers."""

    description = "a dask bag of DataSets"

    def accepts(self, data):
        return is_dask_collection(data)

    def fit_refs(self, data, ctx):
        import dask

        parts, bs = data.to_delayed(), ctx.batch_size
        if ctx.training_approach == "export":
            d = _export_directory(ctx)
            return _gather_exports(ctx, [dask.delayed(_export_partition)(p, d, bs, f"p{i:05d}", ctx.storage_options)
                                         for i, p in enumerate(parts)])
        return _persist_direct(ctx, [dask.delayed(_rebatch)(p, bs) for p in parts])

    def eval_parts(self, data, ctx, n_parts):
        return "delayed", list(data.to_delayed())


class UrlSource(Source):
    """Minibatch files: a URL, a glob, a directory or a list of URLs."""

    description = "minibatch file URLs (a URL, a glob or a list of URLs)"

    def accepts(self, data):
        return isinstance(data, str) or (isinstance(data, (list, tuple)) and bool(data)
                                         and all(isinstance(u, str) for u in data))

    def eval_parts(self, data, ctx, n_parts):
        refs = path_minibatches(data, ctx.storage_options)
        return "refs", [refs[i::n_parts] for i in range(min(n_parts, len(refs)))]

    def local_batches(self, data, batch_size, epochs):
        # A local fit reads in this process, so memory:// is fine here.
        return (list_minibatches(data) if isinstance(data, str) else list(data)), True


class DataSetListSource(Source):
    """A list of DataSets, used as the minibatches, in order."""

    description = "a list of DataSets"

    def accepts(self, data):
        return isinstance(data, list) or (isinstance(data, tuple) and bool(data) and isinstance(data[0], _DATASETS))

    def fit_refs(self, data, ctx):
        _check_datasets(data, "a list given to fit must hold DataSets (for file URLs use fit_paths)")
        return _from_batches(data, ctx)

    def eval_parts(self, data, ctx, n_parts):
        _check_datasets(data, "a list given for evaluation must hold DataSets or file URLs")
        return _scattered_parts(ctx, list(data), n_parts)

    def local_batches(self, data, batch_size, epochs):
        _check_datasets(data, "a list given to fit must hold DataSets (minibatches) or file URLs", allow_empty=True)
        return list(data), False

    def examples(self, data):
        _check_datasets(data, "a list given to score_examples must hold DataSets")
        return type(data[0]).merge(list(data))


class InMemorySource(Source):
    """One DataSet, MultiDataSet or ``(features, labels)`` pair, cut into minibatches."""

    description = "a DataSet, a MultiDataSet or a (features, labels) pair"

    def accepts(self, data):
        return isinstance(data, (DataSet, MultiDataSet, tuple))

    def fit_refs(self, data, ctx):
        return _from_batches(as_dataset(data, "fit's data").batches(ctx.batch_size), ctx)

    def eval_parts(self, data, ctx, n_parts):
        ds = as_dataset(data, "data")
        step = max(1, -(-len(ds) // n_parts))
        return _scattered_parts(ctx, [ds[i:i + step] for i in range(0, len(ds), step)], n_parts)

    def local_batches(self, data, batch_size, epochs):
        return as_dataset(data).batches(batch_size), False

    def examples(self, data):
        return as_dataset(data, "score_examples' data")


class IteratorSource(Source):
    """An iterator of minibatches for a local fit: read once, so for one epoch only."""

    description = "an iterator of minibatches (with epochs=1)"

    def accepts(self, data):
        return hasattr(data, "__iter__")

    def local_batches(self, data, batch_size, epochs):
        if hasattr(data, "shape") and hasattr(data, "dtype"):  # iterable too, row by row
            raise TypeError(f"fit got one array (shape {tuple(data.shape)}): pass features and labels together, "
                            "as (features, labels) or a DataSet, or a list of DataSets")
        if epochs != 1:
            raise ValueError("an iterator of minibatches can be consumed once: pass epochs=1 or a list")
        return data, False


for _source in (DaskArraySource(), DaskBagSource(), UrlSource(), DataSetListSource(), InMemorySource(),
                IteratorSource()):
    register_source(_source, first=False)
del _source
