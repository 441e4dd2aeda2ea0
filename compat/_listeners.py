"""DL4J's training listeners over the core trainer's ``callbacks``.

``sparkNet.setListeners(ScoreIterationListener(10))`` and the like. As in DL4J,
``iterationDone(model, iteration, epoch)`` is called once per iteration (one
minibatch a worker trained), with DL4J's numbering: ``iteration`` is the network's
iteration count before that minibatch, so a fit's calls count up one by one from the
count it started at. The workers record each minibatch's loss, examples and time
as they train; the rows travel to the driver in the round's statistics record (the
one record the core trainer streams from the scheduler to the client's
``callbacks``; nothing runs beside that mechanism), and the listeners are called
for each row as its round completes, the workers' k-th minibatches of a round
before their (k+1)-th. ``model.score()`` is that minibatch's loss and
``model.record`` the whole round's statistics.

``StatsListener`` with a ``FileStatsStorage(path)`` writes the training
statistics to ``path`` (any fsspec URL) as the rounds complete, as the JSON that
``dlspark stats path`` and :meth:`dlspark.stats.TrainingStats.load_json` read.
"""

from __future__ import annotations

import logging
import math

from ._names import with_snake_aliases

__all__ = ["TrainingListener", "BaseTrainingListener", "ScoreIterationListener", "PerformanceListener",
           "StatsListener", "FileStatsStorage", "StatsStorageRouter", "ListenerModel", "CheckpointListener",
           "dispatcher", "checkpoint_options"]

log = logging.getLogger("dlspark.compat")


@with_snake_aliases
class ListenerModel:
    """What a listener's ``model`` argument answers: the iteration's score and counters, and the
    :class:`dlspark.Network` (``getNetwork()``; its parameters are the fit's starting ones until
    the fit returns). ``row`` is the iteration's row of ``record["iterations"]`` (None around a
    fit: ``onEpochStart``/``onEpochEnd``)."""

    def __init__(self, network, record, iteration, epoch, row=None):
        self.network, self.record, self._iteration, self._epoch = network, dict(record), iteration, epoch
        self.row = row

    def score(self) -> float:
        """The iteration's minibatch loss (around a fit: the last round's mean loss over the
        workers; NaN if there is none)."""
        loss = self.record.get("loss") if self.row is None else self.row["loss"]
        return math.nan if loss is None else float(loss)

    def getIterationCount(self) -> int:
        """The iteration (DL4J's count before the minibatch)."""
        return self._iteration

    def getEpochCount(self) -> int:
        """The epoch the iteration belongs to."""
        return self._epoch

    def batchSize(self) -> int:
        """Examples in the iteration's minibatch (around a fit: per worker minibatch of the last
        round)."""
        if self.row is not None:
            return int(self.row["examples"])
        return int(self.record.get("examples", 0) // max(1, self.record.get("minibatches", 1)))

    def getNetwork(self):
        """The dlspark Network being trained."""
        return self.network


@with_snake_aliases
class TrainingListener:
    """DL4J's ``TrainingListener`` (and ``BaseTrainingListener``): override what you need.

    ``iterationDone(model, iteration, epoch)`` once per iteration (a minibatch one worker
    trained), ``onEpochStart(model)`` and ``onEpochEnd(model)`` around each ``fit`` (one epoch,
    as in DL4J's Spark training).
    """

    def iterationDone(self, model, iteration: int, epoch: int) -> None:
        """Called once per iteration, as the round it belongs to completes."""

    def onEpochStart(self, model) -> None:
        """Called before a fit's first round."""

    def onEpochEnd(self, model) -> None:
        """Called after a fit's last round."""


BaseTrainingListener = TrainingListener


@with_snake_aliases
class ScoreIterationListener(TrainingListener):
    """DL4J's ``ScoreIterationListener(printIterations)``: logs ``Score at iteration N is S`` (logger
    ``dlspark.compat``, level INFO) at every iteration that is a multiple of ``printIterations``
    (default 10)."""

    def __init__(self, printIterations: int = 10):
        if isinstance(printIterations, bool) or not isinstance(printIterations, int) or printIterations < 1:
            raise ValueError(f"printIterations must be an integer >= 1, got {printIterations!r}")
        self.print_iterations = printIterations

    def iterationDone(self, model, iteration, epoch):
        if iteration % self.print_iterations == 0:
            log.info("Score at iteration %d is %s", iteration, model.score())


@with_snake_aliases
class PerformanceListener(TrainingListener):
    """DL4J's ``PerformanceListener(frequency, reportScore)``: logs, every ``frequency``
    iterations, the iteration's time, its worker's examples and minibatches per second, the
    worker's wait for data per minibatch in the round (DL4J's ETL time) and, with
    ``reportScore``, the score. An iteration's time is its worker's fit time in the round
    shared equally among the round's minibatches (``dlspark.stats._record.iteration_rows``)."""

    def __init__(self, frequency: int = 1, reportScore: bool = False):
        if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
            raise ValueError(f"frequency must be an integer >= 1, got {frequency!r}")
        self.frequency, self.report_score, self._calls = frequency, bool(reportScore), 0

    def iterationDone(self, model, iteration, epoch):
        self._calls += 1
        if self._calls % self.frequency:
            return
        r, row = model.record, model.row or {}
        worker = row.get("worker")
        seconds = max(float(row.get("time", r.get("round_time", 0.0))), 1e-9)
        steps = max(1, (r.get("worker_steps") or {}).get(worker, 1))
        etl = float((r.get("data_wait") or {}).get(worker, 0.0)) / steps
        text = (f"ETL: {1000 * etl:.0f} ms; iteration {iteration}; iteration time: {1000 * seconds:.0f} ms; "
                f"samples/sec: {model.batchSize() / seconds:.3f}; batches/sec: {1 / seconds:.3f}")
        if self.report_score:
            text += f"; score: {model.score()}"
        log.info(text)


@with_snake_aliases
class StatsStorageRouter:
    """Where a :class:`StatsListener` sends the statistics (DL4J's ``StatsStorageRouter``)."""

    def putRounds(self, rounds, training_stats=None) -> None:
        """Store the rounds so far (and the core's full statistics, when collected)."""
        raise NotImplementedError


@with_snake_aliases
class FileStatsStorage(StatsStorageRouter):
    """DL4J's ``FileStatsStorage(file)``: the training statistics in one file at ``path`` (a path
    or fsspec URL), rewritten atomically after every round; open it with ``dlspark stats path``
    (or ``dlspark stats path --html report.html``)."""

    def __init__(self, path, storage_options=None):
        self.path = str(path)
        self.storage_options = dict(storage_options or {})

    def putRounds(self, rounds, training_stats=None) -> None:
        from dlspark.stats import TrainingStats

        stats = TrainingStats(rounds=rounds)
        if training_stats is not None and training_stats:  # events and clocks, when collected
            stats = TrainingStats(rounds=rounds, events=training_stats.events, clocks=training_stats.clocks,
                                  jobs=training_stats.jobs)
        stats.export_json(self.path, **self.storage_options)

    def __repr__(self):
        return f"FileStatsStorage({self.path!r})"


@with_snake_aliases
class StatsListener(TrainingListener):
    """DL4J's ``StatsListener(statsStorage[, listenerFrequency])``: sends the training statistics to
    a :class:`StatsStorageRouter` (``FileStatsStorage``) every ``listenerFrequency`` rounds and
    at the end of each fit. ``statsStorage`` may be None when ``setListeners`` is given one."""

    def __init__(self, statsStorage=None, listenerFrequency: int = 1):
        if statsStorage is not None and not isinstance(statsStorage, StatsStorageRouter):
            raise TypeError(f"StatsListener takes a FileStatsStorage (a StatsStorageRouter) or None, got "
                            f"{type(statsStorage).__name__}")
        self.storage, self.frequency = statsStorage, int(listenerFrequency)
        self.rounds: list = []
        self._trainer = None

    def roundDone(self, record) -> None:
        """Called with each round's statistics as the round completes (before its iterations)."""
        self.rounds.append(dict(record))
        if self.storage is not None and len(self.rounds) % self.frequency == 0:
            self.storage.putRounds(self.rounds)

    def onEpochEnd(self, model):
        if self.storage is not None:
            stats = getattr(self._trainer, "training_stats", None)
            self.storage.putRounds(self.rounds, stats)


class _CheckpointBuilder:
    """``CheckpointListener.Builder(rootDir)``: ``saveEveryEpoch()``, ``saveEveryNEpochs(n)``,
    ``saveEveryNIterations(n)``, ``keepAll()``, ``keepLast(n)``, then ``build()``."""

    def __init__(self, rootDir):
        self._root, self._epochs, self._iterations, self._keep = str(rootDir), None, None, None

    def _n(self, what, n):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{what} takes an integer >= 1, got {n!r}")
        return n

    def saveEveryEpoch(self):
        """A checkpoint after every fit (one epoch)."""
        return self.saveEveryNEpochs(1)

    def saveEveryNEpochs(self, n: int):
        """A checkpoint after every ``n`` fits."""
        self._epochs = self._n("saveEveryNEpochs", n)
        return self

    def saveEveryNIterations(self, n: int):
        """The core's checkpoint every round that ends ``n`` iterations or more after the last
        one (``checkpoint_every`` rounds, a round being workers x minibatches per round)."""
        self._iterations = self._n("saveEveryNIterations", n)
        return self

    def keepAll(self):
        """Keep every epoch checkpoint (the default)."""
        self._keep = None
        return self

    def keepLast(self, n: int):
        """Keep only the last ``n`` epoch checkpoints."""
        self._keep = self._n("keepLast", n)
        return self

    def build(self) -> "CheckpointListener":
        if self._epochs is None and self._iterations is None:
            raise ValueError("CheckpointListener.Builder(dir) needs saveEveryEpoch(), saveEveryNEpochs(n) or "
                             "saveEveryNIterations(n) before build()")
        return CheckpointListener(self._root, self._epochs, self._iterations, self._keep)


@with_snake_aliases
class CheckpointListener(TrainingListener):
    """DL4J's ``CheckpointListener``, built with ``CheckpointListener.Builder(rootDir)``.

    Epoch checkpoints are written on the driver after a fit, as
    ``checkpoint_<n>_epoch_<e>.dls`` under ``rootDir`` (any URL; ``keepLast`` prunes them).
    ``saveEveryNIterations`` maps onto the core's checkpoints during the fit
    (``checkpoint_every`` rounds, written by the workers to ``rootDir/checkpoint_latest.dls``,
    the file ``fit(..., resume_from=...)`` continues from). Restore a checkpoint into a network
    with ``ModelSerializer.restoreMultiLayerNetwork(url, network=net)``.
    """

    Builder = _CheckpointBuilder

    def __init__(self, root, every_epochs=None, every_iterations=None, keep_last=None):
        self.root, self.every_epochs, self.every_iterations, self.keep_last = root, every_epochs, every_iterations, \
            keep_last
        self._epochs = 0
        self._written: list = []

    @property
    def latest_url(self) -> str:
        """Where the core's in-fit checkpoints go."""
        from dlspark.io import url_join

        return url_join(self.root, "checkpoint_latest.dls")

    def onEpochEnd(self, model):
        from dlspark.io import url_join

        self._epochs += 1
        if not self.every_epochs or self._epochs % self.every_epochs:
            return
        net = model.getNetwork()
        url = url_join(self.root, f"checkpoint_{len(self._written)}_epoch_{net.epoch}.dls")
        net.save(url)
        self._written.append(url)
        while self.keep_last and len(self._written) > self.keep_last:
            _remove_file(self._written.pop(0))

    @staticmethod
    def availableCheckpoints(rootDir) -> list:
        """The epoch checkpoints under ``rootDir``, oldest first."""
        import fsspec

        fs, path = fsspec.core.url_to_fs(str(rootDir))
        found = [p for p in fs.ls(path, detail=False) if p.rsplit("/", 1)[-1].startswith("checkpoint_")
                 and "_epoch_" in p]
        urls = [p if "://" not in str(rootDir) else fs.unstrip_protocol(p) for p in found]
        return sorted(urls, key=lambda u: int(u.rsplit("/", 1)[-1].split("_")[1]))

    @staticmethod
    def lastCheckpoint(rootDir):
        """The newest epoch checkpoint under ``rootDir`` (None if there is none)."""
        found = CheckpointListener.availableCheckpoints(rootDir)
        return found[-1] if found else None


def _remove_file(url):
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    if fs.exists(path):
        fs.rm(path)


def checkpoint_options(listeners, master, n_workers) -> dict:
    """The core fit's ``checkpoint_every``/``checkpoint_url`` for a CheckpointListener that saves
    every N iterations (empty otherwise)."""
    for x in listeners:
        if isinstance(x, CheckpointListener) and x.every_iterations:
            per_round = n_workers * getattr(master, "averaging_frequency", getattr(master, "steps_per_round", 1))
            return {"checkpoint_every": max(1, x.every_iterations // max(1, per_round)),
                    "checkpoint_url": x.latest_url}
    return {}


def parse_listeners(args) -> tuple:
    """``setListeners``' arguments -> (router or None, [listeners]): DL4J's
    ``setListeners(listener, ...)``, ``setListeners([listeners])`` and
    ``setListeners(statsStorage, [listeners])``."""
    items = list(args)
    router = items.pop(0) if items and isinstance(items[0], StatsStorageRouter) else None
    if len(items) == 1 and isinstance(items[0], (list, tuple)):
        items = list(items[0])
    for x in items:
        if not isinstance(x, TrainingListener):
            missing = [m for m in ("iterationDone", "onEpochEnd") if not callable(getattr(x, m, None))]
            if missing:
                raise TypeError(f"setListeners takes DL4J-style listeners (ScoreIterationListener(10), "
                                f"PerformanceListener(1), StatsListener(FileStatsStorage(path)), or an object with "
                                f"iterationDone(model, iteration, epoch) and onEpochEnd(model)); a "
                                f"{type(x).__name__} has no {', '.join(missing)}")
    for x in items:
        if isinstance(x, StatsListener) and x.storage is None:
            if router is None:
                raise ValueError("StatsListener(None) needs a statsStorage: StatsListener(FileStatsStorage(path)) "
                                 "or setListeners(FileStatsStorage(path), [StatsListener(None)])")
            x.storage = router
    return router, items


def dispatcher(listeners, network, trainer):
    """The core ``callbacks`` entry that calls ``listeners`` for each round of one fit, and the
    function that calls their ``onEpochEnd`` after it: ``(callback, end)``."""
    base, state = network.iteration, {"last": None}
    for x in listeners:
        if isinstance(x, StatsListener):
            x._trainer = trainer
        if callable(getattr(x, "onEpochStart", None)):
            x.onEpochStart(ListenerModel(network, {}, network.iteration, network.epoch))

    def on_round(record):
        for x in listeners:
            if isinstance(x, StatsListener):
                x.roundDone(record)
        for row in record.get("iterations") or ():
            # DL4J's numbering: the network's iteration count before the minibatch
            iteration, epoch = base + int(row["fit_step"]), network.epoch + int(row["epoch"])
            model = state["last"] = ListenerModel(network, record, iteration, epoch, row)
            for x in listeners:
                x.iterationDone(model, iteration, epoch)

    def end():
        last = state["last"]
        model = ListenerModel(network, last.record if last else {}, network.iteration, network.epoch)
        for x in listeners:
            x.onEpochEnd(model)

    return on_round, end
