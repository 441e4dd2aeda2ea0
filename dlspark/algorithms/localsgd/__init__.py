"""Local SGD with a bfloat16 pseudo-gradient and error feedback: an algorithm written only
against the public extension point :class:`~dlspark.algorithms.replica.ReplicaAlgorithm`.

- ``_master``: :class:`LocalSGD`, its settings and its replica's round (pure JAX).
"""

from ._master import LocalSGD

__all__ = ["LocalSGD"]
