"""A fit's training statistics: every round's record and every timed event, on the scheduler's clock.

:class:`TrainingStats` is what ``trainer.training_stats`` holds. Iterating over it
(or indexing, ``len``) gives the round records, as the list it replaces did;
``events`` holds the timed events (one dict each), ``summary()`` the figures
per phase, and the exports write JSON (any fsspec URL) or a self-contained HTML
report.
"""

from __future__ import annotations

import json

import numpy as np

from ._clock import Clock

__all__ = ["TrainingStats", "load_json", "PHASES", "MAIN_LANE"]

MAIN_LANE = "main"

#: Every phase a worker, the scheduler or the client records, with what it covers.
PHASES = {
    "setup": "a worker sets the job up from the broadcast spec and initial state",
    "compile": "JAX traces, lowers and compiles a function (taken out of the phase it happened in)",
    "data_wait": "the compute thread waits for its next minibatch",
    "load": "the loading thread reads and stages one minibatch",
    "fit": "one minibatch's step (gradient sharing: computing its update and reading it back)",
    "prepare": "parameter averaging: the replica's contribution copied for its peers",
    "fetch": "parameter averaging: fetching peers' contributions or averaged shares",
    "average": "parameter averaging: computing the mean (or a share of it) into the state",
    "serve": "a peer's request for a contribution or a share answered",
    "wait_peers": "gradient sharing: waiting for a peer more than max_staleness steps behind",
    "encode": "gradient sharing: threshold-encoding the residual",
    "send": "gradient sharing: handing the message to the event loop",
    "push": "gradient sharing: writing one message to the peers",
    "receive": "gradient sharing: a peer's message taken into the inbox",
    "decode": "gradient sharing: decoding its own and the peers' messages",
    "apply": "gradient sharing: applying the decoded update",
    "threshold": "gradient sharing: residual post-processing and the threshold's update",
    "sync": "gradient sharing: the end-of-round sync (missed messages fetched and applied)",
    "checkpoint": "writing a checkpoint",
    "control": "handling a coordinator's order outside the phases above",
    "idle": "waiting for the coordinator's next order (at a barrier, or between rounds)",
    "round": "the scheduler: one round, from its first order to its last answer",
    "order": "the scheduler: one order's round trip to a worker",
    "plan": "the scheduler: the job's state machine handling one event",
    "worker_lost": "the scheduler: a worker of the job was lost (``peer``; an instant, of length 0)",
    "worker_joined": "the scheduler: a worker joined the job mid-fit (``peer``; an instant)",
    "worker_join_failed": "the scheduler: a worker that arrived mid-fit could not join (``peer``; an instant)",
    "worker_dropped": "the scheduler: a worker dropped because a peer could not reach it (``peer``; an instant)",
    "export": "the client: turning the data into minibatch files or references",
    "clock": "the client: measuring the clocks",
    "broadcast": "the client: setting the job up on the workers (spec and initial state)",
    "start": "the client: starting the job in the scheduler (the workers' clocks measured there)",
    "wait": "the client: waiting for the job's result",
    "fetch_state": "the client: fetching the trained state",
}

_BASE = ("phase", "start", "duration", "worker", "lane", "round", "job")


def _percentile(values, q):
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else float("nan")


def events_from_raw(raw, worker, clock: Clock, job) -> list:
    """Recorder tuples of one process as event dicts, their times on the scheduler's clock."""
    out = []
    for phase, start, duration, lane, round, fields in raw:
        e = {"phase": phase, "start": clock.to_scheduler(start), "duration": float(duration), "worker": worker,
             "lane": lane, "round": round, "job": job}
        if fields:
            e.update(fields)
        out.append(e)
    return out


class TrainingStats:
    """Round records and timed events of one or more fits.

    Parameters
    ----------
    rounds : list of dict
        One record per round (loss, examples, round time, per-worker figures).
    events : list of dict
        Timed events: ``phase``, ``start`` (seconds, scheduler's wall clock),
        ``duration`` (seconds), ``worker`` (an address, ``"scheduler"`` or
        ``"client"``), ``lane``, ``round``, ``job`` and the event's figures
        (``bytes``, ``examples``, ``threshold``, ``sparsity``...).
    clocks : dict
        Per job, per process: its clock's offset to the scheduler's at the start
        and end of the job, the drift and the error bound of corrected times.
    jobs : list of dict
        Per fit: ``job``, ``algorithm``, ``start`` and ``end`` (the client's
        window on the scheduler's clock), ``workers``.

    Examples
    --------
    >>> s = TrainingStats(events=[{"phase": "fit", "start": 0.0, "duration": 0.01, "worker": "w"}])
    >>> s.summary()["fit"]["count"]
    1
    """

    def __init__(self, rounds=(), events=(), clocks=None, jobs=()):
        self.rounds = list(rounds)
        self.events = list(events)
        self.clocks = dict(clocks or {})
        self.jobs = list(jobs)

    # -- the list of rounds it replaces --------------------------------------------
    def __iter__(self):
        return iter(self.rounds)

    def __len__(self):
        return len(self.rounds)

    def __getitem__(self, i):
        return self.rounds[i]

    def __bool__(self):
        return bool(self.rounds or self.events)

    def __repr__(self):
        return (f"TrainingStats({len(self.jobs)} jobs, {len(self.rounds)} rounds, {len(self.events)} events, "
                f"{len(self.workers())} workers)")

    def add(self, other: "TrainingStats") -> None:
        """Append another fit's statistics."""
        self.rounds += other.rounds
        self.events += other.events
        self.clocks.update(other.clocks)
        self.jobs += other.jobs

    # -- queries -------------------------------------------------------------------
    def workers(self) -> list:
        """The workers that recorded events (the scheduler and client excluded), sorted."""
        return sorted({e["worker"] for e in self.events} - {"scheduler", "client"})

    def phases(self, worker=None) -> list:
        return sorted({e["phase"] for e in self.events if worker is None or e["worker"] == worker})

    def select(self, phase=None, worker=None, lane=None, round=None) -> list:
        """The events matching every argument given."""
        return [e for e in self.events if (phase is None or e["phase"] == phase)
                and (worker is None or e["worker"] == worker) and (lane is None or e.get("lane") == lane)
                and (round is None or e.get("round") == round)]

    def summary(self, worker=None, lane=None) -> dict:
        """``{phase: {"count", "mean", "p50", "p95", "total"}}`` in seconds, over every event
        (or one worker's, one lane's)."""
        by: dict = {}
        for e in self.events:
            if (worker is None or e["worker"] == worker) and (lane is None or e.get("lane") == lane):
                by.setdefault(e["phase"], []).append(e["duration"])
        return {p: {"count": len(d), "mean": float(np.mean(d)), "p50": _percentile(d, 50),
                    "p95": _percentile(d, 95), "total": float(np.sum(d))} for p, d in sorted(by.items())}

    def round_phases(self, worker) -> dict:
        """``{round: {phase: seconds}}`` of a worker's main lane (the round's own path)."""
        out: dict = {}
        for e in self.events:
            if e["worker"] == worker and e.get("lane") == MAIN_LANE and e.get("round") is not None:
                d = out.setdefault(e["round"], {})
                d[e["phase"]] = d.get(e["phase"], 0.0) + e["duration"]
        return out

    def per_worker(self) -> dict:
        """``{worker: {"examples", "bytes_sent", "bytes_received", "steps"}}``."""
        out = {w: {"examples": 0, "bytes_sent": 0, "bytes_received": 0, "steps": 0} for w in self.workers()}
        for e in self.events:
            w = out.get(e["worker"])
            if w is None:
                continue
            if e["phase"] == "fit":
                w["examples"] += int(e.get("examples", 0) or 0)
                w["steps"] += int(e.get("steps", 1))
            if e["phase"] in ("push", "serve"):
                w["bytes_sent"] += int(e.get("bytes", 0) or 0)
            if e["phase"] in ("receive", "fetch", "sync"):
                w["bytes_received"] += int(e.get("bytes", 0) or 0)
        return out

    def clock_error(self) -> float:
        """The largest error bound of any process's corrected times (seconds)."""
        return max((c["error"] for j in self.clocks.values() for c in j.values()), default=0.0)

    # -- text, frames, files -----------------------------------------------------------
    def stats_as_string(self) -> str:
        """A text summary: the fits, the clocks, and per phase its count, mean, p50, p95 and total."""
        lines = [f"dlspark training statistics: {len(self.jobs)} fits, {len(self.rounds)} rounds, "
                 f"{len(self.workers())} workers, {len(self.events)} events"]
        for job in self.jobs:
            lines.append(f"fit {job['job']} ({job.get('algorithm', '?')}): {job['end'] - job['start']:.3f} s "
                         f"on {len(job.get('workers', ()))} workers")
        if self.clocks:
            lines.append(f"clocks aligned to the scheduler's within {self.clock_error() * 1e3:.3f} ms")
            for job, clocks in self.clocks.items():
                for who, c in sorted(clocks.items()):
                    lines.append(f"  {who}: offset {c['start']['offset'] * 1e3:+.3f} ms, "
                                 f"drift {c['drift'] * 1e3:+.3f} ms, error {c['error'] * 1e3:.3f} ms")
        rows = self.summary()
        if rows:
            lines.append(f"{'phase':<12} {'count':>7} {'mean ms':>10} {'p50 ms':>10} {'p95 ms':>10} {'total s':>10}")
            for p, r in rows.items():
                lines.append(f"{p:<12} {r['count']:>7d} {r['mean'] * 1e3:>10.3f} {r['p50'] * 1e3:>10.3f} "
                             f"{r['p95'] * 1e3:>10.3f} {r['total']:>10.3f}")
        return "\n".join(lines)

    def to_dataframe(self):
        """The events as a pandas DataFrame (one row per event; pandas must be installed)."""
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError("to_dataframe needs pandas: pip install pandas") from e
        cols = list(_BASE) + sorted({k for e in self.events for k in e} - set(_BASE))
        return pd.DataFrame(self.events, columns=cols)

    def to_dict(self) -> dict:
        return {"format": "dlspark-training-stats", "version": 1, "jobs": self.jobs, "clocks": self.clocks,
                "rounds": self.rounds, "events": self.events}

    @classmethod
    def from_dict(cls, d: dict) -> "TrainingStats":
        if not isinstance(d, dict) or d.get("format") != "dlspark-training-stats":
            raise ValueError("not a dlspark training statistics file: expected a JSON object with "
                             "format 'dlspark-training-stats' (written by TrainingStats.export_json)")
        return cls(d.get("rounds", ()), d.get("events", ()), d.get("clocks"), d.get("jobs", ()))

    def export_json(self, url: str, **storage_options) -> None:
        """Write everything to ``url`` (any fsspec URL) as strict JSON, atomically: a value that
        is not a finite number (a NaN loss) is written as ``{"__float__": "nan"}``, which
        :meth:`load_json` reads back, rather than as a bare ``NaN`` that strict parsers refuse."""
        from ..io import write_text

        write_text(url, json.dumps(_finite(self.to_dict()), default=_json_default, allow_nan=False),
                   **storage_options)

    @classmethod
    def load_json(cls, url: str, **storage_options) -> "TrainingStats":
        """Read what :meth:`export_json` wrote."""
        from ..io import read_text

        return cls.from_dict(json.loads(read_text(url, **storage_options), object_hook=_float_hook))

    def export_html(self, url: str, title: str = "dlspark training statistics", **storage_options) -> None:
        """Write a self-contained HTML report (bokeh, scripts inlined) to ``url``: the timeline
        with a lane per worker and thread, durations per phase, examples and bytes per
        worker, the loss curve and, for gradient sharing, threshold, sparsity and bytes per step."""
        from ..io import write_text
        from ._pages import report_html

        write_text(url, report_html(self, title), **storage_options)


def _finite(x):
    """``x`` with every float that is not finite written as ``{"__float__": "nan"}`` (or inf)."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [_finite(v) for v in x]
    if isinstance(x, (float, np.floating)) and not np.isfinite(x):
        return {"__float__": repr(float(x))}
    return x


def _float_hook(d):
    return float(d["__float__"]) if len(d) == 1 and "__float__" in d else d


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, (np.ndarray, tuple, set)):
        return list(x)
    raise TypeError(f"cannot write {type(x).__name__} to JSON")


def load_json(url: str, **storage_options) -> TrainingStats:
    """Training statistics from a file :meth:`TrainingStats.export_json` wrote (any fsspec URL)."""
    return TrainingStats.load_json(url, **storage_options)
