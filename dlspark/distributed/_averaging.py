"""Averaging of train states: pure functions over flat lists of numpy leaves."""

from __future__ import annotations

import numpy as np

__all__ = ["average_leaves", "is_averaged"]


def is_averaged(a) -> bool:
    """Floating-point leaves are averaged; integer leaves (step counts, RNG keys) are not."""
    return np.issubdtype(np.asarray(a).dtype, np.floating)


def average_leaves(own: list, contributions: list) -> list:
    """Element-wise mean of ``contributions`` (lists of leaves, in a fixed order).

    Integer leaves keep the value of ``own``. Every caller that passes the
    contributions in the same order gets bit-identical results.
    """
    if not contributions:
        return list(own)
    out = []
    n = len(contributions)
    for i, mine in enumerate(own):
        if not is_averaged(mine):
            out.append(mine)
            continue
        acc = np.array(contributions[0][i], dtype=np.float64 if np.asarray(mine).dtype == np.float64 else np.float32, copy=True)
        for c in contributions[1:]:
            acc += c[i]
        out.append((acc / n).astype(np.asarray(mine).dtype))
    return out
