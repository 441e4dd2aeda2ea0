"""Gradient sharing over the devices of one process (the device runtime, :mod:`dlspark._mesh`).

Every device holds a replica with its own updater state, residual and threshold.
Rounds are planned by the cluster's own planner
(:class:`~dlspark.distributed._plan.Coordinator`, device ``i`` standing where the
``i``-th worker in address order stands), so the minibatch-to-replica assignment
follows partitions, ``repartition`` and the balanced split as on a cluster with as
many workers. The replicas step in lockstep: at a round's step ``j`` device ``i``
fits the ``j``-th minibatch of its share and runs the workers' own step (:func:`~._state.add_and_encode`: the
update added to the residual, the part that crossed the threshold taken out as a
message, the post-processor, the threshold's update), and every replica applies
the other devices' messages with its own whole update (``own_update="whole"``), or
the sum of all devices' messages (``"encoded"``, so that the parameters stay equal),
as a worker does. This is synchronous delivery: the cluster's staleness, sync and
faults do not arise. With ``delivery_lag=1`` a replica applies its own update and the
other devices' messages of the step before, and a replica without a minibatch in a step
keeps those for the round's end, where every replica applies what it has not in one sum
(:meth:`_Replicas.flush`), as a worker ends its round.

Two encoders, the same bits: ``"host"`` runs the workers' encoder on the host
(faster on XLA's CPU backend, where the devices are the host's cores), ``"xla"``
encodes on each device and sums over the devices in XLA (for accelerators; a
property test holds it to the host encoder's results).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from ..._mesh import FitOutcome, divergence, replica_rngs, stitched_updater_state
from ...stats._record import RoundStats, iteration_rows
from ._encoding import EMPTY, MIN_MESSAGE_ELEMENTS, compiled_scan, decode_into, encode_scratch
from ._messages import SharingFigures
from ._dgc import sent_elements, threshold_for_density, warmup_density
from ._state import (SumVectors, add_and_encode, add_dropped, add_pieces, post_acts, replica_options,
                     sharing_functions)
from ._thresholds import senders, threshold_meta
from ._xla import encode_on_device_jit, message_bytes, sparsity_of

__all__ = ["SharingDeviceRun", "ENCODERS", "resolve_encoder"]

ENCODERS = ("auto", "host", "xla")


def resolve_encoder(encoder: str, devices) -> str:
    if encoder not in ENCODERS:
        raise ValueError(f"sharing_encoder must be one of {ENCODERS}, got {encoder!r}")
    if encoder == "auto":
        return "host" if devices[0].platform == "cpu" else "xla"
    return encoder


class _Lazy:
    """A device vector that the threshold algorithm's ``prepare`` reads only if it needs it."""

    def __init__(self, x):
        self.x = x

    def __array__(self, dtype=None, copy=None):
        a = np.asarray(self.x)
        return a if dtype is None else a.astype(dtype)


def _schedule(master, partitions, epochs, skip, n_dev):
    """The fit's rounds as the cluster's planner deals them: for each round its plan, the
    planner's progress after it and its steps, each ``[minibatch index or None] * n_dev``
    (a replica whose share is shorter idles at the round's last steps). Planning is
    deterministic here (no replica is ever lost)."""
    planner = master.planner(partitions, epochs, skip)
    ranks = list(range(n_dev))
    while (plan := planner.plan_round(ranks)) is not None:
        planner.complete_round(plan, plan.contributors)
        shares = [plan.assignment.get(r) or [] for r in ranks]
        steps = [[s[j] if j < len(s) else None for s in shares] for j in range(max(map(len, shares)))]
        yield plan, planner.progress(), steps


def _loader(runtime, refs, rounds, depth):
    """Yield ``(plan, progress, step in the round, steps in the round, batches)`` for every
    step, ``batches`` being ``[(examples, batch on its device) or None] * devices``, loaded
    ahead on a thread (``depth`` steps)."""
    devices = runtime.devices
    q: queue.Queue = queue.Queue(maxsize=max(depth, 1))
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False  # the fit stopped waiting

    def produce():
        try:
            for plan, progress, steps in rounds:
                for j, group in enumerate(steps):
                    out = []
                    for i, dev in enumerate(devices):
                        if group[i] is not None:
                            ds = runtime.load(refs[group[i]])
                            out.append((len(ds), jax.device_put(ds.jit_batch(), dev)))
                        else:
                            out.append(None)
                    if not put((plan, progress, j, len(steps), out)):
                        return
            put(None)
        except BaseException as e:  # raised where the fit waits for the step
            put(e)

    thread = threading.Thread(target=produce, name="dlspark-parallel-load", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                return
            yield item
    finally:
        stop.set()
        thread.join()


class _Carry(NamedTuple):
    """What each replica takes into the next fit when that fit starts from the state this
    one ended with (``GradientSharing.continue_replicas``): its updater state, residual,
    threshold state and message count, and its parameters where they are its own. ``state``
    is the network's state the fit set (the next fit goes on only if the network's state
    holds the same bits)."""

    state: object
    master: object
    encoder: str
    opt_states: list
    residuals: list
    tstates: list
    steps: list
    params: list | None  # each replica's own parameters (own_update="whole"), else None


def _continuation(runtime, encoder, resuming) -> _Carry | None:
    """The last fit's :class:`_Carry` if this fit goes on from its end, else None; taken (a
    failed fit leaves nothing to go on from)."""
    carry, runtime.sharing_carry = getattr(runtime, "sharing_carry", None), None
    if carry is None or resuming or not runtime.master.replicas_continue():
        return None
    same = (carry.master == runtime.master and carry.encoder == encoder and len(carry.residuals) == len(runtime.devices)
            and _same_state(carry.state, runtime.network.state))
    return carry if same else None


def _same_state(a, b) -> bool:
    """Whether two train states hold the same bits (as the cluster's digests compare them)."""
    if a is b:
        return True
    la, lb = jax.tree_util.tree_flatten(a), jax.tree_util.tree_flatten(b)
    if la[1] != lb[1]:
        return False
    return all(x is y or (np.shape(x) == np.shape(y) and np.asarray(x).dtype == np.asarray(y).dtype
                          and np.array_equal(np.asarray(x), np.asarray(y))) for x, y in zip(la[0], lb[0]))


def _buffers(tree) -> set:
    """Where ``tree``'s device arrays keep their data (one address per array's shard)."""
    return {shard.data.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)
            for shard in x.addressable_shards}


def _on_device(tree, device, held: set):
    """``tree`` on ``device``, a leaf copied only where its data is in ``held`` (see :func:`_buffers`)."""
    return jax.tree_util.tree_map(lambda x: jax.device_put(x, device, may_alias=not (_buffers(x) & held)), tree)


class _Replicas:
    """The devices' replicas and their sharing state."""

    def __init__(self, runtime, encoder, saved_rngs=None, carry: _Carry | None = None):
        net, master = runtime.network, runtime.master
        self.rt, self.net, self.master = runtime, net, master
        self.devices = runtime.devices
        self.encoder = encoder
        self.algo, self.post = master.threshold_algorithm, master.residual_post_processor
        self.own_whole = master.own_update == "whole"
        self.n = int(ravel_pytree(net.state.params)[0].size)
        fns = sharing_functions(net)
        self.apply_flat, self.add_flat = fns.apply_flat, fns.add_flat
        # the host encoder adds the update's pieces to its residual; the XLA one takes it flat
        self.update = fns.update if encoder == "host" else fns.flat_update
        rngs = replica_rngs(net.state.rng, len(self.devices), saved_rngs)
        # copies (the steps donate them): the network keeps its state until the fit succeeds;
        # a replica that goes on takes its updater state (and own parameters) from the carry below
        own = {} if carry is None else {"opt_state": None, **({} if carry.params is None else {"params": None})}
        self.states = [jax.device_put(net.state.replace(rng=rng, **own), d, may_alias=False)
                       for rng, d in zip(rngs, self.devices)]
        self.opts = replica_options(master, len(self.devices), net.state.opt_state, net.state.params)
        self.mask_momentum = fns.mask_momentum
        self.density = None  # the sparsity warm-up's fraction in this epoch (set by the fit)
        # delivery_lag=1: each replica's message of the step before (host: Encoded; XLA: the moved
        # vector), and what a replica idle in a step has yet to apply (host: its peers' Encoded;
        # XLA: their sums), applied at the round's end with the last step's (flush)
        self.lag = master.delivery_lag
        self.prev: dict = {}
        self.pending: list = [[] for _ in self.devices]
        self.sent: dict = {}  # replica -> the elements its message just sent (momentum masking)
        start = master.carried_threshold(runtime.algorithm_state) or self.algo.init()
        self.tstates = [start] * len(self.devices)
        self.steps = [0] * len(self.devices)  # each replica's message counter
        if encoder == "host":
            self.residuals = [np.zeros(self.n, np.float32) for _ in self.devices]
            self.scratch = [encode_scratch(self.n) for _ in self.devices]
            compiled_scan()  # loaded now, not in the first step's messages
            self.pool = ThreadPoolExecutor(len(self.devices), thread_name_prefix="dlspark-encode")
            # The decoded sum of a step, as on a worker (every CPU device reads it in place:
            # device_put of an aligned host vector aliases it). Reuse of its vectors is safe: a
            # vector is written again two steps later, when every replica has finished reading
            # it. A replica that trained in the step between read back that step's update, which
            # waits for the apply before it; an idle replica's add is waited for in its own step.
            self.totals = SumVectors(self.n)
            if self.own_whole or self.lag:  # each replica's own sum (its update and its peers' messages)
                self.own_totals = [SumVectors(self.n) for _ in self.devices]
        else:
            self.residuals = [jax.device_put(jnp.zeros(self.n, jnp.float32), d) for d in self.devices]
            self.zeros = [jax.device_put(jnp.zeros(self.n, jnp.float32), d) for d in self.devices]
        if carry is not None:  # each replica goes on where it stopped (the network's updater state is stitched)
            # the steps donate these buffers: one the network's state holds too is copied, the rest
            # (the replicas' own, which nothing else holds once the carry is taken) are used as they are
            held = _buffers(net.state)
            self.states = [s.replace(opt_state=_on_device(o, d, held))
                           for s, o, d in zip(self.states, carry.opt_states, self.devices)]
            if carry.params is not None:  # its own parameters, the first replica's too (the network may hold a mean)
                self.states = [s.replace(params=_on_device(p, d, held))
                               for s, p, d in zip(self.states, carry.params, self.devices)]
            self.residuals, self.tstates, self.steps = list(carry.residuals), list(carry.tstates), list(carry.steps)

    def carry(self, final) -> _Carry:
        """What the next fit takes if it starts from ``final`` (see :class:`_Carry`)."""
        return _Carry(final, self.master, self.encoder, [s.opt_state for s in self.states], list(self.residuals),
                      list(self.tstates), list(self.steps),
                      [s.params for s in self.states] if self.own_whole else None)

    def close(self):
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=False)

    # -- one step on every device ---------------------------------------------------
    def step(self, batches, on_bad):
        """Fit one minibatch per device (``None``: that device has none this step); returns
        ``(losses by device, examples, bytes sent, thresholds, sparsities)`` of the devices
        that trained."""
        clip = self.opts.clip
        outs = [None if b is None else self.update(self.states[i], self.states[i].opt_state, b[1], clip)
                for i, b in enumerate(batches)]
        finite = jax.device_get([None if o is None else o[5] for o in outs])
        active = []
        for i, o in enumerate(outs):
            if o is None:
                continue
            if not finite[i]:
                # "raise" stops here (the fit's states are dropped: the step wrote over this
                # one's updater state); "skip" leaves this minibatch out
                on_bad(i, float(o[4]))
                self.states[i] = self.states[i].replace(rng=o[3])  # no replay of the same dropout mask
                outs[i] = None
                continue
            active.append(i)
        encode = self._encode_host if self.encoder == "host" else self._encode_xla
        totals, sent, ts, sparsities = encode(outs, active)
        idle = []
        for i, o in enumerate(outs):
            if o is None and self.lag:  # applied at the round's end, as a worker whose share ended does
                self.pending[i].extend(totals[i])
            elif o is None:  # the sum of the others' messages still reaches this replica
                self.states[i] = self.add_flat(self.states[i], totals[i])
                idle.append(self.states[i])
            else:
                opt = o[1]
                if self.opts.mask_fields:
                    opt = self.mask_momentum(opt, self.sent.pop(i), self.opts.mask_fields)
                self.states[i] = self.apply_flat(self.states[i].replace(opt_state=opt, model_state=o[2], rng=o[3]),
                                                 totals[i])
        losses = dict(zip(active, (float(x) for x in jax.device_get([outs[i][4] for i in active]))))
        if idle and self.encoder == "host":  # nothing else waits for these reads of the reused vector
            jax.block_until_ready(idle)
        return losses, sum(batches[i][0] for i in active), sent, ts, sparsities

    def _encode_one(self, i, update):
        """Replica ``i``'s message of this step (host encoder): the workers' own step. Replicas
        encode on threads of their own (the scan and numpy's loops release the GIL), each
        with its own scratch."""
        self.steps[i] += 1
        enc, self.residuals[i] = add_and_encode(self.algo, self.post, self.tstates[i], self.residuals[i], update,
                                                self.scratch[i], self.steps[i], self.density,
                                                keep_dropped=self.own_whole)
        self.tstates[i] = enc.tstate
        if self.opts.mask_fields:
            self.sent[i] = sent_elements(enc.message, self.n)
        return enc

    def _encode_host(self, outs, active):
        if len(active) > 1:
            done = list(self.pool.map(lambda i: self._encode_one(i, outs[i][0]), active))
        else:
            done = [self._encode_one(i, outs[i][0]) for i in active]
        sent = sum(int(enc.message.nbytes) for enc in done) * (len(self.devices) - 1)
        figures = (sent, [e.threshold for e in done], [e.sparsity for e in done])
        encoded = dict(zip(active, done))
        if self.lag:  # the peers' part: their messages of the step before
            peers, self.prev = self.prev, encoded
            return (self._own_sums(outs, encoded, peers), *figures)
        if self.own_whole:
            return (self._own_sums(outs, encoded, encoded), *figures)
        total = self.totals.take()
        for enc in done:  # summed in replica order: the same bits as one thread
            if enc.message[0] != EMPTY:
                decode_into(enc.message, total)
        return ([jax.device_put(total, d) for d in self.devices], *figures)

    def _own_sums(self, outs, encoded, peers):
        """Each replica's sum of a step (host encoder, ``own_update="whole"`` or a
        ``delivery_lag``): its own update (if it trained: whole, or its message), then the
        others' messages of ``peers`` in replica order, as a worker adds them. Under a lag a
        replica idle in the step gets the list of those messages, to apply at the round's end."""
        def one(i):
            if self.lag and i not in encoded:
                return [enc for j, enc in peers.items() if j != i]
            total = self.own_totals[i].take()
            if i in encoded and self.own_whole:
                add_dropped(add_pieces(total, outs[i][0]), encoded[i])
            elif i in encoded and encoded[i].message[0] != EMPTY:
                decode_into(encoded[i].message, total)
            for j, enc in peers.items():
                if j != i and enc.message[0] != EMPTY:
                    decode_into(enc.message, total)
            return jax.device_put(total, self.devices[i])

        return list(self.pool.map(one, range(len(self.devices))))

    def flush(self):
        """A round's end under a ``delivery_lag``: each replica applies what it has not, its
        peers' messages of the round's last step after those of the steps it was idle in, in
        one sum (as a worker ends its round)."""
        if not self.lag:
            return
        if self.encoder == "host":
            for i, d in enumerate(self.devices):
                held = self.pending[i] + [enc for j, enc in self.prev.items() if j != i]
                if held:
                    total = np.zeros(self.n, np.float32)
                    for enc in held:
                        if enc.message[0] != EMPTY:
                            decode_into(enc.message, total)
                    self.states[i] = self.add_flat(self.states[i], jax.device_put(total, d))
        else:
            last = [None] * len(self.devices)
            if self.prev:
                last = self.rt.exchange.sum_with_own([self.prev.get(i, z) for i, z in enumerate(self.zeros)], self.zeros)
            for i in range(len(self.devices)):
                held = self.pending[i] + ([last[i]] if self.prev else [])
                if held:
                    total = held[0]
                    for x in held[1:]:
                        total = total + x
                    self.states[i] = self.add_flat(self.states[i], total)
        self.prev, self.pending = {}, [[] for _ in self.devices]

    def _encode_xla(self, outs, active):
        moved, counts, ts = list(self.zeros), {}, {}
        own = [self.zeros[i] if o is None else o[0] for i, o in enumerate(outs)]  # own_update="whole"
        for i in active:
            r = self.residuals[i] + outs[i][0]
            if self.density is None:
                self.tstates[i] = self.algo.prepare(self.tstates[i], _Lazy(r))
                t = ts[i] = self.tstates[i].threshold
            else:  # the sparsity warm-up's threshold; the threshold algorithm waits (as encode_step)
                t = ts[i] = threshold_for_density(r, self.density)
            moved[i], encoded, counts[i] = encode_on_device_jit(r, np.float32(t), min_count=MIN_MESSAGE_ELEMENTS)
            if self.opts.mask_fields:
                self.sent[i] = moved[i] != 0
            self.steps[i] += 1
            self.residuals[i] = self._post(encoded, t, i)
            if self.own_whole and post_acts(self.post, self.steps[i]):  # what it dropped, dropped here too
                own[i] = own[i] + (self.residuals[i] - encoded)
        if self.lag:  # its own update (whole, or its message), then the others' of the step before
            before = [self.prev.get(i, z) for i, z in enumerate(self.zeros)]
            self.prev = {i: moved[i] for i in active}
            totals = self.rt.exchange.sum_with_own(before, own if self.own_whole else moved)
            totals = [[x] if outs[i] is None else x for i, x in enumerate(totals)]  # idle: applied at the end
        elif self.own_whole:  # each replica's own update, then the others' messages, in XLA
            totals = self.rt.exchange.sum_with_own(moved, own)
        else:
            totals = self.rt.exchange.sum(moved)  # over the devices, in XLA
        counts = dict(zip(counts, (int(c) for c in jax.device_get(list(counts.values())))))
        sent, sparsities = 0, []
        for i in active:
            sent += message_bytes(counts[i], self.n) * (len(self.devices) - 1)
            sparsity = sparsity_of(counts[i], self.n)
            if self.density is None:
                self.tstates[i] = self.algo.update(self.tstates[i], sparsity)
            sparsities.append(sparsity)
        return totals, sent, [float(ts[i]) for i in active], sparsities

    def _post(self, residual, t, i):
        """Replica ``i``'s residual after the post-processor (on the device where it can)."""
        on_device = getattr(self.post, "update_on_device", None)
        if on_device is not None:
            return on_device(residual, t, self.steps[i])
        host = np.array(residual)  # a post-processor of host arrays only: the residual makes the round trip
        return jax.device_put(self.post.update(host, t, self.steps[i]), self.devices[i])

    def carried_states(self):
        return senders(self.tstates, self.steps)

    def write_checkpoint(self, url, step, epoch, progress):
        """What the cluster's first worker writes: replica 0's state, every replica's RNG and
        the thresholds reached. Residuals are not kept (the cluster's checkpoints do not keep
        them either, nor do DL4J's): a resumed fit starts with empty residuals, so its first
        steps may send nothing until they fill to the threshold reached, and every replica
        starts from replica 0's updater state."""
        rngs = [np.asarray(s.rng).tolist() for s in self.states]
        meta = {"threshold_states": threshold_meta(self.algo, self.carried_states())}
        self.rt.write_checkpoint(url, jax.device_get(self.states[0]), step=step, epoch=epoch, progress=progress,
                                 worker_rngs=rngs, meta=meta)


class SharingDeviceRun:
    """One :class:`~dlspark.ParallelWrapper` fit with gradient sharing (``steps_per_round``
    lockstep steps make a round of the statistics)."""

    def __init__(self, runtime):
        self.rt = runtime
        self.encoder = resolve_encoder(runtime.options.get("sharing_encoder", "auto"), runtime.devices)

    def fit(self, refs, partitions, epochs, skip=(), saved_rngs=None, epochs_done=0, epochs_total=None,
            checkpoint_every=None, checkpoint_url=None) -> FitOutcome:
        rt = self.rt
        net, master = rt.network, rt.master
        epochs_total = epochs if epochs_total is None else epochs_total
        home = next(iter(jax.tree_util.tree_leaves(net.state)[0].devices()))
        carry = _continuation(rt, self.encoder, resuming=bool(skip) or saved_rngs is not None)
        reps = _Replicas(rt, self.encoder, saved_rngs, carry)
        try:
            base_step, base_epoch = net.iteration, net.epoch
            n_dev = len(reps.devices)
            stats, trained = [], 0
            depth = max(1, master.worker_prefetch_num_batches)

            def on_bad(i, loss):
                net.nonfinite(base_step + trained, loss)

            rounds = _schedule(master, partitions, epochs, skip, n_dev)
            epoch = None
            for plan, progress, j, n_steps, batches in _loader(rt, refs, rounds, depth):
                if plan.epoch != epoch:  # an epoch's first step
                    epoch = plan.epoch
                    reps.states = [s.replace(epoch=jax.device_put(np.int32(base_epoch + epoch), d))
                                   for s, d in zip(reps.states, reps.devices)]
                    reps.density = warmup_density(reps.opts.warmup, int(base_epoch) + epoch)
                if j == 0:
                    row, t_round = _Row(n_dev), rt.clock()
                t0 = rt.clock()
                losses, examples, sent, ts, sp = reps.step(batches, on_bad)
                if j == n_steps - 1:  # a lag's last messages, applied at the round's end
                    reps.flush()
                row.add(rt.clock() - t0, losses, examples, sent, 4 * reps.n * (n_dev - 1) * len(losses), ts, sp)
                trained += len(losses)  # a skipped non-finite minibatch counts as done, not as trained
                if j == n_steps - 1:
                    stat = row.finish(plan.round, epoch, trained, rt.clock() - t_round)
                    stats.append(stat)
                    rt.report(stat)
                    if checkpoint_every and plan.round % checkpoint_every == 0:
                        # the planner's place after the round (after an epoch's last: the next one's start)
                        after = progress["epoch"]
                        prog = dict(progress, epoch=epochs_done + after, epochs_total=epochs_total)
                        reps.write_checkpoint(checkpoint_url, base_step + trained, base_epoch + after, prog)
            final = reps.states[0]
            params = jax.device_get([s.params for s in reps.states]) if master.final_mean() and n_dev > 1 else []
            apart = divergence(params) if params else None
            if apart:
                # the replicas' mean and the stitched updater state, as the cluster's client takes them
                # (replicas with the same parameters end as the first: there the client takes each
                # array from a worker that holds the first's bits)
                final = final.replace(params=master.end_params(params), opt_state=stitched_updater_state(reps.states))
            final = jax.device_put(final.replace(step=np.int32(base_step + trained), epoch=np.int32(base_epoch + epochs)),
                                   home)
            if master.replicas_continue():
                rt.sharing_carry = reps.carry(final)
            return FitOutcome(final, stats, replica_params=[s.params for s in reps.states],
                              algorithm_state={"threshold_states": reps.carried_states()},
                              published={"sharing_encoder": self.encoder}, divergence=apart)
        finally:
            reps.close()


class _Row:
    """A round's figures as the steps add up, then its statistics with the cluster's keys."""

    def __init__(self, n_dev):
        self.n_dev = n_dev
        self.fit_time, self.examples, self.bytes_sent, self.dense_bytes = 0.0, 0, 0, 0
        self.losses: dict = {r: [] for r in range(n_dev)}
        self.thresholds: dict = {}
        self.sparsities: list = []

    def add(self, fit_time, losses, examples, sent, dense, thresholds, sparsities):
        self.fit_time += fit_time
        for r, x in losses.items():
            self.losses[r].append(x)
        for r, t in zip(sorted(losses), thresholds):
            self.thresholds[r] = t  # a replica's threshold at its last step, as a worker reports it
        self.examples += examples
        self.bytes_sent += sent
        self.dense_bytes += dense
        self.sparsities += sparsities

    def finish(self, round_no, epoch, trained, round_time):
        flat = [x for r in sorted(self.losses) for x in self.losses[r]]
        workers = [r for r in range(self.n_dev) if self.losses[r]]
        return RoundStats.build(
            round=round_no, epoch=epoch, minibatches=len(flat), examples=self.examples,
            loss=(sum(flat) / len(flat)) if flat else None, workers=len(workers), round_time=round_time,
            fit_time_max=self.fit_time, worker_fit_time={r: self.fit_time for r in workers},
            worker_steps={r: len(self.losses[r]) for r in workers}, data_wait={r: 0.0 for r in workers},
            trained_total=trained, attempts=0,
            iterations=iteration_rows(trained - len(flat), epoch,
                                      {r: [(x, self.examples // len(flat)) for x in self.losses[r]] for r in workers},
                                      {r: self.fit_time for r in workers}),
            extra=SharingFigures(bytes_sent=self.bytes_sent, dense_bytes=self.dense_bytes,
                                 threshold=dict(self.thresholds),
                                 sparsity=float(np.mean(self.sparsities)) if self.sparsities else None))
