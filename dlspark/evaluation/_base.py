"""Shared machinery of the evaluations: masks, merging, JSON."""

from __future__ import annotations

import copy
import json

import numpy as np

__all__ = ["BaseEvaluation", "flatten_masked", "from_json"]

_REGISTRY: dict = {}


def flatten_masked(labels, predictions, mask=None):
    """Turn ``[batch, (time,) columns]`` labels and predictions into rows, dropping masked entries.

    ``mask`` is per example ``[batch]`` or per time step ``[batch, time]`` (a
    trailing axis of 1 is accepted). Returns float64 ``(labels, predictions)``
    of shape ``[rows, columns]`` (columns = 1 for 1-d input).
    """
    y = np.asarray(labels)
    p = np.asarray(predictions, dtype=np.float64)
    if p.ndim == 1:
        p = p[:, None]
    if y.ndim == p.ndim - 1 and np.issubdtype(y.dtype, np.integer) and p.shape[-1] > 1:
        n = p.shape[-1]
        if y.size and (y.min() < 0 or y.max() >= n):
            bad = np.unique(y[(y < 0) | (y >= n)])
            raise ValueError(f"the labels hold class ids {bad[:10].tolist()} outside [0, {n}): the predictions "
                             f"have {n} columns, so class ids run from 0 to {n - 1}")
        y = np.eye(n)[y]  # integer class ids -> one-hot
    if y.ndim == 1:
        y = y[:, None]
    if y.shape != p.shape:
        raise ValueError(f"labels of shape {y.shape} do not match predictions of shape {p.shape}; "
                         "give one-hot labels of the predictions' shape or integer class ids")
    if mask is not None:
        m = np.asarray(mask)
        if m.ndim == y.ndim and m.shape[-1] == 1 and m.ndim > 1:
            m = m[..., 0]
        if m.ndim >= y.ndim or m.shape != y.shape[: m.ndim]:
            raise ValueError(f"mask of shape {m.shape} does not fit labels of shape {y.shape}; a mask is "
                             f"per example {y.shape[:1]} or per time step {y.shape[:2]}")
        m = np.broadcast_to(m.reshape(m.shape + (1,) * (y.ndim - 1 - m.ndim)), y.shape[:-1]) != 0
        y, p = y[m], p[m]
    return y.reshape(-1, y.shape[-1]).astype(np.float64), p.reshape(-1, p.shape[-1])


class BaseEvaluation:
    """An accumulator: ``update`` with batches, ``merge`` partial results, JSON round trip."""

    #: names of the attributes that hold the state (arrays or plain values)
    _state: tuple = ()
    _config: tuple = ()

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        _REGISTRY[cls.__name__] = cls

    #: settings that the first data sets when the user left them None (so one side of a merge
    #: that has seen no data may still have None there)
    _inferred: tuple = ()
    #: constructor argument of a setting, where its name differs
    _init_names: dict = {}

    def merge(self, other):
        """Fold ``other`` (same type and settings) into this evaluation and return this one."""
        if type(other) is not type(self):
            raise TypeError(f"cannot merge {type(other).__name__} into {type(self).__name__}")
        for c in self._config:
            a, b = getattr(self, c), getattr(other, c)
            if c in self._inferred and (a is None or b is None):
                continue
            if not _same(a, b):
                raise ValueError(f"cannot merge evaluations with different {c}: {a!r} and {b!r}")
        self._merge(other)
        for c in self._inferred:
            if getattr(self, c) is None:
                setattr(self, c, getattr(other, c))
        return self

    def _blank(self):
        """A new evaluation with this one's settings and none of its data."""
        return type(self)(**{self._init_names.get(c, c): copy.deepcopy(getattr(self, c)) for c in self._config})

    def to_json(self) -> str:
        """Serialise configuration and state (exact: floats are written in full precision)."""
        def enc(v):
            if isinstance(v, np.ndarray):
                return {"__array__": v.tolist(), "dtype": v.dtype.str, "shape": list(v.shape)}
            return v
        d = {"type": type(self).__name__, "config": {c: enc(getattr(self, c)) for c in self._config},
             "state": {s: enc(getattr(self, s)) for s in self._state}}
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str):
        """Rebuild an evaluation written by :meth:`to_json`."""
        return from_json(text, cls)

    def __eq__(self, other):
        return type(self) is type(other) and all(
            _same(getattr(self, k), getattr(other, k)) for k in self._config + self._state)

    def __repr__(self):
        return self.stats()


def _same(a, b):
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    return a == b


def from_json(text: str, expected=None):
    """Rebuild any evaluation from its JSON (``Evaluation.fromJson`` in DL4J)."""
    d = json.loads(text)
    cls = _REGISTRY.get(d.get("type"))
    if cls is None:
        raise ValueError(f"not an evaluation's JSON (type {d.get('type')!r}; known: {sorted(_REGISTRY)})")
    if expected is not None and expected is not BaseEvaluation and not issubclass(cls, expected):
        raise TypeError(f"the JSON holds a {cls.__name__}, not a {expected.__name__}")

    def dec(v):
        if isinstance(v, dict) and "__array__" in v:
            return np.array(v["__array__"], dtype=np.dtype(v["dtype"])).reshape(v["shape"])
        return v
    obj = cls.__new__(cls)
    for k, v in d["config"].items():
        setattr(obj, k, dec(v))
    for k, v in d["state"].items():
        setattr(obj, k, dec(v))
    return obj
