"""LocalSGD (dlspark.algorithms.localsgd): written only against ReplicaAlgorithm, it runs
unchanged on a 2-worker cluster and on ParallelWrapper over 2 CPU devices.

The oracle is the algorithm done by hand in this process: each replica's local steps from
the round's start, its pseudo-gradient plus the error it kept, rounded to bfloat16, the
mean in float32, the step from the round's start (the outer step after full rounds only).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP, accuracy

from dlspark import DistributedTrainer, ParallelWrapper
from dlspark.algorithms import LocalSGD, ReplicaAlgorithm

CPU2 = jax.devices("cpu")[:2]


def _by_hand(net, batches, workers, k, tx=None, gate=True):
    start = net.state
    rngs = [start.rng] + [jax.random.fold_in(start.rng, r) for r in range(1, workers)]
    states = [start.replace(rng=r) for r in rngs]
    errors = [jax.tree_util.tree_map(lambda p: np.zeros(p.shape, np.float32), start.params)] * workers
    outer = None if tx is None else tx.init(start.params)
    for r0 in range(0, len(batches), workers * k):
        chunk = batches[r0:r0 + workers * k]
        sent, full = [], True
        x0 = states[0].params
        for w, share in enumerate(np.array_split(np.arange(len(chunk)), workers)):
            if len(share) == 0:
                continue
            full = full and len(share) >= k
            st = states[w]
            for i in share:
                st = net.steps.train_step(jax.tree_util.tree_map(lambda a: a.copy(), st),
                                          jax.tree_util.tree_map(np.asarray, chunk[i].jit_batch())).state
            pseudo = jax.tree_util.tree_map(lambda s, p, e: np.asarray(s - p, np.float32) + e, x0, st.params, errors[w])
            q = jax.tree_util.tree_map(lambda g: np.asarray(jnp.asarray(g).astype(jnp.bfloat16)), pseudo)
            errors[w] = jax.tree_util.tree_map(lambda g, b: g - b.astype(np.float32), pseudo, q)
            sent.append(q)
            states[w] = st
        mean = jax.tree_util.tree_map(lambda *xs: sum(x.astype(np.float32) for x in xs) / np.float32(len(xs)), *sent)
        if tx is None or (gate and not full):  # a short round (some contributor fitted fewer than k): the mean itself
            params = jax.tree_util.tree_map(lambda s, g: s - g, x0, mean)
        else:
            updates, outer = tx.update(mean, outer, x0)
            params = optax.apply_updates(x0, updates)
        states = [s.replace(params=params) for s in states]
    return states[0]


def _close(a, b, atol):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)


@pytest.mark.parametrize("tx", [None, optax.sgd(0.7, momentum=0.9, nesterov=True)], ids=["plain", "outer"])
def test_local_sgd_over_two_devices_equals_it_done_by_hand(make_net, digits, tx):
    tr, te = digits
    data = tr[:320]  # 10 minibatches of 32: rounds of 2 x 2, the last 1 + 1
    master = LocalSGD(batch_size_per_worker=32, local_steps=2, outer_updater=tx)
    net = make_net(MLP(dropout=0.2))
    wrapper = ParallelWrapper(net, master, CPU2, progress=False)
    wrapper.fit(data)
    expected = _by_hand(make_net(MLP(dropout=0.2)), data.batches(32), 2, 2, tx)
    _close(net.state.params, expected.params, atol=1e-6)
    # bfloat16 on the wire is not float32: the plain mean of the parameters ends elsewhere
    assert (net.iteration, net.epoch) == (10, 1)
    s = wrapper.last_fit_stats
    assert [x["trained_total"] for x in s] == [4, 8, 10] and s[-1]["bytes_received"] > 0
    # one per-iteration row per minibatch, numbered through the fit (what per-iteration listeners get)
    assert [r["fit_step"] for x in s for r in x["iterations"]] == list(range(10))
    assert [r["worker"] for r in s[0]["iterations"]] == [0, 1, 0, 1]
    if tx is None:
        wrapper.fit(tr[:960], epochs=2)
        assert accuracy(net, te) > 0.7  # it learns


def test_the_pseudo_gradient_is_sent_in_bfloat16_with_error_feedback():
    master = LocalSGD(local_steps=1)
    start = {"w": jnp.asarray([1.0, 1.0, 1.0], jnp.float32)}
    params = {"w": jnp.asarray([1.0 - 1e-3, 1.0 - 2.0 ** -9, 0.75], jnp.float32)}
    sent, (error, _) = master.contribute(start, params, master.init_carry(start))
    assert sent["w"].dtype == jnp.bfloat16
    exact = np.asarray(start["w"] - params["w"], np.float32)
    # what bfloat16 lost is kept, and what is sent plus what is kept is the pseudo-gradient
    np.testing.assert_array_equal(np.asarray(sent["w"], np.float32) + np.asarray(error["w"]), exact)
    assert np.abs(np.asarray(error["w"])).max() > 0
    sent2, _ = master.contribute(start, start, (error, ()))  # the next round sends the error back
    np.testing.assert_array_equal(np.asarray(sent2["w"], np.float32), np.asarray(error["w"]).astype(jnp.bfloat16)
                                  .astype(np.float32))
    with pytest.raises(TypeError, match="outer_updater must be an optax transformation"):
        LocalSGD(outer_updater=0.7)
    with pytest.raises(ValueError, match="local_steps must be an integer >= 1, got 0"):
        LocalSGD(local_steps=0)


def test_a_short_round_steps_by_the_mean_and_skips_the_outer_step(make_net, digits):
    # 10 minibatches of 32 over 2 devices at 2 local steps: rounds of 2 + 2, 2 + 2 and 1 + 1; the
    # last is short. Done by hand with its outer step, the fit ends measurably elsewhere
    tr, _ = digits
    tx = optax.sgd(0.7, momentum=0.9, nesterov=True)
    net = make_net(MLP())
    ParallelWrapper(net, LocalSGD(batch_size_per_worker=32, local_steps=2, outer_updater=tx), CPU2,
                    progress=False).fit(tr[:320])
    batches = tr[:320].batches(32)
    _close(net.state.params, _by_hand(make_net(MLP()), batches, 2, 2, tx).params, atol=1e-6)
    every = _by_hand(make_net(MLP()), batches, 2, 2, tx, gate=False)
    gap = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(
        jax.tree_util.tree_leaves(net.state.params), jax.tree_util.tree_leaves(every.params), strict=True))
    assert gap > 1e-4, gap
    # an algorithm that keeps the default finish_short gets one compiled finish for both kinds,
    # as LocalSGD does without an outer updater (every round steps by the mean)
    assert LocalSGD(outer_updater=tx).short_rounds_differ and not LocalSGD().short_rounds_differ
    plain = type("Plain", (LocalSGD,), {"finish_short": ReplicaAlgorithm.finish_short})
    assert not plain(outer_updater=tx).short_rounds_differ


@pytest.mark.slow
@pytest.mark.parametrize("tx", [None, optax.sgd(0.7, momentum=0.9, nesterov=True)], ids=["plain", "outer"])
def test_local_sgd_on_a_two_worker_cluster_ends_where_the_wrapper_ends(client2, make_net, digits, tx):
    # the last round is short (1 + 1): with an outer optimizer both runtimes skip its outer step
    tr, _ = digits
    data = tr[:320]
    master = LocalSGD(batch_size_per_worker=32, local_steps=2, training_approach="direct", outer_updater=tx)
    cluster = make_net(MLP(dropout=0.2))
    trainer = DistributedTrainer(client2, cluster, master, progress=False)
    trainer.fit(data)
    here = make_net(MLP(dropout=0.2))
    wrapper = ParallelWrapper(here, master, CPU2, progress=False)
    wrapper.fit(data)
    _close(cluster.state.params, here.state.params, atol=1e-6)
    assert (cluster.iteration, cluster.epoch) == (here.iteration, here.epoch) == (10, 1)
    assert [set(s) for s in trainer.last_fit_stats] == [set(s) for s in wrapper.last_fit_stats]
    assert [s["bytes_received"] for s in trainer.last_fit_stats] == [s["bytes_received"] for s in wrapper.last_fit_stats]
