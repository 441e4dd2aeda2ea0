"""RegressionEvaluation and EvaluationCalibration."""

from __future__ import annotations

import numpy as np

from ._base import BaseEvaluation, flatten_masked

__all__ = ["RegressionEvaluation", "EvaluationCalibration"]


class RegressionEvaluation(BaseEvaluation):
    """Per-column regression metrics (DL4J's ``RegressionEvaluation``).

    Keeps, per column, the count, means, centred second moments and
    co-moment of labels and predictions, merged with Chan's parallel formulas,
    so merged results equal a single pass to float64 precision.
    """

    _config = ("column_names",)
    _state = ("n", "mean_y", "mean_p", "m2_y", "m2_p", "c_yp", "sse", "sae")

    def __init__(self, column_names=None):
        self.column_names = list(column_names) if column_names is not None else None
        self.n = 0
        self.mean_y = self.mean_p = self.m2_y = self.m2_p = self.c_yp = self.sse = self.sae = None

    def update(self, labels, predictions, mask=None):
        y, p = flatten_masked(labels, predictions, mask)
        if y.shape[0] == 0:
            return
        other = RegressionEvaluation(self.column_names)
        other.n = y.shape[0]
        other.mean_y, other.mean_p = y.mean(0), p.mean(0)
        dy, dp = y - other.mean_y, p - other.mean_p
        other.m2_y, other.m2_p, other.c_yp = (dy * dy).sum(0), (dp * dp).sum(0), (dy * dp).sum(0)
        err = p - y
        other.sse, other.sae = (err * err).sum(0), np.abs(err).sum(0)
        self._merge(other)

    def _merge(self, o):
        if o.n == 0:
            return
        if self.n == 0:
            for k in self._state:
                v = getattr(o, k)
                setattr(self, k, v.copy() if isinstance(v, np.ndarray) else v)
            return
        if len(self.mean_y) != len(o.mean_y):
            raise ValueError(f"this RegressionEvaluation has {len(self.mean_y)} columns, got {len(o.mean_y)}")
        n = self.n + o.n
        dy, dp = o.mean_y - self.mean_y, o.mean_p - self.mean_p
        f = self.n * o.n / n
        self.m2_y = self.m2_y + o.m2_y + dy * dy * f
        self.m2_p = self.m2_p + o.m2_p + dp * dp * f
        self.c_yp = self.c_yp + o.c_yp + dy * dp * f
        self.mean_y = self.mean_y + dy * o.n / n
        self.mean_p = self.mean_p + dp * o.n / n
        self.sse, self.sae, self.n = self.sse + o.sse, self.sae + o.sae, n

    def _check(self):
        if self.n == 0:
            raise ValueError("this RegressionEvaluation has seen no data; call update() first")

    def num_columns(self) -> int:
        return 0 if self.mean_y is None else len(self.mean_y)

    def mean_squared_error(self, column) -> float:
        self._check()
        return float(self.sse[column] / self.n)

    def mean_absolute_error(self, column) -> float:
        self._check()
        return float(self.sae[column] / self.n)

    def root_mean_squared_error(self, column) -> float:
        return float(np.sqrt(self.mean_squared_error(column)))

    def relative_squared_error(self, column) -> float:
        self._check()
        return float(self.sse[column] / self.m2_y[column])

    def r_squared(self, column) -> float:
        """Coefficient of determination, 1 - SSE / SST (scikit-learn's ``r2_score``)."""
        return 1.0 - self.relative_squared_error(column)

    def pearson_correlation(self, column) -> float:
        self._check()
        return float(self.c_yp[column] / np.sqrt(self.m2_y[column] * self.m2_p[column]))

    def average_mean_squared_error(self) -> float:
        return float(np.mean([self.mean_squared_error(i) for i in range(self.num_columns())]))

    def stats(self) -> str:
        if self.n == 0:
            return "RegressionEvaluation: no data"
        names = self.column_names or [f"col_{i}" for i in range(self.num_columns())]
        rows = ["Column    MSE          MAE          RMSE         RSE          R^2          PC"]
        for i, nm in enumerate(names):
            rows.append(f"{nm:<9} " + " ".join(f"{f(i):<12.5e}" for f in (
                self.mean_squared_error, self.mean_absolute_error, self.root_mean_squared_error,
                self.relative_squared_error, self.r_squared, self.pearson_correlation)))
        return "\n".join(rows)


class EvaluationCalibration(BaseEvaluation):
    """Calibration of predicted probabilities (DL4J's ``EvaluationCalibration``).

    Per class: a reliability diagram (mean predicted probability and observed
    frequency in ``reliability_bins`` bins over [0, 1]), a histogram of the
    residuals ``|label - probability|``, and a histogram of the probabilities.
    """

    _config = ("reliability_bins", "histogram_bins")
    _state = ("bin_count", "bin_prob_sum", "bin_pos", "residual_hist", "prob_hist")

    def __init__(self, reliability_bins=10, histogram_bins=50):
        for name, v in (("reliability_bins", reliability_bins), ("histogram_bins", histogram_bins)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        self.reliability_bins, self.histogram_bins = reliability_bins, histogram_bins
        self.bin_count = self.bin_prob_sum = self.bin_pos = self.residual_hist = self.prob_hist = None

    @staticmethod
    def _bin(x, bins):
        return np.clip((x * bins).astype(np.int64), 0, bins - 1)

    def update(self, labels, predictions, mask=None):
        y, p = flatten_masked(labels, predictions, mask)
        c, rb, hb = p.shape[1], self.reliability_bins, self.histogram_bins
        if self.bin_count is None:
            self.bin_count = np.zeros((c, rb), np.int64)
            self.bin_prob_sum = np.zeros((c, rb))
            self.bin_pos = np.zeros((c, rb), np.int64)
            self.residual_hist = np.zeros((c, hb), np.int64)
            self.prob_hist = np.zeros((c, hb), np.int64)
        elif self.bin_count.shape[0] != c:
            raise ValueError(f"this EvaluationCalibration has {self.bin_count.shape[0]} classes, got {c}")
        for j in range(c):
            b = self._bin(p[:, j], rb)
            self.bin_count[j] += np.bincount(b, minlength=rb)
            self.bin_prob_sum[j] += np.bincount(b, weights=p[:, j], minlength=rb)
            self.bin_pos[j] += np.bincount(b, weights=y[:, j], minlength=rb).astype(np.int64)
            self.residual_hist[j] += np.bincount(self._bin(np.abs(y[:, j] - p[:, j]), hb), minlength=hb)
            self.prob_hist[j] += np.bincount(self._bin(p[:, j], hb), minlength=hb)

    def _merge(self, o):
        if o.bin_count is None:
            return
        if self.bin_count is None:
            for k in self._state:
                setattr(self, k, getattr(o, k).copy())
        else:
            for k in self._state:
                setattr(self, k, getattr(self, k) + getattr(o, k))

    def reliability_diagram(self, cls):
        """(mean predicted probability, fraction of positives) for each non-empty bin."""
        if self.bin_count is None:
            raise ValueError("this EvaluationCalibration has seen no data")
        n = self.bin_count[cls]
        keep = n > 0
        return self.bin_prob_sum[cls][keep] / n[keep], self.bin_pos[cls][keep] / n[keep]

    def residual_plot(self, cls):
        """Counts of ``|label - probability|`` in ``histogram_bins`` bins over [0, 1]."""
        return self.residual_hist[cls].copy()

    def probability_histogram(self, cls):
        return self.prob_hist[cls].copy()

    def stats(self) -> str:
        if self.bin_count is None:
            return "EvaluationCalibration: no data"
        lines = []
        for j in range(self.bin_count.shape[0]):
            mp, fp = self.reliability_diagram(j)
            lines.append(f"class {j}: " + " ".join(f"({a:.2f},{b:.2f})" for a, b in zip(mp, fp)))
        return "Reliability (mean predicted, observed)\n" + "\n".join(lines)
