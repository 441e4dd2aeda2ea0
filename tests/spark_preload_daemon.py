"""The Python daemon the test run's Spark executors fork their workers from (Spark's own
``pyspark.daemon``, set by ``spark.python.daemon.module`` in conftest's ``sc``), with JAX and
dlspark imported before it forks: a forked worker then starts with them. A worker is forked
again after every task that raised (the compat tests raise many on purpose), and each paid
about 2 CPU-seconds for these imports. No JAX backend starts here: JAX runs only in the
forked workers."""

import flax  # noqa: F401
import jax  # noqa: F401
import optax  # noqa: F401
from pyspark.daemon import manager

import dlspark  # noqa: F401
import dlspark.compat  # noqa: F401

if __name__ == "__main__":
    manager()
