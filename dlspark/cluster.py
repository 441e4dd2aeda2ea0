"""The embedded default cluster: worker processes sized to this machine."""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys

__all__ = ["local_cluster", "default_worker_count", "gpu_devices"]

#: Set in every worker's environment before JAX starts there.
WORKER_ENV = {
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",  # GPU workers share memory with data loading
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}

#: Dask settings the nanny hands to each worker process. The statistical
#: profiler samples every thread's stack every 10 ms: on a worker pinned to
#: one core, that time comes out of the compute thread's.
#: Dask also sets ``MALLOC_TRIM_THRESHOLD_=65536`` before spawning workers, which
#: fixes glibc's mmap threshold at 128 KiB: every step's large buffers are then
#: mmap'ed and unmapped anew, measured here to make a jitted CPU step ~3x slower.
#: Our workers keep glibc's adaptive defaults instead.
WORKER_CONFIG = {
    "distributed.worker.multiprocessing-method": "spawn",
    "distributed.worker.profile.enabled": False,
    "distributed.nanny.pre-spawn-environ": {"OMP_NUM_THREADS": 1, "MKL_NUM_THREADS": 1, "OPENBLAS_NUM_THREADS": 1},
    # The nannies live in the client's process, beside the scheduler; their
    # 100 ms memory polls and the system monitors cost ~10% of a core here,
    # taken from whichever worker shares that core.
    "distributed.worker.memory.monitor-interval": "1s",
    "distributed.admin.system-monitor.interval": "2s",
}


_DEVICE_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "rocm": "HIP_VISIBLE_DEVICES"}
_PROBE = (
    "import jax\n"
    "for platform in ('cuda', 'rocm'):\n"
    "    try:\n"
    "        print(platform, len(jax.devices(platform)))\n"
    "        break\n"
    "    except RuntimeError:\n"
    "        pass\n"
)


def _could_have_gpus() -> bool:
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() in ("cpu", "tpu"):
        return False
    if not os.path.exists("/dev"):  # not Linux: ask JAX
        return True
    return any(n.startswith("nvidia") and n[6:].isdigit() for n in os.listdir("/dev")) or os.path.exists("/dev/kfd")


@functools.lru_cache(maxsize=1)
def gpu_devices() -> tuple:
    """The GPUs JAX can use on this machine, as ``(platform, ids)`` to hand one to each worker.

    Asked of JAX in a short-lived subprocess: starting JAX's GPU backend in this
    (the client's) process would take GPU memory the workers need. On machines
    with no GPU device nodes nothing is started. ``ids`` follow an existing
    ``CUDA_VISIBLE_DEVICES``/``HIP_VISIBLE_DEVICES``.
    """
    if not _could_have_gpus():
        return ("", ())
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env,
                             timeout=120, check=True).stdout.split()
        platform, n = (out[0], int(out[1])) if len(out) == 2 else ("", 0)
    except (subprocess.SubprocessError, OSError, ValueError):
        return ("", ())
    if platform not in _DEVICE_ENV:
        return ("", ())
    visible = os.environ.get(_DEVICE_ENV[platform])
    ids = [v.strip() for v in visible.split(",")][:n] if visible else [str(i) for i in range(n)]
    return (platform, tuple(ids)) if n else ("", ())


def default_worker_count() -> int:
    """One worker per GPU if JAX sees GPUs, else one per core this process may use."""
    gpus = len(gpu_devices()[1])
    if gpus:
        return gpus
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def local_cluster(n_workers: int | None = None, *, devices=None, **kwargs):
    """Start a ``LocalCluster`` of single-threaded worker processes for dlspark.

    Worker processes are spawned (not forked: JAX is not fork-safe), each with
    one compute thread; on a GPU machine each worker is given one GPU (its
    ``CUDA_VISIBLE_DEVICES``, ``HIP_VISIBLE_DEVICES`` on ROCm), with JAX's
    memory preallocation off.

    Parameters
    ----------
    n_workers : int, optional
        Defaults to one per GPU, or else one per core (:func:`default_worker_count`).
    devices : list of str, optional
        GPU ids to hand out, one per worker (default: every GPU JAX sees). An
        empty list starts CPU workers on a GPU machine.
    **kwargs
        Passed to :class:`distributed.LocalCluster`.

    Examples
    --------
    >>> from dask.distributed import Client
    >>> client = Client(local_cluster(2))  # doctest: +SKIP
    """
    import dask
    from distributed import LocalCluster

    platform, found = gpu_devices()
    devices = found if devices is None else [str(d) for d in devices]
    platform = platform or "cuda"
    n = (len(devices) or default_worker_count()) if n_workers is None else int(n_workers)
    if n < 1:
        raise ValueError(f"n_workers must be >= 1, got {n_workers!r}")
    if devices and n > len(devices):
        raise ValueError(f"n_workers={n} but only {len(devices)} GPUs ({', '.join(devices)}): "
                         "dlspark runs one worker per GPU; pass n_workers <= the GPU count, or devices=[] for CPU workers")
    env = dict(WORKER_ENV)
    env.update(kwargs.pop("env", {}) or {})
    kwargs.setdefault("dashboard_address", None)
    kwargs.setdefault("silence_logs", 40)
    with dask.config.set(WORKER_CONFIG):
        if not devices:
            return LocalCluster(n_workers=n, threads_per_worker=1, processes=True, env=env, **kwargs)
        cluster = LocalCluster(n_workers=0, threads_per_worker=1, processes=True, env=env, **kwargs)
        # One spec per worker, each with its own device visible.
        for i in range(n):
            spec = copy.deepcopy(cluster.new_spec)
            spec["options"]["env"] = {**env, _DEVICE_ENV[platform]: devices[i]}
            cluster.worker_spec[i] = spec
        try:
            cluster.scale(n)
            cluster.wait_for_workers(n, timeout=120)
        except BaseException:
            cluster.close()
            raise
    return cluster
