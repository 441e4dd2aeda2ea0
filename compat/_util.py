"""DL4J's helpers: SparkUtils (text files at any URL) and ModelSerializer (network files and streams)."""

from __future__ import annotations

import uuid

from dlspark import Network
from dlspark.io import read_bytes, read_text, write_bytes, write_text

from ._names import with_snake_aliases

__all__ = ["SparkUtils", "ModelSerializer"]


@with_snake_aliases
class SparkUtils:
    """DL4J's ``SparkUtils`` text helpers, over fsspec: any URL fsspec reaches (``file://``,
    ``s3://``, ``hdfs://`` with pyarrow installed, a local path). ``sc`` is accepted and unused."""

    @staticmethod
    def writeStringToFile(path: str, text: str, sc=None) -> None:
        """Write ``text`` (UTF-8) to ``path`` atomically (an evaluation's ``toJson()``, say)."""
        write_text(path, text)

    @staticmethod
    def readStringFromFile(path: str, sc=None) -> str:
        """Read the UTF-8 text at ``path``."""
        return read_text(path)


def _scratch_url():
    return f"memory://dlspark-compat/{uuid.uuid4().hex}.dls"


def _drop(url):
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    if fs.exists(path):
        fs.rm(path)


@with_snake_aliases
class ModelSerializer:
    """DL4J's ``ModelSerializer``: a network to a file (any URL) or a binary stream, and back.

    The file is dlspark's checkpoint (one zip: arrays, counters and the pickled
    definition; see the README). Restoring rebuilds the network from the
    stored definition: load only files you trust.
    """

    @staticmethod
    def writeModel(network: Network, url_or_stream, save_updater: bool = True) -> None:
        """Write ``network`` to a URL or path, or into a writable binary stream. Without
        ``save_updater`` the updater state (momentum, Adam moments) is stored fresh."""
        if not isinstance(network, Network):
            raise TypeError(f"writeModel takes a dlspark.Network, got {type(network).__name__}")
        if not save_updater:
            fresh = network.state.replace(opt_state=network.updater.init(network.state.params))
            network = Network.from_definition(network.definition(), state=fresh)
        if isinstance(url_or_stream, str):
            network.save(url_or_stream)
            return
        if not hasattr(url_or_stream, "write"):
            raise TypeError(f"writeModel writes to a URL (str) or a binary stream, got {type(url_or_stream).__name__}")
        url = _scratch_url()
        try:
            network.save(url)
            url_or_stream.write(read_bytes(url))
        finally:
            _drop(url)

    @staticmethod
    def restoreMultiLayerNetwork(url_or_stream, load_updater: bool = True) -> Network:
        """Read a network written by :meth:`writeModel` (a URL or path, or a readable binary stream)."""
        if isinstance(url_or_stream, str):
            network = Network.load(url_or_stream)
        elif hasattr(url_or_stream, "read"):
            url = _scratch_url()
            try:
                write_bytes(url, url_or_stream.read())
                network = Network.load(url)
            finally:
                _drop(url)
        else:
            raise TypeError(f"restore reads a URL (str) or a binary stream, got {type(url_or_stream).__name__}")
        if not load_updater:
            network.state = network.state.replace(opt_state=network.updater.init(network.state.params))
        return network

    @staticmethod
    def restoreComputationGraph(url_or_stream, load_updater: bool = True) -> Network:
        """:meth:`restoreMultiLayerNetwork` for a network with several inputs or outputs."""
        return ModelSerializer.restoreMultiLayerNetwork(url_or_stream, load_updater)


class StatsUtils:
    """DL4J's ``StatsUtils``: ``exportStatsAsHtml(stats, path, sc)`` writes the training
    statistics of :meth:`SparkDl4jMultiLayer.getSparkTrainingStats` as one standalone HTML
    page (the core's ``TrainingStats.export_html``: the timeline, per worker, with its
    plotting scripts inlined). ``sc`` is accepted and unused."""

    @staticmethod
    def exportStatsAsHtml(stats, path: str, sc=None) -> None:
        core = getattr(stats, "training_stats", stats)
        if core is None or not hasattr(core, "export_html"):
            raise TypeError("exportStatsAsHtml takes the statistics of getSparkTrainingStats() (collected with "
                            f"setCollectTrainingStats(True)), got {type(stats).__name__}")
        core.export_html(path)
