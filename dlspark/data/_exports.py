"""Exported minibatch files kept between fits of the same data, and removed at the end.

DL4J's users call ``fit`` once per epoch. Writing the same minibatch files again
for every call costs a full pass over the data; :class:`Exports` remembers what
each fit exported, keyed by the data's *content* (a Dask token of its arrays,
so an array changed in place is exported again), and a later fit of the same
data at the same batch size trains from the files already written. Every
directory it created, under a temporary directory or a user's
``export_directory``, is removed by :meth:`Exports.remove`. Temporary local
directories are also removed when the :class:`Exports` is garbage collected or
the interpreter exits (a trainer that was never closed leaves nothing in
``/tmp``); a user's ``export_directory`` is only ever cleared by ``remove``.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
import weakref

import fsspec

from ..io import url_join
from ._dataset import DataSet, MultiDataSet
from ._sources import fit_minibatches, is_dask_collection, reject_memory

__all__ = ["Exports", "content_token"]


def content_token(data):
    """A token naming ``data``'s content, or None for input that cannot be named cheaply
    (an iterator, an object some registered source accepts)."""
    from dask.base import tokenize

    def arrays(ds):
        return (type(ds).__name__, *ds.jit_batch())

    if isinstance(data, (DataSet, MultiDataSet)):
        return tokenize(arrays(data))
    if is_dask_collection(data) or (isinstance(data, tuple) and data and all(is_dask_collection(d) for d in data)):
        return tokenize(data)
    if isinstance(data, tuple) and len(data) in (2, 3, 4) and all(hasattr(d, "shape") or d is None for d in data):
        return tokenize(data)
    if isinstance(data, (list, tuple)) and data and all(isinstance(d, (DataSet, MultiDataSet)) for d in data):
        return tokenize([arrays(d) for d in data])
    return None


class Exports:
    """What a trainer exported: minibatch references by data content, and the directories."""

    def __init__(self):
        self._by_content: dict = {}
        self._dirs: list = []  # (url, is a local temporary directory, storage options)
        self._temporary: list = []  # local temporary directories, shared with the finalizer
        weakref.finalize(self, _remove_local, self._temporary)

    def directory(self, base: str | None, storage_options: dict | None = None) -> str:
        """A fresh directory for one export: a temporary local one, or one under ``base``
        (reached with fsspec ``storage_options``, which :meth:`remove` uses again)."""
        if base is None:
            d = tempfile.mkdtemp(prefix="dlspark-export-")
            self._dirs.append((d, True, None))
            self._temporary.append(d)
            return d
        reject_memory(base, "export_directory")
        d = url_join(base, uuid.uuid4().hex)
        self._dirs.append((d, False, dict(storage_options or {})))
        return d

    def minibatches(self, data, ctx, where=None):
        """``fit_minibatches(data, ctx)``, reusing the files of an earlier export of the same content
        to the same place (``where``: the export directory and its fsspec options)."""
        if ctx.training_approach != "export":
            return fit_minibatches(data, ctx)
        from dask.base import tokenize

        token = content_token(data)
        key = None if token is None else (token, ctx.batch_size, tokenize(where))
        if key is not None and key in self._by_content:
            return self._by_content[key]
        out = fit_minibatches(data, ctx)
        if key is not None:
            self._by_content[key] = out
        return out

    def remove(self):
        """Delete every directory this trainer exported to (what it wrote, nothing else)."""
        for d, local, options in self._dirs:
            if local:
                shutil.rmtree(d, ignore_errors=True)
                continue
            fs, path = fsspec.core.url_to_fs(d, **options)
            try:
                fs.rm(path, recursive=True)
            except FileNotFoundError:  # nothing was written there (an export that failed early)
                pass
        self._dirs = []
        self._temporary.clear()
        self._by_content = {}


def _remove_local(dirs):
    """The finalizer: remove the temporary local directories (it holds no reference to the Exports)."""
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    dirs.clear()
