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
