"""The job's own connections between workers (``dlspark.distributed._channel``), on real sockets."""

import socket
import threading
import time

import pytest

from dlspark.distributed import _channel
from dlspark.distributed._channel import Channel, channel_host


class Inbox:
    def __init__(self):
        self.got, self.cond = [], threading.Condition()

    def __call__(self, sender, via, step, payload):
        with self.cond:
            self.got.append((sender, via, step, bytes(payload)))
            self.cond.notify_all()

    def wait_for(self, n, timeout=10.0):
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.got) >= n, timeout), self.got
        return self.got


def _until(predicate, timeout=10.0):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_channel_host_is_the_host_of_a_plain_tcp_address_only():
    assert channel_host("tcp://10.1.2.3:4567") == "10.1.2.3"
    assert channel_host("tcp://[::1]:4567") == "::1"
    assert channel_host("tls://10.1.2.3:4567") is None  # not encrypted: TLS clusters keep Dask's comms
    assert channel_host("inproc://10.1.2.3/1/2") is None and channel_host("ucx://10.1.2.3:1") is None


def test_a_channel_listens_on_ipv6_too():
    inbox = Inbox()
    try:
        b = Channel("job", "tcp://[::1]:2", "::1", inbox, timeout=5)
    except OSError as e:  # a host without IPv6 loopback
        pytest.skip(f"no IPv6 loopback here: {e}")
    a = Channel("job", "tcp://127.0.0.1:1", "127.0.0.1", Inbox(), timeout=5)
    try:
        a.connect("b", "::1", b.port)
        a.wait_open(["b"], 5)
        a.send("b", "tcp://127.0.0.1:1", 3, b"six")
        assert inbox.wait_for(1) == [("tcp://127.0.0.1:1", "tcp://127.0.0.1:1", 3, b"six")]
    finally:
        a.close()
        b.close()


def test_messages_arrive_in_order_with_their_sender_step_and_bytes():
    inbox_a, inbox_b = Inbox(), Inbox()
    a = Channel("job-1", "tcp://127.0.0.1:1", "127.0.0.1", inbox_a, timeout=5)
    b = Channel("job-1", "tcp://127.0.0.1:2", "127.0.0.1", inbox_b, timeout=5)
    try:
        assert not a.is_open("b") and a.send("b", "x", 1, b"no connection") is False  # the caller sends it another way
        a.connect("b", "127.0.0.1", b.port)
        a.wait_open(["b"], 5)
        assert a.is_open("b") and a.tried("b")
        payloads = [bytes([i]) * (1 + 5000 * i) for i in range(4)] + [b""]
        for step, p in enumerate(payloads, 1):
            assert a.send("b", "tcp://127.0.0.1:1" if step % 2 else "tcp://origin:9", step, memoryview(p))
        got = inbox_b.wait_for(len(payloads))
        assert [(s, v, k) for s, v, k, _ in got] == [("tcp://127.0.0.1:1" if k % 2 else "tcp://origin:9",
                                                      "tcp://127.0.0.1:1", k) for k in range(1, 6)]
        assert [p for *_, p in got] == payloads and inbox_a.got == []
    finally:
        a.close()
        b.close()


def test_a_connection_from_another_job_delivers_nothing():
    inbox = Inbox()
    b = Channel("job-b", "tcp://127.0.0.1:2", "127.0.0.1", inbox, timeout=5)
    a = Channel("job-a", "tcp://127.0.0.1:1", "127.0.0.1", Inbox(), timeout=5)
    c = Channel("job-b", "tcp://127.0.0.1:3", "127.0.0.1", Inbox(), timeout=5)
    try:
        a.connect("b", "127.0.0.1", b.port)
        c.connect("b", "127.0.0.1", b.port)
        a.wait_open(["b"], 5)
        c.wait_open(["b"], 5)
        assert a.send("b", "tcp://127.0.0.1:1", 1, b"wrong job")
        assert c.send("b", "tcp://127.0.0.1:3", 7, b"right job")
        assert inbox.wait_for(1) == [("tcp://127.0.0.1:3", "tcp://127.0.0.1:3", 7, b"right job")]
        time.sleep(0.2)
        assert len(inbox.got) == 1
    finally:
        for ch in (a, b, c):
            ch.close()


class Fallback:
    def __init__(self):
        self.got, self.lock = [], threading.Lock()

    def __call__(self, peer, messages):
        with self.lock:
            self.got.extend((peer, sender, step, bytes(p)) for sender, step, p in messages)


@pytest.mark.parametrize("peer", ["refuses", "does not answer"])
def test_a_connection_that_cannot_be_opened_takes_no_message_and_is_not_tried_again(peer):
    # "does not answer": a listener whose queue is full drops the connection's SYN, as a
    # firewall that drops what it does not let in does; connecting waits until the timeout
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    held = socket.create_connection(listener.getsockname())
    if peer == "refuses":
        port = listener.getsockname()[1]
        held.close()
        listener.close()  # nothing listens there now
    else:
        port = listener.getsockname()[1]
    fallback, inbox = Fallback(), Inbox()
    a = Channel("job", "tcp://127.0.0.1:1", "127.0.0.1", Inbox(), timeout=1, fallback=fallback)
    b = Channel("job", "tcp://127.0.0.1:2", "127.0.0.1", inbox, timeout=1)
    try:
        a.connect("b", "127.0.0.1", port)
        assert a.tried("b") and not a.is_open("b")
        # while it connects the caller sends another way: no message waits on the connection
        assert a.send("b", "tcp://127.0.0.1:1", 1, b"early") is False
        a.wait_open(["b"], 5)
        assert a.tried("b") and not a.is_open("b") and a.send("b", "tcp://127.0.0.1:1", 2, b"x") is False
        first = a._senders["b"]
        a.connect("b", "127.0.0.1", port)  # the next round asks again: not tried again at that port
        assert a._senders["b"] is first and fallback.got == []
        a.connect("b", "127.0.0.1", b.port)  # a port of its own elsewhere is
        a.wait_open(["b"], 5)
        assert a.is_open("b") and a.send("b", "tcp://127.0.0.1:1", 3, b"there")
        assert inbox.wait_for(1) == [("tcp://127.0.0.1:1", "tcp://127.0.0.1:1", 3, b"there")]
    finally:
        a.close()
        b.close()
        held.close()
        listener.close()


@pytest.mark.parametrize("how", ["timeout", "queue"])
def test_a_peer_that_takes_nothing_breaks_the_connection(monkeypatch, how):
    # a listener that accepts and never reads: a cut link as the sender sees it
    server = socket.create_server(("127.0.0.1", 0))
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    if how == "queue":
        monkeypatch.setattr(_channel, "QUEUE_LIMIT", 8)
    fallback = Fallback()
    a = Channel("job", "tcp://127.0.0.1:1", "127.0.0.1", Inbox(), timeout=0.5 if how == "timeout" else 60,
                fallback=fallback)
    try:
        a.connect("b", "127.0.0.1", server.getsockname()[1])
        a.wait_open(["b"], 5)
        payload = b"\0" * (1 << 20)
        sent = 0
        end = time.monotonic() + 20
        while a.send("b", "tcp://127.0.0.1:1", sent, payload):
            sent += 1
            assert time.monotonic() < end
            if how == "timeout":
                time.sleep(0.05)
        assert not a.is_open("b") and not a.tried("b") and sent >= 1  # a write failed: tried again
        if how == "queue":
            assert sent <= 8 + 64  # what the queue held, and what the kernel's buffers took
        # the messages not written (the one being written too) went to the fallback: the last
        # ones accepted, in order
        _until(lambda: fallback.got)
        steps = [step for _, _, step, _ in fallback.got]
        assert steps == list(range(sent - len(steps), sent)), (steps, sent)
    finally:
        a.close()
        server.close()


def test_close_ends_the_channels_threads_and_its_port():
    inbox = Inbox()
    before = set(threading.enumerate())  # the objects: an ended thread's ident is reused
    a = Channel("job", "tcp://127.0.0.1:1", "127.0.0.1", Inbox(), timeout=5)
    b = Channel("job", "tcp://127.0.0.1:2", "127.0.0.1", inbox, timeout=5)
    a.connect("b", "127.0.0.1", b.port)
    a.wait_open(["b"], 5)
    a.send("b", "tcp://127.0.0.1:1", 1, b"hello")
    inbox.wait_for(1)
    a.close()
    b.close()
    _until(lambda: not [t for t in threading.enumerate() if t not in before and t.name.startswith("dlspark-channel")])
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", b.port), timeout=2).close()
    assert a.send("b", "tcp://127.0.0.1:1", 2, b"after close") is False


def _blocked_sender(fallback=None):
    """A channel whose connection to "b" waits in a write: the listener accepts and reads nothing,
    and more is queued than the kernel's buffers take. Returns the channel, the listener and the
    steps queued."""
    server = socket.create_server(("127.0.0.1", 0))
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    a = Channel("job", "tcp://127.0.0.1:1", "127.0.0.1", Inbox(), timeout=60, fallback=fallback)
    a.connect("b", "127.0.0.1", server.getsockname()[1])
    a.wait_open(["b"], 5)
    queued = [k for k in range(32) if a.send("b", "tcp://127.0.0.1:1", k, b"\0" * (1 << 20))]
    assert queued == list(range(32)) and a.is_open("b")
    time.sleep(0.5)  # the sender writes until the buffers are full, and waits
    return a, server, queued


def test_close_ends_a_write_that_waits_on_a_peer_now_not_at_the_timeout():
    before = set(threading.enumerate())  # the objects: an ended thread's ident is reused
    a, server, _ = _blocked_sender()
    try:
        senders = [t for t in threading.enumerate() if t not in before and t.name == "dlspark-channel-send"]
        assert senders and senders[0].is_alive()  # waiting in its write (the timeout is 60 s)
        t0 = time.monotonic()
        a.close()
        senders[0].join(timeout=10)
        assert not senders[0].is_alive() and time.monotonic() - t0 < 5
    finally:
        a.close()
        server.close()


def test_a_connection_replaced_while_it_waits_hands_what_it_did_not_write_to_the_fallback():
    # a peer's run set up again (a retried join) answers on another port at a later round: the old
    # connection's unwritten messages (the one it was writing too) go to the fallback in order,
    # nothing is dropped
    fallback = Fallback()
    a, server, queued = _blocked_sender(fallback)
    other = socket.create_server(("127.0.0.1", 0))
    try:
        a.connect("b", "127.0.0.1", other.getsockname()[1])
        _until(lambda: fallback.got)
        steps = [step for _, _, step, _ in fallback.got]
        assert 0 < len(steps) < len(queued) and steps == queued[-len(steps):], steps
        a.wait_open(["b"], 5)
        assert a.is_open("b")  # the new connection takes the next messages
    finally:
        a.close()
        server.close()
        other.close()
