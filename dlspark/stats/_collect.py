"""Gathering a job's statistics: clock measurements and events from the workers, the
scheduler and the client, assembled on the scheduler's clock."""

from __future__ import annotations

import asyncio

from ._clock import Clock, measure_offset
from ._recorder import NULL, Recorder
from ._summary import TrainingStats, events_from_raw

__all__ = ["measure_workers", "gather_job", "measure_scheduler", "assemble"]

#: ping exchanges per measurement (the one with the smallest round trip is kept)
PINGS = 5


async def measure_workers(rpc, workers) -> dict:
    """``{worker: best_offset}`` of each worker's clock against this (the scheduler's) one."""

    async def one(w):
        async def ping():
            return (await rpc(w).dlspark_clock())["time"]

        try:
            return w, await measure_offset(ping, PINGS)
        except Exception:  # lost meanwhile: its events (if any come) stay uncorrected
            return w, None

    return {w: m for w, m in await asyncio.gather(*[one(w) for w in workers]) if m is not None}


async def gather_job(rpc, job, workers, start_clocks: dict, scheduler_events: list) -> dict:
    """At a job's end: every worker's clock measured again, and its events. Returns what the
    client assembles (see :func:`assemble`)."""
    end_clocks = await measure_workers(rpc, workers)

    async def events(w):
        try:
            return w, (await rpc(w).dlspark_events(job=job))["events"]
        except Exception:  # lost since: its events are lost with it
            return w, None

    got = {w: ev for w, ev in await asyncio.gather(*[events(w) for w in workers]) if ev is not None}
    return {"start": start_clocks, "end": end_clocks, "scheduler": scheduler_events, "events": got}


async def measure_scheduler(rpc_scheduler) -> dict:
    """The scheduler's clock against this (the client's) one."""

    async def ping():
        return (await rpc_scheduler.dlspark_clock())["time"]

    return await measure_offset(ping, PINGS)


def _worker_clock(start, end) -> Clock:
    """A worker's clock from the scheduler's measurements (remote minus local, ``at`` on the
    scheduler's clock) as offsets of the worker's clock, ``at`` on the worker's clock."""

    def conv(m):
        return None if m is None else {**m, "at": m["at"] + m["offset"]}

    return Clock(conv(start), conv(end))


def _client_clock(start, end) -> Clock:
    """The client's clock from its own measurements of the scheduler's (the opposite sense)."""

    def conv(m):
        return None if m is None else {**m, "offset": -m["offset"]}

    return Clock(conv(start), conv(end))


def assemble(job: str, algorithm: str, rounds, gathered: dict, client_events, client_clocks, window,
             workers) -> TrainingStats:
    """One job's :class:`TrainingStats`, every time on the scheduler's clock.

    ``gathered`` is the scheduler's answer (its events, its clock measurements of the
    workers, every worker's events), ``client_clocks`` the client's two measurements of the
    scheduler's clock, ``window`` the client's ``(start, end)`` of the fit.
    """
    events, clocks = [], {}
    no_offset = Clock({"offset": 0.0, "error": 0.0, "at": 0.0})
    events += events_from_raw(gathered["scheduler"], "scheduler", no_offset, job)
    cc = _client_clock(*client_clocks)
    clocks["client"] = cc.as_dict()
    events += events_from_raw(client_events, "client", cc, job)
    for w, raw in gathered["events"].items():
        start = gathered["start"].get(w)
        if start is None:
            continue
        wc = _worker_clock(start, gathered["end"].get(w))
        clocks[w] = wc.as_dict()
        events += events_from_raw(raw, w, wc, job)
    events.sort(key=lambda e: e["start"])
    t0, t1 = cc.to_scheduler(window[0]), cc.to_scheduler(window[1])
    return TrainingStats(rounds, events, {job: clocks},
                         [{"job": job, "algorithm": algorithm, "start": t0, "end": t1, "workers": list(workers)}])



class ClientSide:
    """The client's part of a job's statistics: its events, its clock against the
    scheduler's, and the assembly at the end (:class:`NoClientSide` when they are off)."""

    def __init__(self, client, export_span=None):
        self.client = client
        self.rec = Recorder()
        self.window_start = export_span[0] if export_span else self.rec.now()
        if export_span:
            self.rec.add("export", export_span[0], export_span[1], "client")
        with self.rec.span("clock", "client"):
            self.clock_start = client.sync(measure_scheduler, client.scheduler)

    def span(self, phase, **fields):
        return self.rec.span(phase, "client", **fields)

    def finish(self, job, algorithm, rounds, workers) -> TrainingStats:
        window_end = self.rec.now()
        clock_end = self.client.sync(measure_scheduler, self.client.scheduler)
        gathered = self.client.sync(self.client.scheduler.dlspark_job_stats, job=job)["stats"]
        return assemble(job, algorithm, rounds, gathered, self.rec.drain(), (self.clock_start, clock_end),
                        (self.window_start, window_end), workers)


class NoClientSide:
    """Statistics off: spans that record nothing."""

    def span(self, phase, **fields):
        return NULL.span(phase)
