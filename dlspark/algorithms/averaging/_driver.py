"""Parameter averaging's round driver (scheduler side, pure)."""

from __future__ import annotations

from ...distributed._machine import RoundDone
from ...distributed._messages import FitOrder, FitReply
from .._base import RoundDriver
from ._messages import AverageOrder, AveragingFigures, AverageWith

__all__ = ["AveragingDriver"]


class AveragingDriver(RoundDriver):
    """Every worker with data fits and then averages with the round's other contributors,
    fetching their parameters itself; workers with no data this round only average. The
    round is over when every live worker averaged over exactly the contributors still
    alive; otherwise it is averaged again over those (from the stored contributions, so a
    worker that already averaged gets the same result)."""

    failure = "the replicas could not be averaged"

    def begin(self, plan, hint, live):
        self.round = plan.round
        self.expected = tuple(plan.contributors)
        self.fits, self.averages = {}, {}
        self.fitted = False
        epoch = self.options.base_epoch + plan.epoch
        orders = []
        for w in sorted(live):
            refs = tuple(plan.assignment.get(w) or ())
            if refs:
                orders.append((w, FitOrder(round=plan.round, epoch=epoch, refs=refs, next_refs=tuple(hint.get(w, ())),
                                           plan=AverageWith(self.expected))))
            else:
                orders.append((w, AverageOrder(plan.round, self.expected, 0)))
        return orders

    def step(self, replies, live, attempt):
        if not self.fitted:
            self.fitted = True
            self.fits = {w: r for w, r in replies.items() if isinstance(r, FitReply)}
            self.contributors = [w for w in self.expected if w in self.fits]
            replies = {w: (r.extra["averaged"] if isinstance(r, FitReply) else r) for w, r in replies.items()}
        self.averages = replies
        self.contributors = [w for w in self.contributors if w in live]
        receivers = sorted(live)
        if list(self.expected) == self.contributors and all(w in replies and replies[w].ok for w in receivers):
            return RoundDone(tuple(self.contributors))
        self.expected = tuple(self.contributors)
        return [(w, AverageOrder(self.round, self.expected, attempt)) for w in receivers]

    def round_stats(self):
        a = self.averages.values()
        received = sum(x.bytes_received for x in a)
        return AveragingFigures(avg_time=max((x.avg_time for x in a), default=0.0),
                                fetch_time=max((x.fetch_time for x in a), default=0.0),
                                bytes_received=received, bytes_shared=sum(x.bytes_shared for x in a),
                                bytes_equivalent=received)
