"""DL4J's training masters and their builders, over the core's algorithm masters.

``ParameterAveragingTrainingMaster.Builder(n).batchSizePerWorker(32).build()``
holds a :class:`dlspark.ParameterAveraging`; ``SharedTrainingMaster`` holds a
:class:`dlspark.GradientSharing`. Every default is DL4J's, written out here.
Every setting does what DL4J's does, or the closest thing on Dask (see each
method): ``workersPerNode`` picks that many workers per machine, ``rngSeed``
seeds the order in which the minibatches are dealt to the workers, and
``workerTogglePeriodicGC`` runs Python's collector on the Dask workers.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
import weakref
from dataclasses import replace

from dlspark import GradientSharing, ParameterAveraging
from dlspark.io import url_join

from ._conf import (AdaptiveThresholdAlgorithm, MeshBuildMode, RDDTrainingApproach, Repartition, RepartitionStrategy,
                    ResidualClippingPostProcessor, VoidConfiguration)
from ._names import Builder, as_enum, with_snake_aliases

__all__ = ["TrainingMaster", "ParameterAveragingTrainingMaster", "SharedTrainingMaster"]

#: DL4J's storage level names; pyspark stores RDDs serialized whatever the level says.
_STORAGE_LEVELS = ("NONE", "DISK_ONLY", "DISK_ONLY_2", "DISK_ONLY_3", "MEMORY_ONLY", "MEMORY_ONLY_2",
                   "MEMORY_ONLY_SER", "MEMORY_AND_DISK", "MEMORY_AND_DISK_2", "MEMORY_AND_DISK_SER", "OFF_HEAP")


def _int(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def _storage_level(name, level):
    """A pyspark StorageLevel, a level's name, or None (no persistence)."""
    if level is None or (type(level).__module__ or "").startswith("pyspark"):
        return level
    if isinstance(level, str) and level.upper() in _STORAGE_LEVELS:
        return level.upper()
    raise ValueError(f"{name} must be a pyspark StorageLevel, one of {', '.join(_STORAGE_LEVELS)} or None, "
                     f"got {level!r}")


def spark_storage_level(level):
    """The pyspark StorageLevel for ``level`` (imports pyspark: call it only with an RDD at hand)."""
    if level is None or not isinstance(level, str):
        return level
    from pyspark import StorageLevel

    # pyspark always stores serialized, so DL4J's *_SER levels are the plain ones here
    return getattr(StorageLevel, level.replace("_SER", ""))


@with_snake_aliases
class TrainingMaster:
    """What DL4J's training masters share: the core algorithm master, the DL4J-only settings,
    and the export directories of RDDs trained with ``RDDTrainingApproach.Export``.

    Attributes
    ----------
    algorithm : ParameterAveraging or GradientSharing
        The core master that trains.
    rdd_data_set_num_examples : int
        Examples in each DataSet of a training RDD (DL4J's ``rddDataSetNumExamples``);
        the executors rebatch to ``batchSizePerWorker`` whatever it is.
    rdd_training_approach : RDDTrainingApproach
    storage_level : pyspark StorageLevel, str or None
        Persistence of an RDD of DataSets trained with ``Direct`` (read twice: sized, then collected).
    rng_seed : int or None
        Seeds the order in which each epoch's minibatches are dealt to the workers (DL4J's
        random splits of the data); None keeps the data's order.
    workers_per_node : int or None
        Training workers each machine contributes (None: every Dask worker).
    periodic_gc_ms : int or None
        Period of a ``gc.collect()`` on every Dask worker during training (None: none).
    """

    def __init__(self, algorithm, *, rdd_data_set_num_examples, storage_level, rng_seed, settings):
        self.algorithm = algorithm
        self.rdd_data_set_num_examples = rdd_data_set_num_examples
        self.rdd_training_approach = as_enum(RDDTrainingApproach, algorithm.training_approach, "rddTrainingApproach")
        self.storage_level = storage_level
        self.rng_seed = rng_seed
        #: every builder setting, by DL4J's name
        self.settings = dict(settings)
        self.storage_level_streams = self.settings.get("storageLevelStreams")
        n = self.settings.get("workersPerNode", -1)
        self.workers_per_node = None if n is None or n < 1 else n
        # on when asked for: the toggle set True, or a period set without the toggle set False
        toggle, period = self.settings.get("workerTogglePeriodicGC"), self.settings.get("workerPeriodicGCFrequency")
        self.periodic_gc_ms = (period or 5000) if toggle or (toggle is None and period) else None
        self._export_dirs: list = []
        # local temporary exports go with the master (or the process) if deleteTempFiles was not called
        self._local_dirs: list = []
        weakref.finalize(self, _remove_local, self._local_dirs)

    # -- DL4J's accessors ----------------------------------------------------------------
    def getBatchSizePerWorker(self) -> int:
        """Examples per minibatch on each worker."""
        return self.algorithm.batch_size_per_worker

    def getCollectTrainingStats(self) -> bool:
        """Whether per-round statistics are collected."""
        return self.algorithm.collect_training_stats

    def setCollectTrainingStats(self, collect: bool) -> None:
        """Collect per-round statistics in the fits that follow (or stop)."""
        self.algorithm = replace(self.algorithm, collect_training_stats=_bool("collectTrainingStats", collect))

    def export_dir(self) -> str:
        """A fresh directory for one RDD export: under ``exportDirectory`` if set (every
        executor and Dask worker must reach it), else a local temporary directory."""
        base = self.algorithm.export_directory
        if base is None:
            d = tempfile.mkdtemp(prefix="dlspark-spark-export-")
            self._export_dirs.append(d)
            self._local_dirs.append(d)
            return d
        d = url_join(base, uuid.uuid4().hex)
        self._export_dirs.append(d)
        return d

    def export_dirs(self) -> list:
        """The export directories whose files have not been deleted yet."""
        return list(self._export_dirs)

    def discard_export_dir(self, directory: str) -> None:
        """Delete one export directory now (an export that failed, or wrote nothing)."""
        _remove(directory)
        for dirs in (self._export_dirs, self._local_dirs):
            if directory in dirs:
                dirs.remove(directory)

    def deleteTempFiles(self, sc=None) -> bool:
        """Delete the minibatch files this master's exports wrote (DL4J's ``deleteTempFiles(sc)``)."""
        for d in list(self._export_dirs):
            self.discard_export_dir(d)
        return True

    def __repr__(self):
        return f"{type(self).__name__}({self.algorithm!r})"


def _remove(directory):
    if "://" in directory:
        import fsspec

        fs, path = fsspec.core.url_to_fs(directory)
        if fs.exists(path):
            fs.rm(path, recursive=True)
    else:
        shutil.rmtree(directory, ignore_errors=True)


def _remove_local(dirs):
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def _parse_counts(args, what):
    """``(num_workers, rdd_data_set_num_examples)`` from DL4J's ``Builder(n)`` / ``Builder(workers, n)``."""
    if len(args) == 1:
        return None, _int("rddDataSetNumExamples", args[0])
    if len(args) == 2:
        workers = None if args[0] is None else _int("numWorkers", args[0])
        return workers, _int("rddDataSetNumExamples", args[1])
    raise TypeError(f"{what}(rddDataSetNumExamples) or {what}(numWorkers, rddDataSetNumExamples), "
                    f"e.g. {what}(32); got {len(args)} arguments")


@with_snake_aliases
class _MasterBuilder(Builder):
    """Settings both builders share."""

    def _set(self, name, value):
        self._values[name] = value
        return self

    def batchSizePerWorker(self, batch_size: int):
        """Examples per minibatch on each worker; the executors rebatch the RDD's DataSets to it."""
        return self._set("batchSizePerWorker", _int("batchSizePerWorker", batch_size))

    def workerPrefetchNumBatches(self, n: int):
        """Minibatches each worker loads ahead, on a background thread (0: none)."""
        return self._set("workerPrefetchNumBatches", _int("workerPrefetchNumBatches", n, minimum=0))

    def rddTrainingApproach(self, approach):
        """``RDDTrainingApproach.Export`` (default) or ``RDDTrainingApproach.Direct``."""
        return self._set("rddTrainingApproach", as_enum(RDDTrainingApproach, approach, "rddTrainingApproach"))

    def exportDirectory(self, directory: str):
        """Where exported minibatch files go, a URL every executor and Dask worker reaches
        (each export gets a fresh directory under it). Default: a local temporary directory,
        which suits Spark and Dask on one machine (DL4J's default is ``{hadoop.tmp.dir}/dl4j/``)."""
        if not isinstance(directory, str):
            raise TypeError(f"exportDirectory must be a URL string, got {type(directory).__name__}")
        return self._set("exportDirectory", directory)

    def repartitionData(self, repartition):
        """When minibatches are rebalanced across workers: ``Repartition.Always`` (default),
        ``Never`` or ``NumPartitionsWorkersDiffers``. The Spark RDD itself is not reshuffled;
        the core plans which worker trains which minibatch."""
        return self._set("repartitionData", as_enum(Repartition, repartition, "repartitionData"))

    def repartionData(self, repartition):
        """DL4J's spelling of :meth:`repartitionData`."""
        return self.repartitionData(repartition)

    def repartitionStrategy(self, strategy):
        """``RepartitionStrategy.Balanced`` (default: shares differ by at most one minibatch)
        or ``RepartitionStrategy.SparkDefault``."""
        return self._set("repartitionStrategy", as_enum(RepartitionStrategy, strategy, "repartitionStrategy"))

    def storageLevel(self, level):
        """Persistence of an RDD of DataSets trained with ``Direct`` (default ``MEMORY_ONLY_SER``,
        which is pyspark's ``MEMORY_ONLY``: Python RDDs are always stored serialized); None: none."""
        return self._set("storageLevel", _storage_level("storageLevel", level))

    def collectTrainingStats(self, collect: bool):
        """Record every round's statistics (see ``getSparkTrainingStats``); default False."""
        return self._set("collectTrainingStats", _bool("collectTrainingStats", collect))

    def rngSeed(self, seed: int):
        """Seed of the order in which each epoch's minibatches are dealt to the workers (DL4J
        seeds its random splits of the RDD with it): the same seed deals the same way, epoch
        by epoch. Unset, the data's order is kept. The network's own seed drives its
        initialisation and dropout."""
        return self._set("rngSeed", _int("rngSeed", seed, minimum=0))

    def _common(self):
        v = self._values
        return {"worker_prefetch_num_batches": v["workerPrefetchNumBatches"],
                "training_approach": v["rddTrainingApproach"].value,
                "export_directory": v.get("exportDirectory"),
                "repartition": v["repartitionData"].value,
                "repartition_strategy": v["repartitionStrategy"].value,
                "collect_training_stats": v["collectTrainingStats"]}


@with_snake_aliases
class _ParameterAveragingBuilder(_MasterBuilder):
    """``ParameterAveragingTrainingMaster.Builder(rddDataSetNumExamples)``, DL4J's defaults.

    Defaults: ``batchSizePerWorker`` 16, ``averagingFrequency`` 5,
    ``workerPrefetchNumBatches`` 2 and ``saveUpdater`` True. The last two follow
    DL4J's documentation (prefetch: "2 is often a sensible default"; saveUpdater:
    "enabled by default"); DL4J's builder code leaves them at 0 and false.
    ``rddTrainingApproach`` Export, ``repartitionData`` Always,
    ``repartitionStrategy`` Balanced, ``storageLevel`` MEMORY_ONLY_SER,
    ``storageLevelStreams`` MEMORY_ONLY, ``collectTrainingStats`` False.
    """

    def __init__(self, *args):
        self._num_workers, self._rdd_n = _parse_counts(args, "ParameterAveragingTrainingMaster.Builder")
        self._values = {"batchSizePerWorker": 16, "averagingFrequency": 5, "aggregationDepth": 2,
                        "workerPrefetchNumBatches": 2, "saveUpdater": True,
                        "rddTrainingApproach": RDDTrainingApproach.Export, "repartitionData": Repartition.Always,
                        "repartitionStrategy": RepartitionStrategy.Balanced, "storageLevel": "MEMORY_ONLY_SER",
                        "storageLevelStreams": "MEMORY_ONLY", "collectTrainingStats": False, "rngSeed": None}

    def averagingFrequency(self, frequency: int):
        """Minibatches each worker fits between two averagings (DL4J: 5-10 is a safe choice)."""
        return self._set("averagingFrequency", _int("averagingFrequency", frequency))

    def aggregationDepth(self, depth: int):
        """Recorded: DL4J's tree-aggregation depth. Averaging here is a reduce-scatter among
        the workers, which puts no parameters through the driver at any depth."""
        return self._set("aggregationDepth", _int("aggregationDepth", depth))

    def saveUpdater(self, save: bool):
        """Average the updater state (momentum, Adam moments) too; if False every worker
        starts each round with a fresh updater, as DL4J does."""
        return self._set("saveUpdater", _bool("saveUpdater", save))

    def storageLevelStreams(self, level):
        """Persistence of an RDD of paths given to ``fitPaths`` (default ``MEMORY_ONLY``; None:
        none): persisted, its path strings are collected once and reused by later epochs,
        as DL4J persists it to read it once."""
        return self._set("storageLevelStreams", _storage_level("storageLevelStreams", level))

    def build(self) -> "ParameterAveragingTrainingMaster":
        """The :class:`ParameterAveragingTrainingMaster`."""
        v = self._values
        algorithm = ParameterAveraging(batch_size_per_worker=v["batchSizePerWorker"],
                                       averaging_frequency=v["averagingFrequency"],
                                       save_updater=v["saveUpdater"], update_scale=1.0, **self._common())
        return ParameterAveragingTrainingMaster(algorithm, rdd_data_set_num_examples=self._rdd_n,
                                                storage_level=v["storageLevel"], rng_seed=v["rngSeed"],
                                                settings=dict(v, numWorkers=self._num_workers))


_ParameterAveragingBuilder.__qualname__ = "ParameterAveragingTrainingMaster.Builder"


class ParameterAveragingTrainingMaster(TrainingMaster):
    """DL4J's synchronous parameter averaging: :class:`dlspark.ParameterAveraging` under DL4J's names.

    Examples
    --------
    >>> tm = (ParameterAveragingTrainingMaster.Builder(32).batchSizePerWorker(32)
    ...       .averagingFrequency(5).workerPrefetchNumBatches(2).build())
    >>> tm.algorithm.averaging_frequency
    5

    The replicas' steps are averaged at the updater's own rate, as DL4J does
    (``update_scale=1.0``; :class:`dlspark.ParameterAveraging`'s default scales them with the
    workers).
    """

    Builder = _ParameterAveragingBuilder


@with_snake_aliases
class _SharedBuilder(_MasterBuilder):
    """``SharedTrainingMaster.Builder([voidConfiguration,] rddDataSetNumExamples)``, DL4J's defaults.

    Defaults: threshold algorithm ``AdaptiveThresholdAlgorithm(1e-3)``, residual
    post-processor ``ResidualClippingPostProcessor(5, 5)``, ``workersPerNode``
    -1 (one worker per device), ``workerPrefetchNumBatches`` 2, Export,
    ``repartitionData`` Always, ``repartitionStrategy`` Balanced,
    ``workerTogglePeriodicGC`` off unless asked for (DL4J: on, every 5000 ms),
    ``encodingDebugMode`` False. ``batchSizePerWorker``: DL4J leaves it unset,
    training on the RDD's DataSets as they come, so it defaults to
    ``rddDataSetNumExamples`` (16 when that is not given either).
    """

    def __init__(self, *args):
        void = None
        rest = list(args)
        if rest and isinstance(rest[0], VoidConfiguration):
            void = rest.pop(0)
        elif rest and rest[0] is not None and not isinstance(rest[0], int):
            raise TypeError("SharedTrainingMaster.Builder takes ([voidConfiguration,] rddDataSetNumExamples), "
                            f"e.g. Builder(VoidConfiguration.builder().build(), 32); got a "
                            f"{type(rest[0]).__name__} first")
        threshold = AdaptiveThresholdAlgorithm(1e-3)
        workers = None
        if len(rest) == 3:  # DL4J's (voidConfiguration, numWorkers, thresholdAlgorithm, rddDataSetNumExamples)
            workers, threshold, rest = rest[0], _threshold(rest[1]), rest[2:]
        if len(rest) > 1:
            raise TypeError("SharedTrainingMaster.Builder takes ([voidConfiguration,] rddDataSetNumExamples); "
                            f"got {len(args)} arguments")
        self._rdd_n = _int("rddDataSetNumExamples", rest[0]) if rest else None
        self._num_workers = workers
        self._values = {"voidConfiguration": void if void is not None else VoidConfiguration(),
                        "batchSizePerWorker": self._rdd_n or 16, "thresholdAlgorithm": threshold,
                        "residualPostProcessor": ResidualClippingPostProcessor(5.0, 5), "workersPerNode": -1,
                        "workerPrefetchNumBatches": 2, "rddTrainingApproach": RDDTrainingApproach.Export,
                        "repartitionData": Repartition.Always, "repartitionStrategy": RepartitionStrategy.Balanced,
                        "storageLevel": "MEMORY_ONLY_SER", "workerTogglePeriodicGC": None,
                        "workerPeriodicGCFrequency": None, "encodingDebugMode": False,
                        "collectTrainingStats": False, "rngSeed": None, "meshBuildMode": None}

    def workersPerNode(self, n: int):
        """Training workers each machine contributes: ``n`` of the Dask workers on every host
        train (a fit on a cluster with fewer on some host is refused, naming it); below 1,
        DL4J's -1, every worker (one per device with ``dlspark.cluster.local_cluster``)."""
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"workersPerNode must be an int, got {n!r}")
        return self._set("workersPerNode", -1 if n < 1 else n)

    def thresholdAlgorithm(self, algorithm):
        """``AdaptiveThresholdAlgorithm(t)`` (default, t = 1e-3), ``FixedThresholdAlgorithm(t)`` or
        ``TargetSparsityThresholdAlgorithm(...)``."""
        return self._set("thresholdAlgorithm", _threshold(algorithm))

    def updatesThreshold(self, threshold: float):
        """Deprecated in DL4J: ``thresholdAlgorithm(AdaptiveThresholdAlgorithm(threshold))``."""
        return self.thresholdAlgorithm(AdaptiveThresholdAlgorithm(threshold))

    def residualPostProcessor(self, processor):
        """``ResidualClippingPostProcessor(5, 5)`` (default) or ``NoOpResidualPostProcessor()``."""
        from dlspark import NoResidualPostProcessing, ResidualClipping

        if not isinstance(processor, (ResidualClipping, NoResidualPostProcessing)):
            raise TypeError("residualPostProcessor takes ResidualClippingPostProcessor(thresholdMultiple, "
                            f"frequency) or NoOpResidualPostProcessor(), got {type(processor).__name__}")
        return self._set("residualPostProcessor", processor)

    def encodingDebugMode(self, debug: bool):
        """Record threshold, sparsity, message size and residual norm per worker and step
        (in each round's statistics, ``encoding_debug``)."""
        return self._set("encodingDebugMode", _bool("encodingDebugMode", debug))

    def meshBuildMode(self, mode):
        """``MeshBuildMode.MESH`` (a relay tree) or ``MeshBuildMode.PLAIN``; overrides the
        VoidConfiguration's (DL4J's documentation sets it on this builder too)."""
        return self._set("meshBuildMode", as_enum(MeshBuildMode, mode, "meshBuildMode"))

    def workerTogglePeriodicGC(self, enabled: bool):
        """Run a full collection of Python's garbage collector (``gc.collect()``) on every Dask
        worker every ``workerPeriodicGCFrequency`` ms (default 5000), as DL4J runs the JVM's;
        False leaves the collector to itself. Unlike DL4J (on unless turned off), it is off
        unless this or ``workerPeriodicGCFrequency`` is called: Python collects on its own,
        and a full collection stalls the worker (most during compilation)."""
        return self._set("workerTogglePeriodicGC", _bool("workerTogglePeriodicGC", enabled))

    def workerPeriodicGCFrequency(self, ms: int):
        """The period of the workers' garbage collection, in milliseconds (default 5000); setting
        it turns the collection on unless ``workerTogglePeriodicGC(False)`` says otherwise."""
        return self._set("workerPeriodicGCFrequency", _int("workerPeriodicGCFrequency", ms))

    def build(self) -> "SharedTrainingMaster":
        """The :class:`SharedTrainingMaster`."""
        v = self._values
        mode = v["meshBuildMode"] or v["voidConfiguration"].meshBuildMode
        algorithm = GradientSharing(batch_size_per_worker=v["batchSizePerWorker"],
                                    threshold_algorithm=v["thresholdAlgorithm"],
                                    residual_post_processor=v["residualPostProcessor"],
                                    workers_per_node=None if v["workersPerNode"] < 1 else v["workersPerNode"],
                                    encoding_debug=v["encodingDebugMode"], mesh=mode.value,
                                    # DL4J's workers apply their peers' updates as they arrive, and
                                    # their own as encoded, as their peers do
                                    # and send at their threshold from the first step (no warm-up)
                                    max_staleness=ASYNCHRONOUS_STALENESS, own_update="encoded", sparsity_warmup=(),
                                    **self._common())
        master = SharedTrainingMaster(algorithm, rdd_data_set_num_examples=self._rdd_n or v["batchSizePerWorker"],
                                      storage_level=v["storageLevel"], rng_seed=v["rngSeed"],
                                      settings=dict(v, numWorkers=self._num_workers))
        master.void_configuration = v["voidConfiguration"]
        return master


#: how far a worker runs ahead of its slowest peer under the SharedTrainingMaster: DL4J's
#: gradient sharing is asynchronous (dlspark's own default, 0, is synchronous delivery)
ASYNCHRONOUS_STALENESS = 4


def _threshold(algorithm):
    from dlspark import AdaptiveThreshold, FixedThreshold, TargetSparsityThreshold

    if not isinstance(algorithm, (AdaptiveThreshold, FixedThreshold, TargetSparsityThreshold)):
        raise TypeError("thresholdAlgorithm takes AdaptiveThresholdAlgorithm(t), FixedThresholdAlgorithm(t) or "
                        f"TargetSparsityThresholdAlgorithm(...), got {type(algorithm).__name__}")
    return algorithm


_SharedBuilder.__qualname__ = "SharedTrainingMaster.Builder"


class SharedTrainingMaster(TrainingMaster):
    """DL4J's gradient sharing: :class:`dlspark.GradientSharing` under DL4J's names.

    Attributes
    ----------
    void_configuration : VoidConfiguration
        As given (its ``meshBuildMode`` is used; its network fields are recorded).

    Examples
    --------
    >>> conf = VoidConfiguration.builder().unicastPort(40123).build()
    >>> tm = SharedTrainingMaster.Builder(conf, 32).batchSizePerWorker(32).updatesThreshold(1e-3).build()
    >>> tm.algorithm.threshold_algorithm.initial
    0.001
    """

    Builder = _SharedBuilder
