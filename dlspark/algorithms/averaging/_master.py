"""ParameterAveraging: the master (configuration and plug-in hooks) of synchronous averaging."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .._base import Algorithm, int_setting
from ._device import AveragingDeviceRun

__all__ = ["ParameterAveraging"]


def _positive_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@dataclass(frozen=True)
class ParameterAveraging(Algorithm):
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
        Minibatches each worker fits between two averagings. Rounds do not span epochs (as
        DL4J splits each epoch): an epoch's minibatches are dealt out this many per worker a
        round and its last round takes what is left, so where a worker has fewer minibatches
        an epoch than this, every round is an epoch.
    final_epochs : int
        How many of a fit's last epochs average every ``final_frequency`` minibatches instead
        of every ``averaging_frequency`` (0, the default: none; more than the fit's epochs: the
        whole fit). Counted within each ``fit`` call, so two calls of 10 epochs with
        ``final_epochs=3`` each close with 3 such epochs; a fit resumed from a checkpoint
        counts the epochs it has left, and so closes as the fit it resumes would have.
        Measured on the parity suite (Adam, seeds 0-9): averaging at 50 ended 5.6 points
        below one process on its attention task at 4 workers, and with the fit's last three
        epochs at 5 within 0.7 points of it on every task at 2 and 4 workers, with 1.5 to 3.9
        times fewer rounds than averaging at 5 throughout
        (docs/benchmarks/parity-suite.md). Their rounds, shorter than ``averaging_frequency``,
        end in the plain mean under an ``outer_updater`` too (see there).
    final_frequency : int
        The averaging frequency of the ``final_epochs`` (default 5, the default frequency).
    exchange_precision : {"float32", "bfloat16"}
        What a round's contributions travel in between a cluster's workers. ``"float32"``
        (the default): each replica's averaged leaves as they are, and the mean is exact.
        ``"bfloat16"``: each replica's move since the round's start (parameters, and the
        updater's state with ``save_updater``) rounded to bfloat16, half of the bytes, with
        error feedback: what the rounding lost is kept by the replica and added to its next
        round's move, so nothing is lost for good. Every replica adds the same mean of the
        rounded moves to the round's start, so the replicas stay equal. A replica keeps a
        float32 copy of the round's start and its residual (two more copies of the averaged
        leaves); a worker that joins, or a fit that resumes, starts its residual at zero.
        A :class:`~dlspark.ParallelWrapper` computes the same rounds (its devices exchange nothing
        over a network, so it gains nothing there; it trains as the cluster would). Measured
        on the parity suite (eight tasks, seeds 0-9, frequency 5): within a point of one
        process on every task at 2 and 4 workers (docs/benchmarks/parity-suite.md). On two emulated hosts
        (docs/benchmarks/network.md) it raised averaging from 0.54x to 0.73x one process at
        1 Gbit/s and cost 6% on unlimited links: for links of a gigabit or slower.
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
        When to rebalance minibatches across workers. ``never`` keeps the
        data's partitions on their workers; data of one partition (a single
        DataSet, ``fit_paths``) is shared out as with ``always``.
    repartition_strategy : {"balanced", "spark_default"}
        ``balanced`` splits every round's minibatches into shares that differ
        by at most one; ``spark_default`` assigns whole chunks of
        ``averaging_frequency`` in order, so the last round may leave workers idle.
    collect_training_stats : bool
        Record per-round timings (fit, averaging, idle) on the trainer.
    fused_steps : bool
        When a round's minibatches share one shape, run the worker's steps as
        one compiled call (``lax.scan`` over the stacked minibatches) instead
        of one call per step; the prefetcher then loads a whole round ahead.
        On a worker the loop is rolled, so its compile time does not grow with
        ``averaging_frequency``, unless the step has a convolution (then it is
        unrolled: XLA's CPU backend runs rolled convolutions far slower);
        ParallelWrapper's fused rounds are unrolled. Off by default: on CPU a
        small CNN's fused steps measured about 1.25x slower than separate calls
        (an MLP's were not); try it per network.
    update_scale : "workers" or float
        What every update of the network's updater is multiplied by inside a round that ends
        in the plain mean (every round without an ``outer_updater``; with one, the rounds
        shorter than ``averaging_frequency``): for optax's optimizers, whose learning rate
        scales the update last (Adam, SGD, ...), the rate times this. ``"workers"`` (the
        default) is the number of replicas the fit starts with, the linear rule: the mean of
        ``n`` replicas' steps then moves the parameters about as far as ``n`` steps of one
        process on the same minibatches, so that a rate set for one process at
        ``batch_size_per_worker`` serves any number of workers (gradient sharing applies the
        sum of the replicas' updates, to the same end). ``1.0`` is DL4J's averaging (and what
        ``dlspark.compat`` builds); set it when the rate you give is already scaled for the
        workers. Measured on the parity suite (eight tasks, Adam, seeds 0-9): the mean of
        unscaled steps ends 3.7 points below one process on average over the suite at 2
        workers and 12.9 at 4, the scaled ones within a point of it on every task at 2 and 4
        workers. Larger multiples are not measured; the linear rule is known to want a
        warm-up of the rate there. The scale is the worker count at the fit's start, kept if
        workers are lost or join.
    outer_update_scale : "sqrt" or float
        The same for a round that ends in the outer step. ``"sqrt"`` (the default) is the
        square root of the replicas the fit starts with; ``1.0`` is DiLoCo's (each replica at
        one worker's rate). Chosen on the parity suite's tuning tasks at frequency 50 with the
        outer Nesterov step at 4 workers, where the square root was the better on all four
        when every round took the outer step (``cancer`` -0.18 points from one process
        against -1.49, ``friedman`` +3.44 against -5.12). With the outer step after full
        rounds only and ``final_epochs=3``, one worker's rate held every task at 2 workers
        and missed two at 4 (its attention task by 5.5 points), the square root missed one
        at each count (by 1.2 and 2.7); scaled by the workers (``n``) it was far worse
        (docs/benchmarks/parity-suite.md). Unused without an ``outer_updater``.
    outer_updater : optax.GradientTransformation, optional
        An outer optimizer (DiLoCo, arXiv 2311.08105): at the end of a round in which every
        contributor fitted ``averaging_frequency`` minibatches, the round-start parameters
        minus the workers' mean is taken as a gradient and this transformation's update is
        applied to the round-start parameters. ``optax.sgd(1.0)`` is the plain mean (to float
        rounding); OpenDiLoCo uses ``optax.sgd(0.7, momentum=0.9, nesterov=True)``. A round
        that is shorter (an epoch's last, or every round where a worker has fewer minibatches
        an epoch than the frequency, and the rounds of ``final_epochs``) ends in the plain mean
        of steps scaled by ``update_scale``, as without an outer optimizer, and leaves the
        outer state as it was: the outer step is set for a period, and a short period with it
        was measured to lose (``benchmarks/bench_parity.py``, 2 workers: 3.6 to 5 points on
        the tabular task at frequencies 5 and 20; on the parity suite at frequency 5, 4.5
        points on the GRU task). Its state is the same on every replica, carried from fit to
        fit and saved in checkpoints. ``None`` (the default): the parameters are the mean.
        Use it only at long periods (50 and beyond), where an epoch holds several rounds.
        Measured on the parity suite (eight tasks, Adam, seeds 0-9) at frequency 50 with
        OpenDiLoCo's Nesterov step and ``final_epochs=3``: within a point of one process on
        every task but its attention task at 2 and 4 workers, which it cost 1.2 and 2.7
        points, where the same fits without it held every task
        (docs/benchmarks/parity-suite.md).

    Examples
    --------
    >>> ParameterAveraging(batch_size_per_worker=16, averaging_frequency=5).save_updater
    True
    """

    averaging_frequency: int = 5
    save_updater: bool = True
    fused_steps: bool = False
    outer_updater: object = None
    update_scale: object = "workers"
    outer_update_scale: object = "sqrt"
    final_epochs: int = 0
    final_frequency: int = 5
    exchange_precision: str = "float32"

    name = "averaging"

    def __post_init__(self):
        super().__post_init__()
        int_setting(self, "averaging_frequency")
        int_setting(self, "final_epochs", minimum=0)
        int_setting(self, "final_frequency")
        for name in ("save_updater", "fused_steps"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.exchange_precision not in ("float32", "bfloat16"):
            raise ValueError(f'exchange_precision must be "float32" or "bfloat16", got {self.exchange_precision!r}')
        scale = self.update_scale
        if not (scale == "workers" or _positive_number(scale)):
            raise ValueError(f'update_scale must be "workers" or a positive finite number, got {scale!r}')
        scale = self.outer_update_scale
        if not (scale == "sqrt" or _positive_number(scale)):
            raise ValueError(f'outer_update_scale must be "sqrt" or a positive finite number, got {scale!r}')
        if self.outer_updater is not None and not (hasattr(self.outer_updater, "init")
                                                   and hasattr(self.outer_updater, "update")):
            raise TypeError("outer_updater must be an optax transformation, e.g. "
                            "optax.sgd(0.7, momentum=0.9, nesterov=True), or None; "
                            f"got {type(self.outer_updater).__name__}")

    def for_workers(self, n: int) -> "ParameterAveraging":
        """The master with the worker-relative scales its fit uses settled for ``n`` replicas:
        ``update_scale="workers"`` is ``n``, and under an outer optimizer
        ``outer_update_scale="sqrt"`` is ``sqrt(n)``."""
        outer = self.outer_update_scale
        return replace(self, update_scale=float(n) if self.update_scale == "workers" else self.update_scale,
                       outer_update_scale=math.sqrt(n) if outer == "sqrt" and self.outer_updater is not None else outer)

    def takes_outer_step(self, full: bool) -> bool:
        """Whether a round ends in the outer step: with an ``outer_updater``, a ``full`` one
        (every contributor fitted ``averaging_frequency`` minibatches or more)."""
        return self.outer_updater is not None and full

    @property
    def steps_per_round(self) -> int:
        return self.averaging_frequency

    @property
    def longest_round(self) -> int:
        """Minibatches a worker fits in the fit's longest rounds."""
        return max(self.averaging_frequency, self.final_frequency if self.final_epochs else 0)

    @property
    def prefetch_depth(self) -> int:
        """Minibatches a worker loads ahead: a whole round when its steps are fused."""
        if self.fused_steps and self.worker_prefetch_num_batches:
            return max(self.worker_prefetch_num_batches, self.longest_round)
        return self.worker_prefetch_num_batches

    def job_options(self) -> dict:
        return {**super().job_options(), "final_epochs": self.final_epochs,
                "final_steps_per_round": self.final_frequency}

    # -- plug-in hooks ------------------------------------------------------------
    def create_driver(self, options):
        from ._driver import AveragingDriver

        return AveragingDriver(options)

    def create_run_on_worker(self, worker, job, spec, state, rank):
        from ._run import AveragingRun

        return AveragingRun(worker, job, spec, state, rank)

    def create_device_run(self, runtime):
        return AveragingDeviceRun(runtime)

    def resume_state(self, meta, url, network, storage_options=None):
        if self.outer_updater is None:
            return {}
        from ._numerics import outer_state_from_arrays
        from ...checkpoint import read_checkpoint_aux

        arrays = read_checkpoint_aux(url, **(storage_options or {}))
        if arrays is None:  # written without an outer optimizer: it starts afresh
            return {}
        return {"outer_state": outer_state_from_arrays(self.outer_updater, network.state.params, arrays, url)}

    def after_fit(self, algorithm_state, result, carried, published):
        if self.outer_updater is None or carried is None:
            return dict(algorithm_state)
        return {**algorithm_state, "outer_state": carried}
