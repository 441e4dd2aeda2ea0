"""Secure by default: what listens where, TLS on every connection, and loads that run no code.

Real parts throughout: the trainer's own embedded cluster (its sockets read with psutil),
a LocalCluster secured by dask's configuration alone (certificates made here with the
``cryptography`` package), and checkpoint files crafted to run code when unpickled.
"""

from __future__ import annotations

import ipaddress
import socket

import dask
import numpy as np
import psutil
import pytest
from conftest import MLP

import dlspark
from dlspark import DistributedTrainer, ParameterAveraging
from dlspark.cluster import dashboard_address


# -- what listens where -------------------------------------------------------------------------
def _listening(procs):
    """``(pid, ip, port)`` of every TCP socket listening, and every UDP socket bound, in ``procs``."""
    found = set()
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and c.laddr and not c.raddr):
                found.add((p.pid, c.laddr.ip, c.laddr.port))
    return found


def _family(procs):
    return [psutil.Process(), *psutil.Process().children(recursive=True)] if procs is None else procs


def test_a_port_alone_listens_on_loopback_and_an_address_opens_it_wider():
    # What DistributedTrainer(None, ...) passed to Dask (every interface), and other ports alone:
    # loopback, with a warning that names the way back.
    for given, bound in ((":0", "127.0.0.1:0"), (8787, "127.0.0.1:8787"), ("8787", "127.0.0.1:8787"),
                         (":8787,:8788", "127.0.0.1:8787,127.0.0.1:8788")):
        with pytest.warns(UserWarning, match=r"listens on 127.0.0.1 only .*'0.0.0.0:\d+' .*dlspark.cluster.dashboard-address"):
            assert dashboard_address(given) == bound
    assert dashboard_address("0.0.0.0:8787") == "0.0.0.0:8787"
    assert dashboard_address("127.0.0.1:0") == "127.0.0.1:0"  # the default: no warning (warnings are errors here)
    assert dashboard_address(":8787", host="tcp://10.0.0.5") == "10.0.0.5:8787"  # the scheduler's own host
    assert dashboard_address(None) is None and dashboard_address(False) is None
    with pytest.raises(ValueError, match=r"dashboard_address must be HOST:PORT .*got 'a:b:c'"):
        dashboard_address("a:b:c")
    with pytest.raises(TypeError, match="dashboard_address must be an address"):
        dashboard_address(True)


def test_the_embedded_cluster_listens_on_loopback_only(make_net, capsys):
    """Every socket the trainer's embedded cluster opened (scheduler, dashboard, nannies, workers,
    in this process and in every worker process) is on loopback, and the printed link says so."""
    before = _listening(_family(None))
    with DistributedTrainer(None, make_net(MLP(hidden=8)), ParameterAveraging(), progress=False) as trainer:
        n = len(trainer.client.scheduler_info()["workers"])
        opened = _listening(_family(None)) - before
        printed = capsys.readouterr().out
    assert n >= 1
    # the scheduler and its dashboard, and a nanny and a worker per worker process at least
    assert len(opened) >= 2 + 2 * n, opened
    wide = [(pid, ip, port) for pid, ip, port in opened if not ipaddress.ip_address(ip).is_loopback]
    assert not wide, f"sockets beyond loopback: {wide}"
    dashboard = [port for _, ip, port in opened if f"{ip}:{port}" in printed]
    assert len(dashboard) == 1, printed
    assert "this machine only; dlspark.cluster.dashboard-address opens it wider" in printed


# -- loads that run no code ---------------------------------------------------------------------
class _RunsCode:
    """Unpickled, it runs ``code`` (pickle calls ``exec``, found by name in builtins)."""

    def __init__(self, code):
        self.code = code

    def __reduce__(self):
        return (exec, (self.code,))


def _rewrite(src, dst, member, data):
    import zipfile

    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            zout.writestr(item, data if item.filename == member else zin.read(item.filename))


@pytest.fixture
def crafted(tmp_path, make_net):
    """A saved network, and two copies crafted to write a marker file when unpickled: one whose
    definition does, one whose first array is a pickled object that does."""
    import io
    import pickle

    net = make_net(MLP(hidden=8))
    good = tmp_path / "good.dls"
    net.save(str(good))
    marker = tmp_path / "ran"
    payload = _RunsCode(f"open({str(marker)!r}, 'w').write('code from the file ran')")
    definition = tmp_path / "definition.dls"
    _rewrite(good, definition, "definition.pkl", pickle.dumps(payload))
    arrays = io.BytesIO()
    np.savez(arrays, a0=np.array([payload], dtype=object))
    arrays_file = tmp_path / "arrays.dls"
    _rewrite(good, arrays_file, "arrays.npz", arrays.getvalue())
    return net, str(definition), str(arrays_file), marker


def _weights_only_loads(net, data):
    """Every load path that promises to run nothing from the file, as ``name -> load(url)``."""
    from dlspark.compat import ModelSerializer

    from dlspark import ParallelWrapper
    from dlspark.checkpoint import read_checkpoint_aux, read_checkpoint_meta, restore_checkpoint

    def stream(url):
        return open(url, "rb")

    def resume(url):
        # ParallelWrapper's resume, which DistributedTrainer's shares (the client reads the file)
        fresh = dlspark.Network(net.model, loss=net.loss, updater=net.updater)
        pw = ParallelWrapper(fresh, ParameterAveraging(batch_size_per_worker=4), progress=False)
        return pw.fit(data[:8], epochs=1, resume_from=url)

    return {
        "Network.restore": lambda url: dlspark.Network(net.model, loss=net.loss, updater=net.updater).restore(url),
        "restore_checkpoint": lambda url: restore_checkpoint(url, net.state),
        "read_checkpoint_meta": read_checkpoint_meta,
        "read_checkpoint_aux": read_checkpoint_aux,
        "restoreMultiLayerNetwork(url, network=)": lambda url: ModelSerializer.restoreMultiLayerNetwork(url, network=net),
        "restoreMultiLayerNetwork(stream, network=)":
            lambda url: ModelSerializer.restoreMultiLayerNetwork(stream(url), False, network=net),
        "restoreComputationGraph(url, network=)": lambda url: ModelSerializer.restoreComputationGraph(url, network=net),
        "restore_computation_graph(stream, network=)":
            lambda url: ModelSerializer.restore_computation_graph(stream(url), network=net),
        "ParallelWrapper.fit(resume_from=)": resume,
    }


def test_no_weights_only_load_runs_code_from_a_crafted_checkpoint(crafted, digits):
    from dlspark.compat import ModelSerializer

    from dlspark.errors import CheckpointError

    net, definition, arrays, marker = crafted
    loads = _weights_only_loads(net, digits[0])
    # A pickled definition is never read: the arrays load, and the definition's code never runs.
    for name, load in loads.items():
        load(definition)
        assert not marker.exists(), f"{name} ran the code in the checkpoint's definition"
    restored = ModelSerializer.restoreMultiLayerNetwork(definition, network=net)
    assert restored is not net and restored.token != net.token
    np.testing.assert_array_equal(restored.output(digits[1].features[:5]), net.output(digits[1].features[:5]))
    # A pickled object among the arrays is refused, by name, and never unpickled.
    for name, load in loads.items():
        if name.startswith("read_checkpoint"):  # metadata and aux only: they never open the state's arrays
            continue
        with pytest.raises(CheckpointError, match="array data is truncated or corrupt.*allow_pickle=False"):
            load(arrays)
        assert not marker.exists(), f"{name} ran the code in the checkpoint's arrays"


def test_the_compat_restore_needs_a_network_or_trusted_and_trusted_runs_the_files_code(crafted):
    from dlspark.compat import ModelSerializer

    net, definition, _, marker = crafted
    # What DL4J-shaped code called before: refused with the two ways forward named, nothing run.
    for restore in (ModelSerializer.restoreMultiLayerNetwork, ModelSerializer.restoreComputationGraph,
                    ModelSerializer.restore_multi_layer_network):
        with pytest.raises(TypeError, match=r"Pass the network to load the arrays into.*network=dlspark.Network"
                                            r".*trusted=True for a file you trust"):
            restore(definition)
        with open(definition, "rb") as f, pytest.raises(TypeError, match=r"Pass the network to load the arrays into"):
            restore(f, False)
    assert not marker.exists()
    with pytest.raises(ValueError, match="not both"):
        ModelSerializer.restoreMultiLayerNetwork(definition, network=net, trusted=True)
    with pytest.raises(TypeError, match="network must be the dlspark.Network to load the arrays into, got str"):
        ModelSerializer.restoreMultiLayerNetwork(definition, network="net.dls")
    # The paths named as trusting the file do run its code: the crafted file is live.
    with pytest.raises(TypeError):  # the "definition" it unpickled is exec's None, after the code ran
        ModelSerializer.restoreMultiLayerNetwork(definition, trusted=True)
    assert marker.read_text() == "code from the file ran"
    marker.unlink()
    with pytest.raises(TypeError):
        dlspark.Network.load(definition)
    assert marker.exists()


# -- TLS end to end, from dask's configuration alone ----------------------------------------------
def _certificates(directory):
    """A certificate authority and one certificate it signed for this machine (127.0.0.1,
    localhost), as PEM files: ``(ca_file, cert_file, key_file)``."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def certificate(subject, key, issuer, issuer_key, ca):
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dlspark tests CA")])
    ca = certificate(ca_name, ca_key, ca_name, ca_key, True)
    cert = certificate(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]), key, ca_name, ca_key, False)
    paths = [directory / "ca.pem", directory / "cert.pem", directory / "key.pem"]
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return tuple(str(p) for p in paths)


def _tls_settings(ca, cert, key):
    settings = {"distributed.comm.require-encryption": True, "distributed.comm.tls.ca-file": ca}
    for role in ("client", "scheduler", "worker"):
        settings[f"distributed.comm.tls.{role}.cert"] = cert
        settings[f"distributed.comm.tls.{role}.key"] = key
    return settings


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """One LocalCluster secured by dask's configuration alone (no Security object anywhere), in
    which every process refuses plain TCP: this one (the client, the scheduler, the nannies) and
    each worker (through a Dask preload). Attempts land in ``log``. Last in this module: the
    refusal holds until the module's end."""
    from types import SimpleNamespace

    import _plain_tcp
    from distributed import Client

    from dlspark.cluster import local_cluster

    d = tmp_path_factory.mktemp("tls")
    ca, cert, key = _certificates(d)
    log = d / "plain-tcp.log"
    mp = pytest.MonkeyPatch()
    mp.setenv(_plain_tcp.LOG_VARIABLE, str(log))
    _plain_tcp.install()
    try:
        with dask.config.set({**_tls_settings(ca, cert, key), "distributed.worker.preload": ["_plain_tcp"]}):
            with local_cluster(2) as cluster, Client(cluster) as client:
                yield SimpleNamespace(client=client, cluster=cluster, ca=ca, cert=cert, key=key, log=log)
    finally:
        _plain_tcp.uninstall()
        mp.undo()


def _no_plain_tcp(tls):
    assert not tls.log.exists(), tls.log.read_text()


@pytest.mark.slow
def test_tls_from_dasks_config_carries_fits_evaluation_inference_and_checkpoints(tls, make_net, digits, tmp_path):
    import _plain_tcp

    from dlspark import GradientSharing
    from dlspark.distributed._shared import same_host

    client, tr, te = tls.client, digits[0][:256], digits[1]
    workers = list(client.scheduler_info()["workers"])
    assert client.scheduler.address.startswith("tls://") and all(w.startswith("tls://") for w in workers)
    assert all(client.run(_plain_tcp.guarded).values()) and _plain_tcp.guarded()  # the guard is live everywhere
    assert not same_host(*workers)  # co-located workers, yet no shared-memory shortcut past the comms
    ck = str(tmp_path / "ck.dls")
    for master in (ParameterAveraging(batch_size_per_worker=32, averaging_frequency=2),
                   GradientSharing(batch_size_per_worker=32, own_update="encoded")):  # replicas equal: below
        net = make_net(MLP(hidden=16))
        s0 = net.score(tr)
        trainer = DistributedTrainer(client, net, master, progress=False)
        trainer.fit(tr, epochs=2, checkpoint_every=2, checkpoint_url=ck)
        assert net.iteration == 2 * 8 and net.score(tr) < s0, type(master).__name__
        if isinstance(master, ParameterAveraging):
            assert all(s["bytes_shared"] == 0 < s["bytes_received"] for s in trainer.last_fit_stats)
        else:  # the peers' messages stayed on the TLS comms: no connection of the job's own
            assert sum(s["direct"] for s in trainer.last_fit_stats) == 0
    assert trainer.replica_divergence < 1e-5  # the sharing replicas, compared on the workers over TLS
    evaluation = trainer.evaluate(te)
    assert evaluation.accuracy() == pytest.approx(float((np.asarray(net.output(te.features)).argmax(-1)
                                                         == np.asarray(te.labels).argmax(-1)).mean()))
    keyed = trainer.predict_with_keys({i: te.features[i] for i in range(12)})
    np.testing.assert_allclose(np.stack([keyed[i] for i in range(12)]), net.output(te.features[:12]), rtol=1e-5,
                               atol=1e-6)
    back = make_net(MLP(hidden=16)).restore(ck)  # the last checkpoint the sharing fit wrote
    np.testing.assert_allclose(back.output(te.features[:12]), net.output(te.features[:12]), rtol=1e-5, atol=1e-6)
    _no_plain_tcp(tls)


_SCRIPT = '''
import _plain_tcp  # DLSPARK_TEST_TCP_LOG is set: plain TCP is refused in this script's process

import dask
import flax.linen as nn

import dlspark


class Small(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(x)


if __name__ == "__main__":
    assert _plain_tcp.guarded() and dask.config.get("distributed.comm.require-encryption")
    _, test = dlspark.datasets.digits()
    net = dlspark.Network(dlspark.Model.from_flax(Small(), test.features[:1]))
    with dlspark.DistributedTrainer(None, net, progress=False) as trainer:
        accuracy = trainer.evaluate(test[:64]).accuracy()
        print("evaluated at", trainer.client.scheduler.address, "accuracy", accuracy)
'''


@pytest.mark.slow
def test_the_dlspark_command_reaches_a_tls_scheduler_with_dasks_config_or_its_options(tls, tmp_path, capfd):
    import os

    from click.testing import CliRunner

    from dlspark.cli import main

    address = tls.client.scheduler.address
    # info, with the certificates from dask's configuration
    result = CliRunner().invoke(main, ["info", "--scheduler", address])
    assert result.exit_code == 0, result.output
    assert f"scheduler {address}, 2 worker(s)" in result.output and "versions agree" in result.output
    # train: the script runs in a process of its own, given the certificates of --tls-* and nothing else
    script = tmp_path / "evaluate.py"
    script.write_text(_SCRIPT)
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    capfd.readouterr()
    result = CliRunner().invoke(main, ["train", str(script), "--scheduler", address, "--tls-ca-file", tls.ca,
                                       "--tls-cert", tls.cert, "--tls-key", tls.key], env=env)
    printed = capfd.readouterr()  # the script's own output (its process writes to the file descriptors)
    assert result.exit_code == 0, (result.output, printed)
    assert f"evaluated at {address} accuracy" in printed.out, printed
    _no_plain_tcp(tls)
    # without certificates, the command says how to give them
    no_tls = {"distributed.comm.tls.ca-file": None, "distributed.comm.tls.client.cert": None,
              "distributed.comm.tls.client.key": None}
    with dask.config.set(no_tls):
        result = CliRunner().invoke(main, ["info", "--scheduler", address])
    assert result.exit_code == 2
    assert f"{address} speaks TLS and no certificates are configured: give --tls-ca-file, --tls-cert" in result.output
    result = CliRunner().invoke(main, ["info", "--scheduler", address, "--tls-cert", tls.cert])
    assert result.exit_code == 2 and "TLS needs --tls-ca-file and --tls-cert" in result.output
