"""Calls from one worker to another that end as soon as the scheduler no longer lists the callee.

Dask's ``connect`` retries a refused connection until ``distributed.comm.timeouts.connect``
(30 s by default), since a peer may not be listening yet. A peer killed mid-job refuses every
connection, so without a check each call to it would wait out that timeout before the job
could drop it. While a call is pending, :func:`call_peer` asks the scheduler every
``dlspark.worker.peer-check`` whether it still lists the peer; the scheduler removes a worker
whose process died as soon as its connection closes.
"""

from __future__ import annotations

import asyncio

from .. import config

__all__ = ["call_peer", "PeerLeftError"]


class PeerLeftError(ConnectionError):
    """The peer a call went to is no longer one of the scheduler's workers (an ``OSError``)."""


async def _listed(worker, addr) -> bool:
    try:
        return addr in (await worker.scheduler.dlspark_listed(addresses=[addr]))["listed"]
    except Exception:  # the scheduler did not answer: no evidence that the peer left
        return True


async def call_peer(worker, addr: str, handler: str, **kwargs):
    """``await worker.rpc(addr).<handler>(**kwargs)``; raises :class:`PeerLeftError` once
    the scheduler no longer lists ``addr``, and ``OSError`` as the call itself would."""
    call = asyncio.ensure_future(getattr(worker.rpc(addr), handler)(**kwargs))
    interval = config.get_seconds("worker.peer-check")
    try:
        while True:
            done, _ = await asyncio.wait({call}, timeout=interval)
            if done:
                return call.result()
            if not await _listed(worker, addr):
                raise PeerLeftError(f"worker {addr} is no longer in the cluster")
    finally:
        if not call.done():
            call.cancel()
