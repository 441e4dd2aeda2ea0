"""The adapter from a Keras 3 model (JAX backend) to :class:`~dlspark.Model`'s ``init``/``apply``.

Keras' stateless API (``model.stateless_call``) runs the model on variables it
is given and returns the new non-trainable ones. The trainable variables are
the parameters; the non-trainable ones (batch-norm moving statistics) are the
model state, except the dropout seed generators' ``uint32`` states: those are
drawn afresh from dlspark's per-step, per-replica key on every call, so they are
never averaged, checkpointed or shared between workers. Keras reads
``KERAS_BACKEND`` once, when it is first imported: the adapter sets it to
``jax`` in any process that unpickles it before Keras is imported there, and
refuses a process whose Keras runs another backend.
"""

from __future__ import annotations

import os

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np

from ._model_adapters import _as_outputs, require

__all__ = ["KerasAdapter", "ensure_jax_backend"]


def ensure_jax_backend(caller: str = "Model.from_keras"):
    """Import Keras on its JAX backend, setting ``KERAS_BACKEND=jax`` if Keras is not imported yet.

    Raises ``RuntimeError`` where Keras was already imported with another backend.
    """
    import sys

    if "keras" not in sys.modules:
        os.environ.setdefault("KERAS_BACKEND", "jax")
    keras = require("keras", caller, "keras (Keras 3)")
    backend = keras.backend.backend()
    if backend != "jax":
        raise RuntimeError(f"{caller} needs Keras on its JAX backend, but Keras runs on {backend!r}: set the "
                           "environment variable KERAS_BACKEND=jax before Keras is first imported (dlspark's "
                           "workers get it through dlspark.cluster.worker_env())")
    return keras


def _is_seed_state(v) -> bool:
    return v.path.split("/")[-1] == "seed_generator_state"


def _keys(variables):
    # the variable's place in the model and its own name ("003_kernel"): Keras' paths hold
    # counters of the layers built so far in the process ("sequential_3/dense_6/kernel"), so a
    # model built again, or elsewhere, would not find its checkpoint's arrays by path
    return [f"{i:03d}_{v.name}" for i, v in enumerate(variables)]


class KerasAdapter:
    """``init`` and ``apply`` of a built Keras 3 model (see :meth:`dlspark.Model.from_keras`)."""

    def __init__(self, model):
        keras = ensure_jax_backend()
        if not isinstance(model, keras.Model):
            raise TypeError(f"Model.from_keras takes a keras.Model (Sequential, functional or subclassed), got "
                            f"{type(model).__name__}")
        if not model.built:
            raise ValueError("Model.from_keras needs a built model: start it with keras.Input(shape), or call "
                             "it once on an example batch, or pass example_input")
        self.model = model
        self._index()

    def _index(self):
        m = self.model
        self.params_keys = _keys(m.trainable_variables)
        non_trainable = m.non_trainable_variables
        self.state_keys = _keys(non_trainable)
        self.seeds = [i for i, v in enumerate(non_trainable) if _is_seed_state(v)]
        self.seed_specs = [(tuple(non_trainable[i].shape), str(non_trainable[i].dtype)) for i in self.seeds]

    def __getstate__(self):
        d = dict(self.__dict__)
        m = self.model
        # the class, its config and its variables' values (Keras' own pickling goes through an
        # HDF5 file), unpickled only once the backend is set (__setstate__)
        d["model"] = cloudpickle.dumps((type(m), m.get_config(), [np.asarray(v.value) for v in m.variables]))
        return d

    def __setstate__(self, d):
        ensure_jax_backend("unpickling a Model.from_keras model")
        d = dict(d)
        cls, config, values = cloudpickle.loads(d["model"])
        model = cls.from_config(config)
        if len(model.variables) != len(values):
            raise ValueError(f"the Keras model {cls.__name__} rebuilt from its config has {len(model.variables)} "
                             f"variables, not {len(values)}: start it with keras.Input so that from_config builds it")
        for v, a in zip(model.variables, values):
            v.assign(a)
        d["model"] = model
        self.__dict__.update(d)

    def example_input(self):
        """A one-example batch of zeros of the model's input shapes (a tuple for several inputs)."""
        inputs = getattr(self.model, "inputs", None)
        if not inputs:
            raise ValueError("this Keras model declares no inputs (a subclassed model): pass example_input")
        shapes = [tuple(t.shape) for t in inputs]
        if any(d is None for s in shapes for d in s[1:]):
            raise ValueError(f"the Keras model's input shapes {shapes} have unknown sizes past the batch axis: "
                             "pass example_input")
        ex = [np.zeros((1,) + s[1:], np.dtype(t.dtype)) for s, t in zip(shapes, inputs)]
        return ex[0] if len(ex) == 1 else tuple(ex)

    def init(self, rng, x):
        m = self.model
        # copies: the training steps donate the state's buffers, which must not be the model's own
        variables = {"params": {k: jnp.array(v.value, copy=True)
                                for k, v in zip(self.params_keys, m.trainable_variables)}}
        state = {k: jnp.array(v.value, copy=True)
                 for i, (k, v) in enumerate(zip(self.state_keys, m.non_trainable_variables)) if i not in self.seeds}
        if state:
            variables["keras"] = state
        return variables

    def apply(self, variables, x, train, rng, **kw):
        key = jax.random.wrap_key_data(rng if rng is not None else jax.random.PRNGKey(0))
        params = [variables["params"][k] for k in self.params_keys]
        seeds = dict(zip(self.seeds, self.seed_specs))
        state = []
        for i, k in enumerate(self.state_keys):
            if i in seeds:
                shape, dtype = seeds[i]
                state.append(jax.random.bits(jax.random.fold_in(key, i), shape, jnp.uint32).astype(dtype))
            else:
                state.append(variables["keras"][k])
        inputs = list(x) if isinstance(x, tuple) else x
        out, new_state = self.model.stateless_call(params, state, inputs, training=bool(train), **kw)
        out = _as_outputs(out)
        if not train or "keras" not in variables:
            return out
        return out, {"keras": {k: v for i, (k, v) in enumerate(zip(self.state_keys, new_state))
                               if i not in self.seeds}}
