"""DistributedTrainer: fit a Network on a Dask cluster (DL4J's SparkDl4jMultiLayer)."""

from __future__ import annotations

import shutil
import tempfile
import uuid

from . import _inference as _inf
from .data._sources import SourceContext, fit_minibatches, path_minibatches, reject_memory
from .algorithms._base import Algorithm, positive_int
from .distributed._client import run_fit
from .distributed._scheduler import DlsparkSchedulerPlugin
from .distributed._worker import DlsparkWorkerPlugin
from .io import url_join
from .network import Network

__all__ = ["DistributedTrainer"]


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
        if master is not None and not isinstance(master, Algorithm):
            raise TypeError("master must be a training master such as dlspark.ParameterAveraging(...) or "
                            f"dlspark.GradientSharing(...), got {type(master).__name__}")
        self._cluster = None
        pin = False
        if client is None:
            from distributed import Client

            from .cluster import local_cluster

            self._cluster = local_cluster()
            client = Client(self._cluster)
            pin = _cpu_only()
        positive_int("eval_num_workers", eval_num_workers)
        positive_int("eval_batch_size", eval_batch_size)
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
        #: What the algorithm carries from one fit to the next (and saves in checkpoints):
        #: gradient sharing's ``threshold_state``, the outer optimizer's ``outer_state``.
        self.algorithm_state: dict = {}
        #: The algorithm's running figures, read as attributes too: gradient sharing's
        #: ``communication`` (bytes sent, and what dense fp32 updates would have sent) and
        #: ``replica_divergence`` (largest difference between replicas at the end of a fit).
        self.published: dict = {}
        self.last_fit_stats: list = []
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
        reject_memory(base, "export_directory")
        return url_join(base, uuid.uuid4().hex)

    def _refs_for(self, data):
        """Turn fit's input into minibatch references, their partitions, and futures to keep alive."""
        m = fit_minibatches(data, SourceContext(self.client, self.master.batch_size_per_worker,
                                                self.master.training_approach, self._export_dir))
        return m.refs, m.partitions, m.keep

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
        refs = path_minibatches(paths, storage_options)
        if loader is not None and not callable(loader):
            raise TypeError(f"loader must be a callable url -> DataSet, got {type(loader).__name__}")
        return self._run(refs, [0] * len(refs), epochs, loader, storage_options, checkpoint_every, checkpoint_url,
                         resume_from, callbacks, progress)

    def _check_fit_args(self, epochs, checkpoint_every, checkpoint_url):
        if self.master is None:
            raise ValueError("this trainer has no master; pass one, e.g. DistributedTrainer(client, net, ParameterAveraging())")
        positive_int("epochs", epochs)
        if checkpoint_every is not None:
            positive_int("checkpoint_every", checkpoint_every)
            if not checkpoint_url:
                raise ValueError("checkpoint_every needs checkpoint_url, e.g. fit(data, checkpoint_every=10, checkpoint_url='s3://b/ck.dls')")
            reject_memory(checkpoint_url, "checkpoint_url")

    def _run(self, refs, partitions, epochs, loader, storage_options, checkpoint_every, checkpoint_url, resume_from,
             callbacks, progress):
        return run_fit(self, refs, partitions, epochs, loader=loader, storage_options=storage_options,
                       checkpoint_every=checkpoint_every, checkpoint_url=checkpoint_url, resume_from=resume_from,
                       callbacks=callbacks, progress=progress)

    def __getattr__(self, name):
        # What the algorithm carries or publishes reads as an attribute (gradient sharing:
        # ``threshold_state``, ``communication``, ``replica_divergence``).
        for store in ("algorithm_state", "published"):
            values = self.__dict__.get(store, {})
            if name in values:
                return values[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _network_future(self):
        """The network as workers rebuild it, scattered once per state: the train state is an
        immutable pytree replaced by every fit or restore, so its identity names the version,
        and workers compile once per version, not once per call."""
        cached = getattr(self, "_net_cache", None)
        if cached is not None and cached[0] is self.network.state and cached[1] is self.network:
            return cached[2]
        future = _inf.scatter_network(self.client, self.network)
        self._net_cache = (self.network.state, self.network, future)
        return future

    def do_evaluation(self, data, batch_size: int | None = None, *evaluations, loader=None,
                      storage_options: dict | None = None):
        """Fill several evaluations in one pass over ``data`` (each minibatch is read once).

        ``data`` is what ``fit`` or ``fit_paths`` take. Each worker evaluates
        its share; the partial evaluations are merged by a tree reduction on
        the workers. Returns the filled evaluations, in order.
        """
        return _inf.do_evaluation(self.client, self._network_future(), data, evaluations,
                                  batch_size or self.eval_batch_size, loader=loader, storage_options=storage_options,
                                  threads=self.eval_num_workers, n_workers=len(self._workers()))

    def evaluate(self, data, batch_size: int | None = None, **kw):
        """Classification :class:`~dlspark.evaluation.Evaluation` over ``data`` (distributed)."""
        from .evaluation import Evaluation

        return self.do_evaluation(data, batch_size, Evaluation(), **kw)[0]

    def evaluate_roc(self, data, threshold_steps: int = 0, batch_size: int | None = None, **kw):
        """Binary :class:`~dlspark.evaluation.ROC` over ``data`` (distributed)."""
        from .evaluation import ROC

        return self.do_evaluation(data, batch_size, ROC(threshold_steps), **kw)[0]

    def evaluate_roc_multiclass(self, data, threshold_steps: int = 0, batch_size: int | None = None, **kw):
        """One-vs-all :class:`~dlspark.evaluation.ROCMultiClass` over ``data`` (distributed)."""
        from .evaluation import ROCMultiClass

        return self.do_evaluation(data, batch_size, ROCMultiClass(threshold_steps), **kw)[0]

    def evaluate_regression(self, data, batch_size: int | None = None, **kw):
        """:class:`~dlspark.evaluation.RegressionEvaluation` over ``data`` (distributed)."""
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
        return _inf.predict_with_keys(self.client, self._network_future(), keyed_features, batch_size,
                                      features_mask, self._workers())

    def score_examples(self, data, include_regularization: bool = False, batch_size: int | None = None):
        """Per-example loss (DL4J's ``scoreExamples``).

        ``data`` is a DataSet (returns an array in example order) or keyed
        examples: a dict or list of ``(key, DataSet)`` pairs (returns the same
        kind, keyed). dlspark networks carry no separate regularization terms
        (weight decay lives in the optax updater), so ``include_regularization``
        changes nothing.
        """
        return _inf.score_examples(self.client, self._network_future(), data, batch_size or self.eval_batch_size,
                                   len(self._workers()))

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


def _plugins_installed(dask_scheduler=None):
    return {"scheduler": DlsparkSchedulerPlugin.name in dask_scheduler.plugins,
            "worker": DlsparkWorkerPlugin.name in dask_scheduler.worker_plugins}


def _cpu_only():
    from .cluster import gpu_devices

    return not gpu_devices()[1]
