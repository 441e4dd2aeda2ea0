"""What an algorithm plug-in provides, and what the masters share.

An algorithm is its master (a frozen dataclass the user builds, e.g.
``ParameterAveraging``), which is also its spec: it creates the algorithm's
scheduler-side :class:`RoundDriver` and its worker-side run, and it keeps what
the algorithm carries from one fit to the next. The Dask plugins, the job state
machine and the trainer call these hooks and never ask which algorithm it is.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

from .._validate import positive_int
from ..distributed._messages import JobOptions, Reply
from ..distributed._plan import Coordinator
from ..stats._record import RoundFigures
from ._replica_common import mean_of

__all__ = ["Algorithm", "RoundDriver", "choice", "check_common", "TRAINING_APPROACHES",
           "REPARTITION", "REPARTITION_STRATEGIES"]

TRAINING_APPROACHES = ("export", "direct")
REPARTITION = ("always", "never", "num_partitions_workers_differs")
REPARTITION_STRATEGIES = ("balanced", "spark_default")


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

    def round_stats(self) -> RoundFigures:
        """The algorithm's figures for the round just completed (its typed part of the round's
        ``RoundStats`` record)."""
        return RoundFigures()

    def result_state(self, workers: list) -> dict:
        """What the job result carries back to the client for the algorithm."""
        return {}

    def checkpoint_meta(self, workers: list) -> dict:
        """The algorithm's entries in a checkpoint's metadata."""
        return {}


@dataclass(frozen=True)
class Algorithm(abc.ABC):
    """The base of every master: the settings the engine reads, and the hooks it runs an algorithm through.

    A master is a frozen dataclass deriving from this one; it adds its own settings
    and implements the abstract hooks. The settings below are declared here once
    and read by both runtimes (a :class:`~dlspark.DistributedTrainer` and a
    :class:`~dlspark.ParallelWrapper`); a master never redeclares them.

    Parameters
    ----------
    batch_size_per_worker : int
        Examples per minibatch on each worker or device (used when dlspark cuts
        data into minibatches; minibatch files keep their own size).
    worker_prefetch_num_batches : int
        Minibatches a worker loads ahead in a background thread (0: none).
    training_approach : {"export", "direct"}
        ``export`` writes the data once as minibatch files to ``export_directory``
        and trains from them; ``direct`` keeps minibatches in Dask worker memory.
    export_directory : str, optional
        A URL every worker can read. Default: a temporary local directory.
    repartition : {"always", "never", "num_partitions_workers_differs"}
        When to rebalance minibatches across workers.
    repartition_strategy : {"balanced", "spark_default"}
        How a round's minibatches are shared out.
    collect_training_stats : bool
        Record per-round timings on the trainer.
    """

    batch_size_per_worker: int = 32
    worker_prefetch_num_batches: int = 2
    training_approach: str = "export"
    export_directory: str | None = None
    repartition: str = "always"
    repartition_strategy: str = "balanced"
    collect_training_stats: bool = False

    #: a short name, for messages and statistics
    name: ClassVar[str] = ""

    def __post_init__(self):
        check_common(self)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = vars(cls)
        if ("create_run_on_worker" in own or "create_driver" in own) and "create_device_run" not in own:
            # A master that changes what runs on a cluster but not what runs over devices would
            # run its parent's algorithm in a ParallelWrapper, silently: it runs nowhere but on
            # a cluster until it says how it runs over devices.
            cls.create_device_run = Algorithm.create_device_run

    @property
    @abc.abstractmethod
    def steps_per_round(self) -> int:
        """Minibatches each worker fits in a round (a round ends with the algorithm's exchange)."""

    def for_workers(self, n: int) -> "Algorithm":
        """This master with what depends on the number of replicas settled for a fit on ``n``
        of them (the master a fit's workers or devices are given); by default itself."""
        return self

    def job_options(self) -> dict:
        """The master's settings the job machine plans from."""
        return {"steps_per_round": self.steps_per_round, "repartition": self.repartition,
                "repartition_strategy": self.repartition_strategy}

    def planner(self, partitions, epochs, skip=()) -> Coordinator:
        """The round planner of a fit of ``epochs`` over devices (a ParallelWrapper's run),
        built from the options a cluster's job machine plans from: the same rounds on either."""
        return Coordinator.from_options(partitions, JobOptions(epochs, skip=tuple(skip), **self.job_options()))

    @property
    def prefetch_depth(self) -> int:
        """Minibatches a worker loads ahead of its steps."""
        return self.worker_prefetch_num_batches

    @abc.abstractmethod
    def create_driver(self, options: JobOptions) -> RoundDriver:
        """The scheduler side of one job on a cluster."""

    @abc.abstractmethod
    def create_run_on_worker(self, worker, job: str, spec, state: dict, rank: int):
        """The worker side of one job on a cluster (a ``distributed._run.WorkerRun``)."""

    def create_device_run(self, runtime):
        """The algorithm run over the devices of one process (:class:`~dlspark.ParallelWrapper`).

        ``runtime`` is the wrapper's ``DeviceRuntime``: its devices,
        mesh and exchange, its data, its reporter and its checkpoints. The object
        returned has ``fit(refs, partitions, epochs, resumed) -> (stats, result)``.
        """
        raise NotImplementedError(f"{type(self).__name__} runs on a DistributedTrainer; it defines no "
                                  "create_device_run for ParallelWrapper")

    def resume_state(self, meta: dict, url: str, network, storage_options: dict | None = None) -> dict:
        """The algorithm state to go on with, from a checkpoint's metadata (and arrays read
        from ``url`` with fsspec ``storage_options``)."""
        return {}

    def after_fit(self, algorithm_state: dict, result, carried: list, published: dict) -> dict:
        """Fold a finished job into what the algorithm carries on; ``result`` has the job's
        ``stats`` (round records) and ``algorithm_state`` (the driver's ``result_state``),
        ``carried`` is the first live worker's ``carried_state()``, and ``published`` the
        trainer's figures (updated in place). Returns the new algorithm state."""
        return dict(algorithm_state)

    def replicas_continue(self) -> bool:
        """Whether each replica keeps its own updater state, and what its worker run keeps
        beside it (``WorkerRun.replica_extra``), into a fit that starts from exactly the
        state the last fit ended with. False: every fit starts every replica from the
        client's state."""
        return False

    def replica_fields(self) -> tuple:
        """The train state's fields (paths under it, such as ``".opt_state"``) that each
        replica keeps as its own into such a fit (``replicas_continue``)."""
        return (".opt_state",)

    def final_mean(self) -> bool:
        """Whether a fit whose replicas end apart ends with :meth:`end_params` of their
        parameters (else with the first replica's)."""
        return False

    def end_params(self, replicas: list):
        """The network's parameters at a fit's end from the replicas' (same-structured trees,
        the first replica's first): their mean in float32, summed in replica order."""
        return mean_of(replicas)

    def compare_replicas(self) -> bool:
        """Whether replicas may end apart (then the trainer measures ``replica_divergence``)."""
        return False
