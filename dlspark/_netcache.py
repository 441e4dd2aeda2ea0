"""The worker-side network cache: one Network, with its compiled steps, per network token.

A worker process rebuilds a network from its definition once per client-side
:attr:`Network.token <dlspark.Network.token>` and keeps it between tasks and
jobs: a fit per epoch, or evaluation after each epoch, compiles once, not
each time. Inference also keeps a few state versions of each network, so
that tasks at one version share its arrays. Both caches are bounded by
``dlspark.worker.network-cache-size`` and ``dlspark.worker.state-cache-size``
(read when an entry is added, so ``dask.config.set`` takes effect at once);
the least recently used entry goes first. Every function is thread-safe:
a worker runs tasks on several threads.
"""

from __future__ import annotations

import collections
import copy
import threading

from . import _stepshare, config

__all__ = ["cached_network", "network_at", "clear"]

#: network token -> [Network, OrderedDict(state version -> TrainState)], least recently used first.
_ENTRIES: collections.OrderedDict = collections.OrderedDict()
_LOCK = threading.Lock()


def _bound(key):
    n = config.get(key)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"dlspark.{key} must be an integer >= 1, got {n!r}")
    return n


def _entry(definition, token):
    """The cache entry for ``token``, built (and older entries evicted) if missing; call under _LOCK."""
    entry = _ENTRIES.get(token)
    if entry is not None:
        _ENTRIES.move_to_end(token)
        return entry
    from .network import Network

    size = _bound("worker.network-cache-size")
    while len(_ENTRIES) >= size:
        _ENTRIES.popitem(last=False)
    # A template of the state, not a fresh one: each job and each inference task sends the
    # state it runs at, and initialising would run (on a fresh worker, compile op by op) the
    # initialisers only to throw their output away
    net = Network.from_definition(definition, template=True)
    # Built here, once: every copy and every task then shares the same jitted functions,
    # so each input shape compiles once per process.
    net.steps  # noqa: B018
    entry = _ENTRIES[token] = [net, collections.OrderedDict()]
    return entry


def cached_network(definition: dict, token: str):
    """The worker's Network for the client-side network ``token``.

    Parameters
    ----------
    definition : dict
        :meth:`Network.definition <dlspark.Network.definition>`, used only
        when the token is not cached yet.
    token : str
        The client-side network's token: one definition, so one compiled network.

    Returns
    -------
    Network
        The same object for every call with ``token`` while it stays cached.
    """
    with _LOCK:
        return _entry(definition, token)[0]


def inference_part(state) -> dict:
    """What inference, evaluation and scoring read of a train state."""
    return {"params": state.params, "model_state": state.model_state}


def network_at(definition: dict, token: str, version: str, state: dict):
    """A view of the cached network ``token`` holding the state ``version``.

    The view is a shallow copy: it shares the compiled steps but holds its
    own state, so tasks at different versions never see each other's arrays.
    ``state`` is :func:`inference_part` of the client's state as
    :func:`dlspark.checkpoint.state_to_arrays` gives it, decoded (and checked
    against the network) once per version while the version stays cached.
    """
    with _LOCK:
        net, states = _entry(definition, token)
        found = states.get(version)
        if found is None:
            from .checkpoint import state_from_arrays

            size = _bound("worker.state-cache-size")
            while len(states) >= size:
                states.popitem(last=False)
            part = state_from_arrays(state, inference_part(net.state), f"network {token}'s state {version}")
            found = states[version] = net.state.replace(**part)
        else:
            states.move_to_end(version)
    view = copy.copy(net)
    view.state = found
    return view


def clear() -> None:
    """Forget every cached network and state, and the step functions shared by networks built
    alike (tests; a worker's memory pressure)."""
    with _LOCK:
        _ENTRIES.clear()
    _stepshare.clear()
