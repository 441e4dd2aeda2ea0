"""Storage helpers over fsspec: atomic writes and small text files at any URL."""

from __future__ import annotations

import contextlib
import os
import posixpath
import threading
import uuid

import fsspec

#: Held while numpy reads .npy headers: numpy parses them with ``ast``, whose
#: parser is not thread-safe in some CPython 3.11 releases ("AST constructor
#: recursion depth mismatch" when two threads parse at once).
NPY_READ_LOCK = threading.Lock()

__all__ = ["atomic_write", "write_bytes", "read_bytes", "write_text", "read_text", "url_join", "is_glob",
           "check_writable"]

# On object stores a single PUT is already all-or-nothing, and a rename is a
# copy: there we write in place.  Elsewhere we write a hidden temporary file
# beside the target and rename it, so a crash never leaves a half file under
# the final name.
_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "abfs", "az", "adl"}


def _protocol(fs):
    proto = fs.protocol
    return proto[0] if isinstance(proto, (tuple, list)) else proto


def url_join(base: str, *parts: str) -> str:
    """Join path parts onto a URL (``file:///a`` + ``b`` -> ``file:///a/b``)."""
    out = base.rstrip("/")
    for p in parts:
        out = out + "/" + p.strip("/")
    return out


@contextlib.contextmanager
def atomic_write(url: str, mode: str = "wb", **storage_options):
    """Open ``url`` for writing so that readers see either nothing or the whole file.

    Parameters
    ----------
    url : str
        Any fsspec URL or local path.
    mode : {"wb", "w"}
        Binary or text mode.

    Examples
    --------
    >>> with atomic_write("memory://docs/a.txt", "w") as f:  # doctest: +SKIP
    ...     f.write("hello")
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_write: mode must be 'wb' or 'w', got {mode!r}")
    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    parent = posixpath.dirname(path)
    if parent:
        try:
            fs.makedirs(parent, exist_ok=True)
        except OSError as e:
            if e.errno is None:
                raise
            raise type(e)(e.errno, f"{e.strerror}: {parent!r}, the directory of {url!r}", url) from e
    if _protocol(fs) in _OBJECT_STORES:
        with fs.open(path, mode) as f:
            yield f
        return
    tmp = posixpath.join(parent, f".{posixpath.basename(path)}.{uuid.uuid4().hex}.tmp")
    try:
        with fs.open(tmp, mode) as f:
            yield f
            if _protocol(fs) == "file":
                f.flush()
                os.fsync(f.fileno())
        if _protocol(fs) == "file":
            os.replace(tmp, path)
        else:
            fs.mv(tmp, path)
    except BaseException as e:
        with contextlib.suppress(Exception):
            fs.rm(tmp)
        if isinstance(e, OSError) and e.errno is not None and e.filename != url:
            # the error names the temporary file: name the file being written too
            raise type(e)(e.errno, f"{e.strerror}, writing {url!r} (through the temporary file {tmp!r})",
                          url) from e
        raise


def check_writable(url: str, what: str) -> None:
    """On a local file system, that a file can be written at ``url`` (its directory made if
    missing), so that a fit refuses an unwritable ``checkpoint_url`` before it trains, not at
    its first checkpoint. Other file systems answer when written to."""
    fs, path = fsspec.core.url_to_fs(url)
    if _protocol(fs) != "file":
        return
    parent = posixpath.dirname(path) or "."
    try:
        fs.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise type(e)(e.errno, f"{what} {url!r} cannot be written: its directory {parent!r} cannot be made "
                               f"({e.strerror})", url) from None
    if not os.access(parent, os.W_OK | os.X_OK) or os.path.isdir(path):
        why = "is a directory" if os.path.isdir(path) else f"the directory {parent!r} is not writable"
        raise PermissionError(f"{what} {url!r} cannot be written: {why}; give a file URL in a writable place")


def write_bytes(url: str, data: bytes, **storage_options) -> None:
    """Write ``data`` to ``url`` atomically."""
    with atomic_write(url, "wb", **storage_options) as f:
        f.write(data)


def read_bytes(url: str, **storage_options) -> bytes:
    """Read the whole file at ``url``: one ``cat_file`` (for object stores, one GET,
    where a file object first asks for the size)."""
    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    return fs.cat_file(path)


def write_text(url: str, text: str, **storage_options) -> None:
    """Write ``text`` (UTF-8) to ``url`` atomically; the role of DL4J's ``SparkUtils.writeStringToFile``."""
    write_bytes(url, text.encode("utf-8"), **storage_options)


def read_text(url: str, **storage_options) -> str:
    """Read a UTF-8 text file from ``url``."""
    return read_bytes(url, **storage_options).decode("utf-8")


def is_glob(url: str) -> bool:
    """True if ``url`` holds glob magic (``*``, ``?`` or ``[``)."""
    return any(c in url for c in "*?[")
