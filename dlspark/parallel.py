"""ParallelWrapper: data-parallel training over the devices of one process (DL4J's ParallelWrapper).

On one machine with several GPUs, or many cores, the replicas need no cluster:
no serialization, no scheduler, no worker processes. The wrapper is the device
runtime: it cuts the data, resumes from checkpoints, reports rounds and folds a
fit into what the master carries, for any algorithm; the algorithm's own
replica logic runs through the master's ``create_device_run`` hook over the
runtime's exchange (:mod:`dlspark._mesh`: one replica per device on a one-axis
mesh, ``shard_map`` and ``psum``). The rounds, RNG streams, statistics and
checkpoints are those of a :class:`~dlspark.DistributedTrainer` with one worker
per device.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from ._inference import _check_evaluations, evaluate_dataset, stack_examples, unstack_outputs
from ._mesh import DeviceRuntime, MeshExchange, divergence
from ._validate import positive_int
from .algorithms._base import Algorithm
from .data import as_dataset, list_minibatches, load_ref
from .data._sources import (_aligned_blocks, _batch_arrays, _rebatch, in_memory_examples, is_dask_collection,
                            keyed_items, local_batches)
from .data._sources import keyed_features as require_keyed
from .distributed._client import _progress_bar, _resume, check_epochs_and_checkpoints
from .evaluation import ROC, Evaluation, RegressionEvaluation, ROCMultiClass
from .network import Network

__all__ = ["ParallelWrapper", "resolve_devices"]


# -- devices -----------------------------------------------------------------------
def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _request_cpu_devices(n: int) -> None:
    """Ask JAX for ``n`` CPU devices, if it has not started and nobody chose a count. The
    config setting, not ``XLA_FLAGS``: spawned Dask workers would inherit the variable."""
    if jax.config.jax_num_cpu_devices >= 0 or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # JAX already started: the devices it has are the ones there are
        pass


def resolve_devices(devices=None) -> list:
    """The devices a :class:`ParallelWrapper` trains on.

    Parameters
    ----------
    devices : None, int or sequence of jax.Device
        None: every local device of the default backend (on CPU one per core,
        when JAX is started here). An int: the first that many.

    Returns
    -------
    list of jax.Device
    """
    if isinstance(devices, bool) or not (devices is None or isinstance(devices, (int, list, tuple))):
        raise TypeError(f"devices must be None, a number of devices or a list of jax devices, "
                        f"got {type(devices).__name__}")
    if isinstance(devices, (list, tuple)):
        bad = [type(d).__name__ for d in devices if not isinstance(d, jax.Device)]
        if bad or not devices or len(set(devices)) != len(devices):
            raise ValueError(f"devices must be distinct jax devices, e.g. jax.local_devices()[:2]; got {devices!r}")
        return list(devices)
    if devices is not None:
        positive_int("devices", devices)
    _request_cpu_devices(devices or _cores())
    local = jax.local_devices()
    platform = local[0].platform
    hint = ("; JAX was started before ParallelWrapper could ask for CPU devices: call "
            "jax.config.update('jax_num_cpu_devices', N) right after importing jax") if platform == "cpu" else ""
    if devices is not None and devices > len(local):
        raise ValueError(f"devices={devices}, but JAX has {len(local)} {platform} device(s){hint}")
    if devices is None and platform == "cpu" and len(local) == 1 and _cores() > 1:
        raise ValueError(f"JAX has 1 CPU device on this {_cores()}-core machine{hint}, "
                         "or pass devices=1 to train on one device")
    return local[:devices] if devices else local


# -- data ------------------------------------------------------------------------------
def _minibatches(data, batch_size) -> tuple:
    """``(minibatches, partitions)`` as the cluster cuts ``data``: one partition per dask block
    or bag partition, else one partition."""
    parts = None
    if isinstance(data, tuple) and len(data) == 2 and all(is_dask_collection(d) for d in data):
        import dask

        xs, ys = _aligned_blocks(*data)
        parts = dask.compute(*[dask.delayed(_batch_arrays)(a, b, batch_size) for a, b in zip(xs, ys)])
    elif is_dask_collection(data):
        import dask

        parts = dask.compute(*[dask.delayed(_rebatch)(p, batch_size) for p in data.to_delayed()])
    if parts is not None:
        return [b for p in parts for b in p], [i for i, p in enumerate(parts) for _ in p]
    batches, are_urls = local_batches(data, batch_size, 1)
    refs = list(batches) if are_urls else [as_dataset(b, "a minibatch") for b in batches]
    return refs, [0] * len(refs)


# -- the wrapper -----------------------------------------------------------------------
class _Reporter:
    """A fit's rounds to the progress bar and the callbacks, whatever the algorithm."""

    def __init__(self, bar, callbacks):
        self.bar, self.callbacks = bar, list(callbacks)

    def __call__(self, stat) -> None:
        if self.bar is not None:
            self.bar.update(stat["minibatches"])
            if stat["loss"] is not None:
                self.bar.set_postfix(loss=f"{stat['loss']:.4g}",
                                     ex_s=f"{stat['examples'] / max(stat['round_time'], 1e-9):.0f}", refresh=False)
        for cb in self.callbacks:
            cb(stat)


class ParallelWrapper:
    """Train a :class:`~dlspark.Network` data-parallel over the devices of this process.

    The same rounds, results and checkpoints as a :class:`~dlspark.DistributedTrainer` with
    one worker per device, without a cluster: for one machine with several GPUs or cores.

    Parameters
    ----------
    network : Network
        The network to train; after ``fit`` it holds the trained state.
    master : Algorithm, optional
        The algorithm and its settings, any master with a ``create_device_run`` hook
        (ParameterAveraging, GradientSharing, ...; none: evaluation and inference only) (``batch_size_per_worker`` is per device;
        ``worker_prefetch_num_batches`` minibatches per device are loaded ahead, on a
        thread, and placed on their devices there). With ``fused_steps=True`` a round
        runs as one compiled call; by default one call per step and one to average
        (faster for convolutional networks on XLA's CPU backend).
        ``training_approach`` and ``export_directory`` do not apply (nothing is exported).
        With gradient sharing the devices step in lockstep, one minibatch each, and every
        replica applies the sum of all devices' quantized updates (synchronous
        delivery); ``steps_per_round`` steps make a round of the
        statistics; ``mesh`` and ``max_staleness`` do not apply (no network between replicas).
    devices : None, int or list of jax.Device
        Default: every local device of the default backend. On CPU, JAX's
        ``jax_num_cpu_devices`` setting makes one device per core if JAX starts
        here; set it yourself right after ``import jax`` otherwise.
    progress : bool
        Show a progress bar during fit.
    eval_batch_size : int
        Examples per forward pass for evaluation and scoring.
    sharing_encoder : {"auto", "host", "xla"}
        Gradient sharing's threshold encoding: on the host with the workers' encoder, or
        on each device in XLA with the sum over devices in XLA; the same bits either way.
        ``"auto"``: the host on CPU devices (faster there), XLA on accelerators.

    Attributes
    ----------
    loss_history : list of (round, epoch, mean loss)
    last_fit_stats, training_stats : list of dict
        Round statistics with the cluster's keys (``round_time``, ``fit_time_max``: the
        compiled call, fit and mean; ``data_wait``: waiting for the loader).
    algorithm_state : dict
        What the master carries from fit to fit (the outer optimizer's ``outer_state``,
        gradient sharing's ``threshold_state``), read as attributes too.
    published : dict
        The algorithm's running figures, read as attributes too, as on a
        :class:`~dlspark.DistributedTrainer` (``communication``, ``replica_divergence``).

    Examples
    --------
    >>> wrapper = ParallelWrapper(net, ParameterAveraging(averaging_frequency=5))  # doctest: +SKIP
    >>> wrapper.fit(train, epochs=3).output(x)  # doctest: +SKIP
    """

    def __init__(self, network: Network, master=None, devices=None, *, progress: bool = True,
                 eval_batch_size: int = 64, sharing_encoder: str = "auto"):
        if not isinstance(network, Network):
            raise TypeError(f"network must be a dlspark.Network, got {type(network).__name__}")
        if master is not None and not isinstance(master, Algorithm):
            raise TypeError("master must be a training master such as dlspark.ParameterAveraging(...) or "
                            f"dlspark.GradientSharing(...), got {type(master).__name__}")
        positive_int("eval_batch_size", eval_batch_size)
        self.network, self.master, self.progress, self.eval_batch_size = network, master, progress, eval_batch_size
        self.devices = resolve_devices(devices)
        self.exchange = MeshExchange(self.devices)
        self.mesh = self.exchange.mesh
        self.loss_history: list = []
        self.training_stats: list = []
        self.last_fit_stats: list = []
        self.algorithm_state: dict = {}
        self.published: dict = {}
        self._runtime = DeviceRuntime(network, master, self.exchange, self.algorithm_state,
                                      options={"sharing_encoder": sharing_encoder})
        if master is not None:  # an algorithm without a run over devices is refused here, by name
            master.create_device_run(self._runtime)

    def __getattr__(self, name):
        for store in ("algorithm_state", "published"):
            values = self.__dict__.get(store, {})
            if name in values:
                return values[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self):
        return f"ParallelWrapper({len(self.devices)} x {self.devices[0].platform}, {self.master!r})"

    # -- training --------------------------------------------------------------------
    def fit(self, data, epochs: int = 1, *, checkpoint_every: int | None = None, checkpoint_url: str | None = None,
            resume_from: str | None = None, storage_options: dict | None = None, callbacks=(),
            progress: bool | None = None) -> Network:
        """Train on ``data``: a DataSet, a ``(features, labels)`` pair, a list of DataSets,
        minibatch file URLs, a pair of dask arrays or a dask bag of DataSets.

        Parameters
        ----------
        epochs : int
        checkpoint_every : int, optional
            Write a checkpoint to ``checkpoint_url`` every this many rounds (the
            cluster's format: either trainer resumes from it).
        resume_from : str, optional
            A checkpoint written by a fit (of either trainer) with the same data and ``epochs``.
        storage_options : dict, optional
            fsspec options (credentials, endpoints) for minibatch URLs in ``data``,
            ``checkpoint_url`` and ``resume_from``.
        callbacks : sequence of callables
            Each is called with every round's statistics (a dict).

        Returns
        -------
        Network
            ``self.network``, trained.
        """
        check_epochs_and_checkpoints(epochs, checkpoint_every, checkpoint_url)
        refs, partitions = _minibatches(data, self.master.batch_size_per_worker)
        return self._run(refs, partitions, epochs, None, storage_options, checkpoint_every, checkpoint_url,
                         resume_from, callbacks, progress)

    def fit_paths(self, paths, epochs: int = 1, loader=None, *, storage_options: dict | None = None,
                  checkpoint_every: int | None = None, checkpoint_url: str | None = None,
                  resume_from: str | None = None, callbacks=(), progress: bool | None = None) -> Network:
        """Train from minibatch files: a glob, a directory URL or a list of URLs (any fsspec file
        system, ``memory://`` included: this process reads them); ``loader`` is ``url -> DataSet``
        for files in another format. ``storage_options`` (fsspec options: credentials, endpoints)
        serve the files, ``checkpoint_url`` and ``resume_from``."""
        check_epochs_and_checkpoints(epochs, checkpoint_every, checkpoint_url)
        if loader is not None and not callable(loader):
            raise TypeError(f"loader must be a callable url -> DataSet, got {type(loader).__name__}")
        refs = list_minibatches(paths, **(storage_options or {}))
        return self._run(refs, [0] * len(refs), epochs, loader, storage_options, checkpoint_every, checkpoint_url,
                         resume_from, callbacks, progress)

    def _run(self, refs, partitions, epochs, loader, storage_options, checkpoint_every, checkpoint_url,
             resume_from, callbacks, progress):
        """One fit, any algorithm: the master's device run does the rounds; resuming, the progress
        bar and callbacks, and folding the result into what the master carries are the same
        for every algorithm (and as a cluster's)."""
        net, master = self.network, self.master
        if master is None:
            raise ValueError("this ParallelWrapper has no master; pass one, e.g. ParallelWrapper(net, "
                             "ParameterAveraging())")
        # checkpoints and resumes take the data's fsspec options, as on a cluster
        opts = dict(storage_options or {})
        skip, saved_rngs, epochs_done, epochs_total = (), None, 0, epochs
        if resume_from is not None:  # the cluster's resume: the same checks, meta and state
            epochs, skip, saved_rngs, epochs_done, self.algorithm_state = _resume(
                self, resume_from, epochs, len(refs), opts)
            if epochs <= 0:  # the checkpoint's fit was finished: nothing to train
                self.last_fit_stats = []
                return net
        rt = self._runtime
        # the fit's master: what depends on the number of replicas settled for the devices
        settled = master.for_workers(len(self.devices))
        rt.master, rt.algorithm_state, rt.loader, rt.storage_options, rt.checkpoint_options = (
            settled, self.algorithm_state, loader, storage_options, opts)
        run = settled.create_device_run(rt)  # the master of this fit (it may have been replaced)
        bar = _progress_bar(self.progress if progress is None else progress, epochs * len(refs) - len(skip))
        rt.reporter = _Reporter(bar, callbacks)
        try:
            out = run.fit(refs, partitions, epochs, skip=skip, saved_rngs=saved_rngs,
                                       epochs_done=epochs_done, epochs_total=epochs_total,
                                       checkpoint_every=checkpoint_every, checkpoint_url=checkpoint_url)
        finally:
            rt.reporter = None
            if bar is not None:
                bar.close()
        net.state = out.state
        self.algorithm_state = master.after_fit(self.algorithm_state, out, out.carried, self.published)
        if master.compare_replicas():
            self.published["replica_divergence"] = (divergence(out.replica_params) if out.divergence is None
                                                    else out.divergence)
        self.published.update(out.published)
        base_epoch = net.epoch - epochs
        self.loss_history.extend((s["round"], base_epoch + s["epoch"], s["loss"]) for s in out.stats)
        if master.collect_training_stats:
            self.training_stats.extend(out.stats)
        self.last_fit_stats = out.stats
        return net

    # -- evaluation, inference, scoring (in this process, on the network's device) --------
    def _refs(self, data, batch_size, storage_options):
        if isinstance(data, str) or (isinstance(data, (list, tuple)) and data and all(isinstance(u, str) for u in data)):
            return list_minibatches(data, **(storage_options or {}))
        return _minibatches(data, batch_size)[0]

    def do_evaluation(self, data, batch_size: int | None = None, *evaluations, loader=None,
                      storage_options: dict | None = None, output: int | None = None):
        """Fill several evaluations in one pass over ``data`` (what ``fit`` or ``fit_paths`` take).
        A multi-output network is evaluated one output at a time: ``output`` picks it (the
        evaluate methods take it too), as on a :class:`~dlspark.DistributedTrainer`."""
        _check_evaluations(evaluations)
        if batch_size is not None:
            positive_int("batch_size", batch_size)
        bs = batch_size or self.eval_batch_size
        for ref in self._refs(data, bs, storage_options):
            evaluate_dataset(self.network, load_ref(ref, loader, storage_options), evaluations, bs, output=output)
        return list(evaluations)

    def evaluate(self, data, batch_size: int | None = None, **kw):
        """Classification :class:`~dlspark.evaluation.Evaluation` over ``data``."""
        return self.do_evaluation(data, batch_size, Evaluation(), **kw)[0]

    def evaluate_roc(self, data, threshold_steps: int = 0, batch_size: int | None = None, **kw):
        """Binary :class:`~dlspark.evaluation.ROC` over ``data``."""
        return self.do_evaluation(data, batch_size, ROC(threshold_steps), **kw)[0]

    def evaluate_roc_multiclass(self, data, threshold_steps: int = 0, batch_size: int | None = None, **kw):
        """One-vs-all :class:`~dlspark.evaluation.ROCMultiClass` over ``data``."""
        return self.do_evaluation(data, batch_size, ROCMultiClass(threshold_steps), **kw)[0]

    def evaluate_regression(self, data, batch_size: int | None = None, **kw):
        """:class:`~dlspark.evaluation.RegressionEvaluation` over ``data``."""
        return self.do_evaluation(data, batch_size, RegressionEvaluation(), **kw)[0]

    def predict_with_keys(self, keyed_features, batch_size: int = 64, features_mask=None):
        """Keyed inference: a dict, a list of ``(key, array)`` pairs or a dask bag of pairs in,
        the same kind of keyed outputs out. ``features_mask`` maps keys to per-example masks."""
        kind, items = require_keyed(keyed_features)
        if kind == "bag":
            import dask.bag as db

            out = self.predict_with_keys(list(items.compute()), batch_size)
            return db.from_sequence(out, npartitions=max(1, items.npartitions))
        if not items:
            return {} if kind == "dict" else []
        mask = None if features_mask is None else np.stack([np.asarray(features_mask[k]) for k, _ in items])
        out = self.network.output(stack_examples([f for _, f in items]), batch_size=batch_size, features_mask=mask)
        pairs = unstack_outputs([k for k, _ in items], out)
        return dict(pairs) if kind == "dict" else pairs

    def score_examples(self, data, include_regularization: bool = False, batch_size: int | None = None):
        """Per-example loss: a DataSet gives an array in example order; keyed examples (a dict
        or list of ``(key, DataSet)``) give the same kind, keyed."""
        bs = batch_size or self.eval_batch_size
        keyed = keyed_items(data, of="examples")
        if keyed is None:
            return self.network.score_examples(in_memory_examples(data), bs)
        kind, items = keyed
        if not items:
            return {} if kind == "dict" else []
        parts = [as_dataset(d, f"the examples of key {k!r}") for k, d in items]
        losses = self.network.score_examples(type(parts[0]).merge(parts), bs)
        bounds = np.cumsum([0] + [len(d) for d in parts])
        vals = [losses[a:b] if b - a > 1 else float(losses[a]) for a, b in zip(bounds[:-1], bounds[1:])]
        pairs = list(zip([k for k, _ in items], vals))
        return dict(pairs) if kind == "dict" else pairs

    def calculate_score(self, data, average: bool = True, batch_size: int | None = None) -> float:
        """Total (or, with ``average``, mean per example) loss over ``data``."""
        losses = self.score_examples(data, batch_size=batch_size)
        return float(losses.mean() if average else losses.sum())
