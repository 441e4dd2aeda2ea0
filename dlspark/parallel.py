"""ParallelWrapper: data-parallel training over the devices of one process (DL4J's ParallelWrapper).

On one machine with several GPUs, or many cores, the replicas need no cluster:
no serialization, no scheduler, no worker processes. Each device holds one
replica of the train state (every leaf stacked on a leading replica axis and
sharded over a one-axis mesh). With parameter averaging a round is planned by the cluster's own planner
(:class:`~dlspark.distributed._plan.Coordinator`, device ``i`` standing where the
``i``-th worker in address order stands), so the minibatch-to-replica assignment,
the per-replica RNG streams and the checkpoints are those of a
:class:`~dlspark.DistributedTrainer` with as many workers. A round's steps run as
SPMD calls (``shard_map``: ``train_step`` on every device, one call per step or, with
``fused_steps``, one over the round's stacked minibatches), then its mean (``psum``)
with the outer optimizer in one more. Gradient sharing runs in
:mod:`dlspark._parallel_sharing`.
"""

from __future__ import annotations

import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._inference import _check_evaluations, evaluate_dataset, stack_examples, unstack_outputs
from .algorithms._base import Algorithm, positive_int
from .algorithms.averaging import ParameterAveraging
from .algorithms.averaging._numerics import is_averaged
from .algorithms.sharing import GradientSharing
from ._parallel_sharing import resolve_encoder
from .checkpoint import fit_checkpoint_bytes
from .data import as_dataset, list_minibatches, load_ref
from .data._sources import (_aligned_blocks, _batch_arrays, _rebatch, in_memory_examples, is_dask_collection,
                            keyed_items, local_batches)
from .data._sources import keyed_features as require_keyed
from .distributed._client import _progress_bar, _resume, check_epochs_and_checkpoints
from .evaluation import ROC, Evaluation, RegressionEvaluation, ROCMultiClass
from .io import write_bytes
from .network import Network

__all__ = ["ParallelWrapper", "resolve_devices"]

from ._parallel_averaging import (AXIS, _by_device, _equivalent_bytes, _first, _lead, _policy_step, _Rounds,
                                  _round_function, _step_function)


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
class ParallelWrapper:
    """Train a :class:`~dlspark.Network` data-parallel over the devices of this process.

    The same rounds, results and checkpoints as a :class:`~dlspark.DistributedTrainer` with
    one worker per device, without a cluster: for one machine with several GPUs or cores.

    Parameters
    ----------
    network : Network
        The network to train; after ``fit`` it holds the trained state.
    master : ParameterAveraging or GradientSharing
        The algorithm and its settings (``batch_size_per_worker`` is per device;
        ``worker_prefetch_num_batches`` minibatches per device are loaded ahead, on a
        thread, and placed on their devices there). With ``fused_steps=True`` a round
        runs as one compiled call; by default one call per step and one to average
        (faster for convolutional networks on XLA's CPU backend).
        ``training_approach`` and ``export_directory`` do not apply (nothing is exported).
        With gradient sharing the devices step in lockstep, one minibatch each, and every
        replica applies the sum of all devices' quantized updates (see
        :mod:`dlspark._parallel_sharing`); ``steps_per_round`` steps make a round of the
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
        Round statistics, as the cluster's (``round_time``, ``fit_time_max``: the
        compiled call, fit and mean; ``data_wait``: waiting for the loader;
        ``bytes_equivalent``: what a cluster's replicas would have received).
    algorithm_state : dict
        What the master carries from fit to fit (the outer optimizer's ``outer_state``).

    Examples
    --------
    >>> wrapper = ParallelWrapper(net, ParameterAveraging(averaging_frequency=5))  # doctest: +SKIP
    >>> wrapper.fit(train, epochs=3).output(x)  # doctest: +SKIP
    """

    def __init__(self, network: Network, master=None, devices=None, *, progress: bool = True,
                 eval_batch_size: int = 64, sharing_encoder: str = "auto"):
        if not isinstance(network, Network):
            raise TypeError(f"network must be a dlspark.Network, got {type(network).__name__}")
        if master is None:
            master = ParameterAveraging()
        if not isinstance(master, (ParameterAveraging, GradientSharing)):
            what = type(master).__name__
            if isinstance(master, Algorithm):
                raise NotImplementedError(f"ParallelWrapper runs ParameterAveraging and GradientSharing; {what} "
                                          "runs on a DistributedTrainer")
            raise TypeError(f"master must be dlspark.ParameterAveraging(...) or dlspark.GradientSharing(...), "
                            f"got {what}")
        positive_int("eval_batch_size", eval_batch_size)
        self.network, self.master, self.progress, self.eval_batch_size = network, master, progress, eval_batch_size
        self.devices = resolve_devices(devices)
        self.sharing_encoder = resolve_encoder(sharing_encoder, self.devices)
        self.mesh = Mesh(np.array(self.devices), (AXIS,))
        self.loss_history: list = []
        self.training_stats: list = []
        self.last_fit_stats: list = []
        self.algorithm_state: dict = {}
        self.published: dict = {}
        self._functions: dict = {}
        self._masks: dict = {}  # contributors -> which devices contribute, on the devices

    def __getattr__(self, name):
        values = self.__dict__.get("algorithm_state", {})
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

    def _function(self, kind):
        if kind not in self._functions:
            self._functions[kind] = (_step_function(self.network, self.master, self.mesh, *kind[1:])
                                     if isinstance(kind, tuple) else
                                     _round_function(self.network, self.master, self.mesh, kind))
        return self._functions[kind]

    def _replicate(self, state, saved_rngs):
        """The state on every device; each replica's RNG as the cluster's worker of that rank
        derives it (a checkpoint's saved stream for its position, else a fold of rank 0's)."""
        host = jax.tree_util.tree_map(np.asarray, state)
        rngs = []
        for r in range(len(self.devices)):
            if saved_rngs and r < len(saved_rngs):
                rngs.append(np.asarray(saved_rngs[r], dtype=host.rng.dtype))
            else:
                rngs.append(np.asarray(jax.random.fold_in(state.rng, r)) if r else host.rng)
        stacked = jax.tree_util.tree_map(lambda x: np.stack([x] * len(self.devices)), host.replace(rng=None))
        stacked = stacked.replace(rng=np.stack(rngs))
        tx = self.master.outer_updater
        carried = self.algorithm_state.get("outer_state")
        outer = () if tx is None else jax.tree_util.tree_map(
            lambda x: np.stack([np.asarray(x)] * len(self.devices)), tx.init(state.params) if carried is None else carried)
        sharding = NamedSharding(self.mesh, P(AXIS))
        return jax.device_put(stacked, sharding), jax.device_put(outer, sharding)

    def _replica(self, tree, r=0):
        """Replica ``r`` of a stacked tree, on the host."""
        return jax.tree_util.tree_map(lambda x: np.asarray(_by_device(x)[self.devices[r]])[0], tree)

    def _run(self, refs, partitions, epochs, loader, storage_options, checkpoint_every, checkpoint_url,
             resume_from, callbacks, progress):
        net, master = self.network, self.master
        # checkpoints and resumes take the data's fsspec options, as on a cluster
        self._checkpoint_options = dict(storage_options or {})
        if isinstance(master, GradientSharing):
            return self._run_sharing(refs, epochs, loader, storage_options, checkpoint_every, checkpoint_url,
                                     resume_from, callbacks, progress)
        skip, saved_rngs, epochs_done, epochs_total = (), None, 0, epochs
        if resume_from is not None:  # the cluster's resume: the same checks, meta and state
            epochs, skip, saved_rngs, epochs_done, self.algorithm_state = _resume(
                self, resume_from, epochs, len(refs), self._checkpoint_options)
            if epochs <= 0:  # the checkpoint's fit was finished: nothing to train
                self.last_fit_stats = []
                return net
        base_step, base_epoch = net.iteration, net.epoch
        state, outer = self._replicate(net.state, saved_rngs)
        k = master.averaging_frequency
        depth = master.worker_prefetch_num_batches and max(master.worker_prefetch_num_batches, k)
        rounds = _Rounds(self, refs, partitions, epochs, skip, loader, storage_options, math.ceil(depth / k))
        bar = _progress_bar(self.progress if progress is None else progress, epochs * len(refs) - len(skip))
        leaves = jax.tree_util.tree_leaves(net.state)
        sizes = (sum(x.nbytes for x in leaves), sum(x.nbytes for x in leaves if is_averaged(x)))
        stats, pending, last = [], None, [time.perf_counter(), 0.0]

        def settle(p):
            """Read a round's losses back (one host sync) and account for it."""
            item, losses, oks, t_call = p
            rows = zip(*(np.asarray(a) if hasattr(a, "shape") else a for a in (losses, oks)))  # [replica][step]
            flat = [(float(x), bool(ok)) for row_l, row_o in rows for x, ok in zip(row_l, row_o)]
            done_before = stats[-1]["trained_total"] if stats else 0
            for j, (x, ok) in enumerate(flat):
                if not ok:  # "raise": the network keeps its state from before the fit, as with the cluster
                    net.nonfinite(base_step + done_before + j, x)
            stat = self._round_stats(item, [x for x, ok in flat if ok], time.perf_counter() - last[0],
                                     time.perf_counter() - t_call, rounds.wait - last[1], sizes)
            last[:] = [time.perf_counter(), rounds.wait]
            stats.append(stat)
            if bar is not None:
                bar.update(stat["minibatches"])
                if stat["loss"] is not None:
                    bar.set_postfix(loss=f"{stat['loss']:.4g}",
                                    ex_s=f"{stat['examples'] / max(stat['round_time'], 1e-9):.0f}", refresh=False)
            for cb in callbacks:
                cb(stat)

        try:
            for item in rounds:
                if pending is not None and not item["regular"]:  # this one blocks: settle the last first
                    settle(pending)
                    pending = None
                plan, t_call = item["plan"], time.perf_counter()
                state, outer, losses, oks = self._round(state, outer, item, base_epoch + plan.epoch)
                # The next round is queued on the devices before this one's losses are read back.
                if pending is not None:
                    settle(pending)
                pending = (item, losses, oks, t_call)
                if checkpoint_every and plan.round % checkpoint_every == 0:
                    settle(pending)
                    pending = None
                    prog = dict(item["progress"], epoch=epochs_done + item["progress"]["epoch"],
                                epochs_total=epochs_total)
                    self._checkpoint(checkpoint_url, state, outer, base_step + item["trained_total"],
                                     base_epoch + item["epoch_after"], prog)
            if pending is not None:
                settle(pending)
        finally:
            rounds.close()
            if bar is not None:
                bar.close()
        trained = stats[-1]["trained_total"] if stats else 0
        net.state = jax.tree_util.tree_map(jnp.asarray, self._replica(state).replace(
            step=np.int32(base_step + trained), epoch=np.int32(base_epoch + epochs)))
        carried = None if master.outer_updater is None else self._replica(outer)
        self.algorithm_state = master.after_fit(self.algorithm_state, None, carried, self.published)
        self.loss_history.extend((s["round"], base_epoch + s["epoch"], s["loss"]) for s in stats)
        if master.collect_training_stats:
            self.training_stats.extend(stats)
        self.last_fit_stats = stats
        return net

    def _run_sharing(self, refs, epochs, loader, storage_options, checkpoint_every, checkpoint_url, resume_from,
                     callbacks, progress):
        from ._parallel_sharing import run_sharing

        resumed = None
        if resume_from is not None:  # the cluster's resume: the same checks, meta and thresholds
            total = epochs
            epochs, skip, saved_rngs, epochs_done, self.algorithm_state = _resume(
                self, resume_from, epochs, len(refs), self._checkpoint_options)
            if epochs <= 0:
                self.last_fit_stats = []
                return self.network
            resumed = (skip, saved_rngs, epochs_done, total)
        bar = _progress_bar(self.progress if progress is None else progress,
                            epochs * len(refs) - len(resumed[0] if resumed else ()))
        try:
            stats = run_sharing(self, refs, epochs, loader, storage_options, callbacks, bar, self.sharing_encoder,
                                resumed=resumed, checkpoint_every=checkpoint_every, checkpoint_url=checkpoint_url,
                                checkpoint_options=self._checkpoint_options)
        finally:
            if bar is not None:
                bar.close()
        base_epoch = self.network.epoch - epochs
        self.loss_history.extend((s["round"], base_epoch + s["epoch"], s["loss"]) for s in stats)
        if self.master.collect_training_stats:
            self.training_stats.extend(stats)
        self.last_fit_stats = stats
        return self.network

    def _round(self, state, outer, item, epoch):
        """Dispatch one round; returns ``(state, outer state, losses, applied)``, still on the devices."""
        contributors = tuple(item["plan"].contributors)
        if contributors not in self._masks:
            mask = np.array([r in contributors for r in range(len(self.devices))])
            self._masks[contributors] = jax.device_put(mask, NamedSharding(self.mesh, P(AXIS)))
        args = (np.int32(epoch), self._masks[contributors], np.float32(len(contributors)))
        if item["regular"] and self.master.fused_steps:
            return self._function(True)(state, outer, item["batches"], (), *args)
        if item["regular"]:
            return self._stepwise(state, outer, item["batches"], *args)
        return self._irregular(state, outer, item["batches"], *args)

    def _stepwise(self, state, outer, batches, epoch, mask, n):
        """A round with ``fused_steps=False``: one call per step on every device, then one call
        averages. On XLA's CPU backend this keeps a convolutional step as fast as a plain one;
        fused, it is slower. The steps donate the state, except the round's first when an outer
        optimizer needs the round-start parameters."""
        keep_start = self.master.outer_updater is not None
        start, losses, oks = (state.params if keep_start else ()), [], []
        for j, batch in enumerate(batches):
            state, loss, ok = self._function(("step", j == 0, j > 0 or not keep_start))(state, batch, epoch)
            losses.append(loss), oks.append(ok)
        state, outer, _, _ = self._function(False)(state, outer, (), start, epoch, mask, n)
        return state, outer, jnp.stack(losses, 1), jnp.stack(oks, 1)

    def _round_stats(self, item, losses, round_time, call_time, wait, sizes):
        """A round's statistics, shaped as the cluster's where they apply."""
        plan, n = item["plan"], len(item["plan"].contributors)
        return {"event": "round", "round": plan.round, "epoch": plan.epoch, "minibatches": item["counted"],
                "examples": item["examples"], "loss": (sum(losses) / len(losses)) if losses else None,
                "workers": n, "round_time": round_time, "fit_time_max": call_time,
                "worker_fit_time": {r: call_time for r in plan.contributors}, "data_wait": wait,
                "trained_total": item["trained_total"], "attempts": 0, "avg_time": 0.0, "fetch_time": 0.0,
                "bytes_received": 0, "bytes_equivalent": _equivalent_bytes(*sizes, n, len(self.devices))}

    def _irregular(self, state, outer, batches, epoch, mask, n):
        """A round whose replicas fit different numbers or shapes of minibatches (an epoch's last):
        each replica steps on its own device, as a cluster worker does, then one compiled call
        averages."""
        net, master = self.network, self.master
        step = _policy_step(net)
        parts, losses, oks = [], [], []
        for r, dev in enumerate(self.devices):
            mine = jax.tree_util.tree_map(lambda x: _by_device(x)[dev], state)
            own = batches[r]
            if not own:
                parts.append(mine)
                losses.append([]), oks.append([])
                continue
            st = _first(mine)  # a copy: the step donates it, the round-start parameters stay
            if not master.save_updater:
                st = st.replace(opt_state=net.updater.init(st.params))
            st = st.replace(epoch=jax.device_put(epoch, dev))  # a host scalar: the step donates this copy
            # one step at a time: one compilation per device and shape serves every such round
            ls, ks = [], []
            for b in own:
                st, x, ok = step(st, b)
                ls.append(x), ks.append(ok)
            parts.append(_lead(st))
            losses.append(ls), oks.append(ks)  # read back later: the next device starts meanwhile
        sharding = NamedSharding(self.mesh, P(AXIS))
        fitted = jax.tree_util.tree_map(
            lambda *xs: jax.make_array_from_single_device_arrays((len(xs),) + xs[0].shape[1:], sharding, list(xs)),
            *parts)
        state, outer, _, _ = self._function(False)(fitted, outer, (), state.params, epoch, mask, n)
        return state, outer, losses, oks

    def _checkpoint(self, url, state, outer, step, epoch, progress):
        """Write what the cluster's first worker writes: rank 0's state, every replica's RNG."""
        rngs = [np.asarray(x).tolist() for x in np.asarray(state.rng)]
        aux = None if self.master.outer_updater is None else self._replica(outer)
        write_bytes(url, fit_checkpoint_bytes(self._replica(state), self.network, step=step, epoch=epoch,
                                              progress=progress, worker_rngs=rngs, aux=aux),
                    **self._checkpoint_options)

    # -- evaluation, inference, scoring (in this process, on the network's device) --------
    def _refs(self, data, batch_size, storage_options):
        if isinstance(data, str) or (isinstance(data, (list, tuple)) and data and all(isinstance(u, str) for u in data)):
            return list_minibatches(data, **(storage_options or {}))
        return _minibatches(data, batch_size)[0]

    def do_evaluation(self, data, batch_size: int | None = None, *evaluations, loader=None,
                      storage_options: dict | None = None):
        """Fill several evaluations in one pass over ``data`` (what ``fit`` or ``fit_paths`` take)."""
        _check_evaluations(evaluations)
        bs = batch_size or self.eval_batch_size
        for ref in self._refs(data, bs, storage_options):
            # multi-output networks are evaluated on their first output
            evaluate_dataset(self.network, load_ref(ref, loader, storage_options), evaluations, bs, output=0)
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
