"""One round's statistics: the same record on both runtimes.

A :class:`RoundStats` is built by the cluster's job machine and by
:class:`~dlspark.ParallelWrapper`'s device runs alike, through one typed
constructor: the figures every round has, and the algorithm's own figures as a
typed :class:`RoundFigures` (each algorithm declares its fields once). It is a
``dict`` of those keys, so that callbacks, JSON exports and the dashboard read it
as they read any mapping; a new figure is one field of one class.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["RoundStats", "RoundFigures", "COMMON_KEYS", "iteration_rows"]

#: the keys every round has, on both runtimes, before the algorithm's own
COMMON_KEYS = ("event", "round", "epoch", "minibatches", "examples", "loss", "workers", "round_time", "fit_time_max",
               "worker_fit_time", "worker_steps", "data_wait", "trained_total", "attempts", "iterations")


@dataclass(frozen=True)
class RoundFigures:
    """An algorithm's own figures of a round (a subclass per algorithm declares its fields)."""

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class RoundStats(dict):
    """One round's statistics (see the module's docstring); read as a dict or by attribute.

    Keys: :data:`COMMON_KEYS`, then the fields of the algorithm's figures (``extra``).
    Per-worker figures (``worker_fit_time``, ``worker_steps``, ``data_wait``) map a worker
    (an address on a cluster, a device index in a ParallelWrapper) to its value.
    ``iterations`` holds one row per minibatch trained in the round (see
    :func:`iteration_rows`): what per-iteration listeners are called with.
    """

    @classmethod
    def build(cls, *, round: int, epoch: int, minibatches: int, examples: int, loss: float | None, workers: int,
              round_time: float, fit_time_max: float, worker_fit_time: dict, worker_steps: dict, data_wait: dict,
              trained_total: int, attempts: int, extra: RoundFigures, iterations: list = ()) -> "RoundStats":
        if not isinstance(extra, RoundFigures):
            raise TypeError(f"extra must be a RoundFigures (the algorithm's figures), got {type(extra).__name__}")
        figures = extra.as_dict()
        clash = set(figures) & set(COMMON_KEYS)
        if clash:
            raise ValueError(f"{type(extra).__name__} redeclares the common figures {sorted(clash)}")
        out = cls(event="round", round=round, epoch=epoch, minibatches=minibatches, examples=examples, loss=loss,
                  workers=workers, round_time=round_time, fit_time_max=fit_time_max,
                  worker_fit_time=dict(worker_fit_time), worker_steps=dict(worker_steps), data_wait=dict(data_wait),
                  trained_total=trained_total, attempts=attempts, iterations=list(iterations), **figures)
        out.__dict__["extra"] = extra
        return out

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"round statistics have no {name!r}; they have {sorted(self)}") from None

    def __reduce__(self):
        # a plain dict and the figures: rebuilt as the same record where it is unpickled
        return (_rebuild, (dict(self), self.__dict__.get("extra")))


def iteration_rows(first: int, epoch: int, steps: dict, fit_time: dict) -> list:
    """One round's per-iteration rows, from each worker's minibatches.

    Parameters
    ----------
    first : int
        The minibatches the fit had trained before the round: the first row's ``fit_step``.
    epoch : int
        The round's epoch within the fit.
    steps : dict
        Worker -> its minibatches' ``(loss, examples)`` in the order it trained them (a
        non-finite loss included: the minibatch counts as trained).
    fit_time : dict
        Worker -> its fit time in the round (seconds).

    Returns
    -------
    list of dict
        ``{"fit_step", "epoch", "worker", "loss", "examples", "time"}`` per minibatch, the
        workers' k-th minibatches before their (k+1)-th (they train side by side), and
        ``fit_step`` counting up from ``first``. ``time`` is the worker's fit time shared
        equally among its minibatches: a round's steps run without a host sync between them
        (or as one compiled call), so no step has a time of its own.
    """
    rows, order = [], sorted(steps, key=str)
    for k in range(max((len(v) for v in steps.values()), default=0)):
        for w in order:
            if k < len(steps[w]):
                loss, examples = steps[w][k]
                rows.append({"fit_step": first + len(rows), "epoch": epoch, "worker": w, "loss": float(loss),
                             "examples": int(examples), "time": float(fit_time.get(w, 0.0)) / len(steps[w])})
    return rows


def _rebuild(values, extra):
    out = RoundStats(values)
    if extra is not None:
        out.__dict__["extra"] = extra
    return out
