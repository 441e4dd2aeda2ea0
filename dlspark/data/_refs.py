"""Resolving one minibatch reference on a worker: a file URL, a ``(key, index)`` pair of data
in a worker's memory, or in-memory data (:func:`load_ref`)."""

from __future__ import annotations

import numpy as np

from ._dataset import DataSet, MultiDataSet, as_dataset
from ._files import load_minibatch

__all__ = ["load_ref"]

_DATASETS = (DataSet, MultiDataSet)


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

