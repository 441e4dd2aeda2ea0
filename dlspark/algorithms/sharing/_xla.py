"""Threshold encoding in XLA: the semantics of :func:`._encoding.threshold_encode` on a device.

Where the host encoder builds a message, this one returns what the message
would decode to (``moved``), the residual left behind and the count of moved
elements; the two agree bit for bit (a property test holds them to it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._encoding import HEADER_WORDS, bitmap_words

__all__ = ["encode_on_device", "message_bytes", "sparsity_of"]


def encode_on_device(residual, threshold, min_count: int = 2):
    """``(moved, new residual, count)``: every element with ``|r| >= threshold`` moves by
    ``±threshold``; with fewer than ``min_count`` such elements nothing moves.

    ``moved + new residual == residual`` holds exactly in float32: where ``r - q``
    rounds so that adding ``q`` back does not give ``r``, the residual steps by
    ulps toward one that does, and an element for which none exists stays whole
    (the host encoder's rule).
    """
    t = jnp.asarray(threshold, jnp.float32)
    r = residual
    hit = jnp.abs(r) >= t
    q = jnp.where(hit, jnp.where(r > 0, t, -t), jnp.float32(0))
    new = r - q
    for _ in range(4):
        back = new + q
        bad = hit & (back != r)
        new = jnp.where(bad, jnp.nextafter(new, jnp.where(back < r, jnp.inf, -jnp.inf).astype(jnp.float32)), new)
    keep = hit & ((new + q) == r)
    count = keep.sum(dtype=jnp.int32)
    send = count >= max(int(min_count), 1)
    moved = jnp.where(send & keep, q, jnp.float32(0))
    return moved, jnp.where(send & keep, new, r), jnp.where(send, count, 0)


encode_on_device_jit = jax.jit(encode_on_device, static_argnames=("min_count",))


def message_bytes(count: int, length: int) -> int:
    """The size of the host encoder's message for ``count`` moved elements of ``length``."""
    if count <= 0:
        return 4 * HEADER_WORDS
    if count > length / 16:
        return 4 * (HEADER_WORDS + bitmap_words(length))
    return 4 * (HEADER_WORDS + count)


def sparsity_of(count: int, length: int) -> float:
    """The sparsity a threshold algorithm is told for a step (a dense bitmap counts as 1/16,
    an empty message as 0), as the workers tell it."""
    if count <= 0:
        return 0.0
    if count > length / 16:
        return 1.0 / 16
    return count / length
