"""The job machine's vocabulary: the events it takes and the instructions it gives.

Events derive from :class:`StateMachineEvent`, carry a ``stimulus_id`` and are
dispatched by type (:meth:`dlspark.distributed._machine.JobMachine.handle`);
instructions are what the scheduler plugin carries out. All are frozen
dataclasses: an event that grows a field changes one class.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from ._messages import ErrorReply, JobResult, Order, PeerLost, Reply

__all__ = ["StateMachineEvent", "Start", "Replied", "Failed", "WorkerLost", "WorkerJoined", "Joined", "JoinFailed",
           "Probed", "ClientLost", "ClientBack", "GraceOver", "Cancel",
           "Send", "Tell", "Probe", "Join", "Emit", "Timer", "Finish", "Fail", "Abandon"]


# -- events ---------------------------------------------------------------------
_STIMULI = itertools.count()


@dataclass(frozen=True)
class StateMachineEvent:
    """What the machine takes: every event derives from this and is dispatched by its type.

    ``stimulus_id`` names the stimulus (a reply, a lost worker, a timer) in the machine's
    log (:attr:`JobMachine.log`); left out, it is the event's kind and a counter. It is not
    part of an event's equality: two events of one kind with the same fields are equal.
    """

    stimulus_id: str = field(default="", compare=False, kw_only=True)

    def __post_init__(self):
        if not self.stimulus_id:
            object.__setattr__(self, "stimulus_id", f"{type(self).__name__.lower()}-{next(_STIMULI)}")


@dataclass(frozen=True)
class Start(StateMachineEvent):
    """The job's workers are set up: plan the first round."""


@dataclass(frozen=True)
class Replied(StateMachineEvent):
    """``worker`` answered the order sent as ``seq``."""

    worker: str
    seq: int
    reply: Reply


@dataclass(frozen=True)
class Failed(StateMachineEvent):
    """``worker``'s handler raised (the envelope holds the error): the job fails with it."""

    worker: str
    seq: int
    error: ErrorReply


@dataclass(frozen=True)
class WorkerLost(StateMachineEvent):
    """``worker`` left the cluster, or a connection to it failed."""

    worker: str


@dataclass(frozen=True)
class WorkerJoined(StateMachineEvent):
    """``worker`` arrived in the cluster; it joins the job at the next round."""

    worker: str


@dataclass(frozen=True)
class Joined(StateMachineEvent):
    """``worker``'s set-up from a peer's state succeeded."""

    worker: str


@dataclass(frozen=True)
class JoinFailed(StateMachineEvent):
    """``worker``'s set-up failed with ``error``."""

    worker: str
    error: str


@dataclass(frozen=True)
class Probed(StateMachineEvent):
    """Whether the coordinator itself reached ``worker``."""

    worker: str
    alive: bool


@dataclass(frozen=True)
class ClientLost(StateMachineEvent):
    """The job's client disconnected: its grace period starts."""


@dataclass(frozen=True)
class ClientBack(StateMachineEvent):
    """The job's client is connected again."""


@dataclass(frozen=True)
class GraceOver(StateMachineEvent):
    """The grace period started by the ``absence``-th ``ClientLost`` is over."""

    absence: int = 0


@dataclass(frozen=True)
class Cancel(StateMachineEvent):
    """The client is done with the job (or it was abandoned): stop issuing anything."""


# -- instructions -----------------------------------------------------------------
@dataclass(frozen=True)
class Send:
    """Send ``order`` to ``worker``; its answer comes back as ``Replied``/``Failed`` with ``seq``,
    or as ``WorkerLost``."""

    worker: str
    seq: int
    order: Order


@dataclass(frozen=True)
class Tell:
    """Send ``notice`` to ``worker`` one way: no answer is awaited, and one that cannot be
    delivered is no fault (a worker that is gone is lost by its own event)."""

    worker: str
    notice: PeerLost


@dataclass(frozen=True)
class Probe:
    worker: str


@dataclass(frozen=True)
class Join:
    """Set the job up on ``worker`` from ``source``'s state, as rank ``rank``, after ``delay`` s."""

    worker: str
    source: str
    rank: int
    delay: float = 0.0


@dataclass(frozen=True)
class Emit:
    """A message for the client's event topic (round statistics, joins, checkpoints)."""

    msg: dict


@dataclass(frozen=True)
class Timer:
    """Feed ``event`` back after ``seconds``."""

    seconds: float
    event: object


@dataclass(frozen=True)
class Finish:
    result: JobResult


@dataclass(frozen=True)
class Fail:
    error: ErrorReply


@dataclass(frozen=True)
class Abandon:
    """Stop the job and tear it down everywhere (its client is gone)."""

    reason: str
