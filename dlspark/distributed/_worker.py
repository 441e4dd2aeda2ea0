"""Worker side: a generic WorkerPlugin that routes each job's messages to its run.

Each job is an algorithm's run object (see :mod:`dlspark.distributed._run`),
created by the job's master. The plugin holds no algorithm-specific code: the
coordinator's orders go to ``run.handle``, its notices to ``run.notice``, peers'
requests to ``run.peer``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import os
import time

import cloudpickle
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import to_serialize

from .._malloc import apply_worker_settings
from ._kept import KeptStates, carried_arrays, put_arrays
from ._messages import ErrorReply, Unavailable
from ._peers import call_peer, peer_lost

logger = logging.getLogger(__name__)

__all__ = ["DlsparkWorkerPlugin", "pin_process"]

_HANDLERS = ("setup", "join", "order", "notice", "peer", "state", "keep", "teardown", "clock", "events", "divergence")


def pin_process(cores) -> None:
    """Pin every thread of this process (and so every thread it starts later) to ``cores``."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that ended meanwhile
            pass


def max_param_difference(state, other: dict) -> float:
    """``max |a - b|`` over the parameters of ``state`` and of ``other`` (a state as
    :func:`~dlspark.checkpoint.state_to_arrays` gives it)."""
    import jax
    import numpy as np

    from ..checkpoint import state_from_arrays

    other = state_from_arrays(other, state, "a peer's state")
    worst = 0.0
    for a, b in zip(jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(other.params)):
        a, b = np.asarray(a), np.asarray(b)
        if a.size:
            worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))))
    return worst


def max_leaf_difference(state, leaves) -> float:
    """``max |a - b|`` over the parameter leaves of ``state`` and ``leaves`` (host arrays, in order)."""
    import jax
    import numpy as np

    worst = 0.0
    for a, b in zip(jax.tree_util.tree_leaves(state.params), leaves, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.size:
            worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))))
    return worst


def _reporting(handler):
    """An error becomes the one envelope in the reply: the scheduler relays it to the client
    without unpickling user exception classes itself."""

    @functools.wraps(handler)
    async def wrapped(*args, **kwargs):
        try:
            return await handler(*args, **kwargs)
        except Exception as e:
            return {"error": to_serialize(ErrorReply.from_exception(e))}

    return wrapped


class DlsparkWorkerPlugin(WorkerPlugin):
    """Installs dlspark's comm handlers on every worker (present and future).

    Parameters
    ----------
    pin_cores : bool
        Pin each worker process to its own group of cores (embedded CPU
        clusters): XLA's CPU thread pool ignores thread-count flags, so this is
        how a worker gets the cores it was sized for.
    n_workers : int
        Workers sharing this machine, used to size the core groups.
    cores_per_worker : int, optional
        Size of each core group; default: the machine's cores split evenly
        among ``n_workers``.
    """

    name = "dlspark"

    def __init__(self, pin_cores: bool = False, n_workers: int = 1, cores_per_worker: int | None = None):
        self.pin_cores = pin_cores
        self.n_workers = max(1, int(n_workers))
        self.cores_per_worker = cores_per_worker

    def setup(self, worker):
        self.worker = worker
        self.jobs: dict = {}
        self.ended: collections.deque = collections.deque(maxlen=256)  # jobs torn down, newest last
        self.kept = KeptStates()  # trained states of the last fits, so that the next sends what changed
        apply_worker_settings()  # glibc keeps the steps' freed pages for the next step (dlspark._malloc)
        if self.pin_cores and hasattr(os, "sched_setaffinity"):
            cores = sorted(os.sched_getaffinity(0))
            per = self.cores_per_worker or max(1, len(cores) // self.n_workers)
            try:
                idx = int(worker.name) % max(1, len(cores) // per)
            except (TypeError, ValueError):
                idx = hash(worker.name) % max(1, len(cores) // per)
            pin_process(set(cores[idx * per:(idx + 1) * per]))
        for h in _HANDLERS:
            worker.handlers[f"dlspark_{h}"] = _reporting(getattr(self, f"_{h}"))

    def teardown(self, worker):
        for job in self.jobs.values():
            job.close()
        self.jobs.clear()
        self.kept.clear()

    def _job(self, job):
        try:
            return self.jobs[job]
        except KeyError:
            raise KeyError(f"job {job!r} is not set up on worker {self.worker.address}") from None

    # -- handlers ----------------------------------------------------------------
    async def _setup(self, job: str, spec: bytes, state: dict, rank: int = 0):
        """Set the job up from ``state``; a state that names a kept one (``kept``) brings only the
        arrays that differ from it. ``{"missing": True}``: that state is no longer kept here.
        ``continue``: the fit goes on from the kept one's end, and this replica with it (its
        residual and threshold, kept beside the state; see ``_kept``)."""
        key, goes_on = state.get("kept"), state.pop("continue", False)
        state = self.kept.fill(state)
        if state is None:
            return {"missing": True}
        run = await self._install(job, spec, state, rank)
        extra = self.kept.extra(key) if goes_on else None
        if extra is not None:
            await run.compute(run.continue_from, extra)
        return {"reply": None}

    async def _install(self, job, spec, state, rank):
        loop = asyncio.get_running_loop()
        spec = cloudpickle.loads(spec)
        if state.get("carried"):  # the arrays of what the algorithm carries came beside the spec
            spec = dataclasses.replace(spec, algorithm_state=put_arrays(spec.algorithm_state, state["carried"]))
        new = await loop.run_in_executor(
            None, lambda: spec.master.create_run_on_worker(self.worker, job, spec, state, rank))
        if job in self.ended:  # torn down while it was being set up (the fit failed elsewhere)
            new.close()
            raise RuntimeError(f"job {job!r} ended before its set-up on worker {self.worker.address} finished")
        old = self.jobs.pop(job, None)
        if old is not None:  # set up again (a retried join): the first one's threads end here
            old.close()
        self.jobs[job] = new
        return new

    async def _join(self, job: str, source: str, spec: bytes, rank: int):
        """Set up a job on a worker that arrived mid-fit, from a live peer's current state."""
        resp = await call_peer(self.worker, source, "dlspark_state", job=job, joiner=True)
        if "error" in resp:
            raise RuntimeError(f"could not get job {job!r}'s state from {source}: {resp['error'].text}")
        run = await self._install(job, spec, resp["state"], rank)
        run.adopt(resp["carried"])
        return {"reply": None}

    async def _order(self, job: str, order):
        """An order of the job's coordinator, answered by the job's run."""
        return {"reply": to_serialize(await self._job(job).handle(order))}

    async def _notice(self, job: str, notice):
        """A one-way word of the job's coordinator (a peer was lost), for the job's run."""
        if notice.kind == "peer_lost":  # this worker's calls to it now pending end at once, every job's
            peer_lost(self.worker, notice.peer)
        run = self.jobs.get(job)
        if run is not None:
            run.notice(notice)
        return {}

    async def _peer(self, job: str, request: str, **kw):
        """A peer's request (a contribution, a share, a message), answered by the job's run."""
        run = self.jobs.get(job)
        if run is None:
            return {"reply": to_serialize(Unavailable(peer=self.worker.address))}
        return await run.peer(request, **kw)

    async def _state(self, job: str, step: int | None = None, epoch: int | None = None, params: bool = False,
                     only: list | None = None, carried: bool = False, joiner: bool = False):
        """The job's train state and what its algorithm carries; with ``params``, only the
        parameters' leaves (a third of the state under Adam: a peer comparing replicas needs no more).
        ``only``: the indices of the state's arrays to send (the others None; what the algorithm
        carries only with ``carried``): the client takes a final state from several replicas at once.
        ``joiner``: the state a worker joining mid-fit starts from (``WorkerRun.joiner_state``)."""
        run = self._job(job)
        if params:
            import jax
            import numpy as np

            leaves = await run.compute(lambda: [np.asarray(x) for x in jax.tree_util.tree_leaves(run.state.params)])
            return {"params": to_serialize(leaves)}
        out = await run.dump_state(step, epoch, for_joiner=joiner)
        if only is not None:
            wanted = set(only)
            state = dict(out["state"], arrays=[a if i in wanted else None for i, a in enumerate(out["state"]["arrays"])])
            return {"state": to_serialize(state), "carried": to_serialize(out["carried"]) if carried else None}
        return {"state": to_serialize(out["state"]), "carried": to_serialize(out["carried"])}

    async def _keep(self, job: str, step: int | None = None, epoch: int | None = None):
        """Keep the job's trained state as the client would receive it (``step`` and ``epoch`` as
        the client sets them); its arrays' digests, or None when no state is kept."""
        run = self._job(job)
        out = await run.dump_state(step, epoch)
        kept = {"arrays": out["state"]["arrays"], "carried": carried_arrays({"carried": out["carried"]})}
        extra = await run.compute(run.replica_extra)
        return {"digests": await run.compute(self.kept.keep, job, kept, extra)}

    async def _divergence(self, job: str, source: str, whole_state: bool = False):
        """The largest absolute difference between this replica's parameters and ``source``'s,
        whose parameters come worker to worker: the client receives one number. (``whole_state``:
        fetch ``source``'s whole state, as before parameters alone could be asked for.)"""
        run = self._job(job)
        resp = await call_peer(self.worker, source, "dlspark_state", job=job, params=not whole_state)
        if "error" in resp:
            raise RuntimeError(f"could not get job {job!r}'s state from {source}: {resp['error'].text}")
        if whole_state:
            return {"reply": await run.compute(max_param_difference, run.state, resp["state"])}
        return {"reply": await run.compute(max_leaf_difference, run.state, resp["params"])}

    async def _clock(self):
        """This process's wall clock (the scheduler aligns event times with it)."""
        return {"time": time.time()}

    async def _events(self, job: str):
        """The job's recorded events (see ``dlspark.stats``), handed over once."""
        run = self.jobs.get(job)
        return {"events": run.stats.drain() if run is not None else []}

    async def _teardown(self, job: str):
        self.ended.append(job)
        j = self.jobs.pop(job, None)
        if j is not None:
            j.close()
        return {"reply": None}
