"""The embedded default cluster: worker processes sized to this machine."""

from __future__ import annotations

import os

__all__ = ["local_cluster", "default_worker_count"]

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


def _gpu_count() -> int:
    try:
        import jax

        return len(jax.devices("gpu"))
    except Exception:
        return 0


def default_worker_count() -> int:
    """One worker per GPU if JAX sees GPUs, else one per core this process may use."""
    gpus = _gpu_count()
    if gpus:
        return gpus
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def local_cluster(n_workers: int | None = None, **kwargs):
    """Start a ``LocalCluster`` of single-threaded worker processes for dlspark.

    Worker processes are spawned (not forked: JAX is not fork-safe), each with
    one compute thread; on GPUs each worker sees one device.

    Parameters
    ----------
    n_workers : int, optional
        Defaults to :func:`default_worker_count`.
    **kwargs
        Passed to :class:`distributed.LocalCluster`.

    Examples
    --------
    >>> from dask.distributed import Client
    >>> client = Client(local_cluster(2))  # doctest: +SKIP
    """
    import dask
    from distributed import LocalCluster

    n = default_worker_count() if n_workers is None else int(n_workers)
    if n < 1:
        raise ValueError(f"n_workers must be >= 1, got {n_workers!r}")
    env = dict(WORKER_ENV)
    env.update(kwargs.pop("env", {}) or {})
    kwargs.setdefault("dashboard_address", None)
    kwargs.setdefault("silence_logs", 40)
    with dask.config.set(WORKER_CONFIG):
        return LocalCluster(n_workers=n, threads_per_worker=1, processes=True, env=env, **kwargs)
