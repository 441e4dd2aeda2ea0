"""The Spark executors' Python, checked once per SparkContext before dlspark runs anything there.

Every function dlspark sends to the executors lives in a dlspark module, so an
executor whose Python cannot import dlspark fails the first task with a
``ModuleNotFoundError`` buried in a long ``Py4JJavaError``. One tiny job runs
first instead: a function pickled by value (it needs nothing from dlspark)
reports the executor's Python and its dlspark version, and a missing or
different dlspark is raised on the driver as one
:class:`~dlspark.errors.ExecutorEnvironmentError` naming ``PYSPARK_PYTHON``
and the driver's ``sys.executable``.
"""

from __future__ import annotations

import os
import sys
import weakref

from ..errors import ExecutorEnvironmentError

__all__ = ["check_executors"]

#: SparkContexts whose executors passed (weakly held: a stopped context goes with its entry).
_CHECKED: "weakref.WeakSet" = weakref.WeakSet()

# The probe is compiled from source so that pyspark's cloudpickle sends it by value: a function
# defined in a dlspark module would be pickled by reference, and the executor would have to
# import dlspark to unpickle the check that asks whether it can.
_PROBE_SOURCE = '''
def probe(_):
    import sys
    try:
        import dlspark
    except Exception as e:
        return (sys.executable, None, type(e).__name__ + ": " + str(e))
    return (sys.executable, getattr(dlspark, "__version__", "unknown"), None)
'''


def _probe_function():
    scope: dict = {}
    exec(compile(_PROBE_SOURCE, "<dlspark executor check>", "exec"), scope)  # noqa: S102 (our own constant)
    return scope["probe"]


def _what_runs(sc) -> str:
    conf = sc.getConf()
    chosen = conf.get("spark.pyspark.python") or os.environ.get("PYSPARK_PYTHON")
    return f"PYSPARK_PYTHON={chosen}" if chosen else "PYSPARK_PYTHON unset, so the executors run 'python3' from PATH"


def check_executors(sc) -> None:
    """Raise :class:`~dlspark.errors.ExecutorEnvironmentError` unless ``sc``'s executors import
    the driver's version of dlspark; runs one small Spark job per SparkContext."""
    if sc in _CHECKED:
        return
    # this module is part of dlspark, so the package is imported; read its version without an
    # import of the top package from below it
    dlspark = sys.modules["dlspark"]
    fix = (f"set PYSPARK_PYTHON to a Python with dlspark {dlspark.__version__} installed before the "
           f"SparkContext starts, e.g. the driver's own: export PYSPARK_PYTHON={sys.executable} (or "
           f"os.environ['PYSPARK_PYTHON'] = sys.executable in the script), or install dlspark in the "
           "executors' Python")
    try:
        found = sc.parallelize([0], 1).map(_probe_function()).collect()
    except Exception as e:  # Spark could not run a Python task at all (another Python version, say)
        last = [line for line in str(e).splitlines() if line.strip()][-1:] or [type(e).__name__]
        first = next((line for line in str(e).splitlines() if "Error" in line or "Exception" in line), last[0])
        raise ExecutorEnvironmentError(
            f"the Spark executors could not run a Python task ({_what_runs(sc)}; the driver runs "
            f"{sys.executable}): {first.strip()[:300]}. {fix}") from None
    for executable, version, error in found:
        if error is not None:
            raise ExecutorEnvironmentError(
                f"the Spark executors' Python cannot import dlspark ({error}; they run {executable}, "
                f"{_what_runs(sc)}; the driver runs {sys.executable}): {fix}")
        if version != dlspark.__version__:
            raise ExecutorEnvironmentError(
                f"the Spark executors run dlspark {version} ({executable}, {_what_runs(sc)}) and the driver "
                f"dlspark {dlspark.__version__} ({sys.executable}): {fix}")
    _CHECKED.add(sc)
