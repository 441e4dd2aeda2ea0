"""The embedded default cluster: worker processes sized to this machine."""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys

from . import _worker_start
from ._versions import CHECKED_PACKAGES, check_versions, cluster_versions, version_table

__all__ = ["local_cluster", "slurm_cluster", "jobqueue_options", "default_worker_count", "gpu_devices",
           "worker_env", "keep_client_on_cpu", "check_versions", "cluster_versions", "version_table",
           "CHECKED_PACKAGES", "dashboard_address", "dashboard_listening"]

#: Set in every worker's environment before JAX starts there.
WORKER_ENV = {
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",  # GPU workers share memory with data loading
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    # Keras reads its backend once, at import: Model.from_keras models run on JAX
    "KERAS_BACKEND": "jax",
}

#: Dask settings the nanny hands to each worker process. The statistical
#: profiler samples every thread's stack every 10 ms: on a worker pinned to
#: one core, that time comes out of the compute thread's.
#: Dask also sets ``MALLOC_TRIM_THRESHOLD_=65536`` before spawning workers, which
#: fixes glibc's mmap threshold at 128 KiB: every step's large buffers are then
#: mmap'ed and unmapped anew, measured here to make a jitted CPU step ~3x slower.
#: Our workers are started without it; dlspark's worker plugin then sets glibc's
#: thresholds itself (``dlspark._malloc``), also on clusters dlspark did not start.
WORKER_CONFIG = {
    "distributed.worker.multiprocessing-method": "spawn",
    "distributed.worker.profile.enabled": False,
    # None unsets a default, also where these settings arrive as DASK_* variables (batch jobs),
    # which Dask merges into its defaults rather than replacing them.
    "distributed.nanny.pre-spawn-environ": {"OMP_NUM_THREADS": 1, "MKL_NUM_THREADS": 1, "OPENBLAS_NUM_THREADS": 1,
                                            "MALLOC_TRIM_THRESHOLD_": None},
    # The nannies live in the client's process, beside the scheduler; their
    # 100 ms memory polls and the system monitors cost ~10% of a core here,
    # taken from whichever worker shares that core.
    "distributed.worker.memory.monitor-interval": "1s",
    "distributed.admin.system-monitor.interval": "2s",
    # Every Dask server (the scheduler, each nanny and worker) wakes every 20 ms to time its
    # own event loop. An idle 2-worker cluster here spent 7.8% of a core on that (4.2% in the
    # scheduler's process, 1.6-2.0% in each worker); at 1 s it spends 1.6% (0.9% and 0.3-0.4%).
    # A loop blocked longer than the limit (3 s) is still reported; since the time from the
    # last tick counts toward it, so may one blocked for 2 to 3 s (an info line, not an error).
    "distributed.admin.tick.interval": "1s",
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


def _setting(value, key):
    from . import config

    return config.get(key) if value is None else value


def worker_env(*, preallocate: bool | None = None, memory_fraction: float | None = None,
               platform: str | None = None) -> dict:
    """The environment a dlspark worker gets before JAX starts in it.

    Parameters
    ----------
    preallocate : bool, optional
        ``XLA_PYTHON_CLIENT_PREALLOCATE``: with ``False`` (the default,
        ``dlspark.worker.preallocate``) JAX takes GPU memory as it needs it
        rather than 75% of the GPU at start.
    memory_fraction : float, optional
        ``XLA_PYTHON_CLIENT_MEM_FRACTION``: the share (0, 1] of its GPU a
        worker's JAX may take (``dlspark.worker.memory-fraction``; the role of
        DL4J's ``javacpp.maxbytes``).
    platform : str, optional
        ``JAX_PLATFORMS`` for the workers (``dlspark.worker.platform``); by
        default they inherit it.
    """
    preallocate = _setting(preallocate, "worker.preallocate")
    memory_fraction = _setting(memory_fraction, "worker.memory-fraction")
    platform = _setting(platform, "worker.platform")
    if not isinstance(preallocate, bool):
        raise TypeError(f"preallocate must be True or False, got {preallocate!r}")
    env = dict(WORKER_ENV, XLA_PYTHON_CLIENT_PREALLOCATE=str(preallocate).lower())
    if memory_fraction is not None:
        try:
            fraction = float(memory_fraction)
        except (TypeError, ValueError):
            fraction = float("nan")
        if not 0 < fraction <= 1:
            raise ValueError(f"memory_fraction must be a share of the GPU in (0, 1], e.g. 0.45, got {memory_fraction!r}")
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:g}"
    if platform:
        if not isinstance(platform, str):
            raise TypeError(f"platform must be a JAX platform name such as 'cuda' or 'cpu', got {platform!r}")
        env["JAX_PLATFORMS"] = platform
    return env


def _memory_limit(memory_limit):
    from dask.utils import parse_bytes

    memory_limit = _setting(memory_limit, "worker.memory-limit")
    if memory_limit in ("auto", 0, "0") or memory_limit is False:
        return memory_limit
    try:
        if isinstance(memory_limit, str):
            parse_bytes(memory_limit)
        elif not isinstance(memory_limit, (int, float)) or memory_limit < 0:
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"memory_limit must be 'auto', a size such as '4GiB' or a byte count, got {memory_limit!r}") from None
    return memory_limit


def keep_client_on_cpu() -> None:
    """Keep this process's JAX on CPU (DL4J's "CPUs on the master, GPUs on the workers").

    Call it before this process runs any JAX computation: JAX then never opens a
    GPU here, and the GPUs stay whole for the workers. Only this process's JAX
    configuration changes, not its environment, so workers started from here
    still see their GPUs. ``dlspark.client.cpu-only: true`` (or
    ``client_cpu=True`` on :func:`local_cluster` / :func:`slurm_cluster`) does
    the same.
    """
    import jax

    try:
        from jax._src.xla_bridge import backends_are_initialized
    except ImportError:  # pragma: no cover - older or newer JAX layouts
        def backends_are_initialized():
            return False
    if backends_are_initialized():
        if jax.default_backend() != "cpu":
            raise RuntimeError(f"JAX has already started on {jax.default_backend()} in this process; call "
                               "dlspark.cluster.keep_client_on_cpu() (or set dlspark.client.cpu-only) before any "
                               "JAX computation, or set JAX_PLATFORMS=cpu for the client only")
        return
    jax.config.update("jax_platforms", "cpu")


def _client_cpu(client_cpu):
    if _setting(client_cpu, "client.cpu-only"):
        keep_client_on_cpu()


_GUARD_HELP = (
    "dlspark starts its worker processes with 'spawn' or 'forkserver', which run your script again in "
    "every worker; the code that starts a cluster (local_cluster, DistributedTrainer(None, ...)) must "
    "sit under the main-module guard, e.g.\n\n"
    "    if __name__ == \"__main__\":\n"
    "        trainer = dlspark.DistributedTrainer(None, net, master)\n"
    "        trainer.fit(data)\n"
)


def _is_main_guard(node) -> bool:
    import ast

    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    names = [node.test.left, *node.test.comparators]
    return (any(isinstance(n, ast.Name) and n.id == "__name__" for n in names)
            and any(isinstance(n, ast.Constant) and n.value == "__main__" for n in names))


def _unguarded_main_line():
    """The line of the running script that starts a cluster outside ``if __name__ == "__main__":``,
    or None (guarded, interactive, or not started from a script's module-level code)."""
    import ast

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not str(path).endswith(".py") or not os.path.exists(path):
        return None
    frame = sys._getframe()
    while frame is not None and not (frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None:
        return None
    try:
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (OSError, SyntaxError, ValueError):
        return None
    line = frame.f_lineno
    for node in ast.walk(tree):
        if _is_main_guard(node) and node.lineno <= line <= (node.end_lineno or node.lineno):
            return None
    return f"{path}, line {line}"


def check_main_guard():
    """Refuse to start worker processes from a script's unguarded module-level code.

    Without the guard every spawned worker would run the script again and try to start a
    cluster of its own: multiprocessing stops it with a bootstrapping error in the worker, and
    the cluster waits for workers that never come.
    """
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError("a dlspark cluster was started while a worker process was importing the script. "
                           + _GUARD_HELP)
    where = _unguarded_main_line()
    if where is not None:
        raise RuntimeError(f"{where} starts a dlspark cluster at the top level of the script. " + _GUARD_HELP)


_LOOPBACK = "127.0.0.1"


def dashboard_address(address=None, host: str | None = None) -> str | None:
    """Where a dashboard is to listen, as Dask's ``dashboard_address``; a port alone stays on this machine.

    Dask binds a dashboard given as a port alone (``":8787"``, ``8787``) to
    every network interface. dlspark's clusters bind it to ``host`` (the
    scheduler's, where one was given) or else to 127.0.0.1: the job's pages
    are seen from other machines only when an address says so, such as
    ``"0.0.0.0:8787"`` (every interface) or an interface's own address.

    Parameters
    ----------
    address : str, int, list or None
        ``"127.0.0.1:0"`` (a free port on loopback), ``"0.0.0.0:8787"``, ``":8787"``,
        ``8787``, several separated by commas; None or ``False``: no dashboard.
    host : str, optional
        The scheduler's ``host`` (``local_cluster(host=...)``), used for a port alone.

    A port alone is bound to 127.0.0.1 with a ``UserWarning`` that names the
    way to open it wider, since Dask would have opened it.

    Examples
    --------
    >>> dashboard_address(":8787")  # doctest: +SKIP
    '127.0.0.1:8787'
    >>> dashboard_address("0.0.0.0:8787")
    '0.0.0.0:8787'
    """
    from distributed.utils import clean_dashboard_address

    if address is None or address is False or address == "":
        return None
    if isinstance(address, bool):
        raise TypeError(f"dashboard_address must be an address such as '127.0.0.1:8787' or None, got {address!r}")
    try:
        parsed = clean_dashboard_address(address)
    except (TypeError, ValueError):
        raise ValueError(f"dashboard_address must be HOST:PORT ('127.0.0.1:8787'; '0.0.0.0:8787' for every interface) "
                         f"or a port (':8787', on 127.0.0.1), got {address!r}") from None
    if host and "://" in str(host):
        host = str(host).split("://", 1)[1]
    bare = [a["port"] for a in parsed if not a["address"]]
    if bare and not host:
        import warnings

        # Dask alone listened on every interface here: say so to whoever relied on that.
        warnings.warn(f"dashboard_address={address!r} gives a port without a host: the dashboard listens on "
                      f"{_LOOPBACK} only (this machine). To open it to other machines give a host, e.g. "
                      f"'0.0.0.0:{bare[0]}' (the dashboard_address argument, or dlspark.cluster.dashboard-address "
                      "for DistributedTrainer(None, ...))", UserWarning, stacklevel=3)
    return ",".join(f"{a['address'] or host or _LOOPBACK}:{a['port']}" for a in parsed)


def dashboard_listening(client) -> list:
    """The ``HOST:PORT`` addresses the dashboard of ``client``'s scheduler listens on (empty: no dashboard)."""
    try:
        return client.run_on_scheduler(_dashboard_sockets)
    except Exception:  # a scheduler that refuses run_on_scheduler, or is gone
        return []


def _reach(listening) -> str:
    """Who can open a dashboard that listens on ``listening`` (``HOST:PORT`` strings), in words."""
    hosts = {a.rsplit(":", 1)[0].strip("[]") for a in listening}
    if not hosts:
        return "listening on an unknown address"
    where = ", ".join(listening)
    if all(h.startswith("127.") or h in ("::1", "localhost") for h in hosts):
        return f"listening on {where}: this machine only; dlspark.cluster.dashboard-address opens it wider"
    return f"listening on {where}: other machines can open it"


def _dashboard_sockets(dask_scheduler=None):
    from distributed.comm import get_tcp_server_addresses

    server = getattr(dask_scheduler, "http_server", None)
    if server is None:
        return []
    return [f"[{h}]:{p}" if ":" in str(h) else f"{h}:{p}" for h, p in get_tcp_server_addresses(server)]


def local_cluster(n_workers: int | None = None, *, devices=None, memory_limit=None, preallocate: bool | None = None,
                  memory_fraction: float | None = None, platform: str | None = None,
                  client_cpu: bool | None = None, start_method: str | None = None, **kwargs):
    """Start a ``LocalCluster`` of single-threaded worker processes for dlspark.

    Each worker process has one compute thread; on a GPU machine each worker
    is given one GPU (its ``CUDA_VISIBLE_DEVICES``, ``HIP_VISIBLE_DEVICES`` on
    ROCm), with JAX's memory preallocation off. No worker is forked from a
    process that has started JAX: CPU workers on Linux are forked from a fork
    server that has only imported JAX and dlspark (``dlspark._forkserver``),
    which spares each worker that import; GPU workers, and any elsewhere, are
    spawned.

    Parameters
    ----------
    n_workers : int, optional
        Defaults to one per GPU, or else one per core (:func:`default_worker_count`).
    devices : list of str, optional
        GPU ids to hand out, one per worker (default: every GPU JAX sees). An
        empty list starts CPU workers on a GPU machine.
    memory_limit : str or int, optional
        Each worker's memory limit (``dlspark.worker.memory-limit``; default
        ``"auto"``: the machine's memory split among the workers).
    preallocate, memory_fraction, platform : optional
        JAX's memory and platform settings in each worker, see :func:`worker_env`.
    client_cpu : bool, optional
        Keep this (the client's) process on CPU, see :func:`keep_client_on_cpu`
        (``dlspark.client.cpu-only``).
    start_method : {"auto", "forkserver", "spawn"}, optional
        How worker processes start (``dlspark.worker.start-method``, default
        ``"auto"``: ``"forkserver"`` for CPU workers on Linux, else ``"spawn"``).
        Forked workers are given this process's environment as it is at this
        call (a variable removed from it since the fork server started stays
        in them). A worker its nanny restarts (after a crash or a kill) is
        forked too, as at its first start; Dask's own setting
        (``distributed.worker.multiprocessing-method``) reads ``forkserver``
        only while a nanny starts a worker.
    **kwargs
        Passed to :class:`distributed.LocalCluster`. The scheduler, nannies and
        workers listen on 127.0.0.1 unless ``host`` says otherwise. No
        dashboard runs unless ``dashboard_address`` is given, and a port given
        alone (``":8787"``, ``8787``) listens on ``host``, else on 127.0.0.1
        only (Dask alone would open every interface; see
        :func:`dashboard_address`).

    Examples
    --------
    >>> from dask.distributed import Client
    >>> client = Client(local_cluster(2))  # doctest: +SKIP
    """
    import dask
    from distributed import LocalCluster

    if kwargs.get("processes", True):
        check_main_guard()
    gpu_platform, found = gpu_devices()
    devices = found if devices is None else [str(d) for d in devices]
    gpu_platform = gpu_platform or "cuda"
    n = (len(devices) or default_worker_count()) if n_workers is None else int(n_workers)
    if n < 1:
        raise ValueError(f"n_workers must be >= 1, got {n_workers!r}")
    if devices and n > len(devices):
        raise ValueError(f"n_workers={n} but only {len(devices)} GPUs ({', '.join(devices)}): "
                         "dlspark runs one worker per GPU; pass n_workers <= the GPU count, or devices=[] for CPU workers")
    env = worker_env(preallocate=preallocate, memory_fraction=memory_fraction, platform=platform)
    env.update(kwargs.pop("env", {}) or {})
    kwargs["memory_limit"] = _memory_limit(memory_limit)
    method = _worker_start.start_method(start_method, bool(devices))
    _client_cpu(client_cpu)
    kwargs["dashboard_address"] = dashboard_address(kwargs.get("dashboard_address"), kwargs.get("host"))
    kwargs.setdefault("silence_logs", 40)
    config = dict(WORKER_CONFIG)
    if method == "forkserver":
        config["distributed.worker.multiprocessing-method"] = "forkserver"
        kwargs.setdefault("worker_class", _worker_start.ForkingNanny)  # restarted workers are forked too
        config["distributed.worker.preload"] = [*(dask.config.get("distributed.worker.preload", None) or []),
                                                _worker_start.WORKER_PRELOAD]
        # a forked worker starts with the server's environment, not this process's: given it
        # whole, as a spawned worker inherits it (the worker's own variables win)
        env = {**os.environ, **env}
    with dask.config.set(config):
        if method == "forkserver":
            _worker_start.preload_fork_server()
        if not devices:
            return LocalCluster(n_workers=n, threads_per_worker=1, processes=True, env=env, **kwargs)
        cluster = LocalCluster(n_workers=0, threads_per_worker=1, processes=True, env=env, **kwargs)
        # One spec per worker, each with its own device visible.
        for i in range(n):
            spec = copy.deepcopy(cluster.new_spec)
            spec["options"]["env"] = {**env, _DEVICE_ENV[gpu_platform]: devices[i]}
            cluster.worker_spec[i] = spec
        try:
            cluster.scale(n)
            cluster.wait_for_workers(n, timeout=120)
        except BaseException:
            cluster.close()
            raise
    return cluster


def _dask_env(config: dict) -> dict:
    """Dask settings as the ``DASK_...`` environment variables a batch job reads at start."""
    return {"DASK_" + key.upper().replace(".", "__").replace("-", "_"): repr(value) if not isinstance(value, str) else value
            for key, value in config.items()}


def jobqueue_options(*, memory_limit=None, preallocate: bool | None = None, memory_fraction: float | None = None,
                     platform: str | None = None, job_script_prologue=()) -> dict:
    """Keyword arguments that make any dask-jobqueue cluster start workers as dlspark needs them.

    One worker process per job with one compute thread (``cores=1,
    processes=1``), spawned, not forked; Dask's profiler off; JAX's memory and
    platform settings (:func:`worker_env`) exported before the worker, and so
    JAX, starts. Pass them to ``PBSCluster``, ``LSFCluster``, ``SGECluster``
    ... and book the job's cores and GPU in that scheduler's own terms
    (``resource_spec``, ``ncpus``, ``job_extra_directives``); XLA's CPU thread
    pool uses the cores the job is bound to. :func:`slurm_cluster` does all of
    this for SLURM.

    Examples
    --------
    >>> from dask_jobqueue import PBSCluster  # doctest: +SKIP
    >>> cluster = PBSCluster(resource_spec="select=1:ncpus=4:ngpus=1:mem=16GB", queue="gpu",
    ...                      **jobqueue_options(memory_limit="16GB", platform="cuda"))
    """
    import shlex

    env = worker_env(preallocate=preallocate, memory_fraction=memory_fraction, platform=platform)
    env.update(_dask_env(WORKER_CONFIG))
    options = {
        "cores": 1,
        "processes": 1,
        "job_script_prologue": [f"export {k}={shlex.quote(str(v))}" for k, v in env.items()] + list(job_script_prologue),
    }
    memory = _memory_limit(memory_limit)
    if memory not in ("auto", 0, "0", False):
        options["memory"] = memory if isinstance(memory, str) else f"{int(memory)}B"
    return options


def _jobqueue_names(kwargs, cores_per_worker, memory_limit):
    """Take dask-jobqueue's ``cores``, ``memory`` and ``processes`` out of ``kwargs`` as :func:`slurm_cluster`'s names.

    Its users type ``SLURMCluster``'s names first; they mean the same here, except that a job
    always runs one worker process (``processes=1``).
    """
    if "processes" in kwargs:
        processes = kwargs.pop("processes")
        if processes != 1:
            raise ValueError(f"processes: each SLURM job runs one dlspark worker (processes=1), got processes="
                             f"{processes!r}; ask for more workers with n_workers or cluster.scale(n), and for a "
                             "job's cores with cores_per_worker")
    if "cores" in kwargs:
        cores = kwargs.pop("cores")
        if cores_per_worker not in (1, cores):
            raise ValueError(f"cores={cores!r} and cores_per_worker={cores_per_worker!r} disagree: cores is "
                             "dask-jobqueue's name for slurm_cluster's cores_per_worker; give one of them")
        cores_per_worker = cores
    if "memory" in kwargs:
        memory = kwargs.pop("memory")
        if memory_limit is not None and memory_limit != memory:
            raise ValueError(f"memory={memory!r} and memory_limit={memory_limit!r} disagree: memory is "
                             "dask-jobqueue's name for slurm_cluster's memory_limit; give one of them")
        memory_limit = memory
    return cores_per_worker, memory_limit


def slurm_cluster(n_workers: int = 0, *, gpus_per_worker: int = 0, cores_per_worker: int = 1, memory_limit=None,
                  preallocate: bool | None = None, memory_fraction: float | None = None, platform: str | None = None,
                  client_cpu: bool | None = None, job_extra_directives=(), job_script_prologue=(), **kwargs):
    """A dask-jobqueue ``SLURMCluster`` whose jobs are dlspark workers, one per GPU or core group.

    Each job runs one single-threaded worker, spawned, with JAX's environment
    set before it starts (:func:`jobqueue_options`). With ``gpus_per_worker``
    the job asks for its GPUs through ``--gres=gpu:N`` and SLURM makes only
    those visible to it (``CUDA_VISIBLE_DEVICES``); without, the workers run
    JAX on CPU (unless ``platform`` says otherwise) over ``cores_per_worker``
    cores, confined to them where the site's ``TaskPlugin`` binds jobs to cores
    (``task/cgroup``, ``task/affinity``). ``scale``, ``adapt`` and a
    cancelled job mid-fit all work: a worker that joins is set up at the next
    round, one that leaves is a lost worker.

    Parameters
    ----------
    n_workers : int
        Jobs to submit now (more later with ``cluster.scale`` / ``cluster.adapt``).
    gpus_per_worker : int
        GPUs per worker (0: a CPU worker).
    cores_per_worker : int
        Cores booked per worker (``--cpus-per-task``).
    memory_limit : str, optional
        The job's memory and the worker's limit (``dlspark.worker.memory-limit``;
        default: ``jobqueue.slurm.memory`` from dask-jobqueue's configuration).
    preallocate, memory_fraction, platform : optional
        See :func:`worker_env`.
    client_cpu : bool, optional
        Keep this process's JAX on CPU (:func:`keep_client_on_cpu`).
    **kwargs
        Passed to ``dask_jobqueue.SLURMCluster`` (``queue``, ``account``,
        ``walltime``, ``interface``, ``log_directory``, ``python`` ...).
        dask-jobqueue's own names for what this function sets are taken too:
        ``cores`` as ``cores_per_worker``, ``memory`` as ``memory_limit``, and
        ``processes=1`` (one worker per job is how dlspark runs).

    Examples
    --------
    >>> cluster = slurm_cluster(4, gpus_per_worker=1, cores_per_worker=8, memory_limit="32GB",
    ...                         queue="gpu", walltime="02:00:00")  # doctest: +SKIP
    >>> trainer = dlspark.DistributedTrainer(cluster, net, master)  # doctest: +SKIP
    """
    try:
        from dask_jobqueue import SLURMCluster
    except ImportError:  # pragma: no cover - the hpc extra
        raise ImportError("slurm_cluster needs dask-jobqueue: pip install 'dlspark[hpc]'") from None
    cores_per_worker, memory_limit = _jobqueue_names(kwargs, cores_per_worker, memory_limit)
    gpus = int(gpus_per_worker)
    if gpus < 0:
        raise ValueError(f"gpus_per_worker must be >= 0, got {gpus_per_worker!r}")
    if not gpus and platform is None and _setting(None, "worker.platform") is None:
        platform = "cpu"  # a job given no GPU must not open the node's GPUs
    cores = int(cores_per_worker)
    if cores < 1:
        raise ValueError(f"cores_per_worker must be >= 1, got {cores_per_worker!r}")
    options = jobqueue_options(memory_limit=memory_limit, preallocate=preallocate, memory_fraction=memory_fraction,
                               platform=platform, job_script_prologue=job_script_prologue)
    directives = list(job_extra_directives) + ([f"--gres=gpu:{gpus}"] if gpus else [])
    _client_cpu(client_cpu)
    cluster = SLURMCluster(job_extra_directives=directives, job_cpu=cores, **options, **kwargs)
    if n_workers:
        cluster.scale(int(n_workers))
    return cluster
