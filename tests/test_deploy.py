"""Deployment: worker settings reaching real workers, the version check against a worker that
really runs another dlspark, jobqueue job scripts, and the ``dlspark`` command."""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import dask
import pytest
from click.testing import CliRunner
from dask.utils import parse_bytes
from distributed import Client

import dlspark
from dlspark import cluster as dcluster
from dlspark.cli import main, parse_slurm_options, worker_facts
from dlspark.errors import VersionMismatchError

ROOT = pathlib.Path(__file__).resolve().parents[1]
ODD_VERSION = "0.1.0+odd"


# -- settings ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_memory_and_gpu_settings_reach_the_worker_from_config_and_arguments():
    settings = {"dlspark.worker.preallocate": True, "dlspark.worker.memory-fraction": 0.3,
                "dlspark.worker.memory-limit": "1.5GiB"}
    with dask.config.set(settings):
        # the argument wins over the config key
        with dcluster.local_cluster(1, memory_fraction=0.6) as c, Client(c) as client:
            (facts,) = client.run(worker_facts).values()
    assert facts["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
    assert facts["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.6"
    assert facts["memory_limit"] == parse_bytes("1.5GiB")
    assert facts["nthreads"] == 1
    assert "JAX_PLATFORMS" not in facts["env"]  # workers inherit the platform unless told


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match=r"memory_fraction must be a share of the GPU in \(0, 1\].*got 1.5"):
        dcluster.worker_env(memory_fraction=1.5)
    with pytest.raises(TypeError, match="preallocate must be True or False, got 'yes'"):
        dcluster.worker_env(preallocate="yes")
    with pytest.raises(ValueError, match="memory_limit must be 'auto', a size such as '4GiB'.*got 'lots'"):
        dcluster.local_cluster(1, memory_limit="lots")
    with pytest.raises(ValueError, match="cores_per_worker must be >= 1, got 0"):
        dcluster.slurm_cluster(cores_per_worker=0, memory_limit="1GB")



def test_slurm_cluster_takes_dask_jobqueues_own_names():
    # SLURMCluster's users type cores= and memory= first; they book the job as cores_per_worker and memory_limit do
    cluster = dcluster.slurm_cluster(0, cores=3, memory="2GB", processes=1, interface="lo",
                                     scheduler_options={"dashboard_address": None})
    try:
        lines = cluster.job_script().splitlines()
    finally:
        cluster.close()
    assert "#SBATCH --cpus-per-task=3" in lines and "#SBATCH --mem=2G" in lines
    worker = next(line for line in lines if "distributed.cli.dask_worker" in line)
    assert "--nthreads 1 " in worker and "--memory-limit 1.86GiB" in worker  # 2 GB
    with pytest.raises(ValueError, match=r"processes: each SLURM job runs one dlspark worker \(processes=1\), "
                                         r"got processes=4; ask for more workers with n_workers"):
        dcluster.slurm_cluster(cores=4, processes=4, memory="2GB")
    with pytest.raises(ValueError, match=r"cores=2 and cores_per_worker=4 disagree: cores is dask-jobqueue's name "
                                         r"for slurm_cluster's cores_per_worker"):
        dcluster.slurm_cluster(cores=2, cores_per_worker=4, memory_limit="2GB")
    with pytest.raises(ValueError, match=r"memory='2GB' and memory_limit='4GB' disagree"):
        dcluster.slurm_cluster(memory="2GB", memory_limit="4GB")

@pytest.mark.slow
def test_client_stays_on_cpu_while_workers_keep_their_platform():
    # A fresh process: JAX must not have started before the setting applies. The config key
    # comes through the environment, as on a cluster; only the client's JAX is held to CPU.
    code = (
        "import os, jax\n"
        "from distributed import Client\n"
        "from dlspark.cluster import local_cluster\n"
        "if __name__ == '__main__':\n"
        "    with local_cluster(1) as c, Client(c) as client:\n"
        "        worker = list(client.run(lambda: (os.environ.get('JAX_PLATFORMS'), jax.config.jax_platforms)).values())[0]\n"
        "    print(jax.config.jax_platforms, jax.default_backend(), worker)\n"
    )
    env = dict(os.environ, DASK_DLSPARK__CLIENT__CPU_ONLY="true")
    env.pop("JAX_PLATFORMS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[:2] == ["cpu", "cpu"]
    assert out.stdout.strip().endswith("(None, None)"), out.stdout


# -- jobqueue job scripts --------------------------------------------------------------------------
def _exports_seen_by_a_job(script):
    """Run a job script's prologue in bash, then ask a fresh Python what Dask and JAX would read."""
    exports = "\n".join(line for line in script.splitlines() if line.startswith("export "))
    probe = ("import dask, distributed.nanny, os; "
             "print(dask.config.get('distributed.worker.multiprocessing-method'), "
             "dask.config.get('distributed.worker.profile.enabled'), "
             "sorted(distributed.nanny._get_env_variables('distributed.nanny.pre-spawn-environ')), "
             "os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE'), os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION'), "
             "os.environ.get('JAX_PLATFORMS'))")
    out = subprocess.run(["bash", "-c", f"{exports}\nexec {sys.executable} -c \"{probe}\""],
                         capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.strip()


def test_slurm_job_script_asks_for_one_gpu_and_sets_jax_before_the_worker_starts():
    gpu = dcluster.slurm_cluster(0, gpus_per_worker=1, cores_per_worker=4, memory_limit="3GB", memory_fraction=0.5,
                                 interface="lo", scheduler_options={"dashboard_address": None})
    cpu = dcluster.slurm_cluster(0, cores_per_worker=2, memory_limit="2GB", interface="lo",
                                 scheduler_options={"dashboard_address": None})
    try:
        g, c = gpu.job_script(), cpu.job_script()
    finally:
        gpu.close()
        cpu.close()
    for script, cores in ((g, 4), (c, 2)):
        lines = script.splitlines()
        worker = next(i for i, line in enumerate(lines) if "distributed.cli.dask_worker" in line)
        assert f"#SBATCH --cpus-per-task={cores}" in lines
        assert all(i < worker for i, line in enumerate(lines) if line.startswith("export "))
        assert re.search(r"--nthreads 1 ", lines[worker]) and "--nanny" in lines[worker]
    # one GPU per job: SLURM sets the job's CUDA_VISIBLE_DEVICES to it; nothing here overrides that
    assert "#SBATCH --gres=gpu:1" in g.splitlines() and "CUDA_VISIBLE_DEVICES" not in g
    assert "#SBATCH --mem=3G" in g.splitlines()
    assert "--gres" not in c
    assert _exports_seen_by_a_job(g) == "spawn False ['MKL_NUM_THREADS', 'OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS'] false 0.5 None"
    # a job given no GPU runs JAX on CPU, even on a GPU node
    assert _exports_seen_by_a_job(c).endswith("false None cpu")


def test_jobqueue_options_serve_any_jobqueue_cluster():
    from dask_jobqueue import PBSCluster

    options = dcluster.jobqueue_options(memory_limit="16GB", platform="cuda", preallocate=False)
    with PBSCluster(resource_spec="select=1:ncpus=4:ngpus=1:mem=16GB", interface="lo",
                    scheduler_options={"dashboard_address": None}, **options) as pbs:
        script = pbs.job_script()
    assert "#PBS -l select=1:ncpus=4:ngpus=1:mem=16GB" in script
    assert "export JAX_PLATFORMS=cuda" in script and "export DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD=spawn" in script
    assert "--nthreads 1 " in script


# -- the version check ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def odd_worker_cluster(tmp_path_factory):
    """A one-worker LocalCluster plus a second worker process that runs a copy of dlspark whose
    version differs: the copy (source and distribution metadata, as an install leaves them) comes
    first on that process's PYTHONPATH."""
    site = tmp_path_factory.mktemp("odd-site")
    shutil.copytree(ROOT / "dlspark", site / "dlspark", ignore=shutil.ignore_patterns("__pycache__"))
    init = site / "dlspark" / "__init__.py"
    init.write_text(re.sub(r'__version__ = "[^"]*"', f'__version__ = "{ODD_VERSION}"', init.read_text()))
    meta = site / f"dlspark-{ODD_VERSION}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: dlspark\nVersion: {ODD_VERSION}\n")
    with dcluster.local_cluster(1) as cluster, Client(cluster) as client:
        env = dict(os.environ, PYTHONPATH=str(site))  # and cwd: ``-m`` puts the working directory first
        proc = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", cluster.scheduler_address,
                                 "--nthreads", "1", "--no-nanny", "--name", "odd", "--no-dashboard"],
                                env=env, cwd=site, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            client.wait_for_workers(2, timeout=60)
            yield client, proc
        finally:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_version_mismatch_fails_with_a_table_and_the_cluster_stays_usable(odd_worker_cluster, digits):
    import flax.linen as nn
    import optax

    def make_net():
        # flax's own Dense: the conftest's MLP would import conftest on a worker whose JAX has started
        # (`dlspark info` asked it for its devices), and conftest sets a JAX option that must come first
        return dlspark.Network(dlspark.Model.from_flax(nn.Dense(10), digits[0].features[:1]),
                               loss="softmax_cross_entropy", updater=optax.adam(1e-2), seed=0)

    client, proc = odd_worker_cluster
    odd = next(a for a, w in client.scheduler_info()["workers"].items() if w["name"] == "odd")
    # a lambda travels by value: the odd worker cannot import this test module
    version, where = client.run(lambda: (__import__("dlspark").__version__, __import__("dlspark").__file__),
                                workers=[odd])[odd]
    assert version == ODD_VERSION and "odd-site" in where  # the worker really runs the copy

    master = dlspark.ParameterAveraging(batch_size_per_worker=32)
    with pytest.raises(VersionMismatchError) as info:
        dcluster.check_versions(client)  # what DistributedTrainer does first
    message = str(info.value)
    assert list(info.value.mismatches) == ["dlspark"]
    table = message[message.index("+--"):]
    assert re.search(r"\| package +\| client +\| scheduler +\| worker 0 +\| worker odd +\|", table)
    assert re.search(rf"\| dlspark +\| 0\.1\.0 +\| 0\.1\.0 +\| 0\.1\.0 +\| {re.escape(ODD_VERSION)} +\|", table)
    assert "jax" not in table  # only the packages that differ
    assert "PipInstall" in message

    # `dlspark info` shows the same mismatch, every package's versions and each worker
    result = CliRunner().invoke(main, ["info", "--scheduler", client.scheduler.address])
    assert result.exit_code == 1, result.output
    assert "2 worker(s)" in result.output and "worker odd at" in result.output
    assert re.search(r"\| jaxlib +\| [0-9.]+ ", result.output)
    assert "version mismatch: dlspark" in result.output

    # the cluster is untouched: without the odd worker the same client trains
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while len(client.scheduler_info()["workers"]) > 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    train = dlspark.DataSet(digits[0].features[:256], digits[0].labels[:256])
    with dlspark.DistributedTrainer(client, make_net(), master, progress=False) as trainer:
        trainer.fit(train, epochs=1)
    assert trainer.network.iteration == 8 and trainer.loss_history


# -- the dlspark command --------------------------------------------------------------------------
def test_command_line_errors_name_the_problem():
    runner = CliRunner()
    result = runner.invoke(main, ["train", str(ROOT / "examples" / "train_digits.py"), "--local", "2",
                                  "--scheduler", "tcp://127.0.0.1:1"])
    assert result.exit_code == 2 and "give one of --scheduler, --slurm, --local; got --scheduler and --local" in result.output
    assert parse_slurm_options("workers=2, memory_limit=4GB gpus-per-worker=1 queue=gpu") == {
        "workers": 2, "memory_limit": "4GB", "gpus_per_worker": 1, "queue": "gpu"}
    result = runner.invoke(main, ["train", str(ROOT / "examples" / "train_digits.py"), "--slurm", "workers"])
    assert result.exit_code == 2 and "expected KEY=VALUE pairs" in result.output
    result = runner.invoke(main, ["train", str(ROOT / "examples" / "train_digits.py"), "--slurm", "workers=0,queue=gpu"])
    assert result.exit_code == 2 and "workers must be a whole number >= 1, got 0" in result.output
    result = runner.invoke(main, ["train", "no/such/script.py"])
    assert result.exit_code == 2 and "does not exist" in result.output
