"""Parameter averaging in :class:`~dlspark.ParallelWrapper`: the rounds, planned and loaded
ahead on a thread, and the SPMD functions that run a round's steps and its mean over the
devices (``shard_map`` over the one-axis mesh). The wrapper itself is in :mod:`dlspark.parallel`.
"""

from __future__ import annotations

import queue
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .algorithms.averaging._numerics import is_averaged, outer_step
from .data import load_ref
from .distributed._plan import Coordinator
from .network import one_shape

#: the mesh axis the replicas are laid out on
AXIS = "replica"


class _Rounds:
    """The fit's rounds, planned and loaded ahead on one thread.

    Planning is deterministic here (no replica is ever lost), so the loading thread
    plans too: each item is a round with its minibatches already on their devices,
    stacked ``[replica, step, ...]`` (or, with ``fused_steps=False``, ``[replica, ...]``
    per step) when every replica has as many of one shape (a *regular* round), else
    per replica. ``ahead`` rounds wait in the queue (0: load
    on the caller's thread).
    """

    def __init__(self, wrapper, refs, partitions, epochs, skip, loader, storage_options, ahead):
        m = wrapper.master
        self.wrapper, self.refs, self.loader, self.options = wrapper, refs, loader, storage_options
        self.planner = Coordinator(partitions, epochs, m.averaging_frequency, m.repartition,
                                   m.repartition_strategy, skip=skip)
        self.wait = 0.0
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=ahead) if ahead else None
        if ahead:
            self._thread = threading.Thread(target=self._produce, name="dlspark-parallel-load", daemon=True)
            self._thread.start()

    def _items(self):
        ranks = list(range(len(self.wrapper.devices)))
        while (plan := self.planner.plan_round(ranks)) is not None:
            counted = self.planner.complete_round(plan, plan.contributors)
            yield {"plan": plan, "counted": counted, "progress": self.planner.progress(),
                   "trained_total": self.planner.trained_total, "epoch_after": self.planner.epoch,
                   **self._load(plan, ranks)}

    def _load(self, plan, ranks):
        net, devices = self.wrapper.network, self.wrapper.devices
        loaded = {}
        for r in ranks:
            loaded[r] = []
            for i in plan.assignment.get(r) or ():
                ds = load_ref(self.refs[i], self.loader, self.options)
                net.check_batch(ds)
                loaded[r].append((len(ds), ds.jit_batch()))
        counts = {len(v) for v in loaded.values()}
        examples = sum(n for v in loaded.values() for n, _ in v)
        batches = [b for v in loaded.values() for _, b in v]
        if len(counts) == 1 and 0 not in counts and one_shape(batches):
            # one host array [replica, step, ...] per leaf, each replica's part copied to its device
            # (with fused_steps=False one [replica, ...] array per step)
            stacked = jax.tree_util.tree_map(lambda *xs: np.stack(xs).reshape((len(ranks), -1) + np.shape(xs[0])),
                                             *batches)
            sharding = NamedSharding(self.wrapper.mesh, P(AXIS))
            if not self.wrapper.master.fused_steps:
                stacked = [jax.tree_util.tree_map(lambda x: x[:, j], stacked) for j in range(counts.pop())]
            return {"regular": True, "examples": examples, "batches": jax.device_put(stacked, sharding)}
        return {"regular": False, "examples": examples,
                "batches": {r: [jax.device_put(b, devices[r]) for _, b in loaded[r]] for r in ranks}}

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


# -- the compiled round ----------------------------------------------------------------
def _first(tree):
    return jax.tree_util.tree_map(lambda x: x[0], tree)


def _lead(tree):
    return jax.tree_util.tree_map(lambda x: x[None], tree)


def _mean_over_devices(state, contributes, n):
    """The mean of the contributing replicas' floating leaves, as ``average_leaves`` computes it:
    in at least fp32, a sum then one divide (``n`` an argument: XLA would turn a division by a
    constant into a multiplication). With two devices the sum has one order, so it is the
    cluster's mean bit for bit. Integer leaves (step counts, RNG keys) stay each replica's own."""
    leaves, treedef = jax.tree_util.tree_flatten(state)
    floats = [i for i, x in enumerate(leaves) if is_averaged(x)]
    wide = [leaves[i].astype(jnp.promote_types(leaves[i].dtype, jnp.float32)) for i in floats]
    if contributes is not None:  # some replicas had no minibatch this round: they add nothing
        wide = [jnp.where(contributes, x, jnp.zeros_like(x)) for x in wide]
    sums = jax.lax.psum(wide, AXIS)
    for i, s in zip(floats, sums):
        leaves[i] = (s / n.astype(s.dtype)).astype(leaves[i].dtype)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _policy_step(net, stacked: bool = False):
    """The step a replica runs: under ``on_nonfinite="skip"`` ``train_step``, whose guard
    leaves a bad step out; else ``checked_step``, which only flags it (the fit then raises
    and leaves the network as it was, so there is nothing to undo). ``stacked``: the same
    over stacked minibatches."""
    steps = net.steps
    if net.on_nonfinite == "skip":
        return steps.train_steps if stacked else steps.train_step
    return steps.checked_steps if stacked else steps.checked_step


def _round_function(net, master, mesh, fit: bool):
    """The compiled round: with ``fit``, every replica runs its stacked minibatches
    (``_policy_step``), then the replicas average and take the outer step; without,
    the replicas (already fitted) only average."""
    updater, tx, run_steps = net.updater, master.outer_updater, _policy_step(net, stacked=True)

    def local(state, outer, batches, start, epoch, contributes, n):
        # one device's view: every replicated argument has a leading axis of length 1
        st, ost = _first(state), _first(outer)
        losses = oks = jnp.zeros((0,))
        if fit:
            start = st.params
            if not master.save_updater:
                st = st.replace(opt_state=updater.init(st.params))
            st = st.replace(epoch=epoch)
            st, (losses, oks) = run_steps(st, _first(batches))
        else:
            start = _first(start)
        # in a fitting call every replica has minibatches: all of them contribute
        st = _mean_over_devices(st, None if fit else contributes[0], n)
        if tx is not None:
            params, ost = outer_step(tx, start, st.params, ost)
            st = st.replace(params=params)
        return _lead(st), _lead(ost), losses[None], oks[None]

    spec = P(AXIS)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, spec, P(), spec, P()),
                       out_specs=(spec, spec, spec, spec), check_vma=False)
    # an averaging-only call's state shares buffers with its round-start parameters: no donation
    return jax.jit(fn, donate_argnums=(0, 1) if fit else ())


def _step_function(net, master, mesh, first: bool, donate: bool):
    """One step on every device (``fused_steps=False``); the round's ``first`` resets the updater
    (without ``save_updater``) and sets the epoch, as a cluster worker does at a round's start.
    With ``donate`` the step writes the new state over the old one's buffers, as a worker's step
    does, rather than holding two states per device."""
    step = _policy_step(net)

    def local(state, batch, epoch):
        st = _first(state)
        if first:
            if not master.save_updater:
                st = st.replace(opt_state=net.updater.init(st.params))
            st = st.replace(epoch=epoch)
        st, loss, ok = step(st, _first(batch))
        return _lead(st), loss[None], ok[None]

    spec = P(AXIS)
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, P()), out_specs=(spec, spec, spec),
                                 check_vma=False), donate_argnums=(0,) if donate else ())


def _by_device(x) -> dict:
    return {s.device: s.data for s in x.addressable_shards}


def _equivalent_bytes(full: int, floats: int, n: int, receivers: int) -> int:
    """What a cluster's replicas would have received for this round's mean (its ``bytes_received``):
    with two contributors every replica fetches the others' states, with three or more each
    contributor reduces a share of the floats and every replica gathers the shares."""
    if n <= 2:
        return n * (receivers - 1) * full
    return 2 * (n - 1) * floats + (receivers - n) * floats
