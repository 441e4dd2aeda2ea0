"""Network: model + loss + optax updater + train state; the step functions, output, score, save and load.

The local fit loop is :mod:`dlspark._fit`; the checks on a network's input, :mod:`dlspark._checks`.
"""

from __future__ import annotations

import math
import uuid
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from . import _checks, _fit
from ._checks import _as_tuple, _per_output
from . import losses as _losses
from ._fit import _SYNC_EVERY, batch_signature, one_shape  # noqa: F401  (their home was here)
from . import _stepshare
from .data import as_dataset, load_minibatch
from .checkpoint import zeros_like_output
from .errors import NonFiniteLossError

__all__ = ["Network", "TrainState", "StepUpdate", "StepResult", "Steps", "build_steps", "shared_steps",
           "clear_shared_steps", "step_figures"]

_ON_NONFINITE = ("raise", "skip")


@struct.dataclass
class TrainState:
    """Everything that changes during training, as one pytree of arrays.

    ``step`` is the iteration counter (minibatches applied), ``epoch`` the
    epoch counter, ``rng`` the raw PRNG key that dropout and the like draw from.
    """

    params: Any
    model_state: Any
    opt_state: Any
    step: jax.Array
    epoch: jax.Array
    rng: jax.Array


@struct.dataclass
class StepUpdate:
    """One step's update before it is applied (``Steps.compute_update``'s result).

    ``updates`` is the updater's output for the step's gradients, ``opt_state``,
    ``model_state`` and ``rng`` what follow the step, ``loss`` its loss, and
    ``figures`` the step's own figures (:func:`step_figures`).
    """

    updates: Any
    opt_state: Any
    model_state: Any
    rng: jax.Array
    loss: jax.Array
    figures: dict


@struct.dataclass
class StepResult:
    """What a training step returns, as one pytree (it comes out of ``jax.jit`` and ``lax.scan``).

    ``state`` is the state after the step; ``loss`` the step's loss; ``finite``
    whether its loss and update were finite (for ``train_step``: whether it was
    applied), ``None`` from the steps that do not check; ``figures`` the step's
    own figures (:func:`step_figures`). The steps over stacked minibatches return
    one record whose ``loss``, ``finite`` and ``figures`` have a leading axis, one
    entry per minibatch.
    """

    state: Any
    loss: jax.Array
    finite: Any = None
    figures: dict = struct.field(default_factory=dict)


def step_figures(grads, updates) -> dict:
    """A step's own figures, computed in the step from its gradients and update (a dict of
    scalars; a statistic of every step is added here, and every step reports it). None yet:
    each figure is work in every step."""
    return {}


class Steps(NamedTuple):
    """The jitted functions of one network; built once and reused for every step.

    Every training step returns a :class:`StepResult` (state, loss, finite flag,
    figures); over stacked minibatches, one whose loss, flag and figures are stacked.
    ``compute_update(state, batch, clip_norm=None) -> StepUpdate`` (with the gradient
    clipped by global norm to ``clip_norm`` where given) and ``apply_update(state,
    updates, opt_state, model_state, rng) -> state`` split one training step so
    that a distributed master can act between them; ``train_step(state, batch)``
    is both in one program and leaves the state unchanged (``finite`` false:
    not applied) when the loss or update is not finite. ``train_steps(state,
    batches)`` runs ``train_step`` over minibatches stacked on a leading axis, in
    one compiled call (``lax.scan``). ``bare_step(state, batch)`` is the step with
    no check (``finite`` is ``None``): it applies the update whatever it holds
    (``train_step``'s check is a select over the whole state, which on a large
    network costs a good part of a step), and ``bare_steps`` is it over stacked
    minibatches. ``checked_step(state, batch)`` is the bare step that also says
    whether its loss and update were finite, for a caller that stops at the first
    bad step rather than skip it (``checked_steps`` over stacked minibatches, as
    ``train_steps``). A loop
    checks many bare steps at once:
    ``all_finite(state)`` is false when a parameter is not finite (one that a
    non-finite update reached stays so), and together with the steps' losses it
    says whether to replay them, with ``train_step``, from a copy of the state
    they started from. ``window_end(state, losses, epochs) -> (state, copy of
    state, finite, stacked losses)`` is that check for ``Network.fit``'s
    windows; it also adds ``epochs`` to the epoch counter and copies the state
    for the next window. ``loop_steps(state, batches)`` is
    ``bare_steps`` as a rolled loop: its compile time does not grow with the
    number of minibatches (each number and shape is still a program of its
    own), and it runs a dispatch-bound step faster than one call per step (but
    XLA's CPU backend runs convolutions in it many times slower).
    ``copy_state(state)`` copies the state (the steps donate theirs).
    ``kept_step`` is ``bare_step`` without donating the state it is given: a loop
    that must keep the state it started from (to replay its steps) runs its first
    step with it instead of copying the state first.
    """

    train_step: Callable
    compute_update: Callable
    apply_update: Callable
    output: Callable
    loss_sum: Callable
    per_example_loss: Callable
    train_steps: Callable
    bare_step: Callable
    bare_steps: Callable
    checked_step: Callable
    checked_steps: Callable
    all_finite: Callable
    window_end: Callable
    copy_state: Callable
    loop_steps: Callable
    kept_step: Callable


def _resolve_losses(loss):
    if isinstance(loss, (list, tuple)) and not isinstance(loss, _losses.Loss):
        return tuple(_losses.get_loss(x) for x in loss)
    return _losses.get_loss(loss)


def build_steps(model, loss, updater) -> Steps:
    """Build the jitted step functions for ``model``, ``loss`` and the optax ``updater``.

    This is pure: no Dask, no files. Workers call it once per job.
    """
    loss = _resolve_losses(loss)

    def per_element(outputs, labels, lmask):
        outs, labs, masks = _as_tuple(outputs), _as_tuple(labels), _as_tuple(lmask)
        if len(masks) == 1 and len(labs) > 1:
            masks = masks * len(labs)
        fns = _per_output(loss, len(labs))
        if len(outs) != len(labs):
            raise ValueError(f"the model gives {len(outs)} outputs but the data has {len(labs)} labels arrays")
        return [(fn.fn(o, y), m) for fn, o, y, m in zip(fns, outs, labs, masks)]

    def total_loss(outputs, labels, lmask):
        terms = [_losses.reduce_loss(le, m) for le, m in per_element(outputs, labels, lmask)]
        return sum(t[0] for t in terms), terms[0][1]

    def loss_fn(params, model_state, batch, rng):
        x, y, fmask, lmask = batch
        outputs, new_state = model.apply_train(params, model_state, x, rng, fmask)
        value, _ = total_loss(outputs, y, lmask)
        return value, new_state

    def compute_update(state, batch, clip_norm=None):
        # clip_norm: gradient sharing's local clipping (each replica's gradient clipped by
        # global norm before its updater); an argument, not a constant, so that one program
        # serves every bound, and None (the default) is a program without it
        rng, step_rng = jax.random.split(state.rng)
        (value, new_mstate), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, state.model_state, batch, step_rng
        )
        if clip_norm is not None:
            grads, _ = optax.clip_by_global_norm(clip_norm).update(grads, optax.EmptyState())
        updates, new_opt = updater.update(grads, state.opt_state, state.params)
        return StepUpdate(updates, new_opt, new_mstate, rng, value, step_figures(grads, updates))

    def applied(state, u):
        return apply_update(state, u.updates, u.opt_state, u.model_state, u.rng)

    def apply_update(state, updates, opt_state, model_state, rng):
        return state.replace(
            params=optax.apply_updates(state.params, updates),
            opt_state=opt_state,
            model_state=model_state,
            rng=rng,
            step=state.step + 1,
        )

    def train_step(state, batch):
        u = compute_update(state, batch)
        new = applied(state, u)
        ok = finite(u.loss, u.updates)
        # A non-finite step leaves params and updater state as they were (the
        # rng still advances, so "skip" does not replay the same dropout mask).
        kept = state.replace(rng=u.rng)
        return StepResult(jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new, kept), u.loss, ok, u.figures)

    def all_leaves_finite(leaves):
        return jnp.all(jnp.array([jnp.all(jnp.isfinite(x)) for x in leaves] or [True]))

    def finite(value, updates):
        return jnp.isfinite(value) & all_leaves_finite(jax.tree_util.tree_leaves(updates))

    def bare_step(state, batch):
        u = compute_update(state, batch)
        return StepResult(applied(state, u), u.loss, None, u.figures)

    def copy_state(state):
        return jax.tree_util.tree_map(lambda x: x.copy(), state)

    def kept_step(state, batch):  # bare_step, compiled without donation (a name of its own)
        return bare_step(state, batch)

    def window_end(state, losses, epochs):
        state = state.replace(epoch=state.epoch + epochs)
        return state, copy_state(state), all_finite(state), jnp.stack(losses)

    def checked_step(state, batch):
        u = compute_update(state, batch)
        return StepResult(applied(state, u), u.loss, finite(u.loss, u.updates), u.figures)

    def over_stacked(step, unroll=True):
        """``step`` over minibatches stacked on a leading axis: one :class:`StepResult` whose
        loss, flag and figures have the minibatches' axis. Unrolled by default: XLA's CPU
        backend runs a rolled loop of convolutions many times slower."""
        def steps(state, batches):
            def body(st, batch):
                out = step(st, batch)
                return out.state, out.replace(state=None)

            state, stacked = jax.lax.scan(body, state, batches, unroll=unroll)
            return stacked.replace(state=state)

        return steps

    def all_finite(state):
        return all_leaves_finite([x for x in jax.tree_util.tree_leaves(state.params)
                                  if jnp.issubdtype(x.dtype, jnp.inexact)])

    def output(state, x, fmask):
        return model.apply_eval(state.params, state.model_state, x, fmask)

    def loss_sum(state, batch):
        x, y, fmask, lmask = batch
        outputs = model.apply_eval(state.params, state.model_state, x, fmask)
        value, weight = total_loss(outputs, y, lmask)
        return value * weight, weight

    def per_example_loss(state, batch):
        x, y, fmask, lmask = batch
        outputs = model.apply_eval(state.params, state.model_state, x, fmask)
        total = 0.0
        for le, m in per_element(outputs, y, lmask):
            if le.ndim > 1:  # sequences: mean over unmasked time steps
                mm = jnp.ones(le.shape) if m is None else _losses._broadcast_mask(m, le.shape)
                le = (le * mm).reshape(le.shape[0], -1).sum(1) / jnp.maximum(mm.reshape(le.shape[0], -1).sum(1), 1.0)
            elif m is not None:  # a per-example mask: a masked-out example scores 0 (as DL4J's score arrays)
                le = le * _losses._broadcast_mask(m, le.shape)
            total = total + le
        return total

    steps = Steps(
        train_step=jax.jit(train_step, donate_argnums=(0,)),
        compute_update=jax.jit(compute_update),
        apply_update=jax.jit(apply_update, donate_argnums=(0,)),
        output=jax.jit(output),
        loss_sum=jax.jit(loss_sum),
        per_example_loss=jax.jit(per_example_loss),
        train_steps=jax.jit(over_stacked(train_step), donate_argnums=(0,)),
        bare_step=jax.jit(bare_step, donate_argnums=(0,)),
        bare_steps=jax.jit(_named(over_stacked(bare_step), "bare_steps"), donate_argnums=(0,)),
        checked_step=jax.jit(checked_step, donate_argnums=(0,)),
        checked_steps=jax.jit(over_stacked(checked_step), donate_argnums=(0,)),
        all_finite=jax.jit(all_finite),
        window_end=jax.jit(window_end, donate_argnums=(0,)),
        copy_state=jax.jit(copy_state),
        loop_steps=jax.jit(_named(over_stacked(bare_step, unroll=1), "loop_steps"), donate_argnums=(0,)),
        kept_step=jax.jit(kept_step),
    )
    return steps


def shared_steps(model, loss, updater) -> Steps:
    """:func:`build_steps`, shared by every network of this process whose model, loss and
    updater pickle to the same bytes (:mod:`dlspark._stepshare`: a few kept, the least
    recently used dropped first). The steps are pure functions: networks sharing them share
    no state, only the traced and compiled programs. A model or updater that cannot be
    pickled gets steps of its own."""
    return _stepshare.shared((model, loss, updater), lambda: build_steps(model, loss, updater))


def clear_shared_steps() -> None:
    """Forget the steps kept by :func:`shared_steps`: a network built afterwards traces its own."""
    _stepshare.clear()


def _named(fn, name):
    """``fn`` under ``name``, the name its compiled program is known by (``jit(name)``)."""
    fn.__name__ = fn.__qualname__ = name
    return fn


def _to_device_batch(ds):
    return jax.tree_util.tree_map(jnp.asarray, ds.jit_batch())


class Network:
    """A model with its loss, optax updater and train state (DL4J's MultiLayerNetwork/ComputationGraph).

    Parameters
    ----------
    model : Model
        The architecture (``Model(init, apply, example_input)`` or ``Model.from_flax``).
    loss : str, callable, or sequence of them
        A name from :data:`dlspark.losses.LOSSES`, a per-element loss callable,
        or one loss per output for multi-output models.
    updater : optax.GradientTransformation, optional
        Defaults to ``optax.adam(1e-3)``.
    seed : int
        Seeds parameter initialisation and the training RNG.
    on_nonfinite : {"raise", "skip"}
        What fit does when a step's loss or update is NaN/Inf: raise
        :class:`~dlspark.errors.NonFiniteLossError` naming the iteration (the
        update is not applied), or skip that minibatch and go on.

    Examples
    --------
    >>> import flax.linen as nn, numpy as np, optax
    >>> from dlspark import Model, Network
    >>> model = Model.from_flax(nn.Dense(10), np.zeros((1, 64), np.float32))
    >>> net = Network(model, loss="mcxent", updater=optax.sgd(0.1))
    >>> net.output(np.zeros((2, 64), np.float32)).shape
    (2, 10)
    """

    def __init__(self, model, loss="softmax_cross_entropy", updater=None, seed=0, on_nonfinite="raise"):
        self._configure(model, loss, updater, seed, on_nonfinite)
        self.state = self.init_state()

    def _configure(self, model, loss, updater, seed, on_nonfinite):
        """Everything of ``__init__`` but the train state."""
        from .model import Model

        if not isinstance(model, Model):
            raise TypeError(
                f"model must be a dlspark.Model, got {type(model).__name__}; "
                "for a Flax module use Model.from_flax(module, example_input)"
            )
        if updater is None:
            updater = optax.adam(1e-3)
        if not isinstance(updater, optax.GradientTransformation):
            raise TypeError(f"updater must be an optax.GradientTransformation (e.g. optax.adam(1e-3)), got {type(updater).__name__}")
        if on_nonfinite not in _ON_NONFINITE:
            raise ValueError(f"on_nonfinite must be one of {_ON_NONFINITE}, got {on_nonfinite!r}")
        if not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.model = model
        self.loss = loss
        self._loss = _resolve_losses(loss)
        self.updater = updater
        self.seed = int(seed)
        self.on_nonfinite = on_nonfinite
        #: Names this network's definition: workers keep one compiled copy per token.
        self.token = uuid.uuid4().hex
        self._steps = None
        self._checked_shapes: dict = {}  # batch shapes -> [(labels array, classes)] of class-id labels
        self._output_checked: set = set()  # feature shapes output has taken
        #: ``(iteration, loss)`` of every minibatch fitted so far (DL4J's score listener).
        self.score_history: list = []

    # --- construction -------------------------------------------------------
    def init_state(self) -> TrainState:
        """A fresh train state from the network's seed."""
        p_rng, t_rng = jax.random.split(jax.random.PRNGKey(self.seed))
        params, mstate = self.model.init(p_rng)
        return TrainState(
            params=params,
            model_state=mstate,
            opt_state=self.updater.init(params),
            step=jnp.zeros((), jnp.int32),
            epoch=jnp.zeros((), jnp.int32),
            rng=t_rng,
        )

    def definition(self) -> dict:
        """What rebuilds this network elsewhere: model, loss, updater, seed, options."""
        return {"model": self.model, "loss": self.loss, "updater": self.updater,
                "seed": self.seed, "on_nonfinite": self.on_nonfinite}

    def state_template(self) -> TrainState:
        """:meth:`init_state`'s structure, shapes and dtypes as host zeros, nothing computed or
        compiled (``dlspark.checkpoint.zeros_like_output``): what a process that is sent its
        state checks it against."""
        return zeros_like_output(self.init_state)

    @classmethod
    def from_definition(cls, definition: dict, state: TrainState | None = None, *,
                        template: bool = False) -> "Network":
        """Rebuild a network from :meth:`definition` with ``state``, else with a fresh state from
        its seed, or with ``template`` its :meth:`state_template` (for a process that will be
        sent its state: a worker rebuilding the client's network)."""
        net = cls.__new__(cls)
        net._configure(**definition)
        net.state = state if state is not None else net.state_template() if template else net.init_state()
        return net

    @property
    def steps(self) -> Steps:
        """The jitted step functions, built on first use: shared with every network of this
        process built alike (``shared_steps``), so each input shape traces once."""
        if self._steps is None:
            self._steps = shared_steps(self.model, self._loss, self.updater)
        return self._steps

    @property
    def params(self):
        return self.state.params

    @property
    def iteration(self) -> int:
        """Minibatches applied so far."""
        return int(self.state.step)

    @property
    def epoch(self) -> int:
        """Epochs completed so far."""
        return int(self.state.epoch)

    @property
    def num_params(self) -> int:
        return int(sum(np.size(x) for x in jax.tree_util.tree_leaves(self.state.params)))

    # --- checks ---------------------------------------------------------------
    def check_batch(self, ds) -> None:
        """Raise a clear error if ``ds`` cannot be fed to this network (checked once per shape)."""
        self._check_jit_batch(ds.jit_batch())

    def _check_jit_batch(self, batch) -> None:
        _checks.check_jit_batch(self, batch)

    def _output_shapes(self, x, fm):
        """The model's outputs for features ``x`` as shapes (see :func:`dlspark._checks.output_shapes`)."""
        return _checks.output_shapes(self, x, fm)

    # --- training -------------------------------------------------------------
    def _minibatches(self, data, batch_size, epochs):
        """Normalise fit's input to a re-iterable list of minibatches (or a one-shot iterator)."""
        from .data._sources import local_batches

        return local_batches(data, batch_size, epochs)

    def fit(self, data, epochs: int = 1, batch_size: int = 32, shuffle: bool = False, progress: bool = False,
            steps_per_call: int | None = None):
        """Train locally.

        Parameters
        ----------
        data : DataSet, (features, labels), list of DataSets, list of URLs, glob or iterator
            A DataSet (or pair) is cut into minibatches of ``batch_size``; a list
            of DataSets is used as the minibatches, in order; URLs and globs name
            minibatch files.
        epochs : int
        batch_size : int
            Only used when ``data`` is one DataSet or pair.
        shuffle : bool
            Shuffle minibatch order each epoch, seeded by the network's seed and
            epoch counter (so a resumed run shuffles as an uninterrupted one).
        steps_per_call : int, optional
            Run up to this many consecutive minibatches of one shape as one
            compiled call (a rolled ``lax.scan`` over them, stacked); ``1`` is
            one call per minibatch. On XLA's CPU backend the fused loop gives
            the bits of one call per minibatch (tested); it pays where a step is
            short enough for Python's dispatch to show (a small network, small
            minibatches). ``None`` (the default) fuses 16 unless the step has a
            convolution (XLA's CPU backend runs one in a loop up to about 25x
            slower; not measured on GPUs, so left off there too) or the fit's
            first minibatch holds more than 1 MiB (such a step is not
            dispatch-bound, and stacking would only copy). The fused loop is one
            more program to compile for the first fit on such minibatches. Up
            to ``128 + 2 * steps_per_call`` minibatches are held in memory at
            once, plus one stacked copy of a call's.

        Returns
        -------
        Network
            ``self``.

        Notes
        -----
        Minibatches are read when their step is dispatched, which may be after
        ``fit`` has taken later ones (and when fused, stacked only once a call's
        worth is in hand): an iterator must yield fresh arrays, not refill one
        buffer. A minibatch that cannot be read or fed ends the fit with its
        error, after the minibatches before it are trained and recorded.
        """
        return _fit.fit(self, data, epochs, batch_size, shuffle, progress, steps_per_call)

    def _fused_steps(self, batch) -> int:
        """``fit``'s default steps per call for minibatches like ``batch`` (see ``fit``)."""
        return _fit.fused_steps(self, batch)

    def _step_convolves(self, batch, state=None) -> bool:
        """Whether the step on minibatches like ``batch`` has a convolution (see ``fit``)."""
        return _fit.step_convolves(self, batch, state)

    def fit_minibatch(self, ds) -> float:
        """One training step on one minibatch; returns its loss (DL4J's ``fit(DataSet)``)."""
        ds = as_dataset(ds)
        if len(ds) == 0:
            raise ValueError("the minibatch holds no examples: a step needs at least one")
        self.check_batch(ds)
        it = int(self.state.step)
        out = self.steps.train_step(self.state, _to_device_batch(ds))
        self.state, loss = out.state, float(out.loss)
        if not bool(out.finite):
            self.nonfinite(it, loss)
            return loss
        self.score_history.append((it, loss))
        return loss

    def nonfinite(self, iteration: int, loss: float) -> None:
        """The one non-finite-loss policy, for local, averaged and shared training alike: with
        ``on_nonfinite="raise"`` raise :class:`~dlspark.errors.NonFiniteLossError` naming the
        iteration (the caller keeps the parameters from before that step); with ``"skip"``
        return, and the caller drops the minibatch."""
        if self.on_nonfinite == "raise":
            raise NonFiniteLossError(iteration, loss)

    # --- inference ------------------------------------------------------------
    def output(self, features, batch_size: int | None = None, features_mask=None):
        """Forward pass in inference mode; numpy outputs (a tuple for multi-output models)."""
        return _fit.local_output(self, features, batch_size, features_mask)

    def score(self, data, batch_size: int = 256) -> float:
        """Mean loss over ``data`` (DataSet, pair, list of DataSets, or minibatch URLs)."""
        batches, are_urls = self._minibatches(data, batch_size, 1)
        total, weight = 0.0, 0.0
        for mb in batches:
            ds = load_minibatch(mb) if are_urls else as_dataset(mb)
            self.check_batch(ds)
            s, w = self.steps.loss_sum(self.state, _to_device_batch(ds))
            total, weight = total + float(s), weight + float(w)
        if weight == 0:
            return math.nan
        return total / weight

    def score_examples(self, data, batch_size: int = 256) -> np.ndarray:
        """Per-example loss (mean over unmasked time steps for sequences)."""
        ds = as_dataset(data)
        self.check_batch(ds)
        if len(ds) == 0:  # no examples, no losses
            return np.zeros(0, np.float32)
        return np.concatenate([np.asarray(self.steps.per_example_loss(self.state, _to_device_batch(b)))
                               for b in ds.batches(batch_size)])

    # --- persistence ----------------------------------------------------------
    def save(self, url: str, **storage_options) -> None:
        """Write a checkpoint (arrays, counters and definition) to ``url`` atomically."""
        from .checkpoint import save_checkpoint
        save_checkpoint(self, url, **storage_options)

    def restore(self, url: str, **storage_options) -> "Network":
        """Load a checkpoint's arrays into this network; nothing from the file is executed."""
        from .checkpoint import restore_checkpoint
        self.state = restore_checkpoint(url, self.state, **storage_options)
        return self

    @classmethod
    def load(cls, url: str, **storage_options) -> "Network":
        """Rebuild a network from a checkpoint, definition included.

        The definition is a pickle: load only checkpoints you trust. To load
        arrays from an untrusted file, build the network yourself and call
        :meth:`restore`.
        """
        from .checkpoint import load_checkpoint
        # the checkpoint's arrays replace the whole state: a template suffices to check them against
        return load_checkpoint(url, lambda d: cls.from_definition(d, template=True), **storage_options)

    def __repr__(self):
        return f"Network({self.model!r}, params={self.num_params}, iteration={self.iteration}, epoch={self.epoch})"
