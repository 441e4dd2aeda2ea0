"""A round that ends with a mean over its contributors, on a cluster: its messages and driver.

Parameter averaging and every :class:`~dlspark.algorithms.replica.ReplicaAlgorithm`
end a round alike: each worker with minibatches fits them and then takes the
mean with the round's other contributors, fetching what it needs from them
itself; a worker with no data only takes the mean. The coordinator steps in only
when a peer is lost, sending the mean again over the contributors left. What
differs between the algorithms is the order's handler on the worker (its ``op``),
the figures their replies carry and how the mean is taken, not the round.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import ClassVar

from ..distributed._machine import RoundDone
from ..distributed._messages import FitOrder, FitReply, JobOptions, Order, Reply
from ._base import RoundDriver

__all__ = ["MeanWith", "MeanOrder", "MeanReply", "Leaves", "MeanRoundDriver"]


@dataclass(frozen=True)
class MeanWith:
    """A fit order's plan: take the mean with these contributors as soon as the fit is done;
    ``full``: the round is full (:meth:`~dlspark.distributed._plan.RoundPlan.is_full`), which an
    algorithm may finish otherwise than a short one."""

    contributors: tuple
    full: bool = True


@dataclass(frozen=True)
class MeanOrder(Order):
    """Finish ``round`` with the mean over ``contributors``; ``attempt`` numbers the coordinator's
    tries; ``full`` as in :class:`MeanWith`."""

    op: ClassVar[str] = "mean"
    round: int = 0
    contributors: tuple = ()
    attempt: int = 0
    full: bool = True


@dataclass(frozen=True)
class MeanReply(Reply):
    """A worker's mean: whether it took it, how long it took (fetching included) and the
    bytes it received from its peers."""

    ok: bool = True
    avg_time: float = 0.0
    fetch_time: float = 0.0
    bytes_received: int = 0


@dataclass(frozen=True)
class Leaves(Reply):
    """A replica's contribution to a round (or a part of it), as host arrays."""

    leaves: Sequence = ()


def _took_mean(reply: Reply | None) -> bool:
    return isinstance(reply, MeanReply) and reply.ok


class MeanRoundDriver(RoundDriver):
    """Every worker with data fits and then takes the mean with the round's other
    contributors; workers with no data this round only take the mean. The round is over
    when every live worker took it over exactly the contributors still alive; otherwise
    it is taken again over those (from stored inputs, so a worker that already took it
    gets the same result).

    A subclass names its order (``order``: a :class:`MeanOrder` whose ``op`` is its
    worker's handler), the key its fit reply files the mean's reply under
    (``reply_key``), and its figures (``round_stats``, from ``self.means``).
    """

    #: the order that asks a worker for the round's mean
    order: ClassVar[type[MeanOrder]] = MeanOrder
    #: where a worker's ``FitReply.extra`` holds the reply to the mean it took after its fit
    reply_key: ClassVar[str] = "mean"
    #: a fit order's plan (a :class:`MeanWith`)
    plan: ClassVar[type[MeanWith]] = MeanWith

    def __init__(self, options: JobOptions):
        super().__init__(options)
        self.round = 0
        self.expected: tuple = ()
        self.contributors: list = []
        #: worker -> the reply to its latest mean of the round
        self.means: dict = {}
        self.fitted = False
        self.full = True

    def begin(self, plan, hint: dict, live: frozenset) -> list:
        self.round, self.expected = plan.round, tuple(plan.contributors)
        self.fits, self.means, self.fitted = {}, {}, False
        self.full = plan.is_full(self.options.steps_per_round)  # the plan and every mean order carry it
        epoch = self.options.base_epoch + plan.epoch
        orders: list = []
        for w in sorted(live):
            refs = tuple(plan.assignment.get(w) or ())
            if refs:
                orders.append((w, FitOrder(round=plan.round, epoch=epoch, refs=refs, next_refs=tuple(hint.get(w, ())),
                                           plan=self.plan(self.expected, full=self.full))))
            else:
                orders.append((w, self.order(plan.round, self.expected, 0, full=self.full)))
        return orders

    def step(self, replies: dict[str, Reply], live: frozenset, attempt: int):
        if not self.fitted:
            self.fitted = True
            self.fits = {w: r for w, r in replies.items() if isinstance(r, FitReply)}
            self.contributors = [w for w in self.expected if w in self.fits]
            replies = {w: (r.extra[self.reply_key] if isinstance(r, FitReply) else r) for w, r in replies.items()}
        self.means = replies
        self.contributors = [w for w in self.contributors if w in live]
        receivers = sorted(live)
        if list(self.expected) == self.contributors and all(_took_mean(replies.get(w)) for w in receivers):
            return RoundDone(tuple(self.contributors))
        self.expected = tuple(self.contributors)
        return [(w, self.order(self.round, self.expected, attempt, full=self.full)) for w in receivers]
