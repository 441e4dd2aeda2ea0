"""Split planning and round bookkeeping for one job: pure, no Dask.

The :class:`Coordinator` is the state machine the scheduler plugin drives:
it hands out rounds (which worker fits which minibatches), takes back the
minibatches of workers that failed, and counts a minibatch as trained only
when its worker's parameters made it into a completed average. It is tested
event by event without a cluster.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field

import numpy as np

__all__ = ["RoundPlan", "Coordinator", "split_balanced"]


def split_balanced(items: list, n: int) -> list:
    """Split ``items`` into ``n`` contiguous shares whose sizes differ by at most one."""
    return [list(part) for part in np.array_split(np.asarray(items, dtype=np.int64), n)] if n else []


@dataclass
class RoundPlan:
    """One round: ``assignment`` maps worker address to minibatch indices, in fit order."""

    round: int
    epoch: int
    assignment: dict = field(default_factory=dict)

    @property
    def contributors(self) -> list:
        return sorted(w for w, refs in self.assignment.items() if refs)

    @property
    def fewest_minibatches(self) -> int:
        """The fewest minibatches a contributor fits this round (0 without contributors)."""
        return min((len(refs) for refs in self.assignment.values() if refs), default=0)

    def is_full(self, steps_per_round: int) -> bool:
        """Whether the round is full: every contributor fits ``steps_per_round`` minibatches or
        more (an epoch's last round, or every round of an epoch shorter than that, is not)."""
        return self.fewest_minibatches >= steps_per_round


class Coordinator:
    """Round planner with exactly-once accounting of minibatches per epoch.

    Parameters
    ----------
    partitions : list of int
        The partition of every minibatch (index ``i`` is minibatch ``i``).
    epochs : int
        Epochs to run (counted from ``start_epoch``).
    steps_per_round : int
        Minibatches per worker per round (the averaging frequency).
    repartition, strategy : str
        As in :class:`~dlspark.ParameterAveraging`.
    skip : iterable of int
        Minibatches already trained in the first epoch (resuming a checkpoint).
    final_epochs, final_steps_per_round : int
        The last ``final_epochs`` of the ``epochs`` deal ``final_steps_per_round`` minibatches
        per worker a round instead (0: none).
    """

    def __init__(self, partitions, epochs, steps_per_round, repartition="always", strategy="balanced", skip=(),
                 final_epochs=0, final_steps_per_round=None):
        self.partitions = list(partitions)
        self.n = len(self.partitions)
        if self.n == 0:
            raise ValueError("a job needs at least one minibatch")
        self.epochs = int(epochs)
        self.steps_per_round = int(steps_per_round)
        self.final_epochs = int(final_epochs)
        self.final_steps_per_round = int(final_steps_per_round or steps_per_round)
        self.repartition = repartition
        self.strategy = strategy
        self.epoch = 0
        self.round = 0
        self.done: set = set(int(i) for i in skip)
        self.inflight: dict = {}
        self.trained_total = 0
        self._queues: dict | None = None  # per-worker queues when following partitions
        self._pending: deque = deque()
        self._fill()

    @classmethod
    def from_options(cls, partitions, options) -> Coordinator:
        """The planner of a job's :class:`~dlspark.distributed._messages.JobOptions` (its
        ``epochs`` and ``skip``, and the settings its master's ``job_options()`` names): both
        runtimes build their planners here, so that a master's setting reaches either."""
        return cls(partitions, options.epochs, options.steps_per_round, options.repartition,
                   options.repartition_strategy, skip=options.skip, final_epochs=options.final_epochs,
                   final_steps_per_round=options.final_steps_per_round)

    # -- epochs ----------------------------------------------------------------
    def _fill(self):
        self._pending = deque(i for i in range(self.n) if i not in self.done)
        self._queues = None

    @property
    def k(self) -> int:
        """Minibatches per worker in the current epoch's rounds."""
        final = self.epoch >= self.epochs - self.final_epochs
        return self.final_steps_per_round if final else self.steps_per_round

    @property
    def finished(self) -> bool:
        return self.epoch >= self.epochs

    def _follow_partitions(self, workers):
        if self.repartition == "never":
            # One partition (a single DataSet, a list of files) carries no layout to keep:
            # following it would leave every worker but one idle.
            return len(set(self.partitions)) > 1
        if self.repartition == "num_partitions_workers_differs":
            return len(set(self.partitions)) == len(workers)
        return False

    def _remaining(self) -> int:
        if self._queues is not None:
            return sum(len(q) for q in self._queues.values())
        return len(self._pending)

    def _advance_epoch_if_done(self):
        while not self.finished and self._remaining() == 0 and not self.inflight:
            self.epoch += 1
            self.done = set()
            if not self.finished:
                self._fill()

    # -- rounds ----------------------------------------------------------------
    def plan_round(self, workers) -> RoundPlan | None:
        """Plan the next round over the live ``workers``; ``None`` when the job is complete."""
        self._advance_epoch_if_done()
        if self.finished:
            return None
        workers = sorted(workers)
        if not workers:
            raise RuntimeError("no live workers to plan a round for")
        if self._queues is None and self._follow_partitions(workers):
            self._queues = {w: deque() for w in workers}
            parts = sorted(set(self.partitions))
            owner = {p: workers[j % len(workers)] for j, p in enumerate(parts)}
            for i in self._pending:
                self._queues[owner[self.partitions[i]]].append(i)
            self._pending = deque()
        if self._queues is not None:
            self._rehome(workers)
            assignment = {w: [self._queues[w].popleft() for _ in range(min(self.k, len(self._queues[w])))]
                          for w in workers}
        else:
            take = [self._pending.popleft() for _ in range(min(self.k * len(workers), len(self._pending)))]
            if self.strategy == "balanced":
                shares = split_balanced(take, len(workers))
            else:
                shares = [take[j * self.k:(j + 1) * self.k] for j in range(len(workers))]
            assignment = {w: [int(i) for i in s] for w, s in zip(workers, shares)}
        self.round += 1
        plan = RoundPlan(self.round, self.epoch, assignment)
        self.inflight = {w: list(r) for w, r in assignment.items() if r}
        return plan

    def peek_round(self, workers) -> dict:
        """The assignment the next :meth:`plan_round` over ``workers`` will make if the round in
        flight completes with every worker: a prefetch hint, planned on a copy of this planner.

        Returns ``{worker: [minibatch, ...]}`` (empty when the job will be complete).
        """
        ahead = self.copy()
        ahead.complete_round(None, ahead.inflight)
        plan = ahead.plan_round(workers) if workers else None
        return {} if plan is None else {w: r for w, r in plan.assignment.items() if r}

    def copy(self) -> "Coordinator":
        """An independent planner in the same position (``partitions`` is shared: never changed)."""
        other = copy.copy(self)
        other.done = set(self.done)
        other.inflight = {w: list(r) for w, r in self.inflight.items()}
        other._queues = None if self._queues is None else {w: deque(q) for w, q in self._queues.items()}
        other._pending = deque(self._pending)
        return other

    def _rehome(self, workers):
        """Give the queues of departed workers to the live ones, shortest queue first."""
        live = set(workers)
        for w in [w for w in self._queues if w not in live]:
            for i in self._queues.pop(w):
                self._shortest(workers).append(i)
        for w in workers:
            self._queues.setdefault(w, deque())

    def _shortest(self, workers):
        return min((self._queues.setdefault(w, deque()) for w in workers), key=len)

    def complete_round(self, plan: RoundPlan, contributed) -> int:
        """Count the minibatches of ``contributed`` workers; return the others to the queue.

        Returns the number of minibatches counted.
        """
        contributed = set(contributed)
        counted = 0
        returned = []
        for w, refs in self.inflight.items():
            if w in contributed:
                self.done.update(refs)
                counted += len(refs)
            else:
                returned.extend(refs)
        self.inflight = {}
        if returned:
            if self._queues is not None:
                live = sorted(contributed) or sorted(self._queues)
                for i in reversed(returned):
                    self._shortest(live).appendleft(i)
            else:
                self._pending.extendleft(reversed(returned))
        self.trained_total += counted
        self._advance_epoch_if_done()
        return counted

    def progress(self) -> dict:
        """Where the job stands: epochs completed and minibatches done in the current epoch (of
        ``minibatches`` an epoch, which a resume checks against its data)."""
        return {"epoch": self.epoch, "done": sorted(int(i) for i in self.done), "minibatches": self.n}
