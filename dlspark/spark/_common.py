"""What the pyspark adapter's halves share: recognising an RDD without importing pyspark,
and errors found on executors carried back to the driver as themselves."""

from __future__ import annotations

from ..data import DataSet, MultiDataSet

__all__ = ["is_rdd", "BadElementError"]

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
        import pickle

        try:
            pickle.dumps(self.error)
            error = self.error
        except Exception:  # an error that does not pickle comes back as its type's name and message
            error = RuntimeError(f"{type(self.error).__name__}: {self.error}")
        return (_Failure, (error,))


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
    """Yield ``gen``'s items; an error (a bad element, a dlspark error, data the network or an
    evaluation refuses) becomes a _Failure item, raised on the driver as itself: Spark's task
    succeeds, so the user sees one Python exception and the SparkContext stays as it was."""
    try:
        yield from gen
    except Exception as e:
        yield _Failure(e)


def _probe(rdd, describe):
    """Check the RDD's first element on the driver, through ``describe`` run on an executor
    (only its verdict, a short string, comes back): returns the element's kind, or None
    for an empty RDD; a verdict starting with ``!`` is raised as a TypeError."""
    found = rdd.map(describe).take(1)
    if found and found[0].startswith("!"):
        raise TypeError(found[0][1:])
    return found[0] if found else None


# -- errors in lazy results ----------------------------------------------------------------------
#: marks a pickled error in the message of the exception a lazy task raises on an executor
_TAG = "DLSPARK-ERROR"


class ExecutorTaskError(RuntimeError):
    """Raised on an executor by a lazy result's task (keyed inference, keyed scoring) that met
    an error: its message carries the error, pickled, for the driver to raise as itself."""


def _failing(gen):
    """Yield ``gen``'s items; an error stops the task with an :class:`ExecutorTaskError`
    carrying it. A lazy result cannot hand the error back as data (the user's own
    ``map`` would receive it), so the task fails, and the driver-side actions of
    :func:`clean_errors` find the error in Spark's exception and raise it as itself."""
    try:
        yield from gen
    except Exception as e:
        import base64

        import cloudpickle

        try:
            raw = cloudpickle.dumps(e)
        except Exception:  # an error that does not pickle comes back as its type's name and message
            raw = cloudpickle.dumps(RuntimeError(f"{type(e).__name__}: {e}"))
        raise ExecutorTaskError(f"{type(e).__name__}: {e} [{_TAG}<{base64.b64encode(raw).decode()}>]") from None


def executor_error(e: BaseException):
    """The error an executor's task carried in ``e`` (Spark's exception on the driver), or None."""
    import base64
    import re

    import cloudpickle

    found = re.search(_TAG + r"<([A-Za-z0-9+/=]+)>", str(e))
    if found is None:
        return None
    try:
        return cloudpickle.loads(base64.b64decode(found.group(1)))
    except Exception:  # an error class the driver cannot import: Spark's exception stays
        return None


def _translating(action):
    def run(self, *args, **kwargs):
        try:
            return action(self, *args, **kwargs)
        except Exception as e:
            err = executor_error(e)
            if err is None:
                raise
        raise err

    run.__name__, run.__doc__ = action.__name__, action.__doc__
    return run


_CLEAN_CLASS = []


def _clean_class():
    """The RDD class of :func:`clean_errors` (built on first use: importing pyspark is heavy)."""
    if not _CLEAN_CLASS:
        from pyspark.rdd import PipelinedRDD

        actions = {name: _translating(getattr(PipelinedRDD, name))
                   for name in ("collect", "take", "saveAsTextFile", "saveAsPickleFile")}

        def mapPartitionsWithIndex(self, f, preservesPartitioning=False):
            # every narrow transformation (map, filter, mapValues, values, ...) and the actions
            # built on them (count, reduce, foreach, collectAsMap, ...) come through here
            return cls(self, f, preservesPartitioning)

        cls = type("CleanErrorsRDD", (PipelinedRDD,), {
            "__doc__": "A lazy result whose executors' errors reach the driver as themselves (see clean_errors).",
            "__module__": __name__, "mapPartitionsWithIndex": mapPartitionsWithIndex, **actions})
        _CLEAN_CLASS.append(cls)
    return _CLEAN_CLASS[0]


def clean_errors(rdd, partition_fn, preservesPartitioning=False):
    """``rdd.mapPartitions(partition_fn)`` as a lazy RDD whose actions (``collect``, ``take``,
    ``first``, ``count``, ``collectAsMap``, ``foreach``, ``reduce``, the saves; and those of
    RDDs derived from it by narrow transformations) raise an error that ``partition_fn`` met
    on an executor as itself, one Python exception, instead of Spark's ``Py4JJavaError``
    around it. The failed job leaves the SparkContext as it was."""
    def f(_, iterator):
        return _failing(partition_fn(iterator))

    return _clean_class()(rdd, f, preservesPartitioning)
