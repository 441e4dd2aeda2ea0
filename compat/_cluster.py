"""Which Dask cluster a DL4J-shaped program trains on.

In order: the client given to :func:`configure`; else the scheduler address in
the Spark configuration key ``spark.dlspark.scheduler``; else an embedded
``LocalCluster`` (``dlspark.cluster.local_cluster``: one worker per GPU or
core), started once per process on first use and closed at exit.
"""

from __future__ import annotations

import atexit
import threading

__all__ = ["configure", "dask_client", "progress_enabled", "SCHEDULER_CONF_KEY"]

#: The Spark configuration key naming the Dask scheduler to train on.
SCHEDULER_CONF_KEY = "spark.dlspark.scheduler"

_LOCK = threading.Lock()
_SETTINGS = {"client": None, "progress": False}
_BY_ADDRESS: dict = {}
_EMBEDDED: list = []


def configure(client=None, *, progress: bool | None = None) -> None:
    """Choose the Dask cluster that ``dlspark.compat`` trains on.

    Parameters
    ----------
    client : distributed.Client or str, optional
        A client, or a scheduler address (``"tcp://10.0.0.5:8786"``). None goes
        back to the default: the Spark configuration key ``spark.dlspark.scheduler``
        if the SparkContext has it, else an embedded LocalCluster.
    progress : bool, optional
        Show a progress bar during fits (default: off, as DL4J).

    Examples
    --------
    >>> from dask.distributed import Client
    >>> dlspark.compat.configure(client=Client("tcp://scheduler:8786"))  # doctest: +SKIP
    """
    if client is not None and not isinstance(client, str) and not hasattr(client, "scheduler_info"):
        raise TypeError(f"client must be a distributed.Client or a scheduler address, got {type(client).__name__}")
    with _LOCK:
        _SETTINGS["client"] = client
        if progress is not None:
            if not isinstance(progress, bool):
                raise TypeError(f"progress must be True or False, got {progress!r}")
            _SETTINGS["progress"] = progress


def progress_enabled() -> bool:
    """Whether fits show a progress bar (:func:`configure`)."""
    return _SETTINGS["progress"]


def _connect(address):
    from distributed import Client

    client = _BY_ADDRESS.get(address)
    if client is None or client.status not in ("running", "connecting"):
        client = _BY_ADDRESS[address] = Client(address, set_as_default=False)
    return client


def _embedded():
    if not _EMBEDDED:
        from distributed import Client

        from dlspark.cluster import gpu_devices, local_cluster
        from dlspark.distributed._client import install_plugins

        cluster = local_cluster()
        client = Client(cluster, set_as_default=False)
        # As DistributedTrainer(None, ...) does for its own cluster: pin CPU workers to their cores.
        install_plugins(client, not gpu_devices()[1])
        _EMBEDDED.append((cluster, client))
        atexit.register(_close_embedded)
    return _EMBEDDED[0][1]


def _close_embedded():
    while _EMBEDDED:
        cluster, client = _EMBEDDED.pop()
        client.close()
        cluster.close()


def dask_client(sc):
    """The Dask client for the SparkContext ``sc`` (see the module docstring for the order)."""
    with _LOCK:
        chosen = _SETTINGS["client"]
        if isinstance(chosen, str):
            return _connect(chosen)
        if chosen is not None:
            return chosen
        address = sc.getConf().get(SCHEDULER_CONF_KEY) if sc is not None else None
        if address:
            return _connect(address)
        return _embedded()
