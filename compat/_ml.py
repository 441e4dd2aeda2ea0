"""A ``pyspark.ml`` Estimator and Model over dlspark: fit a Spark DataFrame, transform adds predictions.

dlspark's own extension (DL4J on Spark has no Spark ML stage), in the shape
Spark ML's users know from its classifiers (and elephas' and Horovod's users
from their estimators): :class:`NetworkEstimator` takes a
:class:`dlspark.Network` and a training master as Params beside the usual
``featuresCol`` and ``labelCol``; its ``fit`` trains a copy of the network on
the Dask cluster, the executors turning the rows into minibatch files as
``SparkDl4jMultiLayer.fit(dataframe, featuresCol, labelCol)`` does, so that no
feature array reaches the driver. The :class:`NetworkModel` it returns adds a
prediction column (and, for a classification loss, a probability column) in a
lazy transformation that runs the network on the executors.

This module imports pyspark; ``dlspark.compat`` loads it on first use of
either name.
"""

from __future__ import annotations

from functools import partial

import numpy as np
from pyspark import keyword_only
from pyspark.ml import Estimator, Model
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import HasFeaturesCol, HasLabelCol, HasPredictionCol, HasProbabilityCol, HasWeightCol

from dlspark import Network
from dlspark.losses import output_probabilities

from ._dataframes import _kind, _row_values, _stack, is_spark_dataframe
from ._masters import ParameterAveragingTrainingMaster, TrainingMaster

__all__ = ["NetworkEstimator", "NetworkModel"]

#: losses whose labels are class ids: the prediction is the index of the largest output
_CLASS_ID_LOSSES = ("softmax_cross_entropy", "negative_log_likelihood")


def _positive(name):
    def convert(value):
        value = TypeConverters.toInt(value)
        if value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        return value
    return convert


def _network(value):
    if not isinstance(value, Network):
        raise TypeError(f"network must be a dlspark.Network, got {type(value).__name__}")
    return value


def _master(value):
    if value is not None and not isinstance(value, TrainingMaster):
        raise TypeError("trainingMaster must be ParameterAveragingTrainingMaster.Builder(...).build() or "
                        f"SharedTrainingMaster.Builder(...).build(), got {type(value).__name__}")
    return value


class _NetworkParams(HasFeaturesCol, HasPredictionCol, HasProbabilityCol):
    """The Params that the estimator and its model share."""

    network = Param(Params._dummy(), "network", "the dlspark.Network (the estimator trains a copy of it)",
                    typeConverter=_network)
    batchSize = Param(Params._dummy(), "batchSize", "examples per forward pass on an executor in transform",
                      typeConverter=_positive("batchSize"))

    def __init__(self):
        super().__init__()
        self._setDefault(batchSize=64)

    def getNetwork(self) -> Network:
        """The network (the trained one, for a fitted model)."""
        return self.getOrDefault(self.network)

    def getBatchSize(self) -> int:
        """Examples per forward pass on an executor in transform."""
        return self.getOrDefault(self.batchSize)

    def setNetwork(self, value):
        """Set ``network``."""
        return self._set(network=value)

    def setFeaturesCol(self, value):
        """Set ``featuresCol``."""
        return self._set(featuresCol=value)

    def setPredictionCol(self, value):
        """Set ``predictionCol``."""
        return self._set(predictionCol=value)

    def setProbabilityCol(self, value):
        """Set ``probabilityCol`` ("" for none)."""
        return self._set(probabilityCol=value)

    def setBatchSize(self, value):
        """Set ``batchSize``."""
        return self._set(batchSize=value)


class NetworkEstimator(Estimator, _NetworkParams, HasLabelCol, HasWeightCol):
    """Trains a :class:`dlspark.Network` on a Spark DataFrame; ``fit`` returns a :class:`NetworkModel`.

    Every parameter is a ``pyspark.ml`` Param, with its getter and setter.

    Parameters
    ----------
    network : dlspark.Network
        The network; ``fit`` trains a copy and leaves it as it is.
    featuresCol : str, default "features"
        A number, an array of numbers or a Spark ML vector (dense or sparse) per row.
    labelCol : str, default "label"
        Class indices (numbers, as Spark ML writes them) for a softmax loss, else numbers,
        arrays or vectors.
    weightCol : str, optional
        Non-negative per-example weights: each minibatch's loss is ``sum(w * loss) / sum(w)``,
        so that a row of weight 0 has no effect on the fit.
    predictionCol : str, default "prediction"
    probabilityCol : str, default "probability"
        Set to "" for no probability column (only classification losses give one).
    epochs : int, default 1
        Passes over the DataFrame.
    trainingMaster : ParameterAveragingTrainingMaster or SharedTrainingMaster, optional
        How to train; without one, parameter averaging with ``batchSizePerWorker`` and
        ``averagingFrequency``.
    batchSizePerWorker : int, default 32
    averagingFrequency : int, default 5
        Settings of the parameter averaging master built when no ``trainingMaster`` is
        given (an error beside one).
    batchSize : int, default 64
        Examples per forward pass on an executor in the model's ``transform``.

    Training runs on the Dask cluster of ``dlspark.compat.configure`` (else the Spark
    configuration's ``spark.dlspark.scheduler``, else an embedded one). Columns are
    checked against the schema on the driver before any cluster work.

    Examples
    --------
    >>> est = NetworkEstimator(network=net, featuresCol="features", labelCol="label",  # doctest: +SKIP
    ...                        epochs=5, batchSizePerWorker=32)
    >>> model = est.fit(train_df)  # doctest: +SKIP
    >>> model.transform(test_df).select("label", "prediction", "probability").show()  # doctest: +SKIP
    """

    epochs = Param(Params._dummy(), "epochs", "passes over the DataFrame", typeConverter=_positive("epochs"))
    trainingMaster = Param(Params._dummy(), "trainingMaster",
                           "a ParameterAveragingTrainingMaster or SharedTrainingMaster (None: parameter averaging "
                           "with batchSizePerWorker and averagingFrequency)", typeConverter=_master)
    batchSizePerWorker = Param(Params._dummy(), "batchSizePerWorker",
                               "examples per worker per step, when no trainingMaster is given",
                               typeConverter=_positive("batchSizePerWorker"))
    averagingFrequency = Param(Params._dummy(), "averagingFrequency",
                               "steps between averagings, when no trainingMaster is given",
                               typeConverter=_positive("averagingFrequency"))

    @keyword_only
    def __init__(self, *, network=None, featuresCol="features", labelCol="label", weightCol=None,
                 predictionCol="prediction", probabilityCol="probability", epochs=1, trainingMaster=None, batchSizePerWorker=32,
                 averagingFrequency=5, batchSize=64):
        super().__init__()
        self._setDefault(epochs=1, trainingMaster=None, batchSizePerWorker=32, averagingFrequency=5)
        self.setParams(**self._input_kwargs)

    @keyword_only
    def setParams(self, *, network=None, featuresCol="features", labelCol="label", weightCol=None,
                  predictionCol="prediction", probabilityCol="probability", epochs=1, trainingMaster=None, batchSizePerWorker=32,
                  averagingFrequency=5, batchSize=64):
        """Set any of the Params by keyword."""
        return self._set(**self._input_kwargs)

    def setLabelCol(self, value):
        """Set ``labelCol``."""
        return self._set(labelCol=value)

    def setWeightCol(self, value):
        """Set ``weightCol``."""
        return self._set(weightCol=value)

    def setEpochs(self, value):
        """Set ``epochs``."""
        return self._set(epochs=value)

    def setTrainingMaster(self, value):
        """Set ``trainingMaster``."""
        return self._set(trainingMaster=value)

    def getEpochs(self) -> int:
        """Passes over the DataFrame."""
        return self.getOrDefault(self.epochs)

    def getTrainingMaster(self):
        """The training master ``fit`` uses (built from the averaging settings when none was given)."""
        master = self.getOrDefault(self.trainingMaster)
        if master is not None:
            given = [p.name for p in (self.batchSizePerWorker, self.averagingFrequency) if self.isSet(p)]
            if given:
                raise ValueError(f"{' and '.join(given)} configure the master built when no trainingMaster is "
                                 f"given; with trainingMaster={master!r}, set them on its Builder instead")
            return master
        return (ParameterAveragingTrainingMaster.Builder(self.getOrDefault(self.batchSizePerWorker))
                .batchSizePerWorker(self.getOrDefault(self.batchSizePerWorker))
                .averagingFrequency(self.getOrDefault(self.averagingFrequency)).build())

    def _fit(self, dataset):
        from ._networks import SparkDl4jMultiLayer

        if not self.isDefined(self.network) or self.getOrDefault(self.network) is None:
            raise ValueError("NetworkEstimator needs a network: NetworkEstimator(network=dlspark.Network(...), ...)")
        if not is_spark_dataframe(dataset):
            raise TypeError(f"fit takes a pyspark.sql DataFrame, got {type(dataset).__name__}")
        master = self.getTrainingMaster()
        original = self.getNetwork()
        # a copy: the train state is an immutable pytree that every fit replaces, so the
        # estimator's network keeps its own
        net = Network.from_definition(original.definition(), original.state)
        weight = self.getWeightCol() if self.isDefined(self.weightCol) and self.getWeightCol() else None
        spark_net = SparkDl4jMultiLayer(dataset.sparkSession.sparkContext, net, master)
        for _ in range(self.getEpochs()):
            spark_net.fit(dataset, self.getFeaturesCol(), self.getLabelCol(), weight)
        model = self._copyValues(NetworkModel(featuresCol=self.getFeaturesCol(), predictionCol=self.getPredictionCol(),
                                              probabilityCol=self.getProbabilityCol(), batchSize=self.getBatchSize()))
        return model._set(network=net)  # after _copyValues, which would give it the estimator's network


class NetworkModel(Model, _NetworkParams):
    """A trained network as a Spark ML Model: ``transform`` adds ``predictionCol`` (and
    ``probabilityCol``) to a DataFrame, lazily, the network running on the executors.

    The prediction is a double: the class index for a softmax loss (its largest output),
    0 or 1 for a one-output sigmoid loss, else the network's one output; a network with
    several outputs per example gives a Spark ML dense vector. The probability column
    (a dense vector of the loss's output activation) comes with classification losses only,
    and not when ``probabilityCol`` is "".
    """

    @keyword_only
    def __init__(self, *, network=None, featuresCol="features", predictionCol="prediction",
                 probabilityCol="probability", batchSize=64):
        super().__init__()
        self._set(**self._input_kwargs)

    def _outputs(self, net):
        """(width, loss name, has a probability column) of the network's one output, from its example input."""
        out = net.output(net.model.example_input)
        if isinstance(out, tuple) or np.ndim(out) != 2:
            raise ValueError("NetworkModel.transform takes a network with one output of one row per example; "
                             f"this one gives {'several outputs' if isinstance(out, tuple) else np.shape(out)}")
        loss = net._loss
        return int(np.shape(out)[1]), loss.name, loss.activation is not None and bool(self.getProbabilityCol())

    def _transform(self, dataset):
        from pyspark.ml.linalg import VectorUDT
        from pyspark.sql.types import DoubleType, StructField, StructType

        from dlspark.spark import broadcast_network, check_executors

        if not is_spark_dataframe(dataset):
            raise TypeError(f"transform takes a pyspark.sql DataFrame, got {type(dataset).__name__}")
        net = self.getNetwork()
        kind, _ = _kind(dataset, self.getFeaturesCol(), "featuresCol")
        width, loss, with_prob = self._outputs(net)
        scalar = loss in _CLASS_ID_LOSSES or width == 1
        names = [f.name for f in dataset.schema.fields]
        added = [self.getPredictionCol()] + ([self.getProbabilityCol()] if with_prob else [])
        for name in added:
            if name in names:
                raise ValueError(f"the DataFrame already has a column {name!r}; set predictionCol/probabilityCol "
                                 "to a new name")
        fields = list(dataset.schema.fields) + [StructField(self.getPredictionCol(),
                                                            DoubleType() if scalar else VectorUDT(), False)]
        if with_prob:
            fields.append(StructField(self.getProbabilityCol(), VectorUDT(), False))
        sc = dataset.sparkSession.sparkContext
        check_executors(sc)
        bc = broadcast_network(sc, net)
        index = names.index(self.getFeaturesCol())
        rows = dataset.rdd.mapPartitions(partial(_predict_rows, bc, index, kind, self.getFeaturesCol(),
                                                 self.getBatchSize(), loss, scalar, with_prob))
        return dataset.sparkSession.createDataFrame(rows, StructType(fields), verifySchema=False)


def _predict_rows(bc, index, kind, name, batch_size, loss, scalar, with_prob, rows):
    """Runs on an executor: each row of the partition with its prediction (and probability) appended."""
    from dlspark.spark._executor import _executor_network, _pad_rows

    net, chunk = None, []

    def flush():
        x = _stack([_row_values(r[index], kind, name) for r in chunk], name).astype(np.float32)
        n = len(x)
        # every chunk padded to batch_size rows: one compiled shape per executor process
        out = np.asarray(net.output(_pad_rows(x, batch_size)))[:n]
        prob = output_probabilities(net._loss, out) if net._loss.activation is not None else out
        if loss in _CLASS_ID_LOSSES:
            preds = [float(i) for i in prob.argmax(1)]
        elif scalar and net._loss.activation is not None:
            preds = [float(p >= 0.5) for p in prob[:, 0]]
        elif scalar:
            preds = [float(v) for v in out[:, 0]]
        else:
            from pyspark.ml.linalg import Vectors

            preds = [Vectors.dense(v) for v in out.astype(np.float64)]
        if with_prob:
            from pyspark.ml.linalg import Vectors

            done = [tuple(r) + (p, Vectors.dense(q)) for r, p, q in zip(chunk, preds, prob)]
        else:
            done = [tuple(r) + (p,) for r, p in zip(chunk, preds)]
        chunk.clear()
        return done

    for row in rows:
        chunk.append(row)
        if len(chunk) == batch_size:
            net = net or _executor_network(bc)
            yield from flush()
    if chunk:
        net = net or _executor_network(bc)
        yield from flush()
