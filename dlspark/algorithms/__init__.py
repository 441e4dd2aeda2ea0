"""The distributed algorithms, one plug-in each.

An algorithm is a package with its master (the frozen configuration the user
builds, which is also the plug-in: see :class:`~dlspark.algorithms._base.Algorithm`),
its pure numerics, its worker-side run and its scheduler-side round driver. The
engine (``dlspark.distributed``) routes by job and never asks which one it runs.
"""

from ._base import Algorithm, RoundDriver
from .averaging import ParameterAveraging
from .localsgd import LocalSGD
from .replica import ReplicaAlgorithm, ReplicaFigures
from .sharing import (AdaptiveThreshold, FixedThreshold, GradientSharing, NoResidualPostProcessing, ResidualClipping,
                      ResidualPostProcessor, TargetSparsityThreshold, ThresholdAlgorithm, ThresholdState)

__all__ = ["Algorithm", "RoundDriver", "ParameterAveraging", "GradientSharing", "AdaptiveThreshold",
           "TargetSparsityThreshold", "FixedThreshold", "ThresholdState", "ResidualClipping",
           "NoResidualPostProcessing", "ThresholdAlgorithm", "ResidualPostProcessor", "ReplicaAlgorithm",
           "ReplicaFigures", "LocalSGD"]
