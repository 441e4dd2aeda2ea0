"""Whole fits on workers on separate emulated hosts, and faults of their network.

Each worker runs in a network namespace of its own, joined to the others by a bridge,
its link rate-limited (``dlspark.testing.emulated_cluster``): every byte between workers
crosses a link whose own counters are read, and a link can be cut, healed, or blocked
between two workers only. The harness needs root and iproute2: without them the tests
skip, saying so; with ``DLSPARK_REQUIRE_NETNS=1`` (CI) they fail instead.
"""

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from conftest import MLP, slow_loader
from distributed import Client

import dlspark
from dlspark import DistributedTrainer, GradientSharing, ParameterAveraging
from dlspark.errors import JobFailedError
from dlspark.testing import (emulated_cluster, latency_unavailable, leftovers, netns_unavailable, sweep_leftovers,
                             wait_for_workers)

TESTS = pathlib.Path(__file__).resolve().parent

# Faults must be found in seconds, not minutes: Dask drops a silent worker after ``worker-ttl``; a
# connection whose data goes unacknowledged fails after ``comm.timeouts.tcp``; a worker waits for a
# peer at most ``peer-timeout``.
CONFIG = {
    "distributed.scheduler.worker-ttl": "6s",
    "distributed.comm.timeouts.connect": "8s",
    "distributed.comm.timeouts.tcp": "12s",  # Dask's least (its keepalive probes take 10 s)
    "dlspark.worker.peer-timeout": "20s",
    "dlspark.sharing.stale-timeout": "2s",
}
CUT_SHORT = 3.0  # below worker-ttl and the tcp timeout: the connections live through it
CUT_LONG = 14.0  # well past worker-ttl: Dask drops the worker


def _unavailable(reason):
    if os.environ.get("DLSPARK_REQUIRE_NETNS") == "1":
        pytest.fail(f"DLSPARK_REQUIRE_NETNS=1 but {reason}")
    pytest.skip(reason)


class ComparedAveraging(ParameterAveraging):
    """Parameter averaging whose trainer measures how far its replicas ended apart (the real
    path that gradient sharing uses; averaging's replicas must end equal)."""

    def compare_replicas(self) -> bool:
        return True


def _tests_path():
    """PYTHONPATH for the workers: the tests' networks live in conftest and this module, and the
    workers import them from the shared file system, as a cluster's workers import a user's modules."""
    return os.pathsep.join([str(TESTS)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


@pytest.fixture(scope="module")
def cluster():
    reason = netns_unavailable()
    if reason:
        _unavailable(reason)
    with emulated_cluster(2, rate="1gbit", env={"PYTHONPATH": _tests_path()}, config=CONFIG) as net, \
            Client(net.scheduler_address, set_as_default=False) as client:
        yield net, client


@pytest.fixture
def net(cluster):
    """The module's cluster with both workers registered and every link whole."""
    net, client = cluster
    for h in net.hosts:
        net.heal(h)
    net.isolate(0, 1, on=False)
    try:
        wait_for_workers(net, 2, timeout=30)
    except TimeoutError:  # a worker Dask dropped shut itself down: restart it, as an operator would
        names = {w["name"] for w in client.scheduler_info(n_workers=-1)["workers"].values()}
        for h in net.hosts:
            if h.name not in names:
                net.restart_worker(h, timeout=90)
    client.wait_for_workers(2, timeout=30)
    return net, client


def _minibatches_per_epoch(trainer):
    per_epoch = {}
    for s in trainer.last_fit_stats:
        per_epoch[s["epoch"]] = per_epoch.get(s["epoch"], 0) + s["minibatches"]
    return per_epoch


def _fault_at_round(round_no, fault):
    """A fit callback that runs ``fault()`` on a thread of its own when round ``round_no`` completes."""
    started = threading.Event()

    def on_round(stat):
        if stat["round"] >= round_no and not started.is_set():
            started.set()
            threading.Thread(target=fault, daemon=True).start()

    return on_round, started


def _urls(digits, tmp_path, batch_size=16):
    return dlspark.data.save_minibatches(digits[0], url=str(tmp_path / "mb"), batch_size=batch_size)


def _master(algorithm):
    if algorithm == "averaging":
        return ComparedAveraging(batch_size_per_worker=16, averaging_frequency=2)
    # every replica applies its own encoded messages too (own_update="encoded"), so that equal
    # replicas show each message applied everywhere after a cut (the whole own update's replicas
    # differ by their residuals; the messages and their sync are the same)
    return GradientSharing(batch_size_per_worker=16, threshold_algorithm=dlspark.AdaptiveThreshold(initial=1e-2),
                           own_update="encoded")


NOTHING = {"namespaces": [], "links": [], "processes": [], "rules": []}


def test_teardown_leaves_nothing_also_when_the_body_raises():
    reason = netns_unavailable()
    if reason:
        _unavailable(reason)
    _require_latency()
    with pytest.raises(RuntimeError, match="in the body"):
        with emulated_cluster(1, rate="100mbit", client_rate="1gbit", delay="1ms") as net:
            token = net.token
            assert net.worker_pids()["w0"], "no worker process in the namespace"
            # every link shaped both ways: the worker's at its rate, the client's at its own
            shaped = {dev: subprocess.run(["tc", "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
                      for dev in (net.hosts[0].link, net.client_link, net.client_port)}
            inside = subprocess.run(["ip", "netns", "exec", net.hosts[0].namespace, "tc", "qdisc", "show", "dev",
                                     "eth0"], capture_output=True, text=True).stdout
            assert "tbf" in inside and "100Mbit" in inside and "100Mbit" in shaped[net.hosts[0].link], shaped
            assert all("1Gbit" in shaped[d] for d in (net.client_link, net.client_port)), shaped
            left = leftovers(token)
            assert left["links"] and left["namespaces"] and len(left["rules"]) == 1, left  # the caller's queue
            assert all(p.poll() is None for p in net.delayers.values()) and len(net.delayers) == 2
            raise RuntimeError("in the body")
    assert leftovers(token) == NOTHING


_KILLED_HARNESS = """
import os, signal
from dlspark.testing import emulated_cluster
with emulated_cluster(1, delay="1ms") as net:
    print(net.token, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no teardown: what it made stays behind
"""


def test_what_a_killed_harness_left_behind_is_swept_by_the_next():
    reason = netns_unavailable()
    if reason:
        _unavailable(reason)
    _require_latency()
    r = subprocess.run([sys.executable, "-c", _KILLED_HARNESS], capture_output=True, text=True, timeout=180)
    assert r.returncode == -signal.SIGKILL, r.stderr
    token = r.stdout.split()[0]
    left = leftovers(token)
    try:
        # its scheduler, worker and delays live on, and the caller's namespace's rule
        assert left["namespaces"] and left["links"] and left["processes"] and left["rules"], left
        assert token in sweep_leftovers()  # what the next harness does first, as it starts
        assert leftovers(token) == NOTHING
    finally:
        dlspark.testing._netcluster._remove(token)  # even where the sweep failed: nothing outlives the test


@pytest.mark.slow
def test_wire_bytes_on_the_counters_match_what_averaging_reports(net, make_net, digits):
    """What crosses the links is what the algorithm needs: without ``save_updater`` a round's
    contribution is the parameters (not Adam's moments), and a fit that starts from the state
    the workers kept from the last one is not sent that state again."""
    net, client = net
    model = make_net(MLP(hidden=1024))
    master = ParameterAveraging(batch_size_per_worker=16, averaging_frequency=4, save_updater=False)
    trainer = DistributedTrainer(client, model, master, progress=False)
    trainer.fit(digits[0])  # compiles; the counted fit is the second
    before = net.wire_bytes()
    trainer.fit(digits[0])
    wire = net.wire_delta(before, net.wire_bytes())
    reported = sum(s["bytes_received"] for s in trainer.last_fit_stats)
    params = sum(x.nbytes for x in jax.tree_util.tree_leaves(model.state.params))
    state = sum(x.nbytes for x in dlspark.checkpoint.state_to_arrays(model.state)["arrays"])
    sent = sum(wire[h.name]["tx"] for h in net.hosts)
    received = sum(wire[h.name]["rx"] for h in net.hosts)
    # each of the 2 workers receives its peer's parameters a round, and nothing else of the state
    assert reported == 2 * params * len(trainer.last_fit_stats), (reported, params)
    # Workers send what they report (each contribution to its peer) plus the final state to
    # the client, framing and control messages: within 10% of that on the wire. They receive
    # the contributions and, of the state they kept, what differs (the updater's moments of the
    # replica that did not send the client its state, two thirds of a state under Adam): not
    # the whole state to each, which would be twice the state.
    assert reported + state <= sent <= 1.10 * (reported + state) + 1e6, (wire, reported, state)
    assert reported <= received <= 1.02 * reported + 0.75 * state + 2e5, (wire, reported, state)


@pytest.mark.slow
def test_gradient_sharing_behind_a_firewall_that_lets_in_only_dasks_ports(net, make_net, digits):
    """A worker whose host lets in only its Dask ports (a cloud security group that opens them
    alone drops the rest): its peer's messages to it go through Dask's comms from the start,
    and no round waits for the connection of the job's own that cannot open."""
    if shutil.which("nft") is None:
        _unavailable("nft (nftables) is not installed: no firewall to put up")
    net, client = net
    data = digits[0][:2 * 16 * 24]
    trainer = DistributedTrainer(client, make_net(), _master("sharing"), progress=False)
    trainer.fit(data)  # compiles: a worker that compiles longer holds its peer's first step back
    ports = net.firewall(1)
    try:
        assert int(net.hosts[1].address.rsplit(":", 1)[1]) in ports
        trainer.fit(data)
    finally:
        net.firewall(1, on=False)
    rounds, behind = trainer.last_fit_stats, net.hosts[1].address
    assert sum(r["minibatches"] for r in rounds) == 48 and all(r["workers"] == 2 for r in rounds)
    # the host in front took its peer's every message on the channel, the one behind none
    assert [r["direct"] for r in rounds] == [r["worker_steps"][behind] for r in rounds]
    assert [r["fetched_at_sync"] for r in rounds] == [0] * len(rounds)
    assert max(r["stale_wait"] for r in rounds) < 1.0, [r["stale_wait"] for r in rounds]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["averaging", "sharing"])
def test_a_link_cut_and_healed_mid_fit_trains_every_minibatch_once(net, make_net, digits, tmp_path, algorithm):
    net, client = net
    urls = _urls(digits, tmp_path)

    def fault():
        net.cut(1)
        time.sleep(CUT_SHORT)
        net.heal(1)

    on_round, started = _fault_at_round(3, fault)
    trainer = DistributedTrainer(client, make_net(), _master(algorithm), progress=False)
    trainer.fit_paths(urls, epochs=2, loader=slow_loader(0.02), callbacks=[on_round])
    assert started.is_set()
    assert _minibatches_per_epoch(trainer) == {0: len(urls), 1: len(urls)}
    assert max(s["round_time"] for s in trainer.last_fit_stats) >= CUT_SHORT * 0.5, "the cut stalled no round"
    assert all(s["workers"] == 2 for s in trainer.last_fit_stats)  # nobody was dropped
    assert trainer.replica_divergence <= (0.0 if algorithm == "averaging" else 1e-5)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm", ["averaging", "sharing"])
def test_two_workers_that_cannot_reach_each_other_end_in_bounded_time(net, make_net, digits, tmp_path, algorithm):
    """Both still reach the scheduler: the fit drops one side and finishes, or fails naming the pair."""
    net, client = net
    _fit_with_a_pair_isolated(net, DistributedTrainer(client, make_net(), _master(algorithm), progress=False),
                              _urls(digits, tmp_path), survivors=1)


def _fit_with_a_pair_isolated(net, trainer, urls, survivors):
    """``trainer``'s fit of two epochs of ``urls``, workers 0 and 1 unable to reach each other
    from round 3 on: it ends in bounded time, on ``survivors`` workers with every minibatch
    trained once, or in an error naming the pair. Whether it finished."""
    on_round, started = _fault_at_round(3, lambda: net.isolate(0, 1))
    addresses = [net.hosts[i].address for i in (0, 1)]
    t0 = time.monotonic()
    try:
        trainer.fit_paths(urls, epochs=2, loader=slow_loader(0.02), callbacks=[on_round])
    except JobFailedError as e:
        assert all(a in str(e) for a in addresses), str(e)
        finished = False
    else:
        assert _minibatches_per_epoch(trainer) == {0: len(urls), 1: len(urls)}
        assert trainer.last_fit_stats[-1]["workers"] == survivors
        finished = True
    assert started.is_set()
    assert time.monotonic() - t0 < 60
    return finished


# -- latency: a delay between hosts --------------------------------------------------------------
_PEER = """
import socket, statistics, sys, time
role, kind, host, port, nbytes = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
if role == "serve":
    s = socket.create_server((host, port))
    print(s.getsockname()[1], flush=True)
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if kind == "echo":
        while (b := c.recv(1)):
            c.sendall(b)
    else:
        n = 0
        while n < nbytes:
            n += len(c.recv(1 << 20))
        c.sendall(b"k")
else:
    c = socket.create_connection((host, port), timeout=30)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(15 if kind == "echo" else 1):
        t = time.perf_counter()
        c.sendall(b"x" * (1 if kind == "echo" else nbytes))
        c.recv(1)
        times.append(time.perf_counter() - t)
    print(statistics.median(times))
"""


def _between(kind, server_ns, server_ip, client_ns, nbytes=0):
    """Seconds between two hosts' namespaces (None: the caller's): with ``kind="echo"`` the
    median of 15 one-byte TCP round trips from ``client_ns`` to ``server_ip``, with
    ``"sink"`` the time to send it ``nbytes`` until it has them all."""
    def cmd(ns, *args):
        return (["ip", "netns", "exec", ns] if ns else []) + [sys.executable, "-c", _PEER, *map(str, args)]

    server = subprocess.Popen(cmd(server_ns, "serve", kind, server_ip, 0, nbytes), stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        out = subprocess.run(cmd(client_ns, "ask", kind, server_ip, port, nbytes), capture_output=True, text=True,
                             timeout=60, check=True)
        return float(out.stdout)
    finally:
        server.kill()
        server.wait()


def test_the_clients_link_is_shaped_both_ways(net):
    """``client_rate`` holds for what the client's host sends and for what it receives (a worker
    once reached the scheduler's address through the bridge's own MAC, past the client's link),
    and the client's counters see it."""
    net, _ = net
    a = net.hosts[0]
    mb = 4_000_000
    try:
        net.set_rate(None, client_rate="100mbit")
        before = net.wire_bytes()["client"]
        to_client = _between("sink", None, f"{net.subnet}.1", a.namespace, mb)
        received = net.wire_bytes()["client"]["rx"] - before["rx"]
        from_client = _between("sink", a.namespace, a.ip, None, mb)
    finally:
        net.set_rate("1gbit")
    unshaped = _between("sink", None, f"{net.subnet}.1", a.namespace, mb)
    bound = (mb - 512 * 1024) * 8 / 100e6  # 100 Mbit/s past the token bucket's burst
    assert to_client >= bound and from_client >= bound, (to_client, from_client, bound)
    assert unshaped < bound / 2, unshaped  # at 1 Gbit/s (the workers' links), not the client's 100
    assert mb <= received <= 1.1 * mb, received


def _require_latency():
    reason = latency_unavailable()
    if reason:
        _unavailable(reason)


def test_a_delay_lengthens_every_round_trip_between_hosts(net):
    """One way ``delay`` between any two hosts (the client's too): each round trip takes two
    more, and none once the delay is lifted. The harness holds packets in user space (the
    kernel has no netem), so this is what shows it holds them, and for how long."""
    net, _ = net
    _require_latency()
    a, b = net.hosts[0], net.hosts[1]
    pairs = {"host to host": (b.namespace, b.ip, a.namespace), "client to host": (a.namespace, a.ip, None),
             "host to client": (None, f"{net.subnet}.1", b.namespace)}
    try:
        net.set_delay("10ms")
        assert all(net.delayers[h.name].pid not in pids for h, pids in zip(net.hosts, net.worker_pids().values()))
        delayed = {k: _between("echo", *v) for k, v in pairs.items()}
    finally:
        net.set_delay(None)
    undelayed = {k: _between("echo", *v) for k, v in pairs.items()}
    # medians of 15: a busy machine's scheduling adds milliseconds, not the delay's tens
    assert all(0.020 <= t < 0.045 for t in delayed.values()), delayed
    assert all(t < 0.010 for t in undelayed.values()), undelayed
    assert net.delay is None and all(h.name not in net.delayers for h in net.hosts)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["averaging", "sharing"])
def test_a_fit_across_a_delay_waits_for_it_and_trains_every_minibatch_once(net, make_net, digits, algorithm):
    """Synchronous gradient sharing exchanges every step and averaging at 2 every other, so a
    fit over a one-way delay ``d`` takes at least ``d`` a step: the delay is on the job's path,
    and the fit still trains each minibatch once with the replicas equal."""
    net, client = net
    _require_latency()
    data, delay = digits[0][:2 * 16 * 24], 0.04
    trainer = DistributedTrainer(client, make_net(), _master(algorithm), progress=False)
    trainer.fit(data)  # compiles
    try:
        net.set_delay(delay)
        t0 = time.monotonic()
        trainer.fit(data)
        took = time.monotonic() - t0
    finally:
        net.set_delay(None)
    steps = sum(r["minibatches"] for r in trainer.last_fit_stats) // 2
    assert steps == 24 and all(r["workers"] == 2 for r in trainer.last_fit_stats)
    assert took >= steps * delay, (took, steps)
    assert trainer.replica_divergence <= (0.0 if algorithm == "averaging" else 1e-5)


# Last in the module: Dask drops the worker, and a test after it first waits for it to be
# restarted (about 30 s; the second of these two does).
@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["averaging", "sharing"])
def test_a_cut_longer_than_dask_keeps_the_worker_finishes_on_the_survivor(net, make_net, digits, tmp_path, algorithm):
    net, client = net
    urls = _urls(digits, tmp_path)
    healed = threading.Event()

    def fault():
        net.cut(1)
        time.sleep(CUT_LONG)
        net.heal(1)
        healed.set()

    on_round, started = _fault_at_round(3, fault)
    trainer = DistributedTrainer(client, make_net(), _master(algorithm), progress=False)
    t0 = time.monotonic()
    trainer.fit_paths(urls, epochs=2, loader=slow_loader(0.02), callbacks=[on_round])
    assert started.is_set()
    assert time.monotonic() - t0 < 50
    assert _minibatches_per_epoch(trainer) == {0: len(urls), 1: len(urls)}
    assert trainer.last_fit_stats[-1]["workers"] == 1  # finished on the survivor
    # the fit can end before the link is healed: the module's network must outlive the fault
    assert healed.wait(CUT_LONG + 10), "the link was not healed"


# -- three hosts: the mean in shares --------------------------------------------------------------
# With two contributors a replica fetches its peer's whole contribution; with three or more each
# contributor reduces one share of the elements and every replica gathers the shares
# (dlspark.algorithms.averaging._numerics). Here that path crosses links whose counters are read,
# and a cut between two of the three, both still reaching the scheduler and the third, hits the
# path that must hand a share around a lost peer. Its own cluster (the module's two-host one idles).
HOSTS = 3


@pytest.fixture(scope="module")
def three_hosts_cluster():
    reason = netns_unavailable()
    if reason:
        _unavailable(reason)
    with emulated_cluster(HOSTS, rate="1gbit", env={"PYTHONPATH": _tests_path()}, config=CONFIG) as net, \
            Client(net.scheduler_address, set_as_default=False) as client:
        yield net, client


@pytest.fixture
def three_hosts(three_hosts_cluster):
    """The three-host cluster with every worker registered and no pair isolated."""
    net, client = three_hosts_cluster
    net.isolate(0, 1, on=False)
    wait_for_workers(net, HOSTS, timeout=60)
    client.wait_for_workers(HOSTS, timeout=30)
    return net, client


def _counted_fit(net, trainer, data):
    """The wire bytes (per host, from the interfaces' counters) of a second fit, the first
    having compiled."""
    trainer.fit(data)
    before = net.wire_bytes()
    trainer.fit(data)
    return net.wire_delta(before, net.wire_bytes())


@pytest.mark.slow
def test_three_hosts_average_in_shares_and_the_wire_carries_what_they_report(three_hosts, make_net, digits):
    """A round costs the replicas 2 (n - 1) times the parameters in all (each owner fetches its
    share from the two others, each replica gathers the two shares it does not own), not
    n (n - 1) times as whole contributions would; with ``exchange_precision="bfloat16"`` the
    shares are reduced from 16-bit moves (half of that) and their means gathered in float32.
    The replicas end equal, and what the links carry is what the workers report, within
    framing."""
    net, client = three_hosts
    received = {}
    for precision in ("float32", "bfloat16"):
        model = make_net(MLP(hidden=1024))
        params = sum(x.nbytes for x in jax.tree_util.tree_leaves(model.state.params))
        state = sum(x.nbytes for x in dlspark.checkpoint.state_to_arrays(model.state)["arrays"])
        master = ComparedAveraging(batch_size_per_worker=16, averaging_frequency=4, save_updater=False,
                                   exchange_precision=precision)
        trainer = DistributedTrainer(client, model, master, progress=False)
        wire = _counted_fit(net, trainer, digits[0])
        stats = trainer.last_fit_stats
        assert all(s["workers"] == HOSTS and s["minibatches"] >= HOSTS for s in stats), stats
        reduce_part = params // 2 if precision == "bfloat16" else params
        per_round = [s["bytes_received"] for s in stats]
        assert per_round == [(HOSTS - 1) * (reduce_part + params)] * len(stats), (precision, per_round, params)
        assert trainer.replica_divergence == 0.0, precision
        reported = sum(per_round)
        rx = sum(wire[h.name]["rx"] for h in net.hosts)
        # the workers receive the shares and, of the state they kept, at most what differs
        assert reported <= rx <= 1.03 * reported + state + 3e5, (precision, wire, reported, state)
        received[precision] = rx, reported
    # 3 P a round against 4 P: the links carry the quarter that the workers report saved
    (rx32, reported32), (rx16, reported16) = received["float32"], received["bfloat16"]
    assert 4 * reported16 == 3 * reported32
    assert rx32 - rx16 >= 0.95 * (reported32 - reported16), received


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_of_three_hosts_that_cannot_reach_each_other_end_in_bounded_time(three_hosts, make_net, digits, tmp_path):
    """Both reach the scheduler and the third host: a share one of them owns cannot reach
    the other. The fit drops one side and finishes on two, every minibatch once and the
    replicas equal, or fails naming the pair; never hangs."""
    net, client = three_hosts
    master = ComparedAveraging(batch_size_per_worker=16, averaging_frequency=2)
    trainer = DistributedTrainer(client, make_net(), master, progress=False)
    try:
        if _fit_with_a_pair_isolated(net, trainer, _urls(digits, tmp_path), survivors=HOSTS - 1):
            assert trainer.replica_divergence == 0.0
    finally:
        net.isolate(0, 1, on=False)


_WRAPPER_FIT = """
import sys

import jax
import numpy as np
import optax
from conftest import MLP  # which asks for two CPU devices: three, here

import dlspark

jax.config.update("jax_num_cpu_devices", int(sys.argv[3]))

train = dlspark.datasets.digits()[0][:480]
net = dlspark.Network(dlspark.Model.from_flax(MLP(), train.features[:1]), loss="softmax_cross_entropy",
                      updater=optax.adam(1e-2), seed=0)
master = dlspark.ParameterAveraging(batch_size_per_worker=16, averaging_frequency=4, exchange_precision=sys.argv[2])
dlspark.ParallelWrapper(net, master, devices=int(sys.argv[3]), progress=False).fit(train)
np.save(sys.argv[1], np.concatenate([np.ravel(p) for p in jax.tree_util.tree_leaves(net.params)]))
"""


@pytest.mark.slow
def test_three_hosts_average_in_shares_as_the_wrapper_computes_the_mean(three_hosts, make_net, digits, tmp_path):
    """Three workers end where a ParallelWrapper over three devices (another process: this one
    has two) ends, in float32 and with the shares reduced from 16-bit moves, to float rounding:
    the two runtimes' steps part in the last bits on this network (at two workers too), and
    where such a difference moves a bfloat16 rounding of a move, that element parts by up to
    2**-9 of the move. The bfloat16 fit ends near the float32 one, not on it."""
    net, client = three_hosts
    train = digits[0][:480]  # 30 minibatches: rounds of 4, 4 and 2 a worker, all three contributing
    for precision in ("float32", "bfloat16"):
        model = make_net()
        master = ParameterAveraging(batch_size_per_worker=16, averaging_frequency=4, exchange_precision=precision)
        trainer = DistributedTrainer(client, model, master, progress=False)
        trainer.fit(train)
        assert [s["workers"] for s in trainer.last_fit_stats] == [HOSTS] * 3
        ends = np.concatenate([np.ravel(p) for p in jax.tree_util.tree_leaves(model.params)])
        out = tmp_path / f"{precision}.npy"
        subprocess.run([sys.executable, "-c", _WRAPPER_FIT, str(out), precision, str(HOSTS)], check=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": _tests_path()})
        apart = np.abs(ends - np.load(out))
        if precision == "float32":
            assert apart.max() < 1e-6, apart.max()
            exact = ends
        else:  # a move is at most 4 Adam steps of 1e-2: a flipped rounding parts by 0.04 * 2**-9 at most
            assert apart.max() < 0.04 * 2.0 ** -9 and np.mean(apart > 1e-6) < 0.01, (apart.max(), np.mean(apart > 1e-6))
            gap = np.abs(ends - exact).max()
            assert 0 < gap < 0.01, gap  # a round moves an element by up to 0.04


@pytest.mark.slow
def test_three_hosts_share_gradients_through_a_relay_where_the_ends_cannot_meet(three_hosts, make_net, digits):
    """Gradient sharing's tree mesh of fan-out 1 over three workers is a chain through the
    middle one (in address order), which forwards each end's messages to the other. With the
    two ends unable to reach each other (bridge isolation), both still reaching the scheduler
    and the middle, a fit of two epochs trains every minibatch once and ends with the replicas
    equal, as a plain mesh does where every pair can meet."""
    net, client = three_hosts
    order = sorted(range(HOSTS), key=lambda i: net.hosts[i].address)
    minibatches = -(-len(digits[0]) // 16)
    sent = {}
    for mesh in ("plain", "tree"):
        master = GradientSharing(batch_size_per_worker=16, threshold_algorithm=dlspark.AdaptiveThreshold(initial=1e-2),
                                 own_update="encoded", mesh=mesh, tree_fanout=1)
        trainer = DistributedTrainer(client, make_net(), master, progress=False)
        if mesh == "tree":
            net.isolate(order[0], order[-1])
        try:
            trainer.fit(digits[0], epochs=2)
        finally:
            net.isolate(order[0], order[-1], on=False)
        assert _minibatches_per_epoch(trainer) == {0: minibatches, 1: minibatches}
        assert all(s["workers"] == HOSTS for s in trainer.last_fit_stats)
        assert trainer.replica_divergence <= 1e-5, (mesh, trainer.replica_divergence)
        sent[mesh] = trainer.communication["bytes_sent"]
    assert sent["tree"] == sent["plain"] > 0  # each message counted once per peer it reaches, relayed or not
