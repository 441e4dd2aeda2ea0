"""Worker-side functions for distributed evaluation, keyed inference and scoring.

Module-level and picklable; each worker process rebuilds (and compiles) a
network once per token and reuses it for every task that names the token.
"""

from __future__ import annotations

import copy
import threading
from concurrent.futures import ThreadPoolExecutor

import cloudpickle
import numpy as np

__all__ = ["network_blob", "evaluate_part", "predict_part", "score_part", "merge_evaluations"]

_CACHE: dict = {}
_LOCK = threading.Lock()
_MAX_CACHED = 4


def network_blob(network, token):
    """What a worker needs to rebuild ``network``: its definition and state (version ``token``), pickled once."""
    from .checkpoint import state_to_bytes

    return cloudpickle.dumps({"token": token, "network": network.token, "definition": network.definition(),
                              "state": state_to_bytes(network.state)})


def _network(blob):
    """The worker's copy of a network at the blob's state version.

    One compiled copy per network (its token): a new state version (after a
    fit, say) only swaps the arrays in, so evaluation after each epoch does not
    compile again.
    """
    d = cloudpickle.loads(blob) if isinstance(blob, (bytes, bytearray)) else blob
    with _LOCK:
        entry = _CACHE.get(d["network"])
        if entry is None:
            from .network import Network

            if len(_CACHE) >= _MAX_CACHED:
                _CACHE.pop(next(iter(_CACHE)))
            entry = _CACHE[d["network"]] = {"net": Network.from_definition(d["definition"]), "states": {}}
        states = entry["states"]
        if d["token"] not in states:
            from .checkpoint import state_from_bytes

            if len(states) >= 2:
                states.pop(next(iter(states)))
            states[d["token"]] = state_from_bytes(d["state"], entry["net"].state)
        # A shallow copy shares the compiled steps (built here first, once) but
        # holds its own state, so concurrent tasks at different versions never
        # see each other's arrays.
        entry["net"].steps  # noqa: B018 - builds the jitted functions on the shared network
        view = copy.copy(entry["net"])
        view.state = states[d["token"]]
    return view


def _load(ref, loader, storage_options):
    from .data import as_dataset, load_minibatch

    if isinstance(ref, str):
        if loader is not None:
            return as_dataset(loader(ref), f"the loader's result for {ref!r}")
        return load_minibatch(ref, **(storage_options or {}))
    return as_dataset(ref)


def _batches(ds, batch_size):
    return ds.batches(batch_size) if batch_size and len(ds) > batch_size else [ds]


def evaluate_part(blob, refs, evaluations, batch_size, loader=None, storage_options=None, threads=1):
    """Fill copies of ``evaluations`` from the minibatches ``refs``; each file is read once."""
    net = _network(blob)
    evals = [copy.deepcopy(e) for e in evaluations]
    lock = threading.Lock()

    def one(ref):
        ds = _load(ref, loader, storage_options)
        for b in _batches(ds, batch_size):
            _, labels, fmask, lmask = b.jit_batch()
            out = net.output(b.features, features_mask=fmask)
            if isinstance(out, tuple):  # multi-output networks are evaluated on their first output
                out, labels, lmask = out[0], labels[0], lmask[0]
            with lock:
                for e in evals:
                    e.update(labels, out, lmask)

    if threads > 1:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(one, refs))
    else:
        for r in refs:
            one(r)
    return evals


def merge_evaluations(a, b):
    """Merge two lists of partial evaluations, element by element."""
    return [x.merge(y) for x, y in zip(a, b)]


def stack_examples(feats):
    """Stack per-example arrays (or tuples of arrays) into one batch."""
    if isinstance(feats[0], (tuple, list)):  # multi-input examples: stack each input
        return tuple(np.stack(col) for col in zip(*feats))
    return np.stack(feats)


def predict_stacked(blob, stacked, batch_size, fmask=None):
    """Outputs for a stacked block of examples (the keys stay with the caller)."""
    return _network(blob).output(stacked, batch_size=batch_size, features_mask=fmask)


def unstack_outputs(keys, out):
    if isinstance(out, tuple):
        return [(k, tuple(o[i] for o in out)) for i, k in enumerate(keys)]
    return [(k, out[i]) for i, k in enumerate(keys)]


def predict_part(blob, items, batch_size):
    """``[(key, features)] -> [(key, outputs)]`` (dask bag partitions)."""
    if not items:
        return []
    keys = [k for k, _ in items]
    return unstack_outputs(keys, predict_stacked(blob, stack_examples([f for _, f in items]), batch_size))


def score_part(blob, refs, batch_size, loader=None, storage_options=None):
    """Per-example losses of the minibatches ``refs`` (in order)."""
    net = _network(blob)
    return np.concatenate([net.score_examples(_load(r, loader, storage_options), batch_size) for r in refs])
