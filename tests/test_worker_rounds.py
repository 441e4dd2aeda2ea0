"""The worker handlers of a round, driven one call at a time on a real 3-worker LocalCluster.

The scheduler's coordinator sends these calls; here the test sends them itself, so that
it can stage the orders a lost worker produces (a second average over fewer
contributors, after the first one already ran) without racing a real kill.
"""

import asyncio
import uuid

import jax
import numpy as np
import pytest
from conftest import _cluster_client

import cloudpickle

from dlspark import DistributedTrainer, ParameterAveraging
from dlspark.algorithms.averaging._messages import AverageOrder, AverageWith
from dlspark.algorithms.sharing._messages import SyncOrder
from dlspark.checkpoint import state_from_arrays, state_to_arrays
from dlspark.data import load_minibatch, save_minibatches
from dlspark.distributed._client import checked, setup_workers
from dlspark.distributed._messages import FitOrder, JobSpec
from distributed.protocol import to_serialize

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client3():
    yield from _cluster_client(3)


def _leaves(state):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(state.params)]


class _DrivenJob:
    """A job on ``client``'s workers whose handlers the test calls itself: minibatch files
    of 32 digits each, the spec and state the trainer would send, and ``call``."""

    def __init__(self, client, make_net, digits, tmp_path, n_examples, master=None):
        tr, _ = digits
        self.client = client
        self.urls = save_minibatches(tr[:n_examples], url=str(tmp_path / "mb"), batch_size=32)
        self.net = make_net()
        # steps at the updater's own rate: the tests compute a replica's steps here with the network's
        master = master or ParameterAveraging(batch_size_per_worker=32, update_scale=1.0)
        DistributedTrainer(client, self.net, master, progress=False)  # installs the plugins
        self.workers = sorted(client.scheduler_info()["workers"])
        # the master a fit settles for its workers (update_scale), as the trainer sends it
        self.spec = cloudpickle.dumps(JobSpec(self.net.definition(), self.net.token,
                                              master.for_workers(len(self.workers)), self.urls))
        self.state = state_to_arrays(self.net.state)
        self.id = uuid.uuid4().hex[:12]

    async def setup(self, workers):
        await setup_workers(self.client, workers, self.id, self.spec, self.state)

    async def order(self, addr, order):
        """Send one of the coordinator's orders; the worker's typed reply."""
        return checked(await self.client.rpc(addr).dlspark_order(job=self.id, order=to_serialize(order)))["reply"]

    async def fit(self, addr, round, refs, contributors):
        return await self.order(addr, FitOrder(round=round, epoch=0, refs=tuple(refs), plan=AverageWith(tuple(contributors))))

    async def average(self, addr, round, contributors, attempt=0):
        return await self.order(addr, AverageOrder(round, tuple(contributors), attempt))

    async def peer(self, addr, request, **kw):
        """A peer's request, as another worker makes it."""
        return checked(await self.client.rpc(addr).dlspark_peer(job=self.id, request=request, **kw))["reply"]

    async def teardown(self, addr):
        checked(await self.client.rpc(addr).dlspark_teardown(job=self.id))

    async def state_of(self, addr):
        return checked(await self.client.rpc(addr).dlspark_state(job=self.id))["state"]

    async def params(self, addr):
        return _leaves(state_from_arrays(await self.state_of(addr), self.net.state))


def test_averaging_again_over_fewer_contributors_starts_from_the_stored_inputs(client3, make_net, digits, tmp_path):
    job = _DrivenJob(client3, make_net, digits, tmp_path, 64)
    net, urls, state = job.net, job.urls, job.params
    a, b, c = job.workers
    start = _leaves(net.state)

    async def scenario():
        await job.setup([a, b, c])
        # Round 1: a and b fit a minibatch each and average; c has no data and only averages.
        await asyncio.gather(job.fit(a, 1, [0], [a, b]), job.fit(b, 1, [1], [a, b]), job.average(c, 1, [a, b]))
        mean = [await state(w) for w in (a, b, c)]
        # b is lost after everyone averaged: the coordinator averages again over a alone.
        await asyncio.gather(job.average(a, 1, [a], 1), job.average(c, 1, [a], 1))
        only_a = [await state(w) for w in (a, c)]
        # a is lost too: the round trained nothing, and c goes back to where it started.
        await job.average(c, 1, [], 2)
        back = await state(c)
        await asyncio.gather(*[job.teardown(w) for w in (a, b, c)])
        return mean, only_a, back

    mean, only_a, back = client3.sync(scenario)
    for x, y, z in zip(*mean):
        np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(x, z)
    # a's own fit of minibatch 0, computed here: what a and c must hold after b's loss
    st = net.steps.train_step(jax.tree_util.tree_map(np.copy, net.state),
                              jax.tree_util.tree_map(np.asarray, load_minibatch(urls[0]).jit_batch())).state
    for x, y, want, m in zip(*only_a, _leaves(st), mean[0]):
        np.testing.assert_array_equal(x, y)
        np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-6)
    assert any(not np.allclose(x, m) for x, m in zip(only_a[0], mean[0]))  # not the two-worker mean kept
    for x, s in zip(back, start):
        np.testing.assert_array_equal(x, s)


def _prefetch_threads():
    import threading

    return sum(t.name == "dlspark-prefetch" for t in threading.enumerate())


def _jobs_on_worker(dask_worker):
    return sorted(dask_worker.plugins["dlspark"].jobs)


def test_a_job_set_up_twice_or_after_its_teardown_leaves_no_thread_behind(client3, make_net, digits, tmp_path):
    import time

    driven = _DrivenJob(client3, make_net, digits, tmp_path, 64)
    spec, state, job, a = driven.spec, driven.state, driven.id, driven.workers[0]

    def threads_settle_at(n):
        for _ in range(100):
            if client3.run(_prefetch_threads, workers=[a])[a] == n:
                return True
            time.sleep(0.02)
        return False

    base = client3.run(_prefetch_threads, workers=[a])[a]
    client3.sync(setup_workers, client3, [a], job, spec, state)
    client3.sync(setup_workers, client3, [a], job, spec, state)  # a retried join sets it up again
    assert threads_settle_at(base + 1)  # the first set-up's loading thread ended
    client3.sync(lambda: client3.rpc(a).dlspark_teardown(job=job))
    assert threads_settle_at(base)
    # A set-up that finishes after its job's teardown (the fit failed on another worker) is refused.
    with pytest.raises(RuntimeError, match="ended before its set-up"):
        client3.sync(setup_workers, client3, [a], job, spec, state)
    assert job not in client3.run(_jobs_on_worker, workers=[a])[a]
    assert threads_settle_at(base)


def test_sync_names_a_holder_it_cannot_fetch_from_instead_of_failing(client3, make_net, digits, tmp_path):
    # b never set the job up (as a holder lost since it reported its messages): a's sync
    # applies what it could fetch and names b, for the coordinator to drop it.
    from dlspark import GradientSharing

    job = _DrivenJob(client3, make_net, digits, tmp_path, 64, GradientSharing(batch_size_per_worker=32))
    a, b, _ = job.workers

    async def scenario():
        await job.setup([a])
        try:
            return await job.order(a, SyncOrder({b: [[b, 1]]}))
        finally:
            await job.teardown(a)

    resp = client3.sync(scenario)
    assert list(resp.unreachable) == [b]


def test_three_contributors_average_in_shares_with_the_bits_of_the_full_mean(client3, make_net, digits, tmp_path):
    # Each of three contributors averages one share and fetches the two others: every
    # replica receives 4/3 of the parameters instead of 2x, and all hold the same bits.
    from dlspark.algorithms.averaging._numerics import average_leaves

    job = _DrivenJob(client3, make_net, digits, tmp_path, 96)
    net, urls, workers = job.net, job.urls, job.workers
    floats = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(net.state)
                 if np.issubdtype(np.asarray(x).dtype, np.floating))

    async def scenario():
        await job.setup(workers)
        fits = await asyncio.gather(*[job.fit(w, 1, [i], workers) for i, w in enumerate(workers)])
        states = [state_from_arrays(await job.state_of(w), net.state) for w in workers]
        await asyncio.gather(*[job.teardown(w) for w in workers])
        return fits, states

    fits, states = client3.sync(scenario)
    for f in fits:
        assert f.extra["averaged"].ok and not f.unreachable
        assert 0.6 * floats < f.extra["averaged"].bytes_received < 1.5 * floats  # 4/3, not 2
    for other in states[1:]:  # the parameters (each replica keeps its own RNG key)
        for x, y in zip(_leaves(states[0]), _leaves(other)):
            np.testing.assert_array_equal(x, y)
    # the mean of the three fits, computed here (no dropout: the rank's RNG does not matter)
    fitted = []
    for u in urls:
        st = net.steps.train_step(jax.tree_util.tree_map(np.copy, net.state),
                                  jax.tree_util.tree_map(np.asarray, load_minibatch(u).jit_batch())).state
        fitted.append(_leaves(st))
    for x, w in zip(_leaves(states[0]), average_leaves(fitted[0], fitted)):
        np.testing.assert_allclose(x, w, rtol=1e-5, atol=1e-6)


def test_a_share_owner_that_cannot_be_reached_is_named_and_the_survivors_average(client3, make_net, digits, tmp_path):
    # The third contributor never set the job up (a worker lost before the averaging):
    # both others name it, and averaging again over the two left gives their mean.
    job = _DrivenJob(client3, make_net, digits, tmp_path, 64)
    net = job.net
    a, b, c = job.workers

    async def scenario():
        await job.setup([a, b])
        fits = await asyncio.gather(job.fit(a, 1, [0], [a, b, c]), job.fit(b, 1, [1], [a, b, c]))
        again = await asyncio.gather(*[job.average(w, 1, [a, b], 1) for w in (a, b)])
        states = [await job.params(w) for w in (a, b)]
        await asyncio.gather(*[job.teardown(w) for w in (a, b)])
        return fits, again, states

    fits, again, states = client3.sync(scenario)
    assert [f.unreachable for f in fits] == [(c,), (c,)]
    assert all(r.ok and not r.unreachable for r in again)
    for x, y in zip(*states):
        np.testing.assert_array_equal(x, y)
    assert any(not np.allclose(x, s) for x, s in zip(states[0], _leaves(net.state)))


def test_three_workers_sgd_frequency_one_equals_synchronous_large_batch_sgd(client3, make_net, digits):
    # The whole job with shares: averaging three SGD steps is one step on their union (at 3x the rate).
    batches, net, trainer = _sgd_job(client3, make_net, digits)
    trainer.fit(batches)
    assert all(s["workers"] == 3 for s in trainer.last_fit_stats)
    _assert_equals_synchronous_sgd(net, make_net, batches)


def _sgd_job(client, make_net, digits):
    """18 digits minibatches of 32, and a trainer averaging SGD (lr 0.1) after every step;
    making the trainer installs the plugins, and so the workers' handlers."""
    import optax

    tr, _ = digits
    net = make_net(updater=optax.sgd(0.1))
    master = ParameterAveraging(batch_size_per_worker=32, averaging_frequency=1)
    return tr[:576].batches(32), net, DistributedTrainer(client, net, master, progress=False)


def _assert_equals_synchronous_sgd(net, make_net, batches, workers=3):
    """Averaging ``workers`` SGD steps (lr 0.1) each round, scaled by the workers (the default
    ``update_scale``), is one step on their union at the rate times the workers (the linear rule)."""
    import optax

    from dlspark import DataSet

    sync = make_net(updater=optax.sgd(0.1 * workers))
    sync.fit([DataSet.merge(batches[i:i + workers]) for i in range(0, len(batches), workers)])
    for x, y in zip(_leaves(net.state), _leaves(sync.state)):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def test_a_teardown_ends_the_calls_still_waiting_on_the_job(client3, make_net, digits, tmp_path):
    # A peer waiting for a share or a contribution that will never come (the job failed
    # elsewhere) is answered at teardown, not after the handlers' 600 s timeout.
    job = _DrivenJob(client3, make_net, digits, tmp_path, 64)
    a, b, c = job.workers

    async def scenario():
        await job.setup([a])
        waiting = [asyncio.ensure_future(job.peer(a, "share", round=1, contributors=[a, b, c])),
                   asyncio.ensure_future(job.peer(a, "contribution", round=1))]
        await asyncio.sleep(0.5)
        assert not any(w.done() for w in waiting)
        await job.teardown(a)
        return await asyncio.wait_for(asyncio.gather(*waiting), timeout=30)

    share, contribution = client3.sync(scenario)
    assert type(share).__name__ == "Unavailable" and type(contribution).__name__ == "Unavailable"


def _fail_first_contribution_call(round_no, dask_worker=None):
    # Fault injection: a real transient failure between two live workers cannot be made to
    # happen on cue, so this worker answers one fetch of its contribution as unavailable.
    from dlspark.distributed._messages import Unavailable

    handler = dask_worker.handlers["dlspark_peer"]
    failed = []

    async def flaky(**kw):
        if kw.get("request") == "contribution" and kw.get("round") == round_no and not failed:
            failed.append(True)
            return {"reply": to_serialize(Unavailable())}
        return await handler(**kw)

    dask_worker._dlspark_injected = (handler, failed)
    dask_worker.handlers["dlspark_peer"] = flaky


def _restore_contribution_handler(dask_worker):
    handler, failed = dask_worker._dlspark_injected
    dask_worker.handlers["dlspark_peer"] = handler
    return len(failed)


def test_a_passing_fetch_failure_does_not_throw_a_live_workers_round_away(client3, make_net, digits):
    # One worker fails to fetch a live peer's share once: the coordinator asks the peer
    # itself, finds it answers, and has the round averaged again over all three.
    batches, net, trainer = _sgd_job(client3, make_net, digits)
    victim = sorted(client3.scheduler_info()["workers"])[1]
    client3.run(_fail_first_contribution_call, 3, workers=[victim])
    try:
        trainer.fit(batches)
    finally:
        injected = client3.run(_restore_contribution_handler, workers=[victim])[victim]
    assert injected == 1  # the failure happened
    assert [s["workers"] for s in trainer.last_fit_stats] == [3] * 6  # round 3 kept all three
    _assert_equals_synchronous_sgd(net, make_net, batches)


def test_the_final_state_comes_from_the_first_worker_that_can_send_it(client3, make_net, digits, tmp_path):
    # Every replica holds the trained state at the end of a job: a worker lost just after
    # the job ended (here: one that no longer has it) is passed over, not fatal.
    from dlspark.errors import JobFailedError
    from dlspark.distributed._client import fetch_state_from_any

    job = _DrivenJob(client3, make_net, digits, tmp_path, 64)
    a, b, c = job.workers

    async def scenario():
        await job.setup([b])
        try:
            found = await fetch_state_from_any(client3, [a, b, c], job.id, 7, 1)
        finally:
            await job.teardown(b)
        with pytest.raises(JobFailedError, match="no worker could send its state") as failed:
            await fetch_state_from_any(client3, [a, c], job.id, 7, 1)
        return found, str(failed.value)

    (source, state), message = client3.sync(scenario)
    assert source == b
    restored = state_from_arrays(state["state"], job.net.state)
    assert (int(restored.step), int(restored.epoch)) == (7, 1)
    for x, y in zip(_leaves(restored), _leaves(job.net.state)):
        np.testing.assert_array_equal(x, y)
    assert a in message and c in message


def test_a_sharing_worker_numbers_its_messages_from_the_counter_its_fit_order_gives(client3, make_net, digits,
                                                                                    tmp_path):
    # A worker back at an address whose earlier run's messages every replica holds up to
    # step 5 (the coordinator's counter for it) sends its first message as step 6.
    from dlspark import GradientSharing
    from dlspark.algorithms.sharing._messages import HaveOrder, ShareWith

    job = _DrivenJob(client3, make_net, digits, tmp_path, 64, master=GradientSharing(batch_size_per_worker=32))
    a = job.workers[0]

    async def scenario():
        await job.setup([a])
        try:
            await job.order(a, FitOrder(round=1, epoch=0, refs=(0,), plan=ShareWith({a: (5, 1)})))
            return await job.order(a, HaveOrder())
        finally:
            await job.teardown(a)

    have = client3.sync(scenario)
    assert have.have == {a: [6]} and have.step == 6


def test_moves_in_bfloat16_are_averaged_in_shares_and_again_over_fewer_contributors(client3, make_net, digits,
                                                                                       tmp_path):
    from dlspark.algorithms.averaging._numerics import averaged_indices, encode_moves, mean_of_moves

    master = ParameterAveraging(batch_size_per_worker=32, update_scale=1.0, exchange_precision="bfloat16")
    job = _DrivenJob(client3, make_net, digits, tmp_path, 96, master)
    net, urls = job.net, job.urls
    a, b, c = job.workers
    mixed = averaged_indices(net.state, True)

    def floats(state):
        every = jax.tree_util.tree_leaves(state)
        return [np.asarray(every[i], np.float32) for i in mixed]

    async def scenario():
        await job.setup([a, b, c])
        # three contributors: each averages a share of the moves and gathers the others'
        replies = await asyncio.gather(*[job.fit(w, 1, [i], [a, b, c]) for i, w in enumerate((a, b, c))])
        mean = [floats(state_from_arrays(await job.state_of(w), net.state)) for w in (a, b, c)]
        # b is lost after everyone averaged: a and c average again over a alone
        await asyncio.gather(job.average(a, 1, [a], 1), job.average(c, 1, [a], 1))
        only_a = [floats(state_from_arrays(await job.state_of(w), net.state)) for w in (a, c)]
        await asyncio.gather(*[job.teardown(w) for w in (a, b, c)])
        return replies, mean, only_a

    replies, mean, only_a = client3.sync(scenario)
    # each replica's own fit of its minibatch, computed here, and the mean of its moves in bfloat16
    theta = floats(net.state)
    fitted = [floats(net.steps.train_step(jax.tree_util.tree_map(np.copy, net.state),
                                          jax.tree_util.tree_map(np.asarray, load_minibatch(u).jit_batch())).state)
              for u in urls]
    moves = [encode_moves(y, theta, [np.zeros_like(t) for t in theta])[0] for y in fitted]
    want = mean_of_moves(theta, moves)
    for got in mean:  # every replica holds the same bits: the round's start plus the mean move
        for x, w in zip(got, want, strict=True):
            np.testing.assert_allclose(x, w, rtol=0, atol=1e-7)
    exact = [sum(ys) / 3 for ys in zip(*fitted)]  # near the float32 mean, not on it
    gap = max(float(np.abs(x - e).max()) for x, e in zip(mean[0], exact))
    assert 0 < gap < 1e-2 * 2.0 ** -8
    # a replica fetched its two peers' slices of their moves in 16 bits an element (its own
    # share, s elements: 2 * 2 * s bytes), then the others' mean shares in 32 (4 * (n - s)):
    # 4 * n bytes, where float32 moves would take 4 * n + 4 * s
    elements = sum(t.size for t in theta)
    assert [r.extra["averaged"].bytes_received for r in replies] == [4 * elements] * 3
    # averaged again over a alone: a's own move, rounded, from the same start, on a and on c
    alone = mean_of_moves(theta, moves[:1])
    for got in only_a:
        for x, w in zip(got, alone, strict=True):
            np.testing.assert_allclose(x, w, rtol=0, atol=1e-7)
