"""``dlspark train``: the unchanged example on a cluster the command sets up (embedded and SLURM),
found by the script's trainer; and the trainer's own version check."""

import os
import pathlib
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner
from test_deploy import odd_worker_cluster  # noqa: F401  (a fixture)
from test_slurm import slurm  # noqa: F401  (a fixture)

import dlspark
from dlspark.cli import main
from dlspark.errors import VersionMismatchError

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_digits.py"


@pytest.mark.slow
def test_trainer_refuses_a_cluster_whose_versions_differ(odd_worker_cluster, digits):  # noqa: F811
    import flax.linen as nn
    import optax

    client, _ = odd_worker_cluster
    net = dlspark.Network(dlspark.Model.from_flax(nn.Dense(10), digits[0].features[:1]),
                          loss="softmax_cross_entropy", updater=optax.adam(1e-2), seed=0)
    with pytest.raises(VersionMismatchError, match=r"(?s)different versions.*\(dlspark\).*worker odd.*0\.1\.0\+odd"):
        dlspark.DistributedTrainer(client, net, dlspark.ParameterAveraging(), progress=False)
    # a cluster object is taken as it is: the trainer's own client is closed, the cluster is not
    with pytest.raises(VersionMismatchError, match="worker odd"):
        dlspark.DistributedTrainer(client.cluster, net, dlspark.ParameterAveraging(), progress=False)
    assert client.cluster.status.name == "running"
    assert len(client.scheduler_info()["workers"]) == 2  # nothing was closed or installed
    assert client.run_on_scheduler(lambda dask_scheduler: "dlspark-coordinator" in dask_scheduler.plugins) is False


def test_the_dlspark_console_script_is_installed():
    command = os.path.join(os.path.dirname(sys.executable), "dlspark")
    out = subprocess.run([command, "--help"], capture_output=True, text=True, timeout=60, check=True).stdout
    assert re.search(r"info +The cluster", out) and re.search(r"train +Run SCRIPT", out)


def _train(args, capfd):
    """``dlspark train ARGS`` in this process (the script itself runs in its own, as always):
    the command's messages, the script's output."""
    capfd.readouterr()
    env = {k: None for k in os.environ if k.startswith("DASK_DLSPARK")}
    result = CliRunner().invoke(main, ["train", *args], env=env)
    script = capfd.readouterr()
    script_out = script.out
    assert result.exit_code == 0, (result.output, script_out, script.err[-4000:], result.exception)
    # the script's trainer connected to the command's cluster rather than starting its own
    assert "exited with status 0; 1 client(s) of its used this cluster" in result.output
    return result.output, float(re.search(r"test accuracy ([0-9.]+)", script_out).group(1))


@pytest.mark.slow
def test_train_command_runs_the_unchanged_example_on_a_local_cluster(capfd):
    said, accuracy = _train(["--local", "2", str(EXAMPLE), "--", "--epochs", "1", "--batch-size", "64"], capfd)
    assert re.search(r"running .*train_digits.py against tcp://127\.0\.0\.1:\d+ \(2 worker\(s\)\)", said)
    assert accuracy >= 0.5  # one short epoch; the accuracy bar of distributed fits is in test_trainer and test_slurm


@pytest.mark.slow
def test_dlspark_train_runs_the_unchanged_example_on_slurm(slurm, tmp_path, capfd):  # noqa: F811
    options = f"workers=2,memory_limit=2GB,interface=lo,log_directory={tmp_path}"
    said, accuracy = _train(["--slurm", options, str(EXAMPLE), "--", "--epochs", "1", "--batch-size", "64"], capfd)
    assert re.search(r"against tcp://127\.0\.0\.1:\d+ \(2 worker\(s\)\)", said)
    assert accuracy >= 0.5
    assert len(list(tmp_path.glob("dask-worker-*.out"))) == 2  # the workers were SLURM jobs
