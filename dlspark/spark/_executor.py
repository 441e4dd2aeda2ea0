"""Spark-side execution: evaluation, scoring and keyed inference where the RDD lives.

:func:`do_evaluation`, :func:`predict_with_keys`, :func:`score_examples` and
:func:`calculate_score` run in ``mapPartitions`` on the executors, with the
network broadcast once per state. Keys never leave Spark; keyed results keep the
input's partitioning; partial evaluations merge with the core's ``merge`` on the
executors (``treeReduce``). The executors rebuild the network as the Dask
workers do (:mod:`dlspark._inference`, :mod:`dlspark._netcache`).
"""

from __future__ import annotations

import uuid
import weakref
from functools import partial

import numpy as np

from .._inference import (_check_evaluations, _network, evaluate_part, merge_evaluations, network_blob,
                          stack_examples, unstack_outputs)
from ..data import MultiDataSet, load_ref
from ._environment import check_executors
from ._common import (_DATASETS, _FIT_KINDS, BadElementError, _bad, _Failure, _guarded, _probe, _raise_failures,
                      _type_name, clean_errors)

__all__ = ["broadcast_network", "do_evaluation", "predict_with_keys", "score_examples", "calculate_score"]


# -- the network on the executors ------------------------------------------------------------
#: network -> (SparkContext, state, Broadcast): one broadcast per network state.
_BROADCASTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def broadcast_network(sc, network):
    """``network`` at its current state, broadcast to the executors once.

    The same broadcast is returned while the network keeps that state (its
    train state is an immutable pytree that every fit replaces). Earlier
    broadcasts stay alive while RDDs computed from them do.
    """
    hit = _BROADCASTS.get(network)
    if hit is not None and hit[0] is sc and hit[1] is network.state:
        return hit[2]
    bc = sc.broadcast(network_blob(network, uuid.uuid4().hex))
    _BROADCASTS[network] = (sc, network.state, bc)
    return bc


def _executor_network(bc):
    """Runs on an executor: the broadcast network, compiled once per Python worker process."""
    import cloudpickle
    return _network(cloudpickle.loads(bc.value))


# -- evaluation ------------------------------------------------------------------------------
def _loaded(iterator, loader, what):
    for x in iterator:
        if isinstance(x, str):
            yield load_ref(x, loader)
        elif isinstance(x, _DATASETS):
            yield x
        else:
            raise _bad(what, _FIT_KINDS, x)


def _rebatched(datasets, batch_size):
    """Minibatches of ``batch_size`` examples across consecutive DataSets (the last may be smaller)."""
    pending, held = [], 0
    for ds in datasets:
        if pending and type(ds) is not type(pending[0]):
            raise BadElementError(f"found both {type(pending[0]).__name__} and {type(ds).__name__} "
                                  "elements in one partition; give one kind")
        pending.append(ds)
        held += len(ds)
        if held >= batch_size:
            merged = type(ds).merge(pending)
            full = held - held % batch_size
            yield from merged[:full].batches(batch_size)
            pending = [merged[full:]] if full < held else []
            held -= full
    if pending and held:
        yield type(pending[0]).merge(pending)


def _groups(items, size):
    group = []
    for x in items:
        group.append(x)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def _evaluate_items(bc, evaluations, batch_size, loader, threads, output, iterator):
    blob, acc, n = None, None, 0
    batches = _rebatched(_loaded(iterator, loader, "evaluation"), batch_size)
    for group in _groups(batches, 4 * max(1, threads)):
        if blob is None:
            import cloudpickle

            blob = cloudpickle.loads(bc.value)
        part = evaluate_part(blob, group, evaluations, batch_size, None, None, threads, output)
        acc = part if acc is None else merge_evaluations(acc, part)
        n += sum(len(b) for b in group)
    yield (n, acc)


def _evaluate_partition(bc, evaluations, batch_size, loader, threads, output, iterator):
    """Runs on an executor: ``(examples, partial evaluations)`` of one partition."""
    return _guarded(_evaluate_items(bc, evaluations, batch_size, loader, threads, output, iterator))


def _merge_partials(a, b):
    """Runs on executors (and, last, on the driver): merge two ``(examples, evaluations)``."""
    for x in (a, b):
        if isinstance(x, _Failure):
            return x
    if a[1] is None or b[1] is None:
        return (a[0] + b[0], a[1] if b[1] is None else b[1])
    return (a[0] + b[0], merge_evaluations(a[1], b[1]))


def do_evaluation(rdd, network, evaluations, batch_size: int = 64, threads: int = 1, loader=None, depth: int = 2,
                  output=None):
    """Fill ``evaluations`` in one pass over an RDD, on the Spark executors; returns them.

    Parameters
    ----------
    rdd : pyspark RDD of DataSet, MultiDataSet or minibatch file paths (str)
    network : Network
        Broadcast once (per state) to the executors.
    evaluations : sequence of dlspark.evaluation objects
        Filled in place with the merged result (as the core's ``do_evaluation``).
    batch_size : int
        Examples per forward pass; consecutive DataSets are merged up to it.
    threads : int
        Minibatches each task evaluates at once (DL4J's ``evalNumWorkers``).
    loader : callable, optional
        ``path -> DataSet`` for files in another format.
    depth : int
        Depth of the ``treeReduce`` that merges the partial evaluations on the executors.
    output : int, optional
        Which output of a multi-output network to evaluate (against the labels of the
        same index); a multi-output network without it is refused.
    """
    check_executors(rdd.context)
    evaluations = list(evaluations)
    _check_evaluations(evaluations)
    if rdd.getNumPartitions() == 0:
        raise ValueError("evaluation data holds no examples (an RDD without partitions)")
    bc = broadcast_network(rdd.context, network)
    # the partitions fill blank copies: data already in an evaluation is counted once, here
    f = partial(_evaluate_partition, bc, [e._blank() for e in evaluations], batch_size, loader, threads, output)
    result = rdd.mapPartitions(f).treeReduce(_merge_partials, depth)
    _raise_failures([result])
    n, merged = result
    if not n:
        raise ValueError("evaluation data holds no examples (an empty RDD)")
    for target, r in zip(evaluations, merged):
        target.merge(r)
    return evaluations


# -- keyed inference -------------------------------------------------------------------------
def _is_features(v) -> bool:
    return isinstance(v, np.ndarray) or (isinstance(v, (tuple, list)) and bool(v)
                                         and all(isinstance(a, np.ndarray) for a in v))


def _keyed_problem(with_mask, x):
    what = "feedForwardWithMaskAndKey" if with_mask else "feedForwardWithKey"
    takes = ("(key, (features, mask)) pairs" if with_mask
             else "(key, features) pairs (features: an array, or a tuple of arrays for several inputs)")
    if not (isinstance(x, tuple) and len(x) == 2):
        return f"{what} takes an RDD of {takes}; found an element of type {_type_name(x)}"
    v = x[1]
    if with_mask:
        ok = isinstance(v, (tuple, list)) and len(v) == 2 and _is_features(v[0]) and isinstance(v[1], np.ndarray)
    else:
        ok = _is_features(v)
    if not ok:
        return f"{what} takes an RDD of {takes}; found a pair whose value is of type {_type_name(v)}"
    return None


def _spec(v) -> str:
    """Shapes and dtypes of one example's features (an array or a tuple of arrays), as JSON."""
    import json

    arrays = v if isinstance(v, (tuple, list)) else [v]
    return json.dumps([[list(np.shape(a)), np.asarray(a).dtype.str] for a in arrays] + [isinstance(v, (tuple, list))])


def _describe_keyed(with_mask, x):
    problem = _keyed_problem(with_mask, x)
    if problem:
        return "!" + problem
    v = x[1]
    return "keyed:" + (_spec(v[0]) + "|" + _spec(v[1]) if with_mask else _spec(v))


def _check_takes(network, described, what, batch_size):
    """On the driver: the network takes features shaped as the RDD's first element's (``described``,
    from :func:`_spec`), else a ValueError naming them, before any task runs."""
    import json

    import jax

    def structs(text):
        *arrays, is_tuple = json.loads(text)
        out = [jax.ShapeDtypeStruct((batch_size, *shape), np.dtype(dtype)) for shape, dtype in arrays]
        return tuple(out) if is_tuple else out[0]

    feats, _, mask = described.partition("|")
    try:
        network._output_shapes(structs(feats), structs(mask) if mask else None)
    except ValueError as e:
        raise ValueError(f"{what}: the RDD's first element does not fit the network: {e}") from None


def _pad_rows(tree, n):
    """Pad every array's leading axis to ``n`` rows by repeating its last row, so that a
    partition's last, smaller chunk runs through the shape already compiled."""
    import jax

    def pad(a):
        extra = n - a.shape[0]
        return a if extra <= 0 else np.concatenate([a, np.repeat(a[-1:], extra, axis=0)])

    return jax.tree_util.tree_map(pad, tree)


def _predict_chunk(net, chunk, batch_size, with_mask):
    import jax

    keys = [k for k, _ in chunk]
    feats = [v[0] for _, v in chunk] if with_mask else [v for _, v in chunk]
    mask = np.stack([np.asarray(v[1]) for _, v in chunk]) if with_mask else None
    x = stack_examples(feats)
    n = len(keys)
    out = net.output(_pad_rows(x, batch_size), features_mask=None if mask is None else _pad_rows(mask, batch_size))
    return unstack_outputs(keys, jax.tree_util.tree_map(lambda a: a[:n], out))


def _shapes(v) -> tuple:
    return tuple(np.shape(a) for a in v) if isinstance(v, (tuple, list)) else np.shape(v)


def _predict_partition(bc, batch_size, with_mask, iterator):
    """Runs on an executor: ``(key, features) -> (key, outputs)`` for one partition, in order."""
    net, chunk, first = None, [], None
    for x in iterator:
        problem = _keyed_problem(with_mask, x)
        if problem:
            raise BadElementError(problem)
        shapes = _shapes(x[1][0] if with_mask else x[1])
        if first is None:
            first = (x[0], shapes)
        elif shapes != first[1]:  # found here, the message names the element (stacking would not)
            what = "feedForwardWithMaskAndKey" if with_mask else "feedForwardWithKey"
            raise ValueError(f"{what}: the element with key {x[0]!r} has features of shape {shapes}, the element "
                             f"with key {first[0]!r} {first[1]}; every example takes the network's input shape")
        chunk.append(x)
        if len(chunk) == batch_size:
            net = net or _executor_network(bc)
            yield from _predict_chunk(net, chunk, batch_size, with_mask)
            chunk = []
    if chunk:
        net = net or _executor_network(bc)
        yield from _predict_chunk(net, chunk, batch_size, with_mask)


def predict_with_keys(rdd, network, batch_size: int = 64, with_mask: bool = False):
    """Keyed inference on the executors (DL4J's ``feedForwardWithKey``): a pair RDD of
    ``(key, features)`` (``(key, (features, mask))`` with ``with_mask``) in, a pair RDD of
    ``(key, outputs)`` out, lazily, in the input's partitioning and order.

    Each example's features have no batch axis (they are stacked ``batch_size`` at a time);
    a multi-input network takes a tuple of arrays, a multi-output network gives a tuple.
    The first element is checked on the driver (only its verdict comes back).
    """
    check_executors(rdd.context)
    kind = _probe(rdd, partial(_describe_keyed, with_mask))
    if kind is not None:
        _check_takes(network, kind[len("keyed:"):], "feedForwardWithMaskAndKey" if with_mask else "feedForwardWithKey",
                     batch_size)
    bc = broadcast_network(rdd.context, network)
    # lazy: an error in a later element surfaces at the user's action, raised there as itself
    return clean_errors(rdd, partial(_predict_partition, bc, batch_size, with_mask), preservesPartitioning=True)


# -- scoring ---------------------------------------------------------------------------------
def _scored_problem(x, what="scoreExamples"):
    if isinstance(x, _DATASETS):
        return None
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], _DATASETS):
        return None
    return (f"{what} takes an RDD of DataSets (or MultiDataSets) or a pair RDD of (key, DataSet); "
            f"found an element of type {_type_name(x)}"
            + (f" holding a {_type_name(x[1])}" if isinstance(x, tuple) and len(x) == 2 else ""))


def _describe_scored(x):
    problem = _scored_problem(x)
    return "!" + problem if problem else ("keyed" if isinstance(x, tuple) else "plain")


def _pad_dataset(ds, n):
    extra = n - len(ds)
    return ds if extra <= 0 else type(ds).merge([ds] + [ds[len(ds) - 1:len(ds)]] * extra)


def _score_chunk(net, chunk, batch_size, keyed):
    datasets = [x[1] if keyed else x for x in chunk]
    merged = type(datasets[0]).merge(datasets)
    n = len(merged)
    size = -(-n // batch_size) * batch_size
    losses = np.asarray(net.score_examples(_pad_dataset(merged, size), batch_size))[:n]
    if not keyed:
        return [float(v) for v in losses]
    bounds = np.cumsum([0] + [len(d) for d in datasets])
    # one example scores as a float, several as an array (as the core's keyed scoring)
    return [(k, losses[a:b] if b - a > 1 else float(losses[a]))
            for (k, _), a, b in zip(chunk, bounds[:-1], bounds[1:])]


def _score_partition(bc, batch_size, keyed, iterator, what="scoreExamples"):
    """Runs on an executor: per-example losses of one partition, in order (keyed: ``(key, loss)``)."""
    net, chunk, held, first = None, [], 0, None
    for x in iterator:
        problem = _scored_problem(x, what)
        if problem or isinstance(x, tuple) != keyed:
            raise BadElementError(problem or (f"{what} takes an RDD of DataSets; found a (key, DataSet) pair"
                                              if not keyed else
                                              f"{what} takes keyed or unkeyed DataSets, not both in one RDD"))
        ds = x[1] if keyed else x
        shapes = tuple(np.shape(a)[1:] for a in (ds.features if isinstance(ds, MultiDataSet) else (ds.features,)))
        if first is None:
            first = shapes
        elif shapes != first:  # found here, the message names the element (merging would not)
            where = f"the DataSet with key {x[0]!r}" if keyed else "a DataSet"
            raise ValueError(f"{what}: {where} has examples of features shape {shapes}, the partition's first "
                             f"{first}; every example takes the network's input shape")
        chunk.append(x)
        held += len(x[1] if keyed else x)
        if held >= batch_size:
            net = net or _executor_network(bc)
            yield from _score_chunk(net, chunk, batch_size, keyed)
            chunk, held = [], 0
    if chunk:
        net = net or _executor_network(bc)
        yield from _score_chunk(net, chunk, batch_size, keyed)


def score_examples(rdd, network, batch_size: int = 64):
    """Per-example losses on the executors (DL4J's ``scoreExamples``), lazily: an RDD of
    DataSets gives an RDD of floats, one per example in order; a pair RDD of
    ``(key, DataSet)`` gives ``(key, loss)`` pairs in the input's partitioning (an array
    for a key whose DataSet holds several examples)."""
    check_executors(rdd.context)
    kind = _probe(rdd, _describe_scored)
    bc = broadcast_network(rdd.context, network)
    keyed = kind == "keyed"
    return clean_errors(rdd, partial(_score_partition, bc, batch_size, keyed), preservesPartitioning=keyed)


def _score_sum_items(bc, batch_size, iterator):
    total, n = 0.0, 0
    for v in _score_partition(bc, batch_size, False, iterator, what="calculateScore"):
        total += v
        n += 1
    yield (total, n)


def _score_sum_partition(bc, batch_size, iterator):
    """Runs on an executor: ``(sum of losses, examples)`` of one partition."""
    return _guarded(_score_sum_items(bc, batch_size, iterator))


def calculate_score(rdd, network, batch_size: int = 64, average: bool = True) -> float:
    """Total loss over an RDD of DataSets, or with ``average`` the mean per example
    (DL4J's ``calculateScore``), summed on the executors."""
    check_executors(rdd.context)
    bc = broadcast_network(rdd.context, network)
    parts = _raise_failures(rdd.mapPartitions(partial(_score_sum_partition, bc, batch_size)).collect())
    total, n = sum(t for t, _ in parts), sum(c for _, c in parts)
    if n == 0:
        raise ValueError("calculateScore: the RDD holds no examples")
    return float(total / n if average else total)
