"""Parameter averaging over the devices of one process (the device runtime, :mod:`dlspark._mesh`).

A round is planned by the cluster's own planner
(:class:`~dlspark.distributed._plan.Coordinator`, device ``i`` standing where the
``i``-th worker in address order stands), so the minibatch-to-replica assignment,
the per-replica RNG streams and the checkpoints are those of a cluster with as
many workers. A replica's round is the cluster worker's: :func:`start_round`,
its steps, the mean over the round's contributors (here the exchange's
``psum``), then :func:`outer_step`. A round's steps run as SPMD calls (one per
step or, with ``fused_steps``, one over the round's stacked minibatches), then
its mean and outer step in one more.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from ..._mesh import FitOutcome, averaged_leaves, by_device, first, lead, replica_rngs, with_averaged_leaves
from ...network import one_shape
from ...stats._record import RoundStats, iteration_rows
from ._messages import AveragingFigures
from ._numerics import averaged_indices, averaged_part, outer_step, round_steps, settled_scale, start_round

__all__ = ["AveragingDeviceRun"]


class _Rounds:
    """The fit's rounds, planned and loaded ahead on one thread.

    Planning is deterministic here (no replica is ever lost), so the loading thread
    plans too: each item is a round with its minibatches already on their devices,
    stacked ``[replica, step, ...]`` (or, with ``fused_steps=False``, ``[replica, ...]``
    per step) when every replica has as many of one shape (a *regular* round), else
    per replica. ``ahead`` rounds wait in the queue (0: load on the caller's thread).
    """

    def __init__(self, runtime, refs, partitions, epochs, skip, ahead):
        m = runtime.master
        self.runtime, self.refs = runtime, refs
        self.planner = m.planner(partitions, epochs, skip)
        self.wait = 0.0
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=ahead) if ahead else None
        if ahead:
            self._thread = threading.Thread(target=self._produce, name="dlspark-parallel-load", daemon=True)
            self._thread.start()

    def _items(self):
        ranks = list(range(len(self.runtime.devices)))
        while (plan := self.planner.plan_round(ranks)) is not None:
            counted = self.planner.complete_round(plan, plan.contributors)
            yield {"plan": plan, "counted": counted, "progress": self.planner.progress(),
                   "trained_total": self.planner.trained_total, "epoch_after": self.planner.epoch,
                   **self._load(plan, ranks)}

    def _load(self, plan, ranks):
        rt = self.runtime
        loaded = {}
        for r in ranks:
            loaded[r] = []
            for i in plan.assignment.get(r) or ():
                ds = rt.load(self.refs[i])
                loaded[r].append((len(ds), ds.jit_batch()))
        counts = {len(v) for v in loaded.values()}
        examples = sum(n for v in loaded.values() for n, _ in v)
        steps = {r: len(v) for r, v in loaded.items()}
        batches = [b for v in loaded.values() for _, b in v]
        if len(counts) == 1 and 0 not in counts and one_shape(batches):
            # one host array [replica, step, ...] per leaf, each replica's part copied to its device
            # (with fused_steps=False one [replica, ...] array per step)
            stacked = jax.tree_util.tree_map(lambda *xs: np.stack(xs).reshape((len(ranks), -1) + np.shape(xs[0])),
                                             *batches)
            if not rt.master.fused_steps:
                stacked = [jax.tree_util.tree_map(lambda x: x[:, j], stacked) for j in range(counts.pop())]
            return {"regular": True, "examples": examples, "steps": steps, "batches": rt.exchange.put(stacked)}
        return {"regular": False, "examples": examples, "steps": steps,
                "batches": {r: [jax.device_put(b, rt.devices[r]) for _, b in loaded[r]] for r in ranks}}

    def _produce(self):
        try:
            for item in self._items():
                if not self._put(item):
                    return
            self._put(None)
        except BaseException as e:  # the fit raises it where it waits for the round
            self._put(e)

    def _put(self, x) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(x, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def __iter__(self):
        if self._queue is None:
            yield from self._items()
            return
        while True:
            t0 = time.perf_counter()
            item = self._queue.get()
            self.wait += time.perf_counter() - t0
            if isinstance(item, BaseException):
                raise item
            if item is None:
                return
            yield item

    def close(self):
        self._stop.set()
        if self._queue is not None:
            self._thread.join()


def _policy_step(net, master, stacked: bool = False):
    """The step a replica runs (its updates times the master's ``update_scale``, or its
    ``outer_update_scale`` where the master has an outer optimizer: a round's master, see
    ``AveragingDeviceRun.round_master``): under
    ``on_nonfinite="skip"`` ``train_step``, whose guard
    leaves a bad step out; else ``checked_step``, which only flags it (the fit then raises
    and leaves the network as it was, so there is nothing to undo). ``stacked``: the same
    over stacked minibatches."""
    steps = round_steps(net, settled_scale(master, outer=master.outer_updater is not None))
    if net.on_nonfinite == "skip":
        return steps.train_steps if stacked else steps.train_step
    return steps.checked_steps if stacked else steps.checked_step


def _round_function(net, master, exchange, fit: bool):
    """The compiled round: with ``fit``, every replica starts the round and runs its stacked
    minibatches, then the replicas average and take the outer step; without, the replicas
    (already fitted) only average. With ``exchange_precision="bfloat16"`` the outer slot also
    carries the round's start and the replica's residual, and the mean is the start plus the
    mean of the replicas' moves rounded to bfloat16, as a cluster's workers compute it
    (``_numerics.encode_moves``, ``mean_of_moves``)."""
    tx, run_steps = master.outer_updater, _policy_step(net, master, stacked=True)
    moves = master.exchange_precision == "bfloat16"

    def before(state, outer, batches, start, epoch, contributes, n):
        st, ost = first(state), first(outer)
        if moves:
            ost, theta, residual = ost
        losses = oks = jnp.zeros((0,))
        if fit:
            start = st.params
            st = start_round(st, net.updater, master.save_updater, epoch)
            out = run_steps(st, first(batches))
            st, losses, oks = out.state, out.loss, out.finite
        else:
            start = first(start)
        # in a fitting call every replica has minibatches: all of them contribute
        if moves:  # the move in bfloat16; a replica without minibatches sends none, keeps its residual
            takes = True if fit else contributes[0]
            d = [y.astype(jnp.float32) - t + r
                 for y, t, r in zip(averaged_leaves(averaged_part(st, master.save_updater)), theta, residual,
                                    strict=True)]
            q = [x.astype(jnp.bfloat16).astype(jnp.float32) for x in d]
            residual = [jnp.where(takes, x - y, r) for x, y, r in zip(d, q, residual, strict=True)]
            parts = [jnp.where(takes, y, jnp.zeros_like(y)) for y in q]
            return (st, ost, start, losses, oks, n, theta, residual), parts
        parts = exchange.mean_parts(averaged_part(st, master.save_updater), None if fit else contributes[0])
        return (st, ost, start, losses, oks, n), parts

    def after(kept, sums):
        st, ost, start, losses, oks, n = kept[:6]
        if moves:
            theta, residual = kept[6:]
            theta = [t + x / n.astype(x.dtype) for t, x in zip(theta, sums, strict=True)]
            mean = with_averaged_leaves(averaged_part(st, master.save_updater), theta)
        else:
            mean = exchange.mean_of(averaged_part(st, master.save_updater), sums, n)
        # without save_updater each replica keeps its own updater state (reset next round)
        st = mean if master.save_updater else mean.replace(opt_state=st.opt_state)
        if tx is not None:
            params, ost = outer_step(tx, start, st.params, ost)
            st = st.replace(params=params)
        if moves:  # the next round's moves are taken from where it starts: this state, in float32
            ost = (ost, [x.astype(jnp.float32) for x in averaged_leaves(averaged_part(st, master.save_updater))],
                   residual)
        return lead(st), lead(ost), losses[None], oks[None]

    # an averaging-only call's state shares buffers with its round-start parameters: no donation
    return exchange.spmd_summed(before, after, replicated=(4, 6), donate=(0, 1) if fit else ())


def _step_function(net, master, exchange, first_step: bool, donate: bool):
    """One step on every device (``fused_steps=False``); the round's first starts the round.
    With ``donate`` the step writes the new state over the old one's buffers, as a worker's
    step does, rather than holding two states per device."""
    step = _policy_step(net, master)

    def local(state, batch, epoch):
        st = first(state)
        if first_step:
            st = start_round(st, net.updater, master.save_updater, epoch)
        out = step(st, first(batch))
        return lead(out.state), out.loss[None], out.finite[None]

    return exchange.spmd(local, replicated=(2,), donate=(0,) if donate else ())


def _equivalent_bytes(full: int, floats: int, n: int, receivers: int, moves: bool = False) -> int:
    """What a cluster's replicas would have received for this round's mean (its ``bytes_received``):
    with two contributors every replica fetches the others' states, with three or more each
    contributor reduces a share of the floats and every replica gathers the shares. With
    ``moves`` (``exchange_precision="bfloat16"``) the contributions, and so what a share is
    reduced from, take half of that; the gathered means do not."""
    if n <= 2:
        return n * (receivers - 1) * (full // 2 if moves else full)
    return (n - 1) * (floats // 2 if moves else floats) + (n - 1) * floats + (receivers - n) * floats


class AveragingDeviceRun:
    """One :class:`~dlspark.ParallelWrapper` fit with parameter averaging."""

    def __init__(self, runtime):
        self.rt = runtime
        self.net, self.master, self.exchange = runtime.network, runtime.master, runtime.exchange
        # compiled functions are kept by the wrapper: its later fits reuse them
        self._functions = runtime.cache
        self._plain = None  # the master of a round that ends in the plain mean (round_master)

    def _function(self, kind, master):
        key = (kind, master)  # a master's settings shape its functions
        if key not in self._functions:
            self._functions[key] = (_step_function(self.net, master, self.exchange, *kind[1:])
                                    if isinstance(kind, tuple) else
                                    _round_function(self.net, master, self.exchange, kind))
        return self._functions[key]

    def round_master(self, plan):
        """The master a round runs under: the fit's, where the round takes the outer step (every
        contributor fits ``averaging_frequency`` minibatches, as a cluster's driver decides);
        else the fit's without its outer optimizer (the plain mean, the outer state carried
        through as it is), as a cluster's workers run such a round."""
        if self.master.outer_updater is None or self.master.takes_outer_step(plan.is_full(self.master.steps_per_round)):
            return self.master
        if self._plain is None:
            self._plain = replace(self.master, outer_updater=None)
        return self._plain

    def _replicate(self, state, saved_rngs):
        n = len(self.exchange)
        host = jax.tree_util.tree_map(np.asarray, state)
        stacked = jax.tree_util.tree_map(lambda x: np.stack([x] * n), host.replace(rng=None))
        stacked = stacked.replace(rng=np.stack(replica_rngs(state.rng, n, saved_rngs)))
        tx = self.master.outer_updater
        carried = self.rt.algorithm_state.get("outer_state")
        outer = () if tx is None else jax.tree_util.tree_map(
            lambda x: np.stack([np.asarray(x)] * n), tx.init(state.params) if carried is None else carried)
        if self.master.exchange_precision == "bfloat16":  # the first round's start, and no residual yet
            start = averaged_leaves(averaged_part(host, self.master.save_updater))
            theta = [np.stack([np.asarray(x, np.float32)] * n) for x in start]
            outer = (outer, theta, [np.zeros_like(t) for t in theta])
        return self.exchange.put(stacked), self.exchange.put(outer)

    def _outer_state(self, outer):
        """The outer optimizer's part of the outer slot (which also carries the moves' start and
        residual with ``exchange_precision="bfloat16"``)."""
        return outer[0] if self.master.exchange_precision == "bfloat16" else outer

    def fit(self, refs, partitions, epochs, skip=(), saved_rngs=None, epochs_done=0, epochs_total=None,
            checkpoint_every=None, checkpoint_url=None) -> FitOutcome:
        net, master, ex = self.net, self.master, self.exchange
        epochs_total = epochs if epochs_total is None else epochs_total
        base_step, base_epoch = net.iteration, net.epoch
        state, outer = self._replicate(net.state, saved_rngs)
        k = master.longest_round
        depth = master.worker_prefetch_num_batches and max(master.worker_prefetch_num_batches, k)
        rounds = _Rounds(self.rt, refs, partitions, epochs, skip, math.ceil(depth / k))
        leaves = jax.tree_util.tree_leaves(net.state)
        mixed = sum(leaves[i].nbytes for i in averaged_indices(net.state, master.save_updater))
        sizes = (mixed, mixed)  # a cluster's contribution carries the averaged leaves only
        stats: list = []
        pending, last = None, [time.perf_counter(), 0.0]

        def settle(p):
            """Read a round's losses back (one host sync) and account for it."""
            item, losses, oks, t_call = p
            rows = [np.asarray(x).reshape(-1) for x in (losses if isinstance(losses, list) else np.asarray(losses))]
            okrows = [np.asarray(x).reshape(-1) for x in (oks if isinstance(oks, list) else np.asarray(oks))]
            done_before = stats[-1]["trained_total"] if stats else 0
            flat = [(float(x), bool(ok)) for row_l, row_o in zip(rows, okrows) for x, ok in zip(row_l, row_o)]
            for j, (x, ok) in enumerate(flat):
                if not ok:  # "raise": the network keeps its state from before the fit, as with the cluster
                    net.nonfinite(base_step + done_before + j, x)
            kept = [[float(x) for x, ok in zip(row_l, row_o) if ok] for row_l, row_o in zip(rows, okrows)]
            per = item["examples"] // max(1, len(flat))  # the round's examples, shared among its minibatches
            steps = {r: [(float(x), per) for x in row_l] for r, row_l in enumerate(rows) if len(row_l)}
            stat = self._round_stats(item, kept, time.perf_counter() - last[0], time.perf_counter() - t_call,
                                     rounds.wait - last[1], sizes)
            stat["iterations"] = iteration_rows(done_before, item["plan"].epoch, steps,
                                                {r: stat["fit_time_max"] for r in steps})
            last[:] = [time.perf_counter(), rounds.wait]
            stats.append(stat)
            self.rt.report(stat)

        try:
            for item in rounds:
                if pending is not None and not item["regular"]:  # this one blocks: settle the last first
                    settle(pending)
                    pending = None
                plan, t_call = item["plan"], time.perf_counter()
                state, outer, losses, oks = self._round(state, outer, item, base_epoch + plan.epoch)
                # The next round is queued on the devices before this one's losses are read back.
                if pending is not None:
                    settle(pending)
                pending = (item, losses, oks, t_call)
                if checkpoint_every and plan.round % checkpoint_every == 0:
                    settle(pending)
                    pending = None
                    prog = dict(item["progress"], epoch=epochs_done + item["progress"]["epoch"],
                                epochs_total=epochs_total)
                    rngs = [np.asarray(x).tolist() for x in np.asarray(state.rng)]
                    aux = None if master.outer_updater is None else ex.replica(self._outer_state(outer))
                    self.rt.write_checkpoint(checkpoint_url, ex.replica(state), step=base_step + item["trained_total"],
                                             epoch=base_epoch + item["epoch_after"], progress=prog, worker_rngs=rngs,
                                             aux=aux)
            if pending is not None:
                settle(pending)
        finally:
            rounds.close()
        trained = stats[-1]["trained_total"] if stats else 0
        final = jax.tree_util.tree_map(jnp.asarray, ex.replica(state).replace(
            step=np.int32(base_step + trained), epoch=np.int32(base_epoch + epochs)))
        carried = None if master.outer_updater is None else ex.replica(self._outer_state(outer))
        return FitOutcome(final, stats, carried=carried)

    def _round(self, state, outer, item, epoch):
        """Dispatch one round; returns ``(state, outer state, losses, applied)``, still on the devices."""
        contributors = tuple(item["plan"].contributors)
        master = self.round_master(item["plan"])
        args = (np.int32(epoch), self.exchange.mask(contributors), np.float32(len(contributors)))
        if item["regular"] and master.fused_steps:
            return self._function(True, master)(state, outer, item["batches"], (), *args)
        if item["regular"]:
            return self._stepwise(master, state, outer, item["batches"], *args)
        return self._irregular(master, state, outer, item["batches"], *args)

    def _stepwise(self, master, state, outer, batches, epoch, mask, n):
        """A round with ``fused_steps=False``: one call per step on every device, then one call
        averages. The steps donate the state, except the round's first when an outer
        optimizer needs the round-start parameters."""
        keep_start = master.outer_updater is not None
        start, losses, oks = (state.params if keep_start else ()), [], []
        for j, batch in enumerate(batches):
            state, loss, ok = self._function(("step", j == 0, j > 0 or not keep_start), master)(state, batch, epoch)
            losses.append(loss), oks.append(ok)
        state, outer, _, _ = self._function(False, master)(state, outer, (), start, epoch, mask, n)
        return state, outer, jnp.stack(losses, 1), jnp.stack(oks, 1)

    def _irregular(self, master, state, outer, batches, epoch, mask, n):
        """A round whose replicas fit different numbers or shapes of minibatches (an epoch's last):
        each replica steps on its own device, as a cluster worker does, then one compiled call
        averages."""
        net, ex = self.net, self.exchange
        step = _policy_step(net, master)
        parts, losses, oks = [], [], []
        for r, dev in enumerate(ex.devices):
            mine = jax.tree_util.tree_map(lambda x: by_device(x)[dev], state)
            own = batches[r]
            if not own:
                parts.append(mine)
                losses.append([]), oks.append([])
                continue
            # a copy (the step donates it; the round-start parameters stay); the epoch a host
            # scalar put on the device (the step donates this copy)
            st = start_round(first(mine), net.updater, master.save_updater, jax.device_put(epoch, dev))
            ls, ks = [], []
            for b in own:  # one step at a time: one compilation per device and shape serves every such round
                out = step(st, b)
                st = out.state
                ls.append(out.loss), ks.append(out.finite)
            parts.append(lead(st))
            losses.append(ls), oks.append(ks)  # read back later: the next device starts meanwhile
        fitted = ex.stack(parts)
        state, outer, _, _ = self._function(False, master)(fitted, outer, (), state.params, epoch, mask, n)
        return state, outer, losses, oks

    def _round_stats(self, item, losses, round_time, call_time, wait, sizes):
        """A round's statistics, with the cluster's keys."""
        plan, n = item["plan"], len(item["plan"].contributors)
        flat = [x for row in losses for x in row]
        return RoundStats.build(
            round=plan.round, epoch=plan.epoch, minibatches=item["counted"], examples=item["examples"],
            loss=(sum(flat) / len(flat)) if flat else None, workers=n, round_time=round_time, fit_time_max=call_time,
            worker_fit_time={r: call_time for r in plan.contributors},
            worker_steps={r: len(losses[r]) for r in plan.contributors},
            data_wait={r: wait for r in plan.contributors}, trained_total=item["trained_total"], attempts=0,
            extra=AveragingFigures(bytes_equivalent=_equivalent_bytes(
                *sizes, n, len(self.exchange), self.master.exchange_precision == "bfloat16")))
