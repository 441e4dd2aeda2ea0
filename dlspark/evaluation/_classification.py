"""Classification metrics: Evaluation (multi-class) and EvaluationBinary (multi-label)."""

from __future__ import annotations

import numpy as np

from ._base import BaseEvaluation, flatten_masked

__all__ = ["Evaluation", "EvaluationBinary"]

_AVERAGING = ("macro", "micro")


def _div(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


class Evaluation(BaseEvaluation):
    """Multi-class classification metrics (DL4J's ``Evaluation``).

    Parameters
    ----------
    num_classes : int, optional
        Fixed on the first ``update`` when not given.
    labels : list of str, optional
        Class names for :meth:`~dlspark.evaluation.Evaluation.stats`.
    top_n : int
        Also count top-N accuracy.
    binary_threshold : float, optional
        For two-class (or one-column) outputs: predict class 1 when its
        probability is at least this (DL4J's binary decision threshold).
    cost_array : sequence of float, optional
        Predict ``argmax(probabilities * cost_array)`` (DL4J's cost array).

    Examples
    --------
    >>> import numpy as np
    >>> e = Evaluation()
    >>> e.update(np.eye(3)[[0, 1, 2]], np.eye(3)[[0, 1, 1]])
    >>> round(e.accuracy(), 4)
    0.6667
    """

    _config = ("num_classes", "class_labels", "top_n", "binary_threshold", "cost_array")
    _state = ("confusion", "top_n_correct", "count")
    _inferred = ("num_classes",)
    _init_names = {"class_labels": "labels"}

    def __init__(self, num_classes=None, labels=None, top_n=1, binary_threshold=None, cost_array=None):
        if top_n < 1:
            raise ValueError(f"top_n must be >= 1, got {top_n!r}")
        if binary_threshold is not None and cost_array is not None:
            raise ValueError("give binary_threshold or cost_array, not both")
        self.num_classes = None if num_classes is None else int(num_classes)
        self.class_labels = list(labels) if labels is not None else None
        self.top_n = int(top_n)
        self.binary_threshold = binary_threshold
        self.cost_array = None if cost_array is None else [float(c) for c in cost_array]
        self.confusion = None if self.num_classes is None else np.zeros((self.num_classes,) * 2, np.int64)
        self.top_n_correct = 0
        self.count = 0

    def _predicted(self, p):
        if p.shape[1] == 1:  # one sigmoid column: class 1 vs 0
            return (p[:, 0] >= (0.5 if self.binary_threshold is None else self.binary_threshold)).astype(int)
        if self.binary_threshold is not None:
            if p.shape[1] != 2:
                raise ValueError(f"binary_threshold needs 1 or 2 output columns, got {p.shape[1]}")
            return (p[:, 1] >= self.binary_threshold).astype(int)
        if self.cost_array is not None:
            if len(self.cost_array) != p.shape[1]:
                raise ValueError(f"cost_array has {len(self.cost_array)} entries for {p.shape[1]} classes")
            p = p * np.asarray(self.cost_array)
        return p.argmax(1)

    def update(self, labels, predictions, mask=None):
        """Add a batch: one-hot (or integer) labels and per-class scores/probabilities."""
        y, p = flatten_masked(labels, predictions, mask)
        k = max(p.shape[1], 2)
        if self.num_classes is None:
            self.num_classes = k
            self.confusion = np.zeros((k, k), np.int64)
        if k != self.num_classes:
            raise ValueError(f"this Evaluation has {self.num_classes} classes, got outputs with {p.shape[1]} columns")
        if y.shape[1] == 1:
            true = (y[:, 0] >= 0.5).astype(int)
        else:
            if not np.all(np.isin(y, (0.0, 1.0))) or not np.all(y.sum(1) == 1):
                raise ValueError("labels must be one-hot (exactly one 1 per row) or integer class ids")
            true = y.argmax(1)
        pred = self._predicted(p)
        np.add.at(self.confusion, (true, pred), 1)
        if p.shape[1] > 1:
            top = np.argsort(-p, axis=1, kind="stable")[:, : self.top_n]
            self.top_n_correct += int((top == true[:, None]).any(1).sum())
        else:
            self.top_n_correct += int((pred == true).sum())
        self.count += len(true)

    def _merge(self, other):
        if other.confusion is None:
            return
        if self.confusion is None:
            self.num_classes, self.confusion = other.num_classes, other.confusion.copy()
        else:
            self.confusion = self.confusion + other.confusion
        self.top_n_correct += other.top_n_correct
        self.count += other.count

    # -- metrics ---------------------------------------------------------------
    def _check(self):
        if self.confusion is None or self.count == 0:
            raise ValueError("this Evaluation has seen no data; call update() first")

    def confusion_matrix(self) -> np.ndarray:
        """Counts: rows are true classes, columns predicted classes."""
        self._check()
        return self.confusion.copy()

    def _tp_fp_fn(self):
        self._check()
        c = self.confusion
        tp = np.diag(c)
        return tp, c.sum(0) - tp, c.sum(1) - tp

    def _present(self):
        c = self.confusion
        return (c.sum(0) + c.sum(1)) > 0

    def accuracy(self) -> float:
        self._check()
        return float(np.trace(self.confusion) / self.count)

    def top_n_accuracy(self) -> float:
        self._check()
        return float(self.top_n_correct / self.count)

    def _metric(self, per_class, micro, cls, averaging):
        if cls is not None:
            return float(per_class[cls])
        if averaging not in _AVERAGING:
            raise ValueError(f"averaging must be one of {_AVERAGING}, got {averaging!r}")
        if averaging == "micro":
            return float(micro)
        return float(per_class[self._present()].mean())

    def precision(self, cls=None, averaging="macro") -> float:
        """Precision of class ``cls``, or averaged over the classes seen (macro by default)."""
        tp, fp, fn = self._tp_fp_fn()
        return self._metric(_div(tp, tp + fp), _div(tp.sum(), (tp + fp).sum()), cls, averaging)

    def recall(self, cls=None, averaging="macro") -> float:
        tp, fp, fn = self._tp_fp_fn()
        return self._metric(_div(tp, tp + fn), _div(tp.sum(), (tp + fn).sum()), cls, averaging)

    def f1(self, cls=None, averaging="macro") -> float:
        tp, fp, fn = self._tp_fp_fn()
        return self._metric(_div(2 * tp, 2 * tp + fp + fn), _div(2 * tp.sum(), (2 * tp + fp + fn).sum()), cls,
                            averaging)

    def false_positive_rate(self, cls) -> float:
        tp, fp, fn = self._tp_fp_fn()
        tn = self.count - tp - fp - fn
        return float(_div(fp, fp + tn)[cls])

    def matthews_correlation(self, cls) -> float:
        tp, fp, fn = (x[cls] for x in self._tp_fp_fn())
        tn = self.count - tp - fp - fn
        den = np.sqrt(float((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)))
        return float((tp * tn - fp * fn) / den) if den else 0.0

    def stats(self) -> str:
        if self.confusion is None or self.count == 0:
            return "Evaluation: no data"
        names = self.class_labels or [str(i) for i in range(self.num_classes)]
        lines = [f"Examples: {self.count}   Classes: {self.num_classes}",
                 f" Accuracy:  {self.accuracy():.4f}", f" Precision: {self.precision():.4f}  (macro)",
                 f" Recall:    {self.recall():.4f}  (macro)", f" F1 Score:  {self.f1():.4f}  (macro)"]
        if self.top_n > 1:
            lines.append(f" Top {self.top_n} accuracy: {self.top_n_accuracy():.4f}")
        lines.append("Confusion matrix (rows: actual, columns: predicted)")
        w = max(len(n) for n in names) + 1
        lines.append(" " * w + "".join(f"{n:>7}" for n in names))
        for n, row in zip(names, self.confusion):
            lines.append(f"{n:>{w}}" + "".join(f"{v:>7d}" for v in row))
        return "\n".join(lines)


class EvaluationBinary(BaseEvaluation):
    """Per-output binary metrics for multi-label outputs (DL4J's ``EvaluationBinary``).

    Each output column is its own binary problem; a prediction is positive
    when its probability is at least ``threshold``.
    """

    _config = ("threshold",)
    _state = ("tp", "fp", "tn", "fn")

    def __init__(self, threshold=0.5):
        self.threshold = float(threshold)
        self.tp = self.fp = self.tn = self.fn = None

    def update(self, labels, predictions, mask=None):
        y, p = flatten_masked(labels, predictions, mask)
        if not np.all(np.isin(y, (0.0, 1.0))):
            raise ValueError("EvaluationBinary labels must be 0 or 1")
        pos, pred = y == 1, p >= self.threshold
        counts = [(pos & pred).sum(0), (~pos & pred).sum(0), (~pos & ~pred).sum(0), (pos & ~pred).sum(0)]
        if self.tp is None:
            self.tp, self.fp, self.tn, self.fn = (c.astype(np.int64) for c in counts)
        elif len(self.tp) != y.shape[1]:
            raise ValueError(f"this EvaluationBinary has {len(self.tp)} outputs, got {y.shape[1]}")
        else:
            self.tp, self.fp, self.tn, self.fn = (a + c for a, c in zip((self.tp, self.fp, self.tn, self.fn), counts))

    def _merge(self, other):
        if other.tp is None:
            return
        if self.tp is None:
            self.tp, self.fp, self.tn, self.fn = (x.copy() for x in (other.tp, other.fp, other.tn, other.fn))
        else:
            self.tp, self.fp, self.tn, self.fn = (a + b for a, b in zip((self.tp, self.fp, self.tn, self.fn),
                                                                        (other.tp, other.fp, other.tn, other.fn)))

    def num_outputs(self) -> int:
        return 0 if self.tp is None else len(self.tp)

    def accuracy(self, output) -> float:
        return float(_div(self.tp + self.tn, self.tp + self.tn + self.fp + self.fn)[output])

    def precision(self, output) -> float:
        return float(_div(self.tp, self.tp + self.fp)[output])

    def recall(self, output) -> float:
        return float(_div(self.tp, self.tp + self.fn)[output])

    def f1(self, output) -> float:
        return float(_div(2 * self.tp, 2 * self.tp + self.fp + self.fn)[output])

    def stats(self) -> str:
        if self.tp is None:
            return "EvaluationBinary: no data"
        rows = ["output  accuracy  precision  recall  f1"]
        for i in range(self.num_outputs()):
            rows.append(f"{i:>6}  {self.accuracy(i):8.4f}  {self.precision(i):9.4f}  {self.recall(i):6.4f}  {self.f1(i):.4f}")
        return "\n".join(rows)
