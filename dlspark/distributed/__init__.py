"""The distributed algorithms: masters, the round planner, averaging, and the Dask plugins.

The pure parts (``ParameterAveraging``, ``Coordinator``, ``average_leaves``)
import no Dask; the plugins live in private modules imported by the trainer.
"""

from ._averaging import average_leaves
from ._encoding import decode, threshold_encode
from ._masters import GradientSharing, ParameterAveraging
from ._plan import Coordinator, RoundPlan
from ._thresholds import (AdaptiveThreshold, FixedThreshold, NoResidualPostProcessing, ResidualClipping,
                          TargetSparsityThreshold, ThresholdState)

__all__ = ["ParameterAveraging", "GradientSharing", "Coordinator", "RoundPlan", "average_leaves",
           "threshold_encode", "decode", "AdaptiveThreshold", "TargetSparsityThreshold", "FixedThreshold",
           "ThresholdState", "ResidualClipping", "NoResidualPostProcessing"]
