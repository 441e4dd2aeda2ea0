"""A :class:`~dlspark.algorithms.replica.ReplicaAlgorithm` on a cluster: its worker run and round driver.

Each worker with minibatches fits them, computes its contribution and then takes
the mean over the round's contributors, fetching each peer's contribution itself
(a peer that cannot be reached is named, and the coordinator averages again over
those left). Every mean is computed from stored inputs (the round's start, the
contributions, the carry before the round's finish), so averaging again is safe.
"""

from __future__ import annotations

import asyncio
import time

import jax
import jax.numpy as jnp
import numpy as np
from distributed.protocol import to_serialize

from ..distributed._messages import FitReply, Unavailable
from ..distributed._peers import call_peer
from ..distributed._run import WorkerRun
from ._mean_round import Leaves, MeanOrder, MeanReply, MeanRoundDriver
from ._replica_common import ReplicaFigures, mean_of

__all__ = ["ReplicaRun", "ReplicaDriver"]


class ReplicaDriver(MeanRoundDriver):
    """The round of :class:`~dlspark.algorithms._mean_round.MeanRoundDriver`, with the
    replica's figures (a short round's replicas end it with ``finish_short``)."""

    failure = "the replicas could not take the round's mean"

    def round_stats(self) -> ReplicaFigures:
        m = [r for r in self.means.values() if isinstance(r, MeanReply)]
        return ReplicaFigures(avg_time=max((x.avg_time for x in m), default=0.0),
                              fetch_time=max((x.fetch_time for x in m), default=0.0),
                              bytes_received=sum(x.bytes_received for x in m))


class ReplicaRun(WorkerRun):
    """One worker's replica of a :class:`~dlspark.algorithms.replica.ReplicaAlgorithm`."""

    def __init__(self, worker, job, spec, state, rank):
        super().__init__(worker, job, spec, state, rank)
        m = self.master
        self.carry = m.init_carry(self.state.params)
        self._contribute = jax.jit(m.contribute)
        finish = jax.jit(m.finish)  # full round or not: one compiled finish unless they differ
        self._finish = {True: finish, False: jax.jit(m.finish_short) if m.short_rounds_differ else finish}
        self.rounds: dict = {}  # round -> (start params, carry before the finish)
        self.contributions: dict = {}  # round -> host leaves, or None (its fit failed)
        self.ready: dict = {}  # round -> Event, set when its contribution is known

    def close(self):
        super().close()
        for round, event in self.ready.items():  # peers waiting on this job end now
            self.contributions.setdefault(round, None)
            event.set()

    def _forget_before(self, round):
        for kept in (self.rounds, self.contributions, self.ready):
            for r in [r for r in kept if r < round]:
                del kept[r]

    # -- compute (the job's compute thread) --------------------------------------------
    def _fit(self, round, refs, epoch, next_refs):
        steps, t0 = self.net.steps, time.perf_counter()
        self.prefetch.expect(refs, next_refs)
        wait0 = self.prefetch.wait_time
        start = jax.tree_util.tree_map(jnp.copy, self.state.params)  # kept: the steps donate the state
        state = self.state.replace(epoch=jnp.asarray(epoch, jnp.int32))
        base_step, losses, sizes = int(state.step), [], []
        for n, batch in self.batches(refs):
            out = steps.train_step(state, batch)
            state = out.state
            losses.append((out.loss, out.finite))
            sizes.append(n)
        self.state = state
        losses = jax.device_get(losses)
        for i, (x, ok) in enumerate(losses):
            if not ok:
                self.net.nonfinite(base_step + i, float(x))
        contribution, carry = self._contribute(start, state.params, self.carry)
        self.rounds[round] = (start, carry)
        self.contributions[round] = [np.asarray(x) for x in jax.tree_util.tree_leaves(contribution)]
        kept = [float(x) for x, ok in losses if ok]
        return {"loss_sum": float(sum(kept)), "n": len(kept), "examples": sum(sizes),
                "steps": tuple((float(x), n) for (x, _), n in zip(losses, sizes)),
                "fit_time": time.perf_counter() - t0, "data_wait": self.prefetch.wait_time - wait0}

    def _take_mean(self, round, contributions, full):
        start, carry = self.rounds[round]
        # the contributions' structure (a replica with no data this round made none itself)
        like = jax.tree_util.tree_structure(jax.eval_shape(self.master.contribute, start, start, carry)[0])
        mean = mean_of([jax.tree_util.tree_unflatten(like, c) for c in contributions])
        params, self.carry = self._finish[full](start, mean, carry)
        self.state = self.state.replace(params=params)

    # -- orders -----------------------------------------------------------------------
    async def order_fit(self, order):
        round = order.round
        self._forget_before(round)
        try:
            result = await self.compute(self._fit, round, list(order.refs), order.epoch, list(order.next_refs))
        except BaseException:
            self.contributions[round] = None  # peers waiting for it learn it will not come
            raise
        finally:
            self.ready.setdefault(round, asyncio.Event()).set()
        done = await self.order_mean(MeanOrder(round, tuple(order.plan.contributors), full=order.plan.full))
        return FitReply(unreachable=done.unreachable, extra={"mean": done}, **result)

    async def order_mean(self, order):
        round, contributors, t0 = order.round, list(order.contributors), time.perf_counter()
        if round not in self.rounds:  # no data this round: it starts and finishes from where it is
            self._forget_before(round)
            self.rounds[round] = (self.state.params, self.carry)
        if not contributors:  # every contributor was lost: the round trained nothing
            start, carry = self.rounds[round]
            self.state, self.carry = self.state.replace(params=start), carry
            return MeanReply()
        parts, nbytes = [], 0
        for addr in contributors:
            if addr == self.address:
                parts.append(self.contributions[round])
                continue
            resp = await self._ask(addr, round)
            if not isinstance(resp, Leaves):
                return MeanReply(unreachable=(addr,), ok=False)
            parts.append(list(resp.leaves))
            nbytes += sum(np.asarray(x).nbytes for x in resp.leaves)
        t_fetch = time.perf_counter() - t0
        await self.compute(self._take_mean, round, parts, order.full)
        return MeanReply(avg_time=time.perf_counter() - t0, fetch_time=t_fetch, bytes_received=nbytes)

    async def _ask(self, addr, round):
        try:
            resp = await call_peer(self.worker, addr, "dlspark_peer", job=self.job, request="contribution",
                                   round=round)
        except OSError:
            return Unavailable(peer=addr)
        return resp.get("reply", Unavailable(peer=addr)) if isinstance(resp, dict) else Unavailable(peer=addr)

    # -- requests from peers ----------------------------------------------------------
    async def peer_contribution(self, round: int):
        ev = self.ready.setdefault(round, asyncio.Event())
        await asyncio.wait_for(ev.wait(), timeout=self.peer_timeout())
        leaves = self.contributions.get(round)
        if leaves is None:
            return {"reply": to_serialize(Unavailable(peer=None))}
        return {"reply": to_serialize(Leaves(leaves=list(leaves)))}
