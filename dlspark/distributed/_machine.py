"""The job's policy as a pure state machine: events in, instructions out.

:class:`JobMachine` owns a job's membership, round planning (through the
:class:`~dlspark.distributed._plan.Coordinator`), retry bounds, drop decisions,
checkpoints and the client's grace period. It does no I/O and reads no clock:
the scheduler plugin feeds it events (a worker's reply, a lost worker, a probe's
outcome, ``now``) and carries out the instructions it returns (send an order,
tell the workers a peer was lost, probe a peer, admit a joiner, emit statistics,
finish, fail). Its fault rules
are tested by feeding event sequences, in milliseconds, without a cluster.

What is specific to one algorithm (which orders a round sends, what a round's
replies mean) is the algorithm's *round driver*, a pure object the machine
calls; the machine is the same for every algorithm.

The rules
---------
- A worker lost mid-round (its connection failed, or the scheduler removed it)
  leaves the job: its minibatches of the round go back to the queue, so every
  minibatch is trained once per epoch. The job's other workers are told at once
  (one way), so that none waits out a timeout for what the lost one would have sent.
- A reply that names an unreachable peer makes the machine probe that peer: it
  is dropped if the machine cannot reach it either; otherwise the failure passed
  and the driver re-drives the round over the same workers, with the next attempt
  number. A round re-driven more than ``its workers + extra_attempts`` times fails
  the job with the driver's reason and the pairs of workers that could not reach
  each other.
- Two workers that cannot reach each other while the coordinator reaches both (a
  network partition between them) fail the same round twice: one of them (the
  one in most such pairs, else the later address) is dropped from the job, which
  goes on without it, as with a lost worker.
- A worker that arrives mid-fit joins at the start of the next round, set up from
  a live peer's state; a join that keeps failing is given up after
  ``join_attempts`` tries and reported.
- Every ``checkpoint_every`` rounds, the live workers' RNGs are gathered and the
  first live worker writes the checkpoint (the next one if it is lost meanwhile).
- A client gone for longer than ``client_grace`` seconds stops the job.
- A worker's error (an exception in its handler) fails the job with that error.
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass, field

from ..errors import JobFailedError
from ..stats._record import RoundStats, iteration_rows
from ._events import (Abandon, Cancel, ClientBack, ClientLost, Emit, Fail, Failed, Finish, GraceOver, Join, Joined,
                      JoinFailed, Probe, Probed, Replied, Send, Start, StateMachineEvent, Tell, Timer, WorkerJoined,
                      WorkerLost)
from ._messages import CheckpointOrder, ErrorReply, FitReply, JobOptions, JobResult, PeerLost, RngOrder
from ._plan import Coordinator, RoundPlan

__all__ = ["JobMachine", "RoundDone", "Settings", "InvalidState",
           # events
           "StateMachineEvent", "Start", "Replied", "Failed", "WorkerLost", "WorkerJoined", "Joined", "JoinFailed", "Probed",
           "ClientLost", "ClientBack", "GraceOver", "Cancel",
           # instructions
           "Send", "Tell", "Probe", "Join", "Emit", "Timer", "Finish", "Fail", "Abandon"]


class InvalidState(AssertionError):
    """:meth:`JobMachine.validate_state` found a broken invariant (a defect in the machine)."""


@dataclass(frozen=True)
class RoundDone:
    """A driver's word that its round is over: ``contributors`` trained minibatches that count."""

    contributors: tuple


@dataclass(frozen=True)
class Settings:
    """The machine's bounds; the scheduler plugin reads them from ``dlspark.*`` in dask.config."""

    client_grace: float = 10.0
    join_attempts: int = 20
    join_interval: float = 0.25
    extra_attempts: int = 2


@dataclass
class _Batch:
    """Orders in flight: the phase they belong to and who has yet to answer."""

    phase: str
    waiting: dict = field(default_factory=dict)  # seq -> worker
    replies: dict = field(default_factory=dict)  # worker -> reply
    lost: set = field(default_factory=set)


class JobMachine:
    """A job's policy. ``handle(event, now)`` returns the instructions the event calls for.

    Parameters
    ----------
    job : str
    workers : iterable of str
        The workers the job was set up on (ranks in sorted order).
    driver : RoundDriver
        The algorithm's round driver (see :mod:`dlspark.algorithms`).
    partitions : list of int
        The partition of every minibatch.
    options : JobOptions
    settings : Settings
    """

    def __init__(self, job, workers, driver, partitions, options: JobOptions, settings: Settings = Settings()):
        self.job = job
        self.live = set(workers)
        self.driver = driver
        self.options = options
        self.settings = settings
        self.planner = Coordinator.from_options(partitions, options)
        self.next_rank = len(self.live)
        self.arrived: set = set()  # joined the cluster mid-fit, to be set up at the next round
        self.joining: dict = {}  # worker -> tries so far
        self.stats: list = []
        self.events: list = []  # what happened to the job's workers, as emitted (JobResult.events)
        self.plan: RoundPlan | None = None
        self.attempt = 0
        self.started = 0.0
        self.batch: _Batch | None = None
        self.probing: set = set()
        self.reported: set = set()  # (worker, peer it could not reach) of the batch being probed
        self.pairs: dict = {}  # (worker, live peer it could not reach) -> times in this round
        self.seq = 0
        self.rngs: dict = {}
        self.writers: list = []
        self.client_present = True
        self.absences = 0
        self.over = False
        #: ``(stimulus_id, event kind, instruction kinds)`` of the latest events handled
        self.log: collections.deque = collections.deque(maxlen=1000)

    # -- the one entry point ------------------------------------------------------
    def handle(self, event: StateMachineEvent, now: float = 0.0) -> list:
        """Take ``event``; return the instructions it calls for (possibly none).

        The event is dispatched by its type; each handled event's ``stimulus_id`` is
        recorded in :attr:`log` with the kinds of the instructions it gave.
        """
        if not isinstance(event, StateMachineEvent):
            raise TypeError(f"event must be a StateMachineEvent (Start, Replied, WorkerLost, ...), "
                            f"got {type(event).__name__}")
        if self.over:
            return []
        self.now = now
        try:
            out = self._handle_event(event)
        except JobFailedError as e:
            out = self._fail(e)
        self.log.append((event.stimulus_id, type(event).__name__, tuple(type(i).__name__ for i in out)))
        return out

    @functools.singledispatchmethod
    def _handle_event(self, event):
        raise TypeError(f"JobMachine has no handler for {type(event).__name__}; it takes "
                        f"{', '.join(sorted(c.__name__ for c in _HANDLED.registry if c is not object))}")

    # -- invariants -----------------------------------------------------------------
    def validate_state(self) -> None:
        """Check the machine's invariants; raise :class:`InvalidState` naming the first broken one.

        Cheap enough to run after every event in tests (the test player does).
        """
        def check(ok, what):
            if not ok:
                raise InvalidState(f"job {self.job}: {what}")

        live = self.live
        check(not (self.arrived & live), f"arrived workers {sorted(self.arrived & live)} are already live")
        check(not (set(self.joining) & live), f"joining workers {sorted(set(self.joining) & live)} are already live")
        check(not (self.arrived & set(self.joining)), "a worker both arrived and joining")
        check(all(rank < self.next_rank for _, rank in self.joining.values()), "a joining rank not below next_rank")
        check(self.probing <= live, f"probing workers {sorted(self.probing - live)} that are not live")
        b = self.batch
        if b is not None:
            check(b.phase in ("round", "rngs", "write"), f"a batch in unknown phase {b.phase!r}")
            check(set(b.waiting.values()) <= live,
                  f"orders awaited from workers {sorted(set(b.waiting.values()) - live)} that are not live")
            check(set(b.replies) <= live, f"replies kept from workers {sorted(set(b.replies) - live)} not live")
            check(all(0 < seq <= self.seq for seq in b.waiting), "an awaited order with a sequence number never sent")
            check(not (self.probing and b.waiting), "probing while orders are still awaited")
            check(b.phase != "round" or self.plan is not None, "a round in flight without a plan")
        else:
            check(not self.probing, "probing with no batch in flight")
        check(set(self.writers) <= set(self.rngs), "a checkpoint writer whose RNG was not gathered")
        rounds = [st["round"] for st in self.stats]
        check(rounds == sorted(set(rounds)), f"round statistics out of order or repeated: {rounds}")
        check(0 <= self.attempt, f"attempt {self.attempt} below 0")

    # -- membership -----------------------------------------------------------------
    @_handle_event.register
    def _on_Start(self, event: Start):
        return self._between_rounds()

    @_handle_event.register
    def _on_WorkerJoined(self, event: WorkerJoined):
        if event.worker not in self.live:
            self.arrived.add(event.worker)
        return []

    @_handle_event.register
    def _on_WorkerLost(self, event: WorkerLost):
        w = event.worker
        self.arrived.discard(w)
        if w in self.joining:
            del self.joining[w]
            return self._between_rounds() if not self.joining and self.batch is None else []
        if w not in self.live:
            return []
        self.live.discard(w)
        out = self._worker_event({"event": "lost", "worker": w, "workers": len(self.live)})
        if self.batch is not None and self.batch.phase == "round":  # a worker waiting for its part stops
            out += [Tell(v, PeerLost(w)) for v in sorted(self.live)]
        if w in self.probing:
            out += self._on_Probed(Probed(w, False))
        b = self.batch
        if b is not None:
            for seq in [s for s, x in b.waiting.items() if x == w]:
                del b.waiting[seq]
                b.lost.add(w)
            if b.replies.pop(w, None) is not None:
                b.lost.add(w)  # it answered, but the round is re-driven without it: a fault all the same
            if not b.waiting and not self.probing:
                out += self._batch_complete()
        return out

    @_handle_event.register
    def _on_Joined(self, event: Joined):
        if event.worker not in self.joining:
            return []
        del self.joining[event.worker]
        self.live.add(event.worker)
        out = self._worker_event({"event": "joined", "worker": event.worker, "workers": len(self.live)})
        if not self.joining:
            out += self._between_rounds()
        return out

    @_handle_event.register
    def _on_JoinFailed(self, event: JoinFailed):
        w = event.worker
        if w not in self.joining:
            return []
        self.joining[w][0] += 1
        tries, rank = self.joining[w]
        if tries < self.settings.join_attempts and self.live:  # the same rank: a resumed fit's saved RNG
            return [Join(w, min(self.live), rank, self.settings.join_interval)]
        del self.joining[w]
        out = self._worker_event({"event": "join-failed", "worker": w, "error": event.error})
        if not self.joining:
            out += self._between_rounds()
        return out

    def _rank(self):
        self.next_rank += 1
        return self.next_rank - 1

    # -- the client -----------------------------------------------------------------
    @_handle_event.register
    def _on_ClientLost(self, event: ClientLost):
        self.client_present = False
        self.absences += 1
        return [Timer(self.settings.client_grace, GraceOver(self.absences))]

    @_handle_event.register
    def _on_ClientBack(self, event: ClientBack):
        self.client_present = True
        return []

    @_handle_event.register
    def _on_GraceOver(self, event: GraceOver):
        if self.client_present or event.absence != self.absences:
            return []  # back meanwhile, or the timer of an earlier absence
        self.over = True
        return [Abandon(f"job {self.job}: its client is gone (for more than {self.settings.client_grace:g} s)")]

    @_handle_event.register
    def _on_Cancel(self, event: Cancel):
        self.over = True
        return []

    # -- rounds ---------------------------------------------------------------------
    def _between_rounds(self):
        """Admit workers that arrived, then plan and start the next round."""
        if self.arrived and self.live:
            for w in sorted(self.arrived):
                self.joining[w] = [0, self._rank()]
            self.arrived = set()
            source = min(self.live)
            return [Join(w, source, self.joining[w][1]) for w in sorted(self.joining)]
        if self.joining:
            return []
        if not self.live:
            raise JobFailedError(f"job {self.job}: every worker was lost")
        self.plan = self.planner.plan_round(self.live)
        if self.plan is None:
            self.over = True
            return [Finish(JobResult(tuple(sorted(self.live)), self.planner.trained_total, tuple(self.stats),
                                     self.driver.result_state(sorted(self.live)), tuple(self.events)))]
        hint = self.planner.peek_round(self.live)
        self.attempt = 0
        self.pairs = {}
        self.started = self.now
        return self._send("round", self.driver.begin(self.plan, hint, frozenset(self.live)))

    def _send(self, phase, orders):
        self.batch = _Batch(phase)
        out = []
        for worker, order in orders:
            self.seq += 1
            self.batch.waiting[self.seq] = worker
            out.append(Send(worker, self.seq, order))
        if not out:
            return self._batch_complete()
        return out

    @_handle_event.register
    def _on_Replied(self, event: Replied):
        b = self.batch
        if b is None or b.waiting.get(event.seq) != event.worker:
            return []  # a late answer to a batch already settled
        del b.waiting[event.seq]
        b.replies[event.worker] = event.reply
        if b.waiting:
            return []
        return self._batch_complete()

    @_handle_event.register
    def _on_Failed(self, event: Failed):
        b = self.batch
        if b is None or b.waiting.get(event.seq) != event.worker:
            return []
        self.over = True
        return [Fail(event.error)]

    def _batch_complete(self):
        """Every order of the batch answered or its worker was lost: probe the peers named
        unreachable, then move on."""
        b = self.batch
        named = {p for r in b.replies.values() for p in r.unreachable} & self.live
        self.reported = {(w, p) for w, r in b.replies.items() for p in r.unreachable if p in self.live}
        if named:
            self.probing = set(named)
            b.lost |= named  # a fault either way: the round is re-driven
            return [Probe(p) for p in sorted(named)]
        return self._advance()

    @_handle_event.register
    def _on_Probed(self, event: Probed):
        if event.worker not in self.probing:
            return []
        self.probing.discard(event.worker)
        if event.alive:  # the coordinator reaches it, and a peer did not
            for pair in self.reported:
                if pair[1] == event.worker:
                    self.pairs[pair] = self.pairs.get(pair, 0) + 1
        else:
            self.live.discard(event.worker)
            if self.batch is not None:
                self.batch.replies.pop(event.worker, None)
        if self.probing:
            return []
        return self._advance()

    def _advance(self):
        b = self.batch
        if b.phase != "round":
            return self._checkpoint_step()
        if not self.live:
            raise JobFailedError(f"job {self.job}: every worker was lost")
        out = []
        if b.lost:
            out = self._split_partition()
            self.attempt += 1
            if self.attempt > len(self.plan.assignment) + self.settings.extra_attempts:
                pairs = "; ".join(f"{a} could not reach {p}" for a, p in sorted(self.pairs))
                raise JobFailedError(f"job {self.job}: round {self.plan.round}: {self.driver.failure}"
                                     + (f" ({pairs}, while the coordinator reached both)" if pairs else ""))
        step = self.driver.step(b.replies, frozenset(self.live), self.attempt)
        if not isinstance(step, RoundDone):
            return out + self._send("round", step)
        return out + self._round_done(step)

    def _split_partition(self):
        """Drop one side of a pair of live workers that failed to reach each other twice in
        this round while the coordinator reached both: re-driving it again would fail again."""
        lasting = [pair for pair, n in self.pairs.items() if n >= 2 and set(pair) <= self.live]
        if not lasting:
            return []
        count: dict = {}
        for pair in lasting:
            for w in pair:
                count[w] = count.get(w, 0) + 1
        victim = max(count, key=lambda w: (count[w], w))
        self.live.discard(victim)
        self.batch.replies.pop(victim, None)
        self.pairs = {pair: n for pair, n in self.pairs.items() if victim not in pair}
        others = sorted({w for pair in lasting if victim in pair for w in pair} - {victim})
        return self._worker_event({"event": "partitioned", "worker": victim, "unreachable_from": others,
                                   "workers": len(self.live)})

    def _worker_event(self, msg: dict) -> list:
        """What happened to a worker, for the client (live, on the job's topic, and in the
        result's ``events``), with the latest round begun when it happened."""
        msg = {**msg, "round": self.plan.round if self.plan is not None else 0}
        self.events.append(msg)
        return [Emit(msg)]

    def _round_done(self, done: RoundDone):
        contributors = [w for w in done.contributors if w in self.live]
        fits = {w: r for w, r in self.driver.fits.items() if w in contributors and isinstance(r, FitReply)}
        before = self.planner.trained_total
        counted = self.planner.complete_round(self.plan, contributors)
        n = sum(f.n for f in fits.values())
        stat = RoundStats.build(
            round=self.plan.round, epoch=self.plan.epoch, minibatches=counted,
            examples=sum(f.examples for f in fits.values()),
            loss=(sum(f.loss_sum for f in fits.values()) / n) if n else None, workers=len(contributors),
            round_time=self.now - self.started, fit_time_max=max((f.fit_time for f in fits.values()), default=0.0),
            worker_fit_time={w: f.fit_time for w, f in fits.items()},
            worker_steps={w: f.n for w, f in fits.items()},
            data_wait={w: f.data_wait for w, f in fits.items()},
            trained_total=self.planner.trained_total, attempts=self.attempt,
            extra=self.driver.round_stats(),
            iterations=iteration_rows(before, self.plan.epoch, {w: f.steps for w, f in fits.items()},
                                      {w: f.fit_time for w, f in fits.items()}))
        self.stats.append(stat)
        out = [Emit(stat)]
        every = self.options.checkpoint_every
        if every and self.plan.round % every == 0:
            return out + self._send("rngs", [(w, RngOrder()) for w in sorted(self.live)])
        self.batch = None
        return out + self._between_rounds()

    # -- checkpoints ----------------------------------------------------------------
    def _checkpoint_step(self):
        b = self.batch
        if b.phase == "rngs":
            self.rngs = {w: r.rng for w, r in b.replies.items() if w in self.live}
            self.writers = sorted(self.rngs)
        elif b.phase == "write" and b.replies:
            self.batch = None
            return [Emit({"event": "checkpoint", "url": self.options.checkpoint_url, "round": self.plan.round})] \
                + self._between_rounds()
        self.writers = [w for w in self.writers if w in self.live]
        if not self.writers:  # nobody left to write it: the next round finds out why
            self.batch = None
            return self._between_rounds()
        writer = self.writers.pop(0)
        return self._send("write", [(writer, self._checkpoint_order())])

    def _checkpoint_order(self):
        o = self.options
        progress = self.planner.progress()
        progress.update(epoch=o.epochs_done + progress["epoch"], epochs_total=o.epochs_total)
        workers = sorted(w for w in self.rngs if w in self.live)
        return CheckpointOrder(url=o.checkpoint_url, step=o.base_step + self.planner.trained_total,
                               epoch=o.base_epoch + self.planner.epoch, progress=progress,
                               worker_rngs=[self.rngs[w] for w in workers],
                               meta=self.driver.checkpoint_meta(workers))

    def _fail(self, e):
        self.over = True
        return [Fail(ErrorReply.from_exception(e))]


_HANDLED = JobMachine.__dict__["_handle_event"].dispatcher
