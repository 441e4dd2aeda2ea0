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
