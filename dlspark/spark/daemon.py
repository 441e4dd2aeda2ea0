"""A daemon for Spark's Python workers that forks them with JAX and dlspark already imported.

Spark's executors start their Python workers by forking a daemon (``pyspark.daemon``
unless ``spark.python.daemon.module`` names another), and each worker imports what its
tasks unpickle. A dlspark task needs JAX, flax, optax and dlspark: about two CPU-seconds
of imports in every new worker, and Spark forks a new worker after each task that raised
and when an idle one was dropped. A reused worker also runs a full garbage collection
between two tasks, which walks every object those imports made. This daemon imports them
once, before it forks, and moves them out of the collector's reach (:func:`gc.freeze`):
a forked worker starts with them, and its collections walk only what its tasks made.

Use it by naming it where the ``SparkContext`` is configured, with dlspark installed in
the executors' Python (``PYSPARK_PYTHON``), as every dlspark job on Spark needs::

    conf.set("spark.python.daemon.module", "dlspark.spark.daemon")

Where the executors' Python cannot import dlspark, the daemon itself fails to start and
Spark reports its own error; without this setting, dlspark's first job names the Python
the executors run instead (:class:`~dlspark.errors.ExecutorEnvironmentError`).

No JAX backend starts in the daemon (a backend's threads do not survive a fork): JAX
starts in each worker at its first computation.
"""

import gc

import flax  # noqa: F401
import jax  # noqa: F401
import optax  # noqa: F401

import dlspark.compat  # noqa: F401 (dlspark with it)


def main() -> None:
    """Freeze what is imported so far out of the garbage collector, then serve as
    ``pyspark.daemon`` does."""
    from pyspark.daemon import manager

    gc.freeze()
    manager()


if __name__ == "__main__":
    main()
