"""Whole fits on workers that a real single-node SLURM launched (dask-jobqueue's SLURMCluster).

The module starts SLURM with ``.ci/slurm-up.sh`` (munged, slurmctld, slurmd; root needed) and
stops what it started once no other test process uses it. Without SLURM installed the tests
skip, saying how to install it; with ``DLSPARK_REQUIRE_SLURM=1`` (CI) they fail instead.
"""

import os
import pathlib
import shutil
import subprocess
import threading

import optax
import pytest
from conftest import MLP, accuracy, slow_loader
from distributed import Client

import dlspark
from dlspark import DistributedTrainer, GradientSharing, ParameterAveraging
from dlspark.cluster import slurm_cluster

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
INSTALL = "apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge"


def _unavailable(reason):
    if os.environ.get("DLSPARK_REQUIRE_SLURM") == "1":
        pytest.fail(f"DLSPARK_REQUIRE_SLURM=1 but {reason}")
    pytest.skip(reason)


def _slurm_up(command):
    return subprocess.run(["bash", str(ROOT / ".ci" / "slurm-up.sh"), command], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def slurm():
    """A running single-node SLURM; its configuration reaches sbatch/scancel through SLURM_CONF.

    Several test processes (pytest-xdist) may use it at once, each holding a lease (a file named by
    its pid) while its module runs: the last one out stops the daemons, and only if a test started
    them. Stopping cancels every job, so one module's end must not stop a SLURM that another
    process's jobs still run on."""
    import psutil
    from filelock import FileLock

    missing = [t for t in ("munged", "slurmctld", "slurmd", "sbatch", "scancel") if shutil.which(t) is None]
    if missing:
        _unavailable(f"SLURM is not installed ({', '.join(missing)} missing); on Debian as root: {INSTALL}")
    if os.geteuid() != 0:
        _unavailable("starting a test SLURM (munged, slurmctld, slurmd) needs root")
    home = pathlib.Path(os.environ.get("DLSPARK_SLURM_DIR", "/tmp/dlspark-slurm"))
    leases, ours = home / "test-leases", home / "started-by-tests"
    leases.mkdir(parents=True, exist_ok=True)
    lease = leases / str(os.getpid())
    with FileLock(str(home / "test-leases.lock")):
        up = _slurm_up("start")
        assert up.returncode == 0, f"SLURM did not start:\n{up.stdout}\n{up.stderr}"
        facts = dict(line.split("=", 1) for line in up.stdout.splitlines() if "=" in line)
        if facts.get("STARTED"):
            ours.touch()
        lease.touch()
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = facts["SLURM_CONF"]
    try:
        yield facts
    finally:
        with FileLock(str(home / "test-leases.lock")):
            lease.unlink(missing_ok=True)
            if not any(psutil.pid_exists(int(f.name)) for f in leases.iterdir() if f.name.isdigit()) and ours.exists():
                _slurm_up("stop")
                ours.unlink(missing_ok=True)
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before


@pytest.fixture(scope="module")
def cluster(slurm, tmp_path_factory):
    """Two SLURM jobs, each one dlspark worker (one core, 2 GB); shared by the module's tests."""
    logs = tmp_path_factory.mktemp("slurm-logs")
    # the tests' networks live in conftest: the jobs import it from the shared file system, as a
    # cluster's jobs import a user's modules
    path = os.pathsep.join([str(ROOT / "tests")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    with slurm_cluster(2, memory_limit="2GB", interface="lo", log_directory=str(logs), walltime="00:20:00",
                       job_script_prologue=[f"export PYTHONPATH={path}"],
                       scheduler_options={"dashboard_address": None}) as c, Client(c) as client:
        client.wait_for_workers(2, timeout=120)
        yield c, client


def _job_ids(cluster, client):
    """``{worker address: SLURM job id}`` of the running workers."""
    names = {a: w["name"] for a, w in client.scheduler_info()["workers"].items()}
    return {a: cluster.workers[n].job_id for a, n in names.items() if n in cluster.workers}


def _minibatches_per_epoch(trainer):
    per_epoch = {}
    for s in trainer.last_fit_stats:
        per_epoch[s["epoch"]] = per_epoch.get(s["epoch"], 0) + s["minibatches"]
    return per_epoch


def test_workers_are_slurm_jobs_with_dlsparks_environment(cluster):
    c, client = cluster
    seen = client.run(lambda dask_worker: (os.environ.get("SLURM_JOB_ID"), os.environ.get("JAX_PLATFORMS"),
                                           os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
                                           "spawn_main" in open("/proc/self/cmdline").read(), dask_worker.state.nthreads))
    assert sorted(str(j) for j in _job_ids(c, client).values()) == sorted(v[0] for v in seen.values())
    # a CPU job's worker runs JAX on CPU, in a process its nanny spawned (not forked), with one thread
    assert {v[1:] for v in seen.values()} == {("cpu", "false", True, 1)}


def test_parameter_averaging_on_two_slurm_workers_reaches_the_digits_accuracy(cluster, make_net, digits):
    tr, te = digits
    _, client = cluster
    net = make_net()
    master = ParameterAveraging(batch_size_per_worker=16, averaging_frequency=2)
    DistributedTrainer(client, net, master, progress=False).fit(tr, epochs=8)
    assert accuracy(net, te) >= 0.95


def test_gradient_sharing_on_two_slurm_workers_reaches_the_digits_accuracy(cluster, make_net, digits):
    tr, te = digits
    _, client = cluster
    net = make_net(MLP(hidden=128), updater=optax.adam(3e-3))
    master = GradientSharing(batch_size_per_worker=16, threshold_algorithm=dlspark.AdaptiveThreshold(initial=1e-2))
    trainer = DistributedTrainer(client, net, master, progress=False)
    for epoch in range(1, 31):  # asynchronous steps: each run's trajectory differs (the core test's bound)
        trainer.fit(tr)
        if accuracy(net, te) >= 0.95:
            break
    assert accuracy(net, te) >= 0.95, f"below 95% after {epoch} epochs"
    comm = trainer.communication
    assert comm["bytes_sent"] * 20 <= comm["dense_bytes"], comm


def test_adapt_adds_a_slurm_worker_mid_fit_and_it_trains(cluster, make_net, digits, tmp_path):
    c, client = cluster
    tr, te = digits
    urls = dlspark.data.save_minibatches(tr, url=str(tmp_path / "mb"), batch_size=16)
    started = threading.Event()

    def on_round(stat):
        if stat["round"] == 2 and not started.is_set():
            started.set()
            # adapt talks to SLURM: not on the thread that delivers the fit's events
            threading.Thread(target=c.adapt, kwargs={"minimum": 3, "maximum": 3}, daemon=True).start()

    net = make_net()
    trainer = DistributedTrainer(client, net, ParameterAveraging(batch_size_per_worker=16, averaging_frequency=2),
                                 progress=False)
    trainer.fit_paths(str(tmp_path / "mb"), epochs=4, loader=slow_loader(0.1), callbacks=[on_round])
    assert started.is_set()
    workers = [s["workers"] for s in trainer.last_fit_stats]
    assert workers[0] == 2 and workers[-1] == 3, workers  # the new job's worker joined and trained
    assert _minibatches_per_epoch(trainer) == {e: len(urls) for e in range(4)}
    assert accuracy(net, te) >= 0.9
    c._adaptive.stop()  # keep the three workers: the next test cancels one


def test_a_cancelled_slurm_job_mid_fit_leaves_the_fit_complete_and_correct(cluster, make_net, digits, tmp_path):
    c, client = cluster
    client.wait_for_workers(3, timeout=120)
    tr, te = digits
    urls = dlspark.data.save_minibatches(tr, url=str(tmp_path / "mb"), batch_size=16)
    victim = sorted(_job_ids(c, client).values())[1]
    cancelled = threading.Event()

    def on_round(stat):
        if stat["round"] == 3 and not cancelled.is_set():
            cancelled.set()
            subprocess.Popen(["scancel", str(victim)])

    net = make_net()
    trainer = DistributedTrainer(client, net, ParameterAveraging(batch_size_per_worker=16, averaging_frequency=2),
                                 progress=False)
    trainer.fit_paths(str(tmp_path / "mb"), epochs=3, loader=slow_loader(0.05), callbacks=[on_round])
    assert cancelled.is_set()
    assert str(victim) not in {str(j) for j in _job_ids(c, client).values()}
    assert _minibatches_per_epoch(trainer) == {e: len(urls) for e in range(3)}  # each minibatch once an epoch
    assert net.iteration == 3 * len(urls)
    assert trainer.last_fit_stats[0]["workers"] == 3 and trainer.last_fit_stats[-1]["workers"] == 2
    assert accuracy(net, te) >= 0.9
