"""Calls from one worker to another that end as soon as the scheduler no longer lists the callee.

Dask's ``connect`` retries a refused connection until ``distributed.comm.timeouts.connect``
(30 s by default), since a peer may not be listening yet. A peer killed mid-job refuses every
connection, so without a check each call to it would wait out that timeout before the job
could drop it. While a call is pending, :func:`call_peer` asks the scheduler every
``dlspark.worker.peer-check`` whether it still lists the peer; the scheduler removes a worker
whose process died as soon as its connection closes. A call pending when a job's coordinator
says the peer was lost (:func:`peer_lost`) ends at once, and so does a later call to it that
the scheduler, asked at once, no longer lists.
"""

from __future__ import annotations

import asyncio
import weakref

from .. import config

__all__ = ["call_peer", "peer_lost", "PeerLeftError"]

#: worker -> {peer address: the events of its calls to that peer now pending}
_pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: worker -> the peer addresses a job's coordinator said were lost, until the scheduler lists one again
_lost: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
    said = _lost.get(worker, set())
    if addr in said:  # said to be lost: asked at once, not after a first peer-check interval
        if not await _listed(worker, addr):
            raise PeerLeftError(f"worker {addr} is no longer in the cluster")
        said.discard(addr)  # back at that address
    call = asyncio.ensure_future(getattr(worker.rpc(addr), handler)(**kwargs))
    interval = config.get_seconds("worker.peer-check")
    lost = asyncio.Event()
    waits = _pending.setdefault(worker, {}).setdefault(addr, set())
    waits.add(lost)
    told = asyncio.ensure_future(lost.wait())
    try:
        while True:
            done, _ = await asyncio.wait({call, told}, timeout=interval, return_when=asyncio.FIRST_COMPLETED)
            if call in done:
                return call.result()
            if told in done:
                raise PeerLeftError(f"worker {addr} was lost (its job's coordinator said so)")
            if not await _listed(worker, addr):
                raise PeerLeftError(f"worker {addr} is no longer in the cluster")
    finally:
        waits.discard(lost)
        if not waits:
            _pending.get(worker, {}).pop(addr, None)
        for f in (call, told):
            if not f.done():
                f.cancel()


def peer_lost(worker, addr: str) -> None:
    """A job's coordinator said the peer at ``addr`` was lost: ``worker``'s calls to it now
    pending end with :class:`PeerLeftError`, and a later one asks the scheduler before it
    starts (a worker may come back at that address)."""
    _lost.setdefault(worker, set()).add(addr)
    for lost in list(_pending.get(worker, {}).get(addr, ())):
        lost.set()
