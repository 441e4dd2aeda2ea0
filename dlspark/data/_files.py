"""The minibatch file format: one ``.npz`` per minibatch, at any fsspec URL."""

from __future__ import annotations

import io
import math
import os
import re
import struct
import zipfile
import zlib

import fsspec
import numpy as np

from ..errors import CorruptMinibatchError
from ..io import NPY_READ_LOCK, atomic_write, is_glob, read_bytes, url_join
from ._dataset import DataSet, MultiDataSet, as_dataset

__all__ = ["save_minibatches", "save_dataset", "load_minibatch", "list_minibatches"]

_MULTI = re.compile(r"^(features|labels|features_mask|labels_mask)_(\d+)$")
_SINGLE = {"features", "labels", "features_mask", "labels_mask"}


def save_dataset(data, url: str, **storage_options) -> str:
    """Write one DataSet/MultiDataSet to ``url`` as a minibatch file, atomically; returns ``url``."""
    data = as_dataset(data)
    buf = io.BytesIO()
    np.savez(buf, **data.to_arrays())
    with atomic_write(url, "wb", **storage_options) as f:
        f.write(buf.getvalue())
    return url


def save_minibatches(features, labels=None, url: str = None, batch_size: int = 32, *,
                     features_mask=None, labels_mask=None, prefix: str = "batch", overwrite: bool = False,
                     **storage_options) -> list:
    """Export data as minibatch files under the directory ``url`` (DL4J's batch-and-export).

    Parameters
    ----------
    features : array-like, DataSet or MultiDataSet
        The examples; with a DataSet/MultiDataSet, leave ``labels`` out.
    labels : array-like
        Labels with the same number of examples.
    url : str
        Directory URL (``file://``, ``memory://``, ``s3://``, or a local path).
    batch_size : int
        Examples per file; the last file holds the remainder.
    overwrite : bool
        A directory that already holds files of this ``prefix``
        (``{prefix}_*.npz``) is refused, since a fit of the directory would
        train on the old ones left beside the new; ``True`` replaces them: the
        new files are written first, then the old ones not written over are
        removed. Files of other prefixes are left alone (several writers, one
        prefix each, may fill one directory).

    Returns
    -------
    list of str
        The written files' URLs, in example order (``{prefix}_000000.npz``, ...).

    Examples
    --------
    >>> import numpy as np
    >>> urls = save_minibatches(np.zeros((5, 2)), np.zeros((5, 1)), "memory://doc/mb", batch_size=2)
    >>> [u.rsplit("/", 1)[1] for u in urls]
    ['batch_000000.npz', 'batch_000001.npz', 'batch_000002.npz']
    """
    if not isinstance(url, str):
        raise TypeError("save_minibatches needs a directory url as a string, e.g. save_minibatches(x, y, "
                        f"'file:///tmp/mb', 32); got {type(url).__name__} {url!r}")
    if isinstance(features, (DataSet, MultiDataSet)):
        if labels is not None:
            raise TypeError("pass labels inside the DataSet, not beside it")
        data = features
    else:
        if labels is None:
            raise TypeError("save_minibatches needs labels beside the features array")
        data = DataSet(features, labels, features_mask, labels_mask)
    if not data._l or any(y is None for y in data._l):
        raise ValueError("the data set has no labels: a minibatch file holds features and labels, for training "
                         "and evaluation (features alone go to output or predict_with_keys as arrays)")
    if len(data) == 0:
        raise ValueError("the data set holds no examples: there is nothing to save")
    batches = data.batches(batch_size)
    fs, root = fsspec.core.url_to_fs(url, **storage_options)
    mine = re.compile(re.escape(prefix) + r"_\d+\.npz")
    before = sorted(p for p in fs.ls(root, detail=False) if mine.fullmatch(p.rsplit("/", 1)[-1])) \
        if fs.isdir(root) else []
    if before and not overwrite:
        raise FileExistsError(f"{url!r} already holds {len(before)} minibatch file(s) named {prefix}_*.npz, e.g. "
                              f"{before[0]!r}: a fit of the directory would train on them too. Save to an empty "
                              "directory or under another prefix, or pass overwrite=True to replace them")
    width = max(6, len(str(len(batches))))
    written = [save_dataset(b, url_join(url, f"{prefix}_{i:0{width}d}.npz"), **storage_options)
               for i, b in enumerate(batches)]
    stale = set(before) - {fsspec.core.url_to_fs(u, **storage_options)[1] for u in written}
    if stale:
        fs.rm(sorted(stale))
    return written


def _from_arrays(url, arrays):
    keys = set(arrays)
    if {"features", "labels"} <= keys:
        extra = keys - _SINGLE
        if extra:
            raise CorruptMinibatchError(url, f"unexpected arrays {sorted(extra)}")
        return DataSet(arrays["features"], arrays["labels"], arrays.get("features_mask"), arrays.get("labels_mask"))
    groups: dict = {}
    for k in keys:
        m = _MULTI.match(k)
        if not m:
            raise CorruptMinibatchError(
                url, f"array {k!r} is not part of the format; expected 'features' and 'labels' "
                "(and optional masks), or 'features_0', 'labels_0', ... for multi-input data"
            )
        groups.setdefault(m.group(1), {})[int(m.group(2))] = arrays[k]
    if "features" not in groups or "labels" not in groups:
        raise CorruptMinibatchError(url, f"needs features and labels arrays, found only {sorted(keys)}")

    def seq(kind, n):
        d = groups.get(kind, {})
        return [d.get(i) for i in range(n)]

    nf, nl = len(groups["features"]), len(groups["labels"])
    if sorted(groups["features"]) != list(range(nf)) or sorted(groups["labels"]) != list(range(nl)):
        raise CorruptMinibatchError(url, "numbered arrays must run 0, 1, 2, ... without gaps")
    return MultiDataSet(seq("features", nf), seq("labels", nl), seq("features_mask", nf), seq("labels_mask", nl))


def _np_load(raw: bytes) -> dict:
    with NPY_READ_LOCK, np.load(io.BytesIO(raw), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


_NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
#: the bytes before an .npy header's text: magic, version, then the text's length (2 or 4 bytes)
_NPY_PREFIX = {(1, 0): (10, "<H"), (2, 0): (12, "<I")}
#: ``(shape, fortran_order, dtype)`` by the header's bytes: a worker reads thousands of minibatch
#: files of a few shapes, and numpy's parse of a header (a ``literal_eval``) was about 45% of
#: ``_read_npz`` for a minibatch of 8 x 64 (CHANGELOG; ``benchmarks/bench_loading.py``).
#: Bounded: cleared when full.
_PARSED_HEADERS: dict = {}
_PARSED_HEADERS_SIZE = 256


def _npy_header(data: memoryview):
    """``(shape, fortran_order, dtype, data offset)`` of the ``.npy`` file held in ``data``, or
    None for a version other than 1.0 and 2.0. A header seen before is not parsed again: the
    result is a function of its bytes alone, which are the key."""
    with NPY_READ_LOCK:  # numpy's check of the magic string names what is wrong
        version = np.lib.format.read_magic(io.BytesIO(data[:8]))
    if version not in _NPY_PREFIX:
        return None
    size, fmt = _NPY_PREFIX[version]
    end = size + (struct.unpack_from(fmt, data, size - struct.calcsize(fmt))[0] if len(data) >= size else 0)
    key = bytes(data[:end])
    parsed = _PARSED_HEADERS.get(key)
    if parsed is None:
        with NPY_READ_LOCK:  # numpy's parser checks the header and raises on a bad one
            header = io.BytesIO(key)
            np.lib.format.read_magic(header)
            parsed = _NPY_HEADERS[version](header)
        if len(_PARSED_HEADERS) >= _PARSED_HEADERS_SIZE:
            _PARSED_HEADERS.clear()
        _PARSED_HEADERS[key] = parsed
    return (*parsed, end)


def _read_npz(raw: bytes) -> dict:
    """The arrays of the ``.npz`` file ``raw``, as ``np.load(..., allow_pickle=False)`` reads them.

    The members ``np.savez`` writes (stored, uncompressed ``.npy`` files of format 1.0 or
    2.0) are read straight from ``raw`` after their CRC is checked, with no pass through a
    zip member stream: about 40% of the cost of ``np.load`` for a minibatch of 160 KB here,
    which a worker's loading thread pays on the core its steps run on. Each array is its
    own aligned, writable copy. Anything else (``np.savez_compressed``, other members,
    other ``.npy`` versions) goes through ``np.load``.
    """
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
        members = zf.infolist()
    if any(m.compress_type != zipfile.ZIP_STORED or not m.filename.endswith(".npy") for m in members):
        return _np_load(raw)
    arrays = {}
    for m in members:
        # a local file header: 30 fixed bytes, then the name and an extra field of their own lengths
        if raw[m.header_offset:m.header_offset + 4] != b"PK\x03\x04":
            raise zipfile.BadZipFile(f"bad local header for {m.filename!r}")
        name_len, extra_len = struct.unpack_from("<HH", raw, m.header_offset + 26)
        name = raw[m.header_offset + 30:m.header_offset + 30 + name_len]
        if name != m.filename.encode("utf-8" if m.flag_bits & 0x800 else "cp437"):
            raise zipfile.BadZipFile(f"member {m.filename!r} is named {name!r} in its local header")
        start = m.header_offset + 30 + name_len + extra_len
        data = memoryview(raw)[start:start + m.file_size]
        if len(data) != m.file_size or zlib.crc32(data) != m.CRC:
            raise zipfile.BadZipFile(f"member {m.filename!r} is truncated or its CRC does not match")
        header = _npy_header(data)
        if header is None:
            return _np_load(raw)
        shape, fortran, dtype, offset = header
        if dtype.hasobject:
            raise ValueError(f"member {m.filename!r} holds Python objects, which are never unpickled")
        count = math.prod(shape)
        if offset + count * dtype.itemsize != len(data):
            raise ValueError(f"member {m.filename!r} holds {len(data) - offset} bytes of data, "
                             f"not the {count * dtype.itemsize} its header says")
        a = np.frombuffer(raw, dtype, count, start + offset).copy()
        arrays[m.filename[:-4]] = a.reshape(shape[::-1]).T if fortran else a.reshape(shape)
    return arrays


def load_minibatch(url: str, **storage_options):
    """Read one minibatch file into a DataSet or MultiDataSet.

    Nothing in the file is executed (``allow_pickle=False``). A missing,
    truncated or foreign file raises :class:`dlspark.errors.CorruptMinibatchError`
    naming ``url``.
    """
    try:
        raw = read_bytes(url, **storage_options)
    except FileNotFoundError:
        raise CorruptMinibatchError(url, "file not found") from None
    try:
        arrays = _read_npz(raw)
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError, struct.error, NotImplementedError,
            RuntimeError) as e:
        raise CorruptMinibatchError(url, f"not a readable .npz minibatch ({type(e).__name__}: {e})") from None
    try:
        return _from_arrays(url, arrays)
    except CorruptMinibatchError:
        raise
    except (ValueError, TypeError) as e:
        raise CorruptMinibatchError(url, str(e)) from None


def _hidden(path: str) -> bool:
    return path.rstrip("/").rsplit("/", 1)[-1].startswith(".")


def list_minibatches(paths, **storage_options) -> list:
    """Expand a glob, a directory URL or a list of URLs into a sorted list of file URLs.

    A directory yields its ``*.npz`` files. Hidden files (names starting with
    ``.``, such as a writer's temporary files) are never listed. An empty result raises
    ``FileNotFoundError`` naming the path, as does a list naming local files that do not exist
    (a list of remote URLs is taken as it is: a file missing there is named when it is read).
    """
    if isinstance(paths, (list, tuple)):
        if not paths:
            raise FileNotFoundError("the list of minibatch paths is empty")
        paths = [str(p) for p in paths]
        local = [p for p in paths if "://" not in p or p.startswith("file://")]
        missing = [p for p in local if not os.path.isfile(fsspec.core.url_to_fs(p)[1])]
        if missing:
            raise FileNotFoundError(f"{len(missing)} of the {len(paths)} listed minibatch files do not exist, "
                                    f"e.g. {missing[0]!r}")
        return paths
    if not isinstance(paths, str):
        raise TypeError(f"paths must be a URL, a glob or a list of URLs, got {type(paths).__name__}")
    fs, root = fsspec.core.url_to_fs(paths, **storage_options)
    proto = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    unstrip = (lambda p: p) if proto == "file" and "://" not in paths else (lambda p: fs.unstrip_protocol(p))
    if is_glob(paths):
        # Hidden names (a writer's in-flight ``.name.npz.<id>.tmp`` among them) are never
        # listed, unless the pattern itself asks for a dot, as a shell's glob does.
        explicit = root.rsplit("/", 1)[-1].startswith(".")
        found = sorted(p for p in fs.glob(root) if explicit or not _hidden(p))
        what = "glob"
    elif fs.isdir(root):
        found = sorted(p for p in fs.find(root) if p.endswith(".npz") and not _hidden(p))
        what = "directory"
    elif fs.exists(root):
        found = [root]
        what = "file"
    else:
        raise FileNotFoundError(f"no file or directory at {paths!r}")
    if not found:
        raise FileNotFoundError(f"the {what} {paths!r} matched no minibatch files")
    return [unstrip(p) for p in found]
