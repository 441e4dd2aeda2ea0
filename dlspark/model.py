"""Model: a pair of pure ``init``/``apply`` functions, and the adapters of flax (linen, nnx), Equinox and Keras."""

from __future__ import annotations

import inspect

import jax
import numpy as np

__all__ = ["Model"]


def _example(example_input):
    """Keep a one-example copy of the example input (a pytree of arrays)."""
    def one(a):
        a = np.asarray(a)
        if a.ndim == 0:
            raise ValueError("example_input must have a leading batch axis, got a scalar")
        return np.zeros((1,) + a.shape[1:], a.dtype)
    return jax.tree_util.tree_map(one, example_input)


class Model:
    """A network's architecture as pure functions (the role of DL4J's configuration).

    Parameters
    ----------
    init : callable
        ``init(rng, example_input) -> variables``. ``variables`` is either a
        pytree of parameters, or a dict with a ``"params"`` entry and other
        entries for non-trainable state (e.g. ``"batch_stats"``).
    apply : callable
        ``apply(variables, inputs, train, rng) -> outputs``. For a model with
        state, a call with ``train=True`` returns ``(outputs, new_state)``
        where ``new_state`` holds the non-``params`` entries.
    example_input : array or pytree of arrays
        A batch of inputs (only shapes and dtypes are kept) used to initialise
        the parameters. A tuple of arrays gives a multi-input model.
    uses_features_mask : bool
        If true, ``apply`` also takes ``mask=`` (the features mask).

    Examples
    --------
    >>> import jax.numpy as jnp, numpy as np
    >>> def init(rng, x):
    ...     return {"w": jnp.zeros((x.shape[-1], 2))}
    >>> def apply(v, x, train, rng):
    ...     return x @ v["w"]
    >>> m = Model(init, apply, np.zeros((1, 3), np.float32))
    >>> params, state = m.init(jax.random.PRNGKey(0))
    >>> params["w"].shape, state
    ((3, 2), {})
    """

    def __init__(self, init, apply, example_input, *, uses_features_mask=False, name=None):
        if not callable(init) or not callable(apply):
            raise TypeError("Model needs callables: Model(init, apply, example_input)")
        self._init = init
        self._apply = apply
        self.example_input = _example(example_input)
        self.uses_features_mask = bool(uses_features_mask)
        self.name = name or getattr(apply, "__qualname__", "model")
        self._wrapped = False

    @classmethod
    def from_flax(cls, module, example_input):
        """Adapt a ``flax.linen`` module.

        ``module.__call__`` takes the inputs (a tuple of inputs is passed as
        one argument for multi-input models) and optionally ``train`` (set
        during fit) and ``mask`` (the features mask). Dropout draws from the
        ``"dropout"`` RNG stream; collections other than ``params`` (such as
        ``batch_stats``) are carried as state and updated during training.

        Examples
        --------
        >>> import flax.linen as nn, numpy as np
        >>> m = Model.from_flax(nn.Dense(3), np.zeros((1, 4), np.float32))
        """
        try:
            import flax.linen as nn
        except ImportError as e:  # pragma: no cover - flax is a dependency
            raise ImportError("Model.from_flax needs flax") from e
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"Model.from_flax takes a flax.linen Module, got {type(module).__name__}; "
                "wrap other code with Model(init, apply, example_input)"
            )
        params = inspect.signature(type(module).__call__).parameters
        has_train = "train" in params
        has_mask = "mask" in params
        return cls(
            _FlaxInit(module, has_train),
            _FlaxApply(module, has_train),
            example_input,
            uses_features_mask=has_mask,
            name=type(module).__name__,
        )

    @classmethod
    def from_nnx(cls, module_or_factory, example_input):
        """Adapt a ``flax.nnx`` module, or a factory ``rngs -> module``.

        A factory is called with ``nnx.Rngs`` seeded from the network's seed, so
        that ``Network(..., seed=...)`` decides the initial parameters; a module
        brings its own. ``module(inputs)`` is called in training mode during fit
        and in inference mode otherwise (``nnx.view`` with ``deterministic`` and
        ``use_running_average``, as ``module.train()`` and ``module.eval()`` set
        them); a tuple of inputs is passed as one argument, a tuple or list of
        outputs is a multi-output model, and a ``mask`` parameter of
        ``__call__`` receives the features mask. ``nnx.Param`` variables are the
        parameters, every other variable but the RNG state (``nnx.BatchStat``
        and the like) is non-trainable state, updated by training steps and
        checkpointed. The module's RNG streams (``nnx.Rngs``: typed keys and
        counts) are drawn afresh from dlspark's key on every step, different on
        every worker, and are never averaged or stored.

        Examples
        --------
        >>> from flax import nnx
        >>> import numpy as np
        >>> m = Model.from_nnx(lambda rngs: nnx.Linear(4, 3, rngs=rngs), np.zeros((1, 4), np.float32))
        """
        from ._model_adapters import Bound, NnxAdapter

        adapter = NnxAdapter(module_or_factory)
        adapter._defs()  # the factory's errors here, not in the first step
        return cls(Bound(adapter, "init"), Bound(adapter, "apply"), example_input, uses_features_mask=adapter.has_mask,
                   name=type(adapter.module).__name__ if adapter.module is not None
                   else getattr(module_or_factory, "__name__", "nnx"))

    @classmethod
    def from_equinox(cls, module, example_input, *, state=None, batched=False):
        """Adapt an Equinox module.

        Parameters
        ----------
        module : equinox.Module
            Its floating-point arrays are the parameters. Equinox modules take
            one example: the module is ``jax.vmap``-ed over the batch with the
            axis name ``"batch"`` (the one ``eqx.nn.BatchNorm(axis_name="batch")``
            takes), unless ``batched``. If ``__call__`` has a ``key`` parameter
            it receives a key per example during fit (dropout) and ``None`` in
            inference; a ``mask`` parameter receives the features mask.
            Inference runs ``eqx.nn.inference_mode(module)``.
        example_input : array or tuple of arrays
            A batch of inputs.
        state : equinox.nn.State, optional
            From ``eqx.nn.make_with_state``: the module is then called as
            ``module(x, state, key=...) -> (outputs, state)``, and the state is
            carried and checkpointed as a network's non-trainable state.
        batched : bool
            The module takes whole batches itself (no ``vmap``; ``key`` is the
            step's key).

        Examples
        --------
        >>> import equinox as eqx, jax, numpy as np
        >>> m = Model.from_equinox(eqx.nn.Linear(4, 3, key=jax.random.PRNGKey(0)), np.zeros((1, 4), np.float32))
        """
        from ._model_adapters import Bound, EquinoxAdapter

        adapter = EquinoxAdapter(module, state=state, batched=batched)
        return cls(Bound(adapter, "init"), Bound(adapter, "apply"), example_input, uses_features_mask=adapter.has_mask,
                   name=type(module).__name__)

    @classmethod
    def from_keras(cls, model, example_input=None):
        """Adapt a built Keras 3 model running on Keras' JAX backend, through its stateless API.

        The trainable variables are the parameters, the non-trainable ones
        (``BatchNormalization``'s moving statistics) the network's state; the
        dropout layers' seed generators are drawn afresh from dlspark's key on
        every step, different on every worker, and are never averaged or stored.
        Several inputs are a tuple of arrays, several outputs a tuple. The
        initial parameters are the model's own (the network's seed does not
        redraw them). Keras must run on JAX: ``KERAS_BACKEND=jax`` before
        Keras is first imported (dlspark's workers are given it; see
        :func:`dlspark.cluster.worker_env`).

        Parameters
        ----------
        model : keras.Model
            Built: started from ``keras.Input``, or called once.
        example_input : array or tuple of arrays, optional
            Defaults to zeros of the model's declared input shapes.

        Examples
        --------
        >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")  # doctest: +SKIP
        >>> import keras  # doctest: +SKIP
        >>> m = Model.from_keras(keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]))  # doctest: +SKIP
        """
        from ._model_adapters import Bound
        from ._model_keras import KerasAdapter

        adapter = KerasAdapter(model)
        if example_input is None:
            example_input = adapter.example_input()
        return cls(Bound(adapter, "init"), Bound(adapter, "apply"), example_input, name=getattr(model, "name", None) or "keras")

    # The methods below are what Network uses; they normalise the user's
    # functions to (params, state) and (outputs, new_state).

    def init(self, rng):
        """Return ``(params, state)`` with ``state`` a dict (empty for stateless models)."""
        variables = self._init(rng, self.example_input)
        # A dict with a "params" entry is the Flax convention; anything else is all parameters.
        self._wrapped = isinstance(variables, dict) and "params" in variables
        if self._wrapped:
            return variables["params"], {k: v for k, v in variables.items() if k != "params"}
        return variables, {}

    def _variables(self, params, state):
        return {"params": params, **state} if self._wrapped else params

    def apply_train(self, params, state, inputs, rng, mask=None):
        """Training-mode forward pass: ``(outputs, new_state)``."""
        kw = {"mask": mask} if self.uses_features_mask else {}
        out = self._apply(self._variables(params, state), inputs, True, rng, **kw)
        if state:
            outputs, new_state = out
            return outputs, dict(new_state)
        return out, state

    def apply_eval(self, params, state, inputs, mask=None):
        """Inference-mode forward pass: the outputs."""
        kw = {"mask": mask} if self.uses_features_mask else {}
        return self._apply(self._variables(params, state), inputs, False, None, **kw)

    def __repr__(self):
        return f"Model({self.name})"


class _FlaxInit:
    """Picklable init for a linen module (cloudpickle stores the module by value)."""

    def __init__(self, module, has_train):
        self.module, self.has_train = module, has_train

    def __call__(self, rng, x):
        kw = {"train": False} if self.has_train else {}
        p_rng, d_rng = jax.random.split(rng)
        return self.module.init({"params": p_rng, "dropout": d_rng}, x, **kw)


class _FlaxApply:
    """Picklable apply for a linen module."""

    def __init__(self, module, has_train):
        self.module, self.has_train = module, has_train

    def __call__(self, variables, x, train, rng, **kw):
        if self.has_train:
            kw["train"] = train
        rngs = {"dropout": rng} if rng is not None else {}
        mutable = [k for k in variables if k != "params"] if train else False
        if mutable:
            return self.module.apply(variables, x, rngs=rngs, mutable=mutable, **kw)
        return self.module.apply(variables, x, rngs=rngs, **kw)
