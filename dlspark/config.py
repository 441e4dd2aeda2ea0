"""dlspark's settings in ``dask.config``, under the ``dlspark.`` namespace.

The defaults live in ``dlspark.yaml`` beside this module. Every process that
imports dlspark (the client, the scheduler's plugin, each worker) registers
them, and reads a setting when it needs it, so ``dask.config.set`` in a
test, or a Dask config file on a cluster, takes effect without patching.
Spawned workers of a ``LocalCluster`` receive the client's config at start.

Examples
--------
>>> import dask, dlspark
>>> with dask.config.set({"dlspark.scheduler.client-grace": "1s"}):
...     dlspark.config.get_seconds("scheduler.client-grace")
1.0
"""

from __future__ import annotations

import os

import dask.config
import yaml
from dask.utils import parse_timedelta

__all__ = ["get", "get_seconds", "DEFAULTS"]

with open(os.path.join(os.path.dirname(__file__), "dlspark.yaml")) as f:
    DEFAULTS = yaml.safe_load(f)

dask.config.update_defaults(DEFAULTS)


def get(key: str):
    """The setting ``dlspark.<key>`` (e.g. ``get("worker.network-cache-size")``)."""
    return dask.config.get(f"dlspark.{key}")


def get_seconds(key: str) -> float:
    """A duration setting in seconds (``"10s"``, ``"250ms"`` or a number)."""
    return float(parse_timedelta(get(key), default="seconds"))
