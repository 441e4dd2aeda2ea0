"""The job's typed messages: frozen dataclasses on the control path, one error envelope.

Control messages (an order from the scheduler to a worker, its reply) travel
pickled inside Dask's comm protocol (``to_serialize``); they are small, a few per
round. Dense tensors never travel here: workers fetch them from one another.

An algorithm defines its own orders and replies by subclassing :class:`Order`
and :class:`Reply` in its package; the plugins route them without knowing them.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import ClassVar

import cloudpickle

__all__ = ["JobSpec", "JobOptions", "Order", "Reply", "FitOrder", "FitReply", "RngOrder", "RngReply",
           "CheckpointOrder", "Ack", "ErrorReply", "JobResult", "Unavailable", "PeerLost", "WORKER_EVENTS"]


@dataclass(frozen=True)
class JobSpec:
    """What every worker of a job is set up from (pickled once, for joiners too)."""

    definition: dict
    network_token: str
    master: object
    refs: list
    loader: object = None
    storage_options: dict | None = None
    #: what the algorithm carries from one fit to the next (see ``Algorithm.after_fit``)
    algorithm_state: dict = field(default_factory=dict)
    #: resumed fits: each worker position's RNG when the checkpoint was written
    worker_rngs: list | None = None
    checkpoint_options: dict | None = None


@dataclass(frozen=True)
class JobOptions:
    """What the scheduler's job machine plans from."""

    epochs: int
    steps_per_round: int
    repartition: str = "always"
    repartition_strategy: str = "balanced"
    skip: tuple = ()  # minibatches already trained in the first epoch (a resumed fit)
    base_step: int = 0
    base_epoch: int = 0
    epochs_total: int = 1  # a checkpoint speaks of the whole fit, a resumed one included
    epochs_done: int = 0
    checkpoint_every: int | None = None
    checkpoint_url: str | None = None
    final_epochs: int = 0  # the fit's last epochs, whose rounds are final_steps_per_round long
    final_steps_per_round: int | None = None


@dataclass(frozen=True)
class Order:
    """An instruction from the job's coordinator to one worker; ``op`` names the handler."""

    op: ClassVar[str] = ""


@dataclass(frozen=True)
class PeerLost:
    """The coordinator's word to a job's workers, one way (nothing is answered), that ``peer``
    was lost mid-round: a run waiting for what the peer would have sent stops waiting
    (:meth:`~dlspark.distributed._run.WorkerRun.notice`)."""

    peer: str
    kind: ClassVar[str] = "peer_lost"


@dataclass(frozen=True)
class Reply:
    """A worker's answer. ``unreachable`` names peers it could not reach: the coordinator
    checks each itself and drops those it cannot reach either."""

    unreachable: tuple = ()


@dataclass(frozen=True)
class FitOrder(Order):
    """Fit ``refs`` (indices into the job's references) in this order; ``next_refs`` is a
    prefetch hint; ``plan`` is the algorithm's own instruction for the round."""

    op: ClassVar[str] = "fit"
    round: int = 0
    epoch: int = 0
    refs: tuple = ()
    next_refs: tuple = ()
    plan: object = None


@dataclass(frozen=True)
class FitReply(Reply):
    loss_sum: float = 0.0
    n: int = 0  # minibatches whose loss counts (a skipped non-finite one does not)
    examples: int = 0
    fit_time: float = 0.0
    data_wait: float = 0.0
    #: the algorithm's figures for the round's statistics
    extra: dict = field(default_factory=dict)
    #: each minibatch's ``(loss, examples)`` in the order trained (non-finite ones included):
    #: the round's per-iteration rows (``dlspark.stats._record.iteration_rows``)
    steps: tuple = ()


@dataclass(frozen=True)
class RngOrder(Order):
    op: ClassVar[str] = "rng"


@dataclass(frozen=True)
class RngReply(Reply):
    rng: list = ()


@dataclass(frozen=True)
class CheckpointOrder(Order):
    """Write this worker's state to ``url``. ``worker_rngs``: every live worker's RNG in
    the order rounds are assigned, so that a resumed fit gives each position its dropout
    stream; ``meta``: the algorithm's entries for the checkpoint's metadata."""

    op: ClassVar[str] = "checkpoint"
    url: str = ""
    step: int = 0
    epoch: int = 0
    progress: dict = field(default_factory=dict)
    worker_rngs: list = ()
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Ack(Reply):
    """Done, nothing to report."""


@dataclass(frozen=True)
class Unavailable(Reply):
    """A peer's answer when what was asked for will not come (its fit failed, the job
    was torn down, or ``peer`` is the one that failed it)."""

    peer: str | None = None


@dataclass(frozen=True)
class ErrorReply:
    """The one error envelope: an exception raised on a worker or in the coordinator,
    pickled where it was raised and unpickled only by the client, so that the scheduler
    never needs the user's exception classes."""

    pickled: bytes
    text: str

    @classmethod
    def from_exception(cls, e: BaseException) -> "ErrorReply":
        try:
            pickled = cloudpickle.dumps(e)
        except Exception:
            pickled = cloudpickle.dumps(RuntimeError(f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return cls(pickled, f"{type(e).__name__}: {e}")

    def exception(self) -> BaseException:
        return cloudpickle.loads(self.pickled)


#: what the job machine reports about a worker (the ``event`` of ``JobResult.events``), each with
#: the training statistics' instant that records it
WORKER_EVENTS = {"lost": "worker_lost", "joined": "worker_joined", "join-failed": "worker_join_failed",
                 "partitioned": "worker_dropped"}


@dataclass(frozen=True)
class JobResult:
    """A finished job: the live workers (any holds the trained state), minibatches
    trained, every round's statistics, the algorithm's state to carry on and what
    happened to the job's workers (``events``: each worker lost, joined, that could not
    join or was dropped, in order; the client's ``last_fit_events``)."""

    workers: tuple
    trained: int
    stats: tuple
    algorithm_state: dict = field(default_factory=dict)
    events: tuple = ()
