"""One-way messages between the workers of a job on TCP connections of their own.

Gradient sharing sends every peer a small message each step. Through Dask's comms each
costs both event loops a handler call, msgpack framing and pickling, about a millisecond
of a step's core on each side (measured on the network benchmark's MLP: a worker's event
loop took 8% of its core). A :class:`Channel` carries them instead: the job's run listens
on a port of its own beside the worker's, a sender thread per peer writes length-framed
messages to a connection it opened, and a reader thread per connection hands each
message to the run. Neither path waits for the other's event loop.

Delivery is best effort, as the one-way pushes through Dask are. Until a connection is open
its peer's messages are refused (the run sends them through Dask), so that none waits on a
connection that may never open: a firewall that drops what it does not let in leaves the
attempt waiting until the timeout, and a connection that could not be opened is not tried
again at that port. A connection that fails once open (a write that outlasts the timeout,
more messages waiting than the peer takes, a reset) hands the messages it had not written,
and the one it was writing, to the channel's ``fallback`` (the run sends them through Dask;
a message that arrives twice counts once), and the peer's later messages go that way too; a
message lost all the same is fetched at the round's sync. Only for plain ``tcp://``
clusters: the connections are not encrypted, so a cluster on TLS keeps its messages on
Dask's comms.
"""

from __future__ import annotations

import logging
import queue
import socket
import struct
import threading
import time

__all__ = ["Channel", "channel_host"]

logger = logging.getLogger(__name__)

#: a frame: the sender's address (its length), the step, the payload's length; then both
_FRAME = struct.Struct("<IqI")
#: the hello that opens a connection: the job id's length and the sending worker's
_HELLO = struct.Struct("<II")
#: messages a sender thread holds for a peer that does not take them; beyond it they are dropped
QUEUE_LIMIT = 4096


def channel_host(address: str) -> str | None:
    """The host a worker at Dask address ``address`` listens on, where its comms are plain
    TCP (``tcp://host:port``); None for any other scheme (TLS, in-process, UCX)."""
    if not address.startswith("tcp://"):
        return None
    host = address[len("tcp://"):].rsplit(":", 1)[0]
    return host.strip("[]") or None


def _read_exactly(f, n: int) -> bytes | None:
    data = f.read(n)
    return data if len(data) == n else None


class _Sender:
    """One peer's outgoing connection, written by a thread of its own."""

    def __init__(self, channel, peer: str, where: tuple):
        self.channel, self.peer, self.where = channel, peer, where
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.broken = False
        self.unreachable = False  # the connection could not be opened: not tried again at this address
        self.sock = None  # the connection, once open: close() shuts it to wake a write that waits
        self.ready = threading.Event()  # the attempt to connect ended, either way
        self.lock = threading.Lock()  # a message is queued before the break drains the queue, or refused
        self.thread = threading.Thread(target=self._run, daemon=True, name="dlspark-channel-send")
        self.thread.start()

    def put(self, message) -> bool:
        if not self.ready.is_set():  # still connecting: nothing waits on a connection that may never open
            return False
        with self.lock:
            if not self.broken and self.queue.qsize() < QUEUE_LIMIT:
                self.queue.put(message)
                return True
        if not self.broken:  # the peer takes nothing: the rest goes through Dask
            self._break(f"{QUEUE_LIMIT} messages waiting")
        return False

    def _break(self, why, writing=None):
        """Stop taking messages; hand ``writing`` and every message still waiting to the
        channel's fallback (once: the thread that breaks first drains the queue)."""
        with self.lock:
            first, self.broken = not self.broken, True
        if first:
            logger.info("dlspark job %s: the channel to %s failed (%s); its messages go through Dask",
                        self.channel.job, self.peer, why)
        left = [] if writing is None else [writing]
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                left.append(item)
        if left and self.channel.fallback is not None and not self.channel.closed:
            self.channel.fallback(self.peer, left)

    def _run(self):
        timeout = self.channel.timeout
        try:
            sock = socket.create_connection(self.where, timeout=timeout)
        except OSError as e:  # refused, or no answer (a firewall that drops what it does not let in)
            self.unreachable = True
            self._break(e)
            return
        finally:
            self.ready.set()
        with sock:
            self.sock = sock
            if self.broken:  # closed while it connected
                self._break("closed")
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            job, me = self.channel.job.encode(), self.channel.me.encode()
            message = None
            try:
                sock.sendall(_HELLO.pack(len(job), len(me)) + job + me)
                while True:
                    message = self.queue.get()
                    if message is None or self.broken:  # closed: the rest to the fallback
                        self._break("closed", message)
                        return
                    sender, step, payload = message
                    name = sender.encode()
                    sock.sendall(b"".join((_FRAME.pack(len(name), step, len(payload)), name, payload)))
                    message = None
            except OSError as e:
                self._break(e, message)

    def close(self):
        """Stop: the messages not written go to the fallback (none once the channel is closed),
        and a write waiting on a peer that reads nothing ends now rather than at the timeout."""
        self.broken = True
        self.queue.put(None)
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # not connected any more
                pass


class Channel:
    """A job's direct connections on one worker: :meth:`send` to peers, ``deliver(sender, via,
    step, payload)`` called on a reader thread for each message that arrives. ``me`` is this
    worker's Dask address (the messages' ``via``), ``host`` where it listens, ``timeout`` the
    seconds a connect or a write may take before the connection counts as failed;
    ``fallback(peer, [(sender, step, payload), ...])``, called on the thread that found the
    connection failed, takes the messages it did not deliver. Raises ``OSError`` where it
    cannot listen on ``host``."""

    def __init__(self, job: str, me: str, host: str, deliver, timeout: float, fallback=None):
        self.job, self.me, self.deliver, self.timeout, self.fallback = job, me, deliver, timeout, fallback
        self._server = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.port = self._server.getsockname()[1]
        self._senders: dict = {}
        self._incoming: list = []
        self._lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._accept, daemon=True, name="dlspark-channel-accept").start()

    # -- incoming ---------------------------------------------------------------------
    def _accept(self):
        while not self.closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                if self.closed:
                    conn.close()
                    return
                self._incoming.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True, name="dlspark-channel-read").start()

    def _read(self, conn):
        try:
            with conn, conn.makefile("rb") as f:
                hello = _read_exactly(f, _HELLO.size)
                if hello is None:
                    return
                n_job, n_via = _HELLO.unpack(hello)
                job, via = _read_exactly(f, n_job), _read_exactly(f, n_via)
                if job is None or via is None or job.decode() != self.job:
                    return  # another job's connection (a port reused): nothing of it is applied
                via = via.decode()
                while not self.closed:
                    head = _read_exactly(f, _FRAME.size)
                    if head is None:
                        return
                    n_sender, step, n = _FRAME.unpack(head)
                    sender, payload = _read_exactly(f, n_sender), _read_exactly(f, n)
                    if sender is None or payload is None or self.closed:
                        return
                    self.deliver(sender.decode(), via, step, payload)
        except OSError:  # the connection broke: what it did not bring, the sync fetches
            return
        except Exception:  # a message the run could not take: logged, the connection dropped
            logger.exception("dlspark job %s: a message on the channel from a peer failed", self.job)

    # -- outgoing ---------------------------------------------------------------------
    def connect(self, peer: str, host: str, port: int) -> None:
        """Open (on its sender thread) the connection to ``peer``'s channel at ``host:port``,
        unless one is open or opening there, or could not be opened before. :meth:`send`
        refuses the peer's messages until it is open."""
        with self._lock:
            old = self._senders.get(peer)
            if not self.closed and (old is None or old.where != (host, port) or (old.broken and not old.unreachable)):
                self._senders[peer] = _Sender(self, peer, (host, port))
                if old is not None:
                    old.close()

    def wait_open(self, peers, timeout: float) -> None:
        """Block until each connection to ``peers`` being opened is open or has failed, or
        ``timeout`` seconds have passed."""
        deadline = time.monotonic() + timeout
        for peer in peers:
            s = self._senders.get(peer)
            if s is not None:
                s.ready.wait(max(0.0, deadline - time.monotonic()))

    def is_open(self, peer: str) -> bool:
        """Whether messages to ``peer`` go on a connection now."""
        s = self._senders.get(peer)
        return s is not None and s.ready.is_set() and not s.broken

    def tried(self, peer: str) -> bool:
        """Whether a connection to ``peer`` is open or opening, or the last one could not be
        opened (it is not tried again): :meth:`connect` would do nothing new at its address."""
        s = self._senders.get(peer)
        return s is not None and (not s.broken or s.unreachable)

    def send(self, peer: str, sender: str, step: int, payload: bytes | memoryview) -> bool:
        """Queue a message to ``peer``; False where there is no working connection to it (the
        caller sends it another way)."""
        s = self._senders.get(peer)
        return s is not None and s.put((sender, int(step), payload))

    def close(self):
        with self._lock:
            self.closed = True
            senders, incoming = list(self._senders.values()), list(self._incoming)
        for s in senders:
            s.close()
        for conn in incoming:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the thread waiting in accept
        except OSError:
            pass
        self._server.close()
