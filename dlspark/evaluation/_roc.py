"""ROC and precision-recall: ROC (binary), ROCBinary (per output), ROCMultiClass (one vs all).

``threshold_steps=0`` is exact: every (probability, label) pair is kept, and
AUC / AUPRC equal scikit-learn's ``roc_auc_score`` / ``average_precision_score``.
``threshold_steps=S > 0`` keeps two histograms of S bins over [0, 1] instead
(memory independent of the data); the curves are then evaluated at the
thresholds 0, 1/S, ..., 1, as in DL4J, and AUC is the trapezoid over those points.
"""

from __future__ import annotations

import numpy as np

from ._base import BaseEvaluation, flatten_masked

__all__ = ["ROC", "ROCBinary", "ROCMultiClass"]

_trapezoid = getattr(np, "trapezoid", None) or np.trapz  # numpy < 2 names it trapz


def _curve_exact(scores, labels):
    """(fpr, tpr, precision, recall, thresholds) at every distinct score, highest first."""
    order = np.argsort(-scores, kind="mergesort")
    s, y = scores[order], labels[order]
    distinct = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1]
    tps = np.cumsum(y)[distinct]
    fps = (distinct + 1) - tps
    return tps, fps, s[distinct]


def _curve_hist(pos_hist, neg_hist):
    # counts at or above each threshold i/S, from the highest threshold down
    tps = np.cumsum(pos_hist[::-1])
    fps = np.cumsum(neg_hist[::-1])
    steps = len(pos_hist)
    return tps.astype(np.float64), fps.astype(np.float64), np.arange(steps - 1, -1, -1) / steps


def _auc(tps, fps):
    P, N = tps[-1], fps[-1]
    if P == 0 or N == 0:
        return float("nan")
    tpr, fpr = np.r_[0, tps] / P, np.r_[0, fps] / N
    return float(_trapezoid(tpr, fpr))


def _auprc(tps, fps):
    P = tps[-1]
    if P == 0:
        return float("nan")
    precision = tps / np.maximum(tps + fps, 1)
    recall = np.r_[0, tps / P]
    return float(np.sum(np.diff(recall) * precision))


class _Curve:
    """One binary ROC accumulator (exact or histogram)."""

    def __init__(self, steps):
        self.steps = steps
        self.scores, self.labels = [], []
        self.pos = np.zeros(steps, np.int64) if steps else None
        self.neg = np.zeros(steps, np.int64) if steps else None

    def add(self, scores, labels):
        if self.steps:
            idx = np.clip((scores * self.steps).astype(np.int64), 0, self.steps - 1)
            self.pos += np.bincount(idx[labels == 1], minlength=self.steps)
            self.neg += np.bincount(idx[labels == 0], minlength=self.steps)
        else:
            self.scores.append(scores.astype(np.float64))
            self.labels.append(labels.astype(np.int8))

    def counts(self):
        if self.steps:
            return _curve_hist(self.pos, self.neg)
        if not self.scores:
            raise ValueError("this ROC has seen no data; call update() first")
        s, y = np.concatenate(self.scores), np.concatenate(self.labels)
        self.scores, self.labels = [s], [y]
        return _curve_exact(s, y)

    def state(self):
        if self.steps:
            return self.pos, self.neg
        s = np.concatenate(self.scores) if self.scores else np.zeros(0)
        y = np.concatenate(self.labels) if self.labels else np.zeros(0, np.int8)
        return s, y


class _ROCBase(BaseEvaluation):
    _config = ("threshold_steps",)
    _state = ("_a", "_b")

    def __init__(self, threshold_steps=0):
        if isinstance(threshold_steps, bool) or not isinstance(threshold_steps, int) or threshold_steps < 0:
            raise ValueError(f"threshold_steps must be an integer >= 0 (0 = exact), got {threshold_steps!r}")
        self.threshold_steps = threshold_steps
        self._a = self._b = None  # per column: scores/pos histogram, labels/neg histogram (2-d arrays or lists)

    # state as a list of curves, rebuilt from the serialisable arrays
    def _curves(self):
        if self._a is None:
            return []
        out = []
        for a, b in zip(self._a, self._b):
            c = _Curve(self.threshold_steps)
            if self.threshold_steps:
                c.pos, c.neg = np.asarray(a, np.int64), np.asarray(b, np.int64)
            else:
                c.scores, c.labels = [np.asarray(a, np.float64)], [np.asarray(b, np.int8)]
            out.append(c)
        return out

    def _store(self, curves):
        # one row per column: histograms, or (exact mode) every score and label seen,
        # which all columns have in equal number
        st = [c.state() for c in curves]
        self._a, self._b = np.stack([s[0] for s in st]), np.stack([s[1] for s in st])

    def _add_columns(self, scores, labels):
        if not np.all(np.isin(labels, (0.0, 1.0))):
            raise ValueError(f"{type(self).__name__} labels must be 0/1 (or one-hot)")
        curves = self._curves() or [_Curve(self.threshold_steps) for _ in range(scores.shape[1])]
        if len(curves) != scores.shape[1]:
            raise ValueError(f"this {type(self).__name__} has {len(curves)} outputs, got {scores.shape[1]}")
        for j, c in enumerate(curves):
            c.add(scores[:, j], labels[:, j])
        self._store(curves)

    def _merge(self, other):
        if other._a is None:
            return
        if self._a is None:
            self._a, self._b = other._a.copy(), other._b.copy()
        elif self.threshold_steps:
            self._a, self._b = self._a + other._a, self._b + other._b
        else:
            self._a, self._b = np.concatenate([self._a, other._a], 1), np.concatenate([self._b, other._b], 1)

    def _curve(self, j):
        curves = self._curves()
        if not curves:
            raise ValueError(f"this {type(self).__name__} has seen no data; call update() first")
        return curves[j].counts()

    def _auc_of(self, j):
        tps, fps, _ = self._curve(j)
        return _auc(tps, fps)

    def _auprc_of(self, j):
        tps, fps, _ = self._curve(j)
        return _auprc(tps, fps)

    def _roc_curve_of(self, j):
        """(false positive rates, true positive rates, thresholds), starting at (0, 0)."""
        tps, fps, thr = self._curve(j)
        return np.r_[0, fps / max(fps[-1], 1)], np.r_[0, tps / max(tps[-1], 1)], np.r_[np.inf, thr]

    def _pr_curve_of(self, j):
        """(precision, recall, thresholds)."""
        tps, fps, thr = self._curve(j)
        return tps / np.maximum(tps + fps, 1), tps / max(tps[-1], 1), thr


class ROC(_ROCBase):
    """Binary ROC (DL4J's ``ROC``).

    Predictions are one probability column, or a two-column softmax output
    (column 1 is the positive class); labels likewise (0/1 or one-hot).
    """

    def update(self, labels, predictions, mask=None):
        y, p = flatten_masked(labels, predictions, mask)
        if p.shape[1] not in (1, 2):
            raise ValueError(f"ROC takes 1 or 2 output columns, got {p.shape[1]}; use ROCMultiClass or ROCBinary")
        self._add_columns(p[:, -1:], y[:, -1:])

    def calculate_auc(self) -> float:
        return self._auc_of(0)

    def calculate_auprc(self) -> float:
        return self._auprc_of(0)

    def roc_curve(self):
        return self._roc_curve_of(0)

    def precision_recall_curve(self):
        return self._pr_curve_of(0)

    def stats(self) -> str:
        if self._a is None:
            return "ROC: no data"
        return f"AUC (area under ROC curve): {self.calculate_auc():.6f}\nAUPRC (area under precision/recall curve): {self.calculate_auprc():.6f}"


class ROCBinary(_ROCBase):
    """One binary ROC per output column (multi-label outputs; DL4J's ``ROCBinary``)."""

    def update(self, labels, predictions, mask=None):
        y, p = flatten_masked(labels, predictions, mask)
        self._add_columns(p, y)

    def num_outputs(self) -> int:
        return 0 if self._a is None else len(self._a)

    def calculate_auc(self, output) -> float:
        return self._auc_of(output)

    def calculate_auprc(self, output) -> float:
        return self._auprc_of(output)

    def roc_curve(self, output):
        return self._roc_curve_of(output)

    def stats(self) -> str:
        if self._a is None:
            return "ROCBinary: no data"
        return "\n".join(f"output {i}: AUC {self.calculate_auc(i):.6f}  AUPRC {self.calculate_auprc(i):.6f}"
                         for i in range(self.num_outputs()))


class ROCMultiClass(ROCBinary):
    """One-vs-all ROC per class of a softmax output (DL4J's ``ROCMultiClass``)."""

    def update(self, labels, predictions, mask=None):
        y, p = flatten_masked(labels, predictions, mask)
        if p.shape[1] < 2:
            raise ValueError("ROCMultiClass takes one column per class (at least 2)")
        self._add_columns(p, y)

    def calculate_average_auc(self) -> float:
        return float(np.nanmean([self.calculate_auc(i) for i in range(self.num_outputs())]))
