"""Dense leaves handed between workers on one host through shared memory.

A worker's contribution to an average crosses to a peer on the same host as one copy into
a memory file, which the peer maps and reads in place, instead of a trip through both
processes' TCP stacks (about 1 ms per MB on a small CPU machine, where the copy costs a
few tenths of that). Workers on other hosts, and any worker that cannot get or map the
memory, keep Dask's comms.

The memory is an anonymous file (Linux's ``memfd_create``): it has no name to leak. A peer
maps it through ``/proc/<pid>/fd/<fd>`` of the process that made it, and the kernel frees
it once that process and its readers have let go of it, whether the job closed or the
process was killed. Its pages are reserved when it is made (``posix_fallocate``), so that
a machine short of memory refuses it there, which the caller turns into "use the comms",
rather than killing the process with ``SIGBUS`` at the first write.

:class:`SharedSlots` is the writer's side: per job, ``slots`` files used in turn, so that a
round can be written while a peer still reads the one before. :class:`SharedViews` is the
reader's: it maps a peer's files once, gives read-only numpy views into them, and lets go
of a file no round has read for a few rounds (a peer that left the job).
"""

from __future__ import annotations

import gc
import mmap
import os
from dataclasses import dataclass

import numpy as np

from .. import config

__all__ = ["SharedLeaves", "SharedSlots", "SharedViews", "same_host", "available"]

_ALIGN = 64  # each leaf starts on a cache line, so that XLA's CPU client reads it as it is


def available() -> bool:
    """Whether this worker may hand leaves to co-located peers this way (Linux, and not
    turned off with ``dlspark.worker.shared-memory``)."""
    return bool(config.get("worker.shared-memory")) and hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def same_host(a: str, b: str) -> bool:
    """Whether two worker addresses name one host over plain TCP. A TLS cluster keeps the
    comms: its user asked for every worker-to-worker byte to go through them, encrypted."""
    from distributed.comm import get_address_host, parse_address

    try:
        return (parse_address(a)[0] == parse_address(b)[0] == "tcp"
                and get_address_host(a) == get_address_host(b))
    except (ValueError, TypeError):
        return False


@dataclass(frozen=True)
class SharedLeaves:
    """Where a list of arrays lies: the writer's process and file descriptor, the file's
    identity ``(st_dev, st_ino)`` (which tells it from a later file with the same number,
    and which a reader checks), its size, and per array ``(offset, shape, dtype)``: the dtype
    itself, since the string of an extension type (bfloat16's is ``"<V2"``) names raw bytes."""

    pid: int
    fd: int
    identity: tuple
    size: int
    layout: tuple

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize for _, shape, dt in self.layout)


def _view(mm, offset, shape, dt):
    """A numpy view into ``mm`` that holds the mapping (``np.frombuffer`` exports its buffer):
    while it lives, ``mm.close()`` raises ``BufferError`` rather than unmapping memory it reads."""
    dt = np.dtype(dt)
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(mm, dt, count, offset).reshape(shape)


def _layout(leaves) -> tuple[tuple, int]:
    out, end = [], 0
    for x in leaves:
        start = -(-end // _ALIGN) * _ALIGN
        out.append((start, tuple(x.shape), x.dtype))
        end = start + x.nbytes
    return tuple(out), max(end, 1)


class SharedSlots:
    """The writer's files of one job: ``put(slot, leaves)`` copies ``leaves`` into file
    ``slot`` and says where they lie, or returns None when the memory could not be had (the
    caller then serves them through the comms, for the rest of the job) or the slots are
    closed. Call ``put`` and ``close`` from one thread (the job's compute thread)."""

    def __init__(self, name: str, slots: int = 2):
        self.name = name
        self.files: list = [None] * slots  # (fd, mmap, size, identity)
        self.failed = self.closed = False

    def _file(self, slot: int, size: int):
        f = self.files[slot]
        if f is not None and f[2] >= size:
            return f
        self._drop(slot)
        fd = os.memfd_create(f"{self.name}-{slot}", os.MFD_CLOEXEC)
        try:
            os.posix_fallocate(fd, 0, size)  # refused here when memory is short, not SIGBUS later
            mm = mmap.mmap(fd, size)
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            raise
        self.files[slot] = f = (fd, mm, size, (st.st_dev, st.st_ino))
        return f

    def put(self, slot: int, leaves) -> SharedLeaves | None:
        if self.failed or self.closed:
            return None
        leaves = [np.asarray(x) for x in leaves]
        layout, size = _layout(leaves)
        try:
            fd, mm, size, identity = self._file(slot, size)
            for x, (offset, shape, dt) in zip(leaves, layout):
                np.copyto(_view(mm, offset, shape, dt), x)
        except (OSError, TypeError, ValueError):  # no memory to spare, or leaves it cannot hold:
            self.failed = True                    # this job keeps the comms
            return None
        return SharedLeaves(os.getpid(), fd, identity, size, layout)

    def _drop(self, slot: int) -> bool:
        """Let go of a slot's file; false when a view keeps its mapping (it goes with the last)."""
        f, self.files[slot] = self.files[slot], None
        if f is None:
            return True
        os.close(f[0])
        return _close_mapping(f[1])

    def close(self):
        self.closed = True
        if not all([self._drop(slot) for slot in range(len(self.files))]):
            _collect()


class SharedViews:
    """The reader's mappings of its peers' files, each kept while it is in use.
    ``views`` raises ``OSError`` when the file cannot be mapped from here (another host's or
    container's process, a process that is gone, no permission).

    A peer's file is read every ``len(slots)`` rounds; ``prune(round)``, called each round,
    lets go of the mappings ``views(where, round)`` has not been asked for in the last
    ``keep`` rounds (a peer that left the job, whose memory the kernel frees only once
    nobody maps it). Call both from one thread."""

    def __init__(self, keep: int = 4):
        self.mapped: dict = {}  # (pid, fd, identity) -> mmap
        self.used: dict = {}  # the same keys -> the round that last read it
        self.keep = keep

    def views(self, where: SharedLeaves, round: int | None = None) -> list:
        key = (where.pid, where.fd, tuple(where.identity))
        mm = self.mapped.get(key)
        if mm is None:
            fd = os.open(f"/proc/{where.pid}/fd/{where.fd}", os.O_RDONLY)
            try:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) != tuple(where.identity) or st.st_size < where.size:
                    # another process's file under that name: another pid namespace, or a number reused
                    raise OSError(f"/proc/{where.pid}/fd/{where.fd} is not the shared file it was")
                mm = mmap.mmap(fd, where.size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            self.mapped[key] = mm
        if round is not None:
            self.used[key] = round
        return [_view(mm, offset, shape, dt) for offset, shape, dt in where.layout]

    def prune(self, round: int):
        for stale in [k for k, r in self.used.items() if r < round - self.keep]:
            _close_mapping(self.mapped.pop(stale))
            del self.used[stale]

    def close(self):
        closed = [_close_mapping(mm) for mm in self.mapped.values()]
        self.mapped.clear()
        self.used.clear()
        if not all(closed):
            _collect()


def _close_mapping(mm) -> bool:
    """Unmap ``mm``; false when a view of it is still referenced (the mapping then goes with
    the last view)."""
    try:
        mm.close()
        return True
    except BufferError:
        return False


#: full collections a close made (see _collect); a job's normal end makes none
collections = 0


def _collect():
    """At a close that left mappings to their views: a view held only by a reference cycle (an
    exception's traceback and the frames it holds, say) would keep the mapping, and the
    kernel the memory, until Python's next full collection, which an idle process may not
    reach for a long time. Collect now (100 ms and more in a worker process: a last resort)."""
    global collections
    collections += 1
    gc.collect()
