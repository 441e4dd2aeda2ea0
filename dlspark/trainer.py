"""DistributedTrainer: fit a Network on a Dask cluster (DL4J's SparkDl4jMultiLayer)."""

from __future__ import annotations

import shutil
import tempfile
import uuid

import cloudpickle
import fsspec
import numpy as np

from . import _inference as _inf
from .checkpoint import read_checkpoint_meta, state_from_bytes, state_to_bytes
from .data import DataSet, MultiDataSet, as_dataset, list_minibatches, save_dataset
from .distributed._masters import GradientSharing, ParameterAveraging, _positive_int
from .distributed._thresholds import ThresholdState
from .distributed._scheduler import DlsparkSchedulerPlugin
from .distributed._worker import DlsparkWorkerPlugin
from .errors import CheckpointError, JobFailedError
from .io import url_join
from .network import Network

__all__ = ["DistributedTrainer"]


def _protocol(url):
    return fsspec.core.split_protocol(url)[0] or "file"


def _reject_memory(url, what):
    if _protocol(url) == "memory":
        raise ValueError(
            f"{what} {url!r} is on memory://, which lives inside one process and cannot be read by "
            "worker processes; use a local directory, a shared file system or an object store "
            "(file://, s3://, ...)"
        )


def _list_paths(paths, storage_options):
    """Minibatch file URLs for a glob, directory or list, refusing ``memory://``."""
    for p in [paths] if isinstance(paths, str) else list(paths):
        _reject_memory(str(p), "path")
    return list_minibatches(paths, **(storage_options or {}))


def _check_unique(keys, what):
    seen = set()
    for k in keys:
        if k in seen:
            raise ValueError(f"duplicate key {k!r} in {what}; keys must be unique")
        seen.add(k)


def _export_partition(parts, directory, batch_size, prefix):
    """Runs on a worker: cut one partition's examples into minibatch files."""
    parts = [as_dataset(p) for p in parts]
    if not parts:
        return []
    merged = type(parts[0]).merge(parts)
    return [save_dataset(b, url_join(directory, f"{prefix}_{i:06d}.npz")) for i, b in enumerate(merged.batches(batch_size))]


def _export_arrays(x, y, directory, batch_size, prefix):
    return _export_partition([DataSet(x, y)], directory, batch_size, prefix)


def _rebatch(parts, batch_size):
    parts = [as_dataset(p) for p in parts]
    return type(parts[0]).merge(parts).batches(batch_size) if parts else []


def _is_dask_collection(x):
    try:
        import dask

        return dask.is_dask_collection(x)
    except ImportError:  # pragma: no cover
        return False


class DistributedTrainer:
    """Train a :class:`~dlspark.Network` data-parallel on a Dask cluster.

    Parameters
    ----------
    client : distributed.Client, optional
        Without one, an embedded ``LocalCluster`` is started (one worker per
        GPU, else one single-threaded worker process per core, each pinned to
        its core) and closed with the trainer.
    network : Network
        The network to train; after ``fit`` it holds the trained state.
    master : ParameterAveraging, optional
        The distributed algorithm; needed for fit, not for inference.
    progress : bool
        Show a progress bar during fit.

    Examples
    --------
    >>> with DistributedTrainer(None, net, ParameterAveraging()) as trainer:  # doctest: +SKIP
    ...     trainer.fit(train_dataset, epochs=3)
    ...     trainer.network.output(x)
    """

    def __init__(self, client=None, network: Network | None = None, master=None, *, progress: bool = True,
                 eval_num_workers: int = 1, eval_batch_size: int = 64):
        if network is None or not isinstance(network, Network):
            raise TypeError(f"network must be a dlspark.Network, got {type(network).__name__}")
        if master is not None and not isinstance(master, (ParameterAveraging, GradientSharing)):
            raise TypeError(
                f"master must be dlspark.ParameterAveraging(...) or dlspark.GradientSharing(...), got {type(master).__name__}"
            )
        self._cluster = None
        pin = False
        if client is None:
            from distributed import Client

            from .cluster import local_cluster

            self._cluster = local_cluster()
            client = Client(self._cluster)
            pin = _cpu_only()
        _positive_int("eval_num_workers", eval_num_workers)
        _positive_int("eval_batch_size", eval_batch_size)
        self.eval_num_workers = eval_num_workers
        self.eval_batch_size = eval_batch_size
        self.client = client
        self.network = network
        self.master = master
        self.progress = progress
        #: ``(round, epoch, mean loss)`` of every completed round.
        self.loss_history: list = []
        #: Per-round statistics (timings, bytes moved), DL4J's training stats.
        self.training_stats: list = []
        self._temp_dirs: list = []
        #: Gradient sharing: the threshold state carried from one fit to the next (reduced over workers).
        self.threshold_state = None
        #: Gradient sharing: bytes sent between workers, and what dense fp32 updates would have sent.
        self.communication = {"bytes_sent": 0, "dense_bytes": 0}
        #: Gradient sharing: largest absolute difference between replicas' parameters at the end of the last fit.
        self.replica_divergence = None
        self._install_plugins(pin)

    # -- lifecycle -------------------------------------------------------------
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Delete temporary exports; close the embedded cluster if this trainer started it."""
        self.delete_temp_files()
        if self._cluster is not None:
            self.client.close()
            self._cluster.close()
            self._cluster = None

    def delete_temp_files(self):
        """Remove the minibatch files this trainer exported to temporary directories."""
        for d in self._temp_dirs:
            shutil.rmtree(d, ignore_errors=True)
        self._temp_dirs = []

    def _install_plugins(self, pin):
        have = self.client.run_on_scheduler(_plugins_installed)
        if not have["scheduler"]:
            self.client.register_plugin(DlsparkSchedulerPlugin())
        if not have["worker"]:
            n = len(self.client.scheduler_info()["workers"])
            self.client.register_plugin(DlsparkWorkerPlugin(pin_cores=pin, n_workers=n))

    def _workers(self):
        workers = sorted(self.client.scheduler_info()["workers"])
        if not workers:
            raise RuntimeError("the cluster has no workers; start some (e.g. cluster.scale(2)) and try again")
        return workers

    # -- data ------------------------------------------------------------------
    def _export_dir(self):
        base = self.master.export_directory
        if base is None:
            d = tempfile.mkdtemp(prefix="dlspark-export-")
            self._temp_dirs.append(d)
            return d
        _reject_memory(base, "export_directory")
        return url_join(base, uuid.uuid4().hex)

    def _refs_for(self, data):
        """Turn fit's input into minibatch references and their partitions."""
        bs = self.master.batch_size_per_worker
        if isinstance(data, tuple) and len(data) == 2 and all(_is_dask_collection(d) for d in data):
            return self._refs_dask_arrays(*data)
        if _is_dask_collection(data):
            return self._refs_bag(data)
        if isinstance(data, list):
            bad = [type(d).__name__ for d in data if not isinstance(d, (DataSet, MultiDataSet))]
            if bad or not data:
                raise TypeError(f"a list given to fit must hold DataSets, found {bad[0] if bad else 'nothing'}")
            batches = data
        else:
            try:
                batches = as_dataset(data).batches(bs)
            except TypeError:
                raise TypeError(
                    "fit takes a DataSet, a (features, labels) pair, a list of DataSets, a pair of dask "
                    f"arrays or a dask bag of DataSets; got {type(data).__name__}"
                ) from None
        if self.master.training_approach == "export":
            d = self._export_dir()
            refs = [save_dataset(b, url_join(d, f"batch_{i:06d}.npz")) for i, b in enumerate(batches)]
            return refs, [0] * len(refs), None
        futures = self.client.scatter(list(batches), hash=False)
        return self._direct_refs([(f, None) for f in futures], [0] * len(futures), futures)

    def _direct_refs(self, pairs, partitions, keep):
        if len(self._workers()) > 1:
            self.client.replicate(list({id(f): f for f, _ in pairs}.values()), n=2)
        return [(f.key, i) for f, i in pairs], partitions, keep

    def _refs_dask_arrays(self, x, y):
        import dask

        bs = self.master.batch_size_per_worker
        if x.numblocks[0] != y.numblocks[0] or x.chunks[0] != y.chunks[0]:
            y = y.rechunk({0: x.chunks[0]})
        xs, ys = x.to_delayed().ravel(), y.to_delayed().ravel()
        if self.master.training_approach == "export":
            d = self._export_dir()
            tasks = [dask.delayed(_export_arrays)(a, b, d, bs, f"p{i:05d}") for i, (a, b) in enumerate(zip(xs, ys))]
            return self._gather_exports(tasks)
        tasks = [dask.delayed(lambda a, b, n: DataSet(a, b).batches(n))(a, b, bs) for a, b in zip(xs, ys)]
        return self._persist_direct(tasks)

    def _refs_bag(self, bag):
        import dask

        bs = self.master.batch_size_per_worker
        parts = bag.to_delayed()
        if self.master.training_approach == "export":
            d = self._export_dir()
            return self._gather_exports([dask.delayed(_export_partition)(p, d, bs, f"p{i:05d}") for i, p in enumerate(parts)])
        return self._persist_direct([dask.delayed(_rebatch)(p, bs) for p in parts])

    def _gather_exports(self, tasks):
        per_part = self.client.gather(self.client.compute(tasks))
        refs = [u for urls in per_part for u in urls]
        parts = [i for i, urls in enumerate(per_part) for _ in urls]
        return refs, parts, None

    def _persist_direct(self, tasks):
        futures = self.client.compute(tasks)
        counts = self.client.gather(self.client.map(len, futures, pure=False))
        pairs = [(f, j) for f, c in zip(futures, counts) for j in range(c)]
        parts = [i for i, c in enumerate(counts) for _ in range(c)]
        return self._direct_refs(pairs, parts, futures)

    # -- training --------------------------------------------------------------
    def fit(self, data, epochs: int = 1, *, checkpoint_every: int | None = None, checkpoint_url: str | None = None,
            resume_from: str | None = None, callbacks=(), progress: bool | None = None) -> Network:
        """Train on ``data``: a DataSet, a ``(features, labels)`` pair, a list of DataSets,
        a pair of dask arrays, or a dask bag of DataSets.

        Parameters
        ----------
        epochs : int
        checkpoint_every : int, optional
            Write a checkpoint to ``checkpoint_url`` every this many rounds.
        resume_from : str, optional
            A checkpoint written by a previous ``fit`` with the same data and
            ``epochs``: training continues where it stopped.
        callbacks : sequence of callables
            Each is called with every round's statistics (a dict) as it completes.

        Returns
        -------
        Network
            ``self.network``, trained.
        """
        self._check_fit_args(epochs, checkpoint_every, checkpoint_url)
        refs, partitions, keep = self._refs_for(data)
        try:
            return self._run(refs, partitions, epochs, None, None, checkpoint_every, checkpoint_url, resume_from,
                             callbacks, progress)
        finally:
            del keep

    def fit_paths(self, paths, epochs: int = 1, loader=None, *, storage_options: dict | None = None,
                  checkpoint_every: int | None = None, checkpoint_url: str | None = None,
                  resume_from: str | None = None, callbacks=(), progress: bool | None = None) -> Network:
        """Train from minibatch files (DL4J's ``fitPaths``).

        Parameters
        ----------
        paths : str or list of str
            A glob, a directory URL or a list of file URLs on any fsspec
            file system the workers can reach (not ``memory://``).
        loader : callable, optional
            ``url -> DataSet/MultiDataSet`` for files in another format
            (DL4J's DataSetLoader); default: the ``.npz`` minibatch format.
        storage_options : dict, optional
            fsspec options (credentials, endpoint) used on the client and workers.
        """
        self._check_fit_args(epochs, checkpoint_every, checkpoint_url)
        refs = _list_paths(paths, storage_options)
        if loader is not None and not callable(loader):
            raise TypeError(f"loader must be a callable url -> DataSet, got {type(loader).__name__}")
        return self._run(refs, [0] * len(refs), epochs, loader, storage_options, checkpoint_every, checkpoint_url,
                         resume_from, callbacks, progress)

    def _check_fit_args(self, epochs, checkpoint_every, checkpoint_url):
        if self.master is None:
            raise ValueError("this trainer has no master; pass one, e.g. DistributedTrainer(client, net, ParameterAveraging())")
        _positive_int("epochs", epochs)
        if checkpoint_every is not None:
            _positive_int("checkpoint_every", checkpoint_every)
            if not checkpoint_url:
                raise ValueError("checkpoint_every needs checkpoint_url, e.g. fit(data, checkpoint_every=10, checkpoint_url='s3://b/ck.dls')")
            _reject_memory(checkpoint_url, "checkpoint_url")

    def _resume(self, url, epochs):
        # Everything is checked before the network takes the checkpoint's state: a refused
        # resume leaves the network as it was.
        meta = read_checkpoint_meta(url)
        prog = meta.get("fit_progress")
        if prog is not None and prog.get("epochs_total") != epochs:
            raise CheckpointError(url, f"was written by a fit of {prog.get('epochs_total')} epochs; resume with epochs={prog.get('epochs_total')}")
        rngs = meta.get("worker_rngs") or []
        want = np.shape(np.asarray(self.network.state.rng))
        if any(np.shape(r) != want for r in rngs):
            raise CheckpointError(url, f"holds worker RNG keys of shape {np.shape(rngs[0])}, this network's are "
                                       f"{want}: resume with the PRNG implementation that wrote it")
        self.network.restore(url)
        if prog is None:
            return epochs, (), None, 0
        saved = meta.get("threshold_states") or {}
        if (self.master.algorithm == "sharing" and saved.get("states")
                and saved.get("algorithm") == repr(self.master.threshold_algorithm)):
            # Gradient sharing goes on from the threshold the workers had reached (with
            # the same threshold algorithm; a new one starts from its own initial value).
            states = [ThresholdState(*(float("nan") if x is None else x for x in st)) for st in saved["states"]]
            self.threshold_state = self.master.threshold_algorithm.reduce(states)
        # The fit goes on where the checkpoint stands: ``prog["epoch"]`` of ``epochs``
        # done, and ``done`` minibatches of the next one.
        return epochs - prog["epoch"], prog["done"], rngs, prog["epoch"]

    def _job_spec(self, refs, loader=None, storage_options=None, worker_rngs=None) -> bytes:
        """What every worker of a job is set up from (pickled once, for joiners too)."""
        net = self.network
        return cloudpickle.dumps({"definition": net.definition(), "network_token": net.token,
                                  "master": self.master, "refs": refs,
                                  "loader": loader, "storage_options": storage_options,
                                  "threshold_state": self.threshold_state, "worker_rngs": worker_rngs})

    def _run(self, refs, partitions, epochs, loader, storage_options, checkpoint_every, checkpoint_url, resume_from,
             callbacks, progress):
        skip, worker_rngs, epochs_done = (), None, 0
        epochs_total = epochs
        if resume_from is not None:
            epochs, skip, worker_rngs, epochs_done = self._resume(resume_from, epochs)
            if epochs <= 0:
                return self.network
        net, client = self.network, self.client
        workers = self._workers()
        job = uuid.uuid4().hex[:12]
        spec = self._job_spec(refs, loader, storage_options, worker_rngs)
        state = state_to_bytes(net.state)
        base_step, base_epoch = net.iteration, net.epoch
        options = {"algorithm": self.master.algorithm, "mesh": getattr(self.master, "mesh", None),
                   "tree_fanout": getattr(self.master, "tree_fanout", None),
                   "steps_per_round": self.master.steps_per_round, "repartition": self.master.repartition,
                   "repartition_strategy": self.master.repartition_strategy, "skip": list(skip),
                   "base_epoch": base_epoch, "base_step": base_step,
                   # A checkpoint speaks of the whole fit, a resumed one included: a
                   # checkpoint written after a resume can be resumed from in turn.
                   "epochs_total": epochs_total, "epochs_done": epochs_done,
                   "checkpoint_every": checkpoint_every, "checkpoint_url": checkpoint_url,
                   "threshold_algorithm": repr(getattr(self.master, "threshold_algorithm", None))}
        bar = self._progress_bar(progress, epochs * len(refs) - len(skip))

        def on_event(event):
            _, msg = event
            if msg.get("event") != "round":
                return
            if bar is not None:
                bar.update(msg["minibatches"])
                if msg["loss"] is not None:
                    bar.set_postfix(loss=f"{msg['loss']:.4g}", ex_s=f"{msg['examples'] / max(msg['round_time'], 1e-9):.0f}",
                                    refresh=False)
            for cb in callbacks:
                cb(msg)

        topic = f"dlspark-{job}"
        client.subscribe_topic(topic, on_event)
        try:
            client.sync(_setup_workers, client, workers, job, spec, state)
            client.sync(client.scheduler.dlspark_start, job=job, workers=workers, spec=spec,
                        partitions=partitions, epochs=epochs, options=options, client=client.id)
            result = client.sync(client.scheduler.dlspark_wait, job=job)
            if result["status"] != "OK":
                raise cloudpickle.loads(result["error"])
            source, final = client.sync(_fetch_state_from_any, client, result["workers"], job,
                                        base_step + result["trained"], base_epoch + epochs)
            net.state = state_from_bytes(final, net.state)
            result["workers"] = [source] + [w for w in result["workers"] if w != source]
            if self.master.algorithm == "sharing":
                self._after_sharing(result, job, net)
            for s in result["stats"]:
                self.loss_history.append((s["round"], base_epoch + s["epoch"], s["loss"]))
            if self.master.collect_training_stats:
                self.training_stats.extend(result["stats"])
            self.last_fit_stats = result["stats"]
        finally:
            client.unsubscribe_topic(topic)
            try:
                client.sync(client.scheduler.dlspark_finish, job=job)
            except Exception:  # the cluster is going away; nothing left to clean
                pass
            if bar is not None:
                bar.close()
        return net

    def _after_sharing(self, result, job, net):
        algo = self.master.threshold_algorithm
        states = [ThresholdState(*s) for s in result["threshold_states"]]
        if states:
            self.threshold_state = algo.reduce(states)
        for s in result["stats"]:
            self.communication["bytes_sent"] += s.get("bytes_sent", 0)
            self.communication["dense_bytes"] += s.get("dense_bytes", 0)
        # Every replica applied the same messages; they differ only by the order
        # of float additions. The trainer keeps the first worker's state.
        import jax

        ref = jax.tree_util.tree_leaves(net.state.params)
        worst = 0.0
        for w in result["workers"][1:]:
            try:
                other = state_from_bytes(self.client.sync(_fetch_state, self.client, w, job, None, None), net.state)
            except Exception:  # lost since the job ended: it has nothing left to compare
                continue
            for a, b in zip(ref, jax.tree_util.tree_leaves(other.params)):
                worst = max(worst, float(np.max(np.abs(np.asarray(a) - np.asarray(b)))))
        self.replica_divergence = worst

    # -- evaluation and inference ------------------------------------------------
    def _network_future(self):
        """The network as workers rebuild it, scattered once per state: the train state is an
        immutable pytree replaced by every fit or restore, so its identity names the version,
        and workers compile once per version, not once per call."""
        cached = getattr(self, "_net_cache", None)
        if cached is not None and cached[0] is self.network.state and cached[1] is self.network:
            return cached[2]
        token = uuid.uuid4().hex
        future = self.client.scatter(_inf.network_blob(self.network, token), broadcast=True, hash=False)
        self._net_cache = (self.network.state, self.network, future)
        return future

    def _eval_parts(self, data, loader, storage_options):
        """Split evaluation input into parts: ``(kind, payload)`` with kind "refs" or "delayed"."""
        n_parts = max(1, 2 * len(self._workers()))
        if isinstance(data, str) or (isinstance(data, list) and data and all(isinstance(d, str) for d in data)):
            refs = _list_paths(data, storage_options)
            return "refs", [refs[i::n_parts] for i in range(min(n_parts, len(refs)))]
        if isinstance(data, tuple) and len(data) == 2 and all(_is_dask_collection(d) for d in data):
            import dask

            x, y = data
            if x.chunks[0] != y.chunks[0]:
                y = y.rechunk({0: x.chunks[0]})
            return "delayed", [[dask.delayed(DataSet)(a, b)] for a, b in zip(x.to_delayed().ravel(), y.to_delayed().ravel())]
        if _is_dask_collection(data):
            return "delayed", list(data.to_delayed())
        if isinstance(data, list):
            if not data or not all(isinstance(d, (DataSet, MultiDataSet)) for d in data):
                raise TypeError("a list given for evaluation must hold DataSets or file URLs")
            items = data
        else:
            ds = as_dataset(data, "data")
            step = max(1, -(-len(ds) // n_parts))
            items = [ds[i:i + step] for i in range(0, len(ds), step)]
        parts = [items[i::n_parts] for i in range(min(n_parts, len(items)))]
        return "refs", [self.client.scatter(p, hash=False) for p in parts]

    def do_evaluation(self, data, batch_size: int | None = None, *evaluations, loader=None,
                      storage_options: dict | None = None):
        """Fill several evaluations in one pass over ``data`` (each minibatch is read once).

        ``data`` is what ``fit`` or ``fit_paths`` take. Each worker evaluates
        its share; the partial evaluations are merged by a tree reduction on
        the workers. Returns the filled evaluations, in order.
        """
        from .evaluation import BaseEvaluation

        if not evaluations:
            raise TypeError("do_evaluation needs at least one evaluation, e.g. do_evaluation(data, 64, Evaluation())")
        bad = [type(e).__name__ for e in evaluations if not isinstance(e, BaseEvaluation)]
        if bad:
            raise TypeError(f"evaluations must be dlspark.evaluation objects, got {bad[0]}")
        bs = batch_size or self.eval_batch_size
        kind, parts = self._eval_parts(data, loader, storage_options)
        net = self._network_future()
        client = self.client
        if kind == "refs":
            futures = [client.submit(_inf.evaluate_part, net, p, list(evaluations), bs, loader, storage_options,
                                     self.eval_num_workers, pure=False) for p in parts]
        else:
            import dask

            futures = client.compute([dask.delayed(_inf.evaluate_part)(net, p, list(evaluations), bs, loader,
                                                                        storage_options, self.eval_num_workers)
                                      for p in parts])
        while len(futures) > 1:
            futures = [client.submit(_inf.merge_evaluations, futures[i], futures[i + 1], pure=False)
                       if i + 1 < len(futures) else futures[i] for i in range(0, len(futures), 2)]
        merged = futures[0].result()
        for target, result in zip(evaluations, merged):
            target.__dict__.update(result.__dict__)
        return list(evaluations)

    def evaluate(self, data, batch_size: int | None = None, **kw):
        """Classification :class:`~dlspark.evaluation.Evaluation` over ``data`` (distributed)."""
        from .evaluation import Evaluation

        return self.do_evaluation(data, batch_size, Evaluation(), **kw)[0]

    def evaluate_roc(self, data, threshold_steps: int = 0, batch_size: int | None = None, **kw):
        from .evaluation import ROC

        return self.do_evaluation(data, batch_size, ROC(threshold_steps), **kw)[0]

    def evaluate_roc_multiclass(self, data, threshold_steps: int = 0, batch_size: int | None = None, **kw):
        from .evaluation import ROCMultiClass

        return self.do_evaluation(data, batch_size, ROCMultiClass(threshold_steps), **kw)[0]

    def evaluate_regression(self, data, batch_size: int | None = None, **kw):
        from .evaluation import RegressionEvaluation

        return self.do_evaluation(data, batch_size, RegressionEvaluation(), **kw)[0]

    def predict_with_keys(self, keyed_features, batch_size: int = 64, features_mask=None):
        """Keyed inference (DL4J's ``feedForwardWithKey``).

        ``keyed_features`` is a dict, a list of ``(key, array)`` pairs, or a
        dask bag of pairs; the result is the same kind, keyed outputs (a tuple
        per key for multi-output networks). Keys never enter the computation;
        examples are stacked into batches of ``batch_size`` on the workers.
        ``features_mask`` maps keys to per-example masks.
        """
        client = self.client
        net = self._network_future()
        if _is_dask_collection(keyed_features):
            import dask.bag as db

            return db.from_delayed([
                __import__("dask").delayed(_inf.predict_part)(net, part, batch_size)
                for part in keyed_features.to_delayed()])
        if isinstance(keyed_features, dict):
            items, as_dict = list(keyed_features.items()), True
        elif isinstance(keyed_features, list):
            items, as_dict = keyed_features, False
            _check_unique([k for k, _ in items], "keyed features")
        else:
            raise TypeError(f"keyed features must be a dict, a list of (key, array) pairs or a dask bag, got {type(keyed_features).__name__}")
        if not items:
            return {} if as_dict else []
        workers = self._workers()
        # Keys stay here; workers get stacked blocks of examples and return blocks of
        # outputs (no per-example Python objects on the wire). Blocks go out as soon as
        # they are stacked, round robin, so workers compute while the rest is stacked.
        step = -(-len(items) // max(1, 4 * len(workers)))
        chunks = [items[i:i + step] for i in range(0, len(items), step)]
        futures = []
        for i, c in enumerate(chunks):
            block = _inf.stack_examples([f for _, f in c])
            mask = None if features_mask is None else np.stack([np.asarray(features_mask[k]) for k, _ in c])
            where = [workers[i % len(workers)]]
            [data] = client.scatter([block], workers=where, hash=False)
            futures.append(client.submit(_inf.predict_stacked, net, data, batch_size, mask, workers=where,
                                         allow_other_workers=True, pure=False))
        out = [pair for c, o in zip(chunks, client.gather(futures)) for pair in _inf.unstack_outputs([k for k, _ in c], o)]
        return dict(out) if as_dict else out

    def score_examples(self, data, include_regularization: bool = False, batch_size: int | None = None):
        """Per-example loss (DL4J's ``scoreExamples``).

        ``data`` is a DataSet (returns an array in example order) or keyed
        examples: a dict or list of ``(key, DataSet)`` pairs (returns the same
        kind, keyed). dlspark networks carry no separate regularization terms
        (weight decay lives in the optax updater), so ``include_regularization``
        changes nothing.
        """
        bs = batch_size or self.eval_batch_size
        if isinstance(data, dict) or (isinstance(data, list) and data and isinstance(data[0], tuple)
                                       and not isinstance(data[0][1], (np.ndarray,))):
            items = list(data.items()) if isinstance(data, dict) else list(data)
            keys = [k for k, _ in items]
            _check_unique(keys, "keyed examples")
            parts = [as_dataset(d) for _, d in items]
            merged = type(parts[0]).merge(parts)
            sizes = [len(d) for d in parts]
            losses = self.score_examples(merged, include_regularization, bs)
            bounds = np.cumsum([0] + sizes)
            vals = [losses[a:b] if b - a > 1 else float(losses[a]) for a, b in zip(bounds[:-1], bounds[1:])]
            return dict(zip(keys, vals)) if isinstance(data, dict) else list(zip(keys, vals))
        if isinstance(data, list) and data and all(isinstance(d, (DataSet, MultiDataSet)) for d in data):
            ds = type(data[0]).merge(data)
        else:
            ds = as_dataset(data, "score_examples' data")
        net = self._network_future()
        # contiguous parts, so that concatenation keeps example order
        n_parts = max(1, 2 * len(self._workers()))
        step = max(1, -(-len(ds) // n_parts))
        pieces = self.client.scatter([[ds[i:i + step]] for i in range(0, len(ds), step)], hash=False)
        futures = [self.client.submit(_inf.score_part, net, p, bs, pure=False) for p in pieces]
        return np.concatenate(self.client.gather(futures))

    def calculate_score(self, data, average: bool = True, batch_size: int | None = None) -> float:
        """Total (or, with ``average``, mean per example) loss over ``data`` (DL4J's ``calculateScore``)."""
        losses = self.score_examples(data, batch_size=batch_size)
        return float(losses.mean() if average else losses.sum())

    def _progress_bar(self, progress, total):
        show = self.progress if progress is None else progress
        if not show:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, unit="batch", desc="dlspark fit")


def _checked(resp):
    if isinstance(resp, dict) and resp.get("status") == "dlspark-error":
        raise cloudpickle.loads(resp["error"])
    return resp


async def _setup_workers(client, workers, job, spec, state):
    import asyncio

    for r in await asyncio.gather(*[client.rpc(w).dlspark_setup(job=job, spec=spec, state=state, rank=i)
                                    for i, w in enumerate(workers)]):
        _checked(r)


async def _fetch_state(client, worker, job, step, epoch):
    return _checked(await client.rpc(worker).dlspark_state(job=job, step=step, epoch=epoch))["state"]


async def _fetch_state_from_any(client, workers, job, step, epoch):
    """``(worker, state)`` from the first of ``workers`` that sends its state: every replica
    holds the trained state at the end of a job (bit for bit with averaging, to float
    tolerance with gradient sharing), so a worker lost just after the job ended costs nothing."""
    errors = []
    for worker in workers:
        try:
            return worker, await _fetch_state(client, worker, job, step, epoch)
        except Exception as e:
            errors.append(f"{worker}: {type(e).__name__}: {e}")
    raise JobFailedError(f"job {job} finished, but no worker could send its state: {'; '.join(errors)}")


def _plugins_installed(dask_scheduler=None):
    return {"scheduler": DlsparkSchedulerPlugin.name in dask_scheduler.plugins,
            "worker": DlsparkWorkerPlugin.name in dask_scheduler.worker_plugins}


def _cpu_only():
    from .cluster import gpu_devices

    return not gpu_devices()[1]
