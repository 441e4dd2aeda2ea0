"""Mergeable, serialisable evaluations (DL4J's evaluation classes).

Each has ``update(labels, predictions, mask=None)``, ``merge(other)`` (folds
``other`` in and returns ``self``), ``stats()``, ``to_json()``/``from_json()``
and numeric accessors named as DL4J names them, in snake_case.

The trainers' evaluations (``DistributedTrainer``, ``ParallelWrapper`` and the
``compat`` networks) give them what DL4J's give them, an output layer's
activations: the network's raw outputs (logits) through the loss's output
activation, softmax for ``softmax_cross_entropy``, ``negative_log_likelihood``
and ``kl_divergence``, sigmoid for ``binary_cross_entropy``, and the outputs as
they are for other losses (:func:`dlspark.losses.output_probabilities`).
Thresholds, ROC histograms and calibration bins therefore act on
probabilities. Calling ``update`` yourself, pass probabilities too.
"""

from ._base import BaseEvaluation, from_json
from ._classification import Evaluation, EvaluationBinary
from ._regression import EvaluationCalibration, RegressionEvaluation
from ._roc import ROC, ROCBinary, ROCMultiClass

__all__ = ["BaseEvaluation", "Evaluation", "EvaluationBinary", "ROC", "ROCBinary", "ROCMultiClass",
           "RegressionEvaluation", "EvaluationCalibration", "from_json"]
