r"""Loss functions by name, as DL4J's ``LossFunctions`` names them.

Every loss here is *per element*: ``fn(outputs, labels) -> losses`` where
``losses`` has the shape of ``outputs`` without its last (feature) axis, so a
``[batch, classes]`` output gives one loss per example and a
``[batch, time, classes]`` output one per time step.  :func:`reduce_loss`
averages them under a label mask.

Classification losses take the network's raw outputs (logits) and apply the
output activation themselves, as DL4J pairs an output layer's activation with
its loss: softmax for ``softmax_cross_entropy``/``negative_log_likelihood``/
``kl_divergence``, sigmoid for ``binary_cross_entropy``.

==========================  ==========================  =================================
name (aliases)              outputs                     labels
==========================  ==========================  =================================
softmax_cross_entropy       logits ``[..., C]``          one-hot ``[..., C]`` or integer
(mcxent)                                                 class ids ``[...]``
negative_log_likelihood     logits ``[..., C]``          as softmax_cross_entropy (DL4J
(nll)                                                    defines them as equal)
binary_cross_entropy        logits ``[..., K]``          0/1 (or probabilities) ``[..., K]``
(xent)                                                   summed over K
mse / mean_squared_error    values ``[..., K]``          ``[..., K]``, mean over K
l2                          values ``[..., K]``          ``[..., K]``, sum over K
mae / l1_mean               values ``[..., K]``          ``[..., K]``, mean of \|d\| over K
l1                          values ``[..., K]``          ``[..., K]``, sum of \|d\| over K
hinge / squared_hinge       scores ``[..., K]``          -1/+1 (0/1 is mapped to -1/+1)
cosine_proximity            vectors ``[..., K]``         ``[..., K]``; loss is -cos
kl_divergence               logits ``[..., C]``          probabilities ``[..., C]``
==========================  ==========================  =================================
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["LOSSES", "get_loss", "reduce_loss", "Loss", "output_probabilities"]


def _check_same(name, out_shape, lab_shape, lab_dtype):
    if tuple(out_shape) != tuple(lab_shape):
        raise ValueError(
            f"loss {name!r} needs labels of the outputs' shape {tuple(out_shape)}, "
            f"got labels of shape {tuple(lab_shape)}"
        )


def _check_onehot_or_int(name, out_shape, lab_shape, lab_dtype):
    if tuple(out_shape) == tuple(lab_shape):
        return
    if tuple(out_shape[:-1]) == tuple(lab_shape) and jnp.issubdtype(lab_dtype, jnp.integer):
        return
    raise ValueError(
        f"loss {name!r} needs one-hot labels of the outputs' shape {tuple(out_shape)} or "
        f"integer class ids of shape {tuple(out_shape[:-1])}, got labels of shape "
        f"{tuple(lab_shape)} and dtype {np.dtype(lab_dtype).name}"
    )


def _softmax_xent(outputs, labels):
    if labels.ndim == outputs.ndim - 1:
        return optax.softmax_cross_entropy_with_integer_labels(outputs, labels)
    return optax.softmax_cross_entropy(outputs, labels.astype(outputs.dtype))


def _binary_xent(outputs, labels):
    return optax.sigmoid_binary_cross_entropy(outputs, labels.astype(outputs.dtype)).sum(-1)


def _mse(outputs, labels):
    return optax.squared_error(outputs, labels.astype(outputs.dtype)).mean(-1)


def _l2(outputs, labels):
    return optax.squared_error(outputs, labels.astype(outputs.dtype)).sum(-1)


def _mae(outputs, labels):
    return jnp.abs(outputs - labels.astype(outputs.dtype)).mean(-1)


def _l1(outputs, labels):
    return jnp.abs(outputs - labels.astype(outputs.dtype)).sum(-1)


def _signed(labels, dtype):
    labels = labels.astype(dtype)
    # DL4J's hinge takes -1/+1; 0/1 labels are the common alternative, so map 0 to -1.
    return jnp.where(labels == 0, -1.0, labels).astype(dtype)


def _hinge(outputs, labels):
    return optax.hinge_loss(outputs, _signed(labels, outputs.dtype)).sum(-1)


def _squared_hinge(outputs, labels):
    return jnp.square(optax.hinge_loss(outputs, _signed(labels, outputs.dtype))).sum(-1)


def _cosine(outputs, labels):
    return -optax.cosine_similarity(outputs, labels.astype(outputs.dtype), epsilon=1e-8)


def _kl(outputs, labels):
    return optax.kl_divergence(jax.nn.log_softmax(outputs, axis=-1), labels.astype(outputs.dtype))


def _softmax(outputs):
    from scipy.special import softmax

    return softmax(outputs, axis=-1)


def _sigmoid(outputs):
    from scipy.special import expit

    return expit(outputs)


class Loss(NamedTuple):
    """A named per-element loss with its label-shape check and output activation.

    ``activation`` maps the network's raw outputs (numpy, float64) to what the
    loss compares with the labels (softmax or sigmoid probabilities for the
    classification losses; ``None`` where the outputs are used as they are).
    Evaluations receive the outputs through it, as DL4J's evaluations receive
    an output layer's activations.
    """

    name: str
    fn: Callable
    check: Callable | None
    activation: Callable | None = None


_SPECS = {
    "softmax_cross_entropy": (_softmax_xent, _check_onehot_or_int),
    "negative_log_likelihood": (_softmax_xent, _check_onehot_or_int),
    "binary_cross_entropy": (_binary_xent, _check_same),
    "mse": (_mse, _check_same),
    "l2": (_l2, _check_same),
    "mae": (_mae, _check_same),
    "l1": (_l1, _check_same),
    "hinge": (_hinge, _check_same),
    "squared_hinge": (_squared_hinge, _check_same),
    "cosine_proximity": (_cosine, _check_same),
    "kl_divergence": (_kl, _check_same),
}
#: the output activation each classification loss applies to the logits it is given
_ACTIVATIONS = {
    "softmax_cross_entropy": _softmax,
    "negative_log_likelihood": _softmax,
    "kl_divergence": _softmax,
    "binary_cross_entropy": _sigmoid,
}
_ALIASES = {
    "mcxent": "softmax_cross_entropy",
    "nll": "negative_log_likelihood",
    "xent": "binary_cross_entropy",
    "mean_squared_error": "mse",
    "squared_loss": "mse",
    "l1_mean": "mae",
    "mean_absolute_error": "mae",
    "kld": "kl_divergence",
}

#: Names accepted by :func:`get_loss` (canonical names and DL4J-style aliases).
LOSSES = tuple(sorted(set(_SPECS) | set(_ALIASES)))


def get_loss(loss) -> Loss:
    """Resolve ``loss`` (a name, a :class:`Loss`, or a callable) to a :class:`Loss`.

    A callable must have the signature ``fn(outputs, labels) -> per-element losses``
    (shape ``outputs.shape[:-1]``); dlspark applies label masks and averaging.

    Examples
    --------
    >>> get_loss("MCXENT").name
    'softmax_cross_entropy'
    """
    if isinstance(loss, Loss):
        return loss
    if isinstance(loss, str):
        key = loss.strip().lower().replace("-", "_")
        key = _ALIASES.get(key, key)
        if key not in _SPECS:
            raise ValueError(f"unknown loss {loss!r}; known losses: {', '.join(LOSSES)}")
        fn, check = _SPECS[key]
        return Loss(key, fn, check, _ACTIVATIONS.get(key))
    if callable(loss):
        return Loss(getattr(loss, "__name__", "custom"), loss, None)
    raise TypeError(f"loss must be a name (one of {', '.join(LOSSES)}) or a callable, got {type(loss).__name__}")


def output_probabilities(loss, outputs):
    """``outputs`` (raw network outputs) through ``loss``'s output activation, as float64 numpy.

    Softmax for ``softmax_cross_entropy``, ``negative_log_likelihood`` and
    ``kl_divergence``, sigmoid for ``binary_cross_entropy``; other losses (and
    callables) leave the outputs as they are.

    Examples
    --------
    >>> import numpy as np
    >>> output_probabilities(get_loss("xent"), np.zeros((1, 2))).tolist()
    [[0.5, 0.5]]
    """
    outputs = np.asarray(outputs, dtype=np.float64)
    activation = get_loss(loss).activation
    return outputs if activation is None else activation(outputs)


def reduce_loss(per_element, mask=None):
    """Mean of ``per_element`` losses over the entries where ``mask`` is nonzero, weighted by it.

    ``mask`` has shape ``per_element.shape[:mask.ndim]`` (per example ``[batch]``
    or per time step ``[batch, time]``); a trailing axis of size 1 is accepted.
    Its values weigh the entries: a 0/1 mask counts the entries it keeps, other
    non-negative values are per-example (sample) weights, ``sum(w * l) / sum(w)``;
    an entry of weight 0 adds nothing, not even a non-finite loss.
    Returns ``(mean, weight)`` where ``weight`` is the total weight (for a 0/1 mask,
    the number of counted entries).
    """
    per_element = jnp.asarray(per_element)
    if mask is None:
        return per_element.mean(), jnp.asarray(per_element.size, per_element.dtype)
    mask = _broadcast_mask(mask, per_element.shape).astype(per_element.dtype)
    weight = mask.sum()
    total = jnp.where(mask > 0, per_element * mask, 0.0).sum()
    # weights may sum to less than 1; none at all (a fully masked batch) gives a loss of 0
    return total / jnp.where(weight > 0, weight, 1.0), weight


def _broadcast_mask(mask, shape):
    mask = jnp.asarray(mask)
    if mask.ndim == len(shape) + 1 and mask.shape[-1] == 1:
        mask = mask[..., 0]
    if mask.ndim > len(shape) or tuple(mask.shape) != tuple(shape[: mask.ndim]):
        raise ValueError(
            f"label mask of shape {tuple(mask.shape)} does not fit per-example losses of shape "
            f"{tuple(shape)}; a mask is per example {tuple(shape[:1])} or per time step "
            f"{tuple(shape[:2])}"
        )
    return jnp.broadcast_to(mask.reshape(mask.shape + (1,) * (len(shape) - mask.ndim)), shape)


def check_labels(loss: Loss, outputs_shape, labels_shape, labels_dtype):
    """Raise ``ValueError`` if labels of this shape cannot be taken by ``loss``."""
    if loss.check is not None:
        loss.check(loss.name, outputs_shape, labels_shape, labels_dtype)
