"""How the embedded cluster starts its worker processes (``local_cluster``'s ``start_method``).

CPU workers on Linux are forked from multiprocessing's fork server, whose preload,
:mod:`dlspark._forkserver`, imports JAX and dlspark once for all of them; elsewhere they are
spawned. A worker forked from that server imported JAX there, before its nanny set the
worker's environment: :func:`dask_setup`, this module's Dask worker preload, applies the
worker's own ``JAX_*`` variables to JAX's configuration before any task runs. A spawned
worker has nothing to apply: its JAX reads its own variables.

Dask reads its start method (``distributed.worker.multiprocessing-method``) from its global
configuration each time a nanny starts a worker process, its restarts too; dlspark's
:class:`ForkingNanny` holds it at ``forkserver`` while it starts one, so that a worker
restarted after a crash or a kill is forked as its first start was.

Importing this module imports the ``dlspark`` package, and so JAX: a spawned worker does at
its start what it would otherwise do when dlspark's worker plugin reaches it.
"""

import contextlib
import sys
import threading

from distributed import Nanny

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


_forking_lock = threading.Lock()
_forking = [0, None]  # nannies starting a worker now, and Dask's start method before the first


@contextlib.contextmanager
def forking():
    """Dask's start method held at ``forkserver`` while any caller is inside (nannies of
    several clusters may start workers at once, on several threads); the method from before
    the first comes back when the last leaves."""
    import dask

    key = "distributed.worker.multiprocessing-method"
    with _forking_lock:
        if _forking[0] == 0:
            _forking[1] = dask.config.get(key)
            dask.config.set({key: "forkserver"})
        _forking[0] += 1
    try:
        yield
    finally:
        with _forking_lock:
            _forking[0] -= 1
            if _forking[0] == 0:
                dask.config.set({key: _forking[1]})


class ForkingNanny(Nanny):
    """A nanny whose worker process is forked from the fork server at every start, also when
    it restarts the worker (a plain nanny's restart reads Dask's global start method, which
    ``local_cluster`` sets only while the cluster starts)."""

    async def instantiate(self):
        with forking():
            return await super().instantiate()


def dask_setup(worker=None) -> None:
    """Dask's worker-preload hook, run once as the worker starts."""
    server = sys.modules.get(FORK_SERVER_PRELOAD)
    if server is not None:
        server.apply_jax_env()
