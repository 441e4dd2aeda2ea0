"""Gradient sharing on one worker: the step loop, one-way pushes to peers, the round's end and its sync."""

from __future__ import annotations

import asyncio
import logging
import time

import jax.numpy as jnp
import numpy as np
from distributed.protocol import to_serialize

from ... import config
from ...distributed._channel import Channel, channel_host
from ...distributed._messages import FitReply
from ...distributed._peers import call_peer
from ...distributed._run import WorkerRun
from ._messages import HaveReply, Messages, SyncReply
from ._state import SharingState
from ._topology import tree_links

logger = logging.getLogger(__name__)

__all__ = ["SharingRun"]

#: seconds a round's start waits for new connections of the job's own to open (a few round
#: trips on a LAN); one not open by then takes its messages once it is
CONNECT_WAIT = 0.25


def _cut_off(tree, me, lost) -> set:
    """The workers of this round's relay ``tree`` (``{worker: neighbours}``; None: a plain mesh)
    that ``me`` no longer reaches once ``lost`` is gone."""
    if not tree or me not in tree or lost not in tree:
        return set()
    reached, frontier = {me, lost}, [me]
    while frontier:
        frontier = [n for w in frontier for n in tree[w] if n not in reached]
        reached.update(frontier)
    return set(tree) - reached


class SharingRun(WorkerRun):
    def __init__(self, worker, job, spec, state, rank):
        super().__init__(worker, job, spec, state, rank)
        self.sharing = SharingState(self)
        self.loop = worker.loop.asyncio_loop
        # peers' messages on connections of the job's own where the cluster's comms are plain TCP
        host = channel_host(self.address) if config.get("sharing.direct-messages") else None
        self.channel = None
        self._tree = None  # a tree mesh's relay tree this round (None: a plain mesh)
        self._told = (0, 0)  # the counts of direct and relayed messages the last fit reply covered
        if host is not None:
            try:
                self.channel = Channel(job, self.address, host, self._on_channel, fallback=self._undelivered,
                                       timeout=config.get_seconds("sharing.stale-timeout"))
            except OSError as e:  # cannot listen there: every message through Dask's comms
                logger.info("dlspark job %s: no connections of its own on %s (%s)", job, host, e)

    def close(self):
        if self.channel is not None:
            self.channel.close()
        super().close()

    async def _push(self, sender, step, message, targets):
        payload = to_serialize(message)
        t0 = self.stats.now()
        # One-way: no reply is written or awaited (a message lost on the way is fetched
        # at the round's sync), which halves the messages on both event loops.
        await asyncio.gather(*[call_peer(self.worker, p, "dlspark_peer", job=self.job, request="push", sender=sender,
                                         step=step, message=payload, via=self.address, reply=False)
                               for p in targets], return_exceptions=True)
        self.stats.add("push", t0, self.stats.now(), "comms", bytes=int(message.nbytes) * len(targets), step=step)

    def _send(self, sender, step, message, targets):
        """Send ``message`` to ``targets`` from any thread: on the job's channel where a peer has a
        working connection, through Dask (the event loop's :meth:`_push`) where not; none to a
        peer the coordinator said was lost."""
        lost = self.sharing.lost
        rest = targets = [p for p in targets if p not in lost] if lost else targets
        if self.channel is not None:
            t0 = self.stats.now()
            payload = memoryview(np.ascontiguousarray(message, np.int32)).cast("B")
            rest = [p for p in targets if not self.channel.send(p, sender, step, payload)]
            if len(rest) < len(targets):
                self.stats.add("push", t0, self.stats.now(), "comms", step=step,
                               bytes=int(message.nbytes) * (len(targets) - len(rest)))
        if rest:
            asyncio.run_coroutine_threadsafe(self._push(sender, step, message, rest), self.loop)

    def _undelivered(self, peer, messages):
        """What a failed connection to ``peer`` did not deliver: through Dask instead."""
        for sender, step, payload in messages:
            message = np.frombuffer(payload, np.int32)
            asyncio.run_coroutine_threadsafe(self._push(sender, step, message, [peer]), self.loop)

    async def _open_channels(self, targets):
        """Connect the job's channel to every target without a connection, on the port its run
        names, and wait a moment (:data:`CONNECT_WAIT`) for the connections to open; a peer that
        does not answer (not set up yet, gone) or cannot be reached on that port (a firewall) is
        sent its messages through Dask's comms meanwhile."""
        new = [p for p in targets if not self.channel.tried(p) and channel_host(p)]
        replies = await asyncio.gather(*[call_peer(self.worker, p, "dlspark_peer", job=self.job, request="channel")
                                         for p in new], return_exceptions=True)
        for p, r in zip(new, replies):
            port = r.get("port") if isinstance(r, dict) else None
            if port:
                self.channel.connect(p, channel_host(p), int(port))
        if new:
            await asyncio.get_running_loop().run_in_executor(None, self.channel.wait_open, new, CONNECT_WAIT)

    def joiner_state(self):
        return self.sharing.for_joiner(self.state)

    def replica_extra(self):
        return self.sharing.replica_extra()

    def continue_from(self, extra):
        self.sharing.continue_from(extra)

    # -- orders -----------------------------------------------------------------------
    async def order_fit(self, order):
        me = self.address
        s = self.sharing
        peers = {p: tuple(v) for p, v in order.plan.peers.items() if p != me}
        if me in order.plan.peers:  # a worker back at an address goes on from its messages' numbers
            s.step = max(s.step, int(order.plan.peers[me][0]))
        links = order.plan.links
        # plain mesh: straight to every peer; tree mesh: to tree neighbours, who relay
        s.links = None if links is None else [p for p in links if p != me]
        self._tree = None if links is None else tree_links(  # the driver's: over the round's workers with data
            [w for w, (_, quota) in order.plan.peers.items() if quota], self.master.tree_fanout)
        targets = list(peers) if links is None else s.links

        def send(step, message):
            self._send(me, step, message, targets)

        if self.channel is not None:  # a peer slow to answer gets its messages through Dask meanwhile
            await asyncio.wait({asyncio.ensure_future(self._open_channels(targets))}, timeout=1.0)

        def run():
            s.forget(order.plan.synced, live=set(order.plan.peers))  # the rounds before, which every replica synced
            self.state = self.state.replace(epoch=jnp.asarray(order.epoch, jnp.int32))
            refs = list(order.refs)
            self.prefetch.expect(refs, list(order.next_refs))
            wait0 = self.prefetch.wait_time
            t0 = time.perf_counter()
            out = s.fit(self.batches(refs), peers, send)
            fit_time = time.perf_counter() - t0
            # every peer's messages of the round, applied: the coordinator then needs no sync
            have = s.finish_round(peers)
            self.stats.mark("sync", part="end")
            with s.lock:  # since the last reply: a peer's message that came before this round's order counts here
                direct, relayed = s.direct - self._told[0], s.relayed - self._told[1]
                self._told = (s.direct, s.relayed)
            return FitReply(loss_sum=out.pop("loss_sum"), n=out.pop("n"), examples=out.pop("examples"),
                            steps=out.pop("steps"), fit_time=fit_time, data_wait=self.prefetch.wait_time - wait0,
                            extra={**out, "relayed": relayed, "direct": direct, "have": have,
                                   "threshold_state": tuple(s.tstate)})

        return await self.compute(run)

    async def order_have(self, order):
        self.sharing.forget(order.synced)
        return HaveReply(have=self.sharing.have(), step=self.sharing.step)

    async def order_sync(self, order):
        """Fetch the round's messages this replica missed, then apply every pending one."""
        extra, unreachable, nbytes = [], [], 0
        for holder, keys in order.missing.items():
            if holder == self.address:
                continue
            try:
                resp = await call_peer(self.worker, holder, "dlspark_peer", job=self.job, request="get", keys=keys)
                messages = resp["reply"].messages
            except Exception as e:  # lost since it reported what it holds: the coordinator decides
                logger.info("dlspark job %s: could not fetch messages from %s: %s", self.job, holder, e)
                unreachable.append(holder)
                continue
            extra.extend(zip([tuple(k) for k in keys], messages))
            nbytes += sum(int(np.asarray(m).nbytes) for m in messages)
        self.stats.mark("sync", bytes=nbytes, part="fetch")
        await self.compute(self.sharing.apply_pending, extra)
        self.stats.mark("sync", part="apply")
        s = self.sharing
        return SyncReply(unreachable=tuple(unreachable), threshold=float(s.tstate.threshold), step=s.step,
                         threshold_state=tuple(s.tstate))

    def notice_peer_lost(self, notice):
        """A peer was lost: wait no more for its messages, nor, on a tree mesh, for those of the
        peers whose messages came through it (the round's sync fetches them)."""
        self.sharing.peer_lost(notice.peer, cut_off=_cut_off(self._tree, self.address, notice.peer))

    # -- requests from peers ----------------------------------------------------------
    def _delivered(self, sender: str, via: str | None, step: int, message) -> None:
        """A peer's message, from Dask's comms or the channel (any thread): kept, and on a tree
        mesh relayed onwards, never back where it came from."""
        s = self.sharing
        t0 = self.stats.now()
        message = np.frombuffer(message, np.int32) if isinstance(message, bytes) else np.asarray(message)
        if s.receive(sender, step, message) and s.links:
            onward = [p for p in s.links if p not in (via, sender)]
            if onward:
                with s.lock:  # readers of several connections count at once
                    s.relayed += 1
                self._send(sender, step, message, onward)
        self.stats.add("receive", t0, self.stats.now(), "comms", bytes=int(message.nbytes), sender=sender, step=step)

    def _on_channel(self, sender: str, via: str, step: int, message: bytes) -> None:
        with self.sharing.lock:
            self.sharing.direct += 1
        self._delivered(sender, via, step, message)

    async def peer_push(self, sender: str, step: int, message, via: str | None = None):
        self._delivered(sender, via, step, message)
        return {}

    async def peer_channel(self):
        return {"port": None if self.channel is None else self.channel.port}

    async def peer_get(self, keys: list):
        return {"reply": to_serialize(Messages(messages=self.sharing.get(keys)))}
