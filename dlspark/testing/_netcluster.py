"""An emulated cluster network on one Linux machine: each worker a host of its own.

Every worker runs in its own network namespace, joined to the others by a Linux
bridge through a veth pair; the scheduler and the client stay in the calling
(root) namespace, which reaches the bridge through a veth pair of its own. Each
link can be rate-limited in both directions with a token bucket (``tc qdisc ...
tbf`` on both ends of the veth pair: the namespace's end shapes what the host
sends, the bridge's end what it receives). The kernel's ``tbf`` adds no
latency; a one-way ``delay`` between hosts is made in user space instead (each
host holds what it receives in a netfilter queue, see ``_delay``), so that designs
bound by round trips can be measured too.

The scheduler and the workers are started as a user starts them on separate
machines: ``dask scheduler`` and ``dask worker`` processes, each worker with
dlspark's worker environment (:func:`dlspark.cluster.worker_env` and
``WORKER_CONFIG``: spawned, one thread) and pinned to its own core. Workers
sit on different IP addresses, so no two of them count as one host (no shared
memory between them: every byte crosses a link).

Everything it makes is named after a random token and torn down on exit, also
when the body raises or the process is interrupted (a context manager and a
``weakref.finalize``); what a killed process left behind is removed by the
next harness that starts (:func:`sweep_leftovers`). Needs root and iproute2
(:func:`netns_unavailable` says why not); a host's firewall
(:meth:`EmulatedCluster.firewall`) needs nftables too, and a delay iptables
(:func:`latency_unavailable`).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field

import psutil

from . import _delay
from ._delay import parse_delay

__all__ = ["EmulatedCluster", "Host", "emulated_cluster", "netns_unavailable", "latency_unavailable",
           "sweep_leftovers", "leftovers", "parse_rate", "parse_delay", "wait_for_workers", "RATES"]

#: The link rates the benchmarks and tests name, as ``tc`` rates (None: not shaped).
RATES = {"unlimited": None, "10gbit": "10gbit", "1gbit": "1gbit", "100mbit": "100mbit"}

_PREFIX = "dls"  # every link made here: dls<token><role>; interface names are at most 15 characters
_NS_PREFIX = "dlspark-net-"
_ALIAS = "dlspark-netcluster pid="
_BURST = 512 * 1024  # bytes a link may send at once above its rate (at least 512 kB: veth hands over 64 kB GSO frames)
_FIREWALL = "dlspark_firewall"  # the nftables table of a host's firewall (made in its namespace, gone with it)


def _run(*args, check=True, ns=None, timeout=30):
    cmd = (["ip", "netns", "exec", ns] if ns else []) + [str(a) for a in args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def netns_unavailable() -> str | None:
    """Why an emulated cluster cannot be made here (a sentence), or None when it can."""
    if sys.platform != "linux":
        return f"emulated networks need Linux network namespaces; this is {sys.platform}"
    missing = [t for t in ("ip", "tc", "bridge", "taskset") if shutil.which(t) is None]
    if missing:
        return (f"emulated networks need iproute2 and util-linux ({', '.join(missing)} missing); "
                "on Debian as root: apt-get install -y iproute2 util-linux")
    if os.geteuid() != 0:
        return "emulated networks need root (network namespaces, veth pairs, a bridge, tc qdiscs)"
    probe = f"{_NS_PREFIX}probe-{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def latency_unavailable() -> str | None:
    """Why a delay between emulated hosts cannot be made here (a sentence), or None when it
    can: it needs what :func:`netns_unavailable` asks for, and iptables with its ``NFQUEUE``
    target (the kernel's ``nfnetlink_queue``)."""
    reason = netns_unavailable()
    if reason:
        return reason
    if shutil.which("iptables") is None:
        return "a delay between emulated hosts needs iptables; on Debian as root: apt-get install -y iptables"
    probe = f"{_NS_PREFIX}probe-{os.getpid()}"
    _run("ip", "netns", "add", probe)
    try:
        made = _run("iptables", "-A", "OUTPUT", "-o", "lo", "-j", "NFQUEUE", "--queue-num", "0", "--queue-bypass",
                    ns=probe, check=False)
    finally:
        _run("ip", "netns", "del", probe, check=False)
    if made.returncode:
        return f"iptables cannot queue packets to user space here (its NFQUEUE target): {made.stderr.strip()}"
    return None


def parse_rate(rate) -> str | None:
    """A link rate as ``tc`` takes it: None or ``"unlimited"`` (not shaped), a name of
    :data:`RATES`, or ``tc``'s own form (``"250mbit"``, ``"2gbit"``)."""
    if rate is None or rate == "unlimited":
        return None
    if not isinstance(rate, str):
        raise TypeError(f"rate must be a string such as '1gbit' or 'unlimited', got {rate!r}")
    if not re.fullmatch(r"\d+(\.\d+)?(bit|kbit|mbit|gbit)", rate):
        raise ValueError(f"rate must be 'unlimited' or a tc rate such as '100mbit', '1gbit', '10gbit', got {rate!r}")
    return rate


def _root_rules(tok: str) -> list:
    """The caller's namespace's INPUT rules of the harnesses ``tok`` matches (a regex of tokens)."""
    if shutil.which("iptables") is None:
        return []
    rules = _run("iptables", "-S", "INPUT", check=False).stdout.splitlines()
    return [r for r in rules if re.search(rf"-i {_PREFIX}{tok}c ", r + " ")]


def _own_links() -> dict:
    """``{token: owner pid}`` of the bridges this module made (their alias names the owner)."""
    out = _run("ip", "-o", "link", "show", "type", "bridge", check=False).stdout
    found = {}
    for line in out.splitlines():
        m = re.match(rf"\d+: ({_PREFIX}([0-9a-f]{{6}})br)[:@]", line)
        if m:
            alias = _run("cat", f"/sys/class/net/{m.group(1)}/ifalias", check=False).stdout.strip()
            found[m.group(2)] = int(alias[len(_ALIAS):]) if alias.startswith(_ALIAS) else 0
    return found


def leftovers(token: str | None = None) -> dict:
    """What this module made and is still there: ``{"namespaces": [...], "links": [...],
    "processes": [pids], "rules": [the caller's namespace's iptables rules]}`` (only
    ``token``'s with a token)."""
    tok = token or r"[0-9a-f]{6}"
    nss = [ln.split()[0] for ln in _run("ip", "netns", "list", check=False).stdout.splitlines() if ln.strip()]
    nss = [n for n in nss if re.fullmatch(rf"{_NS_PREFIX}{tok}-.*", n)]
    links = re.findall(rf"^\d+: ({_PREFIX}{tok}[a-z0-9]*)[:@]", _run("ip", "-o", "link", "show", check=False).stdout,
                       re.M)
    pids = []
    for ns in nss:
        pids += [int(p) for p in _run("ip", "netns", "pids", ns, check=False).stdout.split()]
    marker = f"DLSPARK_NETCLUSTER={token}" if token else "DLSPARK_NETCLUSTER="
    for proc in os.listdir("/proc"):
        if proc.isdigit() and int(proc) != os.getpid():
            try:
                with open(f"/proc/{proc}/environ", "rb") as f:
                    if marker.encode() in f.read():
                        pids.append(int(proc))
            except OSError:
                pass
    return {"namespaces": nss, "links": links, "processes": sorted(set(pids)), "rules": _root_rules(tok)}


def _remove(token: str) -> list:
    """Remove everything of ``token``: its processes, rules, namespaces and links. Returns the errors."""
    errors = []
    left = leftovers(token)
    for pid in left["processes"]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for rule in left["rules"]:  # "-A INPUT ...": deleted by the same words after -D
        out = _run("iptables", "-D", *rule.split()[1:], check=False)
        if out.returncode:
            errors.append(out.stderr.strip())
    for ns in left["namespaces"]:
        out = _run("ip", "netns", "del", ns, check=False)
        if out.returncode:
            errors.append(out.stderr.strip())
    for link in left["links"]:  # the root's own veth and the bridge (a namespace's veth went with it)
        out = _run("ip", "link", "del", link, check=False)
        if out.returncode and "Cannot find device" not in out.stderr:
            errors.append(out.stderr.strip())
    for workdir in glob.glob(os.path.join(tempfile.gettempdir(), f"{_NS_PREFIX}{token}-*")):
        shutil.rmtree(workdir, ignore_errors=True)
    return errors


def sweep_leftovers() -> list:
    """Remove what harnesses of processes that no longer run left behind (killed before
    their teardown); returns the tokens removed."""
    swept = []
    for token, owner in _own_links().items():
        if owner and not psutil.pid_exists(owner):
            _remove(token)
            swept.append(token)
    return swept


def _free_subnet() -> str:
    used = set(re.findall(r"inet (\d+\.\d+\.\d+)\.\d+/", _run("ip", "-4", "-o", "addr", check=False).stdout))
    for _ in range(1000):
        k = secrets.randbelow(40 * 256)
        net = f"10.{200 + k // 256}.{k % 256}"
        if net not in used:
            return net
    raise RuntimeError("no free 10.200-239.x.0/24 subnet for an emulated network")


@dataclass
class Host:
    """One worker's machine: its namespace, address, links and processes."""

    name: str
    namespace: str
    ip: str
    link: str  # the bridge's end of its veth pair (in the root namespace)
    core: int | None
    process: subprocess.Popen | None = None
    command: list = field(default_factory=list)  # how its dask worker is started
    address: str | None = None  # its Dask worker's address, once it registered


@dataclass
class EmulatedCluster:
    """A running emulated cluster; made by :func:`emulated_cluster`.

    Attributes
    ----------
    scheduler_address : str
        The ``dask scheduler``'s address (the client connects to it).
    hosts : list of Host
        The worker machines, in order.
    rate, client_rate : str or None
        The workers' and the client's link rate (``tc`` form; None: not shaped).
    delay : float or None
        The one-way delay between any two hosts, in seconds (None: none).
    """

    token: str
    subnet: str
    bridge: str
    client_link: str  # the root namespace's end of its veth pair
    client_port: str  # the bridge's end of it
    hosts: list = field(default_factory=list)
    rate: str | None = None
    client_rate: str | None = None
    delay: float | None = None
    scheduler: subprocess.Popen | None = None
    scheduler_address: str | None = None
    workdir: str = ""
    _finalizer: object = None
    _procs: list = field(default_factory=list)
    _env: dict = field(default_factory=dict)
    delayers: dict = field(default_factory=dict)  # under a delay: {host name or "client": what holds its packets}

    # -- links ------------------------------------------------------------------------
    def _host(self, which) -> Host:
        if isinstance(which, Host):
            return which
        if isinstance(which, int):
            return self.hosts[which]
        for h in self.hosts:
            if which in (h.name, h.address, h.ip):
                return h
        raise KeyError(f"no worker host {which!r}; hosts are {[h.name for h in self.hosts]}")

    def _shape(self, dev, rate, ns=None):
        if rate is None:
            _run("tc", "qdisc", "del", "dev", dev, "root", ns=ns, check=False)
        else:
            _run("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", str(_BURST),
                 "latency", "20ms", ns=ns)

    def set_rate(self, rate=None, client_rate=None):
        """Shape every worker's link in both directions at ``rate``, and the client's at
        ``client_rate`` (None or ``"unlimited"``: not shaped). Takes effect at once."""
        self.rate, self.client_rate = parse_rate(rate), parse_rate(client_rate)
        for h in self.hosts:
            self._shape(h.link, self.rate)  # what the host receives
            self._shape("eth0", self.rate, ns=h.namespace)  # what it sends
        self._shape(self.client_port, self.client_rate)
        self._shape(self.client_link, self.client_rate)

    def _delay_sites(self):
        """``(name, namespace, interface, queue, cpu)`` of each host that holds what it receives."""
        root_cpu = min(os.sched_getaffinity(0))
        return [(h.name, h.namespace, "eth0", 0, h.core) for h in self.hosts] + \
            [("client", None, self.client_link, _delay.root_queue(self.token), root_cpu)]

    def set_delay(self, delay=None, timeout: float = 30):
        """Delay every packet between two hosts by ``delay`` one way (seconds, or ``"2ms"``;
        None: no delay), so that a round trip between any two of them, the client's host
        among them, takes twice that more. Each host (each worker's, and the caller's, where
        the scheduler and the client are) holds what it receives on its link for ``delay`` in
        a netfilter queue that a process of its own, on its worker's core, releases in order
        (``_delay``). The link rates apply as before. Needs iptables (:func:`latency_unavailable`)."""
        delay = parse_delay(delay)
        if delay is not None and latency_unavailable():
            raise RuntimeError(latency_unavailable())
        for name, ns, iface, q, _ in self._delay_sites():
            proc = self.delayers.pop(name, None)
            if proc is not None:
                _delay.stop(proc, ns, iface, q)
        self.delay = delay
        for name, ns, iface, q, cpu in self._delay_sites() if delay is not None else ():
            log = os.path.join(self.workdir, f"{name}.delay.log")
            self.delayers[name] = _delay.start(ns, iface, q, delay, cpu, env=self._env, log=log, cwd=self.workdir,
                                               timeout=timeout, procs=self._procs)

    def cut(self, which):
        """Cut a worker's link (the cable pulled: its packets are dropped, its connections stay open)."""
        _run("ip", "link", "set", "dev", self._host(which).link, "down")

    def heal(self, which):
        """Reconnect a worker's link cut by :meth:`cut`."""
        _run("ip", "link", "set", "dev", self._host(which).link, "up")

    def isolate(self, a, b, on: bool = True):
        """Make workers ``a`` and ``b`` unable to reach each other while both still reach the
        scheduler, the client and every other worker (bridge port isolation: isolated ports
        talk only to ports that are not). ``on=False`` lifts it."""
        for h in (self._host(a), self._host(b)):
            _run("bridge", "link", "set", "dev", h.link, "isolated", "on" if on else "off")

    def firewall(self, which, on: bool = True) -> list:
        """Let into a worker's host only new TCP connections to the ports its processes listen
        on now (its Dask worker's, and its nanny's): the first packet of a connection to any
        other port is dropped, as by a firewall that opens a machine's known ports alone, so
        that connecting there waits until the connector gives up. Returns the ports let in;
        ``on=False`` removes it. Needs nftables (``nft``)."""
        h = self._host(which)
        _run("nft", "delete", "table", "inet", _FIREWALL, ns=h.namespace, check=False)
        if not on:
            return []
        listening = _run("ss", "-ltnH", ns=h.namespace).stdout.split("\n")
        ports = sorted({int(line.split()[3].rsplit(":", 1)[1]) for line in listening if line.strip()})
        if not ports:
            raise RuntimeError(f"nothing listens on {h.name}: no port to let in")
        _run("nft", "add", "table", "inet", _FIREWALL, ns=h.namespace)
        _run("nft", "add", "chain", "inet", _FIREWALL, "input",
             "{ type filter hook input priority 0; policy accept; }", ns=h.namespace)
        _run("nft", "add", "rule", "inet", _FIREWALL, "input",
             f"tcp flags & (syn | ack) == syn tcp dport != {{ {', '.join(map(str, ports))} }} drop", ns=h.namespace)
        return ports

    def wire_bytes(self) -> dict:
        """``{host name: {"tx": bytes sent, "rx": bytes received}}``, read from each worker
        namespace's own interface counters (``/sys/class/net/eth0/statistics``), and the
        client's (the root namespace's end of its link) under ``"client"``."""
        out = {}
        for h in self.hosts:
            vals = _run("cat", "/sys/class/net/eth0/statistics/tx_bytes", "/sys/class/net/eth0/statistics/rx_bytes",
                        ns=h.namespace).stdout.split()
            out[h.name] = {"tx": int(vals[0]), "rx": int(vals[1])}
        base = f"/sys/class/net/{self.client_link}/statistics"
        with open(f"{base}/tx_bytes") as tx, open(f"{base}/rx_bytes") as rx:
            out["client"] = {"tx": int(tx.read()), "rx": int(rx.read())}
        return out

    @staticmethod
    def wire_delta(before: dict, after: dict) -> dict:
        """The bytes each host sent and received between two :meth:`wire_bytes` readings."""
        return {k: {d: after[k][d] - before[k][d] for d in ("tx", "rx")} for k in after if k in before}

    # -- processes ----------------------------------------------------------------------
    def worker_pids(self) -> dict:
        """``{host name: [pids in its namespace]}`` (the nanny and its worker process; not the
        process that makes its delay)."""
        held = {proc.pid for proc in self.delayers.values()}
        return {h.name: [int(p) for p in _run("ip", "netns", "pids", h.namespace, check=False).stdout.split()
                         if int(p) not in held]
                for h in self.hosts}

    def _spawn(self, h: Host):
        log = open(os.path.join(self.workdir, f"{h.name}.log"), "a")
        h.process = subprocess.Popen(h.command, env=self._env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=self.workdir)
        self._procs.append(h.process)

    def restart_worker(self, which, timeout: float = 120) -> str:
        """Start a worker host's ``dask worker`` again (kill what runs in its namespace first),
        as an operator restarts a machine's worker; returns its new address. A worker that
        Dask dropped during a long cut shuts itself down when it hears back from the
        scheduler, so it does not come back by itself."""
        h = self._host(which)
        for pid in self.worker_pids()[h.name]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if h.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                h.process.wait(10)
        h.address = None
        self._spawn(h)
        return wait_for_workers(self, len(self.hosts), timeout)[h.name]

    def worker_addresses(self) -> dict:
        """``{host name: Dask worker address}`` of the workers registered now."""
        return {h.name: h.address for h in self.hosts if h.address}

    def close(self):
        """Stop every process and remove every namespace, link and file it made (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()


def _teardown(token, procs, workdir):
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.1, deadline - time.monotonic()))
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
    _remove(token)
    shutil.rmtree(workdir, ignore_errors=True)


def _env(token, extra_env, config):
    from ..cluster import WORKER_CONFIG, _dask_env, worker_env

    env = dict(os.environ)
    env.update(worker_env(platform="cpu"))
    env.update(_dask_env({**WORKER_CONFIG, **(config or {})}))
    env.update(extra_env or {})
    env["DLSPARK_NETCLUSTER"] = token  # marks every process of this harness (see leftovers)
    return env


def _wait_for_file(path, proc, what, timeout):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}) before it started; see {path}.log")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not start within {timeout} s")
        time.sleep(0.1)


def _start(n_workers, rate, client_rate, delay, cores, extra_env, config, memory_limit, timeout, nanny):
    reason = netns_unavailable()
    if reason:
        raise RuntimeError(reason)
    sweep_leftovers()
    token = secrets.token_hex(3)
    subnet = _free_subnet()
    workdir = tempfile.mkdtemp(prefix=f"dlspark-net-{token}-")
    cl = EmulatedCluster(token=token, subnet=subnet, bridge=f"{_PREFIX}{token}br", client_link=f"{_PREFIX}{token}c",
                         client_port=f"{_PREFIX}{token}cb", workdir=workdir)
    procs: list = []
    cl._finalizer = weakref.finalize(cl, _teardown, token, procs, workdir)
    if cores is None:
        avail = sorted(os.sched_getaffinity(0))
        cores = [avail[i % len(avail)] for i in range(n_workers)]
    try:
        _run("ip", "link", "add", cl.bridge, "type", "bridge")
        _run("ip", "link", "set", "dev", cl.bridge, "alias", f"{_ALIAS}{os.getpid()}")
        # The bridge must not answer for the caller's address: Linux replies to ARP for any of
        # its addresses on any interface, and a worker that learnt the bridge's own MAC for the
        # scheduler would send to it through the bridge device, past the client's link (its
        # rate, its counters, its delay). Only the interface that holds an address answers.
        with open(f"/proc/sys/net/ipv4/conf/{cl.bridge}/arp_ignore", "w") as f:
            f.write("1")
        _run("ip", "link", "set", cl.bridge, "up")
        _run("ip", "link", "add", cl.client_link, "type", "veth", "peer", "name", cl.client_port)
        _run("ip", "link", "set", cl.client_port, "master", cl.bridge)
        _run("ip", "link", "set", cl.client_port, "up")
        _run("ip", "addr", "add", f"{subnet}.1/24", "dev", cl.client_link)
        _run("ip", "link", "set", cl.client_link, "up")
        for i in range(n_workers):
            h = Host(name=f"w{i}", namespace=f"{_NS_PREFIX}{token}-w{i}", ip=f"{subnet}.{10 + i}",
                     link=f"{_PREFIX}{token}w{i}", core=cores[i] if cores else None)
            _run("ip", "netns", "add", h.namespace)
            _run("ip", "link", "add", h.link, "type", "veth", "peer", "name", h.link + "n")
            _run("ip", "link", "set", h.link + "n", "netns", h.namespace)
            _run("ip", "-n", h.namespace, "link", "set", h.link + "n", "name", "eth0")
            _run("ip", "-n", h.namespace, "addr", "add", f"{h.ip}/24", "dev", "eth0")
            _run("ip", "-n", h.namespace, "link", "set", "eth0", "up")
            _run("ip", "-n", h.namespace, "link", "set", "lo", "up")
            _run("ip", "link", "set", h.link, "master", cl.bridge)
            _run("ip", "link", "set", h.link, "up")
            cl.hosts.append(h)
        cl.set_rate(rate, client_rate)
        env = _env(token, extra_env, config)
        cl._procs, cl._env = procs, env
        cl.set_delay(delay)

        sfile = os.path.join(workdir, "scheduler.json")
        log = open(sfile + ".log", "w")
        cl.scheduler = subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", f"{subnet}.1", "--port", "0",
             "--no-dashboard", "--scheduler-file", sfile],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=workdir)
        procs.append(cl.scheduler)
        _wait_for_file(sfile, cl.scheduler, "the dask scheduler", timeout)
        import json

        for _ in range(50):
            try:
                with open(sfile) as f:
                    cl.scheduler_address = json.load(f)["address"]
                break
            except (ValueError, KeyError):  # written as we read
                time.sleep(0.1)
        for h in cl.hosts:
            pin = ["taskset", "-c", str(h.core)] if h.core is not None else []
            h.command = ["ip", "netns", "exec", h.namespace, *pin, sys.executable, "-m", "distributed.cli.dask_worker",
                         cl.scheduler_address, "--name", h.name, "--host", h.ip, "--nthreads", "1", "--nworkers", "1",
                         "--no-dashboard", "--memory-limit", str(memory_limit), "--nanny" if nanny else "--no-nanny",
                         "--local-directory", os.path.join(workdir, h.name)]
            cl._spawn(h)
        wait_for_workers(cl, n_workers, timeout)
    except BaseException:
        cl.close()
        raise
    return cl


def wait_for_workers(cl: EmulatedCluster, n: int, timeout: float = 60) -> dict:
    """Wait until ``n`` workers are registered with the scheduler; record their addresses."""
    from distributed import Client

    with Client(cl.scheduler_address, timeout=timeout, set_as_default=False) as client:
        client.wait_for_workers(n, timeout=timeout)
        info = client.scheduler_info(n_workers=-1)["workers"]
    by_name = {w["name"]: a for a, w in info.items()}
    for h in cl.hosts:
        h.address = by_name.get(h.name)
    return cl.worker_addresses()


@contextlib.contextmanager
def emulated_cluster(n_workers: int = 2, *, rate=None, client_rate=None, delay=None, cores=None, env=None,
                     config=None, memory_limit="4GiB", timeout: float = 120, nanny: bool = True):
    """Start an emulated cluster: ``n_workers`` worker hosts on one bridge, a ``dask
    scheduler`` beside the caller. Everything is removed on exit.

    Parameters
    ----------
    n_workers : int
        Worker hosts, each one network namespace with one ``dask worker`` (one thread).
    rate : str, optional
        Every worker link's rate in both directions: a name of :data:`RATES` or a ``tc``
        rate (``"1gbit"``); None or ``"unlimited"``: not shaped.
    client_rate : str, optional
        The rate of the link between the caller's namespace (the client and the scheduler)
        and the bridge; by default not shaped.
    delay : float or str, optional
        A one-way delay between any two hosts (seconds, or ``"500us"``, ``"2ms"``): see
        :meth:`EmulatedCluster.set_delay`. Default: none (round trips as on loopback).
    cores : list of int, optional
        The core each worker is pinned to; default: the cores this process may use, in turn.
        An empty list pins nothing.
    env : dict, optional
        More environment variables for the scheduler and workers (``PYTHONPATH`` for the
        modules a job's networks are defined in, say).
    config : dict, optional
        Dask settings for the scheduler and workers (``{"distributed.scheduler.worker-ttl":
        "5s", "dlspark.worker.peer-timeout": "10s"}``), handed over as ``DASK_*`` variables.
    memory_limit : str
        Each worker's memory limit.
    timeout : float
        Seconds to wait for the scheduler and the workers to start.
    nanny : bool
        Start each worker under a nanny (``dask worker``'s default).

    Yields
    ------
    EmulatedCluster

    Examples
    --------
    >>> from distributed import Client
    >>> with emulated_cluster(2, rate="1gbit") as net, Client(net.scheduler_address) as client:  # doctest: +SKIP
    ...     before = net.wire_bytes()
    ...     trainer.fit(data)
    ...     print(net.wire_delta(before, net.wire_bytes()))
    """
    if not isinstance(n_workers, int) or n_workers < 1:
        raise ValueError(f"n_workers must be a positive int, got {n_workers!r}")
    parse_rate(rate), parse_rate(client_rate), parse_delay(delay)
    cl = _start(n_workers, rate, client_rate, delay, cores, env, config, memory_limit, timeout, nanny)
    try:
        yield cl
    finally:
        cl.close()
