"""What Deep Gradient Compression (Lin et al., arXiv 1712.01887) adds to threshold sharing (pure).

- momentum-factor masking: the updater's momentum of the elements a replica just
  sent is cleared (:func:`find_momentum`, :func:`mask_momentum`), so that a stale
  momentum does not push them again on the steps that follow;
- local gradient clipping: each replica clips its gradient by global norm before
  its updater (``optax.clip_by_global_norm`` inside the network's
  ``compute_update``), to ``clip / sqrt(replicas)`` (:func:`local_clip_norm`);
- a warm-up of the sparsity: in the first epochs the threshold is the one that
  sends a given fraction of the residual (:func:`warmup_density`,
  :func:`threshold_for_density`).

Both runtimes (a worker's :class:`~._state.SharingState` and the device run's
replicas) call these; none of them knows of Dask or of devices.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ._encoding import EMPTY, decode_into, threshold_sending

__all__ = ["MOMENTUM_FIELDS", "DGC_SPARSITY_WARMUP", "find_momentum", "mask_momentum", "sent_elements",
           "local_clip_norm", "warmup_density", "threshold_for_density"]

#: the fields of optax's states that hold a first moment shaped as the parameters:
#: ``ScaleByAdamState.mu`` (adam, adamw, nadam, lion's ``mu``) and ``TraceState.trace``
#: (sgd with momentum, nesterov)
MOMENTUM_FIELDS = ("mu", "trace")

#: DGC's warm-up: the fraction of elements sent in epochs 0 to 3 (sparsity 75%, 93.75%,
#: 98.4375%, 99.6%), each a quarter of the one before
DGC_SPARSITY_WARMUP = (0.25, 0.0625, 0.015625, 0.00390625)


def _fields(node):
    return getattr(type(node), "_fields", None) if isinstance(node, tuple) else None


def find_momentum(opt_state, params, fields=MOMENTUM_FIELDS) -> list:
    """The paths (``jax.tree_util`` key paths, as strings) of the momentum buffers in an optax state.

    A momentum buffer is a field of a NamedTuple state named in ``fields`` whose value has
    the parameters' tree structure (with ``optax.chain``, ``inject_hyperparams``, masked
    and multi-transform states searched through). Adam's second moment (``nu``) is not a
    momentum and is never cleared.

    Parameters
    ----------
    opt_state : pytree
        The updater's state (``optax.GradientTransformation.init(params)``).
    params : pytree
        The parameters it was made for.
    fields : tuple of str
        Field names that hold a momentum.

    Returns
    -------
    list of str
        One path per momentum buffer found; empty if the updater keeps none.

    Examples
    --------
    >>> import optax, jax.numpy as jnp
    >>> p = {"w": jnp.zeros(3)}
    >>> find_momentum(optax.adam(1e-3).init(p), p)
    ['[0].mu']
    """
    target = jax.tree_util.tree_structure(params)
    found: list = []

    def visit(node, path):
        names = _fields(node)
        if names is not None:
            for name, value in zip(names, node):
                if name in fields and jax.tree_util.tree_structure(value) == target:
                    found.append(f"{path}.{name}")
                else:
                    visit(value, f"{path}.{name}")
        elif isinstance(node, (tuple, list)):
            for i, value in enumerate(node):
                visit(value, f"{path}[{i}]")
        elif isinstance(node, dict):
            for key, value in node.items():
                visit(value, f"{path}[{key!r}]")

    visit(opt_state, "")
    return found


def _split(flat, params):
    """A flat vector of the parameters' size as a tree shaped as ``params`` (its own dtype)."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    out, start = [], 0
    for leaf in leaves:
        size = int(np.prod(jnp.shape(leaf)))
        out.append(jnp.reshape(flat[start:start + size], jnp.shape(leaf)))
        start += size
    return jax.tree_util.tree_unflatten(treedef, out)


def mask_momentum(opt_state, sent, params, fields=MOMENTUM_FIELDS):
    """``opt_state`` with every momentum buffer (:func:`find_momentum`) set to zero where ``sent``.

    Parameters
    ----------
    opt_state : pytree
        The updater's state after the step.
    sent : array of bool
        One flag per parameter element, in ``ravel_pytree(params)`` order: the
        elements the replica's message just carried.
    params : pytree
        The parameters (their structure and shapes).
    fields : tuple of str
        Field names that hold a momentum.

    Returns
    -------
    pytree
        The state, of the same structure, with those momentum entries cleared.
    """
    target = jax.tree_util.tree_structure(params)
    mask = _split(jnp.asarray(sent), params)

    def clear(value):
        return jax.tree_util.tree_map(lambda m, s: jnp.where(s, jnp.zeros_like(m), m), value, mask)

    def visit(node):
        names = _fields(node)
        if names is not None:
            return type(node)(*(clear(v) if n in fields and jax.tree_util.tree_structure(v) == target else visit(v)
                                for n, v in zip(names, node)))
        if isinstance(node, (tuple, list)):
            return type(node)(visit(v) for v in node)
        if isinstance(node, dict):
            return {k: visit(v) for k, v in node.items()}
        return node

    return visit(opt_state)


def sent_elements(message: np.ndarray, n: int) -> np.ndarray:
    """Which of the ``n`` elements a message carries, as a bool vector (none for an EMPTY note)."""
    moved = np.zeros(n, np.float32)
    if int(message[0]) != EMPTY:
        decode_into(message, moved)
    return moved != 0


def local_clip_norm(clip: float, replicas: int) -> np.float32:
    """The global norm a replica clips its gradient to: ``clip / sqrt(replicas)``, as DGC
    does, so that the sum of the replicas' clipped gradients is bounded as one process's
    clipped gradient would be (if they are independent)."""
    return np.float32(clip / math.sqrt(max(1, replicas)))


def warmup_density(schedule, epoch: int):
    """The fraction of elements to send at (the network's) ``epoch`` under a warm-up
    ``schedule`` (one fraction per epoch from epoch 0), or None once it is over."""
    epoch = int(epoch)
    return float(schedule[epoch]) if 0 <= epoch < len(schedule) else None


def threshold_for_density(residual, density: float) -> np.float32:
    """The threshold that sends ``ceil(density * n)`` elements of ``residual``, and at least a
    message's minimum (:func:`~._encoding.threshold_sending`): the magnitude of its k-th
    largest element (ties send more). Positive: an all-zero residual gives the smallest normal
    float32, which sends nothing."""
    t = threshold_sending(residual, math.ceil(density * np.size(residual)))
    return np.float32(max(t, float(np.finfo(np.float32).tiny)))
