"""Write an algorithm once, as one replica's round; both runtimes run it.

:class:`ReplicaAlgorithm` is the extension point for synchronous round-based
algorithms (local SGD and its relatives): a master that says, as pure JAX
functions, what a replica does around the local steps of a round. The engine
runs it on a cluster (a worker per replica: the mean over the round's
contributors is fetched from peers over Dask comms, and a lost peer is dropped
from the mean) and in a :class:`~dlspark.ParallelWrapper` (a device per
replica: the mean is a ``psum`` over the device mesh). A round is:

1. the replica's state at the round's start (the epoch counter set);
2. ``steps_per_round`` local steps of the network's own updater;
3. ``contribute(start, params, carry) -> (contribution, carry)``: what the
   replica puts into the round's mean (any pytree, any floating dtype), from
   the round-start parameters and its parameters after the steps;
4. the mean of the contributions over the round's contributors, in float32
   (a sum, then one divide, in the contributors' order);
5. ``finish(start, mean, carry) -> (params, carry)``: every replica's new
   parameters, the same on each; after a *short* round, in which some
   contributor fitted fewer than ``steps_per_round`` minibatches (an epoch's
   last, or every round where an epoch holds fewer minibatches a replica),
   ``finish_short`` instead, which is ``finish`` unless the algorithm says
   otherwise (an outer optimizer set for a period may skip such a round).

``carry`` is what a replica keeps from round to round (error feedback, an
outer optimizer's state): ``init_carry(params)`` makes it at the start of each
fit. A replica with no minibatch in a round contributes nothing and still
finishes the round. See ``dlspark.algorithms.localsgd`` for a complete one and
the "write your own algorithm" page of the documentation.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from ._base import Algorithm, int_setting
from ._replica_cluster import ReplicaDriver, ReplicaRun
from ._replica_common import ReplicaFigures, mean_of
from ._replica_device import ReplicaDeviceRun

__all__ = ["ReplicaAlgorithm", "ReplicaFigures", "mean_of"]


@dataclass(frozen=True)
class ReplicaAlgorithm(Algorithm):
    """A synchronous algorithm written as one replica's round (see the module's docstring).

    Parameters
    ----------
    local_steps : int
        Minibatches each replica fits between two means (the round's length).
    """

    local_steps: int = 10

    def __post_init__(self):
        super().__post_init__()
        int_setting(self, "local_steps")

    @property
    def steps_per_round(self) -> int:
        return self.local_steps

    # -- what an algorithm writes ------------------------------------------------------
    @abc.abstractmethod
    def init_carry(self, params):
        """What a replica keeps from round to round, at the start of a fit (a pytree)."""

    @abc.abstractmethod
    def contribute(self, start, params, carry):
        """``(contribution, carry)``: the replica's part of the round's mean (pure JAX)."""

    @abc.abstractmethod
    def finish(self, start, mean, carry):
        """``(params, carry)``: the parameters every replica goes on from (pure JAX)."""

    def finish_short(self, start, mean, carry):
        """:meth:`finish` for a round in which some contributor fitted fewer than
        ``steps_per_round`` minibatches (pure JAX); by default :meth:`finish` itself."""
        return self.finish(start, mean, carry)

    @property
    def short_rounds_differ(self) -> bool:
        """Whether the algorithm finishes a short round its own way (so that the engine
        compiles a second finish only then)."""
        return type(self).finish_short is not ReplicaAlgorithm.finish_short

    # -- the engine's hooks ---------------------------------------------------------------
    def create_driver(self, options):
        return ReplicaDriver(options)

    def create_run_on_worker(self, worker, job, spec, state, rank):
        return ReplicaRun(worker, job, spec, state, rank)

    def create_device_run(self, runtime):
        return ReplicaDeviceRun(runtime)
