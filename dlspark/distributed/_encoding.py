"""Threshold encoding of update vectors (Strom 2015; DL4J's encoded gradient sharing).

Pure, vectorised numpy over one flat float32 vector; no Dask.

A message is one int32 array: a 4-word header ``[format, count, length,
threshold bits]`` followed by the payload:

- ``SPARSE``: ``count`` int32 words, each ``+(i+1)`` or ``-(i+1)`` for an
  element ``i`` that moved by ``+threshold`` or ``-threshold``;
- ``BITMAP``: ``ceil(length / 16)`` words, 2 bits per element (bit ``2k`` =
  the element moved, bit ``2k+1`` = it moved down).

The encoder picks the smaller payload, as DL4J does: bitmap as soon as the
sparse message would exceed ``length / 16`` words.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["SPARSE", "BITMAP", "HEADER_WORDS", "Encoded", "threshold_encode", "decode", "decode_into",
           "message_info", "bitmap_words"]

SPARSE, BITMAP = 1, 2
HEADER_WORDS = 4
_SHIFTS = np.arange(0, 32, 2, dtype=np.uint32)


class Encoded(NamedTuple):
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


def message_info(message: np.ndarray) -> dict:
    """Header fields of a message: format, count, length, threshold, and its size in bytes."""
    fmt, count, length = (int(x) for x in message[:3])
    return {"format": fmt, "count": count, "length": length,
            "threshold": float(message[3:4].view(np.float32)[0]), "bytes": int(message.nbytes)}


def threshold_encode(residual: np.ndarray, threshold: float) -> Encoded:
    """Move every element with ``|r| >= threshold`` by ``threshold`` into a message.

    ``decode(message) + residual_out == residual`` holds exactly in float32.
    """
    r = np.asarray(residual, np.float32)
    if r.ndim != 1:
        raise ValueError(f"threshold_encode takes a flat vector, got shape {r.shape}")
    t = np.float32(threshold)
    if not (np.isfinite(t) and t > 0):
        raise ValueError(f"threshold must be a positive finite number, got {threshold!r}")
    n = r.size
    up = r >= t
    down = r <= -t
    moved = up | down
    count = int(np.count_nonzero(moved))
    q = np.where(up, t, np.where(down, -t, np.float32(0)))
    out = r - q
    # r - q is rounded, and adding q back rounds again: where that does not
    # give r back bit for bit, step the residual by ulps toward the value that does.
    for _ in range(4):
        back = out + q
        bad = back != r
        if not bad.any():
            break
        out[bad] = np.nextafter(out[bad], np.where(back[bad] < r[bad], np.inf, -np.inf).astype(np.float32))
    else:
        # Rarely (|r| > 2t, with round-half-even ties on both sides) no float32
        # residual gives r back: such an element stays whole in the residual
        # this step, and moves once later updates change it.
        bad = (out + q) != r
        out[bad], q[bad] = r[bad], 0
        up &= ~bad
        down &= ~bad
        moved = up | down
        count = int(np.count_nonzero(moved))
    if count > n / 16:
        codes = moved.astype(np.uint32) | (down.astype(np.uint32) << 1)
        pad = bitmap_words(n) * 16 - n
        if pad:
            codes = np.concatenate([codes, np.zeros(pad, np.uint32)])
        words = np.bitwise_or.reduce(codes.reshape(-1, 16) << _SHIFTS, axis=1).view(np.int32)
        return Encoded(np.concatenate([_header(BITMAP, count, n, t), words]), out, count)
    idx = np.flatnonzero(moved).astype(np.int32) + 1
    idx[down[idx - 1]] *= -1
    return Encoded(np.concatenate([_header(SPARSE, count, n, t), idx]), out, count)


def decode_into(message: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Add the update a message carries to ``target`` (float32, length of the message) in place."""
    info = message_info(message)
    if target.shape != (info["length"],):
        raise ValueError(f"message of length {info['length']} cannot be applied to a vector of shape {target.shape}")
    t = np.float32(info["threshold"])
    payload = message[HEADER_WORDS:]
    if info["format"] == SPARSE:
        pos = payload[payload > 0] - 1
        neg = -payload[payload < 0] - 1
        target[pos] += t
        target[neg] -= t
    elif info["format"] == BITMAP:
        codes = (payload.view(np.uint32)[:, None] >> _SHIFTS) & 3
        codes = codes.reshape(-1)[: info["length"]]
        target += np.where(codes == 1, t, np.where(codes == 3, -t, np.float32(0)))
    else:
        raise ValueError(f"unknown message format {info['format']}")
    return target


def decode(message: np.ndarray) -> np.ndarray:
    """The dense float32 update a message carries."""
    return decode_into(message, np.zeros(message_info(message)["length"], np.float32))
