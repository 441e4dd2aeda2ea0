"""The relay tree of gradient sharing's tree mesh."""

from __future__ import annotations

__all__ = ["tree_links"]


def tree_links(workers, fanout: int) -> dict:
    """Neighbours of each worker in a ``fanout``-ary tree over the sorted workers.

    Flooding a message along a tree (each node forwards to its neighbours but
    the one it heard from) reaches every node exactly once, and no node talks
    to more than ``fanout + 1`` others: DL4J's mesh mode for large clusters.
    """
    if fanout < 1:
        raise ValueError(f"fanout must be >= 1, got {fanout!r}")
    ws = sorted(workers)
    links: dict = {w: [] for w in ws}
    for i, w in enumerate(ws[1:], start=1):
        parent = ws[(i - 1) // fanout]
        links[w].append(parent)
        links[parent].append(w)
    return {w: sorted(v) for w, v in links.items()}
