"""How the embedded cluster starts its worker processes (``local_cluster``'s ``start_method``).

CPU workers on Linux are forked from multiprocessing's fork server, whose preload,
:mod:`dlspark._forkserver`, imports JAX and dlspark once for all of them; elsewhere they are
spawned. A worker forked from that server imported JAX there, before its nanny set the
worker's environment: :func:`dask_setup`, this module's Dask worker preload, applies the
worker's own ``JAX_*`` variables to JAX's configuration before any task runs. A worker its
nanny spawns (a restart) has nothing to apply: its JAX reads its own variables.

Importing this module imports the ``dlspark`` package, and so JAX: a spawned worker does at
its start what it would otherwise do when dlspark's worker plugin reaches it.
"""

import sys

#: the fork server's preload
FORK_SERVER_PRELOAD = "dlspark._forkserver"
#: the workers' Dask preload (``distributed.worker.preload``): this module
WORKER_PRELOAD = __name__
START_METHODS = ("auto", "forkserver", "spawn")


def start_method(method, gpus: bool) -> str:
    """``"forkserver"`` or ``"spawn"`` for a cluster's workers, from ``method`` (None: the
    ``dlspark.worker.start-method`` setting)."""
    import multiprocessing

    from . import config

    method = config.get("worker.start-method") if method is None else method
    if method not in START_METHODS:
        raise ValueError(f"start_method must be one of {', '.join(map(repr, START_METHODS))}, got {method!r}")
    if method == "auto":
        return "forkserver" if sys.platform.startswith("linux") and not gpus else "spawn"
    if method == "forkserver" and "forkserver" not in multiprocessing.get_all_start_methods():
        raise ValueError(f"start_method='forkserver' is not available on this platform ({sys.platform}): use 'spawn'")
    return method


def preload_fork_server() -> None:
    """Name dlspark's preload for multiprocessing's fork server (under Dask's ``forkserver``
    setting). It takes effect where the server has not started yet in this process: the
    first worker's start starts it."""
    from distributed.utils import get_mp_context

    # Dask names its own preload (distributed and its dependencies) the first time it is asked
    # for this context; dlspark's imports what its workers need, last, so that the server
    # freezes everything imported before it forks
    get_mp_context().set_forkserver_preload(["distributed", FORK_SERVER_PRELOAD])


def dask_setup(worker=None) -> None:
    """Dask's worker-preload hook, run once as the worker starts."""
    server = sys.modules.get(FORK_SERVER_PRELOAD)
    if server is not None:
        server.apply_jax_env()
