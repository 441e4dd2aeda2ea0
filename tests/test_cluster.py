"""The embedded cluster: one device per worker on GPU machines, CPU workers elsewhere."""

import os

import pytest
from distributed import Client

from dlspark import cluster as dcluster

pytestmark = pytest.mark.slow


def _worker_view():
    import os

    import jax.numpy as jnp

    return (os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
            float(jnp.arange(4.0).sum()))


def test_each_worker_sees_only_its_own_device():
    # No GPU here: the ids are only handed out, and each worker's JAX still runs
    # (on CPU); on a GPU machine the same variable gives each worker one GPU.
    with dcluster.local_cluster(devices=["5", "7"]) as c, Client(c) as client:
        views = client.run(_worker_view)
    assert sorted(v[0] for v in views.values()) == ["5", "7"]
    assert all(v[1] == "false" and v[2] == 6.0 for v in views.values())


def test_the_embedded_cluster_keeps_dask_housekeeping_off_the_workers_cores():
    # The profiler off, and each server's event-loop timer every second rather than every
    # 20 ms, in the scheduler (this process) as in the workers.
    with dcluster.local_cluster(1) as c, Client(c) as client:
        import dask

        seen = client.run(lambda: (dask.config.get("distributed.worker.profile.enabled"),
                                   dask.config.get("distributed.admin.tick.interval")))
        ticks = client.run(lambda dask_worker: dask_worker.periodic_callbacks["tick"].callback_time)
        scheduler_tick = c.scheduler.periodic_callbacks["tick"].callback_time
    assert list(seen.values()) == [(False, "1s")]
    assert list(ticks.values()) == [1000] and scheduler_tick == 1000


def test_more_workers_than_devices_is_refused():
    with pytest.raises(ValueError, match=r"n_workers=3 but only 1 GPUs \(0\).*devices=\[\] for CPU workers"):
        dcluster.local_cluster(3, devices=["0"])


def test_no_gpu_probe_without_gpu_device_nodes(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert not dcluster._could_have_gpus()
    if not any(n.startswith("nvidia") for n in os.listdir("/dev")) and not os.path.exists("/dev/kfd"):
        monkeypatch.delenv("JAX_PLATFORMS")
        dcluster.gpu_devices.cache_clear()
        assert dcluster.gpu_devices() == ("", ())
        assert dcluster.default_worker_count() == len(os.sched_getaffinity(0))
