"""Latency for an emulated host: hold each queued packet a fixed time, then let it go.

This kernel's ``tc`` has no ``netem`` (nor ``fq``, whose departure times a BPF program could
set), so the delay is made in user space: ``iptables -A INPUT ... -j NFQUEUE`` hands each
packet a host receives on its link to a netlink queue, and this process, run in the host's
namespace, gives each packet its verdict (accept) ``delay`` seconds after it was queued. Packets leave in
the order they came, as on a wire. Only the packets' metadata is copied to user space, and
the queue takes whole segmentation-offload frames (up to 64 kB), so a few thousand verdicts
a second carry a gigabit. The queue fails open: a packet that finds it (or this process's
socket) full is let through at once rather than dropped, overtaking the held ones, and
while no process listens the rule's ``--queue-bypass`` lets every packet through.

It speaks the kernel's ``nfnetlink_queue`` protocol itself (a page of ``struct``): no
maintained Python library offers it without compiling against ``libnetfilter_queue``.

The process keeps to one CPU: a verdict re-injects the packets it lets go on the CPU it runs
on, and the veth pair queues them on that CPU's backlog, so a process that moved between
CPUs would let a later batch overtake an earlier one (reordered segments, which TCP reads as
loss and slows for).

Run as ``python _delay.py QUEUE DELAY_SECONDS [CPU]`` (by path: it imports nothing of
dlspark); it writes ``ready`` to stdout once bound and runs until killed. :func:`start` and
:func:`stop` do that, and add and remove the rule, for the harness (``_netcluster``).
"""

from __future__ import annotations

import collections
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 1, 2, 3
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_FAIL_OPEN, NFQA_CFG_F_GSO = 1, 4
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
NF_ACCEPT = 1
QUEUE_MAXLEN = 1 << 16


def parse_delay(delay) -> float | None:
    """A one-way delay in seconds: None or 0 (none), a number of seconds, or a string such
    as ``"500us"``, ``"2ms"``, ``"0.1s"``."""
    if delay is None:
        return None
    if isinstance(delay, str):
        m = re.fullmatch(r"(\d+(?:\.\d+)?)(us|ms|s)", delay.strip())
        if not m:
            raise ValueError(f"delay must be seconds or a string such as '500us', '2ms', '0.1s', got {delay!r}")
        delay = float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not (0 <= delay <= 10):
        raise ValueError(f"delay must be between 0 and 10 seconds, got {delay!r}")
    return float(delay) or None


def root_queue(token: str) -> int:
    """The queue a harness's caller's namespace holds its packets in (one per harness: the
    namespace is shared)."""
    return 1 + int(token, 16) % 65000


def _rule(ns, action: str, iface: str, queue: int, check: bool):
    """Add (``-A``) or delete (``-D``) the INPUT rule that hands what ``iface`` receives to
    ``queue`` (let through at once while no process listens on it)."""
    cmd = (["ip", "netns", "exec", ns] if ns else []) + [
        "iptables", action, "INPUT", "-i", iface, "-j", "NFQUEUE", "--queue-num", str(queue), "--queue-bypass"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    if check and out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")


def start(ns, iface: str, queue: int, delay: float, cpu, *, env, log: str, cwd: str, timeout: float,
          procs: list) -> subprocess.Popen:
    """Hold what ``iface`` receives in namespace ``ns`` (None: the caller's) for ``delay``
    seconds: this module's process on ``cpu``, bound to ``queue``, then the rule. The process
    is appended to ``procs`` as soon as it runs (the harness's teardown kills them)."""
    with open(log, "a") as err:
        proc = subprocess.Popen((["ip", "netns", "exec", ns] if ns else []) + [
            sys.executable, os.path.abspath(__file__), str(queue), repr(delay), *([str(cpu)] if cpu is not None else [])],
            env=env, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True, cwd=cwd)
    procs.append(proc)
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline().strip() if ready else ""
    if line != "ready":
        raise RuntimeError(f"the delay on {iface} did not start ({line!r}); see {log}")
    _rule(ns, "-A", iface, queue, check=True)  # after the queue is bound: the rule never meets an unbound one
    return proc


def stop(proc: subprocess.Popen, ns, iface: str, queue: int):
    """Undo :func:`start`: kill the process and remove the rule."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)
    _rule(ns, "-D", iface, queue, check=False)


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _message(msg: int, queue: int, attrs: bytes, flags: int = NLM_F_REQUEST, seq: int = 0) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg, flags, seq, 0) + body


def _attrs(data: bytes):
    off = 0
    while off + 4 <= len(data):
        length, kind = struct.unpack_from("=HH", data, off)
        if length < 4:
            return
        yield kind & 0x3FFF, data[off + 4:off + length]
        off += (length + 3) & ~3


def _configure(sock, queue: int):
    """Bind ``queue``, copy metadata only, take GSO frames whole, fail open; raise on a refusal."""
    requests = [
        _attr(NFQA_CFG_CMD, struct.pack("=BxH", NFQNL_CFG_CMD_BIND, 0)),
        _attr(NFQA_CFG_PARAMS, struct.pack(">IB", 0, NFQNL_COPY_META)),  # packed: 5 bytes
        _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack(">I", QUEUE_MAXLEN)),
        _attr(NFQA_CFG_FLAGS, struct.pack(">I", NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO))
        + _attr(NFQA_CFG_MASK, struct.pack(">I", NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO)),
    ]
    for seq, attrs in enumerate(requests, 1):
        sock.send(_message(NFQNL_MSG_CONFIG, queue, attrs, NLM_F_REQUEST | NLM_F_ACK, seq))
        reply = sock.recv(65536)
        _, kind = struct.unpack_from("=IH", reply, 0)
        if kind == NLMSG_ERROR:
            (err,) = struct.unpack_from("=i", reply, 16)
            if err:
                raise OSError(-err, f"nfnetlink_queue refused configuration step {seq} of queue {queue}: "
                                    f"{os.strerror(-err)}")


def run(queue: int, delay: float, cpu: int | None = None):
    os.sched_setaffinity(0, {cpu if cpu is not None else min(os.sched_getaffinity(0))})
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    try:
        sock.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE (root): room for bursts
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
    sock.bind((0, 0))
    _configure(sock, queue)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    held = collections.deque()  # (due, packet id), in arrival order
    packet_type = (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET
    while True:
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else None
        readable, _, _ = select.select([sock], [], [], timeout)
        if readable:
            while True:
                try:
                    data = sock.recv(1 << 20, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                except OSError:  # ENOBUFS: the kernel dropped messages; those packets fail open
                    continue
                now = time.monotonic()
                off = 0
                while off + 16 <= len(data):
                    length, kind = struct.unpack_from("=IH", data, off)
                    if length < 16:
                        break
                    if kind == packet_type:
                        for akind, payload in _attrs(data[off + 20:off + length]):
                            if akind == NFQA_PACKET_HDR:
                                held.append((now + delay, struct.unpack_from(">I", payload)[0]))
                                break
                    off += (length + 3) & ~3
        now = time.monotonic()
        last = None
        while held and held[0][0] <= now:
            last = held.popleft()[1]
        if last is not None:  # every packet up to ``last`` is due: one verdict lets them all go
            sock.send(_message(NFQNL_MSG_VERDICT_BATCH, queue,
                               _attr(NFQA_VERDICT_HDR, struct.pack(">II", NF_ACCEPT, last))))


if __name__ == "__main__":
    run(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None)
