"""What an algorithm plug-in provides, and what the masters share.

An algorithm is its master (a frozen dataclass the user builds, e.g.
``ParameterAveraging``), which is also its spec: it creates the algorithm's
scheduler-side :class:`RoundDriver` and its worker-side run, and it keeps what
the algorithm carries from one fit to the next. The Dask plugins, the job state
machine and the trainer call these hooks and never ask which algorithm it is.
"""

from __future__ import annotations

import numbers
from typing import ClassVar

import numpy as np

from ..distributed._messages import JobOptions, Reply

__all__ = ["Algorithm", "RoundDriver", "positive_int", "choice", "check_common", "TRAINING_APPROACHES",
           "REPARTITION", "REPARTITION_STRATEGIES"]

TRAINING_APPROACHES = ("export", "direct")
REPARTITION = ("always", "never", "num_partitions_workers_differs")
REPARTITION_STRATEGIES = ("balanced", "spark_default")


def positive_int(name, value, minimum=1) -> int:
    """``value`` as an int, checked to be an integer (numpy's too, not a bool) >= ``minimum``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def int_setting(master, name, minimum=1) -> None:
    """Check a master's integer setting and keep it as a Python int (a numpy integer would not
    go into a checkpoint's JSON)."""
    object.__setattr__(master, name, positive_int(name, getattr(master, name), minimum))


def choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def check_common(m):
    """The checks of the settings every master has."""
    int_setting(m, "batch_size_per_worker")
    int_setting(m, "worker_prefetch_num_batches", minimum=0)
    choice("training_approach", m.training_approach, TRAINING_APPROACHES)
    choice("repartition", m.repartition, REPARTITION)
    choice("repartition_strategy", m.repartition_strategy, REPARTITION_STRATEGIES)
    if not isinstance(m.collect_training_stats, bool):
        raise TypeError(f"collect_training_stats must be True or False, got {m.collect_training_stats!r}")
    if m.export_directory is not None and not isinstance(m.export_directory, str):
        raise TypeError(f"export_directory must be a URL string, got {type(m.export_directory).__name__}")


class RoundDriver:
    """The scheduler side of an algorithm: pure, one per job, called by the job machine.

    ``begin`` returns the round's first orders as ``(worker, order)`` pairs;
    ``step`` is called once every order sent has been answered (or its worker
    lost, and the peers named unreachable probed) with the replies received and
    the live workers, and returns the next orders or a ``RoundDone``.
    ``attempt`` counts the times the round was re-driven after a fault.
    """

    #: what the job machine says when a round is re-driven too often
    failure: ClassVar[str] = "the round could not be completed"

    def __init__(self, options: JobOptions):
        self.options = options
        #: worker -> FitReply of the round under way (the machine reads them for the statistics)
        self.fits: dict = {}

    def begin(self, plan, hint: dict, live: frozenset) -> list:
        raise NotImplementedError

    def step(self, replies: dict[str, Reply], live: frozenset, attempt: int):
        raise NotImplementedError

    def round_stats(self) -> dict:
        """The algorithm's figures for the round just completed."""
        return {}

    def result_state(self, workers: list) -> dict:
        """What the job result carries back to the client for the algorithm."""
        return {}

    def checkpoint_meta(self, workers: list) -> dict:
        """The algorithm's entries in a checkpoint's metadata."""
        return {}


class Algorithm:
    """Mixin of the masters: the hooks through which the engine runs an algorithm."""

    #: a short name, for messages and statistics
    name: ClassVar[str] = ""

    def job_options(self) -> dict:
        """The master's settings the job machine plans from."""
        return {"steps_per_round": self.steps_per_round, "repartition": self.repartition,
                "repartition_strategy": self.repartition_strategy}

    @property
    def prefetch_depth(self) -> int:
        """Minibatches a worker loads ahead of its steps."""
        return self.worker_prefetch_num_batches

    def create_driver(self, options: JobOptions) -> RoundDriver:
        raise NotImplementedError

    def create_run_on_worker(self, worker, job: str, spec, state: dict, rank: int):
        raise NotImplementedError

    def resume_state(self, meta: dict, url: str, network, storage_options: dict | None = None) -> dict:
        """The algorithm state to go on with, from a checkpoint's metadata (and arrays read
        from ``url`` with fsspec ``storage_options``)."""
        return {}

    def after_fit(self, algorithm_state: dict, result, carried: list, published: dict) -> dict:
        """Fold a finished job into what the algorithm carries on; ``carried`` is each
        live worker's ``carried_state()`` (the first worker's first), and ``published``
        the trainer's figures (updated in place). Returns the new algorithm state."""
        return dict(algorithm_state)

    def compare_replicas(self) -> bool:
        """Whether replicas may end apart (then the trainer measures ``replica_divergence``)."""
        return False
