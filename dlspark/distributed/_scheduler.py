"""Scheduler side: a SchedulerPlugin that hosts each job's state machine and carries out
its instructions.

The policy lives in :class:`~dlspark.distributed._machine.JobMachine`; this
module only does the I/O: it sends the machine's orders to the workers' dlspark
handlers, turns their answers, comm errors and Dask's ``add_worker`` /
``remove_worker`` / client hooks into events, and feeds them back. Everything
runs on the scheduler's event loop, one event at a time. Dense tensors move
between workers only.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import cloudpickle
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol import to_serialize
from distributed.protocol.serialize import Serialized, deserialize

from .. import config
from ._machine import (Abandon, Cancel, ClientBack, ClientLost, Emit, Fail, Failed, Finish, Join, JobMachine,
                       JoinFailed, Joined, Probe, Probed, Replied, Send, Settings, Start, Tell, Timer, WorkerJoined,
                       WorkerLost)
from ._messages import WORKER_EVENTS, ErrorReply, JobOptions, RngOrder
from ..stats._collect import gather_job, measure_workers
from ..stats._live import LivePage
from ..stats._recorder import NULL, Recorder

logger = logging.getLogger(__name__)

__all__ = ["DlsparkSchedulerPlugin", "settings_from_config"]


def settings_from_config() -> Settings:
    """The job machine's bounds, from ``dlspark.scheduler.*`` in dask.config."""
    return Settings(client_grace=config.get_seconds("scheduler.client-grace"),
                    join_attempts=int(config.get("scheduler.join-attempts")),
                    join_interval=config.get_seconds("scheduler.join-interval"),
                    extra_attempts=int(config.get("scheduler.extra-attempts")))


def _unwrap(x):
    """The scheduler does not deserialize what it receives: our typed replies come as
    ``Serialized`` (dlspark's own classes; a user's exception stays pickled inside)."""
    return deserialize(x.header, x.frames) if isinstance(x, Serialized) else x


class _JobShell:
    """One job: its machine, and the I/O that the machine's instructions call for."""

    def __init__(self, plugin, job, machine, spec: bytes, client):
        self.plugin = plugin
        self.scheduler = plugin.scheduler
        self.job = job
        self.machine = machine
        self.spec = spec  # pickled job spec, for workers that join mid-fit
        self.client = client  # the client that started it: its loss ends the job
        self.done = asyncio.Event()
        self.result = None
        self.tasks: set = set()
        self.stats = NULL  # the job's statistics: a Recorder when the master collects them
        self.clocks: dict = {}

    def feed(self, event):
        try:
            t0 = self.stats.now()
            instructions = self.machine.handle(event, time.perf_counter())
            if instructions:
                self.stats.add("plan", t0, self.stats.now(), event=type(event).__name__)
            for instruction in instructions:
                self._carry_out(instruction)
        except Exception as e:  # a defect here must fail the job, not hang its client
            logger.exception("dlspark job %s: the coordinator failed on %r", self.job, event)
            self.machine.over = True
            self._do_Fail(Fail(ErrorReply.from_exception(e)))

    def _spawn(self, coro):
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _gone(self, addr):
        return addr not in self.scheduler.workers

    # -- instructions ---------------------------------------------------------------
    @functools.singledispatchmethod
    def _carry_out(self, instruction):
        """Carry out one of the machine's instructions, dispatched by its type."""
        raise TypeError(f"the scheduler plugin has no handler for the instruction {type(instruction).__name__}")

    @_carry_out.register
    def _do_Send(self, i: Send):
        self._spawn(self._send(i))

    async def _send(self, i: Send):
        t0 = self.stats.now()
        try:
            resp = await self.scheduler.rpc(i.worker).dlspark_order(job=self.job, order=to_serialize(i.order))
            self.stats.add("order", t0, self.stats.now(), "orders", op=i.order.op, to=i.worker,
                           round=getattr(i.order, "round", None))
        except OSError:
            return self.feed(WorkerLost(i.worker))
        except Exception as e:
            if self._gone(i.worker):
                return self.feed(WorkerLost(i.worker))
            return self.feed(Failed(i.worker, i.seq, ErrorReply.from_exception(e)))
        if "error" in resp:
            return self.feed(Failed(i.worker, i.seq, _unwrap(resp["error"])))
        self.feed(Replied(i.worker, i.seq, _unwrap(resp["reply"])))

    @_carry_out.register
    def _do_Tell(self, i: Tell):
        self._spawn(self._tell(i))

    async def _tell(self, i: Tell):
        try:
            await self.scheduler.rpc(i.worker).dlspark_notice(job=self.job, notice=to_serialize(i.notice))
        except Exception as e:  # a worker gone meanwhile is lost by its own event
            logger.debug("dlspark job %s: could not tell %s %s: %s", self.job, i.worker, i.notice, e)

    @_carry_out.register
    def _do_Probe(self, i: Probe):
        self._spawn(self._probe(i.worker))

    async def _probe(self, addr):
        alive = False
        if not self._gone(addr):
            try:
                resp = await self.scheduler.rpc(addr).dlspark_order(job=self.job, order=to_serialize(RngOrder()))
                alive = "reply" in resp
            except Exception:
                alive = False
        if not alive:
            logger.warning("dlspark job %s: dropping worker %s, which a peer and the coordinator cannot reach",
                           self.job, addr)
        self.feed(Probed(addr, alive))

    @_carry_out.register
    def _do_Join(self, i: Join):
        self._spawn(self._join(i))

    async def _join(self, i: Join):
        if i.delay:
            await asyncio.sleep(i.delay)
        try:
            resp = await self.scheduler.rpc(i.worker).dlspark_join(job=self.job, source=i.source, spec=self.spec,
                                                                   rank=i.rank)
        except OSError:
            return self.feed(WorkerLost(i.worker))
        except Exception as e:  # the worker's plugin may not be set up yet
            return self.feed(JoinFailed(i.worker, f"{type(e).__name__}: {e}"))
        if "error" in resp:
            return self.feed(JoinFailed(i.worker, _unwrap(resp["error"]).text))
        if self.stats is not NULL:  # a worker joining mid-fit: its clock, so its events line up too
            self.clocks.update(await measure_workers(self.scheduler.rpc, [i.worker]))
        self.feed(Joined(i.worker))

    @_carry_out.register
    def _do_Emit(self, i: Emit):
        if i.msg.get("event") == "join-failed":
            logger.warning("dlspark job %s: worker %s could not join: %s", self.job, i.msg["worker"], i.msg["error"])
        if i.msg.get("event") == "partitioned":
            logger.warning("dlspark job %s: dropping worker %s, which %s cannot reach while the coordinator reaches "
                           "both", self.job, i.msg["worker"], ", ".join(i.msg["unreachable_from"]))
        self.scheduler.log_event(f"dlspark-{self.job}", i.msg)
        phase = WORKER_EVENTS.get(i.msg.get("event"))
        if phase is not None:  # on the timeline too, at the moment it happened
            t = self.stats.now()
            self.stats.add(phase, t, t, "workers", peer=i.msg["worker"], round=i.msg["round"],
                           workers=i.msg.get("workers"))
            self.plugin.live.worker_event(self.job, i.msg)
        if i.msg.get("event") == "round":
            t = self.stats.now()
            self.stats.add("round", t - i.msg["round_time"], t, "rounds", number=i.msg["round"])
            self.plugin.live.round_done(self.job, i.msg)

    @_carry_out.register
    def _do_Timer(self, i: Timer):
        asyncio.get_running_loop().call_later(i.seconds, self.feed, i.event)

    @_carry_out.register
    def _do_Finish(self, i: Finish):
        self.result = {"result": to_serialize(i.result)}
        self.done.set()

    @_carry_out.register
    def _do_Fail(self, i: Fail):
        logger.warning("dlspark job %s failed: %s", self.job, i.error.text)
        self.result = {"error": to_serialize(i.error)}
        self.done.set()

    @_carry_out.register
    def _do_Abandon(self, i: Abandon):
        logger.warning("dlspark %s; stopping the job", i.reason)
        self.result = {"error": to_serialize(ErrorReply.from_exception(RuntimeError(i.reason)))}
        self.done.set()
        self._spawn(self.plugin._finish(self.job))


class DlsparkSchedulerPlugin(SchedulerPlugin):
    """Hosts dlspark's jobs in the scheduler: one state machine each, routed by job id."""

    name = "dlspark-coordinator"

    def __init__(self):
        self.jobs: dict = {}
        self._teardowns: set = set()  # running in the background, referenced until done

    async def start(self, scheduler):
        self.scheduler = scheduler
        scheduler.handlers["dlspark_start"] = self._start
        scheduler.handlers["dlspark_wait"] = self._wait
        scheduler.handlers["dlspark_finish"] = self._finish
        scheduler.handlers["dlspark_clock"] = self._clock
        scheduler.handlers["dlspark_listed"] = self._listed
        scheduler.handlers["dlspark_job_stats"] = self._job_stats
        self.live = LivePage.install(scheduler)

    def remove_worker(self, scheduler, worker, *, stimulus_id=None, **kwargs):
        for shell in list(self.jobs.values()):
            shell.feed(WorkerLost(worker))

    def add_worker(self, scheduler, worker):
        for shell in list(self.jobs.values()):
            shell.feed(WorkerJoined(worker))

    def remove_client(self, scheduler, client):
        # A client that died (a killed notebook kernel) never calls dlspark_finish: its
        # jobs would train on and hold every worker's job state.
        for shell in list(self.jobs.values()):
            if shell.client == client:
                shell.feed(ClientLost())

    def add_client(self, scheduler, client):
        for shell in list(self.jobs.values()):
            if shell.client == client:
                shell.feed(ClientBack())

    async def _start(self, job, workers, spec, partitions, master, options, client=None, wait=False):
        """Start a job; with ``wait``, answer with its result once it is done (as ``_wait``)."""
        if job in self.jobs:
            raise ValueError(f"job {job!r} is already running")
        master = cloudpickle.loads(master)
        options = JobOptions(**options)
        machine = JobMachine(job, workers, master.create_driver(options), partitions, options, settings_from_config())
        shell = self.jobs[job] = _JobShell(self, job, machine, spec, client)
        if master.collect_training_stats:
            shell.stats = Recorder()
            shell.clocks = await measure_workers(self.scheduler.rpc, workers)
        self.live.job_started(job, master, workers)
        shell.feed(Start())
        return (await self._wait(job)) if wait else {}

    async def _wait(self, job):
        shell = self.jobs[job]
        await shell.done.wait()
        return shell.result

    async def _clock(self):
        return {"time": time.time()}

    async def _listed(self, addresses):
        """Which of ``addresses`` are workers now (a worker waiting on a peer asks; see ``_peers``)."""
        return {"listed": [a for a in addresses if a in self.scheduler.workers]}

    async def _job_stats(self, job):
        """A finished job's statistics: the workers' clocks measured again and every
        worker's events (see ``dlspark.stats``)."""
        shell = self.jobs[job]
        workers = [w for w in shell.clocks if w in self.scheduler.workers]
        return {"stats": await gather_job(self.scheduler.rpc, job, workers, shell.clocks, shell.stats.drain())}

    async def _finish(self, job):
        """Forget the job here and on every worker (called once the client has the result). The
        workers' teardowns go on after the reply: a fit call does not wait for them."""
        shell = self.jobs.pop(job, None)
        if shell is not None:
            shell.feed(Cancel())
            if not shell.done.is_set():
                shell.result = {"error": to_serialize(ErrorReply.from_exception(RuntimeError(f"job {job} was stopped")))}
                shell.done.set()
        task = asyncio.ensure_future(asyncio.gather(
            *[self.scheduler.rpc(w).dlspark_teardown(job=job) for w in list(self.scheduler.workers)],
            return_exceptions=True,
        ))
        self._teardowns.add(task)
        task.add_done_callback(self._teardowns.discard)
        return {}
