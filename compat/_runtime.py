"""What a training master's DL4J settings do on Dask: workers per node, the seeded deal of
minibatches, the workers' periodic garbage collection.

Each is a small adapter over the core: a :class:`dlspark.DistributedTrainer` that
trains on ``workersPerNode`` workers of each host, a permutation of the minibatch
references, and a Dask worker plugin.
"""

from __future__ import annotations

import numpy as np
from distributed.diagnostics.plugin import WorkerPlugin

from dlspark import DistributedTrainer

__all__ = ["CompatTrainer", "dealt", "set_periodic_gc", "PeriodicGC", "GC_PLUGIN"]

#: The name of the periodic-collection plugin on the Dask workers.
GC_PLUGIN = "dlspark-compat-periodic-gc"


class CompatTrainer(DistributedTrainer):
    """A :class:`dlspark.DistributedTrainer` whose jobs use ``workers_per_node`` workers of each
    host (DL4J's ``workersPerNode``); None: every worker."""

    workers_per_node: int | None = None

    def _workers(self):
        workers = super()._workers()
        n = self.workers_per_node
        if n is None:
            return workers
        info = self.client.scheduler_info()["workers"]
        by_host: dict = {}
        for w in workers:
            by_host.setdefault(info[w].get("host", w), []).append(w)
        short = {h: len(ws) for h, ws in by_host.items() if len(ws) < n}
        if short:
            raise ValueError(
                f"workersPerNode({n}) trains on {n} workers of each machine, but the Dask cluster runs fewer on "
                f"{', '.join(f'{h} ({k})' for h, k in sorted(short.items()))}. Start {n} workers per machine "
                f"(dlspark.cluster.local_cluster({n}), `dask worker --nworkers {n}`, or a SLURMCluster's "
                "processes), or pass workersPerNode(-1) to train on every worker")
        return sorted(w for ws in by_host.values() for w in ws[:n])


def dealt(refs, seed, epoch: int) -> list:
    """``refs`` in the order one epoch deals them to the workers: as given without a seed,
    else a permutation drawn from ``(seed, epoch)`` (the same seed deals every epoch alike
    across runs, and each epoch differently)."""
    refs = list(refs)
    if seed is None:
        return refs
    order = np.random.default_rng([int(seed), int(epoch)]).permutation(len(refs))
    return [refs[i] for i in order]


class PeriodicGC(WorkerPlugin):
    """A Dask worker plugin: ``gc.collect()`` every ``period_ms`` on the worker's event loop
    (DL4J's ``workerTogglePeriodicGC``). ``collections`` counts the runs."""

    name = GC_PLUGIN

    def __init__(self, period_ms: int):
        self.period_ms = int(period_ms)
        self.collections = 0
        self._callback = None

    def setup(self, worker):
        import gc

        from tornado.ioloop import PeriodicCallback

        def collect():
            gc.collect()
            self.collections += 1

        self._callback = PeriodicCallback(collect, self.period_ms)
        self._callback.start()

    def teardown(self, worker):
        if self._callback is not None:
            self._callback.stop()


_GC_STATE: dict = {}


def set_periodic_gc(client, period_ms) -> None:
    """Run (``period_ms``) or stop (None) the workers' periodic collection; a no-op when the
    cluster already runs it at that period."""
    key = id(client)
    if _GC_STATE.get(key) == period_ms:
        return
    if period_ms is None:
        try:
            client.unregister_worker_plugin(GC_PLUGIN)
        except (ValueError, KeyError):  # never registered on this cluster
            pass
    else:
        client.register_plugin(PeriodicGC(period_ms), name=GC_PLUGIN)
    _GC_STATE[key] = period_ms
