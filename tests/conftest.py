import atexit
import collections
import os
import shutil
import tempfile

# Keep every process in the test run on one XLA CPU thread pool of modest size;
# worker processes set their own environment before JAX starts.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# One JAX compilation cache for the whole run, this process and every process it starts
# (Dask workers, subprocesses, SLURM jobs inherit the variables): the suite starts dozens of
# clusters whose workers compile the same small networks again and again. Measured on
# tests/test_sharing.py and tests/test_worker_rounds.py on 2 cores: 121 s without, 73 s with
# (the cache starting empty, as in CI). Made only by the process that starts the run (spawned
# workers import this module too, and inherit the variables). No size limit: under one, JAX
# lists and reads every entry of the directory at each write (to evict the oldest) and holds a
# file lock meanwhile, which grew with the run's thousands of entries to about a sixth of its
# CPU time. Without the lock a process may read an entry another is still writing: JAX cannot
# decompress it, warns (not an error here, see pyproject.toml) and compiles again.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="dlspark-tests-jax-cache-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

# XLA compiles the run's programs at its fastest, in this process and every process it starts
# (the variable is inherited; XLA reads it when JAX starts its backend): its lowest optimisation
# level, no expensive LLVM passes, the older fusion emitters (the newer ones take several times
# as long to compile a small network). The tests' networks are small: compiling was a tenth of the
# run's CPU time and running the compiled steps under one percent. Every process of the run
# compiles alike, so comparisons of bits between processes are unchanged; a test of a claim that
# rests on how XLA compiles two different programs (a fused round has the bits of its steps one
# at a time) runs under XLA's defaults in a process of its own (``under_xla_defaults``). Measured,
# the whole suite on this 2-core machine: 1,492 s at XLA's defaults, 1,170 s at level 0 alone,
# 974 s with all three. Not set where the run's environment already chooses a level (to run
# the suite at XLA's defaults: ``XLA_FLAGS=--xla_backend_optimization_level=3``), nor where this
# JAX does not know the settings (XLA stops a process at an unknown flag).
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                "--xla_cpu_use_fusion_emitters=false")


def _xla_accepts(flags):
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    probe = "import jax.numpy as jnp; (jnp.ones(2) + 1).block_until_ready()"
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, check=False).returncode == 0


# probed once per run: the processes it starts inherit the outcome
_CHOSEN = "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", "")
if not _CHOSEN and not os.environ.get("DLSPARK_TESTS_XLA_PROBED"):
    os.environ["DLSPARK_TESTS_XLA_PROBED"] = "1"
    if _xla_accepts(FAST_COMPILE):
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *FAST_COMPILE]).strip()


_AT_XLA_DEFAULTS = {}  # test function's node id -> its pytest run at XLA's defaults


def xla_at_defaults():
    """True where this run compiles at XLA's default settings (not ``FAST_COMPILE``)."""
    return not set(FAST_COMPILE) & set(os.environ.get("XLA_FLAGS", "").split())


def under_xla_defaults(request):
    """For a test whose claim rests on how XLA compiles (two different programs, the same bits):
    True where this process compiles at XLA's defaults, and the test goes on; elsewhere the test
    function (every parametrization, in one run) runs again in a pytest process of its own at
    XLA's defaults (its workers inherit them), which must pass, and False: the caller returns."""
    import subprocess
    import sys

    if xla_at_defaults():
        return True
    flags = os.environ.get("XLA_FLAGS", "").split()
    node = request.node.nodeid.split("[")[0]
    if node not in _AT_XLA_DEFAULTS:
        env = dict(os.environ, XLA_FLAGS=" ".join([f for f in flags if f not in FAST_COMPILE]
                                                  + ["--xla_backend_optimization_level=3"]))
        _AT_XLA_DEFAULTS[node] = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", node],
            cwd=request.config.rootpath, env=env, capture_output=True, text=True, timeout=600, check=False)
    r = _AT_XLA_DEFAULTS[node]
    assert r.returncode == 0 and " passed" in r.stdout, (
        f"at XLA's default settings, {node} failed:\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}")
    return False


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

# Several CPU devices in the test process, as equinox's conftest gives it, so that multi-device
# code (ParallelWrapper) is tested on any machine. JAX's setting, not XLA_FLAGS: the spawned Dask
# worker processes must not inherit it. It must come before any JAX operation starts a backend.
try:
    jax.config.update("jax_num_cpu_devices", 2)
except RuntimeError:
    # Not the test process: a Dask worker or a Spark executor that unpickles a class defined
    # here (MLP below) imports this module after its own JAX started; it keeps its devices.
    # (Were it the test process, every ParallelWrapper test would fail on one device.)
    pass

import flax.linen as nn  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import dlspark  # noqa: E402


class FiniteOutputs(nn.Module):
    """A model whose outputs hide a non-finite input: the loss stays finite, the gradient does not."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(10)(x)
        return jnp.where(jnp.isfinite(h), h, 0.0)


class MLP(nn.Module):
    """The small digits classifier used across tests."""

    hidden: int = 64
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Dense(self.hidden)(x))
        if self.dropout:
            x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(10)(x)


class SmallConv(nn.Module):
    """A digits classifier that convolves (its steps are compiled unrolled where they are fused)."""

    @nn.compact
    def __call__(self, x, train=False):
        x = nn.relu(nn.Conv(4, (3, 3))(x.reshape(x.shape[0], 8, 8, 1)))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


class HalfMLP(nn.Module):
    """The digits classifier with bfloat16 parameters (computing in float32)."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.relu(nn.Dense(24, param_dtype=jnp.bfloat16, dtype=jnp.float32)(x))
        return nn.Dense(10, param_dtype=jnp.bfloat16, dtype=jnp.float32)(h)


class BNNet(nn.Module):
    """A network with batch-norm statistics (non-trainable state)."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(32)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(10)(nn.relu(x))


# Each test file runs whole on one of the two xdist processes (--dist loadfile), handed out in
# the order of this hook's items (--no-loadscope-reorder): the files with the most tests first,
# as xdist's own order has it, but files of few and long tests before them: by test count xdist
# handed them out among the last files, and the run's end waited on them (the device script's
# dry run, about 140 s; the emulated network's faults, about 110 s; SLURM's jobs and the train
# command on them, about 100 s together, which had ended a run about 30 s after the other
# process was done).
FIRST = ("test_device_dryrun.py", "test_network_emulated.py", "test_slurm.py", "test_train_command.py")


def pytest_collection_modifyitems(config, items):
    count = collections.Counter(item.path for item in items)
    first = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: (first.get(item.path.name, len(FIRST)), -count[item.path], str(item.path)))


# Test files that share a costly session fixture go to the same xdist process, as one unit of
# --dist loadfile: the compat modules share ``sc`` (Spark's JVM and its Python daemon, which
# imports JAX, Keras and dlspark), started once rather than on both processes.
SAME_PROCESS = {"tests/test_compat_programs.py": "tests/test_compat.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesSharingFixtures(LoadFileScheduling):
        def _split_scope(self, nodeid):
            path = super()._split_scope(nodeid)
            return SAME_PROCESS.get(path, path)

    return FilesSharingFixtures(config, log)


@pytest.fixture(scope="session")
def digits():
    return dlspark.datasets.digits()


@pytest.fixture
def make_net(digits):
    import optax

    def make(module=None, updater=None, loss="softmax_cross_entropy", seed=0, **kw):
        module = module if module is not None else MLP()
        model = dlspark.Model.from_flax(module, digits[0].features[:1])
        return dlspark.Network(model, loss=loss, updater=updater or optax.adam(1e-2), seed=seed, **kw)

    return make


def accuracy(net, ds):
    return float((np.asarray(net.output(ds.features)).argmax(-1) == np.asarray(ds.labels).argmax(-1)).mean())


def tree_equal(a, b):
    import jax

    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)
    )


def _cluster_client(n):
    from distributed import Client

    from dlspark.cluster import local_cluster

    with local_cluster(n) as cluster, Client(cluster) as client:
        yield client


@pytest.fixture(scope="module")
def client1():
    """A real LocalCluster of one worker process (one per test module)."""
    yield from _cluster_client(1)


@pytest.fixture(scope="session")
def _cluster2():
    """The two-worker LocalCluster that every module asking for ``client2`` in one test process
    shares: each start cost about 8 CPU-s (two spawned workers importing JAX, the first fit's
    compilations), a dozen times a run before."""
    from dlspark.cluster import local_cluster

    with local_cluster(2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client2(_cluster2):
    """A real LocalCluster of two worker processes, shared between test modules (a worker a
    test killed has been restarted by its nanny when the next module starts); a fresh client
    per module."""
    from distributed import Client

    with Client(_cluster2) as client:
        client.wait_for_workers(2, timeout=60)
        yield client


@pytest.fixture(scope="session")
def sc():
    """One pyspark SparkContext for the whole run (local[2], a 1 MiB cap on what reaches the
    driver), shared by every compat test module: starting Spark's JVM costs seconds."""
    pytest.importorskip("pyspark")
    import sys
    from pathlib import Path

    from pyspark import SparkConf, SparkContext

    before = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = sys.executable  # the executors' Python: this one, with dlspark installed
    conf = (SparkConf().setMaster("local[2]").setAppName("dlspark-compat-tests")
            .set("spark.driver.maxResultSize", "1m")
            .set("spark.ui.enabled", "false")
            # the driver's JVM (Spark's executors too, in local mode) lives a few minutes: its quick
            # compiler alone and one collector thread. Measured on tests/test_compat.py: the JVM's
            # CPU time 47 s with Java's defaults, 21 s so
            .set("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
            # the executors unpickle the tests' model classes (conftest.MLP) and helpers
            .set("spark.executorEnv.PYTHONPATH", str(Path(__file__).parent))
            # each executor process compiles every network it meets; share the compiled code on disk
            .set("spark.executorEnv.JAX_COMPILATION_CACHE_DIR", os.environ["JAX_COMPILATION_CACHE_DIR"])
            .set("spark.executorEnv.JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
            # workers forked from a daemon that has imported JAX, dlspark and the tests' model
            # libraries (tests/spark_daemon.py, dlspark.spark.daemon's with Keras and Equinox)
            .set("spark.python.daemon.module", "spark_daemon")
            .set("spark.ui.showConsoleProgress", "false"))
    context = SparkContext.getOrCreate(conf)
    context.setLogLevel("ERROR")
    yield context
    context.stop()
    if before is None:
        os.environ.pop("PYSPARK_PYTHON", None)
    else:
        os.environ["PYSPARK_PYTHON"] = before


def kill_at_round(client, round_no):
    """A fit callback that SIGKILLs one worker process when ``round_no`` completes.

    Returns ``(callback, event)``; the event is set once the kill happened.
    """
    import os
    import signal
    import threading

    client.wait_for_workers(2, timeout=120)  # a worker an earlier test killed may still be restarting
    pids = client.run(os.getpid)
    victim = sorted(pids)[1]
    killed = threading.Event()

    def on_round(stat):
        if stat["round"] == round_no and not killed.is_set():
            killed.set()
            os.kill(pids[victim], signal.SIGKILL)

    return on_round, killed


def slow_loader(delay, pid=None):
    """A minibatch loader that sleeps ``delay`` s per file: slow rounds leave the nanny
    time to restart a killed worker and let it rejoin while the fit is still running.
    With ``pid``, only in that worker process (the others load at full speed)."""

    def load(url):
        import os
        import time

        if pid is None or os.getpid() == pid:
            time.sleep(delay)
        return dlspark.data.load_minibatch(url)

    return load


def _reset_a_stray_dask_default(nodeid, when):
    """Dask's Client, made default, sets ``scheduler: dask.distributed`` and on close restores
    what it found, but only where no other default client is alive: two such clients closed in
    the order they were made (one garbage-collected late, say) leave the setting on with no
    client, and a later test's ``compute()`` of a Dask collection fails with "no Client
    active". Seen once in a clean-clone run, in the first tests of tests/test_frames.py.
    Reset, as Dask's own test harness resets its configuration between tests, with a line on
    the run's stderr that names the test where it was found (the run treats warnings as errors)."""
    import sys

    import dask
    from distributed import Client

    if dask.config.get("scheduler", None) not in ("dask.distributed", "distributed"):
        return
    try:
        Client.current(allow_global=True)
    except ValueError:
        dask.config.config.pop("scheduler", None)
        print(f"Dask's scheduler setting was left on 'dask.distributed' with no client ({when} {nodeid}); reset",
              file=sys.__stderr__)


@pytest.fixture(autouse=True)
def _no_stray_dask_default(request):
    _reset_a_stray_dask_default(request.node.nodeid, "before")
    yield
    _reset_a_stray_dask_default(request.node.nodeid, "after")
