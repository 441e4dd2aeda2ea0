"""The checks a network runs on its input once per shape: labels that fit the outputs and the
loss, features the model takes, masks that broadcast, class ids in range (the last on every
minibatch). Each raises an error naming what it found and what the network expects."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import losses as _losses

__all__ = ["check_jit_batch", "output_shapes"]


def _as_tuple(x):
    """``x`` as a tuple: one per output or label array."""
    return tuple(x) if isinstance(x, (list, tuple)) else (x,)


def _per_output(loss, n):
    """One loss per output: ``loss`` repeated, or its own sequence checked against ``n``."""
    if not isinstance(loss, _losses.Loss):
        if len(loss) != n:
            raise ValueError(f"got {len(loss)} losses for {n} outputs; give one loss, or one per output")
        return loss
    return (loss,) * n


def _check_class_ids(labels, ids) -> None:
    """Raise ``ValueError`` naming the class ids of ``labels`` outside ``[0, classes)``."""
    labs = _as_tuple(labels)
    for i, n in ids:
        lab = np.asarray(labs[i])
        if lab.size and (lab.min() < 0 or lab.max() >= n):
            bad = np.unique(lab[(lab < 0) | (lab >= n)])
            where = f"labels[{i}]" if len(labs) > 1 else "the labels"
            raise ValueError(f"{where} hold class ids {bad[:10].tolist()}{' ...' if bad.size > 10 else ''} outside "
                             f"[0, {n}): the model has {n} outputs, so class ids run from 0 to {n - 1} "
                             "(ids counted from 1 need 1 subtracted)")


def check_jit_batch(net, batch) -> None:
    x, y, fm, lm = batch
    if y is None or (isinstance(y, tuple) and (not y or any(a is None for a in y))):
        raise ValueError("the data set has no labels: training, scoring and evaluation need them "
                         "(for outputs alone, use output or predict_with_keys)")
    if type(x) is np.ndarray and type(y) is np.ndarray and fm is None and lm is None:
        key = (x.shape[1:], x.dtype, y.shape[1:], y.dtype)  # the common case, without a tree walk
    else:
        leaves, treedef = jax.tree_util.tree_flatten(batch)
        key = (treedef, tuple((a.shape[1:], a.dtype) if hasattr(a, "dtype")
                              else (np.shape(a)[1:], np.asarray(a).dtype) for a in leaves))
    ids = net._checked_shapes.get(key)
    if ids is not None:
        if ids:
            _check_class_ids(y, ids)
        return
    out = output_shapes(net, x, fm)
    outs, labs = _as_tuple(out), _as_tuple(y)
    if len(outs) != len(labs):
        raise ValueError(f"the model gives {len(outs)} outputs but the data has {len(labs)} labels arrays")
    for fn, o, lab in zip(_per_output(net._loss, len(labs)), outs, labs):
        _losses.check_labels(fn, o.shape, lab.shape, lab.dtype)
        if not np.issubdtype(lab.dtype, np.number) and lab.dtype != np.bool_:
            raise TypeError(f"labels must be numeric, got dtype {lab.dtype}")
    lms = _as_tuple(lm)
    for lmask, o in zip(lms * (len(outs) if len(lms) == 1 else 1), outs):
        if lmask is not None:
            _losses._broadcast_mask(jnp.zeros(lmask.shape), o.shape[:-1])
    # integer class ids (one axis fewer than the outputs): their values are checked on every
    # minibatch (out of range, they index past the outputs, which gives a NaN loss or, below 0,
    # silently the last class)
    ids = [(i, o.shape[-1]) for i, (o, lab) in enumerate(zip(outs, labs))
           if len(lab.shape) == len(o.shape) - 1 and np.issubdtype(lab.dtype, np.integer)]
    if ids:
        _check_class_ids(y, ids)
    net._checked_shapes[key] = ids


def output_shapes(net, x, fm):
    """The model's outputs for features ``x`` as shapes, or a ``ValueError`` naming the
    features' shape and the model's example input when it cannot take them."""
    try:
        return jax.eval_shape(lambda s, xx, m: net.model.apply_eval(s.params, s.model_state, xx, m),
                              net.state, x, fm)
    except Exception as e:
        raise ValueError(
            f"the model cannot take features of shape {jax.tree_util.tree_map(np.shape, x)} "
            f"(example input: {jax.tree_util.tree_map(np.shape, net.model.example_input)}): {e}"
        ) from None
