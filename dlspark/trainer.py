"""DistributedTrainer: fit a Network on a Dask cluster (DL4J's SparkDl4jMultiLayer).

A facade: data sources turn inputs into minibatch references (``dlspark.data``),
the job client runs a fit as a job (``dlspark.distributed._client``), and
evaluation, inference and scoring run as Dask tasks (``dlspark._inference``).
"""

from __future__ import annotations

import time

import numpy as np

from . import _inference as _inf
from ._validate import positive_int
from .algorithms._base import Algorithm
from .data._exports import Exports
from .data._sources import SourceContext, path_minibatches
from .distributed._client import check_fit_args, install_plugins, run_fit
from .network import Network
from .stats import TrainingStats

__all__ = ["DistributedTrainer"]

#: how long a fit waits for a cluster with no workers (starting, or restarted by their nannies) to get one
NO_WORKERS_WAIT_S = 10


def _named_columns(data, features, labels, weight=None):
    """``data`` with its columns named, where ``features`` or ``labels`` are given (a DataFrame)."""
    if features is None and labels is None:
        if weight is not None:
            raise ValueError(f"weight={weight!r} names a DataFrame's weight column: name its features and "
                             "labels too, e.g. fit(ddf, features=['x0', 'x1'], labels='y', weight='w')")
        return data
    from .data._frames import frame_columns

    return frame_columns(data, features, labels, weight)


class DistributedTrainer:
    """Train a :class:`~dlspark.Network` data-parallel on a Dask cluster.

    Parameters
    ----------
    client : distributed.Client or cluster, optional
        A client, or a cluster (``slurm_cluster``, any dask-jobqueue or
        ``LocalCluster``) that the trainer connects to. Without one, the
        trainer connects to ``dlspark.client.address`` when it is set (``dlspark
        train`` sets it), else starts an embedded ``LocalCluster`` (one worker
        per GPU, else one single-threaded worker process per core, each pinned
        to its core; every process and the dashboard listen on 127.0.0.1 only,
        see ``dlspark.cluster.dashboard-address``) and closes it with the trainer. The versions of the
        packages a job needs are compared on every process first
        (:func:`dlspark.cluster.check_versions`).
    network : Network
        The network to train; after ``fit`` it holds the trained state.
    master : ParameterAveraging or GradientSharing, optional
        The distributed algorithm; needed for fit, not for inference.
    progress : bool
        Show a progress bar during fit.
    eval_num_workers, eval_batch_size : int
        Threads per worker and examples per batch for evaluation and scoring.

    Attributes
    ----------
    loss_history : list of (round, epoch, mean loss)
    training_stats : dlspark.stats.TrainingStats
        With ``collect_training_stats=True``: every round's record (iterating
        over it gives them, as over a list) and every timed event of every
        worker, the scheduler and the client on the scheduler's clock, with
        ``summary()``, ``stats_as_string()``, ``to_dataframe()``,
        ``export_json(url)`` and ``export_html(url)``.
    last_fit_stats : list of dict
        The last fit's round statistics.
    last_fit_events : list of dict
        What happened to the last fit's workers, in order: each ``{"event": "lost" |
        "joined" | "join-failed" | "partitioned", "worker": address, "round": the latest
        round begun, "workers": how many train on}`` (a failed join has its ``error``, a
        dropped worker the peers that could not reach it, ``unreachable_from``). Each is
        also logged as it happens (``dlspark.distributed._client``; a warning but for a join).
        After a fit that failed, those that reached the client before it failed.
    algorithm_state : dict
        What the algorithm carries from fit to fit and saves in checkpoints;
        its entries read as attributes too (gradient sharing's ``threshold_state``,
        the outer optimizer's ``outer_state``).
    published : dict
        The algorithm's running figures, read as attributes too (gradient
        sharing's ``communication``, summed over the trainer's fits, and
        ``replica_divergence``, the last fit's).

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
        positive_int("eval_num_workers", eval_num_workers)
        positive_int("eval_batch_size", eval_batch_size)
        from distributed import Client
        from distributed.deploy import Cluster

        from . import config
        from .cluster import check_versions, gpu_devices, local_cluster

        self._cluster = self._own_client = None
        pin = False
        if isinstance(client, Cluster):
            client = self._own_client = Client(client)
        elif client is None and config.get("client.address"):
            client = self._own_client = Client(config.get("client.address"))
        elif client is None:
            # Dask's dashboard, with /dlspark, where dlspark.cluster.dashboard-address says (loopback, a free port)
            self._cluster = local_cluster(dashboard_address=config.get("cluster.dashboard-address"))
            client = Client(self._cluster)
            pin = not gpu_devices()[1]
        if config.get("client.check-versions"):
            try:
                check_versions(client)
            except BaseException:
                self._close_connection(client)
                raise
        self.client, self.network, self.master, self.progress = client, network, master, progress
        self.eval_num_workers, self.eval_batch_size = eval_num_workers, eval_batch_size
        self.loss_history: list = []
        self.training_stats = TrainingStats()
        self.last_fit_stats: list = []
        self.last_fit_events: list = []
        self.algorithm_state: dict = {}
        self.published: dict = {}
        # {worker: (job, digests)} of the states the workers kept from the last fit: the next
        # fit sends each only what differs (dlspark.distributed._kept)
        self._kept_states: dict = {}
        self._kept_master = None  # the master of the fit whose states the workers kept
        # the digests of the state the last fit handed the network where no worker holds it (a
        # mean of the replicas): a next fit from it continues the replicas as from a kept one
        self._ended: dict | None = None
        self._exports = Exports()
        install_plugins(client, pin)
        if self._cluster is not None:
            from .cluster import _reach, dashboard_listening
            from .stats._live import dashboard_link

            link = dashboard_link(client)
            if link:
                print(f"dlspark: the running job's figures at {link} ({_reach(dashboard_listening(client))})")

    def __getattr__(self, name):
        for store in ("algorithm_state", "published"):
            values = self.__dict__.get(store, {})
            if name in values:
                return values[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- lifecycle -------------------------------------------------------------
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Delete temporary exports; close the embedded cluster if this trainer started it."""
        self.delete_temp_files()
        self._close_connection(self.client)

    def _close_connection(self, client):
        """Close the client and the embedded cluster this trainer opened (none it was given)."""
        if self._cluster is not None or self._own_client is not None:
            client.close()
            self._own_client = None
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None

    def delete_temp_files(self):
        """Remove the minibatch files this trainer exported (under a temporary directory or the
        master's ``export_directory``); a later fit exports again."""
        self._exports.remove()

    def _workers(self):
        workers = sorted(self.client.scheduler_info()["workers"])
        if not workers:
            # workers that are starting or being restarted by their nannies come back within seconds
            try:
                self.client.wait_for_workers(1, timeout=NO_WORKERS_WAIT_S)
            except TimeoutError:
                raise RuntimeError(f"the cluster has no workers (waited {NO_WORKERS_WAIT_S} s for one); start some "
                                   "(e.g. cluster.scale(2)) and try again") from None
            workers = sorted(self.client.scheduler_info()["workers"])
        return workers

    def _export_dir(self, storage_options=None):
        return self._exports.directory(self.master.export_directory, storage_options)

    # -- training --------------------------------------------------------------
    def fit(self, data, epochs: int = 1, *, checkpoint_every: int | None = None, checkpoint_url: str | None = None,
            resume_from: str | None = None, callbacks=(), progress: bool | None = None,
            storage_options: dict | None = None, features=None, labels=None, weight=None) -> Network:
        """Train on ``data``: a DataSet, a ``(features, labels)`` pair, a list of DataSets,
        a pair of dask arrays, a dask bag of DataSets, a dask or pandas DataFrame with
        ``features`` and ``labels`` naming its columns, or any registered data source.

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
        storage_options : dict, optional
            fsspec options (credentials, endpoint) for the master's ``export_directory``,
            ``checkpoint_url`` and ``resume_from``, used on the client and workers.
        features, labels : str or list of str, optional
            The feature and label columns of a DataFrame ``data``
            (:func:`dlspark.data.frame_columns`): each partition is cut into minibatches
            on the worker that holds it.
        weight : str, optional
            A DataFrame's column of non-negative per-example weights: each minibatch's
            loss is ``sum(w * loss) / sum(w)``, so a row of weight 0 has no effect.

        Returns
        -------
        Network
            ``self.network``, trained.
        """
        check_fit_args(self.master, epochs, checkpoint_every, checkpoint_url)
        data = _named_columns(data, features, labels, weight)
        # the files of an earlier fit of the same data (by content) are trained from again
        t_export = time.time()
        m = self._exports.minibatches(data, SourceContext(
            self.client, self.master.batch_size_per_worker, self.master.training_approach,
            lambda: self._export_dir(storage_options), storage_options=storage_options),
            where=(self.master.export_directory, storage_options))
        return run_fit(self, m.refs, m.partitions, epochs, storage_options=storage_options,
                       checkpoint_every=checkpoint_every,
                       checkpoint_url=checkpoint_url, resume_from=resume_from, callbacks=callbacks, progress=progress,
                       export_span=(t_export, time.time()))

    def fit_paths(self, paths, epochs: int = 1, loader=None, *, storage_options: dict | None = None,
                  checkpoint_every: int | None = None, checkpoint_url: str | None = None,
                  resume_from: str | None = None, callbacks=(), progress: bool | None = None,
                  features=None, labels=None, weight=None) -> Network:
        """Train from minibatch files (DL4J's ``fitPaths``), or from Parquet files by column name.

        Parameters
        ----------
        paths : str or list of str
            A glob, a directory URL or a list of file URLs on any fsspec
            file system the workers can reach (not ``memory://``).
        loader : callable, optional
            ``url -> DataSet/MultiDataSet`` for files in another format
            (DL4J's DataSetLoader); default: the ``.npz`` minibatch format.
        storage_options : dict, optional
            fsspec options (credentials, endpoint) for ``paths``, ``checkpoint_url`` and
            ``resume_from``, used on the client and workers.
        features, labels : str or list of str, optional
            Column names: ``paths`` are then Parquet files, read by the workers row
            group by row group (:func:`dlspark.data.parquet_columns`); ``weight`` a column of
            sample weights, as in :meth:`fit`.
        """
        if features is not None:  # Parquet files: the workers read their row groups
            from .data._frames import parquet_columns

            return self.fit(parquet_columns(paths, features, labels, storage_options, weight=weight), epochs,
                            checkpoint_every=checkpoint_every, checkpoint_url=checkpoint_url,
                            resume_from=resume_from, callbacks=callbacks, progress=progress,
                            storage_options=storage_options)
        check_fit_args(self.master, epochs, checkpoint_every, checkpoint_url)
        refs = path_minibatches(paths, storage_options)
        if loader is not None and not callable(loader):
            raise TypeError(f"loader must be a callable url -> DataSet, got {type(loader).__name__}")
        return run_fit(self, refs, [0] * len(refs), epochs, loader=loader, storage_options=storage_options,
                       checkpoint_every=checkpoint_every, checkpoint_url=checkpoint_url, resume_from=resume_from,
                       callbacks=callbacks, progress=progress)

    # -- evaluation, inference, scoring -----------------------------------------
    def _network_future(self):
        """The network scattered once per state version: the train state is an immutable pytree
        replaced by every fit or restore, so its identity names the version."""
        cached = self.__dict__.get("_net_cache")
        if cached is not None and cached[0] is self.network.state and cached[1] is self.network:
            return cached[2]
        future = _inf.scatter_network(self.client, self.network)
        self._net_cache = (self.network.state, self.network, future)
        return future

    def do_evaluation(self, data, batch_size: int | None = None, *evaluations, loader=None,
                      storage_options: dict | None = None, output: int | None = None, features=None, labels=None):
        """Fill several evaluations in one pass over ``data`` (what ``fit`` or ``fit_paths`` take):
        each worker evaluates its share, the partial evaluations merge on the workers. A
        multi-output network is evaluated one output at a time: ``output`` picks it (the
        evaluate methods take it too)."""
        if batch_size is not None:
            positive_int("batch_size", batch_size)
        data = _named_columns(data, features, labels)
        return _inf.do_evaluation(self.client, self._network_future(), data, evaluations,
                                  batch_size or self.eval_batch_size, loader=loader, storage_options=storage_options,
                                  threads=self.eval_num_workers, n_workers=len(self._workers()), output=output)

    def _evaluate(self, evaluation, data, batch_size, kw):
        return self.do_evaluation(data, batch_size, evaluation, **kw)[0]

    def evaluate(self, data, batch_size: int | None = None, **kw):
        """Classification :class:`~dlspark.evaluation.Evaluation` over ``data`` (distributed)."""
        from .evaluation import Evaluation

        return self._evaluate(Evaluation(), data, batch_size, kw)

    def evaluate_roc(self, data, threshold_steps: int = 0, batch_size: int | None = None, **kw):
        """Binary :class:`~dlspark.evaluation.ROC` over ``data`` (distributed)."""
        from .evaluation import ROC

        return self._evaluate(ROC(threshold_steps), data, batch_size, kw)

    def evaluate_roc_multiclass(self, data, threshold_steps: int = 0, batch_size: int | None = None, **kw):
        """One-vs-all :class:`~dlspark.evaluation.ROCMultiClass` over ``data`` (distributed)."""
        from .evaluation import ROCMultiClass

        return self._evaluate(ROCMultiClass(threshold_steps), data, batch_size, kw)

    def evaluate_regression(self, data, batch_size: int | None = None, **kw):
        """:class:`~dlspark.evaluation.RegressionEvaluation` over ``data`` (distributed)."""
        from .evaluation import RegressionEvaluation

        return self._evaluate(RegressionEvaluation(), data, batch_size, kw)

    def predict_with_keys(self, keyed_features, batch_size: int = 64, features_mask=None):
        """Keyed inference (DL4J's ``feedForwardWithKey``): a dict, a list of ``(key, array)``
        pairs or a dask bag of pairs in, the same kind of keyed outputs out (a tuple per key
        for multi-output networks). ``features_mask`` maps keys to per-example masks."""
        positive_int("batch_size", batch_size)
        return _inf.predict_with_keys(self.client, self._network_future(), keyed_features, batch_size,
                                      features_mask, self._workers())

    def score_examples(self, data, include_regularization: bool = False, batch_size: int | None = None, *,
                       features=None, labels=None):
        """Per-example loss (DL4J's ``scoreExamples``): a DataSet gives an array in example
        order; keyed examples (a dict or list of ``(key, DataSet)``) give the same kind, keyed.
        A dask DataFrame (``features`` and ``labels`` naming its columns) gives a lazy dask
        Series of the losses with the frame's index and partitions, scored where each
        partition lives (compute or persist it; nothing reaches the client before).
        Weight decay lives in the optax updater, so ``include_regularization`` changes nothing."""
        data = _named_columns(data, features, labels)
        return _inf.score_examples(self.client, self._network_future(), data, batch_size or self.eval_batch_size,
                                   len(self._workers()))

    def calculate_score(self, data, average: bool = True, batch_size: int | None = None, *, features=None,
                        labels=None) -> float:
        """Total (or, with ``average``, mean per example) loss over ``data`` (DL4J's ``calculateScore``)."""
        losses = self.score_examples(data, batch_size=batch_size, features=features, labels=labels)
        if hasattr(losses, "__dask_graph__"):  # a frame's losses: reduced where they are
            return float((losses.mean() if average else losses.sum()).compute())
        if isinstance(losses, dict):  # keyed examples: their losses, whatever the keys
            losses = np.concatenate([np.ravel(v) for v in losses.values()])
        elif isinstance(losses, list):
            losses = np.concatenate([np.ravel(v) for _, v in losses])
        return float(losses.mean() if average else losses.sum())
