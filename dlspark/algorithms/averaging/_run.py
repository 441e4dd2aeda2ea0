"""Parameter averaging on one worker: fit a round, then average with the round's contributors.

Each replica fetches the contributions (or, with three or more contributors, the
shares) it needs from its peers itself; the coordinator steps in only when a peer
is lost. Every average is computed from stored inputs (the contributions, or the
state the replica had before the round), never from what an earlier call left,
so averaging again over fewer contributors is safe.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np
from distributed.protocol import to_serialize

from ...distributed import _shared
from ...distributed._peers import call_peer
from ...distributed._run import WorkerRun
from ...distributed._messages import FitReply, Unavailable
from ...network import one_shape
from ._messages import AverageOrder, AverageReply, Contribution, Share, SharedContribution
from ._numerics import (assemble, average_on_device, average_share, averaged_indices, encode_moves,
                        mean_of_moves, outer_step, round_steps, settled_scale, share_bounds, share_pieces,
                        start_round, take_share)

__all__ = ["AveragingRun"]


def _outer_function(net, tx):
    """The jitted outer step of ``tx``, kept with the network so later fits do not compile it again.

    Each job brings its own copy of ``tx`` (unpickled from the job's spec), so the key is its
    pickled form, the same for every copy of one transformation; a few are kept."""
    fns = net.__dict__.setdefault("_outer_fns", {})
    try:
        key = cloudpickle.dumps(tx)
    except Exception:  # not picklable here: this object's own
        key = id(tx)
    if key not in fns:
        while len(fns) >= 4:
            del fns[next(iter(fns))]
        fns[key] = (tx, jax.jit(lambda start, mean, st: outer_step(tx, start, mean, st)))
    return fns[key][1]


class AveragingRun(WorkerRun):
    def __init__(self, worker, job, spec, state, rank):
        super().__init__(worker, job, spec, state, rank)
        self.contributions: dict = {}  # round -> (device leaves, host leaves) after its fit, or None
        self.untouched: dict = {}  # round -> host leaves of a replica with no data that round
        # round -> {(contributors, attempt): [Event, ("OK", averaged share) | ("lost", peer)]}
        self.shares: dict = {}
        self.ready: dict = {}
        # the leaves a round's mean takes, and so the only ones a contribution carries
        self.mixed = averaged_indices(self.state, self.master.save_updater)
        # the updates' scale in a round that ends in the plain mean, and in one that ends in the outer step
        self.scales = (settled_scale(self.master),
                       None if self.master.outer_updater is None else settled_scale(self.master, outer=True))
        tx = self.master.outer_updater
        self.outer = None if tx is None else _outer_function(self.net, tx)
        carried = spec.algorithm_state.get("outer_state")
        self.outer_state = None if tx is None else (tx.init(self.state.params) if carried is None
                                                   else jax.tree_util.tree_map(jnp.asarray, carried))
        self.round_start: dict = {}  # round -> (parameters, outer state) when the round began
        # exchange_precision="bfloat16": a contribution is the replica's move from the round's
        # start in bfloat16 (its bits, uint16), what the rounding lost kept for the next round's
        self.moves = self.master.exchange_precision == "bfloat16"
        self.theta: dict = {}  # round -> the averaged leaves the round started from (float32 copies, where they lie)
        self.residual: list | None = None
        # Contributions cross to peers on this host through shared memory (see _shared);
        # rounds take the two segments in turn, so that a slow peer may still read the last.
        self.shared = {}  # round -> where its contribution lies in this worker's shared memory
        self.slots = _shared.SharedSlots(f"dlspark-{job[:12]}-{rank}") if _shared.available() else None
        self.peer_views = _shared.SharedViews()
        self.read_shared = self.slots is not None
        # round -> {peer: where its contribution lies in its shared memory}: offered by a peer
        # that got there first, so that the later of two need not ask for it (see order_fit)
        self.offers: dict = {}
        self.offered: set = set()  # rounds whose contribution this worker offered
        self._sending: set = set()  # offers on their way (a task nobody awaits must be held)

    def close(self):
        # The shared memory is let go of on the compute thread, after whatever runs there now
        # (a copy into a slot, a mean still reading a peer's): a shut-down executor runs
        # what was queued before it.
        try:
            self.executor.submit(self._close_shared)
        except RuntimeError:  # closed before
            pass
        super().close()
        # Handlers still waiting on this job (a peer's fetch of a share or a contribution)
        # end now rather than at their timeout.
        for slots in self.shares.values():
            for slot in slots.values():
                if slot[1] is None:
                    slot[1] = ("lost", None)
                slot[0].set()
        for round, event in self.ready.items():
            self.contributions.setdefault(round, None)
            event.set()

    def _close_shared(self):
        # The last mean may still be running, reading a peer's memory in place (a host array
        # goes to XLA's CPU client without a copy, and stays referenced until the call is done):
        # wait for it, so that the views are let go of here, rather than by a full collection
        # (_shared's last resort, 100 ms and more of the worker's time, at the end of every fit).
        try:
            jax.block_until_ready(self.state)
        except Exception:  # buffers a failed call had donated: nothing of them runs
            pass
        self.shared.clear()
        if self.slots is not None:
            self.slots.close()
        self.peer_views.close()

    def forget_rounds_before(self, round):
        self.offered = {r for r in self.offered if r >= round}
        for kept in (self.contributions, self.ready, self.untouched, self.shares, self.round_start, self.shared,
                     self.offers, self.theta):
            for r in [r for r in kept if r < round]:
                del kept[r]

    # -- compute (the job's compute thread) --------------------------------------------
    def _fit(self, refs, epoch, next_refs, outer_round=False):
        steps = round_steps(self.net, self.scales[outer_round])
        state = start_round(self.state, self.net.updater, self.master.save_updater, epoch)
        # The steps apply their updates unchecked (train_step's select over the whole state
        # costs more than the update itself on a large network: 2.5 ms of a 15 ms step with
        # Adam on the benchmarks' MLP); the round is checked once at its end and, when a step
        # was not finite, replayed from ``start``, the state it began with, with train_step
        # (the steps are deterministic). One step at a time, the first step keeps that state
        # (kept_step does not donate it), so it needs no copy (a pass over the whole state:
        # 1.8-2.4 ms a round on the benchmarks' MLP with Adam); one fused call donates the
        # state it is given, so it gets a copy.
        losses = []
        t0 = time.perf_counter()
        self.prefetch.expect(refs, next_refs)
        wait0 = self.prefetch.wait_time
        base_step = int(state.step)
        rec = self.stats
        staged = list(self.batches(refs)) if self.master.fused_steps and len(refs) > 1 else None
        fused = staged is not None and one_shape(b for _, b in staged)
        start = steps.copy_state(state) if fused else state
        if outer_round:  # the outer step starts from the round's parameters
            self._start = (start.params, self.outer_state)
        if self.moves:  # a round's moves are taken from where it started (a copy: the steps donate)
            self._theta = self._start_leaves(self.state)
        if fused:
            # The round's steps as one compiled call over the stacked minibatches: a rolled loop,
            # whose compile time does not grow with the averaging frequency, unless the step
            # convolves (then unrolled: XLA's CPU backend runs a rolled convolution far slower).
            # host arrays on a CPU device (the loader hands them over as they are): stacked by numpy,
            # since jnp.stack would convert each one first, on this thread
            stack = np.stack if self.on_cpu else jnp.stack
            stacked = jax.tree_util.tree_map(lambda *xs: stack(xs), *[b for _, b in staged])
            rolled = not self.net._step_convolves(staged[0][1], state)
            out = (steps.loop_steps if rolled else steps.bare_steps)(state, stacked)
            state, losses = out.state, out.loss
            rec.mark("fit", examples=sum(n for n, _ in staged), steps=len(staged))
        else:
            source, staged = staged or self.batches(refs), []
            for n, batch in source:
                out = (steps.bare_step if staged else steps.kept_step)(state, batch)
                state, loss = out.state, out.loss
                if rec.on:  # each minibatch's own time: wait for its step (only while recording)
                    loss.block_until_ready()
                    rec.mark("fit", examples=n)
                losses.append(loss)
                staged.append((n, batch))  # kept for a replay
        n_examples = sum(n for n, _ in staged)
        # One device-to-host transfer per round, not per step.
        losses, finite = jax.device_get((losses, steps.all_finite(state)))
        losses = np.asarray(losses, np.float64).reshape(-1)
        oks = np.isfinite(losses)
        if not (finite and oks.all()):  # a step was not finite: replay the round with train_step
            state = steps.copy_state(start) if outer_round else start
            replayed = []
            for _, batch in staged:
                out = steps.train_step(state, batch)
                state = out.state
                replayed.append((out.loss, out.finite))
            losses, oks = (np.asarray(v) for v in zip(*jax.device_get(replayed)))
            oks = oks.astype(bool)
        self.state = state
        for i, ok in enumerate(oks):
            if not ok:
                self.net.nonfinite(base_step + i, float(losses[i]))
        steps = tuple((float(x), n) for x, (n, _) in zip(losses, staged))
        losses = [float(x) for x, ok in zip(losses, oks) if ok]
        return {"loss_sum": float(sum(losses)), "n": len(losses), "examples": n_examples, "steps": steps,
                "fit_time": time.perf_counter() - t0, "data_wait": self.prefetch.wait_time - wait0}

    def _start_leaves(self, state):
        """The averaged leaves of ``state`` in float32, a copy where they lie (the steps donate)."""
        every = jax.tree_util.tree_leaves(state)
        return [jnp.array(every[i], dtype=jnp.float32, copy=True) for i in self.mixed]

    def _contribution(self, round, contributors):
        """This replica's averaged leaves (``self.mixed``) after its fit: ``(on the device, on
        the host)``. The device leaves enter its own average without a copy; the host ones are
        served to peers (views of the same memory on a CPU device). With two contributors on
        one host the host leaves are also copied into this worker's shared memory, for the
        peer to read. With moves in bfloat16 the host leaves are the move's bits and there
        are no device leaves: the replica's own mean reads its bits, as its peers do."""
        self.peer_views.prune(round)  # the files of peers gone a few rounds ago
        every = jax.tree_util.tree_leaves(self.state)
        leaves = [every[i] for i in self.mixed]
        if self.moves:  # the move in bfloat16; the rounding's loss goes into the next round's
            theta = self.theta[round]
            if self.residual is None:
                self.residual = [jnp.zeros_like(t) for t in theta]
            host, self.residual = encode_moves(leaves, theta, self.residual)
            leaves = None  # the replica's own mean reads its bits too, as its peers do
        else:
            host = [np.asarray(x) for x in leaves]
        if (self.slots is not None and len(contributors) == 2 and self.address in contributors
                and all(_shared.same_host(a, self.address) for a in contributors)):
            where = self.slots.put(round % 2, host)
            if where is not None:
                self.shared[round] = where
        return leaves, host

    def _average_into_state(self, contributions):
        leaves = jax.tree_util.tree_leaves(self.state)  # the others (integers, a reset updater) are kept
        for i, x in zip(self.mixed, average_on_device([leaves[i] for i in self.mixed], contributions)):
            leaves[i] = x
        self.state = jax.tree_util.tree_unflatten(self.treedef, leaves)

    def _moves_into_state(self, round, contributions):
        """The round's start plus the mean of the contributions' moves (bfloat16 bits)."""
        leaves = jax.tree_util.tree_leaves(self.state)
        new = mean_of_moves(self.theta[round], contributions)
        self._set_mixed([x.astype(leaves[i].dtype, copy=False) for i, x in zip(self.mixed, new, strict=True)])

    def _set_mixed(self, values):
        """The averaged leaves (``self.mixed``) set to ``values``, the others kept."""
        self._set_floats(self.mixed, None, values)

    def _own_contribution(self, round):
        """Its device leaves until its first average of the round, the host ones after
        (so that the device holds one state, not two)."""
        device, host = self.contributions[round]
        return device if device is not None else host

    def _set_floats(self, floats, pieces, values):
        """Replace the floating-point leaves ``floats`` by those ``pieces`` of ``values`` assemble
        (``pieces=None``: by ``values``, one whole leaf each)."""
        leaves = jax.tree_util.tree_leaves(self.state)
        new = values if pieces is None else assemble([leaves[i] for i in floats], pieces, values)
        for i, x in zip(floats, new, strict=True):
            leaves[i] = x
        self.state = jax.tree_util.tree_unflatten(self.treedef, jax.device_put(leaves))

    def _outer_step(self, round):
        """After a round that takes the outer step (its start kept in ``round_start``), the
        parameters move from the round's start by its update of (start - mean); computed from
        the stored start, so averaging again is safe."""
        if self.outer is None or round not in self.round_start:
            return
        start, st = self.round_start[round]
        params, self.outer_state = self.outer(start, self.state.params, st)
        self.state = self.state.replace(params=params)

    def carried_state(self):
        if self.outer_state is None:
            return None
        return jax.tree_util.tree_map(np.asarray, self.outer_state)

    def adopt(self, carried):
        if carried is not None and self.outer is not None:
            self.outer_state = jax.tree_util.tree_map(jnp.asarray, carried)

    def checkpoint_arrays(self):
        return self.carried_state()

    # -- orders -----------------------------------------------------------------------
    async def order_fit(self, order):
        """Fit the round's minibatches, then average with ``order.plan.contributors`` at once
        (one control message per round; the coordinator steps in only if a peer is lost)."""
        round, contributors = order.round, order.plan.contributors
        outer_round = self.master.takes_outer_step(order.plan.full)
        self.forget_rounds_before(round)
        try:
            result = await self.compute(self._fit, list(order.refs), order.epoch, list(order.next_refs), outer_round)
            if outer_round:  # a round that ends in the outer step keeps where it started
                self.round_start[round] = self._start
            if self.moves:
                self.theta[round] = self._theta
            self.contributions[round] = await self.compute(self._contribution, round, contributors)
            self.stats.mark("prepare")
        except BaseException:
            self.contributions[round] = None  # peers waiting for it learn it will not come
            if len(contributors) >= 3:  # and those waiting for its share
                slot = self.shares.setdefault(round, {}).setdefault((tuple(contributors), 0), [asyncio.Event(), None])
                if slot[1] is None:
                    slot[1] = ("lost", self.address)
                slot[0].set()
            raise
        finally:
            self.ready.setdefault(round, asyncio.Event()).set()
        self._offer(round, contributors)
        averaged = await self.order_average(AverageOrder(round, tuple(contributors), 0))
        return FitReply(unreachable=averaged.unreachable, extra={"averaged": averaged}, **result)

    def _offer(self, round, contributors):
        """Tell each co-located contributor where this replica's contribution to ``round`` lies,
        one way (no reply written or awaited). The later of two replicas to finish its fit
        then finds its peer's offer waiting and reads the contribution at once, instead of
        asking for it and waiting for the answer (1 to 2 ms a round on a small CPU machine,
        the whole of its fetch); the earlier one asks as before, and so does a replica whose
        offer did not come (a lost message costs only that)."""
        where = self.shared.get(round)
        if where is None:
            return
        for addr in contributors:
            if addr != self.address and _shared.same_host(addr, self.address):
                # the peer reads it once, from the offer or on asking: served (counted) here
                self.offered.add(round)
                t = self.stats.now()
                self.stats.add("serve", t, t, "comms", bytes=where.nbytes, shared=where.nbytes, offered=1)
                task = asyncio.ensure_future(call_peer(
                    self.worker, addr, "dlspark_peer", job=self.job, request="offer", round=round,
                    sender=self.address, where=to_serialize(where), reply=False))
                self._sending.add(task)
                task.add_done_callback(self._offer_sent)

    def _offer_sent(self, task):
        self._sending.discard(task)
        if not task.cancelled():
            task.exception()  # a peer gone or unreachable: it asks, or is dropped, as before

    async def order_average(self, order):
        """Average the round's contributions, fetched from the peers that hold them.

        With no contributors left the replica goes back to the state it had before the
        round (the round trained nothing). A peer whose contribution cannot be had is
        named in ``unreachable`` and nothing changes here. ``attempt`` numbers the
        coordinator's calls in a round, so that averaging again over the same
        contributors (the failure passed) does not reuse a share that failed.
        """
        round, attempt = order.round, order.attempt
        contributors = list(order.contributors)
        t0 = time.perf_counter()
        if round not in self.contributions:  # no data this round: keep what the round started from
            self.forget_rounds_before(round)
            if round not in self.untouched:
                self.untouched[round] = [np.asarray(x) for x in jax.tree_util.tree_leaves(self.state)]
                if self.moves:  # the mean of the contributors' moves is taken from here
                    self.theta[round] = self._start_leaves(self.state)
                if self.master.takes_outer_step(order.full):
                    self.round_start[round] = (self.state.params, self.outer_state)
        done = AverageReply(avg_time=0.0, fetch_time=0.0, bytes_received=0, contributors=tuple(contributors))
        if contributors == [self.address] and self.contributions.get(round) is not None:
            # Sole contributor: the mean is its own state after its fit (its own move).
            if self.moves:
                await self.compute(self._then_outer, round, self._moves_into_state, round,
                                   [self._own_contribution(round)])
            else:
                await self.compute(self._then_outer, round, self._set_mixed, self._own_contribution(round))
            self.stats.mark("average")
            return replace(done, avg_time=time.perf_counter() - t0)
        if not contributors and round in self.untouched:
            # Every contributor was lost. (A replica that fit this round is among the
            # contributors for as long as it lives.)
            await self.compute(self._restore_untouched, round)
            self.stats.mark("average")
            return replace(done, avg_time=time.perf_counter() - t0)
        if len(contributors) >= 3:
            return await self._average_in_shares(round, contributors, attempt, t0)
        contribs, nbytes, shared, resp, used_offers = [], 0, 0, None, 0
        for addr in contributors:
            if addr == self.address:
                contribs.append(self._own_contribution(round))
                continue
            nearby = self.read_shared and _shared.same_host(addr, self.address)
            offered = self.offers.get(round, {}).get(addr) if nearby else None
            if offered is not None:
                resp = SharedContribution(where=offered)
                used_offers += 1
            else:
                resp = await self._ask(addr, "contribution", round=round, shared=nearby)
            if isinstance(resp, SharedContribution):
                try:
                    resp = Contribution(leaves=await self.compute(self.peer_views.views, resp.where, round))
                    shared += sum(x.nbytes for x in resp.leaves)
                except (OSError, ValueError):
                    resp = await self._ask(addr, "contribution", round=round)
                    if isinstance(resp, Contribution):
                        # the peer is there, and its file could not be mapped from here (another
                        # pid namespace on the same host address, no permission): the comms from
                        # now on; a peer that is gone only fails this request
                        self.read_shared = False
            if not isinstance(resp, Contribution):
                return AverageReply(unreachable=(addr,), ok=False, contributors=tuple(contributors))
            nbytes += sum(np.asarray(x).nbytes for x in resp.leaves)
            contribs.append(resp.leaves)
        t_fetch = time.perf_counter() - t0
        self.stats.mark("fetch", bytes=nbytes, shared=shared, offered=used_offers)
        if self.moves:
            await self.compute(self._then_outer, round, self._moves_into_state, round, contribs)
        else:
            await self.compute(self._then_outer, round, self._average_into_state, contribs)
        del contribs, resp  # this call's views into a peer's shared memory end here
        self._drop_device_copy(round)
        self.stats.mark("average")
        return AverageReply(avg_time=time.perf_counter() - t0, fetch_time=t_fetch, bytes_received=nbytes,
                            contributors=tuple(contributors), bytes_shared=shared)

    def _then_outer(self, round, combine, *args):
        """Put the round's mean into the state (``combine(*args)``), then take the outer step."""
        combine(*args)
        self._outer_step(round)

    def _restore_untouched(self, round):
        self.set_leaves(self.untouched[round])
        if round in self.round_start:
            self.outer_state = self.round_start[round][1]

    def _drop_device_copy(self, round):
        if self.contributions.get(round) is not None:  # averaged: its device copy is no longer needed
            self.contributions[round] = (None, self.contributions[round][1])

    async def _ask(self, addr, op, **kw):
        """A peer's answer to a request, or ``Unavailable`` when it cannot be reached."""
        try:
            resp = await call_peer(self.worker, addr, "dlspark_peer", job=self.job, request=op, **kw)
        except OSError:
            return Unavailable(peer=addr)
        return resp.get("reply", Unavailable(peer=addr)) if isinstance(resp, dict) else Unavailable(peer=addr)

    async def _average_in_shares(self, round, contributors, attempt, t0):
        """The mean over three or more contributors, in shares (see ``_numerics``): this
        replica averages its own share, if it is a contributor, then fetches the others'."""
        me = self.address
        n = len(contributors)
        leaves = jax.tree_util.tree_leaves(self.state)  # shapes and dtypes; the others are kept
        floats = self.mixed
        sizes = [leaves[i].size for i in floats]
        slot = self.shares.setdefault(round, {}).setdefault((tuple(contributors), attempt), [asyncio.Event(), None])
        nbytes = 0
        if me in contributors and slot[1] is None:
            try:
                bounds = share_bounds(sizes, n, contributors.index(me))
                pieces = share_pieces(sizes, *bounds)
                parts = []
                for addr in contributors:
                    if addr == me:
                        parts.append(take_share(self.contributions[round][1], pieces))
                        continue
                    resp = await self._ask(addr, "contribution", round=round, share=list(bounds))
                    if not isinstance(resp, Contribution):
                        slot[1] = ("lost", addr)  # peers waiting for this share learn whom to drop
                        return AverageReply(unreachable=(addr,), ok=False, contributors=tuple(contributors))
                    parts.append(list(resp.leaves))
                    nbytes += sum(np.asarray(x).nbytes for x in parts[-1])
                self.stats.mark("fetch", bytes=nbytes)
                if self.moves:  # the share of the round's start plus the mean of its moves
                    slot[1] = ("OK", await self.compute(self._share_of_moves, round, pieces, parts))
                else:
                    slot[1] = ("OK", await self.compute(average_share, parts))
                self.stats.mark("average")
            finally:
                if slot[1] is None:  # failed here: its waiters must not wait for their timeout
                    slot[1] = ("lost", me)
                slot[0].set()
        elif me in contributors and slot[1][0] != "OK":
            return AverageReply(unreachable=(slot[1][1] or me,), ok=False, contributors=tuple(contributors))
        t_fetch = time.perf_counter() - t0
        own_bytes = nbytes
        all_pieces, all_values = [], []
        for k, addr in enumerate(contributors):
            if addr == me:
                values = slot[1][1]
            else:
                resp = await self._ask(addr, "share", round=round, contributors=contributors, attempt=attempt)
                if not isinstance(resp, Share):
                    return AverageReply(unreachable=(getattr(resp, "peer", None) or addr,), ok=False,
                                        contributors=tuple(contributors))
                values = list(resp.values)
                nbytes += sum(np.asarray(x).nbytes for x in values)
            all_pieces += share_pieces(sizes, *share_bounds(sizes, n, k))
            all_values += values
        self.stats.mark("fetch", bytes=nbytes - own_bytes)
        await self.compute(self._then_outer, round, self._set_floats, floats, all_pieces, all_values)
        self._drop_device_copy(round)
        self.stats.mark("average")
        return AverageReply(avg_time=time.perf_counter() - t0, fetch_time=t_fetch, bytes_received=nbytes,
                            contributors=tuple(contributors))

    def _share_of_moves(self, round, pieces, parts):
        theta = take_share([np.asarray(t) for t in self.theta[round]], pieces)
        return [np.asarray(x) for x in mean_of_moves(theta, parts)]

    # -- requests from peers ----------------------------------------------------------
    async def peer_contribution(self, round: int, share: list | None = None, shared: bool = False):
        """This replica's averaged leaves after its fit in ``round``; with ``share=[lo, hi]``,
        only that flat range of their elements (see ``share_pieces``). A co-located
        peer that can read shared memory (``shared``) is told where they lie in it instead."""
        ev = self.ready.setdefault(round, asyncio.Event())
        await asyncio.wait_for(ev.wait(), timeout=self.peer_timeout())
        t0 = self.stats.now()
        contribution = self.contributions.get(round)
        if contribution is None:
            return {"reply": to_serialize(Unavailable(peer=None))}
        if shared and share is None and round in self.shared:
            where = self.shared[round]
            if round not in self.offered:  # an offered contribution was counted when offered
                self.stats.add("serve", t0, self.stats.now(), "comms", bytes=where.nbytes, shared=where.nbytes)
            return {"reply": to_serialize(SharedContribution(where=where))}
        leaves = contribution[1]  # the averaged leaves only
        if share is not None:
            leaves = take_share(leaves, share_pieces([x.size for x in leaves], *share))
        self.stats.add("serve", t0, self.stats.now(), "comms", bytes=sum(np.asarray(x).nbytes for x in leaves))
        return {"reply": to_serialize(Contribution(leaves=list(leaves)))}

    async def peer_offer(self, round: int, sender: str, where):
        """A co-located peer's word that its contribution to ``round`` lies at ``where``."""
        if round >= min(self.contributions, default=round):  # not a round already forgotten
            self.offers.setdefault(round, {})[sender] = where
        return {}

    async def peer_share(self, round: int, contributors: list, attempt: int = 0):
        """This replica's averaged share of ``round`` over ``contributors``, once it has it."""
        key = (tuple(contributors), attempt)
        slot = self.shares.setdefault(round, {}).setdefault(key, [asyncio.Event(), None])
        await asyncio.wait_for(slot[0].wait(), timeout=self.peer_timeout())
        status, value = slot[1]
        if status != "OK":
            return {"reply": to_serialize(Unavailable(peer=value))}
        t = self.stats.now()
        self.stats.add("serve", t, t, "comms", bytes=sum(np.asarray(x).nbytes for x in value))
        return {"reply": to_serialize(Share(values=list(value)))}
