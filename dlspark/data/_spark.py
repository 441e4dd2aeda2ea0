"""The pyspark adapter of the data-source layer: Spark RDDs as training, evaluation and inference input.

pyspark is never imported here: an RDD is recognised by the module its type
comes from, and every Spark call is a method of the RDD or SparkContext the
caller handed over. The rest of dlspark runs without pyspark installed.

Two halves:

- :class:`SparkRDDSource`, registered in the data-source registry, so that
  ``DistributedTrainer.fit(rdd)`` trains on the Dask cluster from an RDD of
  DataSets, MultiDataSets or minibatch file paths. With the export approach
  the Spark executors cut their partitions into minibatch files (DL4J's
  Export: ``mapPartitions`` writing ``batch_size`` examples a file); an RDD of
  paths is read on the driver as strings only. The direct approach collects
  the minibatches to the driver and scatters them to the Dask workers, and is
  refused above a size limit (:func:`direct_limit`).
- Spark-side execution (:func:`do_evaluation`, :func:`predict_with_keys`,
  :func:`score_examples`, :func:`calculate_score`): evaluation, scoring and
  keyed inference run where the RDD lives, in ``mapPartitions`` on the
  executors, with the network broadcast once per state. Keys never leave
  Spark; keyed results keep the input's partitioning; partial evaluations
  merge with the core's ``merge`` on the executors (``treeReduce``).

Functions that run on executors are module-level, so that executors import
them by name (dlspark must be installed in the executors' Python). An element
of the wrong kind found by an action comes back to the driver as a
``TypeError`` naming it (a missing minibatch file as the core's
``CorruptMinibatchError``); lazy transformations check the RDD's first element
on the driver and raise inside Spark for a later one.
"""

from __future__ import annotations

import re
import uuid
import weakref
from functools import partial

import numpy as np

from ..errors import DlsparkError
from ..io import url_join
from ._dataset import DataSet, MultiDataSet
from ._files import save_dataset
from ._sources import Minibatches, Source, _export_directory, fit_minibatches, load_ref, register_source

__all__ = ["SparkRDDSource", "is_rdd", "collect_paths", "export_minibatches", "direct_minibatches",
           "direct_limit", "broadcast_network", "do_evaluation", "predict_with_keys", "score_examples",
           "calculate_score", "DIRECT_MAX_BYTES"]

#: Default of the ``dlspark.spark.direct-max-bytes`` setting: the most data (raw array
#: bytes) the direct approach collects to the driver. The limit applied is the smaller of
#: it and ``spark.driver.maxResultSize``.
DIRECT_MAX_BYTES = "128MiB"

_DATASETS = (DataSet, MultiDataSet)
_FIT_KINDS = "DataSets, MultiDataSets or minibatch file paths (str)"


def is_rdd(obj) -> bool:
    """Whether ``obj`` is a pyspark RDD (decided without importing pyspark)."""
    return (type(obj).__module__ or "").startswith("pyspark") and hasattr(obj, "mapPartitions")


# -- errors found on executors -------------------------------------------------------------
class BadElementError(TypeError):
    """An RDD element of a kind the call does not take (raised on an executor)."""


class _Failure:
    """An error found on an executor, carried back as data so that the driver raises it
    as itself (raised there, it would reach the driver wrapped in Spark's exception)."""

    __slots__ = ("error",)

    def __init__(self, error):
        self.error = error

    def __reduce__(self):
        return (_Failure, (self.error,))


def _type_name(x) -> str:
    t = type(x)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _bad(what, takes, x):
    return BadElementError(f"{what} takes an RDD of {takes}; found an element of type {_type_name(x)}")


def _raise_failures(results):
    for r in results:
        if isinstance(r, _Failure):
            raise r.error
    return results


def _guarded(gen):
    """Yield ``gen``'s items; an element error or a dlspark error becomes a _Failure item."""
    try:
        yield from gen
    except (BadElementError, DlsparkError) as e:
        yield _Failure(e)


def _probe(rdd, describe):
    """Check the RDD's first element on the driver, through ``describe`` run on an executor
    (only its verdict, a short string, comes back): returns the element's kind, or None
    for an empty RDD; a verdict starting with ``!`` is raised as a TypeError."""
    found = rdd.map(describe).take(1)
    if found and found[0].startswith("!"):
        raise TypeError(found[0][1:])
    return found[0] if found else None


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


# -- the network on the executors ------------------------------------------------------------
#: network -> (SparkContext, state, Broadcast): one broadcast per network state.
_BROADCASTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def broadcast_network(sc, network):
    """``network`` at its current state, broadcast to the executors once.

    The same broadcast is returned while the network keeps that state (its
    train state is an immutable pytree that every fit replaces). Earlier
    broadcasts stay alive while RDDs computed from them do.
    """
    from .._inference import network_blob

    hit = _BROADCASTS.get(network)
    if hit is not None and hit[0] is sc and hit[1] is network.state:
        return hit[2]
    bc = sc.broadcast(network_blob(network, uuid.uuid4().hex))
    _BROADCASTS[network] = (sc, network.state, bc)
    return bc


def _executor_network(bc):
    """Runs on an executor: the broadcast network, compiled once per Python worker process."""
    import cloudpickle

    from .._inference import _network

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
    from .._inference import evaluate_part, merge_evaluations

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
    from .._inference import merge_evaluations

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
    from .._inference import _check_evaluations

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


def _describe_keyed(with_mask, x):
    problem = _keyed_problem(with_mask, x)
    return "!" + problem if problem else "keyed"


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

    from .._inference import stack_examples, unstack_outputs

    keys = [k for k, _ in chunk]
    feats = [v[0] for _, v in chunk] if with_mask else [v for _, v in chunk]
    mask = np.stack([np.asarray(v[1]) for _, v in chunk]) if with_mask else None
    x = stack_examples(feats)
    n = len(keys)
    out = net.output(_pad_rows(x, batch_size), features_mask=None if mask is None else _pad_rows(mask, batch_size))
    return unstack_outputs(keys, jax.tree_util.tree_map(lambda a: a[:n], out))


def _predict_partition(bc, batch_size, with_mask, iterator):
    """Runs on an executor: ``(key, features) -> (key, outputs)`` for one partition, in order."""
    net, chunk = None, []
    for x in iterator:
        problem = _keyed_problem(with_mask, x)
        if problem:
            raise BadElementError(problem)
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
    _probe(rdd, partial(_describe_keyed, with_mask))
    bc = broadcast_network(rdd.context, network)
    return rdd.mapPartitions(partial(_predict_partition, bc, batch_size, with_mask), preservesPartitioning=True)


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
    net, chunk, held = None, [], 0
    for x in iterator:
        problem = _scored_problem(x, what)
        if problem or isinstance(x, tuple) != keyed:
            raise BadElementError(problem or (f"{what} takes an RDD of DataSets; found a (key, DataSet) pair"
                                              if not keyed else
                                              f"{what} takes keyed or unkeyed DataSets, not both in one RDD"))
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
    kind = _probe(rdd, _describe_scored)
    bc = broadcast_network(rdd.context, network)
    keyed = kind == "keyed"
    return rdd.mapPartitions(partial(_score_partition, bc, batch_size, keyed), preservesPartitioning=keyed)


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
    bc = broadcast_network(rdd.context, network)
    parts = _raise_failures(rdd.mapPartitions(partial(_score_sum_partition, bc, batch_size)).collect())
    total, n = sum(t for t, _ in parts), sum(c for _, c in parts)
    if n == 0:
        raise ValueError("calculateScore: the RDD holds no examples")
    return float(total / n if average else total)


register_source(SparkRDDSource())
