"""The worker's prefetcher: order, look-ahead across rounds, bounded depth, errors."""

import threading
import time

import pytest

from dlspark.distributed._prefetch import Prefetcher


class Recorder:
    """A load function that records which refs it loaded, optionally gated."""

    def __init__(self, gate=None):
        self.loaded = []
        self.gate = gate
        self.lock = threading.Lock()

    def __call__(self, ref):
        if self.gate is not None:
            self.gate.wait(5)
        if ref == "bad":
            raise ValueError("cannot read 'bad'")
        with self.lock:
            self.loaded.append(ref)
        return ref * 10


def wait_for(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


@pytest.mark.parametrize("depth", [0, 1, 2, 5])
def test_values_in_order_across_rounds(depth):
    load = Recorder()
    p = Prefetcher(load, depth)
    rounds = [[1, 2, 3], [4, 5], [6], [1, 2]]  # a later epoch repeats refs
    got = []
    for i, refs in enumerate(rounds):
        p.expect(refs, ahead=rounds[i + 1] if i + 1 < len(rounds) else ())
        got.append(list(p.iterate(refs)))
    p.close()
    assert got == [[r * 10 for r in refs] for refs in rounds]
    assert sorted(load.loaded) == sorted(r for refs in rounds for r in refs)  # each loaded once


def test_hint_is_loaded_before_the_next_round_starts():
    load = Recorder()
    p = Prefetcher(load, depth=2)
    p.expect([1, 2], ahead=[3, 4, 5])
    assert list(p.iterate([1, 2])) == [10, 20]
    wait_for(lambda: load.loaded == [1, 2, 3, 4])  # two ahead, not three: depth bounds it
    time.sleep(0.05)
    assert load.loaded == [1, 2, 3, 4]
    p.expect([3, 4, 5])
    assert p.wasted == 0
    assert list(p.iterate([3, 4, 5])) == [30, 40, 50]
    p.close()


def test_wrong_hint_is_dropped_and_counted():
    load = Recorder()
    p = Prefetcher(load, depth=2)
    p.expect([1], ahead=[2, 3])
    assert p.take(1) == 10
    wait_for(lambda: len(load.loaded) == 3)
    p.expect([7, 8])  # the plan changed (a worker left): 2 and 3 were loaded for nothing
    assert p.wasted == 2
    assert list(p.iterate([7, 8])) == [70, 80]
    p.close()


def test_depth_bounds_what_is_held():
    gate = threading.Event()
    load = Recorder(gate)
    p = Prefetcher(load, depth=3)
    p.expect(list(range(10)))
    gate.set()
    wait_for(lambda: len(load.loaded) == 3)
    time.sleep(0.05)
    assert len(load.loaded) == 3
    assert p.take(0) == 0
    wait_for(lambda: len(load.loaded) == 4)
    p.close()


def test_an_unexpected_take_loads_inline():
    p = Prefetcher(Recorder(), depth=2)
    p.expect([1, 2])
    assert p.take(9) == 90
    assert list(p.iterate([1, 2])) == [10, 20]
    p.close()


@pytest.mark.parametrize("depth", [0, 2])
def test_errors_reach_the_consumer_for_their_ref_only(depth):
    p = Prefetcher(Recorder(), depth)
    p.expect([1, "bad", 2])
    assert p.take(1) == 10
    with pytest.raises(ValueError, match="cannot read 'bad'"):
        p.take("bad")
    assert p.take(2) == 20
    # an error in a wrong hint is never raised
    p.expect([3], ahead=["bad"])
    assert p.take(3) == 30
    p.expect([4])
    assert p.take(4) == 40
    p.close()


def test_close_stops_the_thread():
    p = Prefetcher(Recorder(), depth=2)
    p.close()
    p._thread.join(2)
    assert not p._thread.is_alive()


def test_every_load_runs_on_the_loading_thread():
    """Readers such as numpy's .npy header parser are not thread-safe on some CPython
    3.11 releases: with a loading thread, the consumer never loads by itself."""
    threads = set()

    def load(ref):
        threads.add(threading.current_thread().name)
        return ref

    p = Prefetcher(load, depth=1)
    for refs in ([1, 2, 3], [4], [5, 6]):
        p.expect(refs, ahead=[9])  # a wrong hint each time
        assert list(p.iterate(refs)) == refs
    assert p.take(42) == 42  # not expected at all
    p.close()
    assert threads == {"dlspark-prefetch"}


def test_closing_releases_a_consumer_waiting_for_a_load():
    gate = threading.Event()
    p = Prefetcher(Recorder(gate), depth=1)
    p.expect([1, 2])
    errors = []

    def consume():
        try:
            p.take(1)
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=consume)
    t.start()
    time.sleep(0.05)
    p.close()  # a job torn down mid-round: the compute thread must not hang
    t.join(2)
    gate.set()
    assert not t.is_alive()
    assert len(errors) == 1 and "torn down" in errors[0]
