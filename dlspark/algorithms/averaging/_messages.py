"""Parameter averaging's own orders and replies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from ...distributed._messages import Reply
from .._mean_round import Leaves, MeanOrder, MeanReply, MeanWith
from ...stats._record import RoundFigures

__all__ = ["AveragingFigures", "AverageWith", "AverageOrder", "AverageReply", "Contribution", "SharedContribution", "Share"]


@dataclass(frozen=True)
class AverageWith(MeanWith):
    """A fit order's plan: average with these contributors as soon as the fit is done; only a
    ``full`` round takes an outer optimizer's step."""


@dataclass(frozen=True)
class AverageOrder(MeanOrder):
    """Average ``round`` over ``contributors``; ``attempt`` numbers the coordinator's tries;
    ``full`` as in :class:`AverageWith`."""

    op: ClassVar[str] = "average"


@dataclass(frozen=True)
class AverageReply(MeanReply):
    """A worker's average; ``contributors`` are those it averaged over."""

    contributors: tuple = ()
    bytes_shared: int = 0  # of bytes_received, those read from a co-located peer's shared memory


#: a replica's leaves after its fit (or one share of their floating-point elements)
Contribution = Leaves


@dataclass(frozen=True)
class SharedContribution(Reply):
    """A co-located replica's leaves after its fit, in its shared memory (``where``)."""

    where: object = None


@dataclass(frozen=True)
class Share(Reply):
    """A contributor's averaged share of the floating-point elements."""

    values: Sequence = ()


@dataclass(frozen=True)
class AveragingFigures(RoundFigures):
    """Parameter averaging's figures of a round, on both runtimes: the slowest replica's
    mean and fetch times, the bytes its replicas received from peers (through shared
    memory: ``bytes_shared``), and ``bytes_equivalent``, what a cluster's replicas
    receive for the mean (on a cluster the bytes received; in one process, what they
    would have been)."""

    avg_time: float = 0.0
    fetch_time: float = 0.0
    bytes_received: int = 0
    bytes_shared: int = 0
    bytes_equivalent: int = 0
