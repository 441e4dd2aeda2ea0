"""A network's local fit: the step loop that ``Network.fit`` runs in this process (and its
local output, ``Network.output``).

Steps are dispatched without a host sync and read back every ``_SYNC_EVERY``
steps (one transfer); consecutive minibatches of one shape may run as one
compiled call (a rolled loop over them). A window with a non-finite loss is
replayed from its first state under the network's non-finite policy. The
functions take the :class:`~dlspark.Network` as their first argument and know
nothing of clusters.
"""

from __future__ import annotations

import jax
import numpy as np

from .data import as_dataset, load_minibatch
from .data._registry import local_batches

__all__ = ["fit", "fused_steps", "step_convolves", "batch_signature", "one_shape", "local_output"]

#: local fit reads losses back (one host sync) every this many steps: each sync costs
#: about as much as ten small steps on one core (benchmarks/bench_fit_overhead.py). The
#: window's minibatches stay referenced until it is checked (to replay it from its start).
_SYNC_EVERY = 128
_END = object()
#: fit's default number of minibatches per compiled call (``steps_per_call=None``) where it
#: fuses them: a rolled loop's compile time does not grow with this count
_FUSE_STEPS = 16
#: ...and the most bytes of one minibatch it fuses: past this a step is not dispatch-bound and
#: stacking would only copy
_FUSE_MAX_BYTES = 1 << 20


def batch_signature(batch):
    """What must agree for jit batches (``(x, y, fmask, lmask)``) to stack: their structure and
    every array's shape and dtype (read from the arrays, not copied to the host)."""
    x, y, fm, lm = batch
    if type(x) is np.ndarray and type(y) is np.ndarray and fm is None and lm is None:
        return x.shape, x.dtype, y.shape, y.dtype  # the common case, without a tree walk
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    return treedef, tuple((np.shape(a), np.result_type(a)) for a in leaves)


def one_shape(batches) -> bool:
    """Whether the jit batches ``batches`` stack (:func:`batch_signature`)."""
    return len({batch_signature(b) for b in batches}) == 1


def fit(net, data, epochs=1, batch_size=32, shuffle=False, progress=False, steps_per_call=None):
    """Train ``net`` locally on ``data``; returns ``net`` (see :meth:`dlspark.Network.fit`)."""
    if not isinstance(epochs, (int, np.integer)) or epochs < 1:
        raise ValueError(f"epochs must be a positive integer, got {epochs!r}")
    if steps_per_call is not None and (not isinstance(steps_per_call, (int, np.integer))
                                       or isinstance(steps_per_call, bool) or steps_per_call < 1):
        raise ValueError(f"steps_per_call must be a positive integer or None (chosen per network), "
                         f"got {steps_per_call!r}")
    batches, are_urls = local_batches(data, batch_size, epochs)
    if hasattr(batches, "__len__") and len(batches) == 0:
        raise ValueError("the data holds no examples: fit needs at least one minibatch, got an empty dataset")
    if shuffle and not hasattr(batches, "__len__"):
        raise ValueError("shuffle=True needs minibatches it can reorder (a DataSet, a list, URLs); an iterator's "
                         "are taken in the order they come: shuffle them before, or pass shuffle=False")
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=epochs * len(batches) if hasattr(batches, "__len__") else None, unit="batch")
    # (minibatches, their losses on the device: one, or one per minibatch of a fused call)
    # of the steps since the last check
    window: list = []
    in_window = 0
    start, first = _window_start(net), int(net.state.step)  # a copy of the window's first state
    fuse = steps_per_call
    pending: list = []  # consecutive minibatches of one shape, not yet run

    def run(group):
        nonlocal in_window, first, start
        # No host sync per step: steps queue up on the device while Python prepares
        # the next ones, and are checked and read back every _SYNC_EVERY steps.
        if len(group) == 1:
            out = net.steps.bare_step(net.state, group[0])
        else:
            stacked = jax.tree_util.tree_map(lambda *a: np.stack(a), *group)
            out = net.steps.loop_steps(net.state, stacked)
        net.state = out.state
        window.append((group, out.loss))
        in_window += len(group)
        if in_window >= _SYNC_EVERY:
            first, start = _settle(net, window, start, first, bar, epochs=0)
            in_window = 0

    def run_pending():
        for b in pending:
            run([b])
        pending.clear()

    try:
        for _ in range(epochs):
            order = list(batches) if hasattr(batches, "__len__") else batches
            if shuffle and hasattr(batches, "__len__"):
                perm = np.random.default_rng([net.seed, net.epoch]).permutation(len(order))
                order = [order[i] for i in perm]
            kind = None  # the shape of the minibatches in pending
            minibatches = iter(order)
            while True:
                try:
                    mb = next(minibatches, _END)
                    if mb is _END:
                        break
                    batch = _device_batch(net, load_minibatch(mb) if are_urls else mb)
                except Exception:
                    # a minibatch that cannot be read or fed: the ones before it are trained,
                    # checked and recorded, as with one call per minibatch
                    run_pending()
                    if window:
                        _settle(net, window, start, first, bar, epochs=0)
                    raise
                if fuse is None:
                    fuse = fused_steps(net, batch)
                if fuse == 1:
                    run([batch])
                    continue
                sig = batch_signature(batch)
                if sig != kind:
                    run_pending()
                    kind = sig
                pending.append(batch)
                if len(pending) == fuse:
                    run(list(pending))
                    pending.clear()
            run_pending()
            if window:
                first, start = _settle(net, window, start, first, bar, epochs=1)
                in_window = 0
            else:  # each its own array: the state's are donated to the next step
                net.state = net.state.replace(epoch=net.state.epoch + 1)
                start = start.replace(epoch=start.epoch + 1)
        net._start = (net.state, start)
    finally:
        if bar is not None:
            bar.close()
    return net


def fused_steps(net, batch) -> int:
    """``fit``'s default steps per call for minibatches like ``batch`` (see ``fit``)."""
    leaves = jax.tree_util.tree_leaves(batch)
    if sum(a.nbytes if hasattr(a, "nbytes") else np.asarray(a).nbytes for a in leaves) > _FUSE_MAX_BYTES:
        return 1
    return 1 if step_convolves(net, batch) else _FUSE_STEPS


def step_convolves(net, batch, state=None) -> bool:
    """Whether the step on minibatches like ``batch`` has a convolution: XLA's CPU backend
    runs those many times slower in a rolled loop. Found once per network, from the trace
    of the step (on ``state``, by default the network's own; only its shapes count)."""
    convolves = net.__dict__.get("_convolves")
    if convolves is None:
        # the step's trace is cached for its first call
        jaxpr = net.steps.bare_step.trace(net.state if state is None else state, batch).jaxpr
        convolves = net._convolves = "conv_general_dilated" in str(jaxpr)
    return convolves


def _window_start(net):
    """A copy of the state, to replay a window from: the one the last fit left when the
    state is still the one it ended with."""
    kept = net.__dict__.pop("_start", None)
    if kept is not None and kept[0] is net.state:
        return kept[1]
    return net.steps.copy_state(net.state)


def _device_batch(net, ds):
    batch = as_dataset(ds).jit_batch()
    net._check_jit_batch(batch)
    # numpy arrays straight into the jitted step: its C++ path moves them to the device
    # for a fraction of what a jnp.asarray per array costs in Python
    return batch


def _settle(net, window, start, first, bar, epochs):
    """Check and read back the bare steps of ``window`` (one transfer) and record their losses.

    When a loss, or the parameters at the window's end, are not finite, the window is
    replayed from ``start`` (the state before it; the steps are deterministic) under
    the non-finite policy: "raise" redoes the steps before the first bad one and
    raises, leaving the parameters from before it; "skip" redoes the window with
    ``train_step``, which leaves the state unchanged by a bad step. Adds ``epochs``
    to the epoch counter and empties ``window``; returns the iteration of the next
    step and the next window's start.
    """
    batches = [b for group, _ in window for b in group]
    n = len(batches)
    singles = [loss for group, loss in window if len(group) == 1]
    fused = [loss for group, loss in window if len(group) > 1]  # one array per fused call
    # the single calls' losses always _SYNC_EVERY of them (the last repeated), so that one
    # program serves every window, whatever its mix of single and fused calls
    pad = singles[-1:] or [fused[-1][-1]]
    net.state, following, ok, stacked = net.steps.window_end(
        net.state, singles + pad * (_SYNC_EVERY - len(singles)), epochs)
    stacked, ok, fused = jax.device_get((stacked, ok, fused))
    one, many = iter(stacked[:len(singles)]), iter(fused)
    losses = np.concatenate([np.reshape(next(many), -1) if len(group) > 1 else np.reshape(next(one), 1)
                             for group, _ in window])
    window.clear()
    oks = np.isfinite(losses)
    if not (ok and oks.all()):
        net.state = net.steps.copy_state(start)  # train_step donates what it is given
        replayed = []
        for batch in batches:
            out = net.steps.train_step(net.state, batch)
            net.state = out.state
            replayed.append((out.loss, out.finite))
        losses, oks = (np.asarray(v) for v in zip(*jax.device_get(replayed)))
        if net.on_nonfinite == "raise":
            bad = int(np.argmin(oks))
            net.state = start
            for batch in batches[:bad]:
                net.state = net.steps.bare_step(net.state, batch).state
            _record(net, range(first, first + bad), losses[:bad], bar)
            net.nonfinite(first + bad, float(losses[bad]))
        net.state = net.state.replace(epoch=net.state.epoch + epochs)
        following = net.steps.copy_state(net.state)
    _record(net, [first + i for i in range(n) if oks[i]], losses[oks], bar)
    if bar is not None:
        bar.update(n)
    return first + n, following


def _record(net, iterations, losses, bar):
    net.score_history.extend((i, float(x)) for i, x in zip(iterations, losses))
    if bar is not None and len(losses):
        bar.set_postfix(loss=f"{float(losses[-1]):.4g}", refresh=False)


def local_output(net, features, batch_size=None, features_mask=None):
    """:meth:`Network.output <dlspark.Network.output>` in this process: ``net``'s forward pass
    in inference mode, in calls of ``batch_size`` examples; numpy outputs."""
    x = jax.tree_util.tree_map(np.asarray, features)
    n = jax.tree_util.tree_leaves(x)[0].shape[0]
    if batch_size is not None and (isinstance(batch_size, (bool, np.bool_))
                                   or not isinstance(batch_size, (int, np.integer)) or batch_size < 1):
        raise ValueError(f"batch_size must be a positive integer or None (all examples at once), "
                         f"got {batch_size!r}")
    step = int(batch_size) if batch_size else max(n, 1)
    key = jax.tree_util.tree_structure((x, features_mask)), tuple(
        (np.shape(a)[1:], np.asarray(a).dtype) for a in jax.tree_util.tree_leaves((x, features_mask)))
    if key not in net._output_checked:  # once per shape: a clear error, not the model's own
        net._output_shapes(x, features_mask)
        net._output_checked.add(key)
    parts = []
    for i in range(0, max(n, 1), step):  # no examples: one call on the empty arrays
        xs = jax.tree_util.tree_map(lambda a: a[i:i + step], x)
        ms = None if features_mask is None else jax.tree_util.tree_map(lambda a: a[i:i + step], features_mask)
        parts.append(jax.tree_util.tree_map(np.asarray, net.steps.output(net.state, xs, ms)))
    if len(parts) == 1:
        return parts[0]
    return jax.tree_util.tree_map(lambda *a: np.concatenate(a, 0), *parts)
