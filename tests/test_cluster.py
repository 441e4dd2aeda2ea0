"""The embedded cluster: one device per worker on GPU machines, CPU workers elsewhere."""

import os
import signal
import time

import dask
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
        starts = client.run(_worker_origin)
    assert sorted(v[0] for v in views.values()) == ["5", "7"]
    assert all(v[1] == "false" and v[2] == 6.0 for v in views.values())
    # GPU workers are spawned by their nannies, here in this process, and freeze nothing
    assert all(s["parent"] == os.getpid() and s["frozen"] == 0 for s in starts.values()), starts


def _worker_origin():
    """Runs in a worker: the process that started it, what it had frozen, JAX's settings there."""
    import gc
    import os

    import jax
    import numpy as np

    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        parent_cmd = f.read().replace(b"\0", b" ").decode()
    server_threads = len(os.listdir(f"/proc/{os.getppid()}/task"))
    return {"parent": os.getppid(), "parent_cmd": parent_cmd, "parent_threads": server_threads,
            "frozen": gc.get_freeze_count(), "platforms": jax.config.jax_platforms,
            "x64": jax.config.jax_enable_x64, "dtype": str(jax.numpy.arange(4.0).dtype),
            "draw": float(np.random.random()), "probe": os.environ.get("DLSPARK_TEST_PROBE")}


def test_cpu_workers_fork_from_a_server_with_jax_imported_and_keep_their_own_jax_settings(monkeypatch):
    # JAX reads JAX_* at import, which for these workers happened in the fork server; the
    # worker's own values (the platform argument, env=) still reach JAX there
    with dcluster.local_cluster(2, platform="cpu", env={"JAX_ENABLE_X64": "1"}) as c, Client(c) as client:
        first = list(client.run(_worker_origin).values())
    # set here after the server started: a forked worker gets this process's environment, as a spawned one
    monkeypatch.setenv("DLSPARK_TEST_PROBE", "set later")
    with dcluster.local_cluster(1) as c, Client(c) as client:
        (second,) = client.run(_worker_origin).values()
        # killed, the worker is restarted by its nanny: forked from the same server, as at its first start
        ((address, pid),) = client.run(os.getpid).items()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while set(client.scheduler_info(n_workers=-1)["workers"]) in (set(), {address}):
            assert time.monotonic() < deadline, "the nanny did not restart the killed worker"
            time.sleep(0.2)
        (restarted,) = client.run(_worker_origin).values()
    # Dask's own start method is left as it was (dlspark holds it only while a worker starts)
    assert dask.config.get("distributed.worker.multiprocessing-method") == "spawn"
    assert [s["probe"] for s in first] == [None, None] and second["probe"] == restarted["probe"] == "set later"
    for s in first + [second, restarted]:
        assert s["parent"] != os.getpid() and "multiprocessing.forkserver" in s["parent_cmd"], s
        assert s["frozen"] > 100_000, s  # JAX, flax, optax, distributed and dlspark, imported before the fork
        # the server runs no JAX backend (whose threads a fork would lose): one thread, between forks
        assert s["parent_threads"] == 1, s
    assert {s["parent"] for s in first} == {second["parent"]}  # one server per client process
    assert [(s["platforms"], s["x64"], s["dtype"]) for s in first] == [("cpu", True, "float64")] * 2
    # nothing of the first cluster's settings in the next one's workers
    for s in (second, restarted):
        assert (s["platforms"], s["x64"], s["dtype"]) == (os.environ.get("JAX_PLATFORMS"), False, "float32")
    # each forked worker draws its own numpy stream, as a spawned one does
    assert len({s["draw"] for s in first + [second, restarted]}) == 4


def test_start_method_spawn_is_kept_and_bad_values_are_refused():
    with dask.config.set({"dlspark.worker.start-method": "spawn"}):
        with dcluster.local_cluster(1) as c, Client(c) as client:
            (s,) = client.run(_worker_origin).values()
    assert s["parent"] == os.getpid() and s["frozen"] == 0
    with pytest.raises(ValueError, match="start_method must be one of 'auto', 'forkserver', 'spawn', got 'fork'"):
        dcluster.local_cluster(1, start_method="fork")


def test_a_jax_variable_that_jax_cannot_read_is_named():
    from dlspark._forkserver import _parse

    assert _parse("JAX_ENABLE_X64", "On", False) is True and _parse("JAX_NUM_CPU_DEVICES", "3", -1) == 3
    assert _parse("JAX_PLATFORMS", "cpu", None) == "cpu"
    with pytest.raises(ValueError, match="JAX_ENABLE_X64='maybe' in a worker's environment is not a truth value"):
        _parse("JAX_ENABLE_X64", "maybe", False)


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
