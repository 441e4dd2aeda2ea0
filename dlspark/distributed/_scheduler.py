"""Scheduler side: a SchedulerPlugin that runs jobs by driving the pure Coordinator.

It sends small control messages to the workers' dlspark handlers; dense
tensors move between workers only. Worker loss arrives both as comm errors and
through the ``remove_worker`` hook; arrivals through ``add_worker``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback

import cloudpickle
import numpy as np
from distributed.diagnostics.plugin import SchedulerPlugin

from ..errors import JobFailedError
from ._plan import Coordinator, tree_links

logger = logging.getLogger(__name__)

__all__ = ["DlsparkSchedulerPlugin"]

_JOIN_RETRIES = 20
#: seconds a job waits for its client to come back after losing it, before it is torn down
CLIENT_GRACE = 10.0


class _WorkerLost(Exception):
    pass


class RemoteError(Exception):
    """An error raised by a worker's handler, carried as pickled bytes to the client."""

    def __init__(self, pickled: bytes, text: str):
        super().__init__(text)
        self.pickled = pickled


class _JobRunner:
    def __init__(self, scheduler, job, workers, spec, partitions, epochs, options, client=None):
        self.scheduler = scheduler
        self.job = job
        self.client = client  # the client that started it: its loss ends the job
        self.spec = spec  # pickled job spec, for workers that join mid-fit
        self.live = set(workers)
        self.joined: set = set()
        self.next_rank = len(workers)
        self.options = options
        self.coord = Coordinator(partitions, epochs, options["steps_per_round"], options["repartition"],
                                 options["repartition_strategy"], skip=options.get("skip", ()))
        self.done = asyncio.Event()
        self.result: dict = {}
        self.stats: list = []
        self.gs_steps: dict = {}  # gradient sharing: each worker's message counter
        self.threshold_states: dict = {}
        self.cancelled = False
        self.task = asyncio.ensure_future(self._main())

    # -- events from the scheduler ---------------------------------------------
    def worker_left(self, addr):
        self.live.discard(addr)
        self.joined.discard(addr)

    def worker_joined(self, addr):
        if addr not in self.live:
            self.joined.add(addr)

    # -- helpers ---------------------------------------------------------------
    def _gone(self, addr):
        return addr not in self.scheduler.workers

    async def _call(self, addr, op, **kw):
        try:
            resp = await getattr(self.scheduler.rpc(addr), f"dlspark_{op}")(job=self.job, **kw)
        except OSError as e:
            raise _WorkerLost(addr) from e
        except Exception:
            if self._gone(addr):
                raise _WorkerLost(addr) from None
            raise
        if isinstance(resp, dict) and resp.get("status") == "dlspark-error":
            raise RemoteError(resp["error"], resp["text"])
        return resp

    async def _each(self, addrs, op, kw_for):
        addrs = list(addrs)
        results = await asyncio.gather(*[self._call(a, op, **kw_for(a)) for a in addrs], return_exceptions=True)
        ok, lost = {}, []
        for a, r in zip(addrs, results):
            if isinstance(r, _WorkerLost):
                lost.append(a)
            elif isinstance(r, BaseException):
                raise r
            else:
                ok[a] = r
        for a in lost:
            self.worker_left(a)
        return ok, lost

    def _emit(self, msg):
        self.scheduler.log_event(f"dlspark-{self.job}", msg)

    async def _admit_joiners(self):
        for addr in sorted(self.joined):
            if not self.live or self.cancelled:
                break
            source = sorted(self.live)[0]
            error = None
            for _ in range(_JOIN_RETRIES):
                if self.cancelled:
                    break
                try:
                    await self._call(addr, "join", source=source, spec=self.spec, rank=self.next_rank)
                    self.live.add(addr)
                    self.next_rank += 1
                    self._emit({"event": "joined", "worker": addr})
                    error = None
                    break
                except _WorkerLost:
                    break
                except Exception as e:  # the worker's plugin may not be set up yet
                    error = e
                    await asyncio.sleep(0.25)
            if error is not None:
                logger.warning("dlspark job %s: worker %s could not join: %s", self.job, addr, error)
                self._emit({"event": "join-failed", "worker": addr, "error": str(error)})
            self.joined.discard(addr)

    # -- the job ---------------------------------------------------------------
    async def _main(self):
        try:
            await self._rounds()
            if not self.live:
                raise JobFailedError(f"job {self.job}: every worker was lost")
            self.result = {"status": "OK", "worker": sorted(self.live)[0], "workers": sorted(self.live),
                           "trained": self.coord.trained_total, "stats": self.stats,
                           "threshold_states": [self.threshold_states[w] for w in sorted(self.live)
                                                if w in self.threshold_states]}
        except RemoteError as e:
            logger.warning("dlspark job %s failed on a worker: %s", self.job, e)
            self.result = {"status": "error", "error": e.pickled}
        except Exception as e:
            logger.warning("dlspark job %s failed: %s", self.job, e)
            try:
                err = cloudpickle.dumps(e)
            except Exception:
                err = cloudpickle.dumps(JobFailedError(f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            self.result = {"status": "error", "error": err}
        finally:
            self.done.set()

    async def _rounds(self):
        opts = self.options
        while not self.cancelled:
            if self.joined:
                await self._admit_joiners()
            if not self.live:
                return
            plan = self.coord.plan_round(self.live)
            if plan is None:
                return
            t0 = time.perf_counter()
            if opts.get("algorithm") == "sharing":
                fits, contributors, avgs = await self._sharing_round(plan)
            else:
                fits, contributors, avgs = await self._averaging_round(plan)
            t_fit = max((f["fit_time"] for f in fits.values()), default=0.0)
            counted = self.coord.complete_round(plan, contributors)
            losses = [fits[w]["loss_sum"] for w in contributors]
            n = sum(fits[w]["n"] for w in contributors)
            stat = {
                "event": "round", "round": plan.round, "epoch": plan.epoch, "minibatches": counted,
                "examples": sum(fits[w]["examples"] for w in contributors),
                "loss": (sum(losses) / n) if n else None, "workers": len(contributors),
                "round_time": time.perf_counter() - t0, "fit_time_max": t_fit,
                "worker_fit_time": {w: fits[w]["fit_time"] for w in contributors},
                "data_wait": {w: fits[w]["data_wait"] for w in contributors},
                "avg_time": max((a.get("avg_time", 0.0) for a in avgs.values()), default=0.0),
                "fetch_time": max((a.get("fetch_time", 0.0) for a in avgs.values()), default=0.0),
                "bytes_received": sum(a.get("bytes_received", 0) for a in avgs.values()),
                "trained_total": self.coord.trained_total,
            }
            if opts.get("algorithm") == "sharing":
                stat.update(
                    bytes_sent=sum(fits[w]["bytes_sent"] for w in contributors),
                    dense_bytes=sum(fits[w]["dense_bytes"] for w in contributors),
                    threshold={w: fits[w]["threshold"] for w in contributors},
                    stale_wait=max((fits[w]["stale_wait"] for w in contributors), default=0.0),
                    encoding_debug={w: fits[w]["debug"] for w in contributors if fits[w]["debug"]},
                    relayed=sum(fits[w].get("relayed", 0) for w in contributors),
                    fetched_at_sync=self._fetched_at_sync,
                )
            self.stats.append(stat)
            self._emit(stat)
            every = opts.get("checkpoint_every")
            if every and plan.round % every == 0 and self.live:
                await self._checkpoint()

    def _fit_kw(self, plan, hint, w, **extra):
        # ``next_refs``: what this worker will probably fit next round (``hint``, from
        # Coordinator.peek_round), for its prefetcher.
        return {"round": plan.round, "epoch": self.options["base_epoch"] + plan.epoch,
                "refs": plan.assignment[w], "next_refs": hint.get(w, []), **extra}

    async def _averaging_round(self, plan):
        """Every active worker fits and then averages with the round's other contributors,
        fetching their parameters itself; workers with no data this round only average. The
        scheduler steps in again only when a contributor was lost."""
        active = [w for w in plan.assignment if plan.assignment[w]]
        expected = plan.contributors
        hint = self.coord.peek_round(self.live)
        idle = [w for w in sorted(self.live) if w not in plan.assignment or not plan.assignment[w]]
        (fits, _), (idle_avgs, _) = await asyncio.gather(
            self._each(active, "fit", lambda w: self._fit_kw(plan, hint, w, average_with=expected)),
            self._each(idle, "average", lambda w: {"round": plan.round, "contributors": expected}),
        )
        avgs = {**{w: f.pop("averaged", None) for w, f in fits.items()}, **idle_avgs}
        contributors = [w for w in expected if w in fits and w in self.live]
        for attempt in range(1, len(expected) + 3):
            receivers = sorted(self.live)
            if not receivers:
                return fits, [], {}
            if contributors == expected and all(avgs.get(w) and "lost_peer" not in avgs[w] for w in receivers):
                return fits, contributors, avgs
            # A worker could not fetch from a contributor. If the coordinator cannot reach it
            # either, it is lost: average again over those left (from the stored
            # contributions, so a worker that already averaged gets the same result). If it
            # answers, the failure has passed: average again over the same contributors,
            # rather than throw its round away.
            reported = {(a or {}).get("lost_peer") for a in avgs.values()} & set(contributors)
            for peer in sorted(reported):
                if self._gone(peer) or not await self._answers(peer):
                    contributors.remove(peer)
                    self.worker_left(peer)
            expected = contributors = [w for w in contributors if w in self.live]
            avgs, _ = await self._each(receivers, "average",
                                       lambda w: {"round": plan.round, "contributors": contributors,
                                                  "attempt": attempt})
        raise JobFailedError(f"job {self.job}: round {plan.round} could not be averaged")

    async def _answers(self, addr) -> bool:
        try:
            await self._call(addr, "rng")
            return True
        except Exception:
            return False

    async def _sharing_round(self, plan):
        """Workers step freely, exchanging messages peer to peer; then every replica
        catches up on the round's messages it missed, so all applied the same set."""
        peers = {w: (self.gs_steps.get(w, 0), len(plan.assignment.get(w, []))) for w in sorted(self.live)}
        active = [w for w in plan.assignment if plan.assignment[w]]
        # Tree mesh: the round's active workers relay to tree neighbours only;
        # idle workers catch up in the sync below.
        links = tree_links(active, self.options["tree_fanout"]) if self.options.get("mesh") == "tree" else {}
        hint = self.coord.peek_round(self.live)
        fits, _ = await self._each(active, "fit",
                                   lambda w: self._fit_kw(plan, hint, w, peers=peers, links=links.get(w)))
        contributors = [w for w in plan.contributors if w in fits and w in self.live]
        for _ in range(len(self.live) + 3):
            receivers = sorted(self.live)
            if not receivers:
                return fits, [], {}
            haves, lost = await self._each(receivers, "gs_have", lambda w: {})
            holder: dict = {}
            for w in sorted(haves, key=lambda a: a not in contributors):
                for sender, steps in haves[w]["have"].items():
                    for k in steps:
                        holder.setdefault((sender, k), sender if sender in haves else w)
            missing = {}
            for w in haves:
                mine = {(s, k) for s, ks in haves[w]["have"].items() for k in ks}
                need: dict = {}
                for key, h in holder.items():
                    if key not in mine and key[0] != w:
                        need.setdefault(h, []).append(list(key))
                missing[w] = need
            syncs, lost = await self._each(sorted(haves), "gs_sync", lambda w: {"missing": missing[w]})
            # A holder that a peer could not reach is dropped from the job, as a lost worker
            # is, if the coordinator cannot reach it either; the next pass syncs the rest
            # from the holders left (or, if the failure passed, from the same ones).
            unreachable = {h for r in syncs.values() for h in r.get("unreachable", ())} & self.live
            for h in sorted(unreachable):
                if not await self._answers(h):
                    logger.warning("dlspark job %s: dropping worker %s, unreachable during the sync", self.job, h)
                    self.worker_left(h)
            if not lost and not unreachable:
                break
            contributors = [w for w in contributors if w in self.live]
        else:
            raise JobFailedError(f"job {self.job}: round {plan.round}: the replicas could not be synced")
        self._fetched_at_sync = sum(sum(len(k) for k in missing[w].values()) for w in syncs)
        for w, r in syncs.items():
            self.gs_steps[w] = r["step"]
            self.threshold_states[w] = r["threshold_state"]
        await self._each(sorted(self.live), "gs_next", lambda w: {})
        return fits, [w for w in contributors if w in self.live], {}

    async def _checkpoint(self):
        opts = self.options
        progress = self.coord.progress()
        progress.update(epoch=opts.get("epochs_done", 0) + progress["epoch"],
                        epochs_total=opts.get("epochs_total", self.coord.epochs))
        # Each worker's RNG, in the order rounds are assigned (sorted addresses): a resumed
        # fit gives the worker in each position the dropout stream it would have had.
        rngs, _ = await self._each(sorted(self.live), "rng", lambda w: {})
        # Gradient sharing: the thresholds reached, with the algorithm that reached them
        # (JSON has no NaN: a worker that has not stepped yet has no last sparsity).
        thresholds = {"algorithm": opts.get("threshold_algorithm"),
                      "states": [[x if np.isfinite(x) else None for x in self.threshold_states[w]]
                                 for w in sorted(self.live) if w in self.threshold_states]}
        for addr in sorted(rngs):
            if addr not in self.live:
                continue
            try:
                await self._call(addr, "checkpoint", url=opts["checkpoint_url"],
                                 step=opts["base_step"] + self.coord.trained_total,
                                 epoch=opts["base_epoch"] + self.coord.epoch, progress=progress,
                                 worker_rngs=[rngs[w]["rng"] for w in sorted(rngs) if w in self.live],
                                 threshold_states=thresholds)
                self._emit({"event": "checkpoint", "url": opts["checkpoint_url"], "round": self.coord.round})
                return
            except _WorkerLost:
                continue


class DlsparkSchedulerPlugin(SchedulerPlugin):
    """Hosts dlspark's job coordinators in the scheduler (one per running job)."""

    name = "dlspark-coordinator"

    def __init__(self):
        self.jobs: dict = {}

    async def start(self, scheduler):
        self.scheduler = scheduler
        scheduler.handlers["dlspark_start"] = self._start
        scheduler.handlers["dlspark_wait"] = self._wait
        scheduler.handlers["dlspark_finish"] = self._finish

    def remove_worker(self, scheduler, worker, *, stimulus_id=None, **kwargs):
        for job in self.jobs.values():
            job.worker_left(worker)

    def add_worker(self, scheduler, worker):
        for job in self.jobs.values():
            job.worker_joined(worker)

    def remove_client(self, scheduler, client):
        # A client that died (a killed notebook kernel) never calls dlspark_finish: its
        # jobs would train on and hold every worker's job state. Unless it reconnects
        # within CLIENT_GRACE seconds, they are stopped and torn down.
        for job, runner in list(self.jobs.items()):
            if runner.client == client:
                asyncio.get_running_loop().call_later(
                    CLIENT_GRACE, lambda job=job: asyncio.ensure_future(self._abandon(job, client)))

    async def _abandon(self, job, client):
        if client in self.scheduler.clients or job not in self.jobs:
            return
        logger.warning("dlspark job %s: its client %s is gone; stopping the job", job, client)
        await self._finish(job)

    async def _start(self, job, workers, spec, partitions, epochs, options, client=None):
        if job in self.jobs:
            raise ValueError(f"job {job!r} is already running")
        self.jobs[job] = _JobRunner(self.scheduler, job, workers, spec, partitions, epochs, options, client)
        return {"status": "OK"}

    async def _wait(self, job):
        runner = self.jobs[job]
        await runner.done.wait()
        return runner.result

    async def _finish(self, job):
        """Forget the job here and on every worker (called once the client has the result)."""
        runner = self.jobs.pop(job, None)
        if runner is not None:
            runner.cancelled = True
        await asyncio.gather(
            *[self.scheduler.rpc(w).dlspark_teardown(job=job) for w in list(self.scheduler.workers)],
            return_exceptions=True,
        )
        return {"status": "OK"}
