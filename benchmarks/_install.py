"""What decides a benchmark's figures besides dlspark's own code: the packages' versions and
the CPU. The parity suite stamps each result with it (``bench_suite.py``), the network
benchmark its run (``bench_network.py``)."""

from __future__ import annotations

import contextlib
import hashlib
import platform

#: the packages whose versions decide a result's bits besides dlspark's own code
NUMERIC_PACKAGES = ("jax", "jaxlib", "flax", "optax", "numpy")


def install(packages=NUMERIC_PACKAGES) -> str:
    """The versions of ``packages`` (a missing one is named so) and the CPU's model and a digest
    of its feature flags (XLA:CPU compiles for the features it finds there). The same code on
    two installs can part in the low bits, which on the parity suite's noisiest tasks moves a
    seed by points."""
    from importlib import metadata

    def version(p):
        try:
            return metadata.version(p)
        except metadata.PackageNotFoundError:
            return "not installed"

    named = ", ".join(f"{p} {version(p)}" for p in packages)
    model, flags = "CPU model unknown", ""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "CPU model unknown":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = " ".join(sorted(value.split()))
    digest = install_id(flags) if flags else "unknown"
    return f"{named}; {model} ({platform.machine()}, CPU flags {digest})"


def install_id(text: str) -> str:
    """A result's short name for its :func:`install` (a results file maps it back);
    :func:`install` names the CPU's feature flags the same way."""
    return hashlib.sha1(text.encode()).hexdigest()[:8]
