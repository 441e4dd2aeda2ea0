"""Training masters: frozen, validated configuration of the distributed algorithms."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ParameterAveraging", "GradientSharing", "TRAINING_APPROACHES", "REPARTITION", "REPARTITION_STRATEGIES",
           "MESHES"]

TRAINING_APPROACHES = ("export", "direct")
REPARTITION = ("always", "never", "num_partitions_workers_differs")
REPARTITION_STRATEGIES = ("balanced", "spark_default")
MESHES = ("plain", "tree")


def _positive_int(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


@dataclass(frozen=True)
class ParameterAveraging:
    """Synchronous parameter averaging (DL4J's ``ParameterAveragingTrainingMaster``).

    Each round every worker fits ``averaging_frequency`` minibatches of
    ``batch_size_per_worker`` examples from the same starting parameters;
    then the parameters (and with ``save_updater`` the floating-point updater
    state) are averaged across workers, and every worker continues from the mean.

    Parameters
    ----------
    batch_size_per_worker : int
        Examples per minibatch on each worker (used when dlspark cuts data
        into minibatches; minibatch files keep their own size).
    averaging_frequency : int
        Minibatches each worker fits between two averagings.
    worker_prefetch_num_batches : int
        Minibatches a worker loads ahead in a background thread (0: none).
    save_updater : bool
        Average the updater state too; if false, every worker resets its
        updater at the start of each round, as DL4J does.
    training_approach : {"export", "direct"}
        ``export`` writes the data once as minibatch files to
        ``export_directory`` and trains from them; ``direct`` keeps
        minibatches in Dask worker memory (two copies, so that one lost worker
        loses none).
    export_directory : str, optional
        A URL every worker can read (a shared disk, S3, ...). Default: a
        temporary local directory, which suits clusters on one machine.
    repartition : {"always", "never", "num_partitions_workers_differs"}
        When to rebalance minibatches across workers.
    repartition_strategy : {"balanced", "spark_default"}
        ``balanced`` splits every round's minibatches into shares that differ
        by at most one; ``spark_default`` assigns whole chunks of
        ``averaging_frequency`` in order, so the last round may leave workers idle.
    collect_training_stats : bool
        Record per-round timings (fit, averaging, idle) on the trainer.

    Examples
    --------
    >>> ParameterAveraging(batch_size_per_worker=16, averaging_frequency=5).save_updater
    True
    """

    batch_size_per_worker: int = 32
    averaging_frequency: int = 5
    worker_prefetch_num_batches: int = 2
    save_updater: bool = True
    training_approach: str = "export"
    export_directory: str | None = None
    repartition: str = "always"
    repartition_strategy: str = "balanced"
    collect_training_stats: bool = False

    def __post_init__(self):
        _check_common(self)
        _positive_int("averaging_frequency", self.averaging_frequency)
        if not isinstance(self.save_updater, bool):
            raise TypeError(f"save_updater must be True or False, got {self.save_updater!r}")

    @property
    def steps_per_round(self) -> int:
        return self.averaging_frequency

    algorithm = "averaging"


def _check_common(m):
    _positive_int("batch_size_per_worker", m.batch_size_per_worker)
    _positive_int("worker_prefetch_num_batches", m.worker_prefetch_num_batches, minimum=0)
    _choice("training_approach", m.training_approach, TRAINING_APPROACHES)
    _choice("repartition", m.repartition, REPARTITION)
    _choice("repartition_strategy", m.repartition_strategy, REPARTITION_STRATEGIES)
    if not isinstance(m.collect_training_stats, bool):
        raise TypeError(f"collect_training_stats must be True or False, got {m.collect_training_stats!r}")
    if m.export_directory is not None and not isinstance(m.export_directory, str):
        raise TypeError(f"export_directory must be a URL string, got {type(m.export_directory).__name__}")


def _default_threshold():
    from ._thresholds import AdaptiveThreshold

    return AdaptiveThreshold()


def _default_post():
    from ._thresholds import ResidualClipping

    return ResidualClipping(5, 5)


@dataclass(frozen=True)
class GradientSharing:
    """Asynchronous gradient sharing with threshold-encoded sparse updates (DL4J's ``SharedTrainingMaster``).

    Each worker turns every minibatch's gradient into an update through the
    optax updater, adds it to its residual, and sends the part of the residual
    that crossed the threshold, quantized to ``±threshold``, to every peer.
    Every replica applies its own quantized updates and every peer's, never
    its raw update, so all replicas apply the same sums.

    Parameters
    ----------
    batch_size_per_worker, worker_prefetch_num_batches, training_approach, export_directory,
    repartition, repartition_strategy, collect_training_stats
        As in :class:`ParameterAveraging`.
    threshold_algorithm : AdaptiveThreshold, TargetSparsityThreshold or FixedThreshold
        How each worker's threshold moves (default: adaptive, sparsity in [1e-4, 1e-2]).
    residual_post_processor : ResidualClipping or NoResidualPostProcessing
        Default: clip the residual to ±5 thresholds every 5 iterations.
    workers_per_node : int, optional
        Accepted for DL4J compatibility; dlspark runs one worker per device.
    encoding_debug : bool
        Record per step and worker: threshold, sparsity, format, message bytes,
        residual norm, mean |update| / threshold.
    mesh : {"plain", "tree"}
        ``plain``: every worker sends to every peer. ``tree``: the coordinator
        arranges each round's workers in a tree of fan-out ``tree_fanout``;
        a worker sends to its tree neighbours, which relay onwards, so no
        worker talks to more than ``tree_fanout + 1`` others (DL4J's mesh
        mode, for large clusters).
    tree_fanout : int
        Children per node of the relay tree.
    steps_per_round : int
        Minibatches handed to each worker at a time. There is no barrier
        between steps; at the end of each such round the replicas confirm
        they applied the same messages (and lost or joining workers are handled).
    max_staleness : int
        How many steps a worker may run ahead of the slowest live peer.

    Examples
    --------
    >>> GradientSharing(batch_size_per_worker=16).threshold_algorithm.initial
    0.0001
    """

    batch_size_per_worker: int = 32
    threshold_algorithm: object = field(default_factory=_default_threshold)
    residual_post_processor: object = field(default_factory=_default_post)
    workers_per_node: int | None = None
    worker_prefetch_num_batches: int = 2
    training_approach: str = "export"
    export_directory: str | None = None
    repartition: str = "always"
    repartition_strategy: str = "balanced"
    encoding_debug: bool = False
    mesh: str = "plain"
    collect_training_stats: bool = False
    steps_per_round: int = 16
    max_staleness: int = 4
    tree_fanout: int = 4

    algorithm = "sharing"

    def __post_init__(self):
        from ._thresholds import (AdaptiveThreshold, FixedThreshold, NoResidualPostProcessing, ResidualClipping,
                                  TargetSparsityThreshold)

        _check_common(self)
        _choice("mesh", self.mesh, MESHES)
        _positive_int("steps_per_round", self.steps_per_round)
        _positive_int("max_staleness", self.max_staleness, minimum=0)
        _positive_int("tree_fanout", self.tree_fanout)
        if self.workers_per_node is not None:
            _positive_int("workers_per_node", self.workers_per_node)
        if not isinstance(self.threshold_algorithm, (AdaptiveThreshold, TargetSparsityThreshold, FixedThreshold)):
            raise TypeError("threshold_algorithm must be AdaptiveThreshold(...), TargetSparsityThreshold(...) or "
                            f"FixedThreshold(t), got {type(self.threshold_algorithm).__name__}")
        if not isinstance(self.residual_post_processor, (ResidualClipping, NoResidualPostProcessing)):
            raise TypeError("residual_post_processor must be ResidualClipping(...) or NoResidualPostProcessing(), "
                            f"got {type(self.residual_post_processor).__name__}")
        if not isinstance(self.encoding_debug, bool):
            raise TypeError(f"encoding_debug must be True or False, got {self.encoding_debug!r}")
