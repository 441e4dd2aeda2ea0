"""ParallelWrapper: the cluster's algorithms over the devices of one process.

The conftest gives this process two CPU devices. Tested: one device is local
``Network.fit``; two devices with SGD at frequency 1 are synchronous SGD on the
concatenated minibatch; Adam with and without ``save_updater``, uneven last
rounds and the outer optimizer equal parameter averaging done by hand; the same
job as a DistributedTrainer on a 2-worker LocalCluster ends at the same
parameters (dropout included), and a checkpoint of either resumes in the other.
"""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP, _cluster_client, accuracy

import dlspark
from dlspark import DataSet, DistributedTrainer, GradientSharing, ParallelWrapper, ParameterAveraging
from dlspark.algorithms import LocalSGD
from dlspark.algorithms.averaging._numerics import outer_step
from dlspark.checkpoint import read_checkpoint_meta
from dlspark.errors import CheckpointError, NonFiniteLossError
from dlspark.evaluation import Evaluation, RegressionEvaluation

CPU2 = jax.devices("cpu")[:2]


def _close(a, b, rtol=1e-5, atol=1e-6):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _by_hand(net, batches, workers, freq, save_updater=True, tx=None):
    """Parameter averaging done step by step in this process: the oracle. Rounds are cut as the
    cluster's balanced planner cuts them; integer leaves stay rank 0's, and so does the updater's
    state without ``save_updater`` (each replica resets it at the next round's start)."""
    start, ost = net.state, (None if tx is None else tx.init(net.state.params))
    rng0 = start.rng
    rngs = [rng0] + [jax.random.fold_in(rng0, r) for r in range(1, workers)]
    for r0 in range(0, len(batches), workers * freq):
        chunk = batches[r0:r0 + workers * freq]
        states = []
        for w, share in enumerate(np.array_split(np.arange(len(chunk)), workers)):
            if len(share) == 0:
                continue
            st = start.replace(rng=rngs[w])
            if not save_updater:
                st = st.replace(opt_state=net.updater.init(st.params))
            for i in share:
                st = net.steps.train_step(jax.tree_util.tree_map(lambda a: a.copy(), st),
                                          jax.tree_util.tree_map(np.asarray, chunk[i].jit_batch())).state
            rngs[w] = st.rng
            states.append(st)

        def mean(*leaves):
            if np.issubdtype(np.asarray(leaves[0]).dtype, np.floating):
                return sum(np.asarray(x, np.float32) for x in leaves) / len(leaves)
            return leaves[0]

        avg = jax.tree_util.tree_map(mean, *states)
        if not save_updater:
            avg = avg.replace(opt_state=states[0].opt_state)
        if tx is not None:
            params, ost = outer_step(tx, start.params, avg.params, ost)
            avg = avg.replace(params=params)
        start = avg
    return start, ost


@pytest.mark.parametrize("freq", [1, 3])
def test_one_device_equals_local_fit(make_net, digits, freq):
    tr, _ = digits
    batches = tr[:640].batches(32)
    local = make_net(updater=optax.adam(1e-2))
    local.fit(batches, epochs=2)
    net = make_net(updater=optax.adam(1e-2))
    master = ParameterAveraging(batch_size_per_worker=32, averaging_frequency=freq)
    ParallelWrapper(net, master, devices=CPU2[:1], progress=False).fit(batches, epochs=2)
    _close(net.state.params, local.state.params)
    _close(net.state.opt_state, local.state.opt_state)
    assert (net.iteration, net.epoch) == (local.iteration, local.epoch) == (40, 2)


def test_two_devices_sgd_frequency_one_equals_synchronous_sgd(make_net, digits):
    tr, _ = digits
    batches = tr[:512].batches(32)
    net = make_net(updater=optax.sgd(0.1))
    wrapper = ParallelWrapper(net, ParameterAveraging(batch_size_per_worker=32, averaging_frequency=1), CPU2,
                              progress=False)
    wrapper.fit(tr[:512])
    # the default update_scale: two replicas' steps at twice the rate, so their mean is one step
    # on the merged minibatch at twice the rate (the linear rule)
    sync = make_net(updater=optax.sgd(0.2))
    sync.fit([DataSet.merge(batches[i:i + 2]) for i in range(0, len(batches), 2)])
    _close(net.state.params, sync.state.params, rtol=1e-4, atol=1e-6)
    assert net.iteration == 16 and len(wrapper.loss_history) == 8
    s = wrapper.last_fit_stats[0]
    assert (s["round"], s["minibatches"], s["examples"], s["workers"]) == (1, 2, 64, 2)
    # what a cluster's contributions carry: the floating-point leaves (the step counts and keys stay)
    assert s["bytes_equivalent"] == 2 * sum(x.nbytes for x in jax.tree_util.tree_leaves(net.state)
                                            if np.issubdtype(x.dtype, np.floating))


@pytest.mark.parametrize("save_updater, n", [(True, 576), (False, 530)])
def test_adam_and_uneven_last_rounds_equal_averaging_by_hand(make_net, digits, save_updater, n):
    # 576: 18 minibatches, 3 rounds of 2 x 3. 530: 17, the last one short: rounds of 2 x 3,
    # then an uneven 3 + 2 with two shapes (each replica steps on its own device)
    tr, _ = digits
    batches = tr[:n].batches(32)
    net = make_net(MLP(dropout=0.2), updater=optax.adam(1e-2))
    # by hand at Adam's rate times the two replicas: the default update_scale
    expected, _ = _by_hand(make_net(MLP(dropout=0.2), updater=optax.adam(2e-2)), batches, 2, 3, save_updater)
    master = ParameterAveraging(averaging_frequency=3, save_updater=save_updater)
    ParallelWrapper(net, master, CPU2, progress=False).fit(batches)
    # The two programs round differently (the scaled updater against the doubled rate, another
    # fusion). Where a weight's gradient is near zero Adam divides by the root of a near-zero
    # second moment and magnifies that rounding: on an AMD EPYC one weight of the 64 x 64 layer
    # ends 3.6e-6 apart (the mean difference 4e-9). A round averaged wrongly moves the
    # parameters by about the rate, 1e-2.
    _close(net.state.params, expected.params, rtol=1e-4, atol=1e-5)
    _close(net.state.opt_state, expected.opt_state, rtol=1e-4, atol=1e-6)
    assert int(jax.tree_util.tree_leaves(net.state.opt_state)[0]) == (9 if save_updater else 3)
    assert net.iteration == len(batches)
    np.testing.assert_array_equal(np.asarray(net.state.rng), np.asarray(expected.rng))


def test_outer_optimizer_equals_the_outer_loop_by_hand_and_is_carried(make_net, digits):
    tr, _ = digits
    batches = tr[:384].batches(32)
    tx = optax.sgd(0.7, momentum=0.9, nesterov=True)
    net = make_net(updater=optax.sgd(0.1))
    # every round is full (takes the outer step), each replica at one worker's rate (DiLoCo's)
    expected, ost = _by_hand(make_net(updater=optax.sgd(0.1)), batches, 2, 2, tx=tx)
    wrapper = ParallelWrapper(net, ParameterAveraging(averaging_frequency=2, outer_updater=tx, outer_update_scale=1.0),
                              CPU2, progress=False)
    wrapper.fit(batches)
    _close(net.state.params, expected.params, rtol=1e-4, atol=1e-6)
    _close(wrapper.outer_state, ost, rtol=1e-4, atol=1e-6)
    # sgd(1.0) is plain averaging of unscaled steps, to float rounding
    a, b = make_net(updater=optax.sgd(0.1)), make_net(updater=optax.sgd(0.1))
    ParallelWrapper(a, ParameterAveraging(averaging_frequency=2, outer_updater=optax.sgd(1.0), outer_update_scale=1.0),
                    CPU2, progress=False).fit(batches)
    ParallelWrapper(b, ParameterAveraging(averaging_frequency=2, update_scale=1.0), CPU2, progress=False).fit(batches)
    _close(a.state.params, b.state.params, rtol=1e-5, atol=1e-6)


def test_step_by_step_rounds_equal_fused_rounds(make_net, digits):
    tr, _ = digits
    batches = tr[:384].batches(32)  # 12 minibatches: 2 rounds of 2 devices x 3
    nets = []
    for fused in (True, False):
        nets.append(make_net(MLP(dropout=0.2), updater=optax.adam(1e-2)))
        master = ParameterAveraging(averaging_frequency=3, save_updater=False, fused_steps=fused,
                                    outer_updater=optax.sgd(0.7, momentum=0.9))
        ParallelWrapper(nets[-1], master, CPU2, progress=False).fit(batches)
    _close(nets[0].state, nets[1].state)
    assert nets[1].iteration == 12


@pytest.mark.parametrize("master", [
    ParameterAveraging(averaging_frequency=3, save_updater=False, outer_updater=optax.sgd(0.7, momentum=0.9)),
    ParameterAveraging(averaging_frequency=3),
    LocalSGD(local_steps=3, outer_updater=optax.sgd(0.7, momentum=0.9))])
def test_a_rounds_mean_taken_on_the_host_equals_the_psum_inside_the_call(make_net, digits, master):
    """On CPU devices a round's sum over the replicas is taken on the host between two calls
    (``MeshExchange.spmd_summed``); elsewhere it is a ``psum`` inside one. Both, here on CPU,
    end at the same bits (an uneven last round included: 13 minibatches)."""
    tr, _ = digits
    batches = tr[:416].batches(32)
    nets = []
    for fuse in (True, False):
        nets.append(make_net(updater=optax.adam(1e-2)))
        wrapper = ParallelWrapper(nets[-1], master, CPU2, progress=False)
        assert wrapper.exchange.fuse_collectives is False  # CPU devices: the host's sum by default
        wrapper.exchange.fuse_collectives = fuse
        wrapper.fit(batches)
    for a, b in zip(jax.tree_util.tree_leaves(nets[0].state), jax.tree_util.tree_leaves(nets[1].state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert nets[1].iteration == 13


def test_checkpoint_and_resume_equal_an_uninterrupted_run(make_net, digits, tmp_path):
    tr, _ = digits
    data = tr[:640]  # 20 minibatches: 5 rounds of 2 devices x 2 per epoch
    url = str(tmp_path / "ck.dls")
    master = ParameterAveraging(batch_size_per_worker=32, averaging_frequency=2,
                                outer_updater=optax.sgd(0.7, momentum=0.9))
    straight = make_net(MLP(dropout=0.3), updater=optax.adam(1e-2))
    ParallelWrapper(straight, master, CPU2, progress=False).fit(data, epochs=2, checkpoint_every=7, checkpoint_url=url)
    meta = read_checkpoint_meta(url)
    assert (meta["iteration"], meta["epoch"], len(meta["worker_rngs"])) == (28, 1, 2)
    assert (meta["fit_progress"]["epoch"], len(meta["fit_progress"]["done"]), meta["fit_progress"]["epochs_total"]) == (1, 8, 2)
    resumed = make_net(MLP(dropout=0.3), updater=optax.adam(1e-2))
    ParallelWrapper(resumed, master, CPU2, progress=False).fit(data, epochs=2, resume_from=url)
    _close(resumed.state.params, straight.state.params)
    _close(resumed.state.opt_state, straight.state.opt_state)
    assert (resumed.iteration, resumed.epoch) == (straight.iteration, straight.epoch) == (40, 2)


@pytest.mark.parametrize("algorithm", ["averaging", "sharing"])
def test_resuming_a_finished_fit_trains_nothing_and_reports_no_rounds(make_net, digits, tmp_path, algorithm):
    tr, _ = digits
    data = tr[:256]  # 8 minibatches of 32: 4 rounds of averaging, 1 of sharing
    url = str(tmp_path / "done.dls")
    # (gradient sharing's checkpoint holds the first replica's state: the fit ends with it too)
    master = (ParameterAveraging(batch_size_per_worker=32, averaging_frequency=1) if algorithm == "averaging"
              else GradientSharing(batch_size_per_worker=32, steps_per_round=4, final_params="first"))
    net = make_net(MLP(), updater=optax.adam(1e-2))
    wrapper = ParallelWrapper(net, master, CPU2, progress=False)
    wrapper.fit(data, checkpoint_every=1, checkpoint_url=url)  # the last checkpoint is the fit's end
    assert wrapper.last_fit_stats
    before = jax.tree_util.tree_map(np.asarray, net.state.params)
    wrapper.fit(data, resume_from=url)
    assert wrapper.last_fit_stats == []  # not the rounds of the fit before
    _close(net.state.params, before)
    assert net.iteration == 8


def test_fit_paths_evaluation_keyed_inference_and_scoring(make_net, digits, tmp_path):
    tr, te = digits
    urls = dlspark.data.save_minibatches(tr.features[:960], tr.labels[:960], str(tmp_path / "mb"), batch_size=16)
    net = make_net(MLP(hidden=128), updater=optax.adam(5e-3))
    seen = []
    wrapper = ParallelWrapper(net, ParameterAveraging(batch_size_per_worker=16, averaging_frequency=2), CPU2,
                              progress=False)
    wrapper.fit_paths(str(tmp_path / "mb"), epochs=2, callbacks=[seen.append])
    assert len(urls) == 60 and len(seen) == len(wrapper.last_fit_stats) == 2 * 15
    assert net.iteration == 120 and wrapper.loss_history[-1][2] < wrapper.loss_history[0][2]
    ev, reg = wrapper.do_evaluation(te, 50, Evaluation(), RegressionEvaluation())
    assert ev.accuracy() == pytest.approx(accuracy(net, te)) and ev.accuracy() >= 0.8
    assert reg.n == len(te)  # one pass filled both
    keyed = wrapper.predict_with_keys({f"k{i}": te.features[i] for i in range(5)})
    np.testing.assert_allclose(keyed["k3"], net.output(te.features[3:4])[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(wrapper.score_examples(te[:10]), net.score_examples(te[:10]), rtol=1e-6)
    assert wrapper.calculate_score(te[:10]) == pytest.approx(float(net.score_examples(te[:10]).mean()), rel=1e-5)


@pytest.mark.parametrize("master, n, row", [
    (ParameterAveraging(averaging_frequency=2), 128, 100),
    (ParameterAveraging(averaging_frequency=2, fused_steps=True), 128, 100),
    (ParameterAveraging(averaging_frequency=2), 160, 140),  # in the epoch's last, irregular round
    (GradientSharing(batch_size_per_worker=32), 128, 100)],
    ids=["averaging", "averaging-fused", "averaging-irregular", "sharing"])
def test_nonfinite_loss_raises_and_leaves_the_network_as_before_the_fit(make_net, digits, master, n, row):
    # Under "raise" the averaging steps only flag a bad step (no select over the state to undo
    # it): the fit must still stop there and leave the network as it was.
    tr, _ = digits
    bad = tr[:n].features.copy()
    bad[row] = np.nan
    net = make_net()
    before = jax.tree_util.tree_map(np.asarray, net.state.params)
    with pytest.raises(NonFiniteLossError):
        ParallelWrapper(net, master, CPU2, progress=False).fit(DataSet(bad, tr[:n].labels))
    _close(net.state.params, before, rtol=0, atol=0)


# -- gradient sharing ------------------------------------------------------------------
def _sharing_by_hand(net, batches, shares, threshold, own_update="whole", lag=0):
    """Lockstep gradient sharing done in this process with the workers' encoder: the oracle.
    Step j: device i fits minibatch ``shares[i][j]`` (if its share has one) from its replica's
    parameters and adds its update to its residual; every replica applies the others' decoded
    messages and its own whole update (``own_update="whole"``), or every decoded message.
    With ``lag=1`` (``delivery_lag``) a replica that trained applies its own update (whole, or
    its message) and the others' messages of step j-1; one that did not keeps the others'
    messages for the end, where every replica applies what it has not, in one sum (the
    shares are one round). Returns each replica's parameters and residual."""
    from jax.flatten_util import ravel_pytree

    from dlspark.algorithms.sharing._encoding import decode, threshold_encode

    flat, unravel = ravel_pytree(net.state.params)
    residuals = [np.zeros(flat.size, np.float32) for _ in shares]
    params = [net.state.params for _ in shares]
    before, pending = {}, [[] for _ in shares]  # lag: the step before's messages; an idle replica's
    for j in range(max(map(len, shares))):
        messages, updates = {}, {}
        for i, b in [(i, batches[s[j]]) for i, s in enumerate(shares) if j < len(s)]:
            u = net.steps.compute_update(net.state.replace(params=params[i]), b.jit_batch()).updates
            updates[i] = np.asarray(ravel_pytree(u)[0])
            residuals[i] += updates[i]
            messages[i] = decode(threshold_encode(residuals[i], threshold, out=residuals[i], min_count=2).message)
        for i in range(len(shares)):
            if lag and i not in updates:
                pending[i] += [m for k, m in before.items() if k != i]
                continue
            mine = own_update == "whole" and i in updates
            total = updates[i].copy() if mine else np.zeros(flat.size, np.float32)
            if lag:
                total += 0 if mine else messages[i]
                peers = {k: m for k, m in before.items() if k != i}
            else:
                peers = {k: m for k, m in messages.items() if not (mine and k == i)}
            for m in peers.values():
                total += m
            params[i] = optax.apply_updates(params[i], unravel(total))
        before = messages
    for i in range(len(shares) if lag else 0):  # the round's end
        held = pending[i] + [m for k, m in before.items() if k != i]
        if held:
            params[i] = optax.apply_updates(params[i], unravel(np.sum(held, axis=0, dtype=np.float32)))
    return params, residuals


@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("own_update", ["whole", "encoded"])
def test_gradient_sharing_steps_in_lockstep_as_by_hand(make_net, digits, own_update, lag):
    from jax.flatten_util import ravel_pytree

    from dlspark.algorithms.sharing import FixedThreshold, NoResidualPostProcessing

    tr, _ = digits
    batches = tr[:288].batches(32)  # 9 minibatches
    master = GradientSharing(batch_size_per_worker=32, threshold_algorithm=FixedThreshold(3e-3),
                             residual_post_processor=NoResidualPostProcessing(), own_update=own_update,
                             delivery_lag=lag)
    net = make_net(updater=optax.sgd(0.1))
    # one round (16 steps a round by default): the planner deals each device a contiguous share,
    # as it deals a cluster's workers; device 1 idles at the last step
    shares = [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
    params, residuals = _sharing_by_hand(make_net(updater=optax.sgd(0.1)), batches, shares, 3e-3, own_update, lag)
    wrapper = ParallelWrapper(net, master, CPU2, progress=False, sharing_encoder="host")
    wrapper.fit(batches)
    # the fit ends with the replicas' mean (own_update="whole"; they are equal under "encoded")
    _close(net.state.params, jax.tree_util.tree_map(lambda a, b: (a + b) / 2, *params), rtol=1e-6, atol=1e-7)
    assert net.iteration == 9 and net.epoch == 1
    comm = wrapper.published["communication"]
    assert 0 < comm["bytes_sent"] < comm["dense_bytes"] / 10
    apart = np.abs(ravel_pytree(params[0])[0] - ravel_pytree(params[1])[0]).max()
    if lag:  # a step late is another run: the same messages applied a step later change the next gradients
        other, _ = _sharing_by_hand(make_net(updater=optax.sgd(0.1)), batches, shares, 3e-3, own_update, 0)
        assert np.abs(ravel_pytree(other[0])[0] - ravel_pytree(params[0])[0]).max() > 1e-4
    if own_update == "encoded" and lag:  # every message applied by every replica, in other sums
        assert wrapper.published["replica_divergence"] < 1e-6 and apart < 1e-6
    elif own_update == "encoded":
        assert wrapper.published["replica_divergence"] == 0.0 and apart == 0.0
    else:  # each replica holds its own residual's part of its updates, which the other lacks
        gap = np.abs(residuals[0] - residuals[1]).max()
        assert gap > 0 and apart == pytest.approx(gap, rel=1e-3)
        assert wrapper.published["replica_divergence"] == pytest.approx(apart, rel=1e-3)


@pytest.mark.parametrize("lag", [0, 1])
def test_gradient_sharing_encodes_in_xla_with_the_host_encoders_bits(make_net, digits, lag):
    # the default master: adaptive threshold and residual clipping, Adam on every replica
    tr, te = digits
    runs = {}
    for encoder in ("host", "xla"):
        net = make_net()
        wrapper = ParallelWrapper(net, GradientSharing(batch_size_per_worker=16, steps_per_round=8, delivery_lag=lag),
                                  CPU2, progress=False, sharing_encoder=encoder)
        wrapper.fit(tr[:800], epochs=2)
        runs[encoder] = (net, wrapper)
    (a, wa), (b, wb) = runs["host"], runs["xla"]
    _close(a.state, b.state, rtol=0, atol=0)
    assert wa.published["communication"] == wb.published["communication"]
    assert [s["threshold"] for s in wa.last_fit_stats] == [s["threshold"] for s in wb.last_fit_stats]
    assert wa.published["sharing_encoder"] == "host" and wb.published["sharing_encoder"] == "xla"
    assert accuracy(a, te) > 0.6  # it learned: 100 steps of 2 x 16 examples
    assert wa.threshold_state.threshold == wb.threshold_state.threshold  # carried to the next fit


def test_gradient_sharing_skips_a_non_finite_minibatch_and_keeps_the_replicas_equal(make_net, digits):
    tr, _ = digits
    bad = tr[:128].features.copy()
    bad[40] = np.nan  # the second minibatch: device 1's first
    net = make_net(on_nonfinite="skip")
    # every replica applies the same messages (own_update="encoded"): equal replicas show that the
    # skipped minibatch sent nothing and left nothing behind
    wrapper = ParallelWrapper(net, GradientSharing(batch_size_per_worker=32, own_update="encoded"), CPU2,
                              progress=False)
    wrapper.fit(DataSet(bad, tr[:128].labels))
    assert net.iteration == 3 and wrapper.published["replica_divergence"] == 0.0
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(net.state.params))


@pytest.mark.parametrize("own_update", ["whole", "encoded"])
def test_a_replica_without_minibatches_reads_the_reused_sum_before_it_is_written_again(make_net, digits, monkeypatch,
                                                                                       own_update):
    # The host encoder's decoded sum lives in two reused vectors that the CPU devices read in
    # place (one pair for all, or under own_update="whole" one pair per replica). A replica with
    # no minibatch only adds the sum, and nothing else waits for that read. To make a late read
    # certain rather than rare, the add is preceded by ~100 ms of unrelated device work (only
    # the timing is staged; the arithmetic is the real add). The idle replica ends where the
    # other does, less the other's residual under "whole" (its own updates went in whole).
    import dlspark.algorithms.sharing._device as ps
    from jax.flatten_util import ravel_pytree

    real = ps.sharing_functions

    def slow_add(net):
        fns = real(net)
        unravel = ravel_pytree(net.state.params)[1]

        def add_flat(state, flat):
            m = jnp.ones((256, 256)) * jax.tree_util.tree_leaves(state.params)[0].ravel()[0]
            m = jax.lax.fori_loop(0, 400, lambda i, m: jnp.tanh(m @ m), m)
            late = jnp.where(m[0, 0] > 1e30, 1.0, 0.0)  # 0, but only known after the work
            return state.replace(params=optax.apply_updates(state.params, unravel(flat + late)))

        return fns._replace(add_flat=jax.jit(add_flat))

    monkeypatch.setattr(ps, "sharing_functions", slow_add)
    tr, _ = digits
    net = make_net(MLP(hidden=24), updater=optax.sgd(0.1))
    wrapper = ParallelWrapper(net, GradientSharing(batch_size_per_worker=32, own_update=own_update), CPU2,
                              progress=False, sharing_encoder="host")
    wrapper.fit(tr[:32], epochs=6)  # one minibatch an epoch: the second device only ever adds the sum
    held = np.abs(wrapper._runtime.sharing_carry.residuals[0]).max() if own_update == "whole" else 0.0
    assert held > 0 or own_update == "encoded"
    assert wrapper.published["replica_divergence"] == pytest.approx(held, rel=1e-5, abs=0)


def test_gradient_sharing_checkpoints_the_state_it_reached_and_resumes_the_rest(make_net, digits, tmp_path):
    tr, te = digits
    data = tr[:640]  # 20 minibatches of 32: 10 lockstep steps of 2 devices, 5 rounds
    url = str(tmp_path / "ck.dls")
    # the checkpoint holds the first replica's state, which a fit ends with under final_params="first"
    master = GradientSharing(batch_size_per_worker=32, steps_per_round=2, final_params="first")
    straight = make_net(MLP(dropout=0.3))
    ParallelWrapper(straight, master, CPU2, progress=False).fit(data, checkpoint_every=3, checkpoint_url=url)
    meta = read_checkpoint_meta(url)  # round 3: 6 steps of 2 devices
    assert (meta["iteration"], meta["epoch"], len(meta["worker_rngs"])) == (12, 0, 2)
    assert meta["fit_progress"] == {"epoch": 0, "done": list(range(12)), "epochs_total": 1, "minibatches": 20}
    assert len(meta["threshold_states"]["states"]) == 2
    # replica 0's state then: what a fit on just those 12 minibatches ends with
    prefix = make_net(MLP(dropout=0.3))
    ParallelWrapper(prefix, master, CPU2, progress=False).fit(data[:384])
    saved = make_net(MLP(dropout=0.3)).restore(url)
    _close(saved.state.params, prefix.state.params, rtol=0, atol=0)
    _close(saved.state.opt_state, prefix.state.opt_state, rtol=0, atol=0)
    # every replica's RNG (dropout here) is saved: replica 0's is the prefix fit's, replica 1's its own
    rngs = [np.asarray(r, np.uint32) for r in meta["worker_rngs"]]
    np.testing.assert_array_equal(rngs[0], np.asarray(prefix.state.rng))
    assert not np.array_equal(rngs[0], rngs[1])
    resumed = make_net(MLP(dropout=0.3))
    wrapper = ParallelWrapper(resumed, master, CPU2, progress=False)
    wrapper.fit(data, resume_from=url)  # the 8 minibatches left, from the thresholds reached
    assert (resumed.iteration, resumed.epoch) == (straight.iteration, straight.epoch) == (20, 1)
    # replica 0 went on from its saved RNG: one split per step, 4 steps
    key = jnp.asarray(rngs[0])
    for _ in range(4):
        key = jax.random.split(key)[0]
    np.testing.assert_array_equal(np.asarray(resumed.state.rng), np.asarray(key))
    assert sum(s["minibatches"] for s in wrapper.last_fit_stats) == 8
    assert wrapper.threshold_state.steps == 6 + 4  # the thresholds went on from the checkpoint's
    # an epoch's last round: the checkpoint stands at the next epoch's start
    ParallelWrapper(make_net(MLP(dropout=0.3)), master, CPU2, progress=False).fit(
        data, epochs=2, checkpoint_every=5, checkpoint_url=url)
    meta = read_checkpoint_meta(url)
    assert (meta["iteration"], meta["epoch"], meta["fit_progress"]) == (40, 2, {"epoch": 2, "done": [],
                                                                                "epochs_total": 2,
                                                                                "minibatches": 20})


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="network must be a dlspark.Network"):
        ParallelWrapper(object(), ParameterAveraging())
    with pytest.raises(ValueError, match=r"sharing_encoder must be one of \('auto', 'host', 'xla'\), got 'gpu'"):
        ParallelWrapper(_tiny_net(), GradientSharing(), CPU2, sharing_encoder="gpu")
    with pytest.raises(ValueError, match="checkpoint_every needs checkpoint_url"):
        ParallelWrapper(_tiny_net(), GradientSharing(), CPU2, progress=False).fit(
            (np.zeros((4, 64), np.float32), np.zeros((4, 10), np.float32)), checkpoint_every=1)
    with pytest.raises(ValueError, match="devices must be an integer >= 1, got 0"):
        ParallelWrapper(_tiny_net(), ParameterAveraging(), devices=0)
    with pytest.raises(ValueError, match=r"devices=64, but JAX has \d+ .* device"):
        ParallelWrapper(_tiny_net(), ParameterAveraging(), devices=64)
    with pytest.raises(TypeError, match="devices must be None, a number of devices or a list"):
        ParallelWrapper(_tiny_net(), ParameterAveraging(), devices="gpu")
    wrapper = ParallelWrapper(_tiny_net(), ParameterAveraging(), CPU2, progress=False)
    with pytest.raises(ValueError, match="checkpoint_every needs checkpoint_url"):
        wrapper.fit((np.zeros((4, 64), np.float32), np.zeros((4, 10), np.float32)), checkpoint_every=2)


def _tiny_net():
    return dlspark.Network(dlspark.Model.from_flax(MLP(hidden=8), np.zeros((1, 64), np.float32)))


# -- against the cluster ------------------------------------------------------------
@pytest.fixture(scope="module")
def client2():
    yield from _cluster_client(2)


@pytest.mark.slow
def test_same_job_as_a_two_worker_cluster_ends_at_the_same_parameters(client2, make_net, digits):
    tr, _ = digits
    data = tr[:530]  # 17 minibatches (the last short): 2 rounds of 2 x 3, then 3 + 2
    master = ParameterAveraging(batch_size_per_worker=32, averaging_frequency=3, training_approach="direct")
    cluster = make_net(MLP(dropout=0.3), updater=optax.adam(1e-2))
    trainer = DistributedTrainer(client2, cluster, master, progress=False)
    trainer.fit(data)
    cluster_stats = trainer.last_fit_stats
    here = make_net(MLP(dropout=0.3), updater=optax.adam(1e-2))
    wrapper = ParallelWrapper(here, master, CPU2, progress=False)
    wrapper.fit(data)
    _close(here.state.params, cluster.state.params, rtol=1e-4, atol=1e-6)
    _close(here.state.opt_state, cluster.state.opt_state, rtol=1e-4, atol=1e-6)
    assert (here.iteration, here.epoch) == (cluster.iteration, cluster.epoch)
    # the same round records: one set of keys, the same rounds
    assert [set(s) for s in wrapper.last_fit_stats] == [set(s) for s in cluster_stats]
    assert [s["trained_total"] for s in wrapper.last_fit_stats] == [s["trained_total"] for s in cluster_stats]


@pytest.mark.slow
def test_final_epochs_at_their_own_frequency_end_where_a_second_fit_at_it_does(client2, make_net, digits):
    # averaging every 8 minibatches with the fit's last epoch every 2: the rounds of a fit of
    # two epochs at 8 and then one at 2, on either runtime. Every round deals both replicas as
    # many minibatches: where it does not, Adam's step count (each replica's own) parts, and a
    # second fit starts both replicas from the count the first ended with.
    tr, _ = digits
    data = tr[:512]  # 16 minibatches: a round of 8 a worker an epoch, or 4 rounds of 2
    master = ParameterAveraging(batch_size_per_worker=32, averaging_frequency=8, final_epochs=1, final_frequency=2,
                                training_approach="direct")
    one = ParallelWrapper(make_net(), master, CPU2, progress=False)
    one.fit(data, epochs=3)
    assert [sum(s.worker_steps.values()) for s in one.last_fit_stats] == [16, 16, 4, 4, 4, 4]
    two = make_net()
    ParallelWrapper(two, dataclasses.replace(master, final_epochs=0), CPU2, progress=False).fit(data, epochs=2)
    ParallelWrapper(two, dataclasses.replace(master, final_epochs=0, averaging_frequency=2), CPU2,
                    progress=False).fit(data, epochs=1)
    _close(one.network.state.params, two.state.params, rtol=0, atol=0)
    assert one.network.iteration == two.iteration == 48
    trainer = DistributedTrainer(client2, make_net(), master, progress=False)
    trainer.fit(data, epochs=3)
    assert [s["trained_total"] for s in trainer.last_fit_stats] == [16, 32, 36, 40, 44, 48]
    _close(trainer.network.state.params, two.state.params, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["cluster", "wrapper"])
def test_a_checkpoint_of_either_trainer_resumes_in_the_other(client2, make_net, digits, tmp_path, writer):
    tr, _ = digits
    data = tr[:640]
    url = str(tmp_path / "ck.dls")
    master = ParameterAveraging(batch_size_per_worker=32, averaging_frequency=2)

    def trainer(net, who, master=master):
        if who == "cluster":
            return DistributedTrainer(client2, net, master, progress=False)
        return ParallelWrapper(net, master, CPU2, progress=False)

    reader = "wrapper" if writer == "cluster" else "cluster"
    straight = make_net(MLP(dropout=0.3), updater=optax.adam(1e-2))
    trainer(straight, writer).fit(data, epochs=2, checkpoint_every=7, checkpoint_url=url)
    # The minibatches it marks as done are positions in its own data: other data, or the same
    # data cut into other minibatches, is refused by both trainers, and the network is untouched.
    for who in (writer, reader):
        other = make_net(MLP(dropout=0.3), updater=optax.adam(1e-2))
        before = jax.tree_util.tree_map(np.asarray, other.state.params)
        for data_, batch in ((tr[:320], 32), (data, 64)):
            t = trainer(other, who, ParameterAveraging(batch_size_per_worker=batch, averaging_frequency=2))
            with pytest.raises(CheckpointError, match="20 minibatches an epoch, and this fit's data makes 10"):
                t.fit(data_, epochs=2, resume_from=url)
        _close(other.state.params, before, rtol=0, atol=0)
        assert other.iteration == 0
    resumed = make_net(MLP(dropout=0.3), updater=optax.adam(1e-2))
    trainer(resumed, reader).fit(data, epochs=2, resume_from=url)
    _close(resumed.state.params, straight.state.params, rtol=1e-4, atol=1e-6)
    assert (resumed.iteration, resumed.epoch) == (straight.iteration, straight.epoch) == (40, 2)


@pytest.mark.slow
def test_a_gradient_sharing_checkpoint_of_either_trainer_resumes_in_the_other(client2, make_net, digits, tmp_path):
    tr, _ = digits
    data = tr[:640]  # 20 minibatches; 3 epochs of 5 rounds; the checkpoint at round 14 has 48 done
    master = GradientSharing(batch_size_per_worker=32, steps_per_round=2)
    trainers = {"cluster": lambda net: DistributedTrainer(client2, net, master, progress=False),
                "wrapper": lambda net: ParallelWrapper(net, master, CPU2, progress=False)}
    for writer, reader in (("cluster", "wrapper"), ("wrapper", "cluster")):
        url = str(tmp_path / f"{writer}.dls")
        trainers[writer](make_net()).fit(data, epochs=3, checkpoint_every=7, checkpoint_url=url)
        meta = read_checkpoint_meta(url)
        done = meta["fit_progress"]["done"]
        assert meta["iteration"] == 40 + len(done) and meta["fit_progress"]["epoch"] == 2, writer
        assert len(meta["worker_rngs"]) == 2 and len(meta["threshold_states"]["states"]) == 2, writer
        saved_steps = max(st[2] for st in meta["threshold_states"]["states"])
        resumed = make_net()
        trainer = trainers[reader](resumed)
        trainer.fit(data, epochs=3, resume_from=url)
        assert (resumed.iteration, resumed.epoch) == (60, 3), (writer, reader)
        assert sum(s["minibatches"] for s in trainer.last_fit_stats) == 20 - len(done), (writer, reader)
        assert trainer.threshold_state.steps > saved_steps, (writer, reader)  # the thresholds went on


_RECURRENT_ROUNDS = '''
import jax
jax.config.update("jax_num_cpu_devices", 2)
import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import dlspark


class GRU(nn.Module):
    @nn.compact
    def __call__(self, x, mask=None):
        mask = jnp.ones(x.shape[:2]) if mask is None else mask
        h = nn.Embed(12, 16)(x.astype(jnp.int32))
        carry, _ = nn.RNN(nn.GRUCell(32), return_carry=True)(h, seq_lengths=jnp.sum(mask, 1).astype(jnp.int32))
        return nn.Dense(2)(carry)


rng = np.random.default_rng(0)
mask = (np.arange(24)[None, :] < rng.integers(5, 25, 4800)[:, None]).astype(np.float32)
x = (rng.integers(1, 12, (4800, 24)) * mask).astype(np.float32)
data = dlspark.DataSet(x, np.eye(2, dtype=np.float32)[(x[:, 0] > 5).astype(int)], features_mask=mask)
net = dlspark.Network(dlspark.Model.from_flax(GRU(), x[:1]), loss="softmax_cross_entropy",
                      updater=optax.adam(3e-3), seed=0)
master = dlspark.ParameterAveraging(batch_size_per_worker=16, averaging_frequency=50, training_approach="direct",
                                    outer_updater=optax.sgd(0.7, momentum=0.9, nesterov=True))
wrapper = dlspark.ParallelWrapper(net, master, progress=False)
for i in range(10):
    wrapper.fit(data, epochs=1)
print("fits", i + 1, "iteration", net.iteration, flush=True)
'''


def test_averaging_a_recurrent_model_over_as_many_devices_as_cores_does_not_stall(tmp_path):
    """Rounds of 50 fused steps of a GRU and an outer optimizer, two CPU devices: XLA:CPU runs
    both devices' calls and their loops on a pool of as many threads as cores, where an
    all-reduce inside the round's call held a thread the other device's loop needed, and XLA
    aborted the process (4 runs of 4 on a 2-core machine before the sum moved to the host
    between two calls). Its own process, with XLA's wait cut to 10 s: an abort must not take
    the test process with it. On a machine with more cores than devices the pool is not
    exhausted and this passes either way. Ten fits: the code before that change (db30d74^),
    under the run's XLA flags, aborted within its first eight fits in 10 of 10 runs."""
    script = tmp_path / "rounds.py"
    script.write_text(_RECURRENT_ROUNDS)
    flags = os.environ.get("XLA_FLAGS", "")  # the run's own (its fast compile), and the shorter wait
    env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_cpu_collective_call_terminate_timeout_seconds=10 "
                                     "--xla_cpu_collective_call_warn_stuck_timeout_seconds=5".strip())
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fits 10 iteration 3000" in done.stdout, done.stdout
