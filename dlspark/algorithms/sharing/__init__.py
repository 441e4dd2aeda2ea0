"""Gradient sharing (Strom 2015): the master, pure numerics, worker run and round driver.

- ``_master``: :class:`GradientSharing`, the configuration and plug-in hooks;
- ``_encoding``, ``_thresholds``: threshold encoding with residuals, threshold
  algorithms and residual post-processors (pure);
- ``_state``: a worker's residual, inbox and step loop; ``_run``: its orders and peer requests;
- ``_driver``: the scheduler side (a round's end, and the sync plan where a round needs one);
  ``_topology``: the relay tree.
"""

from ._encoding import decode, threshold_encode
from ._master import GradientSharing
from ._thresholds import (AdaptiveThreshold, FixedThreshold, NoResidualPostProcessing, ResidualClipping,
                          ResidualPostProcessor, TargetSparsityThreshold, ThresholdAlgorithm, ThresholdState)

__all__ = ["GradientSharing", "threshold_encode", "decode", "AdaptiveThreshold", "TargetSparsityThreshold",
           "FixedThreshold", "ThresholdState", "ResidualClipping", "NoResidualPostProcessing", "ThresholdAlgorithm",
           "ResidualPostProcessor"]
