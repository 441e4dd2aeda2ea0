"""Threshold encoding of update vectors (Strom 2015; DL4J's encoded gradient sharing).

Pure, vectorised numpy over one flat float32 vector; no Dask.

A message is one int32 array: a 4-word header ``[format, count, length,
threshold bits]`` followed by the payload:

- ``SPARSE``: ``count`` int32 words, each ``+(i+1)`` or ``-(i+1)`` for an
  element ``i`` that moved by ``+threshold`` or ``-threshold``;
- ``BITMAP``: ``ceil(length / 16)`` words, 2 bits per element (bit ``2k`` =
  the element moved, bit ``2k+1`` = it moved down);
- ``EMPTY``: no payload (a step too small to send; it still reports progress).

The encoder picks the smaller payload, as DL4J does: bitmap as soon as the
sparse message would exceed ``length / 16`` words.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["EMPTY", "SPARSE", "BITMAP", "HEADER_WORDS", "MIN_MESSAGE_ELEMENTS", "Encoded", "threshold_encode", "decode",
           "decode_into", "threshold_sending", "empty_message", "message_info", "bitmap_words", "encode_scratch",
           "scratch_size"]

EMPTY, SPARSE, BITMAP = 0, 1, 2
HEADER_WORDS = 4
#: A step that moves fewer elements than this sends an ``EMPTY`` note and keeps them in its
#: residual (DL4J sends no message of fewer than 2 elements); a threshold picked to send a
#: number of elements picks at least this many.
MIN_MESSAGE_ELEMENTS = 2


@dataclass(frozen=True)
class Encoded:
    """The result of :func:`threshold_encode`."""

    message: np.ndarray  # int32, header + payload
    residual: np.ndarray  # float32, what stays behind
    count: int  # elements that moved

    @property
    def format(self) -> int:
        return int(self.message[0])


def bitmap_words(length: int) -> int:
    return (int(length) + 15) // 16


def _header(fmt, count, length, threshold):
    t = np.array([threshold], np.float32).view(np.int32)[0]
    return np.array([fmt, count, length, t], np.int32)


def empty_message(length: int, threshold: float) -> np.ndarray:
    """An ``EMPTY`` note: a step that moves nothing, sent so that peers count the step."""
    return _header(EMPTY, 0, length, threshold)


def message_info(message: np.ndarray) -> dict:
    """Header fields of a message: format, count, length, threshold, and its size in bytes."""
    fmt, count, length = (int(x) for x in message[:3])
    return {"format": fmt, "count": count, "length": length,
            "threshold": float(message[3:4].view(np.float32)[0]), "bytes": int(message.nbytes)}


#: Elements handled at a time by :func:`threshold_encode` (2 MiB of float32):
#: measured fastest here among 2**13 to 2**22.
_BLOCK = 1 << 19


def scratch_size(length: int) -> int:
    """Elements each :func:`threshold_encode` scratch buffer needs for a vector of ``length``."""
    return max(1, min(int(length), _BLOCK))


def encode_scratch(length: int) -> tuple:
    """Reusable scratch buffers for encoding vectors of ``length`` elements."""
    n = scratch_size(length)
    return np.empty(n, np.float32), np.empty(n, bool)


def compiled_scan():
    """The compiled scan, loaded by the first call in a process; None where numba (optional:
    ``pip install dlspark[fast]``) is not installed, and numpy's abs, compare and flatnonzero
    find the hits. Not at import: numba costs a process that never encodes (the client, an
    averaging worker) 0.2 s to import and 0.2 s to load the scan; a gradient-sharing worker
    loads it when its job starts (``_state``), before its first message."""
    global _SCAN
    if _SCAN is _NOT_LOADED:
        try:
            import numba  # noqa: F401
        except ImportError:  # pragma: no cover - the numpy scan does the same, slower
            _SCAN = None
        else:
            try:
                # compiled once per installation and loaded by every later process (on 2 AMD
                # EPYC cores a compile took 0.76 s, a load 0.40 s); numba raises when it finds
                # no writable place for its cache
                _SCAN = _scan_compiler(cache=True)
            except RuntimeError:
                _SCAN = _scan_compiler(cache=False)
    return _SCAN


def _scan_compiler(cache: bool):
    import numba

    @numba.njit(nogil=True, cache=cache)
    def scan(r, t, found, u, copy, add, keep):
        # Indices i with |r[i]| >= t, written to ``found``; returns how many. With ``add``,
        # r += u first; with ``keep``, copy[:] = u + 0 as well (the bits of adding u to
        # zeros: -0.0 becomes +0.0). Elements go 64 at a time, each loop over a group on
        # its own so that the compiler vectorises it (one loop doing all three measured three
        # times as slow); only a group holding a hit is walked one by one, so at the
        # sparsities used each vector is read once.
        n, k, start = r.size, 0, 0
        zero = np.float32(0.0)
        while start + 64 <= n:
            if add:
                for i in range(start, start + 64):
                    r[i] = r[i] + u[i]
            if keep:
                for i in range(start, start + 64):
                    copy[i] = u[i] + zero
            any_hit = False
            for i in range(start, start + 64):
                any_hit |= abs(r[i]) >= t
            if any_hit:
                for i in range(start, start + 64):
                    if abs(r[i]) >= t:
                        found[k] = i
                        k += 1
            start += 64
        for i in range(start, n):
            if add:
                r[i] = r[i] + u[i]
            if keep:
                copy[i] = u[i] + zero
            if abs(r[i]) >= t:
                found[k] = i
                k += 1
        return k

    return scan


def add_and_find(residual: np.ndarray, pieces, threshold: float, scratch: tuple, copy: np.ndarray | None = None):
    """``residual += concatenate(pieces)`` in place and the indices where ``|residual| >= threshold``
    after it (what :func:`threshold_encode` would find), in one pass over each vector; with
    ``copy``, ``copy[:] = 0 + concatenate(pieces)`` in the same pass. The same bits as the
    separate passes. ``pieces`` are host vectors (or CPU device arrays, read in place); the
    caller checked that :func:`compiled_scan` is loaded (numba is installed). Returns the
    indices, ascending."""
    scan = compiled_scan()
    found = scratch[0].view(np.int32)
    t = np.float32(threshold)
    hits, start = [], 0
    for piece in pieces:
        u = np.asarray(piece).reshape(-1)
        for lo in range(0, u.size, found.size):  # at most as many hits as the scratch holds
            m = min(found.size, u.size - lo)
            at = start + lo
            r = residual[at:at + m]
            k = scan(r, t, found, u[lo:lo + m], copy[at:at + m] if copy is not None else r[:0], True,
                     copy is not None)
            if k:
                hits.append(found[:k].astype(np.intp) + at)
        start += u.size
    if start != residual.size:
        raise ValueError(f"the update's pieces hold {start} elements, the residual {residual.size}")
    return np.concatenate(hits) if hits else np.empty(0, np.intp)


_NOT_LOADED = object()
#: The compiled scan once :func:`compiled_scan` loaded it, or None: then numpy finds the hits.
_SCAN = _NOT_LOADED


def threshold_sending(residual, k: int) -> float:
    """The threshold at which ``k`` elements of ``residual`` move: the magnitude of its k-th
    largest element (ties move more), ``k`` raised to :data:`MIN_MESSAGE_ELEMENTS` (a threshold
    that reaches fewer sends nothing) and at most the residual's size; 0.0 when it is empty."""
    a = np.abs(np.asarray(residual, np.float32).ravel())
    if not a.size:
        return 0.0
    k = min(a.size, max(MIN_MESSAGE_ELEMENTS, k))
    return float(np.partition(a, a.size - k)[a.size - k])


def _find(r, t, absr, mask):
    """The ascending indices where ``|r| >= t``."""
    # Block by block, so that |r| and the mask stay in cache: one read of the
    # residual from memory instead of three passes over full-size temporaries.
    n = r.size
    hits = []
    scan = compiled_scan()
    for start in range(0, n, _BLOCK):
        m = min(_BLOCK, n - start)
        if scan is not None:
            found = absr.view(np.int32)  # the scratch holds the block's hit indices instead
            block = r[start:start + m]
            k = scan(block, t, found, block, block[:0], False, False)
            if k:
                hits.append(found[:k].astype(np.intp) + start)
            continue
        np.abs(r[start:start + m], out=absr[:m])
        np.greater_equal(absr[:m], t, out=mask[:m])
        hit = np.flatnonzero(mask[:m])
        if hit.size:
            hits.append(hit + start if start else hit)
    return np.concatenate(hits) if hits else np.empty(0, np.intp)


def threshold_encode(residual: np.ndarray, threshold: float, *, out: np.ndarray | None = None,
                     scratch: tuple | None = None, min_count: int = 0, hits: np.ndarray | None = None) -> Encoded:
    """Move every element with ``|r| >= threshold`` by ``threshold`` into a message.

    ``decode(message) + residual_out == residual`` holds exactly in float32.

    Parameters
    ----------
    residual : float32 vector
    threshold : float
    out : float32 vector, optional
        Where the new residual goes; pass ``residual`` itself to update it in
        place (the worker's hot path: no full-size copy).
    scratch : (float32 vector, bool vector), optional
        Reusable buffers of at least :func:`scratch_size` elements (see
        :func:`encode_scratch`), to avoid allocating per call.
    min_count : int
        With fewer moved elements than this, nothing moves: the message is
        ``EMPTY`` and the residual is left as it is (the sharing steps pass
        :data:`MIN_MESSAGE_ELEMENTS`).
    hits : int vector, optional
        The ascending indices with ``|r| >= threshold``, already found (:func:`add_and_find`):
        the residual is not scanned again.
    """
    r = np.asarray(residual)
    if r.ndim != 1 or r.dtype != np.float32:
        raise ValueError(f"threshold_encode takes a flat float32 vector, got shape {r.shape} and dtype {r.dtype}")
    t = np.float32(threshold)
    if not (np.isfinite(t) and t > 0):
        raise ValueError(f"threshold must be a positive finite number, got {threshold!r}")
    n = r.size
    absr, mask = scratch if scratch is not None else encode_scratch(n)
    if min(absr.size, mask.size) < scratch_size(n):
        raise ValueError(f"scratch buffers must hold {scratch_size(n)} elements, got {absr.size} and {mask.size}")
    idx = _find(r, t, absr, mask) if hits is None else hits
    vals = r[idx]
    q = np.where(vals > 0, t, -t).astype(np.float32)
    new = vals - q
    # vals - q is rounded, and adding q back rounds again: where that does not
    # give the value back bit for bit, step the residual by ulps toward one that does.
    for _ in range(4):
        back = new + q
        bad = back != vals
        if not bad.any():
            break
        new[bad] = np.nextafter(new[bad], np.where(back[bad] < vals[bad], np.inf, -np.inf).astype(np.float32))
    else:
        # Rarely (|r| > 2t, with round-half-even ties on both sides) no float32
        # residual gives r back: such an element stays whole this step, and
        # moves once later updates change it.
        keep = (new + q) == vals
        idx, q, new = idx[keep], q[keep], new[keep]
    count = int(idx.size)
    if out is None:
        out = r.copy()
    elif out is not r:
        np.copyto(out, r)
    if count < max(min_count, 1):
        return Encoded(_header(EMPTY, 0, n, t), out, 0)
    out[idx] = new
    if count > n / 16:
        # Two bits per element, (moved, down), packed little-endian: bit 2k and 2k+1 of
        # word w belong to element 16w + k.
        bits = np.zeros((bitmap_words(n) * 16, 2), bool)
        bits[idx, 0] = True
        bits[idx[q < 0], 1] = True
        words = np.packbits(bits.reshape(-1), bitorder="little").view("<i4").astype(np.int32, copy=False)
        return Encoded(np.concatenate([_header(BITMAP, count, n, t), words]), out, count)
    signed = idx.astype(np.int32) + 1
    signed[q < 0] *= -1
    return Encoded(np.concatenate([_header(SPARSE, count, n, t), signed]), out, count)


def decode_into(message: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Add the update a message carries to ``target`` (float32, length of the message) in place."""
    info = message_info(message)
    if target.shape != (info["length"],):
        raise ValueError(f"message of length {info['length']} cannot be applied to a vector of shape {target.shape}")
    t = np.float32(info["threshold"])
    payload = message[HEADER_WORDS:]
    if info["format"] == EMPTY:
        return target
    if info["format"] == SPARSE:
        pos = payload[payload > 0] - 1
        neg = -payload[payload < 0] - 1
        target[pos] += t
        target[neg] -= t
    elif info["format"] == BITMAP:
        bits = np.unpackbits(payload.astype("<i4", copy=False).view(np.uint8), bitorder="little")
        moved = np.flatnonzero(bits[0:2 * info["length"]:2])
        target[moved] += np.where(bits[2 * moved + 1].astype(bool), -t, t)
    else:
        raise ValueError(f"unknown message format {info['format']}")
    return target


def decode(message: np.ndarray) -> np.ndarray:
    """The dense float32 update a message carries."""
    return decode_into(message, np.zeros(message_info(message)["length"], np.float32))
