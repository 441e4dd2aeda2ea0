"""The distributed algorithms: masters, the round planner, averaging, and the Dask plugins.

The pure parts (``ParameterAveraging``, ``Coordinator``, ``average_leaves``)
import no Dask; the plugins live in private modules imported by the trainer.
"""

from ._averaging import average_leaves
from ._masters import ParameterAveraging
from ._plan import Coordinator, RoundPlan

__all__ = ["ParameterAveraging", "Coordinator", "RoundPlan", "average_leaves"]
