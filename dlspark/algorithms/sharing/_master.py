"""GradientSharing: the master (configuration and plug-in hooks) of threshold-encoded gradient sharing."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace

from .._base import Algorithm, choice, int_setting
from ._device import SharingDeviceRun
from ._dgc import DGC_SPARSITY_WARMUP, MOMENTUM_FIELDS
from ._thresholds import AdaptiveThreshold, ResidualClipping, ResidualPostProcessor, ThresholdAlgorithm

__all__ = ["GradientSharing", "MESHES", "OWN_UPDATES", "FINAL_PARAMS"]

MESHES = ("plain", "tree")
OWN_UPDATES = ("whole", "encoded")
FINAL_PARAMS = ("mean", "first")


def _auto(warmup) -> bool:
    """Whether a ``sparsity_warmup`` is ``"auto"`` (settled per fit by ``for_workers``)."""
    return isinstance(warmup, str) and warmup == "auto"


def _default_threshold():
    return AdaptiveThreshold()


def _default_post():
    return ResidualClipping(5, 5)


@dataclass(frozen=True)
class GradientSharing(Algorithm):
    """Asynchronous gradient sharing with threshold-encoded sparse updates (DL4J's ``SharedTrainingMaster``).

    Each worker turns every minibatch's gradient into an update through the
    optax updater, adds it to its residual, and sends the part of the residual
    that crossed the threshold, quantized to ``±threshold``, to every peer.
    Every replica applies its peers' quantized updates and, by default, its own
    whole update (``own_update``).

    Parameters
    ----------
    batch_size_per_worker, worker_prefetch_num_batches, training_approach, export_directory,
    repartition, repartition_strategy, collect_training_stats
        As in :class:`ParameterAveraging`.
    threshold_algorithm : ThresholdAlgorithm
        AdaptiveThreshold, TargetSparsityThreshold, FixedThreshold, or any object
        with the :class:`~dlspark.algorithms.ThresholdAlgorithm` protocol's methods.
        How each worker's threshold moves (default: adaptive, sparsity in [1e-4, 1e-2], the
        first 20 thresholds taken from each worker's residual so that they send 1e-3 of
        its elements, and never fewer than a message's 2; DL4J starts from a fixed 1e-3,
        ``AdaptiveThreshold(initial=1e-3)``).
    residual_post_processor : ResidualPostProcessor
        ResidualClipping, NoResidualPostProcessing, or any object with the
        :class:`~dlspark.algorithms.ResidualPostProcessor` protocol's ``update``.
        Default: clip the residual to ±5 thresholds every 5 iterations.
    workers_per_node : int, optional
        Accepted for DL4J compatibility; dlspark runs one worker per device.
    encoding_debug : bool
        Record per step and worker: threshold, sparsity, format, message bytes,
        residual norm, mean ``|update|`` / threshold.
    mesh : {"plain", "tree"}
        ``plain``: every worker sends to every peer. ``tree``: the coordinator
        arranges each round's workers in a tree of fan-out ``tree_fanout``;
        a worker sends to its tree neighbours, which relay onwards, so during
        a round's steps no worker talks to more than ``tree_fanout + 1``
        others (DL4J's mesh mode, for large clusters); the round's sync
        fetches a message a replica missed from whichever worker holds it.
        Each worker's ``bytes_sent`` counts its messages once per peer
        (relays move the same total), so the round's total is the bytes on
        the wire, not each worker's share of them.
    tree_fanout : int
        Children per node of the relay tree.
    steps_per_round : int
        Minibatches handed to each worker at a time. No call to the coordinator
        comes between a round's steps (a step waits only for its peers' messages,
        as ``max_staleness`` says); at the end of each such round every replica
        waits for its peers' messages of the round and tells the coordinator which
        it applied, one round trip, and lost or joining workers are handled (a
        round with a fault also syncs the replicas' messages through the coordinator).
    max_staleness : int
        How many steps a worker may run ahead of the slowest live peer. ``0`` (the
        default) is synchronous delivery: at the end of each step a worker waits for
        every live peer's message of that step and applies exactly those, so that every
        replica starts its next step from the same sum of the same messages, as in
        :class:`~dlspark.ParallelWrapper` (with two workers, the same bits). A number
        ``k >= 1`` is DL4J's asynchronous delivery: a worker applies whichever messages
        have come and waits only for a peer more than ``k`` steps behind
        (``dlspark.compat``'s ``SharedTrainingMaster`` uses 4). Synchronous delivery
        was the more accurate on 7 of the parity suite's 8 tasks measured and reached the
        network benchmark's target accuracy in 2 epochs where asynchronous delivery took 3
        to 4; with a core per worker it gave up a few examples/s where the link is fast
        (1.11x the single process against 1.19x on unlimited links, 0.80x both at
        100 Mbit/s). A synchronous step waits for the slowest peer: where workers are
        uneven (shared cores, mixed hardware) asynchronous delivery is the faster.
    delivery_lag : {0, 1}
        Under synchronous delivery, how many steps late a replica applies its peers'
        messages. ``0`` (the default): at the end of each step, those of the same step.
        ``1``: those of the step before, so that a step's messages travel while the next
        step computes, as Pipe-SGD pipelines its all-reduce: across links where a round trip
        takes milliseconds a step no longer waits for one. A replica applies its own update
        at once either way; the messages of a round's last step are applied at the round's
        end, so every replica ends a round with the same messages applied. Deterministic,
        and the same on a cluster and in a :class:`~dlspark.ParallelWrapper`. Only with
        ``max_staleness=0`` (asynchronous delivery applies messages as they come).
    momentum_masking : bool
        Deep Gradient Compression's momentum-factor masking: after each step, the
        updater's momentum (the fields named in ``momentum_fields`` of its optax state
        that are shaped as the parameters: Adam's ``mu``, SGD momentum's ``trace``) is
        set to zero at the elements the replica's message just sent, so that a
        momentum built up in the residual does not push them again. Off by default;
        an updater without momentum is refused when a fit starts.
    momentum_fields : tuple of str
        The optax state fields that hold a momentum (default ``("mu", "trace")``).
    local_gradient_clipping : float, optional
        Clip each replica's gradient by global norm before its updater, to this value
        over the square root of the number of replicas (as DGC does). None (the
        default): no clipping.
    sparsity_warmup : "auto" or tuple of float
        A warm-up of the sparsity over the first epochs (the network's epoch counter,
        from 0): in epoch ``e < len(sparsity_warmup)`` every replica sends the
        fraction ``sparsity_warmup[e]`` of its residual's elements (the threshold is
        the magnitude that sends it) and the threshold algorithm waits, starting
        from its own initial state when the warm-up ends. DGC's is
        ``GradientSharing.DGC_SPARSITY_WARMUP``, ``(0.25, 0.0625, 0.015625,
        0.00390625)``; empty: none. ``"auto"`` (the default): DGC's where a fit starts
        with ``GradientSharing.WARMUP_FROM_WORKERS`` (4) workers or more, none with
        fewer. On the parity suite at 4 workers DGC's warm-up took every task within
        the rule (the worst from -1.62 points against one process to -0.89, the
        average from -0.35 to +0.42) and at 2 workers it changed nothing beyond the
        seeds' spread (the average paired difference +0.01); it sends 1.2 to 10 times the
        bytes over the suite's short fits (a first epoch at a quarter of the elements),
        and on the network benchmark's 2 workers it doubled the time of a fresh fit's
        first epoch. ``()`` turns it off at any count.
    own_update : {"whole", "encoded"}
        How a replica applies its own update. ``"whole"`` (the default): at once and
        whole, beside its peers' encoded messages; what its residual holds (the part
        its peers have not had yet, and whatever residual clipping dropped) is then in
        its own parameters only, so the replicas differ by their residuals
        (``replica_divergence`` reports it) and a fit ends with their mean
        (``final_params``). ``"encoded"``: DL4J's, every replica applies every
        replica's encoded message, its own included, so all apply the same sums and
        end equal (to the order of float additions; with two workers, the same bits).
        On the parity suite (``docs/benchmarks/parity-suite.md``, 10 seeds, points
        against one process), ``"whole"`` took the suite's average from -15.1 to
        -0.43 at 2 workers and from -4.5 to -1.6 at 4: the encoded own update holds a
        replica back by its residual, which on a small regression made training
        diverge. It costs nothing on the wire: the messages are the same.
    final_params : {"mean", "first"}
        What the network's parameters are at a fit's end when the replicas differ
        (``own_update="whole"``). ``"mean"`` (the default): the mean of the replicas'
        parameters (every worker sends its parameters once at the fit's end; the
        network's updater state is stitched, each floating-point array one replica's,
        spread so that the workers send about equal bytes; the replicas themselves go on
        from their own in a fit that continues). ``"first"``:
        the first replica's. On the parity suite at 4 workers the mean took the
        suite's average from -1.59 points against one process to -0.35. Under
        ``own_update="encoded"`` the fit ends with the first replica's. A checkpoint
        holds the first replica's state either way (its worker writes it alone).
    continue_replicas : bool
        A fit that starts from exactly the state the last fit ended with (the
        network's state untouched in between, checked bit for bit) continues each
        replica where it stopped: its own updater state, its residual (the part of
        its updates not sent yet), its threshold and its count of messages, and
        under ``own_update="whole"`` its own parameters, so that fitting an epoch
        at a time trains as one longer fit does. True (the default). With False, or
        when the state was changed, restored or resumed, every replica starts from
        the network's state with an empty residual, as a first fit does; the mass
        held in the residuals is then dropped. On a cluster the replicas that
        continue are also not sent what they keep of their own.

    Examples
    --------
    >>> GradientSharing(batch_size_per_worker=16).threshold_algorithm
    AdaptiveThreshold(initial=None, min_sparsity=0.0001, max_sparsity=0.01, decay=0.9659363289248456, warmup=20)
    >>> GradientSharing(momentum_masking=True, local_gradient_clipping=1.0,
    ...                 sparsity_warmup=GradientSharing.DGC_SPARSITY_WARMUP).sparsity_warmup
    (0.25, 0.0625, 0.015625, 0.00390625)
    """

    threshold_algorithm: object = field(default_factory=_default_threshold)
    residual_post_processor: object = field(default_factory=_default_post)
    workers_per_node: int | None = None
    encoding_debug: bool = False
    mesh: str = "plain"
    steps_per_round: int = 16
    max_staleness: int = 0
    delivery_lag: int = 0
    tree_fanout: int = 4
    momentum_masking: bool = False
    momentum_fields: tuple = MOMENTUM_FIELDS
    local_gradient_clipping: float | None = None
    sparsity_warmup: object = "auto"
    continue_replicas: bool = True
    own_update: str = "whole"
    final_params: str = "mean"

    name = "sharing"
    DGC_SPARSITY_WARMUP = DGC_SPARSITY_WARMUP
    #: ``sparsity_warmup="auto"`` is DGC's warm-up on this many workers or more
    WARMUP_FROM_WORKERS = 4

    def __post_init__(self):
        super().__post_init__()
        choice("mesh", self.mesh, MESHES)
        choice("own_update", self.own_update, OWN_UPDATES)
        choice("final_params", self.final_params, FINAL_PARAMS)
        int_setting(self, "steps_per_round")
        int_setting(self, "max_staleness", minimum=0)
        int_setting(self, "delivery_lag", minimum=0)
        if self.delivery_lag > 1:
            raise ValueError(f"delivery_lag must be 0 (peers' messages applied in their own step) or 1 (a step "
                             f"late), got {self.delivery_lag}")
        if self.delivery_lag and self.max_staleness:
            raise ValueError(f"delivery_lag={self.delivery_lag} lags synchronous delivery; with max_staleness="
                             f"{self.max_staleness} a replica applies its peers' messages as they come: set "
                             "max_staleness=0 to use delivery_lag, or delivery_lag=0")
        int_setting(self, "tree_fanout")
        if self.workers_per_node is not None:
            int_setting(self, "workers_per_node")
        # protocols, not a list of classes: any object with the methods will do, as optax takes
        # any (init, update) pair
        if not isinstance(self.threshold_algorithm, ThresholdAlgorithm):
            raise TypeError("threshold_algorithm must be AdaptiveThreshold(...), TargetSparsityThreshold(...), "
                            "FixedThreshold(t) or another object with init, prepare, update and reduce "
                            f"(the ThresholdAlgorithm protocol), got {type(self.threshold_algorithm).__name__}")
        if not isinstance(self.residual_post_processor, ResidualPostProcessor):
            raise TypeError("residual_post_processor must be ResidualClipping(...), NoResidualPostProcessing() or "
                            "another object with update(residual, threshold, iteration) (the ResidualPostProcessor "
                            f"protocol), got {type(self.residual_post_processor).__name__}")
        if not isinstance(self.encoding_debug, bool):
            raise TypeError(f"encoding_debug must be True or False, got {self.encoding_debug!r}")
        if not isinstance(self.continue_replicas, bool):
            raise TypeError(f"continue_replicas must be True or False, got {self.continue_replicas!r}")
        self._check_dgc()

    def _check_dgc(self):
        if not isinstance(self.momentum_masking, bool):
            raise TypeError(f"momentum_masking must be True or False, got {self.momentum_masking!r}")
        fields = self.momentum_fields
        if isinstance(fields, str) or not isinstance(fields, (tuple, list)) or not fields \
                or not all(isinstance(f, str) for f in fields):
            raise TypeError("momentum_fields must be a non-empty tuple of optax state field names, for example "
                            f"('mu', 'trace'), got {fields!r}")
        object.__setattr__(self, "momentum_fields", tuple(fields))
        clip = self.local_gradient_clipping
        if clip is not None:
            if isinstance(clip, bool) or not isinstance(clip, numbers.Real):
                raise TypeError(f"local_gradient_clipping must be a number or None, got {type(clip).__name__}")
            if not (math.isfinite(clip) and clip > 0):
                raise ValueError(f"local_gradient_clipping must be a finite number > 0 (the global norm bound "
                                 f"before dividing by sqrt(replicas)) or None, got {clip!r}")
            object.__setattr__(self, "local_gradient_clipping", float(clip))
        warm = self.sparsity_warmup
        if _auto(warm):
            return
        if isinstance(warm, (str, bytes)) or not isinstance(warm, (tuple, list)):
            raise TypeError('sparsity_warmup must be "auto", a tuple of fractions sent per epoch (for example '
                            f"GradientSharing.DGC_SPARSITY_WARMUP) or (), got {warm!r}")
        for i, d in enumerate(warm):
            if isinstance(d, bool) or not isinstance(d, numbers.Real) or not 0 < d <= 1:
                raise ValueError(f"sparsity_warmup[{i}] must be a fraction of elements in (0, 1], got {d!r} "
                                 f"(in sparsity_warmup={tuple(warm)!r})")
        object.__setattr__(self, "sparsity_warmup", tuple(float(d) for d in warm))

    def for_workers(self, n: int) -> "GradientSharing":
        """The master with ``sparsity_warmup="auto"`` settled for a fit on ``n`` workers: DGC's
        warm-up from :attr:`WARMUP_FROM_WORKERS` workers, none below."""
        if not _auto(self.sparsity_warmup):
            return self
        return replace(self, sparsity_warmup=DGC_SPARSITY_WARMUP if n >= self.WARMUP_FROM_WORKERS else ())

    # -- plug-in hooks ------------------------------------------------------------
    def create_driver(self, options):
        from ._driver import SharingDriver

        return SharingDriver(options, self)

    def create_run_on_worker(self, worker, job, spec, state, rank):
        from ._run import SharingRun

        return SharingRun(worker, job, spec, state, rank)

    def create_device_run(self, runtime):
        return SharingDeviceRun(runtime)

    def resume_state(self, meta, url, network, storage_options=None):
        # Gradient sharing goes on from the threshold the workers had reached (with the
        # same threshold algorithm; a new one starts from its own initial value).
        from ._thresholds import ThresholdState

        saved = meta.get("threshold_states") or {}
        if not saved.get("states") or saved.get("algorithm") != repr(self.threshold_algorithm):
            return {}
        states = [ThresholdState(*(float("nan") if x is None else x for x in st)) for st in saved["states"]]
        return self.carry_threshold({}, self.threshold_algorithm.reduce(states))

    def carry_threshold(self, algorithm_state, state) -> dict:
        """``algorithm_state`` with the threshold state a fit reached, for the next fit to go on from."""
        return {**algorithm_state, "threshold_state": state, "threshold_algorithm": repr(self.threshold_algorithm)}

    def carried_threshold(self, algorithm_state):
        """The threshold state an earlier fit (or the resumed checkpoint) reached, if it was this
        master's threshold algorithm's (a new one starts from its own initial value), or None."""
        if algorithm_state.get("threshold_algorithm") != repr(self.threshold_algorithm):
            return None
        return algorithm_state.get("threshold_state")

    def after_fit(self, algorithm_state, result, carried, published):
        from ._thresholds import ThresholdState

        out = dict(algorithm_state)
        states = [ThresholdState(*s) for s in result.algorithm_state.get("threshold_states", ())]
        if states:
            out = self.carry_threshold(out, self.threshold_algorithm.reduce(states))
        comm = published.setdefault("communication", {"bytes_sent": 0, "dense_bytes": 0})
        for s in result.stats:
            comm["bytes_sent"] += s.get("bytes_sent", 0)
            comm["dense_bytes"] += s.get("dense_bytes", 0)
        return out

    def replicas_continue(self) -> bool:
        return self.continue_replicas

    def replica_fields(self) -> tuple:
        """Under ``own_update="whole"`` a replica's parameters are its own too (they hold its
        residual's part of its updates, which its peers have not had)."""
        return (".opt_state", ".params") if self.own_update == "whole" else (".opt_state",)

    def final_mean(self) -> bool:
        return self.own_update == "whole" and self.final_params == "mean"

    def compare_replicas(self) -> bool:
        """The replicas differ by the order of float additions (``own_update="encoded"``) or by
        their residuals (``"whole"``): the trainer reports how far apart they ended
        (``replica_divergence``)."""
        return True
