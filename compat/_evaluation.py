"""The core's evaluations under DL4J's camelCase: ``toJson``/``fromJson``, ``calculateAUC``, ...

Each class here is the core class of the same name (same state, same
``update`` and ``merge``) with DL4J's method names added: a camelCase name
resolves to the core's snake_case method (``meanSquaredError`` ->
``mean_squared_error``), and ``fromJson`` returns an instance of this class.
The JSON is the core's, so either side reads what the other writes.
"""

from __future__ import annotations

from dlspark import evaluation as _core
from dlspark.evaluation import _base

from ._names import snake, unknown_name

__all__ = ["Evaluation", "EvaluationBinary", "ROC", "ROCBinary", "ROCMultiClass", "RegressionEvaluation",
           "EvaluationCalibration"]

#: DL4J names whose snake_case form is not the core's name.
_RENAMED = {"calculateAUCPR": "calculate_auprc", "getConfusionMatrix": "confusion_matrix",
            "getConfusion": "confusion_matrix", "getNumRowCounter": "count"}


class _CamelCase:
    """Resolves DL4J's camelCase method names to the core's snake_case ones."""

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        for candidate in (_RENAMED.get(name), snake(name),
                          snake(name[3:]) if name.startswith("get") and name[3:4].isupper() else None):
            if candidate and candidate != name and hasattr(type(self), candidate):
                return getattr(self, candidate)
        raise unknown_name(type(self).__name__, name, [n for n in dir(type(self)) if not n.startswith("_")])

    def toJson(self) -> str:
        """The core's JSON (:meth:`to_json`)."""
        return self.to_json()

    @classmethod
    def fromJson(cls, text: str):
        """Rebuild an evaluation from :meth:`toJson`'s (or the core's ``to_json``'s) text."""
        obj = _base.from_json(text, cls._core)
        obj.__class__ = _BY_NAME.get(type(obj).__name__, type(obj))
        return obj


_BY_NAME: dict = {}


def _dl4j(core_cls, doc):
    cls = type(core_cls.__name__, (_CamelCase, core_cls), {"__doc__": doc, "__module__": __name__,
                                                           "_core": core_cls})
    # Subclasses register themselves by name for from_json; the core's class keeps that name,
    # so that JSON read anywhere comes back as the core's class.
    _base._REGISTRY[core_cls.__name__] = core_cls
    _BY_NAME[core_cls.__name__] = cls
    return cls


Evaluation = _dl4j(_core.Evaluation, "DL4J's ``Evaluation``: :class:`dlspark.evaluation.Evaluation` with "
                                     "camelCase names (``accuracy``, ``f1``, ``topNAccuracy``, ``toJson``, "
                                     "``fromJson``). ``Evaluation(labels=[...])`` names the classes.")
EvaluationBinary = _dl4j(_core.EvaluationBinary, "DL4J's ``EvaluationBinary`` (one binary evaluation per "
                                                 "output column), with camelCase names.")
ROC = _dl4j(_core.ROC, "DL4J's ``ROC``: binary ROC with ``calculateAUC``, ``calculateAUCPR``; ``ROC(32)`` bins "
                       "the scores in 32 steps, ``ROC(0)`` is exact.")
ROCBinary = _dl4j(_core.ROCBinary, "DL4J's ``ROCBinary``: one ROC per output column, ``calculateAUC(column)``.")
ROCMultiClass = _dl4j(_core.ROCMultiClass, "DL4J's ``ROCMultiClass``: one-vs-all ROC per class, "
                                           "``calculateAUC(cls)``, ``calculateAverageAUC()``.")
RegressionEvaluation = _dl4j(_core.RegressionEvaluation, "DL4J's ``RegressionEvaluation``: ``meanSquaredError(col)``, "
                                                         "``meanAbsoluteError``, ``rSquared``, "
                                                         "``pearsonCorrelation``, ...")
EvaluationCalibration = _dl4j(_core.EvaluationCalibration, "DL4J's ``EvaluationCalibration``: reliability "
                                                           "diagrams and histograms, camelCase names.")
