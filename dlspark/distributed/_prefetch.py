"""A worker's minibatch prefetcher: one background thread per job, loading ahead across rounds.

Pure threading, no Dask. The worker tells it which minibatches the current
round consumes and, as a hint, which the next round will probably consume;
the thread keeps up to ``depth`` of them loaded ahead of the consumer, so the
first minibatches of a round are read while the previous round is still being
averaged. A wrong hint (the plan changed because a worker left) only costs
the loads it wasted.
"""

from __future__ import annotations

import threading
import time
from collections import deque

__all__ = ["Prefetcher"]


class _Slot:
    __slots__ = ("ref", "started", "done", "value", "error")

    def __init__(self, ref):
        self.ref = ref
        self.started = self.done = False
        self.value = self.error = None


class Prefetcher:
    """Loads ``load(ref)`` in a background thread, at most ``depth`` results ahead of the consumer.

    Parameters
    ----------
    load : callable
        ``ref -> value``; an exception it raises is re-raised by :meth:`take` for that ref.
    depth : int
        Results held ahead of the consumer; ``0`` loads in the consumer's thread.

    Examples
    --------
    >>> p = Prefetcher(lambda r: r * 10, depth=2)
    >>> p.expect([1, 2], ahead=[3])
    >>> [p.take(1), p.take(2)]
    [10, 20]
    >>> p.expect([3])  # the hint was right: 3 is already loaded
    >>> p.take(3)
    30
    >>> p.close()
    """

    def __init__(self, load, depth: int):
        self.load = load
        self.depth = max(0, int(depth))
        self.wait_time = 0.0
        self.wasted = 0  # loads done for a hint that turned out wrong
        self._plan: deque = deque()  # slots the consumer will take, in order
        self._cv = threading.Condition()
        self._closed = False
        self._thread = None
        if self.depth:
            self._thread = threading.Thread(target=self._run, name="dlspark-prefetch", daemon=True)
            self._thread.start()

    def expect(self, refs, ahead=()) -> None:
        """The consumer takes ``refs`` next, in order, then probably ``ahead``."""
        refs, ahead = list(refs), list(ahead)
        with self._cv:
            keep = 0
            for slot, ref in zip(self._plan, refs):
                if slot.ref != ref:
                    break
                keep += 1
            if keep < len(refs):
                keep = 0  # the plan changed under us: start over
            dropped = list(self._plan)[keep:]
            self.wasted += sum(1 for s in dropped if s.started)
            self._plan = deque(list(self._plan)[:keep])
            self._plan.extend(_Slot(r) for r in refs[keep:] + ahead)
            self._cv.notify_all()

    def take(self, ref):
        """The value for ``ref``, the next ref expected; blocks until it is loaded."""
        t0 = time.perf_counter()
        with self._cv:
            if not self._plan or self._plan[0].ref != ref:
                self._plan.appendleft(_Slot(ref))  # not expected: load it next
                self._cv.notify_all()
            slot = self._plan[0]
            if self._thread is None:
                self._plan.popleft()
            else:
                # Loads stay on the loading thread, one at a time: readers such as
                # numpy's header parser are not safe to run in two threads at once.
                while not slot.done and not self._closed:
                    self._cv.wait()
                if not slot.done:
                    raise RuntimeError("the job was torn down while its minibatches were loading")
                if self._plan and self._plan[0] is slot:
                    self._plan.popleft()
                self._cv.notify_all()
        if self._thread is None:
            slot.started = True
            self._fill(slot)
        self.wait_time += time.perf_counter() - t0
        if slot.error is not None:
            raise slot.error
        return slot.value

    def iterate(self, refs):
        """Take ``refs`` in order (after :meth:`expect`)."""
        for r in refs:
            yield self.take(r)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._plan.clear()
            self._cv.notify_all()

    # -- the loading thread ------------------------------------------------------
    def _fill(self, slot):
        try:
            slot.value = self.load(slot.ref)
        except BaseException as e:  # handed to whoever takes the slot
            slot.error = e
        slot.done = True

    def _next_slot(self):
        started = 0
        for i, slot in enumerate(self._plan):
            if not slot.started:
                # The consumer's next slot is always loaded, whatever the depth.
                return slot if started < self.depth or i == 0 else None
            started += 1
        return None

    def _run(self):
        while True:
            with self._cv:
                slot = self._next_slot()
                while slot is None and not self._closed:
                    self._cv.wait()
                    slot = self._next_slot()
                if self._closed:
                    return
                slot.started = True
            self._fill(slot)
            with self._cv:
                self._cv.notify_all()
