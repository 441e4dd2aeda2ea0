"""The embedded cluster's CPU workers, forked from a server that has imported JAX and dlspark.

A spawned worker process imports distributed, JAX, optax, flax and dlspark before its first
task, every worker anew.
:func:`~dlspark.cluster.local_cluster` starts CPU workers with multiprocessing's
``forkserver`` method instead, with this module as the server's preload: the server, a fresh
interpreter started once per client process, imports them once, and each worker is forked
from it with them imported and out of the garbage collector's reach (:func:`gc.freeze`), as
:mod:`dlspark.spark.daemon` does for Spark's Python workers.

No JAX backend starts in the server (a backend's threads do not survive a fork): JAX starts
in each worker at its first computation, after the nanny has set the worker's environment
(its pinning, XLA's flags and JAX's memory settings are read then). JAX reads its ``JAX_*``
variables earlier, when it is imported, which happened in the server: :func:`apply_jax_env`,
run in each forked worker at its start (:mod:`dlspark._worker_start`'s Dask worker preload),
applies those the worker's environment changed (``JAX_PLATFORMS`` from
``local_cluster(platform=...)``, for one) to JAX's configuration before any task runs.
"""

import gc
import os
import sys

import distributed  # noqa: F401
import flax  # noqa: F401
import jax
import numpy as np
import optax  # noqa: F401

import dlspark  # noqa: F401
import dlspark.distributed._worker  # noqa: F401

__all__ = ["apply_jax_env", "jax_env_changes"]

#: the ``JAX_*`` variables as JAX read them when this module imported it
IMPORT_ENV = {k: v for k, v in os.environ.items() if k.startswith("JAX_")}


def _parse(key: str, raw: str, current):
    """``raw`` (the variable ``key``) as a value of the type JAX's setting holds, by JAX's
    own rules for its variables."""
    if isinstance(current, bool):
        value = raw.strip().lower()
        if value in ("y", "yes", "t", "true", "on", "1"):
            return True
        if value in ("n", "no", "f", "false", "off", "0"):
            return False
        raise ValueError(f"{key}={raw!r} in a worker's environment is not a truth value: "
                         "use one of true, false, 1, 0, yes, no, on, off")
    if isinstance(current, int):
        return int(raw)
    if isinstance(current, float):
        return float(raw)
    return raw


def jax_env_changes() -> dict:
    """``{setting: value}``: JAX's settings whose ``JAX_*`` variable this process's environment
    has with a value other than the one JAX read at import (in the server, for a forked worker)."""
    values = jax.config.values
    changed = {}
    for key, raw in sorted(os.environ.items()):
        name = key.lower()
        if key.startswith("JAX_") and IMPORT_ENV.get(key) != raw and name in values:
            changed[name] = _parse(key, raw, values[name])
    return changed


def apply_jax_env() -> None:
    """Give JAX the ``JAX_*`` settings of this process's environment where they differ from
    what it read at import: in a worker forked from the server, JAX read its variables there,
    before the nanny set the worker's own."""
    for name, value in jax_env_changes().items():
        jax.config.update(name, value)


def _reseed() -> None:
    # every forked worker would otherwise draw the server's numpy global stream, where each
    # spawned worker draws its own
    np.random.seed()


def _in_fork_server() -> bool:
    """True while multiprocessing's fork server imports this module as its preload."""
    from multiprocessing import forkserver

    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


if _in_fork_server():
    gc.freeze()
    os.register_at_fork(after_in_child=_reseed)
