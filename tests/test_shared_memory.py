"""Averaging contributions between co-located workers through shared memory (dlspark.distributed._shared)."""

import errno
import os
import threading
import time

import numpy as np
import optax
import pytest
from conftest import kill_at_round, slow_loader

from dlspark import DistributedTrainer, ParameterAveraging
from dlspark.data import save_minibatches
from dlspark.distributed._shared import SharedSlots, SharedViews, available, same_host

pytestmark = pytest.mark.skipif(not available(), reason="memory files (memfd_create, /proc) are Linux's")


def _held():
    """This process's open files and mappings of dlspark's shared memory."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        maps = [line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                for line in f if "memfd:dlspark-" in line]
    return [x for x in fds if "memfd:dlspark-" in x] + maps


def _memory_files():
    """This process's dlspark memory files: ``(inodes it holds a descriptor of, inodes it maps)``
    (a mapping holds a descriptor too)."""
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "memfd:dlspark-" in os.readlink(f"/proc/self/fd/{fd}"):
                held.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        mapped = {int(line.split()[4]) for line in f if "memfd:dlspark-" in line}
    return sorted(held), sorted(mapped)


def _held_by_workers(client, timeout=10.0):
    # a job's teardown on the workers runs on after the fit returns
    end = time.monotonic() + timeout
    while True:
        held = {w: h for w, h in client.run(_held).items() if h}
        if not held or time.monotonic() > end:
            return held
        time.sleep(0.1)


def test_leaves_cross_through_a_memory_file_aligned_and_by_turns():
    slots, views = SharedSlots("dlspark-test"), SharedViews()
    try:
        a = [np.arange(10, dtype=np.float32), np.ones((3, 5), np.float64), np.array(7, np.int32)]
        b = [x * 2 for x in a]
        wa, wb = slots.put(0, a), slots.put(1, b)
        assert wa.fd != wb.fd and wa.pid == os.getpid()
        got_a, got_b = views.views(wa), views.views(wb)
        for x, y in zip(a + b, got_a + got_b):
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(x, y)
        assert all(v.ctypes.data % 64 == 0 for v in got_a + got_b)  # XLA's CPU client reads them in place
        assert not got_a[0].flags.writeable  # a reader cannot change the writer's leaves
        assert wa.nbytes == sum(x.nbytes for x in a)
        # the round after next writes over the same file, in place, and the reader sees it
        again = slots.put(0, b)
        assert (again.fd, again.identity) == (wa.fd, wa.identity)
        np.testing.assert_array_equal(views.views(again)[1], b[1])
        del got_a, got_b, x, y
    finally:
        views.close()
        slots.close()
    assert _held() == []


def test_a_reader_lets_go_of_a_file_no_round_has_read_for_a_while():
    # A peer that left the job (killed, or dropped by the coordinator) keeps its memory alive
    # for as long as a reader maps it: the reader unmaps files unused for `keep` rounds.
    gone, live, views = SharedSlots("dlspark-test-gone"), SharedSlots("dlspark-test-live2"), SharedViews(keep=2)
    try:
        a = [np.arange(100, dtype=np.float32)]
        held = views.views(gone.put(0, a), round=0)
        for r in range(1, 4):
            views.prune(r)
            views.views(live.put(r % 2, a), round=r)
        # round 3 > 0 + keep: the gone peer's file is let go of, but not under a live view
        np.testing.assert_array_equal(held[0], a[0])
        del held
        gone.close()
        assert [m for m in _held() if "test-gone" in m] == []
        assert len(views.mapped) == 2  # the live peer's two slots
        views.prune(4)
        views.views(live.put(0, a), round=4)
        assert len(views.mapped) == 2
    finally:
        views.close()
        gone.close()
        live.close()
    assert _held() == []


def test_closing_while_views_live_leaves_them_readable():
    # A job closes on its event loop while its compute thread may still read a peer's leaves
    # (or copy its own): the views must keep their memory mapped, not read unmapped memory.
    slots, views = SharedSlots("dlspark-test-live"), SharedViews()
    a = [np.arange(1000, dtype=np.float32)]
    got = views.views(slots.put(0, a))
    views.close()
    slots.close()
    np.testing.assert_array_equal(got[0], a[0])
    assert slots.put(1, a) is None  # closed: nothing new is made
    del got
    assert _held() == []


def test_closing_lets_go_of_mappings_that_only_a_reference_cycle_still_held():
    # A view left in a reference cycle (an exception's traceback holding the frame that read a
    # peer's leaves) dies only at a full collection, which an idle worker may not reach for a
    # long time: closing collects. The automatic collector is off here, so that only close can.
    import gc

    class Holder:
        pass

    was = gc.isenabled()
    gc.disable()
    try:
        slots, views = SharedSlots("dlspark-test-cycle"), SharedViews()
        mine = slots.put(0, [np.arange(1000, dtype=np.float32)])
        # a reader's view of the file, and one of the writer's own mapping of it
        for view in (views.views(mine)[0], np.frombuffer(slots.files[0][1], np.float32, count=10)):
            held = Holder()
            held.self, held.view = held, view
        del held, view
        assert len([m for m in _held() if "test-cycle" in m]) >= 2  # both mappings live on
        views.close()
        assert len([m for m in _held() if "test-cycle" in m]) >= 1  # the writer's, still open
        slots.close()
        assert _held() == []
    finally:
        if was:
            gc.enable()


def test_a_file_that_is_not_the_one_named_is_refused():
    # the same /proc path can name another file: another pid namespace, or a number reused
    import dataclasses

    slots, views = SharedSlots("dlspark-test-identity"), SharedViews()
    where = slots.put(0, [np.zeros(100, np.float32)])
    other = dataclasses.replace(where, identity=(where.identity[0], where.identity[1] + 1))
    with pytest.raises(OSError, match="is not the shared file it was"):
        views.views(other)
    views.close()
    slots.close()


def test_a_machine_short_of_memory_leaves_the_comms_and_no_file(monkeypatch):
    # A machine out of memory cannot be made here: posix_fallocate's refusal is simulated,
    # which is what the kernel answers when the pages cannot be reserved.
    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    slots = SharedSlots("dlspark-test-full")
    assert slots.put(0, [np.zeros(1000, np.float32)]) is None
    assert slots.put(1, [np.zeros(10, np.float32)]) is None  # the job keeps the comms from then on
    assert _held() == []
    slots.close()


def test_a_reader_that_cannot_map_the_file_is_told_so():
    slots, views = SharedSlots("dlspark-test-gone"), SharedViews()
    where = slots.put(0, [np.zeros(100, np.float32)])
    slots.close()  # the writer let go of it (its job closed, or its process is gone)
    with pytest.raises(OSError):
        views.views(where)
    views.close()


def test_same_host_compares_the_hosts_of_plain_tcp_addresses():
    assert same_host("tcp://127.0.0.1:4001", "tcp://127.0.0.1:4002")
    assert not same_host("tcp://10.0.0.1:4001", "tcp://10.0.0.2:4001")
    assert not same_host("tcp://127.0.0.1:4001", "not an address")
    assert not same_host("tls://127.0.0.1:4001", "tls://127.0.0.1:4002")  # a TLS cluster keeps the comms


def _fit(client, make_net, tr, **kw):
    net = make_net(updater=optax.adam(1e-2))
    trainer = DistributedTrainer(client, net, ParameterAveraging(batch_size_per_worker=32, averaging_frequency=3),
                                 progress=False)
    trainer.fit(tr[:576], **kw)
    return trainer


def _use_shared_memory(on):
    import dask

    dask.config.set({"dlspark.worker.shared-memory": on})


def test_co_located_workers_average_through_shared_memory_with_the_comms_bits(client2, make_net, digits):
    tr, _ = digits
    shared = _fit(client2, make_net, tr)
    stats = shared.last_fit_stats
    assert stats and all(s["bytes_shared"] == s["bytes_received"] > 0 for s in stats)
    shared.close()
    assert _held_by_workers(client2) == {}  # the job's files and mappings go with it
    client2.run(_use_shared_memory, False)  # dlspark.worker.shared-memory, in the workers' config
    try:
        comms = _fit(client2, make_net, tr)
        assert all(s["bytes_shared"] == 0 and s["bytes_received"] > 0 for s in comms.last_fit_stats)
        assert _held_by_workers(client2, timeout=0) == {}
    finally:
        client2.run(_use_shared_memory, True)
    for x, y in zip(jax_leaves(shared.network.state), jax_leaves(comms.network.state)):
        np.testing.assert_array_equal(x, y)


def test_the_later_of_two_workers_reads_the_contribution_its_peer_offered(client2, make_net, digits, tmp_path):
    # A worker that finishes its fit tells its co-located peer where its contribution lies;
    # the peer, finishing later, reads it from there without asking. Here one worker is
    # slowed (its loads sleep), so it is the later one in every round: each of its fetches
    # takes an offer, and the other worker's ask for the slow one's contribution.
    tr, _ = digits
    save_minibatches(tr[:576], url=str(tmp_path / "mb"), batch_size=32)
    slow = sorted(client2.scheduler_info()["workers"])[0]
    net = make_net(updater=optax.adam(1e-2))
    master = ParameterAveraging(batch_size_per_worker=32, averaging_frequency=3, collect_training_stats=True)
    trainer = DistributedTrainer(client2, net, master, progress=False)
    trainer.fit_paths(str(tmp_path / "mb"), epochs=2, loader=slow_loader(0.1, pid=client2.run(os.getpid)[slow]))
    fetches = sorted((e for e in trainer.training_stats.events if e["phase"] == "fetch"), key=lambda e: e["round"])
    offered = {w: [e["offered"] for e in fetches if e["worker"] == w] for w in {e["worker"] for e in fetches}}
    assert len(offered) == 2 and len(offered[slow]) == 6  # 18 minibatches an epoch: 3 rounds of 2 x 3
    # the first round also compiles, which may leave either worker the later one
    assert offered[slow][1:] == [1] * 5, offered
    assert [n for w, v in offered.items() if w != slow for n in v[1:]] == [0] * 5, offered
    assert all(s["bytes_shared"] == s["bytes_received"] > 0 for s in trainer.last_fit_stats)
    # an offered contribution counts as served once, read from the offer or on asking
    per_worker = trainer.training_stats.per_worker()
    assert all(w["bytes_sent"] == w["bytes_received"] > 0 for w in per_worker.values()), per_worker
    trainer.close()


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def test_a_killed_worker_leaves_no_segment_behind(client2, make_net, digits, tmp_path):
    tr, _ = digits
    save_minibatches(tr[:576], url=str(tmp_path / "mb"), batch_size=32)
    on_round, killed = kill_at_round(client2, 2)
    late, seen, after = threading.Event(), {}, []

    def watch(stat):
        on_round(stat)
        if killed.is_set():
            after.append(stat["round"])
            if len(after) == 8:  # files last read at round 2 or 3 are let go of by round 8
                late.set()

    net = make_net(updater=optax.adam(1e-2))
    trainer = DistributedTrainer(client2, net, ParameterAveraging(batch_size_per_worker=32, averaging_frequency=3),
                                 progress=False)
    # slow minibatches (0.05 s each) keep the job alive while this thread looks at the workers
    fit = threading.Thread(target=lambda: seen.setdefault("net", trainer.fit_paths(
        str(tmp_path / "mb"), epochs=4, loader=slow_loader(0.05), callbacks=[watch])))
    fit.start()
    assert late.wait(120)
    files = client2.run(_memory_files)  # mid-fit, 8 rounds after the kill
    fit.join(120)
    assert killed.is_set() and "net" in seen and len(after) > 8  # the job was still running
    assert sum(s["minibatches"] for s in trainer.last_fit_stats) == 4 * 18
    # Each worker in the job writes two files and maps its peer's two: the files mapped
    # anywhere are those of the workers in the job, not the killed one's too. (Python's mmap
    # keeps a descriptor of what it maps, so descriptors alone cannot tell them apart.)
    in_job = [w for w, (held, _) in files.items() if held]
    assert len(set().union(*(mapped for _, mapped in files.values()))) <= 2 * len(in_job), files
    trainer.close()
    # the survivor lets go of its files and of its mappings when the job closes, and the
    # kernel frees the memory with the last of them
    assert _held_by_workers(client2) == {}


def _collections():
    from dlspark.distributed import _shared

    return _shared.collections


def test_a_job_ends_without_a_full_collection(client2, make_net, digits):
    # A fit's last mean reads the peer's memory in place and may still run when the job is
    # torn down: the close waits for it, so that the views go with it and no full collection
    # (_shared's last resort, 100 ms and more of a worker's time) is made at each fit's end.
    # A network of 2 MB of state makes the last mean long enough to be caught running.
    from conftest import MLP

    tr, _ = digits
    client2.wait_for_workers(2, timeout=60)  # the worker killed by the test before is back: it counts too
    before = client2.run(_collections)
    net = make_net(module=MLP(hidden=2048), updater=optax.adam(1e-3))
    trainer = DistributedTrainer(client2, net, ParameterAveraging(batch_size_per_worker=32, averaging_frequency=2),
                                 progress=False)
    for _ in range(4):
        trainer.fit(tr[:256])
    trainer.close()
    assert _held_by_workers(client2) == {}
    assert client2.run(_collections) == before


def test_extension_dtypes_cross_as_themselves():
    # bfloat16's dtype string is "<V2" (raw bytes): the layout carries the dtype itself, so
    # the reader's view is bfloat16 with the writer's values, not bytes.
    import jax.numpy as jnp

    slots, views = SharedSlots("dlspark-test-bf16"), SharedViews()
    leaves = [np.asarray(jnp.arange(5, dtype=jnp.bfloat16) / 4), np.arange(3, dtype=np.float32)]
    got = views.views(slots.put(0, leaves))
    assert [g.dtype for g in got] == [x.dtype for x in leaves]
    for g, x in zip(got, leaves):
        np.testing.assert_array_equal(g, x)
    del got
    views.close()
    slots.close()
    # leaves a memory file cannot hold: the job keeps the comms, as when memory is short
    odd = SharedSlots("dlspark-test-odd")
    assert odd.put(0, [np.array([object()], dtype=object)]) is None and odd.failed
    odd.close()


def test_a_network_with_bfloat16_parameters_averages_through_shared_memory(client2, make_net, digits):
    import jax.numpy as jnp
    from conftest import HalfMLP

    tr, _ = digits
    net = make_net(module=HalfMLP(), updater=optax.adam(1e-2, mu_dtype=jnp.float32))
    trainer = DistributedTrainer(client2, net, ParameterAveraging(batch_size_per_worker=32, averaging_frequency=3),
                                 progress=False)
    trainer.fit(tr[:192])
    assert all(s["bytes_shared"] == s["bytes_received"] > 0 for s in trainer.last_fit_stats)
    assert {np.asarray(x).dtype for x in jax_leaves(net.state.params)} == {np.dtype(jnp.bfloat16)}
    trainer.close()


def _unmappable(on):
    # What a reader in another pid namespace on the same host address meets: the writer's
    # /proc/<pid>/fd/<fd> is not there. (Such a namespace cannot be made for a test here.)
    import builtins

    from dlspark.distributed._shared import SharedViews

    if on:
        builtins._dlspark_views = SharedViews.views

        def views(self, where, round=None):
            builtins._dlspark_tries = getattr(builtins, "_dlspark_tries", 0) + 1
            raise FileNotFoundError(f"/proc/{where.pid}/fd/{where.fd}")

        SharedViews.views = views
        builtins._dlspark_tries = 0
        return 0
    SharedViews.views = builtins._dlspark_views
    return builtins._dlspark_tries


def test_a_reader_that_cannot_map_a_live_peers_file_keeps_the_comms_for_the_rest_of_the_job(client2, make_net,
                                                                                              digits):
    tr, _ = digits
    reader = sorted(client2.scheduler_info()["workers"])[0]
    client2.run(_unmappable, True, workers=[reader])
    try:
        trainer = _fit(client2, make_net, tr)  # 18 minibatches: 3 rounds
    finally:
        tries = client2.run(_unmappable, False, workers=[reader])[reader]
    # one failed map; the peer answered through the comms, so no later round tries again
    assert tries == 1
    assert len(trainer.last_fit_stats) == 3 and all(s["bytes_received"] > 0 for s in trainer.last_fit_stats)
    trainer.close()
