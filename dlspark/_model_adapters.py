"""Adapters from flax.nnx and Equinox modules to :class:`~dlspark.Model`'s pure ``init``/``apply``.

What every adapter here guarantees, as ``Model.from_flax`` does for linen:

- parameters and non-trainable state (batch statistics) are flat dicts of plain
  arrays keyed by their path in the module (``"['dense']['kernel'].value"``):
  what optax updates, what the distributed algorithms average (integer leaves
  excepted) and what checkpoints store, with no library object in between;
- the library's own random state (nnx's typed keys and counts) is never part of
  them: each call draws it afresh from the ``rng`` that dlspark passes (one key
  per step, folded per replica by the runtimes), so dropout masks differ between
  steps and between workers, no key is ever averaged, and no typed key reaches
  a checkpoint;
- the adapters pickle (cloudpickle) to Dask workers and Spark executors, and
  rebuild what they derive from the module (graph definitions, tree
  structures) once per process, unpickled.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["require", "flat", "unflat", "owned", "Bound", "NnxAdapter", "EquinoxAdapter"]

#: the optional extra that installs each model library
EXTRA = "models"


def require(module: str, caller: str, what: str):
    """Import ``module`` for ``caller``, or raise ``ImportError`` naming the extra that installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{caller} needs {what}, which is not installed: pip install 'dlspark[{EXTRA}]' "
                          f"(or pip install {what.split()[0]})") from e


def flat(tree) -> dict:
    """``{path: leaf}`` of a pytree: a plain dict of arrays, whatever the tree's node types."""
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def owned(d: dict) -> dict:
    """Copies of the arrays of ``d``: the training steps donate the state's buffers, which must not
    be the module's own (the adapter keeps the module, and pickles it)."""
    return {k: jnp.array(v, copy=True) for k, v in d.items()}


class _Template:
    """The paths and structure of a pytree, to rebuild it from :func:`flat`'s dict."""

    def __init__(self, tree):
        pairs, self.treedef = jax.tree_util.tree_flatten_with_path(tree)
        self.paths = [jax.tree_util.keystr(p) for p, _ in pairs]
        self.leaves = [v for _, v in pairs]


def unflat(template: _Template, d: dict):
    """The pytree of ``template``'s structure with the leaves of the flat dict ``d``."""
    return jax.tree_util.tree_unflatten(template.treedef, [d[p] for p in template.paths])


class Bound:
    """``adapter.<method>`` as a picklable callable that shows the user's module as ``module``
    (a checkpoint stores the classes of the user's own modules by value, found through it)."""

    def __init__(self, adapter, method: str):
        self.adapter, self.method = adapter, method

    @property
    def module(self):
        a = self.adapter
        for name in ("module", "factory", "model"):
            if getattr(a, name, None) is not None:
                return getattr(a, name)
        return None

    def __call__(self, *args, **kwargs):
        return getattr(self.adapter, self.method)(*args, **kwargs)


def _call_params(fn):
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


def _as_outputs(out):
    """A list of outputs is a multi-output model's, as a tuple is."""
    return tuple(out) if isinstance(out, list) else out


def _key_like(template, rng, i):
    """A fresh value for an RNG leaf of ``template``'s kind: a typed key, or a count (zero)."""
    if jnp.issubdtype(template.dtype, jax.dtypes.prng_key):
        return jnp.broadcast_to(jax.random.fold_in(jax.random.wrap_key_data(rng), i), template.shape)
    return jnp.zeros(template.shape, template.dtype)


class NnxAdapter:
    """``init`` and ``apply`` of a ``flax.nnx`` module (see :meth:`dlspark.Model.from_nnx`)."""

    def __init__(self, module_or_factory):
        nnx = require("flax.nnx", "Model.from_nnx", "flax (with nnx)")
        if isinstance(module_or_factory, nnx.Module):
            self.module, self.factory = module_or_factory, None
        elif callable(module_or_factory):
            self.module, self.factory = None, module_or_factory
        else:
            raise TypeError("Model.from_nnx takes a flax.nnx Module or a factory rngs -> Module, "
                            f"got {type(module_or_factory).__name__}")
        self._derived = None
        target = self.module if self.module is not None else self.factory
        call = type(target).__call__ if self.module is not None else None
        self.has_mask = call is not None and "mask" in _call_params(call)

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_derived"] = None  # graph definitions are rebuilt where the adapter is used
        return d

    def _build(self, rng):
        from flax import nnx

        if self.factory is None:
            return self.module
        m = self.factory(nnx.Rngs(rng))
        if not isinstance(m, nnx.Module):
            raise TypeError(f"the factory given to Model.from_nnx must return a flax.nnx Module, got "
                            f"{type(m).__name__}")
        return m

    def _defs(self):
        if self._derived is None:
            from flax import nnx

            abstract = self.module if self.factory is None else nnx.eval_shape(
                lambda: self._build(jax.random.PRNGKey(0)))
            if self.factory is not None:
                self.has_mask = "mask" in _call_params(type(abstract).__call__)
            modes = {}
            for train in (True, False):
                m = nnx.view(abstract, deterministic=not train, use_running_average=not train,
                             raise_if_not_found=False)
                modes[train] = nnx.split(m, nnx.Param, nnx.RngState, ...)
            _, params, rngs, rest = modes[True]
            self._derived = ({t: g[0] for t, g in modes.items()}, _Template(params), _Template(rngs),
                             _Template(rest))
        return self._derived

    def init(self, rng, x):
        from flax import nnx

        _, params, _, rest = nnx.split(self._build(rng), nnx.Param, nnx.RngState, ...)
        return {"params": owned(flat(params)), "nnx": owned(flat(rest))}

    def apply(self, variables, x, train, rng, **kw):
        from flax import nnx

        graphs, params_t, rngs_t, rest_t = self._defs()
        key = rng if rng is not None else jax.random.PRNGKey(0)  # inference draws nothing
        rngs = jax.tree_util.tree_unflatten(rngs_t.treedef, [_key_like(t, key, i) for i, t in
                                                             enumerate(rngs_t.leaves)])
        m = nnx.merge(graphs[bool(train)], unflat(params_t, variables["params"]), rngs,
                      unflat(rest_t, variables["nnx"]))
        out = _as_outputs(m(x, **kw))
        if not train:
            return out
        _, _, _, rest = nnx.split(m, nnx.Param, nnx.RngState, ...)
        return out, {"nnx": flat(rest)}


class EquinoxAdapter:
    """``init`` and ``apply`` of an Equinox module (see :meth:`dlspark.Model.from_equinox`)."""

    def __init__(self, module, state=None, batched=False):
        eqx = require("equinox", "Model.from_equinox", "equinox")
        if not isinstance(module, eqx.Module):
            raise TypeError(f"Model.from_equinox takes an equinox.Module, got {type(module).__name__}")
        if state is not None and not isinstance(state, eqx.nn.State):
            raise TypeError(f"state must be the equinox.nn.State from eqx.nn.make_with_state, got "
                            f"{type(state).__name__}")
        self.module, self.state, self.batched = module, state, bool(batched)
        params = _call_params(type(module).__call__)
        self.has_key = "key" in params
        self.has_mask = "mask" in params
        self._derived = None

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_derived"] = None
        return d

    def _defs(self):
        if self._derived is None:
            import equinox as eqx

            params, static = eqx.partition(self.module, eqx.is_inexact_array)
            self._derived = (static, _Template(params),
                             None if self.state is None else _Template(self.state))
        return self._derived

    def init(self, rng, x):
        import equinox as eqx

        variables = {"params": owned(flat(eqx.filter(self.module, eqx.is_inexact_array)))}
        if self.state is not None:
            variables["eqx_state"] = owned(flat(self.state))
        return variables

    def apply(self, variables, x, train, rng, **kw):
        import equinox as eqx

        static, params_t, state_t = self._defs()
        model = eqx.combine(unflat(params_t, variables["params"]), static)
        if not train:
            model = eqx.nn.inference_mode(model, True)
        state = None if state_t is None else unflat(state_t, variables["eqx_state"])
        n = jax.tree_util.tree_leaves(x)[0].shape[0]
        use_key = self.has_key and rng is not None

        def one(xi, ki, mi):
            args = (xi,) if state is None else (xi, state)
            kwargs = dict(kw)
            if mi is not None:
                kwargs["mask"] = mi
            if use_key:
                kwargs["key"] = ki
            return model(*args, **kwargs)

        mask = kw.pop("mask", None)
        if self.batched:
            out = one(x, rng if use_key else None, mask)
        else:
            keys = jax.random.split(rng, n) if use_key else None
            # "batch" is the axis name Equinox's BatchNorm takes (eqx.nn.BatchNorm(..., axis_name="batch"))
            out = jax.vmap(one, in_axes=(0, 0 if use_key else None, 0 if mask is not None else None),
                           out_axes=0 if state is None else (0, None), axis_name="batch")(x, keys, mask)
        if state is None:
            return _as_outputs(out)
        out, new_state = out
        if not train:
            return _as_outputs(out)
        return _as_outputs(out), {"eqx_state": flat(new_state)}
