"""Synchronous parameter averaging: the master, pure numerics, worker run and round driver.

- ``_master``: :class:`ParameterAveraging`, the configuration and plug-in hooks;
- ``_numerics``: the mean (host reference, on device, in shares) and the outer step;
- ``_run``: the worker side (fit, then average with the round's contributors);
- ``_driver``: the scheduler side (when a round is averaged, and over whom).
"""

from ._master import ParameterAveraging
from ._numerics import average_leaves, average_on_device, outer_step

__all__ = ["ParameterAveraging", "average_leaves", "average_on_device", "outer_step"]
