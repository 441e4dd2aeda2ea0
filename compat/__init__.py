"""DL4J-on-Spark's API over dlspark: keep the SparkContext, the RDDs and the calls; train on Dask.

``SparkDl4jMultiLayer(sc, network, trainingMaster)`` and ``SparkComputationGraph``
wrap a :class:`dlspark.Network`; ``ParameterAveragingTrainingMaster.Builder`` and
``SharedTrainingMaster.Builder`` build :class:`dlspark.ParameterAveraging` and
:class:`dlspark.GradientSharing` with DL4J's defaults. Names are DL4J's
(camelCase), each with a snake_case alias.

Training runs on a Dask cluster (:func:`configure`, else the Spark
configuration key ``spark.dlspark.scheduler``, else an embedded
LocalCluster); an RDD of DataSets reaches it as minibatch files the Spark
executors write, an RDD of paths as its path strings. Evaluation, scoring and
keyed inference of RDDs run on the Spark executors, where the data is.

This package only translates names and calls; the pyspark execution lives in
``dlspark.spark``. Importing it does not import pyspark. ``NetworkEstimator``
and ``NetworkModel`` (a ``pyspark.ml`` Estimator and Model, dlspark's own
extension) load pyspark on first use.

Examples
--------
>>> from dlspark.compat import ParameterAveragingTrainingMaster, SparkDl4jMultiLayer
>>> tm = ParameterAveragingTrainingMaster.Builder(32).batchSizePerWorker(32).averagingFrequency(5).build()
>>> spark_net = SparkDl4jMultiLayer(sc, net, tm)  # doctest: +SKIP
>>> for epoch in range(5):  # doctest: +SKIP
...     spark_net.fit(train_rdd)
"""

from ._cluster import SCHEDULER_CONF_KEY, configure
from ._conf import (AdaptiveThresholdAlgorithm, FixedThresholdAlgorithm, MeshBuildMode, NoOpResidualPostProcessor,
                    RDDTrainingApproach, Repartition, RepartitionStrategy, ResidualClippingPostProcessor,
                    TargetSparsityThresholdAlgorithm, VoidConfiguration)
from ._evaluation import (ROC, Counter, Evaluation, EvaluationAveraging, EvaluationBinary, EvaluationCalibration,
                          RegressionEvaluation, ROCBinary, ROCMultiClass)
from ._masters import ParameterAveragingTrainingMaster, SharedTrainingMaster, TrainingMaster
from ._networks import SparkComputationGraph, SparkDl4jMultiLayer, SparkTrainingStats
from ._listeners import (BaseTrainingListener, CheckpointListener, FileStatsStorage, PerformanceListener,
                         ScoreIterationListener, StatsListener, StatsStorageRouter, TrainingListener)
from ._util import BatchAndExportDataSetsFunction, DataSetExportFunction, ModelSerializer, SparkUtils, StatsUtils
from ._rnn import RNNFormat
from ._earlystopping import (BestScoreEpochTerminationCondition, DataSetLossCalculator, EarlyStoppingConfiguration,
                             EarlyStoppingListener, EarlyStoppingResult, InMemoryModelSaver,
                             InvalidScoreIterationTerminationCondition, LocalFileModelSaver,
                             MaxEpochsTerminationCondition, MaxScoreIterationTerminationCondition,
                             MaxTimeIterationTerminationCondition, ScoreImprovementEpochTerminationCondition,
                             SparkDataSetLossCalculator, SparkEarlyStoppingGraphTrainer, SparkEarlyStoppingTrainer,
                             SparkLossCalculatorComputationGraph, TerminationReason, TimeUnit)

__all__ = [
    "configure",
    "SCHEDULER_CONF_KEY",
    "SparkDl4jMultiLayer",
    "SparkComputationGraph",
    "TrainingMaster",
    "ParameterAveragingTrainingMaster",
    "SharedTrainingMaster",
    "RDDTrainingApproach",
    "Repartition",
    "RepartitionStrategy",
    "VoidConfiguration",
    "MeshBuildMode",
    "AdaptiveThresholdAlgorithm",
    "FixedThresholdAlgorithm",
    "TargetSparsityThresholdAlgorithm",
    "ResidualClippingPostProcessor",
    "NoOpResidualPostProcessor",
    "SparkTrainingStats",
    "SparkUtils",
    "StatsUtils",
    "ModelSerializer",
    "Evaluation",
    "EvaluationBinary",
    "ROC",
    "ROCBinary",
    "ROCMultiClass",
    "RegressionEvaluation",
    "EvaluationCalibration",
    "EvaluationAveraging",
    "Counter",
    "DataSetExportFunction",
    "BatchAndExportDataSetsFunction",
    "TrainingListener",
    "BaseTrainingListener",
    "ScoreIterationListener",
    "PerformanceListener",
    "StatsListener",
    "StatsStorageRouter",
    "FileStatsStorage",
    "CheckpointListener",
    "RNNFormat",
    "SparkEarlyStoppingTrainer",
    "SparkEarlyStoppingGraphTrainer",
    "EarlyStoppingConfiguration",
    "EarlyStoppingResult",
    "EarlyStoppingListener",
    "TerminationReason",
    "MaxEpochsTerminationCondition",
    "ScoreImprovementEpochTerminationCondition",
    "BestScoreEpochTerminationCondition",
    "MaxTimeIterationTerminationCondition",
    "MaxScoreIterationTerminationCondition",
    "InvalidScoreIterationTerminationCondition",
    "TimeUnit",
    "InMemoryModelSaver",
    "LocalFileModelSaver",
    "DataSetLossCalculator",
    "SparkDataSetLossCalculator",
    "SparkLossCalculatorComputationGraph",
    "NetworkEstimator",
    "NetworkModel",
]

#: names whose module imports pyspark, loaded on first use
_LAZY = {"NetworkEstimator": "._ml", "NetworkModel": "._ml"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
