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

import dlspark
from dlspark import DistributedTrainer, ParameterAveraging
from dlspark.cluster import dashboard_address

from conftest import MLP


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
    assert dashboard_address(":0") == "127.0.0.1:0"  # what DistributedTrainer(None, ...) passed to Dask
    assert dashboard_address(8787) == dashboard_address("8787") == "127.0.0.1:8787"
    assert dashboard_address(":8787,:8788") == "127.0.0.1:8787,127.0.0.1:8788"
    assert dashboard_address("0.0.0.0:8787") == "0.0.0.0:8787"
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
    from dlspark import ParallelWrapper
    from dlspark.checkpoint import read_checkpoint_aux, read_checkpoint_meta, restore_checkpoint
    from dlspark.compat import ModelSerializer

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
        with pytest.raises(TypeError, match=r"Pass the network to load the arrays into"):
            restore(open(definition, "rb"), False)
    assert not marker.exists()
    with pytest.raises(ValueError, match="not both"):
        ModelSerializer.restoreMultiLayerNetwork(definition, network=net, trusted=True)
    with pytest.raises(TypeError, match="network must be the dlspark.Network to load the arrays into, got str"):
        ModelSerializer.restoreMultiLayerNetwork(definition, network="net.dls")
    # The paths named as trusting the file do run its code: the crafted file is live.
    with pytest.raises(Exception):
        ModelSerializer.restoreMultiLayerNetwork(definition, trusted=True)
    assert marker.read_text() == "code from the file ran"
    marker.unlink()
    with pytest.raises(Exception):
        dlspark.Network.load(definition)
    assert marker.exists()
