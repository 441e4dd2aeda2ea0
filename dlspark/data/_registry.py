"""The data-source registry: the one place that turns what a user passes into minibatches.

A :class:`Source` recognises one kind of input (:meth:`Source.accepts`) and
serves the uses it implements: a distributed fit (:meth:`Source.fit_refs`),
distributed evaluation (:meth:`Source.eval_parts`), a local fit
(:meth:`Source.local_batches`) and scoring (:meth:`Source.examples`).
Sources are tried in registry order; the first that implements the use and
accepts the input serves it. :func:`register_source` plugs in a new kind of
input (a pyspark RDD, say) without editing the trainer or the network.
:func:`~dlspark.data.load_ref` (:mod:`dlspark.data._refs`) resolves any minibatch reference on a worker: a file URL, a
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

from dataclasses import dataclass
from typing import Any, Callable

import fsspec
import numpy as np

from ._files import list_minibatches

__all__ = ["Source", "SourceContext", "Minibatches", "register_source", "unregister_source", "fit_minibatches",
           "path_minibatches", "evaluation_parts", "local_batches", "in_memory_examples", "keyed_items", "keyed_features",
           "reject_memory", "check_unique", "is_dask_collection"]

_APPROACHES = ("export", "direct")


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

