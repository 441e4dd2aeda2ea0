"""A worker keeps its freed heap for the next step (``dlspark._malloc``): glibc's trim and mmap
thresholds, set with ``mallopt`` when dlspark's worker plugin reaches a worker.

Measured by what the setting is for: page faults. A worker of a plain Dask cluster starts
with Dask's ``MALLOC_TRIM_THRESHOLD_=65536``, which also fixes glibc's mmap threshold at
128 KiB, so that every buffer above that size is unmapped when freed and the next one faulted
in page by page (256 faults for 1 MiB; a buffer too small to hold a 2 MiB huge page, so that
the count does not depend on the kernel's transparent huge pages); once the plugin has set
the thresholds the freed buffer is reused and the next one costs no fault.
"""

from __future__ import annotations

import dask
import pytest
from distributed import Client, LocalCluster

from dlspark import _malloc
from dlspark.distributed._client import install_plugins

pytestmark = pytest.mark.skipif(_malloc._glibc() is None, reason="glibc's mallopt: this C library is not glibc")


def _faults_per_buffer():
    """Minor page faults per 1 MiB float32 buffer allocated, written and freed, in this process."""
    import numpy as np

    def minor_faults():
        with open("/proc/self/stat") as f:
            stat = f.read()
        return int(stat[stat.rfind(")") + 2:].split()[7])

    np.ones(1 << 18, np.float32).sum()  # a first buffer, whatever the settings
    before = minor_faults()
    for _ in range(20):
        np.ones(1 << 18, np.float32).sum()
    return (minor_faults() - before) / 20


@pytest.mark.parametrize("settings", ["defaults", "null"])
def test_the_worker_plugin_sets_the_thresholds_and_a_freed_buffer_is_reused(settings):
    # null: the worker's config leaves glibc alone, and the buffer is faulted in anew as before
    off = {"dlspark.worker.malloc-trim-threshold": None, "dlspark.worker.malloc-mmap-threshold": None}
    with dask.config.set(off if settings == "null" else {}), \
            LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None,
                         env={"MALLOC_TRIM_THRESHOLD_": "65536"}) as cluster, Client(cluster) as client:
        before = client.run(_faults_per_buffer)
        install_plugins(client, pin=False)
        after = client.run(_faults_per_buffer)
    (b,), (a,) = before.values(), after.values()
    assert b > 200, f"without the plugin's settings a 1 MiB buffer should be faulted in anew: {b} faults a buffer"
    if settings == "null":
        assert a > 200, f"with the settings null glibc should be left as it was: {a} faults a buffer"
    else:
        assert a < 10, f"with the plugin's settings a freed 1 MiB buffer should be reused: {a} faults a buffer"


def test_sizes_are_read_as_dask_reads_them_and_bad_ones_are_refused_by_name():
    assert _malloc._size("x", "64MiB") == 64 * 2**20 and _malloc._size("x", 4096) == 4096
    assert _malloc._size("x", None) is None and _malloc.set_thresholds(None, None) == {}
    with pytest.raises(ValueError, match="the malloc trim threshold must be a size such as '64MiB'.*'lots'"):
        _malloc.set_thresholds(trim="lots")
    with pytest.raises(ValueError, match="the malloc mmap threshold must be a size.*-5"):
        _malloc.set_thresholds(mmap=-5)
    with pytest.raises(ValueError, match=r"at most 33554432 bytes \(32MiB\) in glibc, got 67108864"):
        _malloc.set_thresholds(mmap="64MiB")
