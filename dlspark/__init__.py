"""dlspark: data-parallel deep-learning training on Dask, in the manner of DL4J on Spark.

The public surface is re-exported here; submodules ``dlspark.data``,
``dlspark.datasets``, ``dlspark.losses``, ``dlspark.io`` and ``dlspark.errors``
hold the rest.
"""

from . import config, data, datasets, errors, evaluation, io, losses
from .data import DataSet, MultiDataSet
from .model import Model
from .algorithms import (AdaptiveThreshold, FixedThreshold, GradientSharing, NoResidualPostProcessing,
                          ParameterAveraging, ResidualClipping, TargetSparsityThreshold)
from .network import Network, TrainState
from .trainer import DistributedTrainer
from .parallel import ParallelWrapper
from . import spark  # noqa: F401  (registers the pyspark RDD source; it imports no pyspark)

__version__ = "0.1.0"

__all__ = [
    "Model",
    "Network",
    "TrainState",
    "DistributedTrainer",
    "ParallelWrapper",
    "ParameterAveraging",
    "GradientSharing",
    "AdaptiveThreshold",
    "TargetSparsityThreshold",
    "FixedThreshold",
    "ResidualClipping",
    "NoResidualPostProcessing",
    "DataSet",
    "MultiDataSet",
    "config",
    "data",
    "datasets",
    "errors",
    "evaluation",
    "io",
    "losses",
]
