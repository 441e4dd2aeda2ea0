"""The device runtime: what :class:`~dlspark.ParallelWrapper` gives an algorithm to run on.

An algorithm's run over the devices of one process (its master's
``create_device_run``) is written against :class:`DeviceRuntime`: the network,
the devices, the exchange over them (:class:`MeshExchange`: the mean and the sum
over replicas on a one-axis mesh, ``shard_map`` and ``psum``), the minibatches,
the reporter of round statistics and the checkpoint writer. Nothing here knows
which algorithm runs; the cluster's counterpart is ``dlspark.distributed``
(peers and Dask comms).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .checkpoint import fit_checkpoint_bytes
from .data import load_ref
from .io import write_bytes

__all__ = ["AXIS", "DeviceRuntime", "MeshExchange", "FitOutcome", "first", "lead", "by_device", "replica_rngs",
           "divergence"]

#: the mesh axis the replicas are laid out on
AXIS = "replica"


def first(tree):
    """One device's view inside ``shard_map``: the leading replica axis (of length 1) dropped."""
    return jax.tree_util.tree_map(lambda x: x[0], tree)


def _pack(parts) -> tuple:
    """``parts`` as one flat vector per dtype (so that a host sum moves one array per dtype
    each way), and the layout that :func:`_unpack` reverses."""
    groups: dict = {}
    for i, p in enumerate(parts):
        groups.setdefault(jnp.result_type(p), []).append(i)
    vectors = tuple(jnp.concatenate([parts[i].reshape(-1) for i in idx]) for idx in groups.values())
    shapes = [(i, p.shape, p.size) for i, p in enumerate(parts)]
    return vectors, (list(groups.values()), shapes)


def _unpack(vectors, layout) -> list:
    groups, shapes = layout
    out: list = [None] * len(shapes)
    for vector, idx in zip(vectors, groups):
        at = 0
        for i in idx:
            _, shape, size = shapes[i]
            out[i] = vector[at:at + size].reshape(shape)
            at += size
    return out


def lead(tree):
    """The inverse of :func:`first`."""
    return jax.tree_util.tree_map(lambda x: x[None], tree)


def _sum_with_own(m, own):
    """Row ``i``: ``own[i]`` plus the rows of ``m`` but its ``i``-th, in order."""
    out = []
    for i in range(m.shape[0]):
        acc = own[i]
        for j in range(m.shape[0]):
            if j != i:
                acc = acc + m[j]
        out.append(acc)
    return jnp.stack(out)


def by_device(x) -> dict:
    """``device -> its shard`` of a sharded array."""
    return {s.device: s.data for s in x.addressable_shards}


def replica_rngs(rng, n: int, saved=None) -> list:
    """Each replica's RNG as the cluster's worker of that rank derives it: a checkpoint's
    saved stream for its position, else rank 0's own and a fold of it for the others."""
    dtype = np.asarray(rng).dtype
    out = []
    for r in range(n):
        if saved and r < len(saved):
            out.append(np.asarray(saved[r], dtype=dtype))
        else:
            out.append(np.asarray(jax.random.fold_in(rng, r)) if r else np.asarray(rng))
    return out


def divergence(trees) -> float:
    """The largest absolute difference between the first tree's leaves and any other's (leaves
    with no elements differ by nothing)."""
    leaves = [jax.tree_util.tree_leaves(t) for t in trees]
    return max((float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for other in leaves[1:] for a, b in zip(leaves[0], other) if np.size(a)), default=0.0)


def stitch_owners(own_sizes: list, params_bytes: int, n: int) -> list:
    """Which replica each of a fit's replica-own arrays (the updater state's floating-point
    leaves, in tree order; ``own_sizes``: their bytes) comes from when a fit ends with the
    replicas' mean: every replica sends its parameters (``params_bytes``) for the mean, and
    each own array goes, largest first, to the replica with the fewest bytes to send so far
    (the first on a tie). Both runtimes take the same, so that they end with the same bits;
    on a cluster each worker's link then carries about as many bytes as any other's."""
    load = [params_bytes] * n
    owners = [0] * len(own_sizes)
    for k in sorted(range(len(own_sizes)), key=lambda k: (-own_sizes[k], k)):
        r = min(range(n), key=lambda r: (load[r], r))
        owners[k] = r
        load[r] += own_sizes[k]
    return owners


def stitched_updater_state(states: list):
    """The updater state a fit ending with the replicas' mean keeps (``states``: the replicas'
    train states, in replica order): each floating-point leaf from the replica
    :func:`stitch_owners` names, every other leaf (step counts) the first replica's."""
    opts = [jax.tree_util.tree_leaves(s.opt_state) for s in states]
    own = [k for k, x in enumerate(opts[0]) if is_averaged(x)]
    params_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(states[0].params))
    owners = stitch_owners([opts[0][k].nbytes for k in own], params_bytes, len(states))
    leaves = list(opts[0])
    for k, r in zip(own, owners):
        leaves[k] = opts[r][k]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(states[0].opt_state), leaves)


def is_averaged(x) -> bool:
    """Whether a leaf takes part in a mean over replicas: floating-point leaves; integer ones
    (step counts, RNG keys) stay each replica's own."""
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def averaged_leaves(tree) -> list:
    """``tree``'s leaves that a mean takes (:func:`is_averaged`), in order."""
    return [x for x in jax.tree_util.tree_leaves(tree) if is_averaged(x)]


def with_averaged_leaves(tree, values):
    """``tree`` with the leaves a mean takes replaced by ``values``, each in its leaf's dtype."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    at = [i for i, x in enumerate(leaves) if is_averaged(x)]
    for i, x in zip(at, values, strict=True):
        leaves[i] = x.astype(leaves[i].dtype)
    return jax.tree_util.tree_unflatten(treedef, leaves)


class MeshExchange:
    """The exchange between replicas on one process's devices.

    The counterpart of the cluster's peers: the replicas meet in a sum over the
    devices between two halves of a call (:meth:`spmd_summed`; :meth:`mean_parts` and
    :meth:`mean_of` are a mean's halves), and host code sums one vector per device with
    :meth:`sum`. No staleness, sync or faults: the devices step together.
    """

    axis = AXIS

    def __init__(self, devices, fuse_collectives: bool | None = None):
        self.devices = list(devices)
        self.mesh = Mesh(np.array(self.devices), (AXIS,))
        self.stacked = NamedSharding(self.mesh, P(AXIS))
        self._sum = jax.jit(lambda m: m.sum(0), out_shardings=NamedSharding(self.mesh, P()))
        self._masks: dict = {}
        self._own_sum = jax.jit(_sum_with_own, out_shardings=self.stacked)
        #: whether :meth:`spmd_summed` compiles its sum into the call around it (see there);
        #: by default everywhere but on CPU devices
        self.fuse_collectives = (self.devices[0].platform != "cpu") if fuse_collectives is None \
            else bool(fuse_collectives)

    def __len__(self):
        return len(self.devices)

    # -- inside an SPMD call ---------------------------------------------------------
    def psum(self, x):
        return jax.lax.psum(x, AXIS)

    @staticmethod
    def mean_parts(tree, contributes=None) -> list:
        """What a mean over the replicas sums, as the cluster's ``average_leaves`` computes
        it: ``tree``'s floating leaves in at least fp32, zero where this replica does not
        contribute (``contributes``: its flag; one that had no minibatch adds nothing).
        Integer leaves stay each replica's own."""
        wide = [x.astype(jnp.promote_types(x.dtype, jnp.float32)) for x in averaged_leaves(tree)]
        if contributes is not None:
            wide = [jnp.where(contributes, x, jnp.zeros_like(x)) for x in wide]
        return wide

    @staticmethod
    def mean_of(tree, sums, n):
        """``tree`` with its floating leaves replaced by ``sums`` (of :meth:`mean_parts`) over
        ``n``: one divide (``n`` an argument: XLA would turn a division by a constant into a
        multiplication), then each leaf's dtype. With the sum in device order, the cluster's
        mean bit for bit."""
        return with_averaged_leaves(tree, [s / n.astype(s.dtype) for s in sums])

    def spmd(self, fn, replicated=(), donate=()):
        """``fn`` (one replica's view: every argument with a leading axis of length 1, except
        the positions in ``replicated``) run on every device, jitted. Its outputs are
        per replica."""

        def specs(n):
            return tuple(P() if i in replicated else P(AXIS) for i in range(n))

        cache: dict = {}

        def call(*args):
            if len(args) not in cache:
                sm = jax.shard_map(fn, mesh=self.mesh, in_specs=specs(len(args)), out_specs=P(AXIS),
                                   check_vma=False)
                cache[len(args)] = jax.jit(sm, donate_argnums=donate)
            return cache[len(args)](*args)

        return call

    def spmd_summed(self, before, after, replicated=(), donate=()):
        """``before``, a sum over the replicas, then ``after``: one replica's view of
        ``before(*args)`` returns ``(kept, parts)``, ``parts`` a tree of arrays summed over
        the replicas; ``after(kept, sums)`` (``sums`` shaped as ``parts``) returns the call's
        outputs (per replica, as :meth:`spmd`'s). ``replicated`` and ``donate`` are ``before``'s.

        With ``fuse_collectives`` the three are one SPMD call, the sum a ``psum``. Without
        it (CPU devices) ``before`` and ``after`` are two calls and the sum is taken on the
        host between them (:meth:`host_sum`), so that no device ever waits for another
        inside XLA: XLA:CPU runs every device's calls, and the loops inside them, on one
        thread pool of as many threads as cores, where an all-reduce blocks its thread
        until every device has arrived, so a device waiting in one can hold the thread
        another device's loop needs to get there (seen with two devices on two cores and
        a recurrent model: XLA aborts the process after 40 s)."""
        if self.fuse_collectives:
            def fused(*args):
                kept, parts = before(*args)
                return after(kept, self.psum(parts))

            return self.spmd(fused, replicated, donate)
        layout: dict = {}  # the parts' structure, shapes and dtypes, known once ``before`` is traced

        def pre(*args):
            kept, parts = before(*args)
            leaves, layout["tree"] = jax.tree_util.tree_flatten(parts)
            vectors, layout["parts"] = _pack(leaves)
            return lead(kept), lead(vectors)

        def post(kept, vectors):
            sums = jax.tree_util.tree_unflatten(layout["tree"], _unpack(first(vectors), layout["parts"]))
            return after(first(kept), sums)

        first_call = self.spmd(pre, replicated, donate)
        second_call = self.spmd(post)

        def call(*args):
            kept, vectors = first_call(*args)
            return second_call(kept, self.host_sum(vectors))

        return call

    # -- on the host ------------------------------------------------------------------
    def put(self, host_stacked):
        """A host tree ``[replica, ...]`` placed one slice per device."""
        return jax.device_put(host_stacked, self.stacked)

    def stack(self, parts):
        """Per-device trees (each leaf with a leading axis of 1, on its device) as one sharded tree."""
        return jax.tree_util.tree_map(
            lambda *xs: jax.make_array_from_single_device_arrays((len(xs),) + xs[0].shape[1:], self.stacked,
                                                                 list(xs)), *parts)

    def sum(self, per_device):
        """The sum of one vector per device, in XLA; returns each device's copy of it."""
        stacked = jax.make_array_from_single_device_arrays(
            (len(self.devices),) + per_device[0].shape, self.stacked, [v[None] for v in per_device])
        total = by_device(self._sum(stacked))
        return [total[d] for d in self.devices]

    def sum_with_own(self, per_device, own):
        """For each device ``i``: ``own[i]`` plus every other device's vector of ``per_device``,
        added in device order (as a worker adds its peers' messages to its own update), in XLA;
        each device's vector on that device."""
        stack = [jax.make_array_from_single_device_arrays((len(self.devices),) + v[0].shape, self.stacked,
                                                          [x[None] for x in v]) for v in (per_device, own)]
        rows = by_device(self._own_sum(*stack))
        return [rows[d][0] for d in self.devices]

    def host_sum(self, stacked: list) -> list:
        """Each stacked array's sum over the replicas, taken on the host in device order as
        the cluster's mean adds its contributions (the first two added, each next one in
        place), and placed on every device again (``[replica, ...]``)."""
        out = []
        for x in stacked:
            parts = [np.asarray(p) for p in jax.device_get([by_device(x)[d] for d in self.devices])]
            total = parts[0] + parts[1] if len(parts) > 1 else parts[0].copy()
            for p in parts[2:]:
                np.add(total, p, out=total)
            # one host array that every device's shard takes (on CPU devices it may share it)
            out.append(jax.make_array_from_single_device_arrays(
                x.shape, self.stacked, [jax.device_put(total, d) for d in self.devices]))
        return out

    def replica(self, tree, r: int = 0):
        """Replica ``r`` of a stacked tree, on the host."""
        return jax.tree_util.tree_map(lambda x: np.asarray(by_device(x)[self.devices[r]])[0], tree)

    def mask(self, contributors):
        """Which replicas contribute, one flag per device (kept: rounds reuse a few)."""
        key = tuple(contributors)
        if key not in self._masks:
            self._masks[key] = self.put(np.array([r in key for r in range(len(self.devices))]))
        return self._masks[key]


@dataclass
class FitOutcome:
    """What an algorithm's device run hands back: the state to keep (replica 0's), the
    replicas' parameters (for ``replica_divergence``), the round statistics, what the
    algorithm carries to the next fit, and ``algorithm_state`` as a cluster job's
    result carries it (its driver's ``result_state``): the master's ``after_fit`` takes
    it as it takes a cluster job's result."""

    state: object
    stats: list
    replica_params: list = field(default_factory=list)
    carried: object = None
    algorithm_state: dict = field(default_factory=dict)
    #: figures the wrapper publishes as they are (e.g. the encoder that ran)
    published: dict = field(default_factory=dict)
    #: the replicas' divergence where the run already measured it (else the wrapper does)
    divergence: float | None = None


class DeviceRuntime:
    """What a :class:`~dlspark.ParallelWrapper` fit offers an algorithm's device run.

    Attributes
    ----------
    network, master : Network, Algorithm
    exchange : MeshExchange
    devices : list of jax.Device
    algorithm_state : dict
        What the master carried from the last fit (or the resumed checkpoint).
    published : dict
        Running figures the wrapper shows as attributes.
    """

    def __init__(self, network, master, exchange: MeshExchange, algorithm_state: dict, *, loader=None,
                 storage_options=None, checkpoint_options=None, options: dict | None = None,
                 cache: dict | None = None):
        self.network, self.master, self.exchange = network, master, exchange
        self.devices = exchange.devices
        self.algorithm_state = algorithm_state
        self.loader, self.storage_options = loader, storage_options
        self.checkpoint_options = dict(checkpoint_options or {})
        #: runtime settings an algorithm may read (e.g. ``sharing_encoder``)
        self.options = dict(options or {})
        self.reporter = None
        #: kept by the wrapper from fit to fit (an algorithm's compiled functions)
        self.cache = {} if cache is None else cache

    def load(self, ref):
        """A minibatch, read and checked against the network."""
        ds = load_ref(ref, self.loader, self.storage_options)
        self.network.check_batch(ds)
        return ds

    def report(self, stat) -> None:
        """Hand a round's statistics to the progress bar and the callbacks."""
        if self.reporter is not None:
            self.reporter(stat)

    def write_checkpoint(self, url, state, *, step, epoch, progress, worker_rngs, meta=None, aux=None) -> None:
        """Write what the cluster's first worker writes: ``state`` (rank 0's), every replica's
        RNG, the algorithm's metadata and arrays."""
        write_bytes(url, fit_checkpoint_bytes(state, self.network, step=step, epoch=epoch, progress=progress,
                                              worker_rngs=worker_rngs, meta=meta, aux=aux),
                    **self.checkpoint_options)

    @staticmethod
    def clock() -> float:
        return time.perf_counter()
