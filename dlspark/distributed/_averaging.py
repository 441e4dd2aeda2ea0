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
    n = len(contributions)
    out = []
    for i, mine in enumerate(own):
        mine = np.asarray(mine)
        if not is_averaged(mine):
            out.append(mine)
            continue
        if n == 1:
            out.append(np.asarray(contributions[0][i]))
            continue
        # One copy, n-1 in-place adds, one in-place divide: few passes over memory.
        acc = np.array(contributions[0][i], dtype=np.promote_types(mine.dtype, np.float32), copy=True)
        for c in contributions[1:]:
            np.add(acc, c[i], out=acc)
        np.divide(acc, n, out=acc)
        out.append(acc.astype(mine.dtype, copy=False))
    return out
