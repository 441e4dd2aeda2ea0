"""The engine: generic Dask plugins, the job state machine, typed messages, the job client.

Nothing here knows an algorithm: each is a plug-in in :mod:`dlspark.algorithms`
(its master creates its round driver and worker run). The pure parts
(``JobMachine``, ``Coordinator``) import no Dask; the plugins live in private
modules. The masters, threshold algorithms and codecs are also reachable here
for code written against earlier releases (imported on first use: the
algorithms import this package's messages).
"""

from ._machine import JobMachine
from ._plan import Coordinator, RoundPlan

_ALGORITHMS = {"ParameterAveraging": "algorithms", "GradientSharing": "algorithms", "AdaptiveThreshold": "algorithms",
               "TargetSparsityThreshold": "algorithms", "FixedThreshold": "algorithms",
               "ThresholdState": "algorithms", "ResidualClipping": "algorithms",
               "NoResidualPostProcessing": "algorithms", "average_leaves": "algorithms.averaging",
               "threshold_encode": "algorithms.sharing", "decode": "algorithms.sharing"}

__all__ = ["JobMachine", "Coordinator", "RoundPlan", *_ALGORITHMS]


def __getattr__(name):
    if name in _ALGORITHMS:
        import importlib

        return getattr(importlib.import_module(f"dlspark.{_ALGORITHMS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
