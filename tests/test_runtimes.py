"""One algorithm, two runtimes: the rules the cluster and ParallelWrapper share.

Each test here is a place where the two runtimes once disagreed: the threshold carried
to the next fit, the multi-output evaluation rule, ``communication`` as an attribute,
a master that changes only its cluster side, and the round statistics' keys. The
cluster side of each rule is tested in its own module; the slow tests here run the
same job on both and compare.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import dlspark
from dlspark import DistributedTrainer, GradientSharing, ParallelWrapper, ParameterAveraging
from dlspark.algorithms.averaging._messages import AveragingFigures
from dlspark.algorithms.sharing import AdaptiveThreshold
from dlspark.algorithms.sharing._messages import SharingFigures
from dlspark.stats._record import COMMON_KEYS, RoundStats

CPU2 = jax.devices("cpu")[:2]


def _keys(figures):
    return set(COMMON_KEYS) | {f.name for f in dataclasses.fields(figures)}


def test_the_threshold_carried_is_the_mean_over_the_replicas_that_sent(make_net, digits):
    # One minibatch an epoch: the second device never trains, and still holds the fit's
    # starting threshold; the cluster leaves such a worker out of the mean, and so must this.
    tr, _ = digits
    # a low starting threshold: every step sends more than the band allows, so it climbs
    # (the first replica's parameters: the idle one holds none of its updates, so the mean of the
    # two would be half way)
    master = GradientSharing(batch_size_per_worker=32, threshold_algorithm=AdaptiveThreshold(initial=1e-4),
                             final_params="first")
    one = ParallelWrapper(make_net(updater=optax.sgd(0.1)), master, CPU2[:1], progress=False)
    one.fit(tr[:32], epochs=3)
    two = ParallelWrapper(make_net(updater=optax.sgd(0.1)), master, CPU2, progress=False)
    two.fit(tr[:32], epochs=3)
    assert one.threshold_state.steps == two.threshold_state.steps == 3
    assert two.threshold_state.threshold == one.threshold_state.threshold > 1e-4
    _same(one.network.state.params, two.network.state.params)


def test_a_multi_output_network_is_evaluated_one_output_at_a_time(make_net):
    def init(rng, x):
        return {"w": jnp.ones((3, 2)), "v": jnp.ones((3, 1))}

    def apply(p, xs, train, rng):
        return xs[0] @ p["w"], xs[0] @ p["v"]

    x = np.random.default_rng(0).normal(size=(20, 3)).astype(np.float32)
    net = dlspark.Network(dlspark.Model(init, apply, (np.zeros((1, 3), np.float32),)), loss=("mcxent", "mse"))
    labels = (np.eye(2, dtype=np.float32)[np.arange(20) % 2], np.zeros((20, 1), np.float32))
    data = dlspark.MultiDataSet((x,), labels)
    wrapper = ParallelWrapper(net, ParameterAveraging(), CPU2[:1], progress=False)
    with pytest.raises(ValueError, match=r"this network has 2 outputs; evaluate one at a time with output=0 \.\. 1"):
        wrapper.evaluate(data)
    with pytest.raises(ValueError, match="output=2 but this network has 2 outputs"):
        wrapper.evaluate(data, output=2)
    reg = wrapper.evaluate_regression(data, output=1)
    np.testing.assert_allclose(reg.mean_squared_error(0), np.mean(np.asarray(x.sum(1)) ** 2), rtol=1e-5)


def test_communication_and_replica_divergence_are_attributes_as_on_a_cluster(make_net, digits):
    tr, _ = digits
    wrapper = ParallelWrapper(make_net(), GradientSharing(batch_size_per_worker=32), CPU2, progress=False)
    wrapper.fit(tr[:256])
    assert wrapper.communication == wrapper.published["communication"]
    assert 0 < wrapper.communication["bytes_sent"] < wrapper.communication["dense_bytes"]
    assert wrapper.communication["bytes_sent"] == sum(s["bytes_sent"] for s in wrapper.last_fit_stats)
    # apart by their residuals (each replica's own update applied whole)
    params = [np.asarray(ravel_pytree(p)[0]) for p in wrapper._runtime.sharing_carry.params]
    assert wrapper.replica_divergence == pytest.approx(float(np.abs(params[0] - params[1]).max()))
    assert wrapper.replica_divergence > 0
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        wrapper.nothing


def test_a_master_that_changes_only_its_cluster_side_is_refused_by_the_wrapper(make_net):
    class TopK(ParameterAveraging):
        def create_run_on_worker(self, worker, job, spec, state, rank):  # another algorithm on a cluster
            raise AssertionError("not called here")

    with pytest.raises(NotImplementedError, match="TopK runs on a DistributedTrainer; it defines no create_device_run"):
        ParallelWrapper(make_net(), TopK(), CPU2, progress=False)
    ParallelWrapper(make_net(), ParameterAveraging(), CPU2, progress=False)  # its parent still runs


@pytest.mark.parametrize("master, figures", [
    (ParameterAveraging(batch_size_per_worker=32, averaging_frequency=2), AveragingFigures),
    (GradientSharing(batch_size_per_worker=32, steps_per_round=2), SharingFigures)])
def test_round_statistics_are_one_typed_record_with_the_clusters_keys(make_net, digits, master, figures):
    tr, _ = digits
    wrapper = ParallelWrapper(make_net(), master, CPU2, progress=False)
    wrapper.fit(tr[:320])  # 10 minibatches: 3 rounds, the last short
    stats = wrapper.last_fit_stats
    assert len(stats) == 3
    for s in stats:
        assert isinstance(s, RoundStats) and isinstance(s.extra, figures)
        assert set(s) == _keys(figures)
        assert all(isinstance(s[k], dict) for k in ("worker_fit_time", "worker_steps", "data_wait"))
    assert sum(sum(s.worker_steps.values()) for s in stats) == 10 == stats[-1].trained_total
    rows = [r for s in stats for r in s.iterations]  # per-iteration rows, numbered through the fit
    assert [r["fit_step"] for r in rows] == list(range(10)) and all(np.isfinite(r["loss"]) for r in rows)
    assert sum(r["examples"] for r in rows) == 320 and {r["worker"] for r in rows} == {0, 1}
    if figures is SharingFigures:
        assert set(stats[0].threshold) == {0, 1}


# -- the same job on both runtimes (conftest's client2: a 2-worker LocalCluster) ------------
def _same(a, b, atol=0.0):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)


@pytest.mark.slow
def test_both_runtimes_give_gradient_sharings_statistics_and_figures_alike(client2, make_net, digits):
    # (parameter averaging's: test_parallel's test_same_job_as_a_two_worker_cluster_ends_at_the_same_parameters)
    # One step a round: the round's sync makes the cluster's delivery synchronous, as the
    # wrapper's is, and both give minibatches 2j and 2j+1 to the two replicas at step j. (With more steps a
    # round a cluster's worker applies whichever peer messages have come, and its planner
    # deals each worker a run of consecutive minibatches, so two cluster fits differ as
    # much as a cluster fit and a wrapper fit.)
    tr, _ = digits
    master = GradientSharing(batch_size_per_worker=32, steps_per_round=1, training_approach="direct")
    cluster = DistributedTrainer(client2, make_net(), master, progress=False)
    cluster.fit(tr[:256])  # 8 minibatches: 4 rounds of 1 step on each of 2 replicas
    here = ParallelWrapper(make_net(), master, CPU2, progress=False)
    here.fit(tr[:256])
    _same(cluster.network.state.params, here.network.state.params, atol=1e-4)
    assert [set(s) for s in cluster.last_fit_stats] == [set(s) for s in here.last_fit_stats] \
        == [_keys(SharingFigures)] * 4
    assert [s["trained_total"] for s in cluster.last_fit_stats] == [s["trained_total"] for s in here.last_fit_stats]
    for t in (cluster, here):  # communication and replica_divergence on both
        assert t.communication["bytes_sent"] == sum(s["bytes_sent"] for s in t.last_fit_stats) > 0
        assert len(t.last_fit_stats[-1]["threshold"]) == 2
    # apart by their residuals (each replica's own update applied whole), alike on both
    assert cluster.replica_divergence == pytest.approx(here.replica_divergence, abs=1e-4)
    assert here.replica_divergence > 0


@pytest.mark.slow
def test_synchronous_delivery_gives_the_wrappers_bits_on_a_cluster_with_several_steps_a_round(
        client2, make_net, digits):
    # max_staleness=0: every worker applies exactly its peers' messages of a step before its next
    # step, as the wrapper's replicas do; and the wrapper deals minibatches with the cluster's
    # planner (a run of 4 consecutive minibatches per replica and round, not 2j and 2j+1 at
    # step j), so the two runtimes train the same minibatches in the same order. With two
    # replicas the sums are the same bits (a + b == b + a), so the parameters are equal exactly.
    tr, _ = digits
    master = GradientSharing(batch_size_per_worker=32, steps_per_round=4, max_staleness=0,
                             training_approach="direct")
    cluster = DistributedTrainer(client2, make_net(), master, progress=False)
    cluster.fit(tr[:512])  # 16 minibatches: 2 rounds of 4 steps on each of 2 replicas
    here = ParallelWrapper(make_net(), master, CPU2, progress=False, sharing_encoder="host")
    here.fit(tr[:512])
    for t in (cluster, here):
        assert [sorted(s["worker_steps"].values()) for s in t.last_fit_stats] == [[4, 4]] * 2
    _same(cluster.network.state.params, here.network.state.params, atol=0.0)
    assert cluster.communication["bytes_sent"] == here.communication["bytes_sent"] > 0
    assert sorted(cluster.last_fit_stats[-1]["threshold"].values()) == sorted(here.last_fit_stats[-1]["threshold"].values())


@pytest.mark.slow
@pytest.mark.parametrize("minibatches", [19, 17])
def test_delivery_a_step_late_gives_the_wrappers_bits_on_a_cluster(client2, make_net, digits, minibatches):
    # delivery_lag=1: a worker applies its peer's message of the step before, and at its
    # round's end the rest in one sum, as the wrapper's replicas do; 19 minibatches end each
    # epoch in a round of 2 and 1 steps (a worker waits at its end for its peer's last), 17 in
    # one of 1 and 0 (an idle worker, synced by the coordinator). With two replicas the sums
    # are the same bits.
    tr, _ = digits
    master = GradientSharing(batch_size_per_worker=32, steps_per_round=4, delivery_lag=1, training_approach="direct")
    data = tr[:32 * minibatches]
    cluster = DistributedTrainer(client2, make_net(), master, progress=False)
    cluster.fit(data, epochs=2)
    here = ParallelWrapper(make_net(), master, CPU2, progress=False, sharing_encoder="host")
    here.fit(data, epochs=2)
    last = sorted(cluster.last_fit_stats[-1]["worker_steps"].values())
    assert last == ([1, 2] if minibatches == 19 else [1])
    _same(cluster.network.state.params, here.network.state.params, atol=0.0)
    assert cluster.communication["bytes_sent"] == here.communication["bytes_sent"] > 0
    synced = DistributedTrainer(client2, make_net(), dataclasses.replace(master, delivery_lag=0), progress=False)
    synced.fit(data, epochs=2)
    assert max(np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(
        jax.tree_util.tree_leaves(synced.network.state.params),
        jax.tree_util.tree_leaves(cluster.network.state.params))) > 1e-5  # the lag is another run


def _fits(trainer, epochs, data):
    for e in epochs:
        trainer.fit(data, epochs=e)
    return trainer.network.state.params


@pytest.mark.slow
def test_a_fit_an_epoch_at_a_time_goes_on_as_one_longer_fit_on_both_runtimes(client2, make_net, digits):
    # continue_replicas (the default): a fit that starts from the state the last one ended with
    # gives each replica back its own updater state, residual, threshold and message count, so
    # that two fits of an epoch end bit for bit where one fit of two epochs ends, in the wrapper
    # and (with synchronous delivery) on a cluster, whose replicas take their updater state
    # from what their worker kept. Without it the residuals' mass is dropped between the fits.
    tr, _ = digits
    data = tr[:512]
    master = GradientSharing(batch_size_per_worker=32, steps_per_round=4, max_staleness=0,
                             training_approach="direct")
    dropped = dataclasses.replace(master, continue_replicas=False)

    def wrapper(m):
        return ParallelWrapper(make_net(), m, CPU2, progress=False, sharing_encoder="host")

    one = wrapper(master)
    longer = _fits(one, [2], data)
    _same(_fits(wrapper(master), [1, 1], data), longer, atol=0.0)
    cluster = DistributedTrainer(client2, make_net(), master, progress=False)
    _same(_fits(cluster, [1, 1], data), longer, atol=0.0)
    # the updater state a fit ends with is stitched alike: each array from the same replica
    _same(cluster.network.state.opt_state, one.network.state.opt_state, atol=0.0)
    # the replicas, each gone on from its own parameters (own_update="whole"), end as far apart
    assert cluster.replica_divergence == one.replica_divergence > 0
    apart = _fits(wrapper(dropped), [1, 1], data)
    assert max(float(jnp.abs(a - b).max()) for a, b in
               zip(jax.tree_util.tree_leaves(apart), jax.tree_util.tree_leaves(longer))) > 1e-4
    # a state changed between the fits is a new start, as a first fit's: nothing is carried
    def nudged(m):
        w = wrapper(m)
        w.fit(data)
        w.network.state = w.network.state.replace(
            params=jax.tree_util.tree_map(lambda p: p + 1e-3, w.network.state.params))
        w.fit(data)
        return w.network.state.params

    _same(nudged(master), nudged(dropped), atol=0.0)


@pytest.mark.slow
def test_a_final_state_that_both_replicas_hold_comes_half_from_each(client2, make_net, digits, monkeypatch):
    # Parameter averaging's replicas end with the same bits, and gradient sharing's parameters
    # do with synchronous delivery where every replica applies its own encoded messages: the
    # client takes each array from one holder, spread over both workers' links, and the state
    # it rebuilds is the one the workers kept, bit for bit.
    from dlspark.checkpoint import state_to_arrays
    from dlspark.distributed import _client
    from dlspark.distributed._kept import continuing, state_digests

    plans = []
    real = _client.split_fetch

    def recording(*a, **kw):
        plans.append(real(*a, **kw))
        return plans[-1]

    monkeypatch.setattr(_client, "split_fetch", recording)
    tr, _ = digits
    sharing = GradientSharing(batch_size_per_worker=32, steps_per_round=4, training_approach="direct")
    for master in (ParameterAveraging(batch_size_per_worker=32, training_approach="direct"),
                   dataclasses.replace(sharing, own_update="encoded")):
        trainer = DistributedTrainer(client2, make_net(), master, progress=False)
        trainer.fit(tr[:512])
        assert plans[-1] is not None and len(plans[-1]) == 2, master.name
        assert continuing(state_digests(state_to_arrays(trainer.network.state)), trainer._kept_states)
    assert trainer.replica_divergence == 0.0
    # each replica's own update applied whole: the replicas' parameters differ, so every worker
    # sends its parameters for the mean, which no worker holds, and the updater state is
    # stitched: each of its floating-point arrays from one worker, the two workers' bytes about
    # equal; the trainer keeps the state's digests for the next fit to go on from
    trainer = DistributedTrainer(client2, make_net(), sharing, progress=False)
    trainer.fit(tr[:512])
    assert plans[-1] is None and trainer.replica_divergence > 0
    state = state_to_arrays(trainer.network.state)
    mine = state_digests(state)
    assert not continuing(mine, trainer._kept_states) and trainer._ended == mine
    kept = {w: d["arrays"] for w, (_, d) in trainer._kept_states.items()}
    assert len(kept) == 2
    sent = dict.fromkeys(kept, sum(state["arrays"][i].nbytes for i in _client._leaves_under(state, ".params")))
    for i in _client._own_updater_arrays(state):
        holders = [w for w in kept if kept[w][i] == mine["arrays"][i]]
        assert len(holders) == 1  # the replicas' updater states differ: this array is one worker's
        sent[holders[0]] += state["arrays"][i].nbytes
    assert max(sent.values()) < 1.25 * min(sent.values()), sent


def test_stitch_owners_spreads_the_updater_state_over_the_replicas_largest_first():
    from dlspark._mesh import stitch_owners

    # every replica sends 10 bytes of parameters; the largest array goes to the first replica
    # (a tie), the next to the second, and so on to the least loaded, the first on a tie
    assert stitch_owners([4, 8, 8, 4], 10, 2) == [0, 0, 1, 1]
    assert stitch_owners([4, 8, 8, 4], 10, 1) == [0, 0, 0, 0]
    assert stitch_owners([], 10, 3) == []
    sizes = [40, 30, 20, 10, 5, 5]
    for n in (2, 3):
        owners = stitch_owners(sizes, 0, n)
        loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(n)]
        assert max(loads) - min(loads) <= max(sizes) and set(owners) == set(range(n))
