"""Mergeable, serialisable evaluations (DL4J's evaluation classes).

Each has ``update(labels, predictions, mask=None)``, ``merge(other)`` (folds
``other`` in and returns ``self``), ``stats()``, ``to_json()``/``from_json()``
and numeric accessors named as DL4J names them, in snake_case.
"""

from ._base import BaseEvaluation, from_json
from ._classification import Evaluation, EvaluationBinary
from ._regression import EvaluationCalibration, RegressionEvaluation
from ._roc import ROC, ROCBinary, ROCMultiClass

__all__ = ["BaseEvaluation", "Evaluation", "EvaluationBinary", "ROC", "ROCBinary", "ROCMultiClass",
           "RegressionEvaluation", "EvaluationCalibration", "from_json"]
