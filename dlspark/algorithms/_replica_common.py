"""What the two runtimes of a :class:`~dlspark.algorithms.replica.ReplicaAlgorithm` share."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from ..stats._record import RoundFigures

__all__ = ["ReplicaFigures", "mean_of"]


@dataclass(frozen=True)
class ReplicaFigures(RoundFigures):
    """The figures of a :class:`ReplicaAlgorithm`'s round, on both runtimes: the slowest
    replica's mean and fetch times and the bytes the replicas received for the mean (in one
    process, what a cluster's replicas would have received)."""

    avg_time: float = 0.0
    fetch_time: float = 0.0
    bytes_received: int = 0


def mean_of(contributions: list):
    """The mean of same-structured pytrees in float32 on the host, as the device mesh computes
    it too: a sum in the given order, then one divide (IEEE float32 on both)."""
    n = np.float32(len(contributions))

    def mean(*xs):
        total = np.asarray(xs[0]).astype(np.float32)
        for x in xs[1:]:
            total = total + np.asarray(x).astype(np.float32)
        return total / n

    return jax.tree_util.tree_map(mean, *contributions)
