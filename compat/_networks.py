"""SparkDl4jMultiLayer and SparkComputationGraph: DL4J's Spark wrappers over a dlspark Network.

Training goes to a :class:`dlspark.DistributedTrainer` on the Dask cluster
(:func:`dlspark.compat.configure`); evaluation, scoring and keyed inference on
RDDs run on the Spark executors (``dlspark.spark``). This module only
translates names and arguments.
"""

from __future__ import annotations

import math

import numpy as np

from dlspark import DistributedTrainer, Network
from dlspark.data import DataSet, MultiDataSet, SourceContext, fit_minibatches, list_minibatches
from dlspark import spark as _spark

from ._cluster import dask_client, progress_enabled
from ._listeners import checkpoint_options, dispatcher, parse_listeners
from ._runtime import CompatTrainer, dealt, set_periodic_gc
from ._evaluation import Evaluation, RegressionEvaluation, ROC, ROCMultiClass
from ._masters import TrainingMaster, spark_storage_level
from ._conf import RDDTrainingApproach
from ._names import with_snake_aliases
from ._rnn import DatasetsToNWC, LoadNWC, PairsToNWC, RNNFormat, rnn_format, swap_time, value_to_ncw

__all__ = ["SparkDl4jMultiLayer", "SparkComputationGraph", "SparkTrainingStats"]


def _spark_context(sc):
    """A SparkContext from a SparkContext or a SparkSession (pyspark is not imported here)."""
    if hasattr(sc, "sparkContext") and not hasattr(sc, "parallelize"):
        sc = sc.sparkContext
    if not ((type(sc).__module__ or "").startswith("pyspark") and hasattr(sc, "parallelize")):
        raise TypeError(f"sc must be a pyspark SparkContext (or SparkSession), got {type(sc).__name__}")
    return sc


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@with_snake_aliases
class SparkTrainingStats:
    """Every round's statistics from the fits run while collection was on
    (``setCollectTrainingStats(True)``), with DL4J's accessors.

    Attributes
    ----------
    rounds : list of dict
        One dict per round (fit time, averaging or sync time, loss, examples, ...).
    """

    def __init__(self, rounds, training_stats=None):
        self.rounds = list(rounds)
        #: the core's :class:`dlspark.stats.TrainingStats` (timed events too), for the export
        self.training_stats = training_stats

    def getKeySet(self) -> list:
        """The names of the numeric figures recorded."""
        return sorted({k for r in self.rounds for k, v in r.items() if isinstance(v, (int, float))
                       and not isinstance(v, bool)})

    def getValue(self, key: str) -> list:
        """The figure ``key`` of every round that recorded it."""
        if key not in self.getKeySet():
            raise KeyError(f"no training statistic {key!r}; recorded: {', '.join(self.getKeySet())}")
        return [r[key] for r in self.rounds if key in r]

    def statsAsString(self) -> str:
        """One line per figure: rounds, mean, min and max."""
        lines = [f"{len(self.rounds)} rounds"]
        for k in self.getKeySet():
            v = np.asarray(self.getValue(k), dtype=float)
            lines.append(f"{k}: n={len(v)} mean={np.nanmean(v):.6g} min={np.nanmin(v):.6g} max={np.nanmax(v):.6g}")
        return "\n".join(lines)

    def __len__(self):
        return len(self.rounds)

    def __repr__(self):
        return f"SparkTrainingStats({len(self.rounds)} rounds)"


@with_snake_aliases
class _SparkNetwork:
    """What SparkDl4jMultiLayer and SparkComputationGraph share."""

    #: which output evaluations take (None: the network must have one)
    _eval_output = None

    #: Examples per forward pass in evaluation and scoring, by default (DL4J's).
    DEFAULT_EVAL_SCORE_BATCH_SIZE = 64
    #: Threshold steps of the ROC evaluations, by default (DL4J's).
    DEFAULT_ROC_THRESHOLD_STEPS = 32
    #: Minibatches each executor task evaluates at once, by default (DL4J's evaluation workers).
    DEFAULT_EVAL_WORKERS = 4

    def __init__(self, sc, network, training_master=None, rnnDataFormat="NCW"):
        self.sc = _spark_context(sc)
        if not isinstance(network, Network):
            raise TypeError(f"network must be a dlspark.Network, got {type(network).__name__} (DL4J's "
                            "configurations have no counterpart: build a dlspark.Network from a Model)")
        if training_master is not None and not isinstance(training_master, TrainingMaster):
            raise TypeError("training_master must be ParameterAveragingTrainingMaster.Builder(...).build(), "
                            "SharedTrainingMaster.Builder(...).build() or None (evaluation and inference only), "
                            f"got {type(training_master).__name__}")
        self._network = network
        self._master = training_master
        self._trainer = None
        self._exported = None  # ((context, rdd id, batch size), export directory, URLs) of the last RDD exported
        self._score = math.nan
        self._listeners: list = []
        self._eval_workers = self.DEFAULT_EVAL_WORKERS
        self._rnn = rnn_format(rnnDataFormat)
        _spark.check_executors(self.sc)  # once per SparkContext: the executors must import this dlspark

    # -- DL4J's recurrent layout (dlspark.compat._rnn) ---------------------------------------
    def getRnnDataFormat(self) -> RNNFormat:
        """The layout of 3-D features, labels and outputs: ``RNNFormat.NCW`` (DL4J's
        ``[examples, features, time]``, the default) or ``RNNFormat.NWC``."""
        return self._rnn

    def _in_rdd(self, rdd):
        """An RDD whose DataSets come in the network's layout (mapped on the executors)."""
        if self._rnn is RNNFormat.NWC:
            return rdd
        return rdd.map(DatasetsToNWC(), preservesPartitioning=True)

    def _in_loader(self, loader):
        """A minibatch loader whose DataSets come in the network's layout."""
        return loader if self._rnn is RNNFormat.NWC else LoadNWC(loader)

    def _in_local(self, data):
        """Local data (a DataSet, a list of them, or arrays) in the network's layout."""
        if self._rnn is RNNFormat.NWC or isinstance(data, str):
            return data
        if isinstance(data, (list, tuple)) and data and isinstance(data[0], (DataSet, MultiDataSet)):
            return type(data)(self._in_local(d) for d in data)
        if isinstance(data, tuple) and len(data) == 2:  # (features, labels)
            return swap_time(data[0]), swap_time(data[1])
        return DatasetsToNWC()(data)

    # -- training --------------------------------------------------------------------------
    def _fit_trainer(self) -> DistributedTrainer:
        if self._master is None:
            raise ValueError(f"this {type(self).__name__} has no training master (None); pass one to fit, e.g. "
                             f"{type(self).__name__}(sc, network, ParameterAveragingTrainingMaster.Builder(32)"
                             ".build()); evaluation and inference need none")
        client = dask_client(self.sc)
        if self._trainer is None or self._trainer.client is not client:
            self._trainer = CompatTrainer(client, self._network, self._master.algorithm,
                                          progress=progress_enabled())
        self._trainer.network, self._trainer.master = self._network, self._master.algorithm
        self._trainer.workers_per_node = self._master.workers_per_node
        set_periodic_gc(client, self._master.periodic_gc_ms)
        return self._trainer

    def _train_paths(self, trainer, urls, loader=None, exported=False):
        """One epoch from minibatch files: dealt in the master's seeded order, with the listeners."""
        if self._master.rng_seed is not None:
            urls = dealt(list_minibatches(urls) if isinstance(urls, str) else urls, self._master.rng_seed,
                         self._network.epoch)
        on_round, end = dispatcher(self._listeners, self._network, trainer)
        every = checkpoint_options(self._listeners, trainer.master, len(trainer._workers()))
        if not exported:  # files written by the export are in the network's layout already
            loader = self._in_loader(loader)
        trainer.fit_paths(urls, loader=loader, callbacks=[on_round] if self._listeners else (), **every)
        end()

    def _fit_rdd(self, trainer, rdd):
        master = self._master
        if master.rdd_training_approach is RDDTrainingApproach.Direct:
            # read twice (sized, then collected): persisted meanwhile, as DL4J persists at storageLevel
            persist = not rdd.is_cached and master.storage_level is not None
            if persist:
                rdd.persist(spark_storage_level(master.storage_level))
            on_round, end = dispatcher(self._listeners, self._network, trainer)
            try:
                trainer.fit(self._in_rdd(rdd), callbacks=[on_round] if self._listeners else ())
                end()
            finally:
                if persist:
                    rdd.unpersist()
            return
        # Export: as DL4J, an RDD fitted again (another epoch) reuses its export while the
        # master keeps the files (deleteTempFiles removes them).
        bs = master.algorithm.batch_size_per_worker
        key = (id(rdd.context), rdd.id(), bs)
        cached = self._exported
        if cached is None or cached[0] != key or cached[1] not in master.export_dirs():
            used = []

            def export_dir():
                used.append(master.export_dir())
                return used[-1]

            try:
                refs = fit_minibatches(self._in_rdd(rdd),
                                       SourceContext(trainer.client, bs, "export", export_dir=export_dir)).refs
            except BaseException:
                for d in used:
                    master.discard_export_dir(d)
                raise
            if used and not any(r.startswith(used[-1]) for r in refs[:1]):  # an RDD of paths: nothing written
                master.discard_export_dir(used[-1])
            self._exported = cached = (key, used[-1] if used else None, refs)
        written = cached[1] is not None and bool(cached[2]) and str(cached[2][0]).startswith(cached[1])
        self._train_paths(trainer, cached[2], exported=written)

    def _after_fit(self, trainer):
        losses = [loss for _, _, loss in trainer.loss_history if loss is not None]
        if losses:
            self._score = float(losses[-1])
        return self._network

    def fit(self, data, featuresCol=None, labelCol=None, weightCol=None):
        """Train one epoch on ``data``: an RDD of DataSets (or MultiDataSets, or minibatch
        paths), or a directory (or glob) of minibatch files; returns the trained Network.

        A Spark DataFrame trains from its ``featuresCol`` and ``labelCol`` columns
        (numbers, arrays or Spark ML vectors; dlspark's extension: DL4J takes RDDs):
        the executors turn the rows into DataSets and write the minibatch files.
        ``weightCol`` names a column of non-negative per-example weights (a row of weight 0
        has no effect on the fit).

        An RDD of DataSets is exported by the executors to minibatch files of
        ``batchSizePerWorker`` examples (``RDDTrainingApproach.Export``); fitting the same RDD
        again reuses those files. Anything ``DistributedTrainer.fit`` takes works as well.
        """
        from ._dataframes import dataframe_datasets, is_spark_dataframe

        if is_spark_dataframe(data):
            loss = getattr(self._network._loss, "name", None)
            data = dataframe_datasets(data, featuresCol, labelCol,
                                      softmax=loss in ("softmax_cross_entropy", "negative_log_likelihood"),
                                      weight_col=weightCol)
        trainer = self._fit_trainer()
        if isinstance(data, str):
            self._train_paths(trainer, data)
        elif _spark.is_rdd(data):
            self._fit_rdd(trainer, data)
        else:
            on_round, end = dispatcher(self._listeners, self._network, trainer)
            trainer.fit(self._in_local(data), callbacks=[on_round] if self._listeners else ())
            end()
        return self._after_fit(trainer)

    def fitPaths(self, paths, loader=None):
        """Train one epoch from an RDD of minibatch file paths (their strings are collected;
        the Dask workers read the files). ``loader``: ``path -> DataSet`` for another format."""
        trainer = self._fit_trainer()
        if _spark.is_rdd(paths):
            level = self._master.storage_level_streams
            if level is not None and not paths.is_cached:  # DL4J's storageLevelStreams: read once, kept
                from ._masters import spark_storage_level

                paths.__dict__.pop("_dlspark_paths", None)  # strings kept from an earlier persistence are stale
                paths.persist(spark_storage_level(level))
            urls = _spark.collect_paths(paths, "fitPaths")
        else:
            urls = paths
        self._train_paths(trainer, urls, loader)
        return self._after_fit(trainer)

    def fitMultiDataSet(self, data):
        """Train one epoch on an RDD of MultiDataSets (or a directory of their minibatch files)."""
        return self.fit(data)

    def fitPathsMultiDataSet(self, paths, loader=None):
        """Train one epoch from an RDD of paths of MultiDataSet minibatch files."""
        return self.fitPaths(paths, loader)

    # -- evaluation ------------------------------------------------------------------------
    def _rdd(self, data, what):
        if _spark.is_rdd(data):
            return data
        if isinstance(data, str):
            paths = list_minibatches(data)  # names only: the executors read the files
            return self.sc.parallelize(paths, max(1, min(len(paths), self.sc.defaultParallelism)))
        raise TypeError(f"{what} takes an RDD (of DataSets, MultiDataSets or minibatch paths) or a directory "
                        f"of minibatch files, got {type(data).__name__}")

    def doEvaluation(self, data, *args, loader=None):
        """Fill several evaluations in one pass over ``data``, on the executors:
        ``doEvaluation(rdd, evalBatchSize, *evaluations)`` or
        ``doEvaluation(rdd, evalNumWorkers, evalBatchSize, *evaluations)``; returns the list.

        Partial evaluations merge on the executors with the core's ``merge``.
        """
        ints = []
        rest = list(args)
        while rest and _is_int(rest[0]) and len(ints) < 2:
            ints.append(int(rest.pop(0)))
        if rest and callable(rest[0]) and not hasattr(rest[0], "update"):  # DL4J's (paths, [w, b,] loader, ...)
            if loader is not None:
                raise TypeError("doEvaluation got two loaders (one positional, one loader=)")
            loader = rest.pop(0)
            if not ints:
                ints = [self.DEFAULT_EVAL_SCORE_BATCH_SIZE]
        if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
            rest = list(rest[0])
        if not ints:
            raise TypeError("doEvaluation(rdd, [evalNumWorkers,] evalBatchSize, *evaluations) or "
                            "doEvaluation(paths, [evalNumWorkers, evalBatchSize,] loader, *evaluations), e.g. "
                            "doEvaluation(rdd, 64, Evaluation(), ROCMultiClass()); the batch size is missing")
        workers, batch = (self._eval_workers, ints[0]) if len(ints) == 1 else ints
        return _spark.do_evaluation(self._in_rdd(self._rdd(data, "doEvaluation")), self._network, rest, batch,
                                    workers, self._in_loader(loader), output=self._eval_output)

    def _one(self, evaluation, data, batch_size, loader, what):
        rdd = self._in_rdd(self._rdd(data, what))
        return _spark.do_evaluation(rdd, self._network, [evaluation], batch_size, self._eval_workers,
                                    self._in_loader(loader), output=self._eval_output)[0]

    def evaluate(self, data, labels_list=None, batch_size: int = DEFAULT_EVAL_SCORE_BATCH_SIZE, loader=None):
        """Classification :class:`Evaluation` over an RDD (or a directory of minibatch files).

        DL4J's overloads work: ``evaluate(rdd)``, ``evaluate(rdd, labelsList)``,
        ``evaluate(rdd, labelsList, batchSize)``, ``evaluate(path, batchSize, loader)``.
        """
        if _is_int(labels_list):
            labels_list, batch_size, loader = None, labels_list, batch_size if callable(batch_size) else loader
        elif callable(labels_list):
            labels_list, loader = None, labels_list
        if not _is_int(batch_size):
            batch_size = self.DEFAULT_EVAL_SCORE_BATCH_SIZE
        return self._one(Evaluation(labels=labels_list), data, batch_size, loader, "evaluate")

    def evaluateRegression(self, data, batch_size: int = DEFAULT_EVAL_SCORE_BATCH_SIZE, loader=None):
        """:class:`RegressionEvaluation` over an RDD, on the executors."""
        return self._one(RegressionEvaluation(), data, batch_size, loader, "evaluateRegression")

    def evaluateROC(self, data, threshold_steps: int = DEFAULT_ROC_THRESHOLD_STEPS,
                    batch_size: int = DEFAULT_EVAL_SCORE_BATCH_SIZE, loader=None):
        """Binary :class:`ROC` (``threshold_steps`` bins; 0 = exact) over an RDD, on the executors."""
        return self._one(ROC(threshold_steps), data, batch_size, loader, "evaluateROC")

    def evaluateROCMultiClass(self, data, threshold_steps: int = DEFAULT_ROC_THRESHOLD_STEPS,
                              batch_size: int = DEFAULT_EVAL_SCORE_BATCH_SIZE, loader=None):
        """One-vs-all :class:`ROCMultiClass` over an RDD, on the executors."""
        return self._one(ROCMultiClass(threshold_steps), data, batch_size, loader, "evaluateROCMultiClass")

    # -- inference and scoring -------------------------------------------------------------
    def feedForwardWithKey(self, features, batch_size: int = DEFAULT_EVAL_SCORE_BATCH_SIZE):
        """Keyed inference: a pair RDD of ``(key, features of one example)`` in, a pair RDD of
        ``(key, outputs)`` out, in the same partitioning (lazy; the keys stay in Spark).
        A graph with several inputs takes a tuple of arrays per key and gives a tuple."""
        return self._keyed(features, batch_size, False)

    def feedForwardWithMaskAndKey(self, features_and_mask, batch_size: int = DEFAULT_EVAL_SCORE_BATCH_SIZE):
        """:meth:`feedForwardWithKey` for a pair RDD of ``(key, (features, features_mask))``."""
        return self._keyed(features_and_mask, batch_size, True)

    def _keyed(self, pairs, batch_size, with_mask):
        if self._rnn is RNNFormat.NWC:
            return _spark.predict_with_keys(pairs, self._network, batch_size, with_mask=with_mask)
        out = _spark.predict_with_keys(pairs.map(PairsToNWC(with_mask), preservesPartitioning=True),
                                       self._network, batch_size,
                                       with_mask=with_mask)
        return out.mapValues(value_to_ncw)

    def scoreExamples(self, data, include_regularization: bool = False,
                      batch_size: int = DEFAULT_EVAL_SCORE_BATCH_SIZE):
        """Per-example loss, on the executors (lazy): an RDD of DataSets gives an RDD of floats;
        a pair RDD of ``(key, DataSet)`` gives ``(key, loss)`` pairs in the same partitioning.

        ``include_regularization`` changes nothing: weight decay lives in the optax updater,
        not in the loss.
        """
        return _spark.score_examples(self._in_rdd(data), self._network, batch_size)

    def calculateScore(self, data, average: bool = True, batch_size: int = DEFAULT_EVAL_SCORE_BATCH_SIZE) -> float:
        """The loss over an RDD of DataSets: the mean per example with ``average``, else the sum."""
        return _spark.calculate_score(self._in_rdd(data), self._network, batch_size, average)

    def predict(self, features):
        """DL4J's ``predict(features)``: the network's output for a local array of examples,
        on the driver (a tuple of arrays for several outputs)."""
        x = np.asarray(features) if not isinstance(features, (tuple, list)) else tuple(np.asarray(f) for f in features)
        if self._rnn is RNNFormat.NWC:
            return self._network.output(x)
        return swap_time(self._network.output(swap_time(x)))

    # -- listeners -------------------------------------------------------------------------
    def setListeners(self, *listeners) -> None:
        """DL4J's ``setListeners(listener, ...)``, ``setListeners([listeners])`` and
        ``setListeners(statsStorage, [listeners])``: listeners called on the driver as each
        round of a fit completes (see ``dlspark.compat._listeners``); replaces earlier ones."""
        _, self._listeners = parse_listeners(listeners)

    def getListeners(self) -> list:
        """The listeners :meth:`setListeners` set."""
        return list(self._listeners)

    # -- accessors -------------------------------------------------------------------------
    def setDefaultEvaluationWorkers(self, workers: int) -> None:
        """Minibatches each executor task evaluates at once in the evaluation methods (DL4J's
        evaluation workers; default 4)."""
        if not _is_int(workers) or workers < 1:
            raise ValueError(f"setDefaultEvaluationWorkers takes an integer >= 1, got {workers!r}")
        self._eval_workers = int(workers)

    def getDefaultEvaluationWorkers(self) -> int:
        """See :meth:`setDefaultEvaluationWorkers`."""
        return self._eval_workers

    def getLearningRate(self, layer=None) -> float:
        """The updater's current learning rate. The network's optax updater must expose it:
        build it with ``optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)`` (its state
        holds the rate, a schedule's value included). ``layer`` is accepted for DL4J's
        ``getLearningRate(layerIdx)``: one updater serves every layer here."""
        import jax

        found = []

        def visit(node):
            hp = getattr(node, "hyperparams", None)
            if isinstance(hp, dict) and "learning_rate" in hp:
                found.append(float(np.asarray(hp["learning_rate"])))
            return node

        jax.tree_util.tree_map(visit, self._network.state.opt_state,
                               is_leaf=lambda n: hasattr(n, "hyperparams"))
        if not found:
            raise ValueError("getLearningRate: this network's optax updater does not expose its learning rate; "
                             "build it with optax.inject_hyperparams, e.g. "
                             "updater=optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)")
        return found[0]

    def getNetwork(self) -> Network:
        """The dlspark Network (trained in place by ``fit``)."""
        return self._network

    def setNetwork(self, network: Network) -> None:
        """Replace the network (the next fit, evaluation or inference uses it)."""
        if not isinstance(network, Network):
            raise TypeError(f"network must be a dlspark.Network, got {type(network).__name__}")
        self._network = network

    def getSparkContext(self):
        """The SparkContext."""
        return self.sc

    def getScore(self) -> float:
        """The mean loss of the last round of the last fit (NaN before any fit)."""
        return self._score

    def getTrainingMaster(self):
        """The training master (None for evaluation and inference only)."""
        return self._master

    def setCollectTrainingStats(self, collect: bool) -> None:
        """Collect every round's statistics in the fits that follow (see :meth:`getSparkTrainingStats`)."""
        if self._master is None:
            raise ValueError("setCollectTrainingStats needs a training master; this network has None")
        self._master.setCollectTrainingStats(collect)

    def getSparkTrainingStats(self):
        """:class:`SparkTrainingStats` of the rounds fitted while collecting, or None when not collecting."""
        if self._master is None or not self._master.getCollectTrainingStats():
            return None
        stats = self._trainer.training_stats if self._trainer is not None else None
        return SparkTrainingStats(stats if stats is not None else [], stats)

    def deleteTempFiles(self) -> bool:
        """Delete the minibatch files exported from RDDs (the next fit of an RDD exports again)."""
        self._exported = None
        if self._trainer is not None:
            self._trainer.delete_temp_files()
        return self._master.deleteTempFiles(self.sc) if self._master is not None else True

    def close(self) -> None:
        """Delete temporary files. The Dask cluster stays (it is shared; see ``configure``)."""
        self.deleteTempFiles()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@with_snake_aliases
class SparkDl4jMultiLayer(_SparkNetwork):
    """DL4J's ``SparkDl4jMultiLayer(sc, network, trainingMaster)`` for a dlspark Network.

    Training runs on the Dask cluster (``dlspark.compat.configure``); evaluation,
    scoring and keyed inference of RDDs run on the Spark executors.
    Every method has a snake_case alias (``fit_paths``, ``do_evaluation``, ...).

    Parameters
    ----------
    sc : pyspark SparkContext or SparkSession
    network : dlspark.Network
    training_master : ParameterAveragingTrainingMaster, SharedTrainingMaster or None
        None for evaluation and inference only.
    rnnDataFormat : RNNFormat or str, default "NCW"
        The layout of 3-D (recurrent) features, labels and outputs: DL4J's NCW
        ``[examples, features, time]``, swapped to the model's NWC on the way in and back on
        the way out (``dlspark.compat._rnn``), or ``"NWC"`` for data already in it.

    Examples
    --------
    >>> tm = ParameterAveragingTrainingMaster.Builder(32).batchSizePerWorker(32).build()  # doctest: +SKIP
    >>> spark_net = SparkDl4jMultiLayer(sc, net, tm)  # doctest: +SKIP
    >>> for epoch in range(10):  # doctest: +SKIP
    ...     spark_net.fit(train_rdd)
    >>> print(spark_net.evaluate(test_rdd).stats())  # doctest: +SKIP
    """


@with_snake_aliases
class SparkComputationGraph(_SparkNetwork):
    """DL4J's ``SparkComputationGraph(sc, network, trainingMaster)``: a network with several
    inputs or outputs (MultiDataSets; tuples of arrays per key in keyed inference).

    The same methods as :class:`SparkDl4jMultiLayer`, ``fitMultiDataSet`` and
    ``fitPathsMultiDataSet`` included; evaluations use the network's first output
    (against the first labels array), as DL4J's evaluation of a graph does by default.
    """

    _eval_output = 0
