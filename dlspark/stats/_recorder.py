"""The recorder of timed events: one per job on each worker, on the scheduler and the client.

An event is a tuple ``(phase, start, duration, lane, round, fields)``: its start
on this process's wall clock (monotonic clocks cannot be compared across
machines; :mod:`._clock` brings every wall clock onto the scheduler's), its
duration in seconds, the *lane* it belongs to (``"main"``: the round's own path
on a worker, compute thread and order handling; ``"loader"``: the minibatch
loading thread; ``"comms"``: serving peers), the round it belongs to (or None),
and optional figures (``bytes``, ``examples``, ``threshold``...) as a dict.

The main lane is recorded with a cursor: :meth:`Recorder.mark` closes the phase
that ran since the previous mark, so a round's main-lane events tile it without
gaps or overlaps, and the time between two orders is recorded as ``idle``. JAX
compilations seen on a bound thread are recorded as ``compile`` and taken out
of the phase they happened in.

With statistics off the runs hold :data:`NULL`, whose methods do nothing.
"""

from __future__ import annotations

import threading
import time

__all__ = ["Recorder", "NullRecorder", "NULL"]

_now = time.time
_local = threading.local()
_listening = False
# XLA's compilation proper (never nested in another); tracing and lowering stay in their phase
_COMPILE_EVENTS = {"/jax/core/compile/backend_compile_duration": "backend"}


def _on_jax_duration(event, duration, **kw):
    stage = _COMPILE_EVENTS.get(event)
    bound = getattr(_local, "bound", None)
    if stage is None or bound is None:
        return
    recorder, lane = bound
    recorder.compiled(lane, float(duration), stage, kw.get("fun_name"))


def _listen_to_jax():
    global _listening
    if not _listening:
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(_on_jax_duration)
        _listening = True


class _NullSpan:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL_SPAN = _NullSpan()


class NullRecorder:
    """Statistics off: every call returns at once and nothing is kept."""

    on = False
    events = ()

    def now(self) -> float:
        return 0.0

    def add(self, phase, start, end, lane="main", **fields):
        pass

    def mark(self, phase, **fields):
        pass

    def span(self, phase, lane="main", **fields):
        return _NULL_SPAN

    def bind(self, lane="main"):
        pass

    def unbind(self):
        pass

    def begin_order(self, round=None, outside=False):
        pass

    def end_order(self):
        pass

    def start_idle(self):
        pass

    def drain(self) -> list:
        return []


NULL = NullRecorder()


class _Span:
    __slots__ = ("rec", "phase", "lane", "fields", "t0")

    def __init__(self, rec, phase, lane, fields):
        self.rec, self.phase, self.lane, self.fields = rec, phase, lane, fields

    def __enter__(self):
        self.t0 = _now()
        return self

    def __exit__(self, *exc):
        self.rec.add(self.phase, self.t0, _now(), self.lane, **self.fields)
        return False


class Recorder:
    """Keeps one process's events of one job.

    Examples
    --------
    >>> rec = Recorder()
    >>> rec.begin_order(round=1)
    >>> rec.mark("fit", examples=32)
    >>> rec.end_order()
    >>> [e[0] for e in rec.drain()]
    ['fit']
    """

    on = True

    def __init__(self):
        self.events: list = []
        self.round = None
        self._cursor = None  # main lane: where the next mark's phase began
        self._idle_from = None  # main lane: when the last order was answered
        self._compiled: dict = {}  # lane -> compile seconds not yet taken out of a phase

    now = staticmethod(_now)

    def add(self, phase: str, start: float, end: float, lane: str = "main", **fields):
        """Record ``phase`` from ``start`` to ``end`` (wall-clock seconds) on ``lane``."""
        self.events.append((phase, start, end - start, lane, self.round, fields or None))

    def mark(self, phase: str, **fields):
        """Close the main lane's current phase: ``phase`` ran from the previous mark until now
        (less any compilation recorded meanwhile, which is its own event)."""
        t = _now()
        t0 = self._cursor if self._cursor is not None else t
        c = self._compiled.pop("main", 0.0) if self._compiled else 0.0
        self.events.append((phase, t0 + c, t - t0 - c, "main", self.round, fields or None))
        self._cursor = t

    def span(self, phase: str, lane: str = "main", **fields):
        """A context manager recording the time spent in its block (off the main lane's cursor)."""
        return _Span(self, phase, lane, fields)

    # -- compilations -------------------------------------------------------------
    def bind(self, lane: str = "main"):
        """JAX compilations on the calling thread count as this recorder's, on ``lane``."""
        _listen_to_jax()
        _local.bound = (self, lane)

    def unbind(self):
        _local.bound = None

    def compiled(self, lane, seconds, stage, function):
        t = _now()
        self._compiled[lane] = self._compiled.get(lane, 0.0) + seconds
        self.events.append(("compile", t - seconds, seconds, lane, self.round,
                            {"stage": stage, "function": str(function)}))

    # -- orders (the main lane's barriers) ----------------------------------------------
    def begin_order(self, round=None, outside=False):
        """An order arrived: the time since the previous one was answered is ``idle``
        (between rounds when the order opens a new round, so counted in none). An order
        ``outside`` rounds (a checkpoint's) and its idle time count in none either."""
        t = _now()
        if outside:
            self.round = None
        new_round = round is not None and round != self.round
        if self._idle_from is not None:
            if new_round:
                self.round = None
            self.events.append(("idle", self._idle_from, t - self._idle_from, "main", self.round, None))
        if new_round:
            self.round = round
        self._cursor = t

    def end_order(self):
        """The order is answered: what its handler did after its last mark is ``control``."""
        self.mark("control")
        self._idle_from = self._cursor
        self._cursor = None

    def start_idle(self):
        """From now until the next order, this process waits (after its set-up, whose
        compilations stay inside it)."""
        self._compiled.clear()
        self._idle_from = _now()

    def drain(self) -> list:
        """The events recorded so far (as lists, ready for msgpack), forgetting them."""
        out, self.events = self.events, []
        return [list(e) for e in out]
