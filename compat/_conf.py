"""DL4J's configuration vocabulary: enums, VoidConfiguration, threshold algorithms, residual post-processors.

The threshold algorithms and post-processors are the core's classes
(``dlspark.AdaptiveThreshold``, ...) under DL4J's names, with DL4J's
defaults written out here, so that a change of the core's defaults does not
change what a DL4J-shaped program trains with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dlspark.algorithms import (AdaptiveThreshold, FixedThreshold, NoResidualPostProcessing, ResidualClipping,
                                TargetSparsityThreshold)
from dlspark.algorithms.sharing._thresholds import DEFAULT_DECAY

from ._names import Builder, DL4JEnum, as_enum, with_snake_aliases

__all__ = ["RDDTrainingApproach", "Repartition", "RepartitionStrategy", "MeshBuildMode", "VoidConfiguration",
           "AdaptiveThresholdAlgorithm", "TargetSparsityThresholdAlgorithm", "FixedThresholdAlgorithm",
           "ResidualClippingPostProcessor", "NoOpResidualPostProcessor"]


class RDDTrainingApproach(DL4JEnum):
    """How ``fit`` trains from an RDD of DataSets.

    ``Export`` (default): the Spark executors write the RDD as minibatch files
    (``mapPartitions``) and the Dask workers train from them; no array passes
    through the driver. ``Direct``: the minibatches are collected to the driver
    and scattered into the Dask workers' memory; refused above
    ``dlspark.spark.direct-max-bytes`` (128 MiB by default) or
    ``spark.driver.maxResultSize``, whichever is smaller.
    """

    Export = "export"
    Direct = "direct"


class Repartition(DL4JEnum):
    """When minibatches are rebalanced across workers (the core's ``repartition``)."""

    Always = "always"
    Never = "never"
    NumPartitionsWorkersDiffers = "num_partitions_workers_differs"


class RepartitionStrategy(DL4JEnum):
    """How minibatches are rebalanced across workers (the core's ``repartition_strategy``)."""

    Balanced = "balanced"
    SparkDefault = "spark_default"


class MeshBuildMode(DL4JEnum):
    """How gradient-sharing workers pass messages: ``PLAIN`` (every worker to every peer) or
    ``MESH`` (a relay tree, the core's ``mesh="tree"``, for large clusters)."""

    PLAIN = "plain"
    MESH = "tree"


# -- VoidConfiguration ------------------------------------------------------------------------------
@dataclass(frozen=True)
class VoidConfiguration:
    """DL4J's parameter-server network settings, accepted and recorded.

    On Dask, workers reach each other through the scheduler's registry of
    addresses, so the ports, network mask and controller address that Aeron
    needed in DL4J are not used (a configuration without a controller is
    fine). ``meshBuildMode`` is used: ``MESH`` relays gradient-sharing
    messages along a tree (``GradientSharing(mesh="tree")``), ``PLAIN`` sends
    each to every peer. Build one with
    ``VoidConfiguration.builder().unicastPort(40123).networkMask("10.0.0.0/16").build()``.
    """

    unicastPort: int = 49876
    networkMask: str | None = None
    controllerAddress: str | None = None
    meshBuildMode: MeshBuildMode = MeshBuildMode.PLAIN
    streamId: int = 119
    multicastPort: int = 59876
    multicastNetwork: str = "224.0.1.1"
    numberOfShards: int = 1
    shardAddresses: tuple = field(default_factory=tuple)
    backupAddresses: tuple = field(default_factory=tuple)
    ttl: int = 4
    retransmitTimeout: int = 1000
    responseTimeout: int = 30000
    chunksBufferSize: int = 1073741824
    maxChunkSize: int = 65536

    def __post_init__(self):
        object.__setattr__(self, "meshBuildMode", as_enum(MeshBuildMode, self.meshBuildMode, "meshBuildMode"))

    @staticmethod
    def builder() -> "VoidConfigurationBuilder":
        """A builder with DL4J's defaults: ``VoidConfiguration.builder().unicastPort(40123).build()``."""
        return VoidConfigurationBuilder()


@with_snake_aliases
class VoidConfigurationBuilder(Builder):
    """Sets :class:`VoidConfiguration` fields one call at a time; :meth:`build` makes it."""

    def __init__(self):
        self._values = {}

    def _set(self, name, value):
        self._values[name] = value
        return self

    def unicastPort(self, port: int):
        """The UDP port DL4J's workers used (recorded; Dask picks its own ports)."""
        return self._set("unicastPort", port)

    def networkMask(self, mask: str):
        """The network DL4J bound Aeron to, e.g. ``"10.0.0.0/16"`` (recorded)."""
        return self._set("networkMask", mask)

    def controllerAddress(self, address: str):
        """The driver's IP in DL4J (recorded; the Dask scheduler plays that part)."""
        return self._set("controllerAddress", address)

    def meshBuildMode(self, mode):
        """``MeshBuildMode.MESH`` (relay tree) or ``MeshBuildMode.PLAIN`` (every peer)."""
        return self._set("meshBuildMode", as_enum(MeshBuildMode, mode, "meshBuildMode"))

    def streamId(self, value: int):
        """Aeron's stream id (recorded)."""
        return self._set("streamId", value)

    def multicastPort(self, value: int):
        """The multicast port (recorded)."""
        return self._set("multicastPort", value)

    def multicastNetwork(self, value: str):
        """The multicast network (recorded)."""
        return self._set("multicastNetwork", value)

    def numberOfShards(self, value: int):
        """Parameter-server shards (recorded)."""
        return self._set("numberOfShards", value)

    def shardAddresses(self, addresses):
        """Shard addresses (recorded)."""
        return self._set("shardAddresses", tuple(addresses))

    def backupAddresses(self, addresses):
        """Backup addresses (recorded)."""
        return self._set("backupAddresses", tuple(addresses))

    def ttl(self, value: int):
        """Multicast time to live (recorded)."""
        return self._set("ttl", value)

    def retransmitTimeout(self, ms: int):
        """Aeron's retransmit timeout in ms (recorded)."""
        return self._set("retransmitTimeout", ms)

    def responseTimeout(self, ms: int):
        """Aeron's response timeout in ms (recorded)."""
        return self._set("responseTimeout", ms)

    def chunksBufferSize(self, size: int):
        """Aeron's chunk buffer size (recorded)."""
        return self._set("chunksBufferSize", size)

    def maxChunkSize(self, size: int):
        """Aeron's largest message chunk (recorded)."""
        return self._set("maxChunkSize", size)

    def build(self) -> VoidConfiguration:
        """The :class:`VoidConfiguration`."""
        return VoidConfiguration(**self._values)


# -- threshold algorithms and residual post-processors ----------------------------------------------
@dataclass(frozen=True)
class AdaptiveThresholdAlgorithm(AdaptiveThreshold):
    """DL4J's ``AdaptiveThresholdAlgorithm(initialThreshold, minTargetSparsity, maxTargetSparsity, decayRate)``.

    Keeps each step's sparsity within ``[min_sparsity, max_sparsity]`` by
    multiplying or dividing the threshold by ``decay``. Defaults: initial
    threshold 1e-3 (what DL4J's documentation, its examples and its
    ``updatesThreshold`` use; the constant in DL4J's class reads 1e-4), band
    [1e-4, 1e-2], decay 0.5**(1/20) (halving or doubling over 20 steps).
    """

    initial: float = 1e-3
    min_sparsity: float = 1e-4
    max_sparsity: float = 1e-2
    decay: float = DEFAULT_DECAY


@dataclass(frozen=True)
class TargetSparsityThresholdAlgorithm(TargetSparsityThreshold):
    """DL4J's ``TargetSparsityThresholdAlgorithm(initialThreshold, sparsityTarget, decayRate)``:
    steer each step's sparsity toward ``target`` (defaults 1e-4, 1e-3, 0.5**(1/20), DL4J's)."""

    initial: float = 1e-4
    target: float = 1e-3
    decay: float = DEFAULT_DECAY


@dataclass(frozen=True)
class FixedThresholdAlgorithm(FixedThreshold):
    """DL4J's ``FixedThresholdAlgorithm(threshold)``: the same threshold at every step."""

    initial: float = 1e-3


@dataclass(frozen=True)
class ResidualClippingPostProcessor(ResidualClipping):
    """DL4J's ``ResidualClippingPostProcessor(thresholdMultipleClipValue, frequency)``: every
    ``frequency`` steps, clip the residual to ``±threshold_multiple`` thresholds (DL4J: 5, 5)."""

    threshold_multiple: float = 5.0
    frequency: int = 5


@dataclass(frozen=True)
class NoOpResidualPostProcessor(NoResidualPostProcessing):
    """DL4J's ``NoOpResidualPostProcessor``: the residual is left as it is."""
