"""Data sources: the one place that turns what a user passes into minibatches.

A :class:`Source` recognises one kind of input (:meth:`Source.accepts`) and
serves the uses it implements: a distributed fit (:meth:`Source.fit_refs`),
distributed evaluation (:meth:`Source.eval_parts`), a local fit
(:meth:`Source.local_batches`) and scoring (:meth:`Source.examples`).
Sources are tried in registry order; the first that implements the use and
accepts the input serves it. :func:`register_source` plugs in a new kind of
input (a pyspark RDD, say) without editing the trainer or the network.
:func:`load_ref` resolves any minibatch reference on a worker: a file URL, a
``(key, index)`` pair of data in a worker's memory, or an in-memory DataSet.

Examples
--------
>>> class Columns(Source):
...     description = "a dict of 'x' and 'y' arrays"
...     def accepts(self, data):
...         return isinstance(data, dict) and set(data) == {"x", "y"}
...     def fit_refs(self, data, ctx):
...         return fit_minibatches(DataSet(data["x"], data["y"]), ctx)
>>> register_source(Columns())  # doctest: +SKIP
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import fsspec
import numpy as np

from ..io import url_join
from ._dataset import DataSet, MultiDataSet, as_dataset
from ._files import list_minibatches, load_minibatch, save_dataset

__all__ = ["Source", "SourceContext", "Minibatches", "register_source", "unregister_source", "fit_minibatches",
           "path_minibatches", "evaluation_parts", "local_batches", "in_memory_examples", "keyed_items", "keyed_features",
           "load_ref", "reject_memory", "check_unique", "is_dask_collection"]

_APPROACHES = ("export", "direct")
_DATASETS = (DataSet, MultiDataSet)


# -- what a source is given and what it returns ------------------------------------
@dataclass(frozen=True)
class SourceContext:
    """What a source needs to turn input into minibatch references on a cluster.

    Parameters
    ----------
    client : distributed.Client, optional
        Where direct minibatches are scattered and export tasks run.
    batch_size : int
        Examples per minibatch (a master's ``batch_size_per_worker``).
    training_approach : {"export", "direct"}
        ``"export"`` writes minibatch files that workers read; ``"direct"``
        keeps minibatches in workers' memory.
    export_dir : callable, optional
        ``() -> directory URL``: a fresh directory for one export; needed
        when ``training_approach="export"``.
    storage_options : dict, optional
        fsspec options for reading file URLs and for writing exports.
    loader : callable, optional
        ``url -> DataSet`` for files in another format.
    """

    client: Any = None
    batch_size: int = 32
    training_approach: str = "export"
    export_dir: Callable[[], str] | None = None
    storage_options: dict | None = None
    loader: Callable | None = None

    def __post_init__(self):
        bs = self.batch_size
        if isinstance(bs, bool) or not isinstance(bs, (int, np.integer)) or bs < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {bs!r}")
        if self.training_approach not in _APPROACHES:
            raise ValueError(f"training_approach must be one of {_APPROACHES}, got {self.training_approach!r}")
        for name in ("export_dir", "loader"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise TypeError(f"{name} must be a callable or None, got {type(getattr(self, name)).__name__}")


@dataclass(frozen=True)
class Minibatches:
    """The minibatch references of one fit.

    Parameters
    ----------
    refs : list
        One reference per minibatch: a file URL or a ``(key, index)`` pair.
    partitions : list of int
        The input partition each minibatch came from (0 for unpartitioned input).
    keep : object, optional
        Futures to hold alive for the length of the fit (direct minibatches), or None.
    """

    refs: list
    partitions: list
    keep: object = None

    def __post_init__(self):
        if len(self.refs) != len(self.partitions):
            raise ValueError(f"refs and partitions must have one entry per minibatch, got {len(self.refs)} "
                             f"refs and {len(self.partitions)} partitions")


# -- the registry ------------------------------------------------------------------
class Source:
    """One kind of input: recognise it, and turn it into minibatches for the uses it serves.

    Subclass it, set :attr:`description` (it completes "fit takes ..." in the
    error for unsupported input), implement :meth:`accepts` and the methods
    of the uses the source serves; a method left as the base's is a use the
    source does not serve, and the registry passes over it for that use.
    """

    #: What this source takes, as an error message lists it ("a pair of dask arrays").
    description = "an unnamed source"

    def accepts(self, data) -> bool:
        """Whether ``data`` is this source's kind of input."""
        raise NotImplementedError

    def fit_refs(self, data, ctx: SourceContext) -> Minibatches:
        """Minibatch references for a distributed fit."""
        raise NotImplementedError

    def eval_parts(self, data, ctx: SourceContext, n_parts: int) -> tuple:
        """``(kind, parts)`` for distributed evaluation: kind ``"refs"`` (each part a list of
        references, or of futures of DataSets) or ``"delayed"`` (each part a Dask delayed list)."""
        raise NotImplementedError

    def local_batches(self, data, batch_size: int, epochs: int) -> tuple:
        """``(minibatches, are_urls)`` for a local fit in this process."""
        raise NotImplementedError

    def examples(self, data):
        """All examples, in order, as one DataSet or MultiDataSet (scoring)."""
        raise NotImplementedError


_SOURCES: list = []

#: How each use names itself in the error for input that no source serves, and what it adds.
_USE_NAMES = {"fit_refs": "fit", "eval_parts": "evaluation", "local_batches": "fit", "examples": "score_examples"}
_USE_HINTS = {"fit_refs": "; for minibatch files (a URL, a glob or a list of URLs) use fit_paths"}


def register_source(source: Source, first: bool = True) -> Source:
    """Add a data source to the registry; returns ``source``.

    Parameters
    ----------
    source : Source
        An instance of a :class:`Source` subclass.
    first : bool
        Try it before the built-in sources (default), or after them.
    """
    if not isinstance(source, Source):
        raise TypeError(f"source must be an instance of a dlspark.data.Source subclass, got {type(source).__name__}")
    if first:
        _SOURCES.insert(0, source)
    else:
        _SOURCES.append(source)
    return source


def unregister_source(source: Source) -> None:
    """Remove ``source``, an instance that :func:`register_source` added."""
    if source not in _SOURCES:
        raise ValueError(f"source {source!r} is not registered")
    _SOURCES.remove(source)


def _serves(source, use):
    return getattr(type(source), use) is not getattr(Source, use)


def _source_for(use, data):
    for source in list(_SOURCES):
        if _serves(source, use) and source.accepts(data):
            return source
    takes = [s.description for s in _SOURCES if _serves(s, use)]
    listing = ", ".join(takes[:-1]) + " or " + takes[-1] if len(takes) > 1 else "".join(takes)
    raise TypeError(f"{_USE_NAMES[use]} takes {listing}; got {type(data).__name__}{_USE_HINTS.get(use, '')}")


# -- the uses ------------------------------------------------------------------------
def fit_minibatches(data, ctx: SourceContext) -> Minibatches:
    """:class:`Minibatches` for a distributed fit of ``data``: a DataSet, a MultiDataSet, a
    ``(features, labels)`` pair, a list of DataSets, a pair of dask arrays, a dask bag of
    DataSets, or anything a registered source accepts; ``ctx`` is a :class:`SourceContext`."""
    source = _source_for("fit_refs", data)
    out = source.fit_refs(data, ctx)
    if not isinstance(out, Minibatches):
        raise TypeError(f"{type(source).__name__}.fit_refs must return Minibatches, got {type(out).__name__}")
    return out


def evaluation_parts(data, ctx: SourceContext, n_parts: int) -> tuple:
    """Split evaluation input into at most about ``n_parts`` parts.

    Parameters
    ----------
    data : DataSet, (features, labels), list of DataSets, URL/glob/list of URLs, pair of dask arrays or dask bag
    ctx : SourceContext
        Its client scatters in-memory parts; its storage options list files.
    n_parts : int

    Returns
    -------
    tuple
        ``(kind, parts)``: kind ``"refs"`` (each part a list of references
        or futures of DataSets, for ``client.submit``) or ``"delayed"`` (each
        part a Dask delayed list of examples, for ``client.compute``).
    """
    source = _source_for("eval_parts", data)
    kind, parts = source.eval_parts(data, ctx, max(1, int(n_parts)))
    if kind not in ("refs", "delayed"):
        raise ValueError(f"{type(source).__name__}.eval_parts must return kind 'refs' or 'delayed', got {kind!r}")
    return kind, parts


def local_batches(data, batch_size: int, epochs: int) -> tuple:
    """``(minibatches, are_urls)`` for a local fit or score.

    A DataSet (or pair) is cut into batches of ``batch_size``; a list of
    DataSets is used as it is; URLs and globs name files (``are_urls``); an
    iterator is returned as it is and can be consumed once (``epochs == 1``).
    """
    return _source_for("local_batches", data).local_batches(data, batch_size, epochs)


def in_memory_examples(data):
    """All of ``data``'s examples, in order, as one DataSet or MultiDataSet (scoring)."""
    return _source_for("examples", data).examples(data)


def path_minibatches(paths, storage_options: dict | None = None) -> list:
    """The minibatch file URLs (``fit_paths``) of a glob, a directory URL or a list of
    URLs, listed with fsspec ``storage_options``; refuses ``memory://``, which worker
    processes cannot read."""
    for p in [paths] if isinstance(paths, str) else paths if isinstance(paths, (list, tuple)) else ():
        reject_memory(str(p), "path")
    return list_minibatches(paths, **(storage_options or {}))


def reject_memory(url: str, what: str) -> None:
    """Refuse a ``memory://`` URL, which worker processes cannot read; ``what`` names
    the parameter in the message (``"export_directory"``)."""
    if (fsspec.core.split_protocol(url)[0] or "file") == "memory":
        raise ValueError(
            f"{what} {url!r} is on memory://, which lives inside one process and cannot be read by "
            "worker processes; use a local directory, a shared file system or an object store "
            "(file://, s3://, ...)"
        )


def check_unique(keys, what: str) -> None:
    """Refuse a duplicate key in ``keys`` (``what`` names them in the message)."""
    seen = set()
    for k in keys:
        if k in seen:
            raise ValueError(f"duplicate key {k!r} in {what}; keys must be unique")
        seen.add(k)


def is_dask_collection(x) -> bool:
    """Whether ``x`` is a Dask collection (array, bag, dataframe, delayed)."""
    import dask

    return dask.is_dask_collection(x)


# -- keyed inputs (keyed inference and scoring) -----------------------------------------
def keyed_items(data, of: str = "features"):
    """Recognise keyed input: ``(kind, items)``, or None when ``data`` is not keyed.

    ``kind`` is ``"dict"`` or ``"list"`` (``items`` a list of ``(key, value)``
    pairs, keys checked unique) or ``"bag"`` (``items`` a dask bag of pairs).
    ``of`` says what the values are: ``"features"`` (keyed inference; a dask
    bag counts too) or ``"examples"`` (scoring: DataSets, so a list of
    ``(array, array)`` pairs is a list of examples, not keyed input).
    """
    if isinstance(data, dict):
        return "dict", list(data.items())
    if of == "features" and is_dask_collection(data):
        return "bag", data
    if not isinstance(data, list) or not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in data):
        return None
    if of == "examples" and (not data or isinstance(data[0][1], np.ndarray)):
        return None
    check_unique([k for k, _ in data], f"keyed {of}")
    return "list", data


def keyed_features(data):
    """:func:`keyed_items` of keyed inference's input, or a TypeError naming what it takes."""
    keyed = keyed_items(data)
    if keyed is None:
        raise TypeError("keyed features must be a dict, a list of (key, array) pairs or a dask bag, "
                        f"got {type(data).__name__}")
    return keyed


# -- resolving one reference on a worker ------------------------------------------------
def _is_key_ref(ref):
    # Dask keys are strings or tuples; an in-memory (features, labels) pair holds arrays.
    return (isinstance(ref, tuple) and len(ref) == 2 and isinstance(ref[0], (str, tuple))
            and (ref[1] is None or isinstance(ref[1], (int, np.integer))))


def load_ref(ref, loader=None, storage_options: dict | None = None, worker=None):
    """Load one minibatch reference into a DataSet or MultiDataSet (runs on a worker).

    Parameters
    ----------
    ref : str, (key, index), DataSet or (features, labels)
        A file URL; a Dask key held in worker memory and the minibatch's
        index in it (None: the value is the minibatch); or in-memory data.
    loader : callable, optional
        ``url -> DataSet`` for URLs; default: the ``.npz`` minibatch format.
    storage_options : dict, optional
        fsspec options for URLs read without a loader.
    worker : distributed.Worker, optional
        Needed for ``(key, index)`` references. Called from a thread other
        than the worker's event loop: a key this worker lacks is fetched
        from a peer through that loop.
    """
    if isinstance(ref, str):
        if loader is not None:
            return as_dataset(loader(ref), f"the loader's result for {ref!r}")
        return load_minibatch(ref, **(storage_options or {}))
    if isinstance(ref, _DATASETS):
        return ref
    if _is_key_ref(ref):
        if worker is None:
            raise ValueError(f"the reference {ref!r} names data in a Dask worker's memory; pass worker=...")
        from distributed.utils import sync

        key, index = ref
        data = worker.data.get(key) if key in worker.data else None
        if data is None:
            data = sync(worker.loop, _fetch_key, worker, key)
        return data[index] if index is not None else data
    if isinstance(ref, tuple):
        return as_dataset(ref, "an in-memory minibatch reference")
    raise TypeError(f"a minibatch reference must be a file URL, a (key, index) pair with the worker, a DataSet "
                    f"or a (features, labels) pair, got {type(ref).__name__}")


async def _fetch_key(worker, key):
    from distributed.worker import get_data_from_worker

    holders = await worker.scheduler.who_has(keys=[key])
    for addr in holders.get(key, []):
        try:
            resp = await get_data_from_worker(worker.rpc, [key], addr, who=worker.address)
            if resp.get("status") == "OK" and key in resp["data"]:
                return resp["data"][key]
        except OSError:  # that holder is gone; another may still have it
            continue
    raise RuntimeError(f"minibatch {key!r} is held by no live worker")


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
