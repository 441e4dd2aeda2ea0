"""Step functions shared by the networks of a process that are built alike.

A jitted function traces and lowers once per input shape and per function object. A
:class:`~dlspark.Network` built again from the same definition (a second network alike in a
notebook or a search, a checkpoint loaded into a new network, a worker's next job from another
client-side network alike) would trace, lower and look up each of its compiled programs again:
seconds for a large model. :func:`shared` hands every such network the same functions
(:func:`dlspark.network.shared_steps`).
"""

from __future__ import annotations

import collections
import hashlib
import io
import sys
import threading
import types

__all__ = ["SHARED_STEPS", "clear", "shared"]

#: definition key -> Steps, least recently used first (:func:`shared`)
_SHARED: collections.OrderedDict = collections.OrderedDict()
_SHARED_LOCK = threading.Lock()
#: how many step sets a process keeps for networks built alike (each holds its compiled programs)
SHARED_STEPS = 8


def _definition_key(parts: tuple) -> str | None:
    """A digest of what the step functions are built from (a network's model, loss and
    updater), or None when it cannot be pickled.

    Equal digests mean equal pickles, so equal programs: the key never joins two networks
    that train differently. Flax gives each module instance an id that compares equal to every
    other (so that modules hash alike as static arguments of ``jax.jit``); the digest follows
    flax and leaves it out. Anything else that differs between two networks built alike (a
    Keras layer's counter-made name) only keeps them apart.

    A class or function that pickles by reference (by its module and name) is also keyed by
    its identity: a module reloaded with new code (``importlib.reload``, IPython's autoreload)
    gives new objects under the old names, and a network built from them must trace them.
    """
    import cloudpickle

    flax_ids = sys.modules.get("flax.ids")
    flax_id = getattr(flax_ids, "FlaxId", None)

    class KeyPickler(cloudpickle.Pickler):
        def reducer_override(self, obj):
            if flax_id is not None and type(obj) is flax_id:
                return int, (0,)
            if isinstance(obj, (type, types.FunctionType)) and _by_reference(obj):
                # never loaded, only hashed; the callable is a builtin function, not a type or a
                # Python function, so that this hook does not meet it again
                return getattr, (f"{obj.__module__}:{obj.__qualname__}", str(id(obj)))
            return super().reducer_override(obj)

    buf = io.BytesIO()
    try:
        KeyPickler(buf, protocol=5).dump(parts)
    except Exception:  # noqa: BLE001  (whatever stops the pickle: the network keeps steps of its own)
        return None
    return hashlib.sha256(buf.getvalue()).hexdigest()


def _by_reference(obj) -> bool:
    """Whether ``obj`` is found under its module and qualified name (so pickles by reference)."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    if module is None or module.__name__ == "__main__":
        return False
    found = module
    for part in getattr(obj, "__qualname__", "").split("."):
        found = getattr(found, part, None)
    return found is obj


def shared(parts: tuple, build):
    """``build()``, kept and handed to every later call whose ``parts`` pickle to the same
    bytes (:data:`SHARED_STEPS` results kept, the least recently used dropped first); when
    ``parts`` cannot be pickled, a new ``build()`` each time, never kept."""
    key = _definition_key(parts)
    if key is None:
        return build()
    with _SHARED_LOCK:  # building traces nothing yet (jax.jit wrappers): quick under the lock
        found = _SHARED.get(key)
        if found is not None:
            _SHARED.move_to_end(key)
            return found
        made = _SHARED[key] = build()
        while len(_SHARED) > SHARED_STEPS:
            _SHARED.popitem(last=False)
    return made


def clear() -> None:
    """Forget every kept result: a network built afterwards traces and compiles its own
    (its compiled programs still come from JAX's persistent cache where one is set)."""
    with _SHARED_LOCK:
        _SHARED.clear()
