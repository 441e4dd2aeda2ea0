"""The train states a worker keeps after its fits, so that the next fit sends only what changed.

At the end of a fit every replica keeps its trained state, as the client receives it
(:func:`~dlspark.checkpoint.state_to_arrays`), and tells the client a digest of each of its
arrays. The client's next fit of the same network usually starts from that very state:
it sends each worker only the arrays whose digests differ from what the worker kept (for
parameter averaging none but the random key, whose replicas hold the same floating-point
leaves bit for bit), and the worker takes the others from what it kept. A worker that no
longer holds the state named (restarted, or the state made way for newer ones) says so,
and the client sends it everything, as a first fit does.

What the algorithm carries from fit to fit (an outer optimizer's momentum, as large as the
parameters) goes the same way: its arrays leave the spec the workers are set up from
(:func:`pull_arrays`; the scheduler keeps the whole spec for workers that join mid-fit) and
travel beside the state's, as ``carried``, thinned alike.

Digests are XXH3's 128 bits of each array's bytes with its shape and dtype: an array is
taken from the kept state only when it is the client's bit for bit, so a fit starts from
exactly the state it would have been sent. Both ends digest the whole state at every fit's
start and end, so the hash is a fast non-cryptographic one (benchmarks/bench_kept.py times
it against a copy of the same bytes): the states compared are the client's own and the
workers' copies of them, not an adversary's, and 128 bits put a chance collision out of
reach. ``dlspark.worker.kept-states`` bounds how many states a worker keeps (host copies; 0
keeps none).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

import jax
import numpy as np
import xxhash

from .. import config

__all__ = ["KeptStates", "Carried", "digests", "state_digests", "thin", "continuing", "sent_bytes", "pull_arrays", "put_arrays",
           "carried_arrays"]

#: the smallest array that leaves the spec (smaller ones are cheaper inside it)
_LEAST = 1024
_PARTS = ("arrays", "carried")


@dataclass(frozen=True)
class Carried:
    """Where an array pulled out of the spec goes back: ``state["carried"][index]``."""

    index: int


def pull_arrays(tree):
    """``(tree with its arrays of at least 1 kB replaced by Carried places, those arrays)``."""
    out = []

    def pull(x):
        if isinstance(x, (np.ndarray, jax.Array)) and x.nbytes >= _LEAST:
            out.append(np.asarray(x))
            return Carried(len(out) - 1)
        return x

    return jax.tree_util.tree_map(pull, tree), out


def put_arrays(tree, arrays):
    """``tree`` with every :class:`Carried` place replaced by its array."""
    return jax.tree_util.tree_map(lambda x: arrays[x.index] if isinstance(x, Carried) else x, tree,
                                  is_leaf=lambda x: isinstance(x, Carried))


def carried_arrays(carried) -> list:
    """The arrays :func:`pull_arrays` takes from ``{"...": carried}``: what a worker keeps of
    what its algorithm carries, in the order the client's next fit sends them."""
    return pull_arrays(carried)[1]


def _digest(a) -> bytes:
    a = np.ascontiguousarray(a)
    h = xxhash.xxh3_128(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.data.cast("B") if a.size else b"")
    return h.digest()


def digests(arrays) -> list:
    """One digest per array: its bytes, shape and dtype."""
    return [_digest(a) for a in arrays]


def state_digests(state: dict) -> dict:
    """The digests of a state's arrays and of the arrays carried beside them."""
    return {part: digests(state.get(part, ())) for part in _PARTS}


def thin(state: dict, mine: dict, key: str, theirs: dict, own=()) -> dict:
    """``state`` (as :func:`~dlspark.checkpoint.state_to_arrays` gives it, with what is
    ``carried`` beside it) for a worker that kept arrays of digests ``theirs`` under ``key``:
    the arrays it holds already are left out (None). ``own``: indices of ``arrays`` the
    worker takes from what it kept even where they differ (its replica goes on: ``continue``)."""
    out = {**state, "kept": key}
    for part in _PARTS:
        if part in state and len(theirs[part]) == len(mine[part]):
            out[part] = [None if d == t else a for a, d, t in zip(state[part], mine[part], theirs[part])]
    if own and len(theirs["arrays"]) == len(mine["arrays"]):
        out["arrays"] = [None if i in own else a for i, a in enumerate(out["arrays"])]
        out["continue"] = True
    return out


def continuing(mine: dict, kept: dict) -> bool:
    """Whether the state of digests ``mine`` is one a worker kept at the end of the last fit (of
    ``kept``: ``{worker: (key, digests)}``), bit for bit: the client did not change it."""
    return any(d is not None and list(d["arrays"]) == list(mine["arrays"])
               and list(d["carried"]) == list(mine["carried"]) for _, d in kept.values())


def sent_bytes(state: dict) -> int:
    """The bytes of the arrays ``state`` carries (those a thinned state leaves out are not sent)."""
    return sum(a.nbytes for part in _PARTS for a in state.get(part, ()) if a is not None)


class KeptStates:
    """A worker's kept states, the most recent last; thread-safe."""

    def __init__(self):
        self._states: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def keep(self, key: str, state: dict, extra=None) -> dict | None:
        """Keep ``state``'s ``arrays`` and ``carried`` arrays (the worker's own copies) under
        ``key``, with ``extra`` (what the replica itself goes on from, never sent); their
        digests, or None when ``dlspark.worker.kept-states`` is 0."""
        size = config.get("worker.kept-states")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"dlspark.worker.kept-states must be an integer >= 0, got {size!r}")
        if size == 0:
            return None
        found = state_digests(state)
        with self._lock:
            self._states.pop(key, None)
            while len(self._states) >= size:
                self._states.popitem(last=False)
            self._states[key] = {**{part: list(state.get(part, ())) for part in _PARTS}, "extra": extra}
        return found

    def extra(self, key):
        """The ``extra`` kept with the state under ``key``, or None."""
        with self._lock:
            kept = self._states.get(key)
        return None if kept is None else kept.get("extra")

    def fill(self, state: dict) -> dict | None:
        """``state`` whole: a thinned state's missing arrays taken from the state it names, or
        None when that state is not kept here (the client then sends everything)."""
        key = state.get("kept")
        if key is None:
            return state
        with self._lock:
            kept = self._states.get(key)
        out = {k: v for k, v in state.items() if k != "kept"}
        for part in _PARTS:
            if part not in state or not any(a is None for a in state[part]):
                continue
            if kept is None or len(kept[part]) != len(state[part]):
                return None
            # copies: the job's state may be built on these buffers and donated to its steps
            out[part] = [np.array(k, copy=True) if a is None else a for a, k in zip(state[part], kept[part])]
        return out

    def clear(self):
        with self._lock:
            self._states.clear()
