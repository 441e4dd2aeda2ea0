"""Training masters: frozen, validated configuration of the distributed algorithms."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ParameterAveraging", "TRAINING_APPROACHES", "REPARTITION", "REPARTITION_STRATEGIES"]

TRAINING_APPROACHES = ("export", "direct")
REPARTITION = ("always", "never", "num_partitions_workers_differs")
REPARTITION_STRATEGIES = ("balanced", "spark_default")


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
        _positive_int("batch_size_per_worker", self.batch_size_per_worker)
        _positive_int("averaging_frequency", self.averaging_frequency)
        _positive_int("worker_prefetch_num_batches", self.worker_prefetch_num_batches, minimum=0)
        _choice("training_approach", self.training_approach, TRAINING_APPROACHES)
        _choice("repartition", self.repartition, REPARTITION)
        _choice("repartition_strategy", self.repartition_strategy, REPARTITION_STRATEGIES)
        for name in ("save_updater", "collect_training_stats"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.export_directory is not None and not isinstance(self.export_directory, str):
            raise TypeError(f"export_directory must be a URL string, got {type(self.export_directory).__name__}")

    @property
    def steps_per_round(self) -> int:
        return self.averaging_frequency
