"""Gradient sharing's own orders and replies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from ...distributed._messages import Order, Reply
from ...stats._record import RoundFigures

__all__ = ["SharingFigures", "ShareWith", "HaveOrder", "HaveReply", "SyncOrder", "SyncReply", "Messages"]


@dataclass(frozen=True)
class ShareWith:
    """A fit order's plan: ``peers`` maps each live worker to (its message counter at the
    round's start, its minibatches this round); ``links`` are its tree neighbours (tree
    mesh) or None (every worker sends to every peer); ``synced`` maps every sender, lost
    ones too, to the last of its messages that every replica applied in the rounds before
    (which a replica forgets before it starts this round)."""

    peers: dict
    links: tuple | None = None
    synced: dict = field(default_factory=dict)


@dataclass(frozen=True)
class HaveOrder(Order):
    """Report the round's messages held (after forgetting those of earlier rounds, ``synced``
    as in :class:`ShareWith`)."""

    op: ClassVar[str] = "have"
    synced: dict = field(default_factory=dict)


@dataclass(frozen=True)
class HaveReply(Reply):
    have: dict = field(default_factory=dict)  # sender -> [steps]
    step: int = 0


@dataclass(frozen=True)
class SyncOrder(Order):
    """Fetch the round's messages missed (``{holder: [(sender, step), ...]}``) and apply all."""

    op: ClassVar[str] = "sync"
    missing: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SyncReply(Reply):
    threshold: float = 0.0
    step: int = 0
    threshold_state: tuple = ()


@dataclass(frozen=True)
class Messages(Reply):
    """Messages a peer asked for, in the order of its keys."""

    messages: Sequence = ()


@dataclass(frozen=True)
class SharingFigures(RoundFigures):
    """Gradient sharing's figures of a round, on both runtimes: the bytes of the messages
    sent (each counted once per peer) against dense fp32, each worker's threshold at its
    last step, the mean sparsity sent, the longest wait for stale peers, the encoding
    record (``encoding_debug``), messages relayed (tree mesh), fetched at the sync, and taken
    on the job's own connections (``direct``; the rest came through Dask's comms).
    The averaging figures are zero (no mean is taken)."""

    bytes_sent: int = 0
    dense_bytes: int = 0
    threshold: dict = field(default_factory=dict)
    sparsity: float | None = None
    stale_wait: float = 0.0
    encoding_debug: dict = field(default_factory=dict)
    relayed: int = 0
    fetched_at_sync: int = 0
    direct: int = 0
    avg_time: float = 0.0
    fetch_time: float = 0.0
    bytes_received: int = 0
