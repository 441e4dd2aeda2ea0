"""DL4J's early stopping on Spark (``org.deeplearning4j.spark.earlystopping``) over compat's networks.

``SparkEarlyStoppingTrainer(sc, trainingMaster, esConfig, network, trainRDD).fit()``
trains one epoch at a time with :class:`~dlspark.compat.SparkDl4jMultiLayer` (the
Dask cluster trains; the RDD is exported once and its files reused by every epoch),
scores the network after every ``evaluateEveryNEpochs`` epochs with the
configuration's score calculator, hands the best network so far to the model
saver and stops when an epoch or iteration termination condition says so. It
returns an :class:`EarlyStoppingResult`, whose ``getBestModel()`` is the network
with the best epoch's parameters.

As in DL4J's Spark trainer, iteration termination conditions are checked after
each epoch's fit: here against every iteration's score of that epoch (the
per-iteration listener rows), in order, so that a non-finite or too-high score
anywhere in the epoch stops the training after it.
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp

from dlspark import Network

from ._listeners import TrainingListener
from ._names import Builder, DL4JEnum, with_snake_aliases
from ._termination import (BestScoreEpochTerminationCondition, EpochTerminationCondition,
                           InvalidScoreIterationTerminationCondition, IterationTerminationCondition,
                           MaxEpochsTerminationCondition, MaxScoreIterationTerminationCondition,
                           MaxTimeIterationTerminationCondition, ScoreImprovementEpochTerminationCondition, TimeUnit,
                           _positive_int)

__all__ = ["EarlyStoppingConfiguration", "EarlyStoppingResult", "TerminationReason", "EarlyStoppingListener",
           "MaxEpochsTerminationCondition", "ScoreImprovementEpochTerminationCondition",
           "BestScoreEpochTerminationCondition", "MaxTimeIterationTerminationCondition",
           "MaxScoreIterationTerminationCondition", "InvalidScoreIterationTerminationCondition", "TimeUnit",
           "InMemoryModelSaver", "LocalFileModelSaver", "DataSetLossCalculator", "SparkDataSetLossCalculator",
           "SparkLossCalculatorComputationGraph", "SparkEarlyStoppingTrainer", "SparkEarlyStoppingGraphTrainer"]

log = logging.getLogger("dlspark.compat")


def _copy(network: Network) -> Network:
    """A network of its own with ``network``'s definition and a copy of its state (a later fit
    replaces or donates the original's arrays)."""
    return Network.from_definition(network.definition(), jax.tree_util.tree_map(jnp.copy, network.state))


# -- score calculators ----------------------------------------------------------------------
@with_snake_aliases
class DataSetLossCalculator:
    """DL4J's ``DataSetLossCalculator(data, average)``: the network's loss on local ``data`` (a
    DataSet, a list of them, or minibatch URLs), on the driver; the mean per example with
    ``average``, else the sum."""

    def __init__(self, data, average: bool = True):
        from dlspark.data import as_dataset

        self.data, self.average = data, bool(average)
        self._n = None if isinstance(data, (list, tuple, str)) else len(as_dataset(data))

    def calculateScore(self, network) -> float:
        mean = _network_of(network).score(self.data)
        if self.average:
            return mean
        if self._n is None:
            raise ValueError("DataSetLossCalculator(data, average=False) needs data as one DataSet (the sum counts "
                             "its examples)")
        return mean * self._n

    def minimizeScore(self) -> bool:
        """A loss: lower is better."""
        return True


@with_snake_aliases
class SparkDataSetLossCalculator:
    """DL4J's ``SparkDataSetLossCalculator(data, average, sc)``: the loss over an RDD of DataSets,
    computed on the Spark executors (``calculateScore`` of compat's networks)."""

    def __init__(self, data, average: bool = True, sc=None):
        from dlspark import spark as _spark

        if not _spark.is_rdd(data):
            raise TypeError(f"{type(self).__name__} takes an RDD of DataSets, got {type(data).__name__}")
        self.data, self.average = data, bool(average)

    def calculateScore(self, network) -> float:
        from dlspark import spark as _spark

        return _spark.calculate_score(self.data, _network_of(network), 64, self.average)

    def minimizeScore(self) -> bool:
        """A loss: lower is better."""
        return True


@with_snake_aliases
class SparkLossCalculatorComputationGraph(SparkDataSetLossCalculator):
    """DL4J's ``SparkLossCalculatorComputationGraph(data, average, sc)``: the loss over an RDD of
    MultiDataSets."""


def _network_of(x) -> Network:
    return x.getNetwork() if hasattr(x, "getNetwork") and not isinstance(x, Network) else x


# -- model savers -------------------------------------------------------------------------
@with_snake_aliases
class InMemoryModelSaver:
    """DL4J's ``InMemoryModelSaver``: copies of the best and the latest network, in memory."""

    def __init__(self):
        self.best = self.latest = None

    def saveBestModel(self, net, score: float) -> None:
        self.best = _copy(_network_of(net))

    def saveLatestModel(self, net, score: float) -> None:
        self.latest = _copy(_network_of(net))

    def getBestModel(self):
        """The best network saved (None before any)."""
        return self.best

    def getLatestModel(self):
        """The latest network saved (None before any, or without ``saveLastModel(True)``)."""
        return self.latest


@with_snake_aliases
class LocalFileModelSaver:
    """DL4J's ``LocalFileModelSaver(directory)``: ``bestModel.bin`` and ``latestModel.bin`` under
    ``directory`` (a path or fsspec URL), dlspark checkpoints written atomically. Reading one
    back loads only its arrays, into a network built like the one saved (``network=`` when
    this saver saved nothing in this process)."""

    def __init__(self, directory):
        from dlspark.io import url_join

        self.directory = str(directory)
        self.best_url = url_join(self.directory, "bestModel.bin")
        self.latest_url = url_join(self.directory, "latestModel.bin")
        self._like = None

    def saveBestModel(self, net, score: float) -> None:
        net = _network_of(net)
        net.save(self.best_url)
        self._like = self._like or net.definition()

    def saveLatestModel(self, net, score: float) -> None:
        net = _network_of(net)
        net.save(self.latest_url)
        self._like = self._like or net.definition()

    def _read(self, url, network):
        import fsspec

        fs, path = fsspec.core.url_to_fs(url)
        if not fs.exists(path):
            return None
        if network is None:
            if self._like is None:
                raise ValueError(f"LocalFileModelSaver({self.directory!r}) saved no network in this process: pass "
                                 "one built like the saved one to load the arrays into, getBestModel(network=net)")
            network = Network.from_definition(self._like)
        return _copy(network).restore(url)

    def getBestModel(self, network=None):
        """The best network saved (None if there is no file)."""
        return self._read(self.best_url, network)

    def getLatestModel(self, network=None):
        """The latest network saved (None if there is no file)."""
        return self._read(self.latest_url, network)


# -- configuration, listener, result ------------------------------------------------------------
class _ConfigurationBuilder(Builder):
    """``EarlyStoppingConfiguration.Builder()``."""

    def __init__(self):
        self._epoch, self._iteration, self._calc = [], [], None
        self._saver, self._every, self._save_last = None, 1, False

    @staticmethod
    def _items(args):
        return list(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple)) else list(args)

    def epochTerminationConditions(self, *conditions):
        items = self._items(conditions)
        for c in items:
            if not callable(getattr(c, "terminate", None)) or isinstance(c, IterationTerminationCondition):
                raise TypeError(f"epochTerminationConditions takes epoch conditions (MaxEpochsTerminationCondition, "
                                f"ScoreImprovementEpochTerminationCondition, ...), got {type(c).__name__}")
        self._epoch = items
        return self

    def iterationTerminationConditions(self, *conditions):
        items = self._items(conditions)
        for c in items:
            if not callable(getattr(c, "terminate", None)) or isinstance(c, EpochTerminationCondition):
                raise TypeError(f"iterationTerminationConditions takes iteration conditions "
                                f"(MaxTimeIterationTerminationCondition, ...), got {type(c).__name__}")
        self._iteration = items
        return self

    def scoreCalculator(self, calculator):
        if not callable(getattr(calculator, "calculateScore", None)):
            raise TypeError(f"scoreCalculator takes an object with calculateScore(network) (SparkDataSetLossCalculator"
                            f", DataSetLossCalculator), got {type(calculator).__name__}")
        self._calc = calculator
        return self

    def modelSaver(self, saver):
        if not callable(getattr(saver, "saveBestModel", None)):
            raise TypeError(f"modelSaver takes InMemoryModelSaver(), LocalFileModelSaver(dir) or an object with "
                            f"saveBestModel/saveLatestModel/getBestModel, got {type(saver).__name__}")
        self._saver = saver
        return self

    def evaluateEveryNEpochs(self, n: int):
        self._every = _positive_int("evaluateEveryNEpochs", n)
        return self

    def saveLastModel(self, save: bool):
        self._save_last = bool(save)
        return self

    def build(self) -> "EarlyStoppingConfiguration":
        if not self._epoch and not self._iteration:
            raise ValueError("EarlyStoppingConfiguration.Builder() needs a termination condition before build(): "
                             "epochTerminationConditions(MaxEpochsTerminationCondition(n)) or "
                             "iterationTerminationConditions(MaxTimeIterationTerminationCondition(t, TimeUnit.MINUTES))")
        return EarlyStoppingConfiguration(self._epoch, self._iteration, self._calc,
                                          self._saver or InMemoryModelSaver(), self._every, self._save_last)


@with_snake_aliases
class EarlyStoppingConfiguration:
    """DL4J's ``EarlyStoppingConfiguration``, built with ``EarlyStoppingConfiguration.Builder()``:
    ``epochTerminationConditions``, ``iterationTerminationConditions``, ``scoreCalculator``
    (without one, an epoch's score is the last round's training loss), ``modelSaver``
    (``InMemoryModelSaver`` by default), ``evaluateEveryNEpochs`` (1) and ``saveLastModel`` (False)."""

    Builder = _ConfigurationBuilder

    def __init__(self, epoch_conditions, iteration_conditions, score_calculator, model_saver, every, save_last):
        self.epoch_conditions, self.iteration_conditions = list(epoch_conditions), list(iteration_conditions)
        self.score_calculator, self.model_saver = score_calculator, model_saver
        self.evaluate_every, self.save_last = every, save_last

    def getEpochTerminationConditions(self) -> list:
        return list(self.epoch_conditions)

    def getIterationTerminationConditions(self) -> list:
        return list(self.iteration_conditions)

    def getScoreCalculator(self):
        return self.score_calculator

    def getModelSaver(self):
        return self.model_saver

    def getEvaluateEveryNEpochs(self) -> int:
        return self.evaluate_every

    def isSaveLastModel(self) -> bool:
        return self.save_last


class TerminationReason(DL4JEnum):
    """Why an early-stopping fit ended."""

    Error = "error"
    IterationTerminationCondition = "iteration"
    EpochTerminationCondition = "epoch"


@with_snake_aliases
class EarlyStoppingResult:
    """What :meth:`SparkEarlyStoppingTrainer.fit` returns (DL4J's ``EarlyStoppingResult``)."""

    def __init__(self, reason, details, score_vs_epoch, best_epoch, best_score, total_epochs, saver):
        self.reason, self.details, self.score_vs_epoch = reason, details, dict(score_vs_epoch)
        self.best_epoch, self.best_score, self.total_epochs, self.saver = best_epoch, best_score, total_epochs, saver

    def getTerminationReason(self) -> TerminationReason:
        return self.reason

    def getTerminationDetails(self) -> str:
        """The condition that stopped the fit (its ``str``), or the error."""
        return self.details

    def getScoreVsEpoch(self) -> dict:
        """Epoch (from 0) -> score, for every evaluated epoch."""
        return dict(self.score_vs_epoch)

    def getBestModelEpoch(self) -> int:
        """The epoch of the best score (-1 if none was evaluated)."""
        return self.best_epoch

    def getBestModelScore(self) -> float:
        return self.best_score

    def getTotalEpochs(self) -> int:
        """Epochs trained."""
        return self.total_epochs

    def getBestModel(self):
        """The network with the best epoch's parameters, from the model saver (None if no epoch
        was evaluated)."""
        return self.saver.getBestModel() if self.best_epoch >= 0 else None

    def __str__(self):
        return (f"EarlyStoppingResult(terminationReason={self.reason.name}, details={self.details}, "
                f"bestModelEpoch={self.best_epoch}, bestModelScore={self.best_score}, totalEpochs={self.total_epochs})")


@with_snake_aliases
class EarlyStoppingListener:
    """DL4J's ``EarlyStoppingListener``: override what you need."""

    def onStart(self, esConfig, net) -> None:
        """Before the first epoch."""

    def onEpoch(self, epochNum: int, score: float, esConfig, net) -> None:
        """After each evaluated epoch, with its score."""

    def onCompletion(self, esResult) -> None:
        """With the result, as the fit ends."""


class _IterationScores(TrainingListener):
    """Collects an epoch's iteration scores for the iteration termination conditions."""

    def __init__(self):
        self.scores: list = []

    def iterationDone(self, model, iteration, epoch):
        self.scores.append(model.score())


# -- the trainers ------------------------------------------------------------------------------
@with_snake_aliases
class SparkEarlyStoppingTrainer:
    """DL4J's ``SparkEarlyStoppingTrainer(sc, trainingMaster, esConfig, net, train)``.

    Parameters
    ----------
    sc : pyspark SparkContext or SparkSession
    trainingMaster : ParameterAveragingTrainingMaster or SharedTrainingMaster
    esConfig : EarlyStoppingConfiguration
    net : dlspark.Network
        Trained in place: after :meth:`fit` it holds the last epoch's parameters.
    train : RDD of DataSets
        (or anything :meth:`SparkDl4jMultiLayer.fit` takes); one epoch is one ``fit`` of it.
    rnnDataFormat : RNNFormat or str, default "NCW"
        The layout of 3-D data, as :class:`SparkDl4jMultiLayer` takes it.

    Examples
    --------
    >>> conf = (EarlyStoppingConfiguration.Builder()  # doctest: +SKIP
    ...         .epochTerminationConditions(MaxEpochsTerminationCondition(20),
    ...                                     ScoreImprovementEpochTerminationCondition(3))
    ...         .scoreCalculator(SparkDataSetLossCalculator(test_rdd, True, sc))
    ...         .modelSaver(InMemoryModelSaver()).build())
    >>> result = SparkEarlyStoppingTrainer(sc, tm, conf, net, train_rdd).fit()  # doctest: +SKIP
    >>> best = result.getBestModel()  # doctest: +SKIP
    """

    def _spark_network(self, sc, net, master, rnn_format):
        from ._networks import SparkDl4jMultiLayer

        return SparkDl4jMultiLayer(sc, net, master, rnn_format)

    def __init__(self, sc, trainingMaster, esConfig, net, train, rnnDataFormat="NCW"):
        if not isinstance(esConfig, EarlyStoppingConfiguration):
            raise TypeError(f"esConfig must be EarlyStoppingConfiguration.Builder()...build(), got "
                            f"{type(esConfig).__name__}")
        if not isinstance(net, Network):
            raise TypeError(f"net must be a dlspark.Network, got {type(net).__name__}")
        self.config, self.network, self.train = esConfig, net, train
        self.spark_net = self._spark_network(sc, net, trainingMaster, rnnDataFormat)
        self.listener = None

    def setListener(self, listener) -> None:
        """An :class:`EarlyStoppingListener` (or None)."""
        self.listener = listener

    def getSparkNet(self):
        """The compat network that trains each epoch (its listeners are called too)."""
        return self.spark_net

    def fit(self) -> EarlyStoppingResult:
        """Train until a termination condition is met; see the class's docstring."""
        conf, net = self.config, self.network
        calc, saver = conf.score_calculator, conf.model_saver
        minimize = bool(calc.minimizeScore()) if calc is not None and hasattr(calc, "minimizeScore") else True
        for c in conf.epoch_conditions + conf.iteration_conditions:
            c.initialize()
        if self.listener is not None:
            self.listener.onStart(conf, net)
        scores, best_epoch, best_score, epoch = {}, -1, (math.inf if minimize else -math.inf), 0
        recorder = _IterationScores()
        own = self.spark_net.getListeners()
        self.spark_net.setListeners(own + [recorder])

        def result(reason, details, total):
            return EarlyStoppingResult(reason, details, scores, best_epoch, best_score, total, saver)

        try:
            while True:
                recorder.scores = []
                self.spark_net.fit(self.train)
                latest = recorder.scores[-1] if recorder.scores else self.spark_net.getScore()
                stop = next((c for s in recorder.scores or [latest] for c in conf.iteration_conditions
                             if c.terminate(s)), None)
                if stop is not None:
                    if conf.save_last:
                        saver.saveLatestModel(net, latest)
                    log.info("early stopping: %s stopped the fit after epoch %d", stop, epoch)
                    out = result(TerminationReason.IterationTerminationCondition, str(stop), epoch + 1)
                    break
                if epoch % conf.evaluate_every == 0:
                    score = float(calc.calculateScore(net)) if calc is not None else float(latest)
                    scores[epoch] = score
                    better = score < best_score if minimize else score > best_score
                    if better or (best_epoch == -1 and not math.isfinite(score)):
                        best_epoch, best_score = epoch, score
                        saver.saveBestModel(net, score)
                    if conf.save_last:
                        saver.saveLatestModel(net, score)
                    if self.listener is not None:
                        self.listener.onEpoch(epoch, score, conf, net)
                    stop = next((c for c in conf.epoch_conditions if c.terminate(epoch, score, minimize)), None)
                    if stop is not None:
                        log.info("early stopping: %s stopped the fit after epoch %d", stop, epoch)
                        out = result(TerminationReason.EpochTerminationCondition, str(stop), epoch + 1)
                        break
                epoch += 1
        except Exception as e:  # DL4J's trainer ends with an Error result rather than raising
            log.warning("early stopping: the fit ended with an error at epoch %d: %s: %s", epoch, type(e).__name__, e)
            out = result(TerminationReason.Error, f"{type(e).__name__}: {e}", epoch)
        finally:
            self.spark_net.setListeners(own)
        if self.listener is not None:
            self.listener.onCompletion(out)
        return out


@with_snake_aliases
class SparkEarlyStoppingGraphTrainer(SparkEarlyStoppingTrainer):
    """DL4J's ``SparkEarlyStoppingGraphTrainer(sc, trainingMaster, esConfig, graph, train)``: the
    same over :class:`~dlspark.compat.SparkComputationGraph` (an RDD of MultiDataSets)."""

    def _spark_network(self, sc, net, master, rnn_format):
        from ._networks import SparkComputationGraph

        return SparkComputationGraph(sc, net, master, rnn_format)
