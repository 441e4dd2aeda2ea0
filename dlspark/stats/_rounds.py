"""The per-round columns the live page ``/dlspark`` plots: pure functions of the round records
(no bokeh), shared by the page (:mod:`dlspark.stats._pages`) and its keeper (:mod:`dlspark.stats._live`)."""

from __future__ import annotations

import collections

__all__ = ["round_table", "worker_rates"]

_PHASE_COLUMNS = ("fit", "data_wait", "combine", "other")


def round_table(rounds) -> dict:
    """Columns of per-round figures the live page plots (pure; also what tests compare)."""
    cols = {k: [] for k in ("round", "loss", "round_time", *_PHASE_COLUMNS, "bytes", "threshold")}
    for r in rounds:
        fit = float(r.get("fit_time_max", 0.0))
        wait = max(r.get("data_wait", {}).values(), default=0.0) if isinstance(r.get("data_wait"), dict) else 0.0
        combine = float(r.get("avg_time", 0.0))
        total = float(r.get("round_time", 0.0))
        thresholds = r.get("threshold")
        cols["round"].append(int(r["round"]))
        cols["loss"].append(float("nan") if r.get("loss") is None else float(r["loss"]))
        cols["round_time"].append(total)
        cols["fit"].append(max(fit - wait, 0.0))
        cols["data_wait"].append(wait)
        cols["combine"].append(combine)
        cols["other"].append(max(total - fit - combine, 0.0))
        cols["bytes"].append(int(r.get("bytes_sent", 0)) + int(r.get("bytes_received", 0)))
        cols["threshold"].append(float(sum(thresholds.values()) / len(thresholds))
                                 if isinstance(thresholds, dict) and thresholds else float("nan"))
    return cols


def worker_rates(rounds) -> dict:
    """``{"worker": [...], "steps_per_s": [...]}`` over the rounds so far."""
    steps, times = collections.Counter(), collections.Counter()
    for r in rounds:
        for w, t in (r.get("worker_fit_time") or {}).items():
            times[w] += t
            steps[w] += (r.get("worker_steps") or {}).get(w, 0)
    ws = sorted(times)
    return {"worker": ws, "steps_per_s": [steps[w] / times[w] if times[w] > 0 else 0.0 for w in ws]}
