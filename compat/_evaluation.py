"""The core's evaluations under DL4J's names and semantics: ``eval``, ``toJson``/``fromJson``, ``calculateAUC``, ...

Each class here is the core class of the same name (same state, same
``update`` and ``merge``) with DL4J's method names added: a camelCase name
resolves to the core's snake_case method (``meanSquaredError`` ->
``mean_squared_error``), and ``fromJson`` returns an instance of this class.
The JSON is the core's, so either side reads what the other writes.

:class:`Evaluation` also takes DL4J's constructors (``Evaluation(3)``,
``Evaluation(labels, 5)`` for top-5, ``Evaluation(0.7)`` for a binary decision
threshold, ``Evaluation(costArray)``) and reports as DL4J does: with two
classes, ``precision()``, ``recall()``, ``f1()`` and the rates are those of the
positive class (1 unless ``binaryPositiveClass`` says otherwise), and a macro
average leaves out the classes for which the metric is 0/0.
"""

from __future__ import annotations

import numpy as np

from dlspark import evaluation as _core
from dlspark.evaluation import _base

from ._names import DL4JEnum, snake, unknown_name

__all__ = ["Evaluation", "EvaluationBinary", "ROC", "ROCBinary", "ROCMultiClass", "RegressionEvaluation",
           "EvaluationCalibration", "EvaluationAveraging", "Counter"]

#: DL4J names whose snake_case form is not the core's name.
_RENAMED = {"calculateAUCPR": "calculate_auprc", "getConfusion": "confusion_matrix"}
#: words DL4J writes in capitals inside a camelCase name
_ACRONYMS = {"auc": "AUC", "auprc": "AUCPR", "roc": "ROC", "json": "Json"}


def camel(name: str) -> str:
    """``top_n_accuracy`` -> ``topNAccuracy``, ``calculate_auc`` -> ``calculateAUC``: DL4J's spelling."""
    first, *rest = name.split("_")
    return first + "".join(_ACRONYMS.get(w, w[:1].upper() + w[1:]) for w in rest)


class EvaluationAveraging(DL4JEnum):
    """DL4J's ``EvaluationAveraging``: ``Macro`` (each class weighs the same) or ``Micro``
    (each example weighs the same)."""

    Macro = "macro"
    Micro = "micro"


class Counter(dict):
    """DL4J's ``Counter<Integer>``: a dict of class -> count with ``getCount`` and ``totalCount``."""

    def getCount(self, key) -> float:
        """The count of ``key`` (0 for a key never counted)."""
        return self.get(key, 0)

    def totalCount(self) -> float:
        """The sum of every count."""
        return sum(self.values())

    def keySet(self) -> set:
        """The keys."""
        return set(self)


class _CamelCase:
    """Resolves DL4J's camelCase method names to the core's snake_case ones."""

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        for candidate in (_RENAMED.get(name), snake(name),
                          snake(name[3:]) if name.startswith("get") and name[3:4].isupper() else None):
            if candidate and candidate != name and callable(getattr(type(self), candidate, None)):
                return getattr(self, candidate)
        raise unknown_name(type(self).__name__, name, self._dl4j_names())

    @classmethod
    def _dl4j_names(cls) -> list:
        """The public methods under DL4J's spelling (what an unknown name is compared with)."""
        names = {camel(n) for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n, None))}
        return sorted(names | set(_RENAMED))

    def toJson(self) -> str:
        """The core's JSON (:meth:`to_json`)."""
        return self.to_json()

    @classmethod
    def fromJson(cls, text: str):
        """Rebuild an evaluation from :meth:`toJson`'s (or the core's ``to_json``'s) text."""
        obj = _base.from_json(text, cls._core)
        obj.__class__ = _BY_NAME.get(type(obj).__name__, type(obj))
        if isinstance(obj, Evaluation) and not hasattr(obj, "binary_positive_class"):
            obj.binary_positive_class = 1  # the core's JSON has none: DL4J's default
        return obj

    def eval(self, labels, predictions, mask=None):
        """DL4J's ``eval(labels, networkPredictions[, mask])``: add a batch (the core's ``update``)."""
        self.update(labels, predictions, mask)


_BY_NAME: dict = {}


def _register(cls, core_cls):
    # Subclasses register themselves by name for from_json; the core's class keeps that name,
    # so that JSON read anywhere comes back as the core's class.
    _base._REGISTRY[core_cls.__name__] = core_cls
    _BY_NAME[core_cls.__name__] = cls
    return cls


def _dl4j(core_cls, doc):
    cls = type(core_cls.__name__, (_CamelCase, core_cls), {"__doc__": doc, "__module__": __name__,
                                                           "_core": core_cls})
    return _register(cls, core_cls)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _averaging(value, what):
    if isinstance(value, EvaluationAveraging):
        return value.value
    if isinstance(value, str) and value.lower() in ("macro", "micro"):
        return value.lower()
    raise ValueError(f"{what} takes a class index or EvaluationAveraging.Macro / EvaluationAveraging.Micro, "
                     f"got {value!r}")


_UNSET = object()


class Evaluation(_CamelCase, _core.Evaluation):
    """DL4J's ``Evaluation``: :class:`dlspark.evaluation.Evaluation` with DL4J's constructors,
    names and semantics.

    Constructors, as DL4J's: ``Evaluation()``, ``Evaluation(numClasses)``,
    ``Evaluation(numClasses, binaryPositiveClass)``, ``Evaluation(labels)``,
    ``Evaluation(labels, topN)``, ``Evaluation({0: "cat", 1: "dog"})``,
    ``Evaluation(binaryDecisionThreshold[, binaryPositiveClass])``,
    ``Evaluation(costArray)``, ``Evaluation(labels, costArray)``; the core's
    keywords work too.

    Examples
    --------
    >>> import numpy as np
    >>> ev = Evaluation(["a", "b", "c"], 2)
    >>> ev.eval(np.eye(3)[[0, 1, 2]], np.array([[.6, .3, .1], [.5, .4, .1], [.1, .2, .7]]))
    >>> ev.getNumRowCounter(), ev.getTopNCorrectCount(), ev.falseNegatives()
    (3, 3, {0: 0, 1: 1, 2: 0})
    """

    _config = _core.Evaluation._config + ("binary_positive_class",)
    _core = _core.Evaluation

    def __init__(self, *args, num_classes=None, labels=None, top_n=1, binary_threshold=None, cost_array=None,
                 binary_positive_class=_UNSET):
        a = list(args)
        first = a.pop(0) if a else None
        second = a.pop(0) if a else _UNSET
        if a:
            raise TypeError(f"Evaluation takes at most 2 positional arguments (DL4J's constructors), got {len(args)}")
        if isinstance(first, dict):
            missing = [i for i in range(len(first)) if i not in first]
            if missing:
                raise ValueError(f"Evaluation's labels map needs the keys 0 to {len(first) - 1}; missing {missing}")
            first = [first[i] for i in range(len(first))]
        if _is_int(first):
            num_classes = 2 if int(first) == 1 else int(first)  # one sigmoid column: two classes
            if second is not _UNSET:
                if second is not None and num_classes != 2:
                    raise ValueError(f"binaryPositiveClass needs 2 classes (got numClasses={num_classes}); "
                                     "pass None")
                binary_positive_class = second
            elif binary_positive_class is _UNSET:
                binary_positive_class = 1 if num_classes == 2 else None
        elif isinstance(first, float):
            binary_threshold = first
            if second is not _UNSET:
                binary_positive_class = second
        elif isinstance(first, (list, tuple)) and all(isinstance(s, str) for s in first):
            labels = list(first)
            if second is not _UNSET and second is not None:
                if _is_int(second):
                    top_n = int(second)
                else:
                    cost_array = second
        elif isinstance(first, (np.ndarray, list, tuple)):
            cost_array = np.ravel(np.asarray(first, np.float64))
        elif first is not None:
            raise TypeError("Evaluation takes (numClasses[, binaryPositiveClass]), (labels[, topN or costArray]), "
                            "(binaryDecisionThreshold[, binaryPositiveClass]) or (costArray) as DL4J does, "
                            f"got a {type(first).__name__} first")
        elif second is not _UNSET and second is not None:  # Evaluation(None, costArray)
            cost_array = second
        if labels is not None and num_classes is None:
            num_classes = len(labels)
        if cost_array is not None and np.min(np.asarray(cost_array, np.float64)) < 0:
            raise ValueError(f"costArray values must be >= 0, got {np.asarray(cost_array).tolist()}")
        if binary_positive_class is _UNSET:
            binary_positive_class = 1
        if binary_positive_class not in (None, 0, 1):
            raise ValueError(f"binaryPositiveClass must be 0, 1 or None, got {binary_positive_class!r}")
        super().__init__(num_classes=num_classes, labels=labels, top_n=max(1, int(top_n)),
                         binary_threshold=binary_threshold, cost_array=cost_array)
        self.binary_positive_class = binary_positive_class

    # -- counts ------------------------------------------------------------------------------------
    def eval(self, labels, predictions=None, mask=None):
        """``eval(labels, networkPredictions[, mask])``: add a batch; ``eval(predictedIdx,
        actualIdx)``: add one example by its class indices (the number of classes must be known)."""
        if _is_int(labels) and _is_int(predictions):
            if self.num_classes is None:
                raise ValueError("eval(predictedIdx, actualIdx) needs the number of classes: "
                                 "Evaluation(numClasses) or Evaluation(labels)")
            eye = np.eye(self.num_classes)
            self.update(eye[[int(predictions)]], eye[[int(labels)]])  # (predictedIdx, actualIdx), DL4J's order
            return
        if predictions is None:
            raise TypeError("eval takes (labels, networkPredictions[, mask]) or (predictedIdx, actualIdx)")
        self.update(labels, predictions, mask)

    def evalTimeSeries(self, labels, predictions, mask=None):
        """DL4J's ``evalTimeSeries``: labels and predictions in DL4J's [examples, classes, time]
        layout (NCW); ``mask`` per time step [examples, time]."""
        self.update(np.swapaxes(np.asarray(labels), 1, 2), np.swapaxes(np.asarray(predictions), 1, 2), mask)

    def _counts(self):
        """True positives, false positives, false negatives and true negatives per class, as DL4J counts them."""
        tp, fp, fn = self._tp_fp_fn()
        return tp, fp, fn, self.count - tp - fp - fn

    def _as_map(self, values, kind=dict):
        return kind({i: int(v) for i, v in enumerate(values)})

    def truePositives(self) -> dict:
        """Class -> examples of the class predicted as it."""
        return self._as_map(self._counts()[0])

    def falsePositives(self) -> dict:
        """Class -> examples of other classes predicted as it."""
        return self._as_map(self._counts()[1])

    def falseNegatives(self) -> dict:
        """Class -> examples of the class predicted as another."""
        return self._as_map(self._counts()[2])

    def trueNegatives(self) -> dict:
        """Class -> examples of other classes not predicted as it."""
        return self._as_map(self._counts()[3])

    def positive(self) -> dict:
        """Class -> true positives + false negatives (the class's examples)."""
        tp, _, fn, _ = self._counts()
        return self._as_map(tp + fn)

    def negative(self) -> dict:
        """Class -> true negatives + false positives."""
        _, fp, _, tn = self._counts()
        return self._as_map(tn + fp)

    def getTruePositives(self) -> Counter:
        """:meth:`truePositives` as DL4J's ``Counter`` (``getCount(cls)``)."""
        return self._as_map(self._counts()[0], Counter)

    def getFalsePositives(self) -> Counter:
        """:meth:`falsePositives` as a ``Counter``."""
        return self._as_map(self._counts()[1], Counter)

    def getFalseNegatives(self) -> Counter:
        """:meth:`falseNegatives` as a ``Counter``."""
        return self._as_map(self._counts()[2], Counter)

    def getTrueNegatives(self) -> Counter:
        """:meth:`trueNegatives` as a ``Counter``."""
        return self._as_map(self._counts()[3], Counter)

    def classCount(self, cls: int) -> int:
        """Examples whose true class is ``cls``."""
        return self.positive()[cls]

    def getNumRowCounter(self) -> int:
        """Examples (rows) evaluated so far."""
        return self.count

    def getTopN(self) -> int:
        """N of the top-N accuracy (1: plain accuracy)."""
        return self.top_n

    def getTopNCorrectCount(self) -> int:
        """Examples whose true class is among the N highest scores (0 when N is 1, as DL4J)."""
        return int(self.top_n_correct) if self.top_n > 1 else 0

    def getTopNTotalCount(self) -> int:
        """Examples counted for the top-N accuracy (0 when N is 1, as DL4J)."""
        return int(self.count) if self.top_n > 1 else 0

    def getLabelsList(self) -> list:
        """The class names (``"0"``, ``"1"``, ... when none were given)."""
        n = self.num_classes or 0
        return list(self.class_labels) if self.class_labels else [str(i) for i in range(n)]

    def getClassLabel(self, cls: int) -> str:
        """The name of class ``cls``."""
        return self.getLabelsList()[cls]

    def getBinaryPositiveClass(self):
        """The class whose metrics two-class reports give (None: macro averages)."""
        return self.binary_positive_class

    def setBinaryPositiveClass(self, cls) -> None:
        """Set the positive class of a two-class evaluation (0, 1 or None)."""
        if cls not in (None, 0, 1):
            raise ValueError(f"binaryPositiveClass must be 0, 1 or None, got {cls!r}")
        self.binary_positive_class = cls

    def getBinaryDecisionThreshold(self):
        """The binary decision threshold (None: 0.5 / argmax)."""
        return self.binary_threshold

    def getCostArray(self):
        """The cost array (None: plain argmax)."""
        return None if self.cost_array is None else np.asarray(self.cost_array)

    def reset(self) -> None:
        """Forget the data seen (the settings stay)."""
        self.confusion = None if self.num_classes is None else np.zeros((self.num_classes,) * 2, np.int64)
        self.top_n_correct = self.count = 0

    # -- metrics -------------------------------------------------------------------------------------
    def _binary(self):
        return self.binary_positive_class is not None and self.num_classes == 2

    def _rate(self, num, den, cls, averaging, edge, exclude_undefined, what):
        """One class's ``num / den`` (``edge`` when 0/0), or their macro / micro average."""
        if _is_int(cls):
            return float(num[cls] / den[cls]) if den[cls] else float(edge)
        if cls is None:
            if self._binary():
                return self._rate(num, den, self.binary_positive_class, None, edge, exclude_undefined, what)
            cls = EvaluationAveraging.Macro
        avg = _averaging(cls if averaging is None else averaging, what)
        if avg == "micro":
            return float(num.sum() / den.sum()) if den.sum() else float(edge)
        defined = den > 0
        if exclude_undefined:
            return float((num[defined] / den[defined]).mean()) if defined.any() else 0.0
        return float(np.where(defined, num / np.where(defined, den, 1), edge).mean())

    def precision(self, cls=None, averaging=None, edge=0.0) -> float:
        """DL4J's ``precision()`` (the positive class's with two classes, else the macro average over
        the classes ever predicted), ``precision(cls)``, ``precision(EvaluationAveraging.Micro)``."""
        tp, fp, _, _ = self._counts()
        return self._rate(tp, tp + fp, cls, averaging, edge, True, "precision")

    def recall(self, cls=None, averaging=None, edge=0.0) -> float:
        """DL4J's ``recall()``, ``recall(cls)``, ``recall(EvaluationAveraging)`` (as :meth:`precision`)."""
        tp, _, fn, _ = self._counts()
        return self._rate(tp, tp + fn, cls, averaging, edge, True, "recall")

    def falsePositiveRate(self, cls=None, averaging=None, edge=0.0) -> float:
        """FP / (FP + TN): the positive class's with two classes, else the macro average over every class."""
        _, fp, _, tn = self._counts()
        return self._rate(fp, fp + tn, cls, averaging, edge, False, "falsePositiveRate")

    def falseNegativeRate(self, cls=None, averaging=None, edge=0.0) -> float:
        """FN / (FN + TP), as :meth:`falsePositiveRate`."""
        tp, _, fn, _ = self._counts()
        return self._rate(fn, fn + tp, cls, averaging, edge, False, "falseNegativeRate")

    def falseAlarmRate(self) -> float:
        """The mean of the false positive and false negative rates."""
        return (self.falsePositiveRate() + self.falseNegativeRate()) / 2.0

    def fBeta(self, beta: float, cls=None, averaging=None) -> float:
        """F-beta of class ``cls`` (0 where precision or recall is 0/0), or the macro average over
        the classes where both are defined, or the micro average."""
        tp, fp, fn, _ = self._counts()
        b2 = float(beta) ** 2

        def f(t, p, n):
            den = (1 + b2) * t + b2 * n + p
            return (1 + b2) * t / den if den else 0.0

        if cls is None and self._binary():
            cls = self.binary_positive_class
        if _is_int(cls):
            return float(f(tp[cls], fp[cls], fn[cls]) if (tp[cls] + fp[cls]) and (tp[cls] + fn[cls]) else 0.0)
        avg = _averaging(EvaluationAveraging.Macro if cls is None and averaging is None else
                         (averaging if averaging is not None else cls), "fBeta")
        if avg == "micro":
            return float(f(tp.sum(), fp.sum(), fn.sum()))
        defined = ((tp + fp) > 0) & ((tp + fn) > 0)
        return float(np.mean([f(tp[i], fp[i], fn[i]) for i in np.flatnonzero(defined)])) if defined.any() else 0.0

    def f1(self, cls=None, averaging=None) -> float:
        """DL4J's ``f1()``, ``f1(cls)``, ``f1(EvaluationAveraging)``: :meth:`fBeta` with beta 1."""
        return self.fBeta(1.0, cls, averaging)

    def gMeasure(self, cls) -> float:
        """sqrt(precision * recall) of class ``cls`` (or the macro / micro average)."""
        if _is_int(cls):
            return float(np.sqrt(self.precision(cls) * self.recall(cls)))
        if _averaging(cls, "gMeasure") == "micro":
            return float(np.sqrt(self.precision(EvaluationAveraging.Micro) * self.recall(EvaluationAveraging.Micro)))
        return float(np.mean([self.gMeasure(i) for i in range(self.num_classes)]))

    def matthewsCorrelation(self, cls) -> float:
        """Binary (one vs all) Matthews correlation of class ``cls``, or its macro / micro average."""
        if _is_int(cls):
            return self.matthews_correlation(int(cls))
        tp, fp, fn, tn = self._counts()
        if _averaging(cls, "matthewsCorrelation") == "macro":
            return float(np.mean([self.matthews_correlation(i) for i in range(self.num_classes)]))
        tp, fp, fn, tn = tp.sum(), fp.sum(), fn.sum(), tn.sum()
        den = np.sqrt(float((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)))
        return float((tp * tn - fp * fn) / den) if den else 0.0

    def _excluded(self, metric) -> list:
        tp, fp, fn, _ = self._counts()
        den = {"precision": tp + fp, "recall": tp + fn, "f1": np.minimum(tp + fp, tp + fn)}[metric]
        return [int(i) for i in np.flatnonzero(den == 0)]

    def averagePrecisionNumClassesExcluded(self) -> int:
        """Classes left out of the macro precision (never predicted: precision 0/0)."""
        return len(self._excluded("precision"))

    def averageRecallNumClassesExcluded(self) -> int:
        """Classes left out of the macro recall (never present: recall 0/0)."""
        return len(self._excluded("recall"))

    def averageF1NumClassesExcluded(self) -> int:
        """Classes left out of the macro F1."""
        return len(self._excluded("f1"))

    # -- reports -------------------------------------------------------------------------------------
    def confusionMatrix(self) -> str:
        """The confusion matrix as DL4J prints it (rows: actual, columns: predicted)."""
        if self.confusion is None:
            return "Confusion matrix: <no data>"
        names = self.getLabelsList()
        width = max(2, len(str(max(int(self.confusion.max()), self.num_classes))) + 1)
        rows = ["".join(f"{j:>{width}d}" for j in range(self.num_classes)), "-" * (width * self.num_classes + 1)]
        for i, row in enumerate(self.confusion):
            rows.append("".join(f"{int(v):>{width}d}" for v in row) + f" | {i} = {names[i]}")
        rows.append("\nConfusion matrix format: Actual (rowClass) predicted as (columnClass) N times")
        return "\n".join(rows)

    def confusionToString(self) -> str:
        """:meth:`confusionMatrix`."""
        return self.confusionMatrix()

    def stats(self, suppressWarnings: bool = False, includeConfusion=None) -> str:
        """DL4J's report: ``stats()``, ``stats(suppressWarnings)``, ``stats(suppressWarnings,
        includeConfusion)`` (the confusion matrix by default up to 20 classes)."""
        if self.confusion is None or self.count == 0:
            return "Evaluation: no data"
        n = self.num_classes
        line = "=" * 66
        out = ["", "========================Evaluation Metrics========================",
               f" # of classes:    {n}", f" Accuracy:        {self.accuracy():.4f}"]
        if self.top_n > 1:
            out.append(f" Top {self.top_n} Accuracy:  {self.top_n_accuracy():.4f}")
        for label, metric in (("Precision", "precision"), ("Recall", "recall"), ("F1 Score", "f1")):
            value = getattr(self, metric)(EvaluationAveraging.Macro) if not self._binary() else \
                getattr(self, metric)()
            text = f" {label + ':':<17}{value:.4f}"
            excluded = len(self._excluded(metric))
            if n > 2 and excluded:
                text += f"\t({excluded} class{'es' if excluded > 1 else ''} excluded from average)"
            out.append(text)
        if self._binary():
            out.append(f"Precision, recall & F1: reported for positive class (class {self.binary_positive_class} - "
                       f"\"{self.getClassLabel(self.binary_positive_class)}\") only")
        else:
            out.append(f"Precision, recall & F1: macro-averaged (equally weighted avg. of {n} classes)")
        if self.binary_threshold is not None:
            out.append(f"Binary decision threshold: {self.binary_threshold}")
        if self.cost_array is not None:
            out.append(f"Cost array: {list(self.cost_array)}")
        out.append("")
        if not suppressWarnings:
            tp, fp, fn, _ = self._counts()
            for metric, den in (("precision", fp), ("recall", fn)):
                classes = [int(i) for i in np.flatnonzero((tp == 0) & (den == 0))]
                if classes:
                    verb = "was" if len(classes) == 1 else "were"
                    out.append(f"Warning: {len(classes)} class{'es' if len(classes) > 1 else ''} {verb} never "
                               f"predicted by the model and {verb} excluded from average {metric}\n"
                               f"Classes excluded from average {metric}: {classes}")
        if includeConfusion is None:
            includeConfusion = n <= 20
        if includeConfusion:
            out += ["", "=========================Confusion Matrix=========================", self.confusionMatrix()]
        out.append(line)
        return "\n".join(out)


_register(Evaluation, _core.Evaluation)

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
