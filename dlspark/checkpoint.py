"""Checkpoints: one zip file per network at any fsspec URL.

Members:

``dlspark.json``
    ``format``, ``format_version``, the list of array leaves (tree path,
    shape, dtype) and the counters.
``arrays.npz``
    The train state's arrays, ``a0``, ``a1``, ... in leaf order, read with
    ``allow_pickle=False``.
``aux.npz``
    Optional: arrays an algorithm keeps beside the train state (an outer
    optimizer's state), ``a0``, ``a1``, ... in leaf order, listed in the
    metadata's ``aux_leaves``.
``definition.pkl``
    The network's definition (model, loss, updater, seed) as a cloudpickle.
    Only :func:`load_checkpoint` (``Network.load``) reads it; it executes code,
    so load only checkpoints you trust. ``Network.restore`` never reads it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import sysconfig
import zipfile

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np

from .errors import CheckpointError
from .io import NPY_READ_LOCK, read_bytes, write_bytes

__all__ = ["zeros_like_output", "save_checkpoint", "restore_checkpoint", "load_checkpoint", "read_checkpoint_meta", "state_to_bytes",
           "state_from_bytes", "state_to_arrays", "state_from_arrays", "read_checkpoint_aux", "fit_checkpoint_bytes", "FORMAT_VERSION"]

FORMAT = "dlspark-checkpoint"
FORMAT_VERSION = 1


def _leaves(tree):
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(p), np.asarray(v)) for p, v in flat], treedef


def _encode_array(a):
    # Extended dtypes (bfloat16, ...) have no portable npy form: store their bytes.
    if a.dtype.kind == "V":
        return np.ascontiguousarray(a).view(np.uint8).reshape(a.shape + (a.dtype.itemsize,))
    return a


def _decode_array(a, dtype, shape):
    dt = jnp.dtype(dtype)
    if dt.kind == "V":
        return np.ascontiguousarray(a).view(dt).reshape(shape)
    return a


def _installed_roots():
    paths = sysconfig.get_paths()
    return tuple({os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths})


def _user_modules(definition):
    """Modules of the user's own code (not installed packages) that the definition refers to."""
    roots = _installed_roots()
    found = set()
    stack = [definition["model"], definition["model"]._init, definition["model"]._apply, definition["loss"]]
    for obj in stack:
        for o in (obj, type(obj), getattr(obj, "module", None), type(getattr(obj, "module", None))):
            name = getattr(o, "__module__", None)
            mod = sys.modules.get(name) if name else None
            f = getattr(mod, "__file__", None)
            if mod is None or f is None or name == "__main__" or name.split(".")[0] == "dlspark":
                continue
            if not os.path.realpath(f).startswith(roots):
                found.add(mod)
    return found


def _dump_definition(definition) -> bytes:
    # The user's model classes live in their own scripts or packages; store
    # those by value, so that Network.load works where that code is absent.
    mods = _user_modules(definition)
    with contextlib.ExitStack() as stack:
        for m in mods:
            cloudpickle.register_pickle_by_value(m)
            stack.callback(cloudpickle.unregister_pickle_by_value, m)
        return cloudpickle.dumps(definition)


def _npz(leaves) -> bytes:
    out = io.BytesIO()
    np.savez(out, **{f"a{i}": _encode_array(a) for i, (_, a) in enumerate(leaves)})
    return out.getvalue()


def _describe(leaves):
    return [{"path": p, "shape": list(a.shape), "dtype": a.dtype.name} for p, a in leaves]


def state_to_bytes(state, extra: dict | None = None, definition: dict | None = None, aux=None) -> bytes:
    """Serialise a train state pytree (and optionally a definition, and ``aux``: a pytree of
    arrays an algorithm keeps beside the state) to checkpoint bytes."""
    leaves, _ = _leaves(state)
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "leaves": _describe(leaves), **(extra or {})}
    aux_leaves = None if aux is None else _leaves(aux)[0]
    if aux_leaves is not None:
        meta["aux_leaves"] = _describe(aux_leaves)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("dlspark.json", json.dumps(meta, indent=1))
        z.writestr("arrays.npz", _npz(leaves))
        if aux_leaves is not None:
            z.writestr("aux.npz", _npz(aux_leaves))
        if definition is not None:
            z.writestr("definition.pkl", _dump_definition(definition))
    return buf.getvalue()


def fit_checkpoint_bytes(state, network, *, step: int, epoch: int, progress: dict, worker_rngs,
                         meta: dict | None = None, aux=None) -> bytes:
    """A fit's checkpoint, as every trainer writes it: ``state`` with the counters ``step`` and
    ``epoch``, where the fit stands (``progress``), every replica's RNG in position order and
    the algorithm's ``meta`` (and ``aux`` arrays); either trainer resumes from it."""
    st = state.replace(step=np.int32(step), epoch=np.int32(epoch))
    extra = {"iteration": step, "epoch": epoch, "seed": network.seed, "fit_progress": progress,
             "worker_rngs": list(worker_rngs), **(meta or {})}
    return state_to_bytes(st, extra, network.definition(), aux=aux)


def _open(url, raw):
    try:
        z = zipfile.ZipFile(io.BytesIO(raw))
        names = set(z.namelist())
    except zipfile.BadZipFile:
        raise CheckpointError(url, "not a dlspark checkpoint (not a zip archive; truncated or another format)") from None
    if "dlspark.json" not in names or "arrays.npz" not in names:
        raise CheckpointError(url, f"not a dlspark checkpoint (members {sorted(names)}; needs dlspark.json and arrays.npz)")
    try:
        meta = json.loads(z.read("dlspark.json"))
    except (ValueError, zipfile.BadZipFile, OSError) as e:
        raise CheckpointError(url, f"unreadable metadata: {e}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(url, f"format is {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(url, f"format version {meta['format_version']} is newer than this dlspark reads ({FORMAT_VERSION}); upgrade dlspark")
    return z, meta


def _read_arrays(url, z, meta, member="arrays.npz", key="leaves"):
    try:
        with NPY_READ_LOCK, np.load(io.BytesIO(z.read(member)), allow_pickle=False) as npz:
            arrays = [npz[f"a{i}"] for i in range(len(meta[key]))]
    except (zipfile.BadZipFile, ValueError, KeyError, OSError, EOFError) as e:
        raise CheckpointError(url, f"array data is truncated or corrupt ({type(e).__name__}: {e})") from None
    return [_decode_array(a, leaf["dtype"], tuple(leaf["shape"])) for a, leaf in zip(arrays, meta[key])]


def _check_leaves(url, got, like):
    """The tree structure of ``like``, once the described leaves ``got`` were found to match it."""
    want, treedef = _leaves(like)
    if len(got) != len(want):
        raise CheckpointError(url, f"holds {len(got)} arrays, the network has {len(want)}; it was saved from a different architecture or updater")
    for (path, a), leaf in zip(want, got):
        if leaf["path"] != path or tuple(leaf["shape"]) != a.shape or leaf["dtype"] != a.dtype.name:
            raise CheckpointError(
                url, f"array {leaf['path']} has shape {tuple(leaf['shape'])} and dtype {leaf['dtype']}, "
                f"the network expects {path} with shape {a.shape} and dtype {a.dtype.name}"
            )
    return treedef


def state_from_bytes(raw: bytes, like, url: str = "<bytes>"):
    """Rebuild a pytree shaped like ``like`` from checkpoint bytes, checking every leaf."""
    z, meta = _open(url, raw)
    treedef = _check_leaves(url, meta["leaves"], like)
    arrays = _read_arrays(url, z, meta)
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(a) for a in arrays])


def zeros_like_output(make):
    """Host zeros with the structure, shapes and dtypes of ``make()``'s result, ``make`` only
    traced (``jax.eval_shape``: nothing computed or compiled): a template to check arrays sent
    from elsewhere against. ``make()`` itself where host arrays cannot stand for the result
    (JAX's extended dtypes: typed PRNG keys) or ``make`` cannot be traced (it reads values on
    the host: ``np.asarray`` of a traced value, an ``if`` on one)."""
    try:
        shapes = jax.eval_shape(make)
    except jax.errors.JAXTypeError:
        return make()
    if any(jax.dtypes.issubdtype(s.dtype, jax.dtypes.extended) for s in jax.tree_util.tree_leaves(shapes)):
        return make()
    return jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), shapes)


def state_to_arrays(state) -> dict:
    """A train state as it moves between processes of a job: its leaves described as a
    checkpoint lists them, and host copies of its arrays, which Dask's comms send as frames
    of their own (no archive, no CRC, no copy into one buffer: for 16.6 MB of parameters and
    Adam moments, 25-120 ms less on the worker than :func:`state_to_bytes` measured here).
    The copies are the caller's own, so the state may be donated to later steps at once."""
    leaves, _ = _leaves(state)
    return {"leaves": _describe(leaves), "arrays": [np.array(_encode_array(a), copy=True) for _, a in leaves]}


def state_from_arrays(payload: dict, like, source: str = "<arrays>"):
    """Rebuild a pytree shaped like ``like`` from :func:`state_to_arrays`, checking every leaf."""
    got, arrays = payload["leaves"], payload["arrays"]
    treedef = _check_leaves(source, got, like)
    if len(arrays) != len(got):
        raise CheckpointError(source, f"describes {len(got)} arrays but holds {len(arrays)}")
    out = []
    for a, leaf in zip(arrays, got):
        a = np.asarray(a)
        shape, dtype = tuple(leaf["shape"]), jnp.dtype(leaf["dtype"])
        stored = shape + (dtype.itemsize,) if dtype.kind == "V" else shape
        if a.shape != stored or (a.dtype != dtype and not (dtype.kind == "V" and a.dtype == np.uint8)):
            raise CheckpointError(source, f"array {leaf['path']} came with shape {a.shape} and dtype {a.dtype}, "
                                          f"described as {shape} and {leaf['dtype']}")
        out.append(jnp.asarray(_decode_array(a, leaf["dtype"], shape)))
    return jax.tree_util.tree_unflatten(treedef, out)


def save_checkpoint(network, url: str, **storage_options) -> None:
    """Write ``network`` (state and definition) to ``url`` atomically."""
    extra = {"iteration": network.iteration, "epoch": network.epoch, "seed": network.seed}
    write_bytes(url, state_to_bytes(network.state, extra, network.definition()), **storage_options)


def _read(url, storage_options):
    try:
        return read_bytes(url, **storage_options)
    except FileNotFoundError:
        raise CheckpointError(url, "file not found") from None


def restore_checkpoint(url: str, like, **storage_options):
    """Read the arrays of the checkpoint at ``url`` into a state shaped like ``like``."""
    return state_from_bytes(_read(url, storage_options), like, url)


def read_checkpoint_meta(url: str, **storage_options) -> dict:
    """The checkpoint's ``dlspark.json`` metadata (format, leaves, counters, fit progress)."""
    return _open(url, _read(url, storage_options))[1]


def read_checkpoint_aux(url: str, **storage_options):
    """The arrays an algorithm kept beside the state (leaf order), or None if there are none."""
    z, meta = _open(url, _read(url, storage_options))
    if "aux_leaves" not in meta:
        return None
    return _read_arrays(url, z, meta, "aux.npz", "aux_leaves")


def load_checkpoint(url: str, from_definition=None, **storage_options):
    """Rebuild a network from ``url``, definition included (trusted files only).

    Parameters
    ----------
    url : str
    from_definition : callable
        ``definition -> network``, :meth:`dlspark.Network.from_definition`
        (``Network.load`` passes it: the checkpoint format sits below the
        network and does not import it).
    **storage_options
        fsspec options.
    """
    if not callable(from_definition):
        raise TypeError("load_checkpoint needs from_definition, the callable that builds the network from its "
                        "definition, e.g. load_checkpoint(url, dlspark.Network.from_definition); or call "
                        f"dlspark.Network.load(url), which passes it (got {type(from_definition).__name__})")
    raw = _read(url, storage_options)
    z, _ = _open(url, raw)
    if "definition.pkl" not in z.namelist():
        raise CheckpointError(url, "holds no network definition; build the network and call net.restore(url)")
    try:
        definition = cloudpickle.loads(z.read("definition.pkl"))
    except Exception as e:
        raise CheckpointError(url, f"the stored definition cannot be unpickled here ({type(e).__name__}: {e})") from None
    net = from_definition(definition)
    net.state = state_from_bytes(raw, net.state, url)
    return net
