"""Gradient sharing's DGC options: momentum-factor masking, local gradient clipping, sparsity warm-up.

The numerics (``dlspark.algorithms.sharing._dgc``) against direct computations, the
masters' checks, and each option on a ParallelWrapper over the conftest's two CPU
devices (the cluster runs the same replica code: ``SharingState`` calls the same
functions, and ``benchmarks/bench_suite.py`` runs the options on a LocalCluster).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

from dlspark import DistributedTrainer, GradientSharing, ParallelWrapper
from dlspark.algorithms.sharing import FixedThreshold, NoResidualPostProcessing
from dlspark.algorithms.sharing._dgc import (DGC_SPARSITY_WARMUP, find_momentum, local_clip_norm, mask_momentum,
                                             sent_elements, threshold_for_density, warmup_density)
from dlspark.algorithms.sharing._encoding import threshold_encode
from dlspark.algorithms.sharing._state import replica_options

CPU2 = jax.devices("cpu")[:2]
PARAMS = {"dense": {"w": jnp.arange(6.0).reshape(2, 3) - 2.5, "b": jnp.ones(3)}, "out": jnp.full((4,), -1.0)}


@pytest.mark.parametrize("tx, paths", [
    (optax.adam(1e-3), ["[0].mu"]),
    (optax.sgd(0.1, momentum=0.9), ["[0].trace"]),
    (optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), ["[1][0].mu"]),
    (optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9), [".inner_state[0].trace"]),
    (optax.sgd(0.1), []),
    (optax.adagrad(0.1), []),
])
def test_the_momentum_is_found_in_the_optax_state_by_field_name_and_parameter_structure(tx, paths):
    assert find_momentum(tx.init(PARAMS), PARAMS) == paths


def test_masking_clears_the_momentum_exactly_where_the_message_sent_and_nothing_else():
    tx = optax.adam(1e-3)
    grads = jax.tree_util.tree_map(lambda p: p * 0.7 + 0.1, PARAMS)
    _, state = tx.update(grads, tx.init(PARAMS), PARAMS)
    flat_mu = np.asarray(ravel_pytree(state[0].mu)[0])
    residual = np.linspace(-1.0, 1.0, flat_mu.size).astype(np.float32)
    for t in (0.5, 0.05):  # a sparse message, then one dense enough to go as a bitmap
        enc = threshold_encode(residual.copy(), t, min_count=2)
        sent = sent_elements(enc.message, residual.size)
        np.testing.assert_array_equal(sent, np.abs(residual) >= t)
        masked = mask_momentum(state, sent, PARAMS)
        got = np.asarray(ravel_pytree(masked[0].mu)[0])
        np.testing.assert_array_equal(got, np.where(sent, 0.0, flat_mu))
        assert (got[sent] == 0).all() and (got[~sent] != 0).all()
        # Adam's second moment and count are not momentum: untouched
        np.testing.assert_array_equal(ravel_pytree(masked[0].nu)[0], ravel_pytree(state[0].nu)[0])
        assert int(masked[0].count) == int(state[0].count)


def test_the_warmup_threshold_sends_the_scheduled_fraction_and_then_hands_over():
    assert DGC_SPARSITY_WARMUP == (0.25, 0.0625, 0.015625, 0.00390625)
    assert [1 - warmup_density(DGC_SPARSITY_WARMUP, e) for e in range(4)] == [0.75, 0.9375, 0.984375, 0.99609375]
    assert warmup_density(DGC_SPARSITY_WARMUP, 4) is None and warmup_density((), 0) is None
    rng = np.random.default_rng(0)
    r = rng.normal(size=10_000).astype(np.float32)
    for d in DGC_SPARSITY_WARMUP:
        t = threshold_for_density(r, d)
        assert int((np.abs(r) >= t).sum()) == math.ceil(d * r.size)
    assert threshold_for_density(np.zeros(8, np.float32), 0.5) > 0  # nothing to send: sends nothing


def test_local_clipping_bounds_the_gradients_norm_and_leaves_a_smaller_one_unchanged(make_net, digits):
    tr, _ = digits
    net = make_net(updater=optax.sgd(1.0))  # the update is minus the (clipped) gradient
    batch = tr[:32].jit_batch()
    free = net.steps.compute_update(net.state, batch).updates
    norm = float(optax.tree.norm(free))
    bound = local_clip_norm(norm / 2 * math.sqrt(2), 2)  # half the gradient's norm, at two replicas
    assert bound == pytest.approx(norm / 2)
    clipped = net.steps.compute_update(net.state, batch, bound).updates
    assert float(optax.tree.norm(clipped)) == pytest.approx(norm / 2, rel=1e-5)
    ratio = ravel_pytree(clipped)[0] / ravel_pytree(free)[0]
    np.testing.assert_allclose(ratio[jnp.isfinite(ratio)], 0.5, rtol=1e-5)  # the direction kept
    same = net.steps.compute_update(net.state, batch, np.float32(norm * 2)).updates
    for a, b in zip(jax.tree_util.tree_leaves(same), jax.tree_util.tree_leaves(free)):
        np.testing.assert_array_equal(a, b)


def test_bad_settings_are_named():
    with pytest.raises(TypeError, match="momentum_masking must be True or False, got 1"):
        GradientSharing(momentum_masking=1)
    with pytest.raises(TypeError, match="momentum_fields must be a non-empty tuple"):
        GradientSharing(momentum_fields="mu")
    with pytest.raises(ValueError, match=r"local_gradient_clipping must be a finite number > 0 .* got -1"):
        GradientSharing(local_gradient_clipping=-1)
    with pytest.raises(TypeError, match="local_gradient_clipping must be a number or None, got str"):
        GradientSharing(local_gradient_clipping="1")
    with pytest.raises(ValueError, match=r"sparsity_warmup\[1\] must be a fraction of elements in \(0, 1\], got 2"):
        GradientSharing(sparsity_warmup=(0.5, 2))
    with pytest.raises(TypeError, match='sparsity_warmup must be "auto", a tuple of fractions'):
        GradientSharing(sparsity_warmup=0.25)
    with pytest.raises(TypeError, match="got 'dgc'"):
        GradientSharing(sparsity_warmup="dgc")
    m = GradientSharing(momentum_masking=True, local_gradient_clipping=2, sparsity_warmup=[0.5])
    assert (m.local_gradient_clipping, m.sparsity_warmup) == (2.0, (0.5,))
    with pytest.raises(ValueError, match=r"momentum_masking=True .* the network's updater keeps none"):
        replica_options(m, 2, optax.sgd(0.1).init(PARAMS), PARAMS)
    opts = replica_options(m, 4, optax.adam(0.1).init(PARAMS), PARAMS)
    assert opts.clip == np.float32(1.0) and opts.mask_fields == ("mu", "trace") and opts.warmup == (0.5,)
    defaults = replica_options(GradientSharing().for_workers(2), 2, optax.sgd(0.1).init(PARAMS), PARAMS)
    assert defaults == (None, (), ())
    # a master whose warm-up is still "auto" has not been settled for its fit's workers
    with pytest.raises(RuntimeError, match='sparsity_warmup="auto" reached a replica unsettled'):
        replica_options(GradientSharing(), 2, optax.sgd(0.1).init(PARAMS), PARAMS)


# -- on a ParallelWrapper over two CPU devices ----------------------------------------------------
T = 3e-3


def _one_step(make_net, tr, encoder="host", **options):
    """One lockstep step (one minibatch per device) with a fixed threshold; the network after it.
    Every replica applies the step's messages, its own too (``own_update="encoded"``), so that
    the parameters show what was sent."""
    net = make_net(updater=optax.sgd(0.1, momentum=0.9))
    master = GradientSharing(batch_size_per_worker=32, threshold_algorithm=FixedThreshold(T),
                             residual_post_processor=NoResidualPostProcessing(), own_update="encoded", **options)
    wrapper = ParallelWrapper(net, master, CPU2, progress=False, sharing_encoder=encoder)
    wrapper.fit(tr[:64].batches(32))
    return net, wrapper


@pytest.mark.parametrize("encoder", ["host", "xla"])
def test_masking_on_two_devices_zeroes_the_momentum_where_replica_0_sent(make_net, digits, encoder):
    tr, _ = digits
    plain, _ = _one_step(make_net, tr)
    masked, wrapper = _one_step(make_net, tr, encoder, momentum_masking=True)
    trace = np.asarray(ravel_pytree(plain.state.opt_state[0].trace)[0])  # replica 0's: its first gradient
    # the first step's update is -0.1 * trace, all of it in the residual: sent where it reaches T
    sent = np.abs(np.float32(0.1) * trace) >= T
    assert 2 <= sent.sum() < sent.size
    got = np.asarray(ravel_pytree(masked.state.opt_state[0].trace)[0])
    np.testing.assert_array_equal(got, np.where(sent, 0.0, trace))
    for a, b in zip(jax.tree_util.tree_leaves(masked.state.params), jax.tree_util.tree_leaves(plain.state.params)):
        np.testing.assert_array_equal(a, b)  # the step's messages are the same: masking acts on the next
    assert wrapper.published["replica_divergence"] == 0.0


def test_local_clipping_on_two_devices_reaches_each_replicas_update(make_net, digits):
    tr, _ = digits
    start = make_net().state.params
    free, _ = _one_step(make_net, tr)
    # every element of an update clipped to norm 1e-3 / sqrt(2) stays below T after 0.1 x: nothing sent
    clipped, wrapper = _one_step(make_net, tr, local_gradient_clipping=1e-3)
    assert wrapper.published["communication"]["bytes_sent"] < 100  # two EMPTY notes
    for a, b in zip(jax.tree_util.tree_leaves(clipped.state.params), jax.tree_util.tree_leaves(start)):
        np.testing.assert_array_equal(a, b)
    assert any((np.asarray(a) != np.asarray(b)).any() for a, b in
               zip(jax.tree_util.tree_leaves(free.state.params), jax.tree_util.tree_leaves(start)))


def test_the_default_warmup_is_dgcs_from_four_workers_and_none_below(make_net, digits, monkeypatch):
    m = GradientSharing()
    assert m.sparsity_warmup == "auto" and GradientSharing.WARMUP_FROM_WORKERS == 4
    assert m.for_workers(4).sparsity_warmup == GradientSharing.DGC_SPARSITY_WARMUP == m.for_workers(9).sparsity_warmup
    assert m.for_workers(3).sparsity_warmup == () == m.for_workers(2).sparsity_warmup
    chosen = GradientSharing(sparsity_warmup=(0.5,))
    assert chosen.for_workers(8) is chosen and GradientSharing(sparsity_warmup=()).for_workers(8).sparsity_warmup == ()
    # a fit's replicas run the settled master: with the default, the fit of the warm-up its
    # devices' count calls for, bit for bit (the count moved to the 2 devices here)
    tr, _ = digits

    def fit(master):
        net = make_net()
        ParallelWrapper(net, master, CPU2, progress=False).fit(tr[:256], epochs=1)
        return np.asarray(ravel_pytree(net.state.params)[0])

    base = dict(batch_size_per_worker=16, steps_per_round=4)
    dgc = fit(GradientSharing(sparsity_warmup=GradientSharing.DGC_SPARSITY_WARMUP, **base))
    none = fit(GradientSharing(sparsity_warmup=(), **base))
    assert (dgc != none).any()
    monkeypatch.setattr(GradientSharing, "WARMUP_FROM_WORKERS", 2)
    np.testing.assert_array_equal(fit(GradientSharing(**base)), dgc)
    monkeypatch.setattr(GradientSharing, "WARMUP_FROM_WORKERS", 3)
    np.testing.assert_array_equal(fit(GradientSharing(**base)), none)


def test_a_clusters_fit_settles_the_default_warmup_for_its_workers(client2, make_net, digits, monkeypatch):
    # the client settles the master for the workers the fit starts with (two here) before any
    # worker is sent it: with the count moved to 2 the default trains DGC's warm-up, as the
    # wrapper does with it given (synchronous delivery: the same bits on both runtimes)
    tr, _ = digits
    base = dict(batch_size_per_worker=32, steps_per_round=4, training_approach="direct")
    here = ParallelWrapper(make_net(), GradientSharing(sparsity_warmup=GradientSharing.DGC_SPARSITY_WARMUP, **base),
                           CPU2, progress=False, sharing_encoder="host")
    here.fit(tr[:512])
    monkeypatch.setattr(GradientSharing, "WARMUP_FROM_WORKERS", 2)
    cluster = DistributedTrainer(client2, make_net(), GradientSharing(**base), progress=False)
    cluster.fit(tr[:512])
    for a, b in zip(jax.tree_util.tree_leaves(cluster.network.state.params),
                    jax.tree_util.tree_leaves(here.network.state.params)):
        np.testing.assert_array_equal(a, b)
    # the warm-up's first epoch: every step far denser than the threshold band's 0.01-1%
    assert min(r["sparsity"] for r in cluster.last_fit_stats) > 0.05


def test_the_sparsity_warmup_on_two_devices_sends_its_fraction_then_the_threshold_algorithms(make_net, digits):
    tr, _ = digits
    net = make_net()
    # a threshold no update reaches: after the warm-up's one epoch nothing is sent
    master = GradientSharing(batch_size_per_worker=16, steps_per_round=4, threshold_algorithm=FixedThreshold(10.0),
                             sparsity_warmup=(0.01,), own_update="encoded")  # replicas equal: see the end
    wrapper = ParallelWrapper(net, master, CPU2, progress=False)
    wrapper.fit(tr[:256], epochs=2)
    rows = wrapper.last_fit_stats
    n = ravel_pytree(net.state.params)[0].size
    warm = [r for r in rows if r["epoch"] == 0]
    after = [r for r in rows if r["epoch"] == 1]
    assert warm and after
    for r in warm:  # each replica sends ceil(1% of n) elements a step, more where magnitudes tie
        assert math.ceil(0.01 * n) / n <= r["sparsity"] < 0.02
        assert all(t < 10.0 for t in r["threshold"].values())
    for r in after:
        assert r["sparsity"] == 0.0 and all(t == 10.0 for t in r["threshold"].values())
    assert wrapper.published["replica_divergence"] == 0.0


@pytest.mark.parametrize("encoder", ["host", "xla"])
def test_own_update_whole_keeps_the_replicas_apart_by_exactly_their_residuals(make_net, digits, encoder):
    # own_update="whole" (the default): each replica applies its own update whole and its peer's
    # encoded message, so its parameters hold its residual, which its peer lacks; what the clip
    # (every step here, at 1.5 thresholds, of a threshold a fifth of Adam's rate: it drops much)
    # drops from a residual is taken out of that replica's parameters too, so that parameters
    # minus residual stay the same on both replicas.
    from dlspark.algorithms.sharing import ResidualClipping

    tr, _ = digits
    net = make_net()
    master = GradientSharing(batch_size_per_worker=16, steps_per_round=4, threshold_algorithm=FixedThreshold(2e-3),
                             residual_post_processor=ResidualClipping(1.5, 1))
    wrapper = ParallelWrapper(net, master, CPU2, progress=False, sharing_encoder=encoder)
    wrapper.fit(tr[:512], epochs=2)
    carry = wrapper._runtime.sharing_carry  # what each replica takes into a next fit
    params = [np.asarray(ravel_pytree(p)[0]) for p in carry.params]
    residuals = [np.asarray(r) for r in carry.residuals]
    apart = np.abs(params[0] - params[1]).max()
    assert apart > 1e-3 and wrapper.replica_divergence == pytest.approx(apart)
    np.testing.assert_allclose(params[0] - residuals[0], params[1] - residuals[1], rtol=0, atol=1e-5)
    # the fit ends with the replicas' mean (final_params="mean", the default)
    np.testing.assert_array_equal(ravel_pytree(net.state.params)[0], (params[0] + params[1]) / np.float32(2))
