"""LocalSGD: the master, which is also the whole algorithm (a replica's round, pure JAX)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax

from ..replica import ReplicaAlgorithm

__all__ = ["LocalSGD"]


@dataclass(frozen=True)
class LocalSGD(ReplicaAlgorithm):
    """Local SGD whose averaged pseudo-gradient travels in bfloat16, with error feedback.

    Each round every replica fits ``local_steps`` minibatches from the round's starting
    parameters with the network's own updater (whose state stays the replica's own).
    Its pseudo-gradient, the round-start parameters minus its parameters now, plus the
    rounding error it kept from the last round, is sent in bfloat16 (half of float32's
    bytes); what the rounding lost is kept and added to the next round's (error
    feedback, so nothing is lost for good). The replicas take the mean of the bfloat16
    pseudo-gradients in float32 and step from the round-start parameters: by the mean
    itself, or, with ``outer_updater``, by that optax transformation's update of it
    (DiLoCo's outer step) after a round in which every contributor fitted ``local_steps``
    minibatches; a shorter round (an epoch's last) steps by the mean and leaves the outer
    state as it was, as :class:`~dlspark.ParameterAveraging`'s outer step does. Error
    feedback and the outer state start afresh with each fit.

    Parameters
    ----------
    local_steps : int
        Minibatches each replica fits between two means.
    outer_updater : optax.GradientTransformation, optional
        The outer optimizer; ``None``: the parameters step by the mean pseudo-gradient.
    batch_size_per_worker, worker_prefetch_num_batches, training_approach, export_directory,
    repartition, repartition_strategy, collect_training_stats
        As in :class:`~dlspark.algorithms.Algorithm`.

    Examples
    --------
    >>> LocalSGD(local_steps=8, batch_size_per_worker=32).steps_per_round
    8
    """

    outer_updater: object = None

    name = "localsgd"

    def __post_init__(self):
        super().__post_init__()
        if self.outer_updater is not None and not (hasattr(self.outer_updater, "init")
                                                   and hasattr(self.outer_updater, "update")):
            raise TypeError("outer_updater must be an optax transformation, e.g. "
                            f"optax.sgd(0.7, momentum=0.9, nesterov=True), or None; got {type(self.outer_updater).__name__}")

    def init_carry(self, params):
        error = jax.tree_util.tree_map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
        return error, (() if self.outer_updater is None else self.outer_updater.init(params))

    def contribute(self, start, params, carry):
        error, outer = carry
        pseudo = jax.tree_util.tree_map(lambda s, p, e: (s - p).astype(jnp.float32) + e, start, params, error)
        sent = jax.tree_util.tree_map(lambda g: g.astype(jnp.bfloat16), pseudo)
        error = jax.tree_util.tree_map(lambda g, q: g - q.astype(jnp.float32), pseudo, sent)
        return sent, (error, outer)

    def finish(self, start, mean, carry):
        if self.outer_updater is None:  # every round steps by the mean, as a short one does
            return self.finish_short(start, mean, carry)
        error, outer = carry
        updates, outer = self.outer_updater.update(_in_dtypes_of(start, mean), outer, start)
        return optax.apply_updates(start, updates), (error, outer)

    @property
    def short_rounds_differ(self) -> bool:
        """Only with an outer updater: without one every round steps by the mean, and the
        engine compiles one finish for both kinds."""
        return self.outer_updater is not None and super().short_rounds_differ

    def finish_short(self, start, mean, carry):
        """A short round steps by the mean pseudo-gradient itself; the outer state stays as it
        was (the outer step is set for rounds of ``local_steps``)."""
        return jax.tree_util.tree_map(lambda s, g: s - g, start, _in_dtypes_of(start, mean)), carry


def _in_dtypes_of(params, mean):
    """The mean pseudo-gradient (float32) in the parameters' dtypes."""
    return jax.tree_util.tree_map(lambda g, s: g.astype(jnp.result_type(s)), mean, params)
