"""Distributed evaluation, keyed inference and scoring.

The client-side halves (:func:`do_evaluation`, :func:`predict_with_keys`,
:func:`score_examples`) take a client and the future of a scattered
:func:`network_blob`; :class:`~dlspark.DistributedTrainer` delegates to them.
What the data is, and how it splits into parts, is
:mod:`dlspark.data._sources`' business. The worker-side functions are
module-level and picklable; each worker process keeps one compiled network per
network token (:mod:`dlspark._netcache`) and reads minibatches with
:func:`dlspark.data.load_ref`.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import cloudpickle
import numpy as np

from ._netcache import network_at
from .losses import output_probabilities
from .data._sources import SourceContext, evaluation_parts, in_memory_examples, keyed_items, load_ref
from .data._sources import keyed_features as require_keyed

__all__ = ["network_blob", "scatter_network", "do_evaluation", "predict_with_keys", "score_examples",
           "evaluate_part", "evaluate_dataset", "evaluation_outputs", "merge_evaluations", "predict_stacked", "predict_part", "score_part",
           "score_frame"]


# -- the network, as workers rebuild it ---------------------------------------------
def network_blob(network, version):
    """What a worker needs to rebuild ``network`` at state ``version``: its token, definition
    and the part of its state that inference reads (parameters and model state, not the
    updater's: a third of the bytes with Adam), pickled once."""
    from ._netcache import inference_part
    from .checkpoint import state_to_arrays

    return cloudpickle.dumps({"token": version, "network": network.token, "definition": network.definition(),
                              "state": state_to_arrays(inference_part(network.state))})


def scatter_network(client, network):
    """Broadcast ``network`` at its current state to every worker; returns the future."""
    return client.scatter(network_blob(network, uuid.uuid4().hex), broadcast=True, hash=False)


def _network(blob):
    d = cloudpickle.loads(blob) if isinstance(blob, (bytes, bytearray)) else blob
    return network_at(d["definition"], d["network"], d["token"], d["state"])


# -- evaluation ------------------------------------------------------------------------
def _check_evaluations(evaluations):
    from .evaluation import BaseEvaluation

    if not evaluations:
        raise TypeError("do_evaluation needs at least one evaluation, e.g. do_evaluation(data, 64, Evaluation())")
    bad = [type(e).__name__ for e in evaluations if not isinstance(e, BaseEvaluation)]
    if bad:
        raise TypeError(f"evaluations must be dlspark.evaluation objects, got {bad[0]}")


def do_evaluation(client, net_future, data, evaluations, batch_size, *, loader=None, storage_options=None,
                  threads=1, n_workers=1, output=None):
    """Fill ``evaluations`` in one pass over ``data`` on the cluster; returns them, in order.

    Parameters
    ----------
    client : distributed.Client
    net_future : distributed.Future
        Of :func:`network_blob` (see :func:`scatter_network`).
    data : object
        What :func:`dlspark.data.evaluation_parts` takes: a DataSet, a pair,
        a list of DataSets, minibatch file URLs, a pair of dask arrays, a bag.
    evaluations : sequence of dlspark.evaluation objects
        Filled in place from the merged partial evaluations.
    batch_size : int
        Examples per forward pass on the workers.
    loader, storage_options : optional
        How workers read file URLs.
    threads : int
        Minibatches each task evaluates at once.
    n_workers : int
        The data is split into ``2 * n_workers`` parts.
    output : int, optional
        Which output of a multi-output network to evaluate (against the labels of the
        same index); a multi-output network without it is refused.
    """
    _check_evaluations(evaluations)
    evaluations = list(evaluations)
    ctx = SourceContext(client, batch_size, storage_options=storage_options, loader=loader)
    kind, parts = evaluation_parts(data, ctx, max(1, 2 * n_workers))
    if output is not None and (isinstance(output, bool) or not isinstance(output, (int, np.integer)) or output < 0):
        raise ValueError(f"output must be an output index >= 0 or None, got {output!r}")
    # the parts fill blank copies: data already in an evaluation is counted once, here, not once a part
    args = ([e._blank() for e in evaluations], batch_size, loader, storage_options, threads, output)
    if kind == "refs":
        futures = [client.submit(evaluate_part, net_future, p, *args, pure=False) for p in parts]
    else:
        import dask

        futures = client.compute([dask.delayed(evaluate_part)(net_future, p, *args) for p in parts])
    if not futures:
        raise ValueError(f"evaluation data holds no examples (got an empty {type(data).__name__})")
    # A tree of pairwise merges on the workers: the client receives one list of evaluations.
    while len(futures) > 1:
        futures = [client.submit(merge_evaluations, futures[i], futures[i + 1], pure=False)
                   if i + 1 < len(futures) else futures[i] for i in range(0, len(futures), 2)]
    for target, result in zip(evaluations, futures[0].result()):
        target.merge(result)
    return evaluations


def _batches(ds, batch_size):
    return ds.batches(batch_size) if batch_size and len(ds) > batch_size else [ds]


def _one_output(out, labels, lmask, output):
    """The predictions, labels and label mask of the output evaluated."""
    if not isinstance(out, tuple):
        if output not in (None, 0):
            raise ValueError(f"output={output} but this network has one output; leave output out")
        return out, labels, lmask
    if output is None:
        raise ValueError(f"this network has {len(out)} outputs; evaluate one at a time with output=0 .. "
                         f"{len(out) - 1}, e.g. trainer.evaluate(data, output=1)")
    if output >= len(out):
        raise ValueError(f"output={output} but this network has {len(out)} outputs (0 .. {len(out) - 1})")
    return out[output], labels[output], None if lmask is None else lmask[output]


def evaluation_outputs(net, out, output=None):
    """The network's outputs ``out`` (of output ``output``) as its evaluations receive them:
    through the loss's output activation (softmax or sigmoid), so that thresholds, ROC
    histograms and calibration bins see probabilities, not logits."""
    loss = net._loss[output or 0] if isinstance(net._loss, tuple) else net._loss
    return output_probabilities(loss, out)


def evaluate_dataset(net, ds, evaluations, batch_size, output=None, lock=None):
    """Update ``evaluations`` in place with ``net``'s outputs on the DataSet ``ds``.

    The one evaluation path of every runtime (cluster workers, Spark executors,
    ParallelWrapper): forward passes of ``batch_size`` examples, the output
    ``output`` of a multi-output network, probabilities through the loss's output
    activation (:func:`evaluation_outputs`). ``lock`` guards the updates where
    several threads fill the same evaluations.
    """
    for b in _batches(ds, batch_size):
        _, labels, fmask, lmask = b.jit_batch()
        out = net.output(b.features, features_mask=fmask)
        out, labels, lmask = _one_output(out, labels, lmask, output)
        probs = evaluation_outputs(net, out, output)
        with lock if lock is not None else contextlib.nullcontext():
            for e in evaluations:
                e.update(labels, probs, lmask)


def evaluate_part(blob, refs, evaluations, batch_size, loader=None, storage_options=None, threads=1, output=None):
    """Runs on a worker: fill copies of ``evaluations`` from the minibatches ``refs``; each is read once."""
    net = _network(blob)
    evals = [copy.deepcopy(e) for e in evaluations]
    lock = threading.Lock()

    def one(ref):
        evaluate_dataset(net, load_ref(ref, loader, storage_options), evals, batch_size, output, lock)

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


# -- keyed inference -------------------------------------------------------------------
def predict_with_keys(client, net_future, keyed_features, batch_size, features_mask=None, workers=None):
    """Keyed outputs for keyed features, keyed as the input was (DL4J's ``feedForwardWithKey``).

    Parameters
    ----------
    client : distributed.Client
    net_future : distributed.Future
        Of :func:`network_blob`.
    keyed_features : dict, list of (key, array) pairs or dask bag of pairs
        A bag returns a bag; its keys are checked unique when it is computed.
    batch_size : int
    features_mask : dict, optional
        Key -> per-example mask.
    workers : list of str, optional
        Worker addresses that receive the blocks of examples; default: all.
    """
    kind, items = require_keyed(keyed_features)
    if kind == "bag":
        import dask
        import dask.bag as db

        parts = items.to_delayed()
        # One check over every partition's keys, which each output partition waits on: a key
        # repeated across partitions is refused as it is within one.
        unique = dask.delayed(_check_bag_keys)([dask.delayed(_keys_of)(p) for p in parts])
        masks = None if features_mask is None else client.scatter(dict(features_mask), broadcast=True, hash=False)
        return db.from_delayed([dask.delayed(predict_part)(net_future, part, batch_size, masks, unique)
                                for part in parts])
    if not items:
        return {} if kind == "dict" else []
    workers = list(workers or sorted(client.scheduler_info()["workers"]))
    # Keys stay here; workers get stacked blocks of examples and return blocks of
    # outputs (no per-example Python objects on the wire). Blocks go out as soon as
    # they are stacked, round robin, so workers compute while the rest is stacked.
    step = -(-len(items) // max(1, 4 * len(workers)))
    chunks = [items[i:i + step] for i in range(0, len(items), step)]
    futures = []
    for i, c in enumerate(chunks):
        block = stack_examples([f for _, f in c])
        mask = None if features_mask is None else np.stack([np.asarray(features_mask[k]) for k, _ in c])
        where = [workers[i % len(workers)]]
        [data] = client.scatter([block], workers=where, hash=False)
        futures.append(client.submit(predict_stacked, net_future, data, batch_size, mask, workers=where,
                                     allow_other_workers=True, pure=False))
    out = [pair for c, o in zip(chunks, client.gather(futures)) for pair in unstack_outputs([k for k, _ in c], o)]
    return dict(out) if kind == "dict" else out


def stack_examples(feats):
    """Stack per-example arrays (or tuples of arrays) into one batch."""
    if isinstance(feats[0], (tuple, list)):  # multi-input examples: stack each input
        return tuple(np.stack(col) for col in zip(*feats))
    return np.stack(feats)


def predict_stacked(blob, stacked, batch_size, fmask=None):
    """Runs on a worker: outputs for a stacked block of examples (the keys stay with the caller)."""
    return _network(blob).output(stacked, batch_size=batch_size, features_mask=fmask)


def unstack_outputs(keys, out):
    """``[(key, output)]`` from a block of outputs (a tuple per key for multi-output networks)."""
    if isinstance(out, tuple):
        return [(k, tuple(o[i] for o in out)) for i, k in enumerate(keys)]
    return [(k, out[i]) for i, k in enumerate(keys)]


def _keys_of(items):
    return [k for k, _ in items]


def _check_bag_keys(key_lists):
    from .data._sources import check_unique

    check_unique((k for keys in key_lists for k in keys), "the keyed features bag")
    return True


def predict_part(blob, items, batch_size, features_mask=None, _checked=None):
    """Runs on a worker: ``[(key, features)] -> [(key, outputs)]`` (dask bag partitions);
    ``features_mask`` maps keys to per-example masks (every key of the partition needs one)."""
    if not items:
        return []
    keys = [k for k, _ in items]
    mask = None
    if features_mask is not None:
        missing = [k for k in keys if k not in features_mask]
        if missing:
            raise KeyError(f"features_mask has no mask for key {missing[0]!r}; give one for every key")
        mask = np.stack([np.asarray(features_mask[k]) for k in keys])
    return unstack_outputs(keys, predict_stacked(blob, stack_examples([f for _, f in items]), batch_size, mask))


# -- scoring -----------------------------------------------------------------------------
def score_examples(client, net_future, data, batch_size, n_workers=1):
    """Per-example losses (DL4J's ``scoreExamples``).

    Parameters
    ----------
    client : distributed.Client
    net_future : distributed.Future
        Of :func:`network_blob`.
    data : DataSet, (features, labels), list of DataSets, or keyed examples
        Keyed examples (a dict or a list of ``(key, DataSet)`` pairs) return
        the same kind, keyed; anything else an array in example order.
    batch_size : int
    n_workers : int
        The examples are split into ``2 * n_workers`` contiguous parts.
    """
    from .data._frames import FrameColumns, _is_dask

    if isinstance(data, FrameColumns) and _is_dask(data.frame):
        return score_frame(net_future, data, batch_size)
    keyed = keyed_items(data, of="examples")
    if keyed is not None:
        return _score_keyed(client, net_future, keyed, batch_size, n_workers)
    ds = in_memory_examples(data)
    # contiguous parts, so that concatenation keeps example order
    step = max(1, -(-len(ds) // max(1, 2 * n_workers)))
    pieces = client.scatter([[ds[i:i + step]] for i in range(0, len(ds), step)], hash=False)
    futures = [client.submit(score_part, net_future, p, batch_size, pure=False) for p in pieces]
    return np.concatenate(client.gather(futures))


def score_frame(net_future, cols, batch_size):
    """Per-example losses of a dask frame's rows (:class:`~dlspark.data.FrameColumns` with labels),
    as a lazy dask Series named ``"score"`` with the frame's index and partitions: each partition is
    scored in a task where it lives, and nothing runs until the Series is computed or persisted."""
    import pandas as pd

    if cols.labels is None:
        raise ValueError("score_examples needs label columns: name them with labels=[...]")
    meta = pd.Series(np.zeros(0, np.float32), index=cols.frame._meta.index, name="score")
    return cols.frame.map_partitions(_score_frame_partition, net_future, cols.features, cols.labels, batch_size,
                                     meta=meta)


def _score_frame_partition(part, blob, features, labels, batch_size):
    """Runs on a worker: one partition's per-example losses, indexed as its rows."""
    import pandas as pd

    from .data import DataSet
    from .data._frames import frame_arrays

    if len(part) == 0:
        return pd.Series(np.zeros(0, np.float32), index=part.index, name="score")
    losses = _network(blob).score_examples(DataSet(*frame_arrays(part, features, labels)), batch_size)
    return pd.Series(np.asarray(losses, np.float32), index=part.index, name="score")


def _score_keyed(client, net_future, keyed, batch_size, n_workers):
    from .data import as_dataset

    kind, items = keyed
    if not items:
        return {} if kind == "dict" else []
    parts = [as_dataset(d, f"the examples of key {k!r}") for k, d in items]
    losses = score_examples(client, net_future, type(parts[0]).merge(parts), batch_size, n_workers)
    bounds = np.cumsum([0] + [len(d) for d in parts])
    # A key with one example scores as a float, a key with several as an array.
    vals = [losses[a:b] if b - a > 1 else float(losses[a]) for a, b in zip(bounds[:-1], bounds[1:])]
    pairs = list(zip([k for k, _ in items], vals))
    return dict(pairs) if kind == "dict" else pairs


def score_part(blob, refs, batch_size, loader=None, storage_options=None):
    """Runs on a worker: per-example losses of the minibatches ``refs`` (in order)."""
    net = _network(blob)
    return np.concatenate([net.score_examples(load_ref(r, loader, storage_options), batch_size) for r in refs])
