"""Reliability: defects found by reading the code, and claims that had no test, on real clusters."""

import os
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP, accuracy

import dlspark
from dlspark import DataSet, DistributedTrainer, GradientSharing, MultiDataSet, ParameterAveraging
from dlspark.data import list_minibatches, save_minibatches
from dlspark.distributed._plan import Coordinator

pytestmark = pytest.mark.slow


# -- helpers ---------------------------------------------------------------------------------
class TwoHeads(nn.Module):
    """Two inputs, two outputs: a classifier and a regressor."""

    @nn.compact
    def __call__(self, xs, train: bool = False):
        a, b = xs
        h = nn.relu(nn.Dense(32)(jnp.concatenate([a, b], -1)))
        return nn.Dense(10)(h), nn.Dense(1)(h)


class MaskedPool(nn.Module):
    """Sequences (n, T, d) pooled over the unmasked steps: the mask changes the output."""

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        m = jnp.ones(x.shape[:2]) if mask is None else mask.astype(x.dtype)
        pooled = (x * m[..., None]).sum(1) / jnp.maximum(m.sum(1, keepdims=True), 1.0)
        return nn.Dense(3)(nn.relu(nn.Dense(16)(pooled)))


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server in this process (nothing leaves the machine) and its fsspec options."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server._server.server_address
        opts = {"key": "testing", "secret": "testing",
                "client_kwargs": {"endpoint_url": f"http://{host}:{port}", "region_name": "us-east-1"}}
        import boto3

        boto3.client("s3", aws_access_key_id="testing", aws_secret_access_key="testing",
                     **opts["client_kwargs"]).create_bucket(Bucket="rel")
        yield opts
    finally:
        server.stop()


def _multi(digits, n=512):
    tr, _ = digits
    x = tr.features[:n]
    return MultiDataSet([x[:, :32], x[:, 32:]], [tr.labels[:n], x.sum(1, keepdims=True) / 64])


# -- 1: globs ----------------------------------------------------------------------------------
def test_globs_never_list_hidden_or_in_flight_temporary_files(tmp_path):
    urls = save_minibatches(np.zeros((4, 2), np.float32), np.zeros((4, 1), np.float32), str(tmp_path), 2)
    (tmp_path / ".hidden.npz").write_bytes((tmp_path / "batch_000000.npz").read_bytes())
    (tmp_path / ".batch_000002.npz.0123abcd.tmp").write_bytes(b"half a file")
    assert list_minibatches(str(tmp_path) + "/*.npz") == urls
    assert list_minibatches(str(tmp_path) + "/*") == urls
    assert list_minibatches(tmp_path.as_uri() + "/*") == [tmp_path.as_uri() + "/" + os.path.basename(u) for u in urls]
    # a pattern that names the dot itself asks for hidden files, as a shell's glob does
    assert list_minibatches(str(tmp_path) + "/.hidden*") == [str(tmp_path / ".hidden.npz")]


# -- 6: repartition="never" with one partition ---------------------------------------------------
def test_never_with_a_single_partition_shares_the_minibatches_out():
    c = Coordinator([0] * 8, epochs=1, steps_per_round=2, repartition="never")
    p = c.plan_round(["a", "b"])
    assert p.assignment == {"a": [0, 1], "b": [2, 3]}
    # several partitions are still followed: partition 0 on a, partition 1 on b
    c = Coordinator([0, 0, 0, 1, 1, 1], epochs=1, steps_per_round=2, repartition="never")
    assert c.plan_round(["a", "b"]).assignment == {"a": [0, 1], "b": [3, 4]}


def test_never_with_one_dataset_trains_on_every_worker(client2, make_net, digits, tmp_path):
    tr, _ = digits
    master = ParameterAveraging(batch_size_per_worker=32, averaging_frequency=2, repartition="never")
    trainer = DistributedTrainer(client2, make_net(), master, progress=False)
    assert trainer.last_fit_stats == []  # 8: there before any fit
    trainer.fit(tr[:256])
    assert [s["workers"] for s in trainer.last_fit_stats] == [2, 2]
    urls = save_minibatches(tr[:256], url=str(tmp_path / "mb"), batch_size=32)
    trainer.fit_paths(urls)
    assert [s["workers"] for s in trainer.last_fit_stats] == [2, 2]


# -- 2: storage options for checkpoints and resumes ---------------------------------------------
def test_checkpoints_and_resume_on_an_object_store_take_storage_options(client2, make_net, digits, s3):
    # Only the options reach the S3 server: without them s3fs would go to AWS, unreachable here.
    tr, te = digits
    save_minibatches(tr[:384], url="s3://rel/train", batch_size=32, **s3)  # 12 files: 3 rounds of 2 x 2
    master = ParameterAveraging(batch_size_per_worker=32, averaging_frequency=2)
    straight = make_net()
    trainer = DistributedTrainer(client2, straight, master, progress=False)
    trainer.fit_paths("s3://rel/train/*.npz", epochs=2, checkpoint_every=4, checkpoint_url="s3://rel/ck/net.dls",
                      storage_options=s3)
    saved = dlspark.Network.load("s3://rel/ck/net.dls", **s3)
    assert (saved.iteration, saved.epoch) == (16, 1)  # after round 4: epoch 2, round 1
    resumed = make_net()
    trainer = DistributedTrainer(client2, resumed, master, progress=False)
    trainer.fit_paths("s3://rel/train/*.npz", epochs=2, resume_from="s3://rel/ck/net.dls", storage_options=s3)
    assert (resumed.iteration, resumed.epoch) == (24, 2)
    for a, b in zip(jax.tree_util.tree_leaves(resumed.state.params), jax.tree_util.tree_leaves(straight.state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # 11: evaluation JSON on S3 (DL4J's writeStringToFile(path, eval.toJson()))
    ev = trainer.evaluate(te)
    dlspark.io.write_text("s3://rel/eval/ev.json", ev.to_json(), **s3)
    back = dlspark.evaluation.Evaluation.from_json(dlspark.io.read_text("s3://rel/eval/ev.json", **s3))
    assert back.stats() == ev.stats() and back.accuracy() == pytest.approx(accuracy(resumed, te))


@pytest.mark.parametrize("master", [ParameterAveraging(batch_size_per_worker=32, averaging_frequency=2),
                                    GradientSharing(batch_size_per_worker=32, steps_per_round=2)],
                         ids=["averaging", "sharing"])
def test_parallel_wrapper_checkpoints_and_resumes_on_an_object_store(make_net, digits, s3, master):
    # ParallelWrapper's checkpoints and resumes take the fit's storage_options as the cluster's do:
    # without them s3fs would go to AWS, unreachable here.
    from dlspark import ParallelWrapper

    tr, _ = digits
    url = f"s3://rel/pw-{type(master).__name__}/net.dls"
    ParallelWrapper(make_net(), master, devices=2, progress=False).fit(
        tr[:256], epochs=2, checkpoint_every=3, checkpoint_url=url, storage_options=s3)
    assert dlspark.Network.load(url, **s3).iteration == 12  # 3 rounds of 2 steps on 2 devices
    resumed = make_net()
    ParallelWrapper(resumed, master, devices=2, progress=False).fit(tr[:256], epochs=2, resume_from=url,
                                                                     storage_options=s3)
    assert (resumed.iteration, resumed.epoch) == (16, 2)


# -- 5 and 11: masks through keyed inference from a bag; duplicate keys; a masked network trained --
def test_masked_sequences_train_distributed_and_bags_keep_masks_and_refuse_duplicate_keys(client2):
    import dask.bag as db

    rng = np.random.default_rng(0)
    n, t = 240, 6
    x = rng.normal(size=(n, t, 4)).astype(np.float32)
    mask = (np.arange(t)[None, :] < rng.integers(2, t + 1, size=(n, 1))).astype(np.float32)
    cls = (x * mask[..., None]).sum(1)[:, 0] > 0  # depends on the unmasked steps only
    y = np.eye(3, dtype=np.float32)[cls.astype(int) + (x[:, 0, 1] > 1)]
    net = dlspark.Network(dlspark.Model.from_flax(MaskedPool(), x[:1]), updater=optax.adam(1e-2))
    trainer = DistributedTrainer(client2, net, ParameterAveraging(batch_size_per_worker=20), progress=False)
    s0 = net.score(DataSet(x, y, features_mask=mask))
    trainer.fit(DataSet(x, y, features_mask=mask), epochs=3)
    assert net.score(DataSet(x, y, features_mask=mask)) < s0
    keyed = [(f"k{i}", x[i]) for i in range(40)]
    masks = {f"k{i}": mask[i] for i in range(40)}
    out = dict(trainer.predict_with_keys(db.from_sequence(keyed, npartitions=4), features_mask=masks).compute())
    want = net.output(x[:40], features_mask=mask[:40])
    unmasked = net.output(x[:40])
    assert sorted(out) == sorted(masks)
    np.testing.assert_allclose(np.stack([out[f"k{i}"] for i in range(40)]), want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(want, unmasked, atol=1e-4)  # the masks mattered
    # the same key in two partitions is refused, naming it
    dup = db.from_sequence(keyed + [("k3", x[3])], npartitions=5)
    with pytest.raises(ValueError, match="duplicate key 'k3' in the keyed features bag"):
        trainer.predict_with_keys(dup).compute()


# -- 7 and 11: replica divergence reduced on the workers; the sharing plug-ins in a real job ------
def test_replica_divergence_is_reduced_on_the_workers(client2, make_net, digits, monkeypatch):
    from dlspark.algorithms.sharing import NoResidualPostProcessing, TargetSparsityThreshold
    from dlspark.distributed import _client

    tr, te = digits
    fetched = []
    real = _client.fetch_state

    async def counting(client, worker, job, step, epoch):
        fetched.append(worker)
        return await real(client, worker, job, step, epoch)

    monkeypatch.setattr(_client, "fetch_state", counting)
    # asynchronous delivery, every replica applying its own encoded messages too: the replicas
    # may part by float order, so their divergence is measured, on the workers (with
    # synchronous delivery their digests show it is 0)
    master = GradientSharing(batch_size_per_worker=32, threshold_algorithm=TargetSparsityThreshold(target=0.01),
                             residual_post_processor=NoResidualPostProcessing(), max_staleness=4,
                             own_update="encoded")
    net = make_net(MLP(hidden=32))
    trainer = DistributedTrainer(client2, net, master, progress=False)
    s0 = net.score(tr[:640])
    trainer.fit(tr[:640], epochs=3)
    assert fetched and len(fetched) == 1  # the client took one replica's state, not one per worker
    div = trainer.replica_divergence
    assert isinstance(div, float) and 0.0 <= div < 1e-5
    assert net.score(tr[:640]) < 0.8 * s0
    # the threshold the target-sparsity rule reached is carried on
    assert trainer.threshold_state is not None


def test_max_param_difference_is_the_largest_absolute_difference(make_net):
    from dlspark.checkpoint import state_to_arrays
    from dlspark.distributed._worker import max_param_difference

    net = make_net()
    other = net.state.replace(params=jax.tree_util.tree_map(lambda a: a + 0.0, net.state.params))
    leaves, treedef = jax.tree_util.tree_flatten(other.params)
    leaves[1] = np.asarray(leaves[1]).copy()
    leaves[1].flat[3] -= 0.25
    other = other.replace(params=jax.tree_util.tree_unflatten(treedef, leaves))
    assert max_param_difference(net.state, state_to_arrays(other)) == pytest.approx(0.25, rel=1e-6)
    assert max_param_difference(net.state, state_to_arrays(net.state)) == 0.0


# -- 9: a script without the main-module guard ---------------------------------------------------
def test_a_script_without_the_main_guard_is_told_what_to_add(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import dlspark
        from dlspark.cluster import local_cluster

        cluster = local_cluster(1)
    """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert f"{script}, line 5 starts a dlspark cluster at the top level of the script" in r.stderr
    assert 'if __name__ == "__main__":' in r.stderr
    assert "bootstrapping phase" not in r.stderr


# -- a secured cluster: TLS on every comm, encryption required ------------------------------------
def test_a_cluster_given_a_security_object_speaks_tls_and_refuses_plain_clients(make_net, digits):
    # local_cluster(security=...) with a Security object; whole fits of both algorithms over TLS
    # (contributions and messages worker to worker) run in tests/test_security.py, on a cluster
    # secured by dask's configuration alone
    from distributed import Client
    from distributed.security import Security

    from dlspark.cluster import local_cluster

    sec = Security.temporary()
    assert sec.require_encryption
    te = digits[1][:200]
    net = make_net(MLP(hidden=16))
    with local_cluster(1, security=sec) as cluster, Client(cluster, security=sec) as client:
        address = cluster.scheduler_address
        assert address.startswith("tls://")
        assert all(w.startswith("tls://") for w in client.scheduler_info()["workers"])
        trainer = DistributedTrainer(client, net, progress=False)
        assert trainer.evaluate(te).accuracy() == pytest.approx(accuracy(net, te))
        keyed = trainer.predict_with_keys({i: te.features[i] for i in range(20)})
        np.testing.assert_allclose(np.stack([keyed[i] for i in range(20)]), net.output(te.features[:20]),
                                   rtol=1e-5, atol=1e-6)
        # A client without the certificates gets no connection at all.
        with pytest.raises((OSError, TypeError, ValueError)):
            Client(address.replace("tls://", "tcp://"), timeout="3s")
        with pytest.raises((OSError, TypeError, ValueError)):
            Client(address, timeout="3s")


# -- a minibatch file goes bad after the job listed it ---------------------------------------------
@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_file_damaged_mid_fit_is_named_with_its_round_and_a_resume_completes(client2, make_net, digits, tmp_path,
                                                                               damage):
    from dlspark.errors import CorruptMinibatchError

    tr, _ = digits
    urls = save_minibatches(tr[:384], url=str(tmp_path / "mb"), batch_size=32)  # 12 files, 3 rounds an epoch
    victim = urls[9]
    good = open(victim, "rb").read()
    master = ParameterAveraging(batch_size_per_worker=32, averaging_frequency=2)
    trainer = DistributedTrainer(client2, make_net(), master, progress=False)
    ck = str(tmp_path / "ck.dls")

    def on_round(stat):
        if stat["round"] == 4:  # epoch 2 begins: file 9 is read in round 6
            if damage == "truncate":
                open(victim, "wb").write(good[: len(good) // 2])
            else:
                os.remove(victim)

    with pytest.raises(CorruptMinibatchError, match=r"batch_000009\.npz.*round 6"):
        trainer.fit_paths(str(tmp_path / "mb"), epochs=2, checkpoint_every=4, checkpoint_url=ck, callbacks=[on_round])
    # a failed fit is all or nothing: the network is as it was; the checkpoint keeps the progress
    assert (trainer.network.iteration, trainer.network.epoch, trainer.loss_history) == (0, 0, [])
    # the cluster is usable at once, and the resume with the file restored completes
    open(victim, "wb").write(good)
    trainer.fit_paths(str(tmp_path / "mb"), epochs=2, resume_from=ck)
    assert (trainer.network.iteration, trainer.network.epoch) == (24, 2)


# -- bad data: refused before cluster work where it can be, named where it is found ----------------
def test_bad_data_is_named_with_what_is_allowed(client2, make_net, digits, tmp_path):
    tr, _ = digits
    x, y = tr.features[:128], tr.labels[:128]
    trainer = DistributedTrainer(client2, make_net(), ParameterAveraging(batch_size_per_worker=32), progress=False)
    with pytest.raises(ValueError, match="features and labels have different numbers of examples.*100.*90"):
        trainer.fit((x[:100], y[:90]))
    with pytest.raises(ValueError, match="the data holds no examples: fit needs at least one minibatch"):
        trainer.fit(DataSet(x[:0], y[:0]))
    # labels of 5 classes for a 10-class network, refused on the client, naming the file
    urls = save_minibatches(x, y[:, :5], url=str(tmp_path / "five"), batch_size=32)
    with pytest.raises(ValueError, match=r"minibatch '.*five/batch_000000\.npz'.*label"):
        trainer.fit_paths(urls)
    # files whose feature widths disagree with each other: the one that does not fit is named
    mixed = save_minibatches(x, y, url=str(tmp_path / "mixed"), batch_size=32)
    dlspark.data.save_dataset(DataSet(x[:32, :60], y[:32]), mixed[2])
    with pytest.raises(ValueError, match=r"minibatch '.*mixed/batch_000002\.npz': the model cannot take features"):
        trainer.fit_paths(mixed)
    # NaN features: named by URL under on_nonfinite="raise"; trained past under "skip"
    bad = x.copy()
    bad[70, 3] = np.nan
    nan_urls = save_minibatches(bad, y, url=str(tmp_path / "nan"), batch_size=32)
    with pytest.raises(ValueError, match=r"minibatch '.*nan/batch_000002\.npz' holds 1 non-finite feature values.*"
                                         r"on_nonfinite='skip'"):
        trainer.fit_paths(nan_urls)
    skipper = DistributedTrainer(client2, make_net(on_nonfinite="skip"), ParameterAveraging(batch_size_per_worker=32),
                                 progress=False)
    skipper.fit_paths(nan_urls)
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree_util.tree_leaves(skipper.network.state.params))
    # the cluster is still usable after every refusal
    trainer.fit((x, y))
    assert trainer.network.iteration == 4


@pytest.mark.parametrize("algorithm", ["averaging", "sharing"])
def test_fewer_minibatches_than_workers_completes(client2, make_net, digits, algorithm):
    tr, _ = digits
    master = (ParameterAveraging(batch_size_per_worker=32) if algorithm == "averaging"
              else GradientSharing(batch_size_per_worker=32))
    trainer = DistributedTrainer(client2, make_net(), master, progress=False)
    trainer.fit(tr[:32], epochs=3)  # one minibatch, two workers
    assert trainer.network.iteration == 3 and [s["minibatches"] for s in trainer.last_fit_stats] == [1, 1, 1]


# -- the scheduler dies mid-fit ----------------------------------------------------------------------
def _external_cluster(tmp_path, n_workers):
    """A ``dask scheduler`` process and a ``dask worker`` process of ``n_workers`` spawned,
    single-threaded workers set up as dlspark's own; returns (address, scheduler, workers)."""
    import json
    import time

    from dlspark.cluster import WORKER_CONFIG, _dask_env, worker_env

    sfile = tmp_path / "scheduler.json"
    env = {**os.environ, **worker_env(), **_dask_env({k: v for k, v in WORKER_CONFIG.items()
                                                      if not isinstance(v, dict)})}
    # the networks' flax modules live in the tests' conftest: the workers import it from here
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    bindir = os.path.dirname(sys.executable)
    sched = subprocess.Popen([os.path.join(bindir, "dask"), "scheduler", "--host", "127.0.0.1", "--port", "0",
                              "--no-dashboard", "--scheduler-file", str(sfile)], env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not sfile.exists() and time.time() < deadline:
        time.sleep(0.2)
    address = json.loads(sfile.read_text())["address"]
    workers = subprocess.Popen([os.path.join(bindir, "dask"), "worker", address, "--nworkers", str(n_workers),
                                "--nthreads", "1", "--no-dashboard", "--memory-limit", "0"], env=env,
                               start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return address, sched, workers


def test_a_killed_scheduler_fails_the_fit_quickly_and_a_resume_elsewhere_equals_a_straight_run(
        client2, make_net, digits, tmp_path):
    import signal
    import time

    from distributed import Client

    from conftest import slow_loader

    tr, _ = digits
    # 12 minibatches of 32: 3 rounds of 2 workers x 2 per epoch, read slowly so that the round
    # results reach the client while the fit still runs
    data = str(tmp_path / "mb")
    save_minibatches(tr[:384], url=data, batch_size=32)
    master = ParameterAveraging(batch_size_per_worker=32, averaging_frequency=2)
    ck = str(tmp_path / "ck.dls")
    address, sched, workers = _external_cluster(tmp_path, 2)
    killed = {}
    try:
        with Client(address, timeout="60s") as client:
            client.wait_for_workers(2, timeout=120)
            trainer = DistributedTrainer(client, make_net(), master, progress=False)

            def on_round(stat):
                if stat["round"] == 3 and not killed:
                    killed["at"] = time.monotonic()
                    os.kill(sched.pid, signal.SIGKILL)

            with pytest.raises(Exception) as info:
                trainer.fit_paths(data, epochs=2, checkpoint_every=2, checkpoint_url=ck, callbacks=[on_round],
                                  loader=slow_loader(0.3))
            assert killed, f"the fit failed before the scheduler was killed: {info.value!r}"
            waited = time.monotonic() - killed["at"]
    finally:
        for p in (sched, workers):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)
    assert waited < 60, f"fit took {waited:.0f} s to notice the scheduler had gone"
    print(f"the fit raised {waited:.1f} s after the scheduler was killed")
    assert info.type is dlspark.errors.JobFailedError
    assert f"the connection to the scheduler at {address} was lost during the fit" in str(info.value)
    assert f"resume_from={ck!r}" in str(info.value)
    saved = dlspark.Network.load(ck)  # intact: written atomically after round 2
    assert (saved.iteration, saved.epoch) == (8, 0)
    straight = make_net()
    DistributedTrainer(client2, straight, master, progress=False).fit_paths(data, epochs=2)
    resumed = make_net()
    DistributedTrainer(client2, resumed, master, progress=False).fit_paths(data, epochs=2, resume_from=ck)
    assert (resumed.iteration, resumed.epoch) == (24, 2)
    for a, b in zip(jax.tree_util.tree_leaves(resumed.state.params), jax.tree_util.tree_leaves(straight.state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


# -- 2 and 3: exports under an object-store export_directory take storage options; removed at close
def test_exports_on_an_object_store_take_storage_options_and_are_removed_at_close(client2, make_net, digits, s3):
    import s3fs

    fs = s3fs.S3FileSystem(**s3)
    tr, _ = digits
    master = ParameterAveraging(batch_size_per_worker=32, averaging_frequency=2, export_directory="s3://rel/exports")
    net = make_net()
    with DistributedTrainer(client2, net, master, progress=False) as trainer:
        trainer.fit(tr[:384], epochs=2, checkpoint_every=4, checkpoint_url="s3://rel/ck2/net.dls", storage_options=s3)
        assert len(fs.ls("rel/exports")) == 1 and len(fs.find("rel/exports")) == 12
        assert dlspark.Network.load("s3://rel/ck2/net.dls", **s3).iteration == 16
        resumed = make_net()
        again = DistributedTrainer(client2, resumed, master, progress=False)
        again.fit(tr[:384], epochs=2, resume_from="s3://rel/ck2/net.dls", storage_options=s3)
        again.close()
        assert (resumed.iteration, resumed.epoch) == (24, 2)
    assert fs.find("rel/exports") == []  # 3: every export removed at close
    for a, b in zip(jax.tree_util.tree_leaves(resumed.state.params), jax.tree_util.tree_leaves(net.state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


# -- 4 and 11: a MultiDataSet trained and evaluated distributed, one output at a time -------------
def test_multi_output_network_trains_distributed_and_is_evaluated_per_output(client2, digits):
    from dlspark.evaluation import Evaluation, RegressionEvaluation

    mds = _multi(digits)
    net = dlspark.Network(dlspark.Model.from_flax(TwoHeads(), tuple(f[:1] for f in mds.features)),
                          loss=("mcxent", "mse"), updater=optax.adam(1e-2))
    s0 = net.score(mds)
    trainer = DistributedTrainer(client2, net, ParameterAveraging(batch_size_per_worker=32), progress=False,
                                 eval_num_workers=2)  # 11: two evaluation threads per worker
    trainer.fit(mds, epochs=4)
    assert net.score(mds) < 0.5 * s0
    with pytest.raises(ValueError, match=r"this network has 2 outputs; evaluate one at a time with output=0 \.\. 1"):
        trainer.evaluate(mds)
    cls, reg = net.output(tuple(mds.features))
    local = Evaluation()
    local.update(mds.labels[0], cls)
    assert trainer.evaluate(mds, batch_size=48, output=0).stats() == local.stats()
    local_reg = RegressionEvaluation()
    local_reg.update(mds.labels[1], reg)
    dist_reg = trainer.evaluate_regression(mds, output=1)
    assert dist_reg.mean_squared_error(0) == pytest.approx(local_reg.mean_squared_error(0), rel=1e-6)
    with pytest.raises(ValueError, match="output=2 but this network has 2 outputs"):
        trainer.evaluate(mds, output=2)


# -- 11: direct minibatches live in two workers' memory, so a lost worker loses none ----------------
def test_direct_minibatches_survive_a_killed_worker(client2, make_net, digits):
    import time

    from dlspark.data import SourceContext, fit_minibatches

    tr, _ = digits
    # Dask's Active Memory Manager drops surplus replicas every 2 s: the second copies must outlive it
    m = fit_minibatches(tr[:128], SourceContext(client2, 32, "direct"))
    time.sleep(4.5)
    assert [len(v) for v in client2.who_has(m.keep).values()] == [2, 2, 2, 2]
    del m
    trainer, per_epoch = _fit_through_a_kill(client2, make_net, tr, 3, training_approach="direct")
    assert per_epoch == {0: 20, 1: 20, 2: 20}
    assert trainer.network.iteration == 60


def _fit_through_a_kill(client, make_net, tr, epochs, **options):
    """A fit of 640 digits (20 minibatches, 5 rounds an epoch at frequency 2) whose second round
    kills a worker: the trainer, and the minibatches each epoch trained."""
    from conftest import kill_at_round

    on_round, killed = kill_at_round(client, 2)
    master = ParameterAveraging(batch_size_per_worker=32, averaging_frequency=2, **options)
    trainer = DistributedTrainer(client, make_net(), master, progress=False)
    trainer.fit(tr[:640], epochs=epochs, callbacks=[on_round])
    assert killed.is_set()
    client.wait_for_workers(2, timeout=120)  # the killed worker is back for the tests after
    per_epoch = {}
    for s in trainer.last_fit_stats:
        per_epoch[s["epoch"]] = per_epoch.get(s["epoch"], 0) + s["minibatches"]
    return trainer, per_epoch


def test_moves_in_bfloat16_survive_a_killed_worker(client2, make_net, digits):
    tr, _ = digits
    trainer, per_epoch = _fit_through_a_kill(client2, make_net, tr, 2, exchange_precision="bfloat16")
    assert per_epoch == {0: 20, 1: 20} and trainer.network.iteration == 40
    # the survivor went on from the round's mean of rounded moves, which stays finite
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(trainer.network.params))


# -- 11: a gradient-sharing job whose client dies is torn down on every worker -----------------------
_ABANDONING_SHARING_CLIENT = """
import sys, time
import flax.linen as nn, numpy as np, optax
from distributed import Client
import dlspark

class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(10)(x)

def slow(url):
    time.sleep(0.2)
    return dlspark.data.load_minibatch(url)

if __name__ == "__main__":
    with Client(sys.argv[1]) as client:
        net = dlspark.Network(dlspark.Model.from_flax(Net(), np.zeros((1, 64), np.float32)), updater=optax.sgd(0.1))
        master = dlspark.GradientSharing(batch_size_per_worker=8, steps_per_round=2)
        trainer = dlspark.DistributedTrainer(client, net, master, progress=False)
        trainer.fit_paths(sys.argv[2], epochs=50, loader=slow, callbacks=[lambda s: print("round", flush=True)])
"""


def test_a_sharing_job_whose_client_dies_is_torn_down(client2, digits, tmp_path):
    import time

    import dask

    def coordinator_jobs(dask_scheduler):
        return sorted(dask_scheduler.plugins["dlspark-coordinator"].jobs)

    def worker_jobs(dask_worker):
        return sorted(dask_worker.plugins["dlspark"].jobs)

    tr, _ = digits
    with dask.config.set({"dlspark.scheduler.client-grace": "1s"}):  # the scheduler runs in this process
        save_minibatches(tr[:64], url=str(tmp_path / "mb"), batch_size=8)
        script = tmp_path / "client.py"
        script.write_text(_ABANDONING_SHARING_CLIENT)
        proc = subprocess.Popen([sys.executable, str(script), client2.scheduler.address, str(tmp_path / "mb")],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "round"  # its job is running
            assert len(client2.run_on_scheduler(coordinator_jobs)) == 1
        finally:
            proc.kill()
            proc.wait()
        deadline = time.monotonic() + 30
        while client2.run_on_scheduler(coordinator_jobs) or any(client2.run(worker_jobs).values()):
            assert time.monotonic() < deadline, "the dead client's sharing job still runs"
            time.sleep(0.2)


def test_a_call_to_a_peer_that_left_ends_when_the_scheduler_drops_it(client2, make_net):
    # Dask's connect retries a refused connection until its timeout (30 s by default): without
    # the scheduler check, a worker calling a killed peer waited that long before the job could
    # drop the peer. Here the pool's timeout is 600 s, so only the check can end the call.
    import asyncio
    import socket

    from dlspark.distributed._peers import PeerLeftError, call_peer

    with socket.socket() as s:  # a port nobody listens on: a killed worker's address
        s.bind(("127.0.0.1", 0))
        gone = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    listed = sorted(client2.scheduler_info()["workers"])
    DistributedTrainer(client2, make_net(), ParameterAveraging(), progress=False)  # installs dlspark's plugins

    async def call(dask_worker, addr):
        pool_timeout, dask_worker.rpc.timeout = dask_worker.rpc.timeout, 600
        try:
            await asyncio.wait_for(call_peer(dask_worker, addr, "dlspark_clock"), 60)  # a liveness bound
            return "answered"
        except PeerLeftError as e:
            return f"left: {e}"
        except asyncio.TimeoutError:
            return "still waiting"
        finally:
            dask_worker.rpc.timeout = pool_timeout

    assert client2.run(call, addr=gone, workers=listed[:1])[listed[0]] == f"left: worker {gone} is no longer in the cluster"
    # a listed peer answers as before
    assert client2.run(call, addr=listed[1], workers=listed[:1])[listed[0]] == "answered"

    # A job's coordinator saying the peer was lost (its notice, to the worker's handler) ends a
    # pending call at once, and a later call asks the scheduler before it starts: neither waits
    # for the scheduler check, made a minute apart here
    async def told(dask_worker, addr):
        import time

        import dask

        from dlspark.distributed._messages import PeerLost

        pool_timeout, dask_worker.rpc.timeout = dask_worker.rpc.timeout, 600
        out = []
        try:
            with dask.config.set({"dlspark.worker.peer-check": "60s"}):
                pending = asyncio.ensure_future(call_peer(dask_worker, addr, "dlspark_clock"))
                await asyncio.sleep(0.5)
                out.append(pending.done())
                t0 = time.monotonic()
                await dask_worker.handlers["dlspark_notice"](job="some-job", notice=PeerLost(addr))
                for call in (pending, call_peer(dask_worker, addr, "dlspark_clock")):
                    try:
                        await asyncio.wait_for(call, 10)
                    except PeerLeftError as e:
                        out.append(str(e))
            out.append(time.monotonic() - t0 < 5)
            return out
        finally:
            dask_worker.rpc.timeout = pool_timeout

    assert client2.run(told, addr=gone, workers=listed[:1])[listed[0]] == [
        False, f"worker {gone} was lost (its job's coordinator said so)", f"worker {gone} is no longer in the cluster",
        True]
