"""Clock alignment without NTP: each process's wall-clock offset to the scheduler's.

The scheduler (or the client) pings a process a few times; for each exchange it
notes its own clock when the ping left and when the answer came back, and the
remote clock in the answer. The remote clock read happened somewhere inside the
round trip, so ``remote - midpoint`` is the offset to within half the round
trip; the exchange with the smallest round trip is kept. Measured at the job's
start and again at its end, the two offsets give the drift, and an event's
time is corrected with the offset interpolated to its moment.
"""

from __future__ import annotations

import time

__all__ = ["best_offset", "measure_offset", "Clock"]


def best_offset(samples) -> dict:
    """``{"offset", "error", "at", "rtt"}`` from ``(sent, remote, received)`` exchanges:
    ``offset`` is remote minus local clock, ``error`` half the smallest round trip,
    ``at`` the local time of that exchange.

    Examples
    --------
    >>> best_offset([(0.0, 10.6, 1.0), (2.0, 12.1, 2.2)])["offset"]
    10.0
    """
    samples = list(samples)
    if not samples:
        raise ValueError("best_offset needs at least one (sent, remote, received) exchange")
    sent, remote, received = min(samples, key=lambda s: s[2] - s[0])
    mid = (sent + received) / 2
    return {"offset": remote - mid, "error": (received - sent) / 2, "at": mid, "rtt": received - sent}


async def measure_offset(ping, n: int = 5) -> dict:
    """:func:`best_offset` of ``n`` exchanges; ``ping`` is a coroutine function returning the remote clock."""
    samples = []
    for _ in range(n):
        sent = time.time()
        remote = await ping()
        samples.append((sent, float(remote), time.time()))
    return best_offset(samples)


class Clock:
    """One process's clock against the scheduler's: ``offset`` is its clock minus the scheduler's.

    ``start`` and ``end`` are :func:`best_offset` results with ``offset`` in that sense
    and ``at`` on the process's own clock; with both, the offset at a moment is
    interpolated between them (a clock that drifts during the job).

    Examples
    --------
    >>> c = Clock({"offset": 5.0, "error": 0.001, "at": 105.0})
    >>> c.to_scheduler(110.0)
    105.0
    """

    def __init__(self, start: dict, end: dict | None = None):
        self.start, self.end = start, end

    def offset_at(self, t: float) -> float:
        s, e = self.start, self.end
        if e is None or e["at"] <= s["at"]:
            return s["offset"]
        f = min(max((t - s["at"]) / (e["at"] - s["at"]), 0.0), 1.0)
        return s["offset"] + f * (e["offset"] - s["offset"])

    def to_scheduler(self, t: float) -> float:
        return t - self.offset_at(t)

    @property
    def error(self) -> float:
        """The bound on a corrected time's error: the larger half round trip of the two
        measurements (the drift between them is corrected by the interpolation)."""
        return max(self.start["error"], self.end["error"] if self.end else 0.0)

    @property
    def drift(self) -> float:
        return 0.0 if self.end is None else self.end["offset"] - self.start["offset"]

    def as_dict(self) -> dict:
        return {"start": dict(self.start), "end": None if self.end is None else dict(self.end),
                "error": self.error, "drift": self.drift}
