"""glibc's malloc thresholds in a worker process, set with ``mallopt``.

Each jitted step frees and allocates buffers of a parameter vector's size (4 MB for a
network of a million float32 parameters): its outputs, the gradient-sharing loop's vectors.
Under glibc's defaults a thread's arena hands the free top of its heap back to the system
once it passes the trim threshold (128 KiB at first; twice a mapped buffer's size once one
is freed), and the next step takes those pages again one page fault at a time. Dask's
nannies go further by default: their ``MALLOC_TRIM_THRESHOLD_=65536`` also fixes the mmap
threshold at 128 KiB, so that every such buffer is mapped and unmapped anew. A worker
that keeps up to a trim threshold of free heap, and maps only buffers larger than the mmap
threshold, reuses its pages instead. Set at runtime, so that it holds whatever the process
was started with (a fork server's child, a plain Dask cluster's nanny, a batch job).
"""

from __future__ import annotations

import os

from dask.utils import parse_bytes

__all__ = ["set_thresholds", "apply_worker_settings"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: glibc's ceiling on the mmap threshold (``HEAP_MAX_SIZE / 2`` on 64-bit Linux): a larger
#: value is refused by ``mallopt``
_MMAP_MAX = 32 * 2**20


def _glibc():
    """The C library through ctypes where it is glibc, else None (musl, macOS, Windows)."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
    except (AttributeError, ValueError, OSError):
        return None
    import ctypes

    return ctypes.CDLL(None)


def _size(name, value):
    if value is None:
        return None
    try:
        n = parse_bytes(value) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        n = -1
    if n < 0:
        raise ValueError(f"{name} must be a size such as '64MiB' or a number of bytes (or null: glibc's own), "
                         f"got {value!r}")
    return n


def set_thresholds(trim=None, mmap=None) -> dict | None:
    """Set this process's malloc trim threshold and mmap threshold (sizes: ``"64MiB"`` or
    bytes; None leaves one as it is). Returns ``{"trim": bytes, "mmap": bytes}`` of what was
    set, or None where the C library is not glibc (nothing to set)."""
    trim, mmap = _size("the malloc trim threshold", trim), _size("the malloc mmap threshold", mmap)
    if mmap is not None and mmap > _MMAP_MAX:
        raise ValueError(f"the malloc mmap threshold is at most {_MMAP_MAX} bytes (32MiB) in glibc, got {mmap}")
    libc = _glibc()
    if libc is None:
        return None
    done = {}
    for key, option, value in (("trim", _M_TRIM_THRESHOLD, trim), ("mmap", _M_MMAP_THRESHOLD, mmap)):
        if value is not None:
            if libc.mallopt(option, value) != 1:
                raise OSError(f"glibc refused mallopt for the {key} threshold ({value} bytes)")
            done[key] = value
    return done


def apply_worker_settings() -> dict | None:
    """:func:`set_thresholds` from ``dlspark.worker.malloc-trim-threshold`` and
    ``dlspark.worker.malloc-mmap-threshold`` (the worker's own Dask config)."""
    from . import config

    return set_thresholds(config.get("worker.malloc-trim-threshold"), config.get("worker.malloc-mmap-threshold"))
