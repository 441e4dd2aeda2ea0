"""Parameter averaging's round driver (scheduler side, pure)."""

from __future__ import annotations

from typing import ClassVar

from .._mean_round import MeanOrder, MeanRoundDriver
from ._messages import AverageOrder, AverageReply, AverageWith, AveragingFigures

__all__ = ["AveragingDriver"]


class AveragingDriver(MeanRoundDriver):
    """Every worker with data fits and then averages with the round's other contributors,
    fetching their parameters (or, with three or more, their shares) itself; workers with
    no data this round only average. The round itself is
    :class:`~dlspark.algorithms._mean_round.MeanRoundDriver`'s."""

    failure = "the replicas could not be averaged"
    order: ClassVar[type[MeanOrder]] = AverageOrder
    plan: ClassVar[type[AverageWith]] = AverageWith
    reply_key: ClassVar[str] = "averaged"

    def round_stats(self) -> AveragingFigures:
        a = [r for r in self.means.values() if isinstance(r, AverageReply)]
        received = sum(x.bytes_received for x in a)
        return AveragingFigures(avg_time=max((x.avg_time for x in a), default=0.0),
                                fetch_time=max((x.fetch_time for x in a), default=0.0),
                                bytes_received=received, bytes_shared=sum(x.bytes_shared for x in a),
                                bytes_equivalent=received)
