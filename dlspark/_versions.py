"""The version check: the packages a job depends on, compared on client, scheduler and workers.

Versions are collected by Dask's own machinery (``Client.get_versions``, which asks
every process for its installed distributions); what dlspark adds is the list of
packages that must agree and a table that names every process's version.
"""

from __future__ import annotations

from distributed.utils import asciitable

from .errors import VersionMismatchError

__all__ = ["CHECKED_PACKAGES", "cluster_versions", "version_table", "check_versions"]

#: Packages whose versions must agree between the client and every worker: the job's
#: code and pickles (dlspark, cloudpickle), the numerics and their compiled kernels.
CHECKED_PACKAGES = ("dlspark", "jax", "jaxlib", "optax", "flax", "numpy", "cloudpickle")
_ROWS = ("python",) + CHECKED_PACKAGES
_MISSING = "MISSING"


def cluster_versions(client) -> dict:
    """``{process: {package: version}}`` for the client, the scheduler and each worker
    (``"worker <name>"``), over Python and :data:`CHECKED_PACKAGES`."""
    raw = client.get_versions(check=False, packages=list(CHECKED_PACKAGES))
    names = {a: w.get("name", a) for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}

    def pick(entry):
        pkgs = (entry or {}).get("packages") or {}
        return {p: str(pkgs[p]) if pkgs.get(p) is not None else _MISSING for p in _ROWS}

    out = {"client": pick(raw.get("client")), "scheduler": pick(raw.get("scheduler"))}
    for addr in sorted(raw.get("workers", {}), key=lambda a: str(names.get(a, a))):
        out[f"worker {names.get(addr, addr)}"] = pick(raw["workers"][addr])
    return out


def _mismatches(versions: dict) -> dict:
    return {p: {proc: v[p] for proc, v in versions.items()} for p in _ROWS
            if len({v[p] for v in versions.values()}) > 1}


def version_table(versions: dict, only_mismatched: bool = False) -> str:
    """An ASCII table: one row per package, one column for the client, the scheduler and
    each group of workers that agree (named by their members)."""
    procs = list(versions)
    workers = [p for p in procs if p.startswith("worker ")]
    groups: dict = {}
    for w in workers:
        groups.setdefault(tuple(versions[w][p] for p in _ROWS), []).append(w[len("worker "):])
    columns = [("client", versions["client"]), ("scheduler", versions["scheduler"])] if "scheduler" in versions \
        else [("client", versions["client"])]
    for key, members in groups.items():
        shown = ", ".join(members[:4]) + (f" and {len(members) - 4} more" if len(members) > 4 else "")
        label = f"worker {shown}" if len(members) == 1 else f"workers {shown}"
        columns.append((label, dict(zip(_ROWS, key))))
    bad = _mismatches(versions)
    rows = [p for p in _ROWS if not only_mismatched or p in bad]
    return asciitable(["package"] + [c[0] for c in columns], [[p] + [c[1][p] for c in columns] for p in rows])


def check_versions(client) -> dict:
    """Compare the versions on ``client``'s cluster; raise :class:`~dlspark.errors.VersionMismatchError`
    with a table of the packages that differ. Returns the versions when they agree."""
    versions = cluster_versions(client)
    bad = _mismatches(versions)
    if bad:
        raise VersionMismatchError(
            "the client, the scheduler and the workers run different versions of packages a dlspark job "
            f"depends on ({', '.join(bad)}):\n\n{version_table(versions, only_mismatched=True)}\n\n"
            "Install the same versions everywhere: start the workers from the client's environment or "
            "image, or install on the workers with distributed.diagnostics.plugin.PipInstall / "
            "UploadDirectory. Set dlspark.client.check-versions to false to skip this check.", bad)
    return versions
