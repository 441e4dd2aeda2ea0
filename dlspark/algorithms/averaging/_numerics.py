"""Averaging of train states: pure functions over flat lists of leaves.

:func:`average_leaves` is the reference, in numpy; :func:`average_on_device`
computes the same bits with one jitted call, on the device that holds the
replica's own leaves, so that the mean never goes through host memory there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["average_leaves", "average_on_device", "is_averaged", "averaged_indices", "averaged_part", "start_round", "share_bounds", "share_pieces",
           "take_share", "average_share", "assemble", "outer_step", "outer_state_from_arrays", "encode_moves",
           "mean_of_moves"]


def is_averaged(a) -> bool:
    """Floating-point leaves are averaged; integer leaves (step counts, RNG keys) are not."""
    return bool(jnp.issubdtype(a.dtype, jnp.floating)) if hasattr(a, "dtype") else is_averaged(np.asarray(a))


def averaged_indices(state, save_updater: bool) -> list:
    """Positions, among ``state``'s leaves, of those a round's mean takes: the floating-point
    leaves, less the updater's state without ``save_updater`` (each replica resets it at the
    next round's start, so its mean would be thrown away: under Adam it is two thirds of
    what a round would move)."""
    flags = jax.tree_util.tree_map(is_averaged, state)
    if not save_updater:
        flags = flags.replace(opt_state=jax.tree_util.tree_map(lambda _: False, state.opt_state))
    return [i for i, f in enumerate(jax.tree_util.tree_leaves(flags)) if f]


def averaged_part(state, save_updater: bool):
    """The part of ``state`` a round's mean takes, as a tree (see :func:`averaged_indices`)."""
    return state if save_updater else state.replace(opt_state=None)


def _mean_of(parts, dtype):
    """The mean of same-shaped arrays, as every averaging path computes it: one copy in
    at least fp32, in-place adds in the given order, one in-place divide, then ``dtype``."""
    acc = np.array(parts[0], dtype=np.promote_types(dtype, np.float32), copy=True)
    for x in parts[1:]:
        np.add(acc, x, out=acc)
    if len(parts) > 1:
        np.divide(acc, len(parts), out=acc)
    return acc.astype(dtype, copy=False)


def average_leaves(own: list, contributions: list) -> list:
    """Element-wise mean of ``contributions`` (lists of leaves, in a fixed order).

    Integer leaves keep the value of ``own``. Every caller that passes the
    contributions in the same order gets bit-identical results.
    """
    if not contributions:
        return list(own)
    n = len(contributions)
    out = []
    for i, mine in enumerate(own):
        mine = np.asarray(mine)
        if not is_averaged(mine):
            out.append(mine)
            continue
        if n == 1:
            out.append(np.asarray(contributions[0][i]))
            continue
        out.append(_mean_of([c[i] for c in contributions], mine.dtype))
    return out


@jax.jit
def _mean(columns, n):
    # ``columns[i]`` holds leaf i of every contribution, in order; the sum runs in
    # that order and at least in fp32, then one divide, as in average_leaves. ``n``
    # is an argument, not a constant: XLA would turn a division by a constant into
    # a multiplication by its reciprocal, which rounds differently.
    out = []
    for leaves in columns:
        acc = leaves[0].astype(jnp.promote_types(leaves[0].dtype, jnp.float32))
        for x in leaves[1:]:
            acc = acc + x
        out.append((acc / n.astype(acc.dtype)).astype(leaves[0].dtype))
    return out


def average_on_device(own: list, contributions: list) -> list:
    """:func:`average_leaves` as one jitted call: the result lies on the devices of ``own``.

    Contributions may mix device arrays (this replica's own, passed without a
    copy) and host arrays (its peers', moved to the device by the call). The
    function is compiled once per number of contributors and leaf shapes.
    """
    if not contributions:
        return list(own)
    averaged = [i for i, x in enumerate(own) if is_averaged(x)]
    means = iter(_mean([[c[i] for c in contributions] for i in averaged], np.float32(len(contributions))))
    keep = set(averaged)
    return [next(means) if i in keep else x for i, x in enumerate(own)]


# -- the mean in shares, for three or more contributors --------------------------
# With n contributors, fetching every contribution costs each replica (n-1) times
# the parameters a round. Instead each contributor owns one share of the floating
# point elements (their concatenation, cut in n contiguous ranges): it fetches only
# its share from the others and averages it (a reduce-scatter), and every replica
# then fetches each owner's averaged share (an all-gather): 2 (n-1) / n times the
# parameters, whatever n is. Element by element the arithmetic is average_leaves',
# so the result has its bits.


def share_bounds(sizes: list, n: int, k: int) -> tuple:
    """The flat element range ``[lo, hi)`` owned by share ``k`` of ``n``, over leaves of ``sizes``."""
    total = sum(sizes)
    return k * total // n, (k + 1) * total // n


def share_pieces(sizes: list, lo: int, hi: int) -> list:
    """The flat range ``[lo, hi)`` as ``(leaf, start, stop)`` pieces of the flattened leaves."""
    pieces, offset = [], 0
    for i, size in enumerate(sizes):
        a, b = max(lo, offset), min(hi, offset + size)
        if a < b:
            pieces.append((i, a - offset, b - offset))
        offset += size
    return pieces


def take_share(leaves: list, pieces: list) -> list:
    """The 1-D slices of ``leaves`` named by ``pieces`` (views where the leaves are host arrays)."""
    return [np.asarray(leaves[i]).reshape(-1)[a:b] for i, a, b in pieces]


def average_share(shares: list) -> list:
    """Mean of each contributor's slices (``shares[c]`` is contributor c's list), as average_leaves does it."""
    return [_mean_of(parts, parts[0].dtype) for parts in zip(*shares)]


def assemble(like: list, pieces: list, values: list) -> list:
    """Leaves shaped as ``like`` from ``values``, one per piece; the pieces cover every element
    (a leaf with no elements is covered by none)."""
    out = [np.empty(int(np.prod(np.shape(x))), dtype=x.dtype) for x in like]
    for (i, a, b), v in zip(pieces, values):
        out[i][a:b] = v
    return [x.reshape(np.shape(ref)) for x, ref in zip(out, like)]


# -- moves in bfloat16 (exchange_precision="bfloat16") --------------------------------------
@jax.jit
def _encode(host, theta, residual):
    bits, kept = [], []
    for y, t, r in zip(host, theta, residual, strict=True):
        d = y.astype(jnp.float32) - t + r
        b = d.astype(jnp.bfloat16)
        bits.append(jax.lax.bitcast_convert_type(b, jnp.uint16))
        kept.append(d - b.astype(jnp.float32))
    return bits, kept


def encode_moves(leaves: list, theta: list, residual: list) -> tuple[list, list]:
    """A replica's contribution as its moves in bfloat16, with error feedback: ``d = leaf -
    theta + residual`` for each of ``leaves`` (``theta``: the round's starting leaves, in
    float32), sent as ``bfloat16(d)``'s bits; returns ``(bits, d - bfloat16(d))``, the bits as
    host arrays, the second the residual the next round's moves carry, where the arguments
    lie (on a device, for a replica's own state). One compiled call, one pass over the
    leaves; the rounding is XLA's conversion (to nearest, ties to even)."""
    bits, kept = _encode(list(leaves), list(theta), list(residual))
    return [np.asarray(b) for b in bits], kept


@jax.jit
def _mean_of_moves(theta, columns, n):
    out = []
    for t, bits in zip(theta, columns, strict=True):
        acc = jax.lax.bitcast_convert_type(bits[0], jnp.bfloat16).astype(jnp.float32)
        for b in bits[1:]:
            acc = acc + jax.lax.bitcast_convert_type(b, jnp.bfloat16).astype(jnp.float32)
        out.append(t + acc / n)
    return out


def mean_of_moves(theta: list, moves: list) -> list:
    """``theta`` (the round's starting leaves, or the same slices of them, float32) plus the
    mean of the contributors' moves (each a list of its leaves' or slices' bfloat16 bits, in a
    fixed order): summed in that order in float32, one divide, then added, in one compiled
    call (``n`` an argument: XLA would turn a division by a constant into a multiplication by
    its reciprocal, which rounds differently). Every replica that passes the same moves in the
    same order gets the same bits, whole leaves or slices."""
    columns = [[m[i] for m in moves] for i in range(len(theta))]
    return _mean_of_moves(list(theta), columns, np.float32(len(moves)))


# -- a replica's round ----------------------------------------------------------------
def start_round(state, updater, save_updater: bool, epoch):
    """A replica's state at a round's start, on either runtime: without ``save_updater`` the
    updater starts afresh (as DL4J's workers do), and the epoch counter is the round's."""
    if not save_updater:
        state = state.replace(opt_state=updater.init(state.params))
    return state.replace(epoch=jnp.asarray(epoch, jnp.int32))


def scaled_updater(updater, factor: float):
    """``updater`` with every update it gives multiplied by ``factor``: for an optax optimizer
    whose learning rate scales its update last (Adam, SGD with momentum, ...), the same
    optimizer at ``factor`` times its rate. Its state is ``updater``'s, leaf for leaf."""
    def update(updates, state, params=None):
        updates, state = updater.update(updates, state, params)
        return jax.tree_util.tree_map(lambda u: u * factor, updates), state

    return optax.GradientTransformation(updater.init, update)


def settled_scale(master, outer: bool = False) -> float:
    """What a round's updates are multiplied by, as a number: the master's ``update_scale``, or
    with ``outer`` (a round that ends in the outer step) its ``outer_update_scale``. A fit's
    workers and devices get a master settled for their count (``for_workers``)."""
    scale = master.outer_update_scale if outer else master.update_scale
    if scale in ("workers", "sqrt"):
        raise ValueError(f"{'outer_update_scale' if outer else 'update_scale'}={scale!r} is settled when a fit "
                         "starts (master.for_workers(n)); this master was handed to a run unsettled")
    return float(scale)


def round_steps(net, update_scale: float):
    """The network's step functions with its updater's updates times ``update_scale``: the
    network's own at 1, else built once per scale and kept with the network (and shared with
    networks built alike)."""
    if update_scale == 1:
        return net.steps
    kept = net.__dict__.setdefault("_scaled_steps", {})
    if update_scale not in kept or kept[update_scale][0] is not net.updater:  # built for this updater
        from ...network import shared_steps

        kept[update_scale] = (net.updater, shared_steps(net.model, net._loss, scaled_updater(net.updater, update_scale)))
    return kept[update_scale][1]


# -- the outer optimizer (DiLoCo) --------------------------------------------------
def outer_step(tx, start, mean, state):
    """One outer step: the round-start parameters ``start`` minus the workers' ``mean`` is the
    gradient that the optax transformation ``tx`` turns into an update of ``start``.

    Returns ``(parameters, new outer state)``. Pure: every replica computes it from the same
    inputs, so the outer state never needs averaging.
    """
    grad = jax.tree_util.tree_map(lambda s, m: s - m, start, mean)
    updates, state = tx.update(grad, state, start)
    return optax.apply_updates(start, updates), state


def outer_state_from_arrays(tx, params, arrays, url="<checkpoint>"):
    """The outer state ``tx.init(params)`` shaped, filled with a checkpoint's ``arrays``."""
    from ...errors import CheckpointError

    like = tx.init(params)
    leaves, treedef = jax.tree_util.tree_flatten(like)
    if len(arrays) != len(leaves) or any(np.shape(a) != np.shape(x) for a, x in zip(arrays, leaves)):
        raise CheckpointError(url, f"holds an outer optimizer state of {len(arrays)} arrays that does not fit "
                                   f"this master's outer_updater ({len(leaves)} arrays); resume with the same one")
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(a, dtype=np.asarray(x).dtype)
                                                   for a, x in zip(arrays, leaves)])
