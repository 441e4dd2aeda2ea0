"""A :class:`~dlspark.algorithms.replica.ReplicaAlgorithm` over the devices of one process.

Rounds are planned by the cluster's planner (device ``i`` where the ``i``-th worker
stands), each replica fits its minibatches on its own device with the network's
``train_step``, then one SPMD call over the mesh does every replica's
``contribute``, the mean over the round's contributors (a ``psum`` in float32, then
one divide: with two devices the cluster's mean bit for bit) and ``finish`` (on CPU
devices two calls and the sum on the host between them:
:meth:`~dlspark._mesh.MeshExchange.spmd_summed`).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from .._mesh import FitOutcome, by_device, first, lead, replica_rngs
from ..stats._record import RoundStats, iteration_rows
from ._replica_common import ReplicaFigures

__all__ = ["ReplicaDeviceRun"]


def _finish_function(master, exchange, short: bool = False):
    """Every replica's contribution, the mean over the contributors, and its finish (with
    ``short``, its ``finish_short``), in one call."""
    finish = master.finish_short if short else master.finish

    def before(start, params, carry, contributes, n):
        start, params, carry, c = first(start), first(params), first(carry), contributes[0]
        contribution, new_carry = master.contribute(start, params, carry)
        # a replica with no minibatch this round adds nothing and keeps its carry
        carry = jax.tree_util.tree_map(lambda a, b: jnp.where(c, a, b), new_carry, carry)
        wide = jax.tree_util.tree_map(lambda x: jnp.where(c, x.astype(jnp.float32), jnp.float32(0)), contribution)
        return (start, carry, n), wide

    def after(kept, sums):
        start, carry, n = kept
        mean = jax.tree_util.tree_map(lambda s: s / n, sums)
        params, carry = finish(start, mean, carry)
        return lead(params), lead(carry)

    return exchange.spmd_summed(before, after, replicated=(4,))


class ReplicaDeviceRun:
    """One :class:`~dlspark.ParallelWrapper` fit of a replica algorithm."""

    def __init__(self, runtime):
        self.rt = runtime
        self.net, self.master, self.exchange = runtime.network, runtime.master, runtime.exchange
        self._finish = {}  # full round or not -> its compiled finish (one, unless they differ)
        for full in (True, False) if self.master.short_rounds_differ else (True,):
            key = ("replica-finish", self.master, full)
            if key not in runtime.cache:
                runtime.cache[key] = _finish_function(self.master, self.exchange, short=not full)
            self._finish[full] = runtime.cache[key]
        self._finish.setdefault(False, self._finish[True])

    def fit(self, refs, partitions, epochs, skip=(), saved_rngs=None, epochs_done=0, epochs_total=None,
            checkpoint_every=None, checkpoint_url=None) -> FitOutcome:
        rt, net, master, ex = self.rt, self.net, self.master, self.exchange
        epochs_total = epochs if epochs_total is None else epochs_total
        base_step, base_epoch = net.iteration, net.epoch
        ranks = list(range(len(ex)))
        rngs = replica_rngs(net.state.rng, len(ranks), saved_rngs)
        states = [jax.device_put(net.state.replace(rng=r), d, may_alias=False) for r, d in zip(rngs, ex.devices)]
        carry0 = master.init_carry(net.state.params)
        carries = [jax.device_put(carry0, d) for d in ex.devices]
        planner = master.planner(partitions, epochs, skip)
        step = net.steps.train_step
        stats = []
        while (plan := planner.plan_round(ranks)) is not None:
            t0 = time.perf_counter()
            epoch = np.int32(base_epoch + plan.epoch)
            # the round's start, kept (the steps donate the state they are given)
            starts = [jax.tree_util.tree_map(jnp.copy, s.params) for s in states]
            # per replica: (loss, finite) and the examples of each of its steps
            losses: dict[int, list] = {r: [] for r in ranks}
            sizes: dict[int, list] = {r: [] for r in ranks}
            examples = 0
            for r in ranks:
                st = states[r].replace(epoch=jax.device_put(epoch, ex.devices[r]))
                for i in plan.assignment.get(r) or ():
                    ds = rt.load(refs[i])
                    examples += len(ds)
                    sizes[r].append(len(ds))
                    out = step(st, jax.device_put(ds.jit_batch(), ex.devices[r]))
                    st = out.state
                    losses[r].append((out.loss, out.finite))
                states[r] = st
            t_fit = time.perf_counter() - t0
            done_before = planner.trained_total
            counted = planner.complete_round(plan, plan.contributors)
            j = 0
            for r in ranks:  # one host sync a round
                losses[r] = jax.device_get(losses[r])
                for x, ok in losses[r]:
                    if not ok:
                        net.nonfinite(base_step + done_before + j, float(x))
                    j += 1
            stacked = [ex.stack([lead(t) for t in trees]) for trees in
                       (starts, [s.params for s in states], carries)]
            full = plan.is_full(master.steps_per_round)  # as a cluster's driver marks it
            params, carry = self._finish[full](*stacked, ex.mask(plan.contributors),
                                               np.float32(len(plan.contributors)))
            for r, d in enumerate(ex.devices):
                states[r] = states[r].replace(params=jax.tree_util.tree_map(lambda x: by_device(x)[d][0], params))
                carries[r] = jax.tree_util.tree_map(lambda x: by_device(x)[d][0], carry)
            kept = {r: [float(x) for x, ok in losses[r] if ok] for r in ranks}
            flat = [x for r in ranks for x in kept[r]]
            contributed = len(plan.contributors)
            stat = RoundStats.build(
                round=plan.round, epoch=plan.epoch, minibatches=counted, examples=examples,
                loss=(sum(flat) / len(flat)) if flat else None, workers=contributed,
                round_time=time.perf_counter() - t0, fit_time_max=t_fit,
                worker_fit_time={r: t_fit for r in plan.contributors},
                worker_steps={r: len(kept[r]) for r in plan.contributors},
                data_wait={r: 0.0 for r in plan.contributors}, trained_total=planner.trained_total, attempts=0,
                iterations=iteration_rows(done_before, plan.epoch, {
                    r: [(float(x), n) for (x, _), n in zip(losses[r], sizes[r])] for r in ranks if losses[r]},
                    {r: t_fit for r in ranks}),
                extra=ReplicaFigures(bytes_received=self._bytes(contributed)))
            stats.append(stat)
            rt.report(stat)
            if checkpoint_every and plan.round % checkpoint_every == 0:
                prog = dict(planner.progress(), epoch=epochs_done + planner.progress()["epoch"],
                            epochs_total=epochs_total)
                rt.write_checkpoint(checkpoint_url, jax.device_get(states[0]), step=base_step + planner.trained_total,
                                    epoch=base_epoch + planner.epoch, progress=prog,
                                    worker_rngs=[np.asarray(s.rng).tolist() for s in states])
        trained = planner.trained_total
        final = jax.device_put(states[0].replace(step=np.int32(base_step + trained),
                                                 epoch=np.int32(base_epoch + epochs)), ex.devices[0])
        return FitOutcome(final, stats, replica_params=[s.params for s in states])

    def _bytes(self, contributors: int) -> int:
        """What a cluster's replicas would have received for the mean: every replica fetches
        each other contributor's contribution."""
        if not hasattr(self, "_size"):
            params = self.net.state.params
            shapes = jax.eval_shape(self.master.contribute, params, params, self.master.init_carry(params))[0]
            self._size = sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
                             for s in jax.tree_util.tree_leaves(shapes))
        return self._size * contributors * (len(self.exchange) - 1)
