"""DL4J's helpers: SparkUtils (text files and listings at any URL), the export functions (an RDD of
DataSets to minibatch files), ModelSerializer (network files and streams), StatsUtils."""

from __future__ import annotations

import uuid

from dlspark import Network
from dlspark.io import read_bytes, read_text, url_join, write_bytes, write_text

from ._names import with_snake_aliases

__all__ = ["SparkUtils", "ModelSerializer", "StatsUtils", "DataSetExportFunction",
           "BatchAndExportDataSetsFunction"]


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

    @staticmethod
    def listPaths(sc, path: str, recursive: bool = False, allowedExtensions=None, storage_options=None):
        """DL4J's ``listPaths(sc, path[, recursive[, allowedExtensions]])``: an RDD of the paths of
        the files under the directory ``path`` (any fsspec URL), sorted, hidden files left out.

        ``allowedExtensions`` keeps files with those extensions (``"npz"`` or ``".npz"``).
        The listing runs on the driver, as DL4J's does; only names are read.
        """
        import fsspec

        if not isinstance(path, str):
            raise TypeError(f"listPaths takes a directory path or URL (str), got {type(path).__name__}")
        fs, root = fsspec.core.url_to_fs(path, **(storage_options or {}))
        if not fs.isdir(root):
            raise FileNotFoundError(f"listPaths: {path!r} is not a directory")
        found = fs.find(root) if recursive else [p for p in fs.ls(root, detail=False) if fs.isfile(p)]
        keep = None if allowedExtensions is None else {"." + e.lstrip(".") for e in allowedExtensions}
        names = [p for p in found if not p.rsplit("/", 1)[-1].startswith(".")
                 and (keep is None or ("." + p.rsplit(".", 1)[-1]) in keep)]
        local = "://" not in path
        urls = sorted(p if local else fs.unstrip_protocol(p) for p in names)
        return sc.parallelize(urls, max(1, min(len(urls), sc.defaultParallelism)))


def _checked(what, x):
    from dlspark.data import DataSet, MultiDataSet

    if not isinstance(x, (DataSet, MultiDataSet)):
        raise TypeError(f"{what} takes an RDD of DataSets or MultiDataSets; found an element of type "
                        f"{type(x).__name__}")
    return x


class DataSetExportFunction:
    """DL4J's ``DataSetExportFunction(outputDir)``: ``rdd.foreachPartition(DataSetExportFunction(dir))``
    writes every DataSet (or MultiDataSet) of the RDD as one minibatch file under ``dir``
    (any URL every executor reaches), named ``dataset_<unique>_<n>.npz``; train from them
    with ``fitPaths(SparkUtils.listPaths(sc, dir))``. Runs on the executors.
    """

    def __init__(self, outputDir: str, storage_options=None):
        if not isinstance(outputDir, str):
            raise TypeError(f"outputDir must be a directory URL (str), got {type(outputDir).__name__}")
        self.output_dir = outputDir
        self.storage_options = dict(storage_options or {})

    def __call__(self, iterator):
        from dlspark.data import save_dataset

        prefix = uuid.uuid4().hex
        for n, ds in enumerate(iterator):
            save_dataset(_checked("DataSetExportFunction", ds),
                         url_join(self.output_dir, f"dataset_{prefix}_{n}.npz"), **self.storage_options)


class BatchAndExportDataSetsFunction:
    """DL4J's ``BatchAndExportDataSetsFunction(minibatchSize, exportBaseDirectory)``:
    ``rdd.mapPartitionsWithIndex(f)`` cuts each partition into minibatches of exactly
    ``minibatchSize`` examples (the last may be smaller), merging small DataSets and
    splitting big ones, writes them under the directory and yields their paths.
    """

    def __init__(self, minibatchSize: int, exportBaseDirectory: str, storage_options=None):
        if isinstance(minibatchSize, bool) or not isinstance(minibatchSize, int) or minibatchSize < 1:
            raise ValueError(f"minibatchSize must be an integer >= 1, got {minibatchSize!r}")
        if not isinstance(exportBaseDirectory, str):
            raise TypeError(f"exportBaseDirectory must be a directory URL (str), got "
                            f"{type(exportBaseDirectory).__name__}")
        self.minibatch_size, self.directory = minibatchSize, exportBaseDirectory
        self.storage_options = dict(storage_options or {})

    def __call__(self, index, iterator):
        from dlspark.data import save_dataset

        prefix, n, pending, held = uuid.uuid4().hex, 0, [], 0

        def write(ds):
            nonlocal n
            url = url_join(self.directory, f"dataset_{index}_{prefix}_{n}.npz")
            n += 1
            return save_dataset(ds, url, **self.storage_options)

        for ds in iterator:
            pending.append(_checked("BatchAndExportDataSetsFunction", ds))
            held += len(ds)
            if held >= self.minibatch_size:
                merged = type(ds).merge(pending)
                full = held - held % self.minibatch_size
                for b in merged[:full].batches(self.minibatch_size):
                    yield write(b)
                pending, held = ([merged[full:]] if full < held else []), held - full
        if held:
            yield write(type(pending[0]).merge(pending))


def _scratch_url():
    return f"memory://dlspark-compat/{uuid.uuid4().hex}.dls"


def _drop(url):
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    if fs.exists(path):
        fs.rm(path)


_RESTORE_HELP = (
    "{name} rebuilds a network from the file only when told to trust it: the file's stored "
    "definition is a pickle, and unpickling it runs whatever code it holds. Pass the network to "
    "load the arrays into (its model, loss and updater built by your code; nothing from the file "
    "runs), e.g. ModelSerializer.{name}(path, True, network=dlspark.Network(model, ...)), or "
    "trusted=True for a file you trust ({name}(path, trusted=True), as Network.load does)"
)


def _read_all(url_or_stream, name) -> tuple:
    """``(bytes, where)`` from a URL or path, or from a readable binary stream."""
    if isinstance(url_or_stream, str):
        return read_bytes(url_or_stream), url_or_stream
    if hasattr(url_or_stream, "read"):
        return url_or_stream.read(), f"<{type(url_or_stream).__name__}>"
    raise TypeError(f"{name} reads a URL (str) or a binary stream, got {type(url_or_stream).__name__}")


def _restore(name, url_or_stream, load_updater, network, trusted) -> Network:
    if network is not None and not isinstance(network, Network):
        raise TypeError(f"network must be the dlspark.Network to load the arrays into, got {type(network).__name__}")
    if not isinstance(trusted, bool):
        raise TypeError(f"trusted must be True or False, got {trusted!r}")
    if network is not None and trusted:
        raise ValueError(f"{name} takes network= (the arrays only: nothing from the file runs) or trusted=True "
                         "(the network rebuilt from the file's pickled definition), not both")
    if network is None and not trusted:
        raise TypeError(_RESTORE_HELP.format(name=name))
    if network is not None:
        from dlspark.checkpoint import state_from_bytes
        from dlspark.errors import CheckpointError

        try:
            raw, where = _read_all(url_or_stream, name)
        except FileNotFoundError:
            raise CheckpointError(str(url_or_stream), "file not found") from None
        # Only the archive's JSON metadata and its npz arrays (allow_pickle=False) are read.
        restored = Network.from_definition(network.definition(), state=state_from_bytes(raw, network.state, where))
    elif isinstance(url_or_stream, str):
        restored = Network.load(url_or_stream)
    else:
        raw, _ = _read_all(url_or_stream, name)
        url = _scratch_url()
        try:
            write_bytes(url, raw)
            restored = Network.load(url)
        finally:
            _drop(url)
    if not load_updater:
        restored.state = restored.state.replace(opt_state=restored.updater.init(restored.state.params))
    return restored


@with_snake_aliases
class ModelSerializer:
    """DL4J's ``ModelSerializer``: a network to a file (any URL) or a binary stream, and back.

    The file is dlspark's checkpoint (one zip: JSON metadata, the arrays as
    ``.npz`` and the network's definition as a cloudpickle). Restoring reads
    the arrays into a network the caller builds (``network=``), and nothing
    from the file runs, as DL4J's model zips are data. Rebuilding the network
    from the file's own definition unpickles it, which runs whatever code the
    file holds: it is done only with ``trusted=True``, for files you trust
    (:meth:`dlspark.Network.load` on the core's face; :meth:`dlspark.Network.restore`
    is its arrays-only load).
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
    def restoreMultiLayerNetwork(url_or_stream, load_updater: bool = True, *, network: Network | None = None,
                                 trusted: bool = False) -> Network:
        """Read a network written by :meth:`writeModel` (a URL or path, or a readable binary stream).

        Parameters
        ----------
        url_or_stream : str or binary stream
        load_updater : bool
            Keep the stored updater state (momentum, Adam moments); without, it starts fresh.
        network : dlspark.Network, optional
            The network whose structure the file's arrays fill: a new network
            with its model, loss and updater and the file's arrays is returned,
            ``network`` itself is left as it was. Nothing from the file is
            executed (its arrays are read with ``allow_pickle=False``); a file
            from another architecture is refused by name
            (:class:`~dlspark.errors.CheckpointError`).
        trusted : bool
            Without ``network``: rebuild the network from the file's pickled
            definition, which runs the code the file holds. For files you
            trust only.

        Examples
        --------
        >>> net = dlspark.Network(model, loss="softmax_cross_entropy", updater=optax.adam(1e-3))  # doctest: +SKIP
        >>> restored = ModelSerializer.restoreMultiLayerNetwork("model.dls", True, network=net)  # doctest: +SKIP
        >>> mine = ModelSerializer.restoreMultiLayerNetwork("model.dls", trusted=True)  # my own file  # doctest: +SKIP
        """
        return _restore("restoreMultiLayerNetwork", url_or_stream, load_updater, network, trusted)

    @staticmethod
    def restoreComputationGraph(url_or_stream, load_updater: bool = True, *, network: Network | None = None,
                                trusted: bool = False) -> Network:
        """:meth:`restoreMultiLayerNetwork` for a network with several inputs or outputs (the same
        ``network=`` and ``trusted=``)."""
        return _restore("restoreComputationGraph", url_or_stream, load_updater, network, trusted)


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
