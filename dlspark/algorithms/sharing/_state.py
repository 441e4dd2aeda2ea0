"""Worker side of gradient sharing: residual, threshold, inbox of peer messages.

The numerics are :mod:`._encoding` and :mod:`._thresholds`; this module keeps
the per-worker bookkeeping (which message from which peer was applied) and
runs the step loop on the job's compute thread.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from ... import config
from ._dgc import find_momentum, local_clip_norm, mask_momentum, sent_elements, threshold_for_density
from ._dgc import warmup_density
from ._encoding import (EMPTY, MIN_MESSAGE_ELEMENTS, add_and_find, compiled_scan, decode_into,
                        empty_message, encode_scratch, threshold_encode)
from ._thresholds import ThresholdState
from ._xla import sparsity_of

__all__ = ["SharingState", "Encoded", "encode_step", "add_and_encode", "add_dropped", "post_acts", "SumVectors",
           "add_pieces", "sharing_functions", "ReplicaOptions", "replica_options"]

def _aligned_zeros(n):
    """A zeroed fp32 vector whose data starts on a 64-byte boundary: XLA's CPU client
    then takes it as a device array without a copy (``jax.dlpack.from_dlpack``)."""
    buf = np.zeros(n + 16, np.float32)
    start = (-buf.ctypes.data % 64) // 4
    return buf[start:start + n]


class SumVectors:
    """Where a step's decoded sum is added up: two reused aligned vectors of ``n`` float32,
    handed out in turn, zeroed. A CPU device reads the one it is given in place, with no
    4n-byte allocation, page faults and copy per step. The caller sees to it that every
    read of a vector is done before that vector comes round again, two takes later."""

    def __init__(self, n: int):
        self.vectors = (_aligned_zeros(n), _aligned_zeros(n))
        self.taken = 0

    def take(self, zeroed: bool = True) -> np.ndarray:
        """The next vector, zeroed (or as it is, for a caller that writes all of it)."""
        vector = self.vectors[self.taken % 2]
        self.taken += 1
        if zeroed:
            vector.fill(0)
        return vector


class SharingFunctions(NamedTuple):
    """A network's jitted sharing steps (see :func:`_sharing_functions`)."""

    update: Callable
    flat_update: Callable
    apply_flat: Callable
    add_flat: Callable
    mask_momentum: Callable


def _sharing_functions(steps, params, donate_updater) -> SharingFunctions:
    """The sharing steps of a network whose parameters are shaped as ``params``, jitted.

    ``update(state, opt_state, batch)`` is the step's update as pieces of one flat
    vector, ``[ravel(leaf) for leaf in the update's leaves]`` (what ``ravel_pytree``
    would concatenate), with the updater, model state and RNG that follow it and
    whether the loss and the update are finite; the host adds the pieces to its
    residual in place (:func:`add_pieces`). XLA is not asked to concatenate them: on
    the CPU backend its concatenation (and the finiteness check that read the
    concatenated vector) cost 1 to 2 ms of a 15 ms step in a pinned process, and up to
    45 ms each when two devices of one process ran them at once.
    ``flat_update`` is the same with the pieces concatenated on the device (the XLA
    encoder's input). ``apply_flat(state, flat)`` adds a decoded sum to the parameters
    of a state that already holds those and counts the step; ``add_flat`` only adds.
    With ``donate_updater`` the update writes the new updater state over the old one's
    buffers (with Adam, two fresh parameter-sized buffers a step cost 0.6 to 0.9 ms of
    a 17 ms step on the benchmarks' MLP): for networks that stop at a non-finite step,
    which keep nothing of it. Networks that skip such a step go on from the updater
    state before it, which must then stay.
    """
    unravel = ravel_pytree(params)[1]

    def update(state, opt_state, batch, clip=None):
        u = steps.compute_update(state.replace(opt_state=opt_state), batch, clip)
        leaves = jax.tree_util.tree_leaves(u.updates)
        dtype = jnp.result_type(*leaves)  # what ravel_pytree(updates) would give: the updates' own
        pieces = [jnp.ravel(u).astype(dtype) for u in leaves]
        finite = jnp.isfinite(u.loss)
        for piece in pieces:  # checked here, fused with the update, rather than in a host pass
            finite = finite & jnp.all(jnp.isfinite(piece))
        return pieces, u.opt_state, u.model_state, u.rng, u.loss, finite

    def flat_update(state, opt_state, batch, clip=None):
        pieces, *rest = update(state, opt_state, batch, clip)
        return (jnp.concatenate(pieces), *rest)

    def apply_flat(state, flat):
        return steps.apply_update(state, unravel(flat), state.opt_state, state.model_state, state.rng)

    def add_flat(state, flat):
        return state.replace(params=optax.apply_updates(state.params, unravel(flat)))

    def masked(opt_state, sent, fields):
        return mask_momentum(opt_state, sent, params, fields)

    donate = (1,) if donate_updater else ()
    return SharingFunctions(jax.jit(update, donate_argnums=donate), jax.jit(flat_update, donate_argnums=donate),
                            jax.jit(apply_flat, donate_argnums=(0,)), jax.jit(add_flat, donate_argnums=(0,)),
                            jax.jit(masked, static_argnums=(2,)))


def add_pieces(out: np.ndarray, pieces) -> np.ndarray:
    """``out += concatenate(pieces)``, piece by piece into slices of ``out`` (the same bits:
    each element is one addition either way). ``pieces`` are device vectors; on a CPU
    device they are read in place."""
    start = 0
    on_cpu = all(d.platform == "cpu" for p in pieces[:1] if isinstance(p, jax.Array) for d in p.devices())
    for piece in (pieces if on_cpu else jax.device_get(pieces)):  # on a CPU device, views: no copy
        piece = np.asarray(piece)
        out[start:start + piece.size] += piece
        start += piece.size
    if start != out.size:
        raise ValueError(f"the update's pieces hold {start} elements, the residual {out.size}")
    return out


def sharing_functions(net) -> SharingFunctions:
    """The network's jitted sharing steps (:func:`_sharing_functions`), built once per network
    and policy: kept with the network, so that later fits do not compile them again."""
    cache = net.__dict__.setdefault("_sharing_fns", {})
    donate = net.on_nonfinite == "raise"
    if donate not in cache:
        cache[donate] = _sharing_functions(net.steps, net.state.params, donate)
    return cache[donate]


@dataclass(frozen=True)
class Encoded:
    """One replica's step after :func:`encode_step`."""

    message: np.ndarray
    threshold: float
    count: int  # elements moved
    sparsity: float  # what the threshold algorithm was told
    tstate: object  # the threshold state after the step
    dropped: np.ndarray | None = None  # the post-processor's change to the residual (when asked and it acted)


def post_acts(post, iteration: int) -> bool:
    """Whether residual post-processor ``post`` may change the residual at ``iteration``."""
    acts = getattr(post, "acts_at", None)
    return True if acts is None else bool(acts(iteration))


def add_dropped(total, enc: Encoded):
    """``total`` (a replica's sum of a step) with what its post-processor took out of its residual
    taken out too (``own_update="whole"``: its own update went into its parameters whole)."""
    if enc.dropped is not None:
        np.add(total, enc.dropped, out=total)
    return total


def add_and_encode(algo, post, tstate, residual: np.ndarray, pieces, scratch, iteration: int, density=None,
                   keep_dropped=False, copy: np.ndarray | None = None) -> tuple:
    """A replica's step on the host: its update (``pieces``, see :func:`add_pieces`) added to its
    ``residual``, then :func:`encode_step`; with ``copy``, the update also written there as
    ``0 + update``. Where the threshold is known before the residual is (the threshold
    algorithm's optional ``known_threshold``; no sparsity warm-up) and the compiled pass is
    loaded, the addition, the copy and the search for what crosses the threshold are one pass
    over each vector (:func:`~._encoding.add_and_find`) instead of three or four; the same
    bits either way. Returns ``(Encoded, residual)``."""
    known = getattr(algo, "known_threshold", None)
    t = known(tstate) if known is not None and density is None else None
    if t is not None and t > 0 and np.isfinite(t) and compiled_scan() is not None:
        hits = add_and_find(residual, pieces, t, scratch, copy)
        return encode_step(algo, post, tstate, residual, scratch, iteration, density, keep_dropped, hits=(hits, t))
    add_pieces(residual, pieces)
    if copy is not None:
        copy.fill(0)
        add_pieces(copy, pieces)
    return encode_step(algo, post, tstate, residual, scratch, iteration, density, keep_dropped)


def encode_step(algo, post, tstate, residual: np.ndarray, scratch, iteration: int, density=None,
                keep_dropped=False, hits=None) -> tuple:
    """A replica's encode of one step, on either runtime, after its update was added to its
    ``residual``: the threshold (``prepare``), the message of what crossed it (taken out of
    the residual, in place; fewer than 2 elements send an EMPTY note), the post-processor
    (``iteration``: the replica's message number, from 1), then the threshold's update with
    the sparsity sent (:func:`~._xla.sparsity_of`: a bitmap counts as 1/16, an empty
    message as 0). Returns ``(Encoded, residual)``.

    ``density`` (a sparsity warm-up's fraction for this epoch, see
    :func:`~._dgc.warmup_density`): the threshold is the one that sends that fraction of
    the residual instead, and the threshold algorithm's state is left as it was, so that
    it starts (with its own warm-up) when the sparsity warm-up ends.

    ``keep_dropped``: the post-processor's change to the residual (after minus before) comes
    back as ``Encoded.dropped`` where it may have acted (:func:`post_acts`), else None.

    ``hits``: ``(indices, threshold)``, the indices crossing the algorithm's
    ``known_threshold``, found as the update was added (:func:`add_and_encode`); ``prepare``
    must give that threshold."""
    if density is None:
        tstate = algo.prepare(tstate, residual)
        t = tstate.threshold
    else:
        t = threshold_for_density(residual, density)
    if hits is not None:
        hits, known = hits
        if np.float32(known) != np.float32(t):
            raise RuntimeError(f"{algo!r}: known_threshold gave {known!r} but prepare gave {t!r}; known_threshold "
                               "must be the threshold prepare gives whatever the residual, or None")
    enc = threshold_encode(residual, t, out=residual, scratch=scratch, min_count=MIN_MESSAGE_ELEMENTS, hits=hits)
    before = residual.copy() if keep_dropped and post_acts(post, iteration) else None
    residual = post.update(residual, t, iteration)
    dropped = None if before is None else np.subtract(residual, before, out=before)
    sparsity = sparsity_of(enc.count, residual.size)
    after = tstate if density is not None else algo.update(tstate, sparsity)
    return Encoded(enc.message, float(t), enc.count, sparsity, after, dropped), residual


class ReplicaOptions(NamedTuple):
    """A master's per-step options (:func:`replica_options`) as a replica's step loop reads them."""

    clip: object  # the jitted update's clip argument: None, or the bound as float32
    mask_fields: tuple  # momentum fields to clear where sent; () for none
    warmup: tuple  # the sparsity warm-up's fractions by epoch


def replica_options(master, replicas: int, opt_state, params) -> ReplicaOptions:
    """What ``master``'s momentum masking, local clipping and sparsity warm-up mean for a fit
    of ``replicas`` replicas; an updater without momentum under ``momentum_masking`` is refused."""
    fields = ()
    if master.momentum_masking:
        fields = tuple(master.momentum_fields)
        if not find_momentum(opt_state, params, fields):
            raise ValueError(f"momentum_masking=True clears the updater's momentum (its state's fields named "
                             f"{fields}, shaped as the parameters), but the network's updater keeps none: use an "
                             f"updater with momentum (optax.adam, optax.sgd(lr, momentum=0.9)), name its "
                             f"fields in momentum_fields, or leave momentum_masking=False")
    clip = None if master.local_gradient_clipping is None else local_clip_norm(master.local_gradient_clipping,
                                                                               replicas)
    if isinstance(master.sparsity_warmup, str):  # a fit's master is settled (for_workers) before any replica starts
        raise RuntimeError('sparsity_warmup="auto" reached a replica unsettled: settle the master with '
                           "for_workers(n) for the fit's workers first")
    return ReplicaOptions(clip, fields, tuple(master.sparsity_warmup))



def _by_sender(keys) -> dict:
    """Message keys ``(sender, step)`` as ``{sender: [steps, ascending]}``."""
    out: dict = {}
    for sender, step in keys:
        out.setdefault(sender, []).append(step)
    return {s: sorted(v) for s, v in out.items()}


class SharingState:
    """Per-job gradient-sharing state of one worker."""

    def __init__(self, job):
        self.job = job
        master = job.master
        self.algo = master.threshold_algorithm
        self.post = master.residual_post_processor
        self.debug = master.encoding_debug
        self.own_whole = master.own_update == "whole"
        flat = ravel_pytree(job.state.params)[0]
        self.n = int(flat.size)
        self.residual = np.zeros(self.n, np.float32)
        self.scratch = encode_scratch(self.n)
        compiled_scan()  # loaded now, not in the first step's message
        # The decoded sum of a step. Reuse of its vectors is safe: a vector is written again
        # only after the next step's update was read back, which waits for the apply that read it.
        self.totals = SumVectors(self.n)
        # where from_dlpack puts a host vector: the first CPU device (asking for the CPU
        # backend by name would fail where JAX was started on accelerators only)
        device = next(iter(flat.devices()))
        self.in_place = len(flat.devices()) == 1 and device.platform == "cpu" and device.id == 0
        # The steps take the state committed to this device, every round: a vector from
        # from_dlpack is committed, and a state that is committed in one round but not in
        # another (after a restore, an epoch counter set from Python) compiles them again.
        self.device = device if len(flat.devices()) == 1 else None
        self.tstate = master.carried_threshold(job.spec.algorithm_state) or self.algo.init()
        self.step = 0  # this worker's message counter
        self.iteration_base = 0  # messages of the fits this replica goes on from (continue_replicas)
        self.lock = threading.Condition()
        self.inbox: dict = {}  # (sender, step) -> message, this round
        self.applied: set = set()  # (sender, step) applied to this replica, since the last sync
        self.synced: dict = {}  # sender -> every step up to this one was applied by every replica
        self.progress: dict = {}  # sender -> highest step seen
        self.gone: set = set()  # peers not waited for until the next order: lost, or late past the stale timeout
        self.lost: set = set()  # peers the coordinator said were lost (PeerLost), until a round names them again
        self.store: dict = {}  # (sender, step) -> message: everything seen this round, to serve peers that missed one
        self.reported = None  # the store's keys when this round's holdings were last reported (have)
        self.links = None  # tree mesh: this round's neighbours
        self.relayed = 0  # messages sent on to tree neighbours, since the job started
        self.direct = 0  # peers' messages taken on the job's own connections since the job started (SharingRun)
        fns = sharing_functions(job.net)
        self.update, self.apply_flat, self.add_flat = fns.update, fns.apply_flat, fns.add_flat

    def for_joiner(self, state):
        """The train state a worker joining mid-fit starts from, given this replica's ``state``:
        under the whole own update its parameters less its residual (what every replica holds
        in common; the joiner starts with no residual, and this replica's residual reaches it in
        this replica's later messages, so it is not counted twice); under the encoded one the
        parameters as they are (every replica holds the same)."""
        if not self.own_whole:
            return state
        flat, unravel = ravel_pytree(state.params)
        return state.replace(params=unravel(flat - jnp.asarray(self.residual, flat.dtype)))

    # -- inbox (event loop thread) -----------------------------------------------
    def receive(self, sender, step, message) -> bool:
        """Keep a peer's message; True if it was not seen before this round."""
        with self.lock:
            if step <= self.synced.get(sender, 0):
                return False  # a late copy of a message every replica applied in an earlier round
            new = (sender, step) not in self.store and (sender, step) not in self.applied
            self.store.setdefault((sender, step), message)
            if (sender, step) not in self.applied:
                self.inbox.setdefault((sender, step), message)
            self.progress[sender] = max(self.progress.get(sender, 0), step)
            self.lock.notify_all()
        return new

    def have(self):
        """The round's messages this worker holds, as ``{sender: [steps]}``; the sync that follows
        applies these and the ones it fetches, no others (see :meth:`apply_pending`)."""
        with self.lock:
            self.reported = set(self.store)
            return _by_sender(self.reported)

    def get(self, keys):
        with self.lock:
            return [self.store[tuple(k)] for k in keys]

    def _drain_into(self, total, only=None, upto=None):
        """Apply every message in the inbox not yet applied (of those in ``only``, if given; with
        ``upto``, ``{sender: step}``, only a sender's messages up to that step); returns how many."""
        with self.lock:
            items = [(k, m) for k, m in self.inbox.items() if k not in self.applied and (only is None or k in only)
                     and (upto is None or k[1] <= upto.get(k[0], 0))]
            for k, _ in items:
                self.applied.add(k)
        for _, m in items:
            if m[0] != EMPTY:
                decode_into(m, total)
        return len(items)

    def _wait_until_caught_up(self, behind) -> float:
        """Block until ``behind()`` (called under the lock) lists no live peer, or until the
        stale timeout, after which the peers still listed count as gone (the round's sync sorts
        out what they sent); returns the seconds waited."""
        began = time.monotonic()
        deadline = began + config.get_seconds("sharing.stale-timeout")
        with self.lock:
            while True:
                late = [p for p in behind() if p not in self.gone]
                if not late:
                    return time.monotonic() - began
                left = deadline - time.monotonic()
                if left <= 0:
                    self.gone.update(late)
                    return time.monotonic() - began
                self.lock.wait(min(left, 0.05))

    def _wait_for_peers(self, peers, done, max_staleness):
        """Block while some live peer is more than ``max_staleness`` of this round's steps behind.

        ``peers`` maps each peer to ``(its step counter at round start, its
        minibatches this round)``; a peer that finished its share holds no one back.
        """

        def lagging(p):
            start, quota = peers[p]
            theirs = self.progress.get(p, start) - start
            return theirs < quota and theirs < done - max_staleness

        return self._wait_until_caught_up(lambda: [p for p in peers if lagging(p)])

    def _wait_for_step(self, peers, done):
        """Synchronous delivery (``max_staleness=0``): block until every live peer's message of
        this round's step ``done`` (0-based; -1, before the first, waits for none) is here, or
        the peer's share ended before it; returns the seconds waited and ``{peer: its last step
        to apply now}``."""
        upto = {p: start + min(done + 1, quota) for p, (start, quota) in peers.items()}

        def missing(p):
            return upto[p] > peers[p][0] and (p, upto[p]) not in self.store and (p, upto[p]) not in self.applied

        return self._wait_until_caught_up(lambda: [p for p in peers if missing(p)]), upto

    # -- the step loop (compute thread) ------------------------------------------
    def forget(self, synced: dict, live=None):
        """Forget the messages every replica applied in the rounds before this one (``synced``:
        each sender's last such message, as the coordinator counted them), so that the
        bookkeeping stays the size of one round however long the job runs. Called as the next
        order comes, so a peer's message of the new round that came first is kept. With
        ``live`` (a new round's workers), a sender's not among them go too: a late push from
        a worker lost before the round, which no replica reported and none applies (a worker
        back at its address numbers its messages after ``synced``, as the late push is)."""
        with self.lock:
            for sender, step in synced.items():
                self.synced[sender] = max(self.synced.get(sender, 0), int(step))

            def later(key):
                return key[1] > self.synced.get(key[0], 0) and (live is None or key[0] in live)

            self.applied = {k for k in self.applied if later(k)}
            self.inbox = {k: v for k, v in self.inbox.items() if later(k)}
            self.store = {k: v for k, v in self.store.items() if later(k)}
            self.reported = None
            if live is not None:  # a worker back at a lost one's address is waited for again
                self.lost -= live
            self.gone = set(self.lost)

    def peer_lost(self, peer, cut_off=()):
        """The coordinator says ``peer`` was lost (any thread): a step or a round's end waiting
        for its messages stops waiting at once, as it would at the stale timeout (what it sent
        and what it did not are the round's sync's, as then); so it does for the live peers
        in ``cut_off``, whose messages came only through the lost one (a tree mesh's relay),
        for the rest of the round."""
        with self.lock:
            self.lost.add(peer)
            self.gone.add(peer)
            self.gone.update(cut_off)
            self.lock.notify_all()

    def finish_round(self, peers) -> dict:
        """This replica's end of a round (``peers`` as :meth:`fit` takes them): wait, as a step
        does and up to the stale timeout, for every live peer's messages of the round; apply
        those it holds and has not applied (a peer's steps after this replica's last); return
        what it holds, ``{sender: [steps]}``, every one of them applied. Where every replica
        holds every contributor's messages, the round needs no sync."""

        def short(p):
            start, quota = peers[p]
            return any((p, k) not in self.store for k in range(start + 1, start + quota + 1))

        self._wait_until_caught_up(lambda: [p for p in peers if short(p)])
        with self.lock:
            keys = set(self.store)
        self._apply_held(keys)
        return _by_sender(keys)

    def _publish(self, message, send):
        """Ship this worker's message of its current step (already applied here), and keep it
        for peers that miss it."""
        key = (self.job.address, self.step)
        with self.lock:
            self.applied.add(key)
            self.store[key] = message
        send(self.step, message)

    def fit(self, batches, peers, send):
        """Run the steps of one round over ``batches`` (``(examples, device batch)`` pairs);
        ``send(step, message)`` ships a message to the peers."""
        job = self.job
        losses, stats, nbytes, examples, sparsities, steps = [], [], 0, 0, [], []
        stale_wait = 0.0
        state = job.state if self.device is None else jax.device_put(job.state, self.device)
        rec = job.stats
        opts = replica_options(job.master, len(peers) + 1, state.opt_state, state.params)
        density = warmup_density(opts.warmup, int(state.epoch))  # a round is within one epoch
        sync = job.master.max_staleness == 0
        lag = job.master.delivery_lag  # synchronous delivery: the peers' messages of the step this many before
        for done, (n_examples, batch) in enumerate(batches):
            stale_wait += self._wait_for_peers(peers, done, job.master.max_staleness + lag)
            rec.mark("wait_peers")
            pieces, opt, ms, rng, loss, finite = self.update(state, state.opt_state, batch, opts.clip)
            finite = bool(finite)
            rec.mark("fit", examples=n_examples)
            if not finite:
                # The network's policy, as in local and averaged training: stop with the
                # parameters from before this step (the updater state given to the step
                # was written over: the job ends), or skip the minibatch.
                job.state = state.replace(opt_state=opt)
                job.net.nonfinite(int(state.step), float(loss))
                steps.append((loss, n_examples))
                state = state.replace(rng=rng)  # as in train_step: no replay of the same dropout mask
                # a skipped step still counts: an EMPTY note, so that peers do not wait for it
                self.step += 1
                message = empty_message(self.n, float(self.tstate.threshold))
                self._publish(message, send)
                nbytes += message.nbytes * len(peers)
                continue
            state = state.replace(opt_state=opt, model_state=ms, rng=rng)
            if self.own_whole and not self.in_place:  # read twice: fetched from the device once
                pieces = jax.device_get(pieces)
            self.step += 1
            # The decoded sum of the step: under the whole own update, the update itself
            # (written as it is added to the residual), its peers' messages added below
            total = self.totals.take(zeroed=not self.own_whole)
            enc, self.residual = add_and_encode(self.algo, self.post, self.tstate, self.residual, pieces, self.scratch,
                                                self.iteration_base + self.step, density, keep_dropped=self.own_whole,
                                                copy=total if self.own_whole else None)
            t, message = enc.threshold, enc.message
            if opts.mask_fields:
                state = state.replace(opt_state=self.mask_momentum(state.opt_state, sent_elements(message, self.n),
                                                                   opts.mask_fields))
            if rec.on:
                rec.mark("encode", step=self.step, threshold=float(t), sparsity=enc.count / self.n,
                         bytes=int(message.nbytes))
            if self.own_whole:  # its own update whole (the residual keeps what its peers lack)
                add_dropped(total, enc)
            elif message[0] != EMPTY:
                decode_into(message, total)
            self._publish(message, send)
            rec.mark("send")
            nbytes += message.nbytes * len(peers)
            upto = None
            if sync:  # every peer's message of this step (or of the one before), and none of a later one
                waited, upto = self._wait_for_step(peers, done - lag)
                stale_wait += waited
                rec.mark("wait_peers")
            self._drain_into(total, upto=upto)
            rec.mark("decode")
            state = self.apply_flat(state, jax.dlpack.from_dlpack(total) if self.in_place else jnp.asarray(total))
            if rec.on:  # the apply's own time: wait for it (only while recording)
                jax.block_until_ready(state)
                rec.mark("apply")
            fmt = int(message[0])
            self.tstate = enc.tstate
            sparsities.append(enc.sparsity)
            rec.mark("threshold")
            if self.debug:
                stats.append({"step": self.step, "threshold": float(t), "sparsity": enc.count / self.n,
                              "format": ["empty", "sparse", "bitmap"][fmt], "bytes": int(message.nbytes),
                              "residual_norm": float(np.linalg.norm(self.residual)),
                              "update_to_threshold": float(sum(np.abs(np.asarray(p)).sum(dtype=np.float64)
                                                               for p in pieces) / self.n / t)})
            losses.append(loss)
            steps.append((loss, n_examples))
            examples += n_examples
        job.state = state
        losses = [float(x) for x in losses]
        return {"loss_sum": float(sum(losses)), "n": len(losses), "examples": examples, "last_step": self.step,
                "steps": tuple((float(x), n) for x, n in steps),
                "bytes_sent": nbytes, "dense_bytes": 4 * self.n * len(peers) * len(losses),
                "threshold": float(self.tstate.threshold), "stale_wait": stale_wait, "debug": stats,
                "sparsity": float(np.mean(sparsities)) if sparsities else None}

    def replica_extra(self) -> dict:
        """What this replica takes into the next fit if that fit starts from the state this one
        ended with (``GradientSharing.continue_replicas``): its residual, threshold state and
        count of messages. Its updater state goes with the train state it keeps."""
        return {"residual": self.residual.copy(), "tstate": tuple(self.tstate),
                "iteration": self.iteration_base + self.step}

    def continue_from(self, extra: dict) -> None:
        """Go on from :meth:`replica_extra` of the fit before (a residual of another size is
        refused: the network is not the one that fit trained)."""
        residual = np.asarray(extra["residual"], np.float32)
        if residual.shape != (self.n,):
            raise ValueError(f"a residual of {residual.shape} cannot go on in a network of {self.n} parameters")
        self.residual = residual.copy()
        self.tstate = ThresholdState(*extra["tstate"])
        self.iteration_base = int(extra["iteration"])

    def apply_pending(self, extra=()):
        """Apply fetched and still pending messages (the round's sync); params only. Only the
        messages this replica reported holding, and those fetched, are applied: a message that
        came after the report (a late push from a sender lost before the sync) is known to no
        other replica, which would not apply it, so neither does this one."""
        for key, m in extra:
            self.receive(key[0], key[1], m)
        self._apply_held(None if self.reported is None else self.reported | {tuple(k) for k, _ in extra})

    def _apply_held(self, only):
        """Add the held messages not yet applied (those in ``only``, if given) to the parameters."""
        total = np.zeros(self.n, np.float32)
        if self._drain_into(total, only):
            self.job.state = self.add_flat(self.job.state, jnp.asarray(total))
