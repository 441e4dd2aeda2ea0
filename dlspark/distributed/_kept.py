"""The train states a worker keeps after its fits, so that the next fit sends only what changed.

At the end of a fit every replica keeps its trained state, as the client receives it
(:func:`~dlspark.checkpoint.state_to_arrays`), and tells the client a digest of each of its
arrays. The client's next fit of the same network usually starts from that very state:
it sends each worker only the arrays whose digests differ from what the worker kept (for
parameter averaging none but the random key, whose replicas hold the same floating-point
leaves bit for bit), and the worker takes the others from what it kept. A worker that no
longer holds the state named (restarted, or the state made way for newer ones) says so,
and the client sends it everything, as a first fit does.

Digests are BLAKE2b of each array's bytes with its shape and dtype: a leaf is taken from
the kept state only when it is the client's bit for bit, so a fit starts from exactly the
state it would have been sent. ``dlspark.worker.kept-states`` bounds how many states a
worker keeps (host copies; 0 keeps none).
"""

from __future__ import annotations

import collections
import hashlib
import threading

import numpy as np

from .. import config

__all__ = ["KeptStates", "digests", "thin", "sent_bytes"]


def _digest(a) -> bytes:
    a = np.ascontiguousarray(a)
    h = hashlib.blake2b(f"{a.dtype.str}{a.shape}".encode(), digest_size=16)
    h.update(a.data.cast("B") if a.size else b"")
    return h.digest()


def digests(arrays) -> list:
    """One digest per array: its bytes, shape and dtype."""
    return [_digest(a) for a in arrays]


def thin(state: dict, mine: list, key: str, theirs: list) -> dict:
    """``state`` (as :func:`~dlspark.checkpoint.state_to_arrays` gives it) for a worker that kept
    the arrays of digests ``theirs`` under ``key``: the arrays it holds already are left out (None)."""
    if len(theirs) != len(mine):
        return state
    arrays = [None if d == t else a for a, d, t in zip(state["arrays"], mine, theirs)]
    return {**state, "arrays": arrays, "kept": key}


def sent_bytes(state: dict) -> int:
    """The bytes of the arrays ``state`` carries (those a thinned state leaves out are not sent)."""
    return sum(a.nbytes for a in state["arrays"] if a is not None)


class KeptStates:
    """A worker's kept states, the most recent last; thread-safe."""

    def __init__(self):
        self._states: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def keep(self, key: str, arrays: list) -> list | None:
        """Keep ``arrays`` (the worker's own copies) under ``key``; their digests, or None when
        ``dlspark.worker.kept-states`` is 0."""
        size = config.get("worker.kept-states")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"dlspark.worker.kept-states must be an integer >= 0, got {size!r}")
        if size == 0:
            return None
        found = digests(arrays)
        with self._lock:
            self._states.pop(key, None)
            while len(self._states) >= size:
                self._states.popitem(last=False)
            self._states[key] = list(arrays)
        return found

    def fill(self, state: dict) -> dict | None:
        """``state`` whole: a thinned state's missing arrays taken from the state it names, or
        None when that state is not kept here (the client then sends everything)."""
        key = state.get("kept")
        if key is None:
            return state
        with self._lock:
            kept = self._states.get(key)
        if kept is None or len(kept) != len(state["arrays"]):
            return None
        # copies: the job's state may be built on these buffers and donated to its steps
        arrays = [np.array(k, copy=True) if a is None else a for a, k in zip(state["arrays"], kept)]
        return {"leaves": state["leaves"], "arrays": arrays}

    def clear(self):
        with self._lock:
            self._states.clear()
