"""Gradient sharing over the devices of one process: :class:`~dlspark.ParallelWrapper`'s runner
for :class:`~dlspark.GradientSharing`.

Every device holds a replica with its own updater state, residual and threshold.
The replicas step in lockstep: at step ``j`` device ``i`` fits minibatch ``j * n +
i`` of the epoch, turns its update into the residual's part that crossed its
threshold (the workers' encoding: elements with ``|r| >= t`` move as ``±t``, the
rest stays), and every replica applies the sum of all devices' quantized updates,
so that the parameters stay equal. The thresholds move by the master's threshold
algorithm and the residuals by its post-processor, exactly as on a worker.

Two encoders, the same bits: ``"host"`` runs the workers' own encoder on the host
(faster on XLA's CPU backend, where the devices are the host's cores), ``"xla"``
encodes on each device and sums over the devices in XLA (for accelerators; a
property test holds it to the host encoder's results).
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .algorithms.sharing._encoding import EMPTY, decode_into, encode_scratch, threshold_encode
from .algorithms.sharing._state import SumVectors, add_pieces, sharing_functions
from .algorithms.sharing._thresholds import ResidualClipping, threshold_meta
from .algorithms.sharing._xla import encode_on_device_jit, message_bytes, sparsity_of
from .checkpoint import fit_checkpoint_bytes
from .data import load_ref
from .io import write_bytes

__all__ = ["run_sharing", "ENCODERS"]

ENCODERS = ("auto", "host", "xla")


def resolve_encoder(encoder: str, devices) -> str:
    if encoder not in ENCODERS:
        raise ValueError(f"sharing_encoder must be one of {ENCODERS}, got {encoder!r}")
    if encoder == "auto":
        return "host" if devices[0].platform == "cpu" else "xla"
    return encoder


def _prepare(algo, state, residual):
    """The threshold that encodes ``residual``, for algorithms that set it from the residual."""
    prepare = getattr(algo, "prepare", None)
    return state if prepare is None else prepare(state, residual)


class _Lazy:
    """A device vector that the threshold algorithm's ``prepare`` reads only if it needs it."""

    def __init__(self, x):
        self.x = x

    def __array__(self, dtype=None, copy=None):
        a = np.asarray(self.x)
        return a if dtype is None else a.astype(dtype)


def _loader(refs, order, loader, options, devices, depth, check):
    """Yield each step's minibatches, ``[(examples, batch on its device) or None] * devices``,
    loaded ahead on a thread (``depth`` steps)."""
    n = len(devices)
    steps = [order[j:j + n] for j in range(0, len(order), n)]
    q: queue.Queue = queue.Queue(maxsize=max(depth, 1))
    stop = threading.Event()

    def produce():
        try:
            for group in steps:
                out = []
                for i, dev in enumerate(devices):
                    if i < len(group):
                        ds = load_ref(refs[group[i]], loader, options)
                        check(ds)
                        out.append((len(ds), jax.device_put(ds.jit_batch(), dev)))
                    else:
                        out.append(None)
                while not stop.is_set():
                    try:
                        q.put(out, timeout=0.05)
                        break
                    except queue.Full:
                        pass
            q.put(None)
        except BaseException as e:  # raised where the fit waits for the step
            q.put(e)

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


class _Replicas:
    """The devices' replicas and their sharing state."""

    def __init__(self, wrapper, encoder, saved_rngs=None):
        net, master = wrapper.network, wrapper.master
        self.wrapper, self.net, self.master = wrapper, net, master
        self.devices = wrapper.devices
        self.encoder = encoder
        self.algo, self.post = master.threshold_algorithm, master.residual_post_processor
        self.n = int(ravel_pytree(net.state.params)[0].size)
        fns = sharing_functions(net)
        self.apply_flat, self.add_flat = fns.apply_flat, fns.add_flat
        # the host encoder adds the update's pieces to its residual; the XLA one takes it flat
        self.update = fns.update if encoder == "host" else fns.flat_update
        # each replica's RNG as the cluster's worker of that rank has it: a checkpoint's saved
        # stream for its position, else a fold of rank 0's
        rngs = [net.state.rng] + [jax.random.fold_in(net.state.rng, r) for r in range(1, len(self.devices))]
        dtype = np.asarray(net.state.rng).dtype
        rngs = [np.asarray(saved_rngs[r], dtype) if saved_rngs and r < len(saved_rngs) else rng
                for r, rng in enumerate(rngs)]
        # copies (the steps donate them): the network keeps its state until the fit succeeds
        self.states = [jax.device_put(net.state.replace(rng=rng), d, may_alias=False)
                       for rng, d in zip(rngs, self.devices)]
        start = wrapper.master.carried_threshold(wrapper.algorithm_state) or self.algo.init()
        self.tstates = [start] * len(self.devices)
        self.steps = [0] * len(self.devices)  # each replica's message counter
        if encoder == "host":
            self.residuals = [np.zeros(self.n, np.float32) for _ in self.devices]
            self.scratch = [encode_scratch(self.n) for _ in self.devices]
            self.pool = ThreadPoolExecutor(len(self.devices), thread_name_prefix="dlspark-encode")
            # The decoded sum of a step, as on a worker (every CPU device reads it in place:
            # device_put of an aligned host vector aliases it). Reuse of its vectors is safe: a
            # vector is written again two steps later, when every replica has finished reading
            # it. A replica that trained in the step between read back that step's update, which
            # waits for the apply before it; an idle replica's add is waited for in its own step.
            self.totals = SumVectors(self.n)
        else:
            self.residuals = [jax.device_put(jnp.zeros(self.n, jnp.float32), d) for d in self.devices]
            self.zeros = [jax.device_put(jnp.zeros(self.n, jnp.float32), d) for d in self.devices]
            from .parallel import AXIS

            mesh = wrapper.mesh
            self.stacked = NamedSharding(mesh, P(AXIS))
            self.sum = jax.jit(lambda m: m.sum(0), out_shardings=NamedSharding(mesh, P()))
            self.clip = jax.jit(lambda r, lim: jnp.clip(r, -lim, lim))

    def close(self):
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=False)

    # -- one step on every device ---------------------------------------------------
    def step(self, batches, on_bad):
        """Fit one minibatch per device (``None``: that device has none this step); returns
        ``(losses, examples, bytes sent, thresholds, sparsities)`` of the devices that trained."""
        outs = [None if b is None else self.update(self.states[i], self.states[i].opt_state, b[1])
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
            if o is None:  # the sum of the others' messages still reaches this replica
                self.states[i] = self.add_flat(self.states[i], totals[i])
                idle.append(self.states[i])
            else:
                self.states[i] = self.apply_flat(self.states[i].replace(opt_state=o[1], model_state=o[2], rng=o[3]),
                                                 totals[i])
        losses = [float(x) for x in jax.device_get([outs[i][4] for i in active])]
        if idle and self.encoder == "host":  # nothing else waits for these reads of the reused vector
            jax.block_until_ready(idle)
        return losses, sum(batches[i][0] for i in active), sent, ts, sparsities

    def _advance(self, i, t, count):
        """After replica ``i`` encoded at threshold ``t``: its message counter and threshold."""
        self.steps[i] += 1
        sparsity = sparsity_of(count, self.n)
        self.tstates[i] = self.algo.update(self.tstates[i], sparsity)
        return sparsity

    def _encode_one(self, i, update):
        """Replica ``i``'s message of this step (host encoder): its update added to its
        residual, what crossed its threshold taken out. Replicas encode on threads of
        their own (the scan and numpy's loops release the GIL), each with its own scratch."""
        r = self.residuals[i]
        add_pieces(r, update)
        self.tstates[i] = _prepare(self.algo, self.tstates[i], r)
        t = self.tstates[i].threshold
        enc = threshold_encode(r, t, out=r, scratch=self.scratch[i], min_count=2)
        self.residuals[i] = self.post.update(r, t, self.steps[i] + 1)
        return enc, t, self._advance(i, t, enc.count)

    def _encode_host(self, outs, active):
        if len(active) > 1:
            done = list(self.pool.map(lambda i: self._encode_one(i, outs[i][0]), active))
        else:
            done = [self._encode_one(i, outs[i][0]) for i in active]
        total = self.totals.take()
        sent, ts, sparsities = 0, [], []
        for enc, t, sparsity in done:  # summed in replica order: the same bits as one thread
            if enc.message[0] != EMPTY:
                decode_into(enc.message, total)
            sent += int(enc.message.nbytes) * (len(self.devices) - 1)
            ts.append(float(t))
            sparsities.append(sparsity)
        return [jax.device_put(total, d) for d in self.devices], sent, ts, sparsities

    def _encode_xla(self, outs, active):
        moved, counts, ts = list(self.zeros), {}, {}
        for i in active:
            r = self.residuals[i] + outs[i][0]
            self.tstates[i] = _prepare(self.algo, self.tstates[i], _Lazy(r))
            t = ts[i] = self.tstates[i].threshold
            moved[i], self.residuals[i], counts[i] = encode_on_device_jit(r, np.float32(t), min_count=2)
        stacked = jax.make_array_from_single_device_arrays(
            (len(self.devices), self.n), self.stacked, [m[None] for m in moved])
        total = self.sum(stacked)  # over the devices, in XLA
        by_device = {s.device: s.data for s in total.addressable_shards}
        counts = dict(zip(counts, (int(c) for c in jax.device_get(list(counts.values())))))
        sent, sparsities = 0, []
        for i in active:
            t, step = ts[i], self.steps[i] + 1
            sent += message_bytes(counts[i], self.n) * (len(self.devices) - 1)
            if isinstance(self.post, ResidualClipping):
                if step % self.post.frequency == 0:
                    self.residuals[i] = self.clip(self.residuals[i], np.float32(self.post.threshold_multiple * t))
            else:
                host = np.array(self.residuals[i])
                self.residuals[i] = jax.device_put(self.post.update(host, t, step), self.devices[i])
            sparsities.append(self._advance(i, t, counts[i]))
        return [by_device[d] for d in self.devices], sent, list(ts.values()), sparsities

    def write_checkpoint(self, url, step, epoch, progress, storage_options=None):
        """What the cluster's first worker writes: replica 0's state, every replica's RNG and
        the thresholds reached. Residuals are not kept (the cluster's checkpoints do not keep
        them either, nor do DL4J's): a resumed fit starts with empty residuals, so its first
        steps may send nothing until they fill to the threshold reached, and every replica
        starts from replica 0's updater state."""
        rngs = [np.asarray(s.rng).tolist() for s in self.states]
        meta = {"threshold_states": threshold_meta(self.algo, self.tstates)}
        write_bytes(url, fit_checkpoint_bytes(jax.device_get(self.states[0]), self.net, step=step, epoch=epoch,
                                              progress=progress, worker_rngs=rngs, meta=meta),
                    **(storage_options or {}))


def run_sharing(wrapper, refs, epochs, loader, storage_options, callbacks, bar, encoder, *, resumed=None,
                checkpoint_every=None, checkpoint_url=None, checkpoint_options=None):
    """Fit ``refs`` for ``epochs`` with gradient sharing over ``wrapper``'s devices; returns the
    rounds' statistics (``steps_per_round`` steps per device make a round).

    ``resumed``: ``(minibatches done in the first epoch, saved RNGs, epochs done before,
    epochs of the whole fit)`` from a checkpoint (the network already holds its state).
    Every ``checkpoint_every`` rounds a checkpoint goes to ``checkpoint_url``; an epoch's
    last round counts as one, short or not."""
    net, master = wrapper.network, wrapper.master
    skip, saved_rngs, epochs_done, epochs_total = resumed or ((), None, 0, epochs)
    home = next(iter(jax.tree_util.tree_leaves(net.state)[0].devices()))
    reps = _Replicas(wrapper, encoder, saved_rngs)
    try:
        base_step, base_epoch = net.iteration, net.epoch
        n_dev = len(reps.devices)
        stats, trained = [], 0
        depth = max(1, master.worker_prefetch_num_batches)

        def on_bad(i, loss):
            net.nonfinite(base_step + trained, loss)

        round_no = 0
        for epoch in range(epochs):
            reps.states = [s.replace(epoch=jax.device_put(np.int32(base_epoch + epoch), d))
                           for s, d in zip(reps.states, reps.devices)]
            done = set(skip) if epoch == 0 else set()
            order = [i for i in range(len(refs)) if i not in done]
            steps = _loader(refs, order, loader, storage_options, reps.devices, depth, net.check_batch)
            row = _new_row()
            t_round = time.perf_counter()

            def end_round():
                nonlocal round_no
                round_no += 1
                stats.append(_finish_row(row, round_no, epoch, trained, t_round, n_dev, bar, callbacks))
                if checkpoint_every and round_no % checkpoint_every == 0:
                    over = len(done) == len(refs)  # the epoch's last round: the checkpoint is at the next's start
                    progress = {"epoch": epochs_done + epoch + over, "done": [] if over else sorted(done),
                                "epochs_total": epochs_total, "minibatches": len(refs)}
                    reps.write_checkpoint(checkpoint_url, base_step + trained, base_epoch + epoch + over, progress,
                                         checkpoint_options)

            for j, batches in enumerate(steps):
                t0 = time.perf_counter()
                losses, examples, sent, ts, sp = reps.step(batches, on_bad)
                row["fit_time"] += time.perf_counter() - t0
                row["losses"] += losses
                row["examples"] += examples
                row["minibatches"] += len(losses)
                row["bytes_sent"] += sent
                row["dense_bytes"] += 4 * reps.n * (n_dev - 1) * len(losses)
                row["thresholds"] += ts
                row["sparsities"] += sp
                trained += len(losses)
                done.update(order[j * n_dev:(j + 1) * n_dev])  # a skipped non-finite minibatch counts as done
                if (j + 1) % master.steps_per_round == 0 or len(done) == len(refs):
                    end_round()
                    row, t_round = _new_row(), time.perf_counter()
        net.state = jax.device_put(reps.states[0].replace(step=np.int32(base_step + trained),
                                                          epoch=np.int32(base_epoch + epochs)), home)
        wrapper.algorithm_state = master.carry_threshold(wrapper.algorithm_state,
                                                         master.threshold_algorithm.reduce(reps.tstates))
        comm = wrapper.published.setdefault("communication", {"bytes_sent": 0, "dense_bytes": 0})
        comm["bytes_sent"] += sum(s["bytes_sent"] for s in stats)
        comm["dense_bytes"] += sum(s["dense_bytes"] for s in stats)
        params = [jax.tree_util.tree_leaves(s.params) for s in reps.states]
        wrapper.published["replica_divergence"] = max(
            (float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for other in params[1:] for a, b in zip(params[0], other)),
            default=0.0)
        wrapper.published["sharing_encoder"] = encoder
    finally:
        reps.close()
    return stats


def _new_row():
    return {"fit_time": 0.0, "losses": [], "examples": 0, "minibatches": 0, "bytes_sent": 0, "dense_bytes": 0,
            "thresholds": [], "sparsities": []}


def _finish_row(row, round_no, epoch, trained, t_round, n_dev, bar, callbacks):
    losses = row["losses"]
    stat = {"event": "round", "round": round_no, "epoch": epoch, "minibatches": row["minibatches"],
            "examples": row["examples"], "loss": (sum(losses) / len(losses)) if losses else None,
            "workers": n_dev, "round_time": time.perf_counter() - t_round, "fit_time_max": row["fit_time"],
            "trained_total": trained, "bytes_sent": row["bytes_sent"], "dense_bytes": row["dense_bytes"],
            "threshold": float(np.mean(row["thresholds"])) if row["thresholds"] else None,
            "sparsity": float(np.mean(row["sparsities"])) if row["sparsities"] else None}
    if bar is not None:
        bar.update(stat["minibatches"])
        if stat["loss"] is not None:
            bar.set_postfix(loss=f"{stat['loss']:.4g}", refresh=False)
    for cb in callbacks:
        cb(stat)
    return stat
